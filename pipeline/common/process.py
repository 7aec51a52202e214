"""Start-up, status reporting and exit shared by the three child processes (docs/design.md, "Processes and lifecycle").

Children report ``("attached", name)``, ``("ready", name)``, ``("error", name, message)`` or, for a remote rank after
the head stopped, ``("done", name, message)`` over their pipe.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import logging
import os
import signal
import sys
import threading
from collections.abc import Iterator
from multiprocessing.connection import Connection

_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15
# The OS name of the engine's threads that work beside the step chain (grammars, prompt encoding): the
# worker's ThreadGovernor counts their CPU as taken from its threads (docs/design.md, "Threads follow
# the machine's load").
BACKGROUND_THREAD_PREFIX = b"bg-"


class Stopped(BaseException):
    """Raised by ``StopFlag.interrupting`` when a stop cuts a start-up step short; a BaseException so library ``except
    Exception`` clauses let it pass."""


class StopFlag:
    """Set by SIGTERM (from the launcher); reads as set once the parent is no longer ``launcher_pid``."""

    def __init__(self, launcher_pid: int) -> None:
        self._event = threading.Event()
        self.launcher_pid = launcher_pid

    def set(self, *_args) -> None:
        self._event.set()

    def launcher_gone(self) -> bool:
        """True once the launcher has died (this process was given another parent)."""
        return os.getppid() != self.launcher_pid

    def is_set(self) -> bool:
        """True once SIGTERM arrived or the launcher is gone."""
        return self._event.is_set() or self.launcher_gone()

    @contextlib.contextmanager
    def interrupting(self) -> Iterator[None]:
        """Within the block SIGTERM raises ``Stopped`` (and sets the flag) at once, for steps with no loop to poll."""

        def interrupt(*_args) -> None:
            self.set()
            raise Stopped

        if self.is_set():
            raise Stopped
        previous = signal.signal(signal.SIGTERM, interrupt)
        try:
            yield
        finally:
            signal.signal(signal.SIGTERM, previous)


def child_setup(name: str, launcher_pid: int) -> StopFlag:
    """Prepare a child process: own process group (Ctrl-C reaches only the launcher), ``PR_SET_PDEATHSIG`` SIGTERM, a
    umask making its files private; SIGTERM sets the returned flag."""
    os.setpgrp()
    os.umask(0o077)
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass  # not Linux: the getppid() check in StopFlag still catches it
    name_process(name)
    flag = StopFlag(launcher_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, flag.set)
    return flag


def name_process(name: str) -> None:
    """Show the process as ``pipeline-<name>`` in ``ps`` and ``top`` (when setproctitle is installed)."""
    try:
        import setproctitle

        setproctitle.setproctitle(f"pipeline-{name}")
    except ImportError:
        pass


def start_background_thread(name: str, nice: int = 0) -> None:
    """Name the calling thread ``bg-<name>`` (15 bytes kept) and run it at niceness ``nice``; a ThreadPoolExecutor
    initializer, Linux only."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_NAME, (BACKGROUND_THREAD_PREFIX + name.encode())[:15])
        if nice:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)  # a thread id is a process id here
    except (OSError, AttributeError):
        pass


def pin_to_cpus(cpus: tuple[int, ...]) -> None:
    """Restrict the calling process to ``cpus`` (``()``: every CPU; docs/design.md, "CPU placement").

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


def freeze_startup_heap() -> None:
    """``gc.freeze`` every object alive now, once start-up is over, so full collections no longer walk the libraries'
    long-lived objects (as Python's ``gc.freeze`` documentation recommends)."""
    gc.collect()
    gc.freeze()


def exit_now(code: int) -> None:
    """Flush logs and standard streams, then ``os._exit``-style end with ``code``, skipping the interpreter's slow
    teardown; call once everything held is released."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)
