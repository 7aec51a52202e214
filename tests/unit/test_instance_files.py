"""An instance's files: private modes, and the sweep of what dead launchers left."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

import numpy as np

from pipeline.common.instance_files import make_ipc_dir, remove_files_of, sweep_dead_instances
from pipeline.common.layouts import Layout
from pipeline.common.shm_ring import ShmRing


def dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_ring_names_and_socket_dir_are_private():
    ring = ShmRing(f"/pipeline-{os.getpid()}-modes", Layout.of([("x", np.int64, 4)]), 2, 1, create=True)
    try:
        for entry in (f"pipeline-{os.getpid()}-modes", f"sem.pipeline-{os.getpid()}-modes-full0"):
            assert os.stat(f"/dev/shm/{entry}").st_mode & 0o777 == 0o600, entry
    finally:
        ring.unlink()
        ring.close()
    d = make_ipc_dir()
    try:
        assert os.path.basename(d).startswith(f"pipeline-{os.getpid()}-")
        assert os.stat(d).st_mode & 0o777 == 0o700
    finally:
        os.rmdir(d)


def test_sweep_removes_only_dead_owners_files():
    dead = dead_pid()
    stale_dir = tempfile.mkdtemp(prefix=f"pipeline-{dead}-")
    open(os.path.join(stale_dir, "to_io"), "w").close()
    stale_shm = f"/dev/shm/pipeline-{dead}-0badf00d-desc"
    stale_sem = f"/dev/shm/sem.pipeline-{dead}-0badf00d-desc-full0"
    for path in (stale_shm, stale_sem):
        open(path, "w").close()
    live_dir = make_ipc_dir()  # this process is alive: kept
    try:
        removed = sweep_dead_instances()
        assert {stale_dir, stale_shm, stale_sem} <= set(removed)
        assert not any(os.path.exists(p) for p in (stale_dir, stale_shm, stale_sem))
        assert os.path.isdir(live_dir)
        assert remove_files_of(os.getpid()) == [live_dir]  # a launcher cleaning up after itself
        assert not os.path.exists(live_dir)
    finally:
        for path in (stale_shm, stale_sem):
            if os.path.exists(path):
                os.unlink(path)
        if os.path.exists(live_dir):
            os.rmdir(live_dir)
