"""Tool-call parsers: what one is, and the incremental machine every format shares.

A format is free text, then a *calls region* that starts at the parser's
trigger: an optional opening, calls (each with an optional opening and
closing tag) separated by a separator, an optional closing. The same
incremental machine serves a stream and a whole output (the whole output is
one chunk), so a stream reassembles exactly to the non-streamed result
however it is split. docs/design.md, "Tool calling".
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar


@dataclass(frozen=True)
class ToolSpec:
    """A function the model may call: its name and the JSON schema of its arguments."""

    name: str
    parameters: dict


@dataclass
class ToolCallDelta:
    """A piece of call ``index``: ``name`` on its first piece only, then fragments of its JSON ``arguments``."""

    index: int
    name: str | None
    arguments: str


# What a parser emits: content text (a str) or a piece of a call.
Event = str | ToolCallDelta


@dataclass
class ToolCall:
    """One parsed call; ``arguments`` is JSON text (cut short if the output was)."""

    name: str
    arguments: str


def assemble(events: list[Event]) -> tuple[str, list[ToolCall]]:
    """The content and the calls that ``events`` add up to."""
    content: list[str] = []
    calls: list[ToolCall] = []
    for e in events:
        if isinstance(e, str):
            content.append(e)
        elif e.name is not None:
            calls.append(ToolCall(e.name, e.arguments))
        else:
            calls[e.index].arguments += e.arguments
    return "".join(content), calls


class Broken(Exception):
    """The text stops being a call of the format at ``pos``."""

    def __init__(self, pos: int):
        super().__init__(pos)
        self.pos = pos


class CallScanner(ABC):
    """Reads one call, character by character, from its first character to its last."""

    @abstractmethod
    def feed(self, text: str, i: int, pieces: list[tuple[str, str]]) -> int:
        """Consume ``text[i:]`` up to the end of the call, appending to ``pieces``.

        Returns:
            The call ends before ``text[j]`` for the ``j`` returned (``len(text)``:
            it may go on). ``pieces`` get ``("name", name)`` and ``("args", fragment)``.

        Raises:
            Broken: the text is not a call of this format from that position on
                (``pieces`` has what came before it).
        """

    @property
    @abstractmethod
    def done(self) -> bool:
        """True once the call's last character has been consumed."""


class ToolParser(ABC):
    """A model family's tool-call format: its parser (:meth:`stream`) and the grammar that enforces it.

    Subclasses set ``name`` (the ``--tool-call-parser`` value), the layout
    below and :meth:`call_scanner` / :meth:`call_rules`. The layout's literals
    are written as the grammar emits them; the parser skips whitespace
    around them.
    """

    name: ClassVar[str]
    # The text that starts the calls region; it must be ASCII.
    trigger: ClassVar[str]
    # The trigger counts only at the very start of the output (then it is one character).
    anchored: ClassVar[bool] = False
    # The trigger is the region's own first text (hermes' "<tool_call>", JSON's "{", a list's "[").
    trigger_in_region: ClassVar[bool] = True
    region_open: ClassVar[str] = ""
    call_open: ClassVar[str] = ""
    call_close: ClassVar[str] = ""
    separator: ClassVar[str] = ""
    region_close: ClassVar[str] = ""

    @abstractmethod
    def call_scanner(self) -> CallScanner:
        """A scanner for one call."""

    @abstractmethod
    def call_rules(self, tools: list[ToolSpec]) -> str:
        """Lark rules defining ``call``: a call of one of ``tools`` with arguments valid for its schema."""

    def stream(self) -> ToolCallStream:
        """A parser state for one output."""
        return ToolCallStream(self)

    def extract(self, text: str) -> tuple[str, list[ToolCall]]:
        """The content and calls of a whole output."""
        s = self.stream()
        return assemble(s.feed(text) + s.finish())

    def grammar(self, tools: list[ToolSpec], *, free: bool, parallel: bool) -> str:
        """The grammar (llguidance's Lark) of an output in this format.

        Args:
            tools: the functions it may call.
            free: text may come instead (``tool_choice: auto``): the grammar is
                inactive until the trigger; otherwise the output is calls only.
            parallel: several calls, else one.
        """
        one = [self.call_open, "call", self.call_close]
        region = [self.region_open, *one]
        if parallel:
            region.append(("(", [self.separator, *one], ")*"))
        region.append(self.region_close)
        if not free:
            start = ([] if self.trigger_in_region else [self.trigger]) + region
            rules = [f"start: {_seq(start)}"]
        elif self.anchored:
            rules = [f"start: FREE | {_seq(region)}", f"FREE: /([^{_regex_escape(self.trigger)}](.|\\n)*)?/"]
        else:
            if self.trigger_in_region:
                head = self.region_open + self.call_open
                if not head.startswith(self.trigger):
                    raise ValueError(f"{self.name}: the region must start with the trigger")
                region = [head[len(self.trigger) :], "call", self.call_close, *region[4:]]
            rules = [
                "start: TEXT | trigger " + _seq(region),
                "TEXT: /(.|\\n)*/",
                f"trigger[lazy]: TEXT {_lit(self.trigger)}",
            ]
        return "\n".join(["%llguidance {}", *rules, self.call_rules(tools)]) + "\n"


def _lit(s: str) -> str:
    return json.dumps(s)


def _seq(parts: list) -> str:
    """Lark for a sequence of literals, rule names (``call``) and ``(open, parts, close)`` groups."""
    out = []
    for p in parts:
        if isinstance(p, tuple):
            out.append(p[0] + _seq(p[1]) + p[2])
        elif p == "call":
            out.append("call")
        elif p:
            out.append(_lit(p))
    return " ".join(out)


def _regex_escape(c: str) -> str:
    return "\\" + c if c in "[]\\^-" else c


# JSON as json.dumps writes it (and chat templates' tojson): no other whitespace, so none without end.
_COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def json_call_rules(tools: list[ToolSpec], args_key: str = "arguments") -> str:
    """Rules for ``call`` as ``{"name": NAME, "<args_key>": ARGS}``, name first, ARGS valid for its schema."""
    alternatives = " | ".join(f"call_{i}" for i in range(len(tools)))
    rules = [f"call: {alternatives}"]
    for i, t in enumerate(tools):
        head = '{"name": ' + json.dumps(t.name) + ", " + json.dumps(args_key) + ": "
        schema = json.dumps({**t.parameters, "x-guidance": _COMPACT})
        rules.append(f"call_{i}: {_lit(head)} %json {schema} {_lit('}')}")
    return "\n".join(rules)


# Where the machine is in the output.
_TEXT, _REGION_OPEN, _CALL_OPEN, _CALL, _CALL_CLOSE, _AFTER_CALL, _TAIL = range(7)


class ToolCallStream:
    """The incremental parser of one output: :meth:`feed` each text delta, then :meth:`finish`.

    Text that may begin the trigger or a tag is held back until it is told
    apart. Where the text stops following the format, the rest is content,
    from the start of the call it was in if nothing of that call was emitted.
    """

    def __init__(self, parser: ToolParser):
        self._p = parser
        self._buf = ""  # text not consumed yet
        self._raw = ""  # text consumed since the current call began (or the region, for the first)
        self._state = _TEXT
        self._at_start = True
        self._scanner: CallScanner | None = None
        self._num_calls = 0
        self._named = False  # the current call's name was emitted
        self._trim = False  # in _TAIL after the calls: leading whitespace is dropped

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


_WS = " \t\n\r"


class JsonCallScanner(CallScanner):
    """One call as a JSON object: ``{"name": ..., "arguments": {...}}``, keys in any order.

    The arguments stream as the raw text of their value (arguments given as
    a JSON string come whole, decoded, when it ends); arguments before the
    name are held until the name is read; a call without them has ``{}``.

    Args:
        args_keys: the keys that may hold the arguments (Llama 3 writes ``parameters``).
    """

    def __init__(self, args_keys: tuple[str, ...] = ("arguments",)):
        self._args_keys = args_keys
        self._state = "open"
        self._raw = ""  # the key being read
        self._esc = False
        self._key = ""
        self._value: _JsonValue | None = None
        self._name: str | None = None
        self._held = ""  # arguments read before the name
        self._has_args = False
        self._done = False

    @property
    def done(self) -> bool:
        return self._done

    def feed(self, text: str, i: int, pieces: list[tuple[str, str]]) -> int:
        n = len(text)
        while i < n and not self._done:
            st = self._state
            if st == "value":
                start, i = self._value.feed(text, i)
                if self._key in self._args_keys and not self._value.is_string:
                    self._args(text[start:i], pieces)
                if self._value.done:
                    self._value_done(pieces, i)
                continue
            c = text[i]
            i += 1
            if st == "key":
                if self._esc:
                    self._esc = False
                elif c == "\\":
                    self._esc = True
                elif c == '"':
                    self._key, self._state = _json_string(self._raw, i - 1), "colon"
                    continue
                self._raw += c
            elif c in _WS:
                continue
            elif st == "open" and c == "{":
                self._state = "first"
            elif st in ("first", "next") and c == '"':
                self._state, self._raw = "key", ""
            elif st in ("first", "after") and c == "}":
                self._end(pieces, i - 1)
            elif st == "colon" and c == ":":
                self._state, self._value = "value", _JsonValue()
                self._has_args |= self._key in self._args_keys
            elif st == "after" and c == ",":
                self._state = "next"
            else:
                raise Broken(i - 1)
        return i

    def _value_done(self, pieces: list[tuple[str, str]], end: int) -> None:
        v = self._value
        if self._key == "name":
            if not v.is_string:
                raise Broken(end)
            self._name = _json_string(v.raw[1:-1], end)
            pieces.append(("name", self._name))
            if self._held:
                pieces.append(("args", self._held))
        elif self._key in self._args_keys and v.is_string:
            self._args(_json_string(v.raw[1:-1], end), pieces)
        self._state, self._value = "after", None

    def _args(self, fragment: str, pieces: list[tuple[str, str]]) -> None:
        if self._name is None:
            self._held += fragment
        elif fragment:
            pieces.append(("args", fragment))

    def _end(self, pieces: list[tuple[str, str]], pos: int) -> None:
        if self._name is None:
            raise Broken(pos)
        if not self._has_args:
            pieces.append(("args", "{}"))
        self._done = True


def _json_string(raw: str, pos: int) -> str:
    """The string whose JSON text (without quotes) is ``raw``; ``Broken(pos)`` if it is not one."""
    try:
        return json.loads('"' + raw + '"')
    except ValueError:
        raise Broken(pos) from None


class _JsonValue:
    """Where a JSON value ends: a container by its depth, a string by its quote, others by a delimiter."""

    def __init__(self):
        self.started = False
        self.done = False
        self.is_string = False
        self.raw = ""  # a string value's text, quotes included
        self._depth = 0
        self._in_str = False
        self._esc = False

    def feed(self, text: str, i: int) -> tuple[int, int]:
        """Consume from ``text[i]``: ``(start, end)``, the value's characters in this text."""
        n = len(text)
        while i < n and not self.started and text[i] in _WS:
            i += 1
        start = i
        while i < n:
            c = text[i]
            if not self.started:
                self.started, self.is_string = True, c == '"'
            if self._in_str:
                if self._esc:
                    self._esc = False
                elif c == "\\":
                    self._esc = True
                elif c == '"':
                    self._in_str = False
                    if self._depth == 0:
                        i += 1
                        self.done = True
                        break
            elif c == '"':
                self._in_str = True
            elif c in "{[":
                self._depth += 1
            elif c in "}]" and self._depth:
                self._depth -= 1
                if self._depth == 0:
                    i += 1
                    self.done = True
                    break
            elif self._depth == 0 and c in ",}]" + _WS:
                self.done = True  # a number or literal, ended by what follows it
                break
            i += 1
        if self.is_string:
            self.raw += text[start:i]
        return start, i
