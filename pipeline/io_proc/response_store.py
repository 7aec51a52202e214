"""The in-memory store of ``/v1/responses`` objects kept for ``previous_response_id`` (``store: true``).

Bounded three ways, each evicting the oldest first: entries, bytes (each
entry's encoded size) and age. docs/design.md, "The Responses API".
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass


@dataclass(frozen=True)
class StoredResponse:
    """A stored response: ``response`` its JSON, ``conversation`` the JSON list of every item up to
    and including its output (what a follow-up continues)."""

    response: bytes
    conversation: bytes
    stored_at: float


class ResponseStore:
    """Responses by id, oldest first.

    Args:
        max_entries: responses kept at most (0: none is kept).
        max_bytes: their JSON bytes at most, in all; a larger one alone is not kept.
        max_age_s: seconds one is kept.
        clock: seconds, monotonic (tests pass their own).
    """

    def __init__(self, max_entries: int, max_bytes: int, max_age_s: float, clock=time.monotonic):
        self._max_entries, self._max_bytes, self._max_age_s = max_entries, max_bytes, max_age_s
        self._clock = clock
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self.num_bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response_id: str, response: bytes, conversation: bytes) -> bool:
        """Keep a response, evicting the oldest as the bounds require; False if it alone exceeds them."""
        size = len(response) + len(conversation)
        if self._max_entries == 0 or size > self._max_bytes:
            return False
        self._expire()
        while self._entries and (len(self._entries) >= self._max_entries or self.num_bytes + size > self._max_bytes):
            self._pop_oldest()
        self._entries[response_id] = StoredResponse(response, conversation, self._clock())
        self.num_bytes += size
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
        self.num_bytes -= len(entry.response) + len(entry.conversation)
        return True

    def _expire(self) -> None:
        deadline = self._clock() - self._max_age_s
        while self._entries and next(iter(self._entries.values())).stored_at < deadline:
            self._pop_oldest()

    def _pop_oldest(self) -> None:
        _, entry = self._entries.popitem(last=False)
        self.num_bytes -= len(entry.response) + len(entry.conversation)
