"""Start-up, status reporting and exit shared by the three child processes.

The launcher starts each child as ``python -m pipeline.child`` (see ``pipeline.child``) with a pipe end; the child
reports ``("attached", name)`` once it has opened every shared-memory ring (the launcher then unlinks their names),
``("ready", name)`` once it can serve, and ``("error", name, message)`` before exiting on an error, at start-up or later
(docs/design.md, "Processes and lifecycle"). A worker rank on a node other than the head reports ``("done", name,
message)`` before exiting cleanly because the head stopped (docs/design.md, "Parallelism").
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
    """Raised by ``StopFlag.interrupting`` when a stop cuts a long start-up step short.

    A BaseException, like KeyboardInterrupt, so that no ``except Exception`` in the interrupted library code takes it
    for an error of its own.
    """


class StopFlag:
    """Set by SIGTERM (from the launcher); loops poll ``is_set``.

    Args:
        launcher_pid: the launcher's pid; once this process's parent is another one, the launcher is gone and the flag
            reads as set.
    """

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
        """Within the block, SIGTERM raises ``Stopped`` (and sets the flag) instead of waiting to be polled.

        For a long step with no loop to poll from, such as loading a model: a stop then takes effect at once rather than
        after the load. Raises ``Stopped`` at once if the flag is already set.
        """

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
    """Prepare a child process: own process group, die with the launcher, private files.

    Ctrl-C in a terminal reaches only the launcher's process group, which then stops the children in order; SIGTERM sets
    the returned flag. ``PR_SET_PDEATHSIG`` makes the kernel send SIGTERM if the launcher dies, even by ``kill -9``; a
    launcher that died before this call shows as a parent other than ``launcher_pid``. The umask makes every file the
    child creates (zmq socket files, traces) private to the user.
    """
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
    """Name the calling thread ``bg-<name>`` for the OS (15 bytes kept) and run it at niceness ``nice``.

    A ThreadPoolExecutor initializer. Linux only; elsewhere it does nothing.
    """
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_NAME, (BACKGROUND_THREAD_PREFIX + name.encode())[:15])
        if nice:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)  # a thread id is a process id here
    except (OSError, AttributeError):
        pass


def pin_to_cpus(cpus: tuple[int, ...]) -> None:
    """Restrict the calling process (all its threads) to ``cpus``; ``()`` leaves it on every CPU.

    On a machine with few cores the worker's intra-op threads and the other two processes otherwise take turns on the
    same cores, and a decode step waits for whichever thread was descheduled (docs/design.md, "CPU placement").

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
    """Move every object alive now out of the garbage collector's reach (``gc.freeze``).

    Called once start-up is over, before serving. torch, transformers and the tokenizers leave millions of long-lived
    objects, and each full (generation 2) collection walks all of them: 100-150 ms measured in a process that imported
    them, during which no other thread of the process runs. In io_proc that stalled the output reader for whole steps,
    and the worker filled the output ring and waited. Frozen objects are never scanned, so a collection costs what
    serving allocated since (Python's ``gc.freeze`` documentation recommends exactly this).
    """
    gc.collect()
    gc.freeze()


def exit_now(code: int) -> None:
    """Flush the logs and standard streams, then end the process with ``code`` at once.

    A child calls this once it has released everything it holds (rings, sockets, trace files). Skipping the
    interpreter's own teardown is what makes a stop fast: with torch, transformers and the tokenizers loaded, collecting
    and finalizing their module graphs costs 1-3 s of CPU per process, for memory the kernel frees anyway.
    """
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)
