"""Giving the heap back to the system after a burst (docs/design.md, "Memory after a burst"): glibc keeps freed pages
that a live object shares until ``malloc_trim``."""

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
    """Bytes the malloc heap has handed out and not had back (glibc's ``mallinfo2``, all threads); None before glibc
    2.33."""
    if _mallinfo2 is None:
        return None
    info = _mallinfo2()
    return info.uordblks + info.hblkhd


def trim_heap() -> None:
    """Return every malloc arena's free pages to the system (``malloc_trim(0)``); releases the GIL, so run it on its own
    thread. A no-op without glibc."""
    if _malloc_trim is not None:
        _malloc_trim(0)


def limit_arenas(n: int) -> None:
    """Let threads started after this share ``n`` malloc arenas (``mallopt(M_ARENA_MAX)``); a no-op without glibc."""
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
    """Tells when a burst of live items has passed: a peak of at least ``threshold``, then ``settle_s`` down."""

    def __init__(self, threshold: int = 1024, settle_s: float = 1.0):
        super().__init__(settle_s)
        self._threshold = threshold

    def passed(self, live: int) -> bool:
        """Note ``live`` items now; True once per burst, when ``live`` has stayed at a quarter of its peak or less."""
        self._peak = max(self._peak, live)
        return self._settled(self._peak >= self._threshold and live <= self._peak // 4, live)


class HeapWatch(_Settle):
    """Tells when the malloc heap has stayed ``min_bytes`` below its peak for ``settle_s``: a burst has passed and its
    freed pages can go back."""

    def __init__(self, min_bytes: int = 16 * 2**20, settle_s: float = 1.0):
        super().__init__(settle_s)
        self._min_bytes = min_bytes

    def passed(self, in_use: int | None) -> bool:
        """Note the heap in use now (``heap_in_use``; None: unknown); True once per such shrink."""
        if in_use is None:
            return False
        self._peak = max(self._peak, in_use)
        return self._settled(self._peak - in_use >= self._min_bytes, in_use)
