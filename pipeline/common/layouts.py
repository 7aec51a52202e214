"""Fixed byte layouts of the per-step messages and numpy views over them.

Two messages travel on the hot path, each in a slot of a shared-memory ring
(:mod:`pipeline.common.shm_ring`):

* ``StepDescriptor`` (scheduler -> worker): what to compute in step N.
* ``StepOutput`` (worker -> scheduler and io_proc): the tokens sampled in N.

A layout is a list of fields ``(name, dtype, length)``; every field is a 1-D
array at a fixed, 64-byte aligned offset. Arrays are sized by the configured
maxima so a slot never changes size; the header says how many entries are live.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# Token id meaning "the token this slot sampled in the previous step"; the
# worker resolves it from its on-device token-id cache (DESIGN.md, step protocol).
PLACEHOLDER_TOKEN_ID = -1

_ALIGN = 64


@dataclass(frozen=True)
class Layout:
    """A fixed layout of named 1-D arrays.

    Attributes:
        fields: ``(name, numpy dtype, length)`` triples, in memory order.
        offsets: byte offset of each field from the start of a slot.
        nbytes: size of one slot in bytes (multiple of 64).
    """

    fields: tuple[tuple[str, np.dtype, int], ...]
    offsets: tuple[int, ...]
    nbytes: int

    @classmethod
    def of(cls, fields: list[tuple[str, type | str, int]]) -> "Layout":
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
            off += -(-(dt.itemsize * length) // _ALIGN) * _ALIGN
        return cls(tuple(out), tuple(offsets), max(off, _ALIGN))

    def views(self, buf, base: int = 0) -> dict[str, np.ndarray]:
        """Numpy views of every field of the slot starting at byte ``base`` of ``buf``.

        The views alias ``buf`` (an mmap or bytearray): writes go straight to it.
        """
        return {
            name: np.frombuffer(buf, dtype=dt, count=length, offset=base + off)
            for (name, dt, length), off in zip(self.fields, self.offsets)
        }


# Header words of a StepDescriptor.
DESC_STEP_ID, DESC_NUM_REQS, DESC_NUM_TOKENS, DESC_NUM_NEW_BLOCKS = 0, 1, 2, 3
DESC_PLAN_START_NS, DESC_PLAN_END_NS = 4, 5
DESC_HEADER_LEN = 8

# Header words of a StepOutput. Times are time.monotonic_ns() of the worker
# (system-wide clock), or device-clock equivalents mapped onto it.
OUT_STEP_ID, OUT_NUM_ROWS = 0, 1
OUT_PREPARE_START_NS, OUT_PREPARE_END_NS, OUT_LAUNCH_NS = 2, 3, 4
OUT_DEVICE_START_NS, OUT_DEVICE_END_NS, OUT_PUBLISH_NS = 5, 6, 7
OUT_HEADER_LEN = 8


def max_new_blocks_per_step(max_num_seqs: int, max_num_batched_tokens: int, block_size: int) -> int:
    """Worst-case number of block-table entries one step can add.

    Each scheduled request's tokens span at most ``ceil(n / block_size) + 1``
    blocks it did not have, so the sum is bounded by the token budget divided
    by the block size plus two per request.
    """
    return max_num_batched_tokens // block_size + 2 * max_num_seqs


def step_descriptor_layout(max_num_seqs: int, max_num_batched_tokens: int, block_size: int) -> Layout:
    """Layout of a StepDescriptor.

    Per request ``i < num_reqs`` (arrays of length ``max_num_seqs``):
    ``req_num`` (int64, the request's own number, unique for the server's
    life), ``slot`` (int32), ``num_scheduled_tokens`` (int32), ``start_pos``
    (int32, position of its first scheduled token), ``do_sample`` (uint8: 1
    if the last scheduled token's logits are sampled this step), ``is_new``
    (uint8: 1 on a request's first step in this slot; its sampling parameters
    ``temperature`` f32, ``top_p`` f32, ``top_k`` i32, ``seed`` i64 are valid
    then). Per token ``t < num_tokens``: ``token_ids`` (int32, a real id or
    ``PLACEHOLDER_TOKEN_ID``), request-major. Per new block-table entry
    ``b < num_new_blocks``: ``nb_slot``, ``nb_index``, ``nb_block`` (int32):
    ``block_table[nb_slot, nb_index] = nb_block``.
    """
    s, t = max_num_seqs, max_num_batched_tokens
    b = max_new_blocks_per_step(max_num_seqs, max_num_batched_tokens, block_size)
    return Layout.of([
        ("header", np.int64, DESC_HEADER_LEN),
        ("req_num", np.int64, s),
        ("slot", np.int32, s),
        ("num_scheduled_tokens", np.int32, s),
        ("start_pos", np.int32, s),
        ("do_sample", np.uint8, s),
        ("is_new", np.uint8, s),
        ("temperature", np.float32, s),
        ("top_p", np.float32, s),
        ("top_k", np.int32, s),
        ("seed", np.int64, s),
        ("token_ids", np.int32, t),
        ("nb_slot", np.int32, b),
        ("nb_index", np.int32, b),
        ("nb_block", np.int32, b),
    ])


def step_output_layout(max_num_seqs: int) -> Layout:
    """Layout of a StepOutput.

    Row ``r < num_rows`` (arrays of length ``max_num_seqs``): ``req_num``
    (int64) sampled ``token_id`` (int32). Only requests whose descriptor row
    had ``do_sample`` set produce a row, in descriptor order.
    """
    return Layout.of([
        ("header", np.int64, OUT_HEADER_LEN),
        ("req_num", np.int64, max_num_seqs),
        ("token_id", np.int32, max_num_seqs),
    ])
