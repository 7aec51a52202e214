"""The block pool's invariant, checked by the pool tests and after every scheduler test."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from pipeline.scheduler_proc.kv_block_pool import BlockPool


def check_pool(pool: BlockPool, held_blocks: Iterable[list[int]], held_req_indices: Iterable[int] = ()) -> None:
    """Assert the pool's invariant, given what its callers hold.

    Every block is exactly one of free, cached-free or owned; a block's
    reference count equals its owners (each holder of it plus each free still
    deferred behind a step in flight); a name belongs to one block and back;
    every req_index is free, held or deferred, once.
    """
    owners = Counter(b for blocks in held_blocks for b in blocks)
    deferred = [entry for entries in pool._deferred.values() for entry in entries]
    owners.update(b for blocks, _ in deferred for b in blocks)
    assert pool.num_deferred_blocks == sum(len(blocks) for blocks, _ in deferred)
    free, evictable = pool._free_blocks, list(pool._evictable)
    assert len(free) == len(set(free)), "a block is twice in the free list"
    assert not set(free) & set(evictable), f"blocks {set(free) & set(evictable)} both free and cached-free"
    free_set = set(free)
    for b in range(pool.num_blocks):
        assert pool._refs[b] == owners[b], f"block {b}: {pool._refs[b]} references, {owners[b]} owners"
        state = (b in free_set) + (b in pool._evictable) + (pool._refs[b] > 0)
        assert state == 1, f"block {b} is not exactly one of free, cached-free, owned"
    assert all(pool._hash[b] is None for b in free), "a free block keeps a name"
    assert all(pool._hash[b] is not None for b in evictable), "a cached-free block has no name"
    assert all(pool._hash[b] == h for h, b in pool._cached.items())
    assert sum(h is not None for h in pool._hash) == len(pool._cached) == pool.num_cached_blocks
    indices = [*pool._free_req_indices, *held_req_indices, *(s for _, s in deferred if s >= 0)]
    assert sorted(indices) == list(range(pool.num_req_indices)), f"req indices held/free/deferred: {sorted(indices)}"
