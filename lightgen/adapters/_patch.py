"""Reversible in-place edits of a model instance."""

from __future__ import annotations

import functools
from typing import Any, Callable

from torch import nn

_MISSING = object()


class Patcher:
    """Records every attribute it sets so that ``undo`` restores the instance exactly."""

    def __init__(self) -> None:
        self._edits: list[tuple[Any, str, Any]] = []
        self._undo_hooks: list[Callable[[], None]] = []
        self.patched: list[str] = []  # human-readable summary, one line per patched module

    def set(self, obj: Any, name: str, value: Any) -> None:
        self._edits.append((obj, name, obj.__dict__.get(name, _MISSING)))
        # object.__setattr__ keeps nn.Module from registering values as submodules or parameters.
        object.__setattr__(obj, name, value)

    def replace_forward(self, module: nn.Module, make_forward: Callable[[Callable], Callable], label: str,
                        qualname: str) -> None:
        """Swap ``module``'s forward; ``make_forward(original)`` builds the new one.

        Under accelerate hooks (``cpu_offload``, ``dispatch_model``) the hook wraps ``_old_forward``,
        so that is what we replace, leaving the hook in charge of device placement.
        """
        attr = "_old_forward" if hasattr(module, "_hf_hook") and hasattr(module, "_old_forward") else "forward"
        original = getattr(module, attr)
        forward = functools.update_wrapper(make_forward(original), original)
        self.set(module, attr, forward)
        original_repr = module.extra_repr
        self.set(module, "extra_repr", lambda: ", ".join(filter(None, [original_repr(), f"lightgen: {label}"])))
        self.patched.append(f"{qualname}: {label}")

    def on_undo(self, hook: Callable[[], None]) -> None:
        self._undo_hooks.append(hook)

    def undo(self) -> None:
        for hook in reversed(self._undo_hooks):
            hook()
        self._undo_hooks.clear()
        for obj, name, old in reversed(self._edits):
            if old is _MISSING:
                obj.__dict__.pop(name, None)
            else:
                object.__setattr__(obj, name, old)
        self._edits.clear()
        self.patched.clear()
