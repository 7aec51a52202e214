"""What tool-call parsers read and emit: tools, calls, the pieces of a streamed call, call scanners."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Protocol


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
        """Consume ``text[i:]`` up to the end of the call, appending ``("name", name)`` and ``("args", fragment)`` to
        ``pieces``; returns the ``j`` the call ends before (``len(text)``: it may go on).

        Raises:
            Broken: the text is not a call of this format from that position on (``pieces`` has what came before it).
        """

    @property
    @abstractmethod
    def done(self) -> bool:
        """True once the call's last character has been consumed."""


class CallLayout(Protocol):
    """What reading a format's calls needs of its parser (``ToolParser`` has it): the layout's literals and a scanner
    for one call."""

    trigger: str
    anchored: bool
    trigger_in_region: bool
    region_open: str
    call_open: str
    call_close: str
    separator: str
    region_close: str

    def call_scanner(self) -> CallScanner: ...
