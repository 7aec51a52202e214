"""The scheduler's side of the package and the launcher never load torch (docs/design.md, "Overview").

Each case imports in a fresh interpreter, so nothing another test imported
can hide a dependency.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

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
