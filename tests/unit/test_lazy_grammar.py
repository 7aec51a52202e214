"""The auto tool-choice grammar on the scheduler side: no mask while the text cannot reach the trigger,
the same masked positions planned asynchronously and in lock step, and only valid calls after it."""

from __future__ import annotations

import time

import numpy as np
import pytest

from pipeline.common.grammar import build_grammar, load_tokenizer
from pipeline.common.lazy_grammar import advance
from pipeline.common.messages import AddRequest, SamplingParams
from pipeline.io_proc.tool_parsers import TOOL_PARSERS, ToolSpec
from pipeline.scheduler_proc.grammar_manager import GrammarManager
from pipeline.scheduler_proc.grammar_state import GrammarState

WEATHER = ToolSpec("get_weather", {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]})
STOP = 2  # SmolLM2's <|im_end|>


@pytest.fixture(scope="module")
def tokenizers(smol_dir):
    from transformers import AutoTokenizer

    tok = load_tokenizer(str(smol_dir), 49152)
    grammars = GrammarManager(tok, 49152, 2**28, 2**30)
    yield grammars, AutoTokenizer.from_pretrained(smol_dir)
    grammars.close()


def _state(grammars: GrammarManager, parser_name: str) -> GrammarState:
    p = TOOL_PARSERS[parser_name]()
    g = build_grammar("lark", p.grammar([WEATHER], free=True, parallel=False), "tools")
    params = SamplingParams(
        max_tokens=64, stop_token_ids=(STOP,), grammar=g, grammar_trigger=p.trigger, grammar_trigger_at_start=p.anchored
    )
    grammars.add(AddRequest(1, [1], params))
    deadline = time.monotonic() + 30
    while not (ready := grammars.poll()[0]):  # compiled on the background thread
        assert time.monotonic() < deadline
        time.sleep(0.01)
    return ready[0][1][0]


def _wait(grammars: GrammarManager, state: GrammarState) -> None:
    deadline = time.monotonic() + 30
    grammars.flush()  # as the scheduler does after each output
    while not state.ready:  # the mask is computed on a grammar thread
        assert time.monotonic() < deadline
        time.sleep(0.0005)


def _accept(grammars: GrammarManager, state: GrammarState, token: int) -> bool:
    grammars.advance(state, token)
    _wait(grammars, state)
    return not state.error


def _allowed(grammars: GrammarManager, state: GrammarState, token: int) -> bool:
    _wait(grammars, state)
    return bool((state.mask.view(np.uint32)[token // 32] >> (token % 32)) & 1)


def _decode(grammars: GrammarManager, state, ids: list[int]) -> tuple[list[bool], list[bool]]:
    """Lock step's mask decisions per token, and whether asynchronous planning, with the token
    before in flight, would wait for it; each token is checked against the mask where there is one."""
    masked, waits = [], []
    for t in ids:
        waits.append(state.needs_mask(1))
        m = state.needs_mask(0)
        masked.append(m)
        if m:
            assert _allowed(grammars, state, t)
        assert _accept(grammars, state, t)
    return masked, waits


def test_free_text_is_never_masked_and_never_waits(tokenizers):
    grammars, hf = tokenizers
    st = _state(grammars, "hermes")
    ids = hf.encode("The weather in Paris is mild; use a <b>tag</b> or <tool> if you like.", add_special_tokens=False)
    masked, waits = _decode(grammars, st, ids)
    assert not any(masked) and not st.trigger.triggered
    # It waits only where the text ends with the trigger's start ("<tool_..." after "<tool_").
    assert sum(waits) <= 2


def test_the_call_after_the_trigger_is_masked_and_valid(tokenizers):
    grammars, hf = tokenizers
    st = _state(grammars, "hermes")
    text = 'Let me look. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    ids = hf.encode(text, add_special_tokens=False)
    masked, waits = _decode(grammars, st, ids)
    first = next(i for i, m in enumerate(masked) if m)
    assert hf.decode(ids[:first]).endswith("<tool_call") and all(masked[first:]) and st.trigger.triggered
    # Async planning waited for each token whose successor was masked.
    assert all(w for w, m in zip(waits[1:], masked[1:]) if m)
    # Once the call is closed, only the stop token may come.
    assert _allowed(grammars, st, STOP) and not _allowed(grammars, st, hf.encode(" ok", add_special_tokens=False)[0])


def test_a_call_with_wrong_arguments_is_masked_out(tokenizers):
    grammars, hf = tokenizers
    st = _state(grammars, "hermes")
    for t in hf.encode('<tool_call>\n{"name": "get_weather", "arguments": {"', add_special_tokens=False):
        _accept(grammars, st, t)
    assert st.trigger.triggered
    assert _allowed(grammars, st, hf.encode("city", add_special_tokens=False)[0])
    assert not _allowed(grammars, st, hf.encode("town", add_special_tokens=False)[0])


def test_anchored_trigger_decides_on_the_first_token(tokenizers):
    grammars, hf = tokenizers
    st = _state(grammars, "llama3_json")
    assert st.needs_mask(0)  # the first token may open a call
    masked, _ = _decode(grammars, st, hf.encode("Sunny, with {braces} later.", add_special_tokens=False))
    assert masked[0] and not any(masked[1:]) and not st.needs_mask(1)
    st = _state(grammars, "llama3_json")
    masked, _ = _decode(
        grammars, st, hf.encode('{"name": "get_weather", "parameters": {"city": "Oslo"}}', add_special_tokens=False)
    )
    assert all(masked) and st.trigger.triggered and _allowed(grammars, st, STOP)


def test_special_tokens_and_split_characters_leave_the_state_alone(tokenizers):
    grammars, hf = tokenizers
    st = _state(grammars, "hermes")
    im_start = hf.convert_tokens_to_ids("<|im_start|>")
    snowman = hf.encode("☃ <tool_call", add_special_tokens=False)  # a character over several tokens
    for t in [im_start, *snowman]:
        assert _accept(grammars, st, t)
    assert st.needs_mask(0) and not st.trigger.triggered
    assert _allowed(grammars, st, hf.encode(">", add_special_tokens=False)[0])


def test_advance_follows_the_trigger_across_pieces():
    t = b"<tool_call>"
    assert advance(t, 0, b"text <") == 1
    assert advance(t, 1, b"tool_") == 6
    assert advance(t, 6, b"call") == 10
    assert advance(t, 10, b">\n") == len(t)
    assert advance(t, 10, b"x") == 0
    assert advance(t, 0, b"a<tool_call>b") == len(t)
