"""Unit tests of :class:`pipeline.scheduler_proc.kv_block_pool.BlockPool`: counts, deferred free, exhaustion.

A block or req_index freed with ``free_after(step_id, ...)`` must stay out of the
free lists until ``step_completed(s)`` with ``s >= step_id``; with no step in
flight past ``step_id`` it is free at once.
"""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pipeline.scheduler_proc.kv_block_pool import BlockPool


def test_initial_counts():
    pool = BlockPool(num_blocks=10, num_req_indices=3)
    assert (pool.num_free_blocks, pool.num_free_req_indices, pool.num_deferred_blocks) == (10, 3, 0)


def test_allocate_blocks_counts_and_ids():
    pool = BlockPool(num_blocks=10, num_req_indices=2)
    a = pool.allocate_blocks(4)
    b = pool.allocate_blocks(5)
    assert len(a) == 4 and len(b) == 5
    assert len(set(a + b)) == 9 and set(a + b) <= set(range(10))
    assert pool.num_free_blocks == 1
    assert pool.allocate_blocks(0) == []
    assert pool.num_free_blocks == 1


def test_allocate_blocks_exhaustion_takes_nothing():
    """Asking for more blocks than are free returns None and leaves the free list as it was."""
    pool = BlockPool(num_blocks=5, num_req_indices=1)
    first = pool.allocate_blocks(3)
    assert pool.allocate_blocks(3) is None
    assert pool.num_free_blocks == 2
    rest = pool.allocate_blocks(2)
    assert sorted(first + rest) == list(range(5))
    assert pool.allocate_blocks(1) is None
    assert pool.allocate_blocks(0) == []
    assert pool.num_free_blocks == 0


def test_allocate_req_index_exhaustion_and_no_double_allocation():
    pool = BlockPool(num_blocks=1, num_req_indices=4)
    req_indices = [pool.allocate_req_index() for _ in range(4)]
    assert sorted(req_indices) == [0, 1, 2, 3]
    assert pool.allocate_req_index() is None
    assert pool.num_free_req_indices == 0
    pool.free_after(-1, [], req_indices[2])
    assert pool.allocate_req_index() == req_indices[2]
    assert pool.allocate_req_index() is None


def test_free_with_no_step_in_flight_is_immediate():
    """Freeing against a step that already completed (or before any step) returns blocks and req_index at once."""
    pool = BlockPool(num_blocks=6, num_req_indices=2)
    blocks, req_index = pool.allocate_blocks(3), pool.allocate_req_index()
    pool.free_after(-1, blocks, req_index)  # a request that never ran
    assert (pool.num_free_blocks, pool.num_free_req_indices, pool.num_deferred_blocks) == (6, 2, 0)

    pool.step_completed(4)
    blocks, req_index = pool.allocate_blocks(2), pool.allocate_req_index()
    pool.free_after(4, blocks, req_index)  # its last step is the one that just completed
    assert (pool.num_free_blocks, pool.num_free_req_indices, pool.num_deferred_blocks) == (6, 2, 0)
    blocks = pool.allocate_blocks(1)
    pool.free_after(2, blocks, -1)  # an older step
    assert (pool.num_free_blocks, pool.num_free_req_indices, pool.num_deferred_blocks) == (6, 2, 0)


def test_deferred_free_waits_for_its_step():
    """Blocks and req_index freed after step 7 come back on step_completed(7), not on an earlier step."""
    pool = BlockPool(num_blocks=8, num_req_indices=2)
    blocks, req_index = pool.allocate_blocks(5), pool.allocate_req_index()
    pool.step_completed(5)
    pool.free_after(7, blocks, req_index)
    assert (pool.num_free_blocks, pool.num_free_req_indices, pool.num_deferred_blocks) == (3, 1, 5)
    assert pool.allocate_blocks(4) is None, "deferred blocks must not be reusable yet"

    pool.step_completed(6)
    assert (pool.num_free_blocks, pool.num_free_req_indices, pool.num_deferred_blocks) == (3, 1, 5)

    pool.step_completed(7)
    assert (pool.num_free_blocks, pool.num_free_req_indices, pool.num_deferred_blocks) == (8, 2, 0)
    assert sorted(pool.allocate_blocks(8)) == list(range(8))


def test_deferred_free_per_step_and_skipped_steps():
    """Each step releases only what was freed against it or earlier steps; a jump releases everything up to it."""
    pool = BlockPool(num_blocks=9, num_req_indices=3)
    b1, b2, b3 = pool.allocate_blocks(2), pool.allocate_blocks(3), pool.allocate_blocks(4)
    s1, s2, s3 = pool.allocate_req_index(), pool.allocate_req_index(), pool.allocate_req_index()
    pool.free_after(1, b1, s1)
    pool.free_after(3, b2, -1)
    pool.free_after(3, [], s2)
    pool.free_after(6, b3, s3)
    assert (pool.num_free_blocks, pool.num_free_req_indices, pool.num_deferred_blocks) == (0, 0, 9)

    pool.step_completed(0)
    assert (pool.num_free_blocks, pool.num_free_req_indices, pool.num_deferred_blocks) == (0, 0, 9)
    pool.step_completed(2)  # step 1 completed along with 2
    assert (pool.num_free_blocks, pool.num_free_req_indices, pool.num_deferred_blocks) == (2, 1, 7)
    assert sorted(pool.allocate_blocks(2)) == sorted(b1)
    assert pool.allocate_req_index() == s1
    pool.step_completed(5)
    assert (pool.num_free_blocks, pool.num_free_req_indices, pool.num_deferred_blocks) == (3, 1, 4)
    assert pool.allocate_req_index() == s2
    pool.step_completed(6)
    assert (pool.num_free_blocks, pool.num_free_req_indices, pool.num_deferred_blocks) == (7, 1, 0)
    assert pool.allocate_req_index() == s3


def test_free_after_the_deferred_step_completed_is_immediate():
    """Once a step completed, a later free against it is not deferred to a step that will never report again."""
    pool = BlockPool(num_blocks=4, num_req_indices=1)
    a = pool.allocate_blocks(2)
    pool.free_after(3, a, -1)
    pool.step_completed(3)
    b = pool.allocate_blocks(4)
    assert sorted(b) == [0, 1, 2, 3]
    pool.free_after(3, b, -1)
    assert (pool.num_free_blocks, pool.num_deferred_blocks) == (4, 0)


class PoolMachine(RuleBasedStateMachine):
    """Random allocate / schedule / free / complete sequences checked against a model of who holds what.

    The model mirrors the scheduler: a request owns blocks and maybe a req_index and
    remembers the last step that referenced them; steps are issued in order and
    complete in order (possibly several at once).
    """

    @initialize(num_blocks=st.integers(0, 24), num_req_indices=st.integers(0, 6))
    def setup(self, num_blocks, num_req_indices):
        self.pool = BlockPool(num_blocks, num_req_indices)
        self.num_blocks, self.num_req_indices = num_blocks, num_req_indices
        self.requests: list[dict] = []  # {"blocks": [...], "req_index": int, "last_step": int}
        self.deferred: dict[int, list[tuple[list[int], int]]] = {}
        self.next_step = 0
        self.completed = -1

    # -- helpers ---------------------------------------------------------------

    def in_use_blocks(self) -> list[int]:
        return [b for r in self.requests for b in r["blocks"]]

    def in_use_req_indices(self) -> list[int]:
        return [r["req_index"] for r in self.requests if r["req_index"] >= 0]

    def deferred_blocks(self) -> list[int]:
        return [b for entries in self.deferred.values() for blocks, _ in entries for b in blocks]

    def deferred_req_indices(self) -> list[int]:
        return [s for entries in self.deferred.values() for _, s in entries if s >= 0]

    # -- rules -----------------------------------------------------------------

    @rule(n=st.integers(0, 8), with_req_index=st.booleans())
    def new_request(self, n, with_req_index):
        free_before = self.pool.num_free_blocks
        blocks = self.pool.allocate_blocks(n)
        if n > free_before:
            assert blocks is None
            assert self.pool.num_free_blocks == free_before
            return
        assert blocks is not None and len(blocks) == n
        held = set(self.in_use_blocks()) | set(self.deferred_blocks())
        assert not set(blocks) & held, f"blocks {sorted(set(blocks) & held)} handed out while still held"
        assert len(set(blocks)) == n and all(0 <= b < self.num_blocks for b in blocks)
        req_index = -1
        if with_req_index:
            free_before = self.pool.num_free_req_indices
            got = self.pool.allocate_req_index()
            if free_before == 0:
                assert got is None
            else:
                held = set(self.in_use_req_indices()) | set(self.deferred_req_indices())
                assert got is not None and 0 <= got < self.num_req_indices and got not in held
                req_index = got
        self.requests.append({"blocks": list(blocks), "req_index": req_index, "last_step": -1})

    @precondition(lambda self: self.requests)
    @rule(data=st.data(), n=st.integers(0, 4))
    def grow(self, data, n):
        req = data.draw(st.sampled_from(self.requests))
        free_before = self.pool.num_free_blocks
        blocks = self.pool.allocate_blocks(n)
        if n > free_before:
            assert blocks is None
            return
        held = set(self.in_use_blocks()) | set(self.deferred_blocks())
        assert not set(blocks) & held, f"blocks {sorted(set(blocks) & held)} handed out while still held"
        req["blocks"].extend(blocks)

    @rule(data=st.data())
    def schedule_step(self, data):
        """Issue the next step; some requests are in it."""
        step = self.next_step
        self.next_step += 1
        for req in self.requests:
            if data.draw(st.booleans()):
                req["last_step"] = step

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def free_request(self, data):
        req = data.draw(st.sampled_from(self.requests))
        self.requests.remove(req)
        blocks = list(req["blocks"])
        self.pool.free_after(req["last_step"], blocks, req["req_index"])
        if req["last_step"] > self.completed:
            self.deferred.setdefault(req["last_step"], []).append((blocks, req["req_index"]))

    @precondition(lambda self: self.completed < self.next_step - 1)
    @rule(data=st.data())
    def complete_steps(self, data):
        """The oldest in-flight step completes, maybe with a few after it."""
        step = data.draw(st.integers(self.completed + 1, self.next_step - 1))
        self.pool.step_completed(step)
        self.completed = step
        for s in [s for s in self.deferred if s <= step]:
            del self.deferred[s]

    # -- invariants --------------------------------------------------------------

    @invariant()
    def counts_add_up(self):
        in_use, deferred = self.in_use_blocks(), self.deferred_blocks()
        assert self.pool.num_deferred_blocks == len(deferred)
        assert self.pool.num_free_blocks + self.pool.num_deferred_blocks + len(in_use) == self.num_blocks
        assert (
            self.pool.num_free_req_indices + len(self.deferred_req_indices()) + len(self.in_use_req_indices())
            == self.num_req_indices
        )

    @invariant()
    def nothing_held_twice(self):
        held = self.in_use_blocks() + self.deferred_blocks()
        assert len(held) == len(set(held))
        req_indices = self.in_use_req_indices() + self.deferred_req_indices()
        assert len(req_indices) == len(set(req_indices))


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


@pytest.mark.parametrize("num_blocks", [1, 7])
def test_drain_everything_back(num_blocks):
    """After every request is freed and every step completed, all blocks and req_indices are free, each id once."""
    pool = BlockPool(num_blocks, 3)
    held = []
    step = 0
    while (blocks := pool.allocate_blocks(1)) is not None:
        held.append((step, blocks, pool.allocate_req_index() if len(held) < 3 else -1))
        step += 1
    for s, blocks, req_index in held:
        pool.free_after(s, blocks, req_index)
    pool.step_completed(step)
    assert (pool.num_free_blocks, pool.num_free_req_indices, pool.num_deferred_blocks) == (num_blocks, 3, 0)
    assert sorted(pool.allocate_blocks(num_blocks)) == list(range(num_blocks))
    assert sorted(pool.allocate_req_index() for _ in range(3)) == [0, 1, 2]
