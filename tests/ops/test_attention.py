import importlib
import random
import types

import pytest
import torch
import torch.nn.functional as F
from conftest import TOLERANCES

from lightgen import ops


def _qkv(batch, q_heads, kv_heads, q_len, max_len, dim, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    make = lambda *shape: torch.randn(*shape, generator=gen).to(dtype)  # noqa: E731
    return (make(batch, q_heads, q_len, dim), make(batch, kv_heads, max_len, dim), make(batch, kv_heads, max_len, dim),
            make(batch, kv_heads, q_len, dim), make(batch, kv_heads, q_len, dim))


CASES = [  # batch, q_heads, kv_heads, q_len, max_len, dim
    (1, 1, 1, 1, 1, 8),
    (1, 8, 8, 1, 64, 64),
    (3, 4, 2, 1, 17, 32),
    (2, 4, 1, 5, 23, 16),
    (4, 6, 3, 7, 40, 24),
    # head sizes over and between the kernel's register blocks of values, long enough to split over threads
    (1, 4, 2, 1, 300, 80),
    (2, 6, 2, 3, 700, 128),
    (1, 2, 1, 2, 90, 200),
]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("causal", [True, False])
def test_cached_step_writes_kv_and_matches_reference(case, causal, dtype):
    batch, q_heads, kv_heads, q_len, max_len, dim = case
    q, k_cache, v_cache, k_new, v_new = _qkv(*case, dtype)
    cache_pos = torch.tensor([(max_len - q_len) * row // max(batch - 1, 1) for row in range(batch)])
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    out = ops.attention(q, k_cache, v_cache, k_new, v_new, cache_pos, None, 0.3, causal)
    expected = ops.attention_ref(q, k_ref, v_ref, k_new, v_new, cache_pos, None, 0.3, causal)
    torch.testing.assert_close(k_cache, k_ref, atol=0, rtol=0)
    torch.testing.assert_close(v_cache, v_ref, atol=0, rtol=0)
    torch.testing.assert_close(out, expected, **TOLERANCES[dtype])
    for row, start in enumerate(cache_pos.tolist()):
        torch.testing.assert_close(k_cache[row, :, start:start + q_len], k_new[row], atol=0, rtol=0)


@pytest.mark.parametrize("mask_kind", ["bool4d", "float4d", "padding2d", "broadcast_query"])
def test_masks_match_sdpa(mask_kind):
    batch, heads, q_len, keys, dim = 3, 4, 6, 6, 16
    q, k, v, _, _ = _qkv(batch, heads, heads, q_len, keys, dim, torch.float32, seed=1)
    keep = torch.rand(batch, 1, q_len, keys, generator=torch.Generator().manual_seed(2)) > 0.3
    keep[..., 0] = True  # every query sees at least one key
    if mask_kind == "bool4d":
        mask, sdpa_mask = keep, keep
    elif mask_kind == "float4d":
        mask = torch.zeros(keep.shape).masked_fill(~keep, torch.finfo(torch.float32).min)
        sdpa_mask = mask
    elif mask_kind == "padding2d":
        mask = keep[:, 0, 0, :]
        sdpa_mask = mask[:, None, None, :]
    else:
        mask = keep[:, :, :1, :]
        sdpa_mask = mask
    out = ops.attention(q, k, v, mask=mask, scale=0.25)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=sdpa_mask, scale=0.25).transpose(1, 2)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("q_len", [1, 9, 64])
def test_prefill_causal_matches_sdpa_with_gqa(q_len):
    q, k, v, _, _ = _qkv(2, 8, 2, q_len, q_len, 32, torch.float32, seed=3)
    out = ops.attention(q, k, v, causal=True)
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).transpose(1, 2)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def _causal_visibility(q_len: int, key_len: int, window: int, padded: bool):
    """([Tq, Tk] the keys each of the last q_len queries sees, causal and in its window; [3, Tk] three rows'
    padding masks, two of them left-padded when ``padded``)."""
    keys = torch.arange(key_len)
    slots = (key_len - q_len + torch.arange(q_len))[:, None]
    visible = (keys <= slots) & ((keys > slots - window) if window else True)
    padding = torch.ones(3, key_len, dtype=torch.bool)
    if padded:
        padding[1, :4], padding[2, :1] = False, False
    return visible, padding


@pytest.mark.parametrize("half", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("q_heads, kv_heads, q_len, key_len, dim, window, padded", [
    (4, 2, 1, 37, 16, 0, False),  # decode steps
    (2, 2, 1, 513, 64, 0, True),  # a second block of 512 keys, of one key
    (2, 1, 1, 1100, 64, 0, True),  # three blocks
    (2, 1, 1, 1100, 64, 600, False),  # a window over two blocks of HF's keys
    (4, 2, 9, 9, 32, 0, True),  # a padded prompt: padding queries see no key
    (2, 2, 40, 700, 24, 5, True),  # a windowed prefill after a long cache
])
def test_half_precision_is_sdpas_bit_for_bit(half, q_heads, kv_heads, q_len, key_len, dim, window, padded):
    """HF's sdpa on the CPU runs PyTorch's flash attention kernel; in fp16 / bf16 the op forms its weights as that
    kernel does, so the outputs are HF's bit for bit, not only close. A sliding-window layer's cache hands sdpa the
    last window - 1 cached keys and the new ones: the op, which holds every key, counts HF's keys from there.
    (The op runs torch's sdpa itself in these dtypes: test_half_precision_is_sdpas_bit_for_bit_on_random_inputs.)"""
    q, k, v, _, _ = _qkv(3, q_heads, kv_heads, q_len, key_len, dim, half, seed=key_len)
    visible, padding = _causal_visibility(q_len, key_len, window, padded)
    out = ops.attention(q, k, v, mask=padding, causal=True, window=window)
    handed = slice(max(0, key_len - q_len - (window - 1)) if window else 0, key_len)
    group = q_heads // kv_heads  # HF repeats K/V heads for sdpa when it passes a mask
    expected = F.scaled_dot_product_attention(
        q, k[:, :, handed].repeat_interleave(group, 1), v[:, :, handed].repeat_interleave(group, 1),
        attn_mask=(visible & padding[:, None, None, :])[..., handed])
    if half is torch.float16 and window > 512:
        torch.testing.assert_close(out, expected.transpose(1, 2), atol=2e-4, rtol=2e-3)
    else:
        assert torch.equal(out, expected.transpose(1, 2))


@pytest.mark.parametrize("half", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("seed", range(8))
def test_half_precision_is_sdpas_bit_for_bit_on_random_inputs(half, seed):
    """Drawn shapes, windows and paddings, every value sdpa's: the op hands torch's sdpa the keys HF's cache would,
    since its flash kernel sums its products in the CPU BLAS's order (a kernel of ours that followed its rounding
    points but not that order differed at up to 1.2e-3 of bf16 and 2.3% of fp16 values)."""
    r = random.Random(seed)
    kv_heads = r.choice([1, 2])
    q_heads, q_len, key_len = kv_heads * r.choice([1, 2, 3]), r.choice([1, 1, 4, 9]), r.randrange(16, 1200)
    window = r.choice([0, 0, r.randrange(2, 700)])
    q, k, v, _, _ = _qkv(3, q_heads, kv_heads, q_len, key_len, r.choice([16, 64, 80]), half, seed=seed)
    visible, padding = _causal_visibility(q_len, key_len, window, padded=r.random() < 0.5)
    out = ops.attention(q, k, v, mask=padding, causal=True, window=window)
    handed = slice(max(0, key_len - q_len - (window - 1)) if window else 0, key_len)
    expected = F.scaled_dot_product_attention(q, k[:, :, handed], v[:, :, handed], enable_gqa=True,
                                              attn_mask=(visible & padding[:, None, None, :])[..., handed])
    assert torch.equal(out, expected.transpose(1, 2))


@pytest.mark.parametrize("half", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_a_masked_grouped_query_step_is_transformers_sdpa_bit_for_bit(half):
    """A one-query step of grouped heads where HF's sdpa gets a mask (a padded batch, a full sliding window, or a
    static cache's unwritten slots): transformers 5.23+ hands sdpa the query's heads as queries of their K/V head
    (pack_gqa), whose blocks round otherwise (5-25% of fp16 calls, fewer bf16 ones, an ulp); the op with
    ``pack_gqa`` as the installed transformers' is its sdpa_attention_forward bit for bit, and without it would
    differ somewhere in these draws."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from lightgen._compat import sdpa_packs_gqa

    r, unpacked_differs = random.Random(0), False
    for seed in range(60):
        kv_heads, group, dim = r.choice([1, 2, 3]), r.choice([2, 3, 4]), r.choice([8, 12, 64, 128])
        key_len, case = r.randrange(2, 300), r.choice(["padded", "window", "static"])
        window = r.choice([r.randrange(2, 40), r.randrange(300, 400)]) if case == "window" else 0
        slots = key_len + r.randrange(1, 40) if case == "static" else 0  # a static cache's
        q, k, v, _, _ = _qkv(2, kv_heads * group, kv_heads, 1, max(key_len, slots), dim, half, seed=seed)
        if slots:
            k[:, :, key_len:], v[:, :, key_len:] = 0, 0  # HF's unwritten static slots
        handed = slice(max(0, key_len - window) if window else 0, slots or key_len)
        keep = torch.zeros(2, max(key_len, slots), dtype=torch.bool)
        keep[:, :key_len] = True
        padded = case == "padded" or r.random() < 0.4
        if padded:
            keep[1, :r.randrange(1, key_len)] = False
        hf_mask = keep[:, None, None, handed] if padded or slots or key_len >= window else None  # as masking_utils
        module = types.SimpleNamespace(num_key_value_groups=group, is_causal=True)
        expected, _ = sdpa_attention_forward(module, q, k[:, :, handed], v[:, :, handed], hf_mask,
                                             scaling=dim ** -0.5)
        mask = keep if padded else None
        # A static cache's step writes its key at key_len - 1 and sees the written slots (the engine's call).
        written = dict(k_new=k[:, :, key_len - 1:key_len].clone(), v_new=v[:, :, key_len - 1:key_len].clone(),
                       cache_pos=torch.full((2,), key_len - 1), static_slots=slots) if slots else {}
        out = ops.attention(q, k, v, mask=mask, causal=True, window=window, pack_gqa=sdpa_packs_gqa(), **written)
        assert torch.equal(out, expected), f"draw {seed}"
        unpacked = ops.attention(q, k, v, mask=mask, causal=True, window=window, **written)
        unpacked_differs |= not torch.equal(unpacked, expected)
    assert unpacked_differs or not sdpa_packs_gqa() or half is torch.bfloat16  # bf16 rarely tells them apart


@pytest.mark.parametrize("half", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_an_additive_mask_reaches_sdpa_as_hfs_position_bias_does(half):
    """An additive mask (T5's relative position bias with its padding's -inf) goes to sdpa as HF passes it, in the
    dtype, with the causal part folded in."""
    q, k, v, _, _ = _qkv(2, 4, 4, 5, 70, 32, half, seed=5)
    bias = torch.randn(2, 4, 5, 70, generator=torch.Generator().manual_seed(6)).to(half)
    bias[1, :, :, :3] = float("-inf")
    visible, _ = _causal_visibility(5, 70, 0, padded=False)
    out = ops.attention(q, k, v, mask=bias, causal=True)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=bias.masked_fill(~visible, float("-inf")))
    assert torch.equal(out, expected.transpose(1, 2))


@pytest.mark.parametrize("half", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("q_len, past, window", [(6, 20, 0), (9, 600, 0), (5, 40, 7)])
def test_a_stepwise_pass_rounds_as_one_token_steps(half, q_len, past, window):
    """A pass verifying drafts stands for HF's one-token steps: each query rounds as sdpa would over the keys HF's
    cache hands its own step (up to itself; a sliding window's last window - 1 and itself), not as one prefill."""
    q, k_cache, v_cache, k_new, v_new = _qkv(2, 4, 2, q_len, past + q_len, 16, half, seed=past)
    cache_pos = torch.full((2,), past)
    out = ops.attention(q, k_cache, v_cache, k_new, v_new, cache_pos, None, 0.25, True, window, stepwise=True)
    for i in range(q_len):
        slot = past + i
        first = max(0, slot - (window - 1)) if window else 0
        keys, values = k_cache[:, :, first:slot + 1], v_cache[:, :, first:slot + 1]
        expected = F.scaled_dot_product_attention(q[:, :, i:i + 1], keys.repeat_interleave(2, 1),
                                                  values.repeat_interleave(2, 1), scale=0.25)
        assert torch.equal(out[:, i:i + 1], expected.transpose(1, 2))


@pytest.mark.parametrize("half", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("q_heads, kv_heads, q_len, key_len, dim, window, softcap, padded", [
    (4, 2, 1, 37, 16, 0, 0.0, False),  # decode steps
    (2, 2, 1, 513, 64, 0, 0.0, True),
    (4, 1, 1, 300, 80, 0, 50.0, True),  # Gemma 2's capped scores
    (2, 2, 1, 90, 24, 16, 0.0, False),  # a sliding window
    (4, 2, 9, 9, 32, 0, 0.0, True),  # a padded prompt
    (2, 2, 40, 700, 24, 5, 30.0, True),  # a windowed, capped prefill after a long cache
])
def test_eager_mode_is_hfs_eager_attention(half, q_heads, kv_heads, q_len, key_len, dim, window, softcap, padded):
    """A model on HF's eager attention forms fp16 / bf16 scores in the dtype (matmul, scaling, softcap and the
    additive mask each rounded) and weighs the values with float32 softmax weights rounded to it: with ``eager``
    the op runs those torch ops itself, so its outputs are the family's own eager function's bit for bit (queries
    that see keys; a query that sees none is the engine's to spread). Before, a kernel rounding at the same points
    but summing the products in its own order differed at 0.37% (bf16) and 0.57% (fp16) of random inputs' values."""
    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

    q, k, v, _, _ = _qkv(3, q_heads, kv_heads, q_len, key_len, dim, half, seed=key_len + q_len)
    visible, padding = _causal_visibility(q_len, key_len, window, padded)
    keep = visible & padding[:, None, None, :]
    out = ops.attention(q, k, v, mask=padding, causal=True, window=window, softcap=softcap, scale=0.3, eager=True)
    module = torch.nn.Module()
    module.num_key_value_groups, module.training = q_heads // kv_heads, False
    additive = torch.zeros(keep.shape, dtype=half).masked_fill(~keep, torch.finfo(half).min)
    expected, _ = eager_attention_forward(module, q, k, v, additive, scaling=0.3, softcap=softcap or None)
    sees = keep.any(-1).squeeze(1)  # [B, Tq]
    reference = ops.attention_ref(q, k, v, None, None, None, padding, 0.3, True, window, softcap, eager=True)
    assert torch.equal(reference[sees], expected[sees])
    assert torch.equal(out[sees], expected[sees])


@pytest.mark.parametrize("family", ["gemma2", "bart"])
@pytest.mark.parametrize("half", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("seed", range(6))
def test_eager_mode_is_hfs_eager_attention_bit_for_bit_on_random_inputs(family, half, seed):
    """Drawn shapes, windows, softcaps and paddings against Gemma 2's eager function (the float32 softmax of Llama's
    and Gemma's families) and BART's (its softmax in the dtype, as GPT-2's and T5's: ``softmax_in_dtype``; one
    K/V head per query head, no softcap), every value of a query that sees keys equal."""
    family_eager = importlib.import_module(f"transformers.models.{family}.modeling_{family}").eager_attention_forward
    r = random.Random(seed)
    in_dtype = family == "bart"
    kv_heads = r.choice([1, 2])
    q_heads = kv_heads * r.choice([1] if in_dtype else [1, 2])
    q_len, key_len = r.choice([1, 1, 9]), r.randrange(16, 800)
    window, softcap = r.choice([0, 0, r.randrange(2, 500)]), r.choice([0.0] if in_dtype else [0.0, 50.0])
    q, k, v, _, _ = _qkv(3, q_heads, kv_heads, q_len, key_len, r.choice([16, 64]), half, seed=seed)
    visible, padding = _causal_visibility(q_len, key_len, window, padded=r.random() < 0.5)
    keep = visible & padding[:, None, None, :]
    out = ops.attention(q, k, v, mask=padding, causal=True, window=window, softcap=softcap, scale=0.3, eager=True,
                        softmax_in_dtype=in_dtype)
    module = torch.nn.Module()
    module.num_key_value_groups, module.training = q_heads // kv_heads, False
    additive = torch.zeros(keep.shape, dtype=half).masked_fill(~keep, torch.finfo(half).min)
    handed = slice(max(0, key_len - q_len - (window - 1)) if window else 0, key_len)  # a sliding layer's cache
    capped = dict(softcap=softcap) if softcap else {}
    expected, weights = family_eager(module, q, k[:, :, handed], v[:, :, handed], additive[..., handed], scaling=0.3,
                                     **capped)
    sees = keep.any(-1).squeeze(1)
    assert torch.equal(out[sees], expected[sees])
    key_len_rows = torch.full((3,), key_len)
    probs = ops.attention_probs(q, k, key_len_rows, padding, 0.3, True, window, softcap, eager=True,
                                softmax_in_dtype=in_dtype)[..., handed].to(half)
    assert torch.equal(probs.transpose(1, 2)[sees], weights.transpose(1, 2)[sees])


@pytest.mark.parametrize("half", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_softmax_in_dtype_is_the_bart_familys_eager_attention(half):
    """BART's eager function (GPT-2's, T5's) takes its softmax in the dtype: ``softmax_in_dtype`` follows it on
    64 queries over 437 keys, where the float32 softmax HF's Llama family takes differs (3-8 fp16 values a draw)."""
    from transformers.models.bart.modeling_bart import eager_attention_forward

    module = torch.nn.Module()
    module.training = False
    float32_softmax_differs = 0
    for seed in range(3):
        q, k, v, _, _ = _qkv(2, 4, 4, 64, 437, 32, half, seed=seed)
        expected, _ = eager_attention_forward(module, q, k, v, None, scaling=0.5)
        out = ops.attention(q, k, v, scale=0.5, eager=True, softmax_in_dtype=True)
        assert torch.equal(out, expected)
        float32_softmax = ops.attention(q, k, v, scale=0.5, eager=True)
        float32_softmax_differs += int((float32_softmax != out).sum())
    assert half == torch.bfloat16 or float32_softmax_differs > 0, "these draws no longer tell the softmaxes apart"


@pytest.mark.parametrize("q_len, key_len", [(1, 37), (1, 300), (9, 9)])
def test_eager_mode_with_upcast_scores_is_gpt2s_upcast_attention(q_len, key_len):
    """GPT-2's ``reorder_and_upcast_attn`` eager attention forms the scores in float32 (baddbmm), weighs the values
    with its float softmax rounded to bf16: ``upcast`` keeps the op's scores in float32 too."""
    from transformers import GPT2Config
    from transformers.models.gpt2.modeling_gpt2 import GPT2Attention

    module = GPT2Attention(GPT2Config(n_embd=64, n_head=4, reorder_and_upcast_attn=True), layer_idx=0).eval()
    q, k, v, _, _ = _qkv(3, 4, 4, q_len, key_len, 16, torch.bfloat16, seed=key_len)
    visible, padding = _causal_visibility(q_len, key_len, 0, True)
    keep = visible & padding[:, None, None, :]
    additive = torch.zeros(keep.shape, dtype=torch.bfloat16).masked_fill(~keep, torch.finfo(torch.bfloat16).min)
    expected, _ = module._upcast_and_reordered_attn(q, k, v, additive)
    out = ops.attention(q, k, v, mask=padding, causal=True, scale=module.scaling, eager=True, upcast=True)
    sees = keep.any(-1).squeeze(1)
    assert torch.equal(out[sees], expected[sees])
    reference = ops.attention_ref(q, k, v, None, None, None, padding, module.scaling, True, eager=True, upcast=True)
    assert torch.equal(reference[sees], expected[sees])


def test_fully_masked_query_gives_zeros():
    q, k, v, _, _ = _qkv(1, 2, 2, 2, 4, 8, torch.float32)
    mask = torch.tensor([[[[False] * 4, [True] * 4]]])
    out = ops.attention(q, k, v, mask=mask)
    assert torch.equal(out[0, 0], torch.zeros(2, 8))
    torch.testing.assert_close(out, ops.attention_ref(q, k, v, None, None, None, mask, 8 ** -0.5, False))


def test_strided_query_from_transpose():
    base = torch.randn(2, 5, 4, 16)  # [B, T, H, D] as projections produce it
    q = base.transpose(1, 2)
    k, v = torch.randn(2, 4, 5, 16), torch.randn(2, 4, 5, 16)
    torch.testing.assert_close(ops.attention(q, k, v, causal=True),
                               F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(cache_pos=torch.tensor([15])), "cache overflow"),
        (dict(cache_pos=torch.tensor([0, 1])), "'cache_pos' must be int64 \\[B\\]"),
        (dict(mask=torch.ones(1, 1, 2, 5, dtype=torch.bool)), "'mask' must cover all 16 cached keys"),
    ],
)
def test_bad_inputs_raise_clear_errors(kwargs, message):
    q, k, v, k_new, v_new = _qkv(1, 2, 2, 2, 16, 8, torch.float32)
    with pytest.raises(RuntimeError, match=message):
        ops.attention(q, k, v, k_new, v_new, **kwargs)


def test_head_mismatch_error():
    q, k, v, _, _ = _qkv(1, 3, 2, 1, 4, 8, torch.float32)
    with pytest.raises(RuntimeError, match="multiple of key/value heads"):
        ops.attention(q, k, v)


def test_opcheck_including_in_place_cache_write():
    q, k, v, k_new, v_new = _qkv(2, 4, 2, 3, 10, 8, torch.float32)
    attention = torch.ops.lightgen.attention.default
    torch.library.opcheck(attention, (q, k, v, k_new, v_new, torch.tensor([0, 4]), None, 0.5, True))
    torch.library.opcheck(attention, (q, k, v, None, None, None, torch.ones(2, 10, dtype=torch.bool), 0.5, False))


def test_unwritten_cache_garbage_never_leaks_into_the_output():
    q, k, v, k_new, v_new = _qkv(2, 2, 2, 1, 8, 4, torch.float32)
    k[:, :, 3:], v[:, :, 3:] = float("nan"), float("inf")  # what an uninitialised pooled buffer may hold
    pos = torch.tensor([2, 1])
    for attention in (ops.attention, ops.attention_ref):
        out = attention(q, k.clone(), v.clone(), k_new, v_new, pos, None, 0.5, True)
        assert torch.isfinite(out).all()


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("window, softcap", [(1, 0.0), (3, 0.0), (5, 0.7), (0, 0.4), (100, 0.0)])
def test_sliding_window_and_softcap_match_reference(case, window, softcap, dtype):
    batch, q_heads, kv_heads, q_len, max_len, dim = case
    q, k_cache, v_cache, k_new, v_new = _qkv(*case, dtype, seed=4)
    cache_pos = torch.tensor([(max_len - q_len) * row // max(batch - 1, 1) for row in range(batch)])
    keep = torch.rand(batch, max_len, generator=torch.Generator().manual_seed(5)) > 0.2
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    out = ops.attention(q, k_cache, v_cache, k_new, v_new, cache_pos, keep, 0.3, True, window, softcap)
    expected = ops.attention_ref(q, k_ref, v_ref, k_new, v_new, cache_pos, keep, 0.3, True, window, softcap)
    torch.testing.assert_close(out, expected, **TOLERANCES[dtype])


def test_sliding_window_is_hf_mask_and_softcap_is_gemma2_eager():
    """HF's sliding mask (masking_utils.sliding_window_overlay: kv > q - window, causal) and Gemma 2's eager
    soft-capping (tanh(s / cap) * cap before the mask), written out as a dense reference."""
    batch, heads, q_len, keys, dim, window, cap = 2, 4, 3, 9, 12, 4, 0.5
    q, k, v, k_new, v_new = _qkv(batch, heads, 2, q_len, keys, dim, torch.float32, seed=6)
    pos = torch.tensor([keys - q_len, 2])
    out = ops.attention(q, k, v, k_new, v_new, pos, None, 0.4, True, window, cap)
    for row, start in enumerate(pos.tolist()):
        length = start + q_len
        keys_row = k[row, :, :length].repeat_interleave(2, dim=0)
        values_row = v[row, :, :length].repeat_interleave(2, dim=0)
        scores = torch.tanh(q[row] @ keys_row.transpose(-1, -2) * 0.4 / cap) * cap  # [H, Tq, L]
        query_pos = torch.arange(start, length)[:, None]
        key_pos = torch.arange(length)[None, :]
        visible = (key_pos <= query_pos) & (key_pos > query_pos - window)
        expected = scores.masked_fill(~visible, float("-inf")).softmax(-1) @ values_row
        torch.testing.assert_close(out[row], expected.transpose(0, 1), atol=1e-5, rtol=1e-5)


def test_negative_window_or_softcap_is_a_clear_error():
    q, k, v, _, _ = _qkv(1, 2, 2, 1, 4, 8, torch.float32)
    for attention in (ops.attention, ops.attention_ref):
        with pytest.raises(RuntimeError, match="'window' and 'softcap' must be >= 0"):
            attention(q, k, v, None, None, None, None, 0.5, False, -1, 0.0)


def test_opcheck_with_window_and_softcap():
    q, k, v, k_new, v_new = _qkv(2, 4, 2, 3, 10, 8, torch.float32)
    torch.library.opcheck(torch.ops.lightgen.attention.default,
                          (q, k, v, k_new, v_new, torch.tensor([0, 4]), None, 0.5, True, 2, 0.3))


def test_eager_weights_are_nan_where_a_hidden_keys_score_is_nan_as_eagers_additive_mask_leaves_them():
    """HF's eager attention adds its mask to every score, so a padding position's NaN key makes the weights of
    every query of its row NaN; keys past a row's length (not in HF's cache) do not."""
    q, k, _, _, _ = _qkv(2, 4, 2, 3, 10, 8, torch.float16, seed=1)
    k[0, :, 0] = float("nan")  # row 0: a hidden padding key
    k[1, :, 9] = float("nan")  # row 1: past its length
    key_len = torch.tensor([8, 8])
    keep = torch.ones(2, 10, dtype=torch.bool)
    keep[0, 0] = False
    probs = ops.attention_probs(q, k, key_len, keep, 8 ** -0.5, True, eager=True)
    assert bool(probs[0].isnan().all()) and not bool(probs[1].isnan().any())
    plain = ops.attention_probs(q, k, key_len, keep, 8 ** -0.5, True)  # not eager's: hidden keys weigh nothing
    assert not bool(plain.isnan().any())
