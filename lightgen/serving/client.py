"""A small HTTP client for both backends (standard library only; safe to share between threads).

    client = Client("http://127.0.0.1:8000", backend="triton")
    client.generate([{"text": "This function return the number."}])  # -> [{"output_ids": [...], "text": ...}]
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request

from lightgen.serving.core import TRITON_MODEL_NAME as MODEL_NAME


def infer_body(requests: list[dict]) -> dict:
    """A KServe v2 (Triton HTTP) inference call: one JSON string per row of the ``request`` input."""
    return {"inputs": [{"name": "request", "shape": [len(requests), 1], "datatype": "BYTES",
                        "data": [json.dumps(r) for r in requests]}]}


def read_infer_answers(body: dict) -> list[dict]:
    (output,) = [o for o in body["outputs"] if o["name"] == "response"]
    return [json.loads(answer) for answer in output["data"]]


class Client:
    def __init__(self, url: str, backend: str, timeout: float = 120.0) -> None:
        if backend not in ("triton", "ray"):
            raise ValueError(f"backend must be 'triton' or 'ray', got {backend!r}")
        self.url, self.backend, self.timeout = url.rstrip("/"), backend, timeout

    def _call(self, path: str, body=None):
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data=data, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                return response.status, json.loads(response.read() or b"null")
        except urllib.error.HTTPError as error:
            text = error.read().decode(errors="replace")
            try:
                return error.code, json.loads(text)
            except json.JSONDecodeError:  # a proxy's plain-text answer, e.g. while a replica starts
                return error.code, {"error": text}

    def generate(self, requests: list[dict]) -> list[dict]:
        """One answer per request: ``{"output_ids", "text"}`` or ``{"error"}``; a refused call raises."""
        if self.backend == "triton":
            status, body = self._call(f"/v2/models/{MODEL_NAME}/infer", infer_body(requests))
            if status != 200:
                raise RuntimeError(f"Triton refused the call ({status}): {body}")
            return read_infer_answers(body)
        status, body = self._call("/generate", requests)
        if status != 200:
            raise RuntimeError(f"the server refused the call ({status}): {body}")
        return body

    def ready(self) -> bool:
        path = f"/v2/models/{MODEL_NAME}/ready" if self.backend == "triton" else "/health"
        try:
            return self._call(path)[0] == 200
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return False

    def batch_sizes(self) -> dict[int, int]:
        """How many batches of each size the model ran so far (Triton: the dynamic batcher's executions;
        Ray: ``@serve.batch`` calls, summed over the replica that answered)."""
        if self.backend == "triton":
            _, body = self._call(f"/v2/models/{MODEL_NAME}/stats")
            stats = body["model_stats"][0]["batch_stats"]
            return {int(s["batch_size"]): int(s["compute_infer"]["count"]) for s in stats}
        _, body = self._call("/stats")
        return {int(size): count for size, count in body["batch_sizes"].items()}
