"""Llama 3.2 / Llama 4 / ToolACE Python-style calls, ``[get_weather(city="Paris"), f()]``; arguments stream whole as
JSON. The grammar enforces names, types, enums and items, not string lengths, patterns or numeric bounds."""

from __future__ import annotations

import ast
import json

from pipeline.io_proc.tool_parsers.base import ToolParser
from pipeline.io_proc.tool_parsers.calls import Broken, CallScanner, ToolSpec

_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.-")


class PythonicToolParser(ToolParser):
    name = "pythonic"
    trigger = "["
    anchored = True
    region_open = "["
    separator = ", "
    region_close = "]"

    example_call = "<function name>(<argument name>=<value>, ...)"

    def call_scanner(self) -> CallScanner:
        return _PythonCallScanner()

    def call_text(self, name: str, arguments: dict) -> str:
        return f"{name}({', '.join(f'{k}={_python(v)}' for k, v in arguments.items())})"

    def call_rules(self, tools: list[ToolSpec]) -> str:
        g = _PythonLiteralGrammar()
        alternatives = []
        for i, t in enumerate(tools):
            alternatives.append(f"call_{i}")
            g.rules.append(f'call_{i}: {json.dumps(t.name + "(")} {g.members(t.parameters, "=", False)} ")"')
        return "\n".join([f"call: {' | '.join(alternatives)}", *g.rules, *_TERMINALS])


class _PythonCallScanner(CallScanner):
    """``name(key=literal, ...)``: the name when ``(`` comes, the arguments as JSON at ``)``."""

    def __init__(self):
        self._name = ""
        self._args = ""
        self._in_args = False
        self._depth = 0
        self._quote = ""
        self._esc = False
        self._done = False

    @property
    def done(self) -> bool:
        return self._done

    def feed(self, text: str, i: int, pieces: list[tuple[str, str]]) -> int:
        n = len(text)
        if not self._in_args:
            while i < n and not self._name and text[i].isspace():
                i += 1
            while i < n and text[i] in _NAME_CHARS:
                self._name += text[i]
                i += 1
            if i == n:
                return i
            if text[i] != "(" or not self._name:
                raise Broken(i)
            pieces.append(("name", self._name))
            self._in_args = True
            i += 1
        start = i
        while i < n:
            c = text[i]
            if self._quote:
                if self._esc:
                    self._esc = False
                elif c == "\\":
                    self._esc = True
                elif c == self._quote:
                    self._quote = ""
            elif c in "'\"":
                self._quote = c
            elif c in "([{":
                self._depth += 1
            elif c in ")]}":
                if self._depth == 0:
                    self._args += text[start:i]
                    pieces.append(("args", _arguments(self._args, i)))
                    self._done = True
                    return i + 1
                self._depth -= 1
            i += 1
        self._args += text[start:i]
        return i


def _arguments(source: str, pos: int) -> str:
    """The JSON object of keyword arguments ``source``; ``Broken(pos)`` unless all are literals."""
    try:
        call = ast.parse(f"f({source})", mode="eval").body
        if call.args or any(k.arg is None for k in call.keywords):
            raise ValueError("only keyword arguments")
        return json.dumps({k.arg: ast.literal_eval(k.value) for k in call.keywords}, ensure_ascii=False)
    except (SyntaxError, ValueError, TypeError, RecursionError):
        raise Broken(pos) from None


# JSON's string syntax without its "\/" escape is a Python string literal.
_TERMINALS = [
    r'PY_STR: /"(\\([\"\\bfnrt]|u[a-fA-F0-9]{4})|[^\"\\\x00-\x1F\x7F])*"/',
    r"PY_INT: /-?(0|[1-9][0-9]*)/",
    r"PY_NUM: /-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?/",
    'py_any: PY_STR | PY_NUM | "True" | "False" | "None" | "[" (py_any (", " py_any)*)? "]"'
    ' | "{" (PY_STR ": " py_any (", " PY_STR ": " py_any)*)? "}"',
]


class _PythonLiteralGrammar:
    """Lark rules for Python literals that a JSON schema allows (the subset the module docstring names)."""

    def __init__(self):
        self.rules: list[str] = []

    def _rule(self, body: str) -> str:
        name = f"py_{len(self.rules)}"
        self.rules.append(f"{name}: {body}")
        return name

    def value(self, schema: object) -> str:
        if not isinstance(schema, dict):
            return "py_any"
        if "const" in schema:
            return _literal(schema["const"])
        if isinstance(schema.get("enum"), list) and schema["enum"]:
            return self._rule(" | ".join(_literal(v) for v in schema["enum"]))
        for key in ("anyOf", "oneOf"):
            if isinstance(schema.get(key), list) and schema[key]:
                return self._rule(" | ".join(self.value(s) for s in schema[key]))
        kind = schema.get("type")
        if isinstance(kind, list) and kind:
            return self._rule(" | ".join(self.value({**schema, "type": k}) for k in kind))
        if kind == "string":
            return "PY_STR"
        if kind == "integer":
            return "PY_INT"
        if kind == "number":
            return "PY_NUM"
        if kind == "boolean":
            return '("True" | "False")'
        if kind == "null":
            return '"None"'
        if kind == "array":
            item = self.value(schema.get("items", {}))
            return self._rule(f'"[" ({item} (", " {item})*)? "]"')
        if kind == "object" and isinstance(schema.get("properties"), dict):
            return self._rule('"{" ' + self.members(schema, ": ", True) + ' "}"')
        return "py_any"

    def members(self, schema: object, sep: str, quoted: bool) -> str:
        """Keyword arguments (``sep`` "=") or dict entries (``": "``, ``quoted`` keys) in schema order."""
        props = schema.get("properties", {}) if isinstance(schema, dict) else {}
        if not isinstance(props, dict) or not props:
            return ""
        required = set(schema.get("required", [])) if isinstance(schema.get("required"), list) else set()
        items = [
            (json.dumps((json.dumps(k) if quoted else k) + sep), self.value(v), k in required) for k, v in props.items()
        ]
        # rest(i, first): the members from i on; a comma goes before each but the first written.
        memo: dict[tuple[int, bool], str] = {}

        def rest(i: int, first: bool) -> str:
            if i == len(items):
                return ""
            if (i, first) not in memo:
                key, value, req = items[i]
                this = ("" if first else '", " ') + f"{key} {value} " + rest(i + 1, False)
                skip = rest(i + 1, first) or '""'
                body = this if req else f"({this}) | ({skip})"
                memo[i, first] = self._rule(body)
            return memo[i, first]

        return rest(0, True)


def _literal(v: object) -> str:
    """Lark for the Python literal of JSON value ``v``."""
    return json.dumps(repr(v) if not isinstance(v, str) else json.dumps(v))


def _python(v: object) -> str:
    """The Python literal of JSON value ``v`` (a JSON string is a Python string literal too)."""
    if isinstance(v, bool) or v is None:
        return repr(v)
    if isinstance(v, list):
        return "[" + ", ".join(map(_python, v)) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{_python(k)}: {_python(x)}" for k, x in v.items()) + "}"
    return json.dumps(v, ensure_ascii=False)
