"""Entry of the launcher's children: ``python -m pipeline.child ROLE STATUS_FD LAUNCHER_PID``.

The launcher starts io_proc, scheduler_proc and gpu_worker as plain
subprocesses rather than through :mod:`multiprocessing`, whose spawn start
method always runs a resource-tracker process: nothing here needs one (the
rings are ``posix_ipc`` objects, unlinked by name), and a tracker only warns
about "leaked" objects after a ``kill -9``. The child reads its
:class:`~pipeline.common.config.EngineConfig` as JSON from standard input,
reports its status over the inherited pipe ``STATUS_FD``, imports only its
own role's package (so the scheduler never loads torch), and ends through
:func:`~pipeline.common.process.exit_now` (docs/design.md, "Processes and
lifecycle"). A child that finds the launcher gone when it ends removes the
instance's socket directory and ring names.
"""

from __future__ import annotations

import importlib
import logging
import sys
import traceback
from multiprocessing.connection import Connection

import msgspec

from pipeline.common.config import EngineConfig
from pipeline.common.instance_files import remove_files_of
from pipeline.common.process import child_setup, exit_now, report

# role -> (module, function); the function takes (config, status_conn, stop) and returns an exit status.
ENTRIES = {
    "io_proc": ("pipeline.io_proc.main", "run_io_proc"),
    "scheduler": ("pipeline.scheduler_proc.main", "run_scheduler"),
    "gpu_worker": ("pipeline.gpu_worker.main", "run_gpu_worker"),
}


def main(argv: list[str]) -> None:
    """Run one child process; never returns (see the module docstring for ``argv``)."""
    role, status_fd, launcher_pid = argv[0], int(argv[1]), int(argv[2])
    # First, before any slow import: a SIGTERM from now on sets the flag instead of killing.
    stop = child_setup(role, launcher_pid)
    status = Connection(status_fd, readable=False)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s: %(message)s")
    code = 1
    config = None
    try:
        config = msgspec.json.decode(sys.stdin.buffer.read(), type=EngineConfig)
        module, function = ENTRIES[role]
        code = getattr(importlib.import_module(module), function)(config, status, stop)
    except Exception as e:  # whatever ends the role, the launcher must hear why
        traceback.print_exc()
        report(status, "error", role, f"failed: {type(e).__name__}: {e}")
    finally:
        if config is not None and stop.launcher_gone():
            remove_files_of(launcher_pid)
        exit_now(code)


if __name__ == "__main__":
    main(sys.argv[1:])
