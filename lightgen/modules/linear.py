"""Linear layers on lightgen's decode-shaped matmul: packed fp32 weights, opt-in int8 / int4 / bf16.

The module's own weight always stays as it is (``state_dict``, training, prefill-sized inputs and
``restore_model`` use it). Inference on few rows reads a packed copy instead: panels of 64 output
columns stored k after k, one sequential stream per thread (benchmarks/matmul.py, a BART-size
step: 28 GB/s at batch 1, 86% of the measured bandwidth, against 26 GB/s on the [N, K] layout and
11 GB/s for MKL; 1.5x faster than [N, K] at batch 8).
The copy costs, per packed layer, +100% of its fp32 weight bytes (fp32), +50% (bf16), +28% (int8: 8 bits
+ a float scale per 32 weights), +16% (int4: 4 bits + a float16 scale and zero point per 32), +31% (int8-dynamic
with a SIMD int8-dot kernel: int8's bytes in the dot-product layout in place of its panels, + an int32 group sum
per 32), +16% (int4-dynamic with one: its dot-product layout in place of int4's panels, the same bytes as int4).
``pack=False`` keeps fp32 at zero extra memory and runs the kernels on the original layout (HF
Conv1D's [K, N] weight is read as panels in place: fine in isolation, but 1.4x slower than packed in
a GPT-2 decode step, where the strided rows miss DRAM pages).
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Callable

import torch
from torch import nn

from lightgen import ops
from lightgen.memory import WeightArena
from lightgen.ops.linear import (
    dequantize_grouped,
    int8_dot_available,
    pack_int8_dot,
    pack_panels,
    quantize_grouped,
)


@dataclasses.dataclass(frozen=True)
class QuantFormat:
    """Group-wise weight-only quantization (``ops.linear_grouped``): one float scale (and, with zero
    points, one offset) per ``group_size`` consecutive input features of an output column. ``zero_points``
    None: per weight, wherever they cut the rounding error enough to pay for the offsets they add."""
    bits: int
    group_size: int
    zero_points: bool | None = False
    # Lossy: x is rounded to int8 per row and group too and the dot products run in int32 (ops.linear_int8_dynamic),
    # where it has a SIMD kernel (ops.linear.int8_dot_kernel: AVX2 or AVX-512 VNNI; elsewhere the weight-only path).
    # At every row count (ACTIVATION_ROUNDING), so a row's result never depends on the rows beside it. int4: with
    # zero points.
    activations: bool = False


# Chosen by benchmarks/quantize_quality.py on SmolLM2-135M and the demo model (README, "Quantization quality").
FORMATS = {"int8": QuantFormat(8, 32, zero_points=None), "int4": QuantFormat(4, 32, zero_points=True),
           "int8-dynamic": QuantFormat(8, 32, zero_points=None, activations=True),
           "int4-dynamic": QuantFormat(4, 32, zero_points=True, activations=True)}
# Zero points add a float per group (int8 g32: 12.5% more bytes a step): taken where they at least halve the
# squared rounding error. On float-trained weights the two errors are close (a group's range is about twice
# its largest magnitude); weights already on an asymmetric grid (a model dequantized from a Q4_1 file) are
# kept exactly, and those on a symmetric grid (Q8_0) by the symmetric scales.
ZERO_POINT_ERROR_RATIO = 0.5
PRECISIONS = ("int8", "int8-dynamic", "int4", "int4-dynamic", "bf16")
# The LM head's precision where it differs from the other linears.
HEAD_PRECISION = {"int4": "int8", "int4-dynamic": "int8-dynamic"}

# Up to this many rows (batch x beams x new tokens) the fp32 kernels beat ATen/MKL, per layer shape
# (512x512 .. 32000x512, 2048x512, 768x3072) on 2-core Zen 4, AVX-512: packed panels 1.05-1.5x at
# 256 rows; the in-place layouts from 64 rows on are as fast as ATen's blocked GEMM or slower.
PACKED_MAX_ROWS = 256
IN_PLACE_MAX_ROWS = 48
# ACTIVATION_ROUNDING: int8-dynamic and int4-dynamic round activations at every row count, the weight-only panels
# are not kept. Rounding from 2 rows on only (int8-dynamic until 2026-12-07: weight-only at 1 row, exactly "int8")
# made a row's tokens depend on the rows beside it: batch-1 greedy steps ran weight-only where a batch's steps and
# IAD's verification passes rounded, and IAD left greedy (tests/adapters/test_quantize.py). The price is int8's one
# row: there the dot layout (11% more bytes) streams slower than int8's panels. SmolLM2, 2 threads, AVX-512 VNNI
# Zen 4, quiet: benchmarks/matmul.py --shapes smollm2 (211 matmuls), ms int8 / int8-dynamic at 1 row 5.99 / 7.17
# (0.84x), 2 rows 6.59 / 6.18; the native step, both models interleaved in one process (15 rounds), 6.94 / 8.23 at
# batch 1 and 16.19 / 12.19 at batch 8 (1.33x). So at batch 1 "int8" is the faster choice. int4's dot layout holds
# int4's bytes, and its fp32 dequantize costs more than rounding x (--providers lightgen-int4 lightgen-int4-dynamic,
# 1 thread, commit e57d755, quiet, 23.9 GB/s; ms int4 / int4-dynamic: 1 row 9.06 / 6.09, 8: 29.1 / 14.2).


@dataclasses.dataclass(frozen=True)
class LinearWeights:
    # packed panels, or the module's own Parameter ([N, K]; Conv1D: [K, N]); int8/int4-dynamic: ``dot``, the only copy
    weight: torch.Tensor
    out_features: int
    scale: torch.Tensor | None = None  # group-wise quantized: [P, G, 64] float32 (ops.linear_grouped)
    offset: torch.Tensor | None = None  # with zero points: [P, G, 64] float32
    group_size: int = 0  # > 0: quantized group-wise
    # int8-dynamic / int4-dynamic: the weight in ops.pack_int8_dot's layout ([P, ceil(K / 4), 64, 4] int8; int4:
    # [P, ceil(K / 8), 64, 4] uint8; ``weight`` is the same tensor) and its group sums (int8 only)
    dot: torch.Tensor | None = None
    dot_sums: torch.Tensor | None = None
    conv1d: bool = False  # the weight is HF Conv1D's own [K, N] Parameter, read transposed in place
    # For a copy: the precision it was made in, and (version, data_ptr) of the Parameter it was made from.
    precision: str | None = None
    source: tuple[int, int] | None = None

    @property
    def quantized(self) -> bool:
        return self.weight.dtype != torch.float32

    @property
    def max_rows(self) -> float:
        """The most rows of x the kernel runs (more go to ATen), unbounded when quantized (only the kernel can)."""
        if self.quantized:
            return math.inf
        return PACKED_MAX_ROWS if self.source is not None else IN_PLACE_MAX_ROWS

    def takes(self, x: torch.Tensor) -> bool:
        """Whether the kernel runs ``x``: float32 on the CPU, and few rows unless quantized."""
        if x.dtype != torch.float32 or x.device.type != "cpu" or self.weight.device.type != "cpu":
            return False
        return self.quantized or x.numel() <= self.max_rows * x.shape[-1]

    def is_stale(self, weight: torch.Tensor) -> bool:
        """The module's weight changed in place (``load_state_dict``, an optimizer step) or was replaced."""
        return self.source is not None and self.source != (weight._version, weight.data_ptr())

    def placed(self, place: Callable[[torch.Tensor], torch.Tensor]) -> LinearWeights:
        """A copy whose tensors are ``place(tensor)``'s (``weight`` and ``dot`` stay one tensor)."""
        moved: dict[int, torch.Tensor] = {}
        fields = {}
        for name in ("weight", "scale", "offset", "dot", "dot_sums"):
            tensor = getattr(self, name)
            if tensor is not None:
                fields[name] = moved.setdefault(id(tensor), place(tensor))
        return dataclasses.replace(self, **fields)

    def run(self, x: torch.Tensor, bias: torch.Tensor | None, act: str = "none") -> torch.Tensor:
        if self.dot is not None:
            return ops.linear_int8_dynamic(x, self.dot, self.scale, self.offset, self.dot_sums, bias, act,
                                           self.out_features, self.group_size)
        if self.group_size:
            return ops.linear_grouped(x, self.weight, self.scale, self.offset, bias, act, self.out_features,
                                      self.group_size)
        weight = self.weight.t() if self.conv1d else self.weight
        return ops.linear(x, weight, None, bias, act, self.out_features)


def is_conv1d(module: nn.Module) -> bool:
    """HF's Conv1D (GPT-2): a linear layer whose weight is stored [in, out]."""
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf")


def packed_weights(weight: torch.Tensor, precision: str | None, fmt: QuantFormat | None = None,
                   arena: WeightArena | None = None) -> LinearWeights:
    """[N, K] float weight -> packed panels: fp32, bf16, or int8 / int4 group-wise (``FORMATS[precision]``
    unless ``fmt`` is given), copied into ``arena`` where given."""
    packed = _packed(weight, precision, fmt)
    return packed if arena is None else packed.placed(arena.place)


def _packed(weight: torch.Tensor, precision: str | None, fmt: QuantFormat | None) -> LinearWeights:
    weight = weight.detach().float()
    if precision is None:
        return LinearWeights(pack_panels(weight), weight.shape[0])
    if precision == "bf16":
        return LinearWeights(pack_panels(weight.to(torch.bfloat16)), weight.shape[0], precision=precision)
    fmt = fmt or FORMATS[precision]
    if fmt.activations and fmt.bits == 4 and not fmt.zero_points:
        raise ValueError(f"packed_weights: int4 with int8 activations needs zero points, got {fmt}")
    if fmt.zero_points is not None:
        packed, scale, offset = quantize_grouped(weight, fmt.bits, fmt.group_size, fmt.zero_points)
    else:
        symmetric, zero_point = (quantize_grouped(weight, fmt.bits, fmt.group_size, zp) for zp in (False, True))
        errors = [(dequantize_grouped(*q, fmt.group_size, weight.shape[1], weight.shape[0]) - weight).square().sum()
                  for q in (symmetric, zero_point)]
        packed, scale, offset = zero_point if errors[1] <= ZERO_POINT_ERROR_RATIO * errors[0] else symmetric
    dot, dot_sums = (pack_int8_dot(packed, fmt.group_size, weight.shape[1]) if fmt.activations and int8_dot_available()
                     else (None, None))
    if dot is not None:
        packed = dot  # ACTIVATION_ROUNDING: the weight-only panels would never be read
    return LinearWeights(packed, weight.shape[0], scale, offset, fmt.group_size, dot, dot_sums, precision=precision)


def linear_weights(module: nn.Module, quantize: str | None, pack: bool,
                   arena: WeightArena | None = None) -> LinearWeights | None:
    """What the kernel reads for ``module``, or None to leave it to ATen; a packed copy goes into ``arena``."""
    weight = module.weight
    if weight.dtype != torch.float32 or weight.device.type != "cpu":
        return None
    conv1d = is_conv1d(module)
    if quantize is None and not pack:
        return LinearWeights(weight, weight.shape[1] if conv1d else weight.shape[0], conv1d=conv1d)
    packed = packed_weights(weight.t() if conv1d else weight, quantize, arena=arena)
    return dataclasses.replace(packed, source=(weight._version, weight.data_ptr()))


def current_weights(module: nn.Module) -> LinearWeights | None:
    """The module's kernel weights, packed again first if its Parameter changed since they were made
    (None once it is no longer a float32 CPU weight: ATen runs it)."""
    weights = module.__dict__.get("_lightgen_linear")
    if weights is not None and weights.is_stale(module.weight):
        weights = linear_weights(module, weights.precision, pack=True)
        object.__setattr__(module, "_lightgen_linear", weights)  # restore_model still removes it
    return weights


def linear_forward(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Patched inference forward of an nn.Linear / Conv1D."""
    weights = current_weights(module)
    if weights is not None and weights.takes(x):
        return weights.run(x, module.bias)
    if weights is not None and weights.quantized:
        raise TypeError(f"lightgen: a quantized linear layer takes float32 CPU inputs, got {x.dtype} on {x.device}")
    return module._lightgen_original(x)


def apply_linear(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``module(x)`` from lightgen's own fast paths (inference only): a patched layer's kernel is called
    directly, without nn.Module's call and the patched forward's checks (~5 us a layer, measured: a tenth
    of the demo model's decode step). HF models whose modules carry hooks never get here (``skips_hooks``);
    the fairseq IAD/GAD generator does not check (a known limit)."""
    weights = kernel_weights(module, x)
    return weights.run(x, module.bias) if weights is not None else module(x)


def kernel_weights(module: nn.Module, x: torch.Tensor) -> LinearWeights | None:
    """The weights to run ``module`` on ``x`` with the kernel (which can fuse an activation), or None."""
    weights = current_weights(module)
    return weights if weights is not None and weights.takes(x) else None


def check_precision(model: nn.Module, quantize: str | None) -> None:
    if quantize is None:
        return
    if quantize not in PRECISIONS:
        raise ValueError(f"accelerate_model: quantize must be one of {', '.join(PRECISIONS)} or None, got "
                         f"{quantize!r}")
    if quantize in FORMATS and FORMATS[quantize].activations and not int8_dot_available():
        weight_only = quantize.removesuffix("-dynamic")
        warnings.warn(f"lightgen: quantize={quantize!r} needs a SIMD int8-dot kernel (lightgen's compiled AVX2 or "
                      f"AVX-512 kernels); this CPU or build has none, so its linear layers run weight-only "
                      f"{weight_only} (quantize={weight_only!r})", RuntimeWarning, stacklevel=3)
    dtypes = {p.dtype for p in model.parameters()}
    if dtypes != {torch.float32}:
        raise ValueError(f"accelerate_model: quantize={quantize!r} needs a float32 model (it keeps the float32 "
                         f"weights and computes in float32), got parameters of {sorted(map(str, dtypes))}")
