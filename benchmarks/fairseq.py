"""fairseq-generate, vanilla vs the lightgen plugin, on a Transformer-base-size checkpoint.

    python benchmarks/fairseq.py [--quick] [--out benchmarks/results]

Builds a 6+6-layer d512 (ffn 2048, 8 heads) fairseq ``transformer`` with random weights and a
joint 8000-word dictionary, binarizes random sentences of 20 words, and runs ``fairseq-generate``
on them as is and with ``--user-dir "$(lightgen fairseq-plugin-dir)" --task translation_lightgen``,
for beams 4 and 5 and a few ``--batch-size`` values. Speed is fairseq's own "sentences/s" line
(generation only, model loading excluded). Random weights never emit EOS, so every hypothesis
runs to ``--max-len-b`` tokens and both sides decode exactly the same number of steps; the
hypotheses of the two runs are compared.

IAD needs outputs that resemble the inputs, which random weights never give: a small pre-norm
``transformer`` (2+2 layers, d128) is trained in-process for a few hundred Adam steps on a synthetic
GEC-like task over 64 words (w0 becomes w1, w2 is deleted, w3 is doubled, everything else is copied;
sentences of 4-16 words), then ``fairseq-generate --beam 1`` runs vanilla, with the plugin's
``--lightgen-decoding greedy`` and with ``--lightgen-decoding iad``; the three must give the same
hypotheses, and IAD's decoder passes per sentence and tokens per pass come from its log line.

Prints markdown tables and writes <out>/fairseq.json (and fairseq.png with matplotlib).
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

from lightgen.integrations import FAIRSEQ_PLUGIN_DIR  # noqa: E402

sys.path.insert(0, _script_dir)
from _common import (ContentionMeter, format_speedup, hardware_title, machine_lines,  # noqa: E402
                     speedup_chart, start_run, write_results)

WORDS, SENTENCE_WORDS = 8000, 20
PLUGIN_FLAGS = ["--user-dir", str(FAIRSEQ_PLUGIN_DIR), "--task", "translation_lightgen"]
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

COPY_WORDS, COPY_LENGTHS = 64, (4, 16)
COPY_MODEL = ["--encoder-layers", "2", "--decoder-layers", "2", "--encoder-embed-dim", "128",
              "--decoder-embed-dim", "128", "--encoder-ffn-embed-dim", "256", "--decoder-ffn-embed-dim", "256",
              "--encoder-attention-heads", "4", "--decoder-attention-heads", "4", "--encoder-normalize-before",
              "--decoder-normalize-before", "--share-all-embeddings", "--dropout", "0"]
IAD_STATS = re.compile(r"all so far: (\d+) sentences, ([\d.]+) decoder passes per sentence, ([\d.]+) tokens per pass")


@dataclasses.dataclass(frozen=True)
class CopySetup:
    sentences: int
    train_steps: int
    batches: tuple[int, ...]
    block_size: int  # --lightgen-block-size
    max_len_b: int  # with --max-len-a 1.5: room for every doubled word


COPY_FULL = CopySetup(sentences=128, train_steps=800, batches=(1, 16, 64), block_size=16, max_len_b=8)
COPY_QUICK = CopySetup(sentences=32, train_steps=800, batches=(1, 16), block_size=16, max_len_b=8)


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


@dataclasses.dataclass
class IadRow:
    batch: int
    vanilla_greedy_sentences_s: float
    lightgen_greedy_sentences_s: float
    lightgen_iad_sentences_s: float
    iad_passes_per_sentence: float
    iad_tokens_per_pass: float
    same_hypotheses: bool

    @property
    def speedup(self) -> float:  # IAD vs fairseq's own greedy
        return self.lightgen_iad_sentences_s / self.vanilla_greedy_sentences_s

    @property
    def speedup_vs_lightgen_greedy(self) -> float:
        return self.lightgen_iad_sentences_s / self.lightgen_greedy_sentences_s


def save_checkpoint(args, model, path: Path) -> None:
    """The way older fairseq-train saved one (fairseq-generate reads args from it)."""
    torch.save({"args": args, "model": model.state_dict(), "extra_state": {"train_iterator": {"epoch": 1}},
                "optimizer_history": [{"criterion_name": "CrossEntropyCriterion", "optimizer_name": "Adam",
                                       "lr_scheduler_state": {"best": None}, "num_updates": 0}]}, path)


def binarize(root: Path, words: int, sources: list[list[int]], targets: list[list[int]]) -> None:
    with open(root / "dict.txt", "w") as vocab:
        vocab.writelines(f"w{i} 1\n" for i in range(words))
    for side, rows in (("src", sources), ("tgt", targets)):
        (root / f"test.{side}").write_text("".join(" ".join(f"w{i}" for i in row) + "\n" for row in rows))
    subprocess.run(["fairseq-preprocess", "--source-lang", "src", "--target-lang", "tgt", "--testpref",
                    str(root / "test"), "--srcdict", str(root / "dict.txt"), "--tgtdict", str(root / "dict.txt"),
                    "--destdir", str(root / "bin"), "--workers", "1"], check=True, capture_output=True)


def build_data(root: Path, sentences: int) -> None:
    gen = torch.Generator().manual_seed(0)
    binarize(root, WORDS, *(torch.randint(0, WORDS, (sentences, SENTENCE_WORDS), generator=gen).tolist()
                            for _ in range(2)))
    args = options.parse_args_and_arch(options.get_training_parser(), [
        str(root / "bin"), "--arch", "transformer", "--source-lang", "src", "--target-lang", "tgt",
        "--share-all-embeddings"])
    model = tasks.setup_task(args).build_model(args)
    with torch.no_grad():  # LayerNorms start at identity; move them so every op is exercised
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.02)
    save_checkpoint(args, model, root / "model.pt")


def edit(words: list[int]) -> list[int]:
    """The synthetic GEC-like task on word numbers: w0 -> w1, w2 deleted, w3 doubled, the rest copied."""
    return [out for word in words if word != 2 for out in ({0: [1], 3: [3, 3]}.get(word, [word]))]


def copy_sentences(count: int, gen: torch.Generator) -> list[list[int]]:
    lengths = torch.randint(COPY_LENGTHS[0], COPY_LENGTHS[1] + 1, (count,), generator=gen).tolist()
    return [torch.randint(0, COPY_WORDS, (length,), generator=gen).tolist() for length in lengths]


def build_copy_data(root: Path, setup: CopySetup) -> None:
    """Binarized test sentences and their edits, and a model trained on fresh ones (one thread: faster
    for a model this small, and on a busy machine)."""
    sources = copy_sentences(setup.sentences, torch.Generator().manual_seed(1))
    binarize(root, COPY_WORDS, sources, [edit(words) for words in sources])
    args = options.parse_args_and_arch(options.get_training_parser(), [
        str(root / "bin"), "--arch", "transformer", "--source-lang", "src", "--target-lang", "tgt", *COPY_MODEL])
    task = tasks.setup_task(args)
    vocab = task.source_dictionary
    model = task.build_model(args).train()
    optimizer = torch.optim.Adam(model.parameters(), lr=2e-3)
    gen, threads = torch.Generator().manual_seed(0), torch.get_num_threads()
    torch.set_num_threads(1)
    for _ in range(setup.train_steps):
        words = copy_sentences(32, gen)
        src = [[vocab.index(f"w{i}") for i in row] + [vocab.eos()] for row in words]
        tgt = [[vocab.index(f"w{i}") for i in edit(row)] + [vocab.eos()] for row in words]
        src_tokens = torch.full((32, max(map(len, src))), vocab.pad())
        target = torch.full((32, max(map(len, tgt))), vocab.pad())
        previous = target.clone()
        for row, (source_ids, target_ids) in enumerate(zip(src, tgt, strict=True)):
            src_tokens[row, src_tokens.shape[1] - len(source_ids):] = torch.tensor(source_ids)  # left-padded
            target[row, : len(target_ids)] = torch.tensor(target_ids)
            previous[row, : len(target_ids)] = torch.tensor([vocab.eos()] + target_ids[:-1])
        logits = model(src_tokens, (src_tokens != vocab.pad()).sum(1), previous)[0]
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten(), ignore_index=vocab.pad())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    torch.set_num_threads(threads)
    save_checkpoint(args, model.eval(), root / "model.pt")


@dataclasses.dataclass
class Run:
    sentences_s: float
    hypotheses: list[str]  # "H-<id>\t<tokens>", sorted
    references: list[str]  # "T-<id>\t<tokens>", sorted
    log: str


def generate(root: Path, flags: list[str], plugin: list[str] | None = None) -> Run:
    """fairseq-generate on root/bin with root/model.pt: vanilla, or with the plugin and ``plugin`` flags."""
    flags = [str(root / "bin"), "--path", str(root / "model.pt"), "--source-lang", "src", "--target-lang", "tgt",
             *flags]
    command = (["fairseq-generate", *flags, *PLUGIN_FLAGS, *plugin] if plugin is not None
               else [sys.executable, "-c", VANILLA, *flags])
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(done.stderr[-3000:])
    lines = done.stdout.splitlines()
    # Compare tokens only: scores agree to float rounding, not to the printed digit.
    hypotheses = sorted(line.split("\t")[0] + "\t" + line.split("\t")[2] for line in lines if line.startswith("H-"))
    return Run(float(SPEED.search(done.stderr).group(3)), hypotheses,
               sorted(line for line in lines if line.startswith("T-")), done.stderr)


def run_beam_case(root: Path, setup: Setup, beam: int, batch: int) -> Row:
    flags = ["--beam", str(beam), "--batch-size", str(batch), "--max-len-a", "0", "--max-len-b", str(setup.max_len_b)]
    vanilla, accelerated = generate(root, flags), generate(root, flags, plugin=[])
    return Row(beam, batch, vanilla.sentences_s, accelerated.sentences_s, accelerated.hypotheses == vanilla.hypotheses)


def run_iad_case(root: Path, setup: CopySetup, batch: int) -> tuple[IadRow, float]:
    """One batch size; also returns the share of hypotheses equal to the reference edit."""
    flags = ["--beam", "1", "--batch-size", str(batch), "--max-len-a", "1.5", "--max-len-b", str(setup.max_len_b)]
    vanilla = generate(root, flags)
    greedy = generate(root, flags, plugin=["--lightgen-decoding", "greedy"])
    iad = generate(root, flags, plugin=["--lightgen-decoding", "iad", "--lightgen-block-size", str(setup.block_size)])
    sentences, passes, tokens_per_pass = IAD_STATS.findall(iad.log)[-1]
    if int(sentences) != len(iad.hypotheses):  # (fairseq-generate --batch-size 1 leaves one sentence out)
        sys.exit(f"IAD's log counted {sentences} sentences, fairseq-generate printed {len(iad.hypotheses)}")
    correct = sum(h.partition("\t")[2] == t.partition("\t")[2] for h, t in zip(vanilla.hypotheses, vanilla.references,
                                                                               strict=True))
    row = IadRow(batch, vanilla.sentences_s, greedy.sentences_s, iad.sentences_s, float(passes), float(tokens_per_pass),
                 vanilla.hypotheses == greedy.hypotheses == iad.hypotheses)
    return row, correct / len(vanilla.hypotheses)


def markdown(env: dict, setup: Setup, rows: list[Row], copy: CopySetup, iad_rows: list[IadRow],
             correct: float) -> str:
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
    lines += [
        "",
        f"#### IAD, `fairseq-generate --beam 1`, copy-heavy task ({copy.sentences} sentences)",
        "",
        f"- model: pre-norm `transformer` 2+2 layers, d128, ffn 256, 4 heads, {COPY_WORDS}-word shared vocabulary, "
        f"trained for {copy.train_steps} Adam steps (batch 32) on the synthetic edit task (w0 -> w1, w2 deleted, "
        f"w3 doubled, sentences of {COPY_LENGTHS[0]}-{COPY_LENGTHS[1]} words); its greedy output equals the "
        f"reference edit for {correct:.0%} of the test sentences",
        f"- IAD: `--lightgen-decoding iad --lightgen-block-size {copy.block_size}`; decoder passes include the first "
        "(prompt) pass; greedy needs one pass per token (EOS included)",
        "",
        "| batch | fairseq greedy sent/s | lightgen greedy sent/s | lightgen IAD sent/s | IAD vs fairseq greedy | "
        "IAD vs lightgen greedy | IAD passes/sentence | IAD tokens/pass | same hypotheses |",
        "|--:|--:|--:|--:|--:|--:|--:|--:|---|",
    ]
    for row in iad_rows:
        lines.append(f"| {row.batch} | {row.vanilla_greedy_sentences_s:.2f} | {row.lightgen_greedy_sentences_s:.2f} | "
                     f"{row.lightgen_iad_sentences_s:.2f} | {format_speedup(row.speedup)} | "
                     f"{format_speedup(row.speedup_vs_lightgen_greedy)} | {row.iad_passes_per_sentence:.2f} | "
                     f"{row.iad_tokens_per_pass:.2f} | {'yes' if row.same_hypotheses else 'NO'} |")
    return "\n".join(lines)


def draw_chart(plt, env: dict, rows: list[Row], iad_rows: list[IadRow]):
    labels = [f"beam {row.beam}, batch {row.batch}" for row in rows]
    labels += [f"IAD vs greedy, batch {row.batch}" for row in iad_rows]
    return speedup_chart(plt, labels, [row.speedup for row in [*rows, *iad_rows]],
                         "fairseq-generate sentences/s, lightgen plugin vs vanilla (×)",
                         f"beams: transformer base (random); IAD: copy task, 2+2 d128\n{hardware_title(env)}")


def main(argv: list[str] | None = None) -> None:
    args, env = start_run(__doc__, "fairseq", f"{QUICK.sentences} sentences, 2 beam cases, IAD at batch 1 and 16 "
                                              "(about 5 minutes)", argv)
    env["fairseq"] = fairseq.__version__
    setup, copy = (QUICK, COPY_QUICK) if args.quick else (FULL, COPY_FULL)
    with tempfile.TemporaryDirectory() as base, tempfile.TemporaryDirectory() as copy_task:
        base, copy_task = Path(base), Path(copy_task)
        build_data(base, setup.sentences)
        print(f"training the copy-task model ({copy.train_steps} steps)...", file=sys.stderr)
        build_copy_data(copy_task, copy)
        contention = ContentionMeter()
        rows = []
        for beam, batch in setup.cases:
            print(f"beam {beam}, batch {batch}...", file=sys.stderr)
            rows.append(run_beam_case(base, setup, beam, batch))
        iad_rows = []
        for batch in copy.batches:
            print(f"IAD, batch {batch}...", file=sys.stderr)
            row, correct = run_iad_case(copy_task, copy, batch)
            iad_rows.append(row)
        contention.record(env)
    print(markdown(env, setup, rows, copy, iad_rows, correct))
    payload = {"environment": env, "setup": dataclasses.asdict(setup),
               "results": [{**dataclasses.asdict(row), "speedup": row.speedup} for row in rows],
               "iad": {"setup": dataclasses.asdict(copy), "greedy_equals_reference": correct,
                       "results": [{**dataclasses.asdict(row), "speedup": row.speedup,
                                    "speedup_vs_lightgen_greedy": row.speedup_vs_lightgen_greedy}
                                   for row in iad_rows]}}
    write_results(args.out, "fairseq", payload, lambda plt: draw_chart(plt, env, rows, iad_rows))


if __name__ == "__main__":
    main()
