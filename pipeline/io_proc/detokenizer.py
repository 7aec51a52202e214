"""Output token ids -> client text: incremental detokenization, stop strings, finish.

Everything here runs on io_proc's output-reader thread, one object set per
request, and is pure Python over a ``decode`` function, so it is tested without
a server.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from pipeline.common.messages import FinishReason, SamplingParams, check_finish

# What a byte-level decoder emits for an incomplete UTF-8 sequence.
_REPLACEMENT_CHAR = "\ufffd"

DecodeFn = Callable[[list[int]], str]
"""``decode(token_ids) -> text`` with special tokens skipped, e.g.
``functools.partial(tokenizer.decode, skip_special_tokens=True)``."""


class IncrementalDetokenizer:
    """Turns one request's output tokens into text deltas, one token at a time.

    The prefix-offset / read-offset algorithm of Hugging Face
    text-generation-inference and vLLM (``detokenize_incrementally``): decode
    the window ``token_ids[prefix_offset:]`` and the already-emitted part
    ``token_ids[prefix_offset:read_offset]``; the difference is the new text.
    Decoding a short window keeps the per-token cost constant, and starting
    the window one step back keeps context-dependent decoders (e.g.
    SentencePiece's leading space) right.

    A character whose UTF-8 bytes are split over several tokens (emoji, CJK)
    decodes to U+FFFD until its last byte arrives; while the window ends with
    U+FFFD nothing is emitted and the offsets stay, so the character is
    emitted whole later. Otherwise the window advances past every token
    consumed, whether or not it produced text (a skipped special token moves
    the window too). Offsets never move backwards.

    For text made of complete characters, the concatenation of all deltas
    equals ``decode(token_ids)``. An incomplete character still pending when
    the request ends is never emitted (no U+FFFD reaches a client).

    Attributes:
        token_ids: every output token pushed so far (list of int).
        prefix_offset: start of the decode window (index into ``token_ids``).
        read_offset: end of the text already emitted (index into ``token_ids``).
    """

    __slots__ = ("_decode", "token_ids", "prefix_offset", "read_offset")

    def __init__(self, decode: DecodeFn):
        self._decode = decode
        self.token_ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0

    def push(self, token_id: int) -> str:
        """Append ``token_id``; return the text it completes ("" if none yet)."""
        ids = self.token_ids
        ids.append(token_id)
        new_text = self._decode(ids[self.prefix_offset:])
        if new_text.endswith(_REPLACEMENT_CHAR):
            return ""
        prefix_text = self._decode(ids[self.prefix_offset:self.read_offset])
        self.prefix_offset = self.read_offset
        self.read_offset = len(ids)
        return new_text[len(prefix_text):]


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
        decode: see :data:`DecodeFn`.
        params: the request's sampling parameters.
        stop: stop strings (may be empty).

    Attributes:
        num_output_tokens: tokens pushed so far, the finishing one included
            (what ``usage.completion_tokens`` reports).
        token_ids: those tokens (a list that only grows).
    """

    __slots__ = ("_detok", "_stop", "_params", "num_output_tokens", "token_ids")

    def __init__(self, decode: DecodeFn, params: SamplingParams, stop: Sequence[str] = ()):
        self._detok = IncrementalDetokenizer(decode)
        self.token_ids = self._detok.token_ids
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
