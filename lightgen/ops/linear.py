"""Decode-shaped linear layer: ``act(x @ weight.T * scale + bias)`` for a few rows of x."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lightgen import _build
from lightgen.ops.activation import _activation


PANEL = 64  # output columns per packed panel


def linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None = None, bias: torch.Tensor | None = None,
           act: str = "none", out_features: int = -1) -> torch.Tensor:
    """``act(x @ W.T * scale + bias)`` for ``x`` [..., K] float32.

    ``weight`` (float32, bfloat16, or int8 with a per-output-channel ``scale`` [N]) is W [N, K], a
    float32 W viewed from a contiguous [K, N] tensor (HF Conv1D's ``weight.t()``), or W packed by
    ``pack_panels`` with ``out_features`` = N.
    """
    return _build.op("linear")(x, weight, scale, bias, act, out_features)


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """W [N, K] -> panels [ceil(N / 64), K, 64]: each panel's 64 output columns, k after k (zero-padded)."""
    out_features, in_features = weight.shape
    panels = -(-out_features // PANEL)
    padded = weight.new_zeros(panels * PANEL, in_features)
    padded[:out_features] = weight
    return padded.view(panels, PANEL, in_features).transpose(1, 2).contiguous()


def unpack_panels(packed: torch.Tensor, out_features: int) -> torch.Tensor:
    return packed.transpose(1, 2).reshape(-1, packed.shape[1])[:out_features]


def linear_ref(x, weight, scale, bias, act, out_features=-1):
    if weight.dim() == 3:
        weight = unpack_panels(weight, out_features)
    weight = weight.float()
    if scale is not None:
        weight = weight * scale[:, None]
    return _activation(act)(F.linear(x, weight, bias))


def _linear_fake(x, weight, scale, bias, act, out_features=-1):
    return x.new_empty((*x.shape[:-1], out_features if weight.dim() == 3 else weight.shape[0]))


REFERENCES = {"linear": linear_ref}
FAKES = {"linear": _linear_fake}
