"""The scheduler's side of speculative decoding: which rows draft in a step, and each row's run of tokens applied with
its rejected drafts rolled back one step late (docs/design.md, "Speculative decoding")."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from pipeline.common.constants import cdiv
from pipeline.common.descriptor_builder import DescriptorBuilder
from pipeline.scheduler_proc.kv_block_pool import BlockPool
from pipeline.scheduler_proc.request import Request
from pipeline.scheduler_proc.spec_policy import SpecPolicy, SpecStats, output_runs
from pipeline.scheduler_proc.steady_rows import SteadyRows

_NO_DRAFTS: dict[int, int] = {}
_NO_KNOWN: dict[int, list[int]] = {}
# Steps planned with one prepared choice before the policy chooses again (its search costs more than the rest
# of a step's planning, and the evidence it reads changes little in a step).
_CHOICE_STEPS = 4
# Fewer candidates search every step: the search is cheap there, and a threshold taken from a few rows
# would not carry over to the next steps.
_PREPARED_MIN_ROWS = 64


class Drafts:
    """Plans drafts into steps and applies the outputs of steps that had them.

    ``apply_token``: the scheduler's ``(req, token, finished)``, True if the token ended ``req``; ``grammar_rows``: rows
    with a (non-lazy) grammar draft too; ``jump_forward``: they draft forced tokens (``GrammarState.forced``).
    """

    def __init__(
        self,
        max_num_seqs: int,
        k: int,
        adaptive: bool,
        pool: BlockPool,
        steady: SteadyRows,
        builder: DescriptorBuilder,
        apply_token: Callable[[Request, int, list[int]], bool],
        grammar_rows: bool = False,
        jump_forward: bool = False,
    ):
        self.policy = SpecPolicy(max_num_seqs, k, adaptive=adaptive)
        self.stats = SpecStats(k)
        self.pool, self.steady, self.builder, self.apply_token = pool, steady, builder, apply_token
        self.grammar_rows, self.jump_forward = grammar_rows, jump_forward
        self._known: dict[int, dict[int, list[int]]] = {}  # step -> {req_num: the drafts it names}
        self.block_size = steady.block_size
        self._drafted: dict[int, dict[int, int]] = {}  # step -> {req_num: drafts} of general rows
        self._step_tokens: dict[int, int] = {}  # step -> its tokens, drafts included
        self._drafting = np.zeros(max_num_seqs, bool)  # scratch: the steady rows given drafts, by req_index
        # Measurements of applied outputs not yet given to the policy and the stats: (step, what, args).
        self._observations: list[tuple[int, Callable, tuple]] = []
        self._last_output = -1  # the newest step whose output was applied
        # The policy's choice made after a step was published, for the next ones: (k, lowest acceptance
        # chosen), the steps planned with it, and what the next choice is made from (the newest step's
        # choose arguments, and how many steps' fading of idle evidence it owes).
        self._prepared: tuple[int, float] | None = None
        self._prepared_steps = 0
        self._to_prepare: tuple | None = None

    def admit(self, req: Request) -> None:
        """``req`` took its req_index: no rejections, no evidence of its own."""
        req.num_rejected = 0
        self.policy.reset(req.req_index)

    def drafted(self, step_id: int) -> dict[int, int]:
        """The drafts of step ``step_id``'s general rows (from ``plan``): ``{req_num: drafts}``."""
        return self._drafted.get(step_id, _NO_DRAFTS)

    def plan(
        self, step_id: int, steady_rows: np.ndarray, rows: list[tuple[Request, int, bool]], budget: int, max_blocks: int
    ) -> np.ndarray | None:
        """Give decode rows drafts where the policy says they pay, within what the planned step leaves (budget, free
        blocks, ``max_blocks``); never preempts.

        Chosen general rows become ``(req, 1 + k, True)`` in ``rows``; returns the steady rows' drafts (``[D]``, None:
        none).
        """
        base = len(steady_rows) + sum(n for _, n, _ in rows)
        self._step_tokens[step_id] = base
        general = [
            i
            for i, (req, n, sample) in enumerate(rows)
            if n == 1
            and sample
            and not req.is_new
            and (req.grammar is None or self.grammar_rows and req.grammar.trigger is None)
            and req.num_computed_tokens >= len(req.prompt_token_ids)
            and len(req.output_token_ids) >= req.params.min_tokens
        ]
        forced = {}
        if self.jump_forward:
            forced = {i: f for i in general if rows[i][0].grammar is not None and (f := _forced_drafts(rows[i][0]))}
            general = [i for i in general if i not in forced]
        steady, pool, builder = self.steady, self.pool, self.builder
        cand_steady, remaining = steady.draft_candidates(steady_rows)
        reqs = [rows[i][0] for i in general]
        cand = np.concatenate([cand_steady, np.fromiter((r.req_index for r in reqs), np.int64, len(reqs))])
        k, chosen = 0, cand[:0]
        if len(cand):
            left = np.fromiter((r.params.max_tokens - r.num_outputs_planned for r in reqs), np.int64, len(reqs))
            num_sampled = len(steady_rows) + sum(sample for _, _, sample in rows)
            k, chosen = self._choose(num_sampled, base, cand, np.concatenate([remaining, left]), budget)
        if forced and not k:  # every verifying row of a step has the same k
            k = min(self.policy.k_max, max(len(f) for f in forced.values()))
        if not k:
            return None
        ns = len(cand_steady)
        drafts = None
        if (chosen < ns).any():
            room = max_blocks - builder.num_blocks
            got = steady.grow_for_drafts(cand_steady[chosen[chosen < ns]], k, pool, builder, room)
            if len(got):
                self._drafting[got] = True
                drafts = self._drafting[steady_rows] * k
                self._drafting[got] = False
                self._step_tokens[step_id] += k * len(got)
                budget -= k * len(got)
        drafted, known = {}, {}
        for i in [general[c - ns] for c in chosen[chosen >= ns].tolist()] + list(forced):
            req = rows[i][0]
            if i in forced and (budget < k or req.params.max_tokens - req.num_outputs_planned <= k):
                continue
            need = cdiv(req.num_computed_tokens + 1 + k, self.block_size) - len(req.block_ids)
            if need > pool.num_free_blocks or builder.num_blocks + need > max_blocks:
                continue
            if need > 0:
                start = len(req.block_ids)
                req.block_ids.extend(pool.allocate_blocks(need))
                for j in range(start, start + need):
                    builder.add_block(req.req_index, j, req.block_ids[j])
            rows[i] = (req, 1 + k, True)
            drafted[req.req_num] = k
            budget -= k
            if i in forced:
                f = forced[i][:k]
                known[req.req_num] = f + f[-1:] * (k - len(f))  # a repeat is forbidden: verification stops there
        if drafted:
            self._drafted[step_id] = drafted
            self._step_tokens[step_id] += k * len(drafted)
        if known:
            self._known[step_id] = known
        return drafts

    def known(self, step_id: int) -> dict[int, list[int]]:
        """The drafts ``plan`` named for step ``step_id``'s rows (a grammar's forced tokens), by req_num; forgotten once
        read."""
        return self._known.pop(step_id, _NO_KNOWN)

    def apply_output(
        self,
        step_id: int,
        device_ns: int,
        d: int,
        verified: tuple | None,
        req_nums: np.ndarray,
        token_ids: np.ndarray,
        matched: np.ndarray | None,
        requests: dict[int, Request],
        finished: list[int],
    ) -> None:
        """Apply step ``step_id``'s output rows after its ``d`` steady ones, and measure the step (``matched``:
        ``[rows]`` ``draft_matched``, None: unknown); ``finished`` gets the requests that end."""
        self._last_output = step_id
        record = self._observations.append
        record((step_id, self.policy.observe_step, (self._step_tokens.pop(step_id, 0), device_ns)))
        if verified is not None:
            rows, planned, got, last_row = verified
            if planned is not None:
                record((step_id, self.stats.add, (planned - 1, got - 1)))
            if matched is not None:
                m = matched[: len(rows)] if last_row is None else matched[last_row]
                k = np.zeros(len(rows), np.int64) if planned is None else planned - 1
                self.policy.matched[rows] = m
                record((step_id, self.policy.observe_rows, (rows, k, k if got is None else got - 1)))
        drafted = self._drafted.pop(step_id, _NO_DRAFTS)
        starts, lengths = output_runs(req_nums[d:])
        req_nums, token_ids = req_nums[d:].tolist(), token_ids[d:].tolist()
        matched = None if matched is None else matched[d:]
        verified_rows: list[tuple[int, int]] = []  # (drafts, accepted) of the rows that verified drafts
        seen: list[tuple[int, int, int, bool]] = []  # (req_index, drafts, accepted, matched) of live rows
        for start, m in zip(starts.tolist(), lengths.tolist()):
            req = requests.get(req_nums[start])
            if req is None:
                continue
            n = 1 + drafted.get(req.req_num, 0)
            if n > 1:
                verified_rows.append((n - 1, m - 1))
            if not self.apply_run(req, n, token_ids[start : start + m], finished) and matched is not None:
                seen.append((req.req_index, n - 1, m - 1, bool(matched[start + m - 1])))
        if verified_rows:
            record((step_id, self.stats.add, tuple(np.array(c) for c in zip(*verified_rows))))
        if seen:
            index, k, accepted, m = (np.asarray(c) for c in zip(*seen))
            self.policy.matched[index] = m
            record((step_id, self.policy.observe_rows, (index, k, accepted)))

    def _choose(
        self, num_sampled: int, base: int, cand: np.ndarray, remaining: np.ndarray, budget: int
    ) -> tuple[int, np.ndarray]:
        """``SpecPolicy.choose``'s ``(k, rows)``, or a choice ``prepare`` made since the last step applied to these
        candidates (adaptive policy, ``_PREPARED_MIN_ROWS`` candidates only)."""
        policy, args = self.policy, (num_sampled, base, cand, remaining, budget)
        if self._prepared is not None and policy.adaptive and len(cand) >= _PREPARED_MIN_ROWS:
            self._prepared_steps += 1
            self._to_prepare = (args, self._prepared_steps)
            k, lowest = self._prepared
            if not k or budget < k:
                return 0, np.zeros(0, np.int64)
            a = policy.acceptance(cand) * policy.matched[cand]
            rows = np.flatnonzero((a >= lowest) & (a > 0) & (remaining > k))
            if len(rows) * k > budget:
                rows = np.sort(rows[np.argsort(-a[rows], kind="stable")[: budget // k]])
            return (k, rows) if len(rows) else (0, rows)
        self._prepared = None
        self._to_prepare = (args, 0)  # chosen now: prepare must not fade the rows' evidence again
        return policy.choose(*args)

    def prepare(self) -> None:
        """Make the policy's choice for the next steps from this one's candidates (``_choose``), every ``_CHOICE_STEPS``
        steps: called off the path from an output to the next step, once this one is published."""
        if self._to_prepare is None or (self._prepared is not None and self._prepared_steps < _CHOICE_STEPS):
            return
        (args, idle_steps), self._to_prepare = self._to_prepare, None
        if not self.policy.adaptive or len(args[2]) < _PREPARED_MIN_ROWS:  # _choose searches each step there
            return
        k, rows = self.policy.choose(*args, idle_steps=idle_steps)
        self._prepared = (k, float(self.policy.acceptance(args[2][rows]).min()) if k else 0.0)
        self._prepared_steps = 0

    def observe(self, all_outputs: bool = True) -> None:
        """Give the policy and stats the applied outputs' measurements (False: all but the newest); called off the
        output-to-step path."""
        obs, newest = self._observations, self._last_output
        n = len(obs) if all_outputs else next((i for i, o in enumerate(obs) if o[0] >= newest), len(obs))
        for _, what, args in obs[:n]:
            what(*args)
        del obs[:n]

    def apply_run(self, req: Request, n: int, tokens: list[int], finished: list[int]) -> bool:
        """Roll back a row's rejected drafts (planned ``n`` tokens), then append the ``tokens`` it got; True if ``req``
        ended."""
        rejected = n - len(tokens)
        if rejected > 0:
            if self.steady.holds(req):
                self.steady.rollback(req, rejected)
            else:
                req.num_placeholders -= rejected
                if req.req_index >= 0:  # not preempted since (then it recomputes from its known tokens)
                    req.num_computed_tokens -= rejected
                    req.num_rejected += rejected
        return any(self.apply_token(req, t, finished) for t in tokens)


def _forced_drafts(req: Request) -> list[int]:
    """The tokens ``req``'s grammar forces after its tokens in flight (counted as if its drafts in flight are all
    accepted), if its outputs since the grammar said so are those it forced; else none."""
    at, tokens = req.grammar.forced
    out = req.output_token_ids
    done = len(out) - at
    ahead = done + req.num_placeholders
    if ahead >= len(tokens) or (done and out[at:].tolist() != tokens[:done]):
        return []
    return tokens[ahead:]
