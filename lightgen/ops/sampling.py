"""Sampling a token per row: ``torch.multinomial(probs, 1)``, the same draws and tokens, faster on the CPU."""

from __future__ import annotations

import torch

from lightgen import _build


def sample_tokens(probs: torch.Tensor) -> torch.Tensor:
    """``torch.multinomial(probs, 1).squeeze(1)`` for probs [rows, V] (what HF's sampling calls): the same
    tokens from the same state of the default generator, which it leaves where torch.multinomial would.
    Where the kernels are compiled and probs are float32 on the CPU, tokens of probability 0 (all but top-k's
    few) cost their random bits only, not an exponential draw each; torch.multinomial elsewhere. The same
    errors for negative, NaN or +inf probabilities and rows that sum to 0."""
    if probs.dtype != torch.float32 or probs.device.type != "cpu" or probs.dim() != 2 or not _build.load().compiled:
        return sample_tokens_ref(probs)
    return _build.op("sample_tokens")(probs)


def sample_tokens_ref(probs):
    return torch.multinomial(probs, num_samples=1).squeeze(1)


def _sample_tokens_fake(probs):
    return probs.new_empty((probs.shape[0],), dtype=torch.int64)


REFERENCES = {"sample_tokens": sample_tokens_ref}
FAKES = {"sample_tokens": _sample_tokens_fake}
