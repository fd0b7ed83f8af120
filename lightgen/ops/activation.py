"""Bias + activation and the gated (SwiGLU-style) form."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lightgen import _build

ACTIVATIONS = {
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "silu": F.silu,
    "none": lambda x: x.clone(),
}


def bias_act(x: torch.Tensor, bias: torch.Tensor | None, act: str) -> torch.Tensor:
    """``act(x + bias)`` in one pass; ``act`` is one of ``ACTIVATIONS``."""
    return _build.op("bias_act")(x, bias, act)


def gated_act(gate: torch.Tensor, up: torch.Tensor, act: str) -> torch.Tensor:
    """``act(gate) * up`` (SwiGLU when ``act == "silu"``)."""
    return _build.op("gated_act")(gate, up, act)


def _activation(act: str):
    try:
        return ACTIVATIONS[act]
    except KeyError:
        raise ValueError(f"unknown activation '{act}'; expected one of {', '.join(ACTIVATIONS)}") from None


def bias_act_ref(x, bias, act):
    return _activation(act)(x if bias is None else x + bias)


def gated_act_ref(gate, up, act):
    return _activation(act)(gate) * up


REFERENCES = {"bias_act": bias_act_ref, "gated_act": gated_act_ref}
FAKES = {
    "bias_act": lambda x, bias, act: torch.empty_like(x),
    "gated_act": lambda gate, up, act: torch.empty_like(gate),
}
