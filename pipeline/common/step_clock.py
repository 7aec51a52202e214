"""Per-step figures from a process's own clocks, as cumulative counts (docs/design.md, "Metrics"): CPU per step, and
worker rank 0's token gap and device time, over steps that continue running requests only."""

from __future__ import annotations

import time
from bisect import bisect_left

import numpy as np

from pipeline.common.histogram import STEP_CPU_BUCKETS_NS, TOKEN_GAP_BUCKETS_NS, Histogram, HistogramData
from pipeline.common.messages import WorkerStats

# The busy fraction gauge covers about this much device timeline.
BUSY_WINDOW_NS = 1_000_000_000
# CPU time per step is measured for one step in this many.
CPU_SAMPLE_EVERY = 8

_NUM_GAP, _NUM_CPU = len(TOKEN_GAP_BUCKETS_NS) + 1, len(STEP_CPU_BUCKETS_NS) + 1
# Packed layout (int64): device busy ns, busy fraction in millionths (-1: none yet), token gap
# sum and counts, CPU per step sum and counts.
_BUSY, _FRACTION, _GAP_SUM = 0, 1, 2
BUSY_NS = _BUSY  # where the cumulative device busy ns sits in the packed counts
_GAP = 3
_CPU_SUM = _GAP + _NUM_GAP
_CPU = _CPU_SUM + 1
WORKER_STATS_LEN = _CPU + _NUM_CPU


class CpuPerStep:
    """The process's CPU time per step in ns, sampled one step in ``CPU_SAMPLE_EVERY`` (the clock is a costly system
    call in a VM)."""

    __slots__ = ("histogram", "_steps", "_start")

    def __init__(self) -> None:
        self.histogram = Histogram(STEP_CPU_BUCKETS_NS)
        self._steps = 0
        self._start = -1  # CPU time at the start of the step being sampled

    def step(self, counted: bool) -> int | None:
        """Close a step; returns its CPU time (ns) if it was sampled, and observes it if ``counted``."""
        self._steps += 1
        if self._start >= 0:
            cpu = time.process_time_ns() - self._start
            self._start = -1
            if counted:
                self.histogram.observe(cpu)
                return cpu
        elif self._steps % CPU_SAMPLE_EVERY == 0:
            self._start = time.process_time_ns()
        return None


class WorkerClock:
    """Worker rank 0's counts of device time, token gaps and CPU per step, packed in ``values``."""

    def __init__(self) -> None:
        self.values = np.zeros(WORKER_STATS_LEN, np.int64)
        self.values[_FRACTION] = -1
        self._cpu = CpuPerStep()
        self._last_end = 0
        self._window = [0, 0, 0]  # start ns, busy ns, gap ns

    def step(self, start_ns: int, end_ns: int, continues: bool) -> None:
        """Count a step that ran on the device from ``start_ns`` to ``end_ns`` (monotonic ns)."""
        v, w = self.values, self._window
        busy = end_ns - start_ns
        v[_BUSY] += busy
        w[1] += busy
        if continues and self._last_end:
            gap = max(start_ns - self._last_end, 0)
            v[_GAP + bisect_left(TOKEN_GAP_BUCKETS_NS, gap)] += 1
            v[_GAP_SUM] += gap
            w[2] += gap
            cpu = self._cpu.step(True)
            if cpu is not None:
                v[_CPU + bisect_left(STEP_CPU_BUCKETS_NS, cpu)] += 1
                v[_CPU_SUM] += cpu
        else:
            self._cpu.step(False)
            w[0] = w[0] or start_ns
        self._last_end = end_ns
        if end_ns - w[0] >= BUSY_WINDOW_NS:
            v[_FRACTION] = w[1] * 1_000_000 // max(w[1] + w[2], 1)
            w[:] = end_ns, 0, 0


def worker_stats(values: np.ndarray) -> WorkerStats:
    """The ``WorkerStats`` packed in ``values`` (``WorkerClock.values``, copied from a StepOutput)."""
    v = values.tolist()
    fraction = v[_FRACTION]
    return WorkerStats(
        token_gap=HistogramData(v[_GAP:_CPU_SUM], v[_GAP_SUM] * 1e-9),
        device_busy_ns=v[_BUSY],
        busy_fraction=fraction / 1e6 if fraction >= 0 else -1.0,
        step_cpu=HistogramData(v[_CPU:], v[_CPU_SUM] * 1e-9),
    )
