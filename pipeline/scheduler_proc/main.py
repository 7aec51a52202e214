"""scheduler_proc: the process that plans steps.

Loop: take control messages (zmq), plan a step into the descriptor ring
whenever fewer than ``max_inflight`` steps are in flight
(:data:`~pipeline.common.step_protocol.MAX_INFLIGHT_STEPS` with asynchronous
scheduling, 1 in lock step), otherwise wait on the output ring for the oldest
step's tokens. Imports neither torch nor model code.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from collections import deque

import msgspec
import numpy as np
import zmq

from pipeline.common.config import EngineConfig
from pipeline.common.constants import POLL_INTERVAL_S, cdiv
from pipeline.common.grammar import load_tokenizer
from pipeline.common.memory import BurstWatch, trim_heap
from pipeline.common.messages import AbortRequest, AddRequest, Admitted, GetStats, Shutdown, Stats, ToScheduler
from pipeline.common.process import StopFlag, freeze_startup_heap, report
from pipeline.common.shm_ring import RingTimeout, ShmRing
from pipeline.common.step_clock import WORKER_STATS_LEN, CpuPerStep, worker_stats
from pipeline.common.step_protocol import (
    MASK_BITS,
    MAX_INFLIGHT_STEPS,
    OUTPUT_READER_SCHEDULER,
    StepDescriptor,
    StepOutput,
)
from pipeline.common.trace import TraceRecorder
from pipeline.scheduler_proc.scheduler import Scheduler

logger = logging.getLogger("pipeline.scheduler")


class StepTimeout(Exception):
    """A step in flight produced no output within ``--step-timeout``: the worker is hung."""


class SchedulerProc:
    """Owns the scheduler, its rings and sockets; :meth:`run` is the process body.

    A control message that does not decode is logged and dropped. With
    ``config.step_timeout_s`` > 0, :meth:`run` raises :class:`StepTimeout`
    when the oldest step in flight has waited that long for its output.
    """

    def __init__(
        self,
        config: EngineConfig,
        desc_ring: ShmRing[StepDescriptor],
        out_ring: ShmRing[StepOutput],
        control: zmq.Socket,
        replies: zmq.Socket,
    ):
        self.config = config
        self.desc_ring, self.out_ring = desc_ring, out_ring
        self.control, self.replies = control, replies
        # Structured output needs llguidance's view of the tokenizer; building it takes ~0.2 s, so it is
        # done here, before the first step, not when the first grammar request arrives.
        grammar_tokenizer = (
            load_tokenizer(config.tokenizer or config.model, config.vocab_size) if config.vocab_size else None
        )
        self.scheduler = Scheduler(
            config.max_num_seqs,
            config.max_num_batched_tokens,
            config.block_size,
            config.num_kv_blocks,
            config.max_blocks_per_seq,
            grammar_tokenizer,
            cdiv(config.vocab_size, MASK_BITS),
            config.enable_prefix_caching,
            config.block_hash_root,
        )
        self.max_inflight = MAX_INFLIGHT_STEPS if config.async_scheduling else 1
        self.inflight: deque[int] = deque()
        # time.monotonic() at which the oldest step in flight was published, or since its
        # predecessor's output arrived (it cannot run before): what the watchdog measures.
        self._oldest_since = 0.0
        self.trace = TraceRecorder() if config.trace else None
        self._cpu = CpuPerStep()
        self._worker_counts = np.zeros(WORKER_STATS_LEN, np.int64)  # as of the last output read
        self._decoder = msgspec.msgpack.Decoder(ToScheduler)
        self._encoder = msgspec.msgpack.Encoder()
        self._running = True
        self._burst = BurstWatch()

    def run(self, stop) -> None:
        """Serve until a Shutdown message or ``stop.is_set()``."""
        wait_ms = 0
        while self._running and not stop.is_set():
            self._drain_control(wait_ms)
            wait_ms = 0
            if self._burst.passed(self.scheduler.num_unfinished):
                self._release_memory()
            if len(self.inflight) < self.max_inflight and self.scheduler.num_unfinished and self._plan_step():
                continue
            if self.inflight:
                self._await_output()
            else:  # nothing runs and nothing can: sleep in zmq until a message comes
                wait_ms = int(POLL_INTERVAL_S * 1000)

    def _release_memory(self) -> None:
        """After a burst of requests: free the free lists and what cycles hold, then give the heap back.

        With the start-up heap frozen the collection sees only what serving
        allocated (milliseconds once the burst is over); the trim, tens of
        milliseconds after a burst of hundreds of MB, runs on a thread of its own.
        """
        self.scheduler.shrink()
        gc.collect()
        threading.Thread(target=trim_heap, name="trim-heap", daemon=True).start()

    def _drain_control(self, timeout_ms: int) -> None:
        if not self.control.poll(timeout_ms):
            return
        while True:
            try:
                raw = self.control.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                msg = self._decoder.decode(raw)
            except msgspec.DecodeError as e:
                # Only io_proc writes here, but one bad message must not take the engine down.
                logger.warning("dropped a malformed control message (%d bytes): %s", len(raw), e)
                continue
            if isinstance(msg, AddRequest):
                self.scheduler.add_request(msg)
            elif isinstance(msg, AbortRequest):
                self.scheduler.abort_request(msg.req_num, msg.finished_ns)
            elif isinstance(msg, GetStats):
                self.replies.send(self._encoder.encode(self._stats(msg.nonce)))
            elif isinstance(msg, Shutdown):
                self._running = False

    def _plan_step(self) -> bool:
        try:
            desc = self.desc_ring.acquire_write(timeout=POLL_INTERVAL_S)
        except RingTimeout:
            return False
        t0 = time.monotonic_ns()
        step_id = self.scheduler.next_step_id
        if not self.scheduler.schedule(desc):
            return False  # entry stays acquired for the next try
        if self.scheduler.admitted:  # before the step: io_proc has it before the requests' outputs
            nums, cached = zip(*self.scheduler.admitted)
            self.replies.send(self._encoder.encode(Admitted(list(nums), list(cached))))
            self.scheduler.admitted.clear()
        self.desc_ring.publish()
        if self.trace is not None:
            t1 = time.monotonic_ns()
            self.trace.add(self.config.scheduler_role, "plan", "plan", step_id, t0, t1)
            if self.scheduler.num_cached_tokens_step:
                hits = f"{self.scheduler.num_cached_tokens_step} cached tokens"
                self.trace.add(self.config.scheduler_role, "prefix cache", hits, step_id, t0, t1)
        if not self.inflight:
            self._oldest_since = time.monotonic()
        self.inflight.append(step_id)
        return True

    def _await_output(self) -> None:
        try:
            entry = self.out_ring.acquire_read(OUTPUT_READER_SCHEDULER, timeout=POLL_INTERVAL_S)
        except RingTimeout:
            waited = time.monotonic() - self._oldest_since
            if self.config.step_timeout_s and waited > self.config.step_timeout_s:
                raise StepTimeout(
                    f"step {self.inflight[0]} has produced no output for {waited:.1f} s "
                    f"(--step-timeout {self.config.step_timeout_s:g}): the worker is hung"
                ) from None
            return
        t0 = time.monotonic_ns()
        out = entry.read()
        np.copyto(self._worker_counts, entry.worker_stats)
        self.out_ring.release_read(OUTPUT_READER_SCHEDULER)
        expected = self.inflight.popleft()
        if out.step_id != expected:
            raise RuntimeError(f"worker reported step {out.step_id}, expected {expected}")
        self._oldest_since = time.monotonic()
        self.scheduler.process_output(out.step_id, out.req_nums, out.token_ids, out.time_ns)
        self._cpu.step(out.continues)
        if self.trace is not None:
            self.trace.add(self.config.scheduler_role, "plan", "process_output", out.step_id, t0, time.monotonic_ns())
            self.trace.add_step_cpu(self.config.scheduler_role, out.step_id)

    def _stats(self, nonce: int) -> Stats:
        s = self.scheduler
        return Stats(
            nonce=nonce,
            num_running=len(s.running),
            num_waiting=len(s.waiting),
            num_free_blocks=s.pool.num_free_blocks,
            num_total_blocks=s.pool.num_blocks,
            num_free_req_indices=s.pool.num_free_req_indices,
            num_total_req_indices=s.pool.num_req_indices,
            num_steps=s.next_step_id,
            num_preemptions=s.num_preemptions,
            queue_time=s.queue_time.data(),
            prefill_time=s.prefill_time.data(),
            decode_time=s.decode_time.data(),
            inference_time=s.inference_time.data(),
            iteration_tokens=s.iteration_tokens.data(),
            step_cpu=self._cpu.histogram.data(1e-9),
            worker=worker_stats(self._worker_counts),
            # None with caching off, as vLLM reports no prefix-cache figures then.
            prefix_cache_queries=s.prefix.num_queries if s.prefix.enabled else None,
            prefix_cache_hits=s.prefix.num_hits if s.prefix.enabled else None,
            num_cached_blocks=s.pool.num_cached_blocks,
        )


def run_scheduler(config: EngineConfig, status_conn, stop: StopFlag) -> int:
    """Process body of scheduler_proc (see :mod:`pipeline.child`): serve until ``stop``; returns the exit status."""
    role = config.scheduler_role
    desc_ring = config.descriptor_ring()
    out_ring = config.output_ring()
    report(status_conn, "attached", role)
    ctx = zmq.Context()
    control = ctx.socket(zmq.PULL)
    control.bind(config.control_address)
    replies = ctx.socket(zmq.PUSH)
    replies.connect(config.reply_address)
    try:
        loop = SchedulerProc(config, desc_ring, out_ring, control, replies)
    except ValueError as e:
        report(status_conn, "error", role, str(e))
        return 1
    freeze_startup_heap()
    report(status_conn, "ready", role)
    try:
        loop.run(stop)
    finally:
        if loop.trace is not None:
            loop.trace.dump(config.trace_path(role))
        ctx.destroy(linger=0)
        desc_ring.close()
        out_ring.close()
    return 0
