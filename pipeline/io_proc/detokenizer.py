"""Output token ids -> client text: incremental detokenization, stop strings, finish.

Runs on io_proc's output-reader thread. ``new_detokenizer`` picks a table lookup (``ByteLevelDetokenizer``) for a
byte-level BPE decoder, else the ``tokenizers`` streaming decoder (``IncrementalDetokenizer``); both give the same text.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from tokenizers.decoders import DecodeStream

from pipeline.common.messages import FinishReason, SamplingParams, check_finish
from pipeline.io_proc.byte_level import ByteLevelVocab, is_byte_level


class Detokenizer(Protocol):
    """One request's token -> text state: ``push`` returns the text a token completes."""

    def push(self, token_id: int) -> str: ...

    def push_many(self, token_ids: Sequence[int]) -> str:
        """The texts ``push`` would return for each of ``token_ids`` in turn, joined."""
        ...


NewDetokenizer = Callable[[], Detokenizer]
"""Makes a fresh ``Detokenizer`` for a new request."""


class IncrementalDetokenizer:
    """Turns one request's output tokens into text deltas with ``DecodeStream`` (prefix/read-offset algorithm of TGI and
    vLLM): constant cost per token, special tokens skipped.

    A character split over tokens is emitted whole once its last byte arrives; one still pending at the end is never
    emitted (no U+FFFD reaches a client). ``tokenizer`` is used by this thread only.
    """

    __slots__ = ("_tokenizer", "_stream")

    def __init__(self, tokenizer: Any):
        self._tokenizer = tokenizer
        self._stream = DecodeStream(skip_special_tokens=True)

    def push(self, token_id: int) -> str:
        """Take the next token; return the text it completes ("" if none yet)."""
        return self._stream.step(self._tokenizer, token_id) or ""

    def push_many(self, token_ids: Sequence[int]) -> str:
        """The texts ``push`` would return for each of ``token_ids`` in turn, joined."""
        return "".join([self.push(t) for t in token_ids])


class ByteLevelDetokenizer:
    """The deltas ``DecodeStream`` gives, for a byte-level tokenizer, from the bytes alone.

    ``DecodeStream`` emits the lossy UTF-8 decoding of pending bytes once non-empty and not ending in U+FFFD; here a
    token whose bytes are complete text comes from ``ByteLevelVocab.texts``, and only pending bytes are decoded
    (Python's ``errors="replace"`` matches Rust's ``from_utf8_lossy``, so invalid bytes come out the same).
    """

    __slots__ = ("_vocab", "_texts", "_pending")

    def __init__(self, vocab: ByteLevelVocab):
        self._vocab = vocab
        self._texts = vocab.texts
        self._pending = b""  # bytes since the last emission, not yet text

    def push(self, token_id: int) -> str:
        """Take the next token; return the text it completes ("" if none yet)."""
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

    def push_many(self, token_ids: Sequence[int]) -> str:
        """The texts ``push`` would return for each of ``token_ids`` in turn, joined."""
        try:
            texts = [self._texts[t] for t in token_ids]
        except IndexError:  # an id past the vocabulary: token by token
            return "".join([self.push(t) for t in token_ids])
        # Only the tokens from a piece of a character (None) until its text completes decode bytes: a long
        # output usually has a few (emoji, CJK, a rare accented letter), not a reason to go token by token.
        out, i, n = [], 0, len(texts)
        while i < n:
            if not self._pending:
                try:
                    j = texts.index(None, i)
                except ValueError:
                    out.append("".join(texts[i:]))
                    break
                out.append("".join(texts[i:j]))
                i = j
            out.append(self.push(token_ids[i]))
            i += 1
        return "".join(out)


def new_detokenizer(tokenizer: Any) -> NewDetokenizer:
    """The per-request detokenizer factory for ``tokenizer``: ``ByteLevelDetokenizer`` when its decoder is
    ``ByteLevel``, else ``IncrementalDetokenizer``."""
    if is_byte_level(tokenizer):
        return functools.partial(ByteLevelDetokenizer, ByteLevelVocab(tokenizer))
    return functools.partial(IncrementalDetokenizer, tokenizer)


class StopStringMatcher:
    """Finds stop strings in a stream of text deltas without leaking any part of one.

    Holds back the last ``max(len(stop)) - 1`` unreleased characters; on a match, releases the text before it and drops
    the rest (as the OpenAI API does). With ``until`` (a tool call's trigger), only free text before it is searched
    (docs/design.md, "Stop strings").

    Raises:
        ValueError: ``stop`` is empty or contains an empty string.
    """

    __slots__ = ("_stops", "_hold", "_held", "_until", "_at_start", "_tail", "_in_calls")

    def __init__(self, stop: Sequence[str], until: str = "", until_at_start: bool = False):
        if not stop or not all(stop):
            raise ValueError(f"stop strings must be a non-empty list of non-empty strings, got {stop!r}")
        self._stops = tuple(stop)
        self._hold = max(map(len, self._stops)) - 1
        self._held = ""
        self._until = until
        self._at_start = until_at_start
        self._tail = ""  # the text's end that may begin ``until``
        self._in_calls = False

    def push(self, text: str, check: bool = True) -> tuple[str, bool]:
        """Add a delta; with ``check`` false it is held, not searched (vLLM's ``min_tokens`` rule).

        Returns ``(released, matched)``: text to send now, and whether a stop string ended the output.
        """
        if self._in_calls:
            return text, False
        held = len(self._held)
        buf = self._held + text
        calls = self._calls_start(text, held)
        end = len(buf) if calls < 0 else calls
        first = -1
        if check and text:
            # A match must end in the new delta: one inside the held tail was
            # either searched before or came from unchecked text.
            for s in self._stops:
                i = buf.find(s, max(0, held - len(s) + 1), end)
                if i != -1 and (first == -1 or i < first):
                    first = i
        if first != -1:
            self._held = ""
            return buf[:first], True
        if calls >= 0:
            self._held, self._in_calls = "", True
            return buf, False
        cut = len(buf) - self._hold
        if cut <= 0:
            self._held = buf
            return "", False
        self._held = buf[cut:]
        return buf[:cut], False

    def _calls_start(self, text: str, held: int) -> int:
        """Where ``until`` ends in the held text plus ``text`` if this delta completes it, else -1."""
        if not self._until or not text:
            return -1
        if self._at_start:
            until, self._until = self._until, ""  # the first text decides it either way
            return held + len(until) if text.startswith(until) else -1
        seen = self._tail + text
        k = seen.find(self._until)
        keep = len(self._until) - 1
        self._tail = seen[-keep:] if keep else ""
        return -1 if k < 0 else held + k + len(self._until) - (len(seen) - len(text))

    def flush(self) -> str:
        """Release and forget the held-back text (the request ended otherwise)."""
        held, self._held = self._held, ""
        return held


class OutputProcessor:
    """One request's output path: tokens in, client text and finish reason out (``check_finish`` plus stop strings).

    Without a stream or stop strings a token costs only its finish check and the text is decoded at the finish
    (``Detokenizer.push_many``). ``needs_abort``: a stop-string finish the scheduler must be told of.
    """

    __slots__ = (
        "_detok",
        "_stop",
        "_params",
        "_stop_ids",
        "_max_tokens",
        "_min_tokens",
        "_at_finish",
        "num_output_tokens",
        "token_ids",
        "text_pieces",
        "needs_abort",
    )

    def __init__(
        self, detokenizer: Detokenizer, params: SamplingParams, stop: Sequence[str] = (), incremental: bool = True
    ):
        self._detok = detokenizer
        self._stop = StopStringMatcher(stop, params.grammar_trigger, params.grammar_trigger_at_start) if stop else None
        self._params = params
        # check_finish can only answer for these tokens or counts; testing
        # them first keeps its call off the path of nearly every token.
        self._stop_ids = () if params.ignore_eos else frozenset(params.stop_token_ids)
        self._max_tokens = params.max_tokens
        self._min_tokens = params.min_tokens
        self._at_finish = not incremental and self._stop is None
        self.num_output_tokens = 0
        self.token_ids: list[int] = []
        self.text_pieces: list[str] = []
        self.needs_abort = False

    def push(self, token_id: int) -> FinishReason | None:
        """Process the next sampled token (its text joins ``text_pieces``); returns the finish reason, or None. Not
        called again after a finish."""
        self.token_ids.append(token_id)
        n = self.num_output_tokens = self.num_output_tokens + 1
        finish = None
        if token_id in self._stop_ids or n >= self._max_tokens:
            finish = check_finish(token_id, n, self._params)
        if self._at_finish:
            if finish is not None and (text := self._detok.push_many(self.token_ids)):
                self.text_pieces.append(text)
            return finish
        text = self._detok.push(token_id)
        if self._stop is not None:
            # As in vLLM, min_tokens holds off stop strings too: one counts only if
            # a token after the min_tokens-th completes it.
            text, matched = self._stop.push(text, n > self._min_tokens)
            if matched:
                self.needs_abort = finish is None
                finish = "stop"
            elif finish is not None:
                text += self._stop.flush()
        if text:
            self.text_pieces.append(text)
        return finish

    def take_text(self) -> str:
        """The text of ``text_pieces``, joined; empties them."""
        text = "".join(self.text_pieces)
        self.text_pieces.clear()
        return text
