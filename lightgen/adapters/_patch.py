"""Reversible in-place edits of a model instance.

Patched forwards are methods bound to their module and keep their state on it, so
``copy.deepcopy`` of an accelerated model yields an accelerated copy that runs its own weights.
"""

from __future__ import annotations

import types
from typing import Any, Callable

from torch import nn

from lightgen.modules.inference import dispatch_forward


class _Missing:
    """Marks an attribute that did not exist before patching; survives deepcopy as itself."""

    def __deepcopy__(self, memo):
        return self


_MISSING = _Missing()


def _patched_extra_repr(module: nn.Module) -> str:
    return ", ".join(filter(None, [type(module).extra_repr(module), f"lightgen: {module._lightgen_label}"]))


class Patcher:
    """Records every attribute it sets so that ``undo`` restores the instance exactly."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.previous_attn_implementation: str | None = None
        self.quantize: str | None = None  # accelerate_model's weight options
        self.pack = True
        self._edits: list[tuple[Any, str, Any]] = []
        self.patched: list[str] = []  # human-readable summary, one line per patched module

    def set(self, obj: Any, name: str, value: Any) -> None:
        self._edits.append((obj, name, obj.__dict__.get(name, _MISSING)))
        # object.__setattr__ keeps nn.Module from registering values as submodules or parameters.
        object.__setattr__(obj, name, value)

    def replace_forward(self, module: nn.Module, fast: Callable, label: str, qualname: str) -> None:
        """Route ``module``'s inference forward to ``fast(module, *args, **kwargs)``.

        Under accelerate hooks (``cpu_offload``, ``dispatch_model``) the hook wraps ``_old_forward``,
        so that is what we replace, leaving the hook in charge of device placement.
        """
        attr = "_old_forward" if hasattr(module, "_hf_hook") and hasattr(module, "_old_forward") else "forward"
        self.set(module, "_lightgen_original", getattr(module, attr))
        self.set(module, "_lightgen_fast", types.MethodType(fast, module))
        self.set(module, "_lightgen_watch", list(module.modules())[1:])
        self.set(module, "_lightgen_label", label)
        self.set(module, attr, types.MethodType(dispatch_forward, module))
        self.set(module, "extra_repr", types.MethodType(_patched_extra_repr, module))
        self.patched.append(f"{qualname}: {label}")

    def undo(self) -> None:
        if self.previous_attn_implementation is not None:
            self.model.set_attn_implementation(self.previous_attn_implementation)
        for obj, name, old in reversed(self._edits):
            if old is _MISSING:
                obj.__dict__.pop(name, None)
            else:
                object.__setattr__(obj, name, old)
        self._edits.clear()
        self.patched.clear()
