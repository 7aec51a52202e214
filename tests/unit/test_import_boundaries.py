"""The scheduler's side of the package never loads torch (docs/design.md, "Overview").

Each case imports every module of the packages in a fresh interpreter, so
nothing another test imported can hide a dependency.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

_CHECK = """
import importlib, pkgutil, sys
import {package} as root
names = [m.name for m in pkgutil.walk_packages(root.__path__, root.__name__ + ".")]
for name in names:
    importlib.import_module(name)
heavy = sorted(m for m in ("torch", "transformers") if m in sys.modules)
print(len(names), " ".join(heavy))
"""


@pytest.mark.parametrize("package", ["pipeline.common", "pipeline.scheduler_proc"])
def test_package_imports_no_torch(package):
    out = subprocess.run(
        [sys.executable, "-c", _CHECK.format(package=package)], capture_output=True, text=True, check=True
    ).stdout.split()
    assert int(out[0]) > 1, f"{package} has no modules to import"
    assert out[1:] == [], f"importing {package} loads {out[1:]}"
