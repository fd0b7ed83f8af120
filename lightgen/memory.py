"""Generation's CPU memory: a caching allocator for the length of each ``generate`` call, and the packed weights'
arena on 2 MB pages.

A decode step makes 100-200 short-lived tensors (activations, logits, masks). While a lightgen
``generate`` call runs, torch's CPU allocator is lightgen's caching one (``csrc/cpu/allocator.cpp``):
freed blocks are kept by size class and handed out again, so after the first steps of the first
request no step takes memory from the system, and later requests reuse the same blocks (the KV cache
and other per-request buffers are pooled on top, see ``modules.kv_cache``). Up to
``LIGHTGEN_CPU_CACHE_MB`` (default 256) MiB of free blocks are kept between calls; 0 turns the cache off.
Without compiled kernels the cache is off and torch's allocator runs as usual.

``WeightArena`` holds the weight copies ``accelerate_model`` packs on transparent huge pages (Linux).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import mmap
import os
import threading

import torch

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


HUGE_PAGE = 2 << 20
ARENA_CHUNK = 64 << 20
WEIGHT_ALIGNMENT = 64  # a cache line, as torch's CPU allocator aligns


class WeightArena:
    """Packed weights copied onto 2 MB pages (transparent huge pages, asked for with madvise). A decode step streams
    every weight once; on 4 KB pages that is a TLB miss and a restart of the hardware prefetcher's stream every 4 KB
    (SmolLM2-135M fp32: ~130,000 a step). SmolLM2, greedy, 64 tokens, 2 threads, ms a token, both placements in one
    process interleaved (median of 9): fp32 batch 1 16.40 -> 15.20, batch 8 28.14 -> 26.90; int8 7.70 -> 7.04; int4
    5.92 -> 5.80; the same tokens (placement changes no arithmetic). Weights are copied in as they are made, into
    mappings that double from 2 MB to ARENA_CHUNK (a bigger tensor gets its own), so packing peaks at the packed
    weights plus one mapping, and a small model takes one huge page. A mapping is unmapped when no tensor in it is left.
    Without MADV_HUGEPAGE (not Linux) tensors stay where they are."""

    def __init__(self) -> None:
        self._chunk: torch.Tensor | None = None
        self._used = 0

    @staticmethod
    def available() -> bool:
        return hasattr(mmap, "MADV_HUGEPAGE")

    def place(self, tensor: torch.Tensor) -> torch.Tensor:
        """A copy of ``tensor`` in the arena (the tensor itself where it cannot go: not a contiguous CPU tensor)."""
        if not (self.available() and tensor.device.type == "cpu" and tensor.is_contiguous()):
            return tensor
        size = tensor.numel() * tensor.element_size()
        start = -(-self._used // WEIGHT_ALIGNMENT) * WEIGHT_ALIGNMENT
        if self._chunk is None or start + size > self._chunk.numel():
            grown = HUGE_PAGE if self._chunk is None else min(ARENA_CHUNK, 2 * self._chunk.numel())
            self._chunk, start = _huge_page_chunk(max(grown, size)), 0
        view = self._chunk[start:start + size].view(tensor.dtype).view(tensor.shape)
        view.copy_(tensor)
        self._used = start + size
        return view


def _huge_page_chunk(size: int) -> torch.Tensor:
    """uint8 [size] on a private anonymous mapping whose 2 MB-aligned span is advised onto huge pages."""
    size = -(-size // HUGE_PAGE) * HUGE_PAGE
    # Private: a shared anonymous mapping is shmem, which transparent huge pages leave out by default.
    mapping = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    with contextlib.suppress(OSError):  # a kernel without transparent huge pages: 4 KB pages as before
        mapping.madvise(mmap.MADV_HUGEPAGE)
    whole = torch.frombuffer(mapping, dtype=torch.uint8)  # holds the mapping until no view of it is left
    start = -whole.data_ptr() % HUGE_PAGE
    return whole[start:start + size]
