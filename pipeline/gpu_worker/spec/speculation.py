"""Speculative decoding in the worker: drafts in, verification's bookkeeping on the device, drafts out (docs/design.md,
"Speculative decoding"); rows are moved back on the device by rejections the scheduler did not know (``shift``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from pipeline.common.config import EngineConfig
from pipeline.common.step_output import TokenLogprobs
from pipeline.common.step_protocol import DRAFT_TOKEN_ID, MAX_INFLIGHT_STEPS, StepInputs
from pipeline.gpu_worker.attention.backend import AttentionMetadata, StepLayout, slot_mapping
from pipeline.gpu_worker.device import Staged, UploadBatch
from pipeline.gpu_worker.executor import PAD_BLOCKS, Executed
from pipeline.gpu_worker.input_batch import POISON_TOKEN_ID, InputBatch
from pipeline.gpu_worker.sampling.rejection_sampler import VerifyInputs
from pipeline.gpu_worker.sim_device import sim_drafts
from pipeline.gpu_worker.spec.draft_model import DraftModel, DraftPlan
from pipeline.gpu_worker.spec.ngram_proposer import propose_ngram


@dataclass
class SampledPositions:
    """A step's sampled positions (host numpy int64): each sampled row's last token, or its last ``1 + K`` with drafts.

    ``row``/``j``/``token``/``position [S']``: each position's sampled row, place in it, step-token index and (upper
    bound) position; ``first``/``count [S]`` per row; ``verify_rows [V]``; ``proposed``: drafts reported per row.
    """

    row: np.ndarray
    j: np.ndarray
    token: np.ndarray
    position: np.ndarray
    first: np.ndarray
    count: np.ndarray
    k: int
    verify_rows: np.ndarray
    proposed: int = 0

    @classmethod
    def of(cls, x: StepInputs) -> SampledPositions:
        """Step ``x``'s sampled positions; ``ValueError``: rows verify different numbers of drafts, or a row drafts
        but does not sample."""
        rows = x.sample_rows
        n = len(rows)
        # One token per row (decode): each row's last token is its own index.
        last = rows if len(x.token_ids) == len(x.req_index) else (np.cumsum(x.num_scheduled_tokens) - 1)[rows]
        end = x.start_pos[rows] + x.num_scheduled_tokens[rows]
        drafts = x.num_draft_tokens[rows]
        verify_rows = np.flatnonzero(drafts)
        if not len(verify_rows):
            if x.num_draft_tokens.any():
                raise ValueError(f"step {x.step_id}: drafts on a row that does not sample")
            ar = np.arange(n)
            return cls(ar, np.zeros(n, np.int64), last, end, ar, np.ones(n, np.int64), 0, verify_rows)
        k = int(drafts[verify_rows[0]])
        if (drafts[verify_rows] != k).any() or int(x.num_draft_tokens.sum()) != k * len(verify_rows):
            raise ValueError(f"step {x.step_id}: every row with drafts must sample and verify the same number")
        count = drafts + 1
        first = np.cumsum(count) - count
        row = np.repeat(np.arange(n), count)
        j = np.arange(len(row)) - first[row]
        # A row's sampled positions are its last count tokens: the first is count - 1 before its last.
        return cls(row, j, (last - drafts)[row] + j, (end - drafts)[row] + j, first, count, k, verify_rows)

    def output_rows(
        self, host: torch.Tensor, req_num: np.ndarray, logprobs: TokenLogprobs | None
    ) -> tuple[torch.Tensor, np.ndarray, np.ndarray, TokenLogprobs | None, tuple[np.ndarray, np.ndarray] | None]:
        """A finished step's output rows ``(tokens, req_num, draft_matched, logprobs, proposals)`` from ``host`` (``[S'
        + 2S + S * proposed]`` int64, layout as ``SpecState.after_step``)."""
        n, s = len(self.row), len(self.first)
        values = host.numpy()  # numpy's boolean indexing costs a fraction of torch's
        emitted, matched = values[n : n + s], values[n + s : n + 2 * s]
        proposals = (req_num, values[n + 2 * s :].reshape(s, self.proposed)) if self.proposed else None
        keep = self.j < emitted[self.row]
        kept_row = self.row[keep]
        out_matched = (matched > 0)[kept_row].astype(np.uint8)
        if logprobs is not None:
            out_row = np.cumsum(keep) - 1  # the output row of each emitted position
            kept = keep[logprobs.index]
            logprobs = TokenLogprobs(
                out_row[logprobs.index[kept]],
                logprobs.logprob[kept],
                logprobs.top_ids[kept],
                logprobs.top_logprobs[kept],
            )
        return torch.from_numpy(values[:n][keep]), req_num[kept_row], out_matched, logprobs, proposals


@dataclass
class SpecStep:
    """One step's speculative part, decided on the host and staged (None: not needed).

    Index arrays, host int64: ``verify_drafts [V * K]`` and ``draft_index``/``draft_flat [D]`` (draft inputs and where
    their drafts are read), ``shift_req``/``known_rejected [R]``, ``verify_index [V, K + 1]``, ``first``/``base``/
    ``sample_req [S]``, ``token_req [T]``, ``pos_row``/``pos_j [S']``, ``penalized [P]``, ``cached_req``/``cached_pos
    [C]`` (cached prefixes for the history). ``width``: the proposer's history window (an upper bound).
    """

    sp: SampledPositions
    first: Staged
    base: Staged
    sample_req: Staged
    width: int
    verify_drafts: Staged | None = None
    draft_index: Staged | None = None
    draft_flat: Staged | None = None
    draft_req: np.ndarray | None = None
    new_req: Staged | None = None
    shift_req: Staged | None = None
    known_rejected: Staged | None = None
    verify_index: Staged | None = None
    verify_rows: Staged | None = None
    token_req: Staged | None = None
    pos_row: Staged | None = None
    pos_j: Staged | None = None
    penalized: Staged | None = None
    penalized_req: Staged | None = None
    draft_plan: DraftPlan | None = None
    hot_rows: Staged | None = None
    hot_index: Staged | None = None
    draft_probs: torch.Tensor | None = None
    shift_dev: torch.Tensor | None = None
    cached_req: Staged | None = None
    cached_pos: Staged | None = None


class NgramProposer:
    """Prompt lookup over each request's token history (``propose_ngram``)."""

    keeps_history = True

    def __init__(self, k: int, n_min: int, n_max: int):
        self.k, self.n_min, self.n_max = k, n_min, n_max

    def propose(self, state: SpecState, req: torch.Tensor, width: int, token_cache: torch.Tensor):
        """``(drafts [S, K] int64, matched [S] int64)`` for the rows at req_index ``req`` (``[S]``)."""
        history = state.history.index_select(0, req)[:, :width]
        return propose_ngram(history, state.seq_len.index_select(0, req), self.k, self.n_min, self.n_max)


class SimProposer:
    """The simulated device's drafts (``sim_drafts``), host arrays."""

    keeps_history = False

    def __init__(self, k: int, acceptance: float):
        self.k, self.acceptance = k, acceptance

    def propose(self, state: SpecState, req: torch.Tensor, width: int, token_cache: torch.Tensor):
        last = token_cache.index_select(0, req).numpy()
        pos = state.seq_len.index_select(0, req).numpy() - 1
        drafts = torch.from_numpy(sim_drafts(last, pos, self.k, self.acceptance))
        return drafts, torch.full((len(last),), self.k, dtype=torch.int64)


class SpecState:
    """Per-request speculative state on the device, by req_index, and the step protocol around it.

    ``drafts [R, K]`` int64 (``poison`` once consumed), ``num_rejected``/``seq_len [R]`` int64, and for prompt lookup
    ``history [R, max_model_len]`` and ``slot_tokens [num_slots]`` int32 (each KV slot's token; ``num_slots`` includes
    padding blocks). ``poison`` None: poison mode off.
    """

    def __init__(
        self,
        max_num_reqs: int,
        max_model_len: int,
        k: int,
        device,
        proposer,
        poison: int | None,
        input_batch: InputBatch,
        block_size: int,
        num_slots: int,
    ):
        n = max_num_reqs
        self.k, self.proposer, self.poison, self.max_model_len = k, proposer, poison, max_model_len
        self.input_batch = input_batch
        self.drafts = torch.full((n, k), 0 if poison is None else poison, dtype=torch.int64, device=device)
        self.num_rejected = torch.zeros(n, dtype=torch.int64, device=device)
        self.seq_len = torch.ones(n, dtype=torch.int64, device=device)
        self.history = (
            torch.zeros((n, max_model_len), dtype=torch.int32, device=device) if proposer.keeps_history else None
        )
        # The token in each KV slot, written with its key and value: a row admitted after a cached prefix
        # takes that prefix's tokens into its history from here (its step computes only the rest).
        self.block_size = block_size
        self.slot_tokens = torch.zeros(num_slots, dtype=torch.int32, device=device) if proposer.keeps_history else None
        self.verified_at = np.full(n, -(2**62), dtype=np.int64)

    def stage(self, x: StepInputs, batch: UploadBatch) -> SpecStep:
        """Decide step ``x``'s speculative work on the host and stage its arrays in ``batch``."""
        sp = SampledPositions.of(x)
        sp.proposed = 0 if self.drafts_on_device else self.k  # the output reports the drafts a grammar checks
        rows = x.sample_rows
        sample_req = x.req_index[rows]
        st = SpecStep(
            sp,
            first=batch.add(sp.first),
            base=batch.add(sp.token[sp.first]),
            sample_req=batch.add(sample_req),
            # A row's last sampled position is its end.
            width=min(int(sp.position.max(initial=0)) + 1, self.max_model_len) if self.history is not None else 0,
        )
        if len(x.new_rows):
            self.verified_at[x.req_index[x.new_rows]] = -(2**62)
            st.new_req = batch.add(x.req_index[x.new_rows])
            cached = x.new_rows[x.start_pos[x.new_rows] > 0]  # admitted after a prefix found in the cache
            if self.history is not None and len(cached):
                n = x.start_pos[cached]
                st.cached_req = batch.add(np.repeat(x.req_index[cached], n))
                st.cached_pos = batch.add(np.arange(n.sum()) - np.repeat(np.cumsum(n) - n, n))
        # The scheduler saw the outputs of every step but the one before this (the in-flight limit):
        # only a row that verified there can be ahead of its true position.
        if (self.verified_at[x.req_index] >= x.step_id - (MAX_INFLIGHT_STEPS - 1)).any():
            st.shift_req, st.known_rejected = batch.add(x.req_index), batch.add(x.num_rejected)
        if sp.k:
            # A verified row's drafts are its last k tokens: its sampled positions after the first. Those the
            # descriptor leaves as DRAFT_TOKEN_ID are the proposer's; the others it names (a grammar's forced
            # tokens).
            is_draft = sp.j > 0
            slots = sp.token[is_draft]
            st.verify_drafts = batch.add(slots)
            proposed = x.token_ids[slots] == DRAFT_TOKEN_ID
            if proposed.any():
                st.draft_req = sample_req[sp.row[is_draft][proposed]]
                st.draft_index = batch.add(slots[proposed])
                st.draft_flat = batch.add(st.draft_req * self.k + sp.j[is_draft][proposed] - 1)
            st.verify_index = batch.add(sp.first[sp.verify_rows, None] + np.arange(sp.k + 1)[None, :])
            st.verify_rows = batch.add(sp.verify_rows)
            self.verified_at[sample_req[sp.verify_rows]] = x.step_id
            ib = self.input_batch  # staged before this step: its host mirrors are the step's
            if isinstance(self.proposer, DraftModel):
                self._stage_draft_model(x, sp, sample_req, batch, st)
            if ib.penalty is not None and ib.any_penalty_work:
                # Verified rows with penalties count their accepted drafts.
                if len(rows := np.flatnonzero(ib.host_penalized[sample_req[sp.verify_rows]])):
                    st.penalized, st.penalized_req = batch.add(rows), batch.add(sample_req[sp.verify_rows[rows]])
        if self.history is not None:
            st.token_req = batch.add(np.repeat(x.req_index, x.num_scheduled_tokens))
            st.pos_row, st.pos_j = batch.add(sp.row), batch.add(sp.j)
        return st

    def _stage_draft_model(
        self, x: StepInputs, sp: SampledPositions, sample_req: np.ndarray, batch: UploadBatch, st: SpecStep
    ) -> None:
        """Stage the draft model's passes and which verified rows sample (their draft distributions)."""
        first = sp.first[sp.verify_rows]
        req = sample_req[sp.verify_rows]
        st.draft_plan = self.proposer.stage(
            sp.k, req, sp.position[first] - 1, x.sample_rows[sp.verify_rows], sp.token[first], batch
        )
        ib = self.input_batch
        hot = np.flatnonzero(ib.host_temperature[req] > 0) if ib.any_hot else ()
        if len(hot):
            # Each hot verified position's row among the sampler's temperature rows (ModelRunner._stage_sampling).
            hot_pos = np.flatnonzero(ib.host_temperature[sample_req[sp.row]] > 0)
            among = np.full(len(sp.row), -1, np.int64)
            among[hot_pos] = np.arange(len(hot_pos))
            st.hot_rows = batch.add(hot)
            st.hot_index = batch.add(among[first[hot, None] + np.arange(sp.k + 1)[None, :]])

    @property
    def drafts_on_device(self) -> bool:  # a draft model drafts in the step that verifies, not into ``drafts``
        return isinstance(self.proposer, DraftModel)

    def resolve_drafts(self, st: SpecStep, input_ids: torch.Tensor) -> tuple[torch.Tensor, np.ndarray] | None:
        """Write the drafts into ``input_ids`` in place and reset new rows (a draft model drafts now); in poison mode
        returns ``[D]`` int64 stale flags on the device and their req_index, else None."""
        if st.new_req is not None:
            self.num_rejected.index_fill_(0, st.new_req.dev, 0)
        if st.cached_req is not None:  # the block table holds the new rows' blocks by now
            req, pos = st.cached_req.dev, st.cached_pos.dev
            cols = torch.div(pos, self.block_size, rounding_mode="floor")
            slots = slot_mapping(self.input_batch.block_table, req, cols, pos, self.block_size)
            self._write_history(req, pos, self.slot_tokens.index_select(0, slots))
        if st.draft_index is None:
            return None
        if st.draft_plan is not None:
            drafts, st.draft_probs = self.proposer.propose(st.draft_plan, input_ids, self.shift(st))
            input_ids.index_copy_(0, st.draft_index.dev, drafts.view(-1))
            return None
        flat = self.drafts.view(-1)
        drafts = flat.index_select(0, st.draft_flat.dev)
        stale = None
        if self.poison is not None:
            stale = (drafts < 0).long(), st.draft_req
            flat.index_fill_(0, st.draft_flat.dev, self.poison)
        input_ids.index_copy_(0, st.draft_index.dev, drafts.clamp(min=0))
        return stale

    def shift(self, st: SpecStep) -> torch.Tensor | None:
        """``[R]`` int64 on the device: how far each row starts before its planned position; None: nowhere."""
        if st.shift_req is None:
            return None
        if st.shift_dev is None:
            st.shift_dev = self.num_rejected.index_select(0, st.shift_req.dev) - st.known_rejected.dev
        return st.shift_dev

    def verify_inputs(self, st: SpecStep, input_ids: torch.Tensor, meta: AttentionMetadata) -> VerifyInputs | None:
        """Record the step's resolved inputs in the history and ``slot_tokens`` at their device positions and KV slots;
        returns what the executor verifies (None: no drafts)."""
        if self.history is not None:
            self._write_history(st.token_req.dev, meta.positions, input_ids)
            self.slot_tokens.index_copy_(0, meta.slot_mapping, input_ids.to(torch.int32))
        if not st.sp.k:
            return None
        drafts = input_ids.index_select(0, st.verify_drafts.dev).view(-1, st.sp.k)
        v = VerifyInputs(index=st.verify_index.dev, drafts=drafts)
        if st.draft_probs is not None:
            v.draft_probs, v.hot_rows, v.hot_index = st.draft_probs, st.hot_rows.dev, st.hot_index.dev
        return v

    def after_step(
        self,
        st: SpecStep,
        executed: Executed,
        meta,
        layout: StepLayout,
        input_ids: torch.Tensor,
        meanwhile: Callable[[], None] | None = None,
    ) -> None:
        """Apply a step's verification on the device, run ``meanwhile``, then draft every sampled row's next step.

        ``executed.tokens`` is ``[S']`` positions' tokens, then ``[S]`` emitted, ``[S]`` drafts matched and ``[S, K]``
        proposed (``SampledPositions.output_rows``); ``meta.positions`` (``[T]``) are shifted.
        """
        positions = meta.positions
        tokens, accepted = executed.tokens, executed.accepted
        penalty, token_cache = self.input_batch.penalty, self.input_batch.token_cache
        count = torch.ones_like(st.first.dev)
        if accepted is not None:
            k = st.sp.k  # this step's drafts per row (at most self.k)
            count.index_copy_(0, st.verify_rows.dev, accepted + 1)
            self.num_rejected.index_add_(0, st.sample_req.dev.index_select(0, st.verify_rows.dev), k - accepted)
            if st.penalized is not None:
                drafts = input_ids.index_select(0, st.verify_index.dev[:, 1:].reshape(-1)).view(-1, k)
                taken = torch.arange(k, device=tokens.device)[None, :] < accepted[:, None]
                sel = st.penalized.dev
                penalty.counts.index_put_(
                    (st.penalized_req.dev[:, None].expand(-1, k).reshape(-1), drafts.index_select(0, sel).view(-1)),
                    taken.index_select(0, sel).view(-1).to(penalty.counts.dtype),
                    accumulate=True,
                )
        token_cache.index_copy_(0, st.sample_req.dev, tokens.index_select(0, st.first.dev + count - 1))
        base = positions.index_select(0, st.base.dev)  # each sampled row's first sampled input
        self.seq_len.index_copy_(0, st.sample_req.dev, base + 1 + count)
        if self.history is not None:
            pos = base.index_select(0, st.pos_row.dev) + 1 + st.pos_j.dev
            self._write_history(st.sample_req.dev.index_select(0, st.pos_row.dev), pos, tokens)
        if meanwhile is not None:
            meanwhile()
        if self.drafts_on_device:
            self.proposer.consume(input_ids, meta, layout, self.shift(st))
            executed.tokens = torch.cat([tokens, count, torch.full_like(count, self.k)])
        else:
            drafts, matched = self.proposer.propose(self, st.sample_req.dev, st.width, token_cache)
            self.drafts.index_copy_(0, st.sample_req.dev, drafts)
            executed.tokens = torch.cat([tokens, count, matched, drafts.view(-1)])

    def _write_history(self, req: torch.Tensor, pos: torch.Tensor, ids: torch.Tensor) -> None:
        # A position past max_model_len holds nothing a request can reach; clamped, it stays in its row.
        width = self.history.shape[1]
        self.history.view(-1).index_copy_(0, req * width + pos.clamp(max=width - 1), ids.to(torch.int32))


def spec_state(
    config: EngineConfig, device: torch.device, input_batch: InputBatch, draft: DraftModel | None = None
) -> SpecState | None:
    """The speculative state ``config`` asks for (prompt lookup, draft model ``draft``, simulated drafts), or None;
    raises ``ValueError`` for ``draft_model`` without ``draft`` or another method this worker does not run."""
    spec = config.speculative
    if spec is None:
        return None
    k = spec.num_speculative_tokens
    if config.is_simulated:
        proposer = SimProposer(k, config.worker.sim_draft_acceptance)
    elif spec.method == "ngram":
        proposer = NgramProposer(k, spec.prompt_lookup_min, spec.prompt_lookup_max)
    elif spec.method == "draft_model" and draft is not None:
        proposer = draft
    else:
        raise ValueError(f"speculative method {spec.method!r} is not supported by this worker")
    poison = POISON_TOKEN_ID if config.worker.debug_token_cache_poison else None
    slots = (config.num_kv_blocks + PAD_BLOCKS) * config.scheduler.block_size
    return SpecState(
        config.scheduler.max_num_seqs,
        config.max_model_len,
        k,
        device,
        proposer,
        poison,
        input_batch,
        config.scheduler.block_size,
        slots,
    )
