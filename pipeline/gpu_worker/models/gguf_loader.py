"""Reading a GGUF file's tensors as checkpoint tensors, its quantized linear weights as codes and scales.

A quantized linear weight ``<name>.weight`` becomes three tensors in the
layout of ``pipeline.gpu_worker.layers.quant``: ``<name>.weight`` (codes),
``<name>.weight_scale`` and, where the layout has one, ``<name>.weight_zero``,
each ``[out, ...]`` so the layer's weight loader shards them like the weight.
ggml's block formats (ggml-common.h; ``d``, ``dmin`` and ``m`` are f16):

- Q4_0, 18-byte blocks of 32: ``d``, 16 bytes of nibbles (the low nibbles
  are elements 0..15, the high ones 16..31); ``w = d (q - 8)``: int4 with
  ``scale = d``, ``zero = 0``.
- Q4_1, 20-byte blocks: ``d``, ``m``, nibbles; ``w = d q + m``: int4 with
  ``scale = d``, ``zero = m + 8 d`` (exact up to the rounding of that sum).
- Q8_0, 34-byte blocks: ``d``, 32 int8; ``w = d q``: int8 in groups of 32.
- Q4_K, 144-byte super-blocks of 256: ``d``, ``dmin``, 12 bytes holding
  eight 6-bit scales ``sc`` and mins ``m``, 128 bytes of nibbles (each 32
  bytes: the low nibbles are one sub-block of 32, the high ones the next);
  ``w = d sc q - dmin m``: int4 in groups of 32 with ``scale = d sc``,
  ``zero = 8 scale - dmin m``.
- Q5_K, 176 bytes: ``d``, ``dmin``, the 12 scale bytes, 32 bytes of high
  bits (bit ``j`` of byte ``l``: element ``l`` of sub-block ``j``), the
  nibbles as in Q4_K; the same formula with 5-bit ``q``: int8 codes with a
  zero, groups of 32, ``scale = d sc``, ``zero = -dmin m``.
- Q6_K, 210 bytes: 128 bytes of low nibbles, 64 of 2-bit high parts, 16
  int8 scales ``sc``, ``d``; ``w = d sc (q - 32)``: int8 in groups of 16,
  ``scale = d sc``.

Q4_K_M files mix types within one fused layer (Q6_K values beside Q4_K
queries and keys); such a layer holds the one layout all its parts fit
exactly (``quant_layout.common_layout``). The LM head (``output.weight``,
else the tied ``token_embd.weight``) in one of those types is kept the same
way, in a head of its own (``CausalLM.untie_lm_head``). Every other tensor
(the embedding, also where it is the tied head's, and the norms) is
dequantized to float with gguf-py's ``dequantize``: the embedding is a row
gather. llama.cpp's converter permutes the
rows of the query and key projections for its rotary layout; they are
permuted back, as transformers does, codes and scales alike.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from pipeline.common.gguf_layout import FLOAT, KEPT, hf_name, is_linear
from pipeline.gpu_worker.models.base import CausalLM, CheckpointError
from pipeline.gpu_worker.models.gguf_index import GGUFTensor, read_tensors
from pipeline.gpu_worker.models.quant_layout import Layout, common_layout, to_layout

_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34, "Q4_K": 144, "Q5_K": 176, "Q6_K": 210}


def layer_quantization(path: Path, model: CausalLM) -> dict[str, Layout]:
    """``{module name: layout}`` of the model's linear layers the GGUF file holds quantized.

    Raises:
        CheckpointError: a linear weight of a type not in ``KEPT`` (naming it), or a file that cannot be read
            (``_tensors``).
    """
    found: dict[str, list[Layout]] = {}
    tensors = _tensors(path)
    head = _head_tensor(tensors)
    if head is not None and head.tensor_type.name in KEPT:
        found["lm_head"] = [KEPT[head.tensor_type.name]]
    for t in tensors:
        kind = t.tensor_type.name
        if not is_linear(t.name) or kind in FLOAT:
            continue
        if kind not in KEPT:
            raise CheckpointError(
                f"{path.name}: tensor {t.name} is {kind}, which is not served quantized yet "
                f"(kept quantized: {', '.join(KEPT)}); pass --quantization none to expand it to --dtype"
            )
        target = model.parameter_of(hf_name(t.name))
        found.setdefault(target[0].removesuffix(".weight"), []).append(KEPT[kind])
    return {module: common_layout(layouts) for module, layouts in found.items()}


def read_gguf(path: Path, model: CausalLM, shapes_only: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """``(checkpoint name, tensor)`` for every tensor of the GGUF file, as described above (meta tensors of the
    same shapes and dtypes with ``shapes_only``), quantized ones in the layout of the layer they fill.

    Raises:
        CheckpointError: as ``layer_quantization``.
    """
    import gguf

    config = model.config
    heads = {"attn_q": config.num_attention_heads, "attn_k": config.num_key_value_heads}
    modules = dict(model.named_modules())
    tensors = _tensors(path)
    head = _head_tensor(tensors) if getattr(modules.get("lm_head"), "quant_bits", None) else None
    for t in tensors:
        name = hf_name(t.name)
        if name is None:
            continue
        kind = t.tensor_type.name
        rows, cols = (int(t.shape[1]), int(t.shape[0])) if len(t.shape) == 2 else (None, int(t.shape[0]))
        n_heads = heads.get(t.name.split(".")[2]) if t.name.startswith("blk.") else None
        if t is head and name != "lm_head.weight":
            # A tied table: as codes for the head, and dequantized for the embedding (below).
            yield from _quantized(t, "lm_head.weight", modules["lm_head"], rows, cols, None, shapes_only)
        if not (kind in KEPT and (is_linear(t.name) or (t is head and name == "lm_head.weight"))):
            shape = (cols,) if rows is None else (rows, cols)
            if shapes_only:
                yield name, torch.empty(shape, device="meta")
                continue
            data = t.data if kind in FLOAT else gguf.quants.dequantize(t.data, t.tensor_type)
            tensor = torch.from_numpy(np.array(data, dtype=np.float32)).reshape(shape)
            yield name, tensor if n_heads is None else _unpermute(tensor, n_heads)
            continue
        layer = modules[model.parameter_of(name)[0].removesuffix(".weight")]
        yield from _quantized(t, name, layer, rows, cols, n_heads, shapes_only)
    if not shapes_only:  # the last pass: the mapped pages go
        _tensors.cache_clear()


def _quantized(
    t: GGUFTensor, name: str, layer, rows: int, cols: int, n_heads: int | None, shapes_only: bool
) -> Iterator[tuple[str, torch.Tensor]]:
    """Checkpoint tensor ``name``'s codes, scale and zero, from GGUF tensor ``t`` in ``layer``'s layout."""
    import gguf

    if shapes_only:
        block, block_bytes = gguf.GGML_QUANT_SIZES[t.tensor_type]
        raw = torch.empty(rows, cols // block * block_bytes, dtype=torch.uint8, device="meta")
    else:
        raw = torch.from_numpy(np.array(t.data))
    parts = decode(t.tensor_type.name, raw)
    if n_heads is not None:
        parts = tuple(None if part is None else _unpermute(part, n_heads) for part in parts)
    codes, scale, zero = to_layout(layer, *parts)
    yield name, codes
    yield name + "_scale", scale
    if zero is not None:
        yield name + "_zero", zero


def _head_tensor(tensors: list[GGUFTensor]) -> GGUFTensor | None:
    """The tensor the LM head multiplies by: ``output.weight``, else (tied) ``token_embd.weight``."""
    by_name = {t.name: t for t in tensors}
    return by_name.get("output.weight", by_name.get("token_embd.weight"))


@functools.cache
def _tensors(path: Path) -> list[GGUFTensor]:
    """The file's tensors, shared by the passes over it.

    Raises:
        CheckpointError: the file cannot be read, e.g. a tensor's data runs past the end of the file.
    """
    try:
        return read_tensors(path)
    except (ValueError, IndexError) as e:
        raise CheckpointError(f"{path.name}: not a readable GGUF file, truncated or corrupt ({e})") from None


def decode(kind: str, raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``raw [rows, blocks * block bytes]`` uint8 of one ggml block type (``KEPT``) -> ``(codes, scale, zero)``
    in its layout (``KEPT[kind]``; zero None for the symmetric ones), float32 scales."""
    rows = raw.shape[0]
    blocks = raw.reshape(rows, -1, _BLOCK_BYTES[kind])

    def f16(offset: int) -> torch.Tensor:
        return blocks[..., offset : offset + 2].contiguous().view(torch.float16).float()

    def flat(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(rows, -1)

    if kind == "Q8_0":
        return flat(blocks[..., 2:].contiguous().view(torch.int8)), flat(f16(0)), None
    if kind in ("Q4_0", "Q4_1"):
        d = flat(f16(0))
        nibbles = blocks[..., 4:] if kind == "Q4_1" else blocks[..., 2:]
        codes = flat(torch.cat([nibbles & 0x0F, nibbles >> 4], dim=-1))
        return codes, d, flat(f16(2)) + 8 * d if kind == "Q4_1" else torch.zeros_like(d)
    if kind == "Q6_K":
        # Each half of 128 weights: 64 bytes of low 4 bits (byte l < 32: element l in its low nibble, l + 64 in
        # its high one; byte 32 + l: elements 32 + l and 96 + l) and 32 bytes of high 2 bits (bits 2k..2k+1
        # of byte l: element 32 k + l).
        low = blocks[..., :128].reshape(rows, -1, 2, 1, 2, 32)
        low = torch.cat([low & 0x0F, low >> 4], dim=3)
        high = blocks[..., 128:192].reshape(rows, -1, 2, 1, 32)
        high = (high >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=raw.device)[:, None]) & 3
        codes = (low.reshape(high.shape) | (high << 4)).to(torch.int8) - 32
        sc = blocks[..., 192:208].contiguous().view(torch.int8).float()
        return flat(codes), flat(f16(208) * sc), None
    # Q4_K, Q5_K: eight 6-bit scales and mins in 12 bytes. Bytes 0..3 and 4..7 hold scales and mins 0..3 in
    # their low 6 bits; bytes 8..11 the low 4 bits of scales (low nibble) and mins (high nibble) 4..7, whose
    # top 2 bits are the top 2 bits of bytes 0..3 and 4..7.
    packed = blocks[..., 4:16]
    a, b, c = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    sc = torch.cat([a & 63, (c & 0x0F) | ((a >> 6) << 4)], dim=-1).float()
    m = torch.cat([b & 63, (c >> 4) | ((b >> 6) << 4)], dim=-1).float()
    scale, minimum = f16(0) * sc, f16(2) * m
    nibbles = blocks[..., -128:].reshape(rows, -1, 4, 1, 32)
    codes = torch.cat([nibbles & 0x0F, nibbles >> 4], dim=3).reshape(rows, -1, 8, 32)
    if kind == "Q4_K":
        return flat(codes), flat(scale), flat(8 * scale - minimum)
    shifts = torch.arange(8, dtype=torch.uint8, device=raw.device)[:, None]
    high = (blocks[..., 16:48].reshape(rows, -1, 1, 32) >> shifts) & 1
    return flat((codes | (high << 4)).to(torch.int8)), flat(scale), flat(-minimum)


def _unpermute(rows: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's rotary permutation of a query or key projection's rows (transformers' ``reverse_permute``)."""
    shape = rows.shape
    return rows.reshape(n_heads, shape[0] // n_heads // 2, 2, *shape[1:]).transpose(1, 2).reshape(shape)
