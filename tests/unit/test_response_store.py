"""The Responses store's bounds: entries, bytes and age, the oldest evicted first; follow-ups share history."""

from __future__ import annotations

import json

from pipeline.io_proc.openai.response_store import ResponseStore


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_entries_bound_evicts_the_oldest():
    store = ResponseStore(max_entries=2, max_bytes=1000, max_age_s=60, clock=Clock())
    for i in range(3):
        assert store.put(f"r{i}", b"{}", b"[]")
    assert store.get("r0") is None and store.get("r1") and store.get("r2") and len(store) == 2


def test_bytes_bound_evicts_the_oldest_and_refuses_what_alone_exceeds_it():
    store = ResponseStore(max_entries=10, max_bytes=100, max_age_s=60, clock=Clock())
    store.put("a", b"x" * 40, b"")
    store.put("b", b"x" * 40, b"")
    store.put("c", b"x" * 40, b"")
    assert store.get("a") is None and store.get("b") and store.get("c") and store.num_bytes == 80
    assert not store.put("huge", b"x" * 101, b"") and store.get("huge") is None and store.num_bytes == 80


def test_age_bound_and_delete():
    clock = Clock()
    store = ResponseStore(max_entries=10, max_bytes=1000, max_age_s=5, clock=clock)
    store.put("old", b"{}", b"[]")
    clock.now = 3
    store.put("new", b"{}", b"[]")
    clock.now = 6
    assert store.get("old") is None and store.get("new").response == b"{}"
    assert store.delete("new") and not store.delete("new") and len(store) == 0 and store.num_bytes == 0


def test_zero_entries_stores_nothing():
    store = ResponseStore(max_entries=0, max_bytes=1000, max_age_s=5)
    assert not store.put("r", b"{}", b"[]") and store.get("r") is None


def test_a_chain_of_follow_ups_shares_its_history():
    store = ResponseStore(max_entries=100, max_bytes=10_000, max_age_s=60, clock=Clock())
    previous = None
    for hop in range(18):
        assert store.put(f"r{hop}", b"{}", json.dumps([{"hop": hop}]).encode(), previous)
        previous = store.get(f"r{hop}")
    assert previous.conversation() == [{"hop": hop} for hop in range(18)]
    # Each hop keeps its own item only: the bytes grow linearly, not with the square of the hops.
    assert store.num_bytes == sum(2 + len(json.dumps([{"hop": hop}])) for hop in range(18))


def test_history_a_kept_follow_up_reaches_stays_counted_until_it_goes():
    store = ResponseStore(max_entries=2, max_bytes=1000, max_age_s=60, clock=Clock())
    store.put("a", b"{}", b'["' + b"a" * 96 + b'"]')  # 2 + 100 bytes
    store.put("b", b"", b'["bbbbbb"]', store.get("a"))  # 10
    store.put("c", b"", b"[]")  # evicts a from the index, and its response; b still reaches its items
    assert store.get("a") is None and store.get("b").conversation() == ["a" * 96, "bbbbbb"]
    assert store.num_bytes == 112
    store.delete("b")
    assert store.num_bytes == 2


def test_a_follow_up_whose_history_exceeds_the_bytes_bound_is_not_kept():
    store = ResponseStore(max_entries=10, max_bytes=100, max_age_s=60, clock=Clock())
    store.put("a", b"", b"x" * 60)
    a = store.get("a")
    assert not store.put("b", b"", b"x" * 50, a)  # 110 bytes alive with its history
    assert store.get("a") is None and store.get("b") is None and store.num_bytes == 0
