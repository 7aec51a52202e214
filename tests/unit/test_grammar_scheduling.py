"""A grammar request under async scheduling: held out of the step after its own, masked when planned.

docs/design.md, "Structured output".
"""

from __future__ import annotations

import time

import numpy as np

from pipeline.common.grammar import build_grammar, load_tokenizer
from pipeline.common.messages import AddRequest, SamplingParams
from pipeline.common.step_protocol import MASK_BITS, PLACEHOLDER_TOKEN_ID, StepDescriptor, read_descriptor
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


def wait_ready(grammars: GrammarManager, state) -> None:
    """Until ``state``'s next mask is computed (on a grammar thread)."""
    deadline = time.monotonic() + 30
    while not state.ready:
        assert time.monotonic() < deadline
        grammars.wait_masks()


def test_grammar_row_waits_for_its_token_and_carries_its_mask(smol_dir):
    tok = load_tokenizer(str(smol_dir), V)
    words = V // MASK_BITS
    grammars = GrammarManager(tok, V, 2**28, 2**30)
    sched = Scheduler(4, 64, 16, 64, 16)
    layout = StepDescriptor.layout(4, 64, 16, words)

    def plan():
        grammars.wait_masks()
        desc = StepDescriptor(layout.views(bytearray(layout.nbytes)))
        assert sched.schedule(desc)
        return read_descriptor(desc)

    grammar = build_grammar("choice", ["yes", "no"], "guided_choice")
    sched.add_request(AddRequest(1, [5, 6, 7], SamplingParams(max_tokens=8, temperature=0.0)))
    msg = AddRequest(2, [5, 6], SamplingParams(max_tokens=8, temperature=0.0, stop_token_ids=(EOS,), grammar=grammar))
    state = add_compiled(sched, grammars, msg)
    x0 = plan()
    assert x0.req_num.tolist() == [1, 2] and x0.mask_row.tolist() == [1]
    allowed = np.flatnonzero(np.unpackbits(x0.bitmask[0].view(np.uint8), bitorder="little"))
    assert {tok.decode_str([int(t)]) for t in allowed} <= {"y", "ye", "yes", "n", "no"} and EOS not in allowed
    x1 = plan()  # step 0's tokens are not back: only the free request runs, on a placeholder
    assert x1.req_num.tolist() == [1] and x1.token_ids.tolist() == [PLACEHOLDER_TOKEN_ID] and not len(x1.mask_row)
    yes = tok.tokenize_str("yes")
    sched.process_output(0, [1, 2], [9, yes[0]])
    wait_ready(grammars, state)
    x2 = plan()
    assert x2.req_num.tolist() == [1, 2] and x2.mask_row.tolist() == [1]
    assert x2.token_ids.tolist() == [PLACEHOLDER_TOKEN_ID, yes[0]]
    if len(yes) == 1:  # the choice is complete: only the stop token may follow
        allowed = np.flatnonzero(np.unpackbits(x2.bitmask[0].view(np.uint8), bitorder="little"))
        assert allowed.tolist() == [EOS]
    grammars.close()


def test_auto_tool_row_keeps_pace_until_its_trigger(smol_dir):
    """A tool_choice auto row writing free text is planned every step on a placeholder, unmasked;
    where its next token could complete the trigger it waits for its tokens and is masked."""
    from transformers import AutoTokenizer

    from pipeline.io_proc.tool_parsers import TOOL_PARSERS, ToolSpec

    tok, hf = load_tokenizer(str(smol_dir), V), AutoTokenizer.from_pretrained(smol_dir)
    words = V // MASK_BITS
    grammars = GrammarManager(tok, V, 2**28, 2**30)
    sched = Scheduler(4, 64, 16, 64, 16)
    layout = StepDescriptor.layout(4, 64, 16, words)
    parser = TOOL_PARSERS["hermes"]()
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    grammar = build_grammar("lark", parser.grammar([ToolSpec("f", schema)], free=True, parallel=False), "tools")
    params = SamplingParams(
        max_tokens=40, temperature=0.0, stop_token_ids=(EOS,), grammar=grammar, grammar_trigger=parser.trigger
    )
    state = add_compiled(sched, grammars, AddRequest(1, [5, 6], params))
    text = hf.encode('A free answer first. <tool_call>\n{"name": "f"', add_special_tokens=False)
    in_flight: list[int] = []  # steps planned whose output has not come back
    pipelined, masked = [], []  # per output token: planned with a step in flight; sampled under a mask
    while len(masked) < len(text):
        while len(in_flight) < 2:  # as the scheduler's loop: at most two steps in flight
            wait_ready(grammars, state)
            step = sched.next_step_id
            desc = StepDescriptor(layout.views(bytearray(layout.nbytes)))
            if not sched.schedule(desc):
                break
            pipelined.append(bool(in_flight))
            masked.append(bool(len(read_descriptor(desc).mask_row)))
            in_flight.append(step)
        sched.process_output(in_flight.pop(0), [1], [text[len(sched.requests[1].output_token_ids)]])
    k = next(i for i in range(len(text)) if hf.decode(text[:i]).endswith("<tool_"))
    t = next(i for i in range(len(text)) if hf.decode(text[:i]).endswith("<tool_call"))
    assert all(pipelined[1 : k + 1]) and not any(masked[:t]), (pipelined, masked)
    assert all(masked[t:]) and not any(pipelined[t + 1 :])
    grammars.close()
