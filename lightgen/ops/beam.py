"""Beam-search candidate selection: the top-k of log_softmax(scores) + beam scores per batch item."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lightgen import _build


def beam_topk(scores: torch.Tensor, beam_scores: torch.Tensor | None, beams: int, k: int,
              log_softmax: bool = True, stable: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One beam-search step's candidate selection, as LightSeq's R-top-k does it.

    ``scores`` is float32 ``[B * beams, V]`` (a batch item's beams in consecutive rows) and
    ``beam_scores`` float32 ``[B * beams]`` or None. Each candidate is
    ``log_softmax(scores[r])[t] + beam_scores[r]`` (the raw score when ``log_softmax`` is False);
    returns the ``k`` best of each item's ``beams * V`` candidates as values ``[B, k]`` (descending)
    and flat indices ``beam * V + token`` ``[B, k]``, equal values in the order ``torch.topk`` gives them
    on the flattened ``[B, beams * V]`` candidates (what transformers' beam search selects), or, with
    ``stable``, ties to the smaller index (``torch.sort(stable=True)``, ``argmax``), plus survivors
    ``[B]``: how many candidates passed the rough threshold and were sorted (a measure of the
    filter). -inf masks a token or a finished beam; NaN and +inf are errors.
    """
    return _build.op("beam_topk")(scores, beam_scores, beams, k, log_softmax, stable)


def greedy_tokens(scores: torch.Tensor) -> torch.Tensor:
    """``scores.argmax(-1)`` for scores [..., V]: where the kernels are compiled and the scores are float32
    on the CPU, ``beam_topk`` with k = 1 (same ties: the first index; 4-10x faster than torch.argmax, whose
    CPU reduction is not vectorised: 210 vs 22 us on [8, 32000]); torch.argmax elsewhere, and for scores
    holding NaN or +inf, which the kernel refuses."""
    if (scores.dtype != torch.float32 or scores.device.type != "cpu" or scores.numel() == 0
            or not _build.load().compiled):
        return scores.argmax(-1)
    try:
        _, tokens, _ = beam_topk(scores.reshape(-1, scores.shape[-1]), None, 1, 1, False, stable=True)
    except RuntimeError as error:
        if not refuses_non_finite(error):
            raise
        return scores.argmax(-1)
    return tokens.view(scores.shape[:-1])


def refuses_non_finite(error: RuntimeError) -> bool:
    """Whether ``error`` is beam_topk refusing NaN or +inf scores or beam scores (callers that must rank them
    as torch does take the composite instead)."""
    message = str(error)
    return "NaN or +inf" in message or ("'beam_scores' row" in message and "finished beams take" in message)


def _candidates(scores, beam_scores, log_softmax):
    if torch.isnan(scores).any() or torch.isposinf(scores).any():
        raise RuntimeError("lightgen.beam_topk: 'scores' contains NaN or +inf; mask tokens with -inf instead")
    if beam_scores is not None and (torch.isnan(beam_scores).any() or torch.isposinf(beam_scores).any()):
        raise RuntimeError("lightgen.beam_topk: 'beam_scores' contains NaN or +inf")
    candidates = scores
    if log_softmax:
        # A row of only -inf has a NaN log_softmax; its candidates are -inf like any masked token.
        candidates = F.log_softmax(scores, dim=-1).masked_fill(scores == float("-inf"), float("-inf"))
    if beam_scores is not None:
        candidates = candidates + beam_scores[:, None]
    return candidates


def _rough_thresholds(candidates: torch.Tensor, k: int) -> torch.Tensor:
    """Each row's R-top-k: the smallest of the maxima of k contiguous chunks, <= its k-th largest.

    Chunk g holds tokens [g*V//k, (g+1)*V//k), as in the kernel. Computed on candidate values,
    which give the kernel's threshold exactly: the candidate map is monotone, so it commutes with
    max and min.
    """
    rows, vocab = candidates.shape
    if k > vocab:
        return candidates.new_full((rows,), float("-inf"))
    chunk = ((torch.arange(vocab, device=candidates.device) + 1) * k - 1) // vocab
    maxima = candidates.new_full((rows, k), float("-inf"))
    maxima = maxima.scatter_reduce(1, chunk.expand(rows, vocab), candidates, "amax")
    return maxima.amin(dim=1)


def beam_topk_ref(scores, beam_scores, beams, k, log_softmax=True, stable=False):
    """Specification: ``torch.topk`` of the flattened candidates (with ``stable``: a stable descending
    sort of them, first k kept).

    survivors is not a property of the top k but of the kernel's filter; the reference recomputes
    the same rough thresholds so that all three outputs must match exactly.
    """
    candidates = _candidates(scores, beam_scores, log_softmax)
    batch, vocab = scores.shape[0] // beams, scores.shape[1]
    flat = candidates.reshape(batch, beams * vocab)
    if stable:
        values, indices = torch.sort(flat, dim=1, descending=True, stable=True)
    else:
        values, indices = torch.topk(flat, k, dim=1)
    item_thresholds = _rough_thresholds(candidates, k).view(batch, beams).amax(dim=1)
    survivors = (flat >= item_thresholds[:, None]).sum(dim=1)
    return values[:, :k].contiguous(), indices[:, :k].contiguous(), survivors


def _beam_topk_fake(scores, beam_scores, beams, k, log_softmax, stable=False):
    batch = scores.shape[0] // beams
    return (scores.new_empty((batch, k)), scores.new_empty((batch, k), dtype=torch.int64),
            scores.new_empty((batch,), dtype=torch.int64))


REFERENCES = {"beam_topk": beam_topk_ref}
FAKES = {"beam_topk": _beam_topk_fake}
