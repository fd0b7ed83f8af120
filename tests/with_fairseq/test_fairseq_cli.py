"""fairseq-interactive / fairseq-generate with and without the plugin
(``--user-dir "$(lightgen fairseq-plugin-dir)" --task translation_lightgen``), compared line by line,
and the hub interface (``TransformerModel.from_pretrained``) accelerated in Python."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

if not os.environ.get("CI"):  # CI installs fairseq (README test command); a skip there would hide a defect
    pytest.importorskip("fairseq", reason="fairseq not installed: pip install -e '.[fairseq]' && "
                                          "lightgen install-fairseq")

import fairseq_models as fm  # noqa: E402
from fairseq import options, tasks  # noqa: E402
from fairseq.models.transformer import TransformerModel  # noqa: E402

import lightgen  # noqa: E402
from lightgen.adapters.fairseq import allow_fairseq_checkpoints  # noqa: E402
from lightgen.drafter_cli import main as drafter_main  # noqa: E402
from lightgen.generation.drafting import DrafterConfig, NARDrafter  # noqa: E402
from lightgen.integrations import FAIRSEQ_PLUGIN_DIR  # noqa: E402

pytestmark = pytest.mark.fairseq

PLUGIN = FAIRSEQ_PLUGIN_DIR  # the installed package's folder, as `lightgen fairseq-plugin-dir` prints it
PLUGIN_FLAGS = ["--user-dir", str(PLUGIN), "--task", "translation_lightgen"]
SOURCE_TREE_PLUGIN = Path(__file__).resolve().parents[2] / "integrations" / "lightgen_fairseq"  # the old path
SCORE_TOL = 1e-4
POSITIONAL_TOL = 2e-4  # P- lines are printed with 4 decimals: rounding adds up to 1e-4
# fairseq itself cannot load its checkpoints under torch >= 2.6 (weights_only=True and a pickled
# argparse.Namespace): the baseline runs fairseq's own CLI with exactly that class allowed.
VANILLA = ("import argparse, sys, torch; torch.serialization.add_safe_globals([argparse.Namespace]); "
           "from fairseq_cli.{0} import cli_main; sys.argv[0] = 'fairseq-{0}'; cli_main()")


def _lines(count: int, seed: int) -> list[str]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, 12, (count,), generator=gen).tolist()
    return [" ".join(f"w{int(i)}" for i in torch.randint(0, fm.WORDS, (n,), generator=gen)) for n in lengths]


def _script(name: str) -> str:
    """fairseq's console script of this interpreter's environment (found without an activated venv too)."""
    return str(Path(sys.executable).with_name(name))


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A binarized test set and a briefly trained checkpoint, saved the way older fairseq-train saves one."""
    root = tmp_path_factory.mktemp("fairseq_cli")
    fm.dictionary().save(str(root / "dict.txt"))
    for side, seed in (("src", 0), ("tgt", 1)):
        (root / f"test.{side}").write_text("\n".join(_lines(23, seed)) + "\n")
    subprocess.run([_script("fairseq-preprocess"), "--source-lang", "src", "--target-lang", "tgt", "--testpref",
                    str(root / "test"), "--srcdict", str(root / "dict.txt"), "--tgtdict", str(root / "dict.txt"),
                    "--destdir", str(root / "bin"), "--workers", "1"], check=True, capture_output=True)
    args = options.parse_args_and_arch(options.get_training_parser(), [
        str(root / "bin"), "--arch", "transformer", "--source-lang", "src", "--target-lang", "tgt",
        "--encoder-layers", "2", "--decoder-layers", "2", "--encoder-embed-dim", "64", "--decoder-embed-dim", "64",
        "--encoder-ffn-embed-dim", "96", "--decoder-ffn-embed-dim", "96", "--encoder-attention-heads", "4",
        "--decoder-attention-heads", "4", "--max-target-positions", "128", "--max-source-positions", "128"])
    torch.manual_seed(0)
    # Copying with edits: IAD's drafts are accepted, and outputs end at varied lengths.
    model = fm.train(tasks.setup_task(args).build_model(args), "edit", steps=fm.COPY_STEPS)
    torch.save({"args": args, "model": model.state_dict(), "extra_state": {"train_iterator": {"epoch": 1}},
                "optimizer_history": [{"criterion_name": "CrossEntropyCriterion", "optimizer_name": "Adam",
                                       "lr_scheduler_state": {"best": None}, "num_updates": 0}]},
               root / "model.pt")
    return root


def _run(workdir, tool: str, flags: list[str], plugin: bool, stdin: str | None = None, plugin_dir: Path = PLUGIN):
    common = [str(workdir / "bin"), "--path", str(workdir / "model.pt"), "--source-lang", "src",
              "--target-lang", "tgt", *flags]
    command = ([_script(f"fairseq-{tool}"), *common, "--user-dir", str(plugin_dir), "--task", "translation_lightgen"]
               if plugin else [sys.executable, "-c", VANILLA.format(tool), *common])
    done = subprocess.run(command, input=stdin, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.splitlines(), done.stderr


def assert_same_output(expected: list[str], got: list[str]) -> None:
    """Identical lines, except that scores may differ by float rounding; timings are skipped."""
    expected = [line for line in expected if not line.startswith("W-")]
    got = [line for line in got if not line.startswith("W-")]
    assert len(got) == len(expected)
    hypotheses = 0
    for want, have in zip(expected, got, strict=True):
        kind = want.partition("-")[0]
        want_fields, have_fields = want.split("\t"), have.split("\t")
        if kind in ("H", "D"):
            assert have_fields[0] == want_fields[0] and have_fields[2:] == want_fields[2:], (want, have)
            assert abs(float(have_fields[1]) - float(want_fields[1])) <= SCORE_TOL, (want, have)
            hypotheses += 1
        elif kind == "P":
            assert have_fields[0] == want_fields[0]
            torch.testing.assert_close(torch.tensor([float(x) for x in have_fields[1].split()]),
                                       torch.tensor([float(x) for x in want_fields[1].split()]),
                                       atol=POSITIONAL_TOL, rtol=0)
        elif "BLEU" in want:  # corpus BLEU of identical hypotheses
            assert have.split("BLEU")[1] == want.split("BLEU")[1]
        else:
            assert have == want
    assert hypotheses, "no hypotheses were compared"


def _finished_early(lines: list[str]) -> bool:
    lengths = {len(line.split("\t")[2].split()) for line in lines if line.startswith("H-")}
    return len(lengths) > 1


@pytest.mark.parametrize("vanilla_flags, plugin_flags", [
    (["--beam", "4", "--nbest", "2", "--buffer-size", "5", "--batch-size", "5"],) * 2,
    # --lightgen-decoding greedy overrides fairseq's default --beam 5.
    (["--beam", "1", "--min-len", "3"], ["--min-len", "3", "--lightgen-decoding", "greedy"]),
], ids=["beam4-nbest2", "greedy"])
def test_interactive_same_lines(workdir, vanilla_flags, plugin_flags):
    text = "\n".join(_lines(12, 2)) + "\n"
    expected, _ = _run(workdir, "interactive", vanilla_flags, plugin=False, stdin=text)
    got, stderr = _run(workdir, "interactive", plugin_flags, plugin=True, stdin=text)
    assert "running fairseq's own generator" not in stderr
    assert_same_output(expected, got)
    assert _finished_early(got)


def test_the_source_trees_old_plugin_path_still_works(workdir):
    """``--user-dir integrations/lightgen_fairseq`` imports the installed plugin: the same lines, no fallback."""
    text = "\n".join(_lines(6, 4)) + "\n"
    expected, _ = _run(workdir, "interactive", ["--beam", "3"], plugin=True, stdin=text)
    got, stderr = _run(workdir, "interactive", ["--beam", "3"], plugin=True, stdin=text, plugin_dir=SOURCE_TREE_PLUGIN)
    assert "running fairseq's own generator" not in stderr
    drop_timings = lambda lines: [line for line in lines if not line.startswith("W-")]
    assert drop_timings(got) == drop_timings(expected) and any(line.startswith("H-") for line in got)


@pytest.mark.parametrize("flags", [
    ["--beam", "5", "--lenpen", "1.3", "--batch-size", "7", "--no-repeat-ngram-size", "3"],
    ["--beam", "3", "--unkpen", "1", "--max-len-a", "1", "--max-len-b", "2", "--prefix-size", "1"],
], ids=["beam5-lenpen-ngram", "beam3-unkpen-maxlen-prefix"])
def test_generate_same_lines(workdir, flags):
    expected, _ = _run(workdir, "generate", flags, plugin=False)
    got, _ = _run(workdir, "generate", flags, plugin=True)
    assert_same_output(expected, got)
    assert _finished_early(got), "every hypothesis ran to the length limit: EOS handling was not exercised"


@pytest.fixture(scope="module")
def drafter_dir(workdir):
    """An untrained GAD drafter for the checkpoint (its drafts are mostly rejected; the output is greedy's)."""
    torch.manual_seed(0)
    drafter = NARDrafter(DrafterConfig(vocab_size=len(fm.dictionary()), pad_token_id=fm.dictionary().pad(),
                                       d_model=64, heads=4, ffn_dim=96, decoder_layers=1))
    drafter.save_pretrained(workdir / "drafter")
    return workdir / "drafter"


@pytest.mark.parametrize("decoding", ["iad", "gad"])
@pytest.mark.parametrize("tool, flags", [
    ("interactive", ["--buffer-size", "6", "--batch-size", "6"]),
    ("generate", ["--batch-size", "7", "--max-len-a", "1", "--max-len-b", "1"]),
])
def test_aggressive_decoding_same_lines_as_fairseq_greedy(workdir, drafter_dir, tool, flags, decoding, flat_pass_cost):
    """With fixed-length drafts (the CLI inherits LIGHTGEN_FIXED_DRAFTS), so that the passes do not depend on how fast
    this machine runs the tiny model; the adaptive policy's greedy steps are tested in test_fairseq_iad.py."""
    text = "\n".join(_lines(12, 2)) + "\n" if tool == "interactive" else None
    expected, _ = _run(workdir, tool, ["--beam", "1", *flags], plugin=False, stdin=text)
    drafting = ["--lightgen-drafter", str(drafter_dir)] if decoding == "gad" else []
    got, stderr = _run(workdir, tool, ["--lightgen-decoding", decoding, "--lightgen-block-size", "4", *drafting,
                                       *flags], plugin=True, stdin=text)
    assert "running" not in stderr  # no fallback
    assert_same_output(expected, got)
    # The last batch's log line ends with the totals.
    totals = re.findall(rf"lightgen {decoding.upper()}: .*\(all so far: (\d+) sentences, [\d.]+ decoder passes per "
                        rf"sentence, ([\d.]+) tokens per pass", stderr)[-1]
    assert int(totals[0]) == sum(line.startswith("H-") for line in got)
    if decoding == "iad":  # drafts were accepted
        assert float(totals[1]) > 1.2


def test_train_drafter_for_a_fairseq_checkpoint(workdir, tmp_path):
    """``lightgen train-drafter --fairseq-checkpoint``: distilled from the checkpoint's greedy outputs; the
    plugin's GAD with it gives fairseq greedy's lines, with drafts accepted."""
    text = tmp_path / "train.txt"
    text.write_text("\n".join(_lines(400, 7)) + "\n")
    drafter_main(["--fairseq-checkpoint", str(workdir / "model.pt"), "--fairseq-data", str(workdir / "bin"),
                  "--text", str(text), "--out", str(tmp_path / "drafter"), "--steps", "300", "--batch-size", "32",
                  "--lr", "3e-3", "--threads", "1"])
    config = NARDrafter.from_pretrained(tmp_path / "drafter").config
    assert (config.vocab_size, config.d_model, config.encoder_layers) == (len(fm.dictionary()), 64, 0)
    flags = ["--buffer-size", "6", "--batch-size", "6"]
    text_in = "\n".join(_lines(12, 2)) + "\n"
    expected, _ = _run(workdir, "interactive", ["--beam", "1", *flags], plugin=False, stdin=text_in)
    got, stderr = _run(workdir, "interactive", ["--lightgen-decoding", "gad", "--lightgen-drafter",
                                                str(tmp_path / "drafter"), *flags], plugin=True, stdin=text_in)
    assert_same_output(expected, got)
    tokens_per_pass = float(re.findall(r"all so far: .* ([\d.]+) tokens per pass", stderr)[-1])
    assert tokens_per_pass > 1.3, stderr[-2000:]


def test_gad_without_a_drafter_is_a_clear_error(workdir):
    done = subprocess.run([_script("fairseq-generate"), str(workdir / "bin"), "--path", str(workdir / "model.pt"),
                           "--source-lang", "src", "--target-lang", "tgt", "--lightgen-decoding", "gad", *PLUGIN_FLAGS],
                          capture_output=True, text=True)
    assert done.returncode != 0 and "GAD needs a drafter (--lightgen-drafter DIR" in done.stderr


def test_unsupported_flag_falls_back_with_a_warning(workdir):
    got, stderr = _run(workdir, "generate", ["--beam", "2", "--print-alignment"], plugin=True)
    assert stderr.count("--print-alignment needs attention weights") == 1
    # fairseq's SequenceGeneratorWithAlignment ran: one alignment line per hypothesis.
    assert sum(line.startswith("A-") for line in got) == sum(line.startswith("H-") for line in got) > 0


def test_hub_interface_translate(workdir, drafter_dir):
    allow_fairseq_checkpoints()
    # Loaded twice: fairseq's task state does not survive copy.deepcopy.
    hub, accelerated = (TransformerModel.from_pretrained(str(workdir), checkpoint_file="model.pt",
                                                         data_name_or_path=str(workdir / "bin"), source_lang="src",
                                                         target_lang="tgt") for _ in range(2))
    lightgen.accelerate_model(accelerated)
    sentences = _lines(9, 3)
    for beam in (1, 4):
        assert accelerated.translate(sentences, beam=beam) == hub.translate(sentences, beam=beam)
    greedy = hub.translate(sentences, beam=1)
    assert accelerated.translate(sentences, beam=1, lightgen_decoding="iad", lightgen_block_size=4) == greedy
    gad = accelerated.translate(sentences, beam=1, lightgen_decoding="gad", lightgen_drafter=str(drafter_dir))
    assert gad == greedy
    with pytest.raises(ValueError, match="greedy decoding: pass beam=1"):
        accelerated.translate(sentences, beam=4, lightgen_decoding="iad")
    assert accelerated.models[0].decoder.forward.__func__.__module__ == "lightgen.adapters.fairseq"
    lightgen.restore_model(accelerated)
    assert "forward" not in accelerated.models[0].decoder.__dict__
    assert "build_generator" not in accelerated.task.__dict__

