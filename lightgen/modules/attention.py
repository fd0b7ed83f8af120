"""lightgen attention behind transformers' official AttentionInterface.

Registered as implementation "lightgen" (with sdpa's boolean masks), so every HF attention module
that dispatches through ALL_ATTENTION_FUNCTIONS runs ``ops.attention`` without being patched.
Prefill (more than one query) goes to PyTorch's SDPA: its blocked matmuls beat our per-query
kernel there (0.4-0.7x measured in benchmarks/op_kernels.py), while decode steps are where the fused
kernel wins (1.2-1.9x over SDPA). Cases the op does not cover (attention weights requested, dropout in
training, position biases) also go to the sdpa/eager functions. Sliding windows need nothing here: HF's
mask holds them (sdpa reads only the mask too). Soft-capped scores (Gemma 2), which sdpa refuses, run
the op (prefill included) or, when gradients are recorded, the family's own eager function.

A model whose own implementation was eager gets "lightgen_eager": the same, except that a query which sees no key
(a padded prompt position) takes eager's result there, not sdpa's zeros (``with_even_keyless``), and that fp16 /
bf16 attention rounds where eager's does: the kernels in their eager mode (the softmax in float32 or in the dtype, as
the family's eager function takes it: ``softmax_in_dtype``), a prefill the family's eager function.
"""

from __future__ import annotations

import functools
import sys
import types
import warnings

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.utils import output_capturing
from transformers.models.bert.modeling_bert import eager_attention_forward

from lightgen import ops
from lightgen._compat import sdpa_packs_gqa

IMPLEMENTATION = "lightgen"
EAGER_IMPLEMENTATION = "lightgen_eager"

_UNSUPPORTED_KWARGS = ("position_bias", "s_aux")


def lightgen_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                               is_causal=None, **kwargs):
    return _forward(module, query, key, value, attention_mask, scaling, dropout, is_causal, False, **kwargs)


def lightgen_eager_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                                     is_causal=None, **kwargs):
    # fp16 / bf16 round where eager does, not where sdpa does: a prefill runs the family's eager function itself, and
    # so does a query without keys (a padding position, e.g. a chunk of HF's chunked prefill): eager adds the dtype's
    # lowest to its scores, which fp16 does not absorb from 16 on (uneven weights; all -inf: NaN), not an even spread.
    if query.dtype != torch.float32 and (query.shape[-2] > 1 or _sees_no_key(attention_mask, key.shape[-2])):
        return _eager(module, query, key, value, attention_mask, is_causal, True, scaling=scaling, dropout=dropout,
                      **kwargs)
    out, weights = _forward(module, query, key, value, attention_mask, scaling, dropout, is_causal, True, **kwargs)
    if weights is not None or attention_mask is None or attention_mask.dtype != torch.bool:
        return out, weights  # eager's own function ran, or no query can be without keys
    keyless = ~attention_mask[..., :key.shape[-2]].any(-1)  # [B, 1 or H, Tq]
    return with_even_keyless(out, lambda: even_spread(value, value.shape[-2]), keyless.transpose(1, 2)), None


def _sees_no_key(attention_mask, keys: int) -> bool:
    return (attention_mask is not None and attention_mask.dtype == torch.bool
            and not bool(attention_mask[..., :keys].any(-1).all()))


def _forward(module, query, key, value, attention_mask, scaling, dropout, is_causal, eager_model: bool, **kwargs):
    """``eager_model``: the model ran HF's eager attention; fp16 / bf16 kernels round as it does."""
    grad = module.training or torch.is_grad_enabled()
    softcap = kwargs.get("softcap")
    if kwargs.get("output_attentions") or (eager_model and _records_attentions()) or (softcap is not None and grad):
        return _eager(module, query, key, value, attention_mask, is_causal, eager_model, scaling=scaling,
                      dropout=dropout, **kwargs)
    eager = eager_model and query.dtype != torch.float32
    rounding = dict(eager=eager, upcast=_upcasts(module), softmax_in_dtype=eager and softmax_in_dtype(module),
                    pack_gqa=sdpa_packs_gqa())
    if softcap is not None:
        if attention_mask is not None:
            return ops.attention(query, key, value, mask=attention_mask[..., :key.shape[-2]], scale=scaling,
                                 softcap=softcap, **rounding), None
        causal = query.shape[-2] > 1 and getattr(module, "is_causal", True)
        return ops.attention(query, key, value, scale=scaling, causal=causal, softcap=softcap, **rounding), None
    # Prefill, and anything that records gradients (our kernels have no autograd), take sdpa.
    prefill = query.shape[-2] > 1
    unsupported = any(kwargs.get(name) is not None for name in _UNSUPPORTED_KWARGS)
    if prefill or grad or unsupported:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, is_causal=is_causal, **kwargs)
    key_len = key.shape[-2]
    if attention_mask is not None:
        attention_mask = attention_mask[..., :key_len]
    # A single query sees every key it is not masked from: no causal window needed.
    return ops.attention(query, key, value, mask=attention_mask, scale=scaling, **rounding), None


def _records_attentions() -> bool:
    """Whether HF's output recorders collect attention weights in this call: transformers 5 hooks the attention
    modules' outputs instead of passing ``output_attentions`` down, and eager's weights are what they record."""
    collected = output_capturing._active_collector.get()
    return collected is not None and any("attentions" in key for key in collected)


def even_spread(values: torch.Tensor, keys: int) -> torch.Tensor:
    """What eager's softmax over equal scores makes of ``values`` [B, Hkv, keys, D] (float [B, Hkv, D]): each weighs
    1 / keys, a weight rounded to the values' dtype as eager rounds its softmax (bf16's 1/9 is 0.1113...)."""
    weight = torch.tensor(1.0 / keys).to(values.dtype).float()
    return (values.float() * weight).sum(-2)


def with_even_keyless(out, mean_value, keyless):
    """Eager attention's output where a query sees no key: its softmax over scores that are all masked (equal)
    is even, so the query takes the mean of the values it was handed, ``mean_value()`` [B, Hkv, D]; sdpa and
    lightgen's kernels give zeros. ``out`` [B, Tq, H, D]; ``keyless`` [B, Tq] or [B, Tq, 1 or H] (bool)."""
    if not keyless.any():
        return out
    mean = mean_value()
    mean = mean.repeat_interleave(out.shape[2] // mean.shape[1], dim=1)  # [B, H, D]
    if keyless.dim() == 2:
        keyless = keyless[..., None]
    return torch.where(keyless[..., None], mean[:, None].to(out.dtype), out)


def implementation_for(hf_implementation: str | None) -> str:
    """lightgen's implementation for a model that ran ``hf_implementation``."""
    return EAGER_IMPLEMENTATION if hf_implementation == "eager" else IMPLEMENTATION


def _upcasts(module) -> bool:
    """GPT-2's ``reorder_and_upcast_attn``: its eager attention forms the scores in float32."""
    return bool(getattr(module, "reorder_and_upcast_attn", False))


def _family_eager(module):
    """The ``eager_attention_forward`` of ``module``'s family (``module``: the model or any of its modules), or None
    (the family has none: BERT's runs)."""
    return getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)


def softmax_in_dtype(module) -> bool:
    """Whether the eager attention of ``module``'s family (``module``: the model or any of its modules) takes its
    softmax in the scores' dtype (the BART family's, GPT-2's, T5's, BERT's) rather than in float32 rounded after
    (Llama's and most decoder-only families'). The two differ at ~5e-5 of fp16 values (widths not a multiple of 16)."""
    return _takes_softmax_in_dtype(_family_eager(module) or eager_attention_forward)


@functools.cache
def _takes_softmax_in_dtype(family_eager) -> bool:
    """Asked of the function itself, once (~20 ms), as no attribute tells: fp16 scores of one-wide heads, 65,536
    queries over 26 keys, where the two softmaxes differ at ~130 weights; which of them its weights are."""
    generator = torch.Generator().manual_seed(0)
    query = (torch.randn(1, 1, 65536, 1, generator=generator) * 4).half()
    key = torch.randn(1, 1, 26, 1, generator=generator).half()
    module = types.SimpleNamespace(training=False, num_key_value_groups=1, head_dim=1)
    try:
        _, weights = family_eager(module, query, key, key, None, scaling=1.0, dropout=0.0)
    except Exception as error:  # a family's function that needs more of its module than this one holds
        warnings.warn(f"lightgen: cannot tell where {family_eager.__module__}'s eager attention rounds its softmax "
                      f"({error!r}); fp16 / bf16 eager attention takes it in float32", stacklevel=2)
        return False
    scores = torch.matmul(query, key.transpose(-1, -2)) * 1.0
    return torch.equal(weights, torch.softmax(scores, -1)) and not torch.equal(
        weights, torch.softmax(scores, -1, dtype=torch.float32).half())


def _eager(module, query, key, value, attention_mask, is_causal, eager_model: bool, **kwargs):
    """Attention weights as the module's family computes them: its own ``eager_attention_forward`` (which
    repeats grouped K/V heads), or BERT's for families without one, with K/V heads repeated here; for a model
    that ran eager with GPT-2's ``reorder_and_upcast_attn``, the upcast attention HF runs then."""
    query_len, key_len = query.shape[-2], key.shape[-2]
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    if attention_mask is None and query_len > 1 and causal:
        # sdpa's mask function leaves causal masks to SDPA's is_causal (decided as sdpa does); eager needs one,
        # aligned as is_causal's: top-left. HF skips the mask only where that is right, a static cache's prefill
        # included (its keys are every slot, the prompt's first): bottom-right, the prompt saw empty slots.
        attention_mask = torch.ones(query_len, key_len, dtype=torch.bool, device=query.device).tril()
    if attention_mask is not None and attention_mask.dtype == torch.bool:  # sdpa's mask (ours): eager adds it
        attention_mask = torch.zeros(attention_mask.shape, dtype=query.dtype, device=query.device).masked_fill_(
            ~attention_mask, torch.finfo(query.dtype).min)
    if eager_model and _upcasts(module):
        return module._upcast_and_reordered_attn(query, key, value, attention_mask)
    family_eager = _family_eager(module)
    if family_eager is not None:
        return family_eager(module, query, key, value, attention_mask, **kwargs)
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key, value = ops.repeat_kv(key, groups), ops.repeat_kv(value, groups)
    return eager_attention_forward(module, query, key, value, attention_mask, **kwargs)


def register() -> None:
    AttentionInterface.register(IMPLEMENTATION, lightgen_attention_forward)
    AttentionInterface.register(EAGER_IMPLEMENTATION, lightgen_eager_attention_forward)
    for name in (IMPLEMENTATION, EAGER_IMPLEMENTATION):
        AttentionMaskInterface.register(name, sdpa_mask)
