"""Ray Serve backend (``pip install 'lightgen[ray]'``).

HTTP on one route prefix ``/``: ``POST /generate`` with one request object (answer: one answer; HTTP 400
if it is refused) or a list of 1 to ``max_batch_size`` of them (answer: a list, refusals inside it);
``GET /health`` (model info; 200 once the replica is up) and ``GET /stats`` (the batch sizes of the replica
that answers, and its ``replica`` id).
``@ray_serve.batch`` merges concurrent requests on each replica; ``num_replicas``/``max_replicas`` scale out
over every node of the Ray cluster. On an existing cluster, the same application runs with Ray's CLI:

    serve start --address auto --http-host 0.0.0.0 --http-port 8000
    serve run --address auto lightgen.serving.ray:build_app model_dir=/models/gec num_replicas=4 max_replicas=16
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
import threading
from pathlib import Path

import pydantic
import ray
from ray import serve as ray_serve
from starlette.requests import Request
from starlette.responses import JSONResponse

from lightgen.serving import ServeOptions
from lightgen.serving.core import RequestError, check_batch


@ray_serve.deployment
class LightgenDeployment:
    def __init__(self, options: dict) -> None:
        self.options = ServeOptions(**options)
        self.generator = self.options.load_generator()
        self.generate_batch.set_max_batch_size(self.options.max_batch_size)
        self.generate_batch.set_batch_wait_timeout_s(self.options.max_delay_ms / 1000)

    @ray_serve.batch
    async def generate_batch(self, requests: list) -> list[dict]:
        # In a thread: the event loop keeps taking requests (and health checks) while the model runs.
        return await asyncio.to_thread(self.generator.generate, requests)

    async def __call__(self, http: Request) -> JSONResponse:
        path = http.url.path.rstrip("/")
        if http.method == "GET" and path == "/health":
            return JSONResponse(self.generator.info())
        if http.method == "GET" and path == "/stats":  # each replica is its own process: pid names it
            return JSONResponse(dict(self.generator.stats(), replica=os.getpid()))
        if http.method != "POST" or path != "/generate":
            return JSONResponse({"error": f"no route {http.method} {path}; POST /generate, GET /health, "
                                          "GET /stats"}, status_code=404)
        try:
            body = json.loads(await http.body())
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            return JSONResponse({"error": f"request is not JSON: {error}"}, status_code=400)
        if isinstance(body, dict):
            answer = await self.generate_batch(body)
            return JSONResponse(answer, status_code=400 if "error" in answer else 200)
        try:
            requests = check_batch(body, self.generator.limits)
        except RequestError as error:
            return JSONResponse({"error": str(error)}, status_code=400)
        return JSONResponse(list(await asyncio.gather(*map(self.generate_batch, requests))))


def build_app(args: dict):
    """The Ray Serve application for ``options`` (a dict of ``ServeOptions`` fields; strings, as ``serve run
    module:build_app key=value`` passes them, are converted)."""
    options = pydantic.TypeAdapter(ServeOptions).validate_python(dict(args))
    deployment_options = dict(
        # Batches form only if a replica may hold that many requests at once.
        max_ongoing_requests=2 * options.max_batch_size,
        ray_actor_options={"num_cpus": options.threads or 1},
    )
    if options.max_replicas is not None:
        deployment_options["autoscaling_config"] = {"min_replicas": options.num_replicas,
                                                    "initial_replicas": options.num_replicas,
                                                    "max_replicas": options.max_replicas}
    else:
        deployment_options["num_replicas"] = options.num_replicas
    return LightgenDeployment.options(**deployment_options).bind(dataclasses.asdict(options))


def serve(options: ServeOptions) -> None:
    """Start a local Ray instance (or join ``options.ray_address``), run the application on
    ``options.host:port`` until SIGINT/SIGTERM, then shut down what was started (on a cluster joined: the
    application only)."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    # Else Ray advertises the machine's address instead of 127.0.0.1 for a local cluster.
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    # Replicas run in Ray's worker processes: they must import this lightgen, installed or not.
    package_root = str(Path(__file__).resolve().parents[2])
    python_path = ":".join(p for p in (package_root, os.environ.get("PYTHONPATH")) if p)
    ray.init(address=options.ray_address, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": python_path}})
    # After ray.init, which installs its own SIGTERM handler (an abrupt exit that leaves Ray's agents running).
    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        ray_serve.start(http_options={"host": options.host, "port": options.port})
        ray_serve.run(build_app(dataclasses.asdict(options)), name="lightgen", route_prefix="/")
        print(f"lightgen: Ray Serve serving on http://{options.host}:{options.port}/generate "
              f"({options.num_replicas}-{options.max_replicas or options.num_replicas} replicas)", flush=True)
        stop.wait()
    finally:
        if options.ray_address:  # someone else's cluster: remove this application only
            ray_serve.delete("lightgen")
        else:
            ray_serve.shutdown()
        ray.shutdown()

