"""Reading a GGUF file's tensors as checkpoint tensors, its Q4_0 / Q4_1 / Q8_0 linear weights as codes and scales.

A quantized linear weight ``<name>.weight`` becomes three tensors in the
layout of ``pipeline.gpu_worker.layers.quant``: ``<name>.weight`` (codes),
``<name>.weight_scale`` and, for 4 bits, ``<name>.weight_zero``, each
``[out, ...]`` so the layer's weight loader shards them like the weight
(ggml's block formats, from ggml-common.h):

- Q4_0, 18-byte blocks of 32: ``d`` (f16), 16 bytes of nibbles (the low
  nibbles are elements 0..15, the high ones 16..31); ``w = d (q - 8)``:
  int4 with ``scale = d``, ``zero = 0``.
- Q4_1, 20-byte blocks: ``d``, ``m`` (f16), nibbles; ``w = d q + m``: int4
  with ``scale = d``, ``zero = m + 8 d`` (exact up to the rounding of that sum
  in the model dtype).
- Q8_0, 34-byte blocks: ``d`` (f16), 32 int8; ``w = d q``: int8 in groups of 32.

Every other tensor (embeddings, norms, an untied LM head) is dequantized to
float with gguf-py's ``dequantize``: the embedding is a row gather, and the
LM head is also the embedding in the tied models this reads. llama.cpp's
converter permutes the rows of the query and key projections for its rotary
layout; they are permuted back, as transformers does, codes and scales alike.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from pipeline.common.gguf_layout import FLOAT, KEPT, hf_name, is_linear
from pipeline.gpu_worker.models.base import CausalLM, CheckpointError

_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}


def layer_quantization(path: Path, model: CausalLM) -> dict[str, tuple[int, int]]:
    """``{module name: (bits, group size)}`` of the model's linear layers the GGUF file holds quantized.

    Raises:
        CheckpointError: a linear weight of a type not in ``KEPT`` (naming it), the parts of one fused
            layer (q, k and v) in different types, or a file gguf-py cannot read (``_reader``).
    """
    found: dict[str, tuple[tuple[int, int], str]] = {}
    for t in _reader(path).tensors:
        kind = t.tensor_type.name
        if not is_linear(t.name) or kind in FLOAT:
            continue
        if kind not in KEPT:
            raise CheckpointError(
                f"{path.name}: tensor {t.name} is {kind}, which is not served quantized yet "
                f"(kept quantized: {', '.join(KEPT)}); pass --quantization none to expand it to --dtype"
            )
        target = model.parameter_of(hf_name(t.name))
        module = target[0].removesuffix(".weight")
        if module in found and found[module][0] != KEPT[kind]:
            raise CheckpointError(
                f"{path.name}: tensors {found[module][1]} and {t.name} fill one layer, {module}, "
                "in different quantized types; pass --quantization none"
            )
        found[module] = (KEPT[kind], t.name)
    return {m: spec for m, (spec, _) in found.items()}


def read_gguf(path: Path, model: CausalLM, shapes_only: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """``(checkpoint name, tensor)`` for every tensor of the GGUF file, as described above (meta tensors of the
    same shapes and dtypes with ``shapes_only``).

    Raises:
        CheckpointError: as ``layer_quantization``.
    """
    import gguf

    config = model.config
    heads = {"attn_q": config.num_attention_heads, "attn_k": config.num_key_value_heads}
    for t in _reader(path).tensors:
        name = hf_name(t.name)
        if name is None:
            continue
        kind = t.tensor_type.name
        rows, cols = (int(t.shape[1]), int(t.shape[0])) if len(t.shape) == 2 else (None, int(t.shape[0]))
        n_heads = heads.get(t.name.split(".")[2]) if t.name.startswith("blk.") else None
        if not (is_linear(t.name) and kind in KEPT):
            shape = (cols,) if rows is None else (rows, cols)
            if shapes_only:
                yield name, torch.empty(shape, device="meta")
                continue
            data = t.data if kind in FLOAT else gguf.quants.dequantize(t.data, t.tensor_type)
            tensor = torch.from_numpy(np.array(data, dtype=np.float32)).reshape(shape)
            yield name, tensor if n_heads is None else _unpermute(tensor, n_heads)
            continue
        parts = _meta_parts(kind, rows, cols) if shapes_only else _decode(kind, torch.from_numpy(np.array(t.data)))
        for suffix, part in zip(("", "_scale", "_zero"), parts, strict=False):
            yield name + suffix, part if n_heads is None or shapes_only else _unpermute(part, n_heads)
    if not shapes_only:  # the last pass: the mapped pages and parsed fields (225 MiB for SmolLM2's file) go
        _reader.cache_clear()


@functools.cache
def _reader(path: Path):
    """The file's parsed index (seconds to build for a large vocabulary), shared by the passes over it.

    Raises:
        CheckpointError: gguf-py cannot parse it, e.g. a tensor's data runs past the end of the file.
    """
    import gguf

    try:
        return gguf.GGUFReader(path)
    except (ValueError, IndexError) as e:
        raise CheckpointError(f"{path.name}: not a readable GGUF file, truncated or corrupt ({e})") from None


def _decode(kind: str, raw: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``raw [rows, blocks * block bytes]`` uint8 of one ggml block type -> codes, scale (and zero), float32 scales."""
    rows = raw.shape[0]
    blocks = raw.reshape(rows, -1, _BLOCK_BYTES[kind])

    def f16(offset: int) -> torch.Tensor:
        return blocks[..., offset : offset + 2].contiguous().view(torch.float16).reshape(rows, -1).float()

    d = f16(0)
    if kind == "Q8_0":
        return blocks[..., 2:].contiguous().view(torch.int8).reshape(rows, -1), d
    nibbles = blocks[..., 4:] if kind == "Q4_1" else blocks[..., 2:]
    codes = torch.cat([nibbles & 0x0F, nibbles >> 4], dim=-1).reshape(rows, -1)
    zero = f16(2) + 8 * d if kind == "Q4_1" else torch.zeros_like(d)
    return codes, d, zero


def _meta_parts(kind: str, rows: int, cols: int) -> tuple[torch.Tensor, ...]:
    groups = cols // 32
    if kind == "Q8_0":
        return torch.empty(rows, cols, dtype=torch.int8, device="meta"), torch.empty(rows, groups, device="meta")
    return (
        torch.empty(rows, cols, dtype=torch.uint8, device="meta"),
        torch.empty(rows, groups, device="meta"),
        torch.empty(rows, groups, device="meta"),
    )


def _unpermute(rows: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's rotary permutation of a query or key projection's rows (transformers' ``reverse_permute``)."""
    shape = rows.shape
    return rows.reshape(n_heads, shape[0] // n_heads // 2, 2, *shape[1:]).transpose(1, 2).reshape(shape)
