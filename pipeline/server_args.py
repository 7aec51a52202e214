"""``pipeline-serve``'s parser, generated from the config groups (``common/model_flags.py``,
``common/config_groups.py``): one section per group, one flag per field (``pipeline-bench`` adds its own section).
``group_from_args`` builds a group back from the parsed flags."""

from __future__ import annotations

import argparse
import functools
import importlib
import inspect
import typing

import msgspec

from pipeline.common import config_groups, model_flags
from pipeline.common.flags import die, flag_fields

G = typing.TypeVar("G", bound=msgspec.Struct)


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows a flag's default unless it is None or empty (those flags say in words what happens)."""

    def _get_help_string(self, action):
        if action.default in (None, "", ()):
            return action.help
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``pipeline-serve``'s flags."""
    p = argparse.ArgumentParser(
        prog="pipeline-serve",
        description="Serve a language model (Llama, Mistral, Qwen, Gemma, Phi-3 families) with an OpenAI-compatible "
        "HTTP API. Three processes "
        "(HTTP/tokenizer, scheduler, model worker) pass every step through shared memory, and "
        "the scheduler plans step N+1 while step N runs.",
        formatter_class=_HelpFormatter,
    )
    for title, group in {**model_flags.RESOLVED, **config_groups.GROUPS}.items():
        add_flags(p.add_argument_group(title, inspect.getdoc(group).split("\n\n")[0]), group)
    return p


def add_flags(parser: argparse.ArgumentParser | argparse._ArgumentGroup, group: type[msgspec.Struct]) -> None:
    """Add a flag to ``parser`` for each field of ``group`` that has one; its ``dest`` is the field's name."""
    for f in flag_fields(group):
        kwargs = dict(dest=f.name, default=f.default, help=f.flag.help.replace("%", "%%"))
        choices = list(f.flag.choices)
        if f.flag.registry:
            module, _, name = f.flag.registry.partition(":")
            registry = getattr(importlib.import_module(module), name)
            choices += registry.names() if hasattr(registry, "names") else sorted(registry)
            if hasattr(registry, "describe"):
                kwargs["help"] += " " + "; ".join(f"{n}: {registry.describe(n)}" for n in registry.names()) + "."
        if choices:
            kwargs["choices"] = choices
        if f.flag.convert is not None:
            kwargs["type"] = functools.partial(f.flag.convert, flag=f.option)
        elif f.type is bool:
            kwargs["action"] = argparse.BooleanOptionalAction if f.default else "store_true"
        elif f.flag.nargs:
            kwargs.update(nargs=f.flag.nargs, type=typing.get_args(f.type)[0])  # tuple[int, ...]: int
        elif f.type in (int, float):
            kwargs["type"] = f.type
        if f.flag.metavar:
            kwargs["metavar"] = f.flag.metavar
        elif f.flag.name and f.type is not bool and not choices:  # as argparse names it from the flag
            kwargs["metavar"] = f.option.lstrip("-").replace("-", "_").upper()
        parser.add_argument(*filter(None, (f.flag.short, f.option)), **kwargs)


def group_from_args(group: type[G], args: argparse.Namespace) -> G:
    """``group`` with the parsed flags' values, checked; exits with a message naming a bad one."""
    values = {}
    for f in flag_fields(group):
        value = getattr(args, f.name)
        if f.flag.check is not None and (complaint := f.flag.check(value)):
            die(f"{f.option} {complaint}")
        values[f.name] = value
    return group(**values)
