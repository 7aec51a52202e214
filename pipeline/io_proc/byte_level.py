"""Byte-level BPE vocabularies (GPT-2, Llama 3, SmolLM): each token's bytes, computed once.

Such a vocabulary spells every byte as one printable character (GPT-2's ``bytes_to_unicode`` alphabet), and the
tokenizer's ``ByteLevel`` decoder maps a token's characters back to bytes and decodes the bytes of a whole sequence as
UTF-8, lossily. A token's bytes therefore do not depend on its neighbours, so they can be tabulated per id; that is what
lets ``ByteLevelDetokenizer`` turn most tokens into text with one list lookup.
"""

from __future__ import annotations

from typing import Any

from tokenizers.decoders import ByteLevel


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table that byte-level BPE vocabularies are written in.

    From OpenAI's GPT-2 ``encoder.py`` (also ``tokenizers``' ``ByteLevel``): printable Latin-1 bytes stand for
    themselves, the other 68 bytes for ``chr(256 + n)`` in byte order.
    """
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
    """The bytes the ``ByteLevel`` decoder makes of one token's string.

    As ``tokenizers``' ``ByteLevel::decode_chain``: the bytes its characters stand for if every character is in the
    alphabet, else the string's own UTF-8 (an added token such as ``"<|im_end|>"`` or one with other characters).
    """
    try:
        return bytes([UNICODE_TO_BYTE[c] for c in token])
    except KeyError:
        return token.encode("utf-8")


def is_byte_level(tokenizer: Any) -> bool:
    """True if ``tokenizer`` (a ``tokenizers.Tokenizer``) decodes with exactly a ``ByteLevel`` decoder.

    Only then does ``ByteLevelVocab`` describe its decoding; a sequence of decoders or any other decoder
    (SentencePiece's ``Metaspace``, ``WordPiece``, ...) does not qualify.
    """
    return isinstance(tokenizer.decoder, ByteLevel)


class ByteLevelVocab:
    """Per token id, the bytes and (when they stand alone as text) the text that decoding gives it.

    Built once per tokenizer (about 0.1 s for 128k tokens) and then only read, so one instance serves every request on
    any thread.

    Args:
        tokenizer: a ``tokenizers.Tokenizer`` for which ``is_byte_level`` holds.

    Raises:
        ValueError: the tokenizer's decoder is not ``ByteLevel``.

    Attributes:
        texts: ``texts[id]`` is the token's text when its bytes are complete UTF-8 whose last character is not U+FFFD
            (so a decoder that sees it after a character boundary emits it at once, whole), ``""`` for a special token
            or an id with no token (``DecodeStream`` with ``skip_special_tokens`` drops both), and None otherwise (a
            piece of a multi-byte character: it needs the bytes around it).
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
