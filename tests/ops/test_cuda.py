"""Every CUDA kernel against its pure-PyTorch reference on the same GPU tensors, over dtypes and odd
shapes, plus opcheck and the error paths. Skipped without a GPU (conftest)."""

import os
import warnings

import pytest
import torch
import torch.nn.functional as F
from conftest import TOLERANCES, linear_operand

from lightgen import _build, ops
from lightgen.ops.linear import quantize_grouped

pytestmark = pytest.mark.cuda

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DTYPE_IDS = ["fp32", "fp16", "bf16"]
CUDA = "cuda"


DISABLED = os.environ.get("LIGHTGEN_DISABLE_EXT") == "1"  # references only, on purpose (test_build.py)


@pytest.fixture(autouse=True)
def no_reference_fallback():
    """A CUDA op that silently ran its reference would compare the reference with itself."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
    fallbacks = [str(w.message) for w in caught if "no compiled kernel" in str(w.message)]
    assert DISABLED or not fallbacks, fallbacks


def _randn(*shape, dtype=torch.float32, gen, scale=1.0, shift=0.0):
    return (torch.randn(*shape, generator=gen) * scale + shift).to(device=CUDA, dtype=dtype)


@pytest.mark.skipif(DISABLED, reason="LIGHTGEN_DISABLE_EXT=1")
def test_cuda_kernels_are_built_for_this_gpu():
    status = _build.load().cuda
    assert status is not None and status.compiled, status
    assert status.isa == _build.cuda_target(_build.visible_cuda_archs())


NORM_SHAPES = [(1, 1, 8), (1, 1, 512), (3, 7, 33), (2, 5, 1000), (64, 768), (4, 1, 1), (2, 4097)]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", NORM_SHAPES)
def test_norms(shape, dtype):
    gen = torch.Generator().manual_seed(shape[-1])
    x, residual = _randn(*shape, dtype=dtype, gen=gen, scale=3, shift=1), _randn(*shape, dtype=dtype, gen=gen)
    weight, bias = _randn(shape[-1], dtype=dtype, gen=gen), _randn(shape[-1], dtype=dtype, gen=gen)
    tol = TOLERANCES[dtype]
    for b in (bias, None):
        torch.testing.assert_close(ops.layer_norm(x, weight, b, 1e-5), ops.layer_norm_ref(x, weight, b, 1e-5), **tol)
    torch.testing.assert_close(ops.rms_norm(x, weight, 1e-6), ops.rms_norm_ref(x, weight, 1e-6), **tol)
    for fused, reference, args in [(ops.add_layer_norm, ops.add_layer_norm_ref, (weight, bias, 1e-5)),
                                   (ops.add_rms_norm, ops.add_rms_norm_ref, (weight, 1e-6))]:
        total, normed = fused(x, residual, *args)
        ref_total, ref_normed = reference(x, residual, *args)
        torch.testing.assert_close(total, ref_total, atol=0, rtol=0)
        torch.testing.assert_close(normed, ref_normed, **tol)


def test_norm_of_strided_input():
    x = torch.randn(6, 40, device=CUDA)[:, ::2]
    weight, bias = torch.randn(20, device=CUDA), torch.randn(20, device=CUDA)
    torch.testing.assert_close(ops.layer_norm(x, weight, bias, 1e-5), ops.layer_norm_ref(x, weight, bias, 1e-5))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("act", list(ops.ACTIVATIONS))
@pytest.mark.parametrize("shape", [(1, 1), (3, 5, 7), (2, 3072), (1000, 33)])
def test_activations(shape, act, dtype):
    gen = torch.Generator().manual_seed(len(shape))
    x, up = _randn(*shape, dtype=dtype, gen=gen, scale=3), _randn(*shape, dtype=dtype, gen=gen)
    bias = _randn(shape[-1], dtype=dtype, gen=gen)
    for b in (bias, None):
        torch.testing.assert_close(ops.bias_act(x, b, act), ops.bias_act_ref(x, b, act), **TOLERANCES[dtype])
    torch.testing.assert_close(ops.gated_act(x, up, act), ops.gated_act_ref(x, up, act), **TOLERANCES[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("ids_shape, dim", [((1, 1), 8), ((3, 7), 33), ((2, 5), 1024), ((17,), 1)])
def test_embedding(ids_shape, dim, dtype):
    gen = torch.Generator().manual_seed(dim)
    weight, pos_weight = _randn(50, dim, dtype=dtype, gen=gen), _randn(40, dim, dtype=dtype, gen=gen)
    ids = torch.randint(0, 50, ids_shape, generator=gen).to(CUDA)
    positions = torch.randint(0, 40, ids_shape, generator=gen).to(CUDA)
    for scale in (1.0, dim ** 0.5):
        torch.testing.assert_close(ops.embedding(ids, weight, scale, pos_weight, positions),
                                   ops.embedding_ref(ids, weight, scale, pos_weight, positions), atol=0, rtol=0)
        torch.testing.assert_close(ops.embedding(ids, weight, scale), ops.embedding_ref(ids, weight, scale, None, None),
                                   atol=0, rtol=0)


def _qkv(batch, q_heads, kv_heads, q_len, max_len, dim, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (_randn(batch, q_heads, q_len, dim, dtype=dtype, gen=gen),
            _randn(batch, kv_heads, max_len, dim, dtype=dtype, gen=gen),
            _randn(batch, kv_heads, max_len, dim, dtype=dtype, gen=gen),
            _randn(batch, kv_heads, q_len, dim, dtype=dtype, gen=gen),
            _randn(batch, kv_heads, q_len, dim, dtype=dtype, gen=gen))


ATTENTION_CASES = [  # batch, q_heads, kv_heads, q_len, max_len, dim: every head_dim bucket of the kernel
    (1, 1, 1, 1, 1, 8),
    (1, 8, 8, 1, 64, 64),
    (3, 4, 2, 1, 17, 32),
    (2, 4, 1, 5, 23, 16),
    (4, 6, 3, 7, 40, 24),
    (2, 4, 4, 1, 300, 80),
    (2, 2, 1, 3, 129, 128),
    (1, 2, 2, 1, 2000, 256),
    (1, 2, 2, 2, 33, 512),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("case", ATTENTION_CASES)
def test_cached_attention_writes_kv_in_place(case, causal, dtype):
    batch, q_heads, kv_heads, q_len, max_len, dim = case
    q, k_cache, v_cache, k_new, v_new = _qkv(*case, dtype)
    cache_pos = torch.tensor([(max_len - q_len) * row // max(batch - 1, 1) for row in range(batch)], device=CUDA)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    out = ops.attention(q, k_cache, v_cache, k_new, v_new, cache_pos, None, 0.3, causal)
    expected = ops.attention_ref(q, k_ref, v_ref, k_new, v_new, cache_pos, None, 0.3, causal)
    torch.testing.assert_close(k_cache, k_ref, atol=0, rtol=0)
    torch.testing.assert_close(v_cache, v_ref, atol=0, rtol=0)
    torch.testing.assert_close(out, expected, **TOLERANCES[dtype])
    # Host positions (checked on the host) give the same.
    out_host_pos = ops.attention(q, k_ref.clone(), v_ref.clone(), k_new, v_new, cache_pos.cpu(), None, 0.3, causal)
    torch.testing.assert_close(out_host_pos, out, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("mask_kind", ["bool4d", "float4d", "padding2d", "broadcast_query"])
def test_attention_masks(mask_kind, dtype):
    batch, heads, q_len, keys, dim = 3, 4, 6, 6, 16
    q, k, v, _, _ = _qkv(batch, heads, heads, q_len, keys, dim, dtype, seed=1)
    keep = torch.rand(batch, 1, q_len, keys, generator=torch.Generator().manual_seed(2)) > 0.3
    keep[..., 0] = True
    keep = keep.to(CUDA)
    mask = {"bool4d": keep, "float4d": torch.zeros(keep.shape, device=CUDA).masked_fill(~keep, -1e9),
            "padding2d": keep[:, 0, 0, :], "broadcast_query": keep[:, :, :1, :]}[mask_kind]
    expected = ops.attention_ref(q, k, v, None, None, None, mask, 0.25, False)
    torch.testing.assert_close(ops.attention(q, k, v, mask=mask, scale=0.25), expected, **TOLERANCES[dtype])


@pytest.mark.parametrize("q_len", [1, 9, 64])
def test_prefill_causal_matches_sdpa_with_gqa(q_len):
    q, k, v, _, _ = _qkv(2, 8, 2, q_len, q_len, 32, torch.float32, seed=3)
    out = ops.attention(q, k, v, causal=True)
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).transpose(1, 2)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_fully_masked_query_gives_zeros_and_unwritten_garbage_never_leaks():
    q, k, v, k_new, v_new = _qkv(2, 2, 2, 1, 8, 4, torch.float32)
    mask = torch.tensor([[False] * 8, [True] * 8], device=CUDA)
    assert torch.equal(ops.attention(q, k, v, mask=mask)[0], torch.zeros(1, 2, 4, device=CUDA))
    k[:, :, 3:], v[:, :, 3:] = float("nan"), float("inf")
    out = ops.attention(q, k, v, k_new, v_new, torch.tensor([2, 1], device=CUDA), None, 0.5, True)
    assert torch.isfinite(out).all()


def test_attention_errors_on_host_positions():
    q, k, v, k_new, v_new = _qkv(1, 2, 2, 2, 16, 8, torch.float32)
    with pytest.raises(RuntimeError, match="cache overflow"):
        ops.attention(q, k, v, k_new, v_new, torch.tensor([15]))
    with pytest.raises(RuntimeError, match="multiple of key/value heads"):
        ops.attention(q[:, :1].expand(1, 3, 2, 8), k, v)


BEAM_SHAPES = [(1, 1, 1), (2, 4, 1), (3, 3, 2), (4, 5, 16), (5, 8, 33), (2, 2, 1000), (1, 4, 32000), (3, 8, 32000)]


def _beam_inputs(batch, beams, vocab, kind, gen):
    rows = batch * beams
    if kind == "ties":
        scores = torch.randint(-3, 4, (rows, vocab), generator=gen).float()
    else:
        scores = torch.randn(rows, vocab, generator=gen) * 4
        if kind == "masked":
            scores[torch.rand(rows, vocab, generator=gen) < 0.3] = float("-inf")
            scores[::3] = float("-inf")
    beam_scores = -torch.rand(rows, generator=gen) * 20
    beam_scores[1::4] = -1e9
    beam_scores[2::5] = float("-inf")
    return scores.to(CUDA), beam_scores.to(CUDA)


@pytest.mark.parametrize("kind", ["lm", "ties", "masked"])
@pytest.mark.parametrize("log_softmax", [True, False], ids=["log_softmax", "raw"])
@pytest.mark.parametrize("shape", BEAM_SHAPES, ids=lambda s: "B{}x{}xV{}".format(*s))
def test_beam_topk(shape, log_softmax, kind):
    """Both paths: the shared-memory queue, and the full sort when survivors overflow it (masked rows
    and k = beams * V)."""
    batch, beams, vocab = shape
    scores, beam_scores = _beam_inputs(batch, beams, vocab, kind, torch.Generator().manual_seed(vocab + beams))
    for k in sorted({k for k in (1, beams, 2 * beams, beams * vocab) if k <= beams * vocab}):
        for beam in (beam_scores, None):
            values, indices, survivors = ops.beam_topk(scores, beam, beams, k, log_softmax)
            ref_values, ref_indices, ref_survivors = ops.beam_topk_ref(scores, beam, beams, k, log_softmax)
            # The log-sum-exp is summed in another order than ATen's log_softmax: rounding only.
            tolerance = dict(atol=1e-5, rtol=1e-6) if log_softmax else dict(atol=0, rtol=0)
            torch.testing.assert_close(values, ref_values, **tolerance)
            torch.testing.assert_close(indices, ref_indices, atol=0, rtol=0)
            torch.testing.assert_close(survivors, ref_survivors, atol=0, rtol=0)


def test_beam_topk_nan_is_an_error():
    scores = torch.zeros(4, 10, device=CUDA)
    scores[2, 3] = float("nan")
    with pytest.raises(RuntimeError, match="row 2 contains NaN"):
        ops.beam_topk(scores, None, 2, 2, True)
    with pytest.raises(RuntimeError, match="'beam_scores' row 1"):
        ops.beam_topk(torch.zeros(4, 10, device=CUDA), torch.tensor([0, float("inf"), 0, 0], device=CUDA), 2, 2, True)


LINEAR_VARIANTS = [("fp32", "rows"), ("fp32", "k_major"), ("fp32", "packed"), ("bf16", "rows"), ("bf16", "packed"),
                   ("int8", "rows"), ("int8", "packed")]


def _linear_weights(out_features, in_features, variant, gen):
    weight, scale = linear_operand(torch.randn(out_features, in_features, generator=gen) / in_features ** 0.5, *variant)
    return weight.to(CUDA), None if scale is None else scale.to(CUDA)


@pytest.mark.parametrize("variant", LINEAR_VARIANTS, ids=["-".join(v) for v in LINEAR_VARIANTS])
@pytest.mark.parametrize("shape", [(1, 1), (7, 15), (64, 64), (130, 33), (40, 512), (1000, 257)])
@pytest.mark.parametrize("rows", [1, 3, 5, 17, 64])
def test_linear(variant, shape, rows):
    gen = torch.Generator().manual_seed(rows * 100 + shape[0])
    weight, scale = _linear_weights(*shape, variant, gen)
    x = torch.randn(rows, shape[1], generator=gen).to(CUDA)
    bias = torch.randn(shape[0], generator=gen).to(CUDA)
    for act, b in (("none", bias), ("none", None), ("gelu", bias), ("silu", None)):
        torch.testing.assert_close(ops.linear(x, weight, scale, b, act, shape[0]),
                                   ops.linear_ref(x, weight, scale, b, act, shape[0]), atol=1e-5, rtol=1e-5)


def test_linear_leading_dims_and_strided_input():
    gen = torch.Generator().manual_seed(0)
    weight, _ = _linear_weights(72, 32, ("fp32", "packed"), gen)
    x = torch.randn(2, 3, 64, generator=gen).to(CUDA)[..., ::2]
    out = ops.linear(x, weight, None, None, "relu", 72)
    assert out.shape == (2, 3, 72)
    torch.testing.assert_close(out, ops.linear_ref(x, weight, None, None, "relu", 72), atol=1e-5, rtol=1e-5)


def _opcheck_cases():
    gen = torch.Generator().manual_seed(0)
    x, residual = _randn(3, 5, 16, gen=gen), _randn(3, 5, 16, gen=gen)
    weight, bias = _randn(16, gen=gen), _randn(16, gen=gen)
    q, k, v, k_new, v_new = _qkv(2, 4, 2, 3, 10, 8, torch.float32)
    packed, _ = _linear_weights(40, 16, ("fp32", "packed"), gen)
    int4 = [t.to(CUDA) for t in quantize_grouped(torch.randn(40, 16, generator=gen), 4, 8, zero_points=True)]
    return {
        "layer_norm": (x, weight, bias, 1e-5),
        "add_layer_norm": (x, residual, weight, bias, 1e-5),
        "rms_norm": (x, weight, 1e-6),
        "add_rms_norm": (x, residual, weight, 1e-6),
        "bias_act": (x, bias, "gelu"),
        "gated_act": (x, residual, "silu"),
        "attention": (q, k, v, k_new, v_new, torch.tensor([0, 4], device=CUDA), None, 0.5, True),
        "embedding": (torch.tensor([[1, 2]], device=CUDA), x[0], 2.0, x[1], torch.tensor([[0, 3]], device=CUDA)),
        "linear": (x, packed, None, None, "none", 40),
        "linear_grouped": (x, *int4, None, "none", 40, 8),
        "beam_topk": (_randn(6, 50, gen=gen), _randn(6, gen=gen), 3, 4, True),
    }


@pytest.mark.parametrize("name", sorted(set(_build.schemas()) - _build.CPU_ONLY))
def test_opcheck(name):
    torch.library.opcheck(getattr(torch.ops.lightgen, name).default, _opcheck_cases()[name])
