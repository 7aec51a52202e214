"""Control messages between io_proc and scheduler_proc (msgspec tagged unions over zmq): per-request add, abort, stats,
shutdown. ``ToScheduler`` goes to the scheduler, ``ToIO`` back."""

from __future__ import annotations

from typing import Literal, Union

import msgspec

from pipeline.common.histogram import HistogramData

FinishReason = Literal["stop", "length", "abort", "error"]


class SamplingParams(msgspec.Struct, frozen=True):
    """How to sample one request (field semantics follow OpenAI unless noted).

    Attributes:
        max_tokens: at most this many output tokens, clamped to fit ``max_model_len`` (0 only with ``prompt_logprobs``).
        top_k: <= 0 disables.
        seed: 63-bit seed of the request's sampling noise.
        stop_token_ids: EOS and the chat template's end-of-turn token.
        logprobs: alternatives returned per sampled token (0..MAX_LOGPROBS; -1: none).
        prompt_logprobs: the same per prompt token after the first (``echo``); -1: none.
        presence_penalty, frequency_penalty: -2..2, 0 off.
        repetition_penalty: vLLM semantics after Keskar et al. 2019 (> 0, 1 off).
        min_p: after temperature (Nguyen et al. 2024; 0 off).
        min_tokens: no stop token id before this many output tokens (vLLM's rule).
        logit_bias: at most ``MAX_LOGIT_BIAS`` ``(token id, bias)`` pairs.
        grammar: an llguidance grammar every output token follows; empty: none (docs/design.md, "Structured output").
        grammar_trigger: text the grammar lets anything through until (tool calling's ``auto``); empty: constrain every
            token (docs/design.md, "Tool calling").
        lora_id: the LoRA adapter the request runs with (io_proc's id for its name); 0: the base model.
    """

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    logprobs: int = -1
    prompt_logprobs: int = -1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    min_tokens: int = 0
    logit_bias: tuple[tuple[int, float], ...] = ()
    grammar: str = ""
    grammar_trigger: str = ""
    grammar_trigger_at_start: bool = False
    lora_id: int = 0


class AddRequest(msgspec.Struct, tag=True):
    """Add a request. ``req_num`` is unique for the server's life; with ``n`` > 1, choice ``i`` is request ``req_num +
    i`` (docs/design.md, "Parallel choices")."""

    req_num: int
    prompt_token_ids: list[int]
    params: SamplingParams
    n: int = 1


_SEED_MASK = (1 << 63) - 1


def choice_seed(seed: int, index: int) -> int:
    """The seed of choice ``index`` of a request with ``n`` > 1: ``seed + index`` (as vLLM derives it), 63 bits."""
    return (seed + index) & _SEED_MASK


class AbortRequest(msgspec.Struct, tag=True):
    """Stop a request now (client gone, stop string seen); unknown numbers are ignored.

    ``finished_ns``: 0 for a client that left; for a stop string, the ``time_ns`` of the StepOutput that completed it
    (docs/design.md, "Metrics").
    """

    req_num: int
    finished_ns: int = 0


class GetStats(msgspec.Struct, tag=True):
    """Ask the scheduler for a ``Stats`` reply."""

    nonce: int


class Shutdown(msgspec.Struct, tag=True):
    """Ask the receiver to exit its loop."""


class WorkerStats(msgspec.Struct, array_like=True):
    """The worker's own clocks (rank 0), cumulative since it started (docs/design.md, "Metrics"); times in nanoseconds,
    ``busy_fraction`` -1 before the first second of steps."""

    token_gap: HistogramData = msgspec.field(default_factory=HistogramData)
    device_busy_ns: int = 0
    busy_fraction: float = -1.0
    step_cpu: HistogramData = msgspec.field(default_factory=HistogramData)


class Stats(msgspec.Struct, tag=True):
    """One engine's occupancy and cumulative figures, answered to ``GetStats`` with the same nonce (docs/design.md,
    "Metrics"; "Prefix caching"). Fields that are None are not counted yet (caching off, features to come)."""

    nonce: int
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_total_blocks: int
    num_free_req_indices: int
    num_total_req_indices: int
    num_steps: int
    num_preemptions: int
    queue_time: HistogramData = msgspec.field(default_factory=HistogramData)
    prefill_time: HistogramData = msgspec.field(default_factory=HistogramData)
    decode_time: HistogramData = msgspec.field(default_factory=HistogramData)
    inference_time: HistogramData = msgspec.field(default_factory=HistogramData)
    iteration_tokens: HistogramData = msgspec.field(default_factory=HistogramData)
    step_cpu: HistogramData = msgspec.field(default_factory=HistogramData)
    worker: WorkerStats = msgspec.field(default_factory=WorkerStats)
    prefix_cache_queries: int | None = None
    prefix_cache_hits: int | None = None
    spec_decode_num_drafts: int | None = None
    spec_decode_num_draft_tokens: int | None = None
    spec_decode_num_accepted_tokens: int | None = None
    spec_decode_num_accepted_tokens_per_pos: list[int] | None = None
    num_cached_blocks: int = 0
    lora_running: list[int] | None = None
    lora_waiting: list[int] | None = None
    num_grammar_rows_deferred: int = 0  # constrained decode rows left out of a step while their mask was computed
    num_kv_events_dropped: int = 0  # KV-cache events dropped because the publisher's queue was full
    num_waiting_tokens: int = 0  # prompt and output tokens of the waiting requests (SGLang's load counts them)


def merge_stats(per_engine: list[Stats]) -> Stats:
    """The engines' stats summed field by field (``nonce`` 0; busy fractions averaged where known)."""

    def add(values: list):
        present = [v for v in values if v is not None]
        if not present:
            return None
        if isinstance(present[0], HistogramData):
            return sum(present[1:], present[0])
        if isinstance(present[0], list):  # per position
            return [sum(v) for v in zip(*present, strict=True)]
        return sum(present)

    fields = Stats.__struct_fields__[1:]
    merged = {f: add([getattr(s, f) for s in per_engine]) for f in fields if f != "worker"}
    workers = [s.worker for s in per_engine]
    fractions = [w.busy_fraction for w in workers if w.busy_fraction >= 0]
    merged["worker"] = WorkerStats(
        *(add([getattr(w, f) for w in workers]) for f in ("token_gap", "device_busy_ns")),
        sum(fractions) / len(fractions) if fractions else -1.0,
        add([w.step_cpu for w in workers]),
    )
    return Stats(0, **merged)


class Admitted(msgspec.Struct, tag=True):
    """Requests the scheduler admitted for the first time in one step, sent before the step; ``num_cached_tokens`` is
    each one's prefix-cache hit (usage's ``cached_tokens``)."""

    req_nums: list[int]
    num_cached_tokens: list[int]


class GrammarCompiled(msgspec.Struct, tag=True):
    """The scheduler's answer to an ``AddRequest`` with a grammar: ``error`` empty means queued, else why it was
    refused."""

    req_num: int
    error: str = ""


class RequestFailed(msgspec.Struct, tag=True):
    """The scheduler ended request ``req_num`` (a choice) on an error (finish reason "error"); the engine goes on."""

    req_num: int
    message: str


ToScheduler = Union[AddRequest, AbortRequest, GetStats, Shutdown]
ToIO = Union[Stats, Admitted, GrammarCompiled, RequestFailed]


def check_finish(token_id: int, num_output_tokens: int, params: SamplingParams) -> FinishReason | None:
    """Why a request ends after producing ``token_id`` as its ``num_output_tokens``-th token: "stop", "length" or None.

    The scheduler and io_proc both call this, so they agree without talking; stop strings are io_proc's alone.
    """
    if not params.ignore_eos and token_id in params.stop_token_ids:
        return "stop"
    if num_output_tokens >= params.max_tokens:
        return "length"
    return None
