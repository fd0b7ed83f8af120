"""How often fp16 / bf16 models generate HF's tokens exactly, family by family.

    python benchmarks/half_precision.py [--quick] [--attention eager] [--out benchmarks/results]

The test suite's tiny models of each family (tests/models.py: random weights, two layers), cast to bf16 and
fp16, generate 16 forced new tokens for 4 padded rows per seed, greedy, with 3 beams and (accelerated) with
IAD, unpatched (HF's own generate in that dtype; greedy for IAD) and accelerated. Reports the rows whose tokens
are identical. fp32 must be identical
everywhere (the test suite holds it); in fp16 / bf16 lightgen follows HF's rounding points where its kernels
can (README, "fp16 / bf16 models"). ``--attention eager`` loads the models on HF's eager attention instead of
sdpa (their rounding points differ). Prints a markdown table and writes <out>/half_precision.json and .png
(half_precision_eager.* with eager attention).
"""

from __future__ import annotations

import copy
import sys
import warnings

import torch

import lightgen

from _common import REPO_ROOT, hardware_title, start_run, write_results

sys.path.insert(0, str(REPO_ROOT / "tests"))
from models import build, padded_batch  # noqa: E402  (the test suite's models of every family)

FAMILIES = ("llama", "mistral", "qwen2", "gpt2", "gemma", "phi3", "qwen3", "opt", "gpt_neox", "bart", "marian")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
DECODINGS = {"greedy": {}, "beam 3": dict(num_beams=3), "iad": dict(decoding="iad", max_draft=5)}
SEEDS = {"full": 6, "quick": 2}


def identical_rows(family: str, dtype: torch.dtype, settings: dict, seeds: int, attention: str) -> tuple[int, int]:
    same = total = 0
    for seed in range(seeds):
        reference = build(family, seed=seed, dtype=dtype)
        reference.set_attn_implementation(attention)
        accelerated = lightgen.accelerate_model(copy.deepcopy(reference))
        ids, mask = padded_batch(family, 4, 9, seed=seed)
        kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=16, min_new_tokens=16)
        expected = reference.generate(**kwargs, num_beams=settings.get("num_beams", 1))
        got = accelerated.generate(**kwargs, **settings)
        total += expected.shape[0]
        if got.shape == expected.shape:
            same += int((got == expected).all(-1).sum())
    return same, total


def main(argv=None) -> None:
    args, env = start_run(__doc__, "half_precision", f"{SEEDS['quick']} seeds instead of {SEEDS['full']}", argv,
                          lambda parser: parser.add_argument("--attention", choices=("sdpa", "eager"), default="sdpa",
                                                             help="HF's attention implementation of the models"))
    seeds = SEEDS["quick" if args.quick else "full"]
    warnings.simplefilter("ignore")  # HF's deprecation notices, once per model
    rows = []
    for family in FAMILIES:
        for dtype_name, dtype in DTYPES.items():
            for decoding, settings in DECODINGS.items():
                same, total = identical_rows(family, dtype, settings, seeds, args.attention)
                rows.append({"family": family, "dtype": dtype_name, "decoding": decoding, "identical": same,
                             "rows": total})
    env["seeds"], env["attention"] = seeds, args.attention
    print(f"# fp16 / bf16 rows identical to HF's ({args.attention} attention), {seeds} seeds x 4 padded rows, "
          f"16 new tokens\n")
    print("| family | " + " | ".join(f"{d} {dec}" for d in DTYPES for dec in DECODINGS) + " |")
    print("|---|" + "--:|" * (len(DTYPES) * len(DECODINGS)))
    for family in FAMILIES:
        cells = [f"{row['identical']}/{row['rows']}" for row in rows if row["family"] == family]
        print(f"| {family} | " + " | ".join(cells) + " |")
    for dtype_name in DTYPES:
        for decoding in DECODINGS:
            kept = [row for row in rows if row["dtype"] == dtype_name and row["decoding"] == decoding]
            print(f"- {dtype_name} {decoding}: {sum(r['identical'] for r in kept)}/{sum(r['rows'] for r in kept)}")
    stem = "half_precision" if args.attention == "sdpa" else f"half_precision_{args.attention}"
    write_results(args.out, stem, {"environment": env, "results": rows},
                  lambda plt: chart(plt, env, rows))


def chart(plt, env: dict, rows: list[dict]):
    fig, ax = plt.subplots(figsize=(10, 3.5))
    series = [(d, dec) for d in DTYPES for dec in DECODINGS]
    width = 0.8 / len(series)
    for index, (dtype_name, decoding) in enumerate(series):
        shares = [row["identical"] / row["rows"] for family in FAMILIES for row in rows
                  if row["family"] == family and row["dtype"] == dtype_name and row["decoding"] == decoding]
        ax.bar([f + (index - len(series) / 2 + 0.5) * width for f in range(len(FAMILIES))], shares, width=width,
               label=f"{dtype_name} {decoding}")
    ax.set_xticks(list(range(len(FAMILIES))), FAMILIES, fontsize=8)
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("rows identical to HF")
    ax.set_title(f"fp16 / bf16 generate vs HF in the same dtype ({env['attention']} attention), "
                 f"{env['seeds']} seeds x 4 rows\n"
                 f"{hardware_title(env)}", fontsize=9)
    ax.legend(fontsize=7, ncols=6)
    return fig


if __name__ == "__main__":
    main()
