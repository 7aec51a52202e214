"""The token masks of planned steps, written once their constrained rows' previous tokens are known
(docs/design.md, "Structured output").

A constrained row is planned like any other, with a placeholder under
asynchronous scheduling; its mask depends on that placeholder's token, so the
step's ``TokenMasks`` entry follows the descriptor: the scheduler writes it as
soon as each row's matcher has consumed every output token before the one the
step samples. The worker runs the forward pass meanwhile and waits only before
sampling.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from pipeline.common.step_protocol import MASKS, TokenMasks
from pipeline.scheduler_proc.request import Request


@dataclass
class _MaskedRow:
    req: Request
    num_outputs: int  # output tokens before the one this step samples for it


class StepMasks:
    """Planned steps whose masks are not written yet, oldest first.

    Args:
        requests: the scheduler's live requests (by ``req_num``); a row whose request left it (finished,
            aborted, failed) gets a mask that allows everything, since its token is dropped.
    """

    def __init__(self, requests: dict[int, Request]):
        self._requests = requests
        self._steps: deque[tuple[int, list[_MaskedRow]]] = deque()

    def __len__(self) -> int:
        """Steps whose masks are still to be written."""
        return len(self._steps)

    def rebind(self, requests: dict[int, Request]) -> None:
        """Follow the scheduler's request table after it was rebuilt (``Scheduler.shrink``)."""
        self._requests = requests

    def add(self, step_id: int, rows: list[tuple[Request, int]]) -> None:
        """Step ``step_id`` samples the constrained ``rows`` (``(request, output tokens before its
        sample)``), in the order of the descriptor's ``mask_row``."""
        self._steps.append((step_id, [_MaskedRow(r, n) for r, n in rows]))

    def oldest_ready(self) -> bool:
        """Whether the oldest step's masks can be written: every row's matcher has consumed the tokens
        before its sample and computed the mask after them."""
        return all(self._row_ready(row) for row in self._steps[0][1])

    def oldest_computing(self) -> bool:
        """Whether a mask of the oldest step is being computed now: its row's tokens are known and its
        matcher is at work (rather than waiting for a token of a step in flight)."""
        return any(
            len(row.req.output_token_ids) >= row.num_outputs and not self._row_ready(row) for row in self._steps[0][1]
        )

    def _row_ready(self, row: _MaskedRow) -> bool:
        req = row.req
        g = req.grammar
        if self._requests.get(req.req_num) is not req or g.error:
            return True
        return len(req.output_token_ids) >= row.num_outputs and g.ready

    def write_oldest(self, entry: TokenMasks) -> int:
        """Write the oldest step's masks into ``entry`` and forget the step; returns its step id.

        Call once ``oldest_ready``."""
        step_id, rows = self._steps.popleft()
        h, index = entry.header, MASKS.header_index
        h[index["step_id"]], h[index["num_masks"]], h[index["mask_words"]] = step_id, len(rows), entry.bitmask.shape[1]
        for i, row in enumerate(rows):
            req, g = row.req, row.req.grammar
            live = self._requests.get(req.req_num) is req and not g.error
            # A lazy grammar's row may turn out to need no mask once its token in flight is known.
            if live and g.needs_mask(0):
                entry.bitmask[i] = g.mask
            else:
                entry.bitmask[i] = -1
        return step_id
