"""The masks of a step's constrained rows, which the scheduler writes after the step's descriptor (docs/design.md,
"Structured output"): read just before the step samples, while its forward pass runs."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from pipeline.common.process import StopFlag, Stopped
from pipeline.common.shm_ring import RingTimeout, ShmRing
from pipeline.common.step_protocol import TokenMasks

if TYPE_CHECKING:
    from pipeline.gpu_worker.distributed import DescriptorRelay

# While the masks are being computed, publish finished steps and look again this often.
_MASK_POLL_S = 0.0002


class MaskReader:
    """Reads each masked step's ``TokenMasks`` entry, in step order (``ring`` None on a non-head node, which gets
    ``relay``'s); a wait ends with ``Stopped`` once ``stop`` is set."""

    def __init__(self, ring: ShmRing[TokenMasks] | None, rank: int, stop: StopFlag, relay: DescriptorRelay | None):
        self.ring, self.rank, self.stop, self.relay = ring, rank, stop, relay

    def read(self, step_id: int, num_masks: int, meanwhile: Callable[[], None] | None) -> np.ndarray:
        """The ``[num_masks, W]`` int32 bitmasks of step ``step_id``, once written; ``meanwhile`` runs while they are
        awaited.

        Raises:
            Stopped: the process is stopping.
            RuntimeError: the entry is another step's (the scheduler and worker disagree).
        """
        if self.ring is None:
            return self.relay.receive_masks(num_masks)
        while True:
            try:
                entry = self.ring.acquire_read(self.rank, timeout=_MASK_POLL_S)
                break
            except RingTimeout:
                if self.stop.is_set():
                    raise Stopped from None
                if meanwhile is not None:
                    meanwhile()
        got, n, words = entry.step_id, entry.num_masks, entry.bitmask[:num_masks].copy()
        self.ring.release_read(self.rank)
        if got != step_id or n != num_masks:
            raise RuntimeError(f"step {step_id}: read the masks of step {got}")
        if self.relay is not None:
            self.relay.send_masks(words)
        return words
