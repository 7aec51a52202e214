"""Giving the heap back to the system after a burst (docs/design.md, "Memory after a burst").

glibc's malloc keeps what a process frees: a page in the middle of a heap, or in the arena of another thread, stays
mapped as long as one live object shares it. After a burst of requests (262,144 sequences in one request once left
io_proc 500 MB larger for good) nothing is garbage, but the memory is not returned until ``malloc_trim`` releases every
free page of every arena.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import time

_libc = ctypes.CDLL(ctypes.util.find_library("c") or None)
_malloc_trim = getattr(_libc, "malloc_trim", None)
_mallinfo2 = getattr(_libc, "mallinfo2", None)
_mallopt = getattr(_libc, "mallopt", None)
_M_ARENA_MAX = -8  # glibc malloc.h


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks")
    ] + [("keepcost", ctypes.c_size_t)]


if _mallinfo2 is not None:
    _mallinfo2.restype = _MallInfo2


def heap_in_use() -> int | None:
    """Bytes the process's malloc heap has handed out and not yet had back (glibc's ``mallinfo2``).

    Every thread's allocations count, so a difference measures one piece of work only while the process's other threads
    allocate little. None without glibc 2.33 or later. About 1 us.
    """
    if _mallinfo2 is None:
        return None
    info = _mallinfo2()
    return info.uordblks + info.hblkhd


def trim_heap() -> None:
    """Return the free pages of every malloc arena to the system (glibc's ``malloc_trim(0)``).

    Tens of milliseconds after a burst of hundreds of MB; ctypes releases the GIL meanwhile, so callers run it on a
    thread of their own. A no-op without glibc.
    """
    if _malloc_trim is not None:
        _malloc_trim(0)


def limit_arenas(n: int) -> None:
    """Let the threads started after this share ``n`` malloc arenas (glibc's ``mallopt(M_ARENA_MAX)``).

    Each thread otherwise gets an arena of its own (up to 8 per core), and each keeps the pages a few live objects pin
    after a burst. A no-op without glibc.
    """
    if _mallopt is not None:
        _mallopt(_M_ARENA_MAX, n)


class _Settle:
    """A value's peak, and since when it has stayed down: the part ``BurstWatch`` and ``HeapWatch`` share."""

    def __init__(self, settle_s: float):
        self._settle_s = settle_s
        self._peak = 0
        self._low_since: float | None = None

    def _settled(self, low: bool, value: int) -> bool:
        """Whether ``value`` (``low``: down from the peak) has stayed down ``settle_s``; the peak restarts from it."""
        if not low:
            self._low_since = None
            return False
        now = time.monotonic()
        if self._low_since is None:
            self._low_since = now
        if now - self._low_since < self._settle_s:
            return False
        self._peak, self._low_since = value, None
        return True


class BurstWatch(_Settle):
    """Tells when a burst of live items (requests, sequences) has passed.

    Args:
        threshold: the smallest peak that counts as a burst.
        settle_s: how long the count must stay down, so that what the last items left (a response being written) is
            freed first.
    """

    def __init__(self, threshold: int = 1024, settle_s: float = 1.0):
        super().__init__(settle_s)
        self._threshold = threshold

    def passed(self, live: int) -> bool:
        """Note ``live`` items now; True once per burst, when ``live`` has stayed at a quarter of its peak or less."""
        self._peak = max(self._peak, live)
        return self._settled(self._peak >= self._threshold and live <= self._peak // 4, live)


class HeapWatch(_Settle):
    """Tells when the malloc heap has stayed ``min_bytes`` below its peak for ``settle_s``: a burst of large work
    (request bodies, rendered prompts, refused or not) has passed, and the pages it freed can go back to the system.

    Args:
        min_bytes: how much must have been freed since the peak.
        settle_s: how long the heap must stay down, so that a burst still under way is not trimmed in the middle (and
            then not again at its end).
    """

    def __init__(self, min_bytes: int = 16 * 2**20, settle_s: float = 1.0):
        super().__init__(settle_s)
        self._min_bytes = min_bytes

    def passed(self, in_use: int | None) -> bool:
        """Note the heap in use now (``heap_in_use``; None: unknown); True once per such shrink."""
        if in_use is None:
            return False
        self._peak = max(self._peak, in_use)
        return self._settled(self._peak - in_use >= self._min_bytes, in_use)
