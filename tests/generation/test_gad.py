"""Generalized aggressive decoding: any drafter, greedy's tokens (beta=1); GAD++'s acceptance rule."""

import copy
import random

import pytest
import torch
from models import DECODER_ONLY, SEQ2SEQ, VOCAB, build, padded_batch

import lightgen
from lightgen.generation.aggressive import Acceptance, CopyFromInput, aggressive_greedy
from lightgen.generation.drafting import DrafterConfig, NARDrafter, greedy_targets, train_drafter
from lightgen.generation.tokens import pad_rows, padding_mask

GENERATING = SEQ2SEQ + DECODER_ONLY


def _greedy(family, seed, batch=3, length=9, new_tokens=14):
    reference = build(family, seed=seed)
    reference.generation_config.forced_eos_token_id = None
    accelerated = lightgen.accelerate_model(copy.deepcopy(reference))
    ids, mask = padded_batch(family, batch, length, seed=seed)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, pad_token_id=1)
    return accelerated, reference, reference.generate(**kwargs), kwargs


def _random_drafter(seed, encoder_layers=1, width=32):
    """encoder_layers=0: it reads the verifier's encoder output, ``width`` wide (most test models are 32)."""
    torch.manual_seed(seed)
    return NARDrafter(DrafterConfig(vocab_size=VOCAB, pad_token_id=1, d_model=width, heads=2, ffn_dim=48,
                                    encoder_layers=encoder_layers, decoder_layers=1, max_positions=64,
                                    max_block_size=8)).eval()


@pytest.mark.parametrize("family", GENERATING)
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("block_size", [1, 3, 8])
def test_gad_with_an_untrained_drafter_equals_greedy(family, seed, block_size):
    accelerated, _, expected, kwargs = _greedy(family, seed)
    got = accelerated.generate(**kwargs, decoding="gad", drafter=_random_drafter(seed), block_size=block_size)
    assert torch.equal(got, expected)
    if family in SEQ2SEQ:
        shared = _random_drafter(seed, encoder_layers=0, width=accelerated.config.d_model)
        assert torch.equal(accelerated.generate(**kwargs, decoding="gad", drafter=shared, block_size=block_size),
                           expected)


@pytest.mark.parametrize("encoder_layers", [0, 1])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_drafting_on_the_kernels_equals_the_module(encoder_layers, seed):
    """Drafting runs ``drafting_layers()`` (packed weights, cross K/V once per call): the same logits as
    the nn.Module, for padded rows of different lengths and block sizes, and again after the weights change."""
    drafter = _random_drafter(seed, encoder_layers)
    drafter.drafting_precision = None  # float32: the module's logits to rounding (int8: below)
    gen = torch.Generator().manual_seed(seed)
    sources = [torch.randint(3, VOCAB, (length,), generator=gen).tolist() for length in (7, 3, 11)]
    memory = torch.randn(3, 11, 32, generator=gen)
    keep = torch.arange(11) < torch.tensor([7, 3, 11])[:, None]
    session = drafter.start(sources, memory, keep.long())
    targets = [[2, 5, 9] + [drafter.mask_token_id] * 4, [2] + [drafter.mask_token_id] * 2,
               [2, 7, 7, 8, 9, 10] + [drafter.mask_token_id] * 8]
    target, target_pad = pad_rows(targets, 1), padding_mask(targets)
    for _ in range(2):
        layers = drafter.drafting_layers()
        with torch.inference_mode():
            expected = drafter.decode(session.memory, session.source_pad, target, target_pad)
            got = layers.decode(layers.cross_keys_values(session.memory), ~session.source_pad, target, target_pad)
        assert got.shape == (14, VOCAB)
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
        with torch.no_grad():
            drafter.decoder.layers[0].linear1.weight.mul_(3.0)  # an optimizer step would do this in place
    assert drafter.drafting_layers() is not layers
    drafter.drafting_precision = "int8"  # the default: weight-only int8 linears, close to float32
    layers = drafter.drafting_layers()
    with torch.inference_mode():
        expected = drafter.decode(session.memory, session.source_pad, target, target_pad)
        got = layers.decode(layers.cross_keys_values(session.memory), ~session.source_pad, target, target_pad)
    torch.testing.assert_close(got, expected, rtol=0.05, atol=0.05)


def test_a_session_encodes_and_makes_the_cross_keys_and_values_at_its_first_draft_only(monkeypatch):
    """A call whose policy never drafts (drafts that do not pay) costs no drafter work beyond its start: not the
    drafter's own encoding of the sources, its kernels' layers (a walk over its parameters) or the cross K/V."""
    drafter = _random_drafter(3)
    layers = drafter.drafting_layers()
    made, encoded, looked_up = [], [], []
    original, encode, drafting_layers = layers.cross_keys_values, drafter.encode, drafter.drafting_layers
    monkeypatch.setattr(layers, "cross_keys_values", lambda memory: made.append(1) or original(memory))
    monkeypatch.setattr(drafter, "encode", lambda *args: encoded.append(1) or encode(*args))
    monkeypatch.setattr(drafter, "drafting_layers", lambda: looked_up.append(1) or drafting_layers())
    session = drafter.start([[5, 6, 7, 8], [9, 10]])
    assert made == [] and encoded == [] and looked_up == []
    first = session.draft([0, 1], [[2], [2, 4]], [3, 3])
    assert session.draft([0, 1], [[2], [2, 4]], [3, 3]) == first
    assert session.draft([1], [[2, 4]], [3]) == first[1:]
    assert len(made) == len(encoded) == len(looked_up) == 1


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_causal_prefix_drafting_from_its_cache_equals_the_module(seed):
    """A ``causal_prefix`` drafter drafts from cached keys/values of the output so far: over successive
    drafts with outputs growing by different amounts, rows leaving and a block size changing, its drafts'
    logits equal the module's full recomputation."""
    torch.manual_seed(seed)
    drafter = NARDrafter(DrafterConfig(vocab_size=VOCAB, pad_token_id=1, d_model=32, heads=4, ffn_dim=48,
                                       decoder_layers=2, max_positions=64, max_block_size=8,
                                       causal_prefix=True)).eval()
    drafter.drafting_precision = None
    gen = torch.Generator().manual_seed(seed)
    memory = torch.randn(3, 9, 32, generator=gen)
    keep = torch.arange(9) < torch.tensor([9, 4, 6])[:, None]
    session = drafter.start([[5] * 9, [6] * 4, [7] * 6], memory, keep.long(), max_length=40)
    outputs = [[2], [2], [2]]
    rows = [0, 1, 2]
    for step, block in enumerate([4, 4, 6, 3, 8]):
        if step == 3:
            rows = [0, 2]  # row 1 finished
        for row in rows:  # the verifier adds 1..4 tokens per pass
            outputs[row] += torch.randint(3, VOCAB, (int(torch.randint(1, 5, (1,), generator=gen)),),
                                          generator=gen).tolist()
        targets = [outputs[row] + [drafter.mask_token_id] * block for row in rows]
        with torch.inference_mode():
            index = torch.tensor(rows)
            expected = drafter.decode(memory[index], ~keep[index], pad_rows(targets, 1), padding_mask(targets))
        drafts = session.draft(rows, [outputs[row] for row in rows], [block] * len(rows))
        assert drafts == expected.argmax(-1).view(len(rows), block).tolist()
        assert session.cache.filled.tolist() == [len(outputs[0]), len(outputs[1]), len(outputs[2])]
    long = [2] + [9] * 36  # no room left in the cache for 8 masks: that row stops drafting
    assert session.draft([0], [long], [8]) == [[]]


def test_causal_prefix_outputs_do_not_see_later_tokens():
    """In ``decode`` (training, and drafting off the kernels) an output token's state ignores what follows."""
    torch.manual_seed(0)
    drafter = NARDrafter(DrafterConfig(vocab_size=VOCAB, pad_token_id=1, d_model=32, heads=4, ffn_dim=48,
                                       decoder_layers=1, max_positions=64, causal_prefix=True)).eval()
    memory, source_pad = torch.randn(1, 5, 32), torch.zeros(1, 5, dtype=torch.bool)
    captured = []
    hook = drafter.decoder.layers[0].register_forward_hook(lambda module, args, out: captured.append(out))
    mask = drafter.mask_token_id
    for target in ([[2, 5, 6, mask, mask]], [[2, 5, 6, 7, mask]]):
        with torch.no_grad():
            drafter.decode(memory, source_pad, torch.tensor(target), torch.zeros(1, 5, dtype=torch.bool))
    hook.remove()
    torch.testing.assert_close(captured[0][0, :3], captured[1][0, :3])  # 2 5 6: same states
    assert not torch.allclose(captured[0][0, 3], captured[1][0, 3])


def test_drafting_outside_float32_cpu_runs_the_module():
    drafter = _random_drafter(0).to(torch.bfloat16)
    assert drafter.drafting_layers() is None
    session = drafter.start([[5, 6, 7]])
    assert len(session.draft([0], [[2, 5]], [3])[0]) == 3


def test_a_drafter_without_an_encoder_refuses_decoder_only_verifiers():
    accelerated, _, _, kwargs = _greedy("gpt2", 0)
    with pytest.raises(ValueError, match="drafts for encoder-decoder verifiers"):
        accelerated.generate(**kwargs, decoding="gad", drafter=_random_drafter(0, encoder_layers=0))


def _oracle(expected, corrupt_every=0, eos=None):
    """A callable drafter that knows greedy's output (every n-th token wrong, or EOS sprinkled in)."""
    targets = [row.tolist() for row in expected]

    def draft(sources, outputs, block_size):
        drafts = []
        for output in outputs:
            target = next(t for t in targets if t[:len(output)] == output)
            guess = target[len(output):len(output) + block_size]
            for index in range(len(guess)):
                position = len(output) + index
                if corrupt_every and position % corrupt_every == 0:
                    guess[index] = (guess[index] + 5) % VOCAB
                if eos is not None and position % 4 == 3:
                    guess[index] = eos
            drafts.append(guess)
        return drafts

    return draft


@pytest.mark.parametrize("family", ["bart", "marian", "gpt2", "llama"])
@pytest.mark.parametrize("corrupt_every, eos", [(0, None), (3, None), (2, None), (0, 2)])
def test_gad_with_good_bad_and_eos_drafts_equals_greedy(family, corrupt_every, eos, step_counter, flat_pass_cost):
    accelerated, _, expected, kwargs = _greedy(family, 3, batch=4)
    out = accelerated.generate(**kwargs, decoding="gad", drafter=_oracle(expected, corrupt_every, eos), block_size=5,
                               return_dict_in_generate=True)
    assert torch.equal(out.sequences, expected)
    prompt = 1 if family in SEQ2SEQ else kwargs["input_ids"].shape[1]
    longest = expected.shape[1] - prompt
    if corrupt_every == 0 and eos is None and longest > 5:
        assert len(step_counter) <= -(-longest // 6) + 2, "exact drafts: up to 6 tokens per pass"
        assert int(out.tokens_per_iteration[0].max()) == 6


@pytest.mark.parametrize("bad", ["empty", "too_long", "random"])
def test_gad_survives_drafts_of_any_shape(bad):
    accelerated, _, expected, kwargs = _greedy("bart", 4, batch=3)
    rng = random.Random(0)

    def draft(sources, outputs, block_size):
        if bad == "empty":
            return [[] for _ in outputs]
        if bad == "too_long":
            return [[rng.randrange(3, VOCAB) for _ in range(block_size + 7)] for _ in outputs]
        return [[rng.randrange(0, VOCAB) for _ in range(rng.randrange(block_size + 1))] for _ in outputs]

    assert torch.equal(accelerated.generate(**kwargs, decoding="gad", drafter=draft, block_size=4), expected)


def test_a_drafter_answering_for_the_wrong_number_of_rows_is_a_clear_error():
    accelerated, _, _, kwargs = _greedy("bart", 0)
    with pytest.raises(ValueError, match="drafter returned 1 drafts for 3 rows"):
        accelerated.generate(**kwargs, decoding="gad", drafter=lambda sources, outputs, k: [[5]])


@pytest.mark.parametrize("family", ["bart", "mbart", "gpt2", "qwen2"])
@pytest.mark.parametrize("assistant_seed", [None, 7])
def test_gad_with_an_autoregressive_assistant_equals_greedy(family, assistant_seed, step_counter, flat_pass_cost):
    """A small AR model drafts on its own cache; the verifier's copy as assistant drafts greedy itself."""
    accelerated, reference, expected, kwargs = _greedy(family, 2, batch=4, new_tokens=18)
    assistant = copy.deepcopy(reference) if assistant_seed is None else build(family, seed=assistant_seed)
    out = accelerated.generate(**kwargs, decoding="gad", drafter=assistant, block_size=4,
                               return_dict_in_generate=True)
    assert torch.equal(out.sequences, expected)
    if assistant_seed is None:  # every draft token is greedy's: 5 tokens per verifier pass until the end
        assert all(min(row[1:-1].tolist(), default=5) == 5 for row in out.tokens_per_iteration)


@pytest.mark.parametrize("family", ["bart", "gpt2"])
@pytest.mark.parametrize("beta, tau", [(2, 0.5), (3, 2.0), (5, 100.0)])
def test_gad_plus_plus_accepts_only_top_beta_tokens_within_tau(family, beta, tau):
    """Score the GAD++ output with the reference model: every token the verifier did not pick itself
    is among its top-beta and within tau of its top-1, given the output before it."""
    accelerated, reference, _, kwargs = _greedy(family, 6, batch=3, new_tokens=16)
    got = accelerated.generate(**kwargs, decoding="gad", drafter=_random_drafter(6), block_size=6, beta=beta, tau=tau)
    prompt = 1 if family in SEQ2SEQ else kwargs["input_ids"].shape[1]
    with torch.no_grad():
        if family in SEQ2SEQ:
            logits = reference(input_ids=kwargs["input_ids"], attention_mask=kwargs["attention_mask"],
                               decoder_input_ids=got).logits
        else:
            mask = torch.cat([kwargs["attention_mask"], torch.ones_like(got[:, prompt:])], 1)
            positions = (mask.cumsum(-1) - 1).clamp(min=0)
            logits = reference(input_ids=got, attention_mask=mask, position_ids=positions).logits
    log_probs = logits.float().log_softmax(-1)
    for row in range(got.shape[0]):
        for position in range(prompt, got.shape[1]):
            token = int(got[row, position])
            scores = log_probs[row, position - 1]
            if token == 1 and int(got[row, position - 1]) in (1, 2):  # padding after EOS
                break
            top, candidates = scores.topk(beta)
            assert token in candidates.tolist() and float(top[0] - scores[token]) <= tau + 1e-5
            if token == 2:
                break


def test_gad_plus_plus_with_greedy_drafts_is_greedy():
    accelerated, _, expected, kwargs = _greedy("bart", 3, batch=4)
    got = accelerated.generate(**kwargs, decoding="gad", drafter=_oracle(expected), block_size=5, beta=4, tau=3.0)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("kwargs, message", [
    (dict(decoding="gad"), "needs a drafter"),
    (dict(decoding="iad", drafter=lambda *a: []), "needs a drafter"),
    (dict(decoding="iad", beta=2), "apply to decoding='gad' only"),
    (dict(decoding="gad", drafter=lambda *a: [], beta=0), "beta >= 1"),
    (dict(decoding="gad", drafter=lambda *a: [], tau=-1.0), "tau >= 0"),
    (dict(decoding="gad", drafter=lambda *a: [], block_size=0), "block_size must be >= 1"),
    (dict(decoding="gad", drafter="model.bin"), "drafter must be"),
])
def test_bad_aggressive_settings_are_clear_errors(kwargs, message):
    accelerated, _, _, generate_kwargs = _greedy("bart", 0)
    with pytest.raises((ValueError, TypeError), match=message):
        accelerated.generate(**generate_kwargs, **kwargs)


def test_gad_needs_greedy_and_says_so():
    accelerated, _, _, kwargs = _greedy("bart", 0)
    with pytest.warns(RuntimeWarning, match="decoding='gad' is greedy decoding"):
        accelerated.generate(**kwargs, decoding="gad", drafter=_random_drafter(0), do_sample=True)


@pytest.mark.parametrize("drafts", ["copy", "nar"])
def test_rolled_back_cache_is_the_greedy_cache(drafts):
    """After aggressive decoding, the filled cache positions hold what greedy step-by-step decoding wrote."""
    accelerated, _, expected, kwargs = _greedy("bart", 5, batch=1, new_tokens=20)
    decoder = accelerated._lightgen_decoder
    ids, mask = kwargs["input_ids"], kwargs["attention_mask"]
    with torch.no_grad():
        encoded = accelerated.get_encoder()(input_ids=ids, attention_mask=mask)[0]
    start = dict(rows=1, max_len=40, dtype=torch.float32, device="cpu", encoder_hidden=encoded, encoder_mask=mask)
    greedy_state = decoder.start(**start)
    with torch.no_grad():
        for token in expected[0, :-1]:
            decoder.step(greedy_state, token.view(1, 1))
    source = ids[0].tolist()
    session = CopyFromInput([source]) if drafts == "copy" else _random_drafter(5).start([source])
    state = decoder.start(**start, spare_positions=6)
    with torch.no_grad():
        sequences, _ = aggressive_greedy(decoder, state, expected[:, :1], None, session, {2}, 1, expected.shape[1], 6,
                                         Acceptance())
    assert torch.equal(sequences, expected)
    filled = int(state.lengths[0])
    assert filled == expected.shape[1] - 1 == greedy_state.cache.length
    for index in range(len(state.cache.keys)):
        for got, expected_kv in zip(state.cache.layer(index), greedy_state.cache.layer(index), strict=True):
            torch.testing.assert_close(got[:1, :, :filled], expected_kv[:1, :, :filled])
    state.release()
    greedy_state.release()


def _slot_accuracy(drafter, sources, targets, block):
    session, hits, total = drafter.start(sources), 0, 0
    for cut in range(1, 6):
        outputs = [target[:cut] for target in targets]
        drafts = session.draft(list(range(len(sources))), outputs, [block] * len(sources))
        for draft, target in zip(drafts, targets, strict=True):
            expected = target[cut:cut + block]
            hits += sum(a == b for a, b in zip(draft, expected, strict=False))
            total += len(expected)
    return hits / total


def test_drafter_training_learns_to_fill_masks_and_round_trips(tmp_path):
    """train_drafter on a copy task: the trained drafter fills most masked slots; saving keeps it."""
    gen = torch.Generator().manual_seed(8)
    sources = [torch.randint(3, VOCAB, (int(torch.randint(5, 12, (1,), generator=gen)),), generator=gen).tolist()
               for _ in range(256)]
    targets = [[2] + source + [2] for source in sources]
    untrained = _random_drafter(8)
    trained = train_drafter(copy.deepcopy(untrained), sources, targets, steps=200, batch_size=32, lr=3e-3, warmup=10,
                            log=lambda line: None)
    held_sources = sources[:32]  # the task is a rule, so seen sentences measure it as well as new ones
    before = _slot_accuracy(untrained, held_sources, targets[:32], 4)
    after = _slot_accuracy(trained, held_sources, targets[:32], 4)
    assert after > max(0.2, 5 * before), (before, after)  # chance is 1 in 97
    trained.save_pretrained(tmp_path)
    loaded = NARDrafter.from_pretrained(tmp_path)
    for name, tensor in trained.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor.half().float()), name


def test_greedy_targets_are_the_verifiers_greedy_sequences():
    verifier = lightgen.accelerate_model(build("marian", seed=8))
    sources = [[5, 6, 7, 8], [9, 10], [11, 12, 13, 14, 15, 16]]
    targets = greedy_targets(verifier, sources, pad_token_id=1, batch_size=2, max_length=12)
    for source, target in zip(sources, targets, strict=True):
        expected = verifier.generate(input_ids=torch.tensor([source]), max_length=12, do_sample=False)[0].tolist()
        assert target == expected


@pytest.mark.parametrize("family", ["bart", "gpt2"])
@pytest.mark.parametrize("new_tokens", [3, 7])
def test_forced_eos_at_max_length_as_in_hf(family, new_tokens):
    """HF's ForcedEOSTokenLogitsProcessor (BART checkpoints set forced_eos_token_id) stays exact."""
    accelerated, reference, _, kwargs = _greedy(family, 1, batch=4, new_tokens=new_tokens)
    kwargs["forced_eos_token_id"] = 2
    expected = reference.generate(**kwargs)
    assert (expected[:, -1] == 2).any()
    assert torch.equal(accelerated.generate(**kwargs, decoding="iad"), expected)
    assert torch.equal(accelerated.generate(**kwargs, decoding="gad", drafter=_random_drafter(1)), expected)


@pytest.mark.parametrize("family", ["bart", "gpt2"])
def test_assistant_model_argument_runs_batched_gad(family, step_counter):
    """HF's assistant_model argument: lightgen drafts with it (GAD), batched, with greedy's tokens."""
    accelerated, reference, expected, kwargs = _greedy(family, 2, batch=3)
    assistant = build(family, seed=9)
    hf_assistant = copy.deepcopy(assistant)  # lightgen accelerates the one it is given, in place
    got = accelerated.generate(**kwargs, assistant_model=assistant)
    assert torch.equal(got, expected)
    assert step_counter, "lightgen's decoder ran"
    single = {key: value[:1] for key, value in kwargs.items() if key in ("input_ids", "attention_mask")}
    hf_assisted = reference.generate(**kwargs | single, assistant_model=hf_assistant)
    assert torch.equal(accelerated.generate(**kwargs | single, assistant_model=assistant), hf_assisted)


@pytest.mark.parametrize("family", ["bart", "gpt2"])
def test_scored_positions_get_the_logits_every_position_gets(family):
    """Verification scores only the real positions of padded drafts: the same logits, bit for bit."""
    model = lightgen.accelerate_model(build(family, seed=3))
    decoder = model._lightgen_decoder
    tokens = torch.randint(3, VOCAB, (3, 5), generator=torch.Generator().manual_seed(3))
    scored = torch.tensor([[True] * 5, [True, True, False, False, False], [True, False, False, False, False]])
    start = dict(rows=3, max_len=12, dtype=torch.float32, device="cpu")
    if family == "bart":
        start.update(encoder_hidden=torch.randn(3, 4, model.config.d_model), encoder_mask=torch.ones(3, 4))
    logits = {}
    with torch.no_grad():
        for name, kwargs in (("all", dict(all_positions=True)), ("scored", dict(scored=scored))):
            state = decoder.start(**start)
            logits[name] = decoder.step(state, tokens, **kwargs)
            state.release()
    assert logits["scored"].shape == (int(scored.sum()), logits["all"].shape[-1])
    assert torch.equal(logits["scored"], logits["all"][scored])


@pytest.mark.parametrize("family", GENERATING)
@pytest.mark.parametrize("quantize", ["int8", "int4"])
def test_a_self_drafter_drafts_on_the_verifiers_cache_and_returns_greedy(family, quantize, monkeypatch,
                                                                        flat_pass_cost):
    """The verifier with quantized linears drafts on the verifier's own decode state (its decoder never starts
    one: no prompt pass, no catch-up feeds), for padded rows, with drafts cut at max_length; greedy's tokens."""
    from lightgen.drafting import self_drafter
    from lightgen.modules.decoder import Decoder

    reference = build(family, seed=4)
    # No EOS: untrained models often end at once, and a self-drafter has to draft whole outputs here.
    reference.generation_config.forced_eos_token_id = reference.generation_config.eos_token_id = None
    accelerated = lightgen.accelerate_model(copy.deepcopy(reference))
    ids, mask = padded_batch(family, 4, 9, seed=4)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=16, pad_token_id=1)
    expected = reference.generate(**kwargs)
    drafter = self_drafter(accelerated, quantize)
    drafter_decoder = drafter._lightgen_decoder
    started = []
    original_start = Decoder.start
    monkeypatch.setattr(Decoder, "start", lambda self, *a, **k: started.append(self) or original_start(self, *a, **k))
    for block_size in (1, 3, 8):
        out = accelerated.generate(**kwargs, decoding="gad", drafter=drafter, block_size=block_size,
                                   return_dict_in_generate=True)
        assert torch.equal(out.sequences, expected)
        assert drafter_decoder not in started and drafter_decoder.native_steps + len(started) > 0
        # A 1-token block drafts one token a pass: 2 tokens when it is greedy's, which most of int8's are.
        if block_size > 1 and quantize == "int8":
            assert sum(int(row.sum()) for row in out.tokens_per_iteration) > 1.5 * sum(
                len(row) for row in out.tokens_per_iteration)
    # An EOS that one row's greedy output reaches part-way: rows leave the batch at different passes.
    kwargs["eos_token_id"] = int(expected[0, -10])
    expected = reference.generate(**kwargs)
    assert (expected == kwargs["eos_token_id"]).any(-1).any()
    assert torch.equal(accelerated.generate(**kwargs, decoding="gad", drafter=drafter, block_size=4), expected)


@pytest.mark.parametrize("accelerate_first", [True, False])
def test_self_drafter_shares_the_weights_and_leaves_the_verifier_as_it_was(accelerate_first):
    from lightgen.adapters.base import patched_summary
    from lightgen.drafting import self_drafter

    reference = build("llama", seed=5)
    model = lightgen.accelerate_model(copy.deepcopy(reference)) if accelerate_first else copy.deepcopy(reference)
    summary = patched_summary(model)
    ids, mask = padded_batch("llama", 3, 7, seed=5)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=10, pad_token_id=1)
    drafter = self_drafter(model, "int4")
    assert patched_summary(model) == summary
    assert all(a is b for a, b in zip(model.parameters(), drafter.parameters(), strict=True))
    assert drafter._lightgen_patcher.quantize == "int4"
    expected = reference.generate(**kwargs)
    assert torch.equal(model.generate(**kwargs), expected)
    if accelerate_first:  # a drafter for another model of the same shape drafts on its own cache
        other = lightgen.accelerate_model(copy.deepcopy(reference))
        assert torch.equal(other.generate(**kwargs, decoding="gad", drafter=drafter, block_size=4), expected)


def test_self_drafter_needs_a_compact_precision_and_a_hugging_face_model():
    from lightgen.drafting import self_drafter

    with pytest.raises(ValueError, match="compact precision"):
        self_drafter(build("gpt2"), None)
    with pytest.raises(TypeError, match="Hugging Face model"):
        self_drafter(torch.nn.Linear(2, 2))


def test_each_self_drafter_keeps_its_own_cost_line_and_acceptance_history():
    """Drafts of different precisions cost and agree differently: the draft policy learns each on its own."""
    from lightgen.drafting import self_drafter
    from lightgen.generation.draft_policy import _kept_on

    model = lightgen.accelerate_model(build("qwen2", seed=6))
    ids, mask = padded_batch("qwen2", 2, 6, seed=6)
    drafters = [self_drafter(model, "int8"), self_drafter(model, "int4")]
    for drafter in drafters:
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, pad_token_id=1, decoding="gad",
                       drafter=drafter, block_size=3)
    kept = _kept_on(model._lightgen_decoder)
    for what in ("pass_cost", "acceptance"):
        assert sum(key[0] == what and key[1][0] == "self-drafter" for key in kept) == 2
