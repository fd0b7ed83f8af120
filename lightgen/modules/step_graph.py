"""One-token decoder steps on a CUDA device, captured once as a CUDA graph and replayed.

On a GPU a decode step at small batch is bound by the host: every op is a Python call and a kernel launch. A
replayed graph launches the whole step at once. Measured (benchmarks/gpu_generate.py, H200, fp16, 64 tokens a
call, README "CUDA"): a 30-layer Llama at batch 1, 11.7 ms a token with eager steps, 2.9 ms replayed (HF: 23 ms);
Transformer-base beam 4, 3.7 ms eager, 2.1 ms replayed (the beam bookkeeping around the step is not captured).

The step reads its inputs through fixed addresses: the token buffer here, and the request's cache, masks and
positions, which ``DecodeState.reorder`` and ``StaticKVCache.select_rows`` update in place while a graph is held.
Whatever else moves them (rows dropped, a cache grown) changes the addresses the graph was captured with: the next
step captures again, and after ``MAX_CAPTURES`` the request decodes eagerly.

``LIGHTGEN_CUDA_GRAPHS=0`` turns graphs off (every step eager). A step that cannot be captured (an op that
synchronizes) runs eagerly with a warning, or raises under ``LIGHTGEN_STRICT=1``.
"""

from __future__ import annotations

import os
import threading
import warnings
from typing import Callable

import torch

from lightgen import _build
from lightgen.modules.kv_cache import StaticKVCache

MAX_CAPTURES = 4  # per request: a step whose addresses keep moving is not worth capturing


def enabled() -> bool:
    return os.environ.get("LIGHTGEN_CUDA_GRAPHS", "1") != "0"


class StepGraph:
    """Replays ``run_step(tokens [N, 1]) -> logits`` for one request. ``addresses()`` lists the data
    pointers the step reads besides the tokens; the step's host-side bookkeeping, ``cache.length``, which a
    replay does not run, is kept here."""

    def __init__(self, run_step: Callable[[torch.Tensor], torch.Tensor], addresses: Callable[[], tuple],
                 cache: StaticKVCache) -> None:
        self._run_step = run_step
        self._addresses = addresses
        self._cache = cache
        self._warmed = False
        self._graph: torch.cuda.CUDAGraph | None = None
        self._captured_with: tuple = ()
        self._tokens: torch.Tensor | None = None
        self._logits: torch.Tensor | None = None
        self.captures = 0
        self.replays = 0

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        if not self._warmed:
            self._warmed = True
            return self._on_capture_stream(tokens.device, lambda: self._run_step(tokens))
        addresses = self._addresses()
        if self._graph is None or addresses != self._captured_with or tokens.shape != self._tokens.shape:
            self._graph = None  # its memory goes back before a new capture takes its own
            if self.captures >= MAX_CAPTURES or not self._capture(tokens, addresses):
                return self._run_step(tokens)
        else:
            self._tokens.copy_(tokens)
        self._graph.replay()
        self._cache.length += 1
        self.replays += 1
        return self._logits.clone()  # the next replay overwrites the graph's own; processors may write in place

    def _capture(self, tokens: torch.Tensor, addresses: tuple) -> bool:
        self.captures += 1
        self._tokens = tokens.clone()
        graph = torch.cuda.CUDAGraph()

        def capture():
            # thread_local: a generate() in another thread (a server's) may allocate or synchronize meanwhile.
            graph.capture_begin(capture_error_mode="thread_local")
            try:
                self._logits = self._run_step(self._tokens)
            finally:
                graph.capture_end()

        filled = self._cache.length
        try:
            self._on_capture_stream(tokens.device, capture)
        except RuntimeError as error:
            # An op that synchronizes or reads device memory on the host cannot be captured. Nothing ran on the
            # device, so with the host's length put back the step runs eagerly (as every later one of this request).
            self._cache.length = filled
            self.captures = MAX_CAPTURES
            message = (f"lightgen: a decode step could not be captured as a CUDA graph ({error}); this request's "
                       "steps run eagerly")
            if _build.strict():
                raise RuntimeError(f"{message} (LIGHTGEN_STRICT=1 forbids the fallback)") from error
            warnings.warn(message, RuntimeWarning, stacklevel=4)
            return False
        self._cache.length = filled  # the capture ran the host side once and the device side not at all
        self._graph, self._captured_with = graph, addresses
        return True

    @staticmethod
    def _on_capture_stream(device: torch.device, work: Callable[[], torch.Tensor | None]):
        """``work`` on this thread's capture stream for the device, ordered after and before the current stream's
        work: the warm-up step runs there too, so that cuBLAS sets up that stream's workspace outside a capture."""
        streams = _capture_streams.__dict__.setdefault("by_device", {})
        stream = streams.get(device)
        if stream is None:
            stream = streams[device] = torch.cuda.Stream(device)
        current = torch.cuda.current_stream(device)
        stream.wait_stream(current)
        with torch.cuda.stream(stream):
            result = work()
        current.wait_stream(stream)
        if isinstance(result, torch.Tensor) and result.is_cuda:
            result.record_stream(current)
        return result


_capture_streams = threading.local()  # one stream per thread and device: two captures never share one
