"""accelerate_model(fairseq TransformerModel) vs fairseq's own SequenceGenerator: identical hypotheses
(tokens, order), scores within fp32 rounding, over seeds, batch sizes, left-padded sources and flags."""

import copy
import os

import pytest
import torch

if not os.environ.get("CI"):  # CI installs fairseq (README test command); a skip there would hide a defect
    pytest.importorskip("fairseq", reason="fairseq not installed: pip install -e '.[fairseq]' && "
                                          "lightgen install-fairseq")

import fairseq_models as fm  # noqa: E402
from fairseq import search  # noqa: E402

import lightgen  # noqa: E402
from lightgen._compat import check_fairseq_version  # noqa: E402

pytestmark = pytest.mark.fairseq

SCORE_TOL = dict(atol=1e-4, rtol=1e-4)

VARIANTS = {
    "post-norm": dict(),  # fairseq's defaults: sinusoidal positions, relu, scaled embeddings
    "pre-norm": dict(  # and learned positions, gelu, shared embeddings, embedding LayerNorm, unscaled
        encoder_normalize_before=True, decoder_normalize_before=True, decoder_learned_pos=True,
        encoder_learned_pos=True, activation_fn="gelu", share_decoder_input_output_embed=True,
        layernorm_embedding=True, no_scale_embedding=True),
}

SETTINGS = [
    dict(beam_size=1),
    dict(beam_size=1, min_len=4, max_len_b=6),
    dict(beam_size=2),
    dict(beam_size=4, len_penalty=0.6),
    dict(beam_size=5, len_penalty=1.5, min_len=3),
    dict(beam_size=4, no_repeat_ngram_size=2, max_len_b=10),
    dict(beam_size=3, unk_penalty=-2.0, normalize_scores=False),
    dict(beam_size=4, max_len_a=0.5, max_len_b=3),
]


def _pair(seed, **overrides):
    model = fm.build(seed, **overrides)
    return lightgen.accelerate_model(copy.deepcopy(model)), model


def _generate(model, sample, search_strategy=None, models=None, **settings):
    settings.setdefault("max_len_b", 20)
    vocab = fm.dictionary()
    strategy = search_strategy(vocab) if search_strategy else None
    return fm.generator(models or [model], vocab, search_strategy=strategy, **settings).generate(
        models or [model], sample)


def assert_same_hypotheses(expected, got):
    assert len(expected) == len(got)
    for want_sentence, got_sentence in zip(expected, got, strict=True):
        assert [h["tokens"].tolist() for h in got_sentence] == [h["tokens"].tolist() for h in want_sentence]
        for want, have in zip(want_sentence, got_sentence, strict=True):
            torch.testing.assert_close(have["score"], want["score"], **SCORE_TOL)
            torch.testing.assert_close(have["positional_scores"], want["positional_scores"], **SCORE_TOL)


@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()))
@pytest.mark.parametrize("seed, batch, length, variant", [
    (0, 1, 5, "post-norm"), (1, 3, 9, "pre-norm"), (2, 6, 12, "post-norm"),
])
def test_hypotheses_identical_to_sequence_generator(settings, seed, batch, length, variant, step_counter):
    accelerated, reference = _pair(seed, **VARIANTS[variant])
    sample = fm.source_batch(fm.dictionary(), batch, length, seed)
    expected = _generate(reference, sample, **settings)
    got = _generate(accelerated, sample, **settings)
    assert step_counter, "lightgen's decoder step did not run"
    assert_same_hypotheses(expected, got)


def test_cases_cover_early_eos():
    """The parity cases above are only meaningful if hypotheses also end before the length limit."""
    reference = fm.build(1)
    finished = _generate(reference, fm.source_batch(fm.dictionary(), 3, 9, 1), beam_size=4)
    lengths = {len(h["tokens"]) for sentence in finished for h in sentence}
    assert min(lengths) < 21 and max(lengths) == 21, lengths


def test_diverse_beam_search():
    accelerated, reference = _pair(3, **VARIANTS["pre-norm"])
    sample = fm.source_batch(fm.dictionary(), 4, 8, 3)
    strategy = lambda vocab: search.DiverseBeamSearch(vocab, 2, 0.5)
    assert_same_hypotheses(_generate(reference, sample, strategy, beam_size=4),
                           _generate(accelerated, sample, strategy, beam_size=4))


def test_sampling_same_samples_under_one_seed():
    accelerated, reference = _pair(4)
    sample = fm.source_batch(fm.dictionary(), 3, 8, 4)
    runs = []
    for model in (reference, accelerated):
        torch.manual_seed(7)
        runs.append(_generate(model, sample, lambda vocab: search.Sampling(vocab, 10, -1.0), beam_size=3,
                              temperature=0.8))
    assert_same_hypotheses(*runs)


def test_prefix_tokens_and_ensemble():
    (fast_a, slow_a), (fast_b, slow_b) = _pair(5), _pair(6)
    vocab = fm.dictionary()
    sample = fm.source_batch(vocab, 3, 8, 5)
    prefix = torch.tensor([[4, 5], [6, 7], [8, 11]])
    expected = fm.generator([slow_a, slow_b], vocab, beam_size=3, max_len_b=15).generate(
        [slow_a, slow_b], sample, prefix_tokens=prefix)
    got = fm.generator([fast_a, fast_b], vocab, beam_size=3, max_len_b=15).generate(
        [fast_a, fast_b], sample, prefix_tokens=prefix)
    assert_same_hypotheses(expected, got)
    assert all(h["tokens"][:2].tolist() == prefix[i].tolist() for i, sentence in enumerate(got) for h in sentence)


def test_outputs_longer_than_the_first_cache_grow_it():
    accelerated, reference = _pair(7)
    sample = fm.source_batch(fm.dictionary(), 2, 6, 7)
    settings = dict(beam_size=2, min_len=100, max_len_b=110)
    got = _generate(accelerated, sample, **settings)
    assert len(got[0][0]["tokens"]) > 100
    assert_same_hypotheses(_generate(reference, sample, **settings), got)


def test_teacher_forced_forward_and_restore_are_unchanged():
    accelerated, reference = _pair(8)
    sample = fm.source_batch(fm.dictionary(), 3, 7, 8)
    tokens = sample["net_input"]["src_tokens"]
    with torch.no_grad():
        expected = reference(tokens, sample["net_input"]["src_lengths"], tokens)[0]
        torch.testing.assert_close(accelerated(tokens, sample["net_input"]["src_lengths"], tokens)[0], expected,
                                   atol=0, rtol=0)
    lightgen.restore_model(accelerated)
    assert "forward" not in accelerated.decoder.__dict__
    assert_same_hypotheses(_generate(reference, sample, beam_size=2), _generate(accelerated, sample, beam_size=2))


def test_unsupported_decoders_are_refused_by_name():
    with pytest.raises(lightgen.UnsupportedModelError, match="cross_self_attention"):
        lightgen.accelerate_model(fm.build(0, cross_self_attention=True))
    with pytest.raises(lightgen.UnsupportedModelError, match="adaptive softmax"):
        lightgen.accelerate_model(fm.build(0, adaptive_softmax_cutoff="6", decoder_output_dim=64))


def test_untested_fairseq_versions_are_refused():
    with pytest.raises(ImportError, match="lightgen install-fairseq"):
        check_fairseq_version("0.12.2")
    check_fairseq_version("0.12.3.1")
