"""ops.sample_tokens: torch.multinomial(probs, 1)'s tokens and generator state, on every kind of distribution
sampling hands it (top-k and top-p cuts, full rows, one token left, subnormal probabilities)."""

import pytest
import torch

from lightgen import _build, ops

pytestmark = pytest.mark.skipif(not _build.load().compiled, reason="the kernels are not built")


def _same_as_torch(probs: torch.Tensor, seed: int) -> None:
    torch.manual_seed(seed)
    expected, state = torch.multinomial(probs, 1).squeeze(1), torch.get_rng_state()
    torch.manual_seed(seed)
    got = ops.sample_tokens(probs)
    assert torch.equal(got, expected), (seed, got, expected)
    assert torch.equal(torch.get_rng_state(), state), seed  # the stream goes on where torch's would


def _cut(kind: str, scores: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    vocab = scores.shape[-1]
    if kind == "top-k":
        k = int(torch.randint(1, min(vocab, 60) + 1, (1,), generator=generator))
        return scores.masked_fill(scores < scores.topk(k).values[:, -1:], float("-inf"))
    if kind == "top-p":
        ordered, order = scores.softmax(-1).sort(descending=True)
        drop = ordered.cumsum(-1) - ordered > 0.9
        return scores.masked_fill(drop.scatter(1, order, drop), float("-inf"))
    if kind == "one":
        return torch.full_like(scores, float("-inf")).scatter(1, scores.argmax(-1, keepdim=True), 0.0)
    return scores


@pytest.mark.parametrize("kind", ["top-k", "top-p", "full", "one"])
def test_same_tokens_and_generator_state_as_torch_multinomial(kind):
    for seed in range(40):
        generator = torch.Generator().manual_seed(seed)
        rows = int(torch.randint(1, 9, (1,), generator=generator))
        vocab = int(torch.randint(1, 3000, (1,), generator=generator)) if seed % 4 else 50_265
        scores = torch.randn(rows, vocab, generator=generator) * float(torch.rand(1, generator=generator) * 6)
        _same_as_torch(_cut(kind, scores, generator).softmax(-1), seed)


def test_a_probability_too_small_for_its_draw_ties_with_the_zeros_before_it():
    """p / q rounds to 0 for a subnormal p and q > 1; argmax then takes the first 0, a zero-probability token."""
    probs = torch.tensor([[0.0, 1e-45, 0.0], [0.0, 0.0, 1e-45], [1e-45, 0.0, 1e-45]])
    for seed in range(64):
        _same_as_torch(probs, seed)


def test_non_contiguous_probabilities():
    probs = torch.rand(6, 40).softmax(-1)[::2, ::2]
    for seed in range(8):
        _same_as_torch(probs, seed)


@pytest.mark.parametrize("bad, message", [
    (torch.tensor([[0.5, -0.1, 0.6]]), "element < 0"),
    (torch.tensor([[0.5, float("nan"), 0.5]]), "`nan`"),
    (torch.tensor([[0.5, float("inf"), 0.5]]), "`inf`"),
    (torch.tensor([[0.5, 0.5], [0.0, 0.0]]), "sum of probabilities <= 0"),
])
def test_bad_distributions_raise_as_torch_does_and_draw_nothing(bad, message):
    with pytest.raises(RuntimeError, match=message):
        torch.multinomial(bad, 1)
    torch.manual_seed(0)
    state = torch.get_rng_state()
    with pytest.raises(RuntimeError, match=message):
        ops.sample_tokens(bad)
    assert torch.equal(torch.get_rng_state(), state)


def test_other_dtypes_go_to_torch():
    probs = torch.rand(3, 20, dtype=torch.float64).softmax(-1)
    _same_as_torch(probs, 5)
    with pytest.raises(RuntimeError, match="float32"):
        _build.op("sample_tokens")(probs)
