"""Benchmark model.generate() on a CUDA GPU: Hugging Face against lightgen, fp16, side by side in one run.

    python benchmarks/gpu_generate.py [--quick] [--profile] [--out benchmarks/results]

Two random-weight models: a Transformer-base-size translation model (Marian, 6 + 6 layers, d_model 512,
8 heads, FFN 2048: LightSeq's table) with beam 4 at batch 1 / 32 / 128, and a SmolLM2-135M-shaped Llama
(30 layers, d_model 576, grouped-query attention) greedy at batch 1 / 32. Every provider generates exactly
``NEW_TOKENS`` tokens (min_new_tokens = max_new_tokens). Each case first runs in float32, where lightgen
must return HF's tokens exactly (the script exits non-zero otherwise), then in float16, where the table
reports how many sequences and tokens agree with HF's float16 output, and the interleaved timing.
``hf`` is the unpatched model's generate; ``lightgen`` a deep copy after ``lightgen.accelerate_model``, whose
one-token steps replay a CUDA graph; ``lightgen-eager`` the same copy with ``LIGHTGEN_CUDA_GRAPHS=0``.
The GPU's utilisation before and after the run is recorded: a shared GPU makes the ratios unreliable.
Prints a markdown table and writes <out>/gpu_generate.json and (with matplotlib) <out>/gpu_generate.png;
``--profile`` also writes <out>/gpu_profile.txt, torch.profiler's tables of one float16 lightgen call per
case at batch 1 (where per-step launch and Python costs show).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import os
import subprocess
import sys
import time

import torch
import transformers

import lightgen

from _common import Sampling, format_speedup, git_commit, measure, parse_args, speedup_chart, write_results

STEM = "gpu_generate"
VOCAB = 32000
BOS, PAD, EOS = 0, 1, 2
PROMPT_TOKENS = 32
NEW_TOKENS = 64
HF, LIGHTGEN, LIGHTGEN_EAGER = "hf", "lightgen", "lightgen-eager"


@dataclasses.dataclass(frozen=True)
class Case:
    model: str
    num_beams: int
    batch: int


FULL_CASES = (Case("marian", 4, 1), Case("marian", 4, 32), Case("marian", 4, 128), Case("llama", 1, 1),
              Case("llama", 1, 32))
QUICK_CASES = (Case("marian", 4, 1), Case("llama", 1, 1))
SAMPLING = Sampling(samples=5, min_sample_s=0.0, max_measure_s=12.0, min_samples=3, warmup_calls=0)
QUICK_SAMPLING = Sampling(samples=3, min_sample_s=0.0, max_measure_s=5.0, min_samples=2, warmup_calls=0)


def build(name: str) -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    if name == "marian":
        config = transformers.MarianConfig(
            vocab_size=VOCAB, d_model=512, encoder_layers=6, decoder_layers=6, encoder_attention_heads=8,
            decoder_attention_heads=8, encoder_ffn_dim=2048, decoder_ffn_dim=2048, max_position_embeddings=512,
            pad_token_id=PAD, eos_token_id=EOS, decoder_start_token_id=PAD, forced_eos_token_id=None)
        model = transformers.MarianMTModel(config)
    else:
        config = transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
            num_key_value_heads=3, max_position_embeddings=2048, bos_token_id=BOS, eos_token_id=EOS,
            pad_token_id=PAD, tie_word_embeddings=True)
        model = transformers.LlamaForCausalLM(config)
    return model.eval()


def prompts(batch: int, device: str) -> dict:
    """Ragged prompts (a quarter of the rows shorter), left-padded: padding is part of what is timed."""
    gen = torch.Generator().manual_seed(batch)
    ids = torch.randint(EOS + 1, VOCAB, (batch, PROMPT_TOKENS), generator=gen)
    mask = torch.ones_like(ids)
    for row in range(0, batch, 4):
        mask[row, : PROMPT_TOKENS // 4] = 0
        ids[row, : PROMPT_TOKENS // 4] = PAD
    return {"input_ids": ids.to(device), "attention_mask": mask.to(device)}


@contextlib.contextmanager
def cuda_graphs(on: bool):
    previous = os.environ.get("LIGHTGEN_CUDA_GRAPHS")
    os.environ["LIGHTGEN_CUDA_GRAPHS"] = "1" if on else "0"
    try:
        yield
    finally:
        if previous is None:
            del os.environ["LIGHTGEN_CUDA_GRAPHS"]
        else:
            os.environ["LIGHTGEN_CUDA_GRAPHS"] = previous


def generate_fn(model, inputs: dict, num_beams: int, graphs: bool = True):
    kwargs = dict(**inputs, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, num_beams=num_beams,
                  do_sample=False, pad_token_id=PAD)

    def run():
        with torch.inference_mode(), cuda_graphs(graphs):
            out = model.generate(**kwargs)
        torch.cuda.synchronize()
        return out

    return run


def agreement(got: torch.Tensor, expected: torch.Tensor) -> tuple[float, float]:
    """(share of sequences equal, share of new-token positions equal)."""
    if got.shape != expected.shape:
        return 0.0, 0.0
    new_got, new_expected = got[:, -NEW_TOKENS:], expected[:, -NEW_TOKENS:]
    return ((new_got == new_expected).all(dim=1).float().mean().item(),
            (new_got == new_expected).float().mean().item())


def gpu_busy() -> str:
    """nvidia-smi's view of the GPU's utilisation and the processes on it, or why it could not be read."""
    try:
        result = subprocess.run(["nvidia-smi", "--query-gpu=utilization.gpu,memory.used", "--format=csv,noheader"],
                                capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError) as error:
        return f"nvidia-smi failed: {error}"
    return result.stdout.strip() or result.stderr.strip()


def run_case(case: Case, models: dict, sampling: Sampling) -> dict:
    fp32, fp16 = models[case.model]
    inputs = prompts(case.batch, "cuda")
    expected = generate_fn(fp32[HF], inputs, case.num_beams)()
    got = generate_fn(fp32[LIGHTGEN], inputs, case.num_beams)()
    fp32_equal = got.shape == expected.shape and torch.equal(got, expected)
    fp32_rows_differing = int((got != expected).any(dim=1).sum()) if got.shape == expected.shape else None
    eager_equal = torch.equal(generate_fn(fp32[LIGHTGEN], inputs, case.num_beams, graphs=False)(), got)
    fns = {HF: generate_fn(fp16[HF], inputs, case.num_beams),
           LIGHTGEN: generate_fn(fp16[LIGHTGEN], inputs, case.num_beams),
           LIGHTGEN_EAGER: generate_fn(fp16[LIGHTGEN], inputs, case.num_beams, graphs=False)}
    outputs = {provider: fn() for provider, fn in fns.items()}  # also the warm-up
    sequences_equal, tokens_equal = agreement(outputs[LIGHTGEN], outputs[HF])
    timings = measure(fns, sampling)
    return {
        "model": case.model, "num_beams": case.num_beams, "batch": case.batch,
        "fp32_tokens_equal_hf": fp32_equal, "fp32_rows_differing_hf": fp32_rows_differing,
        "fp32_graphs_equal_eager": eager_equal,
        "fp16_sequences_equal_hf": sequences_equal, "fp16_tokens_equal_hf": tokens_equal,
        "ms": {provider: timing.median_us / 1e3 for provider, timing in timings.items()},
        "iqr_ms": {provider: [timing.p25_us / 1e3, timing.p75_us / 1e3] for provider, timing in timings.items()},
        "noisy": any(timing.noisy for timing in timings.values()),
        "speedup": timings[HF].median_us / timings[LIGHTGEN].median_us,
        "speedup_eager": timings[HF].median_us / timings[LIGHTGEN_EAGER].median_us,
    }


def profile(cases: tuple[Case, ...], models: dict, path) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    tables = []
    for case in (case for case in cases if case.batch == 1):
        run = generate_fn(models[case.model][1][LIGHTGEN], prompts(case.batch, "cuda"), case.num_beams)
        run()
        with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            started = time.perf_counter()
            run()
            seconds = time.perf_counter() - started
        averages = prof.key_averages()
        tables.append(f"## {label(case)}, {LIGHTGEN}: {seconds * 1e3:.1f} ms under the profiler\n\n"
                      + averages.table(sort_by="self_cpu_time_total", row_limit=25) + "\n"
                      + averages.table(sort_by="self_device_time_total", row_limit=15) + "\n")
    path.write_text("\n".join(tables))
    print(f"wrote {path}")


def load_models(names: set[str]) -> dict:
    """Per model: (float32 providers, float16 providers), each {"hf": unpatched, "lightgen": accelerated copy}."""
    models = {}
    for name in sorted(names):
        base = build(name)
        pairs = []
        for dtype in (torch.float32, torch.float16):
            hf = copy.deepcopy(base).to("cuda", dtype)
            pairs.append({HF: hf, LIGHTGEN: lightgen.accelerate_model(copy.deepcopy(hf))})
        models[name] = tuple(pairs)
    return models


def label(case: Case) -> str:
    decoding = f"beam {case.num_beams}" if case.num_beams > 1 else "greedy"
    return f"{case.model} {decoding} batch {case.batch}"


def report(env: dict, results: list[dict]) -> None:
    print(f"\n### generate() on {env['gpu']}, float16, {NEW_TOKENS} new tokens, {PROMPT_TOKENS}-token prompts\n")
    print(f"- torch {env['torch']} (CUDA {env['cuda']}), transformers {env['transformers']}, "
          f"lightgen {env['lightgen']} (commit {env['git_commit'] or 'unknown'})")
    print(f"- GPU utilisation / memory before: {env['gpu_before']}; after: {env['gpu_after']}")
    print("\n| case | HF ms | lightgen ms | speedup | eager steps ms | speedup | fp32 tokens = HF | "
          "fp16 sequences = HF | fp16 tokens = HF |")
    print("|---|--:|--:|--:|--:|--:|:-:|--:|--:|")
    for row in results:
        noisy = " (noisy)" if row["noisy"] else ""
        print(f"| {row['label']} | {row['ms'][HF]:.1f} | {row['ms'][LIGHTGEN]:.1f} | "
              f"{format_speedup(row['speedup'])}{noisy} | {row['ms'][LIGHTGEN_EAGER]:.1f} | "
              f"{format_speedup(row['speedup_eager'])}{noisy} | "
              f"{'yes' if row['fp32_tokens_equal_hf'] else '**NO**'} | {row['fp16_sequences_equal_hf']:.0%} | "
              f"{row['fp16_tokens_equal_hf']:.1%} |")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(__doc__, STEM, "two cases, fewer samples (a smoke run)", argv,
                      lambda parser: parser.add_argument("--profile", action="store_true",
                                                         help="also write gpu_profile.txt (torch.profiler)"))
    if not torch.cuda.is_available():
        sys.exit("no CUDA GPU visible: this benchmark times generate() on a GPU")
    status = lightgen._build.load()
    if status.cuda is None or not status.cuda.compiled:
        sys.exit(f"lightgen's CUDA kernels are not compiled ({status.cuda and status.cuda.reason}); nothing to time")
    cases = QUICK_CASES if args.quick else FULL_CASES
    env = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda,
           "transformers": transformers.__version__, "lightgen": lightgen.__version__, "git_commit": git_commit(),
           "mode": "quick" if args.quick else "full", "gpu_before": gpu_busy()}
    started = time.perf_counter()
    models = load_models({case.model for case in cases})
    results = []
    for case in cases:
        row = run_case(case, models, QUICK_SAMPLING if args.quick else SAMPLING)
        row["label"] = label(case)
        results.append(row)
        print(f"{row['label']}: HF {row['ms'][HF]:.1f} ms, lightgen {row['ms'][LIGHTGEN]:.1f} ms "
              f"({row['speedup']:.2f}x), eager steps {row['ms'][LIGHTGEN_EAGER]:.1f} ms, fp32 equal "
              f"{row['fp32_tokens_equal_hf']}, graphs = eager {row['fp32_graphs_equal_eager']}", flush=True)
    env["gpu_after"] = gpu_busy()
    env["seconds"] = time.perf_counter() - started
    report(env, results)
    write_results(args.out, STEM, {"environment": env, "results": results},
                  lambda plt: speedup_chart(plt, [row["label"] for row in results], [row["speedup"] for row in results],
                                            "speedup over HF generate (fp16)", f"{env['gpu']}, torch {env['torch']}"))
    if args.profile:
        profile(cases, models, args.out / "gpu_profile.txt")
    return 0 if all(row["fp32_tokens_equal_hf"] and row["fp32_graphs_equal_eager"] for row in results) else 1


if __name__ == "__main__":
    sys.exit(main())
