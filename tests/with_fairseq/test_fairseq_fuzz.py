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
import math
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

# Copies of a case's model whose weights a random unit roundoff moves, for its rounding (``_rounding``).
ROUNDOFF_DRAWS = 2

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
    81915338300041: "post-norm decoder, weights x4: lightgen's scores 8.6e-4 from fairseq's, 10x fairseq's own error, "
                    "where a weight's roundoff moves them 1.8e-3 (the check)",
    32458722502931: "post-norm, beam 4: a cut fairseq made 4e-5 apart and lightgen 1.7e-4, on a model whose scores a "
                    "weight's roundoff moves 1e-2 (the check)",
    712070101698: "top-k sampling: two tokens 6e-6 apart in log-probability swap places in the top 4, and the same "
                  "draw picks the other (the check)",
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
        steps = functools.cache(lambda: [_steps(decode, model) for model in (reference, accelerated)])

        def cut_ties(tolerance):
            return functools.cache(lambda: _cut_ties(*steps(), _kept_at_a_cut(strategy, settings["beam_size"]),
                                                     tolerance))

        try:
            _assert_alike(*outputs, SCORE_TOL["atol"], cut_ties(0.0))
        except AssertionError:
            tolerance = max(SCORE_TOL["atol"], ROUNDING_FACTOR * _rounding(
                reference, sample, outputs[0], settings, diverse))
            _assert_alike(*outputs, tolerance, cut_ties(tolerance))
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
    """How far two valid fp32 runs of this case can be apart, per log-probability, over the tokens fairseq returned:
    the largest error against fp64 of fairseq's fp32 log-probabilities teacher-forced, of the same with every weight
    moved by a random ±1 unit roundoff (``ROUNDOFF_DRAWS`` draws: an fp32 dot product of length k is the exact one on
    weights moved by up to k of it, so a model that amplifies this amplifies any fp32 run's rounding; seen: fairseq's
    teacher-forced error 8.7e-5, a draw's 1.8e-3 to 4.7e-3, lightgen's 8.6e-4), and (but under diverse beam search,
    whose scores hold its penalties) of the positional scores it returned (temperature and unk penalty applied): its
    incremental steps can round far worse than a teacher-forced pass (seen: one step 1.8e-4 off fp64, the pass
    5e-6)."""
    wide = copy.deepcopy(reference).double()
    moved = [_moved_by_a_roundoff(reference, draw) for draw in range(ROUNDOFF_DRAWS)]
    vocab = fm.dictionary()
    sources, lengths = sample["net_input"]["src_tokens"], sample["net_input"]["src_lengths"]
    error = 0.0
    for row, sentence in enumerate(hypotheses):
        for hypothesis in sentence:
            target = hypothesis["tokens"][None]
            previous = torch.cat([target.new_full((1, 1), vocab.eos()), target[:, :-1]], 1)
            with torch.no_grad():
                precise, *narrow = ((model(sources[row:row + 1], lengths[row:row + 1], previous)[0].double()
                                     / settings.get("temperature", 1.0)).log_softmax(-1).gather(-1, target[..., None])
                                    [0, :, 0] for model in (wide, reference, *moved))
            error = max(error, *(float((fp32 - precise).abs().max()) for fp32 in narrow))
            if not diverse:
                precise = precise - settings.get("unk_penalty", 0.0) * (target[0] == vocab.unk())
                error = max(error, float((hypothesis["positional_scores"].double() - precise).abs().max()))
    return error


def _moved_by_a_roundoff(model, seed: int):
    """A copy of ``model`` with each weight multiplied by 1 + u, u uniform in ±2^-24 (fp32's unit roundoff), and
    rounded to fp32 again (so some move by one ulp, the rest not at all)."""
    moved = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in moved.parameters():
            param.mul_(1 + (torch.rand(param.shape, generator=generator, dtype=torch.float64) * 2 - 1) * 2.0**-24)
    return moved


def _record(searcher, recorded: dict, eos: int) -> None:
    """Patch ``searcher`` (fairseq's search strategy) to keep, per sentence, each cut's candidates: (their scores as
    the search ranks them, which of them end in EOS). BeamSearch's step returns 2 x beams candidates, the cut among
    them. DiverseBeamSearch's groups each keep their best k (``_kept_at_a_cut``) and return only those, so a tie at a
    group's cut is with a candidate it never returns: each group's k + 1 best are taken from the sums its BeamSearch
    step ranks (one entry per group and step). Sampling draws an index into its top-k or top-p candidates sorted by
    probability, so two tokens of equal probability swap places by rounding and the same draw picks the other: its
    entries add, per beam, the drawn token's log-probability and its distance to the nearest other token's
    (``_draw_gaps``)."""
    if not isinstance(searcher, search.DiverseBeamSearch):
        step = searcher.step
        sampling = isinstance(searcher, search.Sampling)

        def recorded_step(*args, **kwargs):
            lprobs = args[1].clone() if sampling else None  # Sampling exponentiates it in place
            scores, indices, beams = step(*args, **kwargs)
            sentences = args[4] if len(args) > 4 else kwargs["original_batch_idxs"]
            drawn = _draw_gaps(lprobs, indices, beams) if sampling else None
            for row, sentence in enumerate(sentences.tolist()):
                recorded.setdefault(sentence, []).append(
                    (scores[row].clone(), indices[row] == eos) + ((drawn[0][row], drawn[1][row]) if sampling else ()))
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


def _draw_gaps(lprobs: torch.Tensor, tokens: torch.Tensor, beams: torch.Tensor):
    """Per row and beam of a sampling step, the drawn token's log-probability (in the beam it grew from) and how far
    the nearest other token's is from it."""
    chosen = lprobs[torch.arange(lprobs.shape[0])[:, None], beams, tokens]
    others = lprobs[torch.arange(lprobs.shape[0])[:, None], beams].scatter(-1, tokens[..., None], -math.inf)
    return chosen, (others - chosen[..., None]).abs().amin(-1)


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


def _cut_ties(fairseq_steps: dict, lightgen_steps: dict, beams: int, tolerance: float = 0.0) -> set[int]:
    """The sentences that fairseq and lightgen both cut at a tie, with the same candidates at every step before: the
    ``beams`` best candidates (those ending in EOS among them become hypotheses) or the ``beams`` best of those that
    do not end in EOS (the running beams) tie with the next one. Which of the two goes on is fp32 rounding's, and the
    hypotheses that grow from it may be any (seen: beams of repeated tokens with one other token at every place, their
    scores 2e-5 apart). A candidate's score sums a log-probability per step, so with a ``tolerance`` per
    log-probability (the case's rounding, ``_rounding``) two are tied, or the runs' candidates the same, within it
    times the steps so far (seen: an ill-conditioned model whose cut fairseq made 4e-5 apart and lightgen 1.7e-4).
    A sampling step is at a tie where a drawn token's log-probability ties another token's (within ``tie`` or the
    tolerance): the same draw may pick either (seen: top-k 4, tokens 7 and 8 swapped)."""

    def within(step: int) -> float:
        return tolerance * (step + 1)

    def tied(indexed) -> bool:
        step, (scores, ends, *drawn) = indexed
        if drawn:  # a sampling step: a drawn token whose probability ties another's
            chosen, gaps = drawn
            return any(tie(lp, lp - gap) or float(gap) <= tolerance for lp, gap in zip(chosen, gaps))
        running = scores[~ends]
        return any(ranked.numel() > beams and (tie(ranked[beams - 1], ranked[beams])
                                               or float(ranked[beams - 1] - ranked[beams]) <= within(step))
                   for ranked in (scores, running))

    def close(mine, theirs) -> bool:
        return torch.allclose(mine[1][0], theirs[1][0], rtol=1e-4, atol=max(1e-4, within(mine[0])))

    return {sentence for sentence, theirs in fairseq_steps.items()
            if first_shared_tie(list(enumerate(theirs)), list(enumerate(lightgen_steps.get(sentence, []))), tied,
                                close) is not None}


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


def test_a_cut_ties_within_the_rounding_only_as_far_as_its_steps_allow():
    """The cut of 32458722502931's step 5 (4 beams): fairseq's 4th and 5th candidates 4e-5 apart (a tie), lightgen's
    1.7e-4; a tie only within a per-step rounding of 1.7e-4 / 6 or more."""
    ends = torch.zeros(6, dtype=torch.bool)
    before = [(torch.tensor([-0.5 * step - 1, -0.5 * step - 2, -0.5 * step - 3, -0.5 * step - 4, -0.5 * step - 5,
                             -0.5 * step - 6]), ends) for step in range(5)]
    fairseq = before + [(torch.tensor([-3.63215, -4.29403, -4.31154, -4.31166, -4.31170, -4.42358]), ends)]
    lightgen = before + [(torch.tensor([-3.63216, -4.29404, -4.31166, -4.31170, -4.31187, -4.42322]), ends)]
    assert _cut_ties({0: fairseq}, {0: lightgen}, beams=4) == set()
    assert _cut_ties({0: fairseq}, {0: lightgen}, beams=4, tolerance=2e-5) == set()  # 1.2e-4 at step 5
    assert _cut_ties({0: fairseq}, {0: lightgen}, beams=4, tolerance=3e-5) == {0}  # 1.8e-4
    parted = before[:4] + [(before[4][0] - 1e-3, ends)] + lightgen[5:]
    assert _cut_ties({0: fairseq}, {0: parted}, beams=4, tolerance=3e-5) == set()  # apart before it (1.5e-4 allowed)


@pytest.mark.parametrize("seed", range(3))
def test_the_rounding_of_a_well_conditioned_model_leaves_the_tolerance_as_it_is(seed):
    """The widened check excuses only ill-conditioned cases: on an ordinary model, ``_rounding`` times
    ``ROUNDING_FACTOR`` (~1e-6 each, measured) stays under the fixed 1e-4, so a defect that moves a score by that
    much still fails."""
    vocab = fm.dictionary()
    model, sample = fm.build(seed), fm.source_batch(vocab, 3, 8, seed)
    with torch.no_grad():
        hypotheses = fm.generator([model], vocab, beam_size=3, max_len_b=10).generate([model], sample)
    assert 0 < ROUNDING_FACTOR * _rounding(model, sample, hypotheses, {}, diverse=False) < SCORE_TOL["atol"]


def test_a_sampling_step_ties_where_a_drawn_token_ties_another_in_both_runs():
    """712070101698's step: a beam drew token 1 of a row whose tokens 1 and 2 are 6e-6 apart (fairseq), the other
    (lightgen); ``_draw_gaps`` finds it and ``_cut_ties`` excuses the sentence, unless one run's draw is clear."""
    lprobs = torch.tensor([[[-0.8129551, -0.8129613, -2.0, -3.0]]]).log_softmax(-1)
    chosen, gaps = _draw_gaps(lprobs, torch.tensor([[0]]), torch.tensor([[0]]))
    assert torch.equal(chosen, lprobs[:, 0, :1]) and torch.allclose(gaps, torch.tensor([[6.2e-6]]), atol=1e-7)
    ends = torch.tensor([False])

    def draw(gap):
        return [(torch.tensor([-1.0]), ends, torch.tensor([-0.81]), torch.tensor([gap]))]

    assert _cut_ties({0: draw(6.2e-6)}, {0: draw(6.7e-6)}, beams=1) == {0}
    assert _cut_ties({0: draw(6.2e-6)}, {0: draw(0.3)}, beams=1) == set()
    assert _cut_ties({0: draw(2e-4)}, {0: draw(3e-4)}, beams=1) == set()
    assert _cut_ties({0: draw(2e-4)}, {0: draw(3e-4)}, beams=1, tolerance=5e-4) == {0}  # within the case's rounding
