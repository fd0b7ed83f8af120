"""When a patched module may take lightgen's kernels."""

from __future__ import annotations

import torch
from torch import nn

# transformers 5 installs these on a model's first call with output_attentions / output_hidden_states and keeps
# them: they record outputs only while a call asks for them and never change what a module returns.
_HF_OUTPUT_RECORDERS = "transformers.utils.output_capturing"


def has_forward_hooks(module: nn.Module, output_recorders: bool = True) -> bool:
    """Whether ``module`` carries forward hooks or pre-hooks (``register_forward_hook``: capture, steering);
    ``output_recorders=False``: not counting HF's own output recorders."""
    if not (module._forward_hooks or module._forward_pre_hooks):  # every patched forward asks: stay cheap
        return False
    hooks = [*module._forward_hooks.values(), *module._forward_pre_hooks.values()]
    return output_recorders or any(getattr(hook, "__module__", None) != _HF_OUTPUT_RECORDERS for hook in hooks)


def skips_hooks(module: nn.Module, output_recorders: bool = True) -> bool:
    """Whether reading ``module``'s weights directly would skip hooks it carries: accelerate's (offload,
    dispatch), which bring the weights in, or forward hooks, which may change what the module returns.
    ``output_recorders=False`` leaves out HF's output recorders, for a caller that computes those outputs itself
    (lightgen's engine)."""
    return "_hf_hook" in module.__dict__ or has_forward_hooks(module, output_recorders)


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
