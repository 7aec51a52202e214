"""Steady rows: running requests that decode one token a step, planned and applied in numpy.

At batch 1024 a step's Python work per request costs more than the rest of
the step, so requests with nothing to change (no prefill, no grammar, no new
parameters) join the steady rows, whose counters live in arrays indexed by
req_index (docs/design.md, "The scheduler").
"""

from __future__ import annotations

from array import array

import numpy as np

from pipeline.common.descriptor_builder import DescriptorBuilder
from pipeline.common.messages import check_finish
from pipeline.common.step_protocol import PLACEHOLDER_TOKEN_ID
from pipeline.scheduler_proc.kv_block_pool import BlockPool
from pipeline.scheduler_proc.request import Request

# Steps a steady row's tokens wait in the per-row buffer before joining its
# request's list (int32: 512 KiB at 1024 rows): appending to a thousand lists
# a step costs more than the rest of the step.
_TOKEN_BUFFER = 128


class SteadyRows:
    """The steady rows' counters, by req_index; the one copy of them while a row is steady.

    The rule: from ``join`` to ``release``, this class owns a request's
    progress. Its ``num_computed_tokens``, ``num_placeholders``,
    ``last_step_id`` and ``output_token_ids`` live here and are None on the
    ``Request``; ``release`` writes them back up to date. Tokens for a steady
    request go through ``apply_output`` (its steady rows) or ``receive`` (a
    row it had before joining).

    Per row: ``_pos`` (num_computed_tokens), ``_in_flight``
    (num_placeholders), ``_last_step`` (last_step_id), ``_remaining`` (tokens
    it may still plan), ``_left`` (tokens it may still receive before
    ``max_tokens``), ``_stop`` (its stop token ids, -1 padded; none with
    ``ignore_eos``), ``_last_token``, ``_admitted`` (its ``admit_seq``),
    ``_req_num`` (-1 once the row holds no steady request) and its newest
    tokens, ``_buffer[i, :_num_buffered[i]]``.

    Args:
        keep_ended_tokens: an ended request gets its buffered tokens back
            (prefix caching names its blocks from them); else they are dropped.
    """

    def __init__(self, max_num_seqs: int, block_size: int, keep_ended_tokens: bool):
        n = max_num_seqs
        self.block_size, self.keep_ended_tokens = block_size, keep_ended_tokens
        self.order = np.zeros(0, np.int64)  # req_index of each steady row, in the order they joined
        self.num_steps = 0  # steps that planned steady rows
        self._req: list[Request | None] = [None] * n
        self._outputs: list[array | None] = [None] * n
        (
            self._pos,
            self._in_flight,
            self._last_step,
            self._remaining,
            self._left,
            self._last_token,
            self._admitted,
            self._num_buffered,
        ) = (np.zeros(n, np.int64) for _ in range(8))
        self._req_num = np.full(n, -1, np.int64)
        self._stop = np.full((n, 1), -1, np.int64)
        self._buffer = np.zeros((n, _TOKEN_BUFFER), np.int32)
        # Step id -> its steady rows, which lead its output: (req_indices, request numbers as an array and a list).
        self._planned: dict[int, tuple[np.ndarray, np.ndarray, list[int]]] = {}

    def __len__(self) -> int:
        return len(self.order)

    def holds(self, req: Request) -> bool:
        return req.req_index >= 0 and self._req[req.req_index] is req

    def join(self, reqs: list[Request]) -> None:
        """``reqs`` (running, each just planned one sampled decode token, no grammar) become steady rows."""
        idx = np.fromiter((r.req_index for r in reqs), np.int64, len(reqs))
        self._req_num[idx] = [r.req_num for r in reqs]
        self._pos[idx] = [r.num_computed_tokens for r in reqs]
        self._in_flight[idx] = [r.num_placeholders for r in reqs]
        self._last_step[idx] = [r.last_step_id for r in reqs]
        self._remaining[idx] = [r.params.max_tokens - r.num_outputs_planned for r in reqs]
        self._left[idx] = [r.params.max_tokens - len(r.output_token_ids) for r in reqs]
        self._admitted[idx] = [r.admit_seq for r in reqs]
        self._num_buffered[idx] = 0
        for r in reqs:
            i = r.req_index
            stop = () if r.params.ignore_eos else r.params.stop_token_ids
            if len(stop) > self._stop.shape[1]:
                self._stop = np.pad(self._stop, ((0, 0), (0, len(stop) - self._stop.shape[1])), constant_values=-1)
            self._stop[i] = -1
            self._stop[i, : len(stop)] = stop
            self._req[i], self._outputs[i] = r, r.output_token_ids
            r.num_computed_tokens = r.num_placeholders = r.last_step_id = r.output_token_ids = None
        self.order = np.concatenate([self.order, idx])

    def plan(
        self,
        builder: DescriptorBuilder,
        pool: BlockPool,
        max_num_batched_tokens: int,
        others_tokens: int,
        others_blocks: int,
        first_other_admitted: int | None,
    ) -> np.ndarray | None:
        """The rows (req_index, int64 ``[D]``) that decode in the step being planned, or None.

        Allocates the blocks of those that cross into a new one. A row that
        has planned its last token sits out. Planning the steady rows before
        the other running requests must give the step the general path would,
        so this returns None (the caller releases every row) when the token
        budget might not reach every row while some other request precedes a
        steady one, or when blocks might run short (the general path would
        make rows wait or preempt).

        Args:
            others_tokens, others_blocks: at most what the other running
                requests take this step.
            first_other_admitted: the first other running request's
                ``admit_seq``; None when there is none.
        """
        active = self.order[self._remaining[self.order] > 0]
        crossing = active[self._pos[active] % self.block_size == 0]
        others_after = (
            first_other_admitted is None or not len(active) or first_other_admitted > self._admitted[active].max()
        )
        # Every active row was planned in the previous step, so they fit the budget by themselves.
        if len(crossing) + others_blocks > pool.num_free_blocks or (
            len(active) + others_tokens > max_num_batched_tokens and not others_after
        ):
            return None
        if len(crossing):
            new = pool.allocate_blocks(len(crossing))
            builder.add_blocks(crossing, self._pos[crossing] // self.block_size, np.asarray(new))
            for i, b in zip(crossing.tolist(), new):
                self._req[i].block_ids.append(b)
        return active

    def write(self, step_id: int, rows: np.ndarray, inputs_known: bool) -> tuple[np.ndarray, ...]:
        """Count ``rows`` (from ``plan``) as planned in step ``step_id``; returns ``DescriptorBuilder.write``'s
        ``decode``. With ``inputs_known`` (lock step) each row's input is its last token, else the placeholder."""
        pos = self._pos[rows]
        if inputs_known:
            tokens = self._last_token[rows]
        else:
            tokens = np.full(len(rows), PLACEHOLDER_TOKEN_ID, np.int64)
        nums = self._req_num[rows]
        self._planned[step_id] = (rows, nums, nums.tolist())
        self._pos[rows] = pos + 1
        self._remaining[rows] -= 1
        self._in_flight[rows] += 1
        self._last_step[rows] = step_id
        self.num_steps += 1
        return nums, rows, pos, tokens

    def apply_output(
        self, step_id: int, req_nums: list[int], token_ids: list[int]
    ) -> tuple[int, list[tuple[int, int]], list[Request]]:
        """Apply the tokens of step ``step_id``'s steady rows, vectorized.

        Returns:
            How many leading output rows were the step's steady rows; the
            ``(req_num, token)`` of those whose request left the steady rows
            since (the caller applies or drops them); and the requests that
            ended, released.

        Raises:
            RuntimeError: the output's first rows are not the step's steady
                rows in the order planned (the worker writes sampled rows in
                descriptor order).
        """
        planned = self._planned.pop(step_id, None)
        if planned is None:
            return 0, [], []
        rows, nums, num_list = planned
        d = len(num_list)
        if req_nums[:d] != num_list:
            raise RuntimeError(f"step {step_id}: output rows are not the steady rows planned")
        tokens = token_ids[:d]
        kept = self._req_num[rows] == nums
        left: list[tuple[int, int]] = []
        if not kept.all():
            left = [(num_list[i], tokens[i]) for i in np.flatnonzero(~kept).tolist()]
            sel = np.flatnonzero(kept)
            rows, tok, num_list = rows[sel], np.asarray(tokens)[sel], [num_list[i] for i in sel.tolist()]
        else:
            tok = np.asarray(tokens)
        self._buffer[rows, self._num_buffered[rows]] = tok
        self._num_buffered[rows] += 1
        self._last_token[rows] = tok
        self._in_flight[rows] -= 1
        self._left[rows] -= 1
        ended = np.flatnonzero((self._left[rows] <= 0) | (self._stop[rows] == tok[:, None]).any(1))
        if not len(ended):
            return d, left, []
        ended_rows = rows[ended]
        if not self.keep_ended_tokens:
            self._num_buffered[ended_rows] = 0  # nobody reads an ended request's tokens
        reqs = [self._write_back(i) for i in ended_rows.tolist()]
        self.order = self.order[self._req_num[self.order] >= 0]
        return d, left, reqs

    def receive(self, req: Request, token: int) -> bool:
        """Append ``token`` from a row ``req`` had before it joined; returns whether it ends the request."""
        i = req.req_index
        self._move_tokens(i)  # older tokens first
        out = self._outputs[i]
        out.append(token)
        self._in_flight[i] -= 1
        self._left[i] -= 1
        self._last_token[i] = token
        return check_finish(token, len(out), req.params) is not None

    def flush(self, step_id: int) -> None:
        """Move the buffers whose turn it is to their requests' lists: each row's once every _TOKEN_BUFFER
        steps, never all at once."""
        for i in self.order[(self.order + step_id) % _TOKEN_BUFFER == 0].tolist():
            self._move_tokens(i)

    def release(self, req: Request) -> None:
        """Make steady ``req`` an ordinary running request again, its fields up to date."""
        self._write_back(req.req_index)
        self.order = self.order[self.order != req.req_index]

    def release_all(self) -> list[Request]:
        reqs = [self._write_back(i) for i in self.order.tolist()]
        self.order = self.order[:0]
        return reqs

    def _write_back(self, i: int) -> Request:
        req = self._req[i]
        self._move_tokens(i)
        req.output_token_ids, self._outputs[i] = self._outputs[i], None
        req.num_computed_tokens = int(self._pos[i])
        req.num_placeholders = int(self._in_flight[i])
        req.last_step_id = int(self._last_step[i])
        self._req[i] = None
        self._req_num[i] = -1
        return req

    def _move_tokens(self, i: int) -> None:
        n = self._num_buffered[i]
        if n:
            self._outputs[i].frombytes(self._buffer[i, :n].tobytes())
            self._num_buffered[i] = 0
