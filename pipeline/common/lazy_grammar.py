"""A grammar inactive until its trigger: tool calling's ``tool_choice: auto`` (docs/design.md, "Tool calling").

``Trigger`` follows the output text without a matcher: a row needs a mask only where the next token could complete the
trigger (and from then on). Decisions depend on consumed tokens only, so async and lock step agree.
"""

from __future__ import annotations

from bisect import bisect_left
from functools import lru_cache

import llguidance

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
    """For a trigger ``T`` of ``L`` bytes, per state ``s < L`` (text ends with ``T[:s]``): ``risky[s]``, some token
    completes ``T``; ``maybe[s]``, some token leads to completion or a risky state."""

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


class Trigger:
    """Where the output's text stands against the (ASCII) trigger of one ``auto`` tool-calling request (a choice)."""

    __slots__ = ("_vocab", "_trigger", "_at_start", "_table", "_s", "_tail")

    def __init__(self, tokenizer: llguidance.LLTokenizer, trigger: str, at_start: bool):
        self._vocab = _vocab(tokenizer)
        self._trigger = trigger.encode()
        self._at_start = at_start
        self._table = None if at_start else _table(tokenizer, self._trigger)
        self._s = 0  # unanchored: the state; anchored: bytes of the text, or -1 once it cannot start with it
        self._tail = b""  # the text's last bytes

    @property
    def triggered(self) -> bool:
        return self._s == len(self._trigger)

    def needs_mask(self, in_flight: int) -> bool:
        """Whether the next sampled token needs a mask, with ``in_flight`` of the row's tokens not fed yet (a row that
        needs one waits for them); False while the text is free and cannot reach the trigger."""
        s = self._s
        if s == len(self._trigger) or in_flight > 1:
            return True
        if self._at_start:
            return s >= 0
        return self._table.maybe[s] if in_flight else self._table.risky[s]

    def feed(self, token_id: int) -> None:
        """Follow output token ``token_id`` (not a stop id); a special token leaves the state alone."""
        data = self._vocab.bytes[token_id] if token_id < len(self._vocab.bytes) else b""
        if not data or self.triggered:
            return
        t, n = self._trigger, len(self._trigger)
        self._tail = (self._tail + data)[-(n + _UTF8_SLACK) :]
        if not self._at_start:
            self._s = advance(t, self._s, data)
        elif self._s >= 0:  # the text so far is t[:s]
            text = t[: self._s] + data
            self._s = n if text.startswith(t) else len(text) if t.startswith(text) else -1

    def tail(self) -> bytes:
        """The text's end from a character boundary, for a fresh matcher to consume: from it on, the matcher's state is
        that of one fed the whole text."""
        if self._at_start:
            return self._trigger[: self._s] if not self.triggered else self._tail
        tail = self._tail[-(self._s + _UTF8_SLACK) :]
        start = 0
        while start < len(tail) and 0x80 <= tail[start] < 0xC0:  # a character's continuation bytes
            start += 1
        return tail[start:]
