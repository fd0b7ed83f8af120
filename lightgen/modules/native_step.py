"""The layers of a decoder step as one native call (``torch.ops.lightgen.decode_layers``, csrc/cpu/decode_step.cpp).

Python's ``Decoder.step`` (decoder.py) stays the specification and runs everything around the layers (embedding,
rotary angles once per step, cache bookkeeping, final norm, LM head). Its layer loop dispatches ~15 ops per layer
from Python, each a few microseconds of interpreter and dispatcher: on a 30-layer model (SmolLM2-135M) a quarter of
a batch-1 step. For blocks of pre-norm, post-norm or parallel residuals (GPT-NeoX) with RMSNorm, LayerNorm or Gemma's
(1 + w) RMSNorm (also on sublayer outputs: Gemma 2/3), separate or fused q/k/v projections (GPT-2's and Phi-3's
[q | k | v], GPT-NeoX's q|k|v per head) with grouped-query self-attention on the static cache, rotate-half rotary on
whole heads, on their first dimensions (Phi-3, GPT-NeoX) or none, one rotary table per layer where layers differ
(Gemma 3), q/k norms, queries scaled or not, soft-capped scores, an additive position-bias mask (T5), optional
cross-attention and a gated (separate or fused gate|up: Phi-3) or plain FFN (Llama, Mistral, Qwen2, Qwen3, Phi-3,
Gemma 1/2/3, GPT-2, GPT-NeoX, OPT, BART, mBART, Marian, M2M-100, Pegasus, T5, mT5) the C++ step runs the same kernels
in the same order on the same inputs, so its output is bit-identical, and the layers' tensors are gathered once per
request (``plan``), not looked up per op. Other shapes (``unsupported`` says why), and steps a kernel would not take
(non-float32, or more rows than the fp32 kernels run: long prompts), keep the Python loop; the result is the same
either way.

Measured (benchmarks/decode_step.py, SmolLM2-135M fp32, 2 threads, AVX-512, a quiet machine; README "Decoder
step"), ms a step at batch 1 / 8: Python step 27.4 / 29.3, native 21.7 / 24.3 (1.26x / 1.21x; the bandwidth floor:
16.4). The Python step's layers under torch.compile (inductor, one graph per layer, 8-11 s to compile) were slower
still, 51.6 / 62.9 against the Python step's 30.4 / 37.8 in an earlier run, and not bit-identical (inductor's cos/sin
of the rotary angles and its fused rotation round otherwise than eager HF). So the native step is kept. The layers'
tensors go over once per request, as one object (a list of SmolLM2's 1860 a call cost ~150 us, machine loaded).
"""

from __future__ import annotations

import dataclasses
import math

import torch

from lightgen import _build
from lightgen.modules.linear import current_weights
from lightgen.modules.norm import norm_kind

# Families whose apply_rotary_pos_emb is HF's rotate-half form, q * cos + rotate_half(q) * sin, as the C++ step
# computes it: on whole heads, or (PARTIAL_ROTATE_HALF) on the first cos.shape[-1] dimensions of each, the rest kept.
_MODULE = "transformers.models.{0}.modeling_{0}"
ROTATE_HALF = {_MODULE.format(family) for family in ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3")}
PARTIAL_ROTATE_HALF = {_MODULE.format(family) for family in ("phi3", "gpt_neox")}
NORM_KINDS = ("rms", "layer", "rms_offset")  # RMSNorm, LayerNorm with its weight (and bias, if any), Gemma's RMSNorm


def unsupported(spec) -> str | None:
    """Why ``spec``'s layers cannot run as one native call, or None when they can."""
    block = spec.block
    if block.act is None:
        return "the native step runs FFNs with a kernel activation, not the model's own activation module"
    first = spec.layers[0]
    kinds, eps, qk_eps = set(), set(), set()
    for layer in spec.layers:
        attn, cross = layer.self_attn, layer.cross_attn
        if (cross is None) != (first.cross_attn is None) or (
                cross is not None and cross.heads != first.cross_attn.heads):
            return "the native step needs cross-attention of one shape in every layer or in none"
        if (attn.q_norm is None) != (attn.k_norm is None):
            return "the native step needs q/k norms in pairs"
        if _attention_shape(attn) != _attention_shape(first.self_attn):
            return "the native step needs the same attention shape in every layer"
        if cross is not None and cross.scaling != first.cross_attn.scaling:
            return "the native step needs the same cross-attention scale in every layer"
        norms = [layer.self_norm, layer.ffn_norm, *([layer.cross_norm] if cross is not None else []),
                 *(norm for norm in (layer.self_out_norm, layer.ffn_out_norm) if norm is not None)]
        kinds |= {norm_kind(norm) for norm in norms}
        if len(kinds) > 1 or not kinds <= set(NORM_KINDS):
            return (f"the native step runs blocks of one norm kind of {', '.join(NORM_KINDS)}, "
                    f"not {sorted(map(str, kinds))}")
        eps |= {_epsilon(norm) for norm in norms}
        if attn.q_norm is not None:  # weights only: the C++ step has no slot for their biases
            if {norm_kind(attn.q_norm), norm_kind(attn.k_norm)} != kinds or kinds == {"layer"}:
                return "the native step runs q/k RMSNorms of the block's norm kind only"
            qk_eps |= {_epsilon(attn.q_norm), _epsilon(attn.k_norm)}
    if len(eps) > 1 or len(qk_eps) > 1:
        return "the native step needs one epsilon for the layers' norms and one for the q/k norms"
    rotate = getattr(spec.apply_rotary, "__module__", None)
    if _rotaries(spec)[0] and rotate not in ROTATE_HALF | PARTIAL_ROTATE_HALF:
        return f"the native step rotates halves as Llama does, not as {rotate}'s apply_rotary_pos_emb"
    status = _build.load()
    return None if status.compiled else f"the C++ kernels are not built ({status.reason})"


def _attention_shape(attn) -> tuple:
    return (attn.heads, attn.kv_heads, attn.head_dim, attn.scaling, attn.scale_queries, attn.softcap,
            attn.k is None, attn.interleaved_qkv)


def _rotaries(spec) -> tuple[tuple, list[int]]:
    """The step's distinct rotary functions (the spec's, or the layers' own: Gemma 3's per layer type) and each
    layer's index among them (-1: none), as Decoder._layers computes one table per rotary function."""
    functions, indices = [], []
    for layer in spec.layers:
        rotary = layer.rotary or spec.rotary
        if rotary is not None and all(rotary is not known for known in functions):
            functions.append(rotary)
        indices.append(-1 if rotary is None else next(i for i, known in enumerate(functions) if known is rotary))
    return tuple(functions), indices


def _epsilon(norm) -> float:
    return norm.variance_epsilon if norm_kind(norm) == "rms" else norm.eps


@dataclasses.dataclass(frozen=True)
class Plan:
    """What the C++ step reads, gathered once per request: per layer its norm weights (and LayerNorm biases) and
    each projection's kernel weights (the packed copies ``apply_linear`` would run), flat as
    csrc/cpu/decode_step.cpp lays them out, handed to it as one object (``layer_weights``)."""
    weights: torch.ScriptObject
    max_rows: float  # the most rows (batch x new tokens) every projection's kernel takes
    heads: int
    kv_heads: int
    head_dim: int
    cross_heads: int
    eps: float
    qk_eps: float
    scale: float
    cross_scale: float
    softcap: float
    act: str
    pre_norm: bool
    norm: str  # one of NORM_KINDS
    gated: bool
    scale_queries: bool
    parallel_residual: bool
    fused_gate_up: bool
    interleaved_qkv: bool
    partial_rotary: bool
    rotaries: tuple  # the rotary functions whose (cos, sin) the layers index, once each per step

    def takes(self, hidden: torch.Tensor) -> bool:
        rows, length, _ = hidden.shape
        return hidden.dtype == torch.float32 and hidden.device.type == "cpu" and rows * length <= self.max_rows


def plan(spec) -> Plan | None:
    """The plan of a spec ``unsupported`` accepts, or None when a projection has no kernel weights (ATen runs it)."""
    tensors, ints, max_rows = [], [], math.inf
    block = spec.block
    rotaries, rotary_index = _rotaries(spec)
    for layer, rotary in zip(spec.layers, rotary_index, strict=True):
        attn = layer.self_attn
        for norm in (layer.self_norm, layer.cross_norm, layer.ffn_norm):
            tensors += [getattr(norm, "weight", None), getattr(norm, "bias", None)]
        tensors += [getattr(attn.q_norm, "weight", None), getattr(attn.k_norm, "weight", None)]
        for norm in (layer.self_out_norm, layer.ffn_out_norm):
            tensors += [getattr(norm, "weight", None), getattr(norm, "bias", None)]
        ints += [attn.window, rotary]
        for module in layer.step_linears(block):
            if module is None:
                tensors += [None] * 6
                ints += [0, 0]
                continue
            weights = current_weights(module)
            if weights is None or weights.weight.device.type != "cpu":
                return None
            max_rows = min(max_rows, weights.max_rows)
            tensors += [weights.weight.t() if weights.conv1d else weights.weight, weights.scale, weights.offset,
                        module.bias, weights.dot, weights.dot_sums]
            ints += [weights.out_features, weights.group_size]
    first = spec.layers[0]
    attn, cross = first.self_attn, first.cross_attn
    qk_eps = next((_epsilon(layer.self_attn.q_norm) for layer in spec.layers if layer.self_attn.q_norm), 0.0)
    return Plan(layer_weights(tensors, ints), max_rows, attn.heads, attn.kv_heads, attn.head_dim,
                getattr(cross, "heads", 0), _epsilon(first.self_norm), qk_eps, attn.scaling,
                getattr(cross, "scaling", 1.0), attn.softcap, block.act, block.pre_norm, norm_kind(first.self_norm),
                block.gated, attn.scale_queries, block.parallel_residual, block.fused_gate_up, attn.interleaved_qkv,
                getattr(spec.apply_rotary, "__module__", None) in PARTIAL_ROTATE_HALF, rotaries)


def layer_weights(tensors: list, ints: list[int]) -> torch.ScriptObject:
    """The layers' tensors (None where a slot is empty) and ints as the C++ step's LayerWeights, which checks their
    counts."""
    return torch.classes.lightgen.LayerWeights(tensors, ints)


def run(plan: Plan, state, hidden: torch.Tensor, tables, mask) -> torch.Tensor:
    """The decoder layers on ``hidden`` [N, T, E], writing the step's K/V into ``state``'s cache; ``tables`` are
    the (cos, sin) of ``plan.rotaries`` (none without rotary), ``mask`` the step's key mask (bool, or additive with a
    relative position bias) or None."""
    cache = state.cache
    cos, sin = [table[0] for table in tables], [table[1] for table in tables]
    # ``_op`` skips the Python scan of every argument for fake script objects that an op taking a ScriptObject does
    # on each call (only export and compile pass those, and neither traces this call): 32 us a step on the demo
    # model, 76 us with SmolLM2's 30 layers of cache tensors.
    return torch.ops.lightgen.decode_layers.default._op(
        hidden, plan.weights, cache.keys, cache.values, cache.rows, state.lengths, mask, cos, sin,
        state.cross_keys, state.cross_values, state.encoder_keep, state.expand, plan.heads, plan.kv_heads,
        plan.head_dim, plan.cross_heads, plan.eps, plan.qk_eps, plan.scale, plan.cross_scale, plan.softcap, plan.act,
        plan.pre_norm, plan.norm, plan.gated, plan.scale_queries, plan.parallel_residual, plan.fused_gate_up,
        plan.interleaved_qkv, plan.partial_rotary)
