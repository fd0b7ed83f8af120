"""Triton Inference Server backend, through PyTriton (``pip install 'lightgen[triton]'``).

One model, ``lightgen``, with one BYTES input ``request`` and one BYTES output ``response``, each a
JSON object per row (the request and answer of ``lightgen.serving.core``). Why JSON and not typed
tensors: Triton's dynamic batcher only merges requests whose tensors have equal shapes (PyTriton has
no ragged batching), and token lists differ in length; one string per request always batches, and
requests with different settings are grouped inside the batch instead.
"""

from __future__ import annotations

import os
import signal
import sysconfig

import numpy as np
from pytriton.model_config import DynamicBatcher, ModelConfig, Tensor
from pytriton.triton import DEFAULT_PROTECTED_ENDPOINTS, Triton, TritonConfig, TritonSecurityConfig

from lightgen.serving.core import TRITON_MODEL_NAME as MODEL_NAME
from lightgen.serving.core import Generator, answer_json


def infer_function(generator: Generator):
    def infer(requests):
        # ``requests``: the client requests Triton's dynamic batcher merged, each with one or more rows.
        # answer_json never raises: an exception here would fail every client in the batch with HTTP 500 and
        # PyTriton's traceback.
        rows = [row[0] for request in requests for row in request["request"]]
        answers = iter(answer_json(generator, rows) if rows else [])
        return [{"response": np.array([[next(answers)] for _ in request["request"]], dtype=np.object_)}
                for request in requests]

    return infer


class _Stop:
    """SIGINT/SIGTERM handler: remembers that a stop was asked for, then raises KeyboardInterrupt (PyTriton
    stops Triton and removes its workspace on KeyboardInterrupt only). ``triton.serve()`` also returns when
    tritonserver dies; ``asked`` tells the two apart."""

    asked = False

    def __call__(self, signum, frame):
        self.asked = True
        raise KeyboardInterrupt


def serve(options) -> None:
    """Start Triton on ``options.host``, serve until SIGINT/SIGTERM, then stop it and remove the workspace."""
    # Triton's Python backend must load this interpreter's libpython, not the system's (a different 3.x
    # build fails inside threading); tritonserver inherits this environment.
    libdir = sysconfig.get_config_var("LIBDIR")
    os.environ["LD_LIBRARY_PATH"] = ":".join(p for p in (libdir, os.environ.get("LD_LIBRARY_PATH")) if p)
    # A job started in the background by a shell inherits SIGINT ignored, and then Ctrl-C or kill -INT
    # could not stop it.
    stop = _Stop()
    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    generator = options.load_generator()
    import torch

    config = TritonConfig(http_address=options.host, http_port=options.port, grpc_address=options.host,
                          grpc_port=options.grpc_port or options.port + 1, metrics_address=options.host,
                          metrics_port=options.metrics_port or options.port + 2, exit_timeout_secs=10,
                          # Without a GPU, its metrics start-up only logs NVML/DCGM "Error" lines.
                          allow_gpu_metrics=torch.cuda.is_available())
    # Statistics (per-model batch sizes) are read-only and what shows batching works: leave them open.
    security = TritonSecurityConfig(restricted_endpoints=[e for e in DEFAULT_PROTECTED_ENDPOINTS if e != "statistics"])
    with Triton(config=config, workspace=options.workspace, security_config=security) as triton:
        triton.bind(model_name=MODEL_NAME, infer_func=infer_function(generator),
                    inputs=[Tensor(name="request", dtype=bytes, shape=(1,))],
                    outputs=[Tensor(name="response", dtype=bytes, shape=(1,))],
                    config=ModelConfig(max_batch_size=options.max_batch_size, batcher=DynamicBatcher(
                        max_queue_delay_microseconds=int(options.max_delay_ms * 1000))),
                    strict=True)
        print(f"lightgen: Triton serving model '{MODEL_NAME}' on http://{options.host}:{options.port} "
              f"({generator.info()})", flush=True)
        triton.serve()
    if not stop.asked:  # a supervisor restarts a server that exits non-zero
        raise SystemExit("lightgen: tritonserver exited without being asked to stop (its log is above)")
