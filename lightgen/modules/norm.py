"""Norm modules on lightgen's ops; patched into existing instances, same parameters."""

from __future__ import annotations

from torch import nn

from lightgen import ops


def norm_kind(module: nn.Module) -> str | None:
    """'layer' for an affine nn.LayerNorm over one dim, 'rms' for HF's RMSNorm classes (and T5's), else None."""
    if isinstance(module, nn.LayerNorm):
        return "layer" if module.elementwise_affine and len(module.normalized_shape) == 1 else None
    # T5's "LayerNorm" is an RMSNorm (no mean, no bias, variance in float32).
    if type(module).__name__.endswith(("RMSNorm", "T5LayerNorm")) and hasattr(module, "variance_epsilon"):
        weight = getattr(module, "weight", None)
        return "rms" if isinstance(weight, nn.Parameter) and weight.dim() == 1 else None
    return None


def apply_norm(module: nn.Module, x):
    """The module's norm (LayerNorm or RMSNorm, by type) on lightgen's op."""
    if isinstance(module, nn.LayerNorm):
        return ops.layer_norm(x, module.weight, module.bias, module.eps)
    return ops.rms_norm(x, module.weight, module.variance_epsilon)


def apply_add_norm(module: nn.Module, x, residual):
    """(x + residual, norm(x + residual))."""
    if isinstance(module, nn.LayerNorm):
        return ops.add_layer_norm(x, residual, module.weight, module.bias, module.eps)
    return ops.add_rms_norm(x, residual, module.weight, module.variance_epsilon)
