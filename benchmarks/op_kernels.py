"""Benchmark lightgen's CPU kernels against the PyTorch code they replace, plus a BART forward.

    python benchmarks/op_kernels.py [--quick] [--ops PREFIX ...] [--out benchmarks/results]

Each op is timed three ways: the lightgen kernel; the eager composite a Hugging Face model runs
today; and the single native ATen op, where one exists that is not already the composite. Every
output is checked against the eager composite before it is timed, so a wrong kernel never gets a
number. Prints a markdown table and writes <out>/kernels.json and (with matplotlib) <out>/kernels.png.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Callable

import torch
import torch.nn.functional as F
import transformers

import lightgen
from lightgen import ops

from _common import (ContentionMeter, NOISY_SPREAD, Sampling, Timing, format_speedup, hardware_title,
                     machine_lines, measure, start_run, write_results)

TOLERANCE = dict(rtol=1e-4, atol=1e-4)  # fp32: kernels and composites differ only by rounding order
EPS = 1e-5
HIDDEN, FFN, VOCAB = 512, 2048, 32000
DECODE_ROWS = (1, 8, 32)  # batch sizes of a one-token decode step
PREFILL_ROWS = 8 * 64  # batch 8 x 64 tokens
ROWS = (*DECODE_ROWS, PREFILL_ROWS)
HEADS, HEAD_DIM = 8, HIDDEN // 8
NATIVE_RMS_NORM = getattr(F, "rms_norm", None)  # added in torch 2.4


@dataclasses.dataclass(frozen=True)
class Settings(Sampling):
    model_layers: int  # encoder and decoder layers of the BART model


FULL = Settings(samples=61, min_sample_s=10e-3, max_measure_s=3.0, model_layers=6)
QUICK = Settings(samples=9, min_sample_s=1e-3, max_measure_s=0.5, model_layers=2)


@dataclasses.dataclass
class Case:
    op: str
    shape: str
    lightgen: Callable[[], object]
    composite: Callable[[], object]
    native: Callable[[], object] | None = None


@dataclasses.dataclass
class Row:
    op: str
    shape: str
    lightgen: Timing
    composite: Timing
    native: Timing | None

    @property
    def speedup_vs_composite(self) -> float:
        return self.composite.median_us / self.lightgen.median_us

    @property
    def speedup_vs_native(self) -> float | None:
        return self.native.median_us / self.lightgen.median_us if self.native else None


# ---------------------------------------------------------------------------------------------
# Timing


def check_and_time(case: Case, settings: Settings) -> Row:
    expected = case.composite()
    candidates = {name: fn for name, fn in (("lightgen", case.lightgen), ("native", case.native)) if fn is not None}
    for name, fn in candidates.items():
        torch.testing.assert_close(fn(), expected, **TOLERANCE, msg=lambda detail, name=name: (
            f"{case.op} [{case.shape}]: {name} differs from the eager composite\n{detail}"))
    fns = {"composite": case.composite, **candidates}
    timings = measure(fns, settings)
    return Row(case.op, case.shape, timings["lightgen"], timings["composite"], timings.get("native"))


# ---------------------------------------------------------------------------------------------
# Cases


def rms_norm_composite(x, weight, eps):
    """Llama/T5 RMSNorm as Hugging Face writes it."""
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def eager_attention(q, k, v, scale, additive_mask=None):
    """transformers' eager_attention_forward (eval, so no dropout), returning [B, T, H, D]."""
    scores = torch.matmul(q, k.transpose(2, 3)) * scale
    if additive_mask is not None:
        scores = scores + additive_mask
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v).transpose(1, 2).contiguous()


def sdpa_attention(q, k, v, scale, causal=False):
    # The transpose is part of what HF's sdpa path runs, and gives lightgen's output layout.
    return F.scaled_dot_product_attention(q, k, v, scale=scale, is_causal=causal).transpose(1, 2).contiguous()


def norm_cases_for(rows: int, weight: torch.Tensor, bias: torch.Tensor) -> list[Case]:
    x, residual = torch.randn(rows, HIDDEN), torch.randn(rows, HIDDEN)
    norm_shape = (HIDDEN,)
    shape = f"{rows}×{HIDDEN}"

    def add_then(norm):
        total = x + residual
        return total, norm(total)

    def native_rms(t):
        return NATIVE_RMS_NORM(t, norm_shape, weight, EPS)

    has_native_rms = NATIVE_RMS_NORM is not None
    return [
        Case("layer_norm", shape,
             lambda: ops.layer_norm(x, weight, bias, EPS),
             lambda: F.layer_norm(x, norm_shape, weight, bias, EPS)),
        Case("add_layer_norm", shape,
             lambda: ops.add_layer_norm(x, residual, weight, bias, EPS),
             lambda: add_then(lambda total: F.layer_norm(total, norm_shape, weight, bias, EPS))),
        Case("rms_norm", shape,
             lambda: ops.rms_norm(x, weight, EPS),
             lambda: rms_norm_composite(x, weight, EPS),
             (lambda: native_rms(x)) if has_native_rms else None),
        Case("add_rms_norm", shape,
             lambda: ops.add_rms_norm(x, residual, weight, EPS),
             lambda: add_then(lambda total: rms_norm_composite(total, weight, EPS)),
             (lambda: add_then(native_rms)) if has_native_rms else None),
    ]


def activation_cases_for(rows: int, bias: torch.Tensor) -> list[Case]:
    x, up = torch.randn(rows, FFN), torch.randn(rows, FFN)
    shape = f"{rows}×{FFN}"

    def bias_act_case(act: str) -> Case:
        eager_act = ops.ACTIVATIONS[act]
        return Case(f"bias_act {act}", shape, lambda: ops.bias_act(x, bias, act), lambda: eager_act(x + bias))

    return [bias_act_case(act) for act in ("gelu", "gelu_tanh", "relu", "silu")] + [
        Case("gated_act silu", shape, lambda: ops.gated_act(x, up, "silu"), lambda: F.silu(x) * up),
    ]


def decode_attention_case(batch: int, past: int) -> Case:
    """One decode step: a new token's K/V joins ``past`` cached tokens and its query attends to all."""
    scale = HEAD_DIM ** -0.5
    q = torch.randn(batch, HEADS, 1, HEAD_DIM)
    k_new, v_new = torch.randn(batch, HEADS, 1, HEAD_DIM), torch.randn(batch, HEADS, 1, HEAD_DIM)
    k_past, v_past = torch.randn(batch, HEADS, past, HEAD_DIM), torch.randn(batch, HEADS, past, HEAD_DIM)
    # A preallocated (static) cache with room for further steps; lightgen and sdpa write the same
    # token into the same slot on every call, so they can share it.
    max_len = past + 64
    k_cache, v_cache = torch.zeros(batch, HEADS, max_len, HEAD_DIM), torch.zeros(batch, HEADS, max_len, HEAD_DIM)
    k_cache[:, :, :past], v_cache[:, :, :past] = k_past, v_past
    cache_pos = torch.full((batch,), past, dtype=torch.int64)

    def composite():  # HF's DynamicCache grows by torch.cat on every step
        keys, values = torch.cat([k_past, k_new], dim=2), torch.cat([v_past, v_new], dim=2)
        return eager_attention(q, keys, values, scale)

    def native():  # a static cache + sdpa: write the new slot, attend over the filled prefix
        k_cache[:, :, past], v_cache[:, :, past] = k_new[:, :, 0], v_new[:, :, 0]
        filled = past + 1
        return sdpa_attention(q, k_cache[:, :, :filled], v_cache[:, :, :filled], scale)

    return Case("attention decode", f"B={batch} H={HEADS} D={HEAD_DIM} past={past}",
                lambda: ops.attention(q, k_cache, v_cache, k_new, v_new, cache_pos, None, scale, False),
                composite, native)


def prefill_attention_case(batch: int, length: int) -> Case:
    scale = HEAD_DIM ** -0.5
    q, k, v = (torch.randn(batch, HEADS, length, HEAD_DIM) for _ in range(3))
    # HF builds the additive causal mask once per forward, outside the attention call.
    causal_mask = torch.full((length, length), float("-inf")).triu(1)[None, None]
    return Case("attention prefill causal", f"B={batch} H={HEADS} D={HEAD_DIM} T={length}",
                lambda: ops.attention(q, k, v, None, None, None, None, scale, True),
                lambda: eager_attention(q, k, v, scale, causal_mask),
                lambda: sdpa_attention(q, k, v, scale, causal=True))


def attention_cases() -> list[Case]:
    decode = [decode_attention_case(batch, past) for batch in (1, 8) for past in (64, 256, 1024)]
    return decode + [prefill_attention_case(8, length) for length in (64, 128)]


def embedding_case(rows: int, weight: torch.Tensor) -> Case:
    ids = torch.randint(0, VOCAB, (rows,))
    scale = HIDDEN ** 0.5  # BART/T5-style scaled embeddings
    return Case("embedding ×scale", f"{rows} ids, {VOCAB}×{HIDDEN}",
                lambda: ops.embedding(ids, weight, scale),
                lambda: F.embedding(ids, weight) * scale)


def all_cases() -> list[Case]:
    norm_weight, norm_bias, ffn_bias = torch.randn(HIDDEN), torch.randn(HIDDEN), torch.randn(FFN)
    embedding_weight = torch.randn(VOCAB, HIDDEN)
    cases = []
    for rows in ROWS:
        cases += norm_cases_for(rows, norm_weight, norm_bias) + activation_cases_for(rows, ffn_bias)
        cases.append(embedding_case(rows, embedding_weight))
    cases += attention_cases()
    # Group the table by op, keeping the order each op first appears in.
    op_order = list(dict.fromkeys(case.op for case in cases))
    return sorted(cases, key=lambda case: op_order.index(case.op))


# ---------------------------------------------------------------------------------------------
# Full model


def model_row(settings: Settings) -> Row:
    """Prefill forward of a random-weight BART before and after ``accelerate_model``.

    BartModel has no LM head: the 32000-way output projection is the same matmul either way and
    would only dilute the difference lightgen makes.
    """
    layers = settings.model_layers
    config = transformers.BartConfig(
        vocab_size=VOCAB, d_model=HIDDEN, encoder_layers=layers, decoder_layers=layers,
        encoder_attention_heads=HEADS, decoder_attention_heads=HEADS, encoder_ffn_dim=FFN, decoder_ffn_dim=FFN,
    )
    model = transformers.BartModel(config).eval()
    input_ids = torch.randint(0, VOCAB, (8, 64))

    def forward():
        return model(input_ids=input_ids).last_hidden_state

    baseline_impl = model.config._attn_implementation
    expected = forward()
    unpatched = measure({"unpatched": forward}, settings)["unpatched"]
    lightgen.accelerate_model(model)
    try:
        torch.testing.assert_close(forward(), expected, **TOLERANCE,
                                   msg=lambda detail: f"BART forward differs after accelerate_model\n{detail}")
        accelerated = measure({"lightgen": forward}, settings)["lightgen"]
    finally:
        lightgen.restore_model(model)
    shape = f"{layers}+{layers} layers, 8×64 tokens (baseline attn: {baseline_impl})"
    return Row("BartModel forward", shape, accelerated, unpatched, None)


# ---------------------------------------------------------------------------------------------
# Reporting


def format_us(timing: Timing | None) -> str:
    if timing is None:
        return "–"
    return f"{timing.median_us:,.1f}{' †' if timing.noisy else ''}"


def markdown(env: dict, settings: Settings, rows: list[Row]) -> str:
    lines = [
        "## lightgen kernel benchmarks",
        "",
        *machine_lines(env),
        f"- {env['mode']} mode, fp32, no_grad; median of up to {settings.samples} interleaved samples "
        f"({settings.max_measure_s:g} s cap per case), each ≥ {settings.min_sample_s * 1e3:g} ms of back-to-back "
        f"calls; {env['timing_seconds']:.0f} s of timing",
        "- native: the single ATen op, where one exists that is not already the composite "
        "(layer_norm's eager composite is the native F.layer_norm itself)",
        f"- † noisy: the interquartile range exceeds {NOISY_SPREAD:.0%} of the median (samples and quartiles are "
        "in kernels.json)",
        "",
        "| op | shape | lightgen µs | eager composite µs | native µs | speedup vs composite | speedup vs native |",
        "|---|---|--:|--:|--:|--:|--:|",
    ]
    for row in rows:
        lines.append(f"| {row.op} | {row.shape} | {format_us(row.lightgen)} | {format_us(row.composite)} | "
                     f"{format_us(row.native)} | {format_speedup(row.speedup_vs_composite)} | "
                     f"{format_speedup(row.speedup_vs_native)} |")
    return "\n".join(lines)


def json_payload(env: dict, settings: Settings, rows: list[Row]) -> dict:
    results = [{**dataclasses.asdict(row), "speedup_vs_composite": row.speedup_vs_composite,
                "speedup_vs_native": row.speedup_vs_native} for row in rows]
    return {"environment": env, "settings": dataclasses.asdict(settings), "results": results}


def draw_chart(plt, env: dict, rows: list[Row]):
    labels = [f"{row.op} [{row.shape}]" for row in rows]
    speedups = [row.speedup_vs_composite for row in rows]
    fig, ax = plt.subplots(figsize=(10, 0.28 * len(rows) + 1.5))
    ax.barh(labels, speedups, color=["tab:green" if s >= 1 else "tab:red" for s in speedups])
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.margins(y=0.01)
    ax.invert_yaxis()  # same order as the table
    ax.set_xlabel("speedup vs eager composite (×)")
    ax.set_title(f"lightgen fp32 kernels vs eager PyTorch\n{hardware_title(env)}", fontsize=10)
    ax.tick_params(axis="y", labelsize=7)
    return fig


def main(argv: list[str] | None = None) -> None:
    def options(parser):
        parser.add_argument("--ops", nargs="+", metavar="PREFIX",
                            help="only the op cases whose names start with one of these (and no BART forward)")

    args, env = start_run(__doc__, "kernels", "fewer samples and a 2+2-layer model (< 40 s)", argv, options)
    settings = QUICK if args.quick else FULL

    with torch.no_grad():
        cases = [case for case in all_cases() if not args.ops or case.op.startswith(tuple(args.ops))]
        print(f"checking and timing {len(cases)} op cases{'' if args.ops else ' and a BART forward'}...",
              file=sys.stderr)
        contention = ContentionMeter()
        rows = [check_and_time(case, settings) for case in cases]
        if not args.ops:
            rows.append(model_row(settings))
        contention.record(env)

    print(markdown(env, settings, rows))
    write_results(args.out, "kernels", json_payload(env, settings, rows), lambda plt: draw_chart(plt, env, rows))


if __name__ == "__main__":
    main()
