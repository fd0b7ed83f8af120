"""Issue 18's divergence classes, each against the unpatched model (deep copy) as the oracle."""

import copy
import warnings

import pytest
import torch
import transformers as tf
from models import VOCAB, build, padded_batch
from transformers.generation.logits_process import LogitsProcessor, LogitsProcessorList

import lightgen
from lightgen.generation.engine import UnsupportedGenerateArgument


def _pair(model):
    return lightgen.accelerate_model(copy.deepcopy(model)), model


class _WriteAt(LogitsProcessor):
    """A custom processor writing ``value`` (NaN, +inf) into token ``token`` of row ``row`` at step ``at``."""

    def __init__(self, prompt_len, at, row, token, value):
        self.prompt_len, self.at, self.row, self.token, self.value = prompt_len, at, row, token, value

    def __call__(self, input_ids, scores):
        if input_ids.shape[1] - self.prompt_len == self.at:
            scores = scores.clone()
            scores[self.row, self.token] = self.value
        return scores


@pytest.mark.parametrize("family", ["bart", "gpt2"])
@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "posinf"])
def test_beam_search_with_nan_or_inf_scores_returns_what_hf_returns(family, value):
    accelerated, reference = _pair(build(family, seed=1))
    ids, mask = padded_batch(family, 2, 6, seed=1)
    prompt_len = 1 if family == "bart" else ids.shape[1]
    for at in (0, 2):
        kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=6, num_beams=3, return_dict_in_generate=True,
                      output_scores=True, logits_processor=LogitsProcessorList([_WriteAt(prompt_len, at, 1, 7, value)]))
        got, expected = accelerated.generate(**kwargs), reference.generate(**kwargs)
        assert torch.equal(got.sequences, expected.sequences)
        assert torch.equal(got.beam_indices, expected.beam_indices)
        torch.testing.assert_close(got.sequences_scores, expected.sequences_scores, equal_nan=True)


def test_beam_search_with_nan_weights_returns_what_hf_returns():
    model = build("gpt2", seed=2)
    with torch.no_grad():
        model.transformer.h[1].mlp.c_proj.weight[0, 0] = float("nan")
    accelerated, reference = _pair(model)
    ids, mask = padded_batch("gpt2", 2, 5, seed=2)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=4, num_beams=2)
    assert torch.equal(accelerated.generate(**kwargs), reference.generate(**kwargs))


def test_beam_search_ties_from_forced_eos_lists_match_hf():
    # forced_eos_token_id as a list writes the same constant into several tokens: exact ties.
    accelerated, reference = _pair(build("bart", seed=3))
    ids, mask = padded_batch("bart", 3, 7, seed=3)
    for settings in (dict(forced_eos_token_id=[2, 5, 9]), dict(forced_bos_token_id=4, num_return_sequences=3)):
        kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=5, num_beams=3, return_dict_in_generate=True,
                      output_scores=True, **settings)
        got, expected = accelerated.generate(**kwargs), reference.generate(**kwargs)
        assert torch.equal(got.sequences, expected.sequences)
        assert torch.equal(got.beam_indices, expected.beam_indices)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_diverse_beam_search_with_repetition_penalty_and_padding(family):
    """Each group of a zero-penalty diverse search is plain beam search, repetition penalty included: its
    per-row state (the prompt padding to skip) is narrowed to the group's rows."""
    accelerated, reference = _pair(build(family, seed=4))
    ids, mask = padded_batch(family, 3, 7, seed=4)
    common = dict(input_ids=ids, attention_mask=mask, max_new_tokens=8, pad_token_id=0, repetition_penalty=1.5)
    got = accelerated.generate(**common, num_beams=4, num_beam_groups=2, diversity_penalty=0.0,
                               num_return_sequences=2)
    plain = reference.generate(**common, num_beams=2)
    assert torch.equal(got[0::2], plain) and torch.equal(got[1::2], plain)


def _bart_causal_lm():
    torch.manual_seed(5)
    config = tf.BartConfig(vocab_size=VOCAB, d_model=32, decoder_layers=2, decoder_attention_heads=4,
                           decoder_ffn_dim=48, max_position_embeddings=64, pad_token_id=1, bos_token_id=0,
                           eos_token_id=2, is_decoder=True, is_encoder_decoder=False, activation_function="gelu")
    model = tf.BartForCausalLM(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.02)
    return model


@pytest.mark.parametrize("settings", [dict(), dict(num_beams=3), dict(num_beams=2, num_return_sequences=2)])
def test_bart_for_causal_lm_generates_as_hf(settings, step_counter):
    accelerated, reference = _pair(_bart_causal_lm())
    ids, mask = padded_batch("gpt2", 3, 6, seed=5)
    kwargs = dict(input_ids=ids + 3, attention_mask=mask, max_new_tokens=7, **settings)
    assert torch.equal(accelerated.generate(**kwargs), reference.generate(**kwargs))
    assert step_counter, "lightgen's decoder step did not run"


@pytest.mark.parametrize("family", ["gpt2", "bart"])
def test_generate_in_train_mode_falls_back_to_hf_dropout(family, monkeypatch):
    accelerated, reference = _pair(build(family, seed=6))
    accelerated.train(), reference.train()
    ids, mask = padded_batch(family, 2, 5, seed=6)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=5)
    torch.manual_seed(0)
    expected = reference.generate(**kwargs)
    torch.manual_seed(0)
    with pytest.warns(RuntimeWarning, match="applies dropout in train\\(\\) mode"):
        got = accelerated.generate(**kwargs)
    assert torch.equal(got, expected)
    monkeypatch.setenv("LIGHTGEN_STRICT", "1")
    with pytest.raises(UnsupportedGenerateArgument, match="dropout"):
        accelerated.generate(**kwargs)


def test_train_mode_without_active_dropout_stays_on_the_engine(step_counter):
    accelerated, reference = _pair(build("llama", seed=6))  # attention_dropout = 0: train() changes nothing
    accelerated.train()
    ids, mask = padded_batch("llama", 2, 5, seed=6)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=5)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        assert torch.equal(accelerated.generate(**kwargs), reference.generate(**kwargs))
    assert step_counter


def test_output_attentions_on_grouped_query_heads():
    model = build("llama", seed=7)  # 4 query heads, 2 K/V heads
    accelerated, _ = _pair(model)
    eager = copy.deepcopy(model)
    eager.set_attn_implementation("eager")
    ids, mask = padded_batch("llama", 2, 6, seed=7)
    with torch.no_grad():
        got = accelerated(input_ids=ids, attention_mask=mask, output_attentions=True)
        expected = eager(input_ids=ids, attention_mask=mask, output_attentions=True)
    assert len(got.attentions) == len(expected.attentions) == 2
    for mine, theirs in zip(got.attentions, expected.attentions, strict=True):
        torch.testing.assert_close(mine, theirs)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=4, return_dict_in_generate=True,
                  output_attentions=True)
    with warnings.catch_warnings():  # lightgen's engine returns them (no fallback)
        warnings.filterwarnings("error", message="lightgen generate", category=RuntimeWarning)
        out = accelerated.generate(**kwargs)
    expected = eager.generate(**kwargs)
    assert torch.equal(out.sequences, expected.sequences)
    assert out.attentions[0][0].shape[1] == 4
    for mine, theirs in zip(out.attentions[-1], expected.attentions[-1], strict=True):  # a decode step: no padding
        torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=1e-5)


def test_empty_prompt_is_a_clear_error():
    accelerated, _ = _pair(build("gpt2"))
    with pytest.raises(ValueError, match="at least one row and one token"):
        accelerated.generate(input_ids=torch.zeros(1, 0, dtype=torch.long), max_new_tokens=3)


@pytest.mark.parametrize("family", ["bart", "gpt2"])
def test_gad_drafts_outside_the_vocabulary_are_rejected(family):
    accelerated, reference = _pair(build(family, seed=8))
    ids, mask = padded_batch(family, 3, 6, seed=8)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=10)
    expected = reference.generate(**kwargs)

    def bad_drafter(sources, outputs, size):
        return [[-3, 5, VOCAB + 11][row % 3:] + [VOCAB] * size for row in range(len(outputs))]

    def late_bad_drafter(sources, outputs, size):  # a plausible token first, then an impossible one
        return [[output[-1], -1, 4] for output in outputs]

    for drafter in (bad_drafter, late_bad_drafter):
        got = accelerated.generate(**kwargs, decoding="gad", drafter=drafter)
        assert torch.equal(got, expected)


def test_rotary_models_generate_past_max_position_embeddings():
    accelerated, reference = _pair(build("llama", seed=9))  # max_position_embeddings=64
    ids, mask = padded_batch("llama", 2, 10, seed=9)
    for settings in (dict(), dict(num_beams=2)):
        kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=70, min_new_tokens=70, **settings)
        expected = reference.generate(**kwargs)
        assert expected.shape[1] == 80
        assert torch.equal(accelerated.generate(**kwargs), expected)


def test_learned_positions_stop_at_eos_before_the_table_ends_or_fail_where_hf_fails():
    accelerated, reference = _pair(build("bart", seed=10))  # 64 positions
    ids, mask = padded_batch("bart", 2, 8, seed=10)
    early = reference.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, min_new_tokens=4)
    eos = sorted({2, *early[:, 1:3].flatten().tolist()})  # every row reaches one within two tokens
    kwargs = dict(input_ids=ids, attention_mask=mask, max_length=100, eos_token_id=eos)
    expected = reference.generate(**kwargs)  # both rows end at EOS, well inside the table
    assert expected.shape[1] < 64
    assert torch.equal(accelerated.generate(**kwargs), expected)
    never = dict(input_ids=ids, attention_mask=mask, max_new_tokens=80, min_new_tokens=80)
    with pytest.raises(IndexError):
        reference.generate(**never)
    with pytest.raises(IndexError, match="past the model's 64 positions"):
        accelerated.generate(**never)


@pytest.mark.parametrize("family", ["bart", "mbart", "marian", "pegasus", "m2m_100", "t5"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_half_precision_decoder_prompts_give_hfs_logits_bit_for_bit(family, dtype):
    """A decoder prompt of several tokens (decoder_input_ids) in fp16 / bf16, on families whose forward has no
    logits_to_keep: HF's prompt pass runs the LM head over every position, and lightgen's does too, since ATen's half
    matmul can round the last row otherwise than alone. That is rare (a bf16 Pegasus of the half fuzz: 2 of 97 logits
    an ulp apart; test_fuzz's regression seed 712080200445); this sweep holds the whole prompt pass to HF's bits."""
    reference = build(family, seed=3).to(dtype)
    accelerated = lightgen.accelerate_model(copy.deepcopy(reference))
    ids, mask = padded_batch(family, 2, 6, seed=3)
    generator = torch.Generator().manual_seed(3)
    for length in range(2, 9):
        prompt = torch.randint(3, VOCAB, (2, length), generator=generator)
        kwargs = dict(input_ids=ids, attention_mask=mask, decoder_input_ids=prompt, max_new_tokens=2, do_sample=False,
                      return_dict_in_generate=True, output_logits=True, pad_token_id=1)
        expected, got = reference.generate(**kwargs), accelerated.generate(**kwargs)
        assert torch.equal(got.sequences, expected.sequences)
        for mine, theirs in zip(got.logits, expected.logits, strict=True):
            assert torch.equal(mine, theirs), (length, (mine.float() - theirs.float()).abs().max())
