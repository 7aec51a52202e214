"""Heartbeats in shared memory (docs/design.md, "Liveness"): per head-node process, one float64, the
``time.monotonic()`` of its loop's last turn (0 before the first)."""

from __future__ import annotations

import mmap
import time
from collections.abc import Sequence

import numpy as np
import posix_ipc


class Heartbeats:
    """The heartbeat table of one server instance; ``create`` in the launcher, attach elsewhere.

    Raises:
        posix_ipc.ExistentialError: creating a name that exists, or attaching to one that does not.
    """

    def __init__(self, name: str, roles: Sequence[str], create: bool):
        self.name, self.roles = name, tuple(roles)
        size = 8 * len(self.roles)
        shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX if create else 0, mode=0o600, size=size if create else 0)
        self._mmap = mmap.mmap(shm.fd, size)
        shm.close_fd()
        self._times = np.frombuffer(self._mmap, np.float64, len(self.roles))
        self._index = {role: i for i, role in enumerate(self.roles)}

    def beat(self, role: str, when: float | None = None) -> None:
        """Record that ``role`` made progress at ``when`` (``time.monotonic()``, now by default)."""
        self._times[self._index[role]] = time.monotonic() if when is None else when

    def age(self, role: str) -> float | None:
        """Seconds since ``role``'s last beat; None before its first or for a role not in the table."""
        i = self._index.get(role)
        if i is None or not self._times[i]:
            return None
        return time.monotonic() - float(self._times[i])

    def stale(self, timeout: float, roles: Sequence[str] | None = None) -> list[tuple[str, float]]:
        """``(role, age)`` of each of ``roles`` (default: all) whose last beat is older than ``timeout`` seconds."""
        out = []
        for role in self.roles if roles is None else roles:
            age = self.age(role)
            if age is not None and age > timeout:
                out.append((role, age))
        return out

    def unlink(self) -> None:
        """Remove the name; the memory lives on until the last process unmaps it. Idempotent."""
        try:
            posix_ipc.unlink_shared_memory(self.name)
        except posix_ipc.ExistentialError:
            pass

    def close(self) -> None:
        """Drop this process's mapping."""
        self._times = np.zeros(len(self.roles))
        try:
            self._mmap.close()
        except BufferError:  # a caller still holds a view; the OS unmaps at exit
            pass
