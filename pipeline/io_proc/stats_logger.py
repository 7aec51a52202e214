"""The periodic stats line (vLLM's "Avg prompt throughput: ..."), from the figures ``/metrics`` renders, logged every
``--log-stats-interval`` seconds while there is traffic."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from pipeline.common.histogram import TOKEN_GAP_BUCKETS_NS
from pipeline.common.messages import Stats, merge_stats
from pipeline.io_proc.engine_client import EngineClient, EngineUnavailable
from pipeline.io_proc.metrics import kv_cache_usage

logger = logging.getLogger("pipeline.stats")


@dataclass(frozen=True)
class Snapshot:
    """What one line compares: the engines' stats summed, and io_proc's token counters, at ``time`` (monotonic s)."""

    time: float
    stats: Stats
    prompt_tokens: int
    generation_tokens: int


def _delta(now: int | None, before: int | None) -> int | None:
    """The change of a counter that the stats may not carry (None: not counted)."""
    return None if now is None else now - (before or 0)


def stats_line(prev: Snapshot, cur: Snapshot) -> str | None:
    """The line for the interval from ``prev`` to ``cur``; None when it saw no traffic."""
    s, p = cur.stats, prev.stats
    dt = max(cur.time - prev.time, 1e-9)
    prompt, generation = cur.prompt_tokens - prev.prompt_tokens, cur.generation_tokens - prev.generation_tokens
    if not (prompt or generation or s.num_running or s.num_waiting):
        return None
    gaps = s.worker.token_gap - p.worker.token_gap
    gap_p50 = gaps.quantile(0.5, TOKEN_GAP_BUCKETS_NS)
    busy = (s.worker.device_busy_ns - p.worker.device_busy_ns) * 1e-9
    parts = [
        f"Avg prompt throughput: {prompt / dt:.1f} tokens/s",
        f"Avg generation throughput: {generation / dt:.1f} tokens/s",
        f"Running: {s.num_running} reqs",
        f"Waiting: {s.num_waiting} reqs",
        f"Preemptions: {s.num_preemptions - p.num_preemptions}",
        f"KV cache usage: {kv_cache_usage(s) * 100:.1f}%",
        "Token gap p50: " + ("-" if gap_p50 is None else f"{gap_p50 / 1000:.0f} us"),
        "Device busy: " + (f"{busy / (busy + gaps.sum) * 100:.1f}%" if busy else "-"),
    ]
    queries = _delta(s.prefix_cache_queries, p.prefix_cache_queries)
    if queries is not None:
        hits = _delta(s.prefix_cache_hits, p.prefix_cache_hits) or 0
        parts.append(f"Prefix cache hit rate: {hits / queries * 100 if queries else 0.0:.1f}%")
    drafted = _delta(s.spec_decode_num_draft_tokens, p.spec_decode_num_draft_tokens)
    if drafted is not None:
        accepted = _delta(s.spec_decode_num_accepted_tokens, p.spec_decode_num_accepted_tokens) or 0
        parts.append(f"Spec decode acceptance rate: {accepted / drafted * 100 if drafted else 0.0:.1f}%")
    return ", ".join(parts)


class StatsLogger:
    """Logs ``stats_line`` every ``interval_s`` seconds on a fixed beat; a failed scrape skips its line."""

    def __init__(self, client: EngineClient, interval_s: float, timeout_s: float):
        self._client = client
        self._interval = interval_s
        self._timeout = timeout_s

    async def _snapshot(self) -> Snapshot:
        stats = merge_stats(await self._client.get_engine_stats(self._timeout))
        c = self._client
        return Snapshot(time.monotonic(), stats, sum(c.prompt_tokens), sum(c.generation_tokens))

    async def run(self) -> None:
        """Log until cancelled."""
        prev, beat = None, time.monotonic()
        while True:
            beat += self._interval
            await asyncio.sleep(max(beat - time.monotonic(), 0))
            try:
                cur = await self._snapshot()
            except (TimeoutError, EngineUnavailable):
                continue
            if prev is not None and (line := stats_line(prev, cur)):
                logger.info("%s", line)
            prev = cur
