import pytest
import torch
from conftest import TOLERANCES

from lightgen import ops

ACTS = ["gelu", "gelu_tanh", "relu", "silu", "none"]
SHAPES = [(1, 1, 7), (1, 1, 2048), (3, 5, 129), (512, 64)]


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("shape", SHAPES)
def test_bias_act_matches_reference(act, shape, dtype):
    gen = torch.Generator().manual_seed(len(shape) + shape[-1])
    x = (torch.randn(shape, generator=gen) * 4).to(dtype)
    bias = torch.randn(shape[-1], generator=gen).to(dtype)
    torch.testing.assert_close(ops.bias_act(x, bias, act), ops.bias_act_ref(x, bias, act), **TOLERANCES[dtype])
    torch.testing.assert_close(ops.bias_act(x, None, act), ops.bias_act_ref(x, None, act), **TOLERANCES[dtype])


@pytest.mark.parametrize("act", ACTS)
def test_gated_act_matches_reference(act, dtype):
    gen = torch.Generator().manual_seed(3)
    gate, up = (torch.randn(4, 3, 77, generator=gen) * 3).to(dtype), torch.randn(4, 3, 77, generator=gen).to(dtype)
    torch.testing.assert_close(ops.gated_act(gate, up, act), ops.gated_act_ref(gate, up, act), **TOLERANCES[dtype])


def test_unknown_activation_is_named_in_the_error():
    with pytest.raises(RuntimeError, match="unknown activation 'mish'"):
        ops.bias_act(torch.randn(2, 4), None, "mish")


def test_shape_mismatch_errors():
    with pytest.raises(RuntimeError, match="'bias' must have shape"):
        ops.bias_act(torch.randn(2, 4), torch.randn(5), "gelu")
    with pytest.raises(RuntimeError, match="must have the same shape"):
        ops.gated_act(torch.randn(2, 4), torch.randn(2, 5), "silu")


@pytest.mark.parametrize("act", ["gelu", "silu"])
def test_opcheck(act):
    x, bias = torch.randn(3, 4, 24), torch.randn(24)
    torch.library.opcheck(torch.ops.lightgen.bias_act.default, (x, bias, act))
    torch.library.opcheck(torch.ops.lightgen.gated_act.default, (x, torch.randn(3, 4, 24), act))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("act", ["silu", "relu", "none"])
def test_half_precision_rounds_where_the_composite_does(act, dtype):
    """act(gate) is rounded to the dtype before the product, x + bias before the activation, as HF's
    composite (``act_fn(gate_proj(x)) * up_proj(x)``) does: bitwise equal, not one rounding off."""
    gen = torch.Generator().manual_seed(5)
    gate, up = (torch.randn(8, 4099, generator=gen) * 3).to(dtype), (torch.randn(8, 4099, generator=gen) * 3).to(dtype)
    assert torch.equal(ops.gated_act(gate, up, act), ops.gated_act_ref(gate, up, act))
    bias = torch.randn(4099, generator=gen).to(dtype)
    assert torch.equal(ops.bias_act(gate, bias, act), ops.bias_act_ref(gate, bias, act))
