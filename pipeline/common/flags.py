"""A flag is a field of a config group (``common/config_groups.py``) that carries its help as metadata.

``Annotated[int, flag("Requests in one step at most.", check=positive)]`` on a frozen msgspec
field declares ``--max-num-seqs``: ``server_args`` generates the parser from the fields and builds
each group from the parsed flags, so a new flag is one field plus the code that reads it.
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys
import types
import typing
from collections.abc import Callable
from typing import Any

import msgspec


@dataclasses.dataclass(frozen=True)
class Flag:
    """A field's flag.

    Attributes:
        help: the ``--help`` text (a literal ``%`` is fine).
        name: the flag, when it is not ``--`` and the field's name with dashes.
        short: an alias, e.g. vLLM's ``-tp``.
        choices: the values it takes (before any from ``registry``).
        registry: ``"module:NAME"``, a registry whose names are further choices (its ``names()``, or a
            dict's sorted keys); the parser imports it, so the group needs no upward import. With
            ``describe(name)``, each is described at the end of the help.
        metavar, nargs: as argparse's.
        check: the complaint about a value (``"must be positive"``), or None when it is fine.
        convert: the field's value from the flag's text and ``flag=`` its name; exits on a bad one.
    """

    help: str
    name: str = ""
    short: str = ""
    choices: tuple[str, ...] = ()
    registry: str = ""
    metavar: str | None = None
    nargs: str | None = None
    check: Callable[[Any], str | None] | None = None
    convert: Callable[..., Any] | None = None


def flag(help: str, **kwargs) -> msgspec.Meta:
    """A field's ``Annotated`` metadata declaring its flag (``Flag``'s attributes as keywords)."""
    return msgspec.Meta(extra={"flag": Flag(help, **kwargs)})


@dataclasses.dataclass(frozen=True)
class FlagField:
    """A group's field with a flag: its name, type without ``None`` (``int``, ``tuple[int, ...]``),
    default and ``Flag``."""

    name: str
    type: Any
    default: Any
    flag: Flag

    @property
    def option(self) -> str:
        """The flag, ``--max-num-seqs``."""
        return self.flag.name or "--" + self.name.replace("_", "-")


def flag_fields(group: type[msgspec.Struct]) -> list[FlagField]:
    """The fields of ``group`` that have a flag, in order."""
    hints = typing.get_type_hints(group, include_extras=True)
    out = []
    for f in msgspec.structs.fields(group):
        hint = hints[f.name]
        metas = [m.extra["flag"] for m in getattr(hint, "__metadata__", ()) if "flag" in (m.extra or {})]
        if metas:
            kind = typing.get_args(hint)[0]
            if isinstance(kind, types.UnionType):  # X | None
                kind = next(t for t in typing.get_args(kind) if t is not type(None))
            out.append(FlagField(f.name, kind, f.default, metas[0]))
    return out


def die(msg: str) -> typing.NoReturn:
    """Exit as argparse does on a bad flag: the message on stderr, status 2."""
    print(f"pipeline-serve: error: {msg}", file=sys.stderr)
    raise SystemExit(2)


def positive(value: float) -> str | None:
    return None if value > 0 else "must be positive"


def off_or_positive(value: float) -> str | None:
    return None if value >= 0 else "must be 0 (off) or positive"


def at_least_0(value: float) -> str | None:
    return None if value >= 0 else "must be >= 0"


def parse_cpu_list(text: str, flag: str) -> tuple[int, ...]:
    """``"0-3,6"`` → ``(0, 1, 2, 3, 6)``; ``""`` → ``()``. Exits with a message on a malformed list
    or a CPU this process may not run on (``os.sched_getaffinity``)."""
    if not text.strip():
        return ()
    cpus: set[int] = set()
    for part in text.split(","):
        if not re.fullmatch(r"\d+(-\d+)?", part.strip()):
            die(f"{flag} {text!r} is not a CPU list; write it like 0-3,6")
        lo, _, hi = part.strip().partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    allowed = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else cpus
    if not cpus or not cpus <= allowed:
        die(f"{flag} {text!r} names CPUs this machine does not offer; available: {','.join(map(str, sorted(allowed)))}")
    return tuple(sorted(cpus))
