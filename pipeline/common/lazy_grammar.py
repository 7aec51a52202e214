"""A grammar inactive until its trigger: tool calling's ``tool_choice: auto`` (docs/design.md, "Tool calling").

The grammar (llguidance's Lark, with a lazy trigger rule or a start anchor)
lets any text through until the trigger, then constrains the call.
``TriggeredGrammarState`` runs no matcher and masks nothing while the
text cannot reach the trigger in the next token, so such a row decodes every
step, with placeholders, like an unconstrained one. Only where the next token
could complete the trigger does it build a matcher (a copy of a pristine one,
fed the last bytes of the text) and mask; once the trigger is in, it is a
constrained row like any other. A row waits for its token in flight only
when that token could bring it to such a point (``needs_mask(1)``).

The decisions depend on the tokens consumed only, so asynchronous scheduling
and lock step mask the same positions and sample the same tokens.
"""

from __future__ import annotations

from bisect import bisect_left
from functools import lru_cache

import llguidance
import numpy as np

from pipeline.common.grammar import GrammarState

# Bytes before the trigger's start fed to a new matcher, so that it starts at a character boundary.
_UTF8_SLACK = 3


class _Vocab:
    """Each token's bytes as text (empty for a special token), for one llguidance tokenizer."""

    def __init__(self, tokenizer: llguidance.LLTokenizer):
        n = tokenizer.vocab_size
        self.bytes = [b"" if tokenizer.is_special_token(t) else tokenizer.decode_bytes([t]) for t in range(n)]
        self.distinct = sorted(set(self.bytes) - {b""})


@lru_cache(maxsize=4)
def _vocab(tokenizer: llguidance.LLTokenizer) -> _Vocab:
    return _Vocab(tokenizer)


class _TriggerTable:
    """For a trigger ``T`` of ``L`` bytes, per state ``s`` (the text ends with ``T[:s]``, ``s < L``):

    ``risky[s]``: some token completes ``T`` from ``s`` (the next token needs a mask);
    ``maybe[s]``: some token leads from ``s`` to completion or to a risky state (a
    token in flight from ``s`` must be waited for).
    """

    def __init__(self, vocab: _Vocab, trigger: bytes):
        t, n = trigger, len(trigger)
        toks = vocab.distinct
        whole = any(t in b for b in toks)

        def starts(prefix: bytes) -> bool:
            i = bisect_left(toks, prefix)
            return i < len(toks) and toks[i].startswith(prefix)

        completes = [False] + [starts(t[j:]) for j in range(1, n)]
        self.risky = [whole or any(completes[j] for j in range(1, s + 1) if t[:s].endswith(t[:j])) for s in range(n)]
        # States a token reaches on its own bytes (the state before it does not matter).
        ends: set[int] = set()
        last = {}
        for k in range(n - 1, 0, -1):
            last.setdefault(t[k - 1], []).append(k)
        for b in toks:
            for k in last.get(b[-1], ()):
                if k <= len(b) and b.endswith(t[:k]):
                    ends.add(k)
                    break
        from_any = any(self.risky[k] for k in ends)
        pieces = {t[i:j] for i in range(n) for j in range(i + 1, n + 1)}
        inner = [b for b in toks if b in pieces]  # tokens that may extend the state they follow
        self.maybe = []
        for s in range(n):
            reach = [advance(t, s, b) for b in inner]
            self.maybe.append(self.risky[s] or from_any or any(k == n or self.risky[k] for k in reach))


@lru_cache(maxsize=16)
def _table(tokenizer: llguidance.LLTokenizer, trigger: bytes) -> _TriggerTable:
    return _TriggerTable(_vocab(tokenizer), trigger)


def advance(trigger: bytes, s: int, data: bytes) -> int:
    """The state after ``data`` follows state ``s``: ``len(trigger)`` once the trigger is complete."""
    text = trigger[:s] + data
    if trigger in text:
        return len(trigger)
    for k in range(min(len(trigger) - 1, len(text)), 0, -1):
        if text.endswith(trigger[:k]):
            return k
    return 0


class TriggeredGrammarState:
    """The grammar of one ``auto`` tool-calling request, on the scheduler side.

    Args:
        pristine: the grammar's matcher before any token (copied when needed).
        tokenizer: the llguidance tokenizer the matcher was built with.
        trigger: the text that starts the constrained part (ASCII).
        at_start: the trigger counts only at the start of the output.
    """

    __slots__ = ("_pristine", "_tokenizer", "_vocab", "_trigger", "_at_start", "_table", "_s", "_tail", "_live")

    def __init__(self, pristine: GrammarState, tokenizer: llguidance.LLTokenizer, trigger: str, at_start: bool):
        self._pristine = pristine
        self._tokenizer = tokenizer
        self._vocab = _vocab(tokenizer)
        self._trigger = trigger.encode()
        self._at_start = at_start
        self._table = None if at_start else _table(tokenizer, self._trigger)
        self._s = 0  # unanchored: the state; anchored: bytes of the text, or -1 once it cannot start with it
        self._tail = b""  # the text's last bytes
        self._live: GrammarState | None = None  # the matcher, at risk or once triggered

    @property
    def triggered(self) -> bool:
        return self._s == len(self._trigger)

    def needs_mask(self, in_flight: int) -> bool:
        """As ``GrammarState.needs_mask``; False while the text is free and cannot reach the trigger."""
        s = self._s
        if s == len(self._trigger) or in_flight > 1:
            return True
        if self._at_start:
            return s >= 0
        return self._table.maybe[s] if in_flight else self._table.risky[s]

    def fill_mask(self, out: np.ndarray) -> None:
        """As ``GrammarState.fill_mask`` (only asked where ``needs_mask``)."""
        if self._live is None:
            self._live = self._matcher_for_tail()
        if self._live is None:
            out.fill(-1)  # the tail does not parse (it always should): nothing is constrained
        else:
            self._live.fill_mask(out)

    def accept(self, token_id: int) -> bool:
        """As ``GrammarState.accept``."""
        if self.triggered:
            return self._live.accept(token_id) if self._live is not None else True
        live, self._live = self._live, None
        ok = live.accept(token_id) if live is not None else True
        data = self._vocab.bytes[token_id] if token_id < len(self._vocab.bytes) else b""
        if not data:
            return ok
        t, n = self._trigger, len(self._trigger)
        self._tail = (self._tail + data)[-(n + _UTF8_SLACK) :]
        if not self._at_start:
            self._s = advance(t, self._s, data)
        elif self._s >= 0:  # the text so far is t[:s]
            text = t[: self._s] + data
            self._s = n if text.startswith(t) else len(text) if t.startswith(text) else -1
        if self.triggered:
            self._live = live if live is not None else self._matcher_for_tail()
        return ok

    def _matcher_for_tail(self) -> GrammarState | None:
        """A matcher fed the text's end from a character boundary, or None if it rejects it."""
        if self._at_start:
            tail = self._trigger[: self._s] if not self.triggered else self._tail
        else:
            tail = self._tail[-(self._s + _UTF8_SLACK) :]
            start = 0
            while start < len(tail) and 0x80 <= tail[start] < 0xC0:  # a character's continuation bytes
                start += 1
            tail = tail[start:]
        m = self._pristine.fork()
        return m if m.consume_tokens(self._tokenizer.tokenize_bytes(tail)) else None
