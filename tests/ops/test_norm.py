import pytest
import torch
import torch.nn.functional as F
from conftest import TOLERANCES

from lightgen import ops

SHAPES = [(1, 1, 8), (1, 1, 512), (3, 7, 33), (2, 5, 1000), (64, 768), (4, 1, 1)]


def _inputs(shape, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=gen) * 3 + 1).to(dtype)
    residual = torch.randn(shape, generator=gen).to(dtype)
    weight = torch.randn(shape[-1], generator=gen).to(dtype)
    bias = torch.randn(shape[-1], generator=gen).to(dtype)
    return x, residual, weight, bias


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("with_bias", [True, False])
def test_layer_norm_matches_reference(shape, with_bias, dtype):
    x, _, weight, bias = _inputs(shape, dtype)
    bias = bias if with_bias else None
    torch.testing.assert_close(ops.layer_norm(x, weight, bias, 1e-5), ops.layer_norm_ref(x, weight, bias, 1e-5),
                               **TOLERANCES[dtype])


@pytest.mark.parametrize("shape", SHAPES)
def test_add_layer_norm_returns_sum_and_norm(shape, dtype):
    x, residual, weight, bias = _inputs(shape, dtype, seed=1)
    total, normed = ops.add_layer_norm(x, residual, weight, bias, 1e-6)
    ref_total, ref_normed = ops.add_layer_norm_ref(x, residual, weight, bias, 1e-6)
    torch.testing.assert_close(total, ref_total, atol=0, rtol=0)
    torch.testing.assert_close(normed, ref_normed, **TOLERANCES[dtype])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("width", [1, 7, 8, 33, 36, 48, 576, 1000, 1024])
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no-bias"])
def test_layer_norm_is_torchs_bit_for_bit(dtype, width, with_bias):
    """LayerNorm rounds as F.layer_norm (HF's) does at every width and dtype, with or without a bias: ATen's moments
    over 256-bit vectors and its epilogues, or torch's own kernel where no row kernel rounds as it does."""
    x, residual, weight, bias = _inputs((500, width), dtype, seed=width)
    bias = bias if with_bias else None
    _, normed = ops.add_layer_norm(x, residual, weight, bias, 1e-5)
    assert torch.equal(ops.layer_norm(x, weight, bias, 1e-5), F.layer_norm(x, (width,), weight, bias, 1e-5))
    assert torch.equal(normed, F.layer_norm(x + residual, (width,), weight, bias, 1e-5))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("width", [1, 3, 8, 15, 36, 64, 100, 576, 2048, 4100, 40000])
def test_rms_norm_is_hfs_composite_bit_for_bit(dtype, width):
    """RMSNorm's variance adds the squares in the order torch's CPU sum does (four vectors of 8 in turn, a cascade
    every 16 of them, the tail, then the lanes), so rows of every width are HF's composite bit for bit, batched or
    one at a time."""
    rows = max(1, 20_000 // width)
    x, residual, weight, _ = _inputs((rows, width), dtype, seed=width)
    expected = ops.rms_norm_ref(x, weight, 1e-6)
    assert torch.equal(ops.rms_norm(x, weight, 1e-6), expected)
    assert torch.equal(ops.rms_norm(x[:1], weight, 1e-6), expected[:1])
    expected_sum_norm = ops.add_rms_norm_ref(x, residual, weight, 1e-6)[1]
    assert torch.equal(ops.add_rms_norm(x, residual, weight, 1e-6)[1], expected_sum_norm)


def test_double_norms_take_torchs_composite():
    x, residual, weight, bias = _inputs((4, 36), torch.float64)
    assert torch.equal(ops.layer_norm(x, weight, bias, 1e-5), F.layer_norm(x, (36,), weight, bias, 1e-5))
    assert torch.equal(ops.rms_norm(x, weight, 1e-6), ops.rms_norm_ref(x, weight, 1e-6))
    total, normed = ops.add_rms_norm(x, residual, weight, 1e-6)
    assert torch.equal(total, x + residual) and torch.equal(normed, ops.rms_norm_ref(x + residual, weight, 1e-6))


@pytest.mark.parametrize("shape", SHAPES)
def test_rms_norms_match_reference(shape, dtype):
    x, residual, weight, _ = _inputs(shape, dtype, seed=2)
    torch.testing.assert_close(ops.rms_norm(x, weight, 1e-6), ops.rms_norm_ref(x, weight, 1e-6), **TOLERANCES[dtype])
    total, normed = ops.add_rms_norm(x, residual, weight, 1e-6)
    ref_total, ref_normed = ops.add_rms_norm_ref(x, residual, weight, 1e-6)
    torch.testing.assert_close(total, ref_total, atol=0, rtol=0)
    torch.testing.assert_close(normed, ref_normed, **TOLERANCES[dtype])


def test_non_contiguous_input_is_accepted():
    x = torch.randn(6, 40)[:, ::2]
    weight, bias = torch.randn(20), torch.randn(20)
    torch.testing.assert_close(ops.layer_norm(x, weight, bias, 1e-5), ops.layer_norm_ref(x, weight, bias, 1e-5))


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: ops.layer_norm(torch.randn(2, 8), torch.randn(7), None, 1e-5), "'weight' must have shape"),
        (lambda: ops.layer_norm(torch.randn(2, 8), torch.randn(8).double(), None, 1e-5), "must share a dtype"),
        (lambda: ops.layer_norm(torch.arange(8).view(1, 8), torch.ones(8).long(), None, 1e-5), "must be float32"),
        (lambda: ops.add_layer_norm(torch.randn(2, 8), torch.randn(3, 8), torch.ones(8), None, 1e-5),
         "'residual' must have the shape"),
    ],
)
def test_bad_inputs_raise_clear_errors(call, message):
    with pytest.raises(RuntimeError, match=message):
        call()


@pytest.mark.parametrize("name", ["layer_norm", "add_layer_norm", "rms_norm", "add_rms_norm"])
def test_opcheck(name):
    x, residual, weight, bias = _inputs((3, 5, 16), torch.float32)
    args = {
        "layer_norm": (x, weight, bias, 1e-5),
        "add_layer_norm": (x, residual, weight, bias, 1e-5),
        "rms_norm": (x, weight, 1e-6),
        "add_rms_norm": (x, residual, weight, 1e-6),
    }[name]
    torch.library.opcheck(getattr(torch.ops.lightgen, name).default, args)
