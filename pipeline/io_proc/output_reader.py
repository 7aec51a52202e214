"""The output reader thread: StepOutputs from the ring -> text per request -> the event loop (docs/design.md, "Output
reader thread").

It copies each entry and releases it before text work. The live-request table is shared with ``EngineClient`` (dict
operations, atomic under the GIL); rows of requests not in it are dropped, so nothing after a finish reaches a client.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable

from pipeline.common.constants import POLL_INTERVAL_S
from pipeline.common.messages import FinishReason
from pipeline.common.shm_ring import RingTimeout, ShmRing
from pipeline.common.step_output import (
    FAILURES,
    OUTPUT_READER_IO,
    DecodedOutput,
    StepOutput,
    TokenLogprobs,
)
from pipeline.common.trace import TraceRecorder
from pipeline.io_proc.openai.logprobs_json import TokenLogprob
from pipeline.io_proc.request_metrics import RequestMetrics
from pipeline.io_proc.request_state import RequestState, StepTime

logger = logging.getLogger(__name__)

# One request's result of one step: (state, new text, finish reason or None,
# output tokens so far).
StepResult = tuple[RequestState, str, FinishReason | None, int]


class OutputReader:
    """The thread that routes sampled tokens to their requests.

    ``send_abort(req_num, finished_ns)`` is called from this thread (thread-safe); ``dispatch(step, results)`` runs on
    the loop once per step with results and must set ``step.time``. ``last_turn``: ``time.monotonic()`` of the last loop
    turn, io_proc's heartbeat.
    """

    def __init__(
        self,
        ring: ShmRing[StepOutput],
        requests: dict[int, RequestState],
        send_abort: Callable[[int, int], None],
        dispatch: Callable[[StepTime, list[StepResult]], None],
        metrics: RequestMetrics,
        trace: TraceRecorder | None = None,
    ):
        self._ring = ring
        self.metrics = metrics
        self._requests = requests
        self._send_abort = send_abort
        self._dispatch = dispatch
        self._trace = trace
        self._closing = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.error: BaseException | None = None
        self.num_generation_tokens = 0
        self.last_turn = time.monotonic()

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start the thread; results are dispatched on ``loop``."""
        self._loop = loop
        self._thread = threading.Thread(target=self._run, name="io-output-reader", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread and wait for it (within one ring poll, ``POLL_INTERVAL_S``); blocks."""
        self._closing.set()
        if self._thread is not None:
            self._thread.join()

    def is_alive(self) -> bool:
        """True while the thread runs."""
        return self._thread is not None and self._thread.is_alive()

    def _run(self) -> None:
        ring, reader = self._ring, OUTPUT_READER_IO
        try:
            while not self._closing.is_set():
                self.last_turn = time.monotonic()
                try:
                    entry = ring.acquire_read(reader, timeout=POLL_INTERVAL_S)
                except RingTimeout:
                    continue
                t0 = time.monotonic_ns()
                # read() copies the rows out, so the entry goes back to the
                # worker before any text work is done.
                out = entry.read(logprobs=True)
                ring.release_read(reader)
                step = self.metrics.step(out)
                if out.req_nums or out.prompt_logprobs is not None:
                    self.process_step(out, step)
                if self._trace is not None:
                    self._trace.add("io_proc", "output", "detokenize", out.step_id, t0, time.monotonic_ns())
                    self._trace.add_step_cpu("io_proc", out.step_id)
        except BaseException as e:
            self.error = e
            logger.exception("output reader thread failed")

    def process_step(self, out: DecodedOutput, step: StepTime) -> None:
        """Run one step's rows and log-probabilities through their requests and dispatch the results (reader thread);
        log-probabilities first, so a token's entry is stored before it is delivered."""
        requests = self._requests
        outputs: list[StepResult] = []
        # First: their rows and log-probabilities (NaN) are then dropped as those of a finished request.
        for req_num, why in zip(out.failed, out.failed_why, strict=True):
            state = requests.pop(req_num, None)
            if state is not None:
                state.error = FAILURES[why]
                self.metrics.finished(state, step, "error")
                outputs.append((state, state.processor.take_text(), "error", state.processor.num_output_tokens))
        if out.prompt_logprobs is not None:
            self._prompt_logprobs(out.prompt_logprobs, outputs, step)
        if out.logprobs is not None:
            self._token_logprobs(out)
        dropped = 0
        for req_num, token_id in zip(out.req_nums, out.token_ids):
            state = requests.get(req_num)
            if state is None:
                dropped += 1
                continue
            state.token_steps.append(step)
            proc = state.processor
            try:
                finish = proc.push(token_id)
            except Exception as e:
                # One request's failure must not stop the others' output: it alone ends, with an error.
                logger.exception("output processing failed for request %d; ending it with an error", req_num)
                finish, proc.needs_abort = "error", True
                state.error = f"internal error while producing the output: {type(e).__name__}"
            if finish is not None:
                requests.pop(req_num, None)
                if proc.needs_abort:
                    # A stop string: the request finished with this step (0: it did not, it failed).
                    self._send_abort(req_num, out.time_ns if finish == "stop" else 0)
                self.metrics.finished(state, step, finish)
                outputs.append((state, proc.take_text(), finish, proc.num_output_tokens))
            elif state.streaming and (proc.text_pieces or state.every_token):
                outputs.append((state, proc.take_text(), None, proc.num_output_tokens))
        accepted = len(out.req_nums) - dropped
        self.num_generation_tokens += accepted
        if accepted or outputs:
            self._loop.call_soon_threadsafe(self._dispatch, step, outputs)

    def _token_logprobs(self, out: DecodedOutput) -> None:
        """Store each sampled token's entry on its request (live ones only)."""
        lp, requests = out.logprobs, self._requests
        for i, row in enumerate(lp.index.tolist()):
            state = requests.get(out.req_nums[row])
            if state is not None:
                state.logprobs.append(
                    TokenLogprob.of(
                        out.token_ids[row], lp.logprob[i], lp.top_ids[i], lp.top_logprobs[i], state.params.logprobs
                    )
                )

    def _prompt_logprobs(self, plp: TokenLogprobs, outputs: list[StepResult], step: StepTime) -> None:
        """Store prompt entries by position; finish requests with ``max_tokens`` 0 that are complete."""
        requests = self._requests
        touched = {}
        for i, (req_num, pos) in enumerate(zip(plp.index.tolist(), plp.pos.tolist())):
            state = requests.get(req_num)
            if state is None or state.prompt_logprobs is None:
                continue
            k = state.params.prompt_logprobs
            state.set_prompt_logprob(
                pos,
                TokenLogprob.of(state.prompt_token_ids[pos], plp.logprob[i], plp.top_ids[i], plp.top_logprobs[i], k),
            )
            touched[req_num] = state
        for req_num, state in touched.items():
            # The scheduler finishes such a request in the step that computes its last prompt entry.
            if state.params.max_tokens == 0 and state.prompt_logprobs_missing == 0:
                requests.pop(req_num, None)
                self.metrics.finished(state, step, "length")
                outputs.append((state, "", "length", 0))
