"""Norm modules on lightgen's ops; patched into existing instances, same parameters."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lightgen import ops

# RMSNorm classes that scale by ``(1 + weight)`` in float32 and round once at the end (Gemma's), by class
# name; their adapters add them. Their ``eps`` attribute is the epsilon.
UNIT_OFFSET_RMS_NORMS: set[str] = set()


def norm_kind(module: nn.Module) -> str | None:
    """'layer' for an affine nn.LayerNorm over one dim, 'rms' for HF's RMSNorm classes (and T5's), 'rms_offset'
    for the ``(1 + weight)`` ones (``UNIT_OFFSET_RMS_NORMS``), else None."""
    if isinstance(module, nn.LayerNorm):
        return "layer" if module.elementwise_affine and len(module.normalized_shape) == 1 else None
    weight = getattr(module, "weight", None)
    if not (isinstance(weight, nn.Parameter) and weight.dim() == 1):
        return None
    if type(module).__name__ in UNIT_OFFSET_RMS_NORMS:
        return "rms_offset"
    # T5's "LayerNorm" is an RMSNorm (no mean, no bias, variance in float32).
    if type(module).__name__.endswith(("RMSNorm", "T5LayerNorm")) and hasattr(module, "variance_epsilon"):
        return "rms"
    return None


def unit_offset_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm, as HF computes it (no kernel yet: the composite keeps its rounding points)."""
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (normed * (1.0 + weight.float())).type_as(x)


def apply_norm(module: nn.Module, x):
    """The module's norm (LayerNorm or RMSNorm, by type) on lightgen's op."""
    if isinstance(module, nn.LayerNorm):
        if module.weight is None:  # OPT's layer_norm_elementwise_affine=False: no kernel
            return F.layer_norm(x, module.normalized_shape, None, None, module.eps)
        return ops.layer_norm(x, module.weight, module.bias, module.eps)
    if type(module).__name__ in UNIT_OFFSET_RMS_NORMS:
        return unit_offset_rms_norm(x, module.weight, module.eps)
    return ops.rms_norm(x, module.weight, module.variance_epsilon)


def apply_add_norm(module: nn.Module, x, residual):
    """(x + residual, norm(x + residual))."""
    if isinstance(module, nn.LayerNorm) and module.weight is None:
        total = x + residual
        return total, apply_norm(module, total)
    if isinstance(module, nn.LayerNorm):
        return ops.add_layer_norm(x, residual, module.weight, module.bias, module.eps)
    if type(module).__name__ in UNIT_OFFSET_RMS_NORMS:
        total = x + residual
        return total, unit_offset_rms_norm(total, module.weight, module.eps)
    return ops.add_rms_norm(x, residual, module.weight, module.variance_epsilon)
