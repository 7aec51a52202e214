"""The CPU weight-only matmul of ``quant_cpu.cpp`` (int4 and int8 codes, group-wise, in float32), compiled for
this CPU at first use and cached; needs AVX2 and FMA. Layouts and blocking: docs/design.md, "Quantized weights".
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from pipeline.gpu_worker.attention import kernel_cache

_SOURCE = Path(__file__).with_name("quant_cpu.cpp")
# -march=native: built on the machine that runs it, so its widest vectors are used. No -ffast-math: the sums keep
# their float32 rounding.
_CFLAGS = ["-O3", "-march=native"]
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
    tiles = out // TILE

    def by_tile(t: torch.Tensor) -> torch.Tensor:  # [out, cols] -> [tiles, cols, 16]
        return t.reshape(tiles, TILE, t.shape[1]).transpose(1, 2)

    # b = zero - 8 a is rounded once, from float64: w = q a + b is then within float32 rounding of (q - 8) a + zero.
    scale64 = scale.double()
    parts = [scale64] if zero is None else [scale64, zero.double() - 8 * scale64]
    coef = torch.stack([by_tile(p) for p in parts], dim=2).float().contiguous()  # [tiles, groups, 1 or 2, 16]
    q = by_tile(codes)
    if zero is None:
        return q.to(torch.int8).contiguous(), coef
    q = q.to(torch.uint8)
    return (q[..., :8] | (q[..., 8:] << 4)).contiguous(), coef


def matmul(x: torch.Tensor, codes: torch.Tensor, coef: torch.Tensor, bits: int, group_size: int) -> torch.Tensor:
    """``x [N, in]`` times the weight ``pack`` made, transposed -> ``[N, out]`` in ``x``'s dtype (computed in
    float32)."""
    return torch.ops.pipeline_quant_cpu.quant_linear(x, codes, coef, bits, group_size)
