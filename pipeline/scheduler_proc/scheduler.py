"""Continuous-batching step planner with asynchronous scheduling (docs/design.md, "The scheduler").

Plans step N+1 while N runs, assuming each decode yields one token (a placeholder the worker resolves). Policy as vLLM
v1's: running first, then waiting FIFO from the longest cached prefix; the newest running request is preempted when
blocks run out.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np
from msgspec.structs import replace

from pipeline.common.constants import cdiv
from pipeline.common.descriptor_builder import DescriptorBuilder
from pipeline.common.histogram import ITERATION_TOKENS_BUCKETS, REQUEST_LATENCY_BUCKETS, Histogram
from pipeline.common.messages import AddRequest, choice_seed
from pipeline.common.step_protocol import DRAFT_TOKEN_ID, StepDescriptor
from pipeline.scheduler_proc.drafts import Drafts
from pipeline.scheduler_proc.grammar_manager import GrammarManager
from pipeline.scheduler_proc.grammar_state import COSTLY_MASKS_PER_STEP_S, MASK_SHARE_OF_STEP, GrammarState
from pipeline.scheduler_proc.kv_block_pool import BlockPool
from pipeline.scheduler_proc.kv_event_publisher import KVEventPublisher
from pipeline.scheduler_proc.lora_slots import LoraSlots
from pipeline.scheduler_proc.prefix_cache import PrefixCache, num_final_tokens
from pipeline.scheduler_proc.request import Request
from pipeline.scheduler_proc.scheduler_outputs import SchedulerOutputsMixin
from pipeline.scheduler_proc.steady_rows import SteadyRows
from pipeline.scheduler_proc.step_masks import MaskedRow, StepMasks

_NO_ROWS = np.zeros(0, np.int64)


@dataclass
class _StepPlan:
    """The general rows of the step being planned: ``(request, tokens, samples)``, within what is left."""

    budget: int  # tokens
    max_rows: int
    rows: list[tuple[Request, int, bool]] = field(default_factory=list)
    mask_budget_s: float = COSTLY_MASKS_PER_STEP_S  # for costly masks that the step's sampling may wait for

    @property
    def full(self) -> bool:
        return self.budget == 0 or len(self.rows) == self.max_rows

    def add(self, req: Request, n: int, sample: bool) -> None:
        self.rows.append((req, n, sample))
        self.budget -= n


class Scheduler(SchedulerOutputsMixin):
    """Plans steps into StepDescriptor views and applies StepOutputs.

    ``max_num_seqs`` is also the number of req_indices; ``grammars`` None: no request has a grammar; ``grammar_drafts``
    and ``jump_forward``: docs/design.md, "Jump-forward".

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
        enable_prefix_caching: bool = True,
        block_hash_root: bytes = b"",
        num_speculative_tokens: int = 0,
        adaptive_speculation: bool = True,
        grammars: GrammarManager | None = None,
        grammar_drafts: bool = False,
        jump_forward: bool = False,
        max_loras: int = 0,
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
        # Prefix caching names an ended steady row's blocks from its tokens.
        self.steady = SteadyRows(max_num_seqs, block_size, keep_ended_tokens=enable_prefix_caching)
        self.requests: dict[int, Request] = {}
        self.grammars = grammars
        self.loras = LoraSlots(max_loras) if max_loras else None  # with --enable-lora
        self.masks = StepMasks(self.requests)  # the masks of planned steps' constrained rows, to be written
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order
        self._general: list[Request] = []  # the running requests that are not steady rows, in running order
        self.next_step_id = 0
        self.num_preemptions = 0
        self.num_grammar_rows_deferred = 0  # constrained decode rows left out of a step (costly masks)
        self.num_grammar_requests = 0  # live requests with a grammar
        self.step_device_s = 0.0  # the steps' device time, seconds (a moving average; 0: none measured)
        self.num_cached_tokens_step = 0  # prompt tokens found cached by the requests admitted in the last step
        # (req_num, prompt tokens found cached) of first admissions since the caller last emptied it.
        self.admitted: list[tuple[int, int]] = []
        # vLLM's request phases, seconds, observed as requests finish; tokens per step.
        self.queue_time, self.prefill_time, self.decode_time, self.inference_time = (
            Histogram(REQUEST_LATENCY_BUCKETS) for _ in range(4)
        )
        self.iteration_tokens = Histogram(ITERATION_TOKENS_BUCKETS)
        self._output_ns = 0  # time_ns of the output being applied
        self._output_step = -1  # its step id
        self._builder = DescriptorBuilder()
        self._max_new_blocks = 0  # block-table entries the ring entry being planned holds
        self._last_output_step = -1
        self._finish_after: dict[int, list[Request]] = {}  # step id -> requests that end when it completes
        # Ended requests whose blocks are named after the next step is published (observe_outputs):
        # (req, its final tokens, its blocks, the step whose completion releases them).
        self._unnamed: list[tuple[Request, int, list[int], int]] = []
        self._num_admitted = 0
        self.masks_drafts = grammar_drafts and bool(num_speculative_tokens) and grammars is not None
        spec = (num_speculative_tokens, adaptive_speculation, self.pool, self.steady, self._builder, self._apply_token)
        self.drafts = (
            Drafts(max_num_seqs, *spec, grammar_rows=self.masks_drafts, jump_forward=self.masks_drafts and jump_forward)
            if num_speculative_tokens
            else None
        )

    def set_kv_events(self, events: KVEventPublisher) -> None:
        """Tell ``events`` of every block the prefix cache names or evicts (docs/design.md, "KV-cache events")."""
        self.pool.events = self.prefix.events = events

    @property
    def num_unfinished(self) -> int:
        return len(self.requests)

    @property
    def num_steady_steps(self) -> int:
        """Steps that planned steady rows."""
        return self.steady.num_steps

    # -- control ----------------------------------------------------------------

    def add_request(self, msg: AddRequest, grammars: list[GrammarState] | None = None) -> None:
        """Queue a new request (a repeated ``req_num`` is ignored); ``grammars``: one matcher per choice.

        Choices ``req_num + i`` share the prompt through the prefix cache (docs/design.md, "Parallel choices").
        """
        if msg.req_num in self.requests:
            return
        prompt = list(msg.prompt_token_ids)
        grammars = grammars or [None] * msg.n
        for i in range(msg.n):
            params = msg.params if msg.n == 1 else replace(msg.params, seed=choice_seed(msg.params.seed, i))
            req = Request(msg.req_num + i, prompt, params, grammars[i])
            self.num_grammar_requests += grammars[i] is not None
            if i == 0:
                self.prefix.name_prompt(req)
            else:
                req.block_hashes = list(self.waiting[-1].block_hashes)
            self.requests[req.req_num] = req
            self.waiting.append(req)

    def abort_request(self, req_num: int, finished_ns: int = 0) -> bool:
        """Drop a request now (blocks and req_index return after its last step in flight); False if unknown.

        ``finished_ns`` > 0: it finished then (a stop string), and its phases are observed.
        """
        req = self.requests.get(req_num)
        if req is None:
            return False
        if finished_ns:
            self._observe_finish(req, finished_ns)
        self._remove(req)
        return True

    def shrink(self) -> None:
        """After a burst: rebuild the request table, which never gives back the room its peak took."""
        self.requests = dict(self.requests)
        self.masks.rebind(self.requests)

    # -- planning ---------------------------------------------------------------

    def observe_outputs(self) -> None:
        """Name ended requests' blocks, measure applied outputs and make speculation's next choice; call once a step is
        published, off the output-to-step path."""
        self._name_ended()
        if self.drafts is not None:
            self.drafts.observe()
            self.drafts.prepare()

    def schedule(self, desc: StepDescriptor) -> int:
        """Plan the next step into ``desc``; returns the requests planned (0: no step, the step id is not consumed)."""
        if self.drafts is not None:  # before admission: a request's req_index may be an ended one's
            self.drafts.observe(all_outputs=False)
        if self._unnamed and self.waiting:  # a request about to be admitted may resend an ended one's tokens
            self._name_ended()
        self._builder.clear()
        self._max_new_blocks = len(desc.nb_block)
        self.num_cached_tokens_step = 0
        steady = self._plan_steady()
        step = _StepPlan(
            self.max_num_batched_tokens - len(steady),
            self.max_num_seqs - len(steady),
            mask_budget_s=max(COSTLY_MASKS_PER_STEP_S, MASK_SHARE_OF_STEP * self.step_device_s),
        )
        self._plan_running(step)
        continues = len(steady) > 0 or len(step.rows) > 0  # the device had work of these requests waiting
        self._admit_waiting(step)
        if not step.rows and not len(steady):
            return 0
        step_id = self.next_step_id
        drafts = self.drafts and self.drafts.plan(step_id, steady, step.rows, step.budget, self._max_new_blocks)
        self.iteration_tokens.observe(self._write(desc, step_id, step.rows, steady, continues, drafts))
        self.next_step_id += 1
        return len(step.rows) + len(steady)

    def _plan_steady(self) -> np.ndarray:
        """The steady rows (req_index ``[D]``) that decode this step; none if they must go the general way."""
        if not len(self.steady):
            return _NO_ROWS
        tokens = blocks = 0  # at most what the other running requests take
        for req in self._general:
            n = max(1, req.num_known_tokens - req.num_computed_tokens)
            tokens += n
            blocks += max(0, cdiv(req.num_computed_tokens + n, self.block_size) - len(req.block_ids))
        first = self._general[0].admit_seq if self._general else None
        rows = self.steady.plan(self._builder, self.pool, self.max_num_batched_tokens, tokens, blocks, first)
        if rows is None:
            self._leave_steady()
            return _NO_ROWS
        return rows

    def _plan_running(self, step: _StepPlan) -> None:
        """Running requests, in order: a prefill chunk, or one decode token."""
        for req in list(self._general):
            if step.full:
                break
            if req.req_index < 0:  # preempted earlier in this loop
                continue
            if req.num_computed_tokens < req.num_known_tokens:  # unfinished prefill
                n = min(req.num_known_tokens - req.num_computed_tokens, step.budget)
            elif req.num_outputs_planned < req.params.max_tokens:  # decode (a grammar's mask follows the step)
                n = 1
            else:  # its last token is in flight; it finishes when that arrives
                continue
            sample = req.samples(req.num_computed_tokens + n)
            if sample and req.grammar is not None and self._mask_would_hold(req, step):
                continue
            if not self._grow_blocks(req, n):
                continue
            # Named now, as planned: a request admitted later in this step may start from them.
            self.prefix.name_final(req, min(req.num_known_tokens, req.num_computed_tokens + n))
            step.add(req, n, sample)

    def _mask_would_hold(self, req: Request, step: _StepPlan) -> bool:
        """Whether ``req`` sits out this step: its costly grammar's mask is not ready and would exceed what is left of
        ``step.mask_budget_s`` (docs/design.md, "Structured output")."""
        g, in_flight = req.grammar, req.num_placeholders
        if not g.costly or not g.needs_mask(in_flight) or (g.ready and not in_flight):
            return False
        if g.cost_s <= step.mask_budget_s:  # expected before the step's forward pass ends
            step.mask_budget_s -= g.cost_s
            return False
        self.num_grammar_rows_deferred += 1
        return True

    def _admit_waiting(self, step: _StepPlan) -> None:
        """Waiting requests in FIFO order, each from its longest cached prefix, while a req_index and the
        blocks of its first chunk are free. A request whose LoRA adapter finds no slot waits for one; those
        behind it go ahead."""
        skipped: list[Request] = []
        while self.waiting and not step.full:
            req = self.waiting[0]
            if req.num_placeholders:
                break  # preempted with a token still in flight: wait for it, keep FIFO order
            if self.pool.num_free_req_indices == 0:
                break
            if self.loras is not None and not self.loras.can_admit(req.params.lora_id):
                skipped.append(self.waiting.popleft())
                continue
            # It starts after its longest cached prefix, in those blocks (found in this step too).
            hit = self.prefix.lookup(req)
            room = self._max_new_blocks - self._builder.num_blocks  # block-table entries the step can still set
            if cdiv(req.num_known_tokens, self.block_size) > room:  # its row must fit them, whatever the chunk
                hit = hit[: max(0, room - cdiv(step.budget, self.block_size))]
            start = len(hit) * self.block_size
            n = min(req.num_known_tokens - start, step.budget)
            sample = req.samples(start + n)
            if sample and req.grammar is not None and self._mask_would_hold(req, step):
                break
            need = cdiv(start + n, self.block_size) - len(hit)
            if (
                need + self.pool.count_unowned(hit) > self.pool.num_free_blocks
                or self._builder.num_blocks + len(hit) + need > self._max_new_blocks
            ):
                break
            self.waiting.popleft()
            self._admit(req, hit)
            self._grow_blocks(req, n)
            self.prefix.name_final(req, min(req.num_known_tokens, start + n))
            step.add(req, n, sample)
        self.waiting.extendleft(reversed(skipped))

    def _admit(self, req: Request, hit: list[int]) -> None:
        """``req`` starts running from the cached blocks ``hit``: a req_index, their block-table entries."""
        start = len(hit) * self.block_size
        self.pool.share(hit)  # before _grow_blocks allocates: an unowned hit could be evicted
        self.prefix.count(req, hit)
        if req.last_step_id < 0:  # its first admission (a preempted request has run)
            self.admitted.append((req.req_num, start))
        self.num_cached_tokens_step += start
        req.block_ids, req.num_named_blocks, req.num_computed_tokens = list(hit), len(hit), start
        if not req.scheduled_ns:  # the first admission; a preempted request keeps it, as in vLLM
            req.scheduled_ns = time.monotonic_ns()
        req.req_index = self.pool.allocate_req_index()
        if self.loras is not None:
            req.lora_slot = self.loras.acquire(req.params.lora_id)
        req.is_new = True
        if self.drafts is not None:
            self.drafts.admit(req)
        req.admit_seq = self._num_admitted
        self._num_admitted += 1
        for i, b in enumerate(hit):  # the new req_index's block-table row
            self._builder.add_block(req.req_index, i, b)
        self.running.append(req)
        self._general.append(req)

    def _grow_blocks(self, req: Request, n: int) -> bool:
        """Give ``req`` blocks for its next ``n`` tokens, preempting the newest running request if needed.

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

    def _preempt(self, req: Request) -> None:
        """Recompute: ``req`` gives back its blocks (its named ones stay cached, for its readmission) and req_index, and
        waits first in line."""
        self._leave_running(req)
        self.prefix.name_final(req, num_final_tokens(req))
        self._free(req)
        req.num_named_blocks = 0
        req.num_computed_tokens = 0
        req.is_new = True
        self.waiting.appendleft(req)
        self.num_preemptions += 1

    def _write(
        self,
        desc: StepDescriptor,
        step_id: int,
        rows: list[tuple[Request, int, bool]],
        steady: np.ndarray,
        continues: bool,
        steady_drafts: np.ndarray | None = None,
    ) -> int:
        """Write the step: the ``steady`` rows' decodes (req_index ``[D]``, ``steady_drafts`` ``[D]``), then ``rows``;
        returns its tokens."""
        b = self._builder
        drafted = self.drafts.drafted(step_id) if self.drafts is not None else {}  # req_num -> drafts
        known = self.drafts.known(step_id) if self.drafts is not None else {}  # req_num -> the drafts named
        masked_rows: list[MaskedRow] = []
        for req, k, sample in rows:
            pos = req.num_computed_tokens
            num_drafts = drafted.get(req.req_num, 0)
            masked = sample and req.grammar is not None and req.grammar.needs_mask(req.num_placeholders)
            named = known.get(req.req_num)
            if masked:
                masked_rows.append(MaskedRow(req, req.last_step_id, num_drafts, named))
            params = req.params if req.is_new else None
            b.add_row(
                req.req_num,
                req.req_index,
                pos,
                req.chunk(pos, k) if not num_drafts else req.chunk(pos, 1) + (named or [DRAFT_TOKEN_ID] * num_drafts),
                sample,
                params,
                *req.prompt_logprob_span(pos, k),
                len(req.prompt_token_ids),
                masked,
                num_drafts,
                req.num_rejected,
                (req.lora_slot, req.params.lora_id),
            )
            req.is_new = False
            if req.params.max_tokens == 0 and pos + k >= req.num_known_tokens:
                # Its last prompt log-probabilities come with this step's output: it ends then.
                self._finish_after.setdefault(step_id, []).append(req)
            req.num_computed_tokens = pos + k
            req.last_step_id = step_id
            if sample:
                req.num_placeholders += 1 + num_drafts
        decode = rejected = None
        if len(steady):  # in lock step every row's input token is known
            decode = self.steady.write(step_id, steady, self._last_output_step == step_id - 1, steady_drafts)
            rejected = self.steady.num_rejected(steady) if self.drafts is not None else None
        num_tokens = b.write(desc, step_id, decode, continues, rejected, steady_drafts)
        if masked_rows:
            self.masks.add(step_id, masked_rows)
            if self.masks_drafts:
                self.start_walks()
        # Grammar rows need their own token back before each step, which steady rows cannot wait for.
        joining = [r for r, k, sample in rows if (k == 1 or r.req_num in drafted) and sample and r.grammar is None]
        if joining:
            self._join_steady(joining)
        return num_tokens

    def start_walks(self) -> None:
        """Give the grammar manager the draft walks whose rows' previous outputs are applied (their masks follow the
        advances of those outputs on the mask thread; ``GrammarManager.flush`` starts them)."""
        for row in self.masks.due_walks():
            drafts = row.drafts if row.drafts is not None else row.req.proposed_drafts[: row.num_drafts].tolist()
            self.grammars.walk(row, drafts)

    def _join_steady(self, reqs: list[Request]) -> None:
        self.steady.join(reqs)
        self._general = [r for r in self._general if not self.steady.holds(r)]

    def _leave_steady(self) -> None:
        """Every steady row goes back to the general path (in running order)."""
        for req in self.steady.release_all():
            self._name_released(req)
        self._general = list(self.running)

    def _name_released(self, req: Request) -> None:
        # Blocks filled while steady are named only now: naming as its tokens arrive would cost a hash a
        # block in the steps of every row, and nothing can reuse them while it runs.
        self.prefix.name_final(req, num_final_tokens(req))

    # -- removal ----------------------------------------------------------------

    def _remove(self, req: Request, ended: bool = False) -> None:
        """Drop ``req`` (finished or aborted; ``ended``: it finished in the output being applied); its named blocks stay
        cached."""
        del self.requests[req.req_num]
        if req.grammar is not None:
            self.grammars.release(req.grammar)
            self.num_grammar_requests -= 1
        if req.req_index < 0:
            self.waiting.remove(req)
            self._free(req)
            return
        self._leave_running(req)
        if ended:
            self._free_ended(req)
        else:
            self._name_released(req)
            self._free(req)

    def _leave_running(self, req: Request) -> None:
        """Take ``req`` (running) out of the running lists, steady or not, its counters up to date."""
        self.running.remove(req)
        self._release_lora(req)
        if self.steady.holds(req):
            self.steady.release(req)
        else:
            self._general.remove(req)

    def adapters_of(self, reqs) -> list[int] | None:
        """The LoRA adapter ids of ``reqs``, sorted (None without ``--enable-lora``)."""
        if self.loras is None:
            return None
        return sorted({r.params.lora_id for r in reqs} - {0})

    def _release_lora(self, req: Request) -> None:
        """``req`` leaves the running requests: its adapter slot may go to another adapter."""
        if self.loras is not None:
            self.loras.release(req.lora_slot)
            req.lora_slot = 0

    def _free_ended(self, req: Request) -> None:
        """``_free`` for ``req``, which ended in the output being applied; naming its blocks waits until the next step
        is published (``observe_outputs``) or a request waits to be admitted."""
        step_id = self._output_step
        if not self.prefix.enabled or self.next_step_id <= step_id + 1:
            self._name_released(req)
            self._free(req)
            return
        release = max(req.last_step_id, step_id + 1)
        self._unnamed.append((req, num_final_tokens(req), req.block_ids, release))
        self.pool.free_after(req.last_step_id, [], req.req_index)
        self.pool.free_after(release, req.block_ids, -1)
        req.block_ids, req.req_index = [], -1

    def _name_ended(self, completed: int | None = None) -> None:
        """Name the blocks of the requests ``_free_ended`` left unnamed: all, or those that step ``completed`` releases
        (a block is named while it is owned)."""
        if not self._unnamed:
            return
        later = []
        for entry in self._unnamed:
            req, final, blocks, release = entry
            if completed is None or release <= completed:
                self.prefix.name_final(req, final, blocks)
            else:
                later.append(entry)
        self._unnamed = later

    def _free(self, req: Request) -> None:
        """Give back ``req``'s blocks and req_index after the last step that reads them."""
        self.pool.free_after(req.last_step_id, req.block_ids, req.req_index)
        req.block_ids, req.req_index = [], -1
