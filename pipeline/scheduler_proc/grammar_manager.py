"""Structured output in the scheduler: grammars compiled, matchers advanced and masks computed off its loop
(docs/design.md, "Structured output", "Off the loop", "Memory")."""

from __future__ import annotations

import logging
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial

import llguidance
import llguidance.numpy
import numpy as np

from pipeline.common.lazy_grammar import Trigger
from pipeline.common.memory import heap_in_use, trim_heap
from pipeline.common.messages import AddRequest
from pipeline.common.process import start_background_thread
from pipeline.common.step_protocol import MASK_BITS
from pipeline.scheduler_proc.grammar_state import CompiledGrammar, GrammarState, error_of
from pipeline.scheduler_proc.step_masks import MaskedRow

log = logging.getLogger(__name__)

# Niceness of the background thread: CFS weighs it 110 against 1024 for a normal thread.
_BACKGROUND_NICE = 10
# A compiled grammar nobody uses is dropped this long after its last use.
CACHE_IDLE_S = 10.0
# Compiled grammars kept at most, used or not.
CACHE_ENTRIES = 256
# The heap is trimmed once this much matcher memory was freed since the last trim.
_TRIM_AFTER_BYTES = 16 * 2**20
# How often unused compiled grammars are looked at, freed matchers handed over and the heap trimmed.
_HOUSEKEEP_S = 0.5


@dataclass
class _Pending:
    """A request waiting for its matchers."""

    msg: AddRequest
    aborted: set[int] = field(default_factory=set)  # choices aborted meanwhile
    copies: Future | None = None  # the job making its matchers
    reserved: int = 0  # bytes counted for it before its copies exist


class GrammarManager:
    """Compiles, caches and copies the matchers of the requests with a grammar, and runs their masks.

    Jobs run on a low-priority background thread (compile, copy, costly masks) and a mask thread; the rest on the
    scheduler's. ``failed``: states whose matcher failed on a token, appended by the threads.
    """

    def __init__(
        self,
        tokenizer: llguidance.LLTokenizer,
        vocab_size: int,
        max_request_bytes: int,
        max_total_bytes: int,
        jump_forward: bool = False,
    ):
        self.jump_forward = jump_forward
        self._tokenizer, self._eos = tokenizer, tokenizer.eos_token
        self.mask_words = -(-vocab_size // MASK_BITS)
        self._limits = llguidance.LLParserLimits(verbose_errors=False)  # no request text in messages and logs
        self._max_request, self._max_total = max_request_bytes, max_total_bytes
        self._background = ThreadPoolExecutor(
            1, "grammar-background", start_background_thread, ("grammar", _BACKGROUND_NICE)
        )
        self._masks = ThreadPoolExecutor(1, "grammar-masks", start_background_thread, ("masks",))
        self._cache: OrderedDict[str, CompiledGrammar] = OrderedDict()  # failed compilations too, for a while
        self._compiling: dict[str, Future] = {}
        self._pending: list[_Pending] = []
        # Advances and draft walks for the next flush's job on the mask thread, and the costly advances, each a
        # job of its own on the background thread; the newest advance, which the next token of its run joins.
        self._batch: list[Callable[[], None]] = []
        self._costly: list[tuple[GrammarState, list[int], bytes | None]] = []
        self._last: tuple[GrammarState, list[int], bytes | None] | None = None
        self._last_batch: Future | None = None  # the mask thread runs its jobs in order
        self._dropped: list[object] = []  # matchers to free on the background thread
        self._used = 0  # bytes counted: compiled grammars, copies, reservations
        self._freed = 0  # bytes freed since the last trim
        self._next_housekeep = 0.0
        self.failed: deque[GrammarState] = deque()

    @property
    def num_pending(self) -> int:
        """Requests still waiting for their matchers."""
        return len(self._pending)

    @property
    def used_bytes(self) -> int:
        """Matcher memory counted now: compiled grammars (the cache), copies, reservations."""
        return self._used

    def add(self, msg: AddRequest) -> None:
        """Take a request with a grammar; it comes back from ``poll`` once its matchers exist."""
        self._pending.append(_Pending(msg))

    def abort(self, req_num: int) -> bool:
        """Drop a request (or one of its choices) still waiting here; True if it was."""
        for p in self._pending:
            if p.msg.req_num <= req_num < p.msg.req_num + p.msg.n:  # its choices
                p.aborted.add(req_num)
                return True
        return False

    def poll(self) -> tuple[list[tuple[AddRequest, list[GrammarState], set[int]]], list[tuple[int, str]]]:
        """Move the waiting requests on (cheap, once per loop turn).

        Returns the ready ``(msg, states, choices aborted meanwhile)`` and the refused ``(req_num, why)``.
        """
        ready, refused = [], []
        now = time.monotonic()
        if now >= self._next_housekeep:
            self._next_housekeep = now + _HOUSEKEEP_S
            self._housekeep(now)
        if not (self._pending or self._compiling):
            return ready, refused
        for text, job in list(self._compiling.items()):
            if job.done():
                self._compiled(text, job)
        for p in list(self._pending):
            outcome = self._move(p)
            if outcome is None:
                continue
            self._pending.remove(p)
            if isinstance(outcome, str):
                refused.append((p.msg.req_num, outcome))
            else:
                ready.append((p.msg, outcome, p.aborted))
        return ready, refused

    def _move(self, p: _Pending) -> list[GrammarState] | str | None:
        """One request's next step: its states when ready, why it is refused, or None while it waits."""
        msg, text = p.msg, p.msg.params.grammar
        if len(p.aborted) == msg.n:
            self._unreserve(p)
            return "aborted"
        entry = self._cache.get(text)
        if entry is None:
            if text not in self._compiling:
                if not self._make_room(self._max_request):
                    return None  # waits for memory
                self._used += self._max_request  # the most it may take, until measured
                self._compiling[text] = self._background.submit(self._compile, text)
            return None
        if entry.error:
            return entry.error
        self._cache.move_to_end(text)
        entry.last_used = time.monotonic()
        per_choice = entry.copy_nbytes * (2 if msg.params.grammar_trigger else 1)  # pristine and matcher
        if p.copies is None:
            cost = entry.nbytes + msg.n * per_choice
            if cost > self._max_request:
                return (
                    f"the grammar takes {cost / 2**20:.1f} MiB of matcher memory for {msg.n} choice(s), more than "
                    f"--max-grammar-memory-per-request ({self._max_request / 2**20:g} MiB): simplify it"
                )
            entry.users += 1  # it stays cached while its copies are made
            if not self._make_room(msg.n * per_choice):
                entry.users -= 1
                return None
            p.reserved = msg.n * per_choice
            self._used += p.reserved
            if msg.params.grammar_trigger:  # its tables are built once per trigger: off this loop too
                self._background.submit(self._new_trigger, msg)
            p.copies = self._background.submit(_copies, entry.template, msg.n)
            return None
        if not p.copies.done():
            return None
        try:
            matchers = p.copies.result()
        except Exception as e:
            self._unreserve(p)
            return f"the grammar's matchers could not be made: {type(e).__name__}: {e}"
        p.reserved = 0  # the states carry it now
        entry.users += msg.n - 1
        stop = msg.params.stop_token_ids
        return [
            GrammarState(
                self._tokenizer,
                entry,
                m,
                msg.req_num + i,
                stop,
                self._new_trigger(msg) if msg.params.grammar_trigger else None,
                self.jump_forward,
            )
            for i, m in enumerate(matchers)
        ]

    def _new_trigger(self, msg: AddRequest) -> Trigger:
        return Trigger(self._tokenizer, msg.params.grammar_trigger, msg.params.grammar_trigger_at_start)

    def _compiled(self, text: str, job: Future) -> None:
        """A compilation has finished: into the cache, with what it measured (a failure too, for a while)."""
        del self._compiling[text]
        self._used -= self._max_request
        try:
            entry = job.result()
        except Exception as e:  # not the grammar's fault: llguidance itself failed
            entry = CompiledGrammar(None, None, False, 0, 0, 0.0, error=f"the grammar could not be compiled: {e}")
        self._used += entry.nbytes
        self._cache[text] = entry

    def _unreserve(self, p: _Pending) -> None:
        if p.reserved:
            self._used -= p.reserved
            p.reserved = 0
            self._cache[p.msg.params.grammar].users -= 1

    def _make_room(self, nbytes: int) -> bool:
        """Whether ``nbytes`` more fit the total, after dropping unused compiled grammars, oldest first."""
        for text, entry in list(self._cache.items()):
            if self._used + nbytes <= self._max_total:
                break
            if not entry.users:
                self._evict(text)
        return self._used + nbytes <= self._max_total

    def _evict(self, text: str) -> None:
        entry = self._cache.pop(text)
        self._used -= entry.nbytes
        self._freed += entry.nbytes
        if entry.template is not None:  # live states still name their entry, not its matcher
            self._dropped.append(entry.template)
            entry.template = None

    def _housekeep(self, now: float) -> None:
        """Drop compiled grammars unused for ``CACHE_IDLE_S`` or past ``CACHE_ENTRIES``; free and trim."""
        for text, entry in list(self._cache.items()):
            if not entry.users and (now - entry.last_used > CACHE_IDLE_S or len(self._cache) > CACHE_ENTRIES):
                self._evict(text)
        if self._dropped:
            dropped, self._dropped = self._dropped, []
            self._background.submit(dropped.clear)  # the last references go on that thread, and their frees
        if self._freed >= _TRIM_AFTER_BYTES:
            self._freed = 0
            self._background.submit(trim_heap)

    def release(self, state: GrammarState) -> None:
        """``state``'s request has ended: its copy is freed and its compiled grammar may expire."""
        entry = state._entry
        entry.users -= 1
        entry.last_used = time.monotonic()
        self._used -= state._nbytes
        self._freed += state._nbytes
        self._dropped += state.take_matchers()

    def advance(self, state: GrammarState, token_id: int, awaited: bool = False) -> None:
        """``state``'s request output ``token_id``: the next ``flush`` advances its matcher and computes the next mask
        (``state.ready`` False until then; failures go to ``failed``). ``awaited`` or cheap masks go to the mask thread.
        """
        job, tail, dropped = state.follow(token_id)
        if dropped is not None:
            self._dropped.append(dropped)
        if not job:
            return
        state.ready = False
        last = self._last
        if last is not None and last[0] is state and tail is None and last[2] is None:
            last[1].append(token_id)  # the run goes on
            return
        self._last = advance = (state, [token_id], tail)
        if awaited or not state.costly:
            self._batch.append(partial(self._compute, *advance))
        else:
            state.on_background = True
            self._costly.append(advance)

    def walk(self, row: MaskedRow, drafts: list[int]) -> None:
        """``row`` verifies ``drafts``: one mask per sampled position goes in the next ``flush``'s job; ``row.masks`` is
        set when they exist."""
        self._last = None
        self._batch.append(partial(self._walk, row, drafts))

    def flush(self, then: Callable[[], object] | None = None) -> None:
        """Start the advances and walks submitted since the last flush: paced ones as one mask-thread job, then
        ``then``; costly ones a job each on the background thread."""
        self._last = None
        for advance in self._costly:
            self._background.submit(self._compute, *advance)
        self._costly.clear()
        if self._batch:
            batch, self._batch = self._batch, []
            self._last_batch = self._masks.submit(self._compute_all, batch, then)

    def wait_masks(self, timeout: float | None = None) -> None:
        """Flush, and wait until the mask thread's jobs are done, or ``timeout`` seconds have passed."""
        self.flush()
        if self._last_batch is not None:
            try:
                self._last_batch.result(timeout)
            except TimeoutError:
                pass

    def _compile(self, text: str) -> CompiledGrammar:  # on the background thread, one at a time
        """Compile ``text`` and compute its first mask, measuring the heap both take."""
        before = heap_in_use()
        m = llguidance.LLMatcher(self._tokenizer, text, log_level=0, limits=self._limits)
        mask = np.zeros(self.mask_words, np.int32)
        if m.is_error():
            return CompiledGrammar(None, None, False, 0, 0, 0.0, error=f"the grammar cannot be used: {error_of(m)}")
        llguidance.numpy.fill_next_token_bitmask(m, mask.reshape(1, -1), 0)
        if m.is_error():  # a schema that only refers to itself ({"$ref": "#"}) has nothing to produce
            why = f"it allows no output at all ({error_of(m)}); does it only refer to itself?"
            return CompiledGrammar(None, None, False, 0, 0, 0.0, error=f"the grammar cannot be used: {why}")
        after = heap_in_use()
        copy = m.deep_copy()
        copy_nbytes = max(0, (heap_in_use() or 0) - (after or 0))
        mask_s = _later_mask_s(copy, mask, self._eos)
        del copy
        nbytes = max(0, after - before) if before is not None else len(text) * 100
        ends = m.is_accepting() or m.is_stopped()
        return CompiledGrammar(m, mask, ends, nbytes, copy_nbytes, mask_s, tuple(m.compute_ff_tokens()))

    def _compute(self, state: GrammarState, token_ids: list[int], tail: bytes | None) -> None:
        # on a grammar thread
        try:
            state.compute(token_ids, tail)
        except Exception as e:  # one request's matcher must not take the thread (and everyone's masks) down
            log.exception("request %d: grammar advance failed", state.req_num)
            state.error = f"the grammar failed: {type(e).__name__}: {e}"
        state.on_background = False
        if state.error:
            self.failed.append(state)

    def _walk(self, row: MaskedRow, drafts: list[int]) -> None:  # on the mask thread
        state = row.req.grammar
        try:
            masks = state.walk(drafts)
        except Exception as e:  # as _compute
            log.exception("request %d: grammar draft walk failed", state.req_num)
            state.error = f"the grammar failed: {type(e).__name__}: {e}"
        if state.error:
            self.failed.append(state)
        else:
            row.masks = masks

    def _compute_all(self, batch: list[Callable[[], None]], then: Callable[[], object] | None) -> None:
        # on the mask thread
        for job in batch:
            job()
        if then is not None:
            try:
                then()
            except Exception:  # the scheduler's loop publishes them instead
                log.exception("publishing the masks of a step failed")

    def close(self) -> None:
        """Stop the threads (jobs in flight are dropped)."""
        self._background.shutdown(wait=False, cancel_futures=True)
        self._masks.shutdown(wait=False, cancel_futures=True)


def _later_mask_s(m: llguidance.LLMatcher, first: np.ndarray, eos: int, tokens: int = 4) -> float:
    """A row's expected mask CPU seconds before its own are measured: the least along ``tokens`` tokens; 0 if none
    allowed. Advances ``m``."""
    least, mask = float("inf"), first.copy()
    for _ in range(tokens):
        ids = np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little"))
        ids = ids[ids != eos]
        if not len(ids) or not m.consume_token(int(ids[0])):
            break
        t0 = time.thread_time()
        llguidance.numpy.fill_next_token_bitmask(m, mask.reshape(1, -1), 0)
        least = min(least, time.thread_time() - t0)
    return 0.0 if least == float("inf") else least


def _copies(template: llguidance.LLMatcher, n: int) -> list[llguidance.LLMatcher]:
    return [template.deep_copy() for _ in range(n)]
