"""Histogram counts, and io_proc's inter-token latencies counted per span of steps against a step-by-step count."""

from __future__ import annotations

import random

import pytest

from pipeline.common.histogram import ITL_BUCKETS, TTFT_BUCKETS, Histogram, HistogramData, buckets_1_2_5
from pipeline.io_proc import request_metrics
from pipeline.io_proc.request_metrics import _InterTokenLatency
from pipeline.io_proc.request_state import StepTime


def test_buckets_are_upper_bounds_inclusive():
    h = Histogram((1, 2, 5))
    for v in (0, 1, 1.5, 2, 5, 6, 100):
        h.observe(v)
    assert h.counts == [2, 2, 1, 2] and h.sum == 115.5
    h.observe(3, n=4)
    assert h.counts == [2, 2, 5, 2] and h.sum == 127.5


def test_vllm_token_bounds():
    assert buckets_1_2_5(100) == (1, 2, 5, 10, 20, 50, 100)
    assert buckets_1_2_5(1024)[-1] == 1000


def test_quantile_interpolates_as_prometheus():
    h = Histogram(TTFT_BUCKETS)
    for v in (0.03, 0.03, 0.07, 3.0):
        h.observe(v)
    d = h.data()
    # rank 2 of 4 falls at the top of the (0.02, 0.04] bucket, which holds two.
    assert d.quantile(0.5, TTFT_BUCKETS) == pytest.approx(0.04)
    assert d.quantile(1.0, TTFT_BUCKETS) == pytest.approx(5.0)
    assert HistogramData().quantile(0.5, TTFT_BUCKETS) is None
    assert (d - d).count == 0 and (d + d).count == 8


def reference(requests: list[list[StepTime]]) -> list[int]:
    """One latency per step after a request's first that brought it tokens (vLLM's: one per engine output)."""
    h = Histogram(ITL_BUCKETS)
    for tokens in requests:
        steps = sorted({s.seq: s for s in tokens}.values(), key=lambda s: s.seq)
        for a, b in zip(steps, steps[1:]):
            h.observe((b.engine_ns - a.engine_ns) * 1e-9)
    return h.counts


@pytest.mark.parametrize("speculative", [False, True])
@pytest.mark.parametrize("num_steps", [300, 70_000])
def test_spans_count_what_step_by_step_counts(num_steps, speculative, monkeypatch):
    """Requests over consecutive steps (spans), with skipped steps and too long ones (step by step), some
    taking several tokens in a step (speculative decoding), across the ring's wrap-around."""
    monkeypatch.setattr(request_metrics, "_FLUSH_SPANS", 7)
    rng = random.Random(num_steps)
    itl = _InterTokenLatency(speculative)
    t, live, done = 0, [], []
    for _ in range(num_steps):
        t += rng.choice([2_000_000, 9_000_000, 30_000_000, 120_000_000, 3_000_000_000])
        step = StepTime(itl.step(t), 0.0, t)
        for r in live:
            if rng.random() < r["p"]:
                r["steps"] += [step] * r["tokens"](rng)
        if rng.random() < 0.3:
            tokens = rng.choice([lambda _: 1, lambda _: 1, lambda r: r.randint(1, 5)]) if speculative else lambda _: 1
            p = rng.choice([1.0, 1.0, 1.0, 0.5])
            live.append({"steps": [step] * tokens(rng), "p": p, "len": rng.randint(1, 300), "tokens": tokens})
        for r in [r for r in live if len(r["steps"]) >= r["len"] or rng.random() < 0.002]:
            live.remove(r)
            itl.observe(r["steps"])
            done.append(r["steps"])
    got = itl.data()
    assert got.counts == reference(done)
    want_sum = sum((s[-1].engine_ns - s[0].engine_ns) * 1e-9 for s in done)
    assert got.sum == pytest.approx(want_sum)
