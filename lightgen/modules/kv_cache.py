"""Preallocated, reused generation memory.

Buffers are checked out of a pool keyed by (shape, dtype, device) and returned when a request
ends, so memory stays flat across requests; the step's short-lived tensors reuse blocks of
``lightgen.memory``'s caching allocator, so steady-state generation takes no memory per step.
A buffer is handed to one request at a time, so concurrent ``generate`` calls never share one.
"""

from __future__ import annotations

import threading
from collections import defaultdict

import torch

Key = tuple[tuple[int, ...], torch.dtype, torch.device]


class BufferPool:
    def __init__(self, max_free_per_key: int = 4) -> None:
        self._free: dict[Key, list[torch.Tensor]] = defaultdict(list)
        self._lock = threading.Lock()
        self._max_free = max_free_per_key

    def take(self, shape, dtype: torch.dtype, device) -> torch.Tensor:
        key = (tuple(shape), dtype, torch.device(device))
        with self._lock:
            free = self._free.get(key)
            if free:
                return free.pop()
        # Never an inference tensor: a buffer first taken under torch.inference_mode() is reused outside it.
        with torch.inference_mode(False):
            return torch.empty(key[0], dtype=dtype, device=key[2])

    def give_back(self, *tensors: torch.Tensor) -> None:
        with self._lock:
            for tensor in tensors:
                free = self._free[(tuple(tensor.shape), tensor.dtype, tensor.device)]
                if len(free) < self._max_free:
                    free.append(tensor)

    def clear(self) -> None:
        with self._lock:
            self._free.clear()


POOL = BufferPool()


class StaticKVCache:
    """Self-attention K/V of every decoder layer, ``keys[layer]`` / ``values[layer]`` [rows, kv_heads,
    max_len, head_dim], written in place.

    Beam reordering and dropping finished rows gather layer by layer into one spare layer-sized buffer
    and swap it in (the layer's old buffer becomes the spare): no cache memory is allocated per step, and
    the cache costs one layer more than its contents, not twice them. ``rows`` shrinks as finished rows
    are dropped.
    """

    def __init__(self, layers: int, rows: int, kv_heads: int, max_len: int, head_dim: int, dtype, device) -> None:
        self._take((layers, rows, kv_heads, max_len, head_dim), dtype, device)
        self.max_len = max_len
        self.rows = rows  # rows still decoding; the buffers keep their full size
        self.length = 0  # positions filled, shared by all rows

    def _take(self, shape, dtype, device) -> None:
        # Pooled as one block per kind (the pool keys buffers by shape); the layers are views into it.
        self._blocks = [POOL.take(shape, dtype, device) for _ in range(2)]
        self.keys, self.values = (list(block.unbind(0)) for block in self._blocks)
        # The two layer-sized buffers taken for reordering (on first use), returned to the pool as taken;
        # ``_spares`` is whichever key / value layer buffer is free now (after swaps, a view into a block).
        self._spare_buffers: list[torch.Tensor] = []
        self._spares: list[torch.Tensor] | None = None

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys[index][: self.rows], self.values[index][: self.rows]

    def select_rows(self, rows: torch.Tensor, keep_addresses: bool = False) -> None:
        """Keep rows ``rows`` (int64, any order, possibly fewer) as rows 0..len(rows)-1. ``keep_addresses``:
        the picked rows are copied back into each layer's buffer (a CUDA graph reads them there) instead of
        the buffers swapping with the spare."""
        if self._spares is None:
            self._spare_buffers = [POOL.take(self.keys[0].shape, self.keys[0].dtype, self.keys[0].device)
                                   for _ in range(2)]
            self._spares = list(self._spare_buffers)
        kept, filled = rows.numel(), slice(0, self.length)
        for kind, layers in enumerate((self.keys, self.values)):
            for index, buffer in enumerate(layers):
                spare = self._spares[kind]
                torch.index_select(buffer[: self.rows, :, filled], 0, rows, out=spare[:kept, :, filled])
                if keep_addresses:
                    buffer[:kept, :, filled].copy_(spare[:kept, :, filled])
                else:
                    layers[index], self._spares[kind] = spare, buffer
        self.rows = kept

    def grow(self, max_len: int) -> None:
        """Room for ``max_len`` positions: the filled part moves into larger pooled buffers.

        For callers that learn the output length only while decoding (fairseq's incremental decoder).
        """
        old_keys, old_values, old_buffers = self.keys, self.values, [*self._blocks, *self._spare_buffers]
        rows, heads, _, head_dim = old_keys[0].shape
        self._take((len(old_keys), rows, heads, max_len, head_dim), old_keys[0].dtype, old_keys[0].device)
        filled = (slice(0, self.rows), slice(None), slice(0, self.length))
        for new_layers, old_layers in ((self.keys, old_keys), (self.values, old_values)):
            for new, previous in zip(new_layers, old_layers, strict=True):
                new[filled] = previous[filled]
        POOL.give_back(*old_buffers)
        self.max_len = max_len

    def release(self) -> None:
        POOL.give_back(*self._blocks, *self._spare_buffers)
        self._spare_buffers, self._spares = [], None
