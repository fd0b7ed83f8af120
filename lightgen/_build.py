"""JIT loader for lightgen's C++ and CUDA kernels.

The sources in ``csrc/`` are compiled on first use with ``torch.utils.cpp_extension`` and
ninja, cached on disk, and loaded as a plain shared library whose ``TORCH_LIBRARY`` block
registers ``torch.ops.lightgen.*``. When the build is impossible or fails, the same schemas are
defined from Python and every op runs its pure-PyTorch reference, with one warning per op.
The CUDA kernels (``csrc/cuda/*.cu``) are a second library, built only where a GPU is visible and
only for its architecture; without it, CUDA tensors take the references the same way.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
import shutil
import sys
import threading
import time
import traceback
import warnings
from pathlib import Path
from typing import Callable

import torch

CSRC = Path(__file__).parent / "csrc"
SCHEMA_FILE = CSRC / "lightgen_ops.cpp"
NAMESPACE = "lightgen"

# Extra compiler flags per ATen CPU capability: we compile for what this machine runs, never more.
_ISA_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-DCPU_CAPABILITY_AVX512"],
    "AVX2": ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY_AVX2"],
}


class KernelBuildError(RuntimeError):
    """The C++ kernels could not be built and LIGHTGEN_STRICT=1 forbids the reference fallback."""


@dataclasses.dataclass
class BuildStatus:
    compiled: bool = False
    reason: str = ""  # why the references are used, when compiled is False
    log_path: str | None = None
    build_seconds: float = 0.0
    isa: str = ""  # what the library targets: ATen's CPU capability, or CUDA archs ("sm_90")
    library_path: str | None = None
    ops: tuple[str, ...] = ()
    cuda: BuildStatus | None = None  # the CUDA library's build; None where no GPU is visible


_lock = threading.Lock()
_status: BuildStatus | None = None
_OPS: dict[str, torch._ops.OpOverload] = {}
_python_lib = None  # keeps the fallback Library alive
_warned: set[tuple[str, str]] = set()


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def strict() -> bool:
    return _env_flag("LIGHTGEN_STRICT")


def schemas() -> dict[str, str]:
    """Op name -> schema, read from the ``m.def`` lines of the C++ library definition."""
    text = SCHEMA_FILE.read_text()
    found = re.findall(r'm\.def\("([^"]+)"\)', text)
    return {s.split("(", 1)[0]: s for s in found}


def cpu_isa() -> str:
    return torch.backends.cpu.get_cpu_capability()


def sources() -> list[Path]:
    return [SCHEMA_FILE, *sorted((CSRC / "cpu").glob("*.cpp"))]


def cuda_sources() -> list[Path]:
    return sorted((CSRC / "cuda").glob("*.cu"))


def _cache_root() -> Path:
    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return Path(os.environ["TORCH_EXTENSIONS_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "lightgen" / "torch_extensions"


def _build_name(kind: str, files: list[Path], target: str) -> str:
    digest = hashlib.sha256()
    for path in files:
        digest.update(path.read_bytes())
    # The interpreter prefix too: cpp_extension rebuilds when torch's include paths change, so two
    # virtualenvs sharing one folder would rebuild it in turn.
    digest.update(f"{torch.__version__}|{target}|{sys.prefix}".encode())
    return f"lightgen_{kind}_{target.lower()}_{digest.hexdigest()[:12]}"


def _cpu_build_name(isa: str) -> str:
    return _build_name("cpu", sources() + sorted((CSRC / "include").glob("*.h")), isa)


def _cuda_build_name(archs: list[str]) -> str:
    headers = sorted((CSRC / "include").glob("*.h")) + sorted((CSRC / "include").glob("*.cuh"))
    return _build_name("cuda", cuda_sources() + headers, f"{cuda_target(archs)}_cu{torch.version.cuda}")


def visible_cuda_archs() -> list[str]:
    """Compute capabilities of the visible GPUs, as ``TORCH_CUDA_ARCH_LIST`` writes them ("9.0")."""
    return sorted({"{}.{}".format(*torch.cuda.get_device_capability(i)) for i in range(torch.cuda.device_count())})


def cuda_target(archs: list[str]) -> str:
    """Archs ("9.0", "8.0") as a name: "sm_90_sm_80"."""
    return "_".join("sm_" + arch.replace(".", "") for arch in archs)


def _gencode_flags(archs: list[str]) -> list[str]:
    # Explicit -gencode flags also stop cpp_extension from probing for a GPU to pick archs.
    return [f"-gencode=arch=compute_{a},code=sm_{a}" for a in (arch.replace(".", "") for arch in archs)]


def _why_cannot_build() -> str | None:
    if _env_flag("LIGHTGEN_DISABLE_EXT"):
        return "LIGHTGEN_DISABLE_EXT=1 is set"
    from torch.utils import cpp_extension

    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        return f"no C++ compiler found (looked for '{compiler}'; set CXX or install g++)"
    if not cpp_extension.is_ninja_available():
        return "ninja is not installed (pip install ninja)"
    return None


# A build takes 1-3 minutes; a lock older than this was left by a process killed mid-build, and
# cpp_extension would wait on it forever without a word.
STALE_LOCK_SECONDS = 900


def lock_file_blocks() -> bool:
    """Whether cpp_extension's build lock is a file whose existence blocks (torch <= 2.13's FileBaton).
    From torch 2.14 it is an OS advisory lock on a file that stays after every build and frees itself
    when its holder dies: that file is never stale, and deleting it could let a second build in."""
    from torch.utils import cpp_extension

    return hasattr(cpp_extension, "FileBaton")


def clear_stale_lock(build_dir: Path) -> None:
    if not lock_file_blocks():
        return
    lock = build_dir / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return
    if age > STALE_LOCK_SECONDS:
        warnings.warn(f"lightgen: removing a build lock left {age / 60:.0f} minutes ago by a build that never "
                      f"finished ({lock})", RuntimeWarning, stacklevel=3)
        lock.unlink(missing_ok=True)


def _why_cannot_build_cuda() -> str | None:
    from torch.utils import cpp_extension

    if torch.version.cuda is None:
        return f"this torch build ({torch.__version__}) has no CUDA support"
    if cpp_extension.CUDA_HOME is None:
        return "no CUDA toolkit found (set CUDA_HOME to the folder that holds bin/nvcc)"
    return _why_cannot_build()


def _compile(status: BuildStatus, name: str, files: list[Path], what: str, **flags) -> None:
    from torch.utils import cpp_extension

    build_dir = _cache_root() / name
    build_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    clear_stale_lock(build_dir)
    log_path = build_dir / "build.log"
    status.log_path = str(log_path)
    started = time.perf_counter()
    try:
        # cpp_extension takes a file lock in build_dir, so concurrent first uses build once.
        library = cpp_extension.load(
            name=name,
            sources=[str(p) for p in files],
            build_directory=str(build_dir),
            is_python_module=False,
            verbose=False,
            **flags,
        )
    except Exception as exc:  # the compiler's output is in the exception text
        log_path.write_text(f"{exc}\n\n{traceback.format_exc()}")
        status.reason = f"the {what} build failed ({type(exc).__name__}); see {log_path}"
        return
    status.build_seconds = time.perf_counter() - started
    status.compiled = True
    status.library_path = str(library) if library else str(build_dir / f"{name}.so")
    log_path.write_text(f"built {name} in {status.build_seconds:.1f}s\n")


def _warn_once(op_name: str, device: str, reason: str) -> None:
    if (op_name, device) in _warned:
        return
    _warned.add((op_name, device))
    warnings.warn(
        f"lightgen: no compiled kernel for op '{op_name}' on {device} ({reason}); "
        f"using the pure-PyTorch reference lightgen.ops.{op_name}_ref instead.",
        RuntimeWarning,
        stacklevel=4,
    )


def _device_of(args) -> str:
    for arg in args:
        if isinstance(arg, torch.Tensor):
            return arg.device.type
    return "cpu"


def _fallback(op_name: str, reference: Callable, reason_for: Callable[[str], str]) -> Callable:
    def run_reference(*args):
        device = _device_of(args)
        if strict():
            raise KernelBuildError(f"lightgen op '{op_name}' has no kernel on {device}: {reason_for(device)}")
        _warn_once(op_name, device, reason_for(device))
        return reference(*args)

    return run_reference


def _register(status: BuildStatus) -> None:
    """Define missing schemas, route uncompiled backends to the references, register fakes."""
    global _python_lib
    from lightgen import ops

    defs = schemas()
    if status.compiled:
        _python_lib = torch.library.Library(NAMESPACE, "IMPL")
    else:
        _python_lib = torch.library.Library(NAMESPACE, "DEF")
        for schema in defs.values():
            _python_lib.define(schema)

    def reason_for(device: str) -> str:
        if device == "cuda" and status.cuda is not None:
            return status.cuda.reason or "the CUDA library has no kernel for this op"
        if device == "cpu" or not status.compiled:
            return status.reason
        return f"lightgen has no {device} kernels built in this version"

    for name in defs:
        # A backend kernel (CPU, CUDA) outranks CompositeExplicitAutograd, so this catches the rest.
        _python_lib.impl(name, _fallback(name, ops.REFERENCES[name], reason_for), "CompositeExplicitAutograd")
        torch.library.register_fake(f"{NAMESPACE}::{name}", ops.FAKES[name], lib=_python_lib)
        _OPS[name] = getattr(getattr(torch.ops, NAMESPACE), name).default
    status.ops = tuple(defs)


def load() -> BuildStatus:
    """Build (or reuse the cache) and register the ops once per process."""
    global _status
    if _status is not None:
        return _status
    with _lock:
        if _status is not None:
            return _status
        status = BuildStatus(isa=cpu_isa())
        reason = _why_cannot_build()
        if reason:
            status.reason = reason
        else:
            _compile(status, _cpu_build_name(status.isa), sources(), "C++",
                     extra_cflags=["-O3", "-fopenmp", "-DNDEBUG", *_ISA_FLAGS.get(status.isa, [])],
                     extra_ldflags=["-fopenmp"])
        if not status.compiled and strict() and not _env_flag("LIGHTGEN_DISABLE_EXT"):
            raise KernelBuildError(f"lightgen kernels unavailable: {status.reason}")
        _register(status)
        if torch.cuda.is_available():
            # After _register: the CUDA library only adds kernels to the schemas defined by then.
            status.cuda = build_cuda(visible_cuda_archs())
            if not status.cuda.compiled and strict() and not _env_flag("LIGHTGEN_DISABLE_EXT"):
                raise KernelBuildError(f"lightgen CUDA kernels unavailable: {status.cuda.reason}")
        _status = status
        return status


def build_cuda(archs: list[str]) -> BuildStatus:
    """Compile (or load from the cache) and load the CUDA kernels for compute capabilities ``archs``
    ("9.0", "8.0"). Needs the CUDA toolkit and a CUDA build of torch, not a GPU: CI checks that
    every ``.cu`` source compiles this way."""
    status = BuildStatus(isa=cuda_target(archs))
    reason = _why_cannot_build_cuda()
    if reason:
        status.reason = reason
        return status
    flags = ["-O3", "-DNDEBUG"]
    _compile(status, _cuda_build_name(archs), cuda_sources(), "CUDA", extra_cflags=flags,
             extra_cuda_cflags=[*flags, *_gencode_flags(archs)])
    return status


def op(name: str) -> torch._ops.OpOverload:
    """The registered ``torch.ops.lightgen.<name>`` overload, building on first use."""
    try:
        return _OPS[name]
    except KeyError:
        load()
        return _OPS[name]
