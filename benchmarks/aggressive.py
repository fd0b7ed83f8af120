"""Benchmark aggressive decoding (IAD, GAD, GAD++) against greedy and beam search on the shipped demo model.

    python benchmarks/aggressive.py [--quick] [--out benchmarks/results]

The demo grammar corrector (``lightgen.demo``) corrects held-out sentences with synthetic errors at
batch 1, 8 and 32: Hugging Face greedy and beam 5 (the unpatched model), HF prompt lookup (batch 1:
HF refuses more), lightgen greedy, IAD, GAD with the shipped drafter (beta=1) and GAD++ (a deep copy
after ``lightgen.accelerate_model``). Greedy-exact providers are checked against HF greedy before
timing. Reports each call's time and the ratio to HF greedy, tokens per decoder pass, the share of
sentences identical to greedy and F0.5 against the references, and, per sentence at batch 1, IAD's
speedup over lightgen greedy against the share of words the model edits. Prints markdown tables and
writes <out>/aggressive.json and (with matplotlib) <out>/aggressive.png.
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
from lightgen.demo import generate_ids, held_out_pairs, load_demo_drafter, load_demo_model
from lightgen.demo.noise import edits, score, words

from _common import (ContentionMeter, Sampling, format_speedup, hardware_title, machine_lines, measure, start_run,
                     write_results)


@dataclasses.dataclass(frozen=True)
class Settings(Sampling):
    sentences: int  # held-out sentences corrected per call
    batch_sizes: tuple[int, ...]
    per_sentence: int  # sentences timed one by one for the speedup-vs-edits plot
    per_sentence_repeats: int


# One call corrects every sentence (0.2-5 s), so a sample is a single call.
FULL = Settings(samples=5, min_sample_s=0.0, max_measure_s=30.0, min_samples=3, warmup_calls=1, sentences=64,
                batch_sizes=(1, 8, 32), per_sentence=48, per_sentence_repeats=3)
QUICK = Settings(samples=2, min_sample_s=0.0, max_measure_s=3.0, min_samples=2, warmup_calls=0, sentences=8,
                 batch_sizes=(1, 8), per_sentence=4, per_sentence_repeats=1)
HF_GREEDY, HF_BEAM, HF_LOOKUP = "HF greedy", "HF beam 5", "HF prompt lookup"
LG_GREEDY, LG_IAD, LG_GAD, LG_GAD_PP = "lightgen greedy", "lightgen IAD", "lightgen GAD", "lightgen GAD++"
GAD_PP = dict(beta=3, tau=1.0)
BLOCK_SIZE = 8
# These must return HF greedy's tokens; the rest report how often they do.
GREEDY_EXACT = (HF_LOOKUP, LG_GREEDY, LG_IAD, LG_GAD)


def providers(reference, accelerated, drafter, batch: int) -> dict[str, tuple[object, dict]]:
    found = {HF_GREEDY: (reference, {}), HF_BEAM: (reference, dict(num_beams=5))}
    if batch == 1:  # "assisted generate is only supported for batch_size = 1"
        found[HF_LOOKUP] = (reference, dict(prompt_lookup_num_tokens=10))
    found.update({LG_GREEDY: (accelerated, {}), LG_IAD: (accelerated, dict(decoding="iad")),
                  LG_GAD: (accelerated, dict(decoding="gad", drafter=drafter, block_size=BLOCK_SIZE)),
                  LG_GAD_PP: (accelerated, dict(decoding="gad", drafter=drafter, block_size=BLOCK_SIZE, **GAD_PP))})
    return found


def _tokens_per_pass(accelerated, tokenizer, sources, batch, kwargs) -> float:
    tokens = passes = 0
    for i in range(0, len(sources), batch):
        with torch.no_grad():
            out = accelerated.generate(**tokenizer(sources[i:i + batch], return_tensors="pt", padding=True),
                                       do_sample=False, max_length=128, return_dict_in_generate=True, **kwargs)
        tokens += sum(int(row.sum()) for row in out.tokens_per_iteration)
        passes += int(out.iterations.sum())
    return tokens / passes


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
    fig, (bars, scatter) = plt.subplots(1, 2, figsize=(13, 4.8))
    names = list(payload["batches"][str(payload["batch_sizes"][0])]["speedup"])
    width = 0.8 / len(names)
    for offset, name in enumerate(names):
        values = [payload["batches"][str(b)]["speedup"].get(name, 0.0) for b in payload["batch_sizes"]]
        xs = [i + (offset - (len(names) - 1) / 2) * width for i in range(len(payload["batch_sizes"]))]
        bars.bar(xs, values, width, label=name)
    bars.set_xticks(range(len(payload["batch_sizes"])), [f"batch {b}" for b in payload["batch_sizes"]])
    bars.axhline(1.0, color="grey", lw=0.8)
    bars.set_ylabel("speedup over HF greedy (×, wall time)")
    bars.set_title("Demo grammar corrector: speed")
    bars.legend(fontsize=7)
    points = payload["per_sentence"]
    scatter.scatter([100 * p["edit_rate"] for p in points], [p["speedup"] for p in points], s=14)
    scatter.axhline(1.0, color="grey", lw=0.8)
    scatter.set_xlabel("words edited by the model (% of source words)")
    scatter.set_ylabel("IAD speedup over lightgen greedy (×, batch 1)")
    scatter.set_title("IAD speedup vs edit rate")
    fig.suptitle(hardware_title(payload["environment"]), fontsize=9)
    return fig


def main(argv: list[str] | None = None) -> None:
    args, env = start_run(__doc__, "aggressive", "8 sentences, batch 1 and 8, fewer samples", argv)
    settings = QUICK if args.quick else FULL
    warnings.filterwarnings("ignore", category=UserWarning)
    reference, tokenizer = load_demo_model()
    accelerated = lightgen.accelerate_model(copy.deepcopy(reference))
    drafter = load_demo_drafter()
    sources, references = held_out_pairs(settings.sentences)
    meter = ContentionMeter()
    batches = {}
    greedy_ids = None
    for batch in settings.batch_sizes:
        chosen = providers(reference, accelerated, drafter, batch)
        outputs = {name: generate_ids(model, tokenizer, sources, batch, **kw) for name, (model, kw) in chosen.items()}
        greedy_ids = outputs[HF_GREEDY]
        mismatched = [name for name in GREEDY_EXACT if name in outputs and outputs[name] != greedy_ids]
        if mismatched:
            sys.exit(f"batch {batch}: {mismatched} differ from HF greedy; not timing wrong outputs")
        timings = measure({name: lambda m=model, kw=kw, b=batch: generate_ids(m, tokenizer, sources, b, **kw)
                           for name, (model, kw) in chosen.items()}, settings)
        batches[str(batch)] = dict(
            median_ms={name: t.median_us / 1e3 for name, t in timings.items()},
            speedup={name: timings[HF_GREEDY].median_us / t.median_us for name, t in timings.items()},
            noisy={name: t.noisy for name, t in timings.items()},
            identical_to_greedy={name: sum(a == b for a, b in zip(ids, greedy_ids, strict=True)) / len(sources)
                                 for name, ids in outputs.items()},
            f0_5={name: score(sources, [tokenizer.decode(i).strip() for i in ids], references)["f0_5"]
                  for name, ids in outputs.items()},
            tokens_per_pass={name: _tokens_per_pass(accelerated, tokenizer, sources, batch, kw)
                             for name, (model, kw) in chosen.items() if "decoding" in kw})
    per_sentence = _per_sentence(accelerated, tokenizer, sources, greedy_ids, settings)
    meter.record(env)
    payload = dict(environment=env, sentences=len(sources), batch_sizes=list(settings.batch_sizes), batches=batches,
                   per_sentence=per_sentence, gad_block_size=BLOCK_SIZE, gad_plus_plus=GAD_PP)

    print(f"# Aggressive decoding on the demo grammar corrector ({len(sources)} held-out sentences)\n")
    print("\n".join(machine_lines(env)) + "\n")
    print(f"GAD: shipped drafter, block {BLOCK_SIZE}; GAD++: beta={GAD_PP['beta']}, tau={GAD_PP['tau']}.\n")
    print("| batch | provider | ms per call | vs HF greedy | tokens/pass | identical to greedy | F0.5 |")
    print("|---|---|---|---|---|---|---|")
    for batch, row in batches.items():
        for name, ms in row["median_ms"].items():
            per_pass = row["tokens_per_pass"].get(name)
            print(f"| {batch} | {name} | {ms:.0f}{' (noisy)' if row['noisy'][name] else ''} "
                  f"| {format_speedup(row['speedup'][name])} | {'' if per_pass is None else f'{per_pass:.2f}'} "
                  f"| {100 * row['identical_to_greedy'][name]:.0f}% | {row['f0_5'][name]:.3f} |")
    write_results(args.out, "aggressive", payload, lambda plt: draw(plt, payload))


if __name__ == "__main__":
    main()
