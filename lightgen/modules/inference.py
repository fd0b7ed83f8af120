"""When a patched module may take lightgen's kernels."""

from __future__ import annotations

import torch
from torch import nn


def dispatch_forward(module: nn.Module, *args, **kwargs):
    """The forward of a patched module: lightgen's path for inference, the original otherwise.

    lightgen's kernels have no autograd, so training or any forward that records gradients runs the
    original. So does a block whose submodules carry accelerate hooks (``cpu_offload``,
    ``dispatch_model``): the fast path reads submodule weights directly, which would skip the hooks
    that bring those weights in. Inference under ``torch.no_grad``/``inference_mode`` is fast.
    """
    if (module.training or torch.is_grad_enabled()
            or any("_hf_hook" in child.__dict__ for child in module._lightgen_watch)):
        return module._lightgen_original(*args, **kwargs)
    return module._lightgen_fast(*args, **kwargs)
