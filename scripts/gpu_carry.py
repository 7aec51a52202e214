"""What the lent GPU machine lacks, carried there: wheels for its Python, and SmolLM2's tokenizer.

That machine (its distributions: scripts/gpu_device_packages.txt) has CPython 3.12, CUDA torch
and transformers, but not every distribution pyproject.toml needs, and it can fetch nothing.
``fetch`` downloads here, into .gpu-carry/ (ignored by git; the tree travels with it, 64 MiB at
most), a wheel of each dependency it lacks and of each of their own dependencies it lacks, built
for CPython 3.12 on manylinux x86-64, and copies the tokenizer of the default model, which the
tests' tiny models and scripts/gpu_model.py use (the 94 MB GGUF file it comes from cannot travel).
``check`` says whether that set is complete. ``verify``, run where the wheels were installed,
says whether every requirement of pyproject.toml and of the carried distributions is met there,
with the versions found, and imports the three processes' modules.

    python scripts/gpu_carry.py fetch     # here, with the package index reachable
    python scripts/gpu_carry.py check     # is .gpu-carry/ complete?
    python scripts/gpu_carry.py verify [SITE_DIR]
"""

from __future__ import annotations

import argparse
import email
import fnmatch
import importlib
import importlib.metadata
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import tomllib
from packaging.requirements import Requirement
from packaging.tags import compatible_tags, cpython_tags
from packaging.utils import canonicalize_name, parse_wheel_filename

ROOT = Path(__file__).resolve().parent.parent
CARRY = ROOT / ".gpu-carry"
WHEELS = CARRY / "wheels"
TOKENIZER = CARRY / "tokenizer"
DEVICE_PACKAGES = ROOT / "scripts" / "gpu_device_packages.txt"

PYTHON = (3, 12)
# Wheels for glibc 2.31 at most: llguidance 1.9 is built for it. The machine's glibc was not read;
# its Python 3.12.3 is Ubuntu 24.04's (glibc 2.39), and pip there refuses a wheel it cannot run.
GLIBC_MAX = 31
PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in range(GLIBC_MAX, 4, -1)] + [
    "manylinux2014_x86_64",
    "manylinux2010_x86_64",
    "manylinux1_x86_64",
]
# Environment markers as that machine evaluates them.
MARKERS = {
    "python_version": "3.12",
    "python_full_version": "3.12.3",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
    "os_name": "posix",
    "extra": "",
}
# Each process's entry module: importing them imports every dependency the server uses.
ENTRY_MODULES = (
    "pipeline.io_proc.main",
    "pipeline.scheduler_proc.main",
    "pipeline.gpu_worker.main",
    "pipeline.bench.cli",
)


def device_patterns() -> list[str]:
    names = [x.strip() for x in DEVICE_PACKAGES.read_text().splitlines() if x.strip() and not x.startswith("#")]
    return [x if "*" in x else canonicalize_name(x) for x in names]


def on_device(name: str, patterns: list[str]) -> bool:
    return any(fnmatch.fnmatchcase(canonicalize_name(name), p) for p in patterns)


def project_requirements() -> list[Requirement]:
    """pyproject.toml's dependencies (the test extra's are not needed to run the GPU check)."""
    with open(ROOT / "pyproject.toml", "rb") as f:
        return [Requirement(r) for r in tomllib.load(f)["project"]["dependencies"]]


def wanted(req: Requirement, patterns: list[str]) -> bool:
    """Whether the GPU machine needs ``req`` carried: it applies there and is not installed there."""
    return (req.marker is None or req.marker.evaluate(MARKERS)) and not on_device(req.name, patterns)


def supported_tags() -> set:
    interpreter = f"cp{PYTHON[0]}{PYTHON[1]}"
    return set(cpython_tags(PYTHON, [interpreter, "abi3", "none"], PLATFORMS)) | set(
        compatible_tags(PYTHON, interpreter, PLATFORMS)
    )


def wheel_requirements(path: Path) -> list[Requirement]:
    """The ``Requires-Dist`` entries of a wheel's metadata."""
    with zipfile.ZipFile(path) as z:
        name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA") and n.count("/") == 1)
        meta = email.message_from_bytes(z.read(name))
    return [Requirement(r) for r in meta.get_all("Requires-Dist") or ()]


def closure(wheel_dir: Path) -> tuple[list[Path], list[str]]:
    """The wheels in ``wheel_dir`` that the GPU machine needs, and what is wrong with the set.

    Starts from pyproject.toml's dependencies and follows each wheel's own, skipping what the
    machine has. A problem is a needed distribution without a wheel, a wheel of the wrong
    version for a requirement, or for another Python or platform, or two wheels of one name.
    """
    patterns, tags = device_patterns(), supported_tags()
    wheels = {}
    for p in sorted(wheel_dir.glob("*.whl")):
        name, version, _, wheel_tags = parse_wheel_filename(p.name)
        wheels.setdefault(name, []).append((p, version, wheel_tags))
    problems, needed = [], {}
    todo = [(r, "pyproject.toml") for r in project_requirements() if wanted(r, patterns)]
    while todo:
        req, by = todo.pop(0)
        name = canonicalize_name(req.name)
        found = wheels.get(name)
        if not found:
            problems.append(f"no wheel of {req} (needed by {by})")
            continue
        path, version, wheel_tags = found[0]
        if not req.specifier.contains(version, prereleases=True):
            problems.append(f"{path.name} does not meet {req} (needed by {by})")
        if name in needed:
            continue
        needed[name] = path
        if len(found) > 1:  # pip would stop at the second
            problems.append(f"{len(found)} wheels of {name}: " + ", ".join(p.name for p, _, _ in found))
        if not wheel_tags & tags:
            problems.append(f"{path.name} is not built for CPython 3.12 on manylinux x86-64 (glibc <= 2.{GLIBC_MAX})")
        todo += [(r, name) for r in wheel_requirements(path) if wanted(r, patterns)]
    problems += [f"{p.name} is not needed" for name, f in wheels.items() if name not in needed for p, _, _ in f]
    return list(needed.values()), problems


def default_tokenizer_dir() -> Path:
    """The default model's Hugging Face directory (converted from its GGUF file once, then cached)."""
    from pipeline.common.model_files import convert_gguf, default_model_path

    return convert_gguf(default_model_path())


def copy_tokenizer(model_dir: Path, dest: Path) -> None:
    """Copy a model directory's tokenizer and generation files (not its config or weights) to ``dest``."""
    dest.mkdir(parents=True, exist_ok=True)
    for f in model_dir.iterdir():
        if f.is_file() and f.name != "config.json" and not f.name.startswith("model.safetensors"):
            shutil.copy2(f, dest / f.name)


def size_mib(paths) -> float:
    return sum(p.stat().st_size for p in paths) / 2**20


def fetch() -> int:
    """Download the wheels the GPU machine needs into .gpu-carry/wheels and copy the tokenizer."""
    patterns = device_patterns()
    top = [str(r) for r in project_requirements() if wanted(r, patterns)]
    with tempfile.TemporaryDirectory() as tmp:
        # The versions installed here (tested here) where this environment has them.
        frozen = subprocess.run(
            [sys.executable, "-m", "pip", "freeze", "--exclude-editable"], capture_output=True, text=True, check=True
        ).stdout
        constraints = Path(tmp, "constraints.txt")
        constraints.write_text("".join(line + "\n" for line in frozen.splitlines() if "==" in line and "@" not in line))
        download = Path(tmp, "wheels")
        cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--only-binary=:all:"]
        cmd += ["--python-version", "3.12", "--implementation", "cp", "--abi", "cp312"]
        cmd += [a for p in PLATFORMS for a in ("--platform", p)]
        cmd += ["--constraint", str(constraints), "--dest", str(download), *top]
        print("gpu_carry: pip download " + " ".join(top), flush=True)
        subprocess.run(cmd, check=True)
        needed, problems = closure(download)
        problems = [p for p in problems if not p.endswith("is not needed")]  # what the machine has is left here
        shutil.rmtree(WHEELS, ignore_errors=True)
        WHEELS.mkdir(parents=True)
        for p in needed:
            shutil.copy2(p, WHEELS / p.name)
    shutil.rmtree(TOKENIZER, ignore_errors=True)
    copy_tokenizer(default_tokenizer_dir(), TOKENIZER)
    for p in sorted(WHEELS.iterdir()):
        print(f"  {p.stat().st_size / 2**20:6.2f} MiB  {p.name}")
    wheels, tok = size_mib(WHEELS.iterdir()), size_mib(TOKENIZER.iterdir())
    print(
        f"gpu_carry: {len(needed)} wheels {wheels:.1f} MiB, tokenizer {tok:.1f} MiB, .gpu-carry {wheels + tok:.1f} MiB"
    )
    for p in problems:
        print(f"gpu_carry: {p}")
    return 1 if problems else 0


def check() -> int:
    """Exit 0 when .gpu-carry/ holds every wheel the GPU machine needs (and no other) and a tokenizer."""
    if not WHEELS.is_dir():
        print("gpu_carry: .gpu-carry/wheels is not fetched: run bash scripts/fetch_gpu_wheels.sh")
        return 2
    needed, problems = closure(WHEELS)
    if not (TOKENIZER / "tokenizer.json").is_file():
        problems.append("no tokenizer in .gpu-carry/tokenizer")
    for p in problems:
        print(f"gpu_carry: {p}")
    tok = size_mib(TOKENIZER.iterdir()) if TOKENIZER.is_dir() else 0.0
    print(f"gpu_carry: {len(needed)} wheels needed, {size_mib(needed):.1f} MiB, tokenizer {tok:.1f} MiB")
    return 1 if problems else 0


def verify(site: Path | None) -> int:
    """Exit 0 when this interpreter meets pyproject.toml's requirements and those of the distributions
    installed in ``site`` (the carried ones), and imports the processes' modules."""
    todo = [(r, "pyproject.toml") for r in project_requirements()]
    if site is not None:
        for dist in importlib.metadata.distributions(path=[str(site)]):
            todo += [(Requirement(r), dist.metadata["Name"]) for r in dist.requires or ()]
    problems = []
    for req, by in todo:
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        try:
            version = importlib.metadata.version(req.name)
        except importlib.metadata.PackageNotFoundError:
            problems.append(f"{req.name} is not installed (needed by {by})")
            continue
        if not req.specifier.contains(version, prereleases=True):
            problems.append(f"{req.name} {version} does not meet {req} (needed by {by})")
    for module in ENTRY_MODULES:
        try:
            importlib.import_module(module)
        except Exception as e:  # any import failure is what this check reports
            problems.append(f"import {module}: {type(e).__name__}: {e}")
    for p in problems:
        print(f"gpu_carry: {p}")
    print(f"gpu_carry: {len(todo)} requirements, {len(ENTRY_MODULES)} modules: {len(problems)} problems")
    return 1 if problems else 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("fetch", help="download the wheels and copy the tokenizer into .gpu-carry/")
    sub.add_parser("check", help="is .gpu-carry/ complete? (exit 2: not fetched)")
    v = sub.add_parser("verify", help="are the requirements met in this interpreter?")
    v.add_argument("site", nargs="?", type=Path, help="where the carried wheels were installed")
    args = p.parse_args()
    if args.command == "fetch":
        return fetch()
    if args.command == "check":
        return check()
    return verify(args.site)


if __name__ == "__main__":
    sys.exit(main())
