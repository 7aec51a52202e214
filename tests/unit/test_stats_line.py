"""The stats line's figures from two snapshots: rates over the interval, the interval's token gap p50, the hooks."""

from __future__ import annotations

from pipeline.common.histogram import HistogramData
from pipeline.common.messages import Stats, WorkerStats
from pipeline.io_proc.stats_logger import Snapshot, stats_line


def _snapshot(t: float, tokens: int, gaps: list[int], **fields) -> Snapshot:
    stats = Stats(0, 1, 2, 30, 100, 5, 8, 0, 0, worker=WorkerStats(token_gap=HistogramData(gaps, 0.0)), **fields)
    return Snapshot(t, stats, tokens, 2 * tokens)


def test_stats_line_figures():
    """Throughput over the interval, the token gap p50 of the interval's gaps alone, and the hooks once carried."""
    gaps_before = [50] + [0] * 16
    gaps_after = [50, 0, 0, 0, 0, 10] + [0] * 11  # ten new gaps, all in (100, 250] us
    line = stats_line(_snapshot(0.0, 100, gaps_before), _snapshot(2.0, 300, gaps_after))
    assert line.startswith("Avg prompt throughput: 100.0 tokens/s, Avg generation throughput: 200.0 tokens/s, ")
    assert "Running: 1 reqs, Waiting: 2 reqs, Preemptions: 0, KV cache usage: 70.0%, Token gap p50: 175 us" in line
    assert "Prefix cache" not in line and "Spec decode" not in line
    hooks = {"prefix_cache_queries": 200, "prefix_cache_hits": 50, "spec_decode_num_draft_tokens": 40}
    line = stats_line(_snapshot(0.0, 100, gaps_before), _snapshot(1.0, 100, gaps_after, **hooks))
    assert line.endswith("Prefix cache hit rate: 25.0%, Spec decode acceptance rate: 0.0%")
    idle = Stats(0, 0, 0, 100, 100, 8, 8, 0, 0)
    assert stats_line(Snapshot(0.0, idle, 5, 5), Snapshot(1.0, idle, 5, 5)) is None
