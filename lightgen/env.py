"""``python -m lightgen.env``: what lightgen can run here and why (versions, threads, ISA, each op)."""

from __future__ import annotations

import platform

import torch


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def report() -> dict:
    import transformers

    from lightgen import __version__, _build

    status = _build.load()
    cuda = torch.cuda.is_available()
    if status.cuda is None:
        gpu = "n/a (no CUDA device)"
    elif status.cuda.compiled:
        gpu = f"compiled ({status.cuda.isa})"
    else:
        gpu = f"reference fallback ({status.cuda.reason})"
    ops = {}
    for name in status.ops:
        cpu = "compiled" if status.compiled else f"reference fallback ({status.reason})"
        ops[name] = {"cpu": cpu, "cuda": "n/a (CPU-only op)" if name in _build.CPU_ONLY and status.cuda else gpu}
    return {
        "lightgen": __version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cpu": _cpu_model(),
        "isa": status.isa,
        "threads": torch.get_num_threads(),
        "cuda": torch.version.cuda if cuda else None,
        "kernels_compiled": status.compiled,
        "kernels_source": status.source,  # built / built by another process / loaded from cache
        "build_seconds": round(status.build_seconds, 1),
        "build_log": status.log_path,
        "library": status.library_path,
        "cuda_build_log": status.cuda.log_path if status.cuda else None,
        "ops": ops,
    }


def format_report(info: dict) -> str:
    lines = [
        f"lightgen {info['lightgen']}  python {info['python']}  torch {info['torch']}  "
        f"transformers {info['transformers']}",
        f"cpu: {info['cpu']}  isa: {info['isa']}  threads: {info['threads']}  cuda: {info['cuda'] or 'none'}",
        f"kernels: {'compiled' if info['kernels_compiled'] else 'NOT compiled'}"
        + (f" ({info['kernels_source']} in {info['build_seconds']} s)" if info["kernels_compiled"] else "")
        + f"  log: {info['build_log'] or '-'}",
        "",
        f"{'op':<16} {'cpu':<40} cuda",
    ]
    for name, where in info["ops"].items():
        lines.append(f"{name:<16} {where['cpu']:<40} {where['cuda']}")
    return "\n".join(lines)


def main() -> None:
    print(format_report(report()))


if __name__ == "__main__":
    main()
