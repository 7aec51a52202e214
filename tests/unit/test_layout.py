"""Unit tests of ``pipeline.common.layouts.Layout``: offsets, sizes, aliasing views, validation."""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.common.layouts import Layout
from pipeline.common.step_output import StepOutput
from pipeline.common.step_protocol import StepDescriptor

FIELDS = [("header", np.int64, 8), ("flag", np.uint8, 3), ("data", np.int32, 64), ("x", np.float32, 17)]


@pytest.mark.parametrize(
    "layout",
    [
        Layout.of(FIELDS),
        Layout.of([("a", np.uint8, 1)]),
        Layout.of([("a", np.int64, 9), ("b", np.uint8, 65), ("c", "float64", 1)]),
        StepDescriptor.layout(max_num_seqs=7, max_num_batched_tokens=33, block_size=16),
        StepOutput.layout(max_output_rows=5, max_num_batched_tokens=33),
    ],
    ids=["mixed", "one-byte", "odd-sizes", "step-descriptor", "step-output"],
)
def test_offsets_aligned_and_fields_do_not_overlap(layout):
    """Every field starts on a 64-byte boundary, fits before the next one, and the entry is a multiple of 64."""
    assert layout.nbytes % 64 == 0 and layout.nbytes >= 64
    assert len(layout.offsets) == len(layout.fields)
    ends = [off + dt.itemsize * n for (_, dt, n), off in zip(layout.fields, layout.offsets)]
    for off in layout.offsets:
        assert off % 64 == 0
    for i in range(len(layout.fields) - 1):
        assert ends[i] <= layout.offsets[i + 1], f"field {layout.fields[i][0]} overlaps the next one"
    assert list(layout.offsets) == sorted(layout.offsets)
    assert ends[-1] <= layout.nbytes


def test_offsets_exact():
    """Fields are packed in order, each rounded up to the next 64 bytes."""
    layout = Layout.of(FIELDS)
    # header: 64 B -> 0; flag: 3 B -> 64; data: 256 B -> 128; x: 68 B -> 384 (rounded to 128 B); total 512.
    assert layout.offsets == (0, 64, 128, 384)
    assert layout.nbytes == 512
    assert [(n, dt, k) for n, dt, k in layout.fields] == [
        ("header", np.dtype(np.int64), 8),
        ("flag", np.dtype(np.uint8), 3),
        ("data", np.dtype(np.int32), 64),
        ("x", np.dtype(np.float32), 17),
    ]


def test_views_alias_the_buffer():
    """A write through a view lands at the field's offset in the buffer, and a write to the buffer shows in the view."""
    layout = Layout.of(FIELDS)
    buf = bytearray(layout.nbytes * 2)
    base = layout.nbytes  # the second entry
    v = layout.views(buf, base)
    assert {k: (a.dtype, a.shape) for k, a in v.items()} == {
        "header": (np.dtype(np.int64), (8,)),
        "flag": (np.dtype(np.uint8), (3,)),
        "data": (np.dtype(np.int32), (64,)),
        "x": (np.dtype(np.float32), (17,)),
    }

    v["data"][:] = np.arange(64, dtype=np.int32) * 7 - 100
    v["header"][3] = -(2**40) + 5
    v["flag"][2] = 0xAB
    v["x"][16] = 1.5

    off = dict(zip([f[0] for f in layout.fields], layout.offsets))
    raw = bytes(buf)
    assert raw[base + off["data"] : base + off["data"] + 256] == (np.arange(64, dtype=np.int32) * 7 - 100).tobytes()
    assert raw[base + off["header"] + 24 : base + off["header"] + 32] == np.int64(-(2**40) + 5).tobytes()
    assert raw[base + off["flag"] + 2] == 0xAB
    assert raw[base + off["x"] + 64 : base + off["x"] + 68] == np.float32(1.5).tobytes()
    assert not any(raw[:base]), "the first entry was written"

    # And the other way: bytes written into the buffer appear in the views.
    buf[base + off["header"] : base + off["header"] + 8] = np.int64(123456789).tobytes()
    assert v["header"][0] == 123456789
    # A second set of views over the same entry sees the same memory.
    assert np.array_equal(layout.views(buf, base)["data"], v["data"])


def test_views_of_different_entries_are_disjoint():
    """Views of different entries of one buffer are disjoint."""
    layout = Layout.of([("a", np.int64, 3), ("b", np.int16, 40)])
    buf = bytearray(layout.nbytes * 3)
    entries = [layout.views(buf, i * layout.nbytes) for i in range(3)]
    for i, s in enumerate(entries):
        s["a"][:] = i + 1
        s["b"][:] = -(i + 1)
    for i, s in enumerate(entries):
        assert (s["a"] == i + 1).all() and (s["b"] == -(i + 1)).all()


def test_duplicate_names_raise():
    with pytest.raises(ValueError, match="duplicate"):
        Layout.of([("a", np.int32, 4), ("b", np.int32, 4), ("a", np.int64, 1)])


def test_negative_length_raises():
    with pytest.raises(ValueError, match="negative"):
        Layout.of([("a", np.int32, 4), ("b", np.int32, -1)])


def test_zero_length_fields():
    """A zero-length field takes no space, gives an empty view, and an all-empty layout still has a 64-byte entry."""
    layout = Layout.of([("a", np.int32, 0), ("b", np.int64, 2), ("c", np.uint8, 0), ("d", np.int16, 1)])
    assert layout.offsets == (0, 0, 64, 64)
    assert layout.nbytes == 128
    v = layout.views(bytearray(layout.nbytes))
    assert v["a"].shape == (0,) and v["c"].shape == (0,)
    v["b"][:] = [1, 2]
    v["d"][0] = 3
    assert v["b"].tolist() == [1, 2] and v["d"].tolist() == [3]

    empty = Layout.of([("a", np.float32, 0)])
    assert empty.nbytes == 64 and empty.offsets == (0,)
    assert Layout.of([]).nbytes == 64

    # A trailing zero-length field starts at the very end of the entry; its view is still valid (and empty).
    trailing = Layout.of([("a", np.int64, 8), ("z", np.int32, 0)])
    assert trailing.offsets == (0, 64) and trailing.nbytes == 64
    buf = bytearray(trailing.nbytes * 2)
    assert trailing.views(buf, trailing.nbytes)["z"].shape == (0,)


def test_field_filling_exactly_64_bytes_is_not_padded():
    layout = Layout.of([("a", np.int64, 8), ("b", np.int32, 16), ("c", np.uint8, 1)])
    assert layout.offsets == (0, 64, 128)
    assert layout.nbytes == 192
