"""A GGUF file's tensors (name, type, shape, data mapped from the file), reading past the metadata without
decoding it. gguf-py's ``GGUFReader`` decodes every metadata value first: about 3 s for SmolLM2's 49152-token
vocabulary and merges, which the weights do not need. The layout is ggml's docs/gguf.md (version 2 and 3);
the tensors' types, byte sizes and data arrays are gguf-py's (``ReaderTensor``'s ``tensor_type``, ``shape``
and ``data``)."""

from __future__ import annotations

import struct
from pathlib import Path
from typing import NamedTuple

import numpy as np

# Bytes of each fixed-size metadata value type (gguf.GGUFValueType: 8 is a string, 9 an array).
_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9
_ALIGNMENT_KEY = b"general.alignment"


class GGUFTensor(NamedTuple):
    name: str
    tensor_type: object  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # ggml's order: the row length first
    data: np.ndarray  # F32 / F16: typed, [rows..., row]; other types: uint8, [rows..., row bytes]


def read_tensors(path: Path) -> list[GGUFTensor]:
    """The file's tensors, their data mapped read-only.

    Raises:
        ValueError: not a GGUF file of version 2 or 3, an unknown metadata or tensor type, or a tensor whose
            data runs past the end of the file.
    """
    import gguf

    data = np.memmap(path, mode="r")
    buf = memoryview(data)
    if bytes(buf[:4]) != b"GGUF":
        raise ValueError("no GGUF magic number")
    version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version}; versions 2 and 3 are read")
    pos, alignment = 24, gguf.GGUF_DEFAULT_ALIGNMENT
    try:
        for _ in range(n_kv):
            key, pos = _string(buf, pos)
            (kind,) = struct.unpack_from("<I", buf, pos)
            if key == _ALIGNMENT_KEY and kind == 4:
                (alignment,) = struct.unpack_from("<I", buf, pos + 4)
            pos = _skip_value(buf, kind, pos + 4)
        infos = []
        for _ in range(n_tensors):
            name, pos = _string(buf, pos)
            (n_dims,) = struct.unpack_from("<I", buf, pos)
            dims = struct.unpack_from(f"<{n_dims}Q", buf, pos + 4)
            kind, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * n_dims)
            pos += 16 + 8 * n_dims
            infos.append((name.decode(), dims, gguf.GGMLQuantizationType(kind), offset))
    except struct.error as e:
        raise ValueError(f"the metadata runs past the end of the file ({e})") from None
    start = -(-pos // alignment) * alignment
    tensors = []
    for name, dims, kind, offset in infos:
        block, block_bytes = gguf.GGML_QUANT_SIZES[kind]
        rows = tuple(reversed(dims))
        if kind == gguf.GGMLQuantizationType.F32 or kind == gguf.GGMLQuantizationType.F16:
            dtype, count, shape = (np.float32 if kind.name == "F32" else np.float16), int(np.prod(dims)), rows
        else:
            dtype, shape = np.uint8, (*rows[:-1], rows[-1] // block * block_bytes)
            count = int(np.prod(shape))
        begin = start + offset
        end = begin + count * np.dtype(dtype).itemsize
        if end > len(data):
            raise ValueError(f"tensor {name}'s data ends at byte {end}, past the file's end at {len(data)}")
        tensors.append(GGUFTensor(name, kind, dims, data[begin:end].view(dtype).reshape(shape)))
    return tensors


# Module functions, not closures over the mapped file: a recursive closure is a reference cycle, which would keep
# the whole mapping (and its resident pages) until a garbage collection.
def _string(buf: memoryview, at: int) -> tuple[bytes, int]:
    (n,) = struct.unpack_from("<Q", buf, at)
    return bytes(buf[at + 8 : at + 8 + n]), at + 8 + n


def _skip_value(buf: memoryview, kind: int, at: int) -> int:
    """The offset after a metadata value of type ``kind`` at ``at``."""
    if kind in _SCALAR_BYTES:
        return at + _SCALAR_BYTES[kind]
    if kind == _STRING:
        return at + 8 + struct.unpack_from("<Q", buf, at)[0]
    if kind != _ARRAY:
        raise ValueError(f"unknown metadata value type {kind} at byte {at}")
    item, count = struct.unpack_from("<IQ", buf, at)
    at += 12
    if item in _SCALAR_BYTES:
        return at + count * _SCALAR_BYTES[item]
    for _ in range(count):
        at = _skip_value(buf, item, at)
    return at
