"""Output token ids -> client text: incremental detokenization, stop strings, finish.

Everything here runs on io_proc's output-reader thread, one object set per
request. Two detokenizers give the same text, chosen per tokenizer at
start-up (:func:`new_detokenizer`): for a byte-level BPE tokenizer (decoder
``ByteLevel``: GPT-2, Llama 3, SmolLM) :class:`ByteLevelDetokenizer` looks
each token's text up in a table built once (about 0.1 us per token); for
every other decoder :class:`IncrementalDetokenizer` runs the ``tokenizers``
library's streaming decoder (``DecodeStream``, in Rust, as vLLM uses it;
about 1 us per token, which at a batch of 1024 is a millisecond per step).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from tokenizers.decoders import DecodeStream

from pipeline.common.messages import FinishReason, SamplingParams, check_finish
from pipeline.io_proc.byte_level import ByteLevelVocab, is_byte_level


class Detokenizer(Protocol):
    """One request's token -> text state: :meth:`push` returns the text a token completes."""

    token_ids: list[int]

    def push(self, token_id: int) -> str: ...


NewDetokenizer = Callable[[], Detokenizer]
"""Makes a fresh :class:`Detokenizer` for a new request."""


class IncrementalDetokenizer:
    """Turns one request's output tokens into text deltas, one token at a time.

    ``DecodeStream`` implements the prefix-offset / read-offset algorithm of
    text-generation-inference and vLLM: it decodes a short window ending at
    the new token and returns the text beyond what the window's start already
    produced, so the cost per token is constant, and context-dependent
    decoders (SentencePiece's leading space) stay right. A character whose
    UTF-8 bytes are split over several tokens (emoji, CJK) yields nothing until
    its last byte arrives and is then emitted whole; an incomplete character
    still pending when the request ends is never emitted (no U+FFFD reaches a
    client). Special tokens are skipped. For text made of complete characters
    the deltas concatenate to ``decode(token_ids, skip_special_tokens=True)``.

    Args:
        tokenizer: a ``tokenizers.Tokenizer`` (a fast tokenizer's
            ``backend_tokenizer``), used by this thread only.

    Attributes:
        token_ids: every output token pushed so far (list of int).
    """

    __slots__ = ("_tokenizer", "_stream", "token_ids")

    def __init__(self, tokenizer: Any):
        self._tokenizer = tokenizer
        self._stream = DecodeStream(skip_special_tokens=True)
        self.token_ids: list[int] = []

    def push(self, token_id: int) -> str:
        """Append ``token_id``; return the text it completes ("" if none yet)."""
        self.token_ids.append(token_id)
        return self._stream.step(self._tokenizer, token_id) or ""


class ByteLevelDetokenizer:
    """Turns one request's output tokens into the text deltas ``DecodeStream`` gives, for a byte-level tokenizer.

    With a ``ByteLevel`` decoder, ``DecodeStream(skip_special_tokens=True)``
    emits, at each token, the lossy UTF-8 decoding of the bytes of the tokens
    since its previous emission, once that text is non-empty and does not end
    in U+FFFD (an incomplete character, or a literal U+FFFD, waits for the
    next token; what is still pending at the end never comes out). This
    reproduces that from the bytes alone: while nothing is pending, a token
    whose own bytes are complete text (:attr:`ByteLevelVocab.texts`) is
    emitted straight from the table, and only a token that leaves bytes
    pending, or follows pending bytes, decodes bytes. Python's
    ``errors="replace"`` substitutes U+FFFD for invalid bytes as Rust's
    ``String::from_utf8_lossy`` does (both follow the Unicode standard's
    "maximal subpart" practice), so even invalid byte sequences come out the same.

    Args:
        vocab: the tokenizer's :class:`ByteLevelVocab` (shared by all requests).

    Attributes:
        token_ids: every output token pushed so far (list of int).
    """

    __slots__ = ("_vocab", "_texts", "_pending", "token_ids")

    def __init__(self, vocab: ByteLevelVocab):
        self._vocab = vocab
        self._texts = vocab.texts
        self._pending = b""  # bytes since the last emission, not yet text
        self.token_ids: list[int] = []

    def push(self, token_id: int) -> str:
        """Append ``token_id``; return the text it completes ("" if none yet)."""
        self.token_ids.append(token_id)
        if not self._pending:
            try:
                text = self._texts[token_id]
            except IndexError:  # past the vocabulary (a padded LM head): no text, as DecodeStream
                return ""
            if text is not None:
                return text
        self._pending += self._vocab.bytes_of(token_id)
        text = self._pending.decode("utf-8", errors="replace")
        if not text or text.endswith("\ufffd"):
            return ""
        self._pending = b""
        return text


def new_detokenizer(tokenizer: Any) -> NewDetokenizer:
    """The per-request detokenizer factory for ``tokenizer`` (a ``tokenizers.Tokenizer``).

    :class:`ByteLevelDetokenizer` (over a :class:`ByteLevelVocab` built here,
    once) when the tokenizer's decoder is ``ByteLevel``, otherwise
    :class:`IncrementalDetokenizer`; the choice follows the decoder, not the
    model's name. Both give the same deltas for a byte-level tokenizer.
    """
    if is_byte_level(tokenizer):
        return functools.partial(ByteLevelDetokenizer, ByteLevelVocab(tokenizer))
    return functools.partial(IncrementalDetokenizer, tokenizer)


class StopStringMatcher:
    """Finds stop strings in a stream of text deltas without leaking any part of one.

    The last ``max(len(stop)) - 1`` characters not yet released are held
    back, because they may be the beginning of a stop string that the next
    delta completes. When a stop string appears, the text before its earliest
    occurrence is released and the rest is dropped (the stop string is not
    part of the output, like the OpenAI API). When the request ends for
    another reason, :meth:`flush` releases what is held.

    Args:
        stop: the stop strings, each non-empty.

    Raises:
        ValueError: ``stop`` is empty or contains an empty string.
    """

    __slots__ = ("_stops", "_hold", "_held")

    def __init__(self, stop: Sequence[str]):
        if not stop or not all(stop):
            raise ValueError(f"stop strings must be a non-empty list of non-empty strings, got {stop!r}")
        self._stops = tuple(stop)
        self._hold = max(map(len, self._stops)) - 1
        self._held = ""

    def push(self, text: str) -> tuple[str, bool]:
        """Add a delta.

        Returns:
            ``(released, matched)``: the text that can be sent now, and
            whether a stop string was found (then ``released`` ends right
            before it, and nothing more must be sent for this request).
        """
        buf = self._held + text
        # Only the held-back tail plus the new delta can contain a stop string
        # that was not complete before: everything released earlier was
        # checked with its tail attached.
        first = -1
        for s in self._stops:
            i = buf.find(s)
            if i != -1 and (first == -1 or i < first):
                first = i
        if first != -1:
            self._held = ""
            return buf[:first], True
        cut = len(buf) - self._hold
        if cut <= 0:
            self._held = buf
            return "", False
        self._held = buf[cut:]
        return buf[:cut], False

    def flush(self) -> str:
        """Release and forget the held-back text (the request ended otherwise)."""
        held, self._held = self._held, ""
        return held


class OutputProcessor:
    """One request's output path: tokens in, client text and finish reason out.

    Applies, per token: incremental detokenization, stop strings, and
    :func:`pipeline.common.messages.check_finish` (stop token ids and
    ``max_tokens``, the same rule the scheduler applies on its side).

    Args:
        detokenizer: this request's :class:`Detokenizer`.
        params: the request's sampling parameters.
        stop: stop strings (may be empty).

    Attributes:
        num_output_tokens: tokens pushed so far, the finishing one included
            (what ``usage.completion_tokens`` reports).
        token_ids: those tokens (a list that only grows).
    """

    __slots__ = ("_detok", "_stop", "_params", "num_output_tokens", "token_ids")

    def __init__(self, detokenizer: Detokenizer, params: SamplingParams, stop: Sequence[str] = ()):
        self._detok = detokenizer
        self.token_ids = detokenizer.token_ids
        self._stop = StopStringMatcher(stop) if stop else None
        self._params = params
        self.num_output_tokens = 0

    def push(self, token_id: int) -> tuple[str, FinishReason | None, bool]:
        """Process the next sampled token.

        Must not be called again once a finish reason was returned.

        Returns:
            ``(text, finish_reason, needs_abort)``: the text to send now
            (possibly ""), why the request ended with this token (None if it
            goes on), and whether the scheduler must be told to abort, which
            is the case only for a stop string: the scheduler finishes stop
            token ids and ``max_tokens`` on its own.
        """
        self.num_output_tokens += 1
        text = self._detok.push(token_id)
        finish = check_finish(token_id, self.num_output_tokens, self._params)
        if self._stop is None:
            return text, finish, False
        text, matched = self._stop.push(text)
        if matched:
            return text, "stop", finish is None
        if finish is not None:
            text += self._stop.flush()
        return text, finish, False
