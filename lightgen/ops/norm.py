"""LayerNorm and RMSNorm, optionally fused with the residual add."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lightgen import _build


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    """``F.layer_norm`` over the last dimension."""
    return _build.op("layer_norm")(x, weight, bias, eps)


def add_layer_norm(x, residual, weight, bias, eps):
    """``(x + residual, layer_norm(x + residual))``: the sum feeds the next residual in pre-LN blocks."""
    return _build.op("add_layer_norm")(x, residual, weight, bias, eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama/T5 RMSNorm: normalise in float32, round to the input dtype, then scale."""
    return _build.op("rms_norm")(x, weight, eps)


def add_rms_norm(x, residual, weight, eps):
    return _build.op("add_rms_norm")(x, residual, weight, eps)


def layer_norm_ref(x, weight, bias, eps):
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def add_layer_norm_ref(x, residual, weight, bias, eps):
    total = x + residual
    return total, layer_norm_ref(total, weight, bias, eps)


def rms_norm_ref(x, weight, eps):
    xf = x.to(torch.float32)
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def add_rms_norm_ref(x, residual, weight, eps):
    total = x + residual
    return total, rms_norm_ref(total, weight, eps)


def _norm_fake(x, weight, *rest):
    return torch.empty_like(x)


def _add_norm_fake(x, residual, weight, *rest):
    return torch.empty_like(x), torch.empty_like(x)


REFERENCES = {
    "layer_norm": layer_norm_ref,
    "add_layer_norm": add_layer_norm_ref,
    "rms_norm": rms_norm_ref,
    "add_rms_norm": add_rms_norm_ref,
}
FAKES = {
    "layer_norm": _norm_fake,
    "add_layer_norm": _add_norm_fake,
    "rms_norm": _norm_fake,
    "add_rms_norm": _add_norm_fake,
}
