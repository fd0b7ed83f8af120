"""What the benchmark scripts share: interleaved timing, machine conditions, report header, outputs."""

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
import transformers

import lightgen
from lightgen import _build
from lightgen.machine import CONTENTION_WARNING, ContentionMeter, format_share  # noqa: F401  (re-exported)

REPO_ROOT = Path(__file__).resolve().parent.parent
NOISY_SPREAD = 0.2  # interquartile range above this fraction of the median marks a timing as noisy


@dataclasses.dataclass(frozen=True)
class Sampling:
    samples: int  # timed samples per function; the median is reported
    min_sample_s: float  # calls are batched so one sample lasts at least this long
    max_measure_s: float  # sampling stops early past this, so a busy machine cannot stretch the run
    # A median needs a few samples even when the time cap is hit.
    min_samples: int = dataclasses.field(default=5, kw_only=True)
    # Untimed calls before sampling; 0 where the caller has already run each function.
    warmup_calls: int = dataclasses.field(default=3, kw_only=True)


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


# ---------------------------------------------------------------------------------------------
# Timing


def calls_per_sample(fn: Callable[[], object], sampling: Sampling) -> int:
    """Warm ``fn`` up, then return how many calls make one sample last ``sampling.min_sample_s``."""
    calls, start = 0, time.perf_counter()
    while calls < sampling.warmup_calls or time.perf_counter() - start < sampling.min_sample_s:
        fn()
        calls += 1
    if calls == 0:  # already warm and one call per sample is enough: nothing to calibrate
        return 1
    per_call = (time.perf_counter() - start) / calls
    return max(1, math.ceil(sampling.min_sample_s / per_call))


def measure(fns: dict[str, Callable[[], object]], sampling: Sampling) -> dict[str, Timing]:
    """Median microseconds per call of each function.

    The functions are sampled in turn, so frequency changes or a noisy neighbour hit all of them
    alike instead of skewing whichever ran during the disturbance.
    """
    calls = {name: calls_per_sample(fn, sampling) for name, fn in fns.items()}
    per_call_us: dict[str, list[float]] = {name: [] for name in fns}
    deadline = time.perf_counter() + sampling.max_measure_s
    for sample in range(sampling.samples):
        if sample >= sampling.min_samples and time.perf_counter() > deadline:
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


# ---------------------------------------------------------------------------------------------
# Machine conditions


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


def compiled_kernels() -> _build.BuildStatus:
    """lightgen's build status; exits when the kernels did not compile."""
    status = _build.load()
    if not status.compiled:  # timing the pure-PyTorch fallbacks would say nothing about the kernels
        sys.exit(f"lightgen kernels are not compiled ({status.reason}); nothing to benchmark")
    return status


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


# ---------------------------------------------------------------------------------------------
# Reporting


def format_speedup(speedup: float | None) -> str:
    return f"{speedup:.2f}×" if speedup is not None else "–"


def machine_lines(env: dict) -> list[str]:
    """Header bullets on hardware, versions, allocator and how busy the machine was."""
    return [
        f"- CPU: {env['cpu']} ({env['logical_cpus']} logical CPUs), torch threads: {env['torch_threads']}, "
        f"ATen CPU capability: {env['cpu_capability']}",
        f"- torch {env['torch']}, transformers {env['transformers']}, lightgen {env['lightgen']} "
        f"(commit {env['git_commit'] or 'unknown'}), python {env['python']}",
        "- allocator: " + ("glibc keeps freed memory, so large outputs do not page-fault on every call"
                           if env["malloc_keeps_freed_memory"] else "default settings (no mallopt)"),
        f"- other processes used {format_share(env['others_cpu_share'])} of the CPUs while timing"
        + (" — **busy machine: multi-threaded timings are unreliable, rerun when it is quiet**"
           if (env["others_cpu_share"] or 0) > CONTENTION_WARNING else ""),
    ]


def hardware_title(env: dict) -> str:
    return f"{env['cpu']}, {env['torch_threads']} threads, {env['cpu_capability']}, torch {env['torch']}"


def speedup_chart(plt, labels: list[str], speedups: list[float], xlabel: str, title: str):
    """Horizontal bars of speedups (green >= 1x, red below), in table order, with a line at 1x."""
    fig, ax = plt.subplots(figsize=(7, 3))
    ax.barh(labels, speedups, color=["tab:green" if s >= 1 else "tab:red" for s in speedups])
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.invert_yaxis()  # same order as the table
    ax.set_xlabel(xlabel)
    ax.set_title(title, fontsize=9)
    return fig


def parse_args(doc: str, stem: str, quick_help: str, argv: list[str] | None,
               options: Callable[[argparse.ArgumentParser], None] | None = None) -> argparse.Namespace:
    """The options every benchmark takes, plus the script's own (``options`` adds them to the parser)."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help=quick_help)
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "benchmarks" / "results",
                        help=f"folder for {stem}.json and {stem}.png")
    if options is not None:
        options(parser)
    return parser.parse_args(argv)


def write_results(out_dir: Path, stem: str, payload: dict, draw_chart: Callable[[object], object]) -> None:
    """Write ``<out_dir>/<stem>.json`` and, with matplotlib, ``<stem>.png``.

    ``draw_chart(pyplot)`` returns the figure to save.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / f"{stem}.json"
    json_path.write_text(json.dumps(payload, indent=2, ensure_ascii=False) + "\n")
    print(f"\nwrote {json_path}")
    try:
        import matplotlib
    except ImportError:
        print(f"matplotlib is not installed; skipped {stem}.png (pip install 'lightgen[bench]')")
        return
    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    fig = draw_chart(plt)
    fig.tight_layout()
    png_path = out_dir / f"{stem}.png"
    fig.savefig(png_path, dpi=120)
    plt.close(fig)
    print(f"wrote {png_path}")


def start_run(doc: str, stem: str, quick_help: str, argv: list[str] | None,
              options: Callable[[argparse.ArgumentParser], None] | None = None) -> tuple[argparse.Namespace, dict]:
    """Parse the command line, require compiled kernels, seed, tune malloc; returns (args, environment)."""
    args = parse_args(doc, stem, quick_help, argv, options)
    status = compiled_kernels()
    torch.manual_seed(0)
    return args, environment(status, args.quick, keep_freed_memory())
