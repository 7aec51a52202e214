"""Start-up and status reporting shared by the three child processes.

The launcher starts each child with :func:`multiprocessing` (spawn) and a
pipe end; the child reports ``("attached", name)`` once it has opened every
shared-memory ring (the launcher then unlinks their names), ``("ready",
name)`` once it can serve, and ``("error", name, message)`` before exiting
on a start-up error. A worker rank of a multi-node run also reports
``("error", name, message)`` when it loses another node's ranks, and, on a
node other than the head, ``("done", name, message)`` before exiting
cleanly because the head stopped (docs/design.md, "Parallelism").
"""

from __future__ import annotations

import ctypes
import os
import signal
import threading
from multiprocessing.connection import Connection

_PR_SET_PDEATHSIG = 1


class StopFlag:
    """Set by SIGTERM (from the launcher); loops poll :meth:`is_set`."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self._parent = os.getppid()

    def set(self, *_args) -> None:
        self._event.set()

    def is_set(self) -> bool:
        """True once SIGTERM arrived or the launcher is gone."""
        return self._event.is_set() or os.getppid() != self._parent


def child_setup(name: str) -> StopFlag:
    """Prepare a child process: own process group, die with the launcher.

    Ctrl-C in a terminal reaches only the launcher's process group, which
    then stops the children in order; SIGTERM sets the returned flag.
    ``PR_SET_PDEATHSIG`` makes the kernel send SIGTERM if the launcher dies,
    even by ``kill -9``.
    """
    os.setpgrp()
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass  # not Linux: the getppid() check in StopFlag still catches it
    try:
        import setproctitle  # optional, makes `ps` show the role
        setproctitle.setproctitle(f"pipeline-{name}")
    except ImportError:
        pass
    flag = StopFlag()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, flag.set)
    return flag


def pin_to_cpus(cpus: tuple[int, ...]) -> None:
    """Restrict the calling process (all its threads) to ``cpus``; ``()`` leaves it on every CPU.

    On a machine with few cores the worker's intra-op threads and the other
    two processes otherwise take turns on the same cores, and a decode step
    waits for whichever thread was descheduled (docs/design.md, "The worker").

    Raises:
        OSError: a CPU that does not exist or is not allowed to this process.
    """
    if cpus and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, cpus)


def report(conn: Connection, *msg) -> None:
    """Send a status tuple to the launcher; a closed pipe means it is gone."""
    try:
        conn.send(msg)
    except (BrokenPipeError, OSError):
        pass
