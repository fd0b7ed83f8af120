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


@pytest.mark.parametrize("family", sorted(set(BUILDERS) - {"bert"}))
@pytest.mark.parametrize("dtype, attention", [(torch.bfloat16, None), (torch.float16, None), (torch.bfloat16, "eager"),
                                              (torch.float16, "eager")],
                         ids=["bf16", "fp16", "bf16-eager", "fp16-eager"])
def test_half_precision_scores_are_hfs_bit_for_bit(family, dtype, attention):
    """Greedy's scores at every step equal HF's bit for bit in fp16 / bf16: norms round as HF's (RMSNorm's squares
    summed in torch's order, LayerNorm as F.layer_norm) and attention runs torch's own sdpa (or, on HF's eager
    attention, its eager ops) over the keys HF's cache hands it. Before (commit 169c802), fp16 steps matched at
    23-96 of 96 per family (mT5 23, T5 48, Qwen3 51, Gemma 3 79, Llama 81), bf16 mT5 95. The models' own attention
    (sdpa; Gemma 2 eager), or eager: the BART family's, GPT-2's and T5's eager softmax runs in the dtype, which the op
    follows (``softmax_in_dtype``; before, 1 of 96 fp16 steps differed for mBART, M2M100 and GPT-2)."""
    model = build(family, seed=1, dtype=dtype)
    if attention is not None:
        model.set_attn_implementation(attention)
    reference = copy.deepcopy(model)
    ids, mask = padded_batch(family, 4, 20, seed=1)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=12, min_new_tokens=12, output_scores=True,
                  return_dict_in_generate=True)
    expected = reference.generate(**kwargs)
    got = lightgen.accelerate_model(model).generate(**kwargs)
    assert torch.equal(got.sequences, expected.sequences)
    for step, (mine, theirs) in enumerate(zip(got.scores, expected.scores, strict=True)):
        assert torch.equal(mine, theirs), f"step {step}"


@pytest.mark.parametrize("family", ["llama", "qwen2", "gpt2", "gpt2_upcast", "bart"])
@pytest.mark.parametrize("gain", [20.0, 16.0], ids=["apart", "nan"])
def test_fp16_eager_positions_without_keys_are_hfs_bit_for_bit(family, gain):
    """A padded prompt position sees no key: HF's eager attention adds fp16's lowest (-65504) to every score there,
    which does not absorb scores of 16 and more (the weights are not even; all at -inf: NaN, which HF's row then
    carries), and GPT-2's upcast attention adds it to float32 scores (a softmax over them). Scaled-up query / key
    weights make such scores: outputs, attention weights and hidden states are HF's bit for bit, NaN where HF's are."""
    model = _eager_bf16(family, seed=2, dtype=torch.float16)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if any(part in name for part in ("q_proj", "k_proj", "c_attn")) and "decoder" not in name.split(".")[0]:
                param.mul_(gain)
    reference = copy.deepcopy(model)
    ids, mask = padded_batch(family.removesuffix("_upcast"), 3, 9, seed=2)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=6, output_scores=True, output_attentions=True,
                  output_hidden_states=True, return_dict_in_generate=True)
    expected = reference.generate(**kwargs)
    got = lightgen.accelerate_model(model).generate(**kwargs)
    attentions = "decoder_attentions" if model.config.is_encoder_decoder else "attentions"
    uneven = False
    for name in ("sequences", "scores", attentions, "hidden_states", "decoder_hidden_states", "cross_attentions"):
        mine, theirs = getattr(got, name, None), getattr(expected, name, None)
        for a, b in zip(_flat(mine), _flat(theirs), strict=True):
            assert a.shape == b.shape and torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(),
                                                                                          b.nan_to_num()), name
    for layer in _flat(getattr(expected, attentions)[0]):
        spread = layer.float().nan_to_num(2.0)
        uneven |= bool((spread.amax(-1) - spread.amin(-1) > 0.5).any())  # some weights far from even
    assert uneven or model.config.is_encoder_decoder


def _flat(value):
    if value is None:
        return []
    if isinstance(value, (tuple, list)):
        return [leaf for item in value for leaf in _flat(item)]
    return [value]


def _eager_bf16(family: str, seed: int = 0, dtype: torch.dtype = torch.bfloat16):
    """``family``'s test model in bf16 (or ``dtype``) on HF's eager attention; "gpt2_upcast": GPT-2 with
    reorder_and_upcast_attn, whose eager attention forms the scores in float32."""
    model = build(family.removesuffix("_upcast"), seed=seed, dtype=dtype)
    if family == "gpt2_upcast":
        model.config.reorder_and_upcast_attn = True
        for block in model.transformer.h:
            block.attn.reorder_and_upcast_attn = True
    model.set_attn_implementation("eager")
    return model


@pytest.mark.parametrize("family", ["llama", "gemma2", "gpt2", "gpt2_upcast", "mistral", "qwen3", "opt", "bart"])
def test_bf16_forward_on_eager_attention_is_hfs_bit_for_bit(family):
    """Through forward (HF's own loop, a fallback, a server's steps) an eager bf16 model's prefill runs the
    family's eager function and a decode step the kernel's eager mode: logits bit for bit HF's (before: up to
    5e-3 apart), padded positions included."""
    model = _eager_bf16(family)
    reference = copy.deepcopy(model)
    accelerated = lightgen.accelerate_model(model)
    ids, mask = padded_batch(family.removesuffix("_upcast"), 3, 9)
    logits = []
    with torch.no_grad():
        for target in (reference, accelerated):
            if target.config.is_encoder_decoder:
                start = torch.full((3, 1), target.config.decoder_start_token_id)
                prompt = target(input_ids=ids, attention_mask=mask, decoder_input_ids=start, use_cache=True)
                step = target(encoder_outputs=(prompt.encoder_last_hidden_state,), attention_mask=mask,
                              decoder_input_ids=prompt.logits[:, -1:].argmax(-1),
                              past_key_values=prompt.past_key_values)
            else:
                prompt = target(input_ids=ids, attention_mask=mask, use_cache=True)
                step = target(input_ids=prompt.logits[:, -1:].argmax(-1), past_key_values=prompt.past_key_values,
                              attention_mask=torch.cat([mask, torch.ones_like(mask[:, :1])], 1))
            logits.append((prompt.logits, step.logits))
    assert torch.equal(logits[1][0], logits[0][0]) and torch.equal(logits[1][1], logits[0][1])


@pytest.mark.parametrize("family", ["llama", "gemma2", "gpt2", "qwen3"])
def test_bf16_eager_padded_positions_are_hfs_bit_for_bit(family):
    """A left-padded position sees no key; HF's eager softmax weighs each key handed to it by 1 / n rounded to
    bf16 (1/9: 0.1113...), not by the exact mean: the hidden states there, the attentions and the returned cache
    (whose later layers' K/V carry those positions) are HF's bit for bit."""
    model = _eager_bf16(family)
    reference = copy.deepcopy(model)
    accelerated = lightgen.accelerate_model(model)
    ids, mask = padded_batch(family, 3, 9)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=5, return_dict_in_generate=True,
                  output_hidden_states=True, output_attentions=True)
    expected, got = reference.generate(**kwargs), accelerated.generate(**kwargs)
    assert torch.equal(got.sequences, expected.sequences)
    for name in ("hidden_states", "attentions"):
        for got_step, expected_step in zip(getattr(got, name), getattr(expected, name), strict=True):
            assert all(torch.equal(a, b) for a, b in zip(got_step, expected_step, strict=True)), name
    caches = [output.get("cache") or output.get("past_key_values") for output in (got, expected)]  # 5.24 renamed it
    for got_layer, expected_layer in zip(caches[0].layers, caches[1].layers, strict=True):
        assert torch.equal(got_layer.keys, expected_layer.keys) and torch.equal(got_layer.values, expected_layer.values)


@pytest.mark.parametrize("family", ["llama", "gpt2", "gpt2_upcast", "gemma2", "opt", "mistral", "bart"])
@pytest.mark.parametrize("settings", [dict(), dict(num_beams=3), dict(decoding="iad", max_draft=5)],
                         ids=["greedy", "beams", "iad"])
def test_bf16_generate_on_eager_attention_is_token_identical(family, settings):
    """A model on HF's eager attention (Gemma 2's default, or chosen) rounds bf16 attention elsewhere than sdpa: the
    scores, their scaling, softcap and mask in bf16, the float softmax rounded before it weighs the values. The
    kernels round there for such a model (decode steps, the prompt pass, cross-attention; a prefill through
    forward runs the family's eager function), so its tokens are HF's too; GPT-2's reorder_and_upcast_attn keeps
    the scores in float32 there, and so do the kernels."""
    for seed in range(2):
        model = _eager_bf16(family, seed)
        reference = copy.deepcopy(model)
        ids, mask = padded_batch(family.removesuffix("_upcast"), 4, 9, seed=seed)
        kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=16, min_new_tokens=16)
        expected = reference.generate(**kwargs, num_beams=settings.get("num_beams", 1))
        assert torch.equal(lightgen.accelerate_model(model).generate(**kwargs, **settings), expected)
