"""A Triton model repository for a standalone ``tritonserver`` (a Triton fleet, NVIDIA's containers): the
same model, input and output as the PyTriton backend, run by Triton's own Python backend.

    lightgen serve /models/gec --backend triton --export-repository /srv/triton-models
    tritonserver --model-repository /srv/triton-models   # its Python must import lightgen

writes ``lightgen/config.pbtxt`` (batching, the serve options as a parameter) and ``lightgen/1/model.py``
(one import of ``TritonPythonModel`` below). Needs no PyTriton.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

from lightgen.serving.core import TRITON_MODEL_NAME, answer_json

CONFIG = """\
name: "{name}"
backend: "python"
max_batch_size: {max_batch_size}
input [ {{ name: "request", data_type: TYPE_STRING, dims: [ 1 ] }} ]
output [ {{ name: "response", data_type: TYPE_STRING, dims: [ 1 ] }} ]
dynamic_batching {{ max_queue_delay_microseconds: {delay_us} }}
instance_group [ {{ count: 1, kind: KIND_CPU }} ]
parameters {{ key: "lightgen_options", value: {{ string_value: {options} }} }}
"""
MODEL_PY = "from lightgen.serving.triton_repository import TritonPythonModel  # noqa: F401\n"


def write_repository(options, out_dir: str | Path) -> Path:
    """Write the repository for ``options`` (a ``ServeOptions``) under ``out_dir``; returns the model folder."""
    # The server may start elsewhere: name the folders absolutely.
    paths = {name: str(Path(path).resolve()) for name in ("model_dir", "drafter_dir", "fairseq_data")
             if (path := getattr(options, name)) is not None}
    options = dataclasses.replace(options, **paths)
    model = Path(out_dir) / TRITON_MODEL_NAME
    (model / "1").mkdir(parents=True, exist_ok=True)
    (model / "config.pbtxt").write_text(CONFIG.format(
        name=TRITON_MODEL_NAME, max_batch_size=options.max_batch_size, delay_us=int(options.max_delay_ms * 1000),
        options=json.dumps(json.dumps(dataclasses.asdict(options)))))
    (model / "1" / "model.py").write_text(MODEL_PY)
    return model


class TritonPythonModel:
    """Triton's Python-backend interface around ``lightgen.serving.core.Generator``."""

    def initialize(self, args):
        from lightgen.serving import ServeOptions

        parameters = json.loads(args["model_config"])["parameters"]
        self.generator = ServeOptions(**json.loads(parameters["lightgen_options"]["string_value"])).load_generator()

    def execute(self, requests):
        import triton_python_backend_utils as pb_utils

        rows = [pb_utils.get_input_tensor_by_name(r, "request").as_numpy().reshape(-1) for r in requests]
        answers = iter(answer_json(self.generator, [row for request in rows for row in request]))
        return [pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(
            "response", np.array([[next(answers)] for _ in request], dtype=np.object_))]) for request in rows]
