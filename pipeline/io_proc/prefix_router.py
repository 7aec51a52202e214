"""Which data-parallel engine holds a prompt's prefix, as far as io_proc has seen (docs/design.md, "Parallelism").

io_proc names the full blocks of every prompt it sends, and of the prompt
plus its output when the request finishes, as the schedulers do
(``pipeline.common.block_hash``), and remembers for each engine the
names it sent there, least recently used first out, as many as one engine's
KV cache has blocks: an engine cannot hold more, so older names are likely
evicted there too. The schedulers are never asked: this is a guess, and a
wrong one costs a recomputed prefix, not a wrong answer.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict

from pipeline.common.block_hash import adapter_root, hash_blocks


class PrefixRouter:
    """Per engine, the block names io_proc sent there, bounded.

    Args:
        num_engines: data-parallel engines.
        capacity: names remembered per engine (its KV cache blocks).
        block_size: tokens per KV block.
        root: the parent name of a first block (``EngineConfig.block_hash_root``).
    """

    def __init__(self, num_engines: int, capacity: int, block_size: int, root: bytes):
        self._seen: list[OrderedDict[bytes, None]] = [OrderedDict() for _ in range(num_engines)]
        self._capacity, self._block_size, self._root = capacity, block_size, root

    def names(self, tokens: list[int], lora_id: int = 0) -> list[bytes]:
        """The names of the full blocks of ``tokens`` run with LoRA adapter ``lora_id`` (0: none)."""
        return hash_blocks(array("i", tokens), self._block_size, adapter_root(self._root, lora_id))

    def matches(self, names: list[bytes]) -> list[int]:
        """Per engine, how many of ``names`` from the first on it was sent."""
        out = []
        for seen in self._seen:
            n = 0
            while n < len(names) and names[n] in seen:
                n += 1
            out.append(n)
        return out

    def record(self, engine: int, names: list[bytes]) -> None:
        """``engine`` was sent (or computed) the blocks ``names``: they become its most recent."""
        seen = self._seen[engine]
        for h in names:
            seen[h] = None
            seen.move_to_end(h)
        while len(seen) > self._capacity:
            seen.popitem(last=False)


def pick_engine(load: list[list[int]], matched: list[int] | None, threshold: int) -> int:
    """The engine a new request goes to.

    Args:
        load: per engine, its live requests ``[waiting, running]``.
        matched: per engine, the blocks of the request's prefix it holds (None: no prefix routing).
        threshold: live requests past the least loaded engine's at which an engine is overloaded.

    Returns:
        The engine that holds the longest prefix (the less loaded on a tie),
        unless it holds no more than the least loaded engine or is
        overloaded; else the least loaded: fewest waiting, then running
        (lowest index on a tie).
    """
    least = min(range(len(load)), key=lambda e: (*load[e], e))
    if matched is None:
        return least
    best = max(range(len(load)), key=lambda e: (matched[e], -sum(load[e]), -e))
    if matched[best] > matched[least] and sum(load[best]) - sum(load[least]) <= threshold:
        return best
    return least
