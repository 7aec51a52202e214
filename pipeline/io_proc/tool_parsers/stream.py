"""The incremental parser every tool-call format shares (``ToolCallStream``); any split of the stream gives the
non-streamed result."""

from __future__ import annotations

from pipeline.io_proc.tool_parsers.calls import Broken, CallLayout, CallScanner, Event, ToolCallDelta

# Where the machine is in the output.
_TEXT, _REGION_OPEN, _CALL_OPEN, _CALL, _CALL_CLOSE, _AFTER_CALL, _TAIL = range(7)


class ToolCallStream:
    """The incremental parser of one output: ``feed`` each text delta, then ``finish``.

    Possible triggers or tags are held back until told apart; text leaving the format becomes content. ``cut``: after
    ``finish``, the partly emitted call the output ended inside ("" if none).
    """

    def __init__(self, parser: CallLayout):
        self._p = parser
        self._buf = ""  # text not consumed yet
        self._raw = ""  # text consumed since the current call began (or the region, for the first)
        self._state = _TEXT
        self._at_start = True
        self._scanner: CallScanner | None = None
        self._num_calls = 0
        self._named = False  # the current call's name was emitted
        self._trim = False  # in _TAIL after the calls: leading whitespace is dropped
        self.cut = ""

    def feed(self, text: str) -> list[Event]:
        """Events for ``text``, the output's next delta."""
        self._buf += text
        out: list[Event] = []
        while self._step(out):
            pass
        return out

    def finish(self) -> list[Event]:
        """Events for the held-back text, at the end of the output."""
        out: list[Event] = []
        rest = self._buf.lstrip() if self._state == _AFTER_CALL or self._trim else self._buf
        if rest and self._state in (_TEXT, _TAIL, _AFTER_CALL):
            out.append(rest)  # text after the calls, or a trigger's start that never completed
        elif self._state in (_REGION_OPEN, _CALL_OPEN, _CALL) and self._raw + rest:
            # Ended inside a call: its text must not vanish.
            if self._named:
                self.cut = self._raw + rest
            else:
                out.append(self._raw + rest)
        self._buf = ""
        return out

    def _step(self, out: list[Event]) -> bool:
        """Advance as far as the buffer allows; True if the state changed and it should go on."""
        p, st = self._p, self._state
        if st == _TEXT:
            return self._scan_text(out)
        if st == _TAIL:
            if self._trim:  # whitespace right after the calls is not content
                self._buf = self._buf.lstrip()
                self._trim = not self._buf
            if self._buf:
                out.append(self._buf)
                self._buf = ""
            return False
        if st == _CALL:
            pieces: list[tuple[str, str]] = []
            try:
                j = self._scanner.feed(self._buf, 0, pieces)
            except Broken as e:
                self._pieces(pieces, out)
                self._consume(e.pos)
                return self._broken(out)
            self._pieces(pieces, out)
            self._consume(j)
            if not self._scanner.done:
                return False
            self._state, self._scanner = _CALL_CLOSE, None
            return True
        # The structural states: skip whitespace, then expect a literal.
        stripped = self._buf.lstrip()
        if not stripped:
            return False
        if st == _REGION_OPEN:
            return self._expect(p.region_open.strip(), _CALL_OPEN, out)
        if st == _CALL_OPEN:
            return self._expect(p.call_open.strip(), _CALL, out)
        if st == _CALL_CLOSE:
            if not self._expect(p.call_close.strip(), _AFTER_CALL, out):
                return False
            self._num_calls += 1
            self._raw, self._named = "", False
            return True
        # _AFTER_CALL: another call, or the end of the region.
        separator, close = p.separator.strip(), p.region_close.strip()
        if not separator and not close and p.call_open.strip():
            separator = ""  # calls follow each other (hermes): another opening tag, or the end
            found = _match(stripped, p.call_open.strip())
            if found is None:
                return False
            if found:
                self._consume(len(self._buf) - len(stripped))
                self._state = _CALL_OPEN
                return True
        for literal, state in ((separator, _CALL_OPEN), (close, _TAIL)):
            if literal:
                found = _match(stripped, literal)
                if found is None:
                    return False
                if found:
                    self._consume(len(self._buf) - len(stripped) + len(literal))
                    self._state = state
                    if state == _TAIL:
                        self._raw, self._trim = "", True
                    return True
        self._buf, self._state, self._raw = stripped, _TAIL, ""
        return True

    def _scan_text(self, out: list[Event]) -> bool:
        p, buf = self._p, self._buf
        if p.anchored:
            if not self._at_start:
                return self._emit_text(len(buf), out)
            found = _match(buf, p.trigger)
            if found is None:
                return False  # a prefix of the trigger so far
            self._at_start = False
            if not found:
                return self._emit_text(len(buf), out)
            return self._enter_region()
        k = buf.find(p.trigger)
        if k < 0:
            # Hold back the longest end that may begin the trigger.
            longest = min(len(buf), len(p.trigger) - 1)
            keep = next((n for n in range(longest, 0, -1) if p.trigger.startswith(buf[-n:])), 0)
            return self._emit_text(len(buf) - keep, out)
        self._emit_text(k, out)
        return self._enter_region()

    def _emit_text(self, n: int, out: list[Event]) -> bool:
        if n:
            out.append(self._buf[:n])
            self._buf = self._buf[n:]
        return False

    def _enter_region(self) -> bool:
        if not self._p.trigger_in_region:
            self._consume(len(self._p.trigger))
        self._state = _REGION_OPEN
        return True

    def _consume(self, n: int) -> None:
        self._raw += self._buf[:n]
        self._buf = self._buf[n:]

    def _expect(self, literal: str, state: int, out: list[Event]) -> bool:
        stripped = self._buf.lstrip()
        found = _match(stripped, literal)
        if found is None:
            return False
        if not found:
            return self._broken(out)
        self._consume(len(self._buf) - len(stripped) + len(literal))
        self._state = state
        if state == _CALL:
            self._scanner = self._p.call_scanner()
        return True

    def _broken(self, out: list[Event]) -> bool:
        """The format breaks at the buffer's start: the rest is content (with the call so far if unnamed)."""
        if not self._named and self._raw:
            out.append(self._raw)
        self._state, self._scanner, self._raw = _TAIL, None, ""
        return True

    def _pieces(self, pieces: list[tuple[str, str]], out: list[Event]) -> None:
        for kind, value in pieces:
            if kind == "name":
                out.append(ToolCallDelta(self._num_calls, value, ""))
                self._named = True
            elif value:
                out.append(ToolCallDelta(self._num_calls, None, value))


def _match(text: str, literal: str) -> bool | None:
    """Whether ``text`` starts with ``literal``; None while ``text`` is a shorter prefix of it."""
    if text.startswith(literal):
        return True
    return None if literal.startswith(text) else False
