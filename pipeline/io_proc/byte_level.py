"""Byte-level BPE vocabularies (GPT-2, Llama 3, SmolLM): each token's bytes, tabulated once, since a token's bytes do
not depend on its neighbours."""

from __future__ import annotations

from typing import Any

from tokenizers.decoders import ByteLevel


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (OpenAI's GPT-2 ``encoder.py``): printable Latin-1 bytes stand for
    themselves, the other 68 for ``chr(256 + n)``."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


UNICODE_TO_BYTE: dict[str, int] = {c: b for b, c in _bytes_to_unicode().items()}
"""The inverse of GPT-2's table: alphabet character -> byte."""


def token_bytes(token: str) -> bytes:
    """The bytes the ``ByteLevel`` decoder makes of one token's string (as ``ByteLevel::decode_chain``), or its UTF-8
    when a character is outside the alphabet."""
    try:
        return bytes([UNICODE_TO_BYTE[c] for c in token])
    except KeyError:
        return token.encode("utf-8")


def is_byte_level(tokenizer: Any) -> bool:
    """True if ``tokenizer`` decodes with exactly a ``ByteLevel`` decoder (not a sequence, not another decoder)."""
    return isinstance(tokenizer.decoder, ByteLevel)


class ByteLevelVocab:
    """Per token id, the bytes and (when they stand alone as text) the text decoding gives it; read-only, shared by
    threads.

    ``texts[id]``: the text when complete and not ending in U+FFFD, ``""`` for special or missing ids, else None.

    Raises:
        ValueError: the tokenizer's decoder is not ``ByteLevel``.
    """

    __slots__ = ("_bytes", "texts")

    def __init__(self, tokenizer: Any):
        if not is_byte_level(tokenizer):
            raise ValueError(f"not a ByteLevel decoder: {tokenizer.decoder!r}")
        vocab = tokenizer.get_vocab(with_added_tokens=True)
        special = {i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}
        size = max(vocab.values(), default=-1) + 1
        self._bytes: list[bytes] = [b""] * size
        self.texts: list[str | None] = [""] * size
        for token, i in vocab.items():
            if i in special:
                continue
            raw = self._bytes[i] = token_bytes(token)
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                text = None
            # A decoded text that ends in U+FFFD, even a literal one, makes
            # DecodeStream wait for more tokens; such a token takes the slow path.
            self.texts[i] = None if text is None or text.endswith("\ufffd") else text

    def __len__(self) -> int:
        return len(self.texts)

    def bytes_of(self, token_id: int) -> bytes:
        """The bytes decoding gives ``token_id`` (``b""`` for a special token or an id past the vocabulary)."""
        return self._bytes[token_id] if 0 <= token_id < len(self._bytes) else b""
