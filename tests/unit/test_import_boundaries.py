"""The scheduler's side of the package and the launcher never load torch (docs/design.md, "Overview"),
and no module of the package imports itself through others.

Each torch case imports in a fresh interpreter, so nothing another test imported
can hide a dependency.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from graphlib import CycleError, TopologicalSorter

import pytest

from tests.conftest import REPO

_CHECK = """
import importlib, pkgutil, sys
names = {names}
for name in list(names) if {walk} else ():  # a package: all its modules
    names += [m.name for m in pkgutil.walk_packages(importlib.import_module(name).__path__, name + ".")]
for name in names:
    importlib.import_module(name)
heavy = sorted(m for m in ("torch", "transformers") if m in sys.modules)
print(len(names), " ".join(heavy))
"""


@pytest.mark.parametrize(
    ("names", "walk"),
    [
        (["pipeline.common"], True),
        (["pipeline.scheduler_proc"], True),
        # The launcher offers --attention-backend from the backend registry (the package's __init__ only).
        (
            ["pipeline.launcher", "pipeline.server_args", "pipeline.server_config", "pipeline.gpu_worker.attention"],
            False,
        ),
    ],
)
def test_imports_no_torch(names, walk):
    out = subprocess.run(
        [sys.executable, "-c", _CHECK.format(names=names, walk=walk)], capture_output=True, text=True, check=True
    ).stdout.split()
    assert int(out[0]) > len(names) or not walk, f"{names} has no modules to import"
    assert out[1:] == [], f"importing {names} loads {out[1:]}"


def _module_imports() -> dict[str, set[str]]:
    """Each module of ``pipeline`` and the modules of ``pipeline`` it names in any import, type-only ones too."""
    files = {}
    for f in (REPO / "pipeline").rglob("*.py"):
        parts = f.relative_to(REPO).with_suffix("").parts
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f

    def module(name: str) -> str:  # "pipeline.a.b.Name" -> "pipeline.a.b"
        while name not in files:
            name = name.rpartition(".")[0]
        return name

    graph = {}
    for name, f in files.items():
        package = name if f.name == "__init__.py" else name.rpartition(".")[0]
        deps = set()
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Import):
                deps |= {module(a.name) for a in node.names if a.name.startswith("pipeline.")}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*up, base] if base else up)
                if base.startswith("pipeline"):
                    deps |= {module(f"{base}.{a.name}") for a in node.names}
        graph[name] = deps - {name}
    return graph


def test_no_import_cycle():
    graph = _module_imports()
    assert len(graph) > 100 and graph["pipeline.scheduler_proc.scheduler"]
    try:
        TopologicalSorter(graph).prepare()
    except CycleError as e:
        pytest.fail(f"an import cycle: {' -> '.join(e.args[1])}")


def _level(module: str) -> int:
    """0: the package root and ``common``, what every process shares; 1: a process's package; 2: the launcher
    side above them."""
    parts = module.split(".")
    if len(parts) == 1 or parts[1] == "common":
        return 0
    return 1 if parts[1] in ("gpu_worker", "scheduler_proc", "io_proc") else 2


def test_no_upward_import():
    graph = _module_imports()
    upward = sorted(f"{m} -> {d}" for m, deps in graph.items() for d in deps if _level(d) > _level(m))
    # Inside the worker, layers and attention backends are what the model families are built of.
    upward += sorted(
        f"{m} -> {d}"
        for m, deps in graph.items()
        if m.startswith(("pipeline.gpu_worker.layers", "pipeline.gpu_worker.attention"))
        for d in deps
        if d.startswith("pipeline.gpu_worker.models")
    )
    assert upward == []
    # The processes share only common/.
    crossing = sorted(
        f"{m} -> {d}"
        for m, deps in graph.items()
        for d in deps
        if _level(m) == _level(d) == 1 and m.split(".")[1] != d.split(".")[1]
    )
    assert crossing == []
