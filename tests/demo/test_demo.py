"""The shipped demo model: loads offline, IAD equals greedy on real sentences, it corrects, the demo runs."""

import copy
import io
import random
import re

import pytest
import torch

import lightgen
from lightgen.demo import EXAMPLES, held_out_pairs, load_demo_drafter, load_demo_model
from lightgen.demo.noise import Noiser, edits, number_pairs, score, words

# Measured on the shipped model (400 held-out sentences, greedy): exact match 0.37, F0.5 0.49 (README
# "Demo model"). The thresholds keep a margin so that kernel rounding cannot flip the test.
MIN_EXACT_MATCH = 0.30
MIN_F05 = 0.40


@pytest.fixture(scope="module")
def models():
    reference, tokenizer = load_demo_model()
    return reference, lightgen.accelerate_model(copy.deepcopy(reference)), tokenizer


def test_loads_offline_as_fp32(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model, tokenizer = load_demo_model()
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert not model.training
    sentence = "The value is returned unchanged."
    ids = tokenizer(sentence)["input_ids"]
    assert ids[0] == tokenizer.bos_token_id and ids[-1] == tokenizer.eos_token_id
    assert tokenizer.decode(ids, skip_special_tokens=True).strip() == sentence


def _greedy(model, tokenizer, sentences, **kwargs):
    enc = tokenizer(sentences, return_tensors="pt", padding=True)
    with torch.no_grad():
        return model.generate(**enc, do_sample=False, num_beams=1, max_length=128, **kwargs)


@pytest.mark.parametrize("batch", [1, 3, 8, 24])
@pytest.mark.parametrize("max_draft", [4, 16, None])  # None: the per-batch default (16 at batch 1, 4 at 24)
def test_iad_equals_greedy_on_held_out_sentences(models, batch, max_draft):
    """Padded batches of real sentences (with and without errors): IAD returns HF greedy's tokens."""
    reference, accelerated, tokenizer = models
    sources, _ = held_out_pairs(48 if batch > 1 else 16)
    for start in range(0, len(sources), batch):
        chunk = sources[start:start + batch]
        expected = _greedy(reference, tokenizer, chunk)
        got = _greedy(accelerated, tokenizer, chunk, decoding="iad", max_draft=max_draft)
        assert torch.equal(got, expected), chunk


def test_iad_default_draft_shrinks_as_the_batch_grows(models, flat_pass_cost):
    """Without max_draft a pass adds up to 33 tokens to a row at batch 1 and at most 5 while 24 rows decode
    (draft + the verifier's own token)."""
    from lightgen.generation.aggressive import DraftBudget

    assert [DraftBudget().per_row(rows) for rows in (1, 2, 4, 8, 16, 32, 64)] == [32, 32, 16, 8, 4, 4, 4]
    _, accelerated, tokenizer = models
    sources, _ = held_out_pairs(24)
    alone = [_greedy(accelerated, tokenizer, [source], decoding="iad", return_dict_in_generate=True)
             for source in sources[:4]]
    assert 5 < max(int(out.tokens_per_iteration[0].max()) for out in alone) <= 33
    batched = _greedy(accelerated, tokenizer, sources, decoding="iad", return_dict_in_generate=True)
    # The first pass has all 24 rows (later ones fewer, as rows finish, so longer drafts again).
    assert max(int(row[0]) for row in batched.tokens_per_iteration) <= 5


def test_iad_accepts_many_tokens_per_pass(models, flat_pass_cost):
    """On this copy-heavy task most drafts pass: far fewer decoder passes than tokens."""
    _, accelerated, tokenizer = models
    sources, _ = held_out_pairs(16)
    out = _greedy(accelerated, tokenizer, sources, decoding="iad", return_dict_in_generate=True)
    tokens = sum(int(row.sum()) for row in out.tokens_per_iteration)
    assert tokens / int(out.iterations.sum()) > 2


@pytest.mark.parametrize("batch", [1, 8])
def test_gad_with_the_shipped_drafter_equals_greedy_in_fewer_passes(models, batch, flat_pass_cost):
    """GAD (beta=1) returns HF greedy's tokens; the distilled drafter's blocks mostly pass."""
    reference, accelerated, tokenizer = models
    drafter = load_demo_drafter()
    sources, _ = held_out_pairs(24)
    tokens = passes = 0
    for start in range(0, len(sources), batch):
        chunk = sources[start:start + batch]
        out = _greedy(accelerated, tokenizer, chunk, decoding="gad", drafter=drafter, block_size=8,
                      return_dict_in_generate=True)
        assert torch.equal(out.sequences, _greedy(reference, tokenizer, chunk)), chunk
        tokens += sum(int(row.sum()) for row in out.tokens_per_iteration)
        passes += int(out.iterations.sum())
    assert tokens / passes > 2


def test_model_corrects_held_out_errors(models):
    _, accelerated, tokenizer = models
    sources, references = held_out_pairs(400)
    hypotheses = []
    for start in range(0, len(sources), 32):
        ids = _greedy(accelerated, tokenizer, sources[start:start + 32], decoding="iad")
        hypotheses += [text.strip() for text in tokenizer.batch_decode(ids, skip_special_tokens=True)]
    result = score(sources, hypotheses, references)
    assert result["exact_match"] >= MIN_EXACT_MATCH and result["f0_5"] >= MIN_F05, result


def test_demo_command_runs_short(capsys):
    from lightgen.cli import main

    main(["demo", "--short"])
    out = capsys.readouterr().out
    for line in ("lightgen greedy == HF greedy: True", "lightgen IAD == HF greedy: True",
                 "lightgen GAD == HF greedy: True",
                 "lightgen beam 4 == HF beam 4: True", "tokens per pass", EXAMPLES[0]):
        assert line in out
    # Results first: every sentence's verdicts before the timing starts, and the timings labelled with the load.
    lines = out.splitlines()
    verdicts = [i for i, line in enumerate(lines) if "same tokens as HF: greedy yes, IAD yes, GAD yes, beam 4 yes" in line]
    timing = next(i for i, line in enumerate(lines) if line.startswith("timing "))
    assert len(verdicts) == len(EXAMPLES) + 4 and max(verdicts) < timing
    # each sentence's correction comes before its verdicts, and the next sentence after them
    first_correction = next(i for i, line in enumerate(lines) if line.startswith("   -> "))
    second_sentence = next(i for i, line in enumerate(lines) if line.startswith("  [2/"))
    assert first_correction < verdicts[0] < second_sentence
    assert re.search(r"other processes used (\d+%|an unknown share) of the \d+ CPUs while timing", out)
    assert "timing [" in out  # the progress line


def test_demo_progress_redraws_one_line_in_a_terminal_and_prints_lines_otherwise():
    from lightgen.demo.compare import Progress

    class Stream(io.StringIO):
        def __init__(self, tty):
            super().__init__()
            self.tty = tty

        def isatty(self):
            return self.tty

    for tty in (True, False):
        stream = Stream(tty)
        progress = Progress(total=6, stream=stream)
        for name in "abcdef":
            progress.step(name)
        text = stream.getvalue()
        if tty:
            assert text.count("\r") == 6 and text.endswith("\n") and text.count("\n") == 1
        else:
            assert text.count("\n") == 6 and "timing [############............] 3/6 c" in text
        assert "6/6 f" in text


def test_demo_bad_arguments_are_clear_errors(capsys):
    from lightgen.cli import main

    with pytest.raises(SystemExit):
        main(["demo", "--batch", "0"])
    assert "--batch must be positive" in capsys.readouterr().err


def test_noise_is_reproducible_and_scored_by_edits():
    train = ["The file is closed when the object is deleted.", "Return the files in the directory."] * 20
    noiser = Noiser(number_pairs(train, min_count=1), clean=0.0)
    first = [noiser(s, random.Random(3)) for s in train]
    assert first == [noiser(s, random.Random(3)) for s in train]
    assert any(a != b for a, b in zip(first, train, strict=True))
    source, reference = "Return the the files in directory.", "Return the files in the directory."
    assert edits(source, reference) == {(1, 2, ""), (5, 5, "the")}
    assert words(reference) == ["Return", "the", "files", "in", "the", "directory", "."]
    perfect = score([source], [reference], [reference])
    assert perfect == dict(exact_match=1.0, precision=1.0, recall=1.0, f0_5=1.0)
    unchanged = score([source], [source], [reference])
    assert unchanged["recall"] == 0.0 and unchanged["exact_match"] == 0.0


@pytest.mark.slow
def test_training_script_runs(tmp_path):
    """A few steps of the real training script on a tiny configuration; the saved model loads."""
    from transformers import AutoModelForSeq2SeqLM

    from lightgen.demo import train

    train.main(["--steps", "2", "--layers", "1", "--d-model", "32", "--ffn", "64", "--heads", "2", "--vocab", "400",
                "--max-tokens", "600", "--eval-sentences", "2", "--threads", "1", "--out", str(tmp_path)])
    model = AutoModelForSeq2SeqLM.from_pretrained(tmp_path, dtype=torch.float32)
    assert model.config.d_model == 32 and (tmp_path / "tokenizer.json").is_file()


@pytest.mark.slow
def test_train_drafter_command_runs(tmp_path):
    """The drafter recipe end to end on a few sentences and steps; the saved drafter drafts for GAD."""
    from lightgen.cli import main
    from lightgen.generation.drafting import NARDrafter

    main(["train-drafter", "--sentences", "40", "--steps", "3", "--batch-size", "8", "--out", str(tmp_path)])
    drafter = NARDrafter.from_pretrained(tmp_path)
    reference, tokenizer = load_demo_model()
    accelerated = lightgen.accelerate_model(reference)
    sources, _ = held_out_pairs(3)
    expected = _greedy(accelerated, tokenizer, sources)
    assert torch.equal(_greedy(accelerated, tokenizer, sources, decoding="gad", drafter=drafter), expected)
