"""Decode-shaped linear layer: ``act(x @ weight.T * scale + bias)`` for a few rows of x."""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F

from lightgen import _build
from lightgen.ops.activation import _activation


PANEL = 64  # output columns per packed panel


def linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None = None, bias: torch.Tensor | None = None,
           act: str = "none", out_features: int = -1) -> torch.Tensor:
    """``act(x @ W.T * scale + bias)`` for ``x`` [..., K] float32.

    ``weight`` (float32, bfloat16, or int8 with a per-output-channel ``scale`` [N]) is W [N, K], a
    float32 W viewed from a contiguous [K, N] tensor (HF Conv1D's ``weight.t()``), or W packed by
    ``pack_panels`` with ``out_features`` = N.
    """
    return _build.op("linear")(x, weight, scale, bias, act, out_features)


def linear_grouped(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None,
                   bias: torch.Tensor | None, act: str, out_features: int, group_size: int) -> torch.Tensor:
    """``act(x @ W.T + bias)`` for ``x`` [..., K] float32, W quantized group-wise by ``quantize_grouped``:
    int8 panels [P, K, 64], or int4 as uint8 panels [P, ceil(K / 2), 64] (k = 2p in the low nibble of byte
    row p, 2p + 1 in the high one); ``scale`` / ``offset`` [P, ceil(K / group_size), 64] per group of
    ``group_size`` consecutive k of a column: int8 w = q * scale (+ offset, with zero points), int4
    w = u * scale + offset (u in 0..15; ``offset`` None: symmetric, offset = -8 * scale).
    """
    return _build.op("linear_grouped")(x, weight, scale, offset, bias, act, out_features, group_size)


def linear_int8_dynamic(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None,
                        sums: torch.Tensor | None, bias: torch.Tensor | None, act: str, out_features: int,
                        group_size: int) -> torch.Tensor:
    """``linear_grouped``'s int8 or int4 weights (``weight``, ``sums``: ``pack_int8_dot`` of its panels; ``scale``,
    ``offset`` its own; int4: with zero points, no ``sums``) times int8 activations: each row's groups of
    ``group_size`` k (a multiple of 4, int4: of 8) are rounded by ``quantize_activations`` and multiplied in
    int32 (``int8_dot_kernel``). Lossy: x is rounded to 8 bits per group, where ``linear_grouped`` takes
    it as it is (``linear_int8_dynamic_ref`` is the exact specification).
    """
    return _build.op("linear_int8_dynamic")(x, weight, scale, offset, sums, bias, act, out_features, group_size)


DOT_KERNELS = ("avx2", "vnni")  # linear_int8_dynamic's SIMD kernels, each faster than the one before


def int8_dot_kernel() -> str | None:
    """The SIMD kernel ``linear_int8_dynamic`` runs here, as the op picks it: "vnni" (the AVX-512 build on a CPU
    reporting avx512_vnni), "avx2" (the AVX2 build, or AVX-512 without VNNI), or the one LIGHTGEN_INT8_DOT_KERNEL
    names (auto, portable, avx2, vnni); None where only the portable one runs (no compiled SIMD kernels, or
    LIGHTGEN_INT8_DOT_KERNEL=portable), which the modules do not use: they run weight-only there."""
    best = None
    if _build.load().compiled and _build.cpu_isa() in ("AVX2", "AVX512"):
        best = "vnni" if _build.cpu_isa() == "AVX512" and "avx512_vnni" in _cpu_flags() else "avx2"
    asked = os.environ.get("LIGHTGEN_INT8_DOT_KERNEL", "").strip().lower()
    if asked in ("", "auto"):
        return best
    if asked == "portable":
        return None
    if asked not in DOT_KERNELS:
        raise ValueError(f"LIGHTGEN_INT8_DOT_KERNEL must be auto, portable, avx2 or vnni, got {asked!r}")
    if best is None or DOT_KERNELS.index(asked) > DOT_KERNELS.index(best):
        raise ValueError(f"LIGHTGEN_INT8_DOT_KERNEL={asked}: this CPU or build has no such kernel (the best here: "
                         f"{best or 'portable'})")
    return asked


def int8_dot_available() -> bool:
    """Whether ``linear_int8_dynamic`` runs a SIMD kernel here (``int8_dot_kernel``)."""
    return int8_dot_kernel() is not None


@functools.cache
def _cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as info:
            return frozenset(next((line.split(":", 1)[1].split() for line in info if line.startswith("flags")), []))
    except OSError:  # not Linux: no VNNI path
        return frozenset()


ACT_FLOOR = 1e-30  # the kernel's kActFloor: a group of smaller magnitude (zeros) quantizes to 0, not NaN


def quantize_activations(x: torch.Tensor, group_size: int):
    """x [M, K] float32 -> (a [M, G, group_size] float holding -127..127, step [M, G], group sums [M, G]):
    x ~ a * step per group, step = amax / 127, a = round(x * (127 / amax)) (to nearest even); a group holding
    inf or NaN gets step NaN, so its outputs are NaN, as float math would give."""
    rows, in_features = x.shape
    groups = -(-in_features // group_size)
    blocks = F.pad(x, (0, groups * group_size - in_features)).view(rows, groups, group_size)
    total = blocks.sum(dim=2)
    amax = blocks.abs().amax(dim=2)
    finite = torch.isfinite(amax) & torch.isfinite(total)
    amax = amax.clamp_min(ACT_FLOOR)
    inv = torch.where(finite, amax.new_tensor(127.0) / amax, 0.0)  # a true division, as the kernel's (127.0 / t
    # would multiply by a rounded reciprocal)
    a = torch.round(torch.where(finite[..., None], blocks, 0.0) * inv[..., None]).clamp_(-127, 127)
    return a, torch.where(finite, amax / 127.0, torch.nan), total


def pack_int8_dot(weight: torch.Tensor, group_size: int, in_features: int | None = None):
    """Group-wise panels (``quantize_grouped``) -> ``linear_int8_dynamic``'s weight layout and sums.

    int8 [P, K, 64] -> ([P, ceil(K / 4), 64, 4]: 4 consecutive k of a column per 32-bit lane, zero-padded; int32
    [P, G, 64]: -128 x each group's sum of q, which undoes the +128 that makes activations unsigned for vpdpbusd).
    int4 (uint8 [P, ceil(K / 2), 64]; ``in_features`` K) -> (uint8 [P, ceil(K / 8), 64, 4]: 8 consecutive k of a
    column per 32-bit lane, k0..k3 in the low nibbles of its 4 bytes and k4..k7 in the high ones, zero-padded;
    None: u in 0..15 is vpdpbusd's unsigned operand as it is).
    """
    if weight.dtype == torch.uint8:
        if group_size % 8 or in_features is None:
            raise ValueError(f"pack_int8_dot: int4 panels need in_features and a group_size that is a multiple of "
                             f"8, got {in_features}, {group_size}")
        panels = weight.shape[0]
        lanes = -(-in_features // 8)
        u = torch.stack([weight & 15, weight >> 4], dim=2).view(panels, -1, PANEL)[:, :in_features]
        u = F.pad(u, (0, 0, 0, lanes * 8 - in_features)).view(panels, lanes, 2, 4, PANEL)
        return (u[:, :, 0] | (u[:, :, 1] << 4)).transpose(2, 3).contiguous(), None
    if weight.dtype != torch.int8 or group_size % 4:
        raise ValueError(f"pack_int8_dot: needs int8 or int4 panels and a group_size that is a multiple of 4, got "
                         f"{weight.dtype}, {group_size}")
    panels, in_features, _ = weight.shape
    k4, groups = -(-in_features // 4), -(-in_features // group_size)
    padded = F.pad(weight, (0, 0, 0, groups * group_size - in_features))
    sums = padded.view(panels, groups, group_size, PANEL).sum(dim=2, dtype=torch.int32) * -128
    dot = padded[:, :k4 * 4].view(panels, k4, 4, PANEL).transpose(2, 3).contiguous()
    return dot, sums


def unpack_int8_dot(dot: torch.Tensor, in_features: int, out_features: int) -> torch.Tensor:
    """The int8 q (int4: uint8 u) [N, K] held in ``pack_int8_dot``'s layout."""
    if dot.dtype == torch.uint8:
        dot = torch.stack([dot & 15, dot >> 4], dim=3)  # [P, lanes, 64, 2, 4]: low nibbles' k first
    return dot.permute(0, 2, 1, *range(3, dot.dim())).reshape(-1, dot[0, :, 0].numel())[:out_features, :in_features]


def quantize_grouped(weight: torch.Tensor, bits: int, group_size: int, zero_points: bool = False):
    """W [N, K] float -> (packed weight, scale, offset or None) for ``linear_grouped``.

    int8: symmetric, scale = max |w| / 127 per group. int4 symmetric (Q4_0's rule): the value of largest
    magnitude maps to -8, so 16 levels are used. With ``zero_points`` (Q4_1's rule) each group's min maps to
    the lowest level and its max to the highest (15; int8: 255, stored as u - 128 with the shift folded into
    the offset, so the kernel reads int8 either way). int4's scales and offsets are float16, as Q4_0 / Q4_1 store
    them (float32: a third of int4's bytes; a Q4_1 file's own grid is kept exactly), rounded before the weights
    are, which are then rounded to them; a weight whose groups do not fit float16's range keeps float32.
    """
    if bits not in (4, 8) or group_size < 1 or (bits == 4 and group_size % 2):
        raise ValueError(f"quantize_grouped: unsupported bits={bits}, group_size={group_size}, "
                         f"zero_points={zero_points}")
    weight = weight.detach().float()
    out_features, in_features = weight.shape
    groups, span = -(-in_features // group_size), min(group_size, in_features)  # group_size >= K: one group
    padded = weight.new_zeros(out_features, groups * span)
    padded[:, :in_features] = weight
    blocks = padded.view(out_features, groups, span)
    quantized = _quantize_blocks(blocks, in_features, bits, zero_points, torch.float16) if bits == 4 else None
    q, scale, offset = quantized or _quantize_blocks(blocks, in_features, bits, zero_points, torch.float32)
    q = q.view(out_features, -1)[:, :in_features]
    if bits == 4:
        if in_features % 2:
            q = torch.cat([q, q.new_zeros(out_features, 1)], dim=1)
        q = q[:, 0::2] | (q[:, 1::2] << 4)
    # [N, G] per-group values are laid out as panels too: [ceil(N / 64), G, 64].
    return pack_panels(q), pack_panels(scale), None if offset is None else pack_panels(offset)


def _quantize_blocks(blocks: torch.Tensor, in_features: int, bits: int, zero_points: bool, dtype: torch.dtype):
    """Blocks [N, G, span] -> (q [N, G, span], scale [N, G], offset [N, G] or None), the scales and offsets in
    ``dtype`` and q rounded to them; None where a group's scale or offset does not fit ``dtype``."""
    # The smallest scale: float32's smallest normal, float16's smallest subnormal (a scale rounded coarsely there
    # still leaves q rounded to it).
    tiny = torch.finfo(torch.float32).tiny if dtype == torch.float32 else 2.0 ** -24
    offset = None
    if zero_points:
        # Padding zeros outside the weight must not widen the last group's range.
        groups, span = blocks.shape[1:]
        valid = (torch.arange(groups * span) < in_features).view(groups, span)
        low = torch.where(valid, blocks, torch.inf).amin(dim=2)
        high = torch.where(valid, blocks, -torch.inf).amax(dim=2)
        levels = (1 << bits) - 1
        scale, low = ((high - low) / levels).clamp_min(tiny).to(dtype), low.to(dtype)
        u = torch.round((blocks - low.float()[..., None]) / scale.float()[..., None]).clamp_(0, levels)
        if bits == 8:
            q, offset = (u - 128).to(torch.int8), low + 128 * scale
        else:
            q, offset = u.to(torch.uint8), low
    elif bits == 8:
        scale = (blocks.abs().amax(dim=2).clamp_min(tiny) / 127.0).to(dtype)
        q = torch.round(blocks / scale.float()[..., None]).clamp_(-127, 127).to(torch.int8)
    else:
        extreme = blocks.gather(2, blocks.abs().argmax(dim=2, keepdim=True))[..., 0]
        # Signed opposite to the extreme, so that it maps to -8; at least tiny in magnitude.
        magnitude = (extreme.abs() / 8.0).clamp_min(tiny).to(dtype)
        scale = torch.where(extreme < 0, magnitude, -magnitude)
        q = (torch.round(blocks / scale.float()[..., None]).clamp_(-8, 7) + 8).to(torch.uint8)
    if not all(t.isfinite().all() for t in (scale, offset) if t is not None):
        return None
    return q, scale, offset


def dequantize_grouped(weight, scale, offset, group_size, in_features, out_features) -> torch.Tensor:
    """The float W [N, K] that ``linear_grouped`` multiplies by (the specification of its format)."""
    q = unpack_panels(weight, out_features)
    if weight.dtype == torch.uint8:
        q = torch.stack([q & 15, q >> 4], dim=2).view(out_features, -1)[:, :in_features]
    q = q.float()

    def per_weight(per_group):
        span = min(group_size, in_features)
        return unpack_panels(per_group, out_features).float().repeat_interleave(span, dim=1)[:, :in_features]

    if offset is not None:
        return q * per_weight(scale) + per_weight(offset)
    return q * per_weight(scale) + (0.0 if weight.dtype == torch.int8 else -8.0 * per_weight(scale))


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """W [N, K] -> panels [ceil(N / 64), K, 64]: each panel's 64 output columns, k after k (zero-padded)."""
    out_features, in_features = weight.shape
    panels = -(-out_features // PANEL)
    padded = weight.new_zeros(panels * PANEL, in_features)
    padded[:out_features] = weight
    return padded.view(panels, PANEL, in_features).transpose(1, 2).contiguous()


def unpack_panels(packed: torch.Tensor, out_features: int) -> torch.Tensor:
    return packed.transpose(1, 2).reshape(-1, packed.shape[1])[:out_features]


def linear_ref(x, weight, scale, bias, act, out_features=-1):
    if weight.dim() == 3:
        weight = unpack_panels(weight, out_features)
    weight = weight.float()
    if scale is not None:
        weight = weight * scale[:, None]
    return _activation(act)(F.linear(x, weight, bias))


def linear_grouped_ref(x, weight, scale, offset, bias, act, out_features, group_size):
    w = dequantize_grouped(weight, scale, offset, group_size, x.shape[-1], out_features)
    return _activation(act)(F.linear(x, w, bias))


def linear_int8_dynamic_ref(x, weight, scale, offset, sums, bias, act, out_features, group_size):
    """The specification: y = sum over groups g of step[m, g] scale[n, g] (sum_k a[m, k] q[n, k]) (+ offset[n, g]
    x S[m, g]), + bias. int8: q, S the float sum of row m's group g; int4: u, S = step[m, g] x the sum of its a (the
    rounded x's sum: y is then the rounded x times the dequantized w, whose offset is the group's minimum). ``sums``
    is the kernel's means, not part of the result."""
    if weight.dtype == torch.uint8 and offset is None:
        raise ValueError("linear_int8_dynamic: int4 weights need their 'offset' (zero points)")
    in_features = x.shape[-1]
    rows = x.reshape(-1, in_features)
    a, step, total = quantize_activations(rows, group_size)
    groups = a.shape[1]
    q = F.pad(unpack_int8_dot(weight, in_features, out_features).float(), (0, groups * group_size - in_features))
    dots = torch.einsum("mgk,ngk->mng", a, q.view(out_features, groups, group_size))  # integers, exact in fp32
    per_group = unpack_panels(scale, out_features).float()  # [N, G]
    y = (dots * step[:, None, :] * per_group).sum(dim=2)
    if offset is not None:
        if weight.dtype == torch.uint8:
            total = step * a.sum(dim=2)
        y = y + total @ unpack_panels(offset, out_features).float().t()
    if bias is not None:
        y = y + bias
    return _activation(act)(y).view(*x.shape[:-1], out_features)


def _linear_fake(x, weight, scale, bias, act, out_features=-1):
    return x.new_empty((*x.shape[:-1], out_features if weight.dim() == 3 else weight.shape[0]))


def _linear_grouped_fake(x, weight, scale, offset, bias, act, out_features, group_size):
    return x.new_empty((*x.shape[:-1], out_features))


def _linear_int8_dynamic_fake(x, weight, scale, offset, sums, bias, act, out_features, group_size):
    return x.new_empty((*x.shape[:-1], out_features))


REFERENCES = {"linear": linear_ref, "linear_grouped": linear_grouped_ref,
              "linear_int8_dynamic": linear_int8_dynamic_ref}
FAKES = {"linear": _linear_fake, "linear_grouped": _linear_grouped_fake,
         "linear_int8_dynamic": _linear_int8_dynamic_fake}
