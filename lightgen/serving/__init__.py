"""Serve a lightgen-accelerated model behind a real serving engine: Triton Inference Server (through
PyTriton, ``lightgen[triton]``) or Ray Serve (``lightgen[ray]``).

Both backends take the same requests and give the same answers (``lightgen.serving.core``); each
module has ``serve(options)``, which blocks until SIGINT or SIGTERM and then shuts down cleanly.
"""

from __future__ import annotations

import dataclasses
import importlib

from lightgen.serving.core import Generator, Limits, RequestError

BACKENDS = {"triton": "lightgen.serving.triton", "ray": "lightgen.serving.ray"}
EXTRA_PACKAGES = {"triton": "pytriton", "ray": "ray"}


@dataclasses.dataclass
class ServeOptions:
    """What ``lightgen serve`` was asked for; fields marked (triton) or (ray) are read by that backend only."""

    model_dir: str | None = None  # a save_pretrained folder or a fairseq checkpoint (.pt); None: the demo model
    drafter_dir: str | None = None  # a NARDrafter folder for decoding="gad"; the demo model has its own
    self_drafter: str | None = None  # or a precision ("int4"...): GAD drafts with the model's own compact copy
    fairseq_data: str | None = None  # a fairseq checkpoint's dictionaries (dict.*.txt); default: its folder
    accelerate: bool = True  # False: plain HF generate behind the same server (for comparisons)
    threads: int | None = None  # torch threads per model instance
    host: str = "127.0.0.1"
    port: int = 8000  # HTTP
    max_batch_size: int = 32
    max_delay_ms: float = 10.0  # how long the first request of a batch waits for batch-mates
    max_input_tokens: int | None = None
    max_new_tokens: int | None = None
    max_body_bytes: int | None = None  # one HTTP body (ray) or one request row (triton); default 1 MiB
    max_text_bytes: int | None = None  # one request's text, in UTF-8 bytes; default 32 per input token
    grpc_port: int | None = None  # (triton) default: port + 1
    metrics_port: int | None = None  # (triton) default: port + 2
    workspace: str | None = None  # (triton) PyTriton's model store; default ~/.cache/pytriton/workspace_*
    num_replicas: int = 1  # (ray)
    max_replicas: int | None = None  # (ray) autoscale between num_replicas and this
    ray_address: str | None = None  # (ray) an existing cluster ("auto", "ray://head:10001"); None: a local one
    drain_timeout_s: float = 30.0  # (ray) on SIGTERM, how long in-flight requests may take to finish

    def limits(self) -> dict:
        return {name: value for name, value in (("max_input_tokens", self.max_input_tokens),
                                                ("max_new_tokens", self.max_new_tokens),
                                                ("max_batch_size", self.max_batch_size),
                                                ("max_body_bytes", self.max_body_bytes),
                                                ("max_text_bytes", self.max_text_bytes)) if value is not None}

    def load_generator(self) -> Generator:
        return Generator.load(self.model_dir, accelerate=self.accelerate, threads=self.threads,
                              drafter_dir=self.drafter_dir, self_drafter=self.self_drafter,
                              fairseq_data=self.fairseq_data, **self.limits())


def backend(name: str):
    """The backend module, or an ImportError that says which extra to install."""
    if name not in BACKENDS:
        raise ValueError(f"unknown serving backend {name!r}; choose one of {sorted(BACKENDS)}")
    try:
        importlib.import_module(EXTRA_PACKAGES[name])
    except ImportError as error:
        raise ImportError(f"the {name} backend needs `pip install 'lightgen[{name}]'` ({error})") from error
    return importlib.import_module(BACKENDS[name])


def serve(backend_name: str, options: ServeOptions) -> None:
    backend(backend_name).serve(options)


__all__ = ["BACKENDS", "Generator", "Limits", "RequestError", "ServeOptions", "backend", "serve"]
