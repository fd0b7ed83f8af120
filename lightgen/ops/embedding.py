"""Token embedding x scale + positional embedding (learned, or a fixed sinusoidal table)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lightgen import _build


def embedding(ids, weight, scale: float = 1.0, pos_weight=None, positions=None) -> torch.Tensor:
    """``weight[ids] * scale (+ pos_weight[positions])``; ids and positions of one shape, int64 or int32 (the index
    types ``F.embedding`` takes: users pass int32 ``input_ids`` to HF models)."""
    return _build.op("embedding")(_as_int64(ids), weight, scale, pos_weight, _as_int64(positions))


def _as_int64(indices):
    return indices.long() if indices is not None and indices.dtype == torch.int32 else indices


def embedding_ref(ids, weight, scale, pos_weight, positions):
    out = F.embedding(ids, weight) * scale
    if pos_weight is not None:
        out = out + F.embedding(positions, pos_weight)
    return out


def _embedding_fake(ids, weight, scale, pos_weight, positions):
    return weight.new_empty((*ids.shape, weight.shape[1]))


REFERENCES = {"embedding": embedding_ref}
FAKES = {"embedding": _embedding_fake}
