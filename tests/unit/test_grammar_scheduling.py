"""A grammar request under async scheduling: held out of the step after its own, masked when planned.

docs/design.md, "Structured output".
"""

from __future__ import annotations

import numpy as np

from pipeline.common.grammar import build_grammar, load_tokenizer
from pipeline.common.messages import AddRequest, SamplingParams
from pipeline.common.step_protocol import MASK_BITS, PLACEHOLDER_TOKEN_ID, StepDescriptor, read_descriptor
from pipeline.scheduler_proc.scheduler import Scheduler

V, EOS = 49152, 2


def test_grammar_row_waits_for_its_token_and_carries_its_mask(smol_dir):
    tok = load_tokenizer(str(smol_dir), V)
    words = V // MASK_BITS
    sched = Scheduler(4, 64, 16, 64, 16, tok, words)
    layout = StepDescriptor.layout(4, 64, 16, words)

    def plan():
        desc = StepDescriptor(layout.views(bytearray(layout.nbytes)))
        assert sched.schedule(desc)
        return read_descriptor(desc)

    grammar = build_grammar("choice", ["yes", "no"], "guided_choice")
    sched.add_request(AddRequest(1, [5, 6, 7], SamplingParams(max_tokens=8, temperature=0.0)))
    sched.add_request(
        AddRequest(2, [5, 6], SamplingParams(max_tokens=8, temperature=0.0, stop_token_ids=(EOS,), grammar=grammar))
    )
    x0 = plan()
    assert x0.req_num.tolist() == [1, 2] and x0.mask_row.tolist() == [1]
    allowed = np.flatnonzero(np.unpackbits(x0.bitmask[0].view(np.uint8), bitorder="little"))
    assert {tok.decode_str([int(t)]) for t in allowed} <= {"y", "ye", "yes", "n", "no"} and EOS not in allowed
    x1 = plan()  # step 0's tokens are not back: only the free request runs, on a placeholder
    assert x1.req_num.tolist() == [1] and x1.token_ids.tolist() == [PLACEHOLDER_TOKEN_ID] and not len(x1.mask_row)
    yes = tok.tokenize_str("yes")
    sched.process_output(0, [1, 2], [9, yes[0]])
    x2 = plan()
    assert x2.req_num.tolist() == [1, 2] and x2.mask_row.tolist() == [1]
    assert x2.token_ids.tolist() == [PLACEHOLDER_TOKEN_ID, yes[0]]
    if len(yes) == 1:  # the choice is complete: only the stop token may follow
        allowed = np.flatnonzero(np.unpackbits(x2.bitmask[0].view(np.uint8), bitorder="little"))
        assert allowed.tolist() == [EOS]
