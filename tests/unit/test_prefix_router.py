"""io_proc's prefix routing over data-parallel engines: what it remembers, and where a request goes."""

from __future__ import annotations

from array import array

from pipeline.common.block_hash import adapter_root, hash_blocks, root_hash
from pipeline.io_proc.prefix_router import PrefixRouter, pick_engine

ROOT = root_hash("m", "float32")


def test_names_are_the_schedulers():
    router = PrefixRouter(2, capacity=100, block_size=4, root=ROOT)
    tokens = list(range(10))
    assert router.names(tokens) == hash_blocks(array("i", tokens), 4, ROOT)
    assert len(router.names(tokens)) == 2


def test_names_include_the_lora_adapter_as_the_schedulers_do():
    router = PrefixRouter(2, capacity=100, block_size=4, root=ROOT)
    tokens = list(range(10))
    assert router.names(tokens, 3) == hash_blocks(array("i", tokens), 4, adapter_root(ROOT, 3))
    names = [set(router.names(tokens, lora_id)) for lora_id in (0, 1, 2)]
    assert not names[0] & names[1] and not names[0] & names[2] and not names[1] & names[2]
    router.record(1, router.names(tokens, 1))
    assert router.matches(router.names(tokens, 1)) == [0, 2]
    assert router.matches(router.names(tokens)) == [0, 0]


def test_matches_count_the_prefix_each_engine_was_sent():
    router = PrefixRouter(3, capacity=100, block_size=2, root=ROOT)
    a = router.names([1, 2, 3, 4, 5, 6])
    router.record(1, a)
    router.record(2, a[:1])
    assert router.matches(a) == [0, 3, 1]
    assert router.matches(router.names([1, 2, 3, 4, 9, 9])) == [0, 2, 1]
    assert router.matches(router.names([9, 9, 3, 4])) == [0, 0, 0], "a block's name covers what precedes it"


def test_memory_is_bounded_least_recently_sent_first_out():
    router = PrefixRouter(1, capacity=3, block_size=1, root=ROOT)
    a, b = router.names([1, 2]), router.names([7, 8])
    router.record(0, a)
    router.record(0, b)  # 4 names, capacity 3: a's first goes
    assert router.matches(a) == [0] and router.matches(b) == [2]
    router.record(0, b[:1])  # refreshed: a[1] is now the oldest
    router.record(0, router.names([5]))
    assert router.matches(b) == [2] and len(router._seen[0]) == 3


def test_pick_engine():
    idle = [[0, 0], [0, 0], [0, 0]]
    assert pick_engine(idle, None, 4) == 0
    assert pick_engine([[1, 0], [0, 3], [0, 2]], None, 4) == 2, "fewest waiting, then running"
    assert pick_engine(idle, [0, 5, 0], 4) == 1, "the longest prefix"
    assert pick_engine(idle, [3, 3, 0], 4) == 0, "a tie goes to the least loaded"
    assert pick_engine([[0, 2], [0, 1], [0, 0]], [3, 3, 0], 4) == 1
    assert pick_engine(idle, [2, 2, 2], 4) == 0, "no engine holds more than the least loaded"
    assert pick_engine([[0, 5], [0, 0]], [4, 0], 4) == 1, "overloaded: 5 more live requests than the least loaded"
    assert pick_engine([[0, 4], [0, 0]], [4, 0], 4) == 0
