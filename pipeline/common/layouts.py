"""Fixed byte layouts of ring entries and numpy views over them.

A layout is a list of fields ``(name, dtype, length)``; every field is a 1-D
array at a fixed, 64-byte aligned offset, so an entry never changes size. The
two step messages built on it are in :mod:`pipeline.common.step_protocol`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pipeline.common.constants import cdiv

_ALIGN = 64


@dataclass(frozen=True)
class Layout:
    """A fixed layout of named 1-D arrays.

    Attributes:
        fields: ``(name, numpy dtype, length)`` triples, in memory order.
        offsets: byte offset of each field from the start of an entry.
        nbytes: size of one entry in bytes (multiple of 64).
    """

    fields: tuple[tuple[str, np.dtype, int], ...]
    offsets: tuple[int, ...]
    nbytes: int

    @classmethod
    def of(cls, fields: list[tuple[str, type | str, int]]) -> Layout:
        """Lay out ``fields`` one after another, each 64-byte aligned.

        Raises:
            ValueError: if a length is negative or a name repeats.
        """
        names = [f[0] for f in fields]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate field names in layout: {names}")
        offsets, out, off = [], [], 0
        for name, dtype, length in fields:
            if length < 0:
                raise ValueError(f"field {name!r} has negative length {length}")
            dt = np.dtype(dtype)
            offsets.append(off)
            out.append((name, dt, int(length)))
            off += cdiv(dt.itemsize * length, _ALIGN) * _ALIGN
        return cls(tuple(out), tuple(offsets), max(off, _ALIGN))

    def views(self, buf, base: int = 0) -> dict[str, np.ndarray]:
        """Numpy views of every field of the entry starting at byte ``base`` of ``buf``.

        The views alias ``buf`` (an mmap or bytearray): writes go straight to it.
        """
        return {
            name: np.frombuffer(buf, dtype=dt, count=length, offset=base + off)
            for (name, dt, length), off in zip(self.fields, self.offsets)
        }
