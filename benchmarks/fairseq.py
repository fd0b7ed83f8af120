"""fairseq-generate, vanilla vs the lightgen plugin, on a Transformer-base-size checkpoint.

    python benchmarks/fairseq.py [--quick] [--out benchmarks/results]

Builds a 6+6-layer d512 (ffn 2048, 8 heads) fairseq ``transformer`` with random weights and a
joint 8000-word dictionary, binarizes random sentences of 20 words, and runs ``fairseq-generate``
on them as is and with ``--user-dir integrations/lightgen_fairseq --task translation_lightgen``,
for beams 4 and 5 and a few ``--batch-size`` values. Speed is fairseq's own "sentences/s" line
(generation only, model loading excluded). Random weights never emit EOS, so every hypothesis
runs to ``--max-len-b`` tokens and both sides decode exactly the same number of steps; the
hypotheses of the two runs are compared. Prints a markdown table and writes
<out>/fairseq.json (and fairseq.png with matplotlib).
"""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

# This script is itself named fairseq.py: import the real package with the script's folder off the path.
_script_dir = sys.path.pop(0)
import fairseq  # noqa: E402
from fairseq import options, tasks  # noqa: E402

sys.path.insert(0, _script_dir)
from _common import (REPO_ROOT, ContentionMeter, format_speedup, hardware_title, machine_lines,  # noqa: E402
                     speedup_chart, start_run, write_results)

WORDS, SENTENCE_WORDS = 8000, 20
PLUGIN_FLAGS = ["--user-dir", str(REPO_ROOT / "integrations" / "lightgen_fairseq"), "--task", "translation_lightgen"]
# fairseq cannot load its own checkpoints under torch >= 2.6 without this one class allowed.
VANILLA = ("import argparse, sys, torch; torch.serialization.add_safe_globals([argparse.Namespace]); "
           "from fairseq_cli.generate import cli_main; sys.argv[0] = 'fairseq-generate'; cli_main()")
SPEED = re.compile(r"Translated ([\d,]+) sentences \(([\d,]+) tokens\) in [\d.]+s \(([\d.]+) sentences/s")


@dataclasses.dataclass(frozen=True)
class Setup:
    sentences: int
    max_len_b: int
    cases: tuple[tuple[int, int], ...]  # (beam, batch size)


FULL = Setup(sentences=128, max_len_b=32, cases=((4, 1), (4, 16), (4, 64), (5, 16), (5, 64)))
QUICK = Setup(sentences=32, max_len_b=24, cases=((4, 16), (5, 32)))


@dataclasses.dataclass
class Row:
    beam: int
    batch: int
    vanilla_sentences_s: float
    lightgen_sentences_s: float
    same_hypotheses: bool

    @property
    def speedup(self) -> float:
        return self.lightgen_sentences_s / self.vanilla_sentences_s


def build_data(root: Path, sentences: int) -> None:
    gen = torch.Generator().manual_seed(0)
    with open(root / "dict.txt", "w") as vocab:
        vocab.writelines(f"w{i} 1\n" for i in range(WORDS))
    for side in ("src", "tgt"):
        ids = torch.randint(0, WORDS, (sentences, SENTENCE_WORDS), generator=gen).tolist()
        (root / f"test.{side}").write_text("".join(" ".join(f"w{i}" for i in row) + "\n" for row in ids))
    subprocess.run(["fairseq-preprocess", "--source-lang", "src", "--target-lang", "tgt", "--testpref",
                    str(root / "test"), "--srcdict", str(root / "dict.txt"), "--tgtdict", str(root / "dict.txt"),
                    "--destdir", str(root / "bin"), "--workers", "1"], check=True, capture_output=True)
    args = options.parse_args_and_arch(options.get_training_parser(), [
        str(root / "bin"), "--arch", "transformer", "--source-lang", "src", "--target-lang", "tgt",
        "--share-all-embeddings"])
    model = tasks.setup_task(args).build_model(args)
    with torch.no_grad():  # LayerNorms start at identity; move them so every op is exercised
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.02)
    torch.save({"args": args, "model": model.state_dict(), "extra_state": {"train_iterator": {"epoch": 1}},
                "optimizer_history": [{"criterion_name": "CrossEntropyCriterion", "optimizer_name": "Adam",
                                       "lr_scheduler_state": {"best": None}, "num_updates": 0}]},
               root / "model.pt")


def generate(root: Path, beam: int, batch: int, max_len_b: int, plugin: bool) -> tuple[float, list[str]]:
    flags = [str(root / "bin"), "--path", str(root / "model.pt"), "--source-lang", "src", "--target-lang", "tgt",
             "--beam", str(beam), "--batch-size", str(batch), "--max-len-a", "0", "--max-len-b", str(max_len_b)]
    command = ["fairseq-generate", *flags, *PLUGIN_FLAGS] if plugin else [sys.executable, "-c", VANILLA, *flags]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(done.stderr[-3000:])
    speed = SPEED.search(done.stderr)
    hypotheses = sorted(line for line in done.stdout.splitlines() if line.startswith("H-"))
    # Compare tokens only: scores agree to float rounding, not to the printed digit.
    return float(speed.group(3)), [line.split("\t")[0] + "\t" + line.split("\t")[2] for line in hypotheses]


def markdown(env: dict, setup: Setup, rows: list[Row]) -> str:
    lines = [
        f"### fairseq-generate, vanilla vs lightgen plugin ({'quick' if env['mode'] == 'quick' else 'full'} run)",
        "",
        *machine_lines(env),
        f"- fairseq {env['fairseq']}; model: fairseq `transformer` (base: 6+6 layers, d512, ffn 2048, 8 heads), "
        f"random weights, shared {WORDS}-word vocabulary, fp32; {setup.sentences} sentences of "
        f"{SENTENCE_WORDS} words, every hypothesis {setup.max_len_b} tokens + EOS",
        "- sentences/s as fairseq-generate reports it (generation only)",
        "",
        "| beam | batch | vanilla sent/s | lightgen sent/s | speedup | same hypotheses |",
        "|--:|--:|--:|--:|--:|---|",
    ]
    for row in rows:
        lines.append(f"| {row.beam} | {row.batch} | {row.vanilla_sentences_s:.2f} | {row.lightgen_sentences_s:.2f} | "
                     f"{format_speedup(row.speedup)} | {'yes' if row.same_hypotheses else 'NO'} |")
    return "\n".join(lines)


def draw_chart(plt, env: dict, rows: list[Row]):
    return speedup_chart(plt, [f"beam {row.beam}, batch {row.batch}" for row in rows], [row.speedup for row in rows],
                         "fairseq-generate sentences/s, lightgen plugin vs vanilla (×)",
                         f"fairseq transformer base, random weights\n{hardware_title(env)}")


def main(argv: list[str] | None = None) -> None:
    args, env = start_run(__doc__, "fairseq", f"{QUICK.sentences} sentences, 2 cases (about 2 minutes)", argv)
    env["fairseq"] = fairseq.__version__
    setup = QUICK if args.quick else FULL
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder)
        build_data(root, setup.sentences)
        contention = ContentionMeter()
        for beam, batch in setup.cases:
            print(f"beam {beam}, batch {batch}...", file=sys.stderr)
            vanilla, expected = generate(root, beam, batch, setup.max_len_b, plugin=False)
            accelerated, got = generate(root, beam, batch, setup.max_len_b, plugin=True)
            rows.append(Row(beam, batch, vanilla, accelerated, got == expected))
        contention.record(env)
    print(markdown(env, setup, rows))
    payload = {"environment": env, "setup": dataclasses.asdict(setup),
               "results": [{**dataclasses.asdict(row), "speedup": row.speedup} for row in rows]}
    write_results(args.out, "fairseq", payload, lambda plt: draw_chart(plt, env, rows))


if __name__ == "__main__":
    main()
