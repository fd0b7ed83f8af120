"""T5's relative position bias for the static-cache decoder step.

T5 adds one learned scalar per (bucket of the key-query distance, head) to the attention scores. The
bias of every distance a request can meet is looked up once per request (``table``); each step then
only gathers its rows from it (``scores_bias``) and every layer shares that one bias, as in HF.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn


@dataclasses.dataclass(frozen=True)
class RelativePositionBias:
    embedding: nn.Embedding  # [buckets, heads]: the model's own relative_attention_bias
    buckets: int
    max_distance: int
    bidirectional: bool  # False for the decoder's causal self-attention
    bucket: Callable  # the family's bucketing: (relative, bidirectional, num_buckets, max_distance) -> bucket ids

    def table(self, max_len: int) -> torch.Tensor:
        """[H, 2 * max_len - 1]: the bias of distances key - query = -(max_len - 1) .. max_len - 1."""
        weight = self.embedding.weight
        relative = torch.arange(1 - max_len, max_len, device=weight.device)
        ids = self.bucket(relative, bidirectional=self.bidirectional, num_buckets=self.buckets,
                          max_distance=self.max_distance)
        return F.embedding(ids, weight).t()

    @staticmethod
    def scores_bias(table: torch.Tensor, positions: torch.Tensor, keys: int) -> torch.Tensor:
        """[N, H, T, keys] additive bias for queries at ``positions`` [N, T] over cache slots 0..keys-1
        (the last dimension contiguous, as the attention op reads it)."""
        centre = table.shape[1] // 2
        index = torch.arange(keys, device=positions.device) - positions[:, :, None] + centre  # [N, T, keys]
        return table[:, index].transpose(0, 1)
