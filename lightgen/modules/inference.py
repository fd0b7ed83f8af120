"""When a patched module may take lightgen's kernels."""

from __future__ import annotations

import torch
from torch import nn


def has_forward_hooks(module: nn.Module) -> bool:
    """Whether ``module`` carries forward hooks or pre-hooks (``register_forward_hook``: capture, steering)."""
    return bool(module._forward_hooks or module._forward_pre_hooks)


def skips_hooks(module: nn.Module) -> bool:
    """Whether reading ``module``'s weights directly would skip hooks it carries: accelerate's (offload,
    dispatch), which bring the weights in, or forward hooks, which may change what the module returns."""
    return "_hf_hook" in module.__dict__ or has_forward_hooks(module)


def dispatch_forward(module: nn.Module, *args, **kwargs):
    """The forward of a patched module: lightgen's path for inference, the original otherwise.

    lightgen's kernels have no autograd, so training or any forward that records gradients runs the
    original. So does a block whose submodules carry hooks (``skips_hooks``): the fast path reads
    submodule weights directly. Inference under ``torch.no_grad``/``inference_mode`` is fast.
    """
    if (module.training or torch.is_grad_enabled()
            or any(skips_hooks(child) for child in module._lightgen_watch)):
        return module._lightgen_original(*args, **kwargs)
    return module._lightgen_fast(*args, **kwargs)
