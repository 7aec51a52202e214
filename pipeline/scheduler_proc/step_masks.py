"""The token masks of planned steps, written once their constrained rows' previous tokens are known (docs/design.md,
"Structured output"); the worker waits for them only before sampling."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from pipeline.common.step_protocol import MASKS, TokenMasks
from pipeline.scheduler_proc.request import Request


@dataclass
class MaskedRow:
    """A constrained row of a planned step: one mask, or with ``num_drafts`` drafts one per sampled position (``masks``,
    once its grammar has walked them: ``GrammarState.walk``)."""

    req: Request
    after_step: int  # the row's previous step: its output comes before this step's masks (-1: none)
    num_drafts: int
    drafts: list[int] | None = None  # the drafts the descriptor names (None: the proposer's)
    masks: np.ndarray | None = None  # [1 + num_drafts, W] int32, once walked
    walking: bool = False


class StepMasks:
    """Planned steps whose masks are not written yet, oldest first; rows whose request left ``requests`` get allow-all
    masks. ``walks_waiting``: a walk waits on a background-thread advance."""

    def __init__(self, requests: dict[int, Request]):
        self._requests = requests
        self._steps: deque[tuple[int, list[MaskedRow]]] = deque()
        self.applied_step = -1
        self.walks_waiting = False  # a due walk waits for its row's advance on the background thread

    def __len__(self) -> int:
        """Steps whose masks are still to be written."""
        return len(self._steps)

    def rebind(self, requests: dict[int, Request]) -> None:
        """Follow the scheduler's request table after it was rebuilt (``Scheduler.shrink``)."""
        self._requests = requests

    def add(self, step_id: int, rows: list[MaskedRow]) -> None:
        """Step ``step_id`` samples the constrained ``rows``, in the order of the descriptor's ``mask_row``."""
        self._steps.append((step_id, rows))

    def due_walks(self) -> list[MaskedRow]:
        """The rows with drafts whose previous step's output is applied and whose walk has not started: marked as
        started (on the scheduler's thread; the mask thread may be writing the oldest step)."""
        due, self.walks_waiting = [], False
        for _, rows in tuple(self._steps):
            for row in rows:
                if row.num_drafts and not row.walking and row.after_step <= self.applied_step and self._live(row):
                    if row.req.grammar.on_background:  # its advance must come first: on the mask thread
                        self.walks_waiting = True
                    else:
                        row.walking = True
                        due.append(row)
        return due

    def oldest_ready(self) -> bool:
        """Whether the oldest step's masks can be written: every row's matcher has consumed the tokens before its
        samples and computed the masks after them."""
        return all(self._row_ready(row) for row in self._steps[0][1])

    def oldest_computing(self) -> bool:
        """Whether a mask of the oldest step is being computed now, or its drafts wait to be walked: its row's tokens
        are known and its matcher is at work (rather than waiting for a step in flight)."""
        return any(row.after_step <= self.applied_step and not self._row_ready(row) for row in self._steps[0][1])

    def _live(self, row: MaskedRow) -> bool:
        req = row.req
        return self._requests.get(req.req_num) is req and not req.grammar.error

    def _row_ready(self, row: MaskedRow) -> bool:
        if not self._live(row):
            return True
        return (
            row.after_step <= self.applied_step
            and row.req.grammar.ready
            and (not row.num_drafts or row.masks is not None)
        )

    def write_oldest(self, entry: TokenMasks) -> int:
        """Write the oldest step's masks into ``entry``; returns its step id. Call once ``oldest_ready``."""
        step_id, rows = self._steps.popleft()
        i = 0
        for row in rows:
            g, n = row.req.grammar, 1 + row.num_drafts
            # A lazy grammar's row may turn out to need no mask once its token in flight is known.
            if not self._live(row) or not g.needs_mask(0):
                entry.bitmask[i : i + n] = -1
            elif row.num_drafts:
                entry.bitmask[i : i + n] = row.masks
            else:
                entry.bitmask[i] = g.mask
            i += n
        h, index = entry.header, MASKS.header_index
        h[index["step_id"]], h[index["num_masks"]], h[index["mask_words"]] = step_id, i, entry.bitmask.shape[1]
        return step_id
