"""The Responses store's bounds: entries, bytes and age, the oldest evicted first."""

from __future__ import annotations

from pipeline.io_proc.response_store import ResponseStore


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
