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
import os
import signal
import sys
import threading
from pathlib import Path

import pydantic
import ray
from ray import serve as ray_serve
from starlette.requests import Request
from starlette.responses import JSONResponse

from lightgen.serving import ServeOptions
from lightgen.serving.core import LOG, RequestError, check_batch, internal_error, load_json

LOOPBACK = "127.0.0.1"


def _bind_replica_rpc_to_loopback() -> None:
    """Ray Serve 2.60 binds each replica's inter-deployment gRPC server to "[::]:0" whatever the node's
    address; on a local cluster (whose node address is 127.0.0.1) bind it there too, as everything else is."""
    from ray.serve._private import replica

    bind = getattr(replica, "add_port_to_grpc_server", None)
    if bind is not None and not getattr(bind, "lightgen_loopback", False):
        def loopback(server, address):
            return bind(server, address.replace("[::]", LOOPBACK, 1) if address.startswith("[::]:") else address)

        loopback.lightgen_loopback = True
        replica.add_port_to_grpc_server = loopback


@ray_serve.deployment
class LightgenDeployment:
    def __init__(self, options: dict) -> None:
        self.options = ServeOptions(**options)
        if self.options.ray_address is None:
            _bind_replica_rpc_to_loopback()
        self.generator = self.options.load_generator()
        self.received = 0  # requests taken on POST /generate (answered or not yet)
        self.generate_batch.set_max_batch_size(self.options.max_batch_size)
        self.generate_batch.set_batch_wait_timeout_s(self.options.max_delay_ms / 1000)

    @ray_serve.batch
    async def generate_batch(self, requests: list) -> list[dict]:
        # In a thread: the event loop keeps taking requests (and health checks) while the model runs.
        return await asyncio.to_thread(self.generator.generate, requests)

    async def __call__(self, http: Request) -> JSONResponse:
        try:
            return await self._route(http)
        except Exception:  # the client gets a short error, the log the traceback
            LOG.exception("lightgen: %s %s failed", http.method, http.url.path)
            return JSONResponse(internal_error(), status_code=500)

    async def _route(self, http: Request) -> JSONResponse:
        path = http.url.path.rstrip("/")
        if http.method == "GET" and path == "/health":
            return JSONResponse(self.generator.info())
        if http.method == "GET" and path == "/stats":  # each replica is its own process: pid names it
            return JSONResponse(dict(self.generator.stats(), replica=os.getpid(), received=self.received))
        if http.method != "POST" or path != "/generate":
            return JSONResponse({"error": f"no route {http.method} {path}; POST /generate, GET /health, "
                                          "GET /stats"}, status_code=404)
        limits = self.generator.limits
        body = await _read_body(http, limits.max_body_bytes)
        if body is None:
            return JSONResponse({"error": f"request body over {limits.max_body_bytes} bytes "
                                          "(lightgen serve --max-body-bytes)"}, status_code=413)
        try:
            body = load_json(body, limits)
        except RequestError as error:
            return JSONResponse({"error": str(error)}, status_code=400)
        self.received += len(body) if isinstance(body, list) else 1
        if isinstance(body, dict):
            answer = await self._answer(body)
            return JSONResponse(answer, status_code=400 if "error" in answer else 200)
        try:
            requests = check_batch(body, limits)
        except RequestError as error:
            return JSONResponse({"error": str(error)}, status_code=400)
        return JSONResponse(list(await asyncio.gather(*map(self._answer, requests))))

    async def _answer(self, request) -> dict:
        # A request refused on its face is answered now, without waiting its turn for a batch.
        refusal = self.generator.refusal(request)
        return {"error": refusal} if refusal else await self.generate_batch(request)


async def _read_body(http: Request, limit: int) -> bytes | None:
    """The body, or None as soon as it is known to be over ``limit`` bytes: from its Content-Length before
    reading anything, else (chunked) while it streams in, so that an oversize body is never held whole."""
    declared = http.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        return None
    chunks, size = [], 0
    async for chunk in http.stream():
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
    return b"".join(chunks)


def build_app(args: dict):
    """The Ray Serve application for ``options`` (a dict of ``ServeOptions`` fields; strings, as ``serve run
    module:build_app key=value`` passes them, are converted)."""
    options = pydantic.TypeAdapter(ServeOptions).validate_python(dict(args))
    deployment_options = dict(
        # Batches form only if a replica may hold that many requests at once.
        max_ongoing_requests=2 * options.max_batch_size,
        ray_actor_options={"num_cpus": options.threads or 1},
        # A replica being stopped (SIGTERM, scale-down) first finishes the requests it holds.
        graceful_shutdown_timeout_s=options.drain_timeout_s, graceful_shutdown_wait_loop_s=0.5,
    )
    if options.max_replicas is not None:
        deployment_options["autoscaling_config"] = {"min_replicas": options.num_replicas,
                                                    "initial_replicas": options.num_replicas,
                                                    "max_replicas": options.max_replicas}
    else:
        deployment_options["num_replicas"] = options.num_replicas
    return LightgenDeployment.options(**deployment_options).bind(dataclasses.asdict(options))


def _local_cluster_on_loopback() -> None:
    """Everything a local Ray instance starts (GCS, raylet, workers, agents, metrics) listens on 127.0.0.1
    only."""
    from ray._private import ray_constants

    # Ray picks the node address from this flag, read when ray is imported (already done): set both. Off,
    # the node address is 127.0.0.1, and Ray's servers then bind it instead of every interface.
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False


def serve(options: ServeOptions) -> None:
    """Start a local Ray instance (or join ``options.ray_address``), run the application on
    ``options.host:port`` until SIGINT/SIGTERM, then drain (requests already taken are answered, new ones
    refused) and shut down what was started (on a cluster joined: the application only)."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if options.ray_address is None:
        _local_cluster_on_loopback()
    # Replicas run in Ray's worker processes: they must import this lightgen, installed or not.
    package_root = str(Path(__file__).resolve().parents[2])
    python_path = ":".join(p for p in (package_root, os.environ.get("PYTHONPATH")) if p)
    local = {} if options.ray_address else dict(_node_ip_address=LOOPBACK, dashboard_host=LOOPBACK)
    ray.init(address=options.ray_address, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": python_path}}, **local)
    # Ray 2.60 turns token authentication on for a local instance (RAY_AUTH_MODE=token, its token in
    # ~/.ray/auth_token or RAY_AUTH_TOKEN), and on a cluster joined when it finds a token; never silently off.
    if os.environ.get("RAY_AUTH_MODE", "").lower() != "token":
        print(f"lightgen: WARNING: the Ray cluster ({options.ray_address or 'local'}) runs without token "
              "authentication: whoever reaches its ports can run code on it (RAY_AUTH_MODE=token; see Ray's "
              "security docs)", file=sys.stderr, flush=True)
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
        print("lightgen: stopping: answering the requests already taken, refusing new ones", flush=True)
    finally:
        try:
            # Deleting the application first drains it: the proxies stop routing to it while its replicas
            # finish what they hold (up to drain_timeout_s); shutting Serve down at once would cut those.
            ray_serve.delete("lightgen")
        finally:
            if not options.ray_address:  # a cluster joined is someone else's: only the application goes
                ray_serve.shutdown()
            ray.shutdown()
