"""What chat and serving code passes to generate() runs on lightgen's engine and gives HF's results:
streamers, caches out and in, decoder masks, use_cache / cache_implementation, prompt lookup, attentions and
hidden states, inputs_embeds, GPT-2's token_type_ids."""

import copy
import warnings

import pytest
import torch
import transformers as tf
from models import DECODER_ONLY, SEQ2SEQ, VOCAB, build, forward_logits, padded_batch, valid_positions
from transformers.cache_utils import DynamicCache
from transformers.generation.streamers import BaseStreamer

import lightgen

FAMILIES = ("bart", "gpt2", "llama", "qwen2")


@pytest.fixture(autouse=True)
def no_fallback():
    """Every call here must run on lightgen's engine: a fallback warning fails the test."""
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="lightgen generate", category=RuntimeWarning)
        yield


def _pair(family, seed, attn_implementation=None):
    model = build(family, seed=seed)
    if attn_implementation is not None:
        model.set_attn_implementation(attn_implementation)
    return lightgen.accelerate_model(copy.deepcopy(model)), model


class Recorder(BaseStreamer):
    def __init__(self):
        self.calls = []

    def put(self, value):
        self.calls.append(("put", value.dtype, value.tolist()))

    def end(self):
        self.calls.append(("end",))


def returned_cache(output):
    """The output's cache: ``cache`` from transformers 5.24, ``past_key_values`` before."""
    return getattr(output, "cache" if "cache" in type(output).__dataclass_fields__ else "past_key_values")


def _self_attention(cache):
    return getattr(cache, "self_attention_cache", cache)


def assert_same_cache(got, expected):
    assert type(got) is type(expected)
    mine, theirs = _self_attention(got), _self_attention(expected)
    assert int(mine.get_seq_length()) == int(theirs.get_seq_length())
    parts = [(mine, theirs)]
    if hasattr(expected, "cross_attention_cache"):
        parts.append((got.cross_attention_cache, expected.cross_attention_cache))
        assert got.is_updated == expected.is_updated
    for mine, theirs in parts:
        assert len(mine.layers) == len(theirs.layers)
        for a, b in zip(mine.layers, theirs.layers, strict=True):
            assert type(a) is type(b)
            torch.testing.assert_close(a.keys, b.keys, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(a.values, b.values, atol=1e-5, rtol=1e-5)


def _eos_after(reference, ids, mask, new_tokens):
    out = reference.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False)
    return int(out[0, -1])


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("settings", [dict(do_sample=False), dict(do_sample=True, top_k=10),
                                      dict(do_sample=True, num_beams=3, num_return_sequences=2)],
                         ids=["greedy", "sample", "beam_sample"])
def test_streamer_gets_hf_calls(family, settings, step_counter):
    """Greedy and sampling: the prompt, each step's tokens, the end. Beam sampling, which HF does not refuse as it
    refuses beam search: the prompt alone (generate's own put), no end."""
    accelerated, reference = _pair(family, 1)
    ids, mask = padded_batch(family, 3, 7, seed=1)
    eos = _eos_after(reference, ids, mask, 3)  # some rows end early: padding is streamed too
    calls = []
    for model in (reference, accelerated):
        streamer = Recorder()
        torch.manual_seed(4)
        sequences = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, eos_token_id=eos,
                                   streamer=streamer, **settings)
        calls.append((sequences, streamer.calls))
    (expected, expected_calls), (got, got_calls) = calls
    assert step_counter
    assert torch.equal(got, expected)
    assert got_calls == expected_calls


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("settings", [dict(num_beams=2, streamer=True), dict(use_cache=False, prefill_chunk_size=2)],
                         ids=["streamed_beams", "chunked_prefill_without_a_cache"])
def test_refused_as_hf_refuses(family, settings):
    accelerated, reference = _pair(family, 1)
    ids, mask = padded_batch(family, 2, 5)
    messages = []
    for model in (reference, accelerated):
        with pytest.raises(ValueError) as refused:
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4,
                           **{**settings, **({"streamer": Recorder()} if "streamer" in settings else {})})
        messages.append(str(refused.value))
    assert messages[0] == messages[1]


@pytest.mark.parametrize("num_beams", [1, 3])
@pytest.mark.parametrize("family, dtype, settings, reason", [
    ("m2m_100", torch.float32, dict(use_cache=False), "positions skip padding"),
    ("llama", torch.float16, dict(use_cache=False), "use_cache=False in float16"),
    ("gpt2", torch.bfloat16, dict(use_cache=False), "use_cache=False in bfloat16"),
    ("qwen2", torch.float16, dict(prefill_chunk_size=2), "prefill_chunk_size in float16")])
def test_hfs_loop_runs_passes_that_lightgen_does_not_follow_or_raises_when_strict(num_beams, family, dtype, settings,
                                                                                   reason, monkeypatch):
    """Without a cache HF runs the whole decoder input again each step. M2M100 / NLLB number positions past
    padding tokens, so a padding token HF generated shifts the positions after it, where its cached steps (and
    lightgen's) number on (a case that tells the two apart: test_fuzz.py's ARGUMENT_REGRESSIONS); in fp16 / bf16
    a whole-sequence pass rounds otherwise than a one-token step, and a chunked prefill otherwise than one pass.
    lightgen hands such calls to HF's loop, with a warning, and so gets HF's tokens, and its scores (bit for bit in
    fp16 / bf16: the patched layers run HF's ops there)."""
    model = build(family, seed=3).to(dtype)
    accelerated = lightgen.accelerate_model(copy.deepcopy(model))
    ids, mask = padded_batch(family, 2, 6, seed=3)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=8, num_beams=num_beams, **settings,
                  return_dict_in_generate=True, output_scores=True)
    expected = model.generate(**kwargs)
    with pytest.warns(RuntimeWarning, match=reason):
        got = accelerated.generate(**kwargs)
    assert torch.equal(got.sequences, expected.sequences)
    tolerance = 1e-4 if dtype == torch.float32 else 0.0
    for mine, theirs in zip(got.scores, expected.scores, strict=True):
        torch.testing.assert_close(mine, theirs, atol=tolerance, rtol=tolerance)
    monkeypatch.setenv("LIGHTGEN_STRICT", "1")
    with pytest.raises(ValueError, match=reason):
        accelerated.generate(**kwargs)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("decoding", ["iad", "prompt_lookup"])
def test_aggressive_decoding_streams_each_pass(family, decoding):
    """One put per decoder pass with the tokens it added (several at once, as HF's assisted decoding)."""
    accelerated, reference = _pair(family, 2)
    ids = padded_batch(family, 1, 12, seed=2)[0].repeat(1, 2)  # a repeated input: drafts get accepted
    kwargs = dict(input_ids=ids, max_new_tokens=12, do_sample=False)
    expected = reference.generate(**kwargs)
    streamer = Recorder()
    prompt = ids if family != "bart" else expected[:, :1]
    # IAD drafts from the output itself here (random weights rarely copy their input), so passes accept drafts.
    extra = (dict(decoding="iad", draft_ids=expected[:, prompt.shape[1]:].tolist()) if decoding == "iad"
             else dict(prompt_lookup_num_tokens=4))
    got = accelerated.generate(**kwargs, **extra, streamer=streamer, return_dict_in_generate=True)
    assert torch.equal(got.sequences, expected)
    assert streamer.calls[0] == ("put", torch.int64, prompt.tolist())
    assert streamer.calls[-1] == ("end",)
    passes = streamer.calls[1:-1]
    assert [len(chunk[0]) for _, _, chunk in passes] == got.tokens_per_iteration[0].tolist()
    if decoding == "iad" and family in ("gpt2", "llama"):  # outputs whose suffixes anchor uniquely in the draft
        assert max(len(chunk[0]) for _, _, chunk in passes) > 1
    assert [token for _, _, chunk in passes for token in chunk[0]] == expected[0, prompt.shape[1]:].tolist()


def test_aggressive_decoding_of_a_batch_with_a_streamer_runs_greedy_and_says_so():
    accelerated, reference = _pair("gpt2", 2)
    ids, mask = padded_batch("gpt2", 2, 6)
    streamer, expected_streamer = Recorder(), Recorder()
    with pytest.warns(RuntimeWarning, match="streams one row"):
        got = accelerated.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, decoding="iad",
                                   streamer=streamer)
    expected = reference.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, streamer=expected_streamer)
    assert torch.equal(got, expected) and streamer.calls == expected_streamer.calls


CACHE_SETTINGS = [dict(), dict(do_sample=True, top_k=10), dict(num_beams=3), dict(num_beams=2, num_return_sequences=2),
                  dict(cache_implementation="static"), dict(cache_implementation="dynamic"), dict(use_cache=False)]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("settings", CACHE_SETTINGS, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()) or "greedy")
def test_returned_cache_is_hfs(family, settings, step_counter):
    accelerated, reference = _pair(family, 3)
    ids, mask = padded_batch(family, 3, 7, seed=3)
    eos = _eos_after(reference, ids, mask, 2)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=6, eos_token_id=eos,
                  return_dict_in_generate=True, **settings)
    torch.manual_seed(5)
    expected = reference.generate(**kwargs)
    torch.manual_seed(5)
    got = accelerated.generate(**kwargs)
    assert step_counter
    assert torch.equal(got.sequences, expected.sequences)
    if settings.get("use_cache") is False:
        assert returned_cache(got) is None and returned_cache(expected) is None
    else:
        assert_same_cache(returned_cache(got), returned_cache(expected))


def test_no_cache_is_built_unless_returned(monkeypatch):
    from transformers.cache_utils import DynamicLayer

    accelerated, _ = _pair("llama", 3)
    ids, mask = padded_batch("llama", 2, 6)
    updates = []
    original = DynamicLayer.update
    monkeypatch.setattr(DynamicLayer, "update", lambda self, *a, **k: updates.append(1) or original(self, *a, **k))
    accelerated.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4)
    accelerated.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, return_dict_in_generate=True,
                         output_scores=True)
    assert len(updates) == 2  # one per layer, for the call that returns its cache


@pytest.mark.parametrize("family", FAMILIES)
def test_iad_returns_hfs_greedy_cache(family):
    accelerated, reference = _pair(family, 2)
    ids = padded_batch(family, 1, 10, seed=2)[0].repeat(1, 2)
    kwargs = dict(input_ids=ids, max_new_tokens=10, do_sample=False, return_dict_in_generate=True)
    expected, got = reference.generate(**kwargs), accelerated.generate(**kwargs, decoding="iad")
    assert torch.equal(got.sequences, expected.sequences)
    assert_same_cache(returned_cache(got), returned_cache(expected))


def _second_turn(family, first_sequences, ids, mask, decoder_mask):
    """The next turn's inputs: the first turn's output and two new tokens (a user's reply)."""
    reply = torch.randint(3, 90, (first_sequences.shape[0], 2), generator=torch.Generator().manual_seed(9))
    history = torch.cat([first_sequences, reply], 1)
    if family == "bart":
        extra = dict(decoder_attention_mask=torch.ones_like(history)) if decoder_mask else {}
        return dict(input_ids=ids, attention_mask=mask, decoder_input_ids=history, **extra)
    grown = torch.cat([mask, torch.ones(mask.shape[0], history.shape[1] - mask.shape[1], dtype=mask.dtype)], 1)
    return dict(input_ids=history, attention_mask=grown)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("first_turn_by", ["hf", "lightgen"])
@pytest.mark.parametrize("settings", [dict(), dict(do_sample=True, top_k=10)], ids=["greedy", "sample"])
def test_multi_turn_chat_continues_from_the_returned_cache(family, first_turn_by, settings, step_counter):
    accelerated, reference = _pair(family, 4)
    ids, mask = padded_batch(family, 2, 6, seed=4)
    first = (reference if first_turn_by == "hf" else accelerated).generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=4, return_dict_in_generate=True)
    # BART: without a decoder mask HF feeds the whole decoder input again after the cache; with one, only the rest.
    for decoder_mask in ([False, True] if family == "bart" else [False]):
        turn = _second_turn(family, first.sequences, ids, mask, decoder_mask)
        theirs, mine = copy.deepcopy(returned_cache(first)), copy.deepcopy(returned_cache(first))
        step_counter.clear()
        kwargs = dict(turn, max_new_tokens=5, return_dict_in_generate=True, **settings)
        torch.manual_seed(3)
        expected = reference.generate(**kwargs, past_key_values=theirs)
        torch.manual_seed(3)
        got = accelerated.generate(**kwargs, past_key_values=mine)
        assert step_counter
        assert torch.equal(got.sequences, expected.sequences)
        assert_same_cache(returned_cache(got), returned_cache(expected))
        assert_same_cache(mine, theirs)  # the caller's object is extended in place, as HF's loop does


@pytest.mark.parametrize("family", ["gpt2", "llama", "qwen2"])
def test_a_prefix_computed_once_serves_several_prompts(family):
    """Prefix caching: a shared system prompt's forward-pass cache, copied for each question."""
    accelerated, reference = _pair(family, 5)
    system = torch.randint(3, 90, (1, 6), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        prefix = reference(input_ids=system, use_cache=True).past_key_values
    for seed in range(2):
        question = torch.randint(3, 90, (1, 3), generator=torch.Generator().manual_seed(10 + seed))
        kwargs = dict(input_ids=torch.cat([system, question], 1), max_new_tokens=6)
        theirs, mine = copy.deepcopy(prefix), copy.deepcopy(prefix)
        assert torch.equal(accelerated.generate(**kwargs, past_key_values=mine),
                           reference.generate(**kwargs, past_key_values=theirs))
        assert_same_cache(mine, theirs)


def test_a_cache_covering_the_whole_input_is_a_clear_error():
    accelerated, reference = _pair("gpt2", 5)
    ids = torch.randint(3, 90, (1, 6))
    with torch.no_grad():
        cache = reference(input_ids=ids, use_cache=True).past_key_values
    with pytest.raises(ValueError, match="at least one token after the cached ones"):
        accelerated.generate(input_ids=ids, max_new_tokens=3, past_key_values=cache)


def test_a_quantized_cache_keeps_hfs_loop(monkeypatch):
    accelerated, _ = _pair("gpt2", 5)
    monkeypatch.setenv("LIGHTGEN_STRICT", "1")
    with pytest.raises(ValueError, match="cache_implementation='quantized'"):
        accelerated.generate(input_ids=torch.randint(3, 90, (1, 4)), max_new_tokens=3,
                             cache_implementation="quantized")


@pytest.mark.parametrize("num_beams", [1, 3])
def test_padded_decoder_prompts_with_decoder_attention_mask(num_beams, step_counter):
    accelerated, reference = _pair("bart", 6)
    ids, mask = padded_batch("bart", 3, 7, seed=6)
    decoder_ids = torch.tensor([[2, 1, 1, 40, 41], [2, 50, 51, 52, 53], [2, 1, 60, 61, 62]])
    decoder_mask = (decoder_ids != 1).long()
    kwargs = dict(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder_ids,
                  decoder_attention_mask=decoder_mask, max_new_tokens=6, num_beams=num_beams,
                  return_dict_in_generate=True, output_scores=True)
    expected, got = reference.generate(**kwargs), accelerated.generate(**kwargs)
    assert step_counter
    assert torch.equal(got.sequences, expected.sequences)
    for mine, theirs in zip(got.scores, expected.scores, strict=True):
        torch.testing.assert_close(mine, theirs, atol=1e-4, rtol=1e-4)
    # The mask matters: without it the padded rows score differently.
    unmasked = reference.generate(**{k: v for k, v in kwargs.items() if k != "decoder_attention_mask"})
    assert not torch.allclose(unmasked.scores[0], expected.scores[0], atol=1e-3)


MODES = [dict(do_sample=False), dict(do_sample=True, top_k=10), dict(num_beams=2)]
MODE_IDS = ["greedy", "sample", "beams"]


def _generate_both(reference, accelerated, **kwargs):
    """(HF's, lightgen's) results of one call, sampling under the same seed."""
    results = []
    for model in (reference, accelerated):
        torch.manual_seed(6)
        results.append(model.generate(**kwargs))
    return results


def _assert_steps_close(got, expected):
    """Per step, per layer: HF's shapes and dtypes, values within 1e-4, padded prompt positions included (they see
    no key: eager attention spreads them evenly over all keys, sdpa gives zeros; lightgen follows the model's)."""
    assert len(got) == len(expected)
    for mine, theirs in zip(got, expected, strict=True):
        assert len(mine) == len(theirs)
        for a, b in zip(mine, theirs, strict=True):
            assert a.shape == b.shape and a.dtype == b.dtype
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("settings", MODES, ids=MODE_IDS)
def test_attentions_and_hidden_states_are_hfs(family, settings, step_counter):
    """Per generated step, per layer, the running rows' (beams' after HF's reorder) weights and hidden states;
    Qwen2's sliding-window layer over the keys HF's cache keeps."""
    _check_attentions_and_hidden_states(family, settings)
    assert step_counter


@pytest.mark.parametrize("family", sorted(set(SEQ2SEQ + DECODER_ONLY) - set(FAMILIES)))
def test_attentions_and_hidden_states_of_every_family(family, step_counter):
    """T5's position bias, OPT's projections and scaled queries, GPT-NeoX's parallel block, Gemma 2's
    soft-capped and windowed layers, the seq2seq families' cross-attention."""
    _check_attentions_and_hidden_states(family, dict(do_sample=False))
    assert step_counter


def _check_attentions_and_hidden_states(family, settings):
    accelerated, reference = _pair(family, 7, "eager")  # HF returns attention weights from eager attention only
    ids, mask = padded_batch(family, 3, 7, seed=7)
    decoder_prompt = {}
    if family in SEQ2SEQ:  # a padded decoder prompt: its padding sees no key, as a decoder-only prompt's does
        decoder_ids = torch.tensor([[2, 40, 41], [2, 50, 51], [2, 60, 61]])
        decoder_ids[1, :2] = 0
        decoder_prompt = dict(decoder_input_ids=decoder_ids, decoder_attention_mask=(decoder_ids != 0).long())
    expected, got = _generate_both(reference, accelerated, input_ids=ids, attention_mask=mask, max_new_tokens=5,
                                   return_dict_in_generate=True, output_attentions=True, output_hidden_states=True,
                                   **settings, **decoder_prompt)
    assert torch.equal(got.sequences, expected.sequences)
    assert list(got.keys()) == list(expected.keys())
    if family in SEQ2SEQ:
        for name in ("decoder_attentions", "cross_attentions", "decoder_hidden_states"):
            _assert_steps_close(getattr(got, name), getattr(expected, name))
        _assert_steps_close([got.encoder_attentions, got.encoder_hidden_states],
                            [expected.encoder_attentions, expected.encoder_hidden_states])
    else:
        for name in ("attentions", "hidden_states"):
            _assert_steps_close(getattr(got, name), getattr(expected, name))
    assert_same_cache(returned_cache(got), returned_cache(expected))  # the padding's K/V after the first layer
    # HF's encoder pass (or any forward asking for them) leaves HF's output recorders on the modules: the engine
    # still runs (the no_fallback fixture fails a fallback).
    accelerated.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2)


def test_hidden_states_alone_and_attentions_of_other_caches(step_counter):
    accelerated, reference = _pair("llama", 7)
    ids, mask = padded_batch("llama", 2, 6, seed=7)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=4, return_dict_in_generate=True)
    expected, got = _generate_both(reference, accelerated, **kwargs, output_hidden_states=True)  # sdpa's
    assert step_counter and got.attentions is None and expected.attentions is None
    _assert_steps_close(got.hidden_states, expected.hidden_states)
    assert_same_cache(returned_cache(got), returned_cache(expected))
    accelerated, reference = _pair("llama", 7, "eager")
    # A caller's empty DynamicCache() (chat code), which makes its layers on first use.
    results = [model.generate(**kwargs, output_attentions=True, past_key_values=DynamicCache())
               for model in (reference, accelerated)]
    _assert_steps_close(results[1].attentions, results[0].attentions)
    # HF's static cache hands attention all its slots: the weights' shapes follow HF's cache, so HF's loop runs, whose
    # recorders take the eager weights from the attention modules' outputs (GPT-2's returned none before, fp32 or bf16).
    for family, dtype in (("llama", torch.float32), ("gpt2", torch.float32), ("gpt2", torch.bfloat16)):
        accelerated, reference = _pair(family, 7, "eager")
        accelerated, reference = accelerated.to(dtype), reference.to(dtype)
        ids, mask = padded_batch(family, 2, 6, seed=7)
        with pytest.warns(RuntimeWarning, match="attentions with StaticLayer cache layers are not supported"):
            expected, got = _generate_both(reference, accelerated, input_ids=ids, attention_mask=mask,
                                           max_new_tokens=4, return_dict_in_generate=True, output_attentions=True,
                                           cache_implementation="static")
        assert torch.equal(got.sequences, expected.sequences)
        _assert_steps_close(got.attentions, expected.attentions)


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma2"])
@pytest.mark.parametrize("cache_implementation", ["dynamic", "static"])
def test_padded_positions_of_eager_models_with_each_cache(family, cache_implementation, step_counter):
    """Eager attention spreads a position that sees no key over every key HF's cache layer hands it: a static
    layer's unwritten slots too, a sliding layer's window (Qwen2's second layer, Gemma 2's odd ones)."""
    accelerated, reference = _pair(family, 9, "eager")
    ids, mask = padded_batch(family, 3, 8, seed=9)
    expected, got = _generate_both(reference, accelerated, input_ids=ids, attention_mask=mask, max_new_tokens=4,
                                   return_dict_in_generate=True, output_hidden_states=True,
                                   cache_implementation=cache_implementation)
    assert step_counter and torch.equal(got.sequences, expected.sequences)
    _assert_steps_close(got.hidden_states, expected.hidden_states)
    assert_same_cache(returned_cache(got), returned_cache(expected))


@pytest.mark.parametrize("family, attn_implementation", [("llama", "eager"), ("gemma2", None), ("qwen2", "sdpa")])
@pytest.mark.parametrize("settings", [dict(), dict(num_beams=2), dict(decoding="iad", max_draft=4)],
                         ids=["greedy", "beams", "iad"])
def test_a_row_of_padding_alone_takes_hfs_tokens(family, attn_implementation, settings, step_counter):
    """A prompt row that is all padding: its last position sees no key, and its first token comes from what the
    model's attention gives there (eager: the mean of the values; sdpa: zeros)."""
    accelerated, reference = _pair(family, 2, attn_implementation)
    ids, mask = padded_batch(family, 3, 7, seed=2)
    mask[2] = 0
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=8)
    expected = reference.generate(**kwargs, num_beams=settings.get("num_beams", 1))
    assert torch.equal(accelerated.generate(**kwargs, **settings), expected)
    assert step_counter


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("settings", MODES, ids=MODE_IDS)
def test_inputs_embeds_are_hfs(family, settings, step_counter):
    """The prompt as embeddings (none of them any token's); decoder-only models also with the prompt's tokens,
    which HF then returns ahead of the new ones (without them, only the new ones)."""
    _check_inputs_embeds(family, settings)
    assert step_counter


@pytest.mark.parametrize("family", sorted(set(DECODER_ONLY) - set(FAMILIES)))
def test_inputs_embeds_of_every_decoder_only_family(family, step_counter):
    """OPT projects given embeddings in; Gemma's scale lives in its embedding's lookup, not on given ones."""
    _check_inputs_embeds(family, dict(do_sample=False))
    assert step_counter


def _check_inputs_embeds(family, settings):
    accelerated, reference = _pair(family, 8)
    ids, mask = padded_batch(family, 3, 7, seed=8)
    with torch.no_grad():
        embeds = reference.get_input_embeddings()(ids)
    embeds = embeds + 0.05 * torch.randn(embeds.shape, generator=torch.Generator().manual_seed(8))
    calls = [dict(inputs_embeds=embeds)] + ([dict(inputs_embeds=embeds, input_ids=ids)] if family != "bart" else [])
    for call in calls:
        expected, got = _generate_both(reference, accelerated, **call, attention_mask=mask, max_new_tokens=5,
                                       return_dict_in_generate=True, output_scores=True, **settings)
        assert torch.equal(got.sequences, expected.sequences)
        for mine, theirs in zip(got.scores, expected.scores, strict=True):  # tokens alone can miss a scale
            torch.testing.assert_close(mine, theirs, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("config_class, model_class",
                         [(tf.BartConfig, tf.BartForCausalLM), (tf.MarianConfig, tf.MarianForCausalLM)],
                         ids=["bart", "marian"])
def test_given_embeddings_are_scaled_where_hf_scales_them(config_class, model_class, step_counter):
    """Both scale their own lookup by sqrt(d_model); Marian's forward also scales embeddings it is given,
    BART's (whose scale lives in the embedding module) does not."""
    torch.manual_seed(5)
    config = config_class(vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2, decoder_attention_heads=4,
                          decoder_ffn_dim=48, max_position_embeddings=64, pad_token_id=1, bos_token_id=0,
                          eos_token_id=2, decoder_start_token_id=2, is_decoder=True, is_encoder_decoder=False,
                          scale_embedding=True)
    reference = model_class(config).eval()
    accelerated = lightgen.accelerate_model(copy.deepcopy(reference))
    embeds = torch.randn(2, 6, 32, generator=torch.Generator().manual_seed(5))
    # Scores, not only tokens: the tiny models' tokens hardly depend on the scale (BART normalizes the embeddings).
    expected, got = _generate_both(reference, accelerated, inputs_embeds=embeds, max_new_tokens=6, do_sample=False,
                                   return_dict_in_generate=True, output_scores=True)
    assert step_counter and torch.equal(got.sequences, expected.sequences)
    for mine, theirs in zip(got.scores, expected.scores, strict=True):
        torch.testing.assert_close(mine, theirs, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("settings", MODES, ids=MODE_IDS)
def test_gpt2_token_type_ids_are_hfs(settings, step_counter):
    """GPT-2 adds wte(token_type_ids) to its input; new tokens take each row's last type, as HF extends them."""
    accelerated, reference = _pair("gpt2", 9)
    ids, mask = padded_batch("gpt2", 3, 7, seed=9)
    types = torch.randint(0, 5, ids.shape, generator=torch.Generator().manual_seed(9))
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=6, return_dict_in_generate=True,
                  output_scores=True, **settings)
    expected, got = _generate_both(reference, accelerated, **kwargs, token_type_ids=types)
    assert step_counter
    assert torch.equal(got.sequences, expected.sequences)
    for mine, theirs in zip(got.scores, expected.scores, strict=True):
        torch.testing.assert_close(mine, theirs, atol=1e-4, rtol=1e-4)
    untyped = reference.generate(**kwargs)
    assert not torch.allclose(untyped.scores[0], expected.scores[0], atol=1e-3)  # the types matter


@pytest.mark.parametrize("family", sorted(SEQ2SEQ + DECODER_ONLY))
def test_int32_token_ids_are_taken_as_hf_takes_them(family, step_counter):
    """Tokenizer and serving code may hand over int32 ids and masks: HF's models embed them and their loops
    return int64 tokens. lightgen's kernels index with int64; the same logits, tokens and dtype here, in
    every mode and in IAD."""
    accelerated, reference = _pair(family, 9)
    ids, mask = (tensor.int() for tensor in padded_batch(family, 3, 7, seed=9))
    got, expected = (forward_logits(model, family, ids, mask) for model in (accelerated, reference))
    valid = valid_positions(family, mask, got)
    torch.testing.assert_close(got[valid], expected[valid], atol=1e-4, rtol=1e-4)
    for settings in MODES:
        expected, got = _generate_both(reference, accelerated, input_ids=ids, attention_mask=mask, max_new_tokens=5,
                                       **settings)
        assert got.dtype == expected.dtype == torch.int64, settings
        assert torch.equal(got, expected), settings
    with torch.no_grad():
        expected = reference.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False)
        got = accelerated.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, decoding="iad")
    assert got.dtype == torch.int64 and torch.equal(got, expected)
    assert step_counter
