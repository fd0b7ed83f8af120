"""Differential fuzz of the fairseq plugin: ``accelerate_model`` on a randomly drawn fairseq Transformer (depths,
widths, heads, pre/post-norm per side, learned or sinusoidal or no positions, activations, shared or scaled
embeddings, embedding LayerNorms, perturbed weights) against fairseq's own ``SequenceGenerator`` over drawn
searches (beam, greedy, sampling, diverse beams; greedy also as lightgen's IAD or GAD), length and score settings,
suppressed tokens, prefixes and left-padded batches. Hypotheses must be identical (tokens, order) but where their
scores tie (``ties_in``, ``_cut_ties``), scores within 1e-4, or within ``ROUNDING_FACTOR`` times fairseq's own fp32
error on the case (``_rounding``: its scores against fp64).

Each case is drawn from its own seed, so a seed is a complete, reproducible case; the run takes a third of
``LIGHTGEN_FUZZ_SECONDS`` (default 90; ``LIGHTGEN_FUZZ_MINUTES`` for a long run) from a base seed that changes
every run (``LIGHTGEN_FUZZ_SEED`` pins it); ``LIGHTGEN_FUZZ_CASE=<seed>`` reruns one case, and a failure names it.
"""

import copy
import functools
import os
import random
import warnings

import pytest
import torch

if not os.environ.get("CI"):  # CI installs fairseq (README test command); a skip there would hide a defect
    pytest.importorskip("fairseq", reason="fairseq not installed: pip install -e '.[fairseq]' && "
                                          "lightgen install-fairseq")

import fairseq_models as fm  # noqa: E402
from fairseq import search  # noqa: E402
from test_fairseq_api import SCORE_TOL  # noqa: E402

from fuzzing import ROUNDING_FACTOR, first_shared_tie, fuzz, tie, ties_in  # noqa: E402

import lightgen  # noqa: E402
from lightgen.generation.drafting import DrafterConfig, NARDrafter  # noqa: E402
from lightgen.generation.fairseq_greedy import AggressiveGenerator, iad_unsupported  # noqa: E402

pytestmark = pytest.mark.fairseq

# Every case that ever failed, with what it found.
REGRESSIONS: dict[int, str] = {
    17803882600004: "post-norm decoder, weights x4: a first step 2e-4 from fairseq's, whose own scores are 2e-4 to "
                    "1.4e-3 from fp64 (the check)",
    17803882600170: "d=4, one head: fairseq's scores 2.4e-4 from fp64, lightgen's 6.6e-5 (the check)",
    17803882600260: "beam 3: hypotheses of equal scores (10 3 10 3 ... with a 10 10 elsewhere) in another order "
                    "(the check)",
    16018164302934: "greedy: one of fairseq's incremental steps 1.8e-4 from fp64, lightgen's 8e-6 (the check)",
    16018164301760: "sampling: an ill-conditioned step, fairseq's and lightgen's 2e-4 off fp64 either side (the check)",
    9845118501178: "greedy, one step 1e-3 from fairseq's, whose teacher-forced fp32 is 5e-4 off fp64 (the check)",
    9845118501621: "beam 5: hypotheses of a repeated token with one other at each place, cut at a tie (the check)",
    9845118504584: "beam 5: the same, scores 2e-5 apart (the check)",
    9845118505090: "diverse beams on an ill-conditioned d=8 model: fairseq's teacher-forced fp32 2.4e-4 from fp64 (the "
                   "check)",
    98758839705043: "IAD, min_len past max_len: lightgen raised ValueError where fairseq asserts (AssertionError); "
                    "22 of 529 IAD cases",
    81915338300759: "diverse beams, d=4: a group cut at a tie with a candidate its step never returns, and the other "
                    "groups' penalties follow it (the check)",
    81915338301098: "diverse beams, d=4: the same, one 11 among repeated 6s at another place (the check)",
}


def _architecture(r: random.Random) -> dict:
    """fairseq Transformer arguments within what the plugin accelerates (it refuses the rest by name)."""
    heads = r.choice([1, 2, 4])
    dim = heads * r.choice([4, 8, 16])
    return dict(
        encoder_layers=r.randint(1, 3), decoder_layers=r.randint(1, 3), encoder_embed_dim=dim,
        decoder_embed_dim=dim, encoder_ffn_embed_dim=r.choice([16, 48, 96]),
        decoder_ffn_embed_dim=r.choice([16, 48, 96]), encoder_attention_heads=heads,
        decoder_attention_heads=heads, encoder_normalize_before=r.random() < 0.5,
        decoder_normalize_before=r.random() < 0.5, encoder_learned_pos=r.random() < 0.4,
        decoder_learned_pos=r.random() < 0.4, no_token_positional_embeddings=r.random() < 0.1,
        activation_fn=r.choice(["relu", "gelu", "gelu_accurate", "tanh", "linear"]),
        share_decoder_input_output_embed=r.random() < 0.5, layernorm_embedding=r.random() < 0.3,
        no_scale_embedding=r.random() < 0.3, max_source_positions=64, max_target_positions=64)


def _settings(r: random.Random, vocab, batch: int) -> tuple[dict, object, torch.Tensor | None]:
    """(SequenceGenerator arguments, a search strategy or None, prefix tokens or None)."""
    settings = dict(beam_size=r.choice([1, 1, 2, 3, 4, 5]), max_len_b=r.choice([3, 8, 20]))
    if r.random() < 0.3:
        settings["max_len_a"] = r.choice([0.5, 1.0, 1.5])
    if r.random() < 0.3:
        settings["min_len"] = r.randint(2, 6)
    if r.random() < 0.3:
        settings["len_penalty"] = r.choice([0.0, 0.6, 1.5])
    if r.random() < 0.2:
        settings["normalize_scores"] = False
    if r.random() < 0.2:
        settings["unk_penalty"] = r.choice([-2.0, 1.0])
    if r.random() < 0.2:
        settings["temperature"] = r.choice([0.7, 1.3])
    if r.random() < 0.2:
        settings["no_repeat_ngram_size"] = r.randint(1, 3)
    if r.random() < 0.15:
        settings["tokens_to_suppress"] = (f"w{r.randrange(fm.WORDS)}",)
    strategy = None
    route = r.random()
    if route < 0.15:
        topk, topp = r.choice([(-1, 0.8), (4, -1.0), (-1, -1.0)])
        strategy = search.Sampling(vocab, topk, topp)
    elif route < 0.25 and settings["beam_size"] >= 2 and settings["beam_size"] % 2 == 0:
        strategy = search.DiverseBeamSearch(vocab, 2, r.choice([0.5, 1.0]))
    prefix = None
    if r.random() < 0.15:
        prefix = torch.randint(vocab.nspecial, len(vocab), (batch, r.randint(1, 2)),
                               generator=torch.Generator().manual_seed(r.randrange(2**31)))
    return settings, strategy, prefix


def run_case(seed: int) -> str:
    """Draw case ``seed``, decode it with fairseq and with lightgen; raises AssertionError on any difference."""
    r = random.Random(seed)
    architecture = _architecture(r)
    reference = fm.build(seed, **architecture)
    with torch.no_grad():  # larger weights than build's: peaked distributions, hypotheses that end early
        for param in reference.parameters():
            param.mul_(r.choice([1.0, 2.0, 4.0]))
    accelerated = lightgen.accelerate_model(copy.deepcopy(reference))
    vocab = fm.dictionary()
    batch = r.randint(1, 6)
    sample = fm.source_batch(vocab, batch, r.randint(2, 14), seed % 2**31)
    settings, strategy, prefix = _settings(r, vocab, batch)
    search_name = type(strategy).__name__ if strategy else "BeamSearch"
    # Greedy search as IAD too (lightgen's AggressiveGenerator), drafts of a drawn size (drawn last: the cases of
    # earlier draws stay as they were).
    block_size = r.choice([1, 4, 16]) if iad_unsupported(fm.generator([accelerated], vocab, search_strategy=strategy,
                                                                       **settings)) is None and r.random() < 0.5 else 0
    drafter = None
    if block_size and r.random() < 0.3:  # GAD with an untrained drafter on the model's encoder output
        torch.manual_seed(seed)
        drafter = NARDrafter(DrafterConfig(vocab_size=len(vocab), pad_token_id=vocab.pad(),
                                           d_model=architecture["encoder_embed_dim"], heads=1, ffn_dim=16,
                                           decoder_layers=1, max_positions=64, max_block_size=16)).eval()
    if block_size:
        search_name = f"{'GAD' if drafter is not None else 'IAD'} block={block_size}"
    description = f"{search_name} beam={settings['beam_size']} rows={batch} {architecture} {settings}" + \
        (f" prefix {prefix.tolist()}" if prefix is not None else "")

    def decode(model, recorded=None):
        torch.manual_seed(seed)
        generator = fm.generator([model], vocab, search_strategy=strategy or search.BeamSearch(vocab), **settings)
        if recorded is not None:
            _record(generator.search, recorded, vocab.eos())
        if block_size and model is accelerated:
            generator = AggressiveGenerator(generator, block_size=block_size, drafter=drafter)
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")
            return generator.generate([model], sample, prefix_tokens=prefix)

    outputs = []
    for model in (reference, accelerated):
        try:
            outputs.append(decode(model))
        except Exception as error:  # noqa: BLE001 - fairseq's own refusals are part of its behavior
            outputs.append(error)
    try:
        if any(isinstance(output, Exception) for output in outputs):
            assert type(outputs[0]) is type(outputs[1]) and str(outputs[0]) == str(outputs[1]), \
                f"fairseq: {outputs[0]!r}; lightgen: {outputs[1]!r}"
            return description + f" (both raise {type(outputs[0]).__name__})"
        diverse = isinstance(strategy, search.DiverseBeamSearch)
        cut_ties = functools.cache(lambda: _cut_ties(*(_steps(decode, model) for model in (reference, accelerated)),
                                                     _kept_at_a_cut(strategy, settings["beam_size"])))
        try:
            _assert_alike(*outputs, SCORE_TOL["atol"], cut_ties)
        except AssertionError:
            _assert_alike(*outputs, max(SCORE_TOL["atol"], ROUNDING_FACTOR * _rounding(
                reference, sample, outputs[0], settings, diverse)), cut_ties)
    except AssertionError as error:
        raise AssertionError(f"{description}\n{error}") from None
    return description


def _assert_alike(expected, got, tolerance: float, cut_ties) -> None:
    """fairseq's hypotheses and lightgen's, sentence by sentence and rank by rank: the same tokens with positional
    scores within ``tolerance`` (a sentence's score within its sum), or other tokens whose score ties fairseq's there
    or another of the sentence's (``ties_in``: their order, or which of them a beam cut kept, is fp32 rounding's),
    or any tokens in a sentence that both runs cut at a tie (``cut_ties()``, ``_cut_ties``)."""
    assert len(expected) == len(got), f"{len(got)} sentences vs fairseq's {len(expected)}"
    for index, (want_sentence, got_sentence) in enumerate(zip(expected, got, strict=True)):
        assert len(want_sentence) == len(got_sentence), f"sentence {index}: {len(got_sentence)} hypotheses"
        scores = [float(hypothesis["score"]) for hypothesis in want_sentence]
        for rank, (want, have) in enumerate(zip(want_sentence, got_sentence, strict=True)):
            where = f"sentence {index}, hypothesis {rank}"
            if want["tokens"].tolist() != have["tokens"].tolist():
                if index in cut_ties():
                    break  # from the tie on, the sentence's hypotheses are fp32 rounding's
                assert ties_in(have["score"], want["score"], scores), \
                    f"{where}: {have['tokens'].tolist()} ({float(have['score'])}) vs fairseq's " \
                    f"{want['tokens'].tolist()} ({float(want['score'])})"
                continue
            torch.testing.assert_close(have["positional_scores"], want["positional_scores"], atol=tolerance,
                                       rtol=SCORE_TOL["rtol"], msg=lambda m: f"{where}, positional scores: {m}")
            torch.testing.assert_close(have["score"], want["score"], atol=tolerance * len(want["tokens"]),
                                       rtol=SCORE_TOL["rtol"], msg=lambda m: f"{where}, score: {m}")


def _rounding(reference, sample, hypotheses, settings: dict, diverse: bool) -> float:
    """fairseq's own fp32 error on this case, over the tokens it returned: the larger of its fp32 log-probabilities
    teacher-forced against fp64 ones, and (but under diverse beam search, whose scores hold its penalties) the
    positional scores it returned against the fp64 ones (temperature and unk penalty applied): its incremental steps
    can round far worse than a teacher-forced pass (seen: one step 1.8e-4 off fp64, the pass 5e-6)."""
    wide = copy.deepcopy(reference).double()
    vocab = fm.dictionary()
    sources, lengths = sample["net_input"]["src_tokens"], sample["net_input"]["src_lengths"]
    error = 0.0
    for row, sentence in enumerate(hypotheses):
        for hypothesis in sentence:
            target = hypothesis["tokens"][None]
            previous = torch.cat([target.new_full((1, 1), vocab.eos()), target[:, :-1]], 1)
            with torch.no_grad():
                narrow, precise = ((model(sources[row:row + 1], lengths[row:row + 1], previous)[0].double()
                                    / settings.get("temperature", 1.0)).log_softmax(-1).gather(-1, target[..., None])
                                   [0, :, 0] for model in (reference, wide))
            error = max(error, float((narrow - precise).abs().max()))
            if not diverse:
                precise = precise - settings.get("unk_penalty", 0.0) * (target[0] == vocab.unk())
                error = max(error, float((hypothesis["positional_scores"].double() - precise).abs().max()))
    return error


def _record(searcher, recorded: dict, eos: int) -> None:
    """Patch ``searcher`` (fairseq's search strategy) to keep, per sentence, each cut's candidates: (their scores as
    the search ranks them, which of them end in EOS). BeamSearch's step returns 2 x beams candidates, the cut among
    them. DiverseBeamSearch's groups each keep their best k (``_kept_at_a_cut``) and return only those, so a tie at a
    group's cut is with a candidate it never returns: each group's k + 1 best are taken from the sums its BeamSearch
    step ranks (one entry per group and step)."""
    if not isinstance(searcher, search.DiverseBeamSearch):
        step = searcher.step

        def recorded_step(*args, **kwargs):
            scores, indices, beams = step(*args, **kwargs)
            sentences = args[4] if len(args) > 4 else kwargs["original_batch_idxs"]
            for row, sentence in enumerate(sentences.tolist()):
                recorded.setdefault(sentence, []).append((scores[row].clone(), indices[row] == eos))
            return scores, indices, beams

        searcher.step = recorded_step
        return
    diverse_step, group_step, calls = searcher.step, searcher.beam.step, []

    def recorded_diverse_step(*args, **kwargs):
        calls.append((args[4] if len(args) > 4 else kwargs["original_batch_idxs"]).tolist())
        return diverse_step(*args, **kwargs)

    def recorded_group_step(step, lprobs, scores, *args, candidate_multiple=2, **kwargs):
        rows, beams, vocab = lprobs.shape
        sums = lprobs[:, ::beams] if step == 0 else lprobs + scores[:, :, step - 1].unsqueeze(-1)
        best = sums.reshape(rows, -1).topk(min(candidate_multiple * beams + 1, sums[0].numel()))
        for row, sentence in enumerate(calls[-1]):
            recorded.setdefault(sentence, []).append((best.values[row].clone(), best.indices[row] % vocab == eos))
        return group_step(step, lprobs, scores, *args, candidate_multiple=candidate_multiple, **kwargs)

    searcher.step, searcher.beam.step = recorded_diverse_step, recorded_group_step


def _kept_at_a_cut(strategy, beam_size: int) -> int:
    """How many candidates a cut keeps: beam_size (beam search), or a diverse beam search group's beams times its
    candidate multiple."""
    if isinstance(strategy, search.DiverseBeamSearch):
        return beam_size // strategy.num_groups * strategy.candidate_multiple
    return beam_size


def _steps(decode, model) -> dict:
    """Per sentence, the candidates of every cut of a rerun of the case on ``model`` (``_record``)."""
    recorded = {}
    decode(model, recorded)
    return recorded


def _cut_ties(fairseq_steps: dict, lightgen_steps: dict, beams: int) -> set[int]:
    """The sentences that fairseq and lightgen both cut at a tie, with the same candidates at every step before: the
    ``beams`` best candidates (those ending in EOS among them become hypotheses) or the ``beams`` best of those that
    do not end in EOS (the running beams) tie with the next one. Which of the two goes on is fp32 rounding's, and the
    hypotheses that grow from it may be any (seen: beams of repeated tokens with one other token at every place, their
    scores 2e-5 apart)."""

    def tied(candidates) -> bool:
        scores, ends = candidates
        running = scores[~ends]
        return (scores.numel() > beams and tie(scores[beams - 1], scores[beams])) or \
            (running.numel() > beams and tie(running[beams - 1], running[beams]))

    def close(mine, theirs) -> bool:
        return torch.allclose(mine[0], theirs[0], rtol=1e-4, atol=1e-4)

    return {sentence for sentence, theirs in fairseq_steps.items()
            if first_shared_tie(theirs, lightgen_steps.get(sentence, []), tied, close) is not None}


def test_fairseq_fuzz():
    fuzz(run_case, 2, 1 / 3)


@pytest.mark.parametrize("seed", sorted(REGRESSIONS))
def test_fairseq_fuzz_regressions(seed):
    run_case(seed)


def test_only_a_cut_tie_in_both_runs_excuses_a_sentence():
    ends = torch.tensor([False, False, False, False])
    tied = [(torch.tensor([-1.0, -2.0, -2.0 - 1e-6, -5.0]), ends)]
    apart = [(torch.tensor([-1.0, -2.0, -2.1, -5.0]), ends)]
    assert _cut_ties({0: tied}, {0: tied}, beams=2) == {0}
    assert _cut_ties({0: tied}, {0: apart}, beams=2) == set()  # lightgen's cut is not a tie
    assert _cut_ties({0: apart + tied}, {0: [(apart[0][0] - 0.5, ends)] + tied}, beams=2) == set()  # parted before
    ended = [(torch.tensor([-1.0, -2.0, -3.0, -3.0 - 1e-6]), torch.tensor([False, True, False, False]))]
    assert _cut_ties({0: ended}, {0: ended}, beams=2) == {0}  # the running beams' cut, past a finished candidate


def test_diverse_beams_record_each_groups_cut_with_the_candidate_past_it():
    """A diverse beam search group returns only the k candidates it keeps; its cut's record holds k + 1 (the next one
    too), ranked, one record per group and step, and the search's results are the unrecorded run's."""
    vocab = fm.dictionary()
    model, sample = fm.build(3), fm.source_batch(vocab, 3, 6, 3)

    def decode(recorded=None):
        generator = fm.generator([model], vocab, beam_size=4, max_len_b=6,
                                 search_strategy=search.DiverseBeamSearch(vocab, 2, 0.5))
        if recorded is not None:
            _record(generator.search, recorded, vocab.eos())
        with torch.no_grad():
            return generator.generate([model], sample)

    recorded = {}
    got, expected = decode(recorded), decode()
    assert [[h["tokens"].tolist() for h in sentence] for sentence in got] == \
        [[h["tokens"].tolist() for h in sentence] for sentence in expected]
    assert _kept_at_a_cut(search.DiverseBeamSearch(vocab, 2, 0.5), 4) == 2
    assert sorted(recorded) == [0, 1, 2]
    for cuts in recorded.values():
        assert len(cuts) % 2 == 0 and all(scores.numel() == 3 and ends.shape == scores.shape for scores, ends in cuts)
        assert all(bool((scores[:-1] >= scores[1:]).all()) for scores, _ in cuts)


def test_fairseq_fuzz_draws_what_it_names():
    """The fuzz's draws reach each kind of case it claims (not a test that can only pass vacuously)."""
    kinds, vocab = set(), fm.dictionary()
    for seed in range(300):
        r = random.Random(seed)
        architecture = _architecture(r)
        settings, strategy, prefix = _settings(r, vocab, 2)
        kinds |= {type(strategy).__name__, architecture["activation_fn"], settings["beam_size"] > 1,
                  prefix is not None, "tokens_to_suppress" in settings, architecture["decoder_normalize_before"]}
    assert {"Sampling", "DiverseBeamSearch", "NoneType", "relu", "gelu", "tanh", True, False} <= kinds
