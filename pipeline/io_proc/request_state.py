"""One live request on io_proc's side: what waits to be sent to its client (docs/design.md, "io_proc").

``processor``, ``token_steps``, ``logprobs`` and ``prompt_logprobs`` belong to the output-reader thread; the rest to the
event loop.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from pipeline.common.messages import FinishReason, SamplingParams
from pipeline.io_proc.detokenizer import OutputProcessor
from pipeline.io_proc.openai.logprobs_json import TokenLogprob


class StepTime:
    """One step as io_proc saw it: ``read_time`` and ``time`` (when the loop took it; None until then) in
    ``time.perf_counter()`` seconds, ``engine_ns`` the StepOutput's ``time_ns``."""

    __slots__ = ("seq", "read_time", "engine_ns", "time")

    def __init__(self, seq: int = 0, read_time: float = 0.0, engine_ns: int = 0) -> None:
        self.seq, self.read_time, self.engine_ns = seq, read_time, engine_ns
        self.time: float | None = None


class RequestState:
    """One live request; call ``EngineClient.release`` when done with it.

    Attributes:
        finish_reason: None while running, then "stop", "length", "abort" or "error".
        refused: "error" before it ran (a grammar: 400), not while running (500).
        compiled: with a grammar, resolved with "" once queued or with why it was refused; shared by choices.
        every_token: deliver tokens that add no text too (token ids or log-probabilities streamed).
        prompt_logprobs: per prompt position (position 0's None); None unless asked.
        choices: ``[choices not finished, most tokens of a finished one, n]`` shared by ``n`` > 1 choices.
        ttft, e2e: seconds, set at the finish (None for a client that left).
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
        """Queue ``text`` (possibly "") for the client and record a finish; event loop only."""
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
        """Yield ``(text, token_ids, logprobs)`` until the finish, joining what arrived meanwhile."""
        while True:
            await self._event.wait()
            self._event.clear()
            text, ids, lps = self.take_text(), self.take_token_ids(), self.take_logprobs()
            if text or (ids and self.every_token):
                yield text, ids, lps
            if self.finish_reason is not None:
                return
