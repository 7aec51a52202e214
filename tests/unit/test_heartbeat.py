"""The heartbeat table: what one process writes, another reads; stale entries are found; nothing is left behind."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import posix_ipc
import pytest

from pipeline.common.config import EngineConfig
from pipeline.common.config_groups import ParallelConfig
from pipeline.common.heartbeat import Heartbeats


def test_beats_cross_processes_and_stale_ones_are_found():
    name = f"/pipeline-{os.getpid()}-test-beat"
    table = Heartbeats(name, ["io_proc", "scheduler", "gpu_worker"], create=True)
    try:
        assert table.age("scheduler") is None and table.stale(0.0) == []  # never beaten: not watched
        table.beat("io_proc", time.monotonic() - 5)
        roles = ["io_proc", "scheduler", "gpu_worker"]
        code = (
            f"from pipeline.common.heartbeat import Heartbeats; Heartbeats({name!r}, {roles}, False).beat('scheduler')"
        )
        subprocess.run([sys.executable, "-c", code], check=True)
        assert 0 <= table.age("scheduler") < 5
        assert [role for role, _ in table.stale(2.0)] == ["io_proc"]
        assert table.stale(2.0, ["scheduler"]) == [] and table.age("nobody") is None
    finally:
        table.unlink()
        table.close()
    assert not os.path.exists(f"/dev/shm{name}")
    with pytest.raises(posix_ipc.ExistentialError):
        Heartbeats(name, ["io_proc"], create=False)


def test_roles_cover_every_head_process():
    config = EngineConfig(
        model="sim", served_model_name="sim", parallel=ParallelConfig(data_parallel_size=2, tensor_parallel_size=2)
    )
    assert config.heartbeat_roles == [
        "io_proc",
        "scheduler",
        "gpu_worker",
        "gpu_worker-tp1",
        "scheduler-dp1",
        "gpu_worker-dp1",
        "gpu_worker-dp1-tp1",
    ]
