"""Cumulative histograms kept as plain counts and shipped in stats replies, rendered by io_proc for Prometheus
(docs/design.md, "Metrics"); request histograms use vLLM's bounds (``vllm/v1/metrics/loggers.py``)."""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence

import msgspec

# vLLM's bounds, seconds.
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
    40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
# vLLM's bounds, counts.
N_BUCKETS = (1, 2, 5, 10, 20)
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
# The runtime's own clocks, nanoseconds (rendered in seconds). A gap of 0 has a bucket of its
# own: with asynchronous scheduling most steps are queued before the previous one ends.
TOKEN_GAP_BUCKETS_NS = tuple(
    int(us * 1000) for us in (0, 10, 25, 50, 100, 250, 500, 1e3, 2.5e3, 5e3, 1e4, 2.5e4, 5e4, 1e5, 2.5e5, 1e6)
)
STEP_CPU_BUCKETS_NS = tuple(
    int(us * 1000) for us in (50, 100, 250, 500, 1e3, 2e3, 5e3, 1e4, 2.5e4, 5e4, 1e5, 2.5e5, 1e6)
)


def buckets_1_2_5(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_value``: vLLM's token-count bounds (``max_model_len``)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return tuple(out)
            out.append(m * scale)
        scale *= 10


class HistogramData(msgspec.Struct, array_like=True):
    """A histogram's counts per bucket (not cumulative; the last is +Inf; empty: nothing observed) and the sum of
    values."""

    counts: list[int] = []
    sum: float = 0.0

    def __add__(self, other: HistogramData) -> HistogramData:
        if not self.counts:
            return other
        if not other.counts:
            return self
        return HistogramData([a + b for a, b in zip(self.counts, other.counts)], self.sum + other.sum)

    def __sub__(self, earlier: HistogramData) -> HistogramData:
        """What was observed since ``earlier`` (a snapshot of the same histogram)."""
        if not earlier.counts:
            return self
        return HistogramData([a - b for a, b in zip(self.counts, earlier.counts)], self.sum - earlier.sum)

    @property
    def count(self) -> int:
        return sum(self.counts)

    def quantile(self, q: float, bounds: Sequence[float]) -> float | None:
        """The ``q`` quantile by linear interpolation within its bucket, as Prometheus' ``histogram_quantile`` estimates
        it (the +Inf bucket answers the highest bound); None if empty."""
        total = self.count
        if not total:
            return None
        rank, seen = q * total, 0
        for i, c in enumerate(self.counts):
            if c and seen + c >= rank:
                if i == len(bounds):
                    return float(bounds[-1])
                lo = bounds[i - 1] if i else min(0.0, bounds[0])
                return lo + (bounds[i] - lo) * (rank - seen) / c
            seen += c
        return float(bounds[-1])


class Histogram:
    """Counts of observed values per bucket of ``bounds`` (ascending upper bounds), and their sum."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: Sequence[float]):
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0

    def observe(self, value: float, n: int = 1) -> None:
        """Count ``value`` ``n`` times."""
        self.counts[bisect_left(self.bounds, value)] += n
        self.sum += value * n

    def data(self, scale: float = 1.0) -> HistogramData:
        """A copy of the counts, with the sum multiplied by ``scale`` (1e-9 turns nanoseconds into seconds)."""
        return HistogramData(list(self.counts), self.sum * scale)
