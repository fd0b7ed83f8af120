"""StepGraph's bookkeeping without a GPU: torch.cuda's graph and stream objects replaced by fakes that record
what a capture ran and replay it, so warm-up, capture, replay, recapture on moved addresses, the capture limit
and a failed capture are each checked against eager steps (tests/adapters/test_cuda_parity.py runs the real
thing on a GPU)."""

import contextlib
import warnings

import pytest
import torch

from lightgen.modules import step_graph
from lightgen.modules.kv_cache import StaticKVCache


class FakeGraph:
    """Records the step a capture ran (the fake decoder step registers its replay) and reruns it on replay."""
    capturing = False

    def __init__(self):
        self.replay_step = None

    def capture_begin(self, capture_error_mode):
        assert capture_error_mode == "thread_local"
        FakeGraph.capturing, FakeGraph.current = True, self

    def capture_end(self):
        FakeGraph.capturing = False

    def replay(self):
        self.replay_step()


class FakeStream:
    def __init__(self, device=None):
        pass

    def wait_stream(self, other):
        pass


@pytest.fixture
def fake_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: FakeStream())
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())


class Step:
    """A decode step's shape of work: logits from the tokens and a state tensor read through its address, the
    state advanced on the device, the cache's length on the host. ``fail`` makes a capture raise as an op that
    synchronizes would."""

    def __init__(self, cache):
        self.cache = cache
        self.state = torch.zeros(3)
        self.fail = False

    def __call__(self, tokens):
        if FakeGraph.capturing:
            if self.fail:  # late in the step, after the host's bookkeeping
                self.cache.length += 1
                raise RuntimeError("operation not permitted when stream is capturing")
            state, out = self.state, torch.empty(tokens.shape[0], 3)

            def replay():
                out.copy_(state + tokens.float())
                state.add_(1)

            FakeGraph.current.replay_step = replay
            self.cache.length += 1
            return out
        logits = self.state + tokens.float()
        self.state.add_(1)
        self.cache.length += 1
        return logits


def _steps(graph, step, count, tokens_of=lambda i: torch.full((3, 1), i), move_at=()):
    outputs = []
    for i in range(count):
        if i in move_at:  # what a grown cache does: the state lives elsewhere now
            step.state = step.state.clone()
        outputs.append(graph(tokens_of(i)))
    return outputs


def _graph(step, cache):
    return step_graph.StepGraph(step, lambda: (step.state.data_ptr(),), cache)


# (steps whose addresses move, captures, replays) over 10 steps: the first is the warm-up; with addresses moving at
# every step from 2, captures 1-4 go to steps 1-4 and steps 5-9 run eagerly.
@pytest.mark.parametrize("move_at, captures, replays", [((), 1, 9), ((3,), 2, 9), ((2, 3, 4, 5, 6, 7), 4, 4)],
                         ids=["fixed", "moved-once", "keeps-moving"])
def test_replays_return_the_eager_steps_logits_and_lengths(fake_cuda, move_at, captures, replays):
    cache, eager_cache = (StaticKVCache(1, 3, 1, 16, 2, torch.float32, "cpu") for _ in range(2))
    step, eager = Step(cache), Step(eager_cache)
    graph = _graph(step, cache)
    got = _steps(graph, step, 10, move_at=move_at)
    expected = _steps(eager, eager, 10, move_at=move_at)
    for g, e in zip(got, expected, strict=True):
        assert torch.equal(g, e)
    assert cache.length == eager_cache.length == 10
    assert torch.equal(step.state, eager.state)
    assert (graph.captures, graph.replays) == (captures, replays)


def test_replayed_logits_are_copies(fake_cuda):
    cache = StaticKVCache(1, 3, 1, 16, 2, torch.float32, "cpu")
    step = Step(cache)
    graph = _graph(step, cache)
    third = _steps(graph, step, 3)[2]
    third_again = third.clone()
    graph(torch.zeros(3, 1, dtype=torch.int64))
    assert torch.equal(third, third_again)  # the next replay did not overwrite what a caller holds


def test_a_step_that_cannot_be_captured_runs_eagerly_with_a_warning(fake_cuda, monkeypatch):
    cache, eager_cache = (StaticKVCache(1, 3, 1, 16, 2, torch.float32, "cpu") for _ in range(2))
    step, eager = Step(cache), Step(eager_cache)
    step.fail = True
    graph = _graph(step, cache)
    with pytest.warns(RuntimeWarning, match="could not be captured as a CUDA graph"):
        got = _steps(graph, step, 5)
    expected = _steps(eager, eager, 5)
    assert all(torch.equal(g, e) for g, e in zip(got, expected, strict=True))
    assert cache.length == 5 and graph.replays == 0 and graph.captures == step_graph.MAX_CAPTURES
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        graph(torch.zeros(3, 1, dtype=torch.int64))  # warned once, eager from then on

    monkeypatch.setenv("LIGHTGEN_STRICT", "1")
    step = Step(StaticKVCache(1, 3, 1, 16, 2, torch.float32, "cpu"))
    step.fail = True
    graph = _graph(step, step.cache)
    graph(torch.zeros(3, 1, dtype=torch.int64))
    with pytest.raises(RuntimeError, match="LIGHTGEN_STRICT=1 forbids the fallback"):
        graph(torch.zeros(3, 1, dtype=torch.int64))
