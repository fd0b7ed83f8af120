"""JIT loader for lightgen's C++ and CUDA kernels.

The sources in ``csrc/`` are compiled on first use with ``torch.utils.cpp_extension`` and
ninja, cached on disk, and loaded as a plain shared library whose ``TORCH_LIBRARY`` block
registers ``torch.ops.lightgen.*``. When the build is impossible or fails, the same schemas are
defined from Python and every op runs its pure-PyTorch reference, with one warning per op.
The CUDA kernels (``csrc/cuda/*.cu``) are a second library, built only where a GPU is visible and
only for its architecture; without it, CUDA tensors take the references the same way.

The cache folder's name is a hash of everything that changes the binary (sources, flags, ISA, torch's
version and build, the compiler), not of the interpreter, so virtualenvs with the same torch share one
build. A finished build leaves a marker beside its library; later processes load that library at once,
without ninja (which would rebuild for another venv's include paths), and ``lightgen build`` fills the
cache ahead of time. A build prints a notice first; a process waiting on another's build says so.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
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
# Ops with no CUDA kernel (on CUDA tensors their reference runs, with the fallback warning): linear_int8_dynamic's
# int8 activations are for CPUs (AVX-512 VNNI or AVX2); a GPU runs weight-only int8 (quantized layers stay on the CPU).
# sample_tokens reproduces the CPU generator's draws; ops.sample_tokens gives CUDA tensors to torch.multinomial.
CPU_ONLY = frozenset({"linear_int8_dynamic", "sample_tokens"})

# Extra compiler flags per ATen CPU capability: we compile for what this machine runs, never more.
_ISA_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c", "-DCPU_CAPABILITY_AVX512"],
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
    # "built" (by this process), "built by another process" (waited for its lock), "loaded from cache", or
    # "loaded from cache (built by another compiler)" where no compiler is found now
    source: str = ""


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


def _compiler_identity(compiler: str) -> str:
    """The resolved compiler binary with its size and mtime: an upgrade changes the binary it writes.
    A stat, not ``--version``: this runs on every import."""
    found = shutil.which(compiler)
    if found is None:
        return f"{compiler} (not found)"
    real = os.path.realpath(found)
    info = os.stat(real)
    return f"{real}:{info.st_size}:{info.st_mtime_ns}"


def _torch_build() -> str:
    return "|".join(str(part) for part in (torch.__version__, torch.version.git_version, torch.version.cuda,
                                           torch.version.debug, torch._C._GLIBCXX_USE_CXX11_ABI))


def _build_name(kind: str, files: list[Path], target: str, flags: dict, compiler: str) -> str:
    """Cache folder name: a hash of what changes the binary, then one of the compiler that wrote it. Not of
    ``sys.prefix``: two virtualenvs with the same torch build compile the same library, and the marker lets
    the second load it without ninja. The compiler's hash comes last so that a machine whose compiler is
    gone can still find a build of the same sources (``_build_by_any_compiler``)."""
    digest = hashlib.sha256()
    for path in files:
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    digest.update(json.dumps([target, flags, _torch_build()], sort_keys=True).encode())
    compiler_digest = hashlib.sha256(compiler.encode()).hexdigest()[:6]
    return f"lightgen_{kind}_{target.lower()}_{digest.hexdigest()[:12]}_{compiler_digest}"


def _cpu_headers() -> list[Path]:
    return sorted((CSRC / "include").glob("*.h"))


def _cpu_flags(isa: str) -> dict:
    return {"extra_cflags": ["-O3", "-fopenmp", "-DNDEBUG", *_ISA_FLAGS.get(isa, [])], "extra_ldflags": ["-fopenmp"]}


def _cuda_flags(archs: list[str]) -> dict:
    flags = ["-O3", "-DNDEBUG"]
    return {"extra_cflags": flags, "extra_cuda_cflags": [*flags, *_gencode_flags(archs)]}


def _cpu_build_name(isa: str) -> str:
    return _build_name("cpu", sources() + _cpu_headers(), isa, _cpu_flags(isa),
                       _compiler_identity(os.environ.get("CXX", "c++")))


def _cuda_build_name(archs: list[str]) -> str:
    from torch.utils import cpp_extension

    headers = _cpu_headers() + sorted((CSRC / "include").glob("*.cuh"))
    nvcc = os.path.join(cpp_extension.CUDA_HOME, "bin", "nvcc") if cpp_extension.CUDA_HOME else "nvcc"
    return _build_name("cuda", cuda_sources() + headers, f"{cuda_target(archs)}_cu{torch.version.cuda}",
                       _cuda_flags(archs), _compiler_identity(os.environ.get("CXX", "c++")) + "|"
                       + _compiler_identity(nvcc))


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


def lock_file_blocks() -> bool:
    """Whether cpp_extension's build lock is a file whose existence blocks (torch <= 2.13's FileBaton).
    From torch 2.14 it is an OS advisory lock on a file that stays after every build and frees itself
    when its holder dies: that file is never stale, and deleting it could let a second build in."""
    from torch.utils import cpp_extension

    return hasattr(cpp_extension, "FileBaton")


def clear_stale_lock(build_dir: Path) -> None:
    """Remove cpp_extension's lock file left by a build that was killed. Called only while holding
    ``build_lock``, which every lightgen build holds for as long as that file exists: so it is stale."""
    if not lock_file_blocks():
        return
    lock = build_dir / "lock"
    if lock.exists():
        warnings.warn(f"lightgen: removing a build lock left by a build that never finished ({lock})",
                      RuntimeWarning, stacklevel=3)
        lock.unlink(missing_ok=True)


PROGRESS_SECONDS = 15.0  # how often a long build, or a wait on another process's build, says it is alive
# CPU seconds of a cold CPU build with g++ at -O3 (measured: 109 on a busy machine, about 52 on a quiet one;
# README "Set up"); the notice divides them over the cores ninja can use.
CPU_BUILD_CPU_SECONDS = 80.0
CUDA_BUILD_CPU_SECONDS_PER_ARCH = 600.0  # nvcc: CI's compile check, two archs, 11 min on 2 cores


def notice(message: str) -> None:
    """A line for the person waiting: stderr, so that piped output stays clean."""
    print(message, file=sys.stderr, flush=True)


@contextlib.contextmanager
def build_lock(build_dir: Path, what: str):
    """An advisory lock on ``build_dir`` (freed by the OS when its holder dies, so never stale), held for
    the whole build; a process that has to wait says whom it waits for, every ``PROGRESS_SECONDS``."""
    try:
        import fcntl
    except ImportError:  # not POSIX: cpp_extension's own lock still serializes the builds
        yield
        return
    path = build_dir / "lightgen.lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        started = time.monotonic()
        reported = None
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                waited = time.monotonic() - started
                if reported is None or waited - reported >= PROGRESS_SECONDS:
                    holder = path.read_text().strip() or "another process"
                    notice(f"lightgen: waiting for {holder}, which is compiling the {what} kernels in {build_dir} "
                           f"({waited:.0f} s so far)")
                    reported = waited
                time.sleep(min(0.5, PROGRESS_SECONDS))
        os.ftruncate(fd, 0)
        os.write(fd, f"process {os.getpid()}".encode())
        yield
    finally:
        os.close(fd)  # releases the lock


def _marker(build_dir: Path) -> Path:
    return build_dir / "lightgen_build.json"


def cached_library(build_dir: Path, name: str) -> Path | None:
    """The library a finished build left in ``build_dir`` (its marker is written after it loaded), or None."""
    library = build_dir / f"{name}.so"
    if _marker(build_dir).is_file() and library.is_file():
        return library
    return None


def _build_by_any_compiler(name: str) -> Path | None:
    """The most recently used finished build of ``name``'s sources, flags and torch by whatever compiler
    wrote it: where no compiler is found now (an image that dropped it after ``lightgen build``)."""
    sources_part = name.rsplit("_", 1)[0]
    found = [library for folder in _cache_root().glob(f"{sources_part}_*")
             if (library := cached_library(folder, folder.name)) is not None]
    return max(found, key=lambda library: _marker(library.parent).stat().st_mtime, default=None)


def _mark_used(build_dir: Path) -> None:
    """The marker's mtime is the library's last use, which ``prune_cache`` reads (a read-only cache stays)."""
    with contextlib.suppress(OSError):
        os.utime(_marker(build_dir))


UNUSED_BUILD_DAYS = 30  # a cached library no process loaded for this long is removed after the next build
ABANDONED_BUILD_DAYS = 1  # a folder with no finished build (a failed or killed one) is removed after this


def prune_cache(keep: Path) -> list[Path]:
    """Remove cache folders of builds unused for ``UNUSED_BUILD_DAYS`` and abandoned ones, never ``keep`` or a
    folder whose build lock is held; returns what it removed. Run after a build, so it costs nothing on
    the common path, and every source change leaves one stale library behind."""
    now = time.time()
    removed = []
    for folder in _cache_root().glob("lightgen_*"):
        if folder == keep or not folder.is_dir():
            continue
        marker = _marker(folder)
        finished = marker.is_file()
        age_days = (now - (marker if finished else folder).stat().st_mtime) / 86400
        if age_days < (UNUSED_BUILD_DAYS if finished else ABANDONED_BUILD_DAYS) or _lock_held(folder):
            continue
        shutil.rmtree(folder, ignore_errors=True)
        removed.append(folder)
    if removed:
        notice(f"lightgen: removed {len(removed)} cached kernel build(s) unused for {UNUSED_BUILD_DAYS} days or "
               f"never finished, from {_cache_root()}")
    return removed


def _lock_held(build_dir: Path) -> bool:
    try:
        import fcntl
    except ImportError:
        return True  # cannot tell: keep it
    path = build_dir / "lightgen.lock"
    if not path.exists():
        return False
    fd = os.open(path, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def _build_notice(what: str, isa: str, files: list[Path], build_dir: Path, cpu_seconds: float) -> str:
    cores = os.cpu_count() or 1
    seconds = cpu_seconds / min(len(files), cores)
    try:
        load = os.getloadavg()[0]
    except OSError:
        load = 0.0
    # A load below the core count leaves the build a core of its own (1.1 on 2 cores was a quiet machine).
    busy = f"; longer now: the machine is busy (load {load:.1f} on {cores} cores)" if load >= cores else ""
    return (f"lightgen: compiling the {what} kernels for {isa} ({len(files)} files), about {seconds:.0f} s on "
            f"{cores} idle cores{busy}; once per machine and torch build, cached in {build_dir}")


def _why_cannot_build_cuda() -> str | None:
    from torch.utils import cpp_extension

    if torch.version.cuda is None:
        return f"this torch build ({torch.__version__}) has no CUDA support"
    if cpp_extension.CUDA_HOME is None:
        return "no CUDA toolkit found (set CUDA_HOME to the folder that holds bin/nvcc)"
    return _why_cannot_build()


def _load_cached(status: BuildStatus, library: Path, source: str) -> bool:
    started = time.perf_counter()
    try:
        torch.ops.load_library(str(library))
    except OSError as exc:  # a library that no longer loads (its torch changed in place): build again
        notice(f"lightgen: the cached {library} does not load ({exc}); building it again")
        _marker(library.parent).unlink(missing_ok=True)
        return False
    status.build_seconds = time.perf_counter() - started
    status.compiled, status.library_path, status.source = True, str(library), source
    status.log_path = str(library.parent / "build.log")
    _mark_used(library.parent)
    return True


def _compile(status: BuildStatus, name: str, files: list[Path], what: str, why_not: Callable[[], str | None],
             cpu_seconds: float, **flags) -> None:
    """Load ``name`` from the cache, or build it there (``why_not`` says why it cannot be built here)."""
    build_dir = _cache_root() / name
    library = cached_library(build_dir, name)
    if library is not None and _load_cached(status, library, "loaded from cache"):
        return  # no compiler or ninja needed for that
    reason = why_not()
    if reason:
        library = _build_by_any_compiler(name)
        if library is None or not _load_cached(status, library, "loaded from cache (built by another compiler)"):
            status.reason = reason
        return
    build_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    with build_lock(build_dir, what):
        library = cached_library(build_dir, name)  # built while we waited
        if library is not None and _load_cached(status, library, "built by another process"):
            return
        clear_stale_lock(build_dir)
        notice(_build_notice(what, status.isa, files, build_dir, cpu_seconds))
        _run_build(status, name, files, what, build_dir, flags)
    if status.compiled:
        prune_cache(keep=build_dir)


def _run_build(status: BuildStatus, name: str, files: list[Path], what: str, build_dir: Path, flags: dict) -> None:
    from torch.utils import cpp_extension

    log_path = build_dir / "build.log"
    status.log_path = str(log_path)
    started = time.perf_counter()
    done = threading.Event()

    def report_progress():
        while not done.wait(PROGRESS_SECONDS):
            objects = sum(1 for path in build_dir.glob("*.o") if path.stat().st_mtime >= wall_start)
            notice(f"lightgen: still compiling the {what} kernels ({time.perf_counter() - started:.0f} s, "
                   f"{objects} of {len(files)} files done)")

    wall_start = time.time() - 1  # file mtimes may be rounded down
    ticker = threading.Thread(target=report_progress, daemon=True)
    ticker.start()
    try:
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
    finally:
        done.set()
        ticker.join()
    status.build_seconds = time.perf_counter() - started
    status.compiled, status.source = True, "built"
    status.library_path = str(library) if library else str(build_dir / f"{name}.so")
    log_path.write_text(f"built {name} in {status.build_seconds:.1f}s\n")
    # Last, and atomically: the marker says the library is whole.
    marker = _marker(build_dir)
    partial = marker.with_suffix(f".{os.getpid()}.tmp")
    partial.write_text(json.dumps({"library": Path(status.library_path).name, "seconds": status.build_seconds,
                                   "torch": _torch_build(), "flags": flags}))
    os.replace(partial, marker)


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
        if _env_flag("LIGHTGEN_DISABLE_EXT"):
            status.reason = "LIGHTGEN_DISABLE_EXT=1 is set"
        else:
            _compile(status, _cpu_build_name(status.isa), sources(), "C++", _why_cannot_build,
                     CPU_BUILD_CPU_SECONDS, **_cpu_flags(status.isa))
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
    if torch.version.cuda is None or _env_flag("LIGHTGEN_DISABLE_EXT"):  # nothing to look up in the cache
        status.reason = _why_cannot_build_cuda()
        return status
    _compile(status, _cuda_build_name(archs), cuda_sources(), "CUDA", _why_cannot_build_cuda,
             CUDA_BUILD_CPU_SECONDS_PER_ARCH * len(archs), **_cuda_flags(archs))
    return status


def op(name: str) -> torch._ops.OpOverload:
    """The registered ``torch.ops.lightgen.<name>`` overload, building on first use."""
    try:
        return _OPS[name]
    except KeyError:
        load()
        return _OPS[name]
