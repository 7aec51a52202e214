"""The compiled-kernel cache: keyed by what changes the binary, built once per key, never half-written.

The subprocess tests run real builds of the cpu_paged kernel into a fresh
``$PIPELINE_CACHE_DIR``, from copies of the package at other paths (other
checkouts), and count the compilations each process logged.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from pipeline.gpu_worker.attention import cpu_paged, kernel_cache

REPO = Path(__file__).resolve().parents[2]
COMPILING = "compiling the kernel for this CPU"
# Loads the kernel as a server's worker does, then calls into it.
LOAD = (
    "import logging; logging.basicConfig(level=logging.INFO)\n"
    "from pipeline.gpu_worker.attention import cpu_paged\n"
    "print(cpu_paged.unavailable_reason(), cpu_paged.supports(9, 3, 64))\n"
)


def _checkout(root: Path, source_suffix: str = "") -> Path:
    """A copy of the package at ``root`` (another checkout); ``source_suffix`` is appended to the kernel's source."""
    shutil.copytree(REPO / "pipeline", root / "pipeline", ignore=shutil.ignore_patterns("__pycache__"))
    if source_suffix:
        src = root / "pipeline" / "gpu_worker" / "attention" / "cpu_paged.cpp"
        src.write_text(src.read_text() + source_suffix)
    return root


def _start(checkout: Path, cache: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(checkout), "PIPELINE_CACHE_DIR": str(cache)}
    return subprocess.Popen(
        [sys.executable, "-c", LOAD],
        env=env,
        cwd=checkout,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group: the compiler dies with it when killed
    )


def _finish(procs: list[subprocess.Popen]) -> int:
    """Wait for the loaders; each must have loaded the kernel. Returns how many compilations they logged."""
    compiled = 0
    for p in procs:
        out, err = p.communicate(timeout=600)
        assert p.returncode == 0 and out.split() == ["None", "True"], (out, err)
        compiled += err.count(COMPILING)
    return compiled


@pytest.fixture(scope="module")
def compiler():
    if shutil.which(os.environ.get("CXX", "c++")) is None or shutil.which("ninja") is None:
        pytest.skip("no C++ compiler or ninja")


def test_build_key_follows_what_changes_the_binary(tmp_path, monkeypatch):
    """The same source at another path (another checkout) keys alike; each input of the build changes the key."""
    a, b = tmp_path / "a.cpp", tmp_path / "b" / "a.cpp"
    b.parent.mkdir()
    a.write_text("int f() { return 1; }\n")
    b.write_text(a.read_text())
    args = (["-O3"], "/usr/bin/g++-12", "g++ 12.2.0")
    key = kernel_cache.build_key(a, *args)
    assert kernel_cache.build_key(b, *args) == key
    b.write_text("int f() { return 2; }\n")
    changed = {
        "source": kernel_cache.build_key(b, *args),
        "flags": kernel_cache.build_key(a, ["-O2"], *args[1:]),
        "compiler": kernel_cache.build_key(a, args[0], "/usr/bin/clang++", args[2]),
        "compiler version": kernel_cache.build_key(a, *args[:2], "g++ 13.1.0"),
    }
    monkeypatch.setattr(torch, "__version__", "0.0.1")
    changed["torch version"] = kernel_cache.build_key(a, *args)
    monkeypatch.undo()
    monkeypatch.setattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", not torch._C._GLIBCXX_USE_CXX11_ABI)
    changed["C++ ABI"] = kernel_cache.build_key(a, *args)
    monkeypatch.undo()
    monkeypatch.setattr(kernel_cache, "cpu_tag", lambda: "x86_64\nflags: sse2")
    changed["CPU"] = kernel_cache.build_key(a, *args)
    assert {k: v for k, v in changed.items() if v == key} == {}
    assert len(set(changed.values())) == len(changed)


def test_no_compiler_is_a_reason_not_an_error(monkeypatch):
    monkeypatch.setenv("CXX", "no-such-compiler-here")
    with pytest.raises(kernel_cache.KernelUnavailable, match="^no C\\+\\+ compiler found$"):
        kernel_cache.load("pipeline_cpu_paged", cpu_paged._SOURCE, cpu_paged._CFLAGS)


@pytest.mark.slow
def test_installs_started_at_once_build_once_per_key(tmp_path, compiler):
    """Two checkouts of one version and one of another, started at once on an empty cache: one build per
    version, all three load it; started again, in turn and at once, nobody builds."""
    cache = tmp_path / "cache"
    a, b = _checkout(tmp_path / "a"), _checkout(tmp_path / "b")
    other = _checkout(tmp_path / "other", "// another version of the kernel\n")
    assert _finish([_start(c, cache) for c in (a, b, other)]) == 2
    assert _finish([_start(c, cache) for c in (b, a, other)]) == 0
    assert sum(_finish([_start(c, cache)]) for c in (a, b, a, other)) == 0
    kernels = sorted(p.name for p in (cache / "kernels").iterdir())
    assert [Path(n).suffix for n in kernels] == [".lock", ".so", ".lock", ".so"], kernels


@pytest.mark.slow
def test_a_builder_killed_mid_compile_leaves_nothing_in_the_way(tmp_path, compiler):
    """Killed while compiling, a builder leaves its build directory (and torch's lock file in it); the next
    start neither waits on it nor loads from it, builds once and removes it."""
    cache = tmp_path / "cache"
    killed = _start(REPO, cache)
    deadline = time.monotonic() + 120
    while not list((cache / "kernels").glob("*.tmp-*/build.ninja")):
        assert killed.poll() is None and time.monotonic() < deadline, killed.communicate()
        time.sleep(0.05)
    os.killpg(killed.pid, signal.SIGKILL)
    killed.wait()
    (leftover,) = (cache / "kernels").glob("*.tmp-*")
    (leftover / "lock").touch()
    assert not list((cache / "kernels").glob("*.so"))
    assert _finish([_start(REPO, cache)]) == 1
    assert not leftover.exists()
    assert len(list((cache / "kernels").glob("*.so"))) == 1
