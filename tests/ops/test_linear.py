import pytest
import torch

from lightgen import ops
from lightgen.modules.linear import packed_weights
from lightgen.ops.linear import pack_panels, unpack_panels

ROWS = [1, 2, 3, 4, 5, 8, 17, 64]
SHAPES = [(1, 1), (7, 15), (8, 16), (9, 17), (64, 64), (130, 33), (40, 512)]  # (out_features, in_features)
# (precision, layout): [N, K] rows, Conv1D's [K, N] read in place, or packed panels.
VARIANTS = [("fp32", "rows"), ("fp32", "k_major"), ("fp32", "packed"), ("bf16", "rows"), ("bf16", "packed"),
            ("int8", "rows"), ("int8", "packed")]


def _weights(out_features, in_features, variant, gen):
    """(weight operand, scale) for ops.linear."""
    precision, layout = variant
    weight = torch.randn(out_features, in_features, generator=gen) / in_features**0.5
    if layout == "k_major":
        return weight.t().contiguous().t(), None
    packed = packed_weights(weight, None if precision == "fp32" else precision)
    if layout == "packed":
        return packed.weight, packed.scale
    return unpack_panels(packed.weight, out_features).contiguous(), packed.scale


@pytest.mark.parametrize("variant", VARIANTS, ids=["-".join(v) for v in VARIANTS])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("rows", ROWS)
def test_linear_matches_reference(variant, shape, rows):
    gen = torch.Generator().manual_seed(rows * 100 + shape[0])
    weight, scale = _weights(*shape, variant, gen)
    x = torch.randn(rows, shape[1], generator=gen)
    bias = torch.randn(shape[0], generator=gen)
    for b in (bias, None):
        torch.testing.assert_close(ops.linear(x, weight, scale, b, "none", shape[0]),
                                   ops.linear_ref(x, weight, scale, b, "none", shape[0]), atol=1e-5, rtol=1e-5)


def test_pack_round_trips():
    weight = torch.randn(130, 7)
    packed = pack_panels(weight)
    assert packed.shape == (3, 7, 64) and packed[2, :, 2:].eq(0).all()
    assert torch.equal(unpack_panels(packed, 130), weight)


@pytest.mark.parametrize("variant", VARIANTS, ids=["-".join(v) for v in VARIANTS])
@pytest.mark.parametrize("act", ["gelu", "gelu_tanh", "relu", "silu"])
def test_fused_activation_and_leading_dims(act, variant):
    gen = torch.Generator().manual_seed(7)
    weight, scale = _weights(72, 32, variant, gen)
    bias, x = torch.randn(72, generator=gen), torch.randn(2, 3, 32, generator=gen)
    out = ops.linear(x, weight, scale, bias, act, 72)
    assert out.shape == (2, 3, 72)
    torch.testing.assert_close(out, ops.linear_ref(x, weight, scale, bias, act, 72), atol=1e-5, rtol=1e-5)


def test_non_contiguous_input_and_empty_batch():
    weight = torch.randn(24, 32)
    x = torch.randn(32, 5).t()
    torch.testing.assert_close(ops.linear(x, weight), x @ weight.t(), atol=1e-5, rtol=1e-5)
    assert ops.linear(torch.randn(0, 32), weight).shape == (0, 24)


def test_int8_weights_are_close_to_float():
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(64, 256, generator=gen)
    quantized = packed_weights(weight, "int8")
    dequantized = unpack_panels(quantized.weight, 64).float() * quantized.scale[:, None]
    assert (dequantized - weight).abs().max(dim=1).values.le(quantized.scale / 2 + 1e-6).all()
    zero_row = packed_weights(torch.zeros(2, 8), "int8")
    assert torch.isfinite(zero_row.scale).all() and zero_row.weight.eq(0).all()


def test_bad_inputs_raise_named_errors():
    weight = torch.randn(8, 16)
    with pytest.raises(RuntimeError, match="'x' must be float32"):
        ops.linear(torch.randn(2, 16, dtype=torch.float64), weight)
    with pytest.raises(RuntimeError, match="must end in in_features=16"):
        ops.linear(torch.randn(2, 15), weight)
    with pytest.raises(RuntimeError, match="int8 weights need their per-output-channel 'scale'"):
        ops.linear(torch.randn(2, 16), weight.to(torch.int8))
    with pytest.raises(RuntimeError, match="'bias' must be a float32 CPU tensor of shape \\[8\\]"):
        ops.linear(torch.randn(2, 16), weight, None, torch.randn(9))
    with pytest.raises(RuntimeError, match="'weight' must be float32, bfloat16 or int8"):
        ops.linear(torch.randn(2, 16), weight.half())
    with pytest.raises(RuntimeError, match="unknown activation"):
        ops.linear(torch.randn(2, 16), weight, None, None, "mish")
    with pytest.raises(RuntimeError, match="packed weights need out_features in \\(64, 128\\], got 8"):
        ops.linear(torch.randn(2, 16), pack_panels(torch.randn(100, 16)), None, None, "none", 8)
    with pytest.raises(RuntimeError, match="out_features=9 does not match"):
        ops.linear(torch.randn(2, 16), weight, None, None, "none", 9)


@pytest.mark.parametrize("variant", [("fp32", "rows"), ("int8", "packed")], ids=["fp32", "int8-packed"])
def test_opcheck(variant):
    weight, scale = _weights(24, 32, variant, torch.Generator().manual_seed(0))
    torch.library.opcheck(torch.ops.lightgen.linear.default,
                          (torch.randn(3, 32), weight, scale, torch.randn(24), "gelu", 24))
