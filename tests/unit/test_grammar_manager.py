"""The scheduler's grammar manager: compile once per grammar off the loop, masks on threads, bounded memory, errors.

docs/design.md, "Structured output".
"""

from __future__ import annotations

import time

import llguidance
import numpy as np
import pytest

from pipeline.common.grammar import build_grammar, load_tokenizer
from pipeline.common.memory import heap_in_use
from pipeline.common.messages import AddRequest, SamplingParams
from pipeline.scheduler_proc import grammar_manager
from pipeline.scheduler_proc.grammar_manager import GrammarManager

V, EOS = 49152, 2
MiB = 2**20
# 2,000 alternatives of two properties each: about 27 MB to compile, a quarter of a MB per copy.
ANY_OF = {
    "anyOf": [
        {
            "type": "object",
            "properties": {f"k{i}": {"type": "integer"}, f"s{i}": {"type": "string"}},
            "required": [f"k{i}"],
        }
        for i in range(2000)
    ]
}
# 2,500 objects that all start with the key "k": once an output is inside one, all of them are alive in
# one parser row, past llguidance's max_items_in_row (2,000), and the matcher enters its error state.
SHARED_KEY = {
    "anyOf": [
        {
            "type": "object",
            "properties": {"k": {"type": "integer"}, f"v{i}": {"type": "string"}},
            "required": ["k", f"v{i}"],
        }
        for i in range(2500)
    ]
}


@pytest.fixture(scope="module")
def tok(smol_dir):
    return load_tokenizer(str(smol_dir), V)


def request(req_num: int, grammar: str, n: int = 1) -> AddRequest:
    return AddRequest(req_num, [5, 6], SamplingParams(max_tokens=8, stop_token_ids=(EOS,), grammar=grammar), n=n)


def settle(manager: GrammarManager, timeout: float = 60.0):
    """Poll until nothing waits; returns every ready and refused request."""
    ready, refused = [], []
    deadline = time.monotonic() + timeout
    while True:
        r, f = manager.poll()
        ready += r
        refused += f
        if not manager.num_pending:
            return ready, refused
        assert time.monotonic() < deadline, "grammars still compiling"
        time.sleep(0.01)


def allowed(mask: np.ndarray) -> set[int]:
    return set(np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little")).tolist())


def test_one_compilation_per_grammar_shared_by_choices_and_requests(tok):
    m = GrammarManager(tok, V, 256 * MiB, 1024 * MiB)
    schema = build_grammar("json_schema", ANY_OF, "guided_json")
    before = heap_in_use()
    m.add(request(1, schema, n=8))
    m.add(request(10, schema))
    ready, refused = settle(m)
    assert not refused and sorted(len(states) for _, states, _ in ready) == [1, 8]
    assert sorted(s.req_num for _, states, _ in ready for s in states) == [1, 2, 3, 4, 5, 6, 7, 8, 10]
    compiled = m._cache[schema]
    # Nine matchers for one compilation: the copies share the compiled grammar.
    assert compiled.users == 9 and 10 * MiB < compiled.nbytes < 100 * MiB and compiled.copy_nbytes < 2 * MiB
    assert m.used_bytes == compiled.nbytes + 9 * compiled.copy_nbytes
    assert heap_in_use() - before < compiled.nbytes + 20 * MiB
    first = ready[0][1][0]
    assert first.ready and allowed(first.mask) and EOS not in allowed(first.mask)  # "{" and the like
    m.close()


def test_masks_follow_the_output_and_the_grammar_ends_on_the_stop_ids(tok):
    m = GrammarManager(tok, V, 256 * MiB, 1024 * MiB)
    m.add(request(1, build_grammar("choice", ["yes", "no"], "guided_choice")))
    ((_, (state,), _),), _ = settle(m)
    assert {tok.decode_str([t]) for t in allowed(state.mask)} <= {"y", "ye", "yes", "n", "no"}
    for t in tok.tokenize_str("yes"):
        m.advance(state, t)  # the next mask is computed on the mask thread
        deadline = time.monotonic() + 10
        while not state.ready:
            m.wait_masks()
            assert time.monotonic() < deadline and not state.error
    assert allowed(state.mask) == {EOS}  # complete: only the request's stop ids
    m.release(state)
    assert m.used_bytes == m._cache[state_grammar(m)].nbytes
    m.close()


def state_grammar(m: GrammarManager) -> str:
    (text,) = m._cache
    return text


def test_grammars_that_cannot_be_used_are_refused_with_why(tok):
    m = GrammarManager(tok, V, 256 * MiB, 1024 * MiB)
    # A schema that only refers to itself (io_proc refuses it first; the manager must too, from llguidance).
    self_ref = llguidance.LLMatcher.grammar_from_json_schema('{"$ref": "#"}')
    m.add(request(1, self_ref))
    m.add(request(3, build_grammar("regex", "((", "guided_regex")))
    m.add(request(5, self_ref))  # the same: not compiled again
    ready, refused = settle(m)
    assert not ready and sorted(r for r, _ in refused) == [1, 3, 5]  # 5 ends with 1's compilation
    assert all(why.startswith("the grammar cannot be used: ") for _, why in refused), refused
    assert m.used_bytes == 0
    m.close()


def test_over_the_total_limit_waits_for_room(tok):
    schema = build_grammar("json_schema", ANY_OF, "guided_json")
    m = GrammarManager(tok, V, 100 * MiB, 120 * MiB)  # room for one compiled grammar, or one compilation
    m.add(request(1, schema))
    other = build_grammar("json_schema", {**ANY_OF, "title": "other"}, "guided_json")
    m.add(request(2, other))
    deadline = time.monotonic() + 60
    first = []
    while not first:
        first, refused = m.poll()
        assert not refused and time.monotonic() < deadline
        time.sleep(0.01)
    assert [msg.req_num for msg, _, _ in first] == [1] and m.num_pending == 1
    time.sleep(0.5)
    assert m.poll() == ([], []) and m.num_pending == 1  # waits: the total would pass its limit
    for state in first[0][1]:
        m.release(state)
    ready, refused = settle(m)  # the first grammar, unused now, is dropped to make room
    assert [msg.req_num for msg, _, _ in ready] == [2] and not refused
    assert schema not in m._cache and m.used_bytes <= 120 * MiB
    m.close()


def test_over_the_per_request_limit_is_refused_with_the_size(tok):
    m = GrammarManager(tok, V, 4 * MiB, 1024 * MiB)
    m.add(request(1, build_grammar("json_schema", ANY_OF, "guided_json")))
    ready, refused = settle(m)
    assert not ready and len(refused) == 1
    assert "MiB of matcher memory" in refused[0][1] and "--max-grammar-memory-per-request (4 MiB)" in refused[0][1]
    m.close()


def test_a_matcher_in_its_error_state_mid_output_fails_its_request(tok):
    m = GrammarManager(tok, V, 256 * MiB, 1024 * MiB)
    m.add(request(1, build_grammar("json_schema", SHARED_KEY, "guided_json")))
    ((_, (state,), _),), _ = settle(m)
    for t in tok.tokenize_str('{"k": 1, "v7": "a"}'):
        assert t in allowed(state.mask)
        m.advance(state, t)
        deadline = time.monotonic() + 10
        while not (state.ready or state.error):
            m.wait_masks()
            assert time.monotonic() < deadline
        if state.error:
            break
    assert state.error.startswith("the output left its grammar") and list(m.failed) == [state], state.error
    assert "max is 2000" in state.error
    m.close()


def test_aborted_while_compiling_and_memory_comes_back(tok, monkeypatch):
    monkeypatch.setattr(grammar_manager, "CACHE_IDLE_S", 0.0)
    m = GrammarManager(tok, V, 256 * MiB, 1024 * MiB)
    schema = build_grammar("json_schema", ANY_OF, "guided_json")
    before = heap_in_use()
    m.add(request(1, schema, n=4))  # choices 1 to 4
    assert all(m.abort(c) for c in (3, 1, 2, 4)) and not m.abort(5)
    ready, refused = settle(m)
    assert refused == [(1, "aborted")] and not ready
    m.add(request(10, schema, n=16))
    ((_, states, _),), _ = settle(m)
    for s in states:
        m.release(s)
    deadline = time.monotonic() + 10
    while m.used_bytes or m._cache:
        m.poll()
        assert time.monotonic() < deadline
        time.sleep(0.01)
    m._background.submit(lambda: None).result()  # its frees have run
    assert heap_in_use() - before < 2 * MiB
    m.close()


def test_a_draft_walk_gives_each_verified_position_its_mask_and_rolls_back(tok):
    """The masks of a row verifying drafts: position j's is the mask after the first j drafts, as if they
    had been output one by one; after a draft the grammar forbids (or a stop id) every token is allowed
    (verification rejects there, so nothing samples from it); the matcher ends where it began."""
    from pipeline.scheduler_proc.step_masks import MaskedRow

    class Req:  # the fields a walk reads
        pass

    m = GrammarManager(tok, V, 256 * MiB, 1024 * MiB)
    schema = build_grammar("json_schema", {"type": "object", "properties": {"ab": {"type": "integer"}}}, "x")
    m.add(request(1, schema, n=2))
    ((_, (state, ref), _),), _ = settle(m)
    text = tok.tokenize_str('{"ab": 12}')
    drafts = text[:3] + tok.tokenize_str("x") + text[4:5]  # three allowed, then one the grammar forbids
    req = Req()
    req.grammar = state
    row = MaskedRow(req, 0, len(drafts))
    m.walk(row, drafts)
    m.wait_masks()
    assert row.masks is not None and row.masks.shape == (1 + len(drafts), m.mask_words) and not state.error
    expected = [ref.mask.copy()]
    for t in drafts[:3]:
        advance(m, ref, t)
        expected.append(ref.mask.copy())
    for j in range(4):
        assert allowed(row.masks[j]) == allowed(expected[j]), j
    assert (row.masks[4:] == -1).all()
    # Rolled back: the state goes on from where it was, as the reference did.
    for t in text[:2]:
        advance(m, state, t)
    assert allowed(state.mask) == allowed(expected[2])
    # A stop id ends a walk too.
    done = Req()
    done.grammar = ref
    advance(m, ref, text[3])
    row = MaskedRow(done, 0, 2)
    m.walk(row, [EOS, text[4]])
    m.wait_masks()
    assert allowed(row.masks[0]) == allowed(ref.mask) and (row.masks[1:] == -1).all()
    m.close()


def advance(m: GrammarManager, state, token: int) -> None:
    """Advance ``state`` by ``token`` and wait for its mask (on the mask thread, or the background one if costly)."""
    m.advance(state, token)
    deadline = time.monotonic() + 10
    while not state.ready:
        m.wait_masks()
        assert time.monotonic() < deadline and not state.error
