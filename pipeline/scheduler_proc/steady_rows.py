"""Steady rows: running requests that decode one token a step, planned and applied in numpy arrays by req_index, as
per-request Python costs more than the step at batch 1024 (docs/design.md, "The scheduler")."""

from __future__ import annotations

from array import array

import numpy as np

from pipeline.common.constants import cdiv
from pipeline.common.descriptor_builder import DescriptorBuilder
from pipeline.common.messages import check_finish
from pipeline.common.step_protocol import PLACEHOLDER_TOKEN_ID
from pipeline.scheduler_proc.kv_block_pool import BlockPool
from pipeline.scheduler_proc.request import Request
from pipeline.scheduler_proc.spec_policy import output_runs

# Steps a steady row's tokens wait in the per-row buffer before joining its
# request's list (int32: 512 KiB at 1024 rows): appending to a thousand lists
# a step costs more than the rest of the step.
_TOKEN_BUFFER = 128


class SteadyRows:
    """The steady rows' counters, by req_index; the one copy of them while a row is steady.

    From ``join`` to ``release`` this owns a request's progress (its ``Request`` fields are None; ``release`` writes
    them back). Speculating, counters assume every draft accepted until ``rollback`` (docs/design.md, "Speculative
    decoding"). ``keep_ended_tokens``: ended requests get their buffered tokens back (for prefix caching).
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
            self._rejected,
            self._num_blocks,
            self._draft_left,
        ) = (np.zeros(n, np.int64) for _ in range(11))
        self._req_num = np.full(n, -1, np.int64)
        self._stop = np.full((n, 1), -1, np.int64)
        self._buffer = np.zeros((n, _TOKEN_BUFFER), np.int32)
        # Step id -> its steady rows, which lead its output: (req_indices, request numbers as an array and a
        # list, tokens planned per row or None for one each).
        self._planned: dict[int, tuple[np.ndarray, np.ndarray, list[int], np.ndarray | None]] = {}

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
        self._rejected[idx] = [r.num_rejected for r in reqs]
        self._num_blocks[idx] = [len(r.block_ids) for r in reqs]
        self._draft_left[idx] = [r.params.max_tokens - r.params.min_tokens for r in reqs]
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
        """The rows (req_index, int64 ``[D]``) that decode in the step being planned, allocating blocks they cross into.

        Returns None (release every row) when the result could differ from the general path: a budget that might not
        reach every row, or blocks that might run short.
        """
        active = self.order[self._remaining[self.order] > 0]
        # After rejected drafts a row may already hold the block its next position needs.
        crossing = active[cdiv(self._pos[active] + 1, self.block_size) > self._num_blocks[active]]
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
            builder.add_blocks(crossing, self._num_blocks[crossing], np.asarray(new))
            self._num_blocks[crossing] += 1
            for i, b in zip(crossing.tolist(), new):
                self._req[i].block_ids.append(b)
        return active

    def draft_candidates(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Of ``rows`` (planned this step), those that may draft (past ``min_tokens``), and the tokens each may still
        plan (at most that minus one drafts)."""
        cand = rows[self._left[rows] <= self._draft_left[rows]]
        return cand, self._remaining[cand]

    def grow_for_drafts(
        self, rows: np.ndarray, k: int, pool: BlockPool, builder: DescriptorBuilder, room: int
    ) -> np.ndarray:
        """Blocks for ``k`` drafts after each of ``rows``' token, in order while free blocks and ``room`` block-table
        entries last; returns the rows that got them (the others do not draft)."""
        need = np.maximum(0, cdiv(self._pos[rows] + 1 + k, self.block_size) - self._num_blocks[rows])
        if need.sum() > min(pool.num_free_blocks, room):
            fits = np.cumsum(need) <= min(pool.num_free_blocks, room)
            rows, need = rows[fits], need[fits]
        growing = np.flatnonzero(need)
        growing, need = rows[growing], need[growing]
        if not len(growing):
            return rows
        new = pool.allocate_blocks(int(need.sum()))
        if len(new) == len(growing):  # one block each: the drafts fit in a block
            owners, cols = growing, self._num_blocks[growing]
        else:  # row i's j-th new block goes to column num_blocks[i] + j
            owners = np.repeat(growing, need)
            cols = np.repeat(self._num_blocks[growing] - (np.cumsum(need) - need), need) + np.arange(len(new))
        builder.add_blocks(owners, cols, np.asarray(new))
        self._num_blocks[growing] += need
        for i, b in zip(owners.tolist(), new):
            self._req[i].block_ids.append(b)
        return rows

    def num_rejected(self, rows: np.ndarray) -> np.ndarray:
        return self._rejected[rows]

    def rollback(self, req: Request, rejected: int) -> None:
        """``rejected`` tokens planned for steady ``req`` in a row it had before joining were drafts the worker
        rejected: its counters go back by them."""
        i = req.req_index
        self._pos[i] -= rejected
        self._remaining[i] += rejected
        self._in_flight[i] -= rejected
        self._rejected[i] += rejected

    def write(
        self, step_id: int, rows: np.ndarray, inputs_known: bool, drafts: np.ndarray | None = None
    ) -> tuple[np.ndarray, ...]:
        """Count ``rows`` (from ``plan``) as planned in step ``step_id``, each with ``drafts`` (``[D]``, None: none)
        counted as accepted; returns ``DescriptorBuilder.write``'s ``decode``. With ``inputs_known`` (lock step) each
        row's input is its last token, else the placeholder."""
        pos = self._pos[rows]
        if inputs_known:
            tokens = self._last_token[rows]
        else:
            tokens = np.full(len(rows), PLACEHOLDER_TOKEN_ID, np.int64)
        nums = self._req_num[rows]
        n = 1 if drafts is None else drafts + 1
        self._planned[step_id] = (rows, nums, nums.tolist(), None if drafts is None else n)
        self._pos[rows] = pos + n
        self._remaining[rows] -= n
        self._in_flight[rows] += n
        self._last_step[rows] = step_id
        self.num_steps += 1
        return nums, rows, pos, tokens

    def apply_output(
        self, step_id: int, req_nums: np.ndarray, token_ids: np.ndarray
    ) -> tuple[int, list[tuple[int, int, list[int]]], list[Request], tuple | None]:
        """Apply the tokens of step ``step_id``'s steady rows, vectorized (a run ends at its first stop token).

        Returns the number of leading steady output rows, the rows whose request left since, the ended requests, and
        speculation's ``(req_indices, planned, got, last_row)``, or None without steady rows.

        Raises:
            RuntimeError: the output's first rows are not the step's steady rows in planned order.
        """
        planned = self._planned.pop(step_id, None)
        if planned is None:
            return 0, [], [], None
        rows, nums, num_list, n = planned
        if n is not None:
            return self._apply_runs(step_id, rows, nums, num_list, n, req_nums, token_ids)
        d = len(num_list)
        if len(req_nums) < d or (req_nums[:d] != nums).any():
            raise RuntimeError(f"step {step_id}: output rows are not the steady rows planned")
        tok = token_ids[:d]
        kept = self._req_num[rows] == nums
        left: list[tuple[int, int, list[int]]] = []
        last_row = None
        if not kept.all():
            left = [(num_list[i], 1, [int(tok[i])]) for i in np.flatnonzero(~kept).tolist()]
            last_row = np.flatnonzero(kept)
            rows, tok = rows[last_row], tok[last_row]
        # A run of accepted drafts fills a buffer faster than one token a step, the pace flush keeps up with.
        full = self._num_buffered[rows] >= _TOKEN_BUFFER
        if full.any():
            for i in rows[full].tolist():
                self._move_tokens(i)
        self._buffer[rows, self._num_buffered[rows]] = tok
        self._num_buffered[rows] += 1
        self._last_token[rows] = tok
        self._in_flight[rows] -= 1
        self._left[rows] -= 1
        ended = np.flatnonzero((self._left[rows] <= 0) | (self._stop[rows] == tok[:, None]).any(1))
        return d, left, self._end(rows[ended]), (rows, None, None, last_row)

    def _apply_runs(
        self,
        step_id: int,
        rows: np.ndarray,
        nums: np.ndarray,
        num_list: list[int],
        planned: np.ndarray,
        req_nums: np.ndarray,
        token_ids: np.ndarray,
    ) -> tuple[int, list[tuple[int, int, list[int]]], list[Request], tuple]:
        """``apply_output`` for a step whose steady rows had drafts: row ``i`` planned ``planned[i]`` tokens."""
        arr = req_nums[: int(planned.sum())]
        starts, lengths = output_runs(arr)
        starts, lengths = starts[: len(num_list)], lengths[: len(num_list)]
        if len(starts) < len(num_list) or (arr[starts] != nums).any() or (lengths > planned).any():
            raise RuntimeError(f"step {step_id}: output rows are not the steady rows planned")
        d = int(starts[-1] + lengths[-1])
        tok_all = token_ids[:d]
        kept = self._req_num[rows] == nums
        left: list[tuple[int, int, list[int]]] = []
        if not kept.all():
            for i in np.flatnonzero(~kept).tolist():
                left.append((num_list[i], int(planned[i]), token_ids[starts[i] : starts[i] + lengths[i]].tolist()))
            keep = np.flatnonzero(kept)
            rows, planned, starts, lengths = rows[keep], planned[keep], starts[keep], lengths[keep]
        last_row = starts + lengths - 1
        offset = np.cumsum(lengths) - lengths
        row_of = np.repeat(np.arange(len(rows)), lengths)
        j = np.arange(int(lengths.sum())) - offset[row_of]
        # The runs are the output's first rows, back to back: with every row kept, they are tok_all.
        tok = tok_all if len(left) == 0 else tok_all[starts[row_of] + j]
        hit = (self._stop[rows[row_of]] == tok[:, None]).any(1)
        take, stopped = lengths, False  # a run's tokens up to its first stop token; whether it has one
        if hit.any():
            first_stop = lengths.copy()
            np.minimum.at(first_stop, row_of[hit], j[hit])
            take, stopped = np.minimum(lengths, first_stop + 1), first_stop < lengths
            taken = j < take[row_of]
            tok, j, row_of = tok[taken], j[taken], row_of[taken]
        buffered = self._num_buffered[rows]
        if (full := buffered + take > _TOKEN_BUFFER).any():
            for i in rows[full].tolist():
                self._move_tokens(i)
            buffered = self._num_buffered[rows]
        self._buffer[rows[row_of], buffered[row_of] + j] = tok
        self._num_buffered[rows] = buffered + take
        self._last_token[rows] = tok[np.cumsum(take) - 1]
        self._in_flight[rows] -= planned
        left_after = self._left[rows] - take
        self._left[rows] = left_after
        rejected = planned - lengths
        self._pos[rows] -= rejected
        self._remaining[rows] += rejected
        self._rejected[rows] += rejected
        ended = np.flatnonzero(stopped | (left_after <= 0))
        return d, left, self._end(rows[ended]), (rows, planned, lengths, last_row)

    def _end(self, ended_rows: np.ndarray) -> list[Request]:
        """Release the rows ``ended_rows`` whose requests ended."""
        if not len(ended_rows):
            return []
        if not self.keep_ended_tokens:
            self._num_buffered[ended_rows] = 0  # nobody reads an ended request's tokens
        reqs = [self._write_back(i) for i in ended_rows.tolist()]
        self.order = self.order[self._req_num[self.order] >= 0]
        return reqs

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
        """Move the buffers whose turn it is to their requests' lists: each row's once every _TOKEN_BUFFER steps, never
        all at once."""
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
        req.num_rejected = int(self._rejected[i])
        self._req[i] = None
        self._req_num[i] = -1
        return req

    def _move_tokens(self, i: int) -> None:
        n = self._num_buffered[i]
        if n:
            self._outputs[i].frombytes(self._buffer[i, :n].tobytes())
            self._num_buffered[i] = 0
