"""What T5/mT5, M2M100/NLLB and Pegasus need beyond the shared per-family tests: Flan-T5's untied, unscaled
LM head, T5's relative position bias at every distance a decode step meets, and M2M100's positions that
skip padding tokens."""

import copy

import pytest
import torch
import transformers as tf
from models import VOCAB, build, lively_t5, padded_batch, t5_config

import lightgen
from lightgen.generation.engine import DECODER_ATTR
from lightgen.modules.position_bias import RelativePositionBias


def _flan_t5(seed=0):
    """Flan-T5 / T5 v1.1: gated-GELU and a checkpoint saved with tie_word_embeddings=False (no output scaling)."""
    torch.manual_seed(seed)
    model = lively_t5(tf.T5ForConditionalGeneration(t5_config(feed_forward_proj="gated-gelu",
                                                              tie_word_embeddings=False))).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.02)
    return model


@pytest.mark.parametrize("settings", [dict(), dict(num_beams=3, num_return_sequences=2), dict(decoding="iad")],
                         ids=["greedy", "beam", "iad"])
def test_flan_t5_generates_like_hf(settings, step_counter):
    reference = _flan_t5(3)
    assert not reference.config.scale_decoder_outputs and reference.config.is_gated_act
    accelerated = lightgen.accelerate_model(copy.deepcopy(reference))
    assert getattr(accelerated, DECODER_ATTR).spec.lm_head_input_scale == 1.0
    ids, mask = padded_batch("t5", 3, 9, seed=3)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
    expected = reference.generate(**kwargs, **{k: v for k, v in settings.items() if k != "decoding"})
    got = accelerated.generate(**kwargs, **settings)
    assert step_counter and torch.equal(got, expected)


def test_flan_t5_forward_matches_hf():
    reference = _flan_t5(4)
    accelerated = lightgen.accelerate_model(copy.deepcopy(reference))
    ids, mask = padded_batch("t5", 4, 11, seed=4)
    kwargs = dict(input_ids=ids, attention_mask=mask, decoder_input_ids=ids[:, :6])
    with torch.no_grad():
        torch.testing.assert_close(accelerated(**kwargs).logits, reference(**kwargs).logits, atol=1e-4, rtol=1e-4)


def test_original_t5_scales_its_tied_lm_head():
    model = lightgen.accelerate_model(build("t5"))
    assert model.config.scale_decoder_outputs
    assert getattr(model, DECODER_ATTR).spec.lm_head_input_scale == pytest.approx(model.config.d_model ** -0.5)


@pytest.mark.parametrize("family", ["t5", "mt5"])
def test_decode_step_bias_is_hf_compute_bias_at_every_distance(family):
    """Queries at positions 0..39 (past the max distance of 12, into the log buckets and beyond) against a
    40-slot cache: HF's bias for a query at ``past`` over ``past + 1`` keys, padded with what causal masking hides."""
    model = build(family)
    attention = model.get_decoder().block[0].layer[0].SelfAttention
    spec = lightgen.accelerate_model(model).__dict__[DECODER_ATTR].spec
    slots = 40
    table = spec.relative_position_bias.table(slots)
    positions = torch.arange(slots).view(-1, 1)  # one row per position, one query each
    got = RelativePositionBias.scores_bias(table, positions, slots)  # [rows, H, 1, slots]
    for past in range(slots):
        expected = attention.compute_bias(1, past + 1, past_seen_tokens=past)[0, :, 0]  # [H, past + 1]
        torch.testing.assert_close(got[past, :, 0, : past + 1], expected, atol=0, rtol=0)
    # A multi-token step (a prompt, an IAD verification pass): HF's bias for queries past..past+3.
    block = RelativePositionBias.scores_bias(table, torch.arange(7, 11).view(1, -1), slots)
    torch.testing.assert_close(block[0, :, :, :11], attention.compute_bias(4, 11, past_seen_tokens=7)[0],
                               atol=0, rtol=0)


@pytest.mark.parametrize("family", ["t5", "mt5"])
@pytest.mark.parametrize("settings", [dict(), dict(num_beams=4), dict(decoding="iad")], ids=["greedy", "beam", "iad"])
def test_long_outputs_reach_the_far_buckets(family, settings):
    """40 new tokens: distances beyond relative_attention_max_distance (12) share the last buckets."""
    reference = build(family, seed=7)
    accelerated = lightgen.accelerate_model(copy.deepcopy(reference))
    ids, mask = padded_batch(family, 2, 14, seed=7)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=40, min_new_tokens=40, do_sample=False)
    if "decoding" in settings:
        kwargs.pop("min_new_tokens")  # IAD runs no logits processors
    expected = reference.generate(**kwargs, **{k: v for k, v in settings.items() if k != "decoding"})
    assert torch.equal(accelerated.generate(**kwargs, **settings), expected)


def test_t5_with_mixed_dtypes_is_a_clear_error():
    model = build("t5").to(torch.bfloat16)
    for block in model.get_decoder().block:  # what from_pretrained(dtype=bfloat16) does (_keep_in_fp32_modules)
        block.layer[-1].DenseReluDense.wo.float()
    with pytest.raises(lightgen.UnsupportedModelError, match="mixed parameter dtypes.*model.to"):
        lightgen.accelerate_model(model)
    assert not any("forward" in vars(m) for m in model.modules())  # nothing left patched


@pytest.mark.parametrize("num_beams", [1, 3])
def test_m2m_100_padding_tokens_take_no_position(num_beams, step_counter):
    """fairseq's make_positions: a decoder prompt with a padding token inside is numbered by a cumulative sum
    of real tokens, and a padding token decoded later reads the zero row. A bias towards the padding id makes
    the model emit it mid-sequence."""
    reference = build("m2m_100", seed=4)
    accelerated = lightgen.accelerate_model(copy.deepcopy(reference))
    pad = reference.config.pad_token_id
    ids, mask = padded_batch("m2m_100", 3, 8, seed=4)
    prompt = torch.tensor([[2, pad, 7]] * 3)
    kwargs = dict(input_ids=ids, attention_mask=mask, decoder_input_ids=prompt, max_new_tokens=12, do_sample=False,
                  num_beams=num_beams, sequence_bias={(pad,): 4.0}, eos_token_id=VOCAB + 1)
    expected = reference.generate(**kwargs)
    assert (expected[:, prompt.shape[1]:-1] == pad).any(), "the test needs padding tokens emitted mid-sequence"
    assert torch.equal(accelerated.generate(**kwargs), expected)
    assert step_counter


@pytest.mark.parametrize("family", ["t5", "m2m_100"])
def test_bf16_models_stay_close(family):
    model = build(family, dtype=torch.bfloat16)
    reference = copy.deepcopy(model)
    ids, mask = padded_batch(family, 2, 8)
    kwargs = dict(input_ids=ids, attention_mask=mask, decoder_input_ids=ids[:, :4])
    with torch.no_grad():
        expected = reference(**kwargs).logits.float()
        got = lightgen.accelerate_model(model)(**kwargs).logits.float()
    torch.testing.assert_close(got, expected, atol=0.1, rtol=0.05)
