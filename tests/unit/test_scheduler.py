"""The scheduler against a reference executor that checks the step protocol.

The executor below plays the worker's part in one process: it keeps a
token-id cache and block table per req_index, resolves placeholders, and
"samples" token ``f(request, position)``, so every request has one correct
output sequence. It asserts what a real device would silently get wrong: a
placeholder resolving to another request's or a consumed token, a block
shared by two live requests, a KV position read before it was written.
"""

from __future__ import annotations

import random
from collections import deque

import pytest
from msgspec.structs import replace

from pipeline.common.messages import AddRequest, SamplingParams
from pipeline.common.step_protocol import PLACEHOLDER_TOKEN_ID, StepDescriptor, StepInputs, read_descriptor
from pipeline.scheduler_proc import steady_rows
from pipeline.scheduler_proc.scheduler import Scheduler

EOS = 3
BS = 4


def sampled_token(req_num: int, pos: int) -> int:
    """Token a request samples after position ``pos``; EOS now and then."""
    h = (req_num * 1_000_003 + pos * 7919) % 997
    return EOS if h < 8 else 10 + h


class ReferenceExecutor:
    """Executes descriptors like the worker does, with checks instead of a model."""

    def __init__(self, num_req_indices: int, num_blocks: int, prefill_of: dict[int, int] | None = None):
        # Choices of an n > 1 request read their shared prefill's KV: choice req_num -> prefill req_num.
        self.prefill_of = prefill_of or {}
        self.token_cache = [None] * num_req_indices
        self.block_table = [dict() for _ in range(num_req_indices)]
        self.kv = {}  # (block, offset) -> (req_num, pos, token)
        self.owner = [None] * num_req_indices
        self.sampled = {}  # (req_num, pos) -> the token sampled for that position
        self.prompt_lp_positions = {}  # req_num -> positions whose prompt log-probability was computed

    def execute(self, x: StepInputs, inflight_refs: set) -> tuple[int, list[int], list[int], set]:
        """Run step ``x`` (as the worker reads it); ``inflight_refs`` holds the rows and blocks of steps in flight.

        Returns (step id, sampled request numbers, sampled tokens, what this step references).
        """
        prefills = set(self.prefill_of.values())
        for s, i, b in zip(x.nb_req_index.tolist(), x.nb_index.tolist(), x.nb_block.tolist()):
            shared = self.kv.get((b, 0), (None,))[0] in prefills  # a choice's row gets its prefill's blocks
            assert shared or ("block", b) not in inflight_refs, f"block {b} reused while a step in flight reads it"
            self.block_table[s][i] = b
        refs = set()
        tok = x.token_ids.tolist()
        new_rows, sample_rows = set(x.new_rows.tolist()), set(x.sample_rows.tolist())
        off, out_req, out_tok = 0, [], []
        for r in range(len(x.req_num)):
            req, req_index = int(x.req_num[r]), int(x.req_index[r])
            k, start = int(x.num_scheduled_tokens[r]), int(x.start_pos[r])
            if r in new_rows:
                assert ("req_index", req_index) not in inflight_refs, (
                    f"req_index {req_index} reused while a step in flight reads it"
                )
                self.owner[req_index] = req
                self.token_cache[req_index] = None
            assert self.owner[req_index] == req, "req_index shared by two live requests"
            for j in range(k):
                pos, t = start + j, tok[off + j]
                if t == PLACEHOLDER_TOKEN_ID:
                    cached = self.token_cache[req_index]
                    assert cached is not None, f"placeholder of req {req} read a consumed/empty cache entry"
                    t = cached
                    self.token_cache[req_index] = None  # poison
                assert self.sampled.get((req, pos), t) == t, f"req {req} pos {pos}: input {t} is not the sampled token"
                b = self.block_table[req_index][pos // BS]
                self.kv[(b, pos % BS)] = (req, pos, t)
            refs.add(("req_index", req_index))
            refs.update(("block", self.block_table[req_index][i]) for i in range((start + k - 1) // BS + 1))
            # Every earlier position of this request must be in its own blocks.
            for p in range(start + k):
                owner = self.kv.get((self.block_table[req_index][p // BS], p % BS))
                mine = owner is not None and owner[1] == p and owner[0] in (req, self.prefill_of.get(req))
                assert mine, f"req {req} pos {p}: KV holds {owner}"
            m = int(x.num_prompt_logprobs[r])
            assert 0 <= m <= k and (x.next_prompt_token[r] >= 0) == (m == k > 0)
            if m == k > 0:  # the next chunk must start with it
                self.sampled[(req, start + k)] = int(x.next_prompt_token[r])
            self.prompt_lp_positions.setdefault(req, set()).update(range(start + 1, start + m + 1))
            if r in sample_rows:
                y = sampled_token(req, start + k - 1)
                self.sampled[(req, start + k)] = y
                self.token_cache[req_index] = y
                out_req.append(req)
                out_tok.append(y)
            off += k
        return x.step_id, out_req, out_tok, refs


def run(requests, depth: int, max_num_seqs=8, budget=16, num_blocks=64, abort_at=None, seed=0, max_blocks_per_seq=16):
    """Drive a Scheduler with ``depth`` steps in flight; return outputs per request."""
    layout = StepDescriptor.layout(max_num_seqs, budget, BS)
    sched = Scheduler(max_num_seqs, budget, BS, num_blocks, max_blocks_per_seq=max_blocks_per_seq)
    ex = ReferenceExecutor(
        max_num_seqs, num_blocks, {r.req_num + 1 + i: r.req_num for r in requests if r.n > 1 for i in range(r.n)}
    )
    outputs = {c: [] for r in requests for c in choice_nums(r)}
    finished = set()
    pending = deque(requests)
    inflight = deque()
    rng = random.Random(seed)
    step = 0
    while pending or sched.num_unfinished or inflight:
        while pending and rng.random() < 0.5:
            sched.add_request(pending.popleft())
        if len(inflight) < depth and sched.num_unfinished:
            buf = bytearray(layout.nbytes)
            d = StepDescriptor(layout.views(buf))
            if sched.schedule(d):
                refs = set().union(*(x[3] for x in inflight)) if inflight else set()
                inflight.append(ex.execute(read_descriptor(d), refs))
                step += 1
                if abort_at and step in abort_at:
                    sched.abort_request(abort_at[step])
                    finished.add(abort_at[step])
                continue
        if inflight:
            sid, reqs, toks, _ = inflight.popleft()
            for r, t in zip(reqs, toks):
                if r not in finished and r in sched.requests:
                    outputs[r].append(t)
            finished.update(sched.process_output(sid, reqs, toks))
        elif pending:
            sched.add_request(pending.popleft())
    assert sched.pool.num_free_blocks == num_blocks, "KV blocks leaked"
    assert sched.pool.num_free_req_indices == max_num_seqs, "req_indices leaked"
    for r in (r for r in requests if r.n == 1):  # every prompt token after the first, once, nothing else
        want = set(range(1, len(r.prompt_token_ids))) if r.params.prompt_logprobs >= 0 else set()
        got = ex.prompt_lp_positions.get(r.req_num, set())
        assert got == want or (abort_at and r.req_num in abort_at.values() and got <= want), r.req_num
    return outputs, sched


def choice_nums(req: AddRequest) -> list[int]:
    """The request numbers that produce ``req``'s outputs (its choices when ``n`` > 1)."""
    return [req.req_num] if req.n == 1 else [req.req_num + 1 + i for i in range(req.n)]


def expected(req: AddRequest, req_num: int | None = None) -> list[int]:
    """The outputs of ``req`` (of its choice ``req_num`` when ``n`` > 1)."""
    out, pos = [], len(req.prompt_token_ids) - 1
    while len(out) < req.params.max_tokens:
        y = sampled_token(req.req_num if req_num is None else req_num, pos)
        out.append(y)
        pos += 1
        if y == EOS and not req.params.ignore_eos:
            break
    return out


def make_requests(n: int, seed: int, max_len=40) -> list[AddRequest]:
    rng = random.Random(seed)
    reqs = []
    for i in range(1, n + 1):
        prompt = [rng.randrange(10, 900) for _ in range(rng.randrange(1, 30))]
        # Some ask for prompt log-probabilities, a few of them with no output (max_tokens 0).
        prompt_lp = rng.choice([-1, -1, -1, 0, 5])
        max_tokens = 0 if prompt_lp >= 0 and rng.random() < 0.3 else rng.choice([1, 2, rng.randrange(1, max_len)])
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=0.0,
            ignore_eos=rng.random() < 0.3,
            stop_token_ids=(EOS,),
            prompt_logprobs=prompt_lp,
        )
        reqs.append(AddRequest(i, prompt, params))
    return reqs


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("n", [1, 8, 40])
def test_outputs_match_reference(depth, n):
    reqs = make_requests(n, seed=n)
    outputs, _ = run(reqs, depth)
    for r in reqs:
        assert outputs[r.req_num] == expected(r), r.req_num


def test_preemption_under_kv_pressure_is_exact():
    reqs = make_requests(24, seed=5, max_len=60)
    outputs, sched = run(reqs, depth=2, num_blocks=24)
    assert sched.num_preemptions > 0
    for r in reqs:
        assert outputs[r.req_num] == expected(r)


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("num_blocks", [2000, 90])
def test_steady_decode_path_is_exact(depth, num_blocks, monkeypatch):
    """Long decodes become steady rows; joins, aborts, EOS, block crossings and (with 90
    blocks) preemptions in the middle of it leave every output exact and free everything. Steady rows'
    tokens wait at most 3 steps in the scheduler's buffer here, so they move to the requests' lists often."""
    monkeypatch.setattr(steady_rows, "_TOKEN_BUFFER", 3)
    reqs = make_requests(96, seed=11, max_len=120)
    aborted = {10: 5, 40: 17, 41: 18, 90: 60}
    outputs, sched = run(
        reqs, depth, max_num_seqs=32, budget=64, num_blocks=num_blocks, abort_at=aborted, max_blocks_per_seq=64
    )
    assert sched.num_steady_steps > 20
    if num_blocks == 90:
        assert sched.num_preemptions > 0
    for r in reqs:
        if r.req_num not in aborted.values():
            assert outputs[r.req_num] == expected(r), r.req_num


def test_max_tokens_costs_no_extra_step():
    req = AddRequest(1, [11, 12, 13], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    _, sched = run([req], depth=2)
    assert sched.next_step_id == 1
    req = AddRequest(2, [11, 12, 13], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    _, sched = run([req], depth=2)
    assert sched.next_step_id == 5


def test_aborts_free_everything():
    reqs = make_requests(16, seed=9)
    run(reqs, depth=2, abort_at={3: 2, 5: 7, 9: 1})


def test_schedule_returns_zero_without_work():
    layout = StepDescriptor.layout(4, 16, BS)
    sched = Scheduler(4, 16, BS, 16, 16)
    assert sched.schedule(StepDescriptor(layout.views(bytearray(layout.nbytes)))) == 0
    assert sched.next_step_id == 0


def test_kv_cache_too_small_for_one_request_is_rejected():
    with pytest.raises(ValueError, match="max_model_len"):
        Scheduler(4, 16, BS, num_kv_blocks=3, max_blocks_per_seq=16)


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("num_blocks", [400, 40])
def test_choices_share_the_prompt_blocks(depth, num_blocks):
    """n > 1: each choice gets its own exact outputs, reads the prefix its shared prefill wrote (the
    executor checks every KV position), and every block comes back, also with aborts and, with 40
    blocks, preemption; plain requests run beside them."""
    rng = random.Random(depth)
    reqs, num = [], 1
    for _ in range(12):
        n = rng.choice([1, 2, 4])
        prompt = [rng.randrange(10, 900) for _ in range(rng.randrange(1, 30))]
        params = SamplingParams(max_tokens=rng.randrange(1, 20), temperature=0.0, stop_token_ids=(EOS,))
        reqs.append(AddRequest(num, prompt, params, n=n))
        num += n + 1
    aborted = {4: reqs[3].req_num + 1, 9: reqs[7].req_num + reqs[7].n}
    outputs, sched = run(reqs, depth, budget=16, num_blocks=num_blocks, abort_at=aborted)
    for r in reqs:
        for c in choice_nums(r):
            if c not in aborted.values():
                assert outputs[c] == expected(r, c), c


def test_four_choices_allocate_the_prompt_once():
    """A 300-token prompt with n = 4: its 18 whole blocks before the last token are allocated once. A
    choice's new req_index needs a block-table entry per inherited block, so with 8 req_indices (48 entries per
    step) two choices join per step."""
    bs, prompt = 16, list(range(10, 310))
    sched = Scheduler(8, 512, bs, 200, max_blocks_per_seq=32)
    layout = StepDescriptor.layout(8, 512, bs)
    sched.add_request(AddRequest(1, prompt, SamplingParams(max_tokens=4, temperature=0.0), n=4))
    # The shared prefill (288 tokens); two choices (their last 12 prompt tokens); two more, two decodes.
    for rows in (1, 2, 4):
        assert sched.schedule(StepDescriptor(layout.views(bytearray(layout.nbytes)))) == rows
    assert sched.pool.num_free_blocks == 200 - 18 - 4  # 18 shared + one block per choice
    sched.process_output(0, [], [])
    sched.process_output(1, [2, 3], [7, 7])
    sched.process_output(2, [2, 3, 4, 5], [7, 7, 7, 7])
    for c in (2, 3, 4, 5):
        sched.abort_request(c)
    assert sched.pool.num_free_blocks == 200 and sched.pool.num_free_req_indices == 8


class StubGrammar:
    """A grammar that allows every token: its rows are masked, never steady, and sit out while a token is in flight."""

    def fill_mask(self, out):
        out[:] = -1

    def accept(self, token_id):
        return True


class StubGrammarScheduler(Scheduler):
    def _new_grammar(self, params):
        return StubGrammar() if params.grammar else None


class GeneralOnlyScheduler(StubGrammarScheduler):
    """The scheduler with its steady rows turned off: every row goes through the general path."""

    def _join_steady(self, reqs):
        pass


def plan_signature(d: StepDescriptor) -> tuple:
    """What a step computes, independent of row order, req_index and block ids: its rows, and the block-table
    entries it sets as (request, index)."""
    x = read_descriptor(d)
    tokens, rows, off = x.token_ids.tolist(), [], 0
    sampled, new = set(x.sample_rows.tolist()), set(x.new_rows.tolist())
    for r, (req, k, start) in enumerate(zip(x.req_num.tolist(), x.num_scheduled_tokens.tolist(), x.start_pos.tolist())):
        rows.append(
            (
                req,
                start,
                tuple(tokens[off : off + k]),
                r in sampled,
                r in new,
                int(x.num_prompt_logprobs[r]),
                int(x.next_prompt_token[r]),
            )
        )
        off += k
    owner = dict(zip(x.req_index.tolist(), x.req_num.tolist()))
    return x.step_id, sorted(rows), sorted((owner[s], i) for s, i in zip(x.nb_req_index.tolist(), x.nb_index.tolist()))


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("max_num_seqs,budget,num_blocks", [(32, 64, 2000), (32, 64, 90), (32, 12, 2000), (32, 20, 90)])
def test_steady_rows_plan_what_the_general_path_plans(depth, max_num_seqs, budget, num_blocks, monkeypatch):
    """Step by step, the scheduler plans the same rows (tokens, positions, samples, new block-table entries)
    as the same scheduler with steady rows turned off, and finishes the same requests, through joins,
    prefills that share the budget (12 tokens for 32 rows: the budget cuts), grammar rows ahead of steady
    ones, block crossings, aborts, EOS and (90 blocks) preemptions, whose recompute needs every token in order."""
    monkeypatch.setattr(steady_rows, "_TOKEN_BUFFER", 3)
    reqs = make_requests(96, seed=12, max_len=120)
    # Long outputs keep many rows decoding at once; every seventh request has a grammar.
    reqs = [
        replace(
            r,
            params=replace(
                r.params,
                grammar="any" if r.req_num % 7 == 1 else "",
                max_tokens=r.params.max_tokens and 20 + r.req_num % 90,
            ),
        )
        for r in reqs
    ]
    aborts = {12: 5, 40: 17, 41: 30, 90: 60}
    scheds = [
        StubGrammarScheduler(max_num_seqs, budget, BS, num_blocks, 64, mask_words=1),
        GeneralOnlyScheduler(max_num_seqs, budget, BS, num_blocks, 64, mask_words=1),
    ]
    layout = StepDescriptor.layout(max_num_seqs, budget, BS, mask_words=1)
    descs = [StepDescriptor(layout.views(bytearray(layout.nbytes))) for _ in scheds]
    pending, inflight, rng, step = deque(reqs), deque(), random.Random(3), 0
    while pending or scheds[0].num_unfinished or inflight:
        if pending and rng.random() < 0.3:
            for s in scheds:
                s.add_request(pending[0])
            pending.popleft()
        if len(inflight) < depth and scheds[0].num_unfinished:
            planned = [s.schedule(d) for s, d in zip(scheds, descs)]
            assert planned[0] == planned[1], step
            if planned[0]:
                assert plan_signature(descs[0]) == plan_signature(descs[1]), f"step {step}"
                # Each one's output lists its sampled rows in its own descriptor order, as the worker's does.
                outs = []
                for d in descs:
                    x = read_descriptor(d)
                    rows = x.sample_rows.tolist()
                    last = (x.start_pos + x.num_scheduled_tokens - 1)[rows].tolist()
                    reqs = x.req_num[rows].tolist()
                    outs.append((reqs, [sampled_token(r, p) for r, p in zip(reqs, last)]))
                inflight.append(outs)
                step += 1
                if step in aborts:
                    for s in scheds:
                        s.abort_request(aborts[step])
                continue
        if inflight:
            outs = inflight.popleft()
            sid = scheds[0]._last_output_step + 1
            done = [sorted(s.process_output(sid, *out)) for s, out in zip(scheds, outs)]
            assert done[0] == done[1]
        elif pending:
            for s in scheds:
                s.add_request(pending[0])
            pending.popleft()
    assert scheds[0].num_steady_steps > 20 and scheds[1].num_steady_steps == 0
    assert scheds[0].num_preemptions == scheds[1].num_preemptions and (num_blocks > 90 or scheds[0].num_preemptions)
