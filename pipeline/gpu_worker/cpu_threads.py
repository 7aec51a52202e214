"""The worker's intra-op thread count: the CPUs it may use, less those other programs keep busy (docs/design.md,
"Threads follow the machine's load")."""

from __future__ import annotations

import logging
import math
import os

import torch

from pipeline.common.process import BACKGROUND_THREAD_PREFIX

logger = logging.getLogger(__name__)

_CLK_TCK = os.sysconf("SC_CLK_TCK")
_INTERVAL_NS = 250_000_000
# A CPU counts as taken once other programs keep it this busy: a thread sharing it would be
# descheduled often enough that every parallel region waits for it.
_TAKEN = 0.3


def usable_cpus() -> int:
    """CPUs this process may run on: its affinity, capped by a cgroup CPU quota (v2 ``cpu.max``, v1 CFS)."""
    cpus = len(os.sched_getaffinity(0))
    quota = _cgroup_quota()
    return max(1, min(cpus, math.ceil(quota))) if quota else cpus


def _cgroup_quota() -> float | None:
    """The cgroup's CPU limit in CPUs, or None without one."""
    for path, period_path in (
        ("/sys/fs/cgroup/cpu.max", None),
        ("/sys/fs/cgroup/cpu/cpu.cfs_quota_us", "/sys/fs/cgroup/cpu/cpu.cfs_period_us"),
    ):
        try:
            with open(path) as f:
                fields = f.read().split()
            if period_path is not None:
                with open(period_path) as f:
                    fields.append(f.read().strip())
        except OSError:
            continue
        if fields[0] in ("max", "-1"):
            return None
        return int(fields[0]) / int(fields[1])
    return None


def _busy_ticks(cpus: set[int]) -> int:
    """Clock ticks the CPUs ``cpus`` spent busy since boot (every program's work, /proc/stat)."""
    busy = 0
    with open("/proc/stat") as f:
        for line in f:
            if not line.startswith("cpu") or line[3] == " ":
                continue
            name, *ticks = line.split()
            if int(name[3:]) in cpus:
                # user nice system idle iowait irq softirq steal: all but idle and iowait.
                t = [int(x) for x in ticks[:8]]
                busy += sum(t) - t[3] - t[4]
    return busy


def _engine_ticks(background: dict[str, bool | None]) -> int:
    """Clock ticks used by this process and its sibling processes, less their background threads'; ``background``
    (whether each thread id is one, None unknown) is updated in place."""
    ppid = os.getppid()
    try:
        with open(f"/proc/{ppid}/task/{ppid}/children") as f:
            pids = {int(p) for p in f.read().split()}
    except OSError:
        pids = set()
    pids.add(os.getpid())
    ticks, seen = 0, {}
    for pid in pids:
        try:
            ticks += _cpu_ticks(f"/proc/{pid}/stat")
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:  # a sibling that just exited
            continue
        for tid in tids:
            task = f"/proc/{pid}/task/{tid}"
            try:
                if (is_background := background.get(tid)) is None:
                    with open(f"{task}/comm", "rb") as f:
                        is_background = f.read().startswith(BACKGROUND_THREAD_PREFIX)
                    # Kept from the second look on: at the first, a new thread may not have its name yet.
                    seen[tid] = is_background if tid in background else None
                else:
                    seen[tid] = is_background
                if is_background:
                    ticks -= _cpu_ticks(f"{task}/stat")
            except OSError:  # a thread that just exited
                continue
    background.clear()
    background.update(seen)
    return ticks


def _cpu_ticks(stat_path: str) -> int:
    """utime + stime of a process or thread, in clock ticks."""
    with open(stat_path) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


class ThreadGovernor:
    """Sets torch's intra-op threads to ``max_threads`` less the CPUs other programs keep busy (at least 1), checked at
    most every 0.25 s; without /proc, keeps ``max_threads``."""

    def __init__(self, max_threads: int, now_ns: int) -> None:
        self.max_threads = max_threads
        self._cpus = os.sched_getaffinity(0)
        self._background: dict[str, bool | None] = {}
        try:
            self._last = (now_ns, _busy_ticks(self._cpus), _engine_ticks(self._background))
        except (OSError, ValueError, IndexError):
            self._last = None
        torch.set_num_threads(max_threads)

    def check(self, now_ns: int) -> None:
        if self._last is None or now_ns - self._last[0] < _INTERVAL_NS:
            return
        then, busy, engine = self._last
        self._last = (now_ns, _busy_ticks(self._cpus), _engine_ticks(self._background))
        seconds = (now_ns - then) / 1e9
        foreign = max(0, (self._last[1] - busy) - (self._last[2] - engine)) / _CLK_TCK / seconds
        threads = max(1, min(self.max_threads, self.max_threads - math.ceil(foreign - _TAKEN)))
        if threads != torch.get_num_threads():
            logger.info(
                "worker threads %d -> %d: other programs keep %.1f CPUs busy", torch.get_num_threads(), threads, foreign
            )
            torch.set_num_threads(threads)
