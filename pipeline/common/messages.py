"""Control messages between io_proc and scheduler_proc (zmq + msgspec).

Control is everything that happens per request, not per step: add, abort,
stats, shutdown. Messages are msgspec structs in a tagged union, encoded as
msgpack. ``io_proc -> scheduler`` uses ``ToScheduler``;
``scheduler -> io_proc`` uses ``ToIO``.
"""

from __future__ import annotations

from typing import Literal, Union

import msgspec

from pipeline.common.histogram import HistogramData

FinishReason = Literal["stop", "length", "abort", "error"]


class SamplingParams(msgspec.Struct, frozen=True):
    """How to sample one request.

    Attributes:
        max_tokens: output tokens to generate at most (>= 0; 0 only with
            ``prompt_logprobs``), already clamped so that prompt + output
            fits ``max_model_len``.
        temperature: 0 means greedy.
        top_p: nucleus mass in (0, 1].
        top_k: keep the k most likely tokens; <= 0 disables.
        seed: 63-bit seed of the request's sampling noise.
        ignore_eos: keep generating after a stop token id.
        stop_token_ids: token ids that end the request (EOS and the chat
            template's end-of-turn token).
        logprobs: with each sampled token, return its log-probability and
            the ``logprobs`` most likely alternatives (0..MAX_LOGPROBS);
            -1 returns none.
        prompt_logprobs: the same for every prompt token after the first
            (what ``echo`` with ``logprobs`` needs); -1 for none. With
            ``max_tokens`` 0 the request ends after its prefill.
        presence_penalty: subtracted from the logit of every token that
            occurs in the output so far (OpenAI semantics, -2..2; 0 is off).
        frequency_penalty: subtracted once per occurrence in the output so
            far (OpenAI semantics, -2..2; 0 is off).
        repetition_penalty: divides positive and multiplies negative logits
            of tokens in the prompt or the output (vLLM semantics, after
            Keskar et al. 2019; > 0, 1 is off).
        min_p: drop tokens less likely than ``min_p`` times the most likely
            one, after temperature (Nguyen et al. 2024; 0 is off).
        min_tokens: ``stop_token_ids`` cannot be sampled before this many
            output tokens, and a stop string counts only if a later token
            completes it (vLLM's rule; 0 is off).
        logit_bias: ``(token id, bias)`` pairs added to the logits before
            sampling, at most ``MAX_LOGIT_BIAS`` (step_protocol).
        grammar: an llguidance grammar (``pipeline.common.grammar.build_grammar``)
            every output token must follow; empty for none. The scheduler
            sends its token bitmask with each step that samples the request
            (docs/design.md, "Structured output").
        grammar_trigger: with ``grammar``, text the grammar lets anything
            through until (tool calling's ``auto``); masks are sent only where
            the next token could complete it, and after it (docs/design.md,
            "Tool calling"). Empty: the grammar constrains every token.
        grammar_trigger_at_start: the trigger counts only at the output's start.
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
    """Add a request. ``req_num`` is unique for the server's life.

    With ``n`` > 1 the prompt has ``n`` choices: they are the requests
    ``req_num .. req_num + n - 1`` (io_proc reserves all ``n`` numbers),
    choice ``i`` sampling with ``choice_seed`` ``(params.seed, i)``
    (docs/design.md, "Parallel choices").
    """

    req_num: int
    prompt_token_ids: list[int]
    params: SamplingParams
    n: int = 1


_SEED_MASK = (1 << 63) - 1


def choice_seed(seed: int, index: int) -> int:
    """The seed of choice ``index`` of a request with ``n`` > 1: ``seed + index`` (as vLLM derives it), 63 bits."""
    return (seed + index) & _SEED_MASK


class AbortRequest(msgspec.Struct, tag=True):
    """Stop a request now (client gone, stop string seen). Unknown numbers are ignored.

    ``finished_ns`` is 0 for a client that left; for a stop string it is the
    ``time_ns`` of the StepOutput whose token completed it: the request
    finished then, and its phase times end there (docs/design.md, "Metrics").
    """

    req_num: int
    finished_ns: int = 0


class GetStats(msgspec.Struct, tag=True):
    """Ask the scheduler for a ``Stats`` reply."""

    nonce: int


class Shutdown(msgspec.Struct, tag=True):
    """Ask the receiver to exit its loop."""


class WorkerStats(msgspec.Struct, array_like=True):
    """The worker's own clocks (rank 0), cumulative since it started (docs/design.md, "Metrics").

    Attributes:
        token_gap: device idle between a step and the next one that continues
            running requests, nanoseconds (``TOKEN_GAP_BUCKETS_NS``).
        device_busy_ns: device time of every step.
        busy_fraction: device time / (device time + token gaps) over the last
            second of steps; -1 before there is one.
        step_cpu: the process's CPU time per such step, nanoseconds (``STEP_CPU_BUCKETS_NS``).
    """

    token_gap: HistogramData = msgspec.field(default_factory=HistogramData)
    device_busy_ns: int = 0
    busy_fraction: float = -1.0
    step_cpu: HistogramData = msgspec.field(default_factory=HistogramData)


class Stats(msgspec.Struct, tag=True):
    """One engine's occupancy and cumulative figures, answered to ``GetStats`` with the same nonce.

    The histograms are the scheduler's (vLLM's request phases from its own
    events, in seconds; tokens per step; its CPU time per step in
    nanoseconds) and the worker's (``WorkerStats``).
    ``prefix_cache_queries`` and ``prefix_cache_hits`` count prompt tokens
    looked up in the prefix cache and found there, since the start (vLLM's
    counters; None with caching off); ``num_cached_blocks`` is the KV blocks
    that hold a cached prefix now, in use or not (docs/design.md, "Prefix
    caching"). ``lora_running`` and ``lora_waiting`` are the ids of the LoRA
    adapters of running and of waiting requests (None without ``--enable-lora``).
    The fields that are None are counted by features still to
    come (speculative decoding); metrics and the stats line show them once
    they are set.
    """

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
    """Requests the scheduler admitted for the first time in one step, sent before the step.

    ``num_cached_tokens[i]`` is the prompt tokens ``req_nums[i]`` found in
    the prefix cache: what its usage reports as ``cached_tokens``.
    """

    req_nums: list[int]
    num_cached_tokens: list[int]


class GrammarCompiled(msgspec.Struct, tag=True):
    """The scheduler's answer to an ``AddRequest`` with a grammar, once its matchers exist or not.

    ``error`` empty: the request is queued. Otherwise it was refused before
    it ran (the grammar does not compile, takes more memory than a request
    may, or the request was aborted meanwhile), and ``error`` says why.
    """

    req_num: int
    error: str = ""


class RequestFailed(msgspec.Struct, tag=True):
    """The scheduler ended request ``req_num`` (a choice) with an error: its finish reason is "error".

    A failure tied to one request, such as its matcher leaving its grammar
    mid-output; the engine serves on.
    """

    req_num: int
    message: str


ToScheduler = Union[AddRequest, AbortRequest, GetStats, Shutdown]
ToIO = Union[Stats, Admitted, GrammarCompiled, RequestFailed]


def check_finish(token_id: int, num_output_tokens: int, params: SamplingParams) -> FinishReason | None:
    """Why a request ends after producing ``token_id`` as its ``num_output_tokens``-th token.

    The scheduler and io_proc both call this on the same tokens, so they
    agree on every finish without talking to each other. Stop strings are
    io_proc's alone (they need text) and end the request with an abort.

    Returns:
        "stop" for a stop token id (unless ``ignore_eos``), "length" when
        ``max_tokens`` is reached, else None.
    """
    if not params.ignore_eos and token_id in params.stop_token_ids:
        return "stop"
    if num_output_tokens >= params.max_tokens:
        return "length"
    return None
