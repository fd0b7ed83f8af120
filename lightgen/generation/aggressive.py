"""Aggressive decoding (Ge et al. 2022, arXiv 2205.10350), batched, on the static cache.

Each iteration a drafter proposes tokens after every row's output so far; the decoder verifies
``[last token, draft]`` in one pass; the row keeps the longest draft prefix the verifier accepts plus
the verifier's own next token, and the cache rolls back by moving the row's length. Rows keep their
own lengths; finished rows leave the batch (and the drafter's batch).

- IAD (input-guided): the draft is copied from the input, after the shortest output suffix (1-3
  tokens) found exactly once in it; without one the row takes an ordinary greedy step.
- GAD (generalized): a drafter (``lightgen.generation.drafting``) proposes ``block_size`` tokens. Acceptance
  is greedy's own choice (top-1), so the output equals greedy; GAD++ (``beta`` > 1) also accepts a
  draft token among the verifier's top-``beta`` whose log-probability is within ``tau`` of the top-1.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
from transformers.generation.utils import GenerateDecoderOnlyOutput, GenerateEncoderDecoderOutput

from lightgen import ops
from lightgen.generation.draft_policy import (  # noqa: F401
    AcceptanceHistory,
    DraftPolicy,
    FixedPassCost,
    PassCost,
    measured_cost,
    measured_history,
)
from lightgen.modules.decoder import Decoder

SUFFIX_LENGTHS = (1, 2, 3)


@dataclass
class _AggressiveStats:
    """What aggressive decoding adds to HF's output: per row, the decoder passes it ran
    (``iterations``, the prompt pass included) and the tokens each pass added
    (``tokens_per_iteration``: accepted draft tokens + the verifier's own token)."""

    iterations: torch.LongTensor | None = None
    tokens_per_iteration: tuple[torch.LongTensor, ...] | None = None


# The mixin goes first among the bases so that its fields come last: HF's outputs treat the first one specially.
@dataclass
class AggressiveEncoderDecoderOutput(_AggressiveStats, GenerateEncoderDecoderOutput):
    pass


@dataclass
class AggressiveDecoderOnlyOutput(_AggressiveStats, GenerateDecoderOnlyOutput):
    pass


class DraftSession(Protocol):
    """A drafter bound to one ``generate`` call's inputs."""

    def draft(self, rows: list[int], outputs: list[list[int]], sizes: list[int]) -> list[list[int]]:
        """Up to ``sizes[i]`` tokens to follow ``outputs[i]`` (the whole decoder sequence so far) for
        batch row ``rows[i]``; an empty list means no guess."""

    def close(self) -> None:
        """Give back what the session holds (caches); called once decoding ends."""


def find_anchor(output: list[int], source: list[int]) -> int | None:
    """Where to resume copying: after the unique occurrence in ``source`` of the shortest suffix of
    ``output`` (1-3 tokens) that occurs exactly once; None when every suffix is absent or ambiguous."""
    return _anchor(output, _suffix_index(source))


_AMBIGUOUS = -1


def _suffix_index(source: list[int]) -> list[dict[tuple[int, ...], int]]:
    """Per suffix length, n-gram -> the position after its one occurrence in ``source`` (or _AMBIGUOUS):
    built once per sentence, so each pass looks anchors up instead of scanning the source per row."""
    index = []
    for size in SUFFIX_LENGTHS:
        ends: dict[tuple[int, ...], int] = {}
        for start in range(len(source) - size + 1):
            gram = tuple(source[start:start + size])
            ends[gram] = _AMBIGUOUS if gram in ends else start + size
        index.append(ends)
    return index


def _anchor(output, index) -> int | None:
    for size, ends in zip(SUFFIX_LENGTHS, index, strict=True):
        if size > len(output):
            return None
        end = ends.get(tuple(output[-size:]))
        if end is not None and end != _AMBIGUOUS:
            return end
    return None


class CopyFromInput:
    """IAD's drafter: copy ``sources[row]`` from the anchor that ``find_anchor`` gives."""

    def __init__(self, sources: list[list[int]]) -> None:
        self.sources = sources
        self._indexes = [_suffix_index(source) for source in sources]
        # The sources padded with -1 (one column more than the longest), for drafting as one gather.
        longest = max(map(len, sources), default=0)
        self._table = np.full((len(sources), longest + 1), -1, dtype=np.int64)
        for row, source in enumerate(sources):
            self._table[row, :len(source)] = source

    def draft(self, rows, outputs, sizes):
        drafts = []
        for row, output, size in zip(rows, outputs, sizes, strict=True):
            start = _anchor(output, self._indexes[row])
            drafts.append([] if start is None else self.sources[row][start:start + size])
        return drafts

    def anchors(self, rows: np.ndarray, tails: list[list[int]]) -> np.ndarray:
        """[N] int64: where each row's draft starts in its source, found from its last tokens ``tails`` (up to the
        longest suffix); where it has no anchor, the padding column after the longest source."""
        missing = self._table.shape[1] - 1
        starts = [_anchor(tail, self._indexes[row]) for row, tail in zip(rows.tolist(), tails, strict=True)]
        return np.array([missing if start is None else start for start in starts], dtype=np.int64)

    def anchored(self, rows: np.ndarray, anchors: np.ndarray) -> np.ndarray:
        """[N] bool: whether each row has a draft at its anchor (its source goes on after it), so the draft policy
        knows it before deciding to draft."""
        return self._table[rows, anchors] >= 0

    def draft_array(self, rows: np.ndarray, anchors: np.ndarray, sizes: np.ndarray) -> np.ndarray:
        """``draft`` on arrays: rows [N] (batch rows), their ``anchors``, sizes [N] -> drafts [N, max(sizes)] int64,
        -1 after each row's draft."""
        width = int(sizes.max()) if sizes.size else 0
        if width == 0:
            return np.empty((len(anchors), 0), dtype=np.int64)
        places = np.minimum(anchors[:, None] + np.arange(width), self._table.shape[1] - 1)
        drafts = self._table[rows[:, None], places]
        drafts[np.arange(width) >= sizes[:, None]] = -1
        return drafts

    def close(self) -> None:
        pass


@dataclass(frozen=True)
class Acceptance:
    """Which draft tokens the verifier keeps: its top-1 (``beta=1``: greedy's output), or with GAD++
    any of its top-``beta`` whose log-probability is at most ``tau`` below the top-1's."""

    beta: int = 1
    tau: float = 0.0

    def __post_init__(self) -> None:
        if self.beta < 1 or self.tau < 0:
            raise ValueError(f"aggressive decoding needs beta >= 1 and tau >= 0, got beta={self.beta}, tau={self.tau}")

    @property
    def reads_logits(self) -> bool:
        return self.beta > 1

    def accepted(self, logits: torch.Tensor | None, predictions: np.ndarray, drafts: np.ndarray) -> np.ndarray:
        """logits [N, 1 + K, V] (None when not ``reads_logits``), their argmax ``predictions`` [N, 1 + K],
        drafts [N, K] (-1 after a row's draft) -> [N, K] bool: slot k passes."""
        if not self.reads_logits:
            return predictions[:, :-1] == drafts
        drafts = torch.from_numpy(drafts).to(logits.device)
        log_probs = logits[:, :-1].log_softmax(-1)
        best, candidates = log_probs.topk(self.beta, dim=-1)
        drafted = log_probs.gather(-1, drafts.clamp(min=0)[..., None])[..., 0]
        return ((candidates == drafts[..., None]).any(-1) & (best[..., 0] - drafted <= self.tau)).cpu().numpy()


GREEDY = Acceptance()  # beta=1: greedy's output exactly


@dataclass(frozen=True)
class DraftBudget:
    """Draft length per row when the caller sets none: ``longest`` for one row, and from ``total / rows``
    (at least ``shortest``) as the batch grows. A verification pass over rows x (1 + draft) positions
    turns compute-bound as rows grow, and drafts past the accepted prefix are wasted work: IAD on the
    demo model, 64 sentences, ms per call at max_draft 4/6/8/12/16: batch 8 181/179/178/192/194, batch 32
    161/166/173/186/202. One row drafts up to 32 (within it the draft policy prices each width): demo model, 64
    sentences at batch 1, max_draft 16 / 32 interleaved in one process (9-15 rounds, three runs, 2 threads, Zen 4):
    436 / 414, 457 / 441 and 490 / 455 ms a call (a sentence of ~20 tokens takes ~2 passes instead of ~3)."""

    longest: int = 32
    total: int = 64
    shortest: int = 4

    def per_row(self, rows: int) -> int:
        return min(self.longest, max(self.shortest, self.total // rows))


def aggressive_greedy(decoder, state, input_ids, prompt_positions, drafter: DraftSession, eos_ids: set[int],
                      pad_token_id: int, max_length: int, max_draft: int | DraftBudget,
                      acceptance: Acceptance = GREEDY, forced_eos: int | None = None, streamer=None, *,
                      pass_cost: PassCost | None = None) -> tuple[torch.Tensor, list[list[int]]]:
    """Greedy decoding (or GAD++'s relaxation of it), accelerated by ``drafter``'s guesses; a row that
    reaches ``max_length`` ends with ``forced_eos`` when given. A ``streamer`` (one row only) gets each
    pass's new tokens, [1, n], as from HF's assisted decoding.

    ``max_draft``: the most draft tokens per row and pass, or a ``DraftBudget`` that sets it from the
    number of rows still decoding; within it ``DraftPolicy`` drafts less where drafts keep being rejected,
    down to plain greedy steps, by ``pass_cost`` (default: ``measured_cost(decoder, drafter)``, measured on this
    decoder across calls; ``FixedPassCost()`` or ``LIGHTGEN_FIXED_DRAFTS=1`` makes every width cost the same and
    keeps drafts whole). Returns the sequences and, per row, the tokens each of its decoder passes added
    (accepted draft tokens + the verifier's own token); a row's pass count is the length of its list. The cache
    needs as many spare positions as the longest draft: padding after short drafts is written there and rolled
    back.

    The bookkeeping runs on the host, in NumPy, over the rows still decoding (``sequences`` holds every row's
    tokens so far, ``lengths`` how many): a pass's few dozen operations on a handful of numbers each cost ~1 us
    there, as torch ops 5-10 us (the demo model at batch 1: ~0.8 ms around a 0.66 ms pass). Only the tokens fed
    and each pass's argmax cross to and from the decoder's device. Per-row Python runs only where a drafter
    takes token lists."""
    rows, prompt_len = input_ids.shape
    device = input_ids.device
    sequences = np.full((rows, max_length), pad_token_id, dtype=np.int64)
    sequences[:, :prompt_len] = input_ids.cpu().numpy()
    lengths = np.full(rows, prompt_len, dtype=np.int64)
    live = np.arange(rows)  # batch row of each row still decoding
    eos = np.array(sorted(eos_ids), dtype=np.int64)
    policy = DraftPolicy(rows, pass_cost if pass_cost is not None else default_cost(decoder, drafter),
                         default_history(decoder, drafter))
    # A pass verifies rows x (1 + draft) positions on the kernels greedy's one-token steps run, never past them.
    kernel_rows = getattr(decoder, "decoder", decoder).kernel_rows(state)
    history: list[tuple[np.ndarray, np.ndarray]] = []  # per pass: (rows in it, tokens each added)

    def next_pass():
        """The next pass's logits, argmax and drafts, as ``_draft_and_verify`` gives them, after the plain greedy
        steps that come first when the policy drafts nothing (rows may end in them)."""
        nonlocal live
        per_row = max_draft.per_row(live.shape[0]) if isinstance(max_draft, DraftBudget) else max_draft
        if kernel_rows < math.inf:
            per_row = max(0, min(per_row, int(kernel_rows) // live.shape[0] - 1))
        anchors = _anchors(drafter, live, sequences, lengths[live])
        # The verifier's own token needs one more place after the draft.
        sizes = policy.plan(np.minimum(max_length - lengths[live] - 1, per_row),
                            found=None if anchors is None else drafter.anchored(live, anchors))
        if not policy.drafting:
            live, logits, best, drafts = _greedy_steps(decoder, state, policy, sequences, lengths, live, eos,
                                                       max_length, history, streamer, drafter)
            return logits, best, drafts
        return _draft_and_verify(decoder, state, drafter, policy, sizes, anchors, sequences, lengths, live,
                                 pad_token_id, acceptance)

    if prompt_len == 1:  # a lone start token (encoder-decoder): the first pass may already verify a draft
        logits, best, drafts = next_pass()
    else:
        logits = decoder.prefill(state, input_ids, prompt_positions)[:, None]  # [rows, 1, V]
        best = ops.greedy_tokens(logits).cpu().numpy()
        drafts = np.empty((rows, 0), dtype=np.int64)
    while True:
        width = drafts.shape[1]
        accepted = acceptance.accepted(logits, best, drafts).cumprod(-1).sum(-1)  # [rows]
        if policy.drafting:  # a pass whose asks all came back empty still tells how often drafts are found
            policy.observe((drafts >= 0).sum(-1), accepted)
        places = np.arange(width + 1)
        row_lengths = lengths[live]
        # A row adds its accepted draft tokens and the verifier's token after them ...
        new_tokens = best.copy()
        new_tokens[:, :width] = np.where(places[:-1] < accepted[:, None], drafts, best[:, :width])
        taken = np.minimum(accepted + 1, max_length - row_lengths)
        # ... up to its first EOS, or up to max_length (where HF's ForcedEOSTokenLogitsProcessor forces EOS).
        ends = (new_tokens[..., None] == eos).any(-1) & (places < taken[:, None])  # np.isin costs ~60 us here
        ended = ends.any(-1)
        taken = np.where(ended, ends.argmax(-1) + 1, taken)
        full = row_lengths + taken >= max_length
        if forced_eos is not None:
            new_tokens[full, taken[full] - 1] = forced_eos
        kept = places < taken[:, None]
        columns = row_lengths[:, None] + places
        sequences[np.repeat(live, taken), columns[kept]] = new_tokens[kept]
        lengths[live] += taken
        history.append((live, taken))
        if streamer is not None:
            streamer.put(torch.from_numpy(new_tokens[:1, :int(taken[0])].copy()))
        if width:
            state.roll_back(torch.from_numpy(width - accepted).to(device))
        finished = ended | full
        if finished.all():
            policy.finish()
            break
        if finished.any():
            keep = np.flatnonzero(~finished)
            state.keep_rows(torch.from_numpy(keep).to(device))
            policy.keep(keep)
            live = live[keep]
        logits, best, drafts = next_pass()
    gained = [[] for _ in range(rows)]
    for pass_rows, pass_tokens in history:
        for row, count in zip(pass_rows.tolist(), pass_tokens.tolist(), strict=True):
            gained[row].append(count)
    return torch.from_numpy(sequences[:, :int(lengths.max())]).to(device=device, dtype=input_ids.dtype), gained


def default_cost(decoder, drafter) -> PassCost:
    return FixedPassCost() if _fixed_drafts() else measured_cost(decoder, drafter)


def default_history(decoder, drafter) -> AcceptanceHistory:
    return AcceptanceHistory() if _fixed_drafts() else measured_history(decoder, drafter)


def _fixed_drafts() -> bool:
    """``LIGHTGEN_FIXED_DRAFTS=1``: every pass costs the same and every call starts from the fixed prior, so drafts
    stay whole (fixed-length drafting, as the paper's) and pass counts do not depend on the machine's timing."""
    return os.environ.get("LIGHTGEN_FIXED_DRAFTS", "0") not in ("", "0")


def _greedy_steps(decoder, state, policy: DraftPolicy, sequences, lengths, live, eos, max_length, history, streamer,
                  drafter):
    """Up to ``policy.greedy_steps()`` plain greedy steps, one token a row each, without a drafting pass's
    bookkeeping (demo model, batch 1: ~0.2 instead of ~1.2 ms a step around the decoder), so that where drafts do
    not pay the loop costs what greedy decoding does. Each step's tokens go to ``sequences`` as it ends, and rows that
    end with an EOS leave the batch there, as in greedy decoding (handing each such step back to the main loop cost
    the demo model's GAD ~3% at batch 8). The last step, one where every row ends, and the step after which a row that
    waited for a draft has one (``policy.waiting``: a copy drafter's anchor, looked up after each step) are handed
    back as the next pass: (the rows still decoding, its logits [rows, 1, V], argmax [rows, 1], no drafts) for the
    main loop's bookkeeping, which also ends rows at max_length (no step here reaches it)."""
    # Steps before the longest row's next token would reach max_length: the main loop takes that one.
    steps = max(1, min(policy.greedy_steps(), max_length - int(lengths[live].max())))
    device = state.next_position.device
    last = torch.from_numpy(sequences[live, lengths[live] - 1]).to(device)
    one_each = np.ones(live.shape[0], dtype=np.int64)  # a step's tokens per row, in ``history``
    taken = 0
    while True:
        started = time.perf_counter()
        logits = decoder.step(state, last[:, None])
        best = ops.greedy_tokens(logits)
        tokens = best.cpu().numpy()  # on a GPU, waits for the step
        policy.timed(live.shape[0], started, time.perf_counter())
        ended = (tokens[:, None] == eos).any(-1)
        taken += 1
        if taken == steps or ended.all() or _draft_found(policy, drafter, live, sequences, lengths, tokens):
            return live, logits[:, None], tokens[:, None], np.empty((live.shape[0], 0), dtype=np.int64)
        sequences[live, lengths[live]] = tokens
        lengths[live] += 1
        history.append((live, one_each))
        if streamer is not None:
            streamer.put(torch.from_numpy(tokens[:1, None]))
        last = best
        if ended.any():
            keep = np.flatnonzero(~ended)
            kept = torch.from_numpy(keep).to(device)
            state.keep_rows(kept)
            policy.keep(keep)
            live, last, one_each = live[keep], best[kept], one_each[keep]


def _draft_found(policy: DraftPolicy, drafter, live, sequences, lengths, tokens) -> bool:
    """Whether a row waiting for a draft (``policy.waiting``) has one after its token in ``tokens`` (written to
    ``sequences`` for the lookup; whoever books the step writes it again); if so, the policy is woken."""
    if policy.waiting is None:
        return False
    waiting = np.flatnonzero(policy.waiting)
    rows = live[waiting]
    sequences[rows, lengths[rows]] = tokens[waiting]
    if not drafter.anchored(rows, _anchors(drafter, rows, sequences, lengths[rows] + 1)).any():
        return False
    policy.wake()
    return True


def _draft_and_verify(decoder, state, drafter, policy: DraftPolicy, sizes, anchors, sequences, lengths, live,
                      pad_token_id, acceptance: Acceptance):
    """Drafts of up to ``sizes`` [rows] tokens for the rows still decoding (a copy drafter's from ``anchors``, those
    the policy's plan was made with), cut to the width the policy picks, and
    one pass verifying them: the logits [rows, 1 + K, V] when the acceptance rule reads them (None otherwise),
    their argmax [rows, 1 + K] (-1 at the padding after short drafts, which greedy acceptance never reads, so
    lightgen's decoder skips their LM head) and the drafts [rows, K] (-1 after each row's draft), on the host. The
    pass's time goes to the policy's cost line."""
    row_lengths = lengths[live]
    drafting_started = time.perf_counter()
    drafts = _draft(drafter, live, sequences, row_lengths, sizes, anchors)
    if getattr(drafter, "steps_per_token", False):
        policy.drafted(int(sizes.max()), time.perf_counter() - drafting_started)
    drafts = _within_vocabulary(drafts, decoder.spec.token_embedding.shape[0])
    draft_lengths = (drafts >= 0).sum(-1)
    drafts = drafts[:, :policy.width(draft_lengths)]
    width = drafts.shape[1]
    real = np.arange(1 + width) <= draft_lengths[:, None]
    tokens = np.concatenate([sequences[live, row_lengths - 1][:, None], drafts], 1)
    tokens[~real] = pad_token_id
    # Padding after short drafts is computed and rolled back; clamp its positions into the table.
    next_position = state.next_position
    positions = np.minimum(next_position.cpu().numpy()[:, None] + np.arange(1 + width),
                           decoder.spec.position_limit - 1)
    device = next_position.device
    started = time.perf_counter()
    fed, positions = torch.from_numpy(tokens).to(device), torch.from_numpy(positions).to(device)
    if acceptance.reads_logits or not isinstance(decoder, Decoder):  # fairseq's scorer post-processes every position
        logits = decoder.step(state, fed, positions, all_positions=True)
        best = ops.greedy_tokens(logits).cpu().numpy()
    else:
        logits = None
        best = np.full(tokens.shape, -1, dtype=np.int64)
        scored = decoder.step(state, fed, positions, scored=torch.from_numpy(real).to(device))
        best[real] = ops.greedy_tokens(scored).cpu().numpy()  # on a GPU, waits for the pass
    policy.timed(tokens.size, started, time.perf_counter())
    return logits, best, drafts


def _within_vocabulary(drafts: np.ndarray, vocab: int) -> np.ndarray:
    """A drafter only proposes: a draft ends before its first id outside the vocabulary (negative, or past
    the embedding), which greedy could never have chosen, so the verifier's own token takes its place."""
    outside = (drafts < 0) | (drafts >= vocab)  # -1 after a draft's end counts too: it stays -1
    return np.where(np.logical_or.accumulate(outside, axis=-1), -1, drafts) if outside.any() else drafts


def _anchors(drafter, live: np.ndarray, sequences: np.ndarray, row_lengths: np.ndarray) -> np.ndarray | None:
    """A copy drafter's anchors for the rows now (``CopyFromInput.anchors``); None for other drafters, which cannot
    tell without drafting."""
    return drafter.anchors(live, _tails(sequences, live, row_lengths)) if isinstance(drafter, CopyFromInput) else None


def _tails(sequences: np.ndarray, live: np.ndarray, row_lengths: np.ndarray) -> list[list[int]]:
    """Each row's last tokens, as many as the longest suffix an anchor is looked up by: only they leave the arrays."""
    ends = row_lengths[:, None] - np.arange(min(SUFFIX_LENGTHS[-1], sequences.shape[1]), 0, -1)
    tails = sequences[live[:, None], ends.clip(min=0)].tolist()
    return [tail[max(0, len(tail) - length):] for tail, length in zip(tails, row_lengths.tolist(), strict=True)]


def _draft(drafter, live: np.ndarray, sequences: np.ndarray, row_lengths: np.ndarray, sizes: np.ndarray,
           anchors: np.ndarray | None) -> np.ndarray:
    """[rows, max(sizes)] draft tokens, -1 after each row's draft."""
    if not (sizes > 0).any():
        return np.empty((sizes.shape[0], 0), dtype=np.int64)
    if anchors is not None:
        return drafter.draft_array(live, anchors, sizes)
    outputs = [row[:length] for row, length in zip(sequences[live].tolist(), row_lengths.tolist(), strict=True)]
    limits = sizes.tolist()
    drafts = drafter.draft(live.tolist(), outputs, limits)
    if len(drafts) != len(outputs):
        raise ValueError(f"the drafter returned {len(drafts)} drafts for {len(outputs)} rows")
    drafts = [list(map(int, draft))[:size] for draft, size in zip(drafts, limits, strict=True)]
    table = np.full((len(drafts), max(map(len, drafts))), -1, dtype=np.int64)
    for row, draft in enumerate(drafts):
        table[row, :len(draft)] = draft
    return table
