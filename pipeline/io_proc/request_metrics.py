"""vLLM's per-request histograms that io_proc measures, as vLLM's frontend does (docs/design.md, "Metrics"); abandoned
requests are not observed, and nothing is done per row of a step."""

from __future__ import annotations

import threading
import time
from bisect import bisect_left

import numpy as np

from pipeline.common.histogram import (
    ITL_BUCKETS,
    N_BUCKETS,
    REQUEST_LATENCY_BUCKETS,
    TTFT_BUCKETS,
    Histogram,
    HistogramData,
    buckets_1_2_5,
)
from pipeline.common.step_clock import CpuPerStep
from pipeline.common.step_output import DecodedOutput
from pipeline.io_proc.request_state import RequestState, StepTime

_ITL_BOUNDS_NS = tuple(int(b * 1e9) for b in ITL_BUCKETS)
# Steps whose inter-step time is kept (a power of two). A request whose tokens came in
# consecutive steps (nearly all) has its inter-token latencies counted from these at once;
# one that skipped steps, or ran longer than a quarter of them, is counted step by step.
_RING = 1 << 16
_MAX_SPAN = _RING // 4
_FLUSH_SPANS = 1024


class _InterTokenLatency:
    """Inter-token latencies, counted per request span of consecutive steps: per-step buckets, summed over finished
    spans with a difference array when read (or every ``_FLUSH_SPANS`` spans)."""

    def __init__(self, speculative: bool = False) -> None:
        self.speculative = speculative  # a step may bring a request several tokens
        self.histogram = Histogram(ITL_BUCKETS)
        self._bucket = np.zeros(_RING, np.int8)
        self._seq = 0
        self._last_ns = 0
        self._spans: list[tuple[int, int]] = []
        self._oldest = 1 << 62  # lowest span start pending
        self._lock = threading.Lock()  # spans and counts: the reader adds, a scrape reads

    def step(self, time_ns: int) -> int:
        """Record the next step's engine time; returns its sequence number."""
        seq = self._seq = self._seq + 1
        self._bucket[seq & (_RING - 1)] = bisect_left(_ITL_BOUNDS_NS, time_ns - self._last_ns)
        self._last_ns = time_ns
        if seq - self._oldest > _RING // 2:
            self.data()
        return seq

    def observe(self, steps: list[StepTime]) -> None:
        """Count the latencies between the steps that brought one request's tokens (``steps``: one per token; a repeated
        step counts once, as vLLM counts one per engine output)."""
        if self.speculative and len(steps) > 1:
            steps = list(dict.fromkeys(steps))  # each step once, in order
        n = len(steps)
        if n < 2:
            return
        first, last = steps[0], steps[-1]
        with self._lock:
            if last.seq - first.seq == n - 1 and n <= _MAX_SPAN:
                self._spans.append((first.seq + 1, last.seq + 1))
                self._oldest = min(self._oldest, first.seq + 1)
                self.histogram.sum += (last.engine_ns - first.engine_ns) * 1e-9
                flush = len(self._spans) >= _FLUSH_SPANS
            else:
                for a, b in zip(steps, steps[1:]):
                    self.histogram.observe((b.engine_ns - a.engine_ns) * 1e-9)
                flush = False
        if flush:
            self.data()

    def data(self) -> HistogramData:
        """The counts so far (adds the pending spans)."""
        with self._lock:
            if self._spans:
                spans = np.array(self._spans, np.int64)
                lo, hi = int(spans[:, 0].min()), int(spans[:, 1].max())
                delta = np.zeros(hi - lo + 1, np.int64)
                np.add.at(delta, spans[:, 0] - lo, 1)
                np.add.at(delta, spans[:, 1] - lo, -1)
                weight = np.cumsum(delta[:-1])
                buckets = self._bucket[np.arange(lo, hi) & (_RING - 1)]
                added = np.bincount(buckets, weights=weight, minlength=len(self.histogram.counts))
                h = self.histogram
                h.counts = [c + int(x) for c, x in zip(h.counts, added)]
                self._spans.clear()
                self._oldest = 1 << 62
            return self.histogram.data()


class RequestMetrics:
    """One engine's request histograms as io_proc sees them (vLLM's buckets), and io_proc's CPU per step.

    ``ttft``/``e2e`` in seconds from arrival; ``time_per_output_token`` 0 for one token; ``n`` and
    ``max_generation_tokens`` once all choices finished; ``speculative``: a step may bring several tokens.
    """

    def __init__(self, max_model_len: int, speculative: bool = False):
        tokens = buckets_1_2_5(max_model_len)
        self.ttft = Histogram(TTFT_BUCKETS)
        self.e2e = Histogram(REQUEST_LATENCY_BUCKETS)
        self.time_per_output_token = Histogram(ITL_BUCKETS)
        self.prompt_tokens, self.generation_tokens, self.max_tokens, self.max_generation_tokens = (
            Histogram(tokens) for _ in range(4)
        )
        self.n = Histogram(N_BUCKETS)
        self.success = {"stop": 0, "length": 0, "abort": 0, "error": 0}
        self.cpu = CpuPerStep()
        self._itl = _InterTokenLatency(speculative)

    def step(self, out: DecodedOutput) -> StepTime:
        """Record a step read from the ring (reader thread); returns the ``StepTime`` its rows get."""
        self.cpu.step(out.continues)
        return StepTime(self._itl.step(out.time_ns), time.perf_counter(), out.time_ns)

    def finished(self, state: RequestState, step: StepTime, finish: str) -> None:
        """Observe ``state``, which finished with ``finish`` in ``step`` (reader thread)."""
        steps = state.token_steps
        if steps:
            state.ttft = steps[0].read_time - state.arrival_time
            self.ttft.observe(state.ttft)
            self._itl.observe(steps)
            # As vLLM: 0 for a request of one token.
            decode_s = (steps[-1].engine_ns - steps[0].engine_ns) * 1e-9
            self.time_per_output_token.observe(decode_s / (len(steps) - 1) if len(steps) > 1 else 0.0)
        state.e2e = step.read_time - state.arrival_time
        self.e2e.observe(state.e2e)
        tokens = state.processor.num_output_tokens
        self.prompt_tokens.observe(state.prompt_len)
        self.generation_tokens.observe(tokens)
        self.max_tokens.observe(state.params.max_tokens)
        self.success[finish] += 1
        group = state.choices
        if group is None:
            self.n.observe(1)
            self.max_generation_tokens.observe(tokens)
            return
        group[0] -= 1
        group[1] = max(group[1], tokens)
        if group[0] == 0:
            self.n.observe(group[2])
            self.max_generation_tokens.observe(group[1])

    @property
    def itl(self) -> HistogramData:
        """Inter-token latencies (seconds) of the finished requests."""
        return self._itl.data()
