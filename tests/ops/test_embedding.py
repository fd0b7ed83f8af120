import math

import pytest
import torch
from conftest import TOLERANCES

from lightgen import ops


@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (2, 1, 5)])
@pytest.mark.parametrize("with_positions", [True, False])
def test_embedding_matches_reference(shape, with_positions, dtype):
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(50, 24, generator=gen).to(dtype)
    ids = torch.randint(0, 50, shape, generator=gen)
    pos_weight = positions = None
    if with_positions:
        pos_weight = torch.randn(16, 24, generator=gen).to(dtype)
        positions = torch.randint(0, 16, shape, generator=gen)
    scale = math.sqrt(24)
    torch.testing.assert_close(ops.embedding(ids, weight, scale, pos_weight, positions),
                               ops.embedding_ref(ids, weight, scale, pos_weight, positions), **TOLERANCES[dtype])


def test_marian_sinusoidal_table():
    from models import build

    table = build("marian").model.encoder.embed_positions.weight.detach()
    weight, ids = torch.randn(20, table.shape[1]), torch.randint(0, 20, (2, 9))
    positions = torch.arange(9).expand(2, 9).contiguous()
    torch.testing.assert_close(ops.embedding(ids, weight, 4.0, table, positions),
                               weight[ids] * 4.0 + table[positions])


def test_out_of_range_ids_raise():
    with pytest.raises(RuntimeError, match="token id 50 .* outside the table"):
        ops.embedding(torch.tensor([[1, 50]]), torch.randn(50, 8))
    with pytest.raises(RuntimeError, match="token id 50 .* outside the table"):
        ops.embedding(torch.tensor([[1, 50]], dtype=torch.int32), torch.randn(50, 8))
    with pytest.raises(RuntimeError, match="must be int64"):
        ops.embedding(torch.tensor([[1, 2]], dtype=torch.int16), torch.randn(50, 8))


def test_int32_ids_and_positions_index_as_int64():
    weight, pos_weight = torch.randn(30, 8), torch.randn(7, 8)
    ids, positions = torch.randint(0, 30, (2, 5)), torch.randint(0, 7, (2, 5))
    expected = ops.embedding(ids, weight, 2.0, pos_weight, positions)
    assert torch.equal(ops.embedding(ids.int(), weight, 2.0, pos_weight, positions.int()), expected)


def test_opcheck():
    weight, ids = torch.randn(30, 8), torch.randint(0, 30, (2, 5))
    torch.library.opcheck(torch.ops.lightgen.embedding.default, (ids, weight, 2.0, torch.randn(7, 8),
                                                                 torch.randint(0, 7, (2, 5))))
    torch.library.opcheck(torch.ops.lightgen.embedding.default, (ids, weight, 1.0, None, None))
