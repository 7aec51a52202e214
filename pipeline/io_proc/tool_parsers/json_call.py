"""Calls written as JSON objects: their scanner, and their grammar rules."""

from __future__ import annotations

import json
from typing import ClassVar

from pipeline.io_proc.tool_parsers.base import ToolParser, lark_literal
from pipeline.io_proc.tool_parsers.calls import Broken, CallScanner, ToolSpec

# JSON as json.dumps writes it (and chat templates' tojson): no other whitespace, so none without end.
_COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def json_call_rules(tools: list[ToolSpec], args_key: str = "arguments") -> str:
    """Rules for ``call`` as ``{"name": NAME, "<args_key>": ARGS}``, name first, ARGS valid for its schema."""
    alternatives = " | ".join(f"call_{i}" for i in range(len(tools)))
    rules = [f"call: {alternatives}"]
    for i, t in enumerate(tools):
        head = '{"name": ' + json.dumps(t.name) + ", " + json.dumps(args_key) + ": "
        schema = json.dumps({**t.parameters, "x-guidance": _COMPACT})
        rules.append(f"call_{i}: {lark_literal(head)} %json {schema} {lark_literal('}')}")
    return "\n".join(rules)


class JsonToolParser(ToolParser):
    """A format whose calls are JSON objects; ``args_keys`` may hold the arguments, the first is the one written."""

    args_keys: ClassVar[tuple[str, ...]] = ("arguments",)

    def call_scanner(self) -> JsonCallScanner:
        return JsonCallScanner(self.args_keys)

    def call_rules(self, tools: list[ToolSpec]) -> str:
        return json_call_rules(tools, self.args_keys[0])

    def call_text(self, name: str, arguments: dict) -> str:
        return json.dumps({"name": name, self.args_keys[0]: arguments}, ensure_ascii=False)

    @property
    def example_call(self) -> str:
        return '{"name": <function name>, ' + json.dumps(self.args_keys[0]) + ": <arguments object>}"


_WS = " \t\n\r"


class JsonCallScanner(CallScanner):
    """One call as a JSON object ``{"name": ..., "arguments": {...}}``, keys in any order; ``args_keys`` may hold the
    arguments (Llama 3 writes ``parameters``), which stream as raw text (a JSON string comes whole, decoded)."""

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
