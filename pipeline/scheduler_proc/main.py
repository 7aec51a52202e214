"""scheduler_proc: the process that plans steps (no torch, no model code); it plans while fewer than ``max_inflight``
steps are in flight, else waits for the oldest step's tokens."""

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
from pipeline.common.constants import POLL_INTERVAL_S
from pipeline.common.grammar import load_tokenizer
from pipeline.common.heartbeat import Heartbeats
from pipeline.common.kv_events import engine_endpoint
from pipeline.common.memory import BurstWatch, limit_arenas, trim_heap
from pipeline.common.messages import (
    AbortRequest,
    AddRequest,
    Admitted,
    GetStats,
    GrammarCompiled,
    RequestFailed,
    Shutdown,
    Stats,
    ToScheduler,
)
from pipeline.common.process import StopFlag, freeze_startup_heap, report
from pipeline.common.shm_ring import RingTimeout, ShmRing
from pipeline.common.step_clock import BUSY_NS, WORKER_STATS_LEN, CpuPerStep, worker_stats
from pipeline.common.step_output import FAILURES, OUTPUT_READER_SCHEDULER, StepOutput
from pipeline.common.step_protocol import MAX_INFLIGHT_STEPS, StepDescriptor, TokenMasks
from pipeline.common.trace import TraceRecorder
from pipeline.scheduler_proc.grammar_manager import GrammarManager
from pipeline.scheduler_proc.grammar_state import MASK_SHARE_OF_STEP
from pipeline.scheduler_proc.kv_event_publisher import KVEventPublisher
from pipeline.scheduler_proc.scheduler import Scheduler

logger = logging.getLogger("pipeline.scheduler")

# How often the loop looks for finished compilations while nothing else runs.
_COMPILING_POLL_MS = 5
# With jump-forward, planning waits this long at most (and at most MASK_SHARE_OF_STEP of a step's device time)
# for the masks of the output just applied, whose job also computes the tokens each grammar forces next.
_FORCED_WAIT_S = 0.002
# How long the loop waits for an output while a step's masks are being computed, before it looks at them again.
_MASK_POLL_S = 0.0002


class StepTimeout(Exception):
    """A step in flight produced no output within ``--step-timeout``: the worker is hung."""


class SchedulerProc:
    """Owns the scheduler, its rings and sockets; ``run`` is the process body, raising ``StepTimeout`` when the oldest
    step waits ``config.observability.step_timeout_s`` and io_proc's heartbeat is fresher (docs/design.md,
    "Liveness")."""

    def __init__(
        self,
        config: EngineConfig,
        desc_ring: ShmRing[StepDescriptor],
        out_ring: ShmRing[StepOutput],
        control: zmq.Socket,
        replies: zmq.Socket,
        heartbeats: Heartbeats | None = None,
        mask_ring: ShmRing[TokenMasks] | None = None,
    ):
        self.config = config
        self.heartbeats = heartbeats
        self.desc_ring, self.out_ring, self.mask_ring = desc_ring, out_ring, mask_ring
        self.control, self.replies = control, replies
        # Structured output needs llguidance's view of the tokenizer; building it takes ~0.2 s, so it is
        # done here, before the first step, not when the first grammar request arrives.
        self.grammars = None
        # The worker reports the drafts a proposer made; a draft model's exist only inside its step.
        grammar_drafts = config.speculative is not None and config.speculative.method != "draft_model"
        jump_forward = grammar_drafts and config.scheduler.grammar_jump_forward
        self._jump_forward = jump_forward and bool(config.vocab_size)
        if config.vocab_size:
            self.grammars = GrammarManager(
                load_tokenizer(config.tokenizer or config.model, config.vocab_size),
                config.vocab_size,
                config.scheduler.max_grammar_memory_per_request_mb * 2**20,
                config.scheduler.max_grammar_memory_mb * 2**20,
                jump_forward,
            )
        self.scheduler = Scheduler(
            config.scheduler.max_num_seqs,
            config.scheduler.max_num_batched_tokens,
            config.scheduler.block_size,
            config.num_kv_blocks,
            config.max_blocks_per_seq,
            config.scheduler.enable_prefix_caching,
            config.block_hash_root,
            config.num_speculative_tokens,
            config.scheduler.speculative_policy == "adaptive",
            self.grammars,
            grammar_drafts=grammar_drafts,
            jump_forward=jump_forward,
            max_loras=config.lora.max_loras if config.lora is not None else 0,
        )
        self.kv_events = None
        if config.kv_events is not None:
            try:
                self.kv_events = KVEventPublisher(config.kv_events, config.scheduler.block_size, config.engine_index)
            except zmq.ZMQError as e:
                endpoint = engine_endpoint(config.kv_events.endpoint, config.engine_index)
                raise ValueError(f"--kv-events-config: cannot open {endpoint}: {e}") from None
            self.kv_events.cleared()  # a subscriber that followed an earlier server on this endpoint starts over
            self.scheduler.set_kv_events(self.kv_events)
        self.max_inflight = MAX_INFLIGHT_STEPS if config.scheduler.async_scheduling else 1
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
        self._mask_lock = threading.Lock()  # the mask ring's writer: this thread or the mask thread

    def run(self, stop) -> None:
        """Serve until a Shutdown message or ``stop.is_set()``."""
        wait_ms = 0
        role = self.config.scheduler_role
        while self._running and not stop.is_set():
            if self.heartbeats is not None:
                self.heartbeats.beat(role)
            if self.kv_events is not None:  # the last turn's events
                self.kv_events.flush()
            self._drain_control(wait_ms)
            wait_ms = 0
            if self._burst.passed(self.scheduler.num_unfinished):
                self._release_memory()
            masks_wait = False
            if self.grammars is not None:
                self._grammar_turn()
                masks_wait = self._publish_masks()  # the mask thread publishes them too, once computed
            if len(self.inflight) < self.max_inflight and self.scheduler.num_unfinished and self._plan_step():
                continue
            if self.inflight:
                # A step waits for masks still being computed: look for them again soon.
                self._await_output(_MASK_POLL_S if masks_wait else POLL_INTERVAL_S)
            elif self.grammars is not None and self.grammars.num_pending:  # look again soon: compiling
                wait_ms = _COMPILING_POLL_MS
            else:  # nothing runs and nothing can: sleep in zmq until a message comes
                wait_ms = int(POLL_INTERVAL_S * 1000)

    def _release_memory(self) -> None:
        """After a burst of requests: collect, free the free lists, and trim the heap on a thread of its own."""
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
                self._add_request(msg)
            elif isinstance(msg, AbortRequest):
                if self.grammars is None or not self.grammars.abort(msg.req_num):
                    self.scheduler.abort_request(msg.req_num, msg.finished_ns)
            elif isinstance(msg, GetStats):
                self._reply(self._stats(msg.nonce))
            elif isinstance(msg, Shutdown):
                self._running = False

    def _add_request(self, msg: AddRequest) -> None:
        """Queue a request (one with a grammar waits for its matchers); one the scheduler cannot take fails alone."""
        if msg.params.grammar:
            if self.grammars is None:
                self._reply(
                    GrammarCompiled(msg.req_num, "structured output needs the model's vocabulary, not configured here")
                )
            else:
                self.grammars.add(msg)
            return
        try:
            self.scheduler.add_request(msg)
        except Exception as e:
            logger.exception("request %d could not be queued", msg.req_num)
            for i in range(msg.n):  # its choices
                self._reply(RequestFailed(msg.req_num + i, f"{type(e).__name__}: {e}"))

    def _grammar_turn(self) -> None:
        """Queue the requests whose matchers are ready, tell io_proc of those refused, and end those whose matcher
        failed on a token (docs/design.md, "Structured output")."""
        ready, refused = self.grammars.poll()
        for msg, states, aborted in ready:
            self.scheduler.add_request(msg, states)
            for num in aborted:
                self.scheduler.abort_request(num)
            self._reply(GrammarCompiled(msg.req_num))
        for req_num, why in refused:
            self._reply(GrammarCompiled(req_num, why))
        if self.scheduler.masks.walks_waiting:
            self.scheduler.start_walks()
            self.grammars.flush(then=self._publish_masks)
        failed = self.grammars.failed
        while failed:
            state = failed.popleft()
            if self.scheduler.abort_request(state.req_num):
                logger.warning("request %d: %s", state.req_num, state.error)
                self._reply(RequestFailed(state.req_num, state.error))

    def _publish_masks(self) -> bool:
        """Write the masks of planned steps whose constrained rows' tokens are known, oldest first; True if some step's
        masks are being computed or cannot be written yet."""
        masks = self.scheduler.masks
        with self._mask_lock:
            while len(masks):
                if not masks.oldest_ready():
                    return masks.oldest_computing()
                try:
                    entry = self.mask_ring.acquire_write(timeout=0)
                except RingTimeout:  # the worker has not read an earlier step's masks yet
                    return True
                step_id = masks.write_oldest(entry)
                self.mask_ring.publish()
                if self.trace is not None:
                    t = time.monotonic_ns()
                    self.trace.add(self.config.scheduler_role, "plan", "masks", step_id, t, t)
        return False

    def _reply(self, msg: Admitted | GrammarCompiled | RequestFailed | Stats) -> None:
        self.replies.send(self._encoder.encode(msg))

    def _plan_step(self) -> bool:
        try:
            desc = self.desc_ring.acquire_write(timeout=POLL_INTERVAL_S)
        except RingTimeout:
            return False
        t0 = time.monotonic_ns()
        step_id = self.scheduler.next_step_id
        if self._jump_forward:  # a row's forced tokens are computed with its mask: those after its newest tokens
            self.grammars.wait_masks(min(_FORCED_WAIT_S, MASK_SHARE_OF_STEP * self.scheduler.step_device_s))
        if not self.scheduler.schedule(desc):
            return False  # entry stays acquired for the next try
        if self.scheduler.admitted:  # before the step: io_proc has it before the requests' outputs
            nums, cached = zip(*self.scheduler.admitted)
            self._reply(Admitted(list(nums), list(cached)))
            self.scheduler.admitted.clear()
        self.desc_ring.publish()
        if len(self.scheduler.masks):  # rows whose masks were known at planning: the worker reads them next
            self.grammars.flush(then=self._publish_masks)  # draft walks the step started
            self._publish_masks()
        self.scheduler.observe_outputs()
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

    def _await_output(self, timeout: float) -> None:
        try:
            entry = self.out_ring.acquire_read(OUTPUT_READER_SCHEDULER, timeout=timeout)
        except RingTimeout:
            if not self._worker_started():
                # A request sent while the worker still loads (docs/design.md, "Readiness"): its step
                # can start only once the worker is up, so the watchdog counts from then.
                self._oldest_since = time.monotonic()
                return
            waited = time.monotonic() - self._oldest_since
            timeout = self.config.observability.step_timeout_s
            if timeout and waited > timeout and not self._io_proc_hung():
                raise StepTimeout(
                    f"step {self.inflight[0]} has produced no output for {waited:.1f} s "
                    f"(--step-timeout {timeout:g}): the worker is hung"
                ) from None
            return
        t0 = time.monotonic_ns()
        out = entry.read(drafts=self.scheduler.drafts is not None, arrays=True)
        busy = self._worker_counts[BUSY_NS]
        np.copyto(self._worker_counts, entry.worker_stats)
        self.out_ring.release_read(OUTPUT_READER_SCHEDULER)
        expected = self.inflight.popleft()
        if out.step_id != expected:
            raise RuntimeError(f"worker reported step {out.step_id}, expected {expected}")
        for req_num, why in zip(out.failed, out.failed_why, strict=True):  # io_proc ends them with an error
            if self.scheduler.abort_request(req_num):
                logger.warning("request %d: %s", req_num, FAILURES[why])
        self._oldest_since = time.monotonic()
        self.scheduler.process_output(
            out.step_id,
            out.req_nums,
            out.token_ids,
            out.time_ns,
            out.draft_matched,
            int(self._worker_counts[BUSY_NS] - busy),
            out.proposals,
        )
        if self.grammars is not None:  # the tokens just applied start the next steps' masks
            self.grammars.flush(then=self._publish_masks)
            self._publish_masks()
        self._cpu.step(out.continues)
        if self.trace is not None:
            self.trace.add(self.config.scheduler_role, "plan", "process_output", out.step_id, t0, time.monotonic_ns())
            self.trace.add_step_cpu(self.config.scheduler_role, out.step_id)

    def _worker_started(self) -> bool:
        """The worker has begun running steps (it beats first then); True where there are no heartbeats."""
        hb = self.heartbeats
        return hb is None or hb.age(self.config.worker_role(0)) is not None

    def _io_proc_hung(self) -> bool:
        """io_proc has stopped reading outputs, so the worker cannot publish: the launcher's watchdog names it."""
        hb = self.heartbeats
        return hb is not None and bool(hb.stale(self.config.observability.step_timeout_s, ["io_proc"]))

    def _stats(self, nonce: int) -> Stats:
        s = self.scheduler
        return Stats(
            nonce=nonce,
            num_running=len(s.running),
            num_waiting=len(s.waiting),
            num_waiting_tokens=sum(r.num_known_tokens for r in s.waiting),
            num_free_blocks=s.pool.num_free_blocks,
            num_total_blocks=s.pool.num_blocks,
            num_free_req_indices=s.pool.num_free_req_indices,
            num_total_req_indices=s.pool.num_req_indices,
            num_steps=s.next_step_id,
            num_preemptions=s.num_preemptions,
            num_grammar_rows_deferred=s.num_grammar_rows_deferred,
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
            num_kv_events_dropped=self.kv_events.num_dropped_events if self.kv_events is not None else 0,
            lora_running=s.adapters_of(s.running),
            lora_waiting=s.adapters_of(s.waiting),
            **self._spec_stats(),
        )

    def _spec_stats(self) -> dict:
        """The Stats fields of speculative decoding (none without it)."""
        if self.scheduler.drafts is None:
            return {}
        self.scheduler.observe_outputs()  # the newest output's too
        st = self.scheduler.drafts.stats
        return dict(
            spec_decode_num_drafts=st.num_drafts,
            spec_decode_num_draft_tokens=st.num_draft_tokens,
            spec_decode_num_accepted_tokens=st.num_accepted_tokens,
            spec_decode_num_accepted_tokens_per_pos=st.accepted_per_pos.tolist(),
        )


def run_scheduler(config: EngineConfig, status_conn, stop: StopFlag) -> int:
    """Process body of scheduler_proc (see ``pipeline.child``): serve until ``stop``; returns the exit status."""
    # Before any thread starts: the grammar threads' matchers (tens of MB each) then come back after
    # a burst; in arenas of their own, 10-20 MB stayed pinned (docs/design.md, "Memory after a burst").
    limit_arenas(2)
    role = config.scheduler_role
    desc_ring = config.descriptor_ring()
    mask_ring = config.mask_ring()
    out_ring = config.output_ring()
    heartbeats = config.heartbeats()
    report(status_conn, "attached", role)
    ctx = zmq.Context()
    control = ctx.socket(zmq.PULL)
    control.bind(config.control_address)
    replies = ctx.socket(zmq.PUSH)
    replies.connect(config.reply_address)
    try:
        loop = SchedulerProc(config, desc_ring, out_ring, control, replies, heartbeats, mask_ring)
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
        if loop.grammars is not None:
            loop.grammars.close()
        if loop.kv_events is not None:
            loop.kv_events.close()
        ctx.destroy(linger=0)
        desc_ring.close()
        if mask_ring is not None:
            mask_ring.close()
        out_ring.close()
        heartbeats.close()
    return 0
