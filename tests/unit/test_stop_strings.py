"""Stop strings: nothing of a stop string ever reaches the client, output is cut
before it, and held-back text is flushed when the request ends otherwise.

The end-to-end cases run through ``OutputProcessor`` with a byte-level
detokenizer (one token per UTF-8 byte), which splits every multi-byte
character over tokens like a real byte-level BPE does, and needs no model files.
"""

from __future__ import annotations

import random

import pytest

from pipeline.common.messages import SamplingParams
from pipeline.io_proc.detokenizer import OutputProcessor, StopStringMatcher

EOS = 256  # outside the byte range, like a special token


class ByteDetokenizer:
    """One token per UTF-8 byte; a character comes out once its last byte arrives; ids >= 256 are special."""

    def __init__(self) -> None:
        self._pending = b""

    def push_many(self, token_ids: list[int]) -> str:
        return "".join(map(self.push, token_ids))

    def push(self, token_id: int) -> str:
        if token_id >= 256:
            return ""
        self._pending += bytes([token_id])
        try:
            text, self._pending = self._pending.decode("utf-8"), b""
        except UnicodeDecodeError:
            return ""
        return text


def byte_encode(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def feed(matcher: StopStringMatcher, pieces: list[str]) -> tuple[list[str], bool]:
    """Push pieces until a match; return what was released after each push."""
    released = []
    for p in pieces:
        text, matched = matcher.push(p)
        released.append(text)
        if matched:
            return released, True
    return released, False


def reference_cut(text: str, stops: list[str]) -> str | None:
    """The text before the earliest stop string, or None if none occurs."""
    hits = [i for i in (text.find(s) for s in stops) if i != -1]
    return text[: min(hits)] if hits else None


def run(text_tokens: list[int], stops: list[str], max_tokens: int = 1000, eos: bool = False):
    """Run tokens through an OutputProcessor; return (deltas, finish, needs_abort, num_output_tokens)."""
    proc = OutputProcessor(ByteDetokenizer(), SamplingParams(max_tokens=max_tokens, stop_token_ids=(EOS,)), stops)
    deltas = []
    for t in text_tokens + ([EOS] if eos else []):
        finish = proc.push(t)
        deltas.append(proc.take_text())
        if finish is not None:
            return deltas, finish, proc.needs_abort, proc.num_output_tokens
    return deltas, None, False, proc.num_output_tokens


def test_split_across_deltas_never_leaks():
    m = StopStringMatcher(["STOP"])
    released, matched = feed(m, ["abc S", "T", "O", "P and more"])
    assert matched
    assert "".join(released) == "abc "
    for i in range(len(released)):
        assert "S" not in "".join(released[: i + 1])


def test_partial_stop_that_does_not_complete_is_released():
    m = StopStringMatcher(["STOP"])
    released, matched = feed(m, ["x ST", "O", "NE y"])
    assert not matched
    assert "".join(released) + m.flush() == "x STONE y"


def test_held_back_text_is_bounded_and_flushed():
    m = StopStringMatcher(["</end>", "xy"])
    released, matched = feed(m, ["hello wor", "ld and </en"])
    assert not matched
    # At most len("</end>") - 1 = 5 characters are held back.
    assert "".join(released) == "hello world and"
    assert m.flush() == " </en"
    assert m.flush() == ""


def test_multiple_stops_earliest_wins():
    m = StopStringMatcher(["world", "lo w", "!"])
    released, matched = feed(m, ["hel", "lo world!"])
    assert matched and "".join(released) == "hel"


def test_stop_at_very_start():
    for pieces in (["STOP now"], ["S", "TOP"], ["ST", "OP"]):
        released, matched = feed(StopStringMatcher(["STOP"]), pieces)
        assert matched and "".join(released) == ""


def test_single_character_stop_holds_nothing():
    m = StopStringMatcher(["\n"])
    assert m.push("abc") == ("abc", False)
    assert m.push("d\ne") == ("d", True)


@pytest.mark.parametrize("bad", [[], [""], ["ok", ""]])
def test_invalid_stops(bad):
    with pytest.raises(ValueError):
        StopStringMatcher(bad)


def test_random_splits_match_reference():
    rng = random.Random(0)
    alphabet = "ab c\nST日😀"
    for _ in range(2000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
        stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 4))]
        cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text) + 1, rng.randint(0, 6))))
        pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
        m = StopStringMatcher(stops)
        released, matched = feed(m, pieces)
        expected = reference_cut(text, stops)
        out = "".join(released)
        if expected is None:
            assert not matched and out + m.flush() == text
        else:
            assert matched and out == expected


def test_processor_cuts_before_stop_and_asks_for_abort():
    tokens = byte_encode("Answer: 42. Done")
    deltas, finish, needs_abort, n = run(tokens, ["Done"])
    assert finish == "stop" and needs_abort
    assert "".join(deltas) == "Answer: 42. "
    # Tokens up to the one that completed the match are counted.
    assert n == len(tokens)


def test_processor_stop_split_inside_multibyte_characters():
    text = "héllo 😀😀 wörld 世界 end"
    deltas, finish, needs_abort, n = run(byte_encode(text), ["😀 w", "界"])
    assert finish == "stop" and needs_abort
    assert "".join(deltas) == "héllo 😀"
    assert all("\ufffd" not in d for d in deltas)
    assert n == len(byte_encode("héllo 😀😀 w"))


def test_processor_flushes_held_text_on_eos_and_length():
    text = "no stop here, just END"
    deltas, finish, needs_abort, n = run(byte_encode(text), ["ENDING"], eos=True)
    assert (finish, needs_abort) == ("stop", False)
    assert "".join(deltas) == text
    assert n == len(byte_encode(text)) + 1

    deltas, finish, needs_abort, n = run(byte_encode(text), ["ENDING"], max_tokens=len(text))
    assert (finish, needs_abort) == ("length", False)
    assert "".join(deltas) == text
    # Held back until the end: the last delta carries the tail.
    assert deltas[-1].endswith("END")


def test_processor_stop_on_the_last_allowed_token_needs_no_abort():
    tokens = byte_encode("abc STOP")
    deltas, finish, needs_abort, _ = run(tokens, ["STOP"], max_tokens=len(tokens))
    # The scheduler frees it for length anyway; the client sees a stop.
    assert (finish, needs_abort) == ("stop", False)
    assert "".join(deltas) == "abc "


def test_processor_stop_at_very_start():
    deltas, finish, needs_abort, n = run(byte_encode("<|x|> rest"), ["<|x|>"])
    assert (finish, needs_abort, n) == ("stop", True, 5)
    assert "".join(deltas) == ""


def run_min_tokens(text: str, stops: list[str], min_tokens: int) -> tuple[str, str | None, int]:
    """Feed ``text`` byte by byte with ``min_tokens``; return (output text, finish, tokens consumed)."""
    params = SamplingParams(max_tokens=len(text.encode()) + 1, stop_token_ids=(EOS,), min_tokens=min_tokens)
    proc = OutputProcessor(ByteDetokenizer(), params, stops)
    out, finish = [], None
    for t in byte_encode(text) + [EOS]:
        finish = proc.push(t)
        out.append(proc.take_text())
        if finish is not None:
            break
    return "".join(out), finish, proc.num_output_tokens


def test_min_tokens_holds_off_a_one_character_stop():
    # "\n" is the 2nd token: ignored while fewer than 4 tokens are out; the next one after the 4th stops.
    assert run_min_tokens("a\nbc\nde\n", ["\n"], 4) == ("a\nbc", "stop", 5)
    assert run_min_tokens("a\nbc\nde\n", ["\n"], 0) == ("a", "stop", 2)
    # Completed exactly by the first token past min_tokens: it counts.
    assert run_min_tokens("abc\nd", ["\n"], 3) == ("abc", "stop", 4)


def test_min_tokens_stop_may_start_before_and_end_after():
    # vLLM's rule: the stop string must be completed by a token after the min_tokens-th,
    # but may start in the text of earlier ones.
    assert run_min_tokens("xxSTOPyy", ["STOP"], 4) == ("xx", "stop", 6)
    # Wholly inside the first min_tokens tokens: ignored, and its text is sent.
    assert run_min_tokens("STOPxxSTOPz", ["STOP"], 4) == ("STOPxx", "stop", 10)
    # A shorter stop held back inside a longer one's window is not matched late.
    assert run_min_tokens("ab" + "c" * 6, ["abcdefgh", "b"], 2) == ("ab" + "c" * 6, "stop", 9)


def test_min_tokens_with_multibyte_characters():
    # "é" is two tokens; the stop "é" completed by tokens 3-4 (past min_tokens 2) counts, the one at 1-2 not.
    assert run_min_tokens("ééa", ["é"], 2) == ("é", "stop", 4)


def until_reference(text: str, stops: list[str], until: str, at_start: bool) -> str | None:
    """The cut of ``text`` where stop strings count only if they end by ``until``'s end (its first
    occurrence; with ``at_start``, only at the start); None if none counts."""
    if at_start:
        end = len(until) if text.startswith(until) else len(text)
    else:
        k = text.find(until)
        end = len(text) if k < 0 else k + len(until)
    hits = [i for i in (text.find(s, 0, end) for s in stops) if i != -1]
    return text[: min(hits)] if hits else None


def test_stop_strings_do_not_apply_inside_tool_calls():
    trigger = "<tool_call>"
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
    for stop in (["}"], [", "], ['"'], ["}", "\n</tool"]):
        for pieces in ([call], list(call), ["Sure. " + call[:5], call[5:]]):
            m = StopStringMatcher(stop, trigger)
            released, matched = feed(m, pieces)
            assert not matched and "".join(released) + m.flush() == "".join(pieces)
    # Before the trigger they apply, and one that ends by the trigger's end counts.
    assert feed(StopStringMatcher(["}"], trigger), ["a} ", call]) == (["a"], True)
    assert feed(StopStringMatcher(["<tool"], trigger), ["Hi <to", "ol_call>\n{"]) == (["Hi", " "], True)
    assert feed(StopStringMatcher(["call>"], trigger), ["Hi <tool_", "call>\n{"]) == (["Hi <t", "ool_"], True)
    # An anchored trigger counts only as the output's first character.
    assert feed(StopStringMatcher(["}"], "{", True), ['{"a": {}}']) == (['{"a": {}}'], False)
    assert feed(StopStringMatcher(["}"], "{", True), ['x {"a": {}}']) == (['x {"a": {'], True)


def test_stop_strings_with_a_trigger_match_the_reference_however_split():
    rng = random.Random(1)
    alphabet = "ab<>c}{"
    for _ in range(3000):
        at_start = rng.random() < 0.3
        until = rng.choice("{<") if at_start else "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4)))
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 24)))
        stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 3))) for _ in range(rng.randint(1, 3))]
        cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text) + 1, rng.randint(0, 6))))
        pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
        m = StopStringMatcher(stops, until, at_start)
        released, matched = feed(m, pieces)
        expected = until_reference(text, stops, until, at_start)
        if expected is None:
            assert not matched and "".join(released) + m.flush() == text, (text, stops, until, pieces)
        else:
            assert matched and "".join(released) == expected, (text, stops, until, pieces)


def test_processor_takes_the_trigger_from_the_sampling_params():
    call = '<tool_call>\n{"name": "f", "arguments": {"a": 1, "b": "x"}}\n</tool_call>'
    params = SamplingParams(max_tokens=1000, stop_token_ids=(EOS,), grammar="g", grammar_trigger="<tool_call>")
    proc = OutputProcessor(ByteDetokenizer(), params, ["}", ", "])
    out = []
    for t in byte_encode(call) + [EOS]:
        finish = proc.push(t)
        out.append(proc.take_text())
    assert (finish, proc.needs_abort, "".join(out)) == ("stop", False, call)
