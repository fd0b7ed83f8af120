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

from dataclasses import dataclass
from typing import Protocol

import torch
from transformers.generation.utils import GenerateDecoderOnlyOutput, GenerateEncoderDecoderOutput

from lightgen import ops
from lightgen.generation.tokens import pad_rows
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
    for size in SUFFIX_LENGTHS:
        if size > len(output):
            return None
        suffix = output[-size:]
        starts = [i for i in range(len(source) - size + 1) if source[i:i + size] == suffix]
        if len(starts) == 1:
            return starts[0] + size
    return None


class CopyFromInput:
    """IAD's drafter: copy ``sources[row]`` from the anchor that ``find_anchor`` gives."""

    def __init__(self, sources: list[list[int]]) -> None:
        self.sources = sources

    def draft(self, rows, outputs, sizes):
        drafts = []
        for row, output, size in zip(rows, outputs, sizes, strict=True):
            start = find_anchor(output, self.sources[row])
            drafts.append([] if start is None else self.sources[row][start:start + size])
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

    def accepted(self, logits: torch.Tensor | None, predictions: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
        """logits [N, 1 + K, V] (None when not ``reads_logits``), their argmax ``predictions`` [N, 1 + K],
        drafts [N, K] (-1 after a row's draft) -> [N, K] bool: slot k passes."""
        if not self.reads_logits:
            return predictions[:, :-1] == drafts
        log_probs = logits[:, :-1].log_softmax(-1)
        best, candidates = log_probs.topk(self.beta, dim=-1)
        drafted = log_probs.gather(-1, drafts.clamp(min=0)[..., None])[..., 0]
        return (candidates == drafts[..., None]).any(-1) & (best[..., 0] - drafted <= self.tau)


GREEDY = Acceptance()  # beta=1: greedy's output exactly


@dataclass(frozen=True)
class DraftBudget:
    """Draft length per row when the caller sets none: ``longest`` for one row, and from ``total / rows``
    (at least ``shortest``) as the batch grows. A verification pass over rows x (1 + draft) positions
    turns compute-bound as rows grow, and drafts past the accepted prefix are wasted work: IAD on the
    demo model, 64 sentences, ms per call at max_draft 4/6/8/12/16: batch 8 181/179/178/192/194, batch 32
    161/166/173/186/202, while one row is fastest at 16."""

    longest: int = 16
    total: int = 64
    shortest: int = 4

    def per_row(self, rows: int) -> int:
        return min(self.longest, max(self.shortest, self.total // rows))


def aggressive_greedy(decoder, state, input_ids, prompt_positions, drafter: DraftSession, eos_ids: set[int],
                      pad_token_id: int, max_length: int, max_draft: int | DraftBudget,
                      acceptance: Acceptance = GREEDY, forced_eos: int | None = None,
                      streamer=None) -> tuple[torch.Tensor, list[list[int]]]:
    """Greedy decoding (or GAD++'s relaxation of it), accelerated by ``drafter``'s guesses; a row that
    reaches ``max_length`` ends with ``forced_eos`` when given. A ``streamer`` (one row only) gets each
    pass's new tokens, [1, n], as from HF's assisted decoding.

    ``max_draft``: the most draft tokens per row and pass, or a ``DraftBudget`` that sets it from the
    number of rows still decoding. Returns the sequences and, per row, the tokens each of its decoder
    passes added (accepted draft tokens + the verifier's own token); a row's pass count is the length of
    its list. The cache needs as many spare positions as the longest draft: padding after short drafts is
    written there and rolled back."""
    rows, prompt_len = input_ids.shape
    device = input_ids.device
    outputs = [row.tolist() for row in input_ids]  # full sequences so far, per row
    live = list(range(rows))  # original row index of each row still decoding
    gained = [[] for _ in range(rows)]
    vocab = decoder.spec.token_embedding.shape[0]
    if prompt_len == 1:  # a lone start token (encoder-decoder): the first pass already verifies a draft
        drafts = _draft(drafter, live, outputs, max_length, max_draft, vocab)
        logits, best, draft_tensor = _verify(decoder, state, outputs, live, drafts, pad_token_id, input_ids.dtype,
                                             acceptance)
    else:
        logits = decoder.step(state, input_ids, prompt_positions)[:, None]  # the prompt pass: [rows, 1, V]
        best = ops.greedy_tokens(logits)
        drafts, draft_tensor = [[] for _ in live], best.new_empty(rows, 0)
    while True:
        width = best.shape[1] - 1
        passed = acceptance.accepted(logits, best, draft_tensor).cumprod(-1).sum(-1).tolist()
        predictions = best.tolist()
        rejected, finished = [], []
        for slot, row in enumerate(live):
            accepted = passed[slot]
            new_tokens = drafts[slot][:accepted] + [predictions[slot][accepted]]
            rejected.append(width - accepted)
            for position, token in enumerate(new_tokens):
                last = len(outputs[row]) + position + 1 >= max_length
                if last or token in eos_ids:
                    new_tokens = new_tokens[:position + 1]
                    if last and forced_eos is not None:  # HF's ForcedEOSTokenLogitsProcessor
                        new_tokens[-1] = forced_eos
                    finished.append(slot)
                    break
            outputs[row].extend(new_tokens)
            gained[row].append(len(new_tokens))
            if streamer is not None:
                streamer.put(torch.tensor([new_tokens]))
        state.roll_back(torch.tensor(rejected, device=device))
        if len(finished) == len(live):
            break
        if finished:
            keep = [slot for slot in range(len(live)) if slot not in finished]
            state.keep_rows(torch.tensor(keep, device=device))
            live = [live[slot] for slot in keep]
        drafts = _draft(drafter, live, outputs, max_length, max_draft, vocab)
        logits, best, draft_tensor = _verify(decoder, state, outputs, live, drafts, pad_token_id, input_ids.dtype,
                                             acceptance)
    return pad_rows(outputs, pad_token_id, device).to(input_ids.dtype), gained


def _draft(drafter, live, outputs, max_length, max_draft, vocab: int) -> list[list[int]]:
    if isinstance(max_draft, DraftBudget):
        max_draft = max_draft.per_row(len(live))
    # The verifier's own token needs one more place after the draft.
    sizes = [min(max_draft, max_length - len(outputs[row]) - 1) for row in live]
    drafts = drafter.draft(live, [outputs[row] for row in live], sizes)
    if len(drafts) != len(live):
        raise ValueError(f"the drafter returned {len(drafts)} drafts for {len(live)} rows")
    return [_within_vocabulary(list(map(int, draft))[:size], vocab) for draft, size in zip(drafts, sizes, strict=True)]


def _within_vocabulary(draft: list[int], vocab: int) -> list[int]:
    """A drafter only proposes: a draft ends before its first id outside the vocabulary (negative, or past
    the embedding), which greedy could never have chosen, so the verifier's own token takes its place."""
    for position, token in enumerate(draft):
        if not 0 <= token < vocab:
            return draft[:position]
    return draft


def _verify(decoder, state, outputs, live, drafts, pad_token_id, dtype,
            acceptance: Acceptance) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """One decoder pass over ``[last token, draft]`` per row: the logits [rows, 1 + K, V] when the
    acceptance rule reads them (None otherwise), their argmax [rows, 1 + K] (-1 at the padding after
    short drafts, which greedy acceptance never reads, so lightgen's decoder skips their LM head) and the
    drafts [rows, K] (-1 after each row's draft)."""
    device = state.next_position.device
    padded = pad_rows([[outputs[row][-1], *draft] for row, draft in zip(live, drafts, strict=True)], pad_token_id,
                      device)
    tokens, width = padded.to(dtype), padded.shape[1] - 1
    draft_lengths = torch.tensor([len(draft) for draft in drafts], device=device)
    real = torch.arange(1 + width, device=device) <= draft_lengths[:, None]
    draft_tensor = padded[:, 1:].masked_fill(~real[:, 1:], -1)
    # Padding after short drafts is computed and rolled back; clamp its positions into the table.
    positions = (state.next_position[:, None] + torch.arange(1 + width, device=device)).clamp(
        max=decoder.spec.position_limit - 1)
    if acceptance.reads_logits or not isinstance(decoder, Decoder):  # fairseq's scorer post-processes every position
        logits = decoder.step(state, tokens, positions, all_positions=True)
        return logits, ops.greedy_tokens(logits), draft_tensor
    best = torch.full(tokens.shape, -1, dtype=torch.long, device=device)
    best[real] = ops.greedy_tokens(decoder.step(state, tokens, positions, scored=real))
    return None, best, draft_tensor
