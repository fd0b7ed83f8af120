"""Benchmark lightgen's beam_topk against the candidate selection transformers' beam search runs.

    python benchmarks/topk.py [--quick] [--out benchmarks/results]

One beam-search step for B in (1, 8, 32), 4 beams, a 32000-token vocabulary and k = 2 * beams:
the eager composite is log_softmax + beam scores + view + torch.topk; beam_topk fuses it with
LightSeq's rough threshold. Logits come from a random-weight BART-size LM head (512 -> 32000),
plain and with a few peaked tokens as a trained model has. The outputs are checked against the
composite before timing. Also reports how many candidates pass the rough threshold (survivors).
Prints a markdown table and writes <out>/topk.json (and topk.png with matplotlib).
"""

from __future__ import annotations

import dataclasses
import statistics
import sys

import torch
import torch.nn.functional as F

from lightgen import ops

from _common import (ContentionMeter, Sampling, Timing, format_speedup, hardware_title, machine_lines,
                     measure, speedup_chart, start_run, write_results)

HIDDEN, VOCAB, BEAMS = 512, 32000, 4
K = 2 * BEAMS  # transformers keeps 2 * num_beams candidates with one EOS token
BATCHES = (1, 8, 32)
SURVIVOR_ITEMS = 256  # batch items the survivor statistics are taken over
FULL = Sampling(samples=31, min_sample_s=5e-3, max_measure_s=2.0)
QUICK = Sampling(samples=9, min_sample_s=1e-3, max_measure_s=0.3)
TOLERANCE = dict(rtol=1e-5, atol=1e-5)


@dataclasses.dataclass
class Row:
    logits: str
    batch: int
    lightgen: Timing
    composite: Timing
    survivors: list[int]

    @property
    def speedup(self) -> float:
        return self.composite.median_us / self.lightgen.median_us


def lm_head_logits(rows: int, head: torch.Tensor, peaked: bool) -> torch.Tensor:
    """Random hidden states through a random-weight LM head; ``peaked`` lifts a few tokens per row
    far above the rest, as a trained model's confident predictions are."""
    logits = torch.randn(rows, HIDDEN) @ head.T
    if peaked:
        tokens = torch.randint(0, VOCAB, (rows, 4))
        logits.scatter_add_(1, tokens, torch.rand(rows, 4) * 6 + 6)
    return logits


def running_beam_scores(batch: int) -> torch.Tensor:
    """Log-probabilities of the live beams some steps in: each item's beams a few nats apart."""
    return (-10 - 4 * torch.rand(batch, BEAMS).sort(dim=1).values).flatten()


def composite(logits: torch.Tensor, beam_scores: torch.Tensor, batch: int):
    """What transformers' _beam_search runs per step (generation/utils.py)."""
    log_probs = F.log_softmax(logits, dim=-1).view(batch, BEAMS, VOCAB) + beam_scores.view(batch, BEAMS, 1)
    return torch.topk(log_probs.reshape(batch, -1), k=K)


def check_and_time(name: str, head: torch.Tensor, batch: int, sampling: Sampling) -> Row:
    logits = lm_head_logits(batch * BEAMS, head, peaked=name == "peaked")
    beam_scores = running_beam_scores(batch)
    expected = composite(logits, beam_scores, batch)
    values, indices, survivors = ops.beam_topk(logits, beam_scores, BEAMS, K, True)
    torch.testing.assert_close(values, expected.values, **TOLERANCE)
    torch.testing.assert_close(indices, expected.indices, rtol=0, atol=0)
    timings = measure({"lightgen": lambda: ops.beam_topk(logits, beam_scores, BEAMS, K, True),
                       "composite": lambda: composite(logits, beam_scores, batch)}, sampling)
    return Row(name, batch, timings["lightgen"], timings["composite"], survivors.tolist())


def survivor_stats(name: str, head: torch.Tensor) -> dict:
    logits = lm_head_logits(SURVIVOR_ITEMS * BEAMS, head, peaked=name == "peaked")
    survivors = ops.beam_topk(logits, running_beam_scores(SURVIVOR_ITEMS), BEAMS, K, True)[2].tolist()
    return {"logits": name, "items": SURVIVOR_ITEMS, "mean": statistics.mean(survivors),
            "median": statistics.median(survivors), "max": max(survivors), "min": min(survivors)}


def format_us(timing: Timing) -> str:
    return f"{timing.median_us:,.1f}{' †' if timing.noisy else ''}"


def markdown(env: dict, sampling: Sampling, rows: list[Row], stats: list[dict]) -> str:
    candidates = BEAMS * VOCAB
    lines = [
        "## lightgen beam_topk benchmark",
        "",
        *machine_lines(env),
        f"- {env['mode']} mode, fp32, no_grad; {BEAMS} beams, V = {VOCAB}, k = {K}; median of up to "
        f"{sampling.samples} interleaved samples; {env['timing_seconds']:.0f} s of timing; "
        "† noisy (IQR > 20% of median)",
        "- composite: log_softmax + beam scores + view + torch.topk, as transformers' beam search runs it",
        "",
        "| logits | B | lightgen µs | eager composite µs | speedup | survivors per item (mean) |",
        "|---|--:|--:|--:|--:|--:|",
    ]
    for row in rows:
        lines.append(f"| {row.logits} | {row.batch} | {format_us(row.lightgen)} | {format_us(row.composite)} | "
                     f"{format_speedup(row.speedup)} | {statistics.mean(row.survivors):.1f} |")
    lines += ["", f"Candidates passing the rough threshold, over {SURVIVOR_ITEMS} batch items "
                  f"(of {candidates:,} per item):", ""]
    for s in stats:
        lines.append(f"- {s['logits']}: mean {s['mean']:.1f}, median {s['median']:g}, min {s['min']}, max {s['max']} "
                     f"({s['mean'] / candidates:.4%} of the candidates on average)")
    return "\n".join(lines)


def draw_chart(plt, env: dict, rows: list[Row]):
    return speedup_chart(plt, [f"{row.logits}, B={row.batch}" for row in rows], [row.speedup for row in rows],
                         "speedup vs eager composite (×)",
                         f"beam_topk ({BEAMS} beams, V={VOCAB}, k={K})\n{hardware_title(env)}")


def main(argv: list[str] | None = None) -> None:
    args, env = start_run(__doc__, "topk", "fewer, shorter samples (< 15 s)", argv)
    sampling = QUICK if args.quick else FULL
    head = torch.randn(VOCAB, HIDDEN) * 0.05

    with torch.no_grad():
        print(f"checking and timing {2 * len(BATCHES)} cases...", file=sys.stderr)
        contention = ContentionMeter()
        rows = [check_and_time(name, head, batch, sampling) for name in ("lm head", "peaked") for batch in BATCHES]
        contention.record(env)
        stats = [survivor_stats(name, head) for name in ("lm head", "peaked")]

    print(markdown(env, sampling, rows, stats))
    payload = {"environment": env, "settings": dataclasses.asdict(sampling),
               "shape": {"beams": BEAMS, "vocab": VOCAB, "k": K, "hidden": HIDDEN},
               "results": [{**dataclasses.asdict(row), "speedup": row.speedup} for row in rows],
               "survivors": stats}
    write_results(args.out, "topk", payload, lambda plt: draw_chart(plt, env, rows))


if __name__ == "__main__":
    main()
