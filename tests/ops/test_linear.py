import math
import os

import pytest
import torch
from conftest import linear_operand

from lightgen import _build, ops
from lightgen.modules.linear import (
    QuantFormat,
    packed_weights,
)
from lightgen.ops.linear import (
    DOT_KERNELS,
    dequantize_grouped,
    int8_dot_available,
    int8_dot_kernel,
    pack_int8_dot,
    pack_panels,
    quantize_grouped,
    unpack_int8_dot,
    unpack_panels,
)

ROWS = [1, 2, 3, 4, 5, 8, 17, 64]
SHAPES = [(1, 1), (7, 15), (8, 16), (9, 17), (64, 64), (130, 33), (40, 512)]  # (out_features, in_features)
# (precision, layout): [N, K] rows, Conv1D's [K, N] read in place, or packed panels.
VARIANTS = [("fp32", "rows"), ("fp32", "k_major"), ("fp32", "packed"), ("bf16", "rows"), ("bf16", "packed"),
            ("int8", "rows"), ("int8", "packed")]


def _weights(out_features, in_features, variant, gen):
    """(weight operand, scale) for ops.linear."""
    return linear_operand(torch.randn(out_features, in_features, generator=gen) / in_features**0.5, *variant)


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


# (bits, group_size, zero_points): group sizes 1 and odd, partial last groups, int4 with odd K.
FORMATS = [QuantFormat(8, 64), QuantFormat(8, 1), QuantFormat(8, 5), QuantFormat(8, 32, True), QuantFormat(8, 5, True),
           QuantFormat(4, 32), QuantFormat(4, 2), QuantFormat(4, 32, True), QuantFormat(4, 6, True)]
FORMAT_IDS = [f"int{f.bits}-g{f.group_size}{'-zp' if f.zero_points else ''}" for f in FORMATS]


@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 17])
def test_linear_grouped_matches_reference(fmt, shape, rows):
    gen = torch.Generator().manual_seed(rows * 100 + shape[0])
    weight = torch.randn(*shape, generator=gen)
    packed = packed_weights(weight, f"int{fmt.bits}", fmt)
    x, bias = torch.randn(rows, shape[1], generator=gen), torch.randn(shape[0], generator=gen)
    args = (packed.weight, packed.scale, packed.offset)
    # fp32 rounding grows with the sum of |x_k w_k| (an output of 0.3 can be the sum of terms near 20 each).
    w = dequantize_grouped(*args, fmt.group_size, shape[1], shape[0])
    bound = 2e-5 + 2e-7 * (x.abs() @ w.abs().t() + bias.abs())
    for b, act in ((bias, "none"), (None, "none"), (bias, "silu")):
        got = ops.linear_grouped(x, *args, b, act, shape[0], fmt.group_size)
        expected = ops.linear_grouped_ref(x, *args, b, act, shape[0], fmt.group_size)
        assert (got - expected).abs().le(bound).all(), (got - expected).abs().max()


@pytest.mark.skipif(os.environ.get("LIGHTGEN_DISABLE_EXT") == "1",
                    reason="the kernel's property: the reference's ATen matmul blocks rows its own way")
@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
def test_linear_grouped_rows_do_not_depend_on_the_batch(fmt):
    """A row's outputs are the same bits alone and in a batch of any size (tiles of 4 rows and their tails), so a
    quantized IAD pass verifies what a quantized greedy step computes."""
    gen = torch.Generator().manual_seed(fmt.bits * 10 + fmt.group_size)
    weight, x = torch.randn(130, 75, generator=gen), torch.randn(11, 75, generator=gen)
    packed = packed_weights(weight, f"int{fmt.bits}", fmt)
    args = (packed.weight, packed.scale, packed.offset, None, "none", 130, fmt.group_size)
    alone = torch.cat([ops.linear_grouped(x[i:i + 1], *args) for i in range(len(x))])
    for rows in (2, 3, 4, 5, 11):
        assert torch.equal(ops.linear_grouped(x[:rows], *args), alone[:rows]), rows


@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
def test_grouped_rounding_error_is_at_most_half_a_step(fmt):
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(70, 45, generator=gen)
    packed, scale, offset = quantize_grouped(weight, fmt.bits, fmt.group_size, fmt.zero_points)
    error = (dequantize_grouped(packed, scale, offset, fmt.group_size, 45, 70) - weight).abs()
    step = unpack_panels(scale, 70).repeat_interleave(fmt.group_size, dim=1)[:, :45].abs()
    # Symmetric int4 maps the largest magnitude to -8; the other sign clamps at +7, a step short at most.
    assert error.le(step * (1.0 if (fmt.bits, fmt.zero_points) == (4, False) else 0.5) + 1e-6).all()
    zeros = quantize_grouped(torch.zeros(2, 8), fmt.bits, fmt.group_size, fmt.zero_points)
    assert all(torch.isfinite(t).all() for t in zeros if t is not None)
    assert dequantize_grouped(*zeros, fmt.group_size, 8, 2).eq(0).all()


def test_int8_with_zero_points_holds_weights_already_on_a_q4_1_grid():
    """A model dequantized from a Q4_1 file (SmolLM2's GGUF) has 16 levels per block of 32: int8 with zero
    points has 255 steps of (max - min) / 255, a fifteenth of Q4_1's, so those levels are kept (to float
    rounding), where symmetric int8 rounds them."""
    gen = torch.Generator().manual_seed(3)
    scale, low = torch.rand(48, 4, 1, generator=gen) * 0.01 + 1e-3, torch.randn(48, 4, 1, generator=gen) * 0.02
    levels = torch.randint(0, 16, (48, 4, 32), generator=gen).float()
    levels[..., 0], levels[..., 1] = 0, 15  # each block spans its grid, as a quantizer's output does
    weight = (levels * scale + low).view(48, 128)
    kept = {}
    for zero_points in (True, False):
        packed, group_scale, offset = quantize_grouped(weight, 8, 32, zero_points)
        kept[zero_points] = (dequantize_grouped(packed, group_scale, offset, 32, 128, 48) - weight).abs().max()
    assert kept[True] < 1e-6 < kept[False]
    chosen = packed_weights(weight, "int8")  # the default takes zero points where they pay, as here
    assert chosen.offset is not None
    assert (dequantize_grouped(chosen.weight, chosen.scale, chosen.offset, 32, 128, 48) - weight).abs().max() < 1e-6


def test_default_int8_keeps_symmetric_scales_where_zero_points_do_not_pay():
    """Float-trained weights (a group's range is about twice its largest magnitude: no gain) and weights on
    a Q8_0 grid (SmolLM2's tied embedding, kept exactly by the symmetric scales) take no offsets."""
    gen = torch.Generator().manual_seed(4)
    levels = torch.randint(-127, 128, (48, 4, 32), generator=gen).float()
    levels[..., 0] = 127  # each block reaches its scale's largest level
    q8_0 = (levels * (torch.rand(48, 4, 1, generator=gen) * 1e-3 + 1e-4)).view(48, 128)
    for weight, exact in ((torch.randn(48, 128, generator=gen) * 0.02, False), (q8_0, True)):
        chosen = packed_weights(weight, "int8")
        assert chosen.offset is None
        error = (dequantize_grouped(chosen.weight, chosen.scale, None, 32, 128, 48) - weight).abs().max()
        assert (error < 1e-7) == exact


def test_group_scales_keep_outlier_columns_from_coarsening_the_rest():
    """Per-output-channel int8 lets one outlier weight set a whole row's step; groups of 64 keep it local."""
    gen = torch.Generator().manual_seed(2)
    weight = torch.randn(64, 576, generator=gen) * 0.02
    weight[:, 7] = 2.0  # an outlier input feature, as real LLMs have
    grouped = packed_weights(weight, "int8")
    error = dequantize_grouped(grouped.weight, grouped.scale, grouped.offset, grouped.group_size, 576, 64) - weight
    per_channel = weight.abs().amax(dim=1, keepdim=True) / 127.0
    channel_error = torch.round(weight / per_channel) * per_channel - weight
    assert error[:, 64:].norm() < 0.05 * channel_error[:, 64:].norm()


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


def test_linear_grouped_bad_inputs_raise_named_errors():
    x = torch.randn(2, 16)
    int8 = packed_weights(torch.randn(8, 16), "int8", QuantFormat(8, 4))
    int4 = packed_weights(torch.randn(8, 16), "int4", QuantFormat(4, 4, True))
    with pytest.raises(RuntimeError, match="'weight' must be int8 or uint8"):
        ops.linear_grouped(x, int8.weight.float(), int8.scale, None, None, "none", 8, 4)
    with pytest.raises(RuntimeError, match="must be packed \\[panels, 7, 64\\] for in_features=14"):
        ops.linear_grouped(torch.randn(2, 14), int4.weight, int4.scale, int4.offset, None, "none", 8, 4)
    with pytest.raises(RuntimeError, match="group_size must be even and positive, got 3"):
        ops.linear_grouped(x, int4.weight, int4.scale, int4.offset, None, "none", 8, 3)
    with pytest.raises(RuntimeError, match="'scale' must be a float32 tensor of shape \\[1, 2, 64\\] on cpu"):
        ops.linear_grouped(x, int8.weight, int8.scale, None, None, "none", 8, 8)
    with pytest.raises(RuntimeError, match="'offset' must be a float32 tensor of shape \\[1, 4, 64\\] on cpu"):
        ops.linear_grouped(x, int8.weight, int8.scale, int8.scale[:, :2].contiguous(), None, "none", 8, 4)
    with pytest.raises(RuntimeError, match="packed weights need out_features in \\(0, 64\\], got 65"):
        ops.linear_grouped(x, int8.weight, int8.scale, None, None, "none", 65, 4)
    with pytest.raises(ValueError, match="unsupported bits=4, group_size=3"):
        quantize_grouped(torch.randn(8, 16), 4, 3)


@pytest.mark.parametrize("variant", [("fp32", "rows"), ("int8", "packed")], ids=["fp32", "int8-packed"])
def test_opcheck(variant):
    weight, scale = _weights(24, 32, variant, torch.Generator().manual_seed(0))
    torch.library.opcheck(torch.ops.lightgen.linear.default,
                          (torch.randn(3, 32), weight, scale, torch.randn(24), "gelu", 24))


@pytest.mark.parametrize("fmt", [QuantFormat(8, 8), QuantFormat(8, 8, True), QuantFormat(4, 8),
                                 QuantFormat(4, 8, True)],
                         ids=["int8", "int8-zp", "int4", "int4-zp"])
def test_opcheck_grouped(fmt):
    packed = packed_weights(torch.randn(24, 33), f"int{fmt.bits}", fmt)
    torch.library.opcheck(torch.ops.lightgen.linear_grouped.default,
                          (torch.randn(3, 33), packed.weight, packed.scale, packed.offset, torch.randn(24), "gelu",
                           24, 8))


# int8 activations (quantize="int8-dynamic" / "int4-dynamic"): group sizes 4 / 8 (the smallest the dot layouts
# take), partial groups, one group wider than K, zero points (int4: always).
DYNAMIC_FORMATS = [QuantFormat(8, 32), QuantFormat(8, 32, True), QuantFormat(8, 4), QuantFormat(8, 12, True),
                   QuantFormat(8, 128), QuantFormat(4, 32, True), QuantFormat(4, 8, True), QuantFormat(4, 24, True),
                   QuantFormat(4, 128, True)]
DYNAMIC_IDS = [f"int{f.bits}-g{f.group_size}{'-zp' if f.zero_points else ''}" for f in DYNAMIC_FORMATS]
KERNELS = ["portable", *DOT_KERNELS]


def _dynamic(weight, fmt):
    q, scale, offset = quantize_grouped(weight, fmt.bits, fmt.group_size, fmt.zero_points)
    dot, sums = pack_int8_dot(q, fmt.group_size, weight.shape[1])
    return q, scale, offset, dot, sums


def _simd_kernels():
    """The SIMD int8-dot kernels this CPU and build run: the best and every one before it."""
    best = int8_dot_kernel()
    return [] if best is None else list(DOT_KERNELS[:DOT_KERNELS.index(best) + 1])


def _kernel(monkeypatch, kernel):
    if kernel != "portable" and kernel not in _simd_kernels():
        pytest.skip(f"this CPU or build has no {kernel} int8-dot kernel")
    monkeypatch.setenv("LIGHTGEN_INT8_DOT_KERNEL", kernel)


def test_int8_dot_layout_round_trips_and_sums_its_groups():
    q, _, _, dot, sums = _dynamic(torch.randn(70, 45), QuantFormat(8, 12))
    assert dot.shape == (2, 12, 64, 4) and sums.shape == (2, 4, 64) and sums.dtype == torch.int32
    assert torch.equal(unpack_int8_dot(dot, 45, 70), unpack_panels(q, 70))
    groups = torch.nn.functional.pad(unpack_panels(q, 70).int(), (0, 3)).view(70, 4, 12).sum(dim=2)
    assert torch.equal(unpack_panels(sums, 70), -128 * groups)
    assert dot[:, 11, :, 1:].eq(0).all() and dot[1, :, 6:].eq(0).all()  # padding k and columns
    with pytest.raises(ValueError, match="multiple of 4"):
        pack_int8_dot(q, 6)


def test_int4_dot_layout_holds_eight_k_a_lane_low_nibbles_first():
    q, _, _, dot, sums = _dynamic(torch.randn(70, 45), QuantFormat(4, 8, True))
    assert dot.shape == (2, 6, 64, 4) and dot.dtype == torch.uint8 and sums is None
    u = unpack_panels(q, 70)
    u = torch.stack([u & 15, u >> 4], dim=2).view(70, -1)[:, :45]
    assert torch.equal(unpack_int8_dot(dot, 45, 70), u)
    # Column 69 (panel 1, column 5), lane 2: k 16..19 in the low nibbles, 20..23 in the high ones.
    assert torch.equal(dot[1, 2, 5], u[69, 16:20] | (u[69, 20:24] << 4))
    # Padding: k 45..47 (the high nibbles of lane 5's bytes 1..3) and columns 70..127.
    assert dot[:, 5, :, 1:].le(15).all() and dot[:, 5, :, 0].gt(15).any() and dot[1, :, 6:].eq(0).all()
    with pytest.raises(ValueError, match="multiple of 8"):
        pack_int8_dot(q, 4, 45)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("fmt", DYNAMIC_FORMATS, ids=DYNAMIC_IDS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 9, 17, 40])
def test_linear_int8_dynamic_matches_reference(monkeypatch, kernel, fmt, shape, rows):
    _kernel(monkeypatch, kernel)
    gen = torch.Generator().manual_seed(rows * 100 + shape[0])
    weight = torch.randn(*shape, generator=gen)
    q, scale, offset, dot, sums = _dynamic(weight, fmt)
    x, bias = torch.randn(rows, shape[1], generator=gen), torch.randn(shape[0], generator=gen)
    w = dequantize_grouped(q, scale, offset, fmt.group_size, shape[1], shape[0])
    # The integer dot products are exact; what differs is the float sum over groups (and the offsets' x sums).
    bound = 2e-5 + 2e-7 * (x.abs() @ w.abs().t() + bias.abs())
    for b, act in ((bias, "none"), (None, "none"), (bias, "silu")):
        args = (x, dot, scale, offset, sums, b, act, shape[0], fmt.group_size)
        got, expected = ops.linear_int8_dynamic(*args), ops.linear_int8_dynamic_ref(*args)
        assert (got - expected).abs().le(bound).all(), (got - expected).abs().max()
    # Lossy against the weight-only path by about int8's step on x: well under a percent of the output's scale.
    weight_only = ops.linear_grouped(x, q, scale, offset, bias, "none", shape[0], fmt.group_size)
    got = ops.linear_int8_dynamic(x, dot, scale, offset, sums, bias, "none", shape[0], fmt.group_size)
    assert (got - weight_only).norm() <= 0.02 * (x.abs() @ w.abs().t()).norm()


@pytest.mark.parametrize("fmt", [QuantFormat(8, 8), QuantFormat(8, 12, True), QuantFormat(4, 8, True),
                                 QuantFormat(4, 32, True)], ids=["int8", "int8-zp", "int4-g8", "int4-g32"])
@pytest.mark.parametrize("shape", [(7, 15), (130, 33), (70, 75)])
def test_simd_and_portable_kernels_give_the_same_bits(monkeypatch, fmt, shape):
    """The same integers and the same float rounding (fused multiply-adds in one order) on every kernel, each the
    reference's result to float rounding, over every row count the tiles of 3 (VNNI), 2 (AVX2) and 1 leave."""
    kernels = _simd_kernels()
    if not kernels:
        pytest.skip("this CPU or build has no SIMD int8-dot kernel")
    gen = torch.Generator().manual_seed(shape[1])
    q, scale, offset, dot, sums = _dynamic(torch.randn(*shape, generator=gen), fmt)
    w = dequantize_grouped(q, scale, offset, fmt.group_size, shape[1], shape[0])
    bias = torch.randn(shape[0], generator=gen)
    for rows in [*range(1, 8), 13]:
        x = torch.randn(rows, shape[1], generator=gen)
        x[0, :5] = 0.0  # a partly zero group
        x[-1, 1] = -x[-1].abs().max()  # a group's -127
        args = (x, dot, scale, offset, sums, bias, "none", shape[0], fmt.group_size)
        monkeypatch.setenv("LIGHTGEN_INT8_DOT_KERNEL", "portable")
        expected = ops.linear_int8_dynamic(*args)
        for kernel in kernels:
            monkeypatch.setenv("LIGHTGEN_INT8_DOT_KERNEL", kernel)
            got = ops.linear_int8_dynamic(*args)
            assert torch.equal(got, expected), (kernel, rows, (got - expected).abs().max())
        bound = 2e-5 + 2e-7 * (x.abs() @ w.abs().t() + bias.abs())
        assert (expected - ops.linear_int8_dynamic_ref(*args)).abs().le(bound).all(), rows


def test_extreme_int8_weights_do_not_saturate_the_int16_pairs(monkeypatch):
    """AVX2 multiplies |q| by a * sign(q) in int16 pairs: q = -128 (zero points' grid) and a = +-127 everywhere
    are its largest pairs, 2 * 128 * 127 < 2^15; int4's u = 15 against a = -127 add up 8 products in int16."""
    kernels = _simd_kernels()
    if not kernels:
        pytest.skip("this CPU or build has no SIMD int8-dot kernel")
    for fmt in (QuantFormat(8, 128, True), QuantFormat(4, 128, True)):
        weight = torch.full((64, 256), -1.0)
        weight[:, ::3] = 1.0
        q, scale, offset, dot, sums = _dynamic(weight, fmt)
        q = torch.full_like(q, -128 if fmt.bits == 8 else 0xFF)  # every weight at its grid's end
        dot, sums = pack_int8_dot(q, fmt.group_size, 256)
        pairs = torch.where(torch.arange(256) % 4 < 2, 1.0, -1.0)  # the two k of an int16 pair share a sign
        x = torch.stack([torch.ones(256), -torch.ones(256), pairs])
        args = (x, dot, scale, offset, sums, None, "none", 64, fmt.group_size)
        monkeypatch.setenv("LIGHTGEN_INT8_DOT_KERNEL", "portable")
        expected = ops.linear_int8_dynamic(*args)
        torch.testing.assert_close(expected, ops.linear_int8_dynamic_ref(*args), atol=1e-4, rtol=1e-5)
        for kernel in kernels:
            monkeypatch.setenv("LIGHTGEN_INT8_DOT_KERNEL", kernel)
            assert torch.equal(ops.linear_int8_dynamic(*args), expected), (fmt.bits, kernel)


def test_the_int8_dot_kernel_is_asked_for_by_name(monkeypatch):
    missing = [k for k in DOT_KERNELS if k not in _simd_kernels()]
    monkeypatch.setenv("LIGHTGEN_INT8_DOT_KERNEL", "sse")
    with pytest.raises(ValueError, match="must be auto, portable, avx2 or vnni, got 'sse'"):
        int8_dot_kernel()
    _, scale, offset, dot, sums = _dynamic(torch.randn(8, 16), QuantFormat(8, 8))
    if _build.load().compiled:
        with pytest.raises(RuntimeError, match="LIGHTGEN_INT8_DOT_KERNEL must be auto, portable, avx2 or vnni"):
            ops.linear_int8_dynamic(torch.randn(2, 16), dot, scale, offset, sums, None, "none", 8, 8)
    for kernel in missing:
        monkeypatch.setenv("LIGHTGEN_INT8_DOT_KERNEL", kernel)
        with pytest.raises(ValueError, match=f"LIGHTGEN_INT8_DOT_KERNEL={kernel}: this CPU or build has no such"):
            int8_dot_kernel()
    monkeypatch.setenv("LIGHTGEN_INT8_DOT_KERNEL", "portable")
    assert int8_dot_kernel() is None and not int8_dot_available()


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("bits", [8, 4])
def test_linear_int8_dynamic_zero_and_non_finite_groups(monkeypatch, kernel, bits):
    _kernel(monkeypatch, kernel)
    _, scale, offset, dot, sums = _dynamic(torch.randn(70, 40), QuantFormat(bits, 8, True))
    x = torch.randn(4, 40)
    x[0] = 0.0
    x[1, :8] = 1e-38  # below the floor: rounds to 0, no inf from 127 / amax
    x[2, 17], x[3, 39] = float("inf"), float("nan")
    args = (dot, scale, offset, sums, None, "none", 70, 8)
    got, expected = ops.linear_int8_dynamic(x, *args), ops.linear_int8_dynamic_ref(x, *args)
    assert got[0].eq(0).all() and torch.isfinite(got[1]).all()
    assert got[2:].isnan().all() and expected[2:].isnan().all()
    torch.testing.assert_close(got[:2], expected[:2], atol=1e-5, rtol=1e-5)


def test_linear_int8_dynamic_bad_inputs_raise_named_errors():
    x = torch.randn(2, 16)
    q, scale, _, dot, sums = _dynamic(torch.randn(8, 16), QuantFormat(8, 4))
    with pytest.raises(RuntimeError, match="group_size must be a positive multiple of 4, got 6"):
        ops.linear_int8_dynamic(x, dot, scale, None, sums, None, "none", 8, 6)
    with pytest.raises(RuntimeError, match="'weight' must be int8 \\[panels, 4, 64, 4\\] or int4 as uint8 "
                                           "\\[panels, 2, 64, 4\\] for in_features=16"):
        ops.linear_int8_dynamic(x, q, scale, None, sums, None, "none", 8, 4)
    with pytest.raises(RuntimeError, match="'weight' must be int8 or uint8 \\(int4\\), got Float"):
        ops.linear_int8_dynamic(x, dot.float(), scale, None, sums, None, "none", 8, 4)
    with pytest.raises(RuntimeError, match="'sums' must be a Int tensor of shape \\[1, 4, 64\\]"):
        ops.linear_int8_dynamic(x, dot, scale, None, sums.float(), None, "none", 8, 4)
    with pytest.raises(RuntimeError, match="'x' must be float32"):
        ops.linear_int8_dynamic(x.double(), dot, scale, None, sums, None, "none", 8, 4)
    with pytest.raises(RuntimeError, match="packed weights need out_features in \\(0, 64\\], got 65"):
        ops.linear_int8_dynamic(x, dot, scale, None, sums, None, "none", 65, 4)


def test_linear_int8_dynamic_bad_int4_inputs_raise_named_errors():
    x = torch.randn(2, 20)
    _, scale, offset, dot, _ = _dynamic(torch.randn(8, 20), QuantFormat(4, 8, True))
    with pytest.raises(RuntimeError, match="group_size must be a positive multiple of 8, got 4 \\(int4 weights\\)"):
        ops.linear_int8_dynamic(x, dot, scale, offset, None, None, "none", 8, 4)
    with pytest.raises(RuntimeError, match="int4 weights take no 'sums'"):
        ops.linear_int8_dynamic(x, dot, scale, offset, torch.zeros(1, 3, 64, dtype=torch.int32), None, "none", 8, 8)
    with pytest.raises(RuntimeError, match="int4 weights need their 'offset'"):
        ops.linear_int8_dynamic(x, dot, scale, None, None, None, "none", 8, 8)
    with pytest.raises(ValueError, match="int4 weights need their 'offset'"):
        ops.linear_int8_dynamic_ref(x, dot, scale, None, None, None, "none", 8, 8)
    with pytest.raises(RuntimeError, match="or int4 as uint8 \\[panels, 3, 64, 4\\] for in_features=20, got Byte "
                                           "\\[1, 2, 64, 4\\]"):
        ops.linear_int8_dynamic(x, dot[:, :2], scale, offset, None, None, "none", 8, 8)
    with pytest.raises(ValueError, match="int4 with int8 activations needs zero points"):
        packed_weights(torch.randn(8, 20), "int4-dynamic", QuantFormat(4, 32, False, activations=True))
    with pytest.raises(RuntimeError, match="int8 weights need their 'sums'"):
        ops.linear_int8_dynamic(torch.randn(2, 16), torch.zeros(1, 4, 64, 4, dtype=torch.int8), scale[:, :2],
                                None, None, None, "none", 8, 8)


@pytest.mark.parametrize("fmt", [QuantFormat(8, 8), QuantFormat(8, 8, True), QuantFormat(4, 8, True)],
                         ids=["int8", "int8-zp", "int4"])
def test_opcheck_int8_dynamic(fmt):
    _, scale, offset, dot, sums = _dynamic(torch.randn(24, 33), fmt)
    torch.library.opcheck(torch.ops.lightgen.linear_int8_dynamic.default,
                          (torch.randn(3, 33), dot, scale, offset, sums, torch.randn(24), "gelu", 24, 8))


@pytest.mark.parametrize("precision", ["int8", "int4"])
def test_dynamic_weights_round_activations_at_every_row_count(monkeypatch, precision):
    """int8-dynamic and int4-dynamic run the int8-activation kernel at every row count, on the weight-only grid in
    the dot-product layout (no weight-only panels beside it), and each row's result is the same whatever rows run
    with it; without a SIMD int8-dot kernel only the weight-only one."""
    weight, bias = torch.randn(96, 80), torch.randn(96)
    weight_only = packed_weights(weight, precision)
    if not int8_dot_available():
        assert packed_weights(weight, f"{precision}-dynamic").dot is None
        pytest.skip("this CPU or build has no SIMD int8-dot kernel")
    dynamic = packed_weights(weight, f"{precision}-dynamic")
    assert dynamic.weight is dynamic.dot and dynamic.quantized and weight_only.dot is None
    assert torch.equal(dynamic.dot, pack_int8_dot(weight_only.weight, 32, 80)[0])  # the weight-only grid
    assert dynamic.max_rows == math.inf
    x = torch.randn(33, 80)
    for rows in (0, 1, 2, 33):
        expected = ops.linear_int8_dynamic(x[:rows], dynamic.dot, dynamic.scale, dynamic.offset, dynamic.dot_sums,
                                           bias, "none", 96, 32)
        assert torch.equal(dynamic.run(x[:rows], bias), expected), rows
    together = dynamic.run(x, bias)
    for row in range(x.shape[0]):
        assert torch.equal(dynamic.run(x[row:row + 1], bias)[0], together[row]), row
    monkeypatch.setenv("LIGHTGEN_INT8_DOT_KERNEL", "portable")
    assert packed_weights(weight, f"{precision}-dynamic").dot is None


@pytest.mark.parametrize("zero_points", [True, False])
def test_int4_scales_are_float16_and_the_weights_rounded_to_them(zero_points):
    gen = torch.Generator().manual_seed(11)
    weight = torch.randn(70, 96, generator=gen) * torch.logspace(-7, 1, 96)  # groups from ~1e-7 up to ~10
    packed, scale, offset = quantize_grouped(weight, 4, 32, zero_points)
    assert scale.dtype == torch.float16 and (offset is None or offset.dtype == torch.float16)
    assert quantize_grouped(weight, 8, 32, zero_points)[1].dtype == torch.float32  # int8 keeps float32
    restored = dequantize_grouped(packed, scale, offset, 32, 96, 70)
    # Half a step of the float16 grid from each weight (a step: the group's float16 scale); symmetric, a whole one
    # for the values opposite the extreme (Q4_0's +8 is clamped to 7).
    step = unpack_panels(scale, 70).float().abs().repeat_interleave(32, dim=1)
    assert ((restored - weight).abs() <= step * (0.5 if zero_points else 1.0) * (1 + 1e-3)).all()


def test_int4_groups_beyond_float16_keep_float32_scales():
    weight = torch.randn(8, 64)
    weight[3, 5] = 1e6  # a range float16 cannot hold
    packed, scale, offset = quantize_grouped(weight, 4, 32, True)
    assert scale.dtype == torch.float32 and offset.dtype == torch.float32
    restored = dequantize_grouped(packed, scale, offset, 32, 64, 8)
    assert restored[3, 5] == pytest.approx(1e6, rel=1e-6)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("zero_points", [True, False])
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_float16_scales_give_the_bits_of_their_float32_values(monkeypatch, kernel, zero_points, rows):
    """The kernels widen float16 scales and offsets exactly: the same weights with them as float32 give the same
    bits, weight-only and, with zero points, with int8 activations."""
    gen = torch.Generator().manual_seed(rows)
    x, weight = torch.randn(rows, 72, generator=gen), torch.randn(100, 72, generator=gen)
    q, scale, offset = quantize_grouped(weight, 4, 8, zero_points)
    assert scale.dtype == torch.float16
    widened = [None if t is None else t.float() for t in (scale, offset)]
    torch.testing.assert_close(ops.linear_grouped(x, q, scale, offset, None, "none", 100, 8),
                               ops.linear_grouped(x, q, *widened, None, "none", 100, 8), atol=0, rtol=0)
    if zero_points:
        _kernel(monkeypatch, kernel)
        dot, sums = pack_int8_dot(q, 8, 72)
        got = ops.linear_int8_dynamic(x, dot, scale, offset, sums, None, "none", 100, 8)
        torch.testing.assert_close(got, ops.linear_int8_dynamic(x, dot, *widened, sums, None, "none", 100, 8),
                                   atol=0, rtol=0)
        torch.testing.assert_close(got, ops.linear_int8_dynamic_ref(x, dot, scale, offset, sums, None, "none", 100, 8),
                                   atol=1e-4, rtol=1e-4)


def test_mixed_scale_and_offset_types_raise_named_errors():
    x = torch.randn(2, 16)
    q, scale, offset = quantize_grouped(torch.randn(8, 16), 4, 4, True)
    with pytest.raises(RuntimeError, match="'offset' must be a float16 tensor of shape \\[1, 4, 64\\] on cpu"):
        ops.linear_grouped(x, q, scale, offset.float(), None, "none", 8, 4)
    with pytest.raises(RuntimeError, match="'offset' must be a float32 tensor of shape \\[1, 4, 64\\] on cpu"):
        ops.linear_grouped(x, q, scale.float(), offset, None, "none", 8, 4)
