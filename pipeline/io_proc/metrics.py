"""Prometheus metrics of ``GET /metrics``.

Scheduler figures come from a :class:`~pipeline.common.messages.Stats` reply
fetched on each scrape; io-side counters are read from the
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
    """A registry exposing the scheduler's last :class:`Stats` and io counters.

    Exposed names: gauges ``pipeline_num_requests_running``,
    ``pipeline_num_requests_waiting``, ``pipeline_kv_blocks_free``,
    ``pipeline_kv_blocks_total``, ``pipeline_slots_free``,
    ``pipeline_slots_total``; counters (the scheduler's cumulative counts)
    ``pipeline_num_steps_total``, ``pipeline_num_preemptions_total``; io-side
    counters ``pipeline_prompt_tokens_total``,
    ``pipeline_generation_tokens_total`` and
    ``pipeline_requests_finished_total{finished_reason="stop"|"length"|"abort"}``.
    """

    def __init__(self, client: EngineClient):
        self._client = client
        self._stats: Stats | None = None
        self._registry = CollectorRegistry(auto_describe=False)
        self._registry.register(self)

    content_type = CONTENT_TYPE_LATEST

    def render(self, stats: Stats) -> bytes:
        """The exposition text (of type :attr:`content_type`) with ``stats``."""
        self._stats = stats
        return generate_latest(self._registry)

    def collect(self) -> Iterator[Metric]:
        """Called by the registry during :meth:`render`."""
        s = self._stats
        if s is not None:
            for name, doc, value in (
                ("pipeline_num_requests_running", "Requests in the running batch.", s.num_running),
                ("pipeline_num_requests_waiting", "Requests waiting to be scheduled.", s.num_waiting),
                ("pipeline_kv_blocks_free", "Free KV cache blocks.", s.num_free_blocks),
                ("pipeline_kv_blocks_total", "KV cache blocks.", s.num_total_blocks),
                ("pipeline_slots_free", "Free request slots.", s.num_free_slots),
                ("pipeline_slots_total", "Request slots (max_num_seqs).", s.num_total_slots),
            ):
                yield GaugeMetricFamily(name, doc, value=value)
            yield CounterMetricFamily("pipeline_num_steps", "Steps planned by the scheduler.", value=s.num_steps)
            yield CounterMetricFamily("pipeline_num_preemptions", "Requests preempted (recompute).",
                                      value=s.num_preemptions)
        c = self._client
        yield CounterMetricFamily("pipeline_prompt_tokens", "Prompt tokens of accepted requests.",
                                  value=c.num_prompt_tokens)
        yield CounterMetricFamily("pipeline_generation_tokens", "Output tokens delivered to live requests.",
                                  value=c.num_generation_tokens)
        finished = CounterMetricFamily("pipeline_requests_finished", "Finished requests by finish reason.",
                                       labels=["finished_reason"])
        for reason, count in c.num_finished.items():
            finished.add_metric([reason], count)
        yield finished
