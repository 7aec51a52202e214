"""The CPU weight-only matmuls of ``quant_cpu.cpp``, compiled for this CPU at first use and cached: ``matmul``
(int4 and int8 codes, group-wise, in float32; needs AVX2 and FMA) and ``matmul_vnni`` (int8 activations, integer
dot products; needs AVX-512 VNNI). Layouts and blocking: docs/design.md, "Quantized weights".
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from pipeline.gpu_worker.attention import kernel_cache

_SOURCE = Path(__file__).with_name("quant_cpu.cpp")
# -march=native: built on the machine that runs it, so its widest vectors are used. No -ffast-math: the sums keep
# their float32 rounding. -fopenmp: at::parallel_for is inline OpenMP in torch's CPU builds, and without it runs on
# one thread.
_CFLAGS = ["-O3", "-march=native", "-fopenmp"]
# Output rows per code tile; a weight's output count must be a multiple of it.
TILE = 16


@functools.cache
def unavailable_reason() -> str | None:
    """None once the kernel (``torch.ops.pipeline_quant_cpu``) is built and loaded, building it if needed; else why
    it cannot be."""
    try:
        kernel_cache.load("pipeline_quant_cpu", _SOURCE, _CFLAGS)
    except kernel_cache.KernelUnavailable as e:
        return str(e)
    if not torch.ops.pipeline_quant_cpu.supported():
        return "this CPU lacks AVX2 and FMA"
    return None


def pack(
    codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, bits: int
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``codes [out, in]``, ``scale``/``zero [out, groups]`` (``quant.quantize_rtn``'s layout) -> the kernel's
    ``(codes, coef)`` (layouts in ``quant_cpu.cpp``), or None where the kernel cannot take this weight (not on the
    CPU, ``out`` not a multiple of 16, int8 with a zero (its int8 is symmetric), or the kernel unavailable)."""
    out, inp = codes.shape
    if bits == 8 and zero is not None:
        return None
    if codes.device.type != "cpu" or out % TILE or unavailable_reason() is not None:
        return None
    # b = zero - 8 a is rounded once, from float64: w = q a + b is then within float32 rounding of (q - 8) a + zero.
    scale64 = scale.double()
    parts = [scale64] if zero is None else [scale64, zero.double() - 8 * scale64]
    coef = torch.stack([_by_tile(p) for p in parts], dim=2).float().contiguous()  # [tiles, groups, 1 or 2, 16]
    q = _by_tile(codes)
    if zero is None:
        return q.to(torch.int8).contiguous(), coef
    q = q.to(torch.uint8)
    return (q[..., :8] | (q[..., 8:] << 4)).contiguous(), coef


def _by_tile(t: torch.Tensor) -> torch.Tensor:
    """``[out, cols]`` -> ``[out / 16, cols, 16]``."""
    return t.reshape(t.shape[0] // TILE, TILE, t.shape[1]).transpose(1, 2)


def matmul(x: torch.Tensor, codes: torch.Tensor, coef: torch.Tensor, bits: int, group_size: int) -> torch.Tensor:
    """``x [N, in]`` times the weight ``pack`` made, transposed -> ``[N, out]`` in ``x``'s dtype (computed in
    float32)."""
    return torch.ops.pipeline_quant_cpu.quant_linear(x, codes, coef, bits, group_size)


@functools.cache
def vnni_unavailable_reason() -> str | None:
    """None where ``quant_linear_vnni`` runs (the kernel built, with AVX-512 VNNI); else why not."""
    reason = unavailable_reason()
    if reason is None and not torch.ops.pipeline_quant_cpu.vnni_supported():
        return "this CPU lacks AVX-512 VNNI"
    return reason


def pack_vnni(
    codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, bits: int
) -> tuple[torch.Tensor, torch.Tensor, int] | None:
    """Like ``pack``, for ``matmul_vnni``: ``(codes, coef, block_size)`` (layouts in ``quant_cpu.cpp``), or None
    where that kernel cannot take the weight (``out`` not a multiple of 16, a group size not a multiple of 16)."""
    out, inp = codes.shape
    group_size = inp // scale.shape[1]
    if codes.device.type != "cpu" or out % TILE or group_size % 16 or vnni_unavailable_reason() is not None:
        return None
    tiles = out // TILE
    # w = c a + b with unsigned codes c: int4's q (w = (q - 8) scale + zero), int8's q + 128; b is rounded once,
    # from float64.
    offset = 8 if bits == 4 else 128
    scale64 = scale.double()
    b = (0 if zero is None else zero.double()) - offset * scale64
    coef = torch.stack([_by_tile(p) for p in (scale64, b)], dim=2).float().contiguous()  # [tiles, groups, 2, 16]
    if bits == 4:
        q = codes.to(torch.uint8).reshape(tiles, TILE, inp // 8, 2, 4)
        q = q[..., 0, :] | (q[..., 1, :] << 4)  # [tiles, 16, in / 8, 4]
    else:
        q = (codes.to(torch.int16) + 128).to(torch.uint8).reshape(tiles, TILE, inp // 4, 4)
    # The activations' blocks: the widest that stays within a group (llama.cpp's q8_K blocks are 256 wide).
    block_size = next(n for n in (256, 128, 64, 32, 16) if group_size % n == 0)
    return q.transpose(1, 2).contiguous(), coef, block_size


def matmul_vnni(
    x: torch.Tensor, codes: torch.Tensor, coef: torch.Tensor, bits: int, group_size: int, block_size: int
) -> torch.Tensor:
    """``x [N, in]``, rounded to int8 per row in blocks of ``block_size`` columns, times the weight ``pack_vnni``
    made, transposed -> ``[N, out]`` in ``x``'s dtype."""
    return torch.ops.pipeline_quant_cpu.quant_linear_vnni(x, codes, coef, bits, group_size, block_size)
