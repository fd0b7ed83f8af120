"""Issue 20's decoder-only families beyond what the shared matrix (tests/models.py) covers: config
variants, HF's sliding-window layer choice, and the models that generate off the engine."""

import copy
import warnings

import pytest
import torch
import transformers as tf
from models import VOCAB, build, forward_logits, padded_batch

import lightgen
from lightgen.generation.engine import UnsupportedGenerateArgument

VARIANTS = {
    # OPT-350m's shape: post-LN blocks, embeddings narrower than the model (project_in / project_out).
    "opt_post_ln_projected": ("opt", lambda: tf.OPTForCausalLM(tf.OPTConfig(
        vocab_size=VOCAB, hidden_size=36, num_hidden_layers=2, num_attention_heads=3, ffn_dim=40,
        max_position_embeddings=64, word_embed_proj_dim=20, do_layer_norm_before=False, pad_token_id=1,
        bos_token_id=2, eos_token_id=2))),
    "opt_plain_layer_norms": ("opt", lambda: tf.OPTForCausalLM(tf.OPTConfig(
        vocab_size=VOCAB, hidden_size=36, num_hidden_layers=2, num_attention_heads=3, ffn_dim=40,
        max_position_embeddings=64, layer_norm_elementwise_affine=False, pad_token_id=1, bos_token_id=2,
        eos_token_id=2))),
    "gpt_neox_sequential": ("gpt_neox", lambda: tf.GPTNeoXForCausalLM(tf.GPTNeoXConfig(
        vocab_size=VOCAB, hidden_size=40, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48,
        max_position_embeddings=64, rotary_pct=1.0, use_parallel_residual=False, bos_token_id=2, eos_token_id=1,
        pad_token_id=0))),
    "qwen3_sliding": ("qwen3", lambda: tf.Qwen3ForCausalLM(tf.Qwen3Config(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=2,
        head_dim=10, intermediate_size=40, max_position_embeddings=64, use_sliding_window=True, sliding_window=4,
        max_window_layers=1, pad_token_id=0, bos_token_id=2, eos_token_id=1))),
}


def _variant(name, seed):
    torch.manual_seed(seed)
    model = VARIANTS[name][1]().eval()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.02)
    return model


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_variants_match_hf_forward_generate_and_restore(name, step_counter):
    family = VARIANTS[name][0]
    model = _variant(name, seed=3)
    reference = copy.deepcopy(model)
    ids, mask = padded_batch(family, 3, 13, seed=3)
    expected = forward_logits(reference, family, ids, mask)
    lightgen.accelerate_model(model)
    torch.testing.assert_close(forward_logits(model, family, ids, mask)[mask.bool()], expected[mask.bool()],
                               atol=1e-4, rtol=1e-4)
    for settings in (dict(), dict(num_beams=3, num_return_sequences=2), dict(decoding="iad")):
        kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=10, do_sample=False)
        hf = reference.generate(**kwargs, **{k: v for k, v in settings.items() if k != "decoding"})
        assert torch.equal(model.generate(**kwargs, **settings), hf)
    assert step_counter
    lightgen.restore_model(model)
    assert torch.equal(forward_logits(model, family, ids, mask), expected)


@pytest.mark.parametrize("family, windows", [
    ("mistral", [6, 6]), ("qwen2", [0, 5]), ("phi3", [7, 7]), ("qwen3", [0, 0]), ("gemma", [0, 0]),
    ("gemma2", [5, 0, 5]), ("gemma3_text", [5, 0, 5]), ("llama", [0, 0])])
def test_each_layer_gets_the_window_hf_gives_it(family, windows):
    """Qwen2/3 window the layers from max_window_layers on, Gemma 2/3 alternate, Mistral and Phi-3 window all."""
    model = lightgen.accelerate_model(build(family))
    assert [layer.self_attn.window for layer in model._lightgen_decoder.spec.layers] == windows
    assert [layer.self_attn.window for layer in
            lightgen.accelerate_model(_variant("qwen3_sliding", 0))._lightgen_decoder.spec.layers] == [0, 4, 4]


def _bidirectional_gemma3():
    torch.manual_seed(0)
    return tf.Gemma3ForCausalLM(tf.Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=12, intermediate_size=40, max_position_embeddings=64, sliding_window=4, pad_token_id=0,
        bos_token_id=2, eos_token_id=1, use_bidirectional_attention=True)).eval()


def _bert_lm_head():
    torch.manual_seed(0)
    return tf.BertLMHeadModel(tf.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                            num_attention_heads=4, intermediate_size=48, max_position_embeddings=64,
                                            is_decoder=True)).eval()


def _gpt2_with_cross_attention():
    torch.manual_seed(0)
    return tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                            add_cross_attention=True)).eval()


@pytest.mark.parametrize("make, reason", [(_bidirectional_gemma3, "use_bidirectional_attention"),
                                          (_bert_lm_head, "does not run bert models"),
                                          (_gpt2_with_cross_attention, "sets add_cross_attention")],
                         ids=["gemma3", "bert", "gpt2"])
def test_models_off_the_engine_warn_and_keep_lightgen_arguments_out_of_hf(make, reason, monkeypatch):
    """These used to run HF's loop silently, and decoding='iad' then failed inside HF ('model_kwargs ... not
    used: ['decoding']')."""
    reference = make()
    accelerated = lightgen.accelerate_model(copy.deepcopy(reference))
    assert not hasattr(accelerated, "_lightgen_decoder")
    ids = torch.randint(3, VOCAB, (2, 6), generator=torch.Generator().manual_seed(1))
    kwargs = dict(input_ids=ids, max_new_tokens=5, do_sample=False, pad_token_id=0)
    expected = reference.generate(**kwargs)
    with pytest.warns(RuntimeWarning, match=reason):
        assert torch.equal(accelerated.generate(**kwargs), expected)
    with pytest.warns(RuntimeWarning, match="without lightgen's decoding, max_draft: greedy's tokens"):
        assert torch.equal(accelerated.generate(**kwargs, decoding="iad", max_draft=4), expected)
    with pytest.raises(ValueError, match="GAD\\+\\+ .* needs lightgen's engine"):
        accelerated.generate(**kwargs, decoding="gad", drafter=object(), beta=2)
    with pytest.raises(ValueError, match="decoding must be"):
        accelerated.generate(**kwargs, decoding="fast")
    monkeypatch.setenv("LIGHTGEN_STRICT", "1")
    with pytest.raises(UnsupportedGenerateArgument, match=reason):
        accelerated.generate(**kwargs)
    lightgen.restore_model(accelerated)
    assert "generate" not in vars(accelerated)


@pytest.mark.parametrize("family", ["gemma2", "qwen3", "phi3"])
def test_forward_with_autograd_and_attention_weights_match_hf(family):
    """Gradients on: soft-capped attention (which sdpa refuses) runs Gemma 2's eager function on an additive
    mask; attention weights of grouped-query models come from the family's eager function too."""
    model = lightgen.accelerate_model(build(family, seed=2))
    reference = build(family, seed=2)
    reference.set_attn_implementation("eager")  # HF returns attention weights only from eager
    ids, mask = padded_batch(family, 2, 9, seed=2)
    valid = mask.bool()
    got = model(input_ids=ids, attention_mask=mask).logits
    expected = reference(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(got[valid], expected[valid], atol=1e-5, rtol=1e-5)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False, return_dict_in_generate=True,
                  output_attentions=True)
    with warnings.catch_warnings():  # lightgen's engine returns them (no fallback)
        warnings.filterwarnings("error", message="lightgen generate", category=RuntimeWarning)
        got = model.generate(**kwargs)
    expected = reference.generate(**kwargs)
    assert torch.equal(got.sequences, expected.sequences)
    for mine, theirs in zip(got.attentions[-1], expected.attentions[-1], strict=True):  # a decode step: no padding
        torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=1e-5)


def test_fallbacks_from_the_engine_drop_iad_and_refuse_gad_plus_plus():
    """What only HF's loop runs (here a model with a forward hook) used to drop decoding= silently, GAD++
    included, whose tokens are not greedy's."""
    reference = build("llama", seed=4)
    accelerated = lightgen.accelerate_model(copy.deepcopy(reference))
    accelerated.register_forward_hook(lambda *args: None)
    ids, mask = padded_batch("llama", 2, 6, seed=4)
    kwargs = dict(input_ids=ids[:1], attention_mask=mask[:1], max_new_tokens=5, do_sample=False)
    with pytest.warns(RuntimeWarning, match="carries forward hooks.*without lightgen's decoding"):
        got = accelerated.generate(**kwargs, decoding="iad")
    assert torch.equal(got, reference.generate(**kwargs))
    drafter = build("llama", seed=5)
    with pytest.raises(ValueError, match="GAD\\+\\+"):
        accelerated.generate(**kwargs, decoding="gad", drafter=drafter, beta=2)


@pytest.mark.parametrize("family", ["mistral", "qwen2", "phi3", "gemma2", "gemma3_text", "opt", "gpt_neox"])
def test_hf_loop_on_the_patched_layers_matches_hf(family):
    """HF's own loop (here for a forward hook on the model, which leaves its blocks patched) steps the patched
    blocks and lightgen's attention through HF's caches, sliding-window layers and soft-capped decode steps
    included."""
    reference = build(family, seed=2)
    accelerated = lightgen.accelerate_model(copy.deepcopy(reference))
    accelerated.register_forward_hook(lambda *args: None)
    ids, mask = padded_batch(family, 3, 12, seed=2)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=10, do_sample=False, num_beams=2)
    with pytest.warns(RuntimeWarning, match="carries forward hooks"):
        got = accelerated.generate(**kwargs)
    assert torch.equal(got, reference.generate(**kwargs))


def test_opt_projections_with_given_embeddings_and_hidden_states():
    """OPT-350m's shape: given embeddings are projected in as looked-up ones are; the last hidden state is
    after project_out (HF's last_hidden_state)."""
    reference = _variant("opt_post_ln_projected", 3)
    accelerated = lightgen.accelerate_model(copy.deepcopy(reference))
    embeds = torch.randn(2, 6, 20, generator=torch.Generator().manual_seed(3))
    kwargs = dict(inputs_embeds=embeds, max_new_tokens=4, do_sample=False, return_dict_in_generate=True,
                  output_scores=True, output_hidden_states=True)
    with warnings.catch_warnings():  # on lightgen's engine (no fallback)
        warnings.filterwarnings("error", message="lightgen generate", category=RuntimeWarning)
        got = accelerated.generate(**kwargs)
    expected = reference.generate(**kwargs)
    assert torch.equal(got.sequences, expected.sequences)
    for mine, theirs in zip(got.scores, expected.scores, strict=True):
        torch.testing.assert_close(mine, theirs, atol=1e-4, rtol=1e-4)
    assert len(got.hidden_states) == len(expected.hidden_states)
    for mine, theirs in zip(got.hidden_states, expected.hidden_states, strict=True):
        assert [t.shape for t in mine] == [t.shape for t in theirs]
        for a, b in zip(mine, theirs, strict=True):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
