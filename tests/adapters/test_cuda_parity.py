"""Patched models on a GPU: token-identical generate() in float32, close logits in float16."""

import copy

import pytest
import torch
from models import DECODER_ONLY, SEQ2SEQ, VOCAB, build, forward_logits, padded_batch, valid_positions

import lightgen

pytestmark = pytest.mark.cuda


def _on_gpu(*tensors):
    return [t.to("cuda") for t in tensors]


@pytest.mark.parametrize("family", SEQ2SEQ + DECODER_ONLY)
@pytest.mark.parametrize("settings", [dict(), dict(num_beams=4),
                                      dict(num_beams=3, num_return_sequences=2, length_penalty=2.0)],
                         ids=["greedy", "beam4", "beam3-return2"])
@pytest.mark.parametrize("seed", [0, 1])
def test_generate_is_token_identical_on_cuda(family, settings, seed, step_counter):
    model = build(family, seed=seed).to("cuda")
    reference = copy.deepcopy(model)
    ids, mask = _on_gpu(*padded_batch(family, 3, 9, seed=seed))
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False, **settings)
    expected = reference.generate(**kwargs)
    got = lightgen.accelerate_model(model).generate(**kwargs)
    assert step_counter, "lightgen's decoder step did not run"
    assert got.shape == expected.shape and torch.equal(got, expected)


@pytest.mark.parametrize("family", ["bart", "marian", "gpt2", "llama"])
def test_fp16_models_stay_close_on_cuda(family):
    model = build(family).to("cuda", torch.float16)
    reference = copy.deepcopy(model)
    ids, mask = _on_gpu(*padded_batch(family, 2, 8))
    expected = forward_logits(reference, family, ids, mask).float()
    got = forward_logits(lightgen.accelerate_model(model), family, ids, mask).float()
    valid = valid_positions(family, mask, expected)
    torch.testing.assert_close(got[valid], expected[valid], atol=0.05, rtol=0.05)


@pytest.fixture
def graph_replays(monkeypatch):
    """Each StepGraph a generate() call made, to show that its steps replayed a CUDA graph."""
    from lightgen.modules.step_graph import StepGraph

    graphs = []
    original = StepGraph.__init__

    def record(self, *args, **kwargs):
        original(self, *args, **kwargs)
        graphs.append(self)

    monkeypatch.setattr(StepGraph, "__init__", record)
    return graphs


@pytest.mark.parametrize("family", ["bart", "marian", "gpt2", "llama", "qwen2", "t5"])
@pytest.mark.parametrize("settings", [dict(), dict(num_beams=4), dict(do_sample=True, top_k=20)],
                         ids=["greedy", "beam4", "sample"])
def test_replayed_steps_equal_eager_steps_and_hf(family, settings, graph_replays, monkeypatch):
    """CUDA-graph steps (the default on a GPU) return the eager steps' tokens, HF's for greedy and beams;
    rows finish at EOS at different steps (a 40-token vocabulary's EOS comes early) and stay in the batch."""
    model = build(family, seed=3).to("cuda")
    reference = copy.deepcopy(model)
    accelerated = lightgen.accelerate_model(model)
    ids, mask = _on_gpu(*padded_batch(family, 4, 7, seed=3))
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=20, **settings)

    def generate(target):
        torch.manual_seed(0)
        return target.generate(**kwargs)

    replayed = generate(accelerated)
    assert graph_replays and sum(graph.replays for graph in graph_replays) > 0
    monkeypatch.setenv("LIGHTGEN_CUDA_GRAPHS", "0")
    eager = generate(accelerated)
    assert torch.equal(replayed, eager)
    if not settings.get("do_sample"):
        assert torch.equal(replayed, generate(reference))


@pytest.mark.parametrize("family", ["bart", "marian", "gpt2", "llama"])
@pytest.mark.parametrize("drafts", ["input", "greedy", "corrupted"])
def test_aggressive_decoding_on_cuda_equals_hf_greedy(family, drafts, monkeypatch):
    """IAD and GAD on a GPU: the loop's bookkeeping runs on the host, the passes on the device; rows finish at
    different passes and leave the batch; exact drafts are verified many tokens a pass."""
    monkeypatch.setenv("LIGHTGEN_FIXED_DRAFTS", "1")  # drafts whole: the pass counts below do not depend on timing
    model = build(family, seed=5).to("cuda")
    reference = copy.deepcopy(model)
    ids, mask = _on_gpu(*padded_batch(family, 4, 9, seed=5))
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=16, do_sample=False)
    expected = reference.generate(**kwargs)
    accelerated = lightgen.accelerate_model(model)
    if drafts == "input":
        out = accelerated.generate(**kwargs, decoding="iad", return_dict_in_generate=True)
    else:
        targets = [row.tolist() for row in expected.cpu()]

        def draft(sources, outputs, block_size):  # greedy's own continuation, every third token wrong if corrupted
            guesses = []
            for output in outputs:
                guess = next(t for t in targets if t[:len(output)] == output)[len(output):len(output) + block_size]
                guesses.append([(t + 1) % VOCAB if drafts == "corrupted" and (len(output) + i) % 3 == 0 else t
                                for i, t in enumerate(guess)])
            return guesses

        out = accelerated.generate(**kwargs, decoding="gad", drafter=draft, block_size=5, return_dict_in_generate=True)
    assert out.sequences.device.type == "cuda" and torch.equal(out.sequences, expected)
    prompt = 1 if family in SEQ2SEQ else ids.shape[1]
    if drafts == "greedy" and expected.shape[1] - prompt > 6:
        assert max(int(row.max()) for row in out.tokens_per_iteration) == 6, "exact drafts: 6 tokens a pass"
