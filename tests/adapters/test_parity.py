"""Patched models compute what the unpatched ones do, for every registered family."""

import copy

import pytest
import torch
from models import BUILDERS, DECODER_ONLY, build, forward_logits, padded_batch, valid_positions

import lightgen

@pytest.mark.parametrize("family", sorted(BUILDERS))
@pytest.mark.parametrize("seed, batch, length", [(0, 1, 1), (1, 3, 9), (2, 4, 16), (3, 2, 31)])
def test_patched_forward_matches_unpatched(family, seed, batch, length):
    model = build(family, seed=seed)
    reference = copy.deepcopy(model)
    ids, mask = padded_batch(family, batch, length, seed=seed)
    expected = forward_logits(reference, family, ids, mask)
    lightgen.accelerate_model(model)
    got = forward_logits(model, family, ids, mask)
    valid = valid_positions(family, mask, expected)
    torch.testing.assert_close(got[valid], expected[valid], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family, implementation",
                         [(family, implementation) for family in DECODER_ONLY for implementation in ("eager", "sdpa")
                          if (family, implementation) != ("gemma2", "sdpa")])  # HF refuses sdpa for Gemma 2
def test_padded_positions_are_the_models_attentions(family, implementation):
    """A left-padded position sees no key: HF's eager softmax spreads it evenly over every key, sdpa gives zeros.
    Neither means anything, but HF returns what follows from them (logits, hidden states, the cache of the
    layers after): the patched model gives its own implementation's, at every position."""
    model = build(family, seed=4)
    model.set_attn_implementation(implementation)
    reference = copy.deepcopy(model)
    ids, mask = padded_batch(family, 4, 9, seed=4)
    assert not mask[:, 0].all()
    expected = forward_logits(reference, family, ids, mask)
    lightgen.accelerate_model(model)
    torch.testing.assert_close(forward_logits(model, family, ids, mask), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family", sorted(set(BUILDERS) - {"bert"}))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_greedy_generate_is_token_identical(family, seed):
    """lightgen's engine, and HF's own loop driving the patched layers through HF's KV cache step by step
    (what every fallback runs): a cache the layers did not update (passed under the other release's name:
    ``cache`` from 5.24, ``past_key_values`` before) would leave each step attending to itself alone."""
    model = build(family, seed=seed)
    reference = copy.deepcopy(model)
    ids, mask = padded_batch(family, 3, 7, seed=seed)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=1)
    expected = reference.generate(**kwargs)
    accelerated = lightgen.accelerate_model(model)
    assert torch.equal(accelerated.generate(**kwargs), expected)
    assert torch.equal(type(accelerated).generate(accelerated, **kwargs), expected)


@pytest.mark.parametrize("family", ["bart", "llama"])
def test_bf16_models_stay_close(family):
    model = build(family, dtype=torch.bfloat16)
    reference = copy.deepcopy(model)
    ids, mask = padded_batch(family, 2, 8)
    expected = forward_logits(reference, family, ids, mask).float()
    got = forward_logits(lightgen.accelerate_model(model), family, ids, mask).float()
    valid = valid_positions(family, mask, expected)
    torch.testing.assert_close(got[valid], expected[valid], atol=0.1, rtol=0.05)


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "phi3", "qwen3", "gpt_neox", "marian", "bart"])
@pytest.mark.parametrize("settings", [dict(), dict(num_beams=3), dict(decoding="iad", max_draft=5)],
                         ids=["greedy", "beams", "iad"])
def test_bf16_generate_is_token_identical(family, settings):
    """bf16 rounds where HF rounds: sdpa's attention weights (fp16 / bf16 kernels), HF's key numbering of a
    sliding-window cache (Mistral, Qwen2, Phi-3 past their windows), the encoder output projected as HF projects it
    (a contiguous tensor) for beams' cross-attention (Marian, BART), and a pass verifying drafts as HF's one-token
    steps would compute them (IAD equals HF's greedy whatever widths its policy picks)."""
    for seed in range(2):
        model = build(family, seed=seed, dtype=torch.bfloat16)
        reference = copy.deepcopy(model)
        ids, mask = padded_batch(family, 4, 9, seed=seed)
        kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=16, min_new_tokens=16)
        expected = reference.generate(**kwargs, num_beams=settings.get("num_beams", 1))
        assert torch.equal(lightgen.accelerate_model(model).generate(**kwargs, **settings), expected)
