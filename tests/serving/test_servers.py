"""Each backend for real: ``lightgen serve`` in a subprocess on 127.0.0.1, concurrent requests (bounded),
answers equal to direct ``generate``, batches observed, bad requests refused while good ones are served,
and a SIGTERM that leaves no process and no workspace behind.

Needs ``lightgen[triton]`` / ``lightgen[ray]``; without them these tests skip, except under
``LIGHTGEN_SERVING_TESTS=1`` (CI's serving run), where a missing extra fails.
"""

import concurrent.futures
import importlib
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import sysconfig
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

from lightgen.demo import EXAMPLES, held_out_pairs, load_demo_model
from lightgen.serving import EXTRA_PACKAGES
from lightgen.serving.client import Client, read_infer_answers
from lightgen.serving.launch import ServerProcess

REPO = Path(__file__).resolve().parents[2]
MAX_NEW_TOKENS = 60
pytestmark = pytest.mark.serving


def _require(backend):
    if os.environ.get("LIGHTGEN_SERVING_TESTS") == "1":
        importlib.import_module(EXTRA_PACKAGES[backend])  # CI's serving run installs both: fail, never skip
    else:
        pytest.importorskip(EXTRA_PACKAGES[backend], reason=f"needs pip install -e '.[{backend}]'")


@pytest.fixture(scope="module", params=["triton", "ray"])
def server(request):
    _require(request.param)
    # Triton is started as a shell's background job (SIGINT ignored) and stopped by SIGINT, which it must
    # restore; Ray is stopped by SIGTERM (Triton's SIGTERM: test_triton_serves_a_saved_folder_and_stops_on_sigterm).
    process = ServerProcess(request.param, ["--max-new-tokens", str(MAX_NEW_TOKENS), "--max-input-tokens", "64",
                                            "--max-batch-size", "16", "--max-delay-ms", "100"],
                            stop_signal=signal.SIGINT if request.param == "triton" else signal.SIGTERM,
                            sigint_ignored=request.param == "triton")
    with process as client:
        client.process = process  # for the tests that look at its sockets and memory
        yield client
    _assert_clean_stop(process)


def _assert_clean_stop(process):
    assert process.returncode == 0, process.output[-3000:]
    assert not process.leftovers, f"left running after the stop signal: {process.leftovers}"
    assert not process.workspaces, f"PyTriton workspace left behind: {process.workspaces}"


@pytest.fixture(scope="module")
def direct():
    """The sentences, and plain HF generate's answer for each (greedy and beam 2), one sentence at a time."""
    model, tokenizer = load_demo_model()
    sentences = EXAMPLES + held_out_pairs(10)[0]
    answers = {}
    for text in sentences:
        for beams in (1, 2):
            with torch.no_grad():
                row = model.generate(**tokenizer(text, return_tensors="pt"), max_new_tokens=MAX_NEW_TOKENS,
                                     num_beams=beams)[0].tolist()[1:]
            answers[text, beams] = row[:row.index(2) + 1] if 2 in row else row
    return sentences, answers, tokenizer


def _concurrently(calls):
    with concurrent.futures.ThreadPoolExecutor(max_workers=len(calls)) as pool:
        return list(pool.map(lambda call: call(), calls))


def test_concurrent_requests_are_batched_and_equal_direct_generate(server, direct):
    sentences, answers, tokenizer = direct
    settings = [{}, {"num_beams": 2}, {"decoding": "iad"}, {"decoding": "gad"}]  # the demo model's drafter
    requests = [dict(text=text, **settings[i % len(settings)]) for i, text in enumerate(sentences)]
    before = server.batch_sizes()
    got = _concurrently([lambda r=r: server.generate([r])[0] for r in requests])
    for request, answer in zip(requests, got, strict=True):
        expected = answers[request["text"], request.get("num_beams", 1)]  # IAD and GAD give greedy's tokens
        assert answer == {"output_ids": expected,
                          "text": tokenizer.decode(expected, skip_special_tokens=True).strip()}, request
    after = server.batch_sizes()
    new = {size: after.get(size, 0) - before.get(size, 0) for size in after}
    assert sum(size * count for size, count in new.items()) == len(requests)
    assert max(size for size, count in new.items() if count) > 1, f"no batch formed: {new}"


def test_token_ids_in_and_out(server, direct):
    sentences, answers, tokenizer = direct
    ids = tokenizer(sentences[0])["input_ids"]
    (answer,) = server.generate([{"input_ids": ids}])
    assert answer["output_ids"] == answers[sentences[0], 1]


def test_seeded_sampling_is_reproducible_whatever_the_batch_mates(server, direct):
    sentences, _, _ = direct
    sample = {"text": sentences[1], "do_sample": True, "top_p": 0.9, "temperature": 1.3, "seed": 11}
    first = server.generate([sample])[0]
    crowd = _concurrently([lambda: server.generate([sample, {"text": sentences[2]}])[0]] +
                          [lambda t=t: server.generate([{"text": t, "do_sample": True}])[0] for t in sentences[3:9]])
    assert "output_ids" in first and crowd[0] == first


def _raw(server, path, data: bytes):
    request = urllib.request.Request(server.url + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def test_bad_requests_are_refused_and_good_ones_still_served(server, direct):
    sentences, answers, _ = direct
    good = {"text": sentences[0]}
    bad = [{"text": sentences[0], "num_beams": 99}, {"text": 5}, {"text": "word " * 100}, {"input_ids": [-1]},
           {"text": "a", "colour": "red"}, {"text": "a", "decoding": "iad", "do_sample": True}, ["not", "a", "dict"]]
    mixed = _concurrently([lambda: server.generate([good] + bad + [good])] +
                          [lambda b=b: server.generate([b])[0] for b in bad])
    mixed_answers, single_answers = mixed[0], mixed[1:]
    assert mixed_answers[0] == mixed_answers[-1] and mixed_answers[0]["output_ids"] == answers[sentences[0], 1]
    for answer in mixed_answers[1:-1] + single_answers:
        assert list(answer) == ["error"] and answer["error"]
    for requests in ([], [good] * 17):  # empty and oversize calls are refused whole
        with pytest.raises(RuntimeError, match="refused"):
            server.generate(requests)
    if server.backend == "triton":
        status, body = _raw(server, "/v2/models/lightgen/infer", json.dumps(
            {"inputs": [{"name": "request", "shape": [1, 1], "datatype": "INT64", "data": [5]}]}).encode())
        assert status == 400 and "INT64" in body["error"], body
        status, body = _raw(server, "/v2/models/lightgen/infer", json.dumps(
            {"inputs": [{"name": "request", "shape": [1, 1], "datatype": "BYTES", "data": ["{not json"]}]}).encode())
        assert status == 200 and "request is not JSON" in json.loads(body["outputs"][0]["data"][0])["error"]
    else:
        assert _raw(server, "/generate", b"{not json")[0] == 400
        status, body = _raw(server, "/generate", json.dumps({"text": "a", "num_beams": 0}).encode())
        assert (status, body) == (400, {"error": "'num_beams' must be in [1, 8], got 0"})
        assert _raw(server, "/generate", json.dumps(good).encode()) == (200, server.generate([good])[0])
    assert server.ready()
    assert server.generate([good])[0]["output_ids"] == answers[sentences[0], 1]


def test_health_endpoints(server):
    if server.backend == "triton":
        for path in ("/v2/health/live", "/v2/health/ready", "/v2/models/lightgen/ready"):
            with urllib.request.urlopen(server.url + path, timeout=10) as response:
                assert response.status == 200
    else:
        with urllib.request.urlopen(server.url + "/health", timeout=10) as response:
            info = json.loads(response.read())
        assert info["accelerated"] is True and info["model_type"] == "mbart"
        assert info["limits"]["max_new_tokens"] == MAX_NEW_TOKENS and info["limits"]["max_batch_size"] == 16


def _replica_counts(client, replicas: int, timeout_s: float = 60.0) -> dict:
    """{replica: requests it has served}, from /stats, which one replica answers per call (Ray routes it);
    polled until ``replicas`` of them answered, or the time is up."""
    counts = {}
    deadline = time.monotonic() + timeout_s
    while len(counts) < replicas and time.monotonic() < deadline:
        _, body = client._call("/stats")
        counts[body["replica"]] = sum(int(size) * count for size, count in body["batch_sizes"].items())
    return counts


def test_ray_spreads_requests_over_replicas(direct):
    """--num-replicas 2 (one thread each): every request answered as direct generate, both replicas served."""
    _require("ray")
    sentences, answers, _ = direct
    process = ServerProcess("ray", ["--num-replicas", "2", "--threads", "1", "--max-new-tokens", str(MAX_NEW_TOKENS),
                                    "--max-batch-size", "4", "--max-delay-ms", "50"])
    with process as client:
        # Ray's router learns of replicas as they start: load them only once both answer.
        assert len(_replica_counts(client, 2)) == 2, "the second replica never answered"
        requests = [{"text": text} for text in sentences * 2]
        got = _concurrently([lambda r=r: client.generate([r])[0]["output_ids"] for r in requests])
        assert got == [answers[r["text"], 1] for r in requests]
        served = _replica_counts(client, 2)
    assert len(served) == 2 and sum(served.values()) == len(requests) and min(served.values()) > 0, served
    _assert_clean_stop(process)


def test_triton_serves_a_saved_folder_and_stops_on_sigterm(tmp_path):
    """A decoder-only model saved without a tokenizer: ids in and out; SIGTERM removes the workspace too."""
    _require("triton")
    from models import build

    model = build("gpt2")
    model.save_pretrained(tmp_path)
    process = ServerProcess("triton", [str(tmp_path), "--max-new-tokens", "6"])
    with process as client:
        answers = client.generate([{"input_ids": [5, 6, 7]}, {"text": "hi"}])
    with torch.no_grad():
        row = model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=6, do_sample=False, pad_token_id=0)
    expected = row[0, 3:].tolist()
    assert answers == [{"output_ids": expected[:expected.index(2) + 1] if 2 in expected else expected},
                       {"error": "this model has no tokenizer: send 'input_ids'"}]
    _assert_clean_stop(process)


def test_exported_repository_runs_on_a_standalone_tritonserver(tmp_path, direct):
    """``--export-repository`` + the ``tritonserver`` binary PyTriton ships, started by hand as on a Triton
    fleet (Triton's own Python backend, no PyTriton in the loop)."""
    _require("triton")
    import pytriton

    from lightgen.serving.launch import free_port

    subprocess.run([sys.executable, "-m", "lightgen.cli", "serve", "--export-repository", str(tmp_path / "models"),
                    "--max-new-tokens", str(MAX_NEW_TOKENS), "--max-batch-size", "8"], check=True)
    # A backend folder as Triton's containers lay it out: the Python backend plus the stub for this Python.
    bundled = Path(pytriton.__file__).parent / "tritonserver"
    backend = tmp_path / "backends" / "python"
    shutil.copytree(bundled / "backends" / "python", backend)
    shutil.copy(bundled / "python_backend_stubs" / sysconfig.get_python_version() / "triton_python_backend_stub",
                backend)
    port = free_port()
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",  # this venv
               LD_LIBRARY_PATH=os.pathsep.join([str(Path(pytriton.__file__).parent.parent / "nvidia_pytriton.libs"),
                                                sysconfig.get_config_var("LIBDIR")]),
               PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p))
    log = open(tmp_path / "tritonserver.log", "w")
    process = subprocess.Popen(
        [str(bundled / "bin" / "tritonserver"), "--model-repository", str(tmp_path / "models"),
         "--backend-directory", str(tmp_path / "backends"), "--http-address", "127.0.0.1", "--http-port", str(port),
         "--allow-grpc", "false", "--allow-metrics", "false"],
        env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        client = Client(f"http://127.0.0.1:{port}", "triton")
        deadline = time.monotonic() + 240
        while not client.ready():
            assert process.poll() is None and time.monotonic() < deadline, (tmp_path / "tritonserver.log").read_text()
            time.sleep(0.5)
        answers = client.generate([{"text": EXAMPLES[0]}, {"text": EXAMPLES[0], "num_beams": 0}])
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=60)
        log.close()
    _, expected, _ = direct
    assert answers[0]["output_ids"] == expected[EXAMPLES[0], 1]
    assert answers[1] == {"error": "'num_beams' must be in [1, 8], got 0"}
    assert process.returncode == 0


def test_serve_benchmark_quick_run(tmp_path):
    """benchmarks/serve.py end to end, kept small: Triton only, lightgen and HF inside (it exits non-zero
    when their tokens differ or a server does not stop cleanly)."""
    _require("triton")
    result = subprocess.run([sys.executable, "benchmarks/serve.py", "--quick", "--backends", "triton", "--requests",
                             "8", "--concurrency", "1", "4", "--out", str(tmp_path)], cwd=REPO, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    runs = json.loads((tmp_path / "serve.json").read_text())["runs"]
    assert [(r["provider"], [level["requests"] for level in r["levels"]]) for r in runs] == [
        ("lightgen", [8, 8]), ("hf", [8, 8])]
    assert all(r["same_outputs"] for r in runs) and "| triton | lightgen | 4 |" in result.stdout


def _post(client, body: bytes, timeout: float = 120.0) -> tuple[int, str]:
    """(status, response text) of one raw POST to the backend's inference route."""
    path = "/v2/models/lightgen/infer" if client.backend == "triton" else "/generate"
    request = urllib.request.Request(client.url + path, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode(errors="replace")


def _poison_bodies(backend: str) -> dict[str, bytes]:
    """Requests that failed their batch-mates, held a replica or leaked a traceback before (issue 21), as the
    HTTP body each backend takes (Triton: the same bytes as one row's string)."""
    rows = {"lone surrogate": json.dumps({"text": "a \ud800"}),
            "nested past the recursion limit": "[" * 100000,
            "nested deeper than a request": json.dumps({"text": "a", "input_ids": [[[[1]]]]}),
            "text over the byte limit": json.dumps({"text": "word " * 100000}),  # 500 KB, under the body cap
            "every setting wrong": json.dumps({"text": "", "num_beams": 0, "temperature": 1e-300, "decoding": 1}),
            "not JSON": "{not json"}
    if backend == "triton":
        bodies = {name: json.dumps({"inputs": [{"name": "request", "shape": [1, 1], "datatype": "BYTES",
                                                "data": [row]}]}).encode() for name, row in rows.items()}
        bodies["row over the body cap"] = json.dumps({"inputs": [{"name": "request", "shape": [1, 1],
                                                                  "datatype": "BYTES", "data": ["x" * (1 << 21)]}]})
        return {name: body if isinstance(body, bytes) else body.encode() for name, body in bodies.items()}
    bodies = {name: row.encode() for name, row in rows.items()}
    bodies["body over the cap"] = b"x" * (1 << 21)
    bodies["a list with a poison row"] = json.dumps([{"text": "a \ud800"}, {"text": "a", "input_ids": [1]}]).encode()
    return bodies


def _refused(backend: str, status: int, text: str) -> bool:
    """A poison request's answer: a 4xx (Ray), or HTTP 200 whose every row is an error (Triton, as for any
    row it refuses), and in no case a traceback."""
    if "Traceback" in text or 'File "' in text:
        return False
    if backend == "ray":
        return 400 <= status < 500 or (status == 200 and all("error" in a for a in json.loads(text)))
    return status == 200 and all("error" in answer for answer in read_infer_answers(json.loads(text)))


def test_poison_requests_fail_alone_and_leak_no_traceback(server, direct):
    sentences, answers, _ = direct
    poison = _poison_bodies(server.backend)
    good = [{"text": text} for text in sentences[:8]]
    calls = [lambda r=r: ("good", r, server.generate([r])[0]) for r in good]
    calls += [lambda n=n, b=b: ("poison", n, _post(server, b)) for n, b in poison.items()]
    random.Random(0).shuffle(calls)
    results = _concurrently(calls)
    for kind, what, result in results:
        if kind == "good":
            assert result["output_ids"] == answers[what["text"], 1], what
        else:
            assert _refused(server.backend, *result), (what, result[0], result[1][:2000])
    _, text = _post(server, poison["lone surrogate"])
    assert "not valid Unicode" in text and "surrogates not allowed" in text
    if server.backend == "ray":
        assert _post(server, poison["body over the cap"])[0] == 413
        assert "nests deeper than 4 levels" in _post(server, poison["nested past the recursion limit"])[1]
    assert server.ready()


def test_everything_the_server_starts_listens_on_loopback_only(server):
    """`lightgen serve` on 127.0.0.1: Triton's HTTP, gRPC and metrics ports; Ray's GCS, raylet, workers,
    agents, metrics, Serve's controller, proxy and replicas (Ray on its own binds most of them to every
    interface, issue 21); Ray's control plane with token authentication on."""
    sockets = server.process.listening()
    assert sockets and all(ip in ("127.0.0.1", "::ffff:127.0.0.1", "::1") for _, ip, _ in sockets), sockets
    if server.backend == "ray":
        names = {name for name, _, _ in sockets}
        assert {"gcs_server", "raylet"} <= names, names
        for process in server.process.processes():
            if process.name() in ("gcs_server", "raylet"):
                assert process.environ().get("RAY_AUTH_MODE") == "token", process.name()


SOAK_REQUESTS, SOAK_CLIENTS, SOAK_SECONDS = 160, 8, 300
SOAK_RSS_GROWTH = 256 << 20


def test_soak_good_and_poison_requests_concurrently(server, direct):
    """Bounded soak (count and time): 20% poison requests of every kind above mixed into greedy, beam and
    IAD calls from concurrent clients; every good request answered correctly, memory bounded. Prints the
    figures (pytest -s)."""
    sentences, answers, _ = direct
    poison = list(_poison_bodies(server.backend).items())
    settings = [{}, {"num_beams": 2}, {"decoding": "iad"}]
    rng = random.Random(21)
    plan = [("poison", poison[i % len(poison)]) if rng.random() < 0.2 else
            ("good", dict(text=rng.choice(sentences), **settings[i % len(settings)])) for i in range(SOAK_REQUESTS)]
    server.generate([{"text": sentences[0]}])  # warm-up: first calls allocate caches
    rss_before = server.process.rss_bytes()
    deadline = time.monotonic() + SOAK_SECONDS

    def one(kind, what):
        if time.monotonic() > deadline:
            return kind, what, "skipped", 0.0
        start = time.perf_counter()
        try:
            result = server.generate([what])[0] if kind == "good" else _post(server, what[1])
        except Exception as error:  # counted as lost
            result = error
        return kind, what, result, time.perf_counter() - start

    with concurrent.futures.ThreadPoolExecutor(max_workers=SOAK_CLIENTS) as pool:
        results = list(pool.map(lambda item: one(*item), plan))
    rss_growth = server.process.rss_bytes() - rss_before
    good = [(what, result, seconds) for kind, what, result, seconds in results if kind == "good" and result != "skipped"]
    bad = [(what, result) for kind, what, result, _ in results if kind == "poison" and result != "skipped"]
    refusals = sorted(seconds for kind, _, result, seconds in results if kind == "poison" and result != "skipped")
    lost = [what for what, result, _ in good if not isinstance(result, dict) or "output_ids" not in result]
    wrong = [what for what, result, _ in good if isinstance(result, dict) and "output_ids" in result
             and result["output_ids"] != answers[what["text"], what.get("num_beams", 1)]]
    leaked = [what[0] for what, result in bad if isinstance(result, Exception) or not _refused(server.backend, *result)]
    latencies = sorted(seconds for _, _, seconds in good)
    print(f"\nsoak {server.backend}: {len(good) + len(bad)} of {SOAK_REQUESTS} requests sent ({len(bad)} poison), "
          f"good answered {len(good) - len(lost)}/{len(good)}, lost {len(lost)}, wrong {len(wrong)}, poison not "
          f"refused cleanly {len(leaked)}, p50 {statistics.median(latencies) * 1e3:.0f} ms, p99 "
          f"{latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))] * 1e3:.0f} ms (poison refused: p50 "
          f"{statistics.median(refusals) * 1e3:.0f} ms, max {refusals[-1] * 1e3:.0f} ms), RSS "
          f"{rss_before / 2**20:.0f} MiB -> {(rss_before + rss_growth) / 2**20:.0f} MiB "
          f"({rss_growth / 2**20:+.0f} MiB)")
    assert len(good) >= SOAK_REQUESTS // 2, "the time bound cut the soak short"  # a signal, not a timing assert
    assert not lost and not wrong and not leaked, (lost[:3], wrong[:3], leaked[:3])
    assert rss_growth < SOAK_RSS_GROWTH, rss_growth
    assert server.ready()


def test_ray_drains_in_flight_requests_on_sigterm(direct):
    """SIGTERM while requests are being served: every request the replica already took is answered (as
    direct generate), requests sent after the stop began are refused, and the server exits 0."""
    _require("ray")
    sentences, answers, _ = direct
    process = ServerProcess("ray", ["--max-new-tokens", str(MAX_NEW_TOKENS), "--max-batch-size", "4",
                                    "--max-delay-ms", "20", "--drain-timeout", "300"])  # a loaded CI machine
    in_flight = [{"text": text, "num_beams": 2} for text in sentences[:12]]  # three batches of four
    with process as client, concurrent.futures.ThreadPoolExecutor(max_workers=len(in_flight)) as pool:
        futures = [pool.submit(lambda r=r: client.generate([r])[0]) for r in in_flight]
        deadline = time.monotonic() + 60
        while client._call("/stats")[1]["received"] < len(in_flight):  # all taken by the replica
            assert time.monotonic() < deadline, "the requests never reached the replica"
            time.sleep(0.05)
        process.stop()
        late = []  # a request every 0.2 s after the stop: until one is refused
        while (not late or late[-1] == 200) and len(late) < 100:
            time.sleep(0.2)
            try:
                late.append(_post(client, json.dumps({"text": sentences[0]}).encode(), timeout=30)[0])
            except (urllib.error.URLError, ConnectionError, TimeoutError) as error:
                late.append(type(error).__name__)
        drained = sum(f.done() for f in futures)  # answered by the time new requests were refused
        got = [f.result() for f in futures]
    assert [a["output_ids"] for a in got] == [answers[r["text"], 2] for r in in_flight]
    print(f"\ndrain: new requests after the stop: {late}; in-flight answered before the first refusal: {drained}")
    assert late[-1] != 200, late  # (ones sent before the stop took hold were answered, not cut)
    _assert_clean_stop(process)


def test_triton_exits_non_zero_when_tritonserver_dies():
    """kill -9 of the tritonserver under `lightgen serve`: it exits non-zero (a supervisor restarts it)
    instead of 0."""
    _require("triton")
    process = ServerProcess("triton", ["--max-new-tokens", "8"])
    with process as client:
        assert client.generate([{"text": EXAMPLES[0]}])[0]["output_ids"]
        (tritonserver,) = [p for p in process.processes() if p.name() == "tritonserver"]
        tritonserver.kill()
        process.process.wait(timeout=120)
    assert process.returncode not in (0, None), process.output[-3000:]
    assert "tritonserver exited without being asked to stop" in process.output
    assert not process.leftovers and not process.workspaces
