"""Output token ids -> client text: incremental detokenization, stop strings, finish.

Everything here runs on io_proc's output-reader thread, one object set per request. Two detokenizers give the same text,
chosen per tokenizer at start-up (``new_detokenizer``): for a byte-level BPE tokenizer (decoder ``ByteLevel``: GPT-2,
Llama 3, SmolLM) ``ByteLevelDetokenizer`` looks each token's text up in a table built once (about 0.2 us per token); for
every other decoder ``IncrementalDetokenizer`` runs the ``tokenizers`` library's streaming decoder (``DecodeStream``, in
Rust, as vLLM uses it; about 1 us per token, which at a batch of 1024 is a millisecond per step).
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
    """Turns one request's output tokens into text deltas, one token at a time.

    ``DecodeStream`` implements the prefix-offset / read-offset algorithm of text-generation-inference and vLLM: it
    decodes a short window ending at the new token and returns the text beyond what the window's start already produced,
    so the cost per token is constant, and context-dependent decoders (SentencePiece's leading space) stay right. A
    character whose UTF-8 bytes are split over several tokens (emoji, CJK) yields nothing until its last byte arrives
    and is then emitted whole; an incomplete character still pending when the request ends is never emitted (no U+FFFD
    reaches a client). Special tokens are skipped. For text made of complete characters the deltas concatenate to
    ``decode(token_ids, skip_special_tokens=True)``.

    Args:
        tokenizer: a ``tokenizers.Tokenizer`` (a fast tokenizer's ``backend_tokenizer``), used by this thread only.
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
    """Turns one request's output tokens into the text deltas ``DecodeStream`` gives, for a byte-level tokenizer.

    With a ``ByteLevel`` decoder, ``DecodeStream(skip_special_tokens=True)`` emits, at each token, the lossy UTF-8
    decoding of the bytes of the tokens since its previous emission, once that text is non-empty and does not end in
    U+FFFD (an incomplete character, or a literal U+FFFD, waits for the next token; what is still pending at the end
    never comes out). This reproduces that from the bytes alone: while nothing is pending, a token whose own bytes are
    complete text (``ByteLevelVocab.texts``) is emitted straight from the table, and only a token that leaves bytes
    pending, or follows pending bytes, decodes bytes. Python's ``errors="replace"`` substitutes U+FFFD for invalid bytes
    as Rust's ``String::from_utf8_lossy`` does (both follow the Unicode standard's "maximal subpart" practice), so even
    invalid byte sequences come out the same.

    Args:
        vocab: the tokenizer's ``ByteLevelVocab`` (shared by all requests).
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
    """The per-request detokenizer factory for ``tokenizer`` (a ``tokenizers.Tokenizer``).

    ``ByteLevelDetokenizer`` (over a ``ByteLevelVocab`` built here, once) when the tokenizer's decoder is ``ByteLevel``,
    otherwise ``IncrementalDetokenizer``; the choice follows the decoder, not the model's name. Both give the same
    deltas for a byte-level tokenizer.
    """
    if is_byte_level(tokenizer):
        return functools.partial(ByteLevelDetokenizer, ByteLevelVocab(tokenizer))
    return functools.partial(IncrementalDetokenizer, tokenizer)


class StopStringMatcher:
    """Finds stop strings in a stream of text deltas without leaking any part of one.

    The last ``max(len(stop)) - 1`` characters not yet released are held back, because they may be the beginning of a
    stop string that the next delta completes. When a stop string appears, the text before its earliest occurrence is
    released and the rest is dropped (the stop string is not part of the output, like the OpenAI API). When the request
    ends for another reason, ``flush`` releases what is held.

    With ``until`` (a tool call's trigger), stop strings apply to the free text only: one counts if it ends by the
    trigger's end, and from there on (the calls, which their grammar ends) the text passes unsearched, so a stop string
    never cuts a call (docs/design.md, "Stop strings").

    Args:
        stop: the stop strings, each non-empty.
        until: the text after which stop strings no longer apply ("" for none).
        until_at_start: ``until`` counts only at the text's start.

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
        """Add a delta.

        With ``check`` false the delta is only held back, not searched: a stop string must end in a delta that is
        checked, though it may start in earlier text (vLLM's rule for ``min_tokens``).

        Returns:
            ``(released, matched)``: the text that can be sent now, and
            whether a stop string was found (then ``released`` ends right
            before it, and nothing more must be sent for this request).
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
    """One request's output path: tokens in, client text and finish reason out.

    Applies, per token: incremental detokenization, stop strings, and ``pipeline.common.messages.check_finish`` (stop
    token ids and ``max_tokens``, the same rule the scheduler applies on its side). The text accumulates here until the
    reader hands it on (``take_text``). When nothing needs the text before the finish (``incremental`` false and no stop
    strings: a client that waits for the whole answer), a token costs only its finish check, and the text is detokenized
    all at once (``Detokenizer.push_many``) with the finishing token: the same text, for a fraction of the work.

    Args:
        detokenizer: this request's ``Detokenizer``.
        params: the request's sampling parameters.
        stop: stop strings (may be empty).
        incremental: the text is wanted as it comes (a stream).

    Attributes:
        num_output_tokens: tokens pushed so far, the finishing one included (what ``usage.completion_tokens`` reports).
        token_ids: those tokens (a list that only grows).
        text_pieces: text produced and not yet taken (non-empty strings).
        needs_abort: set with a "stop" finish that came from a stop string: the scheduler does not know about it and
            must be told to abort (it finishes stop token ids and ``max_tokens`` on its own).
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
        """Process the next sampled token; its text (if any) joins ``text_pieces``.

        Must not be called again once a finish reason was returned.

        Returns:
            Why the request ended with this token, or None if it goes on.
        """
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
