"""KV cache blocks and req_indices, with frees deferred against step ids."""

from __future__ import annotations

from collections import defaultdict


class BlockPool:
    """Free lists of reference-counted KV blocks and of req_indices.

    Allocation is immediate; freeing is not. A block or req_index that an
    in-flight step still reads is not reusable until that step has reported
    completion (docs/design.md, "Deferred free"): callers free with
    ``free_after`` naming the last step that references them, and
    ``step_completed`` gives back what every completed step held.

    A block has one reference per holder: the choices of a request with
    ``n`` > 1 share its prompt's full blocks (``share``; docs/design.md,
    "Parallel choices"), and a block returns to the free list when its last
    holder frees it.

    Args:
        num_blocks: KV cache blocks (ids ``0..num_blocks-1``).
        num_req_indices: request rows (ids ``0..num_req_indices-1``), i.e. ``max_num_seqs``.
    """

    def __init__(self, num_blocks: int, num_req_indices: int):
        self.num_blocks, self.num_req_indices = num_blocks, num_req_indices
        # Stacks popped from the end; reversed so low ids go first.
        self._free_blocks = list(range(num_blocks - 1, -1, -1))
        self._free_req_indices = list(range(num_req_indices - 1, -1, -1))
        self._refs = [0] * num_blocks
        self._deferred: dict[int, list[tuple[list[int], int]]] = defaultdict(list)
        self._num_deferred_blocks = 0
        self._completed_step = -1

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_blocks)

    @property
    def num_free_req_indices(self) -> int:
        return len(self._free_req_indices)

    @property
    def num_deferred_blocks(self) -> int:
        """Blocks that come back once the steps in flight complete (at most: a shared one may stay held)."""
        return self._num_deferred_blocks

    def allocate_blocks(self, n: int) -> list[int] | None:
        """Take ``n`` blocks, one reference each, or None (taking nothing) if fewer are free."""
        if n > len(self._free_blocks):
            return None
        if n == 0:
            return []
        out = self._free_blocks[-n:]
        del self._free_blocks[-n:]
        for b in out:
            self._refs[b] = 1
        return out

    def share(self, blocks: list[int]) -> None:
        """One more holder for each of ``blocks``; each holder frees them once."""
        for b in blocks:
            self._refs[b] += 1

    def allocate_req_index(self) -> int | None:
        """Take a req_index, or None if none is free."""
        return self._free_req_indices.pop() if self._free_req_indices else None

    def free_after(self, step_id: int, blocks: list[int], req_index: int = -1) -> None:
        """Drop one reference to each of ``blocks`` and free ``req_index`` (-1: none) once step ``step_id``
        has completed (now, if it has)."""
        if step_id <= self._completed_step:
            self._release(blocks, req_index)
        else:
            self._deferred[step_id].append((blocks, req_index))
            self._num_deferred_blocks += len(blocks)

    def step_completed(self, step_id: int) -> None:
        """Step ``step_id`` (and every earlier one) reported its output."""
        self._completed_step = step_id
        for s in [s for s in self._deferred if s <= step_id]:
            for blocks, req_index in self._deferred.pop(s):
                self._num_deferred_blocks -= len(blocks)
                self._release(blocks, req_index)

    def _release(self, blocks: list[int], req_index: int) -> None:
        refs, free = self._refs, self._free_blocks  # locals: at batch 1024 this runs for hundreds of blocks a step
        for b in blocks:
            refs[b] -= 1
            if not refs[b]:
                free.append(b)
        if req_index >= 0:
            self._free_req_indices.append(req_index)
