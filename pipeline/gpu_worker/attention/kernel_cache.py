"""Compiled C++ kernels, shared by every install on a machine and built at most once per build key (docs/design.md, "The
kernel cache"): built in a private directory, renamed into ``<cache>/kernels/<name>_<key>.so`` once complete."""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch

from pipeline.common.model_files import cache_dir

logger = logging.getLogger(__name__)


class KernelUnavailable(Exception):
    """The kernel cannot be built or loaded here; the message says why."""


def cpu_tag() -> str:
    """This CPU's architecture, model and feature flags: a ``-march=native`` build is only valid on such a CPU."""
    try:
        info = Path("/proc/cpuinfo").read_text()
        lines = [ln for ln in info.splitlines() if ln.startswith(("model name", "flags"))][:2]
    except OSError:
        lines = [platform.processor()]
    return "\n".join([platform.machine(), *lines])


def build_key(source: Path, cflags: Sequence[str], compiler: str, compiler_version: str) -> str:
    """A hash of what the binary depends on: the source, torch's version and C++ ABI, the compiler, its version and
    flags, and the CPU."""
    parts = [
        hashlib.sha256(source.read_bytes()).hexdigest(),
        torch.__version__,
        str(torch._C._GLIBCXX_USE_CXX11_ABI),
        compiler,
        compiler_version,
        " ".join(cflags),
        cpu_tag(),
    ]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def library_path(name: str, source: Path, cflags: Sequence[str]) -> Path:
    """Where the library built from ``source`` with ``cflags`` is kept.

    Raises:
        KernelUnavailable: no C++ compiler (``$CXX``, default ``c++``) is found.
    """
    from torch.utils import cpp_extension

    compiler = shutil.which(cpp_extension.get_cxx_compiler())
    if compiler is None:
        raise KernelUnavailable("no C++ compiler found")
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = build_key(source, cflags, os.path.realpath(compiler), version)
    return cache_dir() / "kernels" / f"{name}_{key}.so"


def load(name: str, source: Path, cflags: Sequence[str]) -> Path:
    """Load the library built from ``source`` with ``cflags`` into torch, building it if no process has; returns its
    path.

    Raises:
        KernelUnavailable: no compiler, or the build or the load failed.
    """
    try:
        lib = library_path(name, source, cflags)
        if lib.exists() or not _build(lib, source, cflags):
            torch.ops.load_library(str(lib))
    except KernelUnavailable:
        raise
    except Exception as e:  # noqa: BLE001 -- whatever fails, the caller gets one line saying why
        last = (str(e).strip().splitlines() or [""])[-1]
        raise KernelUnavailable(f"building or loading the kernel failed: {type(e).__name__}: {last}") from e
    return lib


def _build(lib: Path, source: Path, cflags: Sequence[str]) -> bool:
    """Build and load ``lib``; False if another process built it while this one waited for the lock."""
    from torch.utils import cpp_extension

    lib.parent.mkdir(parents=True, exist_ok=True)
    # torch's own build lock is a file that outlives a process killed while compiling, and every later
    # start would wait on it forever. An flock is released by the kernel with its holder.
    with open(lib.with_suffix(".lock"), "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("%s: waiting for another process that is compiling it", lib.stem)
            fcntl.flock(lock, fcntl.LOCK_EX)
        if lib.exists():
            return False
        # Under the lock, a build directory of this key can only be left by a builder that was killed.
        for leftover in lib.parent.glob(f"{lib.stem}.tmp-*"):
            shutil.rmtree(leftover, ignore_errors=True)
        logger.info("%s: compiling the kernel for this CPU, once per build key (10-50 s)", lib.stem)
        build_dir = Path(tempfile.mkdtemp(prefix=f"{lib.stem}.tmp-", dir=lib.parent))
        try:
            cpp_extension.load(
                lib.stem,
                [str(source)],
                extra_cflags=list(cflags),
                # The OpenMP runtime is torch's (the same soname, already loaded).
                extra_ldflags=["-fopenmp"] if "-fopenmp" in cflags else [],
                build_directory=str(build_dir),
                is_python_module=False,
                verbose=False,
            )
            # Loaded from the build directory (a second load from another path would register the ops
            # twice); the mapping outlives the rename. Other processes see the whole file or none.
            os.replace(build_dir / f"{lib.stem}.so", lib)
        finally:
            shutil.rmtree(build_dir, ignore_errors=True)
    return True
