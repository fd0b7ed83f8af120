"""Benchmark input-guided aggressive decoding (IAD) against greedy on the shipped demo model.

    python benchmarks/aggressive.py [--quick] [--out benchmarks/results]

The demo grammar corrector (``lightgen.demo``) corrects held-out sentences with synthetic errors at
batch 1 and 8: Hugging Face greedy (the unpatched model), lightgen greedy and lightgen IAD (a deep
copy after ``lightgen.accelerate_model``). Every provider's tokens are checked against HF greedy
first. Reports generated tokens/s, the ratio to HF greedy, IAD's tokens per decoder pass and, per
sentence at batch 1, IAD's speedup over lightgen greedy against the share of words the model edits.
Prints markdown tables and writes <out>/aggressive.json and (with matplotlib) <out>/aggressive.png.
GAD (a drafter for outputs that do not resemble the input) is not implemented yet.
"""

from __future__ import annotations

import copy
import dataclasses
import statistics
import sys
import time
import warnings

import torch

import lightgen
from lightgen.demo import generate_ids, held_out_pairs, load_demo_model
from lightgen.demo.noise import edits, words

from _common import (ContentionMeter, Sampling, format_speedup, hardware_title, machine_lines, measure, start_run,
                     write_results)


@dataclasses.dataclass(frozen=True)
class Settings(Sampling):
    sentences: int  # held-out sentences corrected per call
    per_sentence: int  # sentences timed one by one for the speedup-vs-edits plot
    per_sentence_repeats: int


# One call corrects every sentence (0.2-5 s), so a sample is a single call.
FULL = Settings(samples=5, min_sample_s=0.0, max_measure_s=20.0, min_samples=3, warmup_calls=1, sentences=32,
                per_sentence=32, per_sentence_repeats=3)
QUICK = Settings(samples=3, min_sample_s=0.0, max_measure_s=3.0, min_samples=2, warmup_calls=1, sentences=16,
                 per_sentence=16, per_sentence_repeats=1)
BATCH_SIZES = (1, 8)
HF_GREEDY, LG_GREEDY, LG_IAD = "HF greedy", "lightgen greedy", "lightgen IAD"


def _per_sentence(accelerated, tokenizer, sources, greedy_ids, settings) -> list[dict]:
    """Batch 1, sentence by sentence: edit rate, IAD tokens per pass, IAD speedup over lightgen greedy."""
    rows = []
    for source, ids in zip(sources[:settings.per_sentence], greedy_ids, strict=False):
        enc = tokenizer([source], return_tensors="pt")
        timings = {}
        for label, kwargs in ((LG_GREEDY, {}), (LG_IAD, dict(decoding="iad"))):
            samples = []
            for _ in range(settings.per_sentence_repeats + 1):  # the first call is a warm-up
                start = time.perf_counter()
                with torch.no_grad():
                    out = accelerated.generate(**enc, do_sample=False, max_length=128, return_dict_in_generate=True,
                                               **kwargs)
                samples.append(time.perf_counter() - start)
            timings[label] = statistics.median(samples[1:])
        correction = tokenizer.decode(ids).strip()
        rows.append(dict(edit_rate=len(edits(source, correction)) / len(words(source)),
                         tokens_per_pass=float(out.tokens_per_iteration[0].float().mean()),
                         speedup=timings[LG_GREEDY] / timings[LG_IAD]))
    return rows


def draw(plt, payload):
    fig, (bars, scatter) = plt.subplots(1, 2, figsize=(12, 4.8))
    width = 0.25
    for offset, name in enumerate((HF_GREEDY, LG_GREEDY, LG_IAD)):
        values = [payload["batches"][str(b)]["tokens_per_s"][name] for b in BATCH_SIZES]
        xs = [i + (offset - 1) * width for i in range(len(BATCH_SIZES))]
        bars.bar(xs, values, width, label=name)
    bars.set_xticks(range(len(BATCH_SIZES)), [f"batch {b}" for b in BATCH_SIZES])
    bars.set_ylabel("generated tokens / s")
    bars.set_title("Demo grammar corrector: throughput")
    bars.legend()
    points = payload["per_sentence"]
    scatter.scatter([100 * p["edit_rate"] for p in points], [p["speedup"] for p in points], s=14)
    scatter.axhline(1.0, color="grey", lw=0.8)
    scatter.set_xlabel("words edited by the model (% of source words)")
    scatter.set_ylabel("IAD speedup over lightgen greedy (×, batch 1)")
    scatter.set_title("IAD speedup vs edit rate")
    fig.suptitle(hardware_title(payload["environment"]), fontsize=9)
    return fig


def main(argv: list[str] | None = None) -> None:
    args, env = start_run(__doc__, "aggressive", "16 sentences, fewer samples", argv)
    settings = QUICK if args.quick else FULL
    warnings.filterwarnings("ignore", category=UserWarning)
    reference, tokenizer = load_demo_model()
    accelerated = lightgen.accelerate_model(copy.deepcopy(reference))
    sources, _ = held_out_pairs(settings.sentences)
    providers = {HF_GREEDY: (reference, {}), LG_GREEDY: (accelerated, {}), LG_IAD: (accelerated, dict(decoding="iad"))}
    meter = ContentionMeter()
    batches = {}
    greedy_ids = None
    for batch in BATCH_SIZES:
        outputs = {name: generate_ids(model, tokenizer, sources, batch, **kw)
                   for name, (model, kw) in providers.items()}
        greedy_ids = outputs[HF_GREEDY]
        mismatched = [name for name, ids in outputs.items() if ids != greedy_ids]
        if mismatched:
            sys.exit(f"batch {batch}: {mismatched} differ from HF greedy; not timing wrong outputs")
        tokens = sum(len(ids) + 1 for ids in greedy_ids)  # + EOS
        timings = measure({name: lambda m=model, kw=kw, b=batch: generate_ids(m, tokenizer, sources, b, **kw)
                           for name, (model, kw) in providers.items()}, settings)
        stats = [accelerated.generate(**tokenizer(sources[i:i + batch], return_tensors="pt", padding=True),
                                      do_sample=False, max_length=128, decoding="iad", return_dict_in_generate=True)
                 for i in range(0, len(sources), batch)]
        passes = sum(int(s.iterations.sum()) for s in stats)
        batches[str(batch)] = dict(
            tokens_per_s={name: tokens / (t.median_us * 1e-6) for name, t in timings.items()},
            median_ms={name: t.median_us / 1e3 for name, t in timings.items()},
            noisy={name: t.noisy for name, t in timings.items()},
            iad_tokens_per_pass=tokens / passes)
    per_sentence = _per_sentence(accelerated, tokenizer, sources, greedy_ids, settings)
    meter.record(env)
    payload = dict(environment=env, sentences=len(sources), batches=batches, per_sentence=per_sentence)

    print(f"# IAD vs greedy on the demo grammar corrector ({len(sources)} held-out sentences)\n")
    print("\n".join(machine_lines(env)) + "\n")
    print("| batch | HF greedy tok/s | lightgen greedy tok/s | lightgen IAD tok/s | IAD vs HF greedy "
          "| IAD vs lightgen greedy | IAD tokens/pass |")
    print("|---|---|---|---|---|---|---|")
    for batch, row in batches.items():
        rate = row["tokens_per_s"]
        print(f"| {batch} | {rate[HF_GREEDY]:.0f} | {rate[LG_GREEDY]:.0f} | {rate[LG_IAD]:.0f} "
              f"| {format_speedup(rate[LG_IAD] / rate[HF_GREEDY])} | {format_speedup(rate[LG_IAD] / rate[LG_GREEDY])} "
              f"| {row['iad_tokens_per_pass']:.2f} |")
    write_results(args.out, "aggressive", payload, lambda plt: draw(plt, payload))


if __name__ == "__main__":
    main()
