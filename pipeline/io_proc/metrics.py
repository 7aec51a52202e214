"""Prometheus metrics of ``GET /metrics`` (docs/design.md, "Metrics"): the ``pipeline_`` family always, plus vLLM's
names and labels with ``--metrics-compat vllm``; one registry per app."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from pipeline.common.histogram import (
    ITERATION_TOKENS_BUCKETS,
    ITL_BUCKETS,
    N_BUCKETS,
    REQUEST_LATENCY_BUCKETS,
    STEP_CPU_BUCKETS_NS,
    TOKEN_GAP_BUCKETS_NS,
    TTFT_BUCKETS,
    HistogramData,
    buckets_1_2_5,
)
from pipeline.common.messages import Stats
from pipeline.io_proc.engine_client import EngineClient
from pipeline.io_proc.request_metrics import RequestMetrics

METRICS_COMPAT = ("none", "vllm")

# Per engine: its Stats reply and io_proc's histograms of its requests.
Source = Callable[[Stats, RequestMetrics], HistogramData]


@dataclass(frozen=True)
class HistogramDef:
    """A histogram ``pipeline_<name>`` (``vllm``: vLLM's name); ``scale`` converts ``bounds`` (1e-9 for nanoseconds),
    ``"tokens"`` means vLLM's ``max_model_len`` 1-2-5 bounds."""

    name: str
    doc: str
    bounds: tuple | str
    source: Source
    vllm: str | None = None
    scale: float = 1.0


HISTOGRAMS = (
    HistogramDef("time_to_first_token_seconds", "Time to first token: arrival (after tokenization) to the first "
                 "token read by io_proc.", TTFT_BUCKETS, lambda s, r: r.ttft.data(),
                 "vllm:time_to_first_token_seconds"),
    HistogramDef("inter_token_latency_seconds", "Time between a request's consecutive output tokens (engine "
                 "step times).", ITL_BUCKETS, lambda s, r: r.itl, "vllm:inter_token_latency_seconds"),
    HistogramDef("e2e_request_latency_seconds", "End-to-end request latency: arrival to the last token read by "
                 "io_proc.", REQUEST_LATENCY_BUCKETS, lambda s, r: r.e2e.data(), "vllm:e2e_request_latency_seconds"),
    HistogramDef("request_time_per_output_token_seconds", "A request's decode time over its output tokens after the "
                 "first.", ITL_BUCKETS, lambda s, r: r.time_per_output_token.data(),
                 "vllm:request_time_per_output_token_seconds"),
    HistogramDef("request_queue_time_seconds", "Time from the scheduler receiving a request to first scheduling "
                 "it.", REQUEST_LATENCY_BUCKETS, lambda s, r: s.queue_time, "vllm:request_queue_time_seconds"),
    HistogramDef("request_prefill_time_seconds", "Time from first scheduling a request to its first token.",
                 REQUEST_LATENCY_BUCKETS, lambda s, r: s.prefill_time, "vllm:request_prefill_time_seconds"),
    HistogramDef("request_decode_time_seconds", "Time from a request's first token to its last.",
                 REQUEST_LATENCY_BUCKETS, lambda s, r: s.decode_time, "vllm:request_decode_time_seconds"),
    HistogramDef("request_inference_time_seconds", "Time from first scheduling a request to its last token.",
                 REQUEST_LATENCY_BUCKETS, lambda s, r: s.inference_time, "vllm:request_inference_time_seconds"),
    HistogramDef("request_prompt_tokens", "Prompt tokens per finished request.", "tokens",
                 lambda s, r: r.prompt_tokens.data(), "vllm:request_prompt_tokens"),
    HistogramDef("request_generation_tokens", "Output tokens per finished request.", "tokens",
                 lambda s, r: r.generation_tokens.data(), "vllm:request_generation_tokens"),
    HistogramDef("request_params_max_tokens", "The max_tokens parameter of finished requests.", "tokens",
                 lambda s, r: r.max_tokens.data(), "vllm:request_params_max_tokens"),
    HistogramDef("request_max_num_generation_tokens", "Most output tokens of any choice, per request.", "tokens",
                 lambda s, r: r.max_generation_tokens.data(), "vllm:request_max_num_generation_tokens"),
    HistogramDef("request_params_n", "The n parameter (choices) of finished requests.", N_BUCKETS,
                 lambda s, r: r.n.data(), "vllm:request_params_n"),
    HistogramDef("iteration_tokens", "Tokens per step.", ITERATION_TOKENS_BUCKETS,
                 lambda s, r: s.iteration_tokens, "vllm:iteration_tokens_total"),
    HistogramDef("token_gap_seconds", "Device idle between a step and the next one that continues running "
                 "requests.", TOKEN_GAP_BUCKETS_NS, lambda s, r: s.worker.token_gap, scale=1e-9),
)  # fmt: skip


@dataclass(frozen=True)
class CounterDef:
    """A counter from each engine's Stats and io_proc's client; ``value`` None means not counted (yet)."""

    name: str
    doc: str
    value: Callable[[Stats, EngineClient, int], int | float | None]
    vllm: str | None = None


COUNTERS = (
    CounterDef("num_preemptions", "Requests preempted (recompute).", lambda s, c, e: s.num_preemptions,
               "vllm:num_preemptions"),
    CounterDef("prompt_tokens", "Prompt tokens of accepted requests.", lambda s, c, e: c.prompt_tokens[e],
               "vllm:prompt_tokens"),
    CounterDef("generation_tokens", "Output tokens delivered to live requests.",
               lambda s, c, e: c.generation_tokens[e], "vllm:generation_tokens"),
    CounterDef("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
               lambda s, c, e: s.prefix_cache_queries, "vllm:prefix_cache_queries"),
    CounterDef("prefix_cache_hits", "Prompt tokens found in the prefix cache.",
               lambda s, c, e: s.prefix_cache_hits, "vllm:prefix_cache_hits"),
    CounterDef("spec_decode_num_drafts", "Speculative drafts.", lambda s, c, e: s.spec_decode_num_drafts,
               "vllm:spec_decode_num_drafts"),
    CounterDef("spec_decode_num_draft_tokens", "Draft tokens proposed.",
               lambda s, c, e: s.spec_decode_num_draft_tokens, "vllm:spec_decode_num_draft_tokens"),
    CounterDef("spec_decode_num_accepted_tokens", "Draft tokens accepted.",
               lambda s, c, e: s.spec_decode_num_accepted_tokens, "vllm:spec_decode_num_accepted_tokens"),
    CounterDef("device_busy_seconds", "Device time of the steps.", lambda s, c, e: s.worker.device_busy_ns * 1e-9),
)  # fmt: skip

# Scheduler figures in the pipeline_ family: in total and per engine (pipeline_engine_<name>{engine}).
_GAUGES = (
    ("num_requests_running", "Requests in the running batch.", "num_running"),
    ("num_requests_waiting", "Requests waiting to be scheduled.", "num_waiting"),
    ("kv_blocks_free", "Free KV cache blocks.", "num_free_blocks"),
    ("kv_blocks_total", "KV cache blocks.", "num_total_blocks"),
    ("req_indices_free", "Free request indices (rows of the worker's per-request tables).", "num_free_req_indices"),
    ("req_indices_total", "Request indices (max_num_seqs).", "num_total_req_indices"),
    ("kv_blocks_cached", "KV cache blocks holding a cached prefix, in use or not.", "num_cached_blocks"),
)
_ENGINE_COUNTERS = (
    ("num_steps", "Steps planned by the scheduler.", "num_steps"),
    (
        "grammar_rows_deferred",
        "Decode rows of constrained requests left out of a step while their costly mask was being computed.",
        "num_grammar_rows_deferred",
    ),
    ("kv_events_dropped", "KV-cache events dropped: the publisher's queue was full.", "num_kv_events_dropped"),
)
# Counters of COUNTERS also reported per engine (pipeline_engine_<name>{engine}): where a request went matters.
_PER_ENGINE = {"prefix_cache_queries", "prefix_cache_hits"}


def kv_cache_usage(s: Stats) -> float:
    """Fraction of KV cache blocks in use (vLLM's ``kv_cache_usage_perc``: 1 means full)."""
    return 1.0 - s.num_free_blocks / s.num_total_blocks if s.num_total_blocks else 0.0


def _cumulative(data: HistogramData, bounds: tuple, scale: float) -> tuple[list[tuple[str, float]], float]:
    counts = data.counts or [0] * (len(bounds) + 1)
    out, total = [], 0
    for bound, c in zip((*(b * scale for b in bounds), float("inf")), counts):
        total += c
        out.append(("+Inf" if bound == float("inf") else repr(float(bound)), total))
    return out, data.sum


class PipelineMetrics:
    """A registry exposing the engines' last ``Stats``, io_proc's counters and request histograms; ``compat`` ``"vllm"``
    adds the ``vllm:`` family; ``lora``: with ``--enable-lora``, ``(max_loras, adapter names by id)`` for vLLM's
    ``lora_requests_info``."""

    def __init__(
        self,
        client: EngineClient,
        model_name: str,
        max_model_len: int,
        compat: str = "none",
        lora: tuple[int, dict[int, str]] | None = None,
    ):
        self._client = client
        self._model = model_name
        self._token_bounds = buckets_1_2_5(max_model_len)
        self._vllm = compat == "vllm"
        self._lora = lora
        self._stats: list[Stats] = []
        self._registry = CollectorRegistry(auto_describe=False)
        self._registry.register(self)

    content_type = CONTENT_TYPE_LATEST

    def render(self, stats: list[Stats]) -> bytes:
        """The exposition text (of type ``content_type``) with ``stats``, one per engine in engine order."""
        self._stats = stats
        return generate_latest(self._registry)

    def collect(self) -> Iterator[Metric]:
        """Called by the registry during ``render``."""
        if not self._stats:
            return
        stats, client = self._stats, self._client
        requests = client.request_metrics
        engines = range(len(stats))
        yield from self._scheduler_figures()
        for c in COUNTERS:
            values = [c.value(stats[e], client, e) for e in engines]
            if any(v is None for v in values):
                continue
            yield CounterMetricFamily(f"pipeline_{c.name}", c.doc, value=sum(values))
            if c.name in _PER_ENGINE:
                family = CounterMetricFamily(f"pipeline_engine_{c.name}", f"{c.doc} Per engine.", labels=["engine"])
                for e, v in enumerate(values):
                    family.add_metric([str(e)], v)
                yield family
            if self._vllm and c.vllm:
                family = CounterMetricFamily(c.vllm, c.doc, labels=["model_name", "engine"])
                for e, v in enumerate(values):
                    family.add_metric([self._model, str(e)], v)
                yield family
        yield from self._accepted_per_position()
        finished = CounterMetricFamily(
            "pipeline_requests_finished", "Finished requests by finish reason.", labels=["finished_reason"]
        )
        for reason, count in client.num_finished.items():
            finished.add_metric([reason], count)
        yield finished
        for h in HISTOGRAMS:
            bounds = self._token_bounds if h.bounds == "tokens" else h.bounds
            per_engine = [h.source(stats[e], requests[e]) for e in engines]
            total = sum(per_engine[1:], per_engine[0])
            family = HistogramMetricFamily(f"pipeline_{h.name}", h.doc)
            family.add_metric([], *_cumulative(total, bounds, h.scale))
            yield family
            if self._vllm and h.vllm:
                family = HistogramMetricFamily(h.vllm, h.doc, labels=["model_name", "engine"])
                for e, data in enumerate(per_engine):
                    family.add_metric([self._model, str(e)], *_cumulative(data, bounds, h.scale))
                yield family
        cpu = HistogramMetricFamily(
            "pipeline_step_cpu_seconds",
            "CPU time of a process (all its threads) per step, one step in 8.",
            labels=["process"],
        )
        for process, data in (
            ("scheduler", sum((s.step_cpu for s in stats[1:]), stats[0].step_cpu)),
            ("gpu_worker", sum((s.worker.step_cpu for s in stats[1:]), stats[0].worker.step_cpu)),
            ("io_proc", sum((r.cpu.histogram.data(1e-9) for r in requests[1:]), requests[0].cpu.histogram.data(1e-9))),
        ):
            cpu.add_metric([process], *_cumulative(data, STEP_CPU_BUCKETS_NS, 1e-9))
        yield cpu
        fractions = [s.worker.busy_fraction for s in stats if s.worker.busy_fraction >= 0]
        if fractions:
            yield GaugeMetricFamily(
                "pipeline_device_busy_fraction",
                "Device time / (device time + token gaps) over the last second of steps (mean over engines).",
                value=sum(fractions) / len(fractions),
            )
        if self._vllm:
            yield from self._vllm_success()

    def _accepted_per_position(self) -> Iterator[Metric]:
        """Accepted draft tokens by draft position (vLLM's ``spec_decode_num_accepted_tokens_per_pos``)."""
        per_engine = [s.spec_decode_num_accepted_tokens_per_pos for s in self._stats]
        if any(p is None for p in per_engine):
            return
        doc = "Draft tokens accepted, by position in the draft (0: the first)."
        family = CounterMetricFamily("pipeline_spec_decode_num_accepted_tokens_per_pos", doc, labels=["position"])
        for pos, counts in enumerate(zip(*per_engine, strict=True)):
            family.add_metric([str(pos)], sum(counts))
        yield family
        if self._vllm:
            family = CounterMetricFamily(
                "vllm:spec_decode_num_accepted_tokens_per_pos", doc, labels=["model_name", "engine", "position"]
            )
            for e, counts in enumerate(per_engine):
                for pos, c in enumerate(counts):
                    family.add_metric([self._model, str(e), str(pos)], c)
            yield family

    def _scheduler_figures(self) -> Iterator[Metric]:
        stats = self._stats
        for kind, rows in ((GaugeMetricFamily, _GAUGES), (CounterMetricFamily, _ENGINE_COUNTERS)):
            for name, doc, field in rows:
                values = [getattr(s, field) for s in stats]
                yield kind(f"pipeline_{name}", doc, value=sum(values))
                per_engine = kind(f"pipeline_engine_{name}", f"{doc} Per data-parallel engine.", labels=["engine"])
                for e, v in enumerate(values):
                    per_engine.add_metric([str(e)], v)
                yield per_engine
        per_engine = CounterMetricFamily(
            "pipeline_engine_num_preemptions",
            "Requests preempted (recompute). Per data-parallel engine.",
            labels=["engine"],
        )
        for e, s in enumerate(stats):
            per_engine.add_metric([str(e)], s.num_preemptions)
        yield per_engine
        if not self._vllm:
            return
        for name, doc, value in (
            ("vllm:num_requests_running", "Number of requests in model execution batches.", lambda s: s.num_running),
            ("vllm:num_requests_waiting", "Number of requests waiting to be processed.", lambda s: s.num_waiting),
            ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", kv_cache_usage),
        ):
            family = GaugeMetricFamily(name, doc, labels=["model_name", "engine"])
            for e, s in enumerate(stats):
                family.add_metric([self._model, str(e)], value(s))
            yield family
        if self._lora is not None:
            yield self._lora_requests_info(stats)

    def _lora_requests_info(self, stats: list[Stats]) -> Metric:
        """vLLM's ``lora_requests_info``: the adapters of running and of waiting requests (names joined by
        commas) as labels, the time of the figures as its value (as vLLM sets it)."""
        max_loras, names = self._lora
        family = GaugeMetricFamily(
            "vllm:lora_requests_info",
            "Running stats on lora requests.",
            labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
        )

        def joined(ids) -> str:
            return ",".join(names.get(i, str(i)) for i in sorted({i for s in stats for i in ids(s) or ()}))

        waiting, running = joined(lambda s: s.lora_waiting), joined(lambda s: s.lora_running)
        family.add_metric([str(max_loras), waiting, running], time.time())
        return family

    def _vllm_success(self) -> Iterator[Metric]:
        family = CounterMetricFamily(
            "vllm:request_success",
            "Count of successfully processed requests.",
            labels=["model_name", "engine", "finished_reason"],
        )
        for e, r in enumerate(self._client.request_metrics):
            for reason, count in r.success.items():
                family.add_metric([self._model, str(e), reason], count)
        yield family
