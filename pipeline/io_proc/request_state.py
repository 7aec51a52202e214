"""One live request on io_proc's side: what waits to be sent to its client.

A ``RequestState`` is created by ``EngineClient.add_request``, fed by the output reader
(``pipeline.io_proc.output_reader``) and consumed by a handler in ``pipeline.io_proc.openai.serving_chat`` or
``serving_completion`` (docs/design.md, "io_proc").

Thread ownership: ``processor`` is used only by the output-reader thread, which also appends to ``token_steps``,
``logprobs`` and ``prompt_logprobs``; everything else is the event loop's (the reader hands each step's results to the
loop, which calls ``RequestState.deliver``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from pipeline.common.messages import FinishReason, SamplingParams
from pipeline.io_proc.detokenizer import OutputProcessor
from pipeline.io_proc.openai.logprobs_json import TokenLogprob


class StepTime:
    """One step as io_proc saw it: when the reader read it, its engine time, and when the loop took it.

    The reader makes one per step and appends it to ``RequestState.token_steps`` of every request that got a token in
    the step; the loop sets ``time`` when it handles the step, once for all of them.

    Attributes:
        seq: the step's number among those this reader has read (consecutive).
        read_time: ``time.perf_counter()`` seconds when the reader read it.
        engine_ns: the StepOutput's ``time_ns``.
        time: ``time.perf_counter()`` seconds, None until the loop has taken the step.
    """

    __slots__ = ("seq", "read_time", "engine_ns", "time")

    def __init__(self, seq: int = 0, read_time: float = 0.0, engine_ns: int = 0) -> None:
        self.seq, self.read_time, self.engine_ns = seq, read_time, engine_ns
        self.time: float | None = None


class RequestState:
    """One live request: its output processor and what waits to be sent to the client.

    ``EngineClient.release`` must be called when the client side is done with it.

    Attributes:
        req_num: the request's number (unique for the server's life).
        prompt_len: prompt tokens.
        processor: token -> text (reader thread only).
        finish_reason: None while running, then "stop", "length", "abort" or "error" (see ``error``).
        error: with finish reason "error", what went wrong.
        refused: with finish reason "error", the request was refused before it ran (its grammar: a client error, 400)
            rather than failed while running (500).
        compiled: for a request with a grammar, resolved with "" once the scheduler has compiled it and queued the
            request, or with why it was refused; None for others. Choices of one request share it.
        num_output_tokens: output tokens delivered to this side so far (all of them once finished; a non-streaming
            request's only at its finish).
        streaming: the consumer reads ``updates`` and is woken per step; otherwise it waits for the finish
            (``wait_finished``) and nothing is delivered before it.
        every_token: deliver every token, even one that adds no text (a stream that returns token ids or
            log-probabilities).
        logprobs: each output token's ``TokenLogprob``, appended by the reader thread before the token is delivered
            (requests that asked for log-probabilities; otherwise stays empty).
        prompt_logprobs: per prompt position, its ``TokenLogprob`` (position 0's logprob is None: nothing predicts it),
            filled by the reader thread; None unless the request asked for them.
        prompt_logprobs_missing: prompt positions whose entry has not arrived.
        released: the client side is done with it (set by ``EngineClient.release``).
        engine: the data-parallel engine that serves it (0 with one engine).
        num_cached_tokens: prompt tokens its engine found in the prefix cache when it admitted the request; None until
            that is known.
        arrival_time: ``time.perf_counter()`` when it was added (seconds).
        token_steps: one ``StepTime`` per output token, that of the step which brought it (appended by the reader
            thread); see ``delivery_times``.
        choices: shared by the ``n`` > 1 choices of one request: ``[choices not finished, most tokens of a finished one,
            n]``; None for one choice.
        ttft, e2e: time to first token and end-to-end latency in seconds, set by the reader thread when the request
            finishes (None before, and for one the client left).
    """

    __slots__ = (
        "req_num",
        "prompt_len",
        "processor",
        "finish_reason",
        "error",
        "refused",
        "compiled",
        "num_output_tokens",
        "every_token",
        "released",
        "engine",
        "num_cached_tokens",
        "arrival_time",
        "token_steps",
        "params",
        "prompt_token_ids",
        "logprobs",
        "prompt_logprobs",
        "prompt_logprobs_missing",
        "streaming",
        "choices",
        "ttft",
        "e2e",
        "_pieces",
        "_ids_taken",
        "_lps_taken",
        "_event",
    )

    def __init__(
        self,
        req_num: int,
        prompt_len: int,
        processor: OutputProcessor,
        streaming: bool,
        return_token_ids: bool,
        params: SamplingParams | None = None,
        prompt_token_ids: list[int] | None = None,
    ):
        self.req_num = req_num
        self.prompt_len = prompt_len
        self.processor = processor
        self.finish_reason: FinishReason | None = None
        self.error: str | None = None
        self.refused = False
        self.compiled: asyncio.Future[str] | None = None
        self.num_output_tokens = 0
        self.params = params
        self.prompt_token_ids = prompt_token_ids
        wants_logprobs = params is not None and params.logprobs >= 0
        self.every_token = streaming and (return_token_ids or wants_logprobs)
        self.logprobs: list[TokenLogprob] = []
        self.prompt_logprobs: list[TokenLogprob | None] | None = None
        self.prompt_logprobs_missing = 0
        if params is not None and params.prompt_logprobs >= 0 and prompt_token_ids:
            self.prompt_logprobs = [TokenLogprob(prompt_token_ids[0], None, [], [])] + [None] * (prompt_len - 1)
            self.prompt_logprobs_missing = prompt_len - 1
        self.released = False
        self.engine = 0
        self.num_cached_tokens: int | None = None
        self.arrival_time = time.perf_counter()
        self.token_steps: list[StepTime] = []
        self.streaming = streaming
        self.choices: list[int] | None = None
        self.ttft: float | None = None
        self.e2e: float | None = None
        self._pieces: list[str] = []
        self._ids_taken = 0
        self._lps_taken = 0
        self._event = asyncio.Event()

    def deliver(self, text: str, finish: FinishReason | None, num_output_tokens: int) -> None:
        """Queue ``text`` for the client and record a finish (event loop only).

        Args:
            text: new text (possibly "").
            finish: the finish reason if the request ended with this step.
            num_output_tokens: output tokens so far, this step's included.
        """
        if text:
            self._pieces.append(text)
        self.num_output_tokens = num_output_tokens
        if finish is not None:
            self.finish_reason = finish
        # A non-streaming waiter only cares about the end (the reader thread
        # does not even deliver to it before), so only a finish wakes it.
        if self.streaming or finish is not None:
            self._event.set()

    def fail(self, message: str, refused: bool = False) -> None:
        """End the request with finish reason "error" (event loop only); ``refused``: before it ran."""
        self.error, self.refused = message, refused
        self.deliver("", "error", self.num_output_tokens)

    @property
    def delivery_times(self) -> list[tuple[float, int]]:
        """``(perf_counter seconds, tokens so far)`` for each step that brought this request tokens, as the event loop
        took the step: the client-side token timeline (TTFT, ITL), kept without delivering to, or waking, any consumer
        per step."""
        return [(step.time, n) for n, step in enumerate(self.token_steps, 1) if step.time is not None]

    def take_text(self) -> str:
        """Text produced since the last call (deltas of several steps are joined)."""
        text = "".join(self._pieces)
        self._pieces.clear()
        return text

    def take_token_ids(self) -> list[int]:
        """Output token ids delivered since the last call."""
        # The reader thread only appends to the list, so slicing up to the
        # delivered count is consistent.
        ids = self.processor.token_ids[self._ids_taken : self.num_output_tokens]
        self._ids_taken = self.num_output_tokens
        return ids

    def take_logprobs(self) -> list[TokenLogprob]:
        """Log-probabilities of the output tokens delivered since the last call."""
        # As take_token_ids: the reader appends an entry before its token is delivered.
        end = min(self.num_output_tokens, len(self.logprobs))
        lps = self.logprobs[self._lps_taken : end]
        self._lps_taken = end
        return lps

    def set_prompt_logprob(self, pos: int, entry: TokenLogprob) -> None:
        """Record prompt position ``pos``'s entry (reader thread); a repeat (after a preemption) is ignored."""
        if self.prompt_logprobs[pos] is None:
            self.prompt_logprobs[pos] = entry
            self.prompt_logprobs_missing -= 1

    async def wait_finished(self) -> None:
        """Return once the request has a finish reason."""
        while self.finish_reason is None:
            await self._event.wait()
            self._event.clear()

    async def updates(self) -> AsyncIterator[tuple[str, list[int], list[TokenLogprob]]]:
        """Yield ``(text, token_ids, logprobs)`` as output arrives; end when the request finishes.

        ``token_ids`` are the output tokens since the previous update, and ``logprobs`` their entries (empty unless the
        request asked). An update is yielded when there is text, or, with ``every_token``, when there are tokens. What
        arrived while the consumer was busy is joined into one update, so a slow client costs fewer chunks, not more
        memory.
        """
        while True:
            await self._event.wait()
            self._event.clear()
            text, ids, lps = self.take_text(), self.take_token_ids(), self.take_logprobs()
            if text or (ids and self.every_token):
                yield text, ids, lps
            if self.finish_reason is not None:
                return
