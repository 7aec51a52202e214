"""The in-memory store of ``/v1/responses`` objects kept for ``previous_response_id`` (docs/design.md, "The Responses
API"): follow-ups share history by link; bounded by entries, bytes kept alive and age, oldest evicted first."""

from __future__ import annotations

import json
import time
from collections import OrderedDict


class StoredResponse:
    """A stored response: ``response`` its JSON, ``items`` the JSON list of the items its request added (input, then
    output), ``previous`` the stored response it continued (None: none)."""

    __slots__ = ("response", "items", "previous", "stored_at", "_holders")

    def __init__(self, response: bytes, items: bytes, previous: StoredResponse | None, stored_at: float):
        self.response, self.items, self.previous, self.stored_at = response, items, previous, stored_at
        self._holders = 0  # the store's index, and the follow-ups whose ``previous`` it is

    @property
    def size(self) -> int:
        return len(self.response) + len(self.items)

    def conversation(self) -> list[dict]:
        """Every item up to and including this response's output, oldest first (decoding: off the event loop)."""
        chain = []
        node: StoredResponse | None = self
        while node is not None:
            chain.append(node.items)
            node = node.previous
        return [item for items in reversed(chain) for item in json.loads(items)]


class ResponseStore:
    """Responses by id, oldest first (``max_entries`` 0: none kept; a response larger than ``max_bytes`` alone is not
    kept)."""

    def __init__(self, max_entries: int, max_bytes: int, max_age_s: float, clock=time.monotonic):
        self._max_entries, self._max_bytes, self._max_age_s = max_entries, max_bytes, max_age_s
        self._clock = clock
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self.num_bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response_id: str, response: bytes, items: bytes, previous: StoredResponse | None = None) -> bool:
        """Keep a response that continues ``previous``, evicting the oldest as the bounds require; False if it cannot be
        kept within them."""
        entry = StoredResponse(response, items, previous, self._clock())
        if self._max_entries == 0 or entry.size > self._max_bytes:
            return False
        self._hold(entry)  # its history first, so that evicting the oldest cannot free it
        self._expire()
        while self._entries and (len(self._entries) >= self._max_entries or self.num_bytes > self._max_bytes):
            self._unindex(self._entries.popitem(last=False)[1])
        if self.num_bytes > self._max_bytes:  # its history alone is too large
            self._release(entry)
            return False
        self._entries[response_id] = entry
        return True

    def get(self, response_id: str) -> StoredResponse | None:
        """The response, or None if it was never stored, was evicted or has expired."""
        self._expire()
        return self._entries.get(response_id)

    def delete(self, response_id: str) -> bool:
        """Drop a response; False if it was not there."""
        entry = self._entries.pop(response_id, None)
        if entry is None:
            return False
        self._unindex(entry)
        return True

    def _expire(self) -> None:
        deadline = self._clock() - self._max_age_s
        while self._entries and next(iter(self._entries.values())).stored_at < deadline:
            self._unindex(self._entries.popitem(last=False)[1])

    def _unindex(self, entry: StoredResponse) -> None:
        """``entry`` is no longer found by its id: its response object goes at once, its items when no kept follow-up
        reaches them."""
        self.num_bytes -= len(entry.response)
        entry.response = b""
        self._release(entry)

    def _hold(self, entry: StoredResponse) -> None:
        """Count one more holder of ``entry``; its bytes (and its history's, once) from the first."""
        while entry is not None:
            entry._holders += 1
            if entry._holders > 1:
                return
            self.num_bytes += entry.size
            entry = entry.previous

    def _release(self, entry: StoredResponse) -> None:
        """Count one holder less; at none, its bytes go, and its hold on its history."""
        while entry is not None:
            entry._holders -= 1
            if entry._holders > 0:
                return
            self.num_bytes -= entry.size
            entry = entry.previous
