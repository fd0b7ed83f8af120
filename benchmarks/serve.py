"""Bounded load test of ``lightgen serve``: each backend (Triton through PyTriton, Ray Serve) with lightgen
or plain HF generate inside, on the demo grammar corrector, greedy, one sentence per request.

For each concurrency level, that many client threads send requests back to back (a closed loop) until
the request count is reached; reported: requests/s, p50 and p99 latency, the mean batch the server ran.
Servers and clients share the machine (loopback). Needs ``pip install -e '.[test,triton,ray]'``.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import threading
import time
from pathlib import Path

from _common import REPO_ROOT, ContentionMeter, compiled_kernels, environment, format_speedup, machine_lines, \
    write_results

from lightgen.demo import held_out_pairs
from lightgen.serving.launch import ServerProcess

PROVIDERS = {"lightgen": [], "hf": ["--no-accelerate"]}
FULL = dict(requests=200, concurrency=(1, 8, 32))
QUICK = dict(requests=24, concurrency=(1, 8))
SERVER_THREADS = 2


def load(client, sentences: list[str], concurrency: int) -> dict:
    """Send every sentence once from ``concurrency`` threads; latencies and outputs per sentence."""
    latencies, outputs, errors = [0.0] * len(sentences), [None] * len(sentences), []
    indices, lock = iter(range(len(sentences))), threading.Lock()

    def worker():
        while True:
            with lock:
                index = next(indices, None)
            if index is None:
                return
            start = time.perf_counter()
            try:
                (answer,) = client.generate([{"text": sentences[index]}])
            except Exception as error:  # noqa: BLE001 - reported, and the run fails below
                errors.append(repr(error))
                return
            latencies[index] = time.perf_counter() - start
            outputs[index] = answer.get("output_ids", answer)

    before = client.batch_sizes()
    start = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - start
    if errors:
        sys.exit(f"requests failed: {errors[:3]}")
    after = client.batch_sizes()
    batches = {size: after.get(size, 0) - before.get(size, 0) for size in after}
    ordered = sorted(latencies)
    return dict(concurrency=concurrency, requests=len(sentences), seconds=wall, requests_per_s=len(sentences) / wall,
                p50_ms=statistics.median(ordered) * 1e3, p99_ms=ordered[min(len(ordered) - 1,
                                                                             int(0.99 * len(ordered)))] * 1e3,
                mean_batch=sum(s * c for s, c in batches.items()) / max(1, sum(batches.values())),
                outputs=outputs)


def draw(plt, payload):
    fig, ax = plt.subplots(figsize=(7, 3.5))
    for run in payload["runs"]:
        rows = run["levels"]
        ax.plot([r["concurrency"] for r in rows], [r["p99_ms"] for r in rows], marker="o",
                label=f"{run['backend']} + {run['provider']}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")  # HF and lightgen differ by orders of magnitude here
    ax.set_xlabel("concurrent clients")
    ax.set_ylabel("p99 latency (ms)")
    ax.set_title(f"lightgen serve, demo model, greedy ({payload['environment']['cpu']})", fontsize=8)
    ax.legend(fontsize=8)
    return fig


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="24 requests, concurrency 1 and 8")
    parser.add_argument("--backends", nargs="+", choices=["triton", "ray"], default=["triton", "ray"])
    parser.add_argument("--providers", nargs="+", choices=list(PROVIDERS), default=list(PROVIDERS))
    parser.add_argument("--requests", type=int, help="per concurrency level (default 200; --quick 24)")
    parser.add_argument("--concurrency", type=int, nargs="+", help="client threads per level (default 1 8 32)")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "benchmarks" / "results",
                        help="folder for serve.json and serve.png")
    args = parser.parse_args(argv)
    settings = dict(QUICK if args.quick else FULL)
    settings.update({k: v for k, v in (("requests", args.requests), ("concurrency", args.concurrency)) if v})
    env = environment(compiled_kernels(), args.quick, malloc_tuned=False)
    env["server_torch_threads"] = SERVER_THREADS
    sources, _ = held_out_pairs(min(settings["requests"], 400))
    sentences = list(itertools.islice(itertools.cycle(sources), settings["requests"]))
    meter = ContentionMeter()
    runs = []
    for backend, provider in itertools.product(args.backends, args.providers):
        server = ServerProcess(backend, ["--threads", str(SERVER_THREADS), "--max-batch-size", "32",
                                         "--max-delay-ms", "5"] + PROVIDERS[provider])
        started = time.perf_counter()
        with server as client:
            ready_s = time.perf_counter() - started
            load(client, sentences[:4], 4)  # warm-up: first calls allocate caches
            levels = [load(client, sentences, c) for c in settings["concurrency"]]
        if server.returncode != 0 or server.leftovers or server.workspaces:
            sys.exit(f"{backend} did not shut down cleanly: {server.leftovers} {server.workspaces}")
        runs.append(dict(backend=backend, provider=provider, ready_s=ready_s, levels=levels))
        print(f"{backend} + {provider}: ready in {ready_s:.1f} s", flush=True)
    meter.record(env)
    reference = runs[0]["levels"][0]["outputs"]
    for run in runs:
        run["same_outputs"] = all(level.pop("outputs") == reference for level in run["levels"])
    payload = dict(environment=env, requests=settings["requests"], runs=runs)

    print(f"\n# lightgen serve: {settings['requests']} requests per level, demo model, greedy\n")
    print("\n".join(machine_lines(env)) + f"\n- servers: {SERVER_THREADS} torch threads, max batch 32, "
          "max delay 5 ms, one instance/replica, clients on the same machine\n")
    print("| backend | inside | clients | req/s | p50 ms | p99 ms | mean batch | p99 vs HF | same tokens |")
    print("|---|---|--:|--:|--:|--:|--:|--:|---|")
    for run in runs:
        hf = next((r for r in runs if r["backend"] == run["backend"] and r["provider"] == "hf"), None)
        for i, level in enumerate(run["levels"]):
            ratio = hf["levels"][i]["p99_ms"] / level["p99_ms"] if hf and run is not hf else None
            print(f"| {run['backend']} | {run['provider']} | {level['concurrency']} | {level['requests_per_s']:.1f} "
                  f"| {level['p50_ms']:.0f} | {level['p99_ms']:.0f} | {level['mean_batch']:.1f} "
                  f"| {format_speedup(ratio)} | {'yes' if run['same_outputs'] else 'NO'} |")
    write_results(args.out, "serve", payload, lambda plt: draw(plt, payload))
    if not all(run["same_outputs"] for run in runs):
        sys.exit("backends/providers returned different tokens")


if __name__ == "__main__":
    main()
