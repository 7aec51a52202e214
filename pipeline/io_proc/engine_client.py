"""io_proc's side of the engine: control messages out, sampled tokens in.

* Control (zmq, msgspec msgpack): ``AddRequest`` / ``AbortRequest`` /
  ``GetStats`` are pushed to the scheduler; ``Stats`` replies are pulled back.
* Tokens (shared memory): a dedicated thread reads every ``StepOutput`` from
  the output ring as reader ``OUTPUT_READER_IO``, runs each row through its
  request's :class:`~pipeline.io_proc.detokenizer.OutputProcessor`, and hands
  the step's results to the event loop with one ``call_soon_threadsafe``.

Thread ownership: a :class:`RequestState`'s ``processor`` is used only by the
reader thread; everything else in it only by the event loop. The table of live
requests is shared (single dict operations, atomic under the GIL): the loop
inserts before sending ``AddRequest`` and removes on abort, the reader thread
removes on finish. A row whose request is not in the table is dropped: after a
finish (or abort) a request may still get one token from the step already in
flight, and no token after a finish may reach a client.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections.abc import AsyncIterator, Sequence

import msgspec
import zmq
import zmq.asyncio

from pipeline.common.config import EngineConfig
from pipeline.common.constants import POLL_INTERVAL_S
from pipeline.common.messages import (AbortRequest, AddRequest, FinishReason, GetStats, SamplingParams, Stats,
                                      ToIO)
from pipeline.common.shm_ring import RingTimeout, ShmRing
from pipeline.common.step_protocol import OUTPUT_READER_IO, StepOutput
from pipeline.common.trace import TraceRecorder
from pipeline.io_proc.detokenizer import DecodeFn, OutputProcessor

logger = logging.getLogger(__name__)

# Control messages queued towards a scheduler that does not read them before
# sends fail (EngineUnavailable) instead of blocking the event loop.
_CONTROL_SNDHWM = 100_000


class EngineUnavailable(Exception):
    """The scheduler is not taking control messages (its queue is full)."""


class RequestState:
    """One live request: its output processor and what waits to be sent to the client.

    Created by :meth:`EngineClient.add_request`; :meth:`EngineClient.release`
    must be called when the client side is done with it.

    Attributes:
        req_num: the request's number (unique for the server's life).
        prompt_len: prompt tokens.
        processor: token -> text (reader thread only).
        finish_reason: None while running, then "stop", "length" or "abort".
        num_output_tokens: output tokens delivered to this side so far (all
            of them once finished).
        every_token: deliver every token, even one that adds no text (a
            stream that returns token ids).
        released: the client side is done with it (set by :meth:`EngineClient.release`).
        arrival_time: ``time.perf_counter()`` when it was added (seconds).
        delivery_times: ``(perf_counter, tokens so far)`` at each step that
            delivered tokens, taken on the event loop: the client-side token
            timeline (TTFT, ITL) without waking a streaming consumer per step.
    """

    __slots__ = ("req_num", "prompt_len", "processor", "finish_reason", "num_output_tokens", "every_token",
                 "released", "arrival_time", "delivery_times", "_streaming", "_pieces", "_ids_taken", "_event")

    def __init__(self, req_num: int, prompt_len: int, processor: OutputProcessor, streaming: bool,
                 return_token_ids: bool):
        self.req_num = req_num
        self.prompt_len = prompt_len
        self.processor = processor
        self.finish_reason: FinishReason | None = None
        self.num_output_tokens = 0
        self.every_token = streaming and return_token_ids
        self.released = False
        self.arrival_time = time.perf_counter()
        self.delivery_times: list[tuple[float, int]] = []
        self._streaming = streaming
        self._pieces: list[str] = []
        self._ids_taken = 0
        self._event = asyncio.Event()

    def deliver(self, text: str, finish: FinishReason | None, num_output_tokens: int) -> None:
        """Queue ``text`` for the client and record a finish (event loop only)."""
        if text:
            self._pieces.append(text)
        if num_output_tokens > self.num_output_tokens:
            self.delivery_times.append((time.perf_counter(), num_output_tokens))
        self.num_output_tokens = num_output_tokens
        if finish is not None:
            self.finish_reason = finish
        # A non-streaming waiter only cares about the end: waking it per step
        # would cost one task switch per request per step for nothing.
        if self._streaming or finish is not None:
            self._event.set()

    def take_text(self) -> str:
        """Text produced since the last call (deltas of several steps are joined)."""
        text = "".join(self._pieces)
        self._pieces.clear()
        return text

    def take_token_ids(self) -> list[int]:
        """Output token ids delivered since the last call."""
        # The reader thread only appends to the list, so slicing up to the
        # delivered count is consistent.
        ids = self.processor.token_ids[self._ids_taken:self.num_output_tokens]
        self._ids_taken = self.num_output_tokens
        return ids

    async def wait_finished(self) -> None:
        """Return once the request has a finish reason."""
        while self.finish_reason is None:
            await self._event.wait()
            self._event.clear()

    async def updates(self) -> AsyncIterator[tuple[str, list[int]]]:
        """Yield ``(text, token_ids)`` as output arrives; end when the request finishes.

        ``token_ids`` are the output tokens since the previous update. An
        update is yielded when there is text, or, with :attr:`every_token`,
        when there are tokens. What arrived while the consumer was busy is
        joined into one update, so a slow client costs fewer chunks, not
        more memory.
        """
        while True:
            await self._event.wait()
            self._event.clear()
            text, ids = self.take_text(), self.take_token_ids()
            if text or (ids and self.every_token):
                yield text, ids
            if self.finish_reason is not None:
                return


class EngineClient:
    """Sends requests to the scheduler and routes sampled tokens back to them.

    Args:
        config: the server configuration (its zmq addresses).
        ring: the output ring, attached (``create=False``) with two readers.
        decode: see :data:`~pipeline.io_proc.detokenizer.DecodeFn`; used only
            by the reader thread.
        trace: if given, the reader thread records its per-step handling span.

    Raises:
        zmq.ZMQError: the reply address cannot be bound.

    Counters (read by the metrics endpoint): ``num_prompt_tokens``,
    ``num_generation_tokens`` (tokens delivered to live requests),
    ``num_finished`` (requests by finish reason; a client that left counts
    as "abort").
    """

    def __init__(self, config: EngineConfig, ring: ShmRing[StepOutput], decode: DecodeFn, trace: TraceRecorder | None = None):
        self._ring = ring
        self._trace = trace
        self._decode = decode
        self._requests: dict[int, RequestState] = {}
        self._req_nums = itertools.count(1)
        self._nonces = itertools.count(1)
        self._stats_waiters: dict[int, asyncio.Future[Stats]] = {}
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(ToIO)
        # zmq sockets are not thread-safe; the push socket is used by the loop
        # (add, abort, stats) and by the reader thread (stop-string aborts).
        self._send_lock = threading.Lock()
        self._ctx = zmq.asyncio.Context()
        self._push = zmq.Socket(self._ctx, zmq.PUSH)
        self._push.setsockopt(zmq.LINGER, 0)
        self._push.setsockopt(zmq.SNDHWM, _CONTROL_SNDHWM)
        self._push.connect(config.control_address)
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        self._pull.bind(config.reply_address)
        self._closing = threading.Event()
        self._reader: threading.Thread | None = None
        self._replies_task: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.reader_error: BaseException | None = None
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.num_finished: dict[str, int] = {"stop": 0, "length": 0, "abort": 0}

    # -- lifecycle (event loop) ------------------------------------------------

    def start(self) -> None:
        """Start the output reader thread and the reply receiver; call from the running loop."""
        self._loop = asyncio.get_running_loop()
        self._replies_task = self._loop.create_task(self._receive_replies())
        self._reader = threading.Thread(target=self._read_outputs, name="io-output-reader", daemon=True)
        self._reader.start()

    async def stop(self) -> None:
        """Stop the reader thread (within one ring poll, 0.2 s) and the reply receiver."""
        self._closing.set()
        if self._reader is not None:
            await asyncio.to_thread(self._reader.join)
        if self._replies_task is not None:
            self._replies_task.cancel()

    def close(self) -> None:
        """Close the zmq sockets and context without waiting for unsent messages."""
        self._push.close(linger=0)
        self._pull.close(linger=0)
        self._ctx.term()

    def is_healthy(self) -> bool:
        """True while the reader thread runs."""
        return self._reader is not None and self._reader.is_alive()

    # -- requests (event loop) -------------------------------------------------

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams, stop: Sequence[str],
                    streaming: bool, return_token_ids: bool = False) -> RequestState:
        """Register a request and send it to the scheduler.

        Args:
            prompt_token_ids: the prompt, already checked against ``max_model_len``.
            params: sampling parameters (``max_tokens`` already clamped).
            stop: stop strings (possibly empty).
            streaming: the consumer reads :meth:`RequestState.updates` (woken
                per step) rather than :meth:`RequestState.wait_finished`.
            return_token_ids: a stream needs every token, text or not.

        Raises:
            EngineUnavailable: the scheduler's queue is full.
        """
        req_num = next(self._req_nums)
        state = RequestState(req_num, len(prompt_token_ids), OutputProcessor(self._decode, params, stop), streaming,
                             return_token_ids)
        # Registered before sending: the first token may arrive right after.
        self._requests[req_num] = state
        try:
            self._send(AddRequest(req_num, prompt_token_ids, params))
        except EngineUnavailable:
            del self._requests[req_num]
            raise
        self.num_prompt_tokens += len(prompt_token_ids)
        return state

    def release(self, state: RequestState) -> None:
        """The client is done with ``state``; abort the request if it still runs.

        Idempotent. Output that arrives later for it is dropped.
        """
        if state.released:
            return
        state.released = True
        if state.finish_reason is not None:
            return
        self.num_finished["abort"] += 1
        if self._requests.pop(state.req_num, None) is not None:
            self._send_abort(state.req_num)

    def abort_all(self) -> None:
        """Finish every live request with "abort" (server shutdown): their
        consumers wake up and end their responses, and the scheduler is told."""
        for req_num in list(self._requests):
            state = self._requests.pop(req_num, None)
            if state is None:
                continue
            self._send_abort(req_num)
            if not state.released:
                state.deliver("", "abort", state.processor.num_output_tokens)
                self.num_finished["abort"] += 1

    async def get_stats(self, timeout: float) -> Stats:
        """Ask the scheduler for its occupancy.

        Raises:
            TimeoutError: no reply within ``timeout`` seconds.
            EngineUnavailable: the scheduler's queue is full.
        """
        nonce = next(self._nonces)
        future: asyncio.Future[Stats] = asyncio.get_running_loop().create_future()
        self._stats_waiters[nonce] = future
        try:
            self._send(GetStats(nonce))
            return await asyncio.wait_for(future, timeout)
        finally:
            del self._stats_waiters[nonce]

    async def _receive_replies(self) -> None:
        while True:
            frame = await self._pull.recv()
            try:
                reply = self._decoder.decode(frame)
            except msgspec.DecodeError:
                logger.warning("dropping an undecodable reply from the scheduler (%d bytes)", len(frame))
                continue
            future = self._stats_waiters.get(reply.nonce)
            if future is not None and not future.done():
                future.set_result(reply)

    def _dispatch(self, outputs: list[tuple[RequestState, str, FinishReason | None, int]]) -> None:
        """Deliver one step's results (runs on the loop, one call per step)."""
        for state, text, finish, num_output_tokens in outputs:
            if state.released:
                continue
            state.deliver(text, finish, num_output_tokens)
            if finish is not None:
                self.num_finished[finish] += 1

    # -- control sends (any thread) --------------------------------------------

    def _send(self, msg: AddRequest | AbortRequest | GetStats) -> None:
        with self._send_lock:
            try:
                self._push.send(self._encoder.encode(msg), zmq.NOBLOCK)
            except zmq.Again:
                raise EngineUnavailable("the scheduler is not reading control messages") from None

    def _send_abort(self, req_num: int) -> None:
        try:
            self._send(AbortRequest(req_num))
        except EngineUnavailable:
            # The request stays in the scheduler until it finishes by length
            # or EOS; its tokens are dropped here since it left the table.
            logger.warning("could not send abort for request %d: scheduler queue full", req_num)

    # -- output reader thread --------------------------------------------------

    def _read_outputs(self) -> None:
        ring, reader = self._ring, OUTPUT_READER_IO
        try:
            while not self._closing.is_set():
                try:
                    slot = ring.acquire_read(reader, timeout=POLL_INTERVAL_S)
                except RingTimeout:
                    continue
                t0 = time.monotonic_ns()
                # read() copies the rows out, so the slot goes back to the
                # worker before any text work is done.
                out = slot.read()
                ring.release_read(reader)
                if out.req_nums:
                    self._process_step(out.req_nums, out.token_ids)
                if self._trace is not None:
                    self._trace.add("io_proc", "output", "detokenize", out.step_id, t0, time.monotonic_ns())
                    self._trace.add_step_cpu("io_proc", out.step_id)
        except BaseException as e:
            self.reader_error = e
            logger.exception("output reader thread failed")

    def _process_step(self, req_nums: list[int], token_ids: list[int]) -> None:
        requests = self._requests
        outputs = []
        accepted = 0
        for req_num, token_id in zip(req_nums, token_ids):
            state = requests.get(req_num)
            if state is None:
                continue
            accepted += 1
            try:
                text, finish, needs_abort = state.processor.push(token_id)
            except Exception:
                # One request's failure must not stop the others' output.
                logger.exception("output processing failed for request %d; aborting it", req_num)
                text, finish, needs_abort = "", "abort", True
            if finish is not None:
                requests.pop(req_num, None)
                if needs_abort:
                    self._send_abort(req_num)
            if text or finish is not None or state.every_token:
                outputs.append((state, text, finish, state.processor.num_output_tokens))
        self.num_generation_tokens += accepted
        if outputs:
            self._loop.call_soon_threadsafe(self._dispatch, outputs)
