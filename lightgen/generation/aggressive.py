"""Input-guided aggressive decoding (IAD; Ge et al. 2022, arXiv 2205.10350), batched, on the static cache.

Each row drafts by copying its input from an anchor, the decoder verifies ``[last token, draft]`` in one
pass, the row keeps the longest draft prefix that greedy decoding would have produced plus the
verifier's own next token, and the cache rolls back by moving the row's length. The next anchor follows
the shortest output suffix (1-3 tokens) found exactly once in the input; without one the row takes an
ordinary greedy step. Rows keep their own lengths; finished rows leave the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.generation.utils import GenerateDecoderOnlyOutput, GenerateEncoderDecoderOutput

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


def iad_greedy(decoder, state, input_ids, prompt_positions, sources: list[list[int]], eos_ids: set[int],
               pad_token_id: int, max_length: int, max_draft: int) -> tuple[torch.Tensor, list[list[int]]]:
    """Greedy decoding, accelerated by drafts copied from ``sources``.

    Returns the sequences and, per row, the tokens each of its decoder passes added (accepted draft
    tokens + the verifier's own token); a row's pass count is the length of its list."""
    rows, prompt_len = input_ids.shape
    device = input_ids.device
    sequences = torch.full((rows, max_length), pad_token_id, dtype=input_ids.dtype, device=device)
    sequences[:, :prompt_len] = input_ids
    outputs = [row.tolist() for row in input_ids]  # full sequences so far, per row
    live = list(range(rows))  # original row index of each row still decoding
    logits = decoder.step(state, input_ids, prompt_positions)[:, None]  # the prompt pass: [rows, 1, V]
    drafts = [[] for _ in live]
    gained = [[] for _ in range(rows)]
    while True:
        predictions = logits.argmax(-1).tolist()  # [rows, 1 + K]
        rejected, finished = [], []
        for slot, row in enumerate(live):
            draft, guesses = drafts[slot], predictions[slot]
            accepted = 0
            while accepted < len(draft) and guesses[accepted] == draft[accepted]:
                accepted += 1
            new_tokens = draft[:accepted] + [guesses[accepted]]
            rejected.append(len(guesses) - 1 - accepted)
            for position, token in enumerate(new_tokens):
                if token in eos_ids or len(outputs[row]) + position + 1 >= max_length:
                    new_tokens = new_tokens[:position + 1]
                    finished.append(slot)
                    break
            outputs[row].extend(new_tokens)
            gained[row].append(len(new_tokens))
        for row in live:
            sequences[row, : len(outputs[row])] = torch.tensor(outputs[row], dtype=sequences.dtype)
        state.roll_back(torch.tensor(rejected, device=device))
        if len(finished) == len(live):
            break
        if finished:
            keep = [slot for slot in range(len(live)) if slot not in finished]
            state.keep_rows(torch.tensor(keep, device=device))
            live = [live[slot] for slot in keep]
        drafts = []
        for row in live:
            start = find_anchor(outputs[row], sources[row])
            room = max_length - len(outputs[row]) - 1  # the verifier's own token needs one more place
            drafts.append([] if start is None else sources[row][start:start + min(max_draft, room)])
        width = max(len(draft) for draft in drafts)
        tokens = torch.full((len(live), 1 + width), pad_token_id, dtype=input_ids.dtype, device=device)
        for slot, row in enumerate(live):
            tokens[slot, 0] = outputs[row][-1]
            tokens[slot, 1:1 + len(drafts[slot])] = torch.tensor(drafts[slot], dtype=input_ids.dtype)
        # Padding after short drafts is computed and rolled back; clamp its positions into the table.
        positions = (state.next_position[:, None] + torch.arange(1 + width, device=device)).clamp(
            max=decoder.spec.position_limit - 1)
        logits = decoder.step(state, tokens, positions, all_positions=True)
    final_length = max(len(output) for output in outputs)
    return sequences[:, :final_length], gained
