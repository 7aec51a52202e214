"""Fixed byte layouts of ring entries and numpy views over them.

Every field is an array at a fixed, 64-byte aligned offset, so an entry never changes size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from pipeline.common.constants import cdiv

_ALIGN = 64


@dataclass(frozen=True)
class Layout:
    """A fixed layout of named arrays: ``fields`` ``(name, dtype, elements)`` in memory order, byte ``offsets``,
    ``nbytes`` per entry (a multiple of 64)."""

    fields: tuple[tuple[str, np.dtype, int], ...]
    shapes: tuple[tuple[int, ...], ...]
    offsets: tuple[int, ...]
    nbytes: int

    @classmethod
    def of(cls, fields: list[tuple[str, type | str, int | tuple[int, ...]]]) -> Layout:
        """Lay out ``fields`` (``(name, dtype, length or shape)``) one after another, each 64-byte aligned.

        Raises:
            ValueError: if a length is negative or a name repeats.
        """
        names = [f[0] for f in fields]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate field names in layout: {names}")
        offsets, out, shapes, off = [], [], [], 0
        for name, dtype, size in fields:
            shape = (size,) if isinstance(size, int | np.integer) else tuple(size)
            if any(n < 0 for n in shape):
                raise ValueError(f"field {name!r} has negative length {size}")
            dt, length = np.dtype(dtype), math.prod(int(n) for n in shape)
            offsets.append(off)
            out.append((name, dt, length))
            shapes.append(tuple(int(n) for n in shape))
            off += cdiv(dt.itemsize * length, _ALIGN) * _ALIGN
        return cls(tuple(out), tuple(shapes), tuple(offsets), max(off, _ALIGN))

    def views(self, buf, base: int = 0) -> dict[str, np.ndarray]:
        """Numpy views of every field of the entry at byte ``base`` of ``buf``, aliasing it (writes go straight
        through)."""
        return {
            name: np.frombuffer(buf, dtype=dt, count=length, offset=base + off).reshape(shape)
            for (name, dt, length), shape, off in zip(self.fields, self.shapes, self.offsets)
        }
