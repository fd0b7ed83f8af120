"""``lightgen demo``: the shipped grammar-correction model, HF vs lightgen greedy, IAD, GAD and beam search."""

from __future__ import annotations

import copy
import statistics
import time

import torch


def median_seconds(fn, repeats: int) -> float:
    fn()  # warm-up: first calls allocate and fill caches
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def run(sentences: int, batch: int, repeats: int) -> None:
    import lightgen
    from lightgen.demo import EXAMPLES, generate_ids, held_out_pairs, load_demo_drafter, load_demo_model
    from lightgen.demo.noise import score
    from lightgen.env import format_report, report

    print(format_report(report()), "\n")
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
    with torch.no_grad():
        shown = generate_ids(accelerated, tokenizer, EXAMPLES, len(EXAMPLES), decoding="iad")
        for text, ids in zip(EXAMPLES, shown, strict=True):
            print(f"  {text}\n  -> {decode(ids)}\n")

        texts = EXAMPLES + sources
        runs = {  # name: (model, generate arguments)
            "HF greedy": (reference, {}),
            "lightgen greedy": (accelerated, {}),
            "lightgen IAD": (accelerated, dict(decoding="iad")),
            "lightgen GAD": (accelerated, dict(decoding="gad", drafter=drafter)),
            "HF beam 4": (reference, dict(num_beams=4)),
            "lightgen beam 4": (accelerated, dict(num_beams=4)),
        }
        outputs = {name: generate_ids(model, tokenizer, texts, batch, **kw) for name, (model, kw) in runs.items()}
        checks = {"lightgen greedy == HF greedy": outputs["lightgen greedy"] == outputs["HF greedy"],
                  "lightgen IAD == HF greedy": outputs["lightgen IAD"] == outputs["HF greedy"],
                  "lightgen GAD == HF greedy": outputs["lightgen GAD"] == outputs["HF greedy"],
                  "lightgen beam 4 == HF beam 4": outputs["lightgen beam 4"] == outputs["HF beam 4"]}
        greedy_text = [decode(ids) for ids in outputs["HF greedy"][len(EXAMPLES):]]
        beam_text = [decode(ids) for ids in outputs["HF beam 4"][len(EXAMPLES):]]

        enc = tokenizer(texts, return_tensors="pt", padding=True)
        per_pass = {}
        for name in ("lightgen IAD", "lightgen GAD"):
            stats = accelerated.generate(**enc, do_sample=False, max_length=128, return_dict_in_generate=True,
                                         **runs[name][1])
            per_pass[name] = sum(int(row.sum()) for row in stats.tokens_per_iteration) / int(stats.iterations.sum())

        timings = {name: median_seconds(lambda m=model, kw=kw: generate_ids(m, tokenizer, texts, batch, **kw),
                                        repeats) for name, (model, kw) in runs.items()}

    words = sum(len(text.split()) for text in texts)
    print(f"{len(texts)} sentences ({len(EXAMPLES)} above + {len(sources)} held-out with synthetic errors), "
          f"batch {batch}, torch threads: {torch.get_num_threads()}, median of {repeats}")
    print(f"\n{'':<18}{'ms':>10}{'words/s':>10}{'vs HF greedy':>14}")
    for name, seconds in timings.items():
        print(f"{name:<18}{seconds * 1e3:>10.1f}{words / seconds:>10.0f}{timings['HF greedy'] / seconds:>13.2f}x")
    print()
    for name, tokens in per_pass.items():
        print(f"{name}: {tokens:.2f} tokens per pass (generated tokens per decoder pass; greedy: 1)")
    for label, hypotheses in (("greedy", greedy_text), ("beam 4", beam_text)):
        result = score(sources, hypotheses, references)
        print(f"held-out corrections, {label}: exact match {result['exact_match']:.2f}, edit precision "
              f"{result['precision']:.2f}, recall {result['recall']:.2f}, F0.5 {result['f0_5']:.2f}")
    for label, same in checks.items():
        print(f"{label}: {same}")
    if not all(checks.values()):
        raise SystemExit("lightgen produced different tokens from HF generate")
