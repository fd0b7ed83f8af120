import pytest
import torch

from lightgen import ops

INF = float("inf")
# (B, beams, V): from a one-token vocabulary up to a real one, one beam up to eight.
SHAPES = [(1, 1, 1), (2, 4, 1), (3, 3, 2), (1, 1, 7), (4, 5, 16), (5, 8, 33), (2, 2, 1000), (1, 4, 32000),
          (3, 8, 32000), (5, 1, 32000)]


def _scores(rows, vocab, kind, gen):
    if kind == "ties":  # integer-valued: exact ties within and across beams
        return torch.randint(-3, 4, (rows, vocab), generator=gen).float()
    # Spread like a language model's logits, with a few tokens far ahead as a trained head has.
    scores = torch.randn(rows, vocab, generator=gen) * 4
    peaks = torch.randint(0, vocab, (rows, 3), generator=gen)
    scores.scatter_add_(1, peaks, torch.rand(rows, 3, generator=gen) * 10 + 5)
    if kind == "masked":
        scores[torch.rand(rows, vocab, generator=gen) < 0.3] = -INF
        scores[::3] = -INF  # whole rows, e.g. every token banned
    return scores


def _beam_scores(rows, gen):
    beam_scores = -torch.rand(rows, generator=gen) * 20
    beam_scores[1::4] = -1e9  # finished beams, as transformers marks them
    beam_scores[2::5] = -INF
    return beam_scores


def _ks(beams, vocab):
    return sorted({k for k in (1, beams, 2 * beams, beams * vocab) if k <= beams * vocab})


def _assert_matches_reference(scores, beam_scores, beams, k, log_softmax):
    values, indices, survivors = ops.beam_topk(scores, beam_scores, beams, k, log_softmax)
    ref_values, ref_indices, ref_survivors = ops.beam_topk_ref(scores, beam_scores, beams, k, log_softmax)
    # Raw scores are only added to; log_softmax may differ from ATen's by rounding.
    tolerance = dict(atol=1e-6, rtol=1e-6) if log_softmax else dict(atol=0, rtol=0)
    torch.testing.assert_close(values, ref_values, **tolerance)
    torch.testing.assert_close(indices, ref_indices, atol=0, rtol=0)
    torch.testing.assert_close(survivors, ref_survivors, atol=0, rtol=0)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}x{}xV{}".format(*s))
@pytest.mark.parametrize("kind", ["lm", "ties", "masked"])
@pytest.mark.parametrize("log_softmax", [True, False], ids=["log_softmax", "raw"])
@pytest.mark.parametrize("with_beam_scores", [True, False], ids=["beam_scores", "no_beam_scores"])
def test_matches_reference(shape, kind, log_softmax, with_beam_scores):
    batch, beams, vocab = shape
    gen = torch.Generator().manual_seed(batch * 1000 + beams * 100 + vocab)
    scores = _scores(batch * beams, vocab, kind, gen)
    beam_scores = _beam_scores(batch * beams, gen) if with_beam_scores else None
    for k in _ks(beams, vocab):
        _assert_matches_reference(scores, beam_scores, beams, k, log_softmax)


@pytest.mark.parametrize("batch", [1, 8])
def test_matches_the_composite_transformers_runs(batch):
    # Tie-free logits, so torch.topk's order is the only possible one.
    beams, vocab, k = 4, 32000, 8
    gen = torch.Generator().manual_seed(batch)
    scores = torch.randn(batch * beams, vocab, generator=gen) * 4
    beam_scores = -torch.rand(batch * beams, generator=gen)
    expected = torch.topk((torch.log_softmax(scores, -1) + beam_scores[:, None]).view(batch, -1), k)
    values, indices, _ = ops.beam_topk(scores, beam_scores, beams, k, True)
    torch.testing.assert_close(values, expected.values, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(indices, expected.indices, atol=0, rtol=0)


def test_rough_threshold_keeps_few_candidates():
    beams, vocab, k = 4, 32000, 8
    gen = torch.Generator().manual_seed(0)
    scores = _scores(3 * beams, vocab, "lm", gen)
    _, _, survivors = ops.beam_topk(scores, -torch.rand(3 * beams, generator=gen), beams, k, True)
    assert (survivors >= k).all() and (survivors < beams * vocab // 100).all(), survivors


def test_stable_ties_go_to_the_smaller_flat_index():
    values, indices, _ = ops.beam_topk(torch.zeros(6, 5), None, 3, 7, False, stable=True)
    torch.testing.assert_close(indices, torch.arange(7).expand(2, 7), atol=0, rtol=0)
    torch.testing.assert_close(values, torch.zeros(2, 7), atol=0, rtol=0)


def test_masked_candidates_sort_last():
    scores = torch.full((4, 3), -INF)
    scores[1, 2] = 0.5
    beam_scores = torch.tensor([0.0, -1.0, -INF, 0.0])
    values, indices, survivors = ops.beam_topk(scores, beam_scores, 2, 6, True, stable=True)
    torch.testing.assert_close(values, torch.tensor([[-1.0] + [-INF] * 5, [-INF] * 6]), atol=0, rtol=0)
    torch.testing.assert_close(indices, torch.tensor([[5, 0, 1, 2, 3, 4], [0, 1, 2, 3, 4, 5]]), atol=0, rtol=0)
    torch.testing.assert_close(survivors, torch.tensor([6, 6]), atol=0, rtol=0)
    _assert_orders_like_torch_topk(scores, beam_scores, 2, 6, True)


def _assert_orders_like_torch_topk(scores, beam_scores, beams, k, log_softmax):
    """The composite transformers' ``_get_top_k_continuations`` runs: torch.topk over [B, beams * V]."""
    candidates = ops.beam_topk_ref.__globals__["_candidates"](scores, beam_scores, log_softmax)
    expected = torch.topk(candidates.reshape(scores.shape[0] // beams, -1), k)
    values, indices, _ = ops.beam_topk(scores, beam_scores, beams, k, log_softmax)
    torch.testing.assert_close(indices, expected.indices, atol=0, rtol=0)
    torch.testing.assert_close(values, expected.values, atol=0, rtol=0)


def test_ties_in_the_issue_repro_are_ordered_as_torch_topk():
    # V=150, 3 beams, two tokens at 0 and the rest -inf, the first step's beam scores [0, -1e9, -1e9], top 6.
    scores = torch.full((3, 150), -INF)
    scores[:, 2] = scores[:, 134] = 0.0
    beam_scores = torch.tensor([0.0, -1e9, -1e9])
    _assert_orders_like_torch_topk(scores, beam_scores, 3, 6, False)
    expected = torch.topk((scores + beam_scores[:, None]).view(1, -1), 6)
    assert not torch.equal(expected.indices, torch.sort(expected.indices).values)  # index order would be wrong


def _tie_pattern(rows, vocab, pattern, gen):
    if pattern == "constant":
        return torch.zeros(rows, vocab)
    if pattern == "few_levels":  # two or three distinct values: ties everywhere, also across beams
        return torch.randint(0, 3, (rows, vocab), generator=gen).float()
    if pattern == "forced":  # one token allowed (forced BOS/EOS), or a few (forced EOS given as a list)
        scores = torch.full((rows, vocab), -INF)
        allowed = torch.randint(0, vocab, (int(torch.randint(1, 4, (1,), generator=gen)),), generator=gen)
        scores[:, allowed] = 0.0
        return scores
    if pattern == "identical_beams":  # every beam the same row, as on the first step
        return (torch.randn(1, vocab, generator=gen) * 3).round().expand(rows, vocab).contiguous()
    scores = torch.randn(rows, vocab, generator=gen)  # "sparse": LM-like with a few duplicated values
    duplicates = torch.randint(0, vocab, (rows, max(1, vocab // 8)), generator=gen)
    return scores.scatter(1, duplicates, scores.gather(1, duplicates[:, :1]).expand_as(duplicates))


@pytest.mark.parametrize("pattern", ["constant", "few_levels", "forced", "identical_beams", "sparse"])
@pytest.mark.parametrize("log_softmax", [True, False], ids=["log_softmax", "raw"])
def test_ties_are_ordered_as_torch_topk(pattern, log_softmax):
    """Property: over many sizes (both sides of torch's k * 64 <= n switch between partial_sort and
    nth_element) and every k class, the kernel returns torch.topk's values and indices, ties included."""
    gen = torch.Generator().manual_seed(len(pattern) * 7 + log_softmax)
    for case in range(60):
        batch = int(torch.randint(1, 4, (1,), generator=gen))
        beams = int(torch.randint(1, 7, (1,), generator=gen))
        vocab = int(torch.tensor([1, 2, 5, 13, 63, 64, 150, 300, 1001])[torch.randint(0, 9, (1,), generator=gen)])
        scores = _tie_pattern(batch * beams, vocab, pattern, gen)
        beam_scores = None
        if case % 3:
            beam_scores = torch.zeros(batch * beams)
            beam_scores.view(batch, beams)[:, 1:] = -1e9 if case % 3 == 1 else -torch.randint(
                0, 3, (batch, beams - 1), generator=gen).float()
        n = beams * vocab
        for k in sorted({min(n, k) for k in (1, 2, 2 * beams, 3 * beams, max(1, n // 64), n // 64 + 1, n)}):
            _assert_orders_like_torch_topk(scores, beam_scores, beams, k, log_softmax)


def test_non_contiguous_scores_are_accepted():
    scores = torch.randn(8, 200)[:, ::2]
    _assert_matches_reference(scores, torch.randn(8), 4, 5, True)


@pytest.mark.parametrize(
    "args, message",
    [
        ((torch.tensor([[0.0, float("nan")]]), None, 1, 1, True), "row 0 contains NaN or \\+inf"),
        ((torch.tensor([[0.0], [INF]]), None, 1, 1, False), "row 1 contains NaN or \\+inf"),
        ((torch.zeros(2, 3), torch.tensor([0.0, float("nan")]), 2, 1, True), "'beam_scores' row 1 is nan"),
        ((torch.zeros(2, 3).double(), None, 2, 1, True), "'scores' must be float32"),
        ((torch.zeros(6), None, 2, 1, True), "'scores' must be \\[B \\* beams, V\\]"),
        ((torch.zeros(3, 4), None, 2, 1, True), "the 3 rows of 'scores' are not a multiple of 2 beams"),
        ((torch.zeros(2, 4), None, 0, 1, True), "'beams' must be >= 1"),
        ((torch.zeros(2, 4), None, 2, 0, True), "'k' must be in \\[1, beams \\* V\\] = \\[1, 8\\], got 0"),
        ((torch.zeros(2, 4), None, 2, 9, True), "got 9"),
        ((torch.zeros(2, 4), torch.zeros(3), 2, 1, True), "'beam_scores' must have shape"),
        ((torch.zeros(2, 4), torch.zeros(2).half(), 2, 1, True), "'beam_scores' must be float32"),
    ],
)
def test_bad_inputs_raise_clear_errors(args, message):
    with pytest.raises(RuntimeError, match=message):
        ops.beam_topk(*args)


@pytest.mark.parametrize("with_beam_scores", [True, False])
@pytest.mark.parametrize("log_softmax", [True, False])
def test_opcheck(with_beam_scores, log_softmax):
    gen = torch.Generator().manual_seed(0)
    scores = _scores(6, 50, "lm", gen)
    beam_scores = _beam_scores(6, gen) if with_beam_scores else None
    torch.library.opcheck(torch.ops.lightgen.beam_topk.default, (scores, beam_scores, 3, 4, log_softmax))


@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (8, 32000), (2, 9, 3000), (4, 1, 50)])
@pytest.mark.parametrize("kind", ["logits", "ties", "masked"])
def test_greedy_tokens_is_argmax(shape, kind):
    gen = torch.Generator().manual_seed(len(shape) * shape[-1])
    rows = int(torch.tensor(shape[:-1]).prod())
    scores = _scores(rows, shape[-1], kind, gen).view(shape)
    assert torch.equal(ops.greedy_tokens(scores), scores.argmax(-1))


@pytest.mark.parametrize("bad", [float("nan"), INF])
def test_greedy_tokens_takes_torch_argmax_where_the_kernel_refuses(bad):
    scores = torch.randn(3, 40)
    scores[1, 7] = bad
    scores[2, 3] = bad
    assert torch.equal(ops.greedy_tokens(scores), scores.argmax(-1))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_greedy_tokens_of_other_dtypes_and_empty_batches(dtype):
    scores = torch.randn(4, 100).to(dtype)
    assert torch.equal(ops.greedy_tokens(scores), scores.argmax(-1))
    assert ops.greedy_tokens(torch.empty(0, 100)).shape == (0,)
