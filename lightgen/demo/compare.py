"""``lightgen demo``: the shipped grammar-correction model, HF vs lightgen greedy, IAD, GAD and beam search.

Results come first: each sentence's correction and whether every lightgen decoding returned HF's tokens
are printed as soon as that sentence is done; the timings come last, with a progress line while they run
and the share of the CPUs other processes took meanwhile beside them.
"""

from __future__ import annotations

import copy
import statistics
import sys
import time

import torch

from lightgen.machine import ContentionMeter, busy, load_label

# lightgen decoding -> the HF decoding whose tokens it must return
CHECKS = {"lightgen greedy": "HF greedy", "lightgen IAD": "HF greedy", "lightgen GAD": "HF greedy",
          "lightgen beam 4": "HF beam 4"}


def median_seconds(fn, repeats: int) -> float:
    fn()  # warm-up: first calls allocate and fill caches
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


class Progress:
    """``timing [#####.....] 12/24 lightgen IAD (40 s)`` after each call: one line redrawn in a terminal, a
    line each otherwise (a log, a notebook)."""

    def __init__(self, total: int, stream=sys.stdout, width: int = 24):
        self.total, self.stream, self.width = total, stream, width
        self.done, self.started = 0, time.perf_counter()
        self.tty = getattr(stream, "isatty", lambda: False)()

    def step(self, label: str) -> None:
        self.done += 1
        filled = self.width * self.done // self.total
        line = (f"timing [{'#' * filled}{'.' * (self.width - filled)}] {self.done}/{self.total} {label} "
                f"({time.perf_counter() - self.started:.0f} s)")
        if self.tty:
            print(f"\r{line:<90}", end="" if self.done < self.total else "\n", file=self.stream, flush=True)
        else:
            print(line, file=self.stream, flush=True)


def interleaved_seconds(calls: dict, repeats: int, progress: Progress) -> dict[str, list[float]]:
    """Seconds per call of each function, ``repeats`` rounds of all of them in turn: a noisy neighbour then
    slows every decoding alike instead of whichever ran during the disturbance. No warm-up here: the
    caller has run each one already."""
    seconds = {name: [] for name in calls}
    for _ in range(repeats):
        for name, fn in calls.items():
            start = time.perf_counter()
            fn()
            seconds[name].append(time.perf_counter() - start)
            progress.step(name)
    return seconds


def run(sentences: int, batch: int, repeats: int) -> None:
    import lightgen
    from lightgen.demo import EXAMPLES, generate_ids, held_out_pairs, load_demo_drafter, load_demo_model
    from lightgen.demo.noise import score
    from lightgen.env import format_report, report

    print(format_report(report()), "\n", flush=True)
    reference, tokenizer = load_demo_model()
    accelerated = lightgen.accelerate_model(copy.deepcopy(reference))
    drafter = load_demo_drafter()
    sources, references = held_out_pairs(sentences)
    config = reference.config
    print(f"model: lightgen's demo grammar corrector, {config.model_type} {config.encoder_layers}+"
          f"{config.decoder_layers} layers, "
          f"d_model {config.d_model}, vocab {config.vocab_size}, "
          f"{sum(p.numel() for p in reference.parameters()) / 1e6:.1f}M parameters (shipped in the package)\n")

    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True).strip()
    texts = EXAMPLES + sources
    runs = {  # name: (model, generate arguments)
        "HF greedy": (reference, {}),
        "lightgen greedy": (accelerated, {}),
        "lightgen IAD": (accelerated, dict(decoding="iad")),
        "lightgen GAD": (accelerated, dict(decoding="gad", drafter=drafter)),
        "HF beam 4": (reference, dict(num_beams=4)),
        "lightgen beam 4": (accelerated, dict(num_beams=4)),
    }
    print(f"{len(EXAMPLES)} example sentences, then {len(sources)} held-out ones with synthetic errors: each with "
          f"lightgen IAD's correction (the fastest), then whether lightgen's greedy, IAD, GAD and beam 4 returned "
          f"HF's tokens\n")
    outputs = {name: [] for name in runs}
    first = "lightgen IAD"  # its correction is shown at once; the slower decodings follow
    with torch.no_grad():
        for start in range(0, len(texts), batch):
            chunk, rows = texts[start:start + batch], range(start, start + min(batch, len(texts) - start))
            for name in (first, *(name for name in runs if name != first)):
                model, kw = runs[name]
                outputs[name] += generate_ids(model, tokenizer, chunk, batch, **kw)
                if name == first:
                    for i in rows:
                        print(f"  [{i + 1}/{len(texts)}] {texts[i]}\n   -> {decode(outputs[first][i])}", flush=True)
            for i in rows:
                verdicts = ", ".join(f"{name.removeprefix('lightgen ')} {'yes' if outputs[name][i] == outputs[hf][i] else 'NO'}"
                                     for name, hf in CHECKS.items())
                print(f"      [{i + 1}] same tokens as HF: {verdicts}", flush=True)
        checks = {f"{name} == {hf}": outputs[name] == outputs[hf] for name, hf in CHECKS.items()}
        print()
        for label, same in checks.items():
            print(f"{label}: {same}")
        if not all(checks.values()):
            raise SystemExit("lightgen produced different tokens from HF generate")
        for label, name in (("greedy", "HF greedy"), ("beam 4", "HF beam 4")):
            result = score(sources, [decode(ids) for ids in outputs[name][len(EXAMPLES):]], references)
            print(f"held-out corrections, {label}: exact match {result['exact_match']:.2f}, edit precision "
                  f"{result['precision']:.2f}, recall {result['recall']:.2f}, F0.5 {result['f0_5']:.2f}")

        enc = tokenizer(texts, return_tensors="pt", padding=True)
        for name in ("lightgen IAD", "lightgen GAD"):
            stats = accelerated.generate(**enc, do_sample=False, max_length=128, return_dict_in_generate=True,
                                         **runs[name][1])
            tokens = sum(int(row.sum()) for row in stats.tokens_per_iteration) / int(stats.iterations.sum())
            print(f"{name}: {tokens:.2f} tokens per pass (generated tokens per decoder pass; greedy: 1)")

        print(f"\ntiming {len(runs)} decodings x {repeats} round(s) over the {len(texts)} sentences, batch {batch} ...",
              flush=True)
        meter = ContentionMeter()
        seconds = interleaved_seconds(
            {name: lambda m=model, kw=kw: generate_ids(m, tokenizer, texts, batch, **kw)
             for name, (model, kw) in runs.items()}, repeats, Progress(len(runs) * repeats))
        share = meter.others_share()

    timings = {name: statistics.median(values) for name, values in seconds.items()}
    words = sum(len(text.split()) for text in texts)
    print(f"\n{len(texts)} sentences, batch {batch}, torch threads: {torch.get_num_threads()}, median of {repeats}")
    print(load_label(share))
    ratio_header = "vs HF greedy" + (" (noise?)" if busy(share) or share is None else "")
    print(f"\n{'':<18}{'ms':>10}{'words/s':>10}{ratio_header:>24}")
    for name, value in timings.items():
        print(f"{name:<18}{value * 1e3:>10.1f}{words / value:>10.0f}{timings['HF greedy'] / value:>23.2f}x")
