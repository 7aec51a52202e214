"""Entry of the launcher's children: ``python -m pipeline.child KIND STATUS_FD LAUNCHER_PID RANK`` (docs/design.md,
"Processes and lifecycle").

Plain subprocesses, not ``multiprocessing`` (no resource tracker). The child reads its ``EngineConfig`` as JSON on
stdin, reports over ``STATUS_FD``, imports only its role's package, and ends through ``exit_now``.
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
from pipeline.common.process import child_setup, exit_now, name_process, pin_to_cpus, report

# kind -> (module, function); the function takes (config, status_conn, stop), and a worker also its rank,
# and returns an exit status.
ENTRIES = {
    "io_proc": ("pipeline.io_proc.main", "run_io_proc"),
    "scheduler": ("pipeline.scheduler_proc.main", "run_scheduler"),
    "gpu_worker": ("pipeline.gpu_worker.main", "run_gpu_worker"),
}


def main(argv: list[str]) -> None:
    """Run one child process; never returns (see the module docstring for ``argv``)."""
    kind, status_fd, launcher_pid, rank = argv[0], int(argv[1]), int(argv[2]), int(argv[3])
    # First, before any slow import: a SIGTERM from now on sets the flag instead of killing.
    stop = child_setup(kind, launcher_pid)
    status = Connection(status_fd, readable=False)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s: %(message)s")
    code = 1
    config = None
    role = kind
    try:
        config = msgspec.json.decode(sys.stdin.buffer.read(), type=EngineConfig)
        role = {"gpu_worker": config.worker_role(rank), "scheduler": config.scheduler_role}.get(kind, kind)
        name_process(role)
        pin_to_cpus(config.parallel.worker_cpus if kind == "gpu_worker" else config.parallel.frontend_cpus)
        module, function = ENTRIES[kind]
        extra = {"rank": rank} if kind == "gpu_worker" else {}
        code = getattr(importlib.import_module(module), function)(config, status, stop, **extra)
    except Exception as e:  # whatever ends the role, the launcher must hear why
        traceback.print_exc()
        report(status, "error", role, f"failed: {type(e).__name__}: {e}")
    finally:
        if config is not None and stop.launcher_gone():
            remove_files_of(launcher_pid)
        exit_now(code)


if __name__ == "__main__":
    main(sys.argv[1:])
