"""A single-writer, multi-reader ring of fixed-layout entries in POSIX shared memory.

Dijkstra's bounded buffer with a ``full``/``empty`` POSIX semaphore pair per reader (full memory barriers, futex
sleeps): each reader consumes every entry, and a full ring makes the writer wait.
"""

from __future__ import annotations

import mmap
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import numpy as np
import posix_ipc

from pipeline.common.layouts import Layout

EntryT = TypeVar("EntryT")


class RingTimeout(Exception):
    """Raised when a ring wait times out."""


class ShmRing(Generic[EntryT]):
    """One ring: ``num_entries`` entries of ``layout`` plus its semaphores; ``create`` in the launcher, attach
    elsewhere; ``wrap`` turns an entry's ``{field: view}`` dict into what acquires return.

    Raises:
        posix_ipc.ExistentialError: creating a name that exists, or attaching to one that does not.
    """

    def __init__(
        self,
        name: str,
        layout: Layout,
        num_entries: int,
        num_readers: int,
        create: bool,
        wrap: Callable[[dict[str, np.ndarray]], Any] = dict,
    ):
        if not name.startswith("/"):
            raise ValueError(f"ring name must start with '/': {name!r}")
        self.name, self.layout, self.num_entries, self.num_readers = name, layout, num_entries, num_readers
        flags = posix_ipc.O_CREX if create else 0
        size = layout.nbytes * num_entries
        # Mode 0600: only this user's processes may map the ring or touch its semaphores.
        shm = posix_ipc.SharedMemory(name, flags, mode=0o600, size=size if create else 0)
        self._mmap = mmap.mmap(shm.fd, size)
        shm.close_fd()
        self._full = [
            posix_ipc.Semaphore(f"{name}-full{r}", flags, mode=0o600, initial_value=0) for r in range(num_readers)
        ]
        self._empty = [
            posix_ipc.Semaphore(f"{name}-empty{r}", flags, mode=0o600, initial_value=num_entries)
            for r in range(num_readers)
        ]
        self._entries: list[EntryT] = [wrap(layout.views(self._mmap, i * layout.nbytes)) for i in range(num_entries)]
        self._write_idx = 0
        self._write_taken = 0  # readers whose `empty` was taken for the next entry
        self._read_idx = [0] * num_readers

    # -- writer side ---------------------------------------------------------

    def acquire_write(self, timeout: float | None = None) -> EntryT:
        """Wait until the next entry is free in every reader (``timeout`` None: forever, 0: no wait); return its views.

        Raises:
            RingTimeout: not free in time; semaphores taken are kept, so calling again resumes.
        """
        while self._write_taken < self.num_readers:
            try:
                self._empty[self._write_taken].acquire(timeout)
            except (posix_ipc.BusyError, posix_ipc.SignalError):  # a signal ends the wait like a timeout
                raise RingTimeout(self.name) from None
            self._write_taken += 1
        return self._entries[self._write_idx % self.num_entries]

    def publish(self) -> None:
        """Publish the entry returned by ``acquire_write`` to every reader."""
        assert self._write_taken == self.num_readers, "publish() without acquire_write()"
        self._write_taken = 0
        self._write_idx += 1
        for sem in self._full:
            sem.release()

    # -- reader side ---------------------------------------------------------

    def acquire_read(self, reader: int, timeout: float | None = None) -> EntryT:
        """Wait for the next published entry for ``reader``; its views stay valid until ``release_read``.

        Raises:
            RingTimeout: nothing was published in time.
        """
        try:
            self._full[reader].acquire(timeout)
        except (posix_ipc.BusyError, posix_ipc.SignalError):  # a signal ends the wait like a timeout
            raise RingTimeout(self.name) from None
        return self._entries[self._read_idx[reader] % self.num_entries]

    def release_read(self, reader: int) -> None:
        """Give the entry last returned by ``acquire_read`` back to the writer."""
        self._read_idx[reader] += 1
        self._empty[reader].release()

    # -- lifecycle -----------------------------------------------------------

    def unlink(self) -> None:
        """Remove the names (idempotent); the memory lives until the last process unmaps it."""
        names = [self.name] + [s.name for s in self._full + self._empty]
        for i, n in enumerate(names):
            try:
                (posix_ipc.unlink_shared_memory if i == 0 else posix_ipc.unlink_semaphore)(n)
            except posix_ipc.ExistentialError:
                pass

    def close(self) -> None:
        """Drop this process's views and handles."""
        self._entries = []
        for sem in self._full + self._empty:
            sem.close()
        try:
            self._mmap.close()
        except BufferError:
            # A caller still holds a view; the OS unmaps at exit.
            pass
