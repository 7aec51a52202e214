"""The base of tool-call parsers: a format's layout, and the llguidance Lark grammar it gives (docs/design.md, "Tool
calling"): free text, then a calls region from the trigger."""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from typing import ClassVar

from pipeline.io_proc.tool_parsers.calls import CallScanner, ToolCall, ToolSpec, assemble
from pipeline.io_proc.tool_parsers.stream import ToolCallStream


class ToolParser(ABC):
    """A model family's tool-call format: its parser (``stream``) and the grammar that enforces it; subclasses set
    ``name`` (``--tool-call-parser``), the layout and ``call_scanner``/``call_rules``."""

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

    @abstractmethod
    def call_text(self, name: str, arguments: dict) -> str:
        """One call as the grammar writes it, without its tags."""

    @property
    @abstractmethod
    def example_call(self) -> str:
        """One call with placeholders for its name and arguments, for telling the model the format."""

    def render(self, calls: list[str]) -> str:
        """Calls (each from ``call_text`` or ``example_call``) laid out as the model writes them."""
        head = "" if self.trigger_in_region else self.trigger
        one = [self.call_open + c + self.call_close for c in calls]
        return head + self.region_open + self.separator.join(one) + self.region_close

    def stream(self) -> ToolCallStream:
        """A parser state for one output."""
        return ToolCallStream(self)

    def extract(self, text: str) -> tuple[str, list[ToolCall]]:
        """The content and calls of a whole output; a call it ends inside is content, not a broken call."""
        s = self.stream()
        content, calls = assemble(s.feed(text) + s.finish())
        if s.cut:
            calls.pop()
            content += s.cut
        return content, calls

    def grammar(self, tools: list[ToolSpec], *, free: bool, parallel: bool) -> str:
        """The grammar (llguidance's Lark) of an output in this format: with ``free``, inactive until the trigger; with
        ``parallel``, several calls."""
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
                f"trigger[lazy]: TEXT {lark_literal(self.trigger)}",
            ]
        return "\n".join(["%llguidance {}", *rules, self.call_rules(tools)]) + "\n"


def lark_literal(s: str) -> str:
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
            out.append(lark_literal(p))
    return " ".join(out)


def _regex_escape(c: str) -> str:
    return "\\" + c if c in "[]\\^-" else c
