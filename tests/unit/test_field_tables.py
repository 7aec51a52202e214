"""The step protocol's field tables are its one definition: layout, views, reader, packing and docs follow them."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from pipeline.common.descriptor_builder import DescriptorBuilder
from pipeline.common.messages import SamplingParams
from pipeline.common.records import Field
from pipeline.common.step_protocol import DESCRIPTOR, descriptor_dims, reference_markdown

DOC = Path(__file__).resolve().parents[2] / "docs" / "step-protocol.md"


class ParamsWithTypicalP(SamplingParams, frozen=True):
    """SamplingParams with one more parameter, as a new feature would add it."""

    typical_p: float = 1.0


def with_typical_p():
    """DESCRIPTOR with a throwaway sampling parameter: one line in the table, nothing else."""
    groups = tuple(
        dataclasses.replace(g, fields=(*g.fields, Field("typical_p", np.float32, "locally typical sampling mass")))
        if g.name == "sampling"
        else g
        for g in DESCRIPTOR.groups
    )
    return dataclasses.replace(DESCRIPTOR, groups=groups)


def test_a_field_added_to_the_table_reaches_layout_views_reader_packing_and_docs():
    record = with_typical_p()
    layout = record.layout(descriptor_dims(4, 16, 4))
    assert "typical_p" in [name for name, _, _ in layout.fields]
    desc = record.view_base(layout.views(bytearray(layout.nbytes)))
    assert desc.typical_p.shape == (4,) and desc.typical_p.dtype == np.float32

    b = DescriptorBuilder(record)
    b.add_row(1, 0, 0, [5, 6], True, ParamsWithTypicalP(max_tokens=3, typical_p=0.25))
    b.add_row(2, 3, 7, [9], True, None)
    b.add_row(3, 2, 0, [4], False, ParamsWithTypicalP(max_tokens=3, typical_p=0.75))
    b.write(desc, 11)
    x = record.read(desc)
    assert x.new_rows.tolist() == [0, 2] and x.typical_p.tolist() == [0.25, 0.75]

    buf = np.zeros(layout.nbytes, np.uint8)
    n = record.pack(desc, buf)
    assert n == record.packed_nbytes(desc.header)
    copy = record.view_base(layout.views(bytearray(layout.nbytes)))
    record.unpack(buf, copy)
    assert record.read(copy).typical_p.tolist() == [0.25, 0.75]
    assert "| `typical_p` | float32 | per new row | locally typical sampling mass |" in record.reference()


def test_every_field_is_in_the_reference_doc():
    """docs/step-protocol.md is what the tables generate (python -m pipeline.common.step_protocol)."""
    assert DOC.read_text() == reference_markdown()
