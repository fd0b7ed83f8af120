"""Preallocated, reused generation memory.

Buffers are checked out of a pool keyed by (shape, dtype, device) and returned when a request
ends, so steady-state generation allocates nothing per step and memory stays flat across requests.
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
    """Self-attention K/V of every decoder layer, [rows, kv_heads, max_len, head_dim], written in place.

    Beam reordering and dropping finished rows gather into a second set of buffers and swap, so no
    cache memory is allocated per step; ``rows`` shrinks as finished rows are dropped.
    """

    def __init__(self, layers: int, rows: int, kv_heads: int, max_len: int, head_dim: int, dtype, device) -> None:
        shape = (layers, rows, kv_heads, max_len, head_dim)
        self.keys = POOL.take(shape, dtype, device)
        self.values = POOL.take(shape, dtype, device)
        self._spare_keys: torch.Tensor | None = None
        self._spare_values: torch.Tensor | None = None
        self.max_len = max_len
        self.rows = rows  # rows still decoding; the buffers keep their full size
        self.length = 0  # positions filled, shared by all rows

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys[index, : self.rows], self.values[index, : self.rows]

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep rows ``rows`` (int64, any order, possibly fewer) as rows 0..len(rows)-1."""
        if self._spare_keys is None:
            self._spare_keys = POOL.take(self.keys.shape, self.keys.dtype, self.keys.device)
            self._spare_values = POOL.take(self.values.shape, self.values.dtype, self.values.device)
        kept, filled = rows.numel(), slice(0, self.length)
        active = slice(0, self.rows)
        torch.index_select(self.keys[:, active, :, filled], 1, rows, out=self._spare_keys[:, :kept, :, filled])
        torch.index_select(self.values[:, active, :, filled], 1, rows, out=self._spare_values[:, :kept, :, filled])
        self.keys, self._spare_keys = self._spare_keys, self.keys
        self.values, self._spare_values = self._spare_values, self.values
        self.rows = kept

    def grow(self, max_len: int) -> None:
        """Room for ``max_len`` positions: the filled part moves into larger pooled buffers.

        For callers that learn the output length only while decoding (fairseq's incremental decoder).
        """
        layers, rows, heads, _, head_dim = self.keys.shape
        keys = POOL.take((layers, rows, heads, max_len, head_dim), self.keys.dtype, self.keys.device)
        values = POOL.take(keys.shape, self.values.dtype, self.values.device)
        filled = (slice(None), slice(0, self.rows), slice(None), slice(0, self.length))
        keys[filled] = self.keys[filled]
        values[filled] = self.values[filled]
        self.release()
        self.keys, self.values, self.max_len = keys, values, max_len

    def release(self) -> None:
        spares = [t for t in (self._spare_keys, self._spare_values) if t is not None]
        POOL.give_back(self.keys, self.values, *spares)
        self._spare_keys = self._spare_values = None
