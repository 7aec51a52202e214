"""The benchmark's summary figures from hand-made spans: what each one counts."""

from __future__ import annotations

import pytest

from pipeline.bench.drivers import RequestTimes
from pipeline.bench.report import summarize


def test_host_cpu_per_token_counts_every_engines_steps():
    """Two engines (``-dp 2``) of 10 steps each; io_proc, one process for both, records a CPU span per output
    (20). The figure is all the CPU over all the tokens, whichever engine's steps it was spent on."""
    spans = []
    for s in range(10):
        for worker in ("gpu_worker", "gpu_worker-dp1"):
            spans.append((worker, "device", "step", s, s * 1000, s * 1000 + 900, -1))
        for role in ("scheduler", "gpu_worker", "scheduler-dp1", "gpu_worker-dp1"):
            spans.append((role, "cpu", "step", s, 0, 0, 100_000))  # 100 us
    spans += [("io_proc", "cpu", "step", s, 0, 0, 50_000) for s in range(20)]
    times = [RequestTimes(submit=0.0, token_times=[1.0] * 50, num_tokens=50) for _ in range(2)]
    r = summarize(times, spans)
    assert r["host_cpu_per_token_us"] == pytest.approx((40 * 100 + 20 * 50) / 100)


def test_host_cpu_per_token_is_none_without_cpu_spans():
    """A server benchmarked over ``--url`` gives no spans."""
    times = [RequestTimes(submit=0.0, token_times=[1.0, 2.0], num_tokens=2)]
    assert summarize(times, [])["host_cpu_per_token_us"] is None
