"""Quantized layers' layouts: which a layer holds, and a checkpoint tensor's codes re-expressed in it.

A layer's layout is ``(bits, group size, zero)``: int4 or int8 codes
(``layers/quant.py``), input columns per scale (None: a row), whether it has
a zero. Shared by the loaders of each format (``quantized``, ``gguf_loader``,
``packed_loader``).
"""

from __future__ import annotations

import math

import torch

from pipeline.gpu_worker.layers.linear import LinearBase, RowParallelLinear
from pipeline.gpu_worker.models.base import CausalLM

Layout = tuple[int, int | None, bool]


def quantized_layer(model: CausalLM, modules: dict, name: str) -> LinearBase | None:
    """The quantized layer whose weight checkpoint tensor ``name`` fills, or None."""
    target = model.parameter_of(name)
    layer = modules.get(target[0].removesuffix(".weight")) if target and target[0].endswith(".weight") else None
    return layer if getattr(layer, "quant_bits", None) is not None else None


def common_layout(layouts: list[Layout]) -> Layout:
    """The layout holding each of ``layouts`` exactly (the parts of one fused layer): theirs where they agree;
    else int4 only if all are, a zero if any has one, groups of the greatest common group size (all given)."""
    if len(set(layouts)) == 1:
        return layouts[0]
    bits = 4 if all(b == 4 for b, _, _ in layouts) else 8
    return bits, math.gcd(*(g for _, g, _ in layouts)), any(z for _, _, z in layouts)


def to_layout(
    layer: LinearBase, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A full checkpoint tensor's ``codes``/``scale``/``zero`` re-expressed exactly in ``layer``'s layout (see
    ``common_layout``): int4 codes as int8 ``q - 8``, a missing zero as 0, each scale and zero repeated over
    the layer's groups within its own.

    Raises:
        ValueError: the tensor's groups do not split into the layer's.
    """
    groups = full_groups(layer)
    if groups % scale.shape[1]:
        raise ValueError(f"{scale.shape[1]} groups per row in the checkpoint do not split into the layer's {groups}")
    if layer.weight.dtype == torch.int8 and codes.dtype == torch.uint8:
        codes = codes.to(torch.int8) - 8
    if hasattr(layer, "weight_zero"):
        zero = torch.zeros_like(scale) if zero is None else zero
    repeat = groups // scale.shape[1]
    if repeat > 1:
        scale = scale.repeat_interleave(repeat, dim=1)
        zero = None if zero is None else zero.repeat_interleave(repeat, dim=1)
    return codes, scale, zero


def full_groups(layer: LinearBase) -> int:
    """The groups of a row of the full checkpoint tensor that fills a quantized ``layer`` (its own count this
    rank's columns; a row-parallel layer's full tensor has tp times more)."""
    return layer.weight_scale.shape[1] * (layer.tp.size if isinstance(layer, RowParallelLinear) else 1)
