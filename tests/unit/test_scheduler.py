"""The scheduler against a reference executor that checks the step protocol.

The executor below plays the worker's part in one process: it keeps a
token-id cache and block table per req_index, resolves placeholders, and
"samples" token ``f(request, position)``, so every request has one correct
output sequence. It asserts what a real device would silently get wrong: a
placeholder resolving to another request's or a consumed token, a block
written while a step in flight of another request reads it, a KV position
read before it was written or holding keys of another prefix (blocks found
in the prefix cache included). Every run is checked with prefix caching on
and off, and the block pool's invariant after every step.
"""

from __future__ import annotations

import random
from collections import deque

import numpy as np
import pytest
from msgspec.structs import replace

from pipeline.common.block_hash import root_hash
from pipeline.common.messages import AddRequest, SamplingParams
from pipeline.common.step_protocol import PLACEHOLDER_TOKEN_ID, StepDescriptor, StepInputs, read_descriptor
from pipeline.scheduler_proc import steady_rows
from pipeline.scheduler_proc.scheduler import Scheduler
from tests.unit.pool_invariant import check_pool

EOS = 3
BS = 4
ROOT = root_hash("test-model", "float32")


def sampled_token(req_num: int, pos: int) -> int:
    """Token a request samples after position ``pos``; EOS now and then."""
    h = (req_num * 1_000_003 + pos * 7919) % 997
    return EOS if h < 8 else 10 + h


class ReferenceExecutor:
    """Executes descriptors like the worker does, with checks instead of a model.

    As the worker, a step writes every row's keys and values before any row
    reads: a row may read blocks another row of the same step writes.
    """

    def __init__(self, num_indices: int, prompts: dict[int, list[int]]):
        self.prompts = prompts  # req_num -> its prompt
        self.token_cache = [None] * num_indices
        self.block_table = [dict() for _ in range(num_indices)]
        self.kv = {}  # (block, offset) -> (pos, signature of the tokens up to pos)
        self.index_owner = [None] * num_indices
        self.sampled = {}  # (req_num, pos) -> the token sampled for that position
        self.prompt_lp_positions = {}  # req_num -> positions whose prompt log-probability was computed
        self._sig = {}  # (req_num, pos) -> signature

    def signature(self, req: int, pos: int) -> int:
        """Stands for the keys and values at ``pos``: they depend on every token up to it."""
        key = (req, pos)
        if key not in self._sig:
            prompt = self.prompts[req]
            tok = prompt[pos] if pos < len(prompt) else self.sampled[key]
            self._sig[key] = hash((self.signature(req, pos - 1) if pos else 0, tok))
        return self._sig[key]

    def execute(self, x: StepInputs, inflight_refs: set) -> tuple[int, list[int], list[int], set]:
        """Run step ``x`` (as the worker reads it); ``inflight_refs``: the req_indices and blocks of steps in flight.

        Returns (step id, sampled request numbers, sampled tokens, what this step references).
        """
        readers: dict[int, set] = {}  # block -> requests whose steps in flight read it
        for ref in inflight_refs:
            if ref[0] == "block":
                readers.setdefault(ref[1], set()).add(ref[2])
        for s, i, b in zip(x.nb_req_index.tolist(), x.nb_index.tolist(), x.nb_block.tolist()):
            self.block_table[s][i] = b
        refs = set()
        tok = x.token_ids.tolist()
        new_rows, sample_rows = set(x.new_rows.tolist()), set(x.sample_rows.tolist())
        rows, off = [], 0
        for r in range(len(x.req_num)):  # every row's writes first
            req, idx = int(x.req_num[r]), int(x.req_index[r])
            k, start = int(x.num_scheduled_tokens[r]), int(x.start_pos[r])
            if r in new_rows:
                assert ("index", idx) not in inflight_refs, f"req_index {idx} reused while a step in flight reads it"
                self.index_owner[idx] = req
                self.token_cache[idx] = None
            assert self.index_owner[idx] == req, "req_index shared by two live requests"
            for j in range(k):
                pos, t = start + j, tok[off + j]
                if t == PLACEHOLDER_TOKEN_ID:
                    cached = self.token_cache[idx]
                    assert cached is not None, f"placeholder of req {req} read a consumed/empty cache entry"
                    t = cached
                    self.token_cache[idx] = None  # poison
                assert self.sampled.get((req, pos), t) == t, f"req {req} pos {pos}: input {t} is not the sampled token"
                if pos >= len(self.prompts[req]):
                    self.sampled[(req, pos)] = t
                else:
                    assert t == self.prompts[req][pos], f"req {req} pos {pos}: input {t} is not its prompt's"
                b = self.block_table[idx][pos // BS]
                assert readers.get(b, set()) <= {req}, f"req {req} writes block {b}, which {readers[b]} read in flight"
                self.kv[(b, pos % BS)] = (pos, self.signature(req, pos))
            refs.add(("index", idx))
            refs.update(("block", self.block_table[idx][i], req) for i in range((start + k - 1) // BS + 1))
            rows.append((r, req, idx, k, start))
            off += k
        out_req, out_tok = [], []
        for r, req, idx, k, start in rows:
            # Every earlier position of this request holds its own prefix's keys, whoever wrote them.
            for p in range(start + k):
                got = self.kv.get((self.block_table[idx][p // BS], p % BS))
                assert got == (p, self.signature(req, p)), f"req {req} pos {p}: KV holds {got}"
            m = int(x.num_prompt_logprobs[r])
            assert 0 <= m <= k and (x.next_prompt_token[r] >= 0) == (m == k > 0)
            if m == k > 0:  # the next chunk must start with it
                assert int(x.next_prompt_token[r]) == self.prompts[req][start + k]
            self.prompt_lp_positions.setdefault(req, set()).update(range(start + 1, start + m + 1))
            if r in sample_rows:
                y = sampled_token(req, start + k - 1)
                self.sampled[(req, start + k)] = y
                self.token_cache[idx] = y
                out_req.append(req)
                out_tok.append(y)
        return x.step_id, out_req, out_tok, refs


def check_invariant(sched: Scheduler) -> None:
    running = [r for r in sched.requests.values() if r.req_index >= 0]
    assert all(not r.block_ids for r in sched.requests.values() if r.req_index < 0), "a waiting request holds blocks"
    check_pool(sched.pool, [r.block_ids for r in running], [r.req_index for r in running])


def run(
    requests,
    depth: int,
    max_num_seqs=8,
    budget=16,
    num_blocks=64,
    abort_at=None,
    seed=0,
    max_blocks_per_seq=16,
    caching=(True, False),
    after=None,
):
    """Drive a Scheduler with ``depth`` steps in flight, with prefix caching on and off; return outputs per
    request (equal both ways) and the scheduler of the first way.

    ``after`` maps a request number to one whose finish it waits for before it arrives.
    """
    results = [
        _run(requests, depth, max_num_seqs, budget, num_blocks, abort_at, seed, max_blocks_per_seq, c, after or {})
        for c in caching
    ]
    for outputs, _ in results[1:]:
        assert outputs == results[0][0], "outputs differ with prefix caching on and off"
    return results[0]


def _run(requests, depth, max_num_seqs, budget, num_blocks, abort_at, seed, max_blocks_per_seq, caching, after):
    layout = StepDescriptor.layout(max_num_seqs, budget, BS, max_blocks_per_seq=max_blocks_per_seq)
    sched = Scheduler(
        max_num_seqs,
        budget,
        BS,
        num_blocks,
        max_blocks_per_seq=max_blocks_per_seq,
        enable_prefix_caching=caching,
        block_hash_root=ROOT,
    )
    ex = ReferenceExecutor(max_num_seqs, {c: list(r.prompt_token_ids) for r in requests for c in choice_nums(r)})
    outputs = {c: [] for r in requests for c in choice_nums(r)}
    finished = set()
    pending = deque(requests)
    inflight = deque()
    rng = random.Random(seed)
    step = 0

    def may_arrive() -> bool:
        return bool(pending) and after.get(pending[0].req_num, 0) in finished | {0}

    while pending or sched.num_unfinished or inflight:
        while may_arrive() and rng.random() < 0.5:
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
                check_invariant(sched)
                continue
        if inflight:
            sid, reqs, toks, _ = inflight.popleft()
            for r, t in zip(reqs, toks):
                if r not in finished and r in sched.requests:
                    outputs[r].append(t)
            finished.update(sched.process_output(sid, reqs, toks))
            check_invariant(sched)
        elif may_arrive():
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
    return [req.req_num + i for i in range(req.n)]


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
    """n > 1: each choice gets its own exact outputs, reads the prefix the first choice wrote (the
    executor checks every KV position), and every block comes back, also with aborts and, with 40
    blocks, preemption; plain requests run beside them."""
    rng = random.Random(depth)
    reqs, num = [], 1
    for _ in range(12):
        n = rng.choice([1, 2, 4])
        prompt = [rng.randrange(10, 900) for _ in range(rng.randrange(1, 30))]
        params = SamplingParams(max_tokens=rng.randrange(1, 20), temperature=0.0, stop_token_ids=(EOS,))
        reqs.append(AddRequest(num, prompt, params, n=n))
        num += n
    aborted = {4: reqs[3].req_num + reqs[3].n - 1, 9: reqs[7].req_num + reqs[7].n - 1}
    outputs, sched = run(reqs, depth, budget=16, num_blocks=num_blocks, abort_at=aborted)
    assert sched.prefix.num_hits > 0
    for r in reqs:
        for c in choice_nums(r):
            if c not in aborted.values():
                assert outputs[c] == expected(r, c), c


@pytest.mark.parametrize(
    "cached_rows, tokens",
    [(True, [[300, 12, 12, 12], [1, 1, 1, 1]]), (False, [[300, 12], [1, 1, 12, 12]])],
    ids=["room-for-cached-rows", "no-room"],
)
def test_four_choices_allocate_the_prompt_once(cached_rows, tokens):
    """A 300-token prompt with n = 4: its 18 whole blocks before the last token are computed and allocated once.

    Choice 0 computes the prompt; the others find its blocks in the prefix cache, in the very step that
    computes them, and compute only their last 12 tokens. A choice's new req_index needs a block-table
    entry per block: the ring entry has room for whole cached rows, so all four start in the first step;
    an entry without that room (48 entries per step) lets two choices join per step.
    """
    bs, prompt = 16, list(range(10, 310))
    sched = Scheduler(8, 512, bs, 200, max_blocks_per_seq=32, block_hash_root=ROOT)
    layout = StepDescriptor.layout(8, 512, bs, max_blocks_per_seq=32 if cached_rows else 0)
    sched.add_request(AddRequest(1, prompt, SamplingParams(max_tokens=4, temperature=0.0), n=4))
    planned = []
    for step in range(2):
        d = StepDescriptor(layout.views(bytearray(layout.nbytes)))
        assert sched.schedule(d) == len(tokens[step])
        planned.append(read_descriptor(d).num_scheduled_tokens.tolist())
    assert planned == tokens
    assert sched.pool.num_free_blocks == 200 - 18 - 4  # 18 shared + one block per choice
    assert (sched.prefix.num_queries, sched.prefix.num_hits) == (4 * 300, 3 * 288)
    assert sched.admitted == [(1, 0), (2, 288), (3, 288), (4, 288)]
    sched.process_output(0, [1, 2, 3, 4][: len(tokens[0])], [7] * len(tokens[0]))
    sched.process_output(1, [1, 2, 3, 4], [7, 7, 7, 7])
    for c in (1, 2, 3, 4):
        sched.abort_request(c)
    assert sched.pool.num_free_blocks == 200 and sched.pool.num_free_req_indices == 8
    check_invariant(sched)


class StubGrammar:
    """A grammar that allows every token: its rows are masked and never steady; its masks are cheap, so its
    rows decode every step."""

    ready = True
    costly = False
    error = ""
    mask = np.full(1, -1, np.int32)

    def needs_mask(self, in_flight):
        return True


class StubGrammars:
    """The grammar manager of ``StubGrammar``s: advancing and releasing one changes nothing."""

    def advance(self, state, token_id, awaited=False):
        pass

    def release(self, state):
        pass


def add(sched: Scheduler, msg: AddRequest) -> None:
    sched.add_request(msg, [StubGrammar() for _ in range(msg.n)] if msg.params.grammar else None)


class GeneralOnlyScheduler(Scheduler):
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
        Scheduler(max_num_seqs, budget, BS, num_blocks, 64, grammars=StubGrammars()),
        GeneralOnlyScheduler(max_num_seqs, budget, BS, num_blocks, 64, grammars=StubGrammars()),
    ]
    layout = StepDescriptor.layout(max_num_seqs, budget, BS)
    descs = [StepDescriptor(layout.views(bytearray(layout.nbytes))) for _ in scheds]
    pending, inflight, rng, step = deque(reqs), deque(), random.Random(3), 0
    while pending or scheds[0].num_unfinished or inflight:
        if pending and rng.random() < 0.3:
            for s in scheds:
                add(s, pending[0])
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
                add(s, pending[0])
            pending.popleft()
    assert scheds[0].num_steady_steps > 20 and scheds[1].num_steady_steps == 0
    assert scheds[0].num_preemptions == scheds[1].num_preemptions and (num_blocks > 90 or scheds[0].num_preemptions)


# -- prefix caching --------------------------------------------------------------


def chat(num: int, prompt: list[int], max_tokens: int, **params) -> AddRequest:
    return AddRequest(num, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **params))


@pytest.mark.parametrize("depth", [1, 2], ids=["lock-step", "async"])
@pytest.mark.parametrize("system_len", [3 * BS - 1, 3 * BS, 3 * BS + 1], ids=["boundary-1", "boundary", "boundary+1"])
@pytest.mark.parametrize("together", [True, False], ids=["together", "one-after-another"])
def test_a_shared_system_prompt(depth, system_len, together):
    """Users sharing a system prompt that ends one token before a block boundary, on it, one after: the
    outputs are exact with the cache on and off, and the cache is hit, arriving together or one by one."""
    rng = random.Random(system_len)
    system = [rng.randrange(10, 900) for _ in range(system_len)]
    reqs = [chat(i, system + [rng.randrange(10, 900) for _ in range(rng.randrange(0, 9))], 6) for i in range(1, 9)]
    after = {} if together else {i: i - 1 for i in range(2, 9)}
    outputs, sched = run(reqs, depth, budget=64, after=after)
    for r in reqs:
        assert outputs[r.req_num] == expected(r)
    # Each later user finds every whole block of the system prompt, less one holding its own last token,
    # also in the very step that computes it.
    want = sum(min(system_len // BS, (len(r.prompt_token_ids) - 1) // BS) * BS for r in reqs[1:])
    assert sched.prefix.num_hits == want > 0


@pytest.mark.parametrize("depth", [1, 2], ids=["lock-step", "async"])
@pytest.mark.parametrize("background", [False, True], ids=["alone", "beside-a-long-request"])
def test_a_conversation_resent_turn_by_turn(depth, background):
    """Each turn resends the previous turn's prompt, its reply and a new message: it finds its whole
    history cached, the reply's blocks (named as the reply's tokens became final) included. Beside a
    long request a step is in flight when a turn ends, so its blocks' naming is deferred: the next
    turn, arriving at once, still finds them."""
    rng = random.Random(depth)
    prompt, reqs = [rng.randrange(10, 900) for _ in range(10)], []
    for turn in range(1, 6):
        req = chat(turn, prompt, 7)
        reqs.append(req)
        prompt = prompt + expected(req) + [rng.randrange(10, 900) for _ in range(3)]
    long = [chat(9, [rng.randrange(10, 900) for _ in range(5)], 100)] if background else []
    outputs, sched = run(
        long + reqs, depth, after={t: t - 1 for t in range(2, 6)}, max_blocks_per_seq=32, num_blocks=128
    )
    for r in long + reqs:
        assert outputs[r.req_num] == expected(r)
    history = sum((len(r.prompt_token_ids) + 7) // BS * BS for r in reqs[:-1])  # each turn's final whole blocks
    assert sched.prefix.num_hits == history


@pytest.mark.parametrize("depth", [1, 2])
def test_a_prompt_entirely_cached(depth):
    """The same prompt again, whole blocks only: its last block is computed again (its last token's
    logits are needed), in a block of its own, and everything else is found."""
    prompt = list(range(10, 10 + 4 * BS))
    reqs = [chat(1, prompt, 5), chat(2, prompt, 5), chat(3, prompt + [77], 5)]
    outputs, sched = run(reqs, depth, after={2: 1, 3: 2})
    for r in reqs:
        assert outputs[r.req_num] == expected(r)
    assert sched.prefix.num_hits == 3 * BS + 4 * BS  # request 2: all but the last block; request 3: all four
    assert sched.admitted[1:] == [(2, 3 * BS), (3, 4 * BS)]


@pytest.mark.parametrize("depth", [1, 2])
def test_preemption_and_aborts_mid_prefill_with_shared_prefixes(depth):
    """Under KV pressure, users of a few shared prefixes are preempted (their blocks stay cached for their
    return) and some are aborted while their prompt is being prefilled in chunks; a sharer's abort or
    preemption never frees a block another still uses (the executor checks every KV position)."""
    rng = random.Random(7 + depth)
    prefixes = [[rng.randrange(10, 900) for _ in range(n)] for n in (9, 16, 23)]
    reqs = []
    for i in range(1, 41):
        prompt = rng.choice(prefixes) + [rng.randrange(10, 900) for _ in range(rng.randrange(0, 12))]
        reqs.append(chat(i, prompt, rng.randrange(1, 30)))
    aborted = {6: 3, 11: 9, 12: 10, 30: 25}
    outputs, sched = run(reqs, depth, budget=8, num_blocks=24, abort_at=aborted, max_blocks_per_seq=16)
    assert sched.num_preemptions > 0 and sched.prefix.num_hits > 0
    for r in reqs:
        if r.req_num not in aborted.values():
            assert outputs[r.req_num] == expected(r)


def test_what_needs_every_prompt_position_skips_the_lookup():
    """Prompt log-probabilities need every position's logits, and the worker counts the repetition
    penalty's prompt tokens from the tokens it computes: such requests compute their whole prompt (and
    still leave it cached for others)."""
    prompt = list(range(10, 10 + 5 * BS))
    reqs = [
        chat(1, prompt, 3),
        chat(2, prompt, 3, prompt_logprobs=0),
        chat(3, prompt, 3, repetition_penalty=1.2),
        chat(4, prompt, 3, presence_penalty=0.5),  # counts output tokens only: a first admission may reuse
    ]
    outputs, sched = run(reqs, depth=2, after={2: 1, 3: 2, 4: 3})
    assert sched.admitted == [(1, 0), (2, 0), (3, 0), (4, 4 * BS)]
    assert sched.prefix.num_queries == 2 * 5 * BS
