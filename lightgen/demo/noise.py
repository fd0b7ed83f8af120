"""Synthetic grammatical errors for the demo model, and an edit-level score (precision, recall, F0.5).

Errors are injected word by word into clean sentences, as in real grammar correction most sentences
need few edits: article and preposition swaps, singular/plural agreement, a dropped function word,
a duplicated word, a misspelling.
"""

from __future__ import annotations

import collections
import difflib
import random
import re
import string

ARTICLES = ("a", "an", "the")
PREPOSITIONS = ("of", "in", "on", "at", "to", "for", "with", "from", "by", "into", "about")
AGREEMENT = (("is", "are"), ("was", "were"), ("has", "have"), ("does", "do"), ("this", "these"), ("that", "those"))
DROPPABLE = ("a", "an", "the", "to", "of", "is", "be", "and")
_WORD = re.compile(r"[A-Za-z'\-]+|[^\sA-Za-z'\-]")


def words(sentence: str) -> list[str]:
    """Words and punctuation marks, each its own item."""
    return _WORD.findall(sentence)


def join(items: list[str]) -> str:
    """Inverse of ``words`` for the corpus's spacing: punctuation sticks to the word before it."""
    return re.sub(r" ([.,;:!?])", r"\1", " ".join(items))


def number_pairs(sentences: list[str], min_count: int = 20) -> dict[str, str]:
    """Frequent word pairs ``w``/``ws`` (``return``/``returns``, ``file``/``files``), both directions."""
    counts = collections.Counter(w for s in sentences for w in words(s) if w.isalpha())
    pairs = {}
    for word, count in counts.items():
        stem = word[:-1]
        if word.endswith("s") and len(stem) >= 3 and count >= min_count and counts[stem] >= min_count:
            pairs[word], pairs[stem] = stem, word
    for one, other in AGREEMENT:
        pairs[one], pairs[other] = other, one
    return pairs


class Noiser:
    """Corrupts sentences with 1-3 errors (or none, with probability ``clean``), reproducibly from ``rng``."""

    def __init__(self, pairs: dict[str, str], clean: float = 0.2):
        self.pairs, self.clean = pairs, clean

    def __call__(self, sentence: str, rng: random.Random) -> str:
        if rng.random() < self.clean:
            return sentence
        items = words(sentence)
        for _ in range(rng.choice((1, 1, 2, 2, 3))):
            kind = rng.choice((self._article, self._preposition, self._agreement, self._drop, self._duplicate,
                               self._spelling, self._spelling))
            kind(items, rng)
        return join(items)

    @staticmethod
    def _pick(items, rng, allowed) -> int | None:
        places = [i for i, w in enumerate(items) if allowed(w)]
        return rng.choice(places) if places else None

    def _swap_from(self, items, rng, group):
        i = self._pick(items, rng, lambda w: w.lower() in group)
        if i is not None:
            replacement = rng.choice([w for w in group if w != items[i].lower()])
            items[i] = replacement.capitalize() if items[i][0].isupper() else replacement

    def _article(self, items, rng):
        if rng.random() < 0.3:
            self._drop(items, rng, ARTICLES)
        else:
            self._swap_from(items, rng, ARTICLES)

    def _preposition(self, items, rng):
        self._swap_from(items, rng, PREPOSITIONS)

    def _agreement(self, items, rng):
        i = self._pick(items, rng, lambda w: w in self.pairs)
        if i is not None:
            items[i] = self.pairs[items[i]]

    def _drop(self, items, rng, droppable=DROPPABLE):
        i = self._pick(items, rng, lambda w: w.lower() in droppable)
        if i is not None and len(items) > 4:
            del items[i]

    def _duplicate(self, items, rng):
        i = self._pick(items, rng, str.isalpha)
        if i is not None:
            items.insert(i, items[i])

    def _spelling(self, items, rng):
        i = self._pick(items, rng, lambda w: len(w) >= 4 and w.isalpha())
        if i is None:
            return
        word, at = items[i], rng.randrange(1, len(items[i]) - 1)
        change = rng.randrange(4)
        if change == 0:
            word = word[:at] + word[at + 1] + word[at] + word[at + 2:]  # transpose
        elif change == 1:
            word = word[:at] + word[at + 1:]  # delete
        elif change == 2:
            word = word[:at] + word[at] + word[at:]  # double
        else:
            word = word[:at] + rng.choice(string.ascii_lowercase) + word[at + 1:]  # substitute
        items[i] = word


def edits(source: str, target: str) -> set[tuple[int, int, str]]:
    """Word-level edits turning ``source`` into ``target``: (start, end, replacement) over source words."""
    a, b = words(source), words(target)
    return {(i1, i2, " ".join(b[j1:j2])) for op, i1, i2, j1, j2
            in difflib.SequenceMatcher(a=a, b=b, autojunk=False).get_opcodes() if op != "equal"}


def score(sources: list[str], hypotheses: list[str], references: list[str]) -> dict[str, float]:
    """Exact match and edit-level precision, recall and F0.5 (edits proposed vs edits needed)."""
    proposed = needed = correct = exact = 0
    for source, hypothesis, reference in zip(sources, hypotheses, references, strict=True):
        mine, gold = edits(source, hypothesis), edits(source, reference)
        proposed, needed, correct = proposed + len(mine), needed + len(gold), correct + len(mine & gold)
        exact += words(hypothesis) == words(reference)
    precision = correct / proposed if proposed else 1.0
    recall = correct / needed if needed else 1.0
    f05 = 1.25 * precision * recall / (0.25 * precision + recall) if precision + recall else 0.0
    return dict(exact_match=exact / len(sources), precision=precision, recall=recall, f0_5=f05)
