"""One transformer block for every family, described by a tiny spec.

Adapters map a family's existing submodules (same Parameter objects) onto ``BlockSpec`` and call
``run_block`` with the attention sublayers bound to that family's calling convention. The block
then fuses each residual add with the following norm and the FFN bias with its activation.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from lightgen import ops
from lightgen.modules.linear import apply_linear, kernel_weights
from lightgen.modules.norm import apply_add_norm, apply_norm

# HF activation names (config strings) -> lightgen activation; others keep the HF FFN path.
HF_ACTIVATIONS = {
    "gelu": "gelu",
    "relu": "relu",
    "silu": "silu",
    "swish": "silu",
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
}


@dataclasses.dataclass(frozen=True)
class BlockSpec:
    pre_norm: bool
    act: str | None  # lightgen activation, or None to call the HF activation module
    ffn_in: tuple[str, ...]  # ("fc1",) or ("gate_proj", "up_proj") when gated
    ffn_out: str
    act_module: str  # attribute name of the HF activation, used when act is None
    clamp_fp16: bool = False  # BART-style encoders clamp inf in fp16
    # One projection whose output halves are gate | up (Phi-3's gate_up_proj), named alone in ffn_in.
    fused_gate_up: bool = False
    # GPT-NeoX: every sublayer reads the block input through its own norm; out = (ffn + attn) + input.
    parallel_residual: bool = False

    @property
    def gated(self) -> bool:
        return len(self.ffn_in) == 2 or self.fused_gate_up


def activation_for(hf_name) -> str | None:
    return HF_ACTIVATIONS.get(hf_name) if isinstance(hf_name, str) else None


def _matmul_no_bias(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The projection without its bias, for nn.Linear and HF's Conv1D (weight stored [in, out])."""
    if isinstance(layer, nn.Linear):
        return F.linear(x, layer.weight)
    return torch.matmul(x, layer.weight)


# Exact GELU: ATen's addmm + gelu beats our bias_act from 32 rows up (0.83-0.97x at 32-512 rows of 2048,
# benchmarks/op_kernels.py), so prefill-sized inputs keep the HF path; decode rows (1-8) gain 1.9-2.8x.
_GELU_KERNEL_MAX_ROWS = 16


def _use_hf_activation(spec: BlockSpec, x: torch.Tensor) -> bool:
    if spec.act is None:
        return True
    if x.dtype != torch.float32:
        # fp16 / bf16 round at every op of HF's composite: its linear adds the bias inside the matmul (one
        # rounding, bias_act's input is rounded without it) and some activations are composites themselves
        # (gelu_new). SiLU and ReLU are one rounding in HF as in gated_act, which rounds before the product.
        return not (spec.gated and spec.act in ("silu", "relu"))
    return not spec.gated and spec.act == "gelu" and x.numel() // x.shape[-1] > _GELU_KERNEL_MAX_ROWS


def feed_forward(ffn_owner: nn.Module, spec: BlockSpec, x: torch.Tensor) -> torch.Tensor:
    if spec.gated:
        if spec.fused_gate_up:
            gate_x, up_x = apply_linear(getattr(ffn_owner, spec.ffn_in[0]), x).chunk(2, dim=-1)
        else:
            gate_x, up_x = (apply_linear(getattr(ffn_owner, name), x) for name in spec.ffn_in)
        if _use_hf_activation(spec, x):
            hidden = getattr(ffn_owner, spec.act_module)(gate_x) * up_x
        else:
            hidden = ops.gated_act(gate_x, up_x, spec.act)
    else:
        fc_in = getattr(ffn_owner, spec.ffn_in[0])
        weights = kernel_weights(fc_in, x) if spec.act is not None else None
        if weights is not None:
            hidden = weights.run(x, fc_in.bias, spec.act)
        elif _use_hf_activation(spec, x):
            hidden = getattr(ffn_owner, spec.act_module)(apply_linear(fc_in, x))
        else:
            hidden = ops.bias_act(_matmul_no_bias(fc_in, x), fc_in.bias, spec.act)
    return apply_linear(getattr(ffn_owner, spec.ffn_out), hidden)


Sublayer = Callable[[torch.Tensor], torch.Tensor]


def run_block(spec: BlockSpec, hidden: torch.Tensor, sublayers: Sequence[tuple[Sublayer, nn.Module]]) -> torch.Tensor:
    """Run ``sublayers`` ((call, its norm) pairs, FFN last) with residuals: pre-norm, post-norm or parallel."""
    if spec.parallel_residual:
        outs = [call(apply_norm(norm, hidden)) for call, norm in sublayers]
        total = outs[-1]
        for out in reversed(outs[:-1]):
            total = total + out
        hidden = total + hidden
    elif spec.pre_norm:
        residual = hidden
        normed = apply_norm(sublayers[0][1], hidden)
        for index, (call, _) in enumerate(sublayers):
            out = call(normed)
            if index + 1 == len(sublayers):
                hidden = out + residual
            else:
                residual, normed = apply_add_norm(sublayers[index + 1][1], out, residual)
    else:
        for call, norm in sublayers:
            _, hidden = apply_add_norm(norm, call(hidden), hidden)
    if spec.clamp_fp16 and hidden.dtype == torch.float16 and not torch.isfinite(hidden).all():
        clamp_value = torch.finfo(hidden.dtype).max - 1000
        hidden = torch.clamp(hidden, min=-clamp_value, max=clamp_value)
    return hidden
