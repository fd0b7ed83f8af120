"""Benchmark one decoder step of SmolLM2-135M-Instruct (30 layers, fp32): the Python step, the native step (all
layers in one C++ call) and the Python step's layers under torch.compile (inductor).

    python benchmarks/decode_step.py [--quick] [--no-compile] [--quantize=int8|int8-dynamic|int4|int4-dynamic|bf16]
        [--out benchmarks/results]

Each provider decodes one token per row on its own state after a 32-token prompt, then rolls the position back,
so every timed call is the same step; providers are sampled in turn. The logits of the providers are checked
equal (native vs Python: bit for bit) before timing. ms per step against the bandwidth floor (the bytes of the
weights a step reads, over the read bandwidth of a 256 MB sum on 2 MB pages, as the weights are, timed in turn with
the steps). Prints a markdown table and writes <out>/decode_step.json (and decode_step.png with matplotlib); with
``--quantize``, the weights of ``accelerate_model(quantize=...)`` and decode_step_<precision>.json / .png.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import time

import torch

import lightgen
from lightgen.memory import cached_cpu_memory
from lightgen.modules.decoder import DECODER_ATTR

from _common import (ContentionMeter, Sampling, Timing, format_speedup, hardware_title, machine_lines, measure,
                     speedup_chart, start_run, write_results)
from generate import bandwidth_tensor, load_smollm2, memory_bandwidth, smollm2_missing

PROMPT = 32
BATCHES = (1, 8)
FULL = Sampling(samples=21, min_sample_s=0.2, max_measure_s=60.0)
QUICK = Sampling(samples=5, min_sample_s=0.05, max_measure_s=10.0)
PYTHON, NATIVE, COMPILED = "python step", "native step", "python step, torch.compile"
# A sum over a tensor far beyond the caches, timed in turn with the steps: the bandwidth of the same minutes (this
# VM's swings 12-49 GB/s between runs), from which each row's floor is taken.
READ = "read 256 MB"
READ_BYTES = 256 << 20


@dataclasses.dataclass
class Row:
    batch: int
    timings: dict[str, Timing]
    floor_ms: float
    equal: dict[str, bool]  # each provider's logits equal to the Python step's

    def ms(self, provider: str) -> float | None:
        return self.timings[provider].median_us / 1e3 if provider in self.timings else None


class Provider:
    """One state on the accelerated model, decoding the same token again and again (rolled back after each)."""

    def __init__(self, decoder, batch: int, native: bool, compiled: bool = False):
        self.decoder, self.native = decoder, native
        prompt = torch.randint(100, 20000, (batch, PROMPT), generator=torch.Generator().manual_seed(batch))
        self.state = decoder.start(batch, PROMPT + 2, torch.float32, "cpu")
        self.token = prompt[:, -1:]
        self.back = torch.ones(batch, dtype=torch.int64)
        self.layers = None
        with self._settings():
            decoder.step(self.state, prompt[:, :-1])
        if compiled:  # after the prompt pass, which would compile for its own shape
            # Dynamo specializes on the layer index (the cache's list lookups): one graph per layer, not 8.
            config = torch._dynamo.config
            config.recompile_limit = max(config.recompile_limit, 4 * len(decoder.spec.layers))
            self.layers = torch.compile(decoder._layers, dynamic=False)

    @contextlib.contextmanager
    def _settings(self):
        """This provider's step for one call: the native one, or the Python one (compiled or not), without
        autograd as in generate (with it, patched modules such as the LM head run their original forward)."""
        decoder, reason = self.decoder, self.decoder.native_reason
        decoder.native_reason = reason if self.native else "benchmark: the Python step"
        if self.layers is not None:
            decoder._layers = self.layers  # an instance attribute over the method, for this provider only
        try:
            with torch.inference_mode():
                yield
        finally:
            decoder.native_reason = reason
            decoder.__dict__.pop("_layers", None)

    def __call__(self) -> torch.Tensor:
        with self._settings():
            logits = self.decoder.step(self.state, self.token)
        self.state.roll_back(self.back)
        return logits


def weight_bytes(model) -> int:
    """Bytes a step reads: every layer's and the LM head's (tied: the embedding) kernel weights, the norms."""
    seen, total = set(), 0
    for module in model.modules():
        weights = module.__dict__.get("_lightgen_linear")
        tensors = [weights.weight, weights.scale, weights.offset] if weights is not None else []
        if weights is None and type(module).__name__.endswith("RMSNorm"):
            tensors = [module.weight]
        for tensor in tensors:
            if tensor is not None and tensor.data_ptr() not in seen:
                seen.add(tensor.data_ptr())
                total += tensor.nbytes
    return total


def run_batch(decoder, batch: int, sampling: Sampling, compile_step: bool, weights_mb: float,
              notes: list[str]) -> Row:
    providers = {PYTHON: Provider(decoder, batch, native=False), NATIVE: Provider(decoder, batch, native=True)}
    if compile_step:
        started = time.perf_counter()
        try:
            providers[COMPILED] = compiled = Provider(decoder, batch, native=False, compiled=True)
            compiled()
            notes.append(f"B={batch}: torch.compile's first steps took {time.perf_counter() - started:.0f} s")
        except Exception as exc:  # noqa: BLE001 (whatever it raised is the result to report)
            notes.append(f"B={batch}: torch.compile failed: {type(exc).__name__}: {str(exc)[:300]}")
            providers.pop(COMPILED, None)
    expected = providers[PYTHON]()
    equal = {name: bool(torch.equal(provider(), expected)) for name, provider in providers.items()}
    before = decoder.native_steps
    source = bandwidth_tensor(READ_BYTES // 4)
    timings = measure({**providers, READ: source.sum}, sampling)
    if decoder.native_steps == before:
        sys.exit("the native step did not run")
    for provider in providers.values():
        provider.state.release()
    bandwidth = READ_BYTES / (timings[READ].median_us * 1e-6) / 1e9
    return Row(batch, timings, weights_mb / bandwidth, equal)  # MB / (GB/s) = ms


def markdown(env: dict, rows: list[Row], weights_mb: float, bandwidth: float, notes: list[str]) -> str:
    lines = [
        f"## lightgen decoder step: Python vs native vs torch.compile (SmolLM2-135M-Instruct, {env['precision']})",
        "",
        *machine_lines(env),
        f"- load average before timing: {env['load_before']}; {env['mode']} mode; {env['timing_seconds']:.0f} s "
        f"of timing; one step after a {PROMPT}-token prompt, median of interleaved samples, † noisy",
        f"- bandwidth floor: {weights_mb:.0f} MB of weights a step at the read bandwidth of the `{READ}` sum (2 MB "
        f"pages) timed in turn with the steps ({bandwidth:.1f} GB/s measured before them)",
        *(f"- {note}" for note in notes),
        "",
        "| B | " + " | ".join(f"{name} ms" for name in rows[0].timings)
        + " | floor ms | native: share of the floor | native vs python | logits equal to the Python step's |",
        "|--:|" + "--:|" * len(rows[0].timings) + "--:|--:|--:|---|",
    ]
    for row in rows:
        cells = [f"{row.ms(name):.2f}{' †' if timing.noisy else ''}" for name, timing in row.timings.items()]
        speedup = row.timings[PYTHON].median_us / row.timings[NATIVE].median_us
        lines.append(f"| {row.batch} | " + " | ".join(cells) + f" | {row.floor_ms:.2f} | "
                     f"{row.floor_ms / row.ms(NATIVE):.0%} | {format_speedup(speedup)} | "
                     + ", ".join(f"{name}: {'yes' if same else 'NO'}" for name, same in row.equal.items()) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    def options(parser):
        parser.add_argument("--no-compile", action="store_true", help="leave out the torch.compile provider")
        parser.add_argument("--quantize", choices=("int8", "int8-dynamic", "int4", "int4-dynamic", "bf16"),
                            help="time accelerate_model(quantize=...)'s weight copies (decode_step_<precision>.json)")

    args, env = start_run(__doc__, "decode_step", "fewer, shorter samples", argv, options)
    compile_step, quantize = not args.no_compile, args.quantize
    name = f"decode_step_{quantize}" if quantize else "decode_step"
    env["precision"] = quantize or "fp32"
    missing = smollm2_missing()
    if missing:
        sys.exit(f"SmolLM2 is not available: {missing}")
    sampling = QUICK if args.quick else FULL
    model = lightgen.accelerate_model(load_smollm2()[0].eval(), quantize=quantize)
    decoder = getattr(model, DECODER_ATTR)
    if decoder.native_reason is not None:
        sys.exit(f"the native step cannot run: {decoder.native_reason}")
    env["load_before"] = " ".join(f"{load:.2f}" for load in os.getloadavg())
    weights_mb = weight_bytes(model) / 1e6
    bandwidth = memory_bandwidth()["read"]
    notes: list[str] = []
    with torch.no_grad(), cached_cpu_memory():  # as generate runs its steps
        contention = ContentionMeter()
        rows = [run_batch(decoder, batch, sampling, compile_step, weights_mb, notes) for batch in BATCHES]
        contention.record(env)
    print(markdown(env, rows, weights_mb, bandwidth, notes))
    payload = {"environment": env, "settings": dataclasses.asdict(sampling), "weights_mb": weights_mb,
               "read_bandwidth_gb_s": bandwidth, "notes": notes,
               "results": [{"batch": row.batch, "ms_per_step": {name: row.ms(name) for name in row.timings},
                            "timings": {name: dataclasses.asdict(t) for name, t in row.timings.items()},
                            "floor_ms": row.floor_ms, "logits_equal_to_python_step": row.equal} for row in rows]}
    labels = [f"{name}, B={row.batch}" for row in rows for name in row.timings if name not in (PYTHON, READ)]
    speedups = [row.timings[PYTHON].median_us / row.timings[name].median_us for row in rows for name in row.timings
                if name not in (PYTHON, READ)]
    write_results(args.out, name, payload, lambda plt: speedup_chart(
        plt, labels, speedups, "speedup vs the Python step (×)",
        f"SmolLM2-135M decoder step, {env['precision']}\n{hardware_title(env)}"))


if __name__ == "__main__":
    main()
