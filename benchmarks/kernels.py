"""Benchmark lightgen's CPU kernels against the PyTorch code they replace, plus a BART forward.

    python benchmarks/kernels.py [--quick] [--out benchmarks/results]

Each op is timed three ways: the lightgen kernel; the eager composite a Hugging Face model runs
today; and the single native ATen op, where one exists that is not already the composite. Every
output is checked against the eager composite before it is timed, so a wrong kernel never gets a
number. Prints a markdown table and writes <out>/kernels.json and (with matplotlib) <out>/kernels.png.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
import transformers

import lightgen
from lightgen import _build, ops

REPO_ROOT = Path(__file__).resolve().parent.parent
TOLERANCE = dict(rtol=1e-4, atol=1e-4)  # fp32: kernels and composites differ only by rounding order
EPS = 1e-5
HIDDEN, FFN, VOCAB = 512, 2048, 32000
DECODE_ROWS = (1, 8, 32)  # batch sizes of a one-token decode step
PREFILL_ROWS = 8 * 64  # batch 8 x 64 tokens
ROWS = (*DECODE_ROWS, PREFILL_ROWS)
HEADS, HEAD_DIM = 8, HIDDEN // 8
NATIVE_RMS_NORM = getattr(F, "rms_norm", None)  # added in torch 2.4


@dataclasses.dataclass(frozen=True)
class Settings:
    samples: int  # timed samples per function; the median is reported
    min_sample_s: float  # calls are batched so one sample lasts at least this long
    max_measure_s: float  # sampling stops early past this, so a busy machine cannot stretch the run
    model_layers: int  # encoder and decoder layers of the BART model


FULL = Settings(samples=61, min_sample_s=10e-3, max_measure_s=3.0, model_layers=6)
QUICK = Settings(samples=9, min_sample_s=1e-3, max_measure_s=0.5, model_layers=2)
MIN_SAMPLES = 5  # a median needs a few samples even when the time cap is hit
NOISY_SPREAD = 0.2  # interquartile range above this fraction of the median marks a timing as noisy
CONTENTION_WARNING = 0.1  # above this share of the CPUs used by other processes, timings are suspect


@dataclasses.dataclass
class Timing:
    median_us: float
    p25_us: float
    p75_us: float
    calls_per_sample: int
    samples: int

    @property
    def noisy(self) -> bool:
        return self.p75_us - self.p25_us > NOISY_SPREAD * self.median_us


@dataclasses.dataclass
class Case:
    op: str
    shape: str
    lightgen: Callable[[], object]
    composite: Callable[[], object]
    native: Callable[[], object] | None = None


@dataclasses.dataclass
class Row:
    op: str
    shape: str
    lightgen: Timing
    composite: Timing
    native: Timing | None

    @property
    def speedup_vs_composite(self) -> float:
        return self.composite.median_us / self.lightgen.median_us

    @property
    def speedup_vs_native(self) -> float | None:
        return self.native.median_us / self.lightgen.median_us if self.native else None


# ---------------------------------------------------------------------------------------------
# Timing


def calls_per_sample(fn: Callable[[], object], min_sample_s: float) -> int:
    """Warm ``fn`` up, then return how many calls make one sample last ``min_sample_s``."""
    calls, start = 0, time.perf_counter()
    while calls < 3 or time.perf_counter() - start < min_sample_s:
        fn()
        calls += 1
    per_call = (time.perf_counter() - start) / calls
    return max(1, math.ceil(min_sample_s / per_call))


def measure(fns: dict[str, Callable[[], object]], settings: Settings) -> dict[str, Timing]:
    """Median microseconds per call of each function.

    The functions are sampled in turn, so frequency changes or a noisy neighbour hit all of them
    alike instead of skewing whichever ran during the disturbance.
    """
    calls = {name: calls_per_sample(fn, settings.min_sample_s) for name, fn in fns.items()}
    per_call_us: dict[str, list[float]] = {name: [] for name in fns}
    deadline = time.perf_counter() + settings.max_measure_s
    for sample in range(settings.samples):
        if sample >= MIN_SAMPLES and time.perf_counter() > deadline:
            break
        for name, fn in fns.items():
            start = time.perf_counter()
            for _ in range(calls[name]):
                fn()
            per_call_us[name].append((time.perf_counter() - start) / calls[name] * 1e6)
    timings = {}
    for name, values in per_call_us.items():
        quartiles = statistics.quantiles(values, n=4)
        timings[name] = Timing(statistics.median(values), quartiles[0], quartiles[2], calls[name], len(values))
    return timings


def keep_freed_memory() -> bool:
    """Make glibc keep freed tensors' memory instead of handing it back to the kernel.

    By default a freed multi-MB tensor is unmapped or trimmed off the heap, so the next call
    page-faults its output in again; on a VM those faults can cost as much as the op, and whether
    they happen depends on the heap's history, which made large-shape timings jump between runs.
    A long-running model reaches the same fault-free steady state through glibc's adaptive
    thresholds; this reaches it at once. Returns False where the C library has no ``mallopt``.
    """
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3  # from glibc's malloc.h
    return bool(mallopt(m_mmap_threshold, 32 << 20) and mallopt(m_trim_threshold, 1 << 30))


def check_and_time(case: Case, settings: Settings) -> Row:
    expected = case.composite()
    candidates = {name: fn for name, fn in (("lightgen", case.lightgen), ("native", case.native)) if fn is not None}
    for name, fn in candidates.items():
        torch.testing.assert_close(fn(), expected, **TOLERANCE, msg=lambda detail, name=name: (
            f"{case.op} [{case.shape}]: {name} differs from the eager composite\n{detail}"))
    fns = {"composite": case.composite, **candidates}
    timings = measure(fns, settings)
    return Row(case.op, case.shape, timings["lightgen"], timings["composite"], timings.get("native"))


# ---------------------------------------------------------------------------------------------
# Cases


def rms_norm_composite(x, weight, eps):
    """Llama/T5 RMSNorm as Hugging Face writes it."""
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def eager_attention(q, k, v, scale, additive_mask=None):
    """transformers' eager_attention_forward (eval, so no dropout), returning [B, T, H, D]."""
    scores = torch.matmul(q, k.transpose(2, 3)) * scale
    if additive_mask is not None:
        scores = scores + additive_mask
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v).transpose(1, 2).contiguous()


def sdpa_attention(q, k, v, scale, causal=False):
    # The transpose is part of what HF's sdpa path runs, and gives lightgen's output layout.
    return F.scaled_dot_product_attention(q, k, v, scale=scale, is_causal=causal).transpose(1, 2).contiguous()


def norm_cases_for(rows: int, weight: torch.Tensor, bias: torch.Tensor) -> list[Case]:
    x, residual = torch.randn(rows, HIDDEN), torch.randn(rows, HIDDEN)
    norm_shape = (HIDDEN,)
    shape = f"{rows}×{HIDDEN}"

    def add_then(norm):
        total = x + residual
        return total, norm(total)

    def native_rms(t):
        return NATIVE_RMS_NORM(t, norm_shape, weight, EPS)

    has_native_rms = NATIVE_RMS_NORM is not None
    return [
        Case("layer_norm", shape,
             lambda: ops.layer_norm(x, weight, bias, EPS),
             lambda: F.layer_norm(x, norm_shape, weight, bias, EPS)),
        Case("add_layer_norm", shape,
             lambda: ops.add_layer_norm(x, residual, weight, bias, EPS),
             lambda: add_then(lambda total: F.layer_norm(total, norm_shape, weight, bias, EPS))),
        Case("rms_norm", shape,
             lambda: ops.rms_norm(x, weight, EPS),
             lambda: rms_norm_composite(x, weight, EPS),
             (lambda: native_rms(x)) if has_native_rms else None),
        Case("add_rms_norm", shape,
             lambda: ops.add_rms_norm(x, residual, weight, EPS),
             lambda: add_then(lambda total: rms_norm_composite(total, weight, EPS)),
             (lambda: add_then(native_rms)) if has_native_rms else None),
    ]


def activation_cases_for(rows: int, bias: torch.Tensor) -> list[Case]:
    x, up = torch.randn(rows, FFN), torch.randn(rows, FFN)
    shape = f"{rows}×{FFN}"

    def bias_act_case(act: str) -> Case:
        eager_act = ops.ACTIVATIONS[act]
        return Case(f"bias_act {act}", shape, lambda: ops.bias_act(x, bias, act), lambda: eager_act(x + bias))

    return [bias_act_case(act) for act in ("gelu", "gelu_tanh", "relu", "silu")] + [
        Case("gated_act silu", shape, lambda: ops.gated_act(x, up, "silu"), lambda: F.silu(x) * up),
    ]


def decode_attention_case(batch: int, past: int) -> Case:
    """One decode step: a new token's K/V joins ``past`` cached tokens and its query attends to all."""
    scale = HEAD_DIM ** -0.5
    q = torch.randn(batch, HEADS, 1, HEAD_DIM)
    k_new, v_new = torch.randn(batch, HEADS, 1, HEAD_DIM), torch.randn(batch, HEADS, 1, HEAD_DIM)
    k_past, v_past = torch.randn(batch, HEADS, past, HEAD_DIM), torch.randn(batch, HEADS, past, HEAD_DIM)
    # A preallocated (static) cache with room for further steps; lightgen and sdpa write the same
    # token into the same slot on every call, so they can share it.
    max_len = past + 64
    k_cache, v_cache = torch.zeros(batch, HEADS, max_len, HEAD_DIM), torch.zeros(batch, HEADS, max_len, HEAD_DIM)
    k_cache[:, :, :past], v_cache[:, :, :past] = k_past, v_past
    cache_pos = torch.full((batch,), past, dtype=torch.int64)

    def composite():  # HF's DynamicCache grows by torch.cat on every step
        keys, values = torch.cat([k_past, k_new], dim=2), torch.cat([v_past, v_new], dim=2)
        return eager_attention(q, keys, values, scale)

    def native():  # a static cache + sdpa: write the new slot, attend over the filled prefix
        k_cache[:, :, past], v_cache[:, :, past] = k_new[:, :, 0], v_new[:, :, 0]
        filled = past + 1
        return sdpa_attention(q, k_cache[:, :, :filled], v_cache[:, :, :filled], scale)

    return Case("attention decode", f"B={batch} H={HEADS} D={HEAD_DIM} past={past}",
                lambda: ops.attention(q, k_cache, v_cache, k_new, v_new, cache_pos, None, scale, False),
                composite, native)


def prefill_attention_case(batch: int, length: int) -> Case:
    scale = HEAD_DIM ** -0.5
    q, k, v = (torch.randn(batch, HEADS, length, HEAD_DIM) for _ in range(3))
    # HF builds the additive causal mask once per forward, outside the attention call.
    causal_mask = torch.full((length, length), float("-inf")).triu(1)[None, None]
    return Case("attention prefill causal", f"B={batch} H={HEADS} D={HEAD_DIM} T={length}",
                lambda: ops.attention(q, k, v, None, None, None, None, scale, True),
                lambda: eager_attention(q, k, v, scale, causal_mask),
                lambda: sdpa_attention(q, k, v, scale, causal=True))


def attention_cases() -> list[Case]:
    decode = [decode_attention_case(batch, past) for batch in (1, 8) for past in (64, 256)]
    return decode + [prefill_attention_case(8, length) for length in (64, 128)]


def embedding_case(rows: int, weight: torch.Tensor) -> Case:
    ids = torch.randint(0, VOCAB, (rows,))
    scale = HIDDEN ** 0.5  # BART/T5-style scaled embeddings
    return Case("embedding ×scale", f"{rows} ids, {VOCAB}×{HIDDEN}",
                lambda: ops.embedding(ids, weight, scale),
                lambda: F.embedding(ids, weight) * scale)


def all_cases() -> list[Case]:
    norm_weight, norm_bias, ffn_bias = torch.randn(HIDDEN), torch.randn(HIDDEN), torch.randn(FFN)
    embedding_weight = torch.randn(VOCAB, HIDDEN)
    cases = []
    for rows in ROWS:
        cases += norm_cases_for(rows, norm_weight, norm_bias) + activation_cases_for(rows, ffn_bias)
        cases.append(embedding_case(rows, embedding_weight))
    cases += attention_cases()
    # Group the table by op, keeping the order each op first appears in.
    op_order = list(dict.fromkeys(case.op for case in cases))
    return sorted(cases, key=lambda case: op_order.index(case.op))


# ---------------------------------------------------------------------------------------------
# Full model


def model_row(settings: Settings) -> Row:
    """Prefill forward of a random-weight BART before and after ``accelerate_model``.

    BartModel has no LM head: the 32000-way output projection is the same matmul either way and
    would only dilute the difference lightgen makes.
    """
    layers = settings.model_layers
    config = transformers.BartConfig(
        vocab_size=VOCAB, d_model=HIDDEN, encoder_layers=layers, decoder_layers=layers,
        encoder_attention_heads=HEADS, decoder_attention_heads=HEADS, encoder_ffn_dim=FFN, decoder_ffn_dim=FFN,
    )
    model = transformers.BartModel(config).eval()
    input_ids = torch.randint(0, VOCAB, (8, 64))

    def forward():
        return model(input_ids=input_ids).last_hidden_state

    baseline_impl = model.config._attn_implementation
    expected = forward()
    unpatched = measure({"unpatched": forward}, settings)["unpatched"]
    lightgen.accelerate_model(model)
    try:
        torch.testing.assert_close(forward(), expected, **TOLERANCE,
                                   msg=lambda detail: f"BART forward differs after accelerate_model\n{detail}")
        accelerated = measure({"lightgen": forward}, settings)["lightgen"]
    finally:
        lightgen.restore_model(model)
    shape = f"{layers}+{layers} layers, 8×64 tokens (baseline attn: {baseline_impl})"
    return Row("BartModel forward", shape, accelerated, unpatched, None)


# ---------------------------------------------------------------------------------------------
# Reporting


def machine_busy_seconds() -> float | None:
    """CPU seconds the whole machine has spent busy (or stolen by the hypervisor) since boot."""
    try:
        fields = [int(value) for value in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    except (OSError, ValueError):
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


class ContentionMeter:
    """Share of the machine's CPU capacity that other processes used while we were timing.

    On a shared machine a busy neighbour delays every multi-threaded op by whole scheduler ticks,
    so the report says how quiet the machine was instead of leaving the reader to guess.
    """

    def __init__(self):
        self.machine_start = machine_busy_seconds()
        self.own_start = time.process_time()
        self.wall_start = time.perf_counter()

    def others_share(self) -> float | None:
        machine_end = machine_busy_seconds()
        if self.machine_start is None or machine_end is None:
            return None
        others = (machine_end - self.machine_start) - (time.process_time() - self.own_start)
        capacity = (time.perf_counter() - self.wall_start) * (os.cpu_count() or 1)
        return max(0.0, others / capacity)


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def git_commit() -> str | None:
    try:
        result = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                                text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return result.stdout.strip() if result.returncode == 0 else None


def environment(status: _build.BuildStatus, quick: bool, malloc_tuned: bool) -> dict:
    return {
        "cpu": cpu_model(),
        "logical_cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "lightgen_isa": status.isa,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "lightgen": lightgen.__version__,
        "python": platform.python_version(),
        "git_commit": git_commit(),
        "mode": "quick" if quick else "full",
        "dtype": "float32",
        "malloc_keeps_freed_memory": malloc_tuned,
    }


def format_us(timing: Timing | None) -> str:
    if timing is None:
        return "–"
    return f"{timing.median_us:,.1f}{' †' if timing.noisy else ''}"


def format_share(share: float | None) -> str:
    return f"{share:.0%}" if share is not None else "an unknown share"


def format_speedup(speedup: float | None) -> str:
    return f"{speedup:.2f}×" if speedup is not None else "–"


def markdown(env: dict, settings: Settings, rows: list[Row]) -> str:
    lines = [
        "## lightgen kernel benchmarks",
        "",
        f"- CPU: {env['cpu']} ({env['logical_cpus']} logical CPUs), torch threads: {env['torch_threads']}, "
        f"ATen CPU capability: {env['cpu_capability']}",
        f"- torch {env['torch']}, transformers {env['transformers']}, lightgen {env['lightgen']} "
        f"(commit {env['git_commit'] or 'unknown'}), python {env['python']}",
        f"- {env['mode']} mode, fp32, no_grad; median of up to {settings.samples} interleaved samples "
        f"({settings.max_measure_s:g} s cap per case), each ≥ {settings.min_sample_s * 1e3:g} ms of back-to-back "
        f"calls; {env['timing_seconds']:.0f} s of timing",
        "- allocator: " + ("glibc keeps freed memory, so large outputs do not page-fault on every call"
                           if env["malloc_keeps_freed_memory"] else "default settings (no mallopt)"),
        f"- other processes used {format_share(env['others_cpu_share'])} of the CPUs while timing"
        + (" — **busy machine: multi-threaded timings are unreliable, rerun when it is quiet**"
           if (env["others_cpu_share"] or 0) > CONTENTION_WARNING else ""),
        "- native: the single ATen op, where one exists that is not already the composite "
        "(layer_norm's eager composite is the native F.layer_norm itself)",
        f"- † noisy: the interquartile range exceeds {NOISY_SPREAD:.0%} of the median (samples and quartiles are "
        "in kernels.json)",
        "",
        "| op | shape | lightgen µs | eager composite µs | native µs | speedup vs composite | speedup vs native |",
        "|---|---|--:|--:|--:|--:|--:|",
    ]
    for row in rows:
        lines.append(f"| {row.op} | {row.shape} | {format_us(row.lightgen)} | {format_us(row.composite)} | "
                     f"{format_us(row.native)} | {format_speedup(row.speedup_vs_composite)} | "
                     f"{format_speedup(row.speedup_vs_native)} |")
    return "\n".join(lines)


def write_json(path: Path, env: dict, settings: Settings, rows: list[Row]) -> None:
    results = [{**dataclasses.asdict(row), "speedup_vs_composite": row.speedup_vs_composite,
                "speedup_vs_native": row.speedup_vs_native} for row in rows]
    payload = {"environment": env, "settings": dataclasses.asdict(settings), "results": results}
    path.write_text(json.dumps(payload, indent=2, ensure_ascii=False) + "\n")


def write_chart(path: Path, env: dict, rows: list[Row]) -> bool:
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    labels = [f"{row.op} [{row.shape}]" for row in rows]
    speedups = [row.speedup_vs_composite for row in rows]
    fig, ax = plt.subplots(figsize=(10, 0.28 * len(rows) + 1.5))
    ax.barh(labels, speedups, color=["tab:green" if s >= 1 else "tab:red" for s in speedups])
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.margins(y=0.01)
    ax.invert_yaxis()  # same order as the table
    ax.set_xlabel("speedup vs eager composite (×)")
    ax.set_title(f"lightgen fp32 kernels vs eager PyTorch\n{env['cpu']}, {env['torch_threads']} threads, "
                 f"{env['cpu_capability']}, torch {env['torch']}", fontsize=10)
    ax.tick_params(axis="y", labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer samples and a 2+2-layer model (< 40 s)")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "benchmarks" / "results",
                        help="folder for kernels.json and kernels.png")
    args = parser.parse_args(argv)
    settings = QUICK if args.quick else FULL

    status = _build.load()
    if not status.compiled:  # timing the pure-PyTorch fallbacks would say nothing about the kernels
        sys.exit(f"lightgen kernels are not compiled ({status.reason}); nothing to benchmark")
    torch.manual_seed(0)
    env = environment(status, args.quick, keep_freed_memory())

    with torch.no_grad():
        cases = all_cases()
        print(f"checking and timing {len(cases)} op cases and a BART forward...", file=sys.stderr)
        contention = ContentionMeter()
        rows = [check_and_time(case, settings) for case in cases]
        rows.append(model_row(settings))
        env["others_cpu_share"] = contention.others_share()
        env["timing_seconds"] = time.perf_counter() - contention.wall_start

    print(markdown(env, settings, rows))
    args.out.mkdir(parents=True, exist_ok=True)
    write_json(args.out / "kernels.json", env, settings, rows)
    print(f"\nwrote {args.out / 'kernels.json'}")
    if write_chart(args.out / "kernels.png", env, rows):
        print(f"wrote {args.out / 'kernels.png'}")
    else:
        print("matplotlib is not installed; skipped kernels.png (pip install 'lightgen[bench]')")


if __name__ == "__main__":
    main()
