"""KV cache block and req_index accounting: reference counts, prefix caching, frees deferred against step ids."""

from __future__ import annotations

from collections import OrderedDict, defaultdict
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pipeline.scheduler_proc.kv_event_publisher import KVEventPublisher


class BlockPool:
    """KV cache blocks and request indices.

    Every block is exactly one of: *free* (no name, no owner), *cached-free*
    (named by its block hash, no owner: its keys and values can be reused
    until it is evicted) or *owned* (a reference count of owners). The owners
    of a block are the requests that hold it and the steps in flight that
    still read it: callers free with ``free_after`` naming the last step
    that references the block, and the reference goes when that step reports
    completion (``step_completed``; docs/design.md, "Deferred free"), so
    no block a step in flight reads or writes is handed out again.

    Naming, sharing and eviction: docs/design.md, "Prefix caching".

    Args:
        num_blocks: KV cache blocks (ids ``0..num_blocks-1``).
        num_req_indices: request indices (ids ``0..num_req_indices-1``), i.e. ``max_num_seqs``.
        enable_caching: name blocks at all; without it ``cache_blocks``
            does nothing and ``lookup`` finds nothing.

    ``events``, when set, hears of each name an eviction forgets
    (``removed``; docs/design.md, "KV-cache events").
    """

    def __init__(self, num_blocks: int, num_req_indices: int, enable_caching: bool = True):
        self.num_blocks, self.num_req_indices = num_blocks, num_req_indices
        self.enable_caching = enable_caching
        # Stacks popped from the end; reversed so low ids go first.
        self._free_blocks = list(range(num_blocks - 1, -1, -1))
        self._free_req_indices = list(range(num_req_indices - 1, -1, -1))
        self._refs = [0] * num_blocks
        self._hash: list[bytes | None] = [None] * num_blocks
        self._cached: dict[bytes, int] = {}  # block hash -> the block it names
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached-free blocks, least recently freed first
        self._deferred: dict[int, list[tuple[list[int], int]]] = defaultdict(list)
        self._num_deferred_blocks = 0
        self._completed_step = -1
        self.events: KVEventPublisher | None = None

    @property
    def num_free_blocks(self) -> int:
        """Blocks ``allocate_blocks`` can hand out now: free and cached-free."""
        return len(self._free_blocks) + len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        """Named blocks, owned or cached-free."""
        return len(self._cached)

    @property
    def num_free_req_indices(self) -> int:
        return len(self._free_req_indices)

    @property
    def num_deferred_blocks(self) -> int:
        """Blocks that come back once the steps in flight complete (at most: a shared one may stay held)."""
        return self._num_deferred_blocks

    def allocate_blocks(self, n: int) -> list[int] | None:
        """Take ``n`` unnamed blocks, one owner each, or None (taking nothing) if fewer are free."""
        if n > self.num_free_blocks:
            return None
        if n == 0:
            return []
        k = min(n, len(self._free_blocks))
        out = self._free_blocks[len(self._free_blocks) - k :]
        del self._free_blocks[len(self._free_blocks) - k :]
        for _ in range(n - k):  # evict the least recently freed named blocks
            b, _ = self._evictable.popitem(last=False)
            del self._cached[self._hash[b]]
            if self.events is not None:
                self.events.removed(self._hash[b])
            self._hash[b] = None
            out.append(b)
        for b in out:
            self._refs[b] = 1
        return out

    def lookup(self, hashes: list[bytes]) -> list[int]:
        """The blocks named ``hashes[0]``, ``hashes[1]``, ... up to the first name not cached; takes nothing."""
        out = []
        cached = self._cached
        for h in hashes:
            b = cached.get(h)
            if b is None:
                break
            out.append(b)
        return out

    def count_unowned(self, blocks: list[int]) -> int:
        """How many of ``blocks`` are cached-free: what ``share`` takes from ``num_free_blocks``."""
        refs = self._refs
        return sum(1 for b in blocks if not refs[b])

    def share(self, blocks: list[int]) -> None:
        """One more owner for each of ``blocks`` (owned or cached-free); each owner frees them once."""
        refs, evictable = self._refs, self._evictable
        for b in blocks:
            if not refs[b]:
                del evictable[b]
            refs[b] += 1

    def cache_blocks(self, blocks: list[int], hashes: list[bytes]) -> list[int]:
        """Name owned full blocks whose tokens are final: ``blocks[i]`` gets ``hashes[i]``; returns the ``i`` named.

        A name that already names another block (the same prefix computed
        twice at once) leaves this block unnamed: it is freed unnamed.
        """
        named: list[int] = []
        if not self.enable_caching:
            return named
        cached, names = self._cached, self._hash
        for i, (b, h) in enumerate(zip(blocks, hashes)):
            if h not in cached and names[b] is None:
                cached[h] = b
                names[b] = h
                named.append(i)
        return named

    def allocate_req_index(self) -> int | None:
        """Take a req_index, or None if none is free."""
        return self._free_req_indices.pop() if self._free_req_indices else None

    def free_after(self, step_id: int, blocks: list[int], req_index: int) -> None:
        """Drop one owner of each of ``blocks``, and free ``req_index`` (-1: none), once step ``step_id`` has completed.

        ``blocks`` in order from the request's first: its last ones are evicted first.
        """
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
        # Locals: at batch 1024 this runs for hundreds of blocks a step.
        refs, names, free, evictable = self._refs, self._hash, self._free_blocks, self._evictable
        for b in reversed(blocks):  # a prefix outlives its tails: its blocks are the most recently freed
            refs[b] -= 1
            if not refs[b]:
                if names[b] is None:
                    free.append(b)
                else:
                    evictable[b] = None
        if req_index >= 0:
            self._free_req_indices.append(req_index)
