"""What int8 and bf16 weights cost in quality, on the shipped grammar-correction demo model.

    python benchmarks/quality.py [--quick] [--out benchmarks/results]

Held-out demo sentences with synthetic errors are corrected with greedy search and beam search
(4 beams) by the unpatched model (HF, fp32) and by lightgen with fp32, bf16 and int8 weights.
Reports, per precision and decoding: the share of sentences whose tokens equal HF fp32's, the share
of tokens equal position by position, and the task scores (exact match, edit-level precision,
recall and F0.5 against the clean references). lightgen fp32 must equal HF exactly.
Prints a markdown table and writes <out>/quality.json (and quality.png with matplotlib).
"""

from __future__ import annotations

import copy
import sys

import lightgen
from lightgen.demo import generate_ids, held_out_pairs, load_demo_model
from lightgen.demo.noise import score

from _common import hardware_title, start_run, write_results

SENTENCES = {"full": 400, "quick": 40}
DECODINGS = {"greedy": {}, "beam 4": {"num_beams": 4}}
PRECISIONS = ("fp32", "bf16", "int8")


def token_agreement(got: list[list[int]], expected: list[list[int]]) -> tuple[float, float]:
    """(share of sentences identical, share of reference positions holding the same token)."""
    same_sentences = sum(a == b for a, b in zip(got, expected, strict=True)) / len(expected)
    matched = sum(sum(x == y for x, y in zip(a, b, strict=False)) for a, b in zip(got, expected, strict=True))
    return same_sentences, matched / max(1, sum(len(b) for b in expected))


def main(argv=None) -> None:
    args, env = start_run(__doc__, "quality", "40 sentences instead of 400", argv)
    count = SENTENCES["quick" if args.quick else "full"]
    sources, references = held_out_pairs(count)
    hf_model, tokenizer = load_demo_model()
    models = {"hf fp32": hf_model}
    for precision in PRECISIONS:
        quantize = None if precision == "fp32" else precision
        models[f"lightgen {precision}"] = lightgen.accelerate_model(copy.deepcopy(hf_model), quantize=quantize)
    rows = []
    for decoding, kwargs in DECODINGS.items():
        outputs = {name: generate_ids(model, tokenizer, sources, **kwargs) for name, model in models.items()}
        expected = outputs["hf fp32"]
        if outputs["lightgen fp32"] != expected:
            sys.exit(f"lightgen fp32 {decoding} differs from HF fp32 on the demo model")
        for name, ids in outputs.items():
            sentences_same, tokens_same = token_agreement(ids, expected)
            hypotheses = [tokenizer.decode(row).strip() for row in ids]
            rows.append({"provider": name, "decoding": decoding, "sentences_equal_hf_fp32": sentences_same,
                         "tokens_equal_hf_fp32": tokens_same, **score(sources, hypotheses, references)})
    env["sentences"] = count
    print(f"# int8 / bf16 quality on the demo model: {count} held-out sentences\n")
    print("| provider | decoding | sentences = HF fp32 | tokens = HF fp32 | exact match | precision | recall | F0.5 |")
    print("|---|---|--:|--:|--:|--:|--:|--:|")
    for row in rows:
        print(f"| {row['provider']} | {row['decoding']} | {row['sentences_equal_hf_fp32']:.1%} | "
              f"{row['tokens_equal_hf_fp32']:.1%} | {row['exact_match']:.1%} | {row['precision']:.3f} | "
              f"{row['recall']:.3f} | {row['f0_5']:.3f} |")
    write_results(args.out, "quality", {"environment": env, "results": rows}, lambda plt: chart(plt, env, rows))


def chart(plt, env: dict, rows: list[dict]):
    fig, ax = plt.subplots(figsize=(8, 4))
    labels = [f"{row['provider']}\n{row['decoding']}" for row in rows]
    positions = range(len(rows))
    ax.bar([p - 0.2 for p in positions], [row["f0_5"] for row in rows], width=0.4, label="F0.5 (edits)")
    ax.bar([p + 0.2 for p in positions], [row["tokens_equal_hf_fp32"] for row in rows], width=0.4,
           label="tokens equal to HF fp32")
    ax.set_xticks(list(positions), labels, fontsize=7)
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("score / share (0-1)")
    ax.set_title(f"Demo grammar corrector, {env['sentences']} held-out sentences: fp32 vs bf16 vs int8 weights\n"
                 f"{hardware_title(env)}", fontsize=9)
    ax.legend(fontsize=8)
    return fig


if __name__ == "__main__":
    main()
