"""Fixed-layout records defined by one field table each (docs/step-protocol.md): layout, views, host copy, packing and
reference table all derive from it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from pipeline.common.layouts import Layout


@dataclass(frozen=True)
class Field:
    """One array of a record (or, in a header, one int64 value).

    ``width``: elements per entry, a number or the constant or header field holding it (> 1: 2-D); ``rows``: a uint8
    flag's host copy holds its set entries' indices under this name; ``widen`` False: bit patterns copied as they are.
    """

    name: str
    dtype: type
    meaning: str
    width: int | str = 1
    rows: str = ""
    widen: bool = True


@dataclass(frozen=True)
class Group:
    """Fields of one extent: ``capacity`` entries laid out, the first ``count`` live; ``select``: a flag's ``rows``
    name, the host copy then holding only those entries."""

    name: str
    per: str
    capacity: str
    count: str
    fields: tuple[Field, ...]
    select: str = ""
    meaning: str = ""


class RecordView:
    """Typed views of one ring entry: one attribute per field, and each header value as an int property."""

    __slots__ = ()
    record: Record

    if TYPE_CHECKING:

        def __getattr__(self, name: str) -> Any: ...

    def __init__(self, views: Mapping[str, np.ndarray]):
        for name in self.record.names:
            setattr(self, name, views[name])


class HostCopy:
    """The reader's copy of one entry (``Record.read``): header values as ints, live fields as arrays (int64 unless
    ``widen`` is False; ``rows`` flags as indices; ``select`` groups narrowed)."""

    __slots__ = ()

    if TYPE_CHECKING:

        def __getattr__(self, name: str) -> Any: ...


@dataclass(frozen=True, eq=False)
class Record:
    """A record's field table: an int64 ``header`` (with every group's ``count``), then ``groups`` in layout order."""

    name: str
    header: tuple[Field, ...]
    groups: tuple[Group, ...]
    constants: Mapping[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        names = ["header", *(f.name for f in self.header), *(f.name for f in self.fields)]
        names += [f.rows for f in self.fields if f.rows]
        if len(set(names)) != len(names):
            raise ValueError(f"{self.name}: repeated field names in {names}")
        index = {f.name: i for i, f in enumerate(self.header)}
        for g in self.groups:
            if g.count not in index and g.count not in self.constants:
                raise ValueError(f"{self.name}: group {g.name!r} counts its entries in {g.count!r}, not a header field")
        props = {
            f.name: property(lambda self, i=i: int(self.header[i]), doc=f.meaning) for i, f in enumerate(self.header)
        }
        object.__setattr__(self, "header_index", index)
        object.__setattr__(
            self,
            "view_base",
            type(self.name + "View", (RecordView,), {"__slots__": self.names, "record": self, **props}),
        )
        plan = tuple(
            (g.count, g.select, tuple((f.name, f.rows, f.widen and np.dtype(f.dtype).kind in "iu") for f in g.fields))
            for g in self.groups
        )
        object.__setattr__(self, "_read_plan", plan)
        host_names = (*index, *(f.rows or f.name for f in self.fields))
        object.__setattr__(self, "host_type", type(self.name + "Copy", (HostCopy,), {"__slots__": host_names}))

    @property
    def fields(self) -> tuple[Field, ...]:
        return tuple(f for g in self.groups for f in g.fields)

    @property
    def names(self) -> tuple[str, ...]:
        """The layout's fields: ``header``, then every group field."""
        return ("header", *(f.name for f in self.fields))

    def group(self, name: str) -> Group:
        return next(g for g in self.groups if g.name == name)

    def layout(self, dims: Mapping[str, int]) -> Layout:
        """The entry layout with each group's ``capacity`` (and named widths) taken from ``dims`` or the constants."""
        dims = {**self.constants, **dims}
        out: list[tuple[str, type, int | tuple[int, ...]]] = [("header", np.int64, len(self.header))]
        for g in self.groups:
            n = dims[g.capacity]
            for f in g.fields:
                out.append((f.name, f.dtype, n if f.width == 1 else (n, _width(f, dims))))
        return Layout.of(out)

    def live_counts(self, header: np.ndarray) -> list[tuple[str, int]]:
        """Each field's live elements under ``header`` (int64), in layout order (a 2-D field counts whole rows)."""
        values = {f.name: int(header[i]) for i, f in enumerate(self.header)}
        dims = {**self.constants, **values}
        out = [("header", len(self.header))]
        for g in self.groups:
            n = dims[g.count]
            out.extend((f.name, n * _width(f, dims)) for f in g.fields)
        return out

    def read(self, view: RecordView) -> HostCopy:
        """Copy ``view``'s live entries out (the ring entry may be reused after)."""
        h = view.header
        x = self.host_type()
        for name, i in self.header_index.items():
            setattr(x, name, int(h[i]))
        for count, select, fields in self._read_plan:
            n = getattr(x, count) if count in self.header_index else self.constants[count]
            sel = getattr(x, select) if select else None
            for name, rows, widen in fields:
                a = getattr(view, name)
                if rows:
                    setattr(x, rows, np.flatnonzero(a[:n]))
                elif sel is None:
                    setattr(x, name, a[:n].astype(np.int64) if widen else a[:n].copy())
                elif len(sel):  # a selection copies already
                    setattr(x, name, a[sel].astype(np.int64, copy=False) if widen else a[sel])
                else:
                    setattr(x, name, np.empty((0, *a.shape[1:]), np.int64 if widen else a.dtype))
        return x

    def packed_nbytes(self, header: np.ndarray) -> int:
        """Bytes ``pack`` writes for an entry with this ``header``."""
        size = {name: np.dtype(dt).itemsize for name, dt in self._dtypes()}
        return sum(size[name] * n for name, n in self.live_counts(header))

    def pack(self, view: RecordView, out: np.ndarray) -> int:
        """Copy the live elements of ``view`` into ``out`` (uint8), back to back, header first; returns the bytes."""
        off = 0
        for name, n in self.live_counts(view.header):
            raw = getattr(view, name).reshape(-1)[:n].view(np.uint8)
            out[off : off + raw.size] = raw
            off += raw.size
        return off

    def unpack(self, buf: np.ndarray, view: RecordView) -> None:
        """Write what ``pack`` packed into ``buf`` (uint8) back into ``view``'s fields."""
        off = 0
        for name, n in self.live_counts(buf[: 8 * len(self.header)].view(np.int64)):
            dst = getattr(view, name).reshape(-1)
            size = dst.itemsize * n
            dst[:n] = buf[off : off + size].view(dst.dtype)
            off += size

    def reference(self) -> str:
        """The record's reference table (Markdown), as docs/step-protocol.md holds it."""
        lines = [f"### {self.name}", "", "| field | dtype | extent | meaning |", "| --- | --- | --- | --- |"]
        lines += [f"| `{f.name}` | int64 | header | {f.meaning} |" for f in self.header]
        for g in self.groups:
            for f in g.fields:
                extent = f"per {g.per}" + (f" × `{f.width}`" if f.width != 1 else "")
                meaning = f.meaning + (f" (the reader gets `{f.rows}`: the indices of the set rows)" if f.rows else "")
                lines.append(f"| `{f.name}` | {np.dtype(f.dtype).name} | {extent} | {meaning} |")
        lines.append("")
        for g in self.groups:
            note = f" {g.meaning}." if g.meaning else ""
            lines.append(f"- per {g.per} (`{g.name}`): `{g.capacity}` laid out, the first `{g.count}` live.{note}")
        return "\n".join(lines) + "\n"

    def _dtypes(self):
        yield "header", np.int64
        for f in self.fields:
            yield f.name, f.dtype


def _width(f: Field, dims: Mapping[str, int]) -> int:
    return f.width if isinstance(f.width, int) else dims[f.width]
