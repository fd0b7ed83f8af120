"""Adaptive draft lengths (draft_policy.py): wrong drafts fall back to greedy passes, good drafts keep
drafting, and the tokens stay greedy's; the vectorised IAD drafter matches its list form."""

import itertools
import random

import numpy as np

import pytest
import torch
from models import SEQ2SEQ

from lightgen.generation import aggressive
from lightgen.generation.aggressive import CopyFromInput, find_anchor
from lightgen.generation.draft_policy import AcceptanceHistory, DraftPolicy, FixedPassCost, PassCost
from lightgen.modules.decoder import Decoder
from tests.generation.test_gad import _greedy, _oracle

# A compute-bound machine: a pass over n positions costs 1 + n/2 (a greedy step over 4 rows: 3).
COMPUTE_BOUND = FixedPassCost(1.0, 0.5)


@pytest.fixture
def widths(monkeypatch):
    """The tokens per row of every decoder pass after the prompt pass."""
    seen = []
    original = Decoder.step

    def step(self, state, tokens, *args, **kwargs):
        seen.append(tokens.shape[1])
        return original(self, state, tokens, *args, **kwargs)

    monkeypatch.setattr(Decoder, "step", step)
    return seen


def _with_cost(monkeypatch, cost):
    monkeypatch.setattr(aggressive, "default_cost", lambda decoder: cost)
    monkeypatch.setattr(aggressive, "default_history", lambda decoder, drafter: AcceptanceHistory())


@pytest.mark.parametrize("family", ["bart", "gpt2", "llama"])
def test_always_wrong_drafts_fall_to_greedy_passes_and_equal_greedy(family, monkeypatch, widths):
    _with_cost(monkeypatch, COMPUTE_BOUND)
    accelerated, _, expected, kwargs = _greedy(family, 3, batch=4, new_tokens=24)
    got = accelerated.generate(**kwargs, decoding="gad", drafter=_oracle(expected, corrupt_every=1), block_size=6)
    assert torch.equal(got, expected)
    passes = widths[1:] if family not in SEQ2SEQ else widths
    drafting = [width for width in passes if width > 1]
    # A few rejected drafts teach the policy, then one-token probes at doubling waits.
    assert len(drafting) <= 8 and max(drafting[3:], default=2) == 2, widths
    assert len(passes) - len(drafting) >= 12


@pytest.mark.parametrize("family", ["bart", "gpt2"])
def test_good_drafts_keep_drafting_when_passes_are_compute_bound(family, monkeypatch, widths):
    _with_cost(monkeypatch, COMPUTE_BOUND)
    accelerated, _, expected, kwargs = _greedy(family, 3, batch=4, new_tokens=24)
    out = accelerated.generate(**kwargs, decoding="gad", drafter=_oracle(expected), block_size=6,
                               return_dict_in_generate=True)
    assert torch.equal(out.sequences, expected)
    longest = max(int(row.sum()) for row in out.tokens_per_iteration)
    if longest > 8:
        assert int(out.iterations.max()) < longest / 2


@pytest.mark.parametrize("family", ["marian", "qwen2"])
def test_drafts_good_then_bad_equal_greedy_under_a_measured_cost(family, monkeypatch):
    """The default cost (measured on this decoder) with drafts right for a while, then wrong."""
    accelerated, _, expected, kwargs = _greedy(family, 4, batch=3, new_tokens=24)
    good, bad = _oracle(expected), _oracle(expected, corrupt_every=1)

    def drafter(sources, outputs, block_size):
        return good(sources, outputs, block_size) if len(outputs[0]) < 14 else bad(sources, outputs, block_size)

    monkeypatch.setattr(aggressive, "default_cost", aggressive.measured_cost)
    for _ in range(2):  # the second call starts from the cost the first measured
        assert torch.equal(accelerated.generate(**kwargs, decoding="gad", drafter=drafter, block_size=5), expected)


def test_policy_shrinks_rejected_rows_probes_at_doubling_waits_and_recovers():
    policy = DraftPolicy(2, COMPUTE_BOUND)
    limits = torch.tensor([8, 8])
    planned = []
    for _ in range(40):
        sizes = policy.plan(limits)
        width = policy.width(sizes)
        planned.append(width)
        if width:
            policy.observe(torch.full((2,), width), torch.zeros(2, dtype=torch.long))
    assert planned[0] >= 1 and 0 in planned[:6]
    probes = [index for index, width in enumerate(planned) if index > 6 and width]
    assert set(planned[7:]) <= {0, 1} and len(probes) >= 2
    gaps = [b - a for a, b in itertools.pairwise(probes)]
    assert gaps == sorted(gaps) and gaps[-1] > gaps[0]
    # Drafts that pass again: the rows draft more than one token again.
    for _ in range(80):  # the next probe comes after the longest wait
        sizes = policy.plan(limits)
        width = policy.width(sizes)
        if width:
            policy.observe(torch.full((2,), width), torch.full((2,), width))
    assert policy.width(policy.plan(limits)) > 1


def test_flat_cost_drafts_in_full_and_rows_are_their_own():
    policy = DraftPolicy(3, FixedPassCost())
    assert policy.plan(torch.tensor([5, 5, 2])).tolist() == [5, 5, 2]
    for _ in range(6):  # row 0 always wrong, row 1 always right
        policy.observe(torch.tensor([5, 5, 0]), torch.tensor([0, 5, 0]))
    p = policy.acceptance()
    assert float(p[0]) < 0.3 and float(p[2]) == pytest.approx(2 / 3) and float(p[1]) > 0.9
    sizes = policy.plan(torch.tensor([16, 16, 16]))
    assert sizes[0] <= 2 and sizes[1] == 16 and policy.width(sizes) == 16
    policy.keep(torch.tensor([1]))
    assert policy.acceptance().shape == (1,) and float(policy.acceptance()[0]) == float(p[1])


def test_new_rows_start_from_what_earlier_calls_accepted():
    history = AcceptanceHistory()
    assert history.prior() == (2.0, 1.0)  # nothing seen: p = 2/3, first drafts of 7 tokens
    assert DraftPolicy(1, FixedPassCost(), history).plan(torch.tensor([16])).tolist() == [7]
    policy = DraftPolicy(2, FixedPassCost(), history)
    for _ in range(5):  # a copying workload: 15 of 16 draft tokens kept
        policy.observe(torch.tensor([16, 0]), torch.tensor([15, 0]))
    policy.finish()
    assert history.prior() == pytest.approx((3 * 15 / 16, 3 / 16))
    assert DraftPolicy(1, FixedPassCost(), history).plan(torch.tensor([16])).tolist() == [16]
    for _ in range(8):  # then calls whose drafts are rejected at once (chat): the old calls fade
        chat = DraftPolicy(1, FixedPassCost(), history)
        for _ in range(10):
            chat.observe(torch.tensor([3]), torch.tensor([0]))
        chat.finish()
    p = float(DraftPolicy(1, FixedPassCost(), history).acceptance()[0])
    assert p == pytest.approx(0.1)  # the floor: rows still draft a token, and learn again
    assert DraftPolicy(1, FixedPassCost(), history).plan(torch.tensor([16])).tolist() == [1]
    every = AcceptanceHistory()
    every.add(50.0, 0.0)
    assert every.prior() == pytest.approx((3 * 0.98, 3 * 0.02))  # never certain: p^i still falls


@pytest.mark.parametrize("family", ["bart", "llama"])
def test_a_second_call_drafts_in_full_from_its_first_pass(family, monkeypatch, widths):
    """Drafts that were always right in the first call: the second call's first drafts are whole (the first
    call's were cut by the 2/3 prior), its tokens still greedy's; the history is per drafter type."""
    monkeypatch.setattr(aggressive, "default_cost", lambda decoder: FixedPassCost())
    accelerated, _, expected, kwargs = _greedy(family, 3, batch=2, new_tokens=24)
    calls = []
    for _ in range(2):
        widths.clear()
        assert torch.equal(accelerated.generate(**kwargs, decoding="gad", drafter=_oracle(expected), block_size=12),
                           expected)
        calls.append(list(widths[1:] if family not in SEQ2SEQ else widths))
    assert calls[0][0] == 1 + 7 and calls[1][0] == 1 + 12, calls
    assert len(calls[1]) < len(calls[0])


def test_histories_are_per_decoder_and_drafter_type():
    from lightgen.generation.draft_policy import measured_history

    class Wrapper:
        def __init__(self, decoder):
            self.decoder = decoder  # fairseq's per-call scoring wrapper

    first, second = Decoder.__new__(Decoder), Decoder.__new__(Decoder)
    copy = CopyFromInput([[1, 2, 3]])
    assert measured_history(first, copy) is measured_history(Wrapper(first), CopyFromInput([[4]]))
    assert measured_history(first, copy) is not measured_history(second, copy)
    assert measured_history(first, copy) is not measured_history(first, object())


def test_pass_cost_fits_the_fastest_time_per_width():
    cost, rng = PassCost(), random.Random(0)
    assert cost.line() == (1.0, 0.0)  # nothing measured: all widths alike
    for _ in range(6):
        for positions in (4, 8, 16, 32):
            cost.observe(positions, 0.01 + 0.001 * positions + rng.random() * 0.02)  # load only adds time
        for positions in (4, 8, 16, 32):
            cost.observe(positions, 0.01 + 0.001 * positions)
    a, b = cost.line()
    assert a == pytest.approx(0.01) and b == pytest.approx(0.001)


def test_pass_cost_forgets_the_oldest_count_beyond_its_limit():
    cost = PassCost(counts=2)
    cost.observe(1, 5.0)  # an outlier that would bend the line, then evicted by two newer counts
    cost.observe(2, 0.2)
    cost.observe(4, 0.4)
    assert cost.line() == pytest.approx((0.1 * 0.2, 0.1))  # through (2, 0.2) and (4, 0.4), the intercept floored
    cost.observe(2, 0.1)  # the faster half of count 2's window: 0.1
    a, b = cost.line()
    assert (a, b) == pytest.approx((0.1 * 0.1, 0.15))


@pytest.mark.parametrize("load", ["exponential", "spikes", "heavy"])
def test_pass_cost_is_not_steepened_by_widths_seen_less_often(load):
    """Under load a wide count seen twice must not look dearer than the greedy width seen in a full window
    (by the minimum up to 1.4x here: the likely reason copy-heavy demo rows drafted one token on a loaded machine)."""
    rng = random.Random(1)
    slow = {"exponential": lambda: rng.expovariate(1.0), "heavy": lambda: rng.expovariate(0.3),
            "spikes": lambda: (rng.random() < 0.1) * rng.uniform(2, 10) + 0.1 * rng.random()}[load]
    true_a, true_b = 0.02, 0.0005
    ratios = []
    for _ in range(400):
        cost = PassCost()
        for positions, seen in ((8, 8), (24, 2), (40, 2)):  # greedy over 8 rows, then drafts of 2 and 4
            for _ in range(seen):
                cost.observe(positions, (true_a + true_b * positions) * (1 + slow()))
        a, b = cost.line()
        ratios.append(((a + 40 * b) / (a + 8 * b)) / ((true_a + 40 * true_b) / (true_a + 8 * true_b)))
    assert 0.85 < sorted(ratios)[len(ratios) // 2] < 1.15  # by the minimum: 1.02-1.38


def test_pass_cost_counts_the_whole_iteration_since_the_last_pass():
    """Drafting and bookkeeping between passes cost as much per pass as the decoder; the line gets both."""
    policy = DraftPolicy(1, PassCost())
    policy.timed(4, 10.0, 10.5)  # the call's first pass: its own 0.5 s
    policy.timed(8, 11.0, 11.5)  # 0.5 s of drafting and acceptance before it
    assert [list(times) for times in policy.cost._times.values()] == [[0.5], [1.0]]


def test_near_best_widths_go_to_the_longer_draft():
    """Copied text is accepted in longer runs than the geometric p^i: the widest width within RATE_TOLERANCE of
    the best expected rate is taken, not the best alone."""
    from lightgen.generation.draft_policy import RATE_TOLERANCE

    a, b = 1.0, 0.15  # the best expected rate at K = 8, within 5% of it up to K = 13
    policy = DraftPolicy(1, FixedPassCost(a, b))
    policy.accepted, policy.rejected = np.array([25.0]), np.array([2.0])  # p = 27 / 30 = 0.9
    places = np.arange(17)
    rate = (1 + np.concatenate([[0.0], np.cumsum(0.9 ** places[1:])])) / (a + b * (1 + places))
    best, chosen = int(rate.argmax()), int(policy.plan(torch.tensor([16]))[0])
    assert chosen > best and rate[chosen] >= (1 - RATE_TOLERANCE) * rate.max()
    assert chosen == 16 or rate[chosen + 1] < (1 - RATE_TOLERANCE) * rate.max()


def _find_anchor_by_scanning(output, source):
    for size in (1, 2, 3):
        if size > len(output):
            return None
        starts = [i for i in range(len(source) - size + 1) if source[i:i + size] == output[-size:]]
        if len(starts) == 1:
            return starts[0] + size
    return None


def test_indexed_anchors_and_tensor_drafts_match_scanning():
    rng = random.Random(0)
    sources = [[rng.randrange(6) for _ in range(rng.randrange(0, 20))] for _ in range(30)]
    drafter = CopyFromInput(sources)
    for _ in range(20):
        rows = rng.sample(range(30), 8)
        outputs = [[rng.randrange(6) for _ in range(rng.randrange(1, 9))] for _ in rows]
        sizes = [rng.randrange(0, 7) for _ in rows]
        for output, row in zip(outputs, rows):
            assert find_anchor(output, sources[row]) == _find_anchor_by_scanning(output, sources[row])
        lists = drafter.draft(rows, outputs, sizes)
        tensor = drafter.draft_tensor(torch.tensor(rows), [output[-3:] for output in outputs], torch.tensor(sizes))
        assert [[t for t in row if t >= 0] for row in tensor.tolist()] == lists
        assert all(set(row[len(draft):]) <= {-1} for row, draft in zip(tensor.tolist(), lists))
