"""Continuous-batching step planner with asynchronous scheduling.

The scheduler plans step N+1 while step N runs, assuming every decoding
request produces exactly one token in N. That token is not known yet, so
N+1's input for it is :data:`PLACEHOLDER_TOKEN_ID`, which the worker resolves
on the device from its token-id cache (docs/design.md, "The step protocol").
Planning uses plain Python and numpy: no torch, no model code.

Running requests that plainly decode (one token a step, no grammar) are
*steady rows*: their counters live in per-req_index numpy arrays and each step
plans them all at once, so per-request Python work is left for the rows that
change (a join, a prefill chunk, a finish, a new block); the rows' own
counters are brought up to date only when they leave (docs/design.md, "The
scheduler").

Policy (as vLLM v1's scheduler): running requests first, in arrival order,
one token per decode and a chunk per unfinished prefill, then waiting
requests in FIFO order, all under ``max_num_batched_tokens`` and
``max_num_seqs``. KV blocks are allocated on demand; when none are left the
newest running request is preempted (recompute: its blocks are freed and it
restarts from its prompt plus the tokens it has produced).

Planning, the steady rows and applying outputs share every request's
counters, so they stay in one module, longer than most.
"""

from __future__ import annotations

import logging
import time
from array import array
from collections import deque

import numpy as np
from msgspec.structs import replace

from pipeline.common.constants import cdiv
from pipeline.common.grammar import GrammarState
from pipeline.common.histogram import ITERATION_TOKENS_BUCKETS, REQUEST_LATENCY_BUCKETS, Histogram
from pipeline.common.lazy_grammar import TriggeredGrammarState
from pipeline.common.messages import AddRequest, SamplingParams, check_finish, choice_seed
from pipeline.common.step_protocol import (
    MAX_MASKED_ROWS,
    PLACEHOLDER_TOKEN_ID,
    DescriptorBuilder,
    StepDescriptor,
    max_new_blocks_per_step,
)
from pipeline.scheduler_proc.kv_block_pool import BlockPool
from pipeline.scheduler_proc.prefix_cache import PrefixCache, num_final_tokens

log = logging.getLogger(__name__)

# Steps a steady row's tokens wait in the scheduler's per-req_index buffer before
# joining its request's list (int32: 512 KiB at 1024 rows).
_TOKEN_BUFFER = 128


class Request:
    """Scheduler-side state of one request.

    ``num_computed_tokens`` counts tokens already placed in a step (in flight
    included); ``num_placeholders`` counts tokens sampled in steps whose
    output has not arrived (0 or 1). ``block_hashes`` names its prompt's
    full blocks and those of its final tokens so far; its first
    ``num_named_blocks`` blocks carry their names in the pool
    (docs/design.md, "Prefix caching"). ``grammar`` is the matcher of a
    structured-output request (None for others); it has consumed every token
    of ``output_token_ids``. ``queued_ns``, ``scheduled_ns`` (first
    admission; 0 before) and ``first_token_ns`` (0 before) are vLLM's request
    events on ``time.monotonic_ns()`` (docs/design.md, "Metrics").
    """

    __slots__ = (
        "req_num",
        "prompt_token_ids",
        "output_token_ids",
        "params",
        "num_computed_tokens",
        "num_placeholders",
        "req_index",
        "block_ids",
        "last_step_id",
        "is_new",
        "block_hashes",
        "num_named_blocks",
        "grammar",
        "queued_ns",
        "scheduled_ns",
        "first_token_ns",
    )

    def __init__(
        self, req_num: int, prompt_token_ids: list[int], params: SamplingParams, grammar: GrammarState | None = None
    ):
        self.req_num = req_num
        self.prompt_token_ids = prompt_token_ids
        # int32 ids: a request that ends frees one buffer, not an object per token (at batch 1024 a few
        # dozen requests of hundreds of tokens can end in one step).
        self.output_token_ids = array("i")
        self.params = params
        self.num_computed_tokens = 0
        self.num_placeholders = 0
        self.req_index = -1
        self.block_ids: list[int] = []
        self.last_step_id = -1
        self.is_new = True
        self.block_hashes: list[bytes] = []
        self.num_named_blocks = 0
        self.grammar = grammar
        self.queued_ns = time.monotonic_ns()
        self.scheduled_ns = 0
        self.first_token_ns = 0

    @property
    def num_known_tokens(self) -> int:
        """Prompt plus output tokens whose ids the scheduler has."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_outputs_planned(self) -> int:
        """Output tokens received plus those sampled in steps in flight."""
        return len(self.output_token_ids) + self.num_placeholders

    def token_at(self, pos: int) -> int:
        """Token id at position ``pos``, or the placeholder if not yet known."""
        p = len(self.prompt_token_ids)
        if pos < p:
            return self.prompt_token_ids[pos]
        if pos - p < len(self.output_token_ids):
            return self.output_token_ids[pos - p]
        return PLACEHOLDER_TOKEN_ID


class Scheduler:
    """Plans steps into StepDescriptor views and applies StepOutputs.

    Args:
        max_num_seqs: requests per step at most; also the number of req_indices.
        max_num_batched_tokens: tokens per step at most.
        block_size: tokens per KV block.
        num_kv_blocks: KV blocks in the cache.
        max_blocks_per_seq: block-table row width (``ceil(max_model_len / block_size)``).
        grammar_tokenizer: llguidance's tokenizer
            (:func:`~pipeline.common.grammar.load_tokenizer`) for requests
            with a grammar; None when the model has none (the simulated device).
        mask_words: int32 words of one token bitmask (``ceil(vocab / 32)``).
        enable_prefix_caching: reuse the blocks of cached prefixes.
        block_hash_root: the parent name of a first block (``EngineConfig.block_hash_root``).

    Raises:
        ValueError: if one request of ``max_model_len`` tokens could not fit.
    """

    def __init__(
        self,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        block_size: int,
        num_kv_blocks: int,
        max_blocks_per_seq: int,
        grammar_tokenizer=None,
        mask_words: int = 0,
        enable_prefix_caching: bool = True,
        block_hash_root: bytes = b"",
    ):
        if num_kv_blocks < max_blocks_per_seq:
            raise ValueError(
                f"num_kv_blocks={num_kv_blocks} cannot hold one request of max_model_len "
                f"({max_blocks_per_seq} blocks); raise the KV cache size or lower --max-model-len"
            )
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.block_size = block_size
        self.pool = BlockPool(num_kv_blocks, max_num_seqs, enable_prefix_caching)
        self.prefix = PrefixCache(self.pool, block_size, block_hash_root)
        self.num_cached_tokens_step = 0  # prompt tokens found cached by the requests admitted in the last step
        self.requests: dict[int, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.next_step_id = 0
        self.num_preemptions = 0
        self.num_steady_steps = 0  # steps that planned steady rows
        # (req_num, prompt tokens found cached) of first admissions since the caller last emptied it.
        self.admitted: list[tuple[int, int]] = []
        # vLLM's request phases, seconds, observed as requests finish; tokens per step.
        self.queue_time, self.prefill_time, self.decode_time, self.inference_time = (
            Histogram(REQUEST_LATENCY_BUCKETS) for _ in range(4)
        )
        self.iteration_tokens = Histogram(ITERATION_TOKENS_BUCKETS)
        self._output_ns = 0  # time_ns of the output being applied
        self._builder = DescriptorBuilder()
        self._grammar_tokenizer, self._mask_words = grammar_tokenizer, mask_words
        self._max_new_blocks = max_new_blocks_per_step(max_num_seqs, max_num_batched_tokens, block_size)
        self._last_output_step = -1
        self._finish_after: dict[int, list[Request]] = {}  # step id -> requests that end when it completes
        # Steady rows, by req_index: `_steady_indices` lists them in the order they
        # joined. For a steady row, `_pos` (its true num_computed_tokens),
        # `_remaining` (tokens it may still plan), `_unapplied` (tokens planned
        # since it joined, not yet added to its num_placeholders) and `_last`
        # (its true last_step_id) are current and the Request's own fields
        # are not; `_apply_steady` applies them. `_others` is
        # every other running request, in running order.
        # `_unapplied` also counts down as the row's tokens arrive; `_left` is
        # the tokens it may still receive before `max_tokens` ends it,
        # `_stop` its stop token ids (-1 padded; none with ignore_eos),
        # `_last_token` its latest token, and `_req_num` its request number
        # (-1 once the req_index holds no steady row). Its newest tokens wait in
        # `_tokens[req_index, :_num_tokens[req_index]]`, which is moved to the request's
        # own list every _TOKEN_BUFFER steps and when it leaves: appending to
        # a thousand lists a step costs more than the rest of the step.
        self._steady_req: list[Request | None] = [None] * max_num_seqs
        self._steady_indices = np.zeros(0, np.int64)
        (
            self._pos,
            self._remaining,
            self._unapplied,
            self._last,
            self._admitted,
            self._left,
            self._last_token,
            self._num_tokens,
        ) = (np.zeros(max_num_seqs, np.int64) for _ in range(8))
        self._req_num = np.full(max_num_seqs, -1, np.int64)
        self._stop = np.full((max_num_seqs, 1), -1, np.int64)
        self._tokens = np.zeros((max_num_seqs, _TOKEN_BUFFER), np.int32)
        # Step id -> its steady rows, which lead its output: (req_indices, request numbers as an array and a list).
        self._steady_planned: dict[int, tuple[np.ndarray, np.ndarray, list[int]]] = {}
        self._others: list[Request] = []
        self._num_admitted = 0  # admissions so far: `_admitted[req_index]` orders running requests

    # -- control ----------------------------------------------------------------

    def add_request(self, msg: AddRequest) -> None:
        """Queue a new request. A repeated ``req_num`` is ignored.

        With ``msg.n`` > 1 its choices are the requests ``req_num + i``, each
        seeded :func:`~pipeline.common.messages.choice_seed` ``(seed, i)``;
        they share the prompt through the prefix cache: the first computes
        it, and the others, admitted behind it, find its blocks
        (docs/design.md, "Parallel choices").
        """
        if msg.req_num in self.requests:
            return
        prompt = list(msg.prompt_token_ids)
        for i in range(msg.n):
            params = msg.params if msg.n == 1 else replace(msg.params, seed=choice_seed(msg.params.seed, i))
            req = Request(msg.req_num + i, prompt, params, self._new_grammar(params))
            if i == 0:
                self.prefix.name_prompt(req)
            else:
                req.block_hashes = list(self.waiting[-1].block_hashes)
            self.requests[req.req_num] = req
            self.waiting.append(req)

    def _new_grammar(self, params: SamplingParams) -> GrammarState | TriggeredGrammarState | None:
        """A fresh matcher for a request with a grammar (about 1 ms: llguidance compiles lazily), else None."""
        if not params.grammar:
            return None
        if self._grammar_tokenizer is None:
            raise ValueError("structured output needs a model with a tokenizer")
        state = GrammarState(self._grammar_tokenizer, params.grammar, params.stop_token_ids)
        if params.grammar_trigger:
            return TriggeredGrammarState(
                state, self._grammar_tokenizer, params.grammar_trigger, params.grammar_trigger_at_start
            )
        return state

    def abort_request(self, req_num: int, finished_ns: int = 0) -> None:
        """Drop a request now; its blocks and req_index return after its last step in flight.

        ``finished_ns`` > 0 means the request finished then (a stop string),
        and its phases are observed.
        """
        req = self.requests.get(req_num)
        if req is None:
            return
        if finished_ns:
            self._observe_finish(req, finished_ns)
        self._remove(req)

    @property
    def num_unfinished(self) -> int:
        return len(self.requests)

    def shrink(self) -> None:
        """After a burst: rebuild the request table, which never gives back the room its peak took."""
        self.requests = dict(self.requests)

    # -- planning ---------------------------------------------------------------

    def schedule(self, desc: StepDescriptor) -> int:
        """Plan the next step into the descriptor ring entry ``desc``.

        Returns:
            The number of requests planned; 0 means nothing could run now
            and ``desc`` holds no step (the step id is not consumed).
        """
        step_id = self.next_step_id
        self._builder.clear()
        steady = self._plan_steady()
        budget = self.max_num_batched_tokens - len(steady)
        max_rows = self.max_num_seqs - len(steady)
        rows: list[tuple[Request, int, bool]] = []  # (request, num tokens, samples)
        num_masks = 0  # rows planned that sample under a grammar
        self.num_cached_tokens_step = 0

        for req in list(self._others):
            if budget == 0 or len(rows) == max_rows:
                break
            if req.req_index < 0:  # preempted earlier in this loop
                continue
            if req.num_computed_tokens < req.num_known_tokens:  # unfinished prefill
                n = min(req.num_known_tokens - req.num_computed_tokens, budget)
            elif req.num_outputs_planned < req.params.max_tokens:  # decode
                if req.grammar is not None and req.num_placeholders and req.grammar.needs_mask(req.num_placeholders):
                    continue  # its mask needs the token in flight: it sits out this step alone
                n = 1
            else:  # its last token is in flight; it finishes when that arrives
                continue
            sample = self._samples(req, req.num_computed_tokens + n)
            if sample and req.grammar is not None and req.grammar.needs_mask(req.num_placeholders):
                if num_masks == MAX_MASKED_ROWS:
                    continue
                num_masks += 1
            if not self._grow_blocks(req, n):
                continue
            # Named now, as planned: a request admitted later in this step may start from them.
            self.prefix.name_final(req, min(req.num_known_tokens, req.num_computed_tokens + n))
            rows.append((req, n, sample))
            budget -= n

        continues = len(steady) > 0 or len(rows) > 0
        while self.waiting and budget > 0 and len(rows) < max_rows:
            req = self.waiting[0]
            if req.num_placeholders:
                break  # preempted with a token still in flight: wait for it, keep FIFO order
            if self.pool.num_free_req_indices == 0:
                break
            # It starts after its longest cached prefix, in those blocks (found in this step too).
            hit = self.prefix.lookup(req)
            room = self._max_new_blocks - self._builder.num_blocks  # block-table entries the step can still set
            if cdiv(req.num_known_tokens, self.block_size) > room:  # its row must fit them, whatever the chunk
                hit = hit[: max(0, room - cdiv(budget, self.block_size))]
            start = len(hit) * self.block_size
            n = min(req.num_known_tokens - start, budget)
            masked = req.grammar is not None and self._samples(req, start + n) and req.grammar.needs_mask(0)
            if masked and num_masks == MAX_MASKED_ROWS:
                break
            need = cdiv(start + n, self.block_size) - len(hit)
            if (
                need + self.pool.count_unowned(hit) > self.pool.num_free_blocks
                or self._builder.num_blocks + len(hit) + need > self._max_new_blocks
            ):
                break
            self.waiting.popleft()
            self.pool.share(hit)  # before _grow_blocks allocates: an unowned hit could be evicted
            self.prefix.count(req, hit)
            if req.last_step_id < 0:  # its first admission (a preempted request has run)
                self.admitted.append((req.req_num, start))
            self.num_cached_tokens_step += start
            req.block_ids, req.num_named_blocks, req.num_computed_tokens = list(hit), len(hit), start
            if not req.scheduled_ns:  # the first admission; a preempted request keeps it, as in vLLM
                req.scheduled_ns = time.monotonic_ns()
            req.req_index = self.pool.allocate_req_index()
            req.is_new = True
            self._admitted[req.req_index] = self._num_admitted
            self._num_admitted += 1
            for i, b in enumerate(hit):  # the new req_index's block-table row
                self._builder.add_block(req.req_index, i, b)
            self._grow_blocks(req, n)
            self.prefix.name_final(req, min(req.num_known_tokens, start + n))
            self.running.append(req)
            self._others.append(req)
            rows.append((req, n, self._samples(req, start + n)))
            num_masks += masked
            budget -= n

        if not rows and not len(steady):
            return 0
        self._write(desc, step_id, rows, steady, continues)
        self.iteration_tokens.observe(len(steady) + sum(k for _, k, _ in rows))
        self.next_step_id += 1
        return len(rows) + len(steady)

    @staticmethod
    def _samples(req: Request, end: int) -> bool:
        """Whether a row of ``req`` that computes up to position ``end`` samples a token.

        Only the chunk that reaches the last known token samples, and a request
        with ``max_tokens`` 0 (prompt log-probabilities only) never does.
        """
        return end >= req.num_known_tokens and req.params.max_tokens > 0

    def _plan_steady(self) -> np.ndarray:
        """Req indices (int64 ``[D]``) of the steady rows that decode in the step being planned.

        Allocates the blocks of those that cross into a new one. A steady row
        that has planned its last token sits out. Planning the steady rows
        before the others must give the step the general path would: so when
        the token budget might not reach every row and some other running
        request precedes a steady row, or when blocks might run short (the
        general path would make rows wait or preempt), every steady row goes
        back to the general path first and none is returned.
        """
        req_indices = self._steady_indices
        if not len(req_indices):
            return req_indices
        active = req_indices[self._remaining[req_indices] > 0]
        crossing = active[self._pos[active] % self.block_size == 0]
        tokens = blocks = 0  # at most what the other running requests take
        for req in self._others:
            n = max(1, req.num_known_tokens - req.num_computed_tokens)
            tokens += n
            blocks += max(0, cdiv(req.num_computed_tokens + n, self.block_size) - len(req.block_ids))
        others_after = (
            not self._others
            or not len(active)
            or self._admitted[self._others[0].req_index] > self._admitted[active].max()
        )
        # Every active row was planned in the previous step, so they fit the budget by themselves.
        if len(crossing) + blocks > self.pool.num_free_blocks or (
            len(active) + tokens > self.max_num_batched_tokens and not others_after
        ):
            self._leave_steady()
            return self._steady_indices
        if len(crossing):
            new = self.pool.allocate_blocks(len(crossing))
            self._builder.add_blocks(crossing, self._pos[crossing] // self.block_size, np.asarray(new))
            for s, b in zip(crossing.tolist(), new):
                self._steady_req[s].block_ids.append(b)
        return active

    def _join_steady(self, reqs: list[Request]) -> None:
        """``reqs`` (running, each just planned one sampled decode token, no grammar) become steady rows."""
        req_indices = np.fromiter((r.req_index for r in reqs), np.int64, len(reqs))
        for r in reqs:
            self._steady_req[r.req_index] = r
        self._req_num[req_indices] = [r.req_num for r in reqs]
        self._pos[req_indices] = [r.num_computed_tokens for r in reqs]
        self._remaining[req_indices] = [r.params.max_tokens - r.num_outputs_planned for r in reqs]
        self._unapplied[req_indices] = 0
        self._num_tokens[req_indices] = 0
        self._last[req_indices] = [r.last_step_id for r in reqs]
        self._left[req_indices] = [r.params.max_tokens - len(r.output_token_ids) for r in reqs]
        for r in reqs:
            stop = () if r.params.ignore_eos else r.params.stop_token_ids
            if len(stop) > self._stop.shape[1]:
                self._stop = np.pad(self._stop, ((0, 0), (0, len(stop) - self._stop.shape[1])), constant_values=-1)
            self._stop[r.req_index] = -1
            self._stop[r.req_index, : len(stop)] = stop
        self._steady_indices = np.concatenate([self._steady_indices, req_indices])
        self._others = [r for r in self._others if self._steady_req[r.req_index] is not r]

    def _apply_steady(self, req_index: int) -> None:
        """Bring the steady row in ``req_index`` up to date and make it an ordinary running request."""
        req = self._steady_req[req_index]
        self._move_tokens(req_index)
        req.num_computed_tokens = int(self._pos[req_index])
        req.num_placeholders += int(self._unapplied[req_index])
        req.last_step_id = int(self._last[req_index])
        self._steady_req[req_index] = None
        self._req_num[req_index] = -1
        # Its blocks filled while steady are named only now: naming as its tokens arrive would cost
        # a hash a block in the steps of every row, and nothing can reuse them while it runs.
        self.prefix.name_final(req, num_final_tokens(req))

    def _leave_steady(self) -> None:
        """Every steady row goes back to the general path (``_others``, in running order)."""
        for s in self._steady_indices.tolist():
            self._apply_steady(s)
        self._steady_indices = self._steady_indices[:0]
        self._others = list(self.running)

    def _grow_blocks(self, req: Request, n: int) -> bool:
        """Give ``req`` blocks for its next ``n`` tokens, preempting if needed.

        Returns False if ``req`` cannot run this step (it may have been preempted).
        """
        need = cdiv(req.num_computed_tokens + n, self.block_size) - len(req.block_ids)
        while need > self.pool.num_free_blocks:
            if self.pool.num_free_blocks + self.pool.num_deferred_blocks >= need:
                return False  # blocks come back when the step in flight completes
            victim = self.running[-1]
            self._preempt(victim)
            if victim is req:
                return False
        if need > 0:
            start = len(req.block_ids)
            blocks = self.pool.allocate_blocks(need)
            req.block_ids.extend(blocks)
            for i, b in enumerate(blocks):
                self._builder.add_block(req.req_index, start + i, b)
        return True

    def _write(
        self,
        desc: StepDescriptor,
        step_id: int,
        rows: list[tuple[Request, int, bool]],
        steady: np.ndarray,
        continues: bool,
    ) -> None:
        """Write the step: the ``steady`` rows' decodes (req_indices, int64 ``[D]``), then ``rows``; update counters.

        ``continues``: some row's request was running before (the descriptor's flag).
        """
        b = self._builder
        for req, k, sample in rows:
            pos = req.num_computed_tokens
            if k == 1:
                tokens = [req.token_at(pos)]
            else:  # a prefill chunk: every id is known
                known = (
                    req.prompt_token_ids + req.output_token_ids.tolist()
                    if pos + k > len(req.prompt_token_ids)
                    else req.prompt_token_ids
                )
                tokens = known[pos : pos + k]
            num_plp, next_token = 0, -1
            if req.params.prompt_logprobs >= 0:  # positions pos..pos+num_plp-1 predict prompt tokens
                num_plp = max(0, min(k, len(req.prompt_token_ids) - 1 - pos))
                if num_plp == k:
                    next_token = req.prompt_token_ids[pos + k]
            mask = None
            if sample and req.grammar is not None and req.grammar.needs_mask(req.num_placeholders):
                mask = np.empty(self._mask_words, np.int32)
                req.grammar.fill_mask(mask)
            b.add_row(
                req.req_num,
                req.req_index,
                pos,
                tokens,
                sample,
                req.params if req.is_new else None,
                num_plp,
                next_token,
                len(req.prompt_token_ids),
                mask,
            )
            req.is_new = False
            if req.params.max_tokens == 0 and pos + k >= req.num_known_tokens:
                # Its last prompt log-probabilities come with this step's output: it ends then.
                self._finish_after.setdefault(step_id, []).append(req)
            req.num_computed_tokens = pos + k
            req.last_step_id = step_id
            if sample:
                req.num_placeholders += 1
        decode = None
        if len(steady):
            pos = self._pos[steady]
            if self._last_output_step == step_id - 1:  # lock step: every row's input token is known
                tokens = self._last_token[steady]
            else:  # the previous step's tokens are on the device only
                tokens = np.full(len(steady), PLACEHOLDER_TOKEN_ID, np.int64)
            nums = self._req_num[steady]
            decode = (nums, steady, pos, tokens)
            self._steady_planned[step_id] = (steady, nums, nums.tolist())
            self._pos[steady] = pos + 1
            self._remaining[steady] -= 1
            self._unapplied[steady] += 1
            self._last[steady] = step_id
            self.num_steady_steps += 1
        b.write(desc, step_id, decode, continues)
        # Grammar rows need their own token back before each step, which steady rows cannot wait for.
        joining = [req for req, k, sample in rows if k == 1 and sample and req.grammar is None]
        if joining:
            self._join_steady(joining)

    # -- outputs ----------------------------------------------------------------

    def process_output(self, step_id: int, req_nums: list[int], token_ids: list[int], time_ns: int = 0) -> list[int]:
        """Apply StepOutput ``step_id``: append tokens, finish requests, release frees.

        A token for a request that finished or was aborted is the one wasted
        token of a step already in flight: it is dropped. ``time_ns`` is the
        output's engine timestamp (now if 0), which its tokens get.

        Returns:
            ``req_num`` of the requests that finished (stop token, length, or the
            end of the prefill of a request with ``max_tokens`` 0).

        Raises:
            RuntimeError: if the output's first rows are not the step's steady
                rows in the order planned (the worker writes sampled rows in
                descriptor order).
        """
        finished: list[int] = []
        self._output_ns = time_ns or time.monotonic_ns()
        rest = zip(req_nums, token_ids)
        planned = self._steady_planned.pop(step_id, None)
        if planned is not None:
            d = len(planned[2])
            if req_nums[:d] != planned[2]:
                raise RuntimeError(f"step {step_id}: output rows are not the steady rows planned")
            rest = zip(req_nums[d:], token_ids[d:])
            self._steady_output(*planned, token_ids[:d], finished)
        # Each steady row's buffer is emptied once every _TOKEN_BUFFER steps, never all at once.
        for s in self._steady_indices[(self._steady_indices + step_id) % _TOKEN_BUFFER == 0].tolist():
            self._move_tokens(s)
        for r, t in rest:
            req = self.requests.get(r)
            if req is not None:
                self._apply_token(req, t, finished)
        for req in self._finish_after.pop(step_id, ()):
            if self.requests.get(req.req_num) is req:
                finished.append(req.req_num)
                self._observe_finish(req, self._output_ns)
                self._remove(req)
        self.pool.step_completed(step_id)
        self._last_output_step = step_id
        return finished

    def _apply_token(self, req: Request, t: int, finished: list[int]) -> None:
        """Append ``t`` to ``req`` through its own counters; remove it and list it in ``finished`` if it ends."""
        req.num_placeholders -= 1
        if not req.output_token_ids and not req.first_token_ns:
            req.first_token_ns = self._output_ns
        steady = req.req_index >= 0 and self._steady_req[req.req_index] is req
        if steady:  # a steady row's token from a general row
            self._move_tokens(req.req_index)  # older tokens first
            self._left[req.req_index] -= 1
            self._last_token[req.req_index] = t
        req.output_token_ids.append(t)
        if req.grammar is not None and not req.grammar.accept(t):
            # The worker's mask forbids this; the matcher keeps its state and the request goes on.
            log.error("request %d: token %d is outside its grammar", req.req_num, t)
        if check_finish(t, len(req.output_token_ids), req.params) is not None:
            finished.append(req.req_num)
            self._observe_finish(req, self._output_ns)
            self._remove(req)
        elif not steady:  # a steady row's counters are not current: it names its blocks when it leaves
            self.prefix.name_final(req, num_final_tokens(req))

    def _move_tokens(self, req_index: int) -> None:
        """Append the tokens buffered for the steady row in ``req_index`` to its request's own list."""
        n = self._num_tokens[req_index]
        if n:
            self._steady_req[req_index].output_token_ids.frombytes(self._tokens[req_index, :n].tobytes())
            self._num_tokens[req_index] = 0

    def _steady_output(
        self, req_indices: np.ndarray, nums: np.ndarray, num_list: list[int], tokens: list[int], finished: list[int]
    ) -> None:
        """Apply the tokens of a step's steady rows (``req_indices``, ``nums``: int64 ``[D]``), vectorized.

        A row that has left the steady rows since it was planned goes through
        :meth:`_apply_token`, or is dropped if its request is gone. Requests
        that end are removed and listed in ``finished``.
        """
        kept = self._req_num[req_indices] == nums
        if not kept.all():
            for i in np.flatnonzero(~kept).tolist():
                req = self.requests.get(num_list[i])
                if req is not None:
                    self._apply_token(req, tokens[i], finished)
            idx = np.flatnonzero(kept)
            req_indices, tok, num_list = req_indices[idx], np.asarray(tokens)[idx], [num_list[i] for i in idx.tolist()]
        else:
            tok = np.asarray(tokens)
        self._tokens[req_indices, self._num_tokens[req_indices]] = tok
        self._num_tokens[req_indices] += 1
        self._last_token[req_indices] = tok
        self._unapplied[req_indices] -= 1
        self._left[req_indices] -= 1
        ended = np.flatnonzero((self._left[req_indices] <= 0) | (self._stop[req_indices] == tok[:, None]).any(1))
        if len(ended):
            finished.extend(num_list[i] for i in ended.tolist())
            self._remove_steady(req_indices[ended])

    def _remove_steady(self, req_indices: np.ndarray) -> None:
        """:meth:`_remove` for the steady rows in ``req_indices`` (int64 ``[k]``), with one pass over the running list.

        At batch 1024 a few dozen rows can end in one step; removing them one
        by one would scan the running list once for each.
        """
        if not self.prefix.enabled:  # with caching, its blocks' names do
            self._num_tokens[req_indices] = 0  # nobody reads an ended request's tokens
        for s in req_indices.tolist():
            req = self._steady_req[s]
            self._observe_finish(req, self._output_ns)
            self._apply_steady(s)
            del self.requests[req.req_num]
            # req.req_index, not s: an int made by tolist() would outlive the burst in the free list and keep
            # the allocator page it sits on from being given back.
            self.pool.free_after(req.last_step_id, req.block_ids, req.req_index)
            req.block_ids, req.req_index = [], -1
        self.running = [r for r in self.running if r.req_index >= 0]  # a running request has a req_index
        self._steady_indices = self._steady_indices[self._req_num[self._steady_indices] >= 0]

    def _observe_finish(self, req: Request, end_ns: int) -> None:
        """Observe the phases of ``req``, which finished at ``end_ns`` (vLLM's intervals:
        queued -> first scheduled -> first token -> last token; docs/design.md, "Metrics")."""
        if not req.scheduled_ns:
            return
        first = req.first_token_ns or end_ns  # a prefill-only request (max_tokens 0) ends at its last chunk
        self.queue_time.observe((req.scheduled_ns - req.queued_ns) * 1e-9)
        self.prefill_time.observe((first - req.scheduled_ns) * 1e-9)
        self.decode_time.observe((end_ns - first) * 1e-9)
        self.inference_time.observe((end_ns - req.scheduled_ns) * 1e-9)

    # -- internals --------------------------------------------------------------

    def _remove(self, req: Request) -> None:
        """Drop ``req`` (finished or aborted); its named blocks stay cached."""
        del self.requests[req.req_num]
        if req.req_index >= 0:
            self._leave_running(req)
            self.prefix.name_final(req, num_final_tokens(req))
        else:
            self.waiting.remove(req)
        self.pool.free_after(req.last_step_id, req.block_ids, req.req_index)
        req.block_ids, req.req_index = [], -1

    def _leave_running(self, req: Request) -> None:
        """Take ``req`` (running) out of the running lists, steady or not, its counters up to date."""
        self.running.remove(req)
        if self._steady_req[req.req_index] is req:
            self._apply_steady(req.req_index)
            self._steady_indices = self._steady_indices[self._steady_indices != req.req_index]
        else:
            self._others.remove(req)

    def _preempt(self, req: Request) -> None:
        """Free ``req``'s blocks (its named ones stay cached, for its readmission) and requeue it first."""
        self._leave_running(req)
        self.prefix.name_final(req, num_final_tokens(req))
        self.pool.free_after(req.last_step_id, req.block_ids, req.req_index)
        req.block_ids, req.req_index, req.num_named_blocks = [], -1, 0
        req.num_computed_tokens = 0
        req.is_new = True
        self.waiting.appendleft(req)
        self.num_preemptions += 1
