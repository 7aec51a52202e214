"""io_proc's control client of the engine (docs/design.md, "The control channel"), and the lifecycle that wires its
parts; tokens come back through the ``OutputReader`` thread (see ``output_reader`` for the live-request table)."""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import threading
import time
from collections.abc import Sequence

import msgspec
import zmq
import zmq.asyncio
from msgspec.structs import replace

from pipeline.common.config import EngineConfig
from pipeline.common.messages import (
    AbortRequest,
    AddRequest,
    Admitted,
    GetStats,
    GrammarCompiled,
    RequestFailed,
    SamplingParams,
    Stats,
    ToIO,
    choice_seed,
    merge_stats,
)
from pipeline.common.shm_ring import ShmRing
from pipeline.common.step_output import StepOutput
from pipeline.common.trace import TraceRecorder
from pipeline.io_proc.detokenizer import NewDetokenizer, OutputProcessor
from pipeline.io_proc.output_reader import OutputReader, StepResult
from pipeline.io_proc.prefix_router import PrefixRouter, pick_engine
from pipeline.io_proc.request_metrics import RequestMetrics
from pipeline.io_proc.request_state import RequestState, StepTime

logger = logging.getLogger(__name__)

# Control messages queued towards a scheduler that does not read them before
# sends fail (EngineUnavailable) instead of blocking the event loop.
_CONTROL_SNDHWM = 100_000
# How long a finished request's usage waits for its engine's Admitted message
# (sent before the request's first step, so it is normally there long before).
_ADMITTED_TIMEOUT_S = 5.0


class EngineUnavailable(Exception):
    """The scheduler is not taking control messages (its queue is full)."""


class EngineClient:
    """Sends requests to the engines' schedulers and routes sampled tokens back (docs/design.md, "Parallelism").

    A new request goes to the engine with its longest cached prefix (``PrefixRouter``) unless overloaded, else the least
    loaded. Counters per engine: ``prompt_tokens``, ``generation_tokens``, ``num_finished``.

    Raises:
        zmq.ZMQError: the reply address cannot be bound.
    """

    def __init__(
        self,
        config: EngineConfig,
        rings: Sequence[ShmRing[StepOutput]],
        new_detokenizer: NewDetokenizer,
        trace: TraceRecorder | None = None,
    ):
        self._new_detokenizer = new_detokenizer
        self._requests: dict[int, RequestState] = {}
        self._req_nums = itertools.count(1)
        self._nonces = itertools.count(1)
        self._stats_waiters: dict[int, asyncio.Future[Stats]] = {}
        # AddRequest number of a request with a grammar -> its choices, until the scheduler has compiled it.
        self._compiling: dict[int, list[RequestState]] = {}
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(ToIO)
        # zmq sockets are not thread-safe; the push sockets are used by the loop
        # (add, abort, stats) and by the reader threads (stop-string aborts).
        self._send_lock = threading.Lock()
        self._ctx = zmq.asyncio.Context()
        self._pushes = []
        for engine in config.engines():
            push = zmq.Socket(self._ctx, zmq.PUSH)
            push.setsockopt(zmq.LINGER, 0)
            push.setsockopt(zmq.SNDHWM, _CONTROL_SNDHWM)
            push.connect(engine.control_address)
            self._pushes.append(push)
        if len(rings) != len(self._pushes):
            raise ValueError(f"{len(rings)} output rings for {len(self._pushes)} engines")
        self._pull = self._ctx.socket(zmq.PULL)  # every engine's scheduler replies here
        self._pull.setsockopt(zmq.LINGER, 0)
        self._pull.bind(config.reply_address)
        self._readers = [
            OutputReader(
                ring,
                self._requests,
                functools.partial(self._send_abort, engine=e),
                self._dispatch,
                RequestMetrics(config.max_model_len, config.num_speculative_tokens > 0),
                trace,
            )
            for e, ring in enumerate(rings)
        ]
        self._router = None
        if config.parallel.data_parallel_size > 1 and config.scheduler.enable_prefix_caching:
            self._router = PrefixRouter(
                config.parallel.data_parallel_size,
                config.num_kv_blocks,
                config.scheduler.block_size,
                config.block_hash_root,
            )
        # An engine is overloaded for prefix routing with this many more live requests than the least loaded.
        self._balance_threshold = max(1, config.scheduler.max_num_seqs // 4)
        # Requests sent whose Admitted message has not come; a usage waits on the future, if any.
        self._unadmitted: dict[int, RequestState] = {}
        self._admitted_waiters: dict[int, asyncio.Future[None]] = {}
        self._replies_task: asyncio.Task | None = None
        self.prompt_tokens = [0] * len(rings)
        self.num_finished: dict[str, int] = {"stop": 0, "length": 0, "abort": 0, "error": 0}
        self._shutting_down = False

    @property
    def generation_tokens(self) -> list[int]:
        """Output tokens accepted for live requests so far, per engine."""
        return [r.num_generation_tokens for r in self._readers]

    @property
    def request_metrics(self) -> list[RequestMetrics]:
        """Each engine's request histograms, in engine order."""
        return [r.metrics for r in self._readers]

    @property
    def num_live(self) -> int:
        """Requests (choices) that have not finished."""
        return len(self._requests)

    @property
    def reader_turn(self) -> float:
        """``time.monotonic()`` of the last turn of the output reader thread that turned least recently."""
        return min(r.last_turn for r in self._readers)

    @property
    def shutting_down(self) -> bool:
        """``abort_all`` was called: the server is stopping."""
        return self._shutting_down

    @property
    def reader_error(self) -> BaseException | None:
        """The exception that ended an output reader thread, if one did."""
        return next((r.error for r in self._readers if r.error is not None), None)

    # -- lifecycle (event loop) ------------------------------------------------

    def start(self) -> None:
        """Start the output reader threads and the reply receiver; call from the running loop."""
        loop = asyncio.get_running_loop()
        self._replies_task = loop.create_task(self._receive_replies())
        for reader in self._readers:
            reader.start(loop)

    async def stop(self) -> None:
        """Stop the reader threads (within one ring poll, ``POLL_INTERVAL_S``) and the reply receiver."""
        for reader in self._readers:
            await asyncio.to_thread(reader.stop)
        if self._replies_task is not None:
            self._replies_task.cancel()

    def close(self) -> None:
        """Close the zmq sockets and context without waiting for unsent messages."""
        for push in self._pushes:
            push.close(linger=0)
        self._pull.close(linger=0)
        self._ctx.term()

    def is_healthy(self) -> bool:
        """True while every output reader thread runs."""
        return all(r.is_alive() for r in self._readers)

    # -- requests (event loop) -------------------------------------------------

    def add_request(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        stop: Sequence[str],
        streaming: bool,
        return_token_ids: bool = False,
    ) -> RequestState:
        """Register a request of one choice and send it to the scheduler (see ``add_choices``)."""
        return self.add_choices(prompt_token_ids, params, stop, streaming, return_token_ids)[0]

    def add_choices(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        stop: Sequence[str],
        streaming: bool,
        return_token_ids: bool = False,
        n: int = 1,
    ) -> list[RequestState]:
        """Register ``n`` choices of one prompt and send them as one request (docs/design.md, "Parallel choices").

        Returns one state per choice, in order.

        Raises:
            EngineUnavailable: the scheduler's queue is full, or the server is shutting down.
        """
        if self._shutting_down:
            # A request still being tokenized when the stop came would
            # otherwise start after abort_all and hold the shutdown.
            raise EngineUnavailable("the server is shutting down")
        # Choice i is request req_num + i.
        req_num = next(self._req_nums)
        nums = [req_num] + [next(self._req_nums) for _ in range(n - 1)]
        states = []
        choices = [n, 0, n] if n > 1 else None  # shared: see RequestState.choices
        for i, num in enumerate(nums):
            p = params if n == 1 else replace(params, seed=choice_seed(params.seed, i))
            processor = OutputProcessor(self._new_detokenizer(), p, stop, incremental=streaming)
            states.append(
                RequestState(num, len(prompt_token_ids), processor, streaming, return_token_ids, p, prompt_token_ids)
            )
            states[-1].choices = choices
        if params.max_tokens == 0 and states[0].prompt_logprobs_missing == 0:
            # Nothing for the device to compute (an echo of a one-token prompt,
            # or without log-probabilities): finished as it starts.
            for state in states:
                state.num_cached_tokens = 0
                state.deliver("", "length", 0)
            self.num_finished["length"] += n
            return states
        engine = self._pick_engine(prompt_token_ids, params.lora_id)
        for state in states:
            state.engine = engine
        if params.grammar:
            compiled = asyncio.get_running_loop().create_future()
            for state in states:
                state.compiled = compiled
            self._compiling[req_num] = states
        # Registered before sending: the first token may arrive right after.
        for state in states:
            self._requests[state.req_num] = state
            self._unadmitted[state.req_num] = state
        try:
            self._send(AddRequest(req_num, prompt_token_ids, params, n=n), engine)
        except EngineUnavailable:
            for state in states:
                del self._requests[state.req_num]
                del self._unadmitted[state.req_num]
            self._compiling.pop(req_num, None)
            raise
        self.prompt_tokens[engine] += len(prompt_token_ids)
        return states

    def _pick_engine(self, prompt: list[int], lora_id: int = 0) -> int:
        """The engine for a new request of ``prompt`` with LoRA adapter ``lora_id``; overloaded means over a quarter
        of ``max_num_seqs`` above the least loaded (as SGLang's router)."""
        if len(self._pushes) == 1:
            return 0
        load = [[0, 0] for _ in self._pushes]
        for state in self._requests.values():
            # The processor's count, not the delivered one: a non-streaming
            # request is delivered nothing before its finish.
            load[state.engine][state.processor.num_output_tokens > 0] += 1
        if self._router is None:
            return pick_engine(load, None, 0)
        names = self._router.names(prompt, lora_id)
        engine = pick_engine(load, self._router.matches(names), self._balance_threshold)
        self._router.record(engine, names)
        return engine

    def release(self, state: RequestState) -> None:
        """The client is done with ``state``: abort it if it still runs (idempotent; later output is dropped)."""
        if state.released:
            return
        state.released = True
        self._unadmitted.pop(state.req_num, None)
        if state.finish_reason is not None:
            return
        self.num_finished["abort"] += 1
        if self._requests.pop(state.req_num, None) is not None:
            self._send_abort(state.req_num, engine=state.engine)

    def abort_all(self) -> None:
        """Finish every live request with "abort" (server shutdown): their consumers wake up and end their responses,
        and the scheduler is told. Stats requests waiting for a reply fail with ``EngineUnavailable``. From now on
        ``add_request`` refuses new requests (a 503)."""
        self._shutting_down = True
        for future in self._stats_waiters.values():  # the schedulers are stopping too: no reply will come
            if not future.done():
                future.set_exception(EngineUnavailable("the server is shutting down"))
        for states in self._compiling.values():
            states[0].compiled.set_result("the server is shutting down")
        self._compiling.clear()
        for req_num in list(self._requests):
            state = self._requests.pop(req_num, None)
            if state is None:
                continue
            self._send_abort(req_num, engine=state.engine)
            if not state.released:
                state.deliver("", "abort", state.processor.num_output_tokens)
                self.num_finished["abort"] += 1

    async def get_stats(self, timeout: float) -> Stats:
        """The engines' occupancy, summed (``nonce`` 0); as ``get_engine_stats``."""
        return merge_stats(await self.get_engine_stats(timeout))

    async def get_engine_stats(self, timeout: float) -> list[Stats]:
        """Ask every engine's scheduler for its occupancy; one reply per engine, in order.

        Raises:
            TimeoutError: not every reply came within ``timeout`` seconds.
            EngineUnavailable: a scheduler's queue is full.
        """
        loop = asyncio.get_running_loop()
        nonces = [next(self._nonces) for _ in self._pushes]
        for nonce in nonces:
            self._stats_waiters[nonce] = loop.create_future()
        try:
            for engine, nonce in enumerate(nonces):
                self._send(GetStats(nonce), engine)
            async with asyncio.timeout(timeout):
                return [await self._stats_waiters[n] for n in nonces]
        finally:
            for nonce in nonces:
                del self._stats_waiters[nonce]

    async def _receive_replies(self) -> None:
        while True:
            frame = await self._pull.recv()
            try:
                reply = self._decoder.decode(frame)
            except msgspec.DecodeError:
                logger.warning("dropping an undecodable reply from the scheduler (%d bytes)", len(frame))
                continue
            if isinstance(reply, Admitted):
                self._on_admitted(reply)
            elif isinstance(reply, Stats):
                future = self._stats_waiters.get(reply.nonce)
                if future is not None and not future.done():
                    future.set_result(reply)
            elif isinstance(reply, GrammarCompiled):
                self._on_compiled(reply)
            elif isinstance(reply, RequestFailed):
                self._on_failed(reply.req_num, reply.message)

    def _on_compiled(self, reply: GrammarCompiled) -> None:
        """The scheduler has compiled a request's grammar (it runs now) or refused it (its choices end)."""
        states = self._compiling.pop(reply.req_num, None)
        if states is None:
            return
        states[0].compiled.set_result(reply.error)
        if reply.error:
            for state in states:
                if self._requests.pop(state.req_num, None) is not None and not state.released:
                    state.fail(reply.error, refused=True)
                    self.num_finished["error"] += 1

    def _on_failed(self, req_num: int, message: str) -> None:
        """The scheduler ended request ``req_num`` with an error (it has dropped it already)."""
        state = self._requests.pop(req_num, None)
        if state is not None and not state.released:
            state.fail(message)
            self.num_finished["error"] += 1

    def _on_admitted(self, msg: Admitted) -> None:
        for req_num, n in zip(msg.req_nums, msg.num_cached_tokens):
            state = self._unadmitted.pop(req_num, None)
            if state is not None:
                state.num_cached_tokens = n
            future = self._admitted_waiters.pop(req_num, None)
            if future is not None and not future.done():
                future.set_result(None)

    async def wait_admitted(self, states: list[RequestState]) -> None:
        """Return once each of ``states`` knows its ``num_cached_tokens`` (0 after a few seconds)."""
        loop = asyncio.get_running_loop()
        missing = [st for st in states if st.num_cached_tokens is None]
        for st in missing:
            self._admitted_waiters[st.req_num] = loop.create_future()
        try:
            async with asyncio.timeout(_ADMITTED_TIMEOUT_S):
                for st in missing:
                    await self._admitted_waiters[st.req_num]
        except TimeoutError:
            logger.warning("no admission report for %d requests: reporting 0 cached tokens", len(missing))
        finally:
            for st in missing:
                self._admitted_waiters.pop(st.req_num, None)
                if st.num_cached_tokens is None:
                    st.num_cached_tokens = 0

    def _dispatch(self, step: StepTime, outputs: list[StepResult]) -> None:
        """Stamp one step's arrival and deliver its results (runs on the loop, one call per step)."""
        step.time = time.perf_counter()
        for state, text, finish, num_output_tokens in outputs:
            if state.released:
                continue
            state.deliver(text, finish, num_output_tokens)
            if finish is not None:
                self.num_finished[finish] += 1
                if self._router is not None:  # the engine now caches the output's blocks too
                    tokens = state.prompt_token_ids + state.processor.token_ids[:num_output_tokens]
                    self._router.record(state.engine, self._router.names(tokens, state.params.lora_id))

    # -- control sends (any thread) --------------------------------------------

    def _send(self, msg: AddRequest | AbortRequest | GetStats, engine: int) -> None:
        with self._send_lock:
            try:
                self._pushes[engine].send(self._encoder.encode(msg), zmq.NOBLOCK)
            except zmq.Again:
                raise EngineUnavailable("the scheduler is not reading control messages") from None

    def _send_abort(self, req_num: int, finished_ns: int = 0, *, engine: int) -> None:
        try:
            self._send(AbortRequest(req_num, finished_ns), engine)
        except EngineUnavailable:
            # The request stays in the scheduler until it finishes by length
            # or EOS; its tokens are dropped here since it left the table.
            logger.warning("could not send abort for request %d: scheduler queue full", req_num)
