"""A grammar request under async scheduling: planned every step, its mask written once its token is known.

docs/design.md, "Structured output".
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from pipeline.common.grammar import build_grammar, load_tokenizer
from pipeline.common.messages import AddRequest, SamplingParams
from pipeline.common.step_protocol import MASK_BITS, PLACEHOLDER_TOKEN_ID, StepDescriptor, TokenMasks, read_descriptor
from pipeline.scheduler_proc import grammar_state
from pipeline.scheduler_proc.grammar_manager import GrammarManager
from pipeline.scheduler_proc.scheduler import Scheduler

V, EOS = 49152, 2


def add_compiled(sched: Scheduler, grammars: GrammarManager, msg: AddRequest):
    """Queue ``msg`` once the manager has compiled its grammar (on its background thread); its state."""
    grammars.add(msg)
    deadline = time.monotonic() + 30
    while not (ready := grammars.poll()[0]):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    ((_, states, _),) = ready
    sched.add_request(msg, states)
    return states[0]


@pytest.fixture
def cheap_masks(monkeypatch):
    """Every mask counts as cheap: on a loaded machine one can take over ``PACE_MASK_S``, and its row would
    then sit out a step (``test_costly_grammar_row_sits_out_instead_of_holding_the_step``)."""
    monkeypatch.setattr(grammar_state, "PACE_MASK_S", 10.0)


def write_masks(sched: Scheduler, grammars: GrammarManager, words: int) -> tuple[int, np.ndarray]:
    return write_masks_for(sched, grammars, words, 4)


def write_masks_for(sched: Scheduler, grammars: GrammarManager, words: int, rows: int) -> tuple[int, np.ndarray]:
    """The oldest planned step's masks, as the scheduler's loop writes them once their tokens are known."""
    deadline = time.monotonic() + 30
    while not sched.masks.oldest_ready():
        assert time.monotonic() < deadline
        grammars.wait_masks()
    layout = TokenMasks.layout(rows, words * MASK_BITS)
    entry = TokenMasks(layout.views(bytearray(layout.nbytes)))
    step_id = sched.masks.write_oldest(entry)
    assert entry.step_id == step_id and entry.mask_words == words
    return step_id, entry.bitmask[: entry.num_masks].copy()


def planner(sched: Scheduler):
    """Plans ``sched``'s next step (4 rows, 64 tokens, blocks of 16) and returns the worker's copy of it."""
    layout = StepDescriptor.layout(4, 64, 16)

    def plan():
        desc = StepDescriptor(layout.views(bytearray(layout.nbytes)))
        assert sched.schedule(desc)
        return read_descriptor(desc)

    return plan


def allowed_ids(mask: np.ndarray) -> list[int]:
    return np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little")).tolist()


def test_grammar_row_runs_every_step_and_its_mask_follows(smol_dir, cheap_masks):
    """Under async scheduling a constrained row is planned on a placeholder like any other; the mask of
    the step it samples in is written once the token in flight is known."""
    tok = load_tokenizer(str(smol_dir), V)
    words = V // MASK_BITS
    grammars = GrammarManager(tok, V, 2**28, 2**30)
    sched = Scheduler(4, 64, 16, 64, 16, grammars=grammars)
    plan = planner(sched)

    grammar = build_grammar("choice", ["yes", "no"], "guided_choice")
    sched.add_request(AddRequest(1, [5, 6, 7], SamplingParams(max_tokens=8, temperature=0.0)))
    msg = AddRequest(2, [5, 6], SamplingParams(max_tokens=8, temperature=0.0, stop_token_ids=(EOS,), grammar=grammar))
    state = add_compiled(sched, grammars, msg)
    x0 = plan()
    assert x0.req_num.tolist() == [1, 2] and x0.mask_row.tolist() == [1] and x0.num_masked_rows == 1
    step, masks = write_masks(sched, grammars, words)
    assert step == 0 and len(masks) == 1
    assert {tok.decode_str([t]) for t in allowed_ids(masks[0])} <= {"y", "ye", "yes", "n", "no"}
    assert EOS not in allowed_ids(masks[0])
    x1 = plan()  # step 0's tokens are not back: both rows run on placeholders, the grammar's mask to follow
    assert x1.req_num.tolist() == [1, 2] and x1.token_ids.tolist() == [PLACEHOLDER_TOKEN_ID] * 2
    assert x1.mask_row.tolist() == [1] and len(sched.masks) == 1 and not sched.masks.oldest_ready()
    yes = tok.tokenize_str("yes")
    sched.process_output(0, [1, 2], [9, yes[0]])
    step, masks = write_masks(sched, grammars, words)
    assert step == 1 and len(sched.masks) == 0
    if len(yes) == 1:  # the choice is complete: only the stop token may follow
        assert allowed_ids(masks[0]) == [EOS]
    sched.abort_request(2)  # a row whose request has gone gets a mask that allows everything
    x2 = plan()
    assert x2.req_num.tolist() == [1]
    x3 = plan()
    assert x3.req_num.tolist() == [1] and state.error == ""
    grammars.close()


def test_auto_tool_row_keeps_pace_through_its_trigger(smol_dir, cheap_masks):
    """A tool_choice auto row is planned every step on a placeholder, before and after its trigger;
    its mask allows everything while the text is free and constrains the call after the trigger."""
    from transformers import AutoTokenizer

    from pipeline.io_proc.tool_parsers import TOOL_PARSERS, ToolSpec

    tok, hf = load_tokenizer(str(smol_dir), V), AutoTokenizer.from_pretrained(smol_dir)
    words = V // MASK_BITS
    grammars = GrammarManager(tok, V, 2**28, 2**30)
    sched = Scheduler(4, 64, 16, 64, 16, grammars=grammars)
    layout = StepDescriptor.layout(4, 64, 16)
    parser = TOOL_PARSERS["hermes"]()
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    grammar = build_grammar("lark", parser.grammar([ToolSpec("f", schema)], free=True, parallel=False), "tools")
    params = SamplingParams(
        max_tokens=40, temperature=0.0, stop_token_ids=(EOS,), grammar=grammar, grammar_trigger=parser.trigger
    )
    add_compiled(sched, grammars, AddRequest(1, [5, 6], params))
    text = hf.encode('A free answer first. <tool_call>\n{"name": "f"', add_special_tokens=False)
    in_flight: list[int] = []  # steps planned whose output has not come back
    pipelined, constrained = [], []  # per output token: planned with a step in flight; sampled under a mask
    while len(constrained) < len(text):
        while len(in_flight) < 2:  # as the scheduler's loop: at most two steps in flight
            step = sched.next_step_id
            desc = StepDescriptor(layout.views(bytearray(layout.nbytes)))
            if not sched.schedule(desc):
                break
            pipelined.append(bool(in_flight))
            in_flight.append((step, len(read_descriptor(desc).mask_row)))
        step, num_masks = in_flight.pop(0)
        mask = None
        if num_masks:  # the worker samples the step once its masks are written
            got, masks = write_masks(sched, grammars, words)
            assert got == step
            mask = masks[0]
        constrained.append(mask is not None and bool((mask != -1).any()))
        sched.process_output(step, [1], [text[len(sched.requests[1].output_token_ids)]])
    t = next(i for i in range(len(text)) if hf.decode(text[:i]).endswith("<tool_call"))
    assert all(pipelined[1:]), pipelined
    assert not any(constrained[:t]) and all(constrained[t + 1 :]), constrained
    grammars.close()


def test_every_step_carries_every_constrained_row(smol_dir, cheap_masks):
    """256 JSON-schema requests under async scheduling: once admitted, every step plans every live row,
    each advances a token per step, and each step's masks come in one entry (no cap on masked rows)."""
    rows = 256
    tok = load_tokenizer(str(smol_dir), V)
    words = V // MASK_BITS
    grammars = GrammarManager(tok, V, 2**30, 2**32)
    sched = Scheduler(rows, 4096, 16, 4096, 16, grammars=grammars)
    layout = StepDescriptor.layout(rows, 4096, 16)
    schema = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}
    grammar = build_grammar("json_schema", schema, "response_format")
    text = tok.tokenize_str('{"a": "' + "x" * 64)
    params = SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=(EOS,), grammar=grammar)
    grammars.add(AddRequest(1000, [5, 6, 7], params, n=rows))  # n choices: one matcher each
    deadline = time.monotonic() + 60
    while not (ready := grammars.poll()[0]):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    ((msg, states, _),) = ready
    sched.add_request(msg, states)
    in_flight, per_step = [], []
    while sched.num_unfinished:
        while len(in_flight) < 2 and sched.num_unfinished:
            desc = StepDescriptor(layout.views(bytearray(layout.nbytes)))
            step = sched.next_step_id
            if not sched.schedule(desc):
                break
            x = read_descriptor(desc)
            per_step.append((len(x.req_num), x.num_masked_rows, len(sched.requests)))
            in_flight.append((step, x.req_num.tolist(), x.num_masked_rows))
        step, nums, num_masks = in_flight.pop(0)
        got, masks = write_masks_for(sched, grammars, words, rows)
        assert got == step and len(masks) == num_masks == len(nums)
        outs = [text[len(sched.requests[r].output_token_ids)] if r in sched.requests else EOS for r in nums]
        sched.process_output(step, nums, outs)
    assert per_step[0][:2] == (rows, rows)  # all admitted in the first step, every row masked
    assert all(n == m == rows for n, m, _ in per_step[1:12]), per_step  # then every step carries them all
    assert len(per_step) == 12  # 12 tokens each in 12 steps: none sat out
    grammars.close()


def test_costly_grammar_row_sits_out_instead_of_holding_the_step(smol_dir):
    """A row whose mask takes milliseconds (computed on the background thread) is planned only with its
    token known and its mask ready, so the other rows' sampling never waits for it."""
    tok = load_tokenizer(str(smol_dir), V)
    grammars = GrammarManager(tok, V, 2**28, 2**30)
    sched = Scheduler(4, 64, 16, 64, 16, grammars=grammars)
    plan = planner(sched)

    sched.add_request(AddRequest(1, [5, 6, 7], SamplingParams(max_tokens=8, temperature=0.0)))
    bomb = build_grammar("regex", "a{100000}", "guided_regex")  # its first mask builds a 40 MB lexer
    params = SamplingParams(max_tokens=8, temperature=0.0, stop_token_ids=(EOS,), grammar=bomb)
    state = add_compiled(sched, grammars, AddRequest(2, [5, 6], params))
    assert state.costly
    assert plan().req_num.tolist() == [1, 2]
    assert plan().req_num.tolist() == [1]  # its token is in flight: it sits out
    grammars.close()


@pytest.mark.parametrize(("device_ms", "planned"), [(1, [1]), (1000, [1, 2])])
def test_a_slow_device_step_hides_a_costly_mask(smol_dir, device_ms, planned):
    """The budget for costly masks is a quarter of the steps' device time (at least 1 ms): behind a 1 s
    forward pass the costly row runs while its mask is computed; behind 1 ms steps it sits out."""
    tok = load_tokenizer(str(smol_dir), V)
    grammars = GrammarManager(tok, V, 2**28, 2**30)
    sched = Scheduler(4, 64, 16, 64, 16, grammars=grammars)
    plan = planner(sched)
    sched.add_request(AddRequest(1, [5, 6, 7], SamplingParams(max_tokens=8, temperature=0.0)))
    bomb = build_grammar("regex", "a{100000}", "guided_regex")
    params = SamplingParams(max_tokens=8, temperature=0.0, stop_token_ids=(EOS,), grammar=bomb)
    state = add_compiled(sched, grammars, AddRequest(2, [5, 6], params))
    assert plan().req_num.tolist() == [1, 2]
    assert plan().req_num.tolist() == [1]
    (a,) = tok.tokenize_str("a")
    busy = threading.Event()
    grammars._background.submit(busy.wait, 30)  # its next mask waits behind this job
    sched.process_output(0, [1, 2], [9, a], device_ns=device_ms * 10**6)
    assert state.costly and not state.ready
    assert plan().req_num.tolist() == planned
    busy.set()
    grammars.close()


def test_jump_forward_names_the_forced_tokens_as_drafts(smol_dir, cheap_masks):
    """With jump-forward, a constrained row whose grammar forces its next tokens verifies them as drafts
    the descriptor names (not the proposer's), and its step's masks are walked over them: one per sampled
    position, each allowing its forced token."""
    tok = load_tokenizer(str(smol_dir), V)
    words = V // MASK_BITS
    grammars = GrammarManager(tok, V, 2**28, 2**30, jump_forward=True)
    sched = Scheduler(4, 64, 16, 64, 16, num_speculative_tokens=3, adaptive_speculation=False, grammars=grammars,
                      grammar_drafts=True, jump_forward=True)  # fmt: skip
    plan = planner(sched)
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "species": {"enum": ["cat", "dog"]}},
        "required": ["name", "species"],
        "x-guidance": {"whitespace_flexible": False},
    }
    grammar = build_grammar("json_schema", schema, "response_format")
    params = SamplingParams(max_tokens=32, temperature=0.0, stop_token_ids=(EOS,), grammar=grammar)
    state = add_compiled(sched, grammars, AddRequest(1, [5, 6, 7], params))
    at, head = state.forced
    assert at == 0 and tok.decode_str(head) == '{"name'  # the object's start and its first key are forced
    x0 = plan()
    assert x0.num_draft_tokens.tolist() == [0]  # new at its req_index: nothing proposed there yet
    write_masks_for(sched, grammars, words, 4)
    sched.process_output(0, [1], [head[0]])
    grammars.wait_masks()  # as the scheduler's loop waits before planning, with jump-forward on
    x1 = plan()
    forced = head[1:]
    k = min(3, len(forced))  # with no other row drafting, k is the longest forced run's (at most K)
    named = forced[:k]
    assert x1.num_draft_tokens.tolist() == [k] and x1.token_ids.tolist() == [head[0], *named]
    step, masks = write_masks_for(sched, grammars, words, 4 * (1 + k))
    assert step == 1 and len(masks) == 1 + k
    for j, t in enumerate(named):
        assert t in allowed_ids(masks[j]), j
    # All accepted, then the bonus: one output, one advance; the next forced run starts from there.
    sched.process_output(1, [1] * (k + 1), [*named, tok.tokenize_str('":"')[0]])
    grammars.wait_masks()
    assert state.forced[0] == 1 + k + 1 and state.error == ""
    grammars.close()
