"""lightgen's generate() loop vs Hugging Face's, token for token (fp32, random-weight models)."""

import copy
import os
import re
import threading

import pytest
import torch
from models import DECODER_ONLY, SEQ2SEQ, build, padded_batch

import lightgen
from lightgen import memory


def _pair(family, seed):
    model = build(family, seed=seed)
    return lightgen.accelerate_model(copy.deepcopy(model)), model


GENERATING = SEQ2SEQ + DECODER_ONLY


def _eos_from_greedy(reference, ids, mask, new_tokens=3):
    """A token greedy decoding emits early, so that using it as EOS ends some rows early."""
    out = reference.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False)
    return int(out[0, -1])


GREEDY_AND_BEAM = [
    dict(),
    dict(min_new_tokens=5),
    dict(repetition_penalty=1.3, no_repeat_ngram_size=2),
    dict(bad_words_ids=[[5], [7, 8]], forced_bos_token_id=4, forced_eos_token_id=2),
    dict(num_beams=2),
    dict(num_beams=4, length_penalty=0.0, early_stopping="never"),
    dict(num_beams=4, length_penalty=2.0, early_stopping=True),
    dict(num_beams=3, length_penalty=-1.0, early_stopping=False, num_return_sequences=3),
    dict(num_beams=4, no_repeat_ngram_size=3, num_return_sequences=2),
]


@pytest.mark.parametrize("family", GENERATING)
@pytest.mark.parametrize("settings", GREEDY_AND_BEAM,
                         ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()) or "greedy")
@pytest.mark.parametrize("seed, batch, length", [(0, 1, 5), (1, 3, 9), (2, 5, 12)])
def test_tokens_identical_to_hf(family, settings, seed, batch, length, step_counter):
    accelerated, reference = _pair(family, seed)
    ids, mask = padded_batch(family, batch, length, seed=seed)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False, **settings)
    expected = reference.generate(**kwargs)
    got = accelerated.generate(**kwargs)
    assert step_counter, "lightgen's decoder step did not run"
    assert got.shape == expected.shape and torch.equal(got, expected)


@pytest.mark.parametrize("family", GENERATING)
@pytest.mark.parametrize("num_beams", [1, 4])
@pytest.mark.parametrize("seed", [3, 4])
def test_eos_early_and_scores_match(family, num_beams, seed):
    accelerated, reference = _pair(family, seed)
    ids, mask = padded_batch(family, 4, 8, seed=seed)
    eos = _eos_from_greedy(reference, ids, mask)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=10, num_beams=num_beams, eos_token_id=[eos, 2],
                  return_dict_in_generate=True, output_scores=True, output_logits=True)
    expected, got = reference.generate(**kwargs), accelerated.generate(**kwargs)
    assert type(got) is type(expected)
    assert torch.equal(got.sequences, expected.sequences)
    assert len(got.scores) == len(expected.scores)
    for mine, theirs in zip(got.scores, expected.scores, strict=True):
        torch.testing.assert_close(mine, theirs, atol=1e-4, rtol=1e-4)
    if num_beams > 1:
        torch.testing.assert_close(got.sequences_scores, expected.sequences_scores, atol=1e-4, rtol=1e-4)
        assert torch.equal(got.beam_indices, expected.beam_indices)


@pytest.mark.parametrize("family", GENERATING)
@pytest.mark.parametrize("settings", [dict(), dict(temperature=0.7, top_k=20), dict(top_p=0.8, num_return_sequences=2),
                                      dict(num_beams=3)])
def test_seeded_sampling_identical_to_hf(family, settings):
    """Same processors and the same RNG calls in the same order: identical samples."""
    accelerated, reference = _pair(family, 5)
    ids, mask = padded_batch(family, 3, 7, seed=5)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=10, do_sample=True, **settings)
    torch.manual_seed(11)
    expected = reference.generate(**kwargs)
    torch.manual_seed(11)
    got = accelerated.generate(**kwargs)
    assert torch.equal(got, expected)


def test_unsupported_argument_falls_back_with_a_warning(monkeypatch):
    from transformers import GenerationMixin

    accelerated, reference = _pair("bart", 6)
    ids, mask = padded_batch("bart", 1, 6, seed=6)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=5, return_dict_in_generate=True)
    # A caller's own decoding loop is HF's to call (here HF's own sampling loop).
    with pytest.warns(RuntimeWarning, match="argument 'custom_generate' is not supported"):
        got = accelerated.generate(**kwargs, custom_generate=GenerationMixin._sample)
    assert torch.equal(got.sequences, reference.generate(**kwargs).sequences)
    embeds = reference.get_decoder().embed_tokens(torch.full((1, 1), 2))  # tensors too, not only flags
    messages = []
    for model in (reference, accelerated):  # HF's loop passes decoder_input_ids too, which its decoder refuses
        with pytest.raises(ValueError) as refused:
            model.generate(**kwargs, decoder_inputs_embeds=embeds)
        messages.append(str(refused.value))
    assert messages[0] == messages[1]
    monkeypatch.setenv("LIGHTGEN_STRICT", "1")
    with pytest.raises(ValueError, match="LIGHTGEN_STRICT=1"):
        accelerated.generate(**kwargs, custom_generate=GenerationMixin._sample)


@pytest.mark.parametrize("family", ["bart", "gpt2"])
def test_hf_cache_is_built_only_when_hf_loop_runs(family, monkeypatch):
    """lightgen's loop skips HF's cache object (it never reads it); a fall back inside the engine (here
    output_attentions of a static cache, refused after HF's front half) builds it and returns HF's own result."""
    from transformers import GenerationMixin

    built = []
    original = GenerationMixin._prepare_cache_for_generation
    monkeypatch.setattr(GenerationMixin, "_prepare_cache_for_generation",
                        lambda model, *args, **kwargs: built.append(1) or original(model, *args, **kwargs))
    accelerated, reference = _pair(family, 6)
    ids, mask = padded_batch(family, 2, 6, seed=6)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=5, pad_token_id=1)
    assert torch.equal(accelerated.generate(**kwargs), reference.generate(**kwargs))
    assert len(built) == 1  # the reference's
    config = copy.deepcopy(reference.generation_config)  # in a config, it reaches the engine's own check
    config.output_attentions = config.return_dict_in_generate = True
    config.cache_implementation = "static"
    with pytest.warns(RuntimeWarning, match="attentions with StaticLayer cache layers are not supported"):
        got = accelerated.generate(**kwargs, generation_config=config)
    expected = reference.generate(**kwargs, generation_config=config)
    assert len(built) == 3 and (got.get("cache") or got.get("past_key_values")) is not None  # 5.24 renamed the field
    assert torch.equal(got.sequences, expected.sequences)
    attentions = got.decoder_attentions if family == "bart" else got.attentions
    assert len(attentions) == 5


def test_generation_past_the_position_table_fails_where_hf_fails():
    accelerated, reference = _pair("bart", 0)
    ids, mask = padded_batch("bart", 1, 4)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=200, min_new_tokens=200)
    with pytest.raises(IndexError, match="max_position_embeddings"):
        accelerated.generate(**kwargs)
    with pytest.raises(IndexError):
        reference.generate(**kwargs)


def test_buffers_are_reused_across_calls():
    from lightgen.modules.kv_cache import POOL

    accelerated, _ = _pair("marian", 1)
    ids, mask = padded_batch("marian", 2, 6)
    POOL.clear()
    accelerated.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, num_beams=2)
    pooled = {id(t) for free in POOL._free.values() for t in free}
    accelerated.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, num_beams=2)
    assert pooled and pooled == {id(t) for free in POOL._free.values() for t in free}


def test_cache_reorders_through_one_spare_layer_and_pools_only_what_it_took():
    """Reordering swaps each layer with one spare layer-sized buffer; what goes back to the pool is the
    buffers taken (never a view into another), so the next cache shares memory with nothing."""
    from lightgen.modules.kv_cache import POOL, StaticKVCache

    POOL.clear()
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):  # later rounds reuse pooled buffers
        cache = StaticKVCache(3, 4, 2, 10, 8, torch.float32, "cpu")
        contents = [torch.randn(4, 2, 10, 8, generator=gen) for _ in range(6)]
        for buffer, content in zip(cache.keys + cache.values, contents, strict=True):
            buffer.copy_(content)
        cache.length = 7
        for rows in (torch.tensor([1, 1, 3, 0]), torch.tensor([3, 2, 0, 1]), torch.tensor([2, 0])):
            contents = [content[rows] for content in contents]
            cache.select_rows(rows)
            for layer in range(3):
                for got, expected in zip(cache.layer(layer), (contents[layer], contents[3 + layer]), strict=True):
                    assert torch.equal(got[:, :, :7], expected[:, :, :7])
        taken = cache._blocks + cache._spare_buffers
        assert sum(t.numel() for t in taken) == 2 * (3 + 1) * 4 * 2 * 10 * 8  # layers + 1 spare, per kind
        cache.release()
        pooled = [t for free in POOL._free.values() for t in free]
        assert {id(t) for t in pooled} >= {id(t) for t in taken}
        assert all(t._base is None for t in pooled)


def test_reorder_keeping_addresses_moves_the_same_rows_in_place():
    """While a CUDA step graph reads a request's tensors, beam reorders copy into them (the same result as the
    buffer swap); a reorder to fewer rows still makes new, smaller tensors, and the addresses say so."""
    from lightgen.modules.decoder import DecodeState
    from lightgen.modules.kv_cache import StaticKVCache

    gen = torch.Generator().manual_seed(1)
    states = []
    for _ in range(2):
        cache = StaticKVCache(2, 4, 2, 10, 8, torch.float32, "cpu")
        state = DecodeState(cache, torch.ones(4, 10, dtype=torch.bool), torch.arange(4) + 5)
        states.append(state)
    contents = [torch.randn(4, 2, 10, 8, generator=gen) for _ in range(4)]
    keep = torch.rand(4, 10, generator=gen) > 0.3
    for state in states:
        for buffer, content in zip(state.cache.keys + state.cache.values, contents, strict=True):
            buffer.copy_(content)
        state.cache.length = 6
        state.key_keep.copy_(keep)
        state.lengths.fill_(6)
    swapped, pinned = states
    pinned.step_graph = object()  # what reorder checks: a graph reads this request's tensors
    before = pinned.addresses()
    for rows in (torch.tensor([1, 1, 3, 0]), torch.tensor([3, 2, 0, 0])):
        swapped.reorder(rows)
        pinned.reorder(rows)
        assert pinned.addresses() == before
        for name in ("key_keep", "next_position", "lengths"):
            assert torch.equal(getattr(pinned, name), getattr(swapped, name))
        for got, expected in zip(pinned.cache.keys + pinned.cache.values, swapped.cache.keys + swapped.cache.values,
                                 strict=True):
            assert torch.equal(got[:, :, :6], expected[:, :, :6])
    pinned.reorder(torch.tensor([2, 0]))
    assert pinned.addresses() != before and pinned.next_position.shape == (2,)


def test_concurrent_generate_calls_each_get_their_own_result():
    accelerated, reference = _pair("bart", 2)
    inputs = [padded_batch("bart", 2, 5 + i, seed=i) for i in range(4)]
    expected = [reference.generate(input_ids=i, attention_mask=m, max_new_tokens=8, num_beams=2) for i, m in inputs]
    results = [None] * len(inputs)

    def run(index):
        ids, mask = inputs[index]
        for _ in range(3):
            results[index] = accelerated.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, num_beams=2)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(inputs))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert all(torch.equal(got, want) for got, want in zip(results, expected, strict=True))
    # The calls shared lightgen's CPU cache; once all have left, torch's own allocator serves again.
    before = memory.cache_stats()
    torch.empty(4321)
    assert memory.cache_stats() == before


def test_restore_removes_the_engine():
    accelerated, _ = _pair("bart", 0)
    lightgen.restore_model(accelerated)
    assert "generate" not in vars(accelerated) and not hasattr(accelerated, "_lightgen_decoder")


@pytest.mark.parametrize("settings", [dict(), dict(num_beams=3), dict(decoding="iad")], ids=["greedy", "beam", "iad"])
def test_sliding_window_models_run_on_the_engine(settings, step_counter, monkeypatch):
    """A window of 4 and prompts of 9: Mistral used to build no decoder and run HF's loop silently."""
    import transformers as tf

    if not os.environ.get("LIGHTGEN_DISABLE_EXT"):  # strict: no fallback to HF (nor to the reference ops)
        monkeypatch.setenv("LIGHTGEN_STRICT", "1")
    torch.manual_seed(0)
    config = tf.MistralConfig(vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                              num_key_value_heads=1, intermediate_size=48, max_position_embeddings=64,
                              pad_token_id=0, sliding_window=4)
    reference = tf.MistralForCausalLM(config).eval()
    accelerated = lightgen.accelerate_model(copy.deepcopy(reference))
    assert [layer.self_attn.window for layer in accelerated._lightgen_decoder.spec.layers] == [4, 4]
    ids, mask = padded_batch("mistral", 2, 9)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=8, pad_token_id=0)
    expected = reference.generate(**kwargs, **{k: v for k, v in settings.items() if k != "decoding"})
    assert torch.equal(accelerated.generate(**kwargs, **settings), expected)
    assert step_counter


@pytest.mark.parametrize("family", SEQ2SEQ)
@pytest.mark.parametrize("num_beams", [1, 3])
def test_forced_decoder_prompt_and_max_length(family, num_beams, step_counter):
    accelerated, reference = _pair(family, 7)
    ids, mask = padded_batch(family, 2, 6, seed=7)
    decoder_prompt = torch.tensor([[2, 11, 12], [2, 13, 14]])
    kwargs = dict(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder_prompt, max_length=11,
                  num_beams=num_beams)
    assert torch.equal(accelerated.generate(**kwargs), reference.generate(**kwargs))
    assert step_counter


def test_memory_stays_flat_over_200_calls():
    psutil = pytest.importorskip("psutil")
    accelerated, _ = _pair("bart", 8)
    ids, mask = padded_batch("bart", 4, 10, seed=8)
    process = psutil.Process()
    for _ in range(20):  # warm-up fills the pool and the allocator's free lists
        accelerated.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, num_beams=2)
    before = process.memory_info().rss
    for _ in range(200):
        accelerated.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, num_beams=2)
    growth_mb = (process.memory_info().rss - before) / 2**20
    assert growth_mb < 16, f"RSS grew by {growth_mb:.1f} MiB over 200 calls"


@pytest.mark.parametrize("family", ["bart", "marian", "gpt2", "llama"])
@pytest.mark.parametrize("settings", [dict(num_beams=4), dict(num_beams=3, length_penalty=2.0, early_stopping=True),
                                      dict(num_beams=4, num_return_sequences=2, early_stopping="never",
                                           length_penalty=0.5)])
def test_group_beam_search_with_one_group_is_hf_beam_search(family, settings, monkeypatch):
    """The v4 bookkeeping in generation/diverse.py, checked against HF's own beam search."""
    from lightgen.generation import diverse, engine

    monkeypatch.setattr(engine, "_beam_search", lambda model, decoder, state, input_ids, positions, processors,
                        criteria, config, output_class, *reorder_last: diverse.group_beam_search(
                            decoder, state, input_ids, positions, processors, criteria, config, output_class))
    accelerated, reference = _pair(family, 1)
    ids, mask = padded_batch(family, 3, 7, seed=1)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=10, pad_token_id=1, **settings)
    assert torch.equal(accelerated.generate(**kwargs), reference.generate(**kwargs))
    scored = dict(kwargs, return_dict_in_generate=True, output_scores=True, output_logits=True)
    got, expected = accelerated.generate(**scored), reference.generate(**scored)
    assert type(got) is type(expected) and torch.equal(got.sequences, expected.sequences)
    torch.testing.assert_close(got.sequences_scores, expected.sequences_scores, rtol=1e-4, atol=1e-4)
    assert torch.equal(got.beam_indices, expected.beam_indices.long())
    assert len(got.scores) == len(expected.scores) == len(got.logits)
    for mine, theirs in zip(got.scores + got.logits, expected.scores + expected.logits, strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", ["bart", "llama"])
def test_diverse_beam_search_without_penalty_repeats_plain_beam_search(family):
    accelerated, reference = _pair(family, 2)
    ids, mask = padded_batch(family, 2, 6, seed=2)
    common = dict(input_ids=ids, attention_mask=mask, max_new_tokens=8, pad_token_id=1)
    got = accelerated.generate(**common, num_beams=4, num_beam_groups=2, diversity_penalty=0.0,
                               num_return_sequences=2)
    plain = reference.generate(**common, num_beams=2)
    assert torch.equal(got[0::2], plain) and torch.equal(got[1::2], plain)


@pytest.mark.parametrize("family", ["marian", "gpt2"])
def test_diversity_penalty_makes_groups_choose_different_tokens(family):
    accelerated, _ = _pair(family, 3)
    ids, mask = padded_batch(family, 2, 6, seed=3)
    out = accelerated.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, num_beams=4, num_beam_groups=4,
                               diversity_penalty=1e4, num_return_sequences=4, pad_token_id=1)
    first = out[:, 1 if family in SEQ2SEQ else ids.shape[1]].view(2, 4)
    assert all(len(set(row.tolist())) == 4 for row in first)


@pytest.mark.parametrize("family", ["bart", "gpt2"])
def test_diverse_beam_search_returns_scores_and_beam_indices(family):
    """sequences_scores: each hypothesis's summed scores (the processed per-step scores of its tokens along
    its beam indices) over its length to the length penalty, as v4's hypotheses score them."""
    accelerated, _ = _pair(family, 4)
    ids, mask = padded_batch(family, 2, 6, seed=4)
    out = accelerated.generate(input_ids=ids, attention_mask=mask, num_beams=4, num_beam_groups=2,
                               diversity_penalty=0.7, num_return_sequences=2, max_new_tokens=7, pad_token_id=1,
                               length_penalty=1.5, return_dict_in_generate=True, output_scores=True)
    plain = accelerated.generate(input_ids=ids, attention_mask=mask, num_beams=4, num_beam_groups=2,
                                 diversity_penalty=0.7, num_return_sequences=2, max_new_tokens=7, pad_token_id=1,
                                 length_penalty=1.5)
    assert torch.equal(out.sequences, plain)
    start = 1 if family in SEQ2SEQ else ids.shape[1]
    for row in range(out.sequences.shape[0]):
        steps = int((out.beam_indices[row] >= 0).sum())
        tokens = out.sequences[row, start:start + steps]
        total = sum(out.scores[t][out.beam_indices[row, t], tokens[t]] for t in range(steps))
        torch.testing.assert_close(out.sequences_scores[row], total / steps ** 1.5, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", GENERATING)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_rows_finishing_early_are_dropped_and_output_is_unchanged(family, seed, monkeypatch):
    from lightgen.modules.decoder import DecodeState

    drops = []
    original = DecodeState.keep_rows
    monkeypatch.setattr(DecodeState, "keep_rows", lambda self, rows: drops.append(rows.numel()) or original(self, rows))
    accelerated, reference = _pair(family, seed)
    ids, mask = padded_batch(family, 5, 8, seed=seed)
    eos = _eos_from_greedy(reference, ids, mask)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=12, eos_token_id=eos, pad_token_id=1,
                  no_repeat_ngram_size=3)
    expected, got = reference.generate(**kwargs), accelerated.generate(**kwargs)
    assert torch.equal(got, expected)
    generated = expected[:, 1 if family in SEQ2SEQ else ids.shape[1]:]
    finish_steps = [row.tolist().index(eos) if eos in row.tolist() else generated.shape[1] - 1 for row in generated]
    assert bool(drops) == (min(finish_steps) < max(finish_steps))


@pytest.mark.parametrize("settings", [dict(), dict(no_repeat_ngram_size=2)], ids=["fused log_softmax", "processors"])
def test_beam_search_selects_with_the_r_top_k_kernel(settings, monkeypatch):
    from lightgen import ops

    calls = []
    original = ops.beam_topk
    monkeypatch.setattr(ops, "beam_topk", lambda *a: calls.append(a[-1]) or original(*a))
    accelerated, reference = _pair("gpt2", 3)  # its generation_config adds no processors
    ids, mask = padded_batch("gpt2", 3, 7, seed=3)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=9, num_beams=4, **settings)
    assert torch.equal(accelerated.generate(**kwargs), reference.generate(**kwargs))
    assert calls and all(fused == (not settings) for fused in calls)


@pytest.mark.parametrize("bad, message", [(torch.zeros((0, 5), dtype=torch.long), "non-empty"),
                                          (torch.tensor([[5, 500]]), "token id 500 .* outside the table")])
def test_bad_inputs_are_clear_errors(bad, message):
    accelerated, _ = _pair("bart", 0)
    with pytest.raises((ValueError, RuntimeError), match=message):
        accelerated.generate(input_ids=bad, max_new_tokens=3)


@pytest.mark.parametrize("family", DECODER_ONLY)
@pytest.mark.parametrize("num_beams", [1, 3])
def test_unpadded_prompts_without_attention_mask(family, num_beams, step_counter):
    accelerated, reference = _pair(family, 4)
    ids = torch.randint(3, 97, (3, 6), generator=torch.Generator().manual_seed(4))
    kwargs = dict(input_ids=ids, max_new_tokens=6, pad_token_id=0, num_beams=num_beams)
    assert torch.equal(accelerated.generate(**kwargs), reference.generate(**kwargs))
    assert step_counter


def _greedy_without_processors(family, seed, batch=3):
    accelerated, reference = _pair(family, seed)
    for model in (accelerated, reference):
        model.generation_config.forced_eos_token_id = None
    ids, mask = padded_batch(family, batch, 9, seed=seed)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=14, pad_token_id=1)
    return accelerated, reference.generate(**kwargs), kwargs


@pytest.mark.parametrize("family", GENERATING)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_iad_drafting_from_the_input_equals_greedy(family, seed):
    accelerated, expected, kwargs = _greedy_without_processors(family, seed)
    assert torch.equal(accelerated.generate(**kwargs, decoding="iad"), expected)


@pytest.mark.parametrize("family", GENERATING)
@pytest.mark.parametrize("corrupt_every", [0, 5, 2])
def test_iad_with_good_and_bad_drafts_equals_greedy_in_fewer_passes(family, corrupt_every, step_counter,
                                                                    flat_pass_cost):
    """Drafts copied from the greedy output itself (every n-th token corrupted): long acceptances,
    rejections and anchors that move; the tokens must stay greedy's."""
    accelerated, expected, kwargs = _greedy_without_processors(family, 5, batch=4)
    drafts = [row.tolist() for row in expected]
    for row in drafts:
        for index in range(corrupt_every - 1, len(row), corrupt_every or len(row) + 1):
            row[index] = (row[index] + 7) % 97
    got = accelerated.generate(**kwargs, decoding="iad", max_draft=6, draft_ids=drafts)
    assert torch.equal(got, expected)
    generated = expected.shape[1] - (1 if family in SEQ2SEQ else kwargs["input_ids"].shape[1])
    # Some random models stop at once; the tiny T5s repeat one token, so no suffix of their output is unique in
    # the draft and IAD finds no anchor (their tokens are still checked above).
    if corrupt_every == 0 and generated > 6 and family not in ("t5", "mt5"):
        assert len(step_counter) < generated - 3, "exact drafts should need fewer decoder passes"


@pytest.mark.parametrize(("family", "batch", "pack"), [("llama", 40, True), ("gpt2", 8, False), ("bart", 40, True)])
def test_iad_verifies_within_the_rows_greedys_kernels_take(family, batch, pack, flat_pass_cost, monkeypatch):
    """A pass verifies rows x (1 + draft) positions. Past the fp32 kernels' rows (PACKED_MAX_ROWS; IN_PLACE_MAX_ROWS
    with pack=False) ATen would run it, whose sums round otherwise than greedy's one-token steps on the kernel, so
    the drafts shrink to keep every pass within them (before: 40 x 7 = 280 > 256 positions)."""
    from lightgen.modules.decoder import Decoder
    from lightgen.modules.linear import IN_PLACE_MAX_ROWS, PACKED_MAX_ROWS

    reference = build(family, seed=6)
    reference.generation_config.forced_eos_token_id = None
    accelerated = lightgen.accelerate_model(copy.deepcopy(reference), pack=pack)
    ids, mask = padded_batch(family, batch, 9, seed=6)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=12, pad_token_id=1)
    with torch.no_grad():
        expected = reference.generate(**kwargs)
    fed = []
    original = Decoder._step
    monkeypatch.setattr(Decoder, "_step", lambda self, state, tokens, *a, **k: (
        fed.append((state.in_prompt, tokens.shape)) or original(self, state, tokens, *a, **k)))
    got = accelerated.generate(**kwargs, decoding="iad", max_draft=6, draft_ids=[row.tolist() for row in expected])
    assert torch.equal(got, expected)
    limit = PACKED_MAX_ROWS if pack else IN_PLACE_MAX_ROWS
    passes = [shape for in_prompt, shape in fed if not in_prompt]
    assert max(rows * width for rows, width in passes) <= limit
    assert max(width for _, width in passes) > 1  # drafts were verified


@pytest.mark.parametrize("family", ["bart", "gpt2"])
def test_iad_reports_passes_and_tokens_per_pass(family, step_counter):
    """return_dict_in_generate adds per-row pass counts and tokens per pass; sequences stay greedy's."""
    from lightgen.generation.aggressive import AggressiveDecoderOnlyOutput, AggressiveEncoderDecoderOutput

    accelerated, expected, kwargs = _greedy_without_processors(family, 5, batch=4)
    drafts = [row.tolist() for row in expected]
    out = accelerated.generate(**kwargs, decoding="iad", max_draft=6, draft_ids=drafts, return_dict_in_generate=True)
    assert isinstance(out, AggressiveEncoderDecoderOutput if family in SEQ2SEQ else AggressiveDecoderOnlyOutput)
    assert torch.equal(out.sequences, expected)
    assert out.iterations.tolist() == [len(row) for row in out.tokens_per_iteration]
    assert int(out.iterations.max()) == len(step_counter)  # the last row to finish took part in every pass
    prompt = 1 if family in SEQ2SEQ else kwargs["input_ids"].shape[1]
    assert max(int(row.sum()) for row in out.tokens_per_iteration) == expected.shape[1] - prompt
    assert all(int(row.min()) >= 1 for row in out.tokens_per_iteration)
    with pytest.warns(RuntimeWarning, match="does not return scores or logits"):
        accelerated.generate(**kwargs, decoding="iad", return_dict_in_generate=True, output_scores=True)


def test_iad_needs_greedy_and_says_so():
    accelerated, _ = _pair("bart", 0)
    ids, mask = padded_batch("bart", 1, 5)
    with pytest.warns(RuntimeWarning, match="decoding='iad' is greedy decoding"):
        accelerated.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, num_beams=2, decoding="iad")
    with pytest.raises(ValueError, match="decoding must be 'auto', 'iad' or 'gad'"):
        accelerated.generate(input_ids=ids, max_new_tokens=4, decoding="fast")


def test_generate_inside_and_outside_inference_mode_share_buffers():
    """Pooled buffers first allocated under torch.inference_mode() are reused by a plain call."""
    accelerated, reference = _pair("bart", 0)
    ids, mask = padded_batch("bart", 2, 6)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=5)
    expected = reference.generate(**kwargs)
    with torch.inference_mode():
        assert torch.equal(accelerated.generate(**kwargs), expected)
    assert torch.equal(accelerated.generate(**kwargs), expected)


@pytest.mark.parametrize("family", ["bart", "gpt2"])
def test_min_length_blocking_in_place_keeps_raw_logits_and_scores(family):
    """EOS is blocked in place on the engine's own logits; output_logits still gets them unprocessed."""
    accelerated, reference = _pair(family, 6)
    ids, mask = padded_batch(family, 3, 6, seed=6)
    eos = _eos_from_greedy(reference, ids, mask, new_tokens=1)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=6, min_new_tokens=4, min_length=3,
                  eos_token_id=eos, pad_token_id=1, return_dict_in_generate=True, output_scores=True,
                  output_logits=True)
    got, expected = accelerated.generate(**kwargs), reference.generate(**kwargs)
    assert torch.equal(got.sequences, expected.sequences)
    assert torch.isinf(got.scores[0][:, eos]).all() and not torch.isinf(got.logits[0][:, eos]).any()
    for mine, theirs in zip(got.scores + got.logits, expected.scores + expected.logits, strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-4)


def test_min_length_blocking_copies_after_a_processor_of_unknown_origin():
    from transformers import LogitsProcessor, LogitsProcessorList, MinNewTokensLengthLogitsProcessor

    from lightgen.generation.engine import _without_vocabulary_scans

    class Cached(LogitsProcessor):  # returns a tensor it keeps: writing into it would corrupt its state
        def __init__(self):
            self.kept = torch.zeros(2, 10)

        def __call__(self, input_ids, scores):
            return self.kept

    eos = torch.tensor([3])
    blocked = MinNewTokensLengthLogitsProcessor(2, 5, eos)
    ours_first = _without_vocabulary_scans(LogitsProcessorList([blocked, Cached()]))
    assert ours_first[0].in_place
    cached = Cached()
    after_user = _without_vocabulary_scans(LogitsProcessorList([cached, blocked]))
    out = after_user(torch.zeros(2, 3, dtype=torch.long), torch.randn(2, 10))
    assert not after_user[1].in_place and torch.isinf(out[:, 3]).all() and not cached.kept.isinf().any()


def test_processors_apply_as_hfs_list_does_with_signatures_checked_once():
    from transformers import (LogitsProcessor, LogitsProcessorList, MinNewTokensLengthLogitsProcessor,
                              NoRepeatNGramLogitsProcessor, RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper)

    from lightgen.generation.engine import _applying

    class NeedsMore(LogitsProcessor):  # HF's list refuses it unless the keyword is passed (it never is)
        def __call__(self, input_ids, scores, extra):
            return scores

    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 40, (3, 9), generator=generator)
    processors = LogitsProcessorList([RepetitionPenaltyLogitsProcessor(1.3), NoRepeatNGramLogitsProcessor(2),
                                      MinNewTokensLengthLogitsProcessor(5, 4, torch.tensor([2])),
                                      TemperatureLogitsWarper(0.7)])
    for _ in range(5):
        scores = torch.randn(3, 40, generator=generator)
        assert torch.equal(_applying(processors)(ids, scores.clone()), processors(ids, scores.clone()))
    with_more = LogitsProcessorList([*processors, NeedsMore()])
    assert _applying(with_more) is with_more
    accelerated, reference = _pair("gpt2", 3)
    ids, mask = padded_batch("gpt2", 2, 5, seed=3)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=3, pad_token_id=0,
                  logits_processor=LogitsProcessorList([NeedsMore()]))
    for model in (reference, accelerated):
        with pytest.raises(ValueError, match="required parameters"):
            model.generate(**kwargs)


@pytest.mark.parametrize("top_k", [1, 3, 50, 400])
def test_top_k_keeps_the_scores_hfs_warper_keeps(top_k):
    """Ties at the k-th score, rows already mostly masked, k past the vocabulary, NaN / +inf (HF's own call)."""
    from transformers import TopKLogitsWarper

    from lightgen.generation.engine import _TopK

    warper, generator = TopKLogitsWarper(top_k), torch.Generator().manual_seed(top_k)
    ids = torch.zeros(6, 2, dtype=torch.long)
    for case in range(12):
        scores = torch.randn(6, 300, generator=generator)
        scores[0] = scores[0].round()  # many ties
        scores[1, 5:] = float("-inf")  # fewer finite scores than k
        scores[2] = float("-inf")
        if case % 3 == 1:
            scores[3, 7] = float("nan")
        if case % 3 == 2:
            scores[4, 9] = float("inf")
        torch.testing.assert_close(_TopK(warper)(ids, scores.clone()), warper(ids, scores.clone()), rtol=0, atol=0,
                                   equal_nan=True)


HOOKED_MODULES = {  # a linear layer, a norm (read directly by lightgen's fused paths) and a whole layer
    "bart": ("model.decoder.layers.0.self_attn.q_proj", "model.decoder.layers.1.final_layer_norm",
             "model.encoder.layers.0.self_attn_layer_norm", "model.decoder.layers.0"),
    "gpt2": ("transformer.h.0.attn.c_attn", "transformer.h.1.ln_2", "transformer.h.0"),
}


@pytest.mark.parametrize("family, hooked", [(f, m) for f, names in HOOKED_MODULES.items() for m in names])
def test_forward_hooks_run_and_change_the_output_as_in_hf(family, hooked):
    """Hooks that change a module's output (steering) must not be skipped by lightgen's direct weight reads:
    generate warns and runs HF's loop, whose patched blocks run their original code around a hooked module."""
    accelerated, reference = _pair(family, 0)
    calls = []

    def steer(module, inputs, output):
        calls.append(1)
        return output * 1.5

    for model in (accelerated, reference):
        model.get_submodule(hooked).register_forward_hook(steer)
    ids, mask = padded_batch(family, 2, 6)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=6, min_new_tokens=6, pad_token_id=0)
    expected = reference.generate(**kwargs)
    hf_calls = len(calls)
    calls.clear()
    with pytest.warns(RuntimeWarning, match=f"module '{re.escape(hooked)}' carries forward hooks"):
        got = accelerated.generate(**kwargs)
    assert torch.equal(got, expected) and len(calls) == hf_calls > 0
    forward = dict(input_ids=ids, attention_mask=mask) | ({"decoder_input_ids": ids} if family in SEQ2SEQ else {})
    with torch.no_grad():  # the patched forward itself, outside generate: the unhooked layers run lightgen's kernels
        torch.testing.assert_close(accelerated(**forward).logits, reference(**forward).logits, atol=1e-4, rtol=1e-4)
