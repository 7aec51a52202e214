"""The scheduler's side of speculative decoding: which rows draft in a step, and each row's run of tokens
applied with its rejected drafts rolled back one step late (docs/design.md, "Speculative decoding")."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from pipeline.common.constants import cdiv
from pipeline.common.descriptor_builder import DescriptorBuilder
from pipeline.scheduler_proc.kv_block_pool import BlockPool
from pipeline.scheduler_proc.request import Request
from pipeline.scheduler_proc.spec_policy import SpecPolicy, SpecStats, output_runs
from pipeline.scheduler_proc.steady_rows import SteadyRows


class Drafts:
    """Plans drafts into steps and applies the outputs of steps that had them.

    Args:
        max_num_seqs: req_indices.
        k: drafts per row at most (``num_speculative_tokens``).
        block_size: tokens per KV block.
        adaptive: the policy chooses k and the rows from measured acceptance and cost; False: every
            row that may draft drafts ``k`` (``SpecPolicy``'s ``adaptive``).
    """

    def __init__(self, max_num_seqs: int, k: int, block_size: int, adaptive: bool = True):
        self.policy = SpecPolicy(max_num_seqs, k, adaptive=adaptive)
        self.stats = SpecStats(k)
        self.block_size = block_size
        self._drafted: dict[int, dict[int, int]] = {}  # step -> {req_num: tokens planned} of general rows
        self._step_tokens: dict[int, int] = {}  # step -> its tokens, drafts included

    def admit(self, req: Request) -> None:
        """``req`` took its req_index: no rejections, no evidence of its own."""
        req.num_rejected = 0
        self.policy.reset(req.req_index)

    def num_drafts(self, step_id: int, req: Request) -> int:
        """Drafts general row ``req`` verifies in step ``step_id`` (from ``plan``)."""
        drafted = self._drafted.get(step_id)
        return drafted[req.req_num] - 1 if drafted and req.req_num in drafted else 0

    def plan(
        self,
        step_id: int,
        steady: SteadyRows,
        steady_rows: np.ndarray,
        rows: list[tuple[Request, int, bool]],
        budget: int,
        pool: BlockPool,
        builder: DescriptorBuilder,
        max_new_blocks: int,
    ) -> np.ndarray | None:
        """Give decode rows drafts where the policy says they pay, once the step is planned as without them.

        Drafts take only what is left of the token ``budget``, free blocks and block-table entries (they
        never preempt). General rows chosen become ``(req, 1 + k, True)`` in ``rows``; returns the steady
        rows' drafts (``[D]``, None: none). Rows with a grammar, before ``min_tokens`` or new at their
        req_index (no drafts proposed there yet) do not draft.
        """
        general = [
            i
            for i, (req, n, sample) in enumerate(rows)
            if n == 1
            and sample
            and not req.is_new
            and req.grammar is None
            and req.num_computed_tokens >= len(req.prompt_token_ids)
            and len(req.output_token_ids) >= req.params.min_tokens
        ]
        cand_steady, remaining = steady.draft_candidates(steady_rows)
        reqs = [rows[i][0] for i in general]
        cand = np.concatenate([cand_steady, np.fromiter((r.req_index for r in reqs), np.int64, len(reqs))])
        if not len(cand):
            return None
        left = np.fromiter((r.params.max_tokens - r.num_outputs_planned for r in reqs), np.int64, len(reqs))
        num_sampled = len(steady_rows) + sum(sample for _, _, sample in rows)
        base = len(steady_rows) + sum(n for _, n, _ in rows)
        k, chosen = self.policy.choose(num_sampled, base, cand, np.concatenate([remaining, left]), budget)
        if not k:
            return None
        ns = len(cand_steady)
        drafts = None
        if (chosen < ns).any():
            room = max_new_blocks - builder.num_blocks
            got = steady.grow_for_drafts(cand_steady[chosen[chosen < ns]], k, pool, builder, room)
            if len(got):
                drafts = np.where(np.isin(steady_rows, got), k, 0)
        drafted = {}
        for c in chosen[chosen >= ns].tolist():
            i = general[c - ns]
            req = rows[i][0]
            need = cdiv(req.num_computed_tokens + 1 + k, self.block_size) - len(req.block_ids)
            if need > pool.num_free_blocks or builder.num_blocks + need > max_new_blocks:
                continue
            if need > 0:
                start = len(req.block_ids)
                req.block_ids.extend(pool.allocate_blocks(need))
                for j in range(start, start + need):
                    builder.add_block(req.req_index, j, req.block_ids[j])
            rows[i] = (req, 1 + k, True)
            drafted[req.req_num] = 1 + k
        if drafted:
            self._drafted[step_id] = drafted
        return drafts

    def planned(self, step_id: int, num_tokens: int) -> None:
        """Step ``step_id`` was written with ``num_tokens`` tokens (its cost is measured against them)."""
        self._step_tokens[step_id] = num_tokens

    def observe_step(self, step_id: int, device_ns: int) -> None:
        """Step ``step_id``'s output came: it took ``device_ns`` on the device."""
        self.policy.observe_step(self._step_tokens.pop(step_id, 0), device_ns)

    def observe_steady(self, verified: tuple, matched: np.ndarray | None) -> None:
        """The steady rows' part of an output (``SteadyRows.apply_output``'s last value)."""
        rows, planned, got, last_row = verified
        if planned is not None:
            self.stats.add(planned - 1, got - 1)
        if matched is not None:
            m = matched[: len(rows)] if last_row is None else matched[last_row]
            k = np.zeros(len(rows), np.int64) if planned is None else planned - 1
            self.policy.observe_rows(rows, k, k if got is None else got - 1, m.astype(bool))

    def apply_general(
        self,
        step_id: int,
        req_nums: list[int],
        token_ids: list[int],
        matched: np.ndarray | None,
        requests: dict[int, Request],
        steady: SteadyRows,
        apply_token: Callable[[Request, int], bool],
    ) -> None:
        """Apply the general rows of step ``step_id``'s output (those after its steady rows): per request its
        run of tokens; ``apply_token`` appends one and says whether the request ended."""
        drafted = self._drafted.pop(step_id, {})
        starts, lengths = output_runs(np.asarray(req_nums, np.int64))
        seen: list[tuple[int, int, int, bool]] = []  # (req_index, drafts, accepted, matched) of live rows
        for start, m in zip(starts.tolist(), lengths.tolist()):
            req = requests.get(req_nums[start])
            if req is None:
                continue
            n = drafted.get(req.req_num, 1)
            if n > 1:
                self.stats.add(np.array([n - 1]), np.array([m - 1]))
            if not self.apply_run(req, n, token_ids[start : start + m], steady, apply_token) and matched is not None:
                seen.append((req.req_index, n - 1, m - 1, bool(matched[start + m - 1])))
        if seen:
            self.policy.observe_rows(*(np.asarray(c) for c in zip(*seen)))

    @staticmethod
    def apply_run(
        req: Request, n: int, tokens: list[int], steady: SteadyRows, apply_token: Callable[[Request, int], bool]
    ) -> bool:
        """Roll back the rejected drafts of a row of ``req`` planned with ``n`` tokens, then append the
        ``tokens`` it got, up to the one that ends it; True if it ended.

        The rollback comes first: an appended token counts as final (nameable for prefix caching) only up
        to the positions really computed or planned.
        """
        rejected = n - len(tokens)
        if rejected > 0:
            if steady.holds(req):
                steady.rollback(req, rejected)
            else:
                req.num_placeholders -= rejected
                if req.req_index >= 0:  # not preempted since (then it recomputes from its known tokens)
                    req.num_computed_tokens -= rejected
                    req.num_rejected += rejected
        return any(apply_token(req, t) for t in tokens)
