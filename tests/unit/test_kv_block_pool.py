"""Unit tests of ``pipeline.scheduler_proc.kv_block_pool.BlockPool``: counts, deferred free, exhaustion.

A block or req_index freed with ``free_after(step_id, ...)`` must stay out of the
free lists until ``step_completed(s)`` with ``s >= step_id``; with no step in
flight past ``step_id`` it is free at once.
"""

from __future__ import annotations

import os
import subprocess
import sys
from array import array

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pipeline.common.block_hash import hash_blocks, root_hash
from pipeline.scheduler_proc.kv_block_pool import BlockPool
from tests.unit.pool_invariant import check_pool


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


# -- prefix caching -------------------------------------------------------------

BS = 2
ROOT = root_hash("test-model", "float32")


def names(tokens: list[int]) -> list[bytes]:
    return hash_blocks(array("i", tokens), BS, ROOT)


def test_block_hashes_chain_their_parent():
    """A block's name covers every token before it: equal blocks after different prefixes differ."""
    a, b = names([1, 2, 3, 4]), names([9, 9, 3, 4])
    assert len(a) == 2 and a[1] != b[1] and a[0] != b[0]
    assert names([1, 2, 3, 4, 5]) == a, "a partial last block has no name"
    assert names([1, 2, 3, 4, 5, 6])[:2] == a
    assert hash_blocks(array("i", [1, 2, 3, 4]), BS, a[0], start=1) == a[1:]
    assert names([1, 2]) != hash_blocks(array("i", [1, 2]), BS, root_hash("test-model", "bfloat16"))


def test_block_hashes_same_in_another_process():
    """io_proc routes by the names the schedulers compute: they cannot depend on the process (hash seeds)."""
    code = (
        "from array import array; from pipeline.common.block_hash import hash_blocks, root_hash; "
        "print(hash_blocks(array('i', [5, 6, 7, 8]), 2, root_hash('test-model', 'float32'))[1].hex())"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == names([5, 6, 7, 8])[1].hex()


def test_freed_named_blocks_stay_cached_and_are_found():
    pool = BlockPool(num_blocks=6, num_req_indices=2)
    h = names([1, 2, 3, 4, 5, 6])
    blocks = pool.allocate_blocks(3)
    pool.cache_blocks(blocks[:2], h[:2])  # the third block's tokens are not final yet
    assert pool.lookup(h) == blocks[:2] and pool.num_cached_blocks == 2
    pool.free_after(-1, blocks, -1)
    assert pool.num_free_blocks == 6, "cached-free blocks count as free"
    assert pool.lookup(h) == blocks[:2], "a finished request's blocks stay cached"
    assert pool.lookup(names([1, 2, 9, 9])) == blocks[:1]
    assert pool.lookup(names([7, 7, 3, 4])) == []
    hit = pool.lookup(h)
    assert pool.count_unowned(hit) == 2
    pool.share(hit)
    assert pool.num_free_blocks == 4 and pool.count_unowned(hit) == 0
    check_pool(pool, [hit])


def test_eviction_takes_free_blocks_first_then_least_recently_freed():
    """Unnamed free blocks go first; then cached-free ones, oldest free first and a request's tail before its head."""
    pool = BlockPool(num_blocks=5, num_req_indices=1)
    a, b = pool.allocate_blocks(2), pool.allocate_blocks(2)
    pool.cache_blocks(a, names([1, 2, 3, 4]))
    pool.cache_blocks(b, names([5, 6, 7, 8]))
    pool.free_after(-1, a, -1)
    pool.free_after(-1, b, -1)
    assert pool.num_free_blocks == 5
    first = pool.allocate_blocks(1)
    assert first not in (a, b) and pool.num_cached_blocks == 4, "an unnamed free block goes before any named one"
    assert pool.allocate_blocks(1) == [a[1]]
    assert pool.lookup(names([1, 2, 3, 4])) == [a[0]], "evicting a block drops its name only"
    assert pool.allocate_blocks(2) == [a[0], b[1]]
    assert pool.lookup(names([5, 6, 7, 8])) == [b[0]]
    pool.share([b[0]])  # a hit makes it owned: not evictable
    assert pool.allocate_blocks(1) is None
    check_pool(pool, [first, [a[1]], [a[0], b[1]], [b[0]]])


def test_a_hit_refreshes_recency():
    pool = BlockPool(num_blocks=4, num_req_indices=1)
    a, b = pool.allocate_blocks(2), pool.allocate_blocks(2)
    pool.cache_blocks(a, names([1, 2, 3, 4]))
    pool.cache_blocks(b, names([5, 6, 7, 8]))
    pool.free_after(-1, a, -1)
    pool.free_after(-1, b, -1)
    hit = pool.lookup(names([1, 2, 3, 4]))
    pool.share(hit)
    pool.free_after(-1, hit, -1)  # a's blocks are now the most recently freed
    assert pool.allocate_blocks(2) == [b[1], b[0]]


def test_a_name_names_one_block():
    """The same prefix computed twice at once: the second copy stays unnamed and is freed as a plain block."""
    pool = BlockPool(num_blocks=4, num_req_indices=1)
    h = names([1, 2, 3, 4])
    a, b = pool.allocate_blocks(2), pool.allocate_blocks(2)
    pool.cache_blocks(a, h)
    pool.cache_blocks(b, h)
    assert pool.lookup(h) == a and pool.num_cached_blocks == 2
    pool.free_after(-1, b, -1)
    assert sorted(pool.allocate_blocks(2)) == sorted(b), "b's blocks were freed unnamed"
    check_pool(pool, [a, b])


def test_deferred_blocks_stay_findable_but_not_reusable():
    """A block freed behind a step in flight can be hit (later steps read it after it is written), never reused."""
    pool = BlockPool(num_blocks=2, num_req_indices=1)
    h = names([1, 2, 3, 4])
    blocks = pool.allocate_blocks(2)
    pool.cache_blocks(blocks, h)
    pool.free_after(3, blocks, -1)
    assert pool.num_free_blocks == 0 and pool.allocate_blocks(1) is None
    hit = pool.lookup(h)
    assert hit == blocks
    pool.share(hit)
    pool.step_completed(3)
    assert pool.num_free_blocks == 0, "the hit keeps them owned"
    check_pool(pool, [hit])


def test_without_caching_nothing_is_named():
    pool = BlockPool(num_blocks=2, num_req_indices=1, enable_caching=False)
    h = names([1, 2, 3, 4])
    blocks = pool.allocate_blocks(2)
    pool.cache_blocks(blocks, h)
    pool.free_after(-1, blocks, -1)
    assert pool.lookup(h) == [] and pool.num_cached_blocks == 0
    check_pool(pool, [])


class CachingPoolMachine(RuleBasedStateMachine):
    """Arrivals, steps, finishes, aborts and preemptions of requests sharing prefixes, as the scheduler drives the pool.

    A request takes the longest run of cached blocks of its prompt (leaving
    one token to compute), allocates the rest, and names its full blocks once
    a step computed them. Checked after every rule: the pool invariant, that
    no block a step in flight reads is handed out again, and that a hit block
    holds the tokens the request expects.
    """

    @initialize(num_blocks=st.integers(1, 24))
    def setup(self, num_blocks):
        self.pool = BlockPool(num_blocks, num_req_indices=64)
        self.requests: list[dict] = []  # {"tokens", "blocks", "computed": blocks computed, "last_step"}
        self.inflight: dict[int, set[int]] = {}  # step id -> the blocks it reads or writes
        self.content: dict[int, bytes] = {}  # block -> the name of the prefix its keys and values hold
        self.next_step = 0

    def _allocate(self, n: int) -> list[int] | None:
        blocks = self.pool.allocate_blocks(n)
        if blocks is not None:
            busy = set().union(*self.inflight.values()) | {b for r in self.requests for b in r["blocks"]}
            assert not set(blocks) & busy, f"blocks {sorted(set(blocks) & busy)} handed out while in use"
            for b in blocks:
                self.content.pop(b, None)
        return blocks

    def _admit(self, tokens: list[int]) -> None:
        h = names(tokens)
        hit = self.pool.lookup(h[: (len(tokens) - 1) // BS])
        for b, name in zip(hit, h):
            assert self.content.get(b) == name, f"hit block {b} holds another prefix"
        need = -(-len(tokens) // BS) - len(hit)
        if need + self.pool.count_unowned(hit) > self.pool.num_free_blocks:
            return  # it would wait for blocks
        self.pool.share(hit)
        blocks = hit + self._allocate(need)
        self.requests.append({"tokens": tokens, "hashes": h, "blocks": blocks, "computed": len(hit), "last_step": -1})

    @rule(
        prefix=st.sampled_from([(), (1, 2, 3), (1, 2, 3, 4, 5), (7, 8)]), tail=st.lists(st.integers(1, 3), max_size=5)
    )
    def arrive(self, prefix, tail):
        if prefix or tail:
            self._admit([*prefix, *tail])

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def step(self, data):
        """Some requests compute their blocks in the next step; those full of final tokens get names."""
        sid = self.next_step
        self.next_step += 1
        reads = set()
        for r in self.requests:
            if data.draw(st.booleans()):
                r["last_step"] = sid
                reads.update(r["blocks"])
                full = len(r["hashes"])
                new = range(r["computed"], full)
                self.pool.cache_blocks([r["blocks"][i] for i in new], [r["hashes"][i] for i in new])
                for i in new:
                    self.content.setdefault(r["blocks"][i], r["hashes"][i])
                r["computed"] = len(r["blocks"])
        self.inflight[sid] = reads

    @precondition(lambda self: self.inflight)
    @rule(data=st.data())
    def complete(self, data):
        sid = data.draw(st.sampled_from(sorted(self.inflight)))
        self.pool.step_completed(sid)
        for s in [s for s in self.inflight if s <= sid]:
            del self.inflight[s]

    @precondition(lambda self: self.requests)
    @rule(data=st.data(), why=st.sampled_from(["finish", "abort", "preempt"]))
    def leave(self, data, why):
        """Finish, abort and preemption all free a request's blocks behind its last step; they stay cached."""
        r = data.draw(st.sampled_from(self.requests))
        self.requests.remove(r)
        self.pool.free_after(r["last_step"], r["blocks"], -1)
        if why == "preempt":  # it comes back and looks its prefix up again
            self._admit(r["tokens"])

    @invariant()
    def pool_invariant(self):
        check_pool(self.pool, [r["blocks"] for r in self.requests])


TestCachingPoolMachine = CachingPoolMachine.TestCase
TestCachingPoolMachine.settings = settings(max_examples=150, stateful_step_count=50, deadline=None)
