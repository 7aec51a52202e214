"""Prometheus metrics of ``GET /metrics``.

Scheduler figures come from one :class:`~pipeline.common.messages.Stats`
reply per engine fetched on each scrape, reported in total and per engine; io-side counters are read from the
:class:`~pipeline.io_proc.engine_client.EngineClient`. Each app has its own
registry, so several servers in one process (tests) do not collide.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from pipeline.common.messages import Stats
from pipeline.io_proc.engine_client import EngineClient


class PipelineMetrics:
    """A registry exposing the schedulers' last :class:`Stats` and io counters.

    Exposed names, summed over the data-parallel engines: gauges ``pipeline_num_requests_running``,
    ``pipeline_num_requests_waiting``, ``pipeline_kv_blocks_free``,
    ``pipeline_kv_blocks_total``, ``pipeline_req_indices_free``,
    ``pipeline_req_indices_total``, ``pipeline_kv_blocks_cached``; counters (the
    scheduler's cumulative counts) ``pipeline_num_steps_total``,
    ``pipeline_num_preemptions_total``, ``pipeline_prefix_cache_queries_total``
    and ``pipeline_prefix_cache_hits_total`` (prompt tokens); io-side
    counters ``pipeline_prompt_tokens_total``,
    ``pipeline_generation_tokens_total`` and
    ``pipeline_requests_finished_total{finished_reason="stop"|"length"|"abort"}``.
    Each scheduler figure also per engine, labelled ``engine``: the same name
    with ``pipeline_engine_`` for ``pipeline_`` (``pipeline_engine_kv_blocks_free{engine="0"}``).
    """

    def __init__(self, client: EngineClient):
        self._client = client
        self._stats: list[Stats] = []
        self._registry = CollectorRegistry(auto_describe=False)
        self._registry.register(self)

    content_type = CONTENT_TYPE_LATEST

    def render(self, stats: list[Stats]) -> bytes:
        """The exposition text (of type :attr:`content_type`) with ``stats``, one per engine in engine order."""
        self._stats = stats
        return generate_latest(self._registry)

    def collect(self) -> Iterator[Metric]:
        """Called by the registry during :meth:`render`."""
        gauges = (
            ("num_requests_running", "Requests in the running batch.", "num_running"),
            ("num_requests_waiting", "Requests waiting to be scheduled.", "num_waiting"),
            ("kv_blocks_free", "Free KV cache blocks.", "num_free_blocks"),
            ("kv_blocks_total", "KV cache blocks.", "num_total_blocks"),
            (
                "req_indices_free",
                "Free request indices (rows of the worker's per-request tables).",
                "num_free_req_indices",
            ),
            ("req_indices_total", "Request indices (max_num_seqs).", "num_total_req_indices"),
            ("kv_blocks_cached", "KV cache blocks holding a cached prefix, in use or not.", "num_cached_blocks"),
        )
        counters = (
            ("num_steps", "Steps planned by the scheduler.", "num_steps"),
            ("num_preemptions", "Requests preempted (recompute).", "num_preemptions"),
            ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", "prefix_cache_queries"),
            ("prefix_cache_hits", "Prompt tokens found in the prefix cache.", "prefix_cache_hits"),
        )
        for kind, rows in ((GaugeMetricFamily, gauges), (CounterMetricFamily, counters)) if self._stats else ():
            for name, doc, field in rows:
                values = [getattr(s, field) for s in self._stats]
                yield kind(f"pipeline_{name}", doc, value=sum(values))
                per_engine = kind(f"pipeline_engine_{name}", f"{doc} Per data-parallel engine.", labels=["engine"])
                for e, v in enumerate(values):
                    per_engine.add_metric([str(e)], v)
                yield per_engine
        c = self._client
        yield CounterMetricFamily(
            "pipeline_prompt_tokens", "Prompt tokens of accepted requests.", value=c.num_prompt_tokens
        )
        yield CounterMetricFamily(
            "pipeline_generation_tokens", "Output tokens delivered to live requests.", value=c.num_generation_tokens
        )
        finished = CounterMetricFamily(
            "pipeline_requests_finished", "Finished requests by finish reason.", labels=["finished_reason"]
        )
        for reason, count in c.num_finished.items():
            finished.add_metric([reason], count)
        yield finished
