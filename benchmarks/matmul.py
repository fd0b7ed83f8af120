"""Benchmark the matmuls of one BART-size decode step, per provider and number of rows.

    python benchmarks/matmul.py [--quick] [--out benchmarks/results]

One decode step of a BART-size decoder runs 49 matmuls over 154 MB of fp32 weights: per layer
(6) self-attention q, k, v, out and cross-attention q, out (512x512), fc1 (2048x512) and fc2
(512x2048), then the LM head (32000x512). They run back to back for M rows (batch x beams).
Providers: ``aten`` (F.linear, MKL), ``onednn`` (weights packed by torch.utils.mkldnn),
``lightgen-inplace`` (ops.linear on nn.Linear's own [N, K] weight, what ``pack=False`` runs),
``lightgen`` fp32 / bf16 / int8 / int4 (packed panels, what accelerate_model runs; bf16, int8
and int4 are weight-only, int8 / int4 group-wise: ops.linear_grouped), ``lightgen-int8-dynamic``
(``quantize="int8-dynamic"``: the same int8 weights times int8 activations per group of 32, int32 dot
products (VNNI or AVX2), at every row count), ``lightgen-int4-dynamic`` (``quantize="int4-dynamic"``:
int4's weights times int8 activations, at every row count), ``fbgemm-int8`` (torch dynamic
quantization, int8 activations per tensor, fbgemm's int8 GEMM). ``--shapes smollm2`` runs SmolLM2-135M's step
instead: 30 layers of q (576x576), k, v (192x576), o (576x576), gate, up (1536x576), down (576x1536), and the tied
LM head (49152x576).
Reports ms per step, the GB/s of weight bytes each provider streams, that as a share of the
memory bandwidth measured in the same run (a 256 MB sum), and the ratio to aten.
Outputs are checked against aten before timing.
Prints a markdown table and writes <out>/matmul.json (and matmul.png with matplotlib).
"""

from __future__ import annotations

import sys
import warnings

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils import mkldnn

from lightgen import ops
from lightgen.modules.linear import packed_weights

from _common import (ContentionMeter, Sampling, format_speedup, hardware_title, machine_lines, measure, start_run,
                     write_results)

LAYERS, D_MODEL, FFN, VOCAB = 6, 512, 2048, 32000
ROWS = (1, 4, 8, 16, 32, 64)
FULL = Sampling(samples=21, min_sample_s=0.05, max_measure_s=20.0)
QUICK = Sampling(samples=5, min_sample_s=0.01, max_measure_s=2.0, warmup_calls=1)
BANDWIDTH_FLOATS = 64 << 20  # 256 MB: far beyond the caches
PROVIDERS = ("aten", "onednn", "lightgen-inplace", "lightgen", "lightgen-bf16", "lightgen-int8",
             "lightgen-int8-dynamic", "lightgen-int4", "lightgen-int4-dynamic", "fbgemm-int8")
# Bytes streamed per weight, scales and zero points included (int8: 4 bytes per 32; int4: 8 per 32). int8-dynamic
# reads the dot-product layout: 1 byte + a float scale and an int32 sum per 32; int4-dynamic's has int4's bytes.
BYTES_PER_WEIGHT = {"lightgen-bf16": 2, "lightgen-int8": 1 + 4 / 32, "lightgen-int8-dynamic": 1 + 8 / 32,
                    "lightgen-int4": 0.5 + 8 / 32, "lightgen-int4-dynamic": 0.5 + 8 / 32, "fbgemm-int8": 1}
SHAPES = {  # (out_features, in_features, bias) per matmul of one decode step
    "bart": ([(D_MODEL, D_MODEL, True)] * 6 + [(FFN, D_MODEL, True), (D_MODEL, FFN, True)]) * LAYERS
    + [(VOCAB, D_MODEL, False)],
    "smollm2": [(576, 576, False), (192, 576, False), (192, 576, False), (576, 576, False), (1536, 576, False),
                (1536, 576, False), (576, 1536, False)] * 30 + [(49152, 576, False)],
}


def decode_step_layers(shapes: str = "bart") -> list[nn.Linear]:
    return [nn.Linear(k, n, bias=bias).eval() for n, k, bias in SHAPES[shapes]]


def provider_calls(layers: list[nn.Linear], names=None) -> dict[str, list]:
    """Per provider (``names``, with aten; default all), one callable per layer taking x [M, K]."""
    names = set(names or PROVIDERS) | {"aten"}
    def fbgemm():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch.ao's deprecation notices
            return [torch.ao.quantization.quantize_dynamic(nn.Sequential(layer), {nn.Linear}, dtype=torch.qint8)
                    for layer in layers]

    def lightgen(precision):
        packed = [packed_weights(layer.weight, precision) for layer in layers]
        return [lambda x, w=weights, b=layer.bias: w.run(x, b) for weights, layer in zip(packed, layers, strict=True)]

    makers = {  # built only when asked for: SmolLM2's step holds 538 MB of fp32 weights per copy
        "aten": lambda: [lambda x, layer=layer: F.linear(x, layer.weight, layer.bias) for layer in layers],
        "onednn": lambda: [mkldnn.to_mkldnn(nn.Sequential(layer)) for layer in layers],
        "lightgen-inplace": lambda: [lambda x, layer=layer: ops.linear(x, layer.weight, None, layer.bias)
                                     for layer in layers],
        "lightgen": lambda: lightgen(None),
        "lightgen-bf16": lambda: lightgen("bf16"),
        "lightgen-int8": lambda: lightgen("int8"),
        "lightgen-int8-dynamic": lambda: lightgen("int8-dynamic"),
        "lightgen-int4": lambda: lightgen("int4"),
        "lightgen-int4-dynamic": lambda: lightgen("int4-dynamic"),
        "fbgemm-int8": fbgemm,
    }
    return {name: make() for name, make in makers.items() if name in names}


def step_fn(calls: list, inputs: dict[int, torch.Tensor], layers: list[nn.Linear]):
    def run():
        for call, layer in zip(calls, layers, strict=True):
            call(inputs[layer.in_features])
    return run


def relative_error(calls, layers, inputs) -> float:
    worst = 0.0
    for call, layer in zip(calls, layers, strict=True):
        x = inputs[layer.in_features]
        expected = F.linear(x, layer.weight, layer.bias)
        worst = max(worst, float((call(x) - expected).norm() / expected.norm()))
    return worst


def options(parser) -> None:
    parser.add_argument("--shapes", choices=sorted(SHAPES), default="bart", help="whose decode step (default bart)")
    parser.add_argument("--rows", type=int, nargs="+", help=f"rows per matmul (default {' '.join(map(str, ROWS))})")
    parser.add_argument("--providers", nargs="+", choices=PROVIDERS, help="only these (aten is always run)")


def main(argv=None) -> None:
    args, env = start_run(__doc__, "matmul", "fewer samples (for CI smoke runs)", argv, options)
    sampling = QUICK if args.quick else FULL
    layers = decode_step_layers(args.shapes)
    env["shapes"] = args.shapes
    weight_bytes = sum(layer.weight.numel() for layer in layers) * 4
    calls = provider_calls(layers, args.providers)
    env["providers"] = list(calls)
    meter = ContentionMeter()
    big = torch.randn(BANDWIDTH_FLOATS)
    bandwidth = BANDWIDTH_FLOATS * 4 / (measure({"sum": big.sum}, sampling)["sum"].median_us * 1e-6) / 1e9
    del big
    results = []
    with torch.no_grad():
        for rows in args.rows or ((1, 8) if args.quick else ROWS):
            inputs = {k: torch.randn(rows, k) for k in {layer.in_features for layer in layers}}
            errors = {name: relative_error(fns, layers, inputs) for name, fns in calls.items()}
            for name in {"lightgen", "lightgen-inplace"} & set(calls):
                if errors[name] > 1e-5:
                    sys.exit(f"{name} fp32 differs from aten by {errors[name]:.2e} (relative) at {rows} rows")
            timings = measure({name: step_fn(fns, inputs, layers) for name, fns in calls.items()}, sampling)
            entry = {"rows": rows, "providers": {}}
            for name, timing in timings.items():
                streamed = weight_bytes * BYTES_PER_WEIGHT.get(name, 4) / 4
                gb_s = streamed / (timing.median_us * 1e-6) / 1e9
                entry["providers"][name] = {
                    "ms": timing.median_us / 1e3, "p25_ms": timing.p25_us / 1e3, "p75_ms": timing.p75_us / 1e3,
                    "noisy": timing.noisy, "weight_gb_s": gb_s, "bandwidth_share": gb_s / bandwidth,
                    "vs_aten": timings["aten"].median_us / timing.median_us, "relative_error": errors[name],
                }
            results.append(entry)
    meter.record(env)
    env["memory_bandwidth_gb_s"] = bandwidth
    env["weight_mb_fp32"] = weight_bytes / 1e6
    report(env, results)
    stem = "matmul" if args.shapes == "bart" else f"matmul-{args.shapes}"
    write_results(args.out, stem, {"environment": env, "results": results}, lambda plt: chart(plt, env, results))


def report(env: dict, results: list[dict]) -> None:
    names = env["providers"]
    print(f"# decode-step matmuls ({env['shapes']}): {len(SHAPES[env['shapes']])} matmuls, layers + LM head, "
          f"{env['weight_mb_fp32']:.0f} MB fp32 weights\n")
    print("\n".join(machine_lines(env)))
    print(f"- memory bandwidth (256 MB sum, same run): {env['memory_bandwidth_gb_s']:.1f} GB/s\n")
    print("ms per step (× vs aten; GB/s of weights streamed, % of the measured bandwidth)\n")
    print("| rows | " + " | ".join(names) + " |")
    print("|---:|" + "---:|" * len(names))
    for entry in results:
        cells = []
        for name in names:
            p = entry["providers"][name]
            cells.append(f"{p['ms']:.2f} ({format_speedup(p['vs_aten'])}; {p['weight_gb_s']:.0f} GB/s, "
                         f"{p['bandwidth_share']:.0%}){' ~' if p['noisy'] else ''}")
        print(f"| {entry['rows']} | " + " | ".join(cells) + " |")
    errors = ", ".join(f"{name} {max(e['providers'][name]['relative_error'] for e in results):.1e}"
                       for name in names)
    print(f"\nworst relative error vs aten fp32: {errors}; ~ marks a noisy timing")


def chart(plt, env: dict, results: list[dict]):
    names = env["providers"]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    rows = [entry["rows"] for entry in results]
    for name in names:
        ax.plot(rows, [entry["providers"][name]["ms"] for entry in results], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("rows per matmul (batch × beams)")
    ax.set_ylabel(f"ms per decode step ({len(SHAPES[env['shapes']])} matmuls)")
    ax.set_title(f"{env['shapes']} decode-step matmuls\n{hardware_title(env)}", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return fig


if __name__ == "__main__":
    main()
