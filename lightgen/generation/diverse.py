"""Diverse (group) beam search: Vijayakumar et al. 2016, with HF v4's ``_group_beam_search`` semantics.

transformers 5 removed it from its core (it lives in a Hub repo), so lightgen carries its own: the
beams are split into ``num_beam_groups`` groups decoded one after another at every step; a group's
scores are lowered by ``diversity_penalty`` times how often each token was just chosen by the
earlier groups of the same sentence (Hamming diversity), then HF's other processors run, and each
group keeps its best ``num_beams // num_beam_groups`` continuations with v4's finished-hypothesis
bookkeeping. With one group it is ordinary beam search.

With ``return_dict_in_generate`` it returns HF's beam output: ``sequences_scores`` (v4's hypothesis
scores), ``scores`` (per step, every row's processed log-probabilities: after the Hamming penalty and
the processors, before the running beam score is added, as v4), ``logits`` and ``beam_indices``. v4
numbered a group's beams within the group; here, as in HF's beam search, ``beam_indices`` holds the
row (``batch_index * num_beams + beam``) each token was chosen from, so one group equals beam search.
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from transformers.generation.logits_process import LogitsProcessorList

# Processor state with one entry per row of the whole batch x beams (transformers 5's repetition penalty
# skips each row's left padding); a group's call sees only its rows.
_PER_ROW_STATE = {"RepetitionPenaltyLogitsProcessor": ("prompt_ignore_length",)}


class Hypotheses:
    """The best finished sequences of one (sentence, group), v4's ``BeamHypotheses``."""

    def __init__(self, size: int, length_penalty: float, early_stopping, max_length: int) -> None:
        self.size, self.length_penalty = size, length_penalty
        self.early_stopping, self.max_length = early_stopping, max_length
        self.beams: list[tuple[float, torch.Tensor, torch.Tensor]] = []  # (score, tokens, beam indices)
        self.worst_score = 1e9

    def add(self, tokens: torch.Tensor, sum_logprobs: float, generated_len: int, beam_indices: torch.Tensor) -> None:
        score = sum_logprobs / (generated_len ** self.length_penalty)
        if len(self.beams) < self.size or score > self.worst_score:
            self.beams.append((score, tokens, beam_indices))
            if len(self.beams) > self.size:
                ranked = sorted((beam[0], index) for index, beam in enumerate(self.beams))
                del self.beams[ranked[0][1]]
                self.worst_score = ranked[1][0]
            else:
                self.worst_score = min(score, self.worst_score)

    def is_done(self, best_sum_logprobs: float, cur_len: int, prompt_len: int) -> bool:
        if len(self.beams) < self.size:
            return False
        if self.early_stopping is True:
            return True
        length = cur_len - prompt_len
        if self.early_stopping == "never" and self.length_penalty > 0.0:
            length = self.max_length - prompt_len
        return self.worst_score >= best_sum_logprobs / length ** self.length_penalty


def _hamming_penalty(scores, current_tokens, group, group_size, num_beams, penalty):
    """Lower each row's scores by ``penalty`` x how often earlier groups of its sentence chose a token."""
    if group == 0 or penalty == 0.0:
        return scores
    batch = current_tokens.shape[0] // num_beams
    earlier = current_tokens.view(batch, num_beams)[:, : group * group_size]
    counts = torch.zeros(batch, scores.shape[-1], dtype=scores.dtype, device=scores.device)
    counts.scatter_add_(1, earlier, torch.ones_like(earlier, dtype=scores.dtype))
    return scores - penalty * counts.repeat_interleave(group_size, dim=0)


def _for_rows(logits_processor, rows: int, members: torch.Tensor) -> LogitsProcessorList:
    """The processors as a call on the batch's rows ``members`` sees them: per-row state narrowed."""
    narrowed = LogitsProcessorList()
    for processor in logits_processor:
        state = {name: getattr(processor, name) for name in _PER_ROW_STATE.get(type(processor).__name__, ())}
        state = {name: value[members.to(value.device)] for name, value in state.items()
                 if isinstance(value, torch.Tensor) and value.dim() == 1 and value.shape[0] == rows}
        if state:
            processor = copy.copy(processor)
            vars(processor).update(state)
        narrowed.append(processor)
    return narrowed


def group_beam_search(decoder, state, input_ids, prompt_positions, logits_processor, stopping_criteria,
                      generation_config, output_class):
    num_beams, groups = generation_config.num_beams, generation_config.num_beam_groups
    group_size = num_beams // groups
    pad_token_id = generation_config._pad_token_tensor
    eos = generation_config._eos_token_tensor
    eos_ids = set(eos.tolist()) if eos is not None else set()
    max_length = generation_config.max_length
    rows, cur_len = input_ids.shape
    batch, prompt_len, device = rows // num_beams, cur_len, input_ids.device
    keep_per_group = max(2, 1 + len(eos_ids)) * group_size

    hypotheses = [Hypotheses(group_size, generation_config.length_penalty, generation_config.early_stopping,
                             max_length) for _ in range(batch * groups)]
    done = [False] * (batch * groups)
    sequences = torch.full((rows, max_length), pad_token_id if pad_token_id is not None else 0,
                           dtype=input_ids.dtype, device=device)
    sequences[:, :cur_len] = input_ids
    beam_scores = torch.full((batch, num_beams), -1e9, device=device)
    beam_scores[:, ::group_size] = 0  # every group starts from its first beam
    beam_scores = beam_scores.view(-1)
    group_rows = [torch.tensor([b * num_beams + g * group_size + j for b in range(batch) for j in range(group_size)],
                               device=device) for g in range(groups)]
    group_processors = [_for_rows(logits_processor, rows, members) for members in group_rows]
    keep_scores = generation_config.return_dict_in_generate and generation_config.output_scores
    keep_logits = generation_config.return_dict_in_generate and generation_config.output_logits
    all_scores = () if keep_scores else None
    raw_logits = () if keep_logits else None
    # Per running row, the row each of its generated tokens was chosen from.
    history = torch.full((rows, max_length - prompt_len), -1, dtype=torch.long, device=device)

    logits = decoder.prefill(state, input_ids, prompt_positions)
    while True:
        current_tokens = torch.zeros(rows, dtype=input_ids.dtype, device=device)
        reorder = torch.zeros(rows, dtype=torch.long, device=device)
        processed = torch.empty_like(logits) if keep_scores else None
        step = cur_len - prompt_len
        for group, members in enumerate(group_rows):
            group_sequences = sequences[members, :cur_len]
            scores = nn.functional.log_softmax(logits[members], dim=-1)
            scores = _hamming_penalty(scores, current_tokens, group, group_size, num_beams,
                                      generation_config.diversity_penalty or 0.0)
            scores = group_processors[group](group_sequences, scores)
            if keep_scores:
                processed[members] = scores
            vocab = scores.shape[-1]
            scores = (scores + beam_scores[members, None]).view(batch, group_size * vocab)
            top_scores, top_indices = torch.topk(scores, keep_per_group, dim=1, largest=True, sorted=True)
            next_scores = torch.zeros(batch, group_size, device=device)
            next_tokens = torch.full((batch, group_size), pad_token_id if pad_token_id is not None else 0,
                                     dtype=input_ids.dtype, device=device)
            next_sources = torch.zeros(batch, group_size, dtype=torch.long, device=device)
            for b in range(batch):
                slot = b * groups + group
                if done[slot]:
                    continue
                filled = 0
                for rank, (score, index) in enumerate(zip(top_scores[b].tolist(), top_indices[b].tolist(),
                                                          strict=True)):
                    token, source = index % vocab, b * group_size + index // vocab
                    if token in eos_ids:
                        if rank < group_size:
                            indices = history[members[source], :step + 1].clone()
                            indices[step] = _row(source, group, group_size, num_beams)
                            hypotheses[slot].add(group_sequences[source].clone(), score, cur_len + 1 - prompt_len,
                                                 indices)
                    else:
                        next_scores[b, filled], next_tokens[b, filled], next_sources[b, filled] = score, token, source
                        filled += 1
                    if filled == group_size:
                        break
                done[slot] = hypotheses[slot].is_done(top_scores[b].max().item(), cur_len + 1, prompt_len)
            sources = next_sources.view(-1)
            beam_scores[members] = next_scores.view(-1)
            sequences[members, : cur_len] = group_sequences[sources]
            sequences[members, cur_len] = next_tokens.view(-1)
            current_tokens[members] = next_tokens.view(-1)
            reorder[members] = _row(sources, group, group_size, num_beams)
            history[members] = history[members[sources]]
            history[members, step] = reorder[members]
        if keep_scores:
            all_scores += (processed,)
        if keep_logits:
            raw_logits += (logits.clone(),)
        cur_len += 1
        if all(done) or bool(stopping_criteria(sequences[:, :cur_len], None).all()):
            break
        state.reorder(reorder)
        logits = decoder.step(state, current_tokens[:, None])
    decoded, best_scores, beam_indices = _finalize(sequences[:, :cur_len], beam_scores, history, hypotheses, done,
                                                   generation_config, prompt_len, groups)
    if not generation_config.return_dict_in_generate:
        return decoded
    return output_class(sequences=decoded, sequences_scores=best_scores if keep_scores else None, scores=all_scores,
                        logits=raw_logits, beam_indices=beam_indices)


def _row(sources, group: int, group_size: int, num_beams: int):
    """Group-local beam numbers (``sentence * group_size + beam``) -> rows of the whole batch."""
    return num_beams * (sources // group_size) + group * group_size + sources % group_size


def _finalize(sequences, beam_scores, history, hypotheses, done, generation_config, prompt_len, groups):
    """v4's ``BeamSearchScorer.finalize``: add running beams, pick the best hypotheses over groups. Returns
    the sequences, their scores and their beam indices (-1 after each one's end)."""
    group_size = generation_config.num_beams // groups
    keep = generation_config.num_return_sequences
    eos = generation_config._eos_token_tensor
    for slot, hyp in enumerate(hypotheses):
        if done[slot]:
            continue
        for j in range(group_size):
            row = slot * group_size + j
            hyp.add(sequences[row], beam_scores[row].item(), sequences.shape[-1] - prompt_len,
                    history[row, :sequences.shape[-1] - prompt_len])
    chosen = []
    for b in range(len(hypotheses) // groups):
        candidates = sorted((beam for hyp in hypotheses[b * groups:(b + 1) * groups] for beam in hyp.beams),
                            key=lambda beam: beam[0])
        chosen.extend(candidates.pop() for _ in range(keep))
    best = [tokens for _, tokens, _ in chosen]
    lengths = [len(tokens) for tokens in best]
    width = min(max(lengths) + 1, generation_config.max_length)
    pad = generation_config._pad_token_tensor
    decoded = sequences.new_full((len(best), width), int(pad) if pad is not None and min(lengths) != max(lengths)
                                 else 0)
    for row, tokens in enumerate(best):
        decoded[row, : len(tokens)] = tokens
        if len(tokens) < width and eos is not None:
            decoded[row, len(tokens)] = eos[0]
    beam_indices = torch.full((len(chosen), max(len(indices) for _, _, indices in chosen)), -1, dtype=torch.long,
                              device=sequences.device)
    for row, (_, _, indices) in enumerate(chosen):
        beam_indices[row, :len(indices)] = indices
    scores = torch.tensor([score for score, _, _ in chosen], device=sequences.device)
    return decoded, scores, beam_indices
