"""Attention over a preallocated KV cache, for a decode step or a prefill block.

Shapes: ``q`` [B, Hq, Tq, D]; ``k_cache``/``v_cache`` [B, Hkv, Tmax, D] with Hq a multiple of Hkv
(grouped-query heads); optional ``k_new``/``v_new`` [B, Hkv, Tq, D] are written in place at
``cache_pos[b] + t`` (``cache_pos`` int64 [B], default 0) and row b then attends to keys
``[0, cache_pos[b] + Tq)``; without them every row attends to all Tmax keys. ``mask`` is bool
(True = attend) or additive, [B, Tmax] or broadcastable to [B, Hq, Tq, Tmax]. ``causal`` lets query
t see keys up to ``len - Tq + t`` (bottom-right aligned). ``window`` > 0 (HF's ``sliding_window``) hides
keys at or before ``len - Tq + t - window`` from query t, so it sees at most ``window`` keys ending at
its own position; ``softcap`` > 0 maps scores to ``tanh(s / softcap) * softcap`` before the mask is
added (Gemma 2). A query with no visible key returns zeros. In fp16 / bf16 the CPU kernel rounds as the
kernel HF's sdpa runs there (PyTorch's CPU flash attention): as one prefill, or with ``stepwise`` (causal)
each query as HF's one-token step for it would (a verification pass of drafts); with ``eager`` as HF's eager
attention (scores, their scaling, softcap and mask each rounded to the dtype, the softmax in float32 rounded before
it weighs the values, or with ``softmax_in_dtype`` the softmax in the dtype, as the BART family's, GPT-2's and T5's
eager functions take it; ``upcast`` keeps the scores in float32, as GPT-2's ``reorder_and_upcast_attn``); with
``pack_gqa`` a single query's grouped heads go to sdpa as queries of their K/V head where HF's sdpa gets a mask (a
``mask`` is given, the window is full, or static slots are unwritten), as transformers 5.23+ hands them;
``static_slots`` > 0: the slots of HF's static cache layer, every one of which (the unwritten ones zeros, masked)
its attention gets. float32 ignores them.
Returns [B, Tq, Hq, D], the layout the output projection reads.
"""

from __future__ import annotations

import torch

from lightgen import _build


def attention(q, k_cache, v_cache, k_new=None, v_new=None, cache_pos=None, mask=None, scale=None, causal=False,
              window: int = 0, softcap: float = 0.0, stepwise: bool = False, eager: bool = False,
              upcast: bool = False, softmax_in_dtype: bool = False, pack_gqa: bool = False, static_slots: int = 0):
    if scale is None:
        scale = q.shape[-1] ** -0.5
    return _build.op("attention")(q, k_cache, v_cache, k_new, v_new, cache_pos, mask, scale, causal, window, softcap,
                                  stepwise, eager, upcast, softmax_in_dtype, pack_gqa, static_slots)


def attention_ref(q, k_cache, v_cache, k_new, v_new, cache_pos, mask, scale, causal, window=0, softcap=0.0,
                  stepwise=False, eager=False, upcast=False, softmax_in_dtype=False, pack_gqa=False,
                  static_slots=0):
    if window < 0 or softcap < 0:
        raise RuntimeError(f"lightgen.attention: 'window' and 'softcap' must be >= 0 (0: none), got {window}, {softcap}")
    batch, q_heads, q_len, _ = q.shape
    kv_heads, max_len = k_cache.shape[1], k_cache.shape[2]
    if k_new is not None:
        pos = cache_pos.tolist() if cache_pos is not None else [0] * batch
        for b, start in enumerate(pos):
            if start < 0 or start + q_len > max_len:
                raise RuntimeError(f"lightgen.attention: row {b} writes past the cache of {max_len} (cache overflow)")
            k_cache[b, :, start : start + q_len] = k_new[b]
            v_cache[b, :, start : start + q_len] = v_new[b]
        key_len = torch.tensor(pos, device=q.device) + q_len
    else:
        key_len = torch.full((batch,), max_len, device=q.device)

    group = q_heads // kv_heads
    in_cache = torch.arange(max_len, device=q.device).view(1, -1) < key_len.view(-1, 1)  # [B, Tmax]
    # Zero unwritten values: 0-probability x uninitialised memory (inf/NaN) would poison the sum.
    dtype = q.dtype if eager else torch.float32
    values = v_cache.to(dtype).repeat_interleave(group, dim=1).masked_fill(~in_cache[:, None, :, None], 0.0)
    probs = attention_probs(q, k_cache, key_len, mask, scale, causal, window, softcap, eager, upcast,
                            softmax_in_dtype)
    out = torch.matmul(probs.to(dtype), values)  # [B, Hq, Tq, D]
    return out.transpose(1, 2).contiguous().to(q.dtype)


def repeat_kv(states: torch.Tensor, group: int) -> torch.Tensor:
    """K/V heads [B, H, S, D] repeated for ``group`` query heads each as HF's repeat_kv does: expanded and reshaped,
    a view where it can be (one K/V head), which torch's matmul runs otherwise than a copy (fp16 values an ulp
    apart)."""
    if group == 1:
        return states
    batch, heads, length, dim = states.shape
    return states[:, :, None].expand(batch, heads, group, length, dim).reshape(batch, heads * group, length, dim)


def attention_probs(q, k_cache, key_len, mask, scale, causal, window=0, softcap=0.0, eager=False, upcast=False,
                    softmax_in_dtype=False):
    """The weights ``attention`` gives each key, float32 [B, Hq, Tq, Tmax], for caches written up to ``key_len``
    [B] (int64; the queries are the last Tq of them); the other arguments as ``attention``'s. A query with no
    visible key gets zeros. The reference computes its output from these; the decoder step returns them for
    HF's ``output_attentions`` (the kernels return only the output: computing the weights here, and only on
    the calls that ask, keeps every other call as fast as it was and the weights the reference's, exactly).
    With ``eager`` (and not ``upcast``), fp16 / bf16 scores are formed in their dtype, as HF's eager attention
    forms them, and with ``softmax_in_dtype`` weighed by a softmax in that dtype; a query whose score for any key
    in the cache is NaN gets NaN weights, as eager's additive mask leaves them.
    """
    _, q_heads, q_len, _ = q.shape
    max_len = k_cache.shape[2]
    group = q_heads // k_cache.shape[1]
    key_idx = torch.arange(max_len, device=q.device)
    in_cache = key_idx.view(1, -1) < key_len.view(-1, 1)  # [B, Tmax]: positions past a row's length are unwritten
    dtype = q.dtype if eager and not upcast else torch.float32
    keys = repeat_kv(k_cache.to(dtype), group)
    scores = torch.matmul(q.to(dtype), keys.transpose(-1, -2)) * scale  # [B, Hq, Tq, Tmax]
    if softcap > 0:
        scores = torch.tanh(scores / softcap) * softcap

    visible = in_cache.unsqueeze(1)  # [B, 1, Tmax]
    slot = key_len.view(-1, 1, 1) - q_len + torch.arange(q_len, device=q.device).view(1, -1, 1)  # [B, Tq, 1]
    if causal:
        visible = visible & (key_idx.view(1, 1, -1) <= slot)  # [B, Tq, Tmax]
    if window > 0:
        visible = visible & (key_idx.view(1, 1, -1) > slot - window)
    visible = visible.unsqueeze(1)
    if mask is not None:
        if mask.dim() == 2:
            mask = mask[:, None, None, :]
        if mask.dtype == torch.bool:
            visible = visible & mask
        else:
            scores = scores + mask.to(dtype)
    scores = scores.float()
    # HF's eager attention adds its mask to every key's score: a NaN score, even a hidden key's (a padding position's
    # NaN state), makes the query's weights NaN. Keys past a row's length are not HF's.
    poisoned = (scores.isnan() & in_cache[:, None, None, :]).any(-1, keepdim=True) if eager else None
    scores = scores.masked_fill(~visible, float("-inf"))
    row_max = scores.amax(-1, keepdim=True)
    weights = torch.exp(scores - row_max.clamp_min(torch.finfo(torch.float32).min))
    denom = weights.sum(-1, keepdim=True)
    if eager and softmax_in_dtype and not upcast:
        probs = torch.softmax(scores.to(dtype), -1).float()
    else:
        probs = torch.softmax(scores, -1) if eager else weights / denom  # eager: HF's own (float32) softmax
    probs = torch.where(denom > 0, probs, torch.zeros_like(weights))
    return probs if poisoned is None else probs.masked_fill(poisoned, float("nan"))


def _attention_fake(q, k_cache, v_cache, k_new, v_new, cache_pos, mask, scale, causal, window=0, softcap=0.0,
                    stepwise=False, eager=False, upcast=False, softmax_in_dtype=False, pack_gqa=False,
                    static_slots=0):
    batch, heads, q_len, head_dim = q.shape
    return q.new_empty((batch, q_len, heads, head_dim))


REFERENCES = {"attention": attention_ref}
FAKES = {"attention": _attention_fake}
