"""Generation's CPU memory: a caching allocator for the length of each ``generate`` call.

A decode step makes 100-200 short-lived tensors (activations, logits, masks). While a lightgen
``generate`` call runs, torch's CPU allocator is lightgen's caching one (``csrc/cpu/allocator.cpp``):
freed blocks are kept by size class and handed out again, so after the first steps of the first
request no step takes memory from the system, and later requests reuse the same blocks (the KV cache
and other per-request buffers are pooled on top, see ``modules.kv_cache``). Up to
``LIGHTGEN_CPU_CACHE_MB`` (default 256) MiB of free blocks are kept between calls; 0 turns the cache off.
Without compiled kernels the cache is off and torch's allocator runs as usual.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import os
import threading

from lightgen import _build

DEFAULT_LIMIT_MB = 256


@dataclasses.dataclass(frozen=True)
class CacheStats:
    system_allocations: int  # blocks the cache took from the system, ever
    reused: int  # blocks it handed out again
    cached_bytes: int  # free blocks it holds now
    live_bytes: int  # blocks handed out and not freed yet


_library: ctypes.CDLL | None = None
_library_lock = threading.Lock()


def _limit_bytes() -> int:
    text = os.environ.get("LIGHTGEN_CPU_CACHE_MB", str(DEFAULT_LIMIT_MB)).strip()
    try:
        megabytes = float(text)
    except ValueError:
        raise ValueError(f"LIGHTGEN_CPU_CACHE_MB must be a number of MiB, got {text!r}") from None
    if megabytes < 0:
        raise ValueError(f"LIGHTGEN_CPU_CACHE_MB must be >= 0, got {text!r}")
    return int(megabytes * (1 << 20))


def _cache_library() -> ctypes.CDLL | None:
    """The compiled library's cache functions, or None when the kernels are not compiled."""
    global _library
    if _library is not None:
        return _library
    status = _build.load()
    if not status.compiled:
        return None
    with _library_lock:
        if _library is None:
            library = ctypes.CDLL(status.library_path)  # already loaded: the same handle, the same cache
            library.lightgen_cpu_cache_empty.restype = ctypes.c_int64
            library.lightgen_cpu_cache_set_limit.argtypes = [ctypes.c_int64]
            _library = library
    return _library


@contextlib.contextmanager
def cached_cpu_memory():
    """Serve torch's CPU allocations from lightgen's cache inside the block (nests, thread-safe)."""
    limit = _limit_bytes()
    library = _cache_library() if limit else None
    if library is None:
        yield
        return
    library.lightgen_cpu_cache_set_limit(limit)
    library.lightgen_cpu_cache_enter()
    try:
        yield
    finally:
        library.lightgen_cpu_cache_exit()


def cache_stats() -> CacheStats | None:
    """The cache's counters, or None without compiled kernels."""
    library = _cache_library()
    if library is None:
        return None
    values = (ctypes.c_int64 * 4)()
    library.lightgen_cpu_cache_stats(values)
    return CacheStats(*values)


def empty_cpu_cache() -> int:
    """Return every cached free block to the system; the number of bytes freed."""
    library = _cache_library()
    return 0 if library is None else int(library.lightgen_cpu_cache_empty())
