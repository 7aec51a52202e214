"""The GPU check's own logic, without a GPU or the package index: which carried wheels are complete,
the stages' flags, the summary table (scripts/gpu_carry.py, scripts/gpu_check.py)."""

from __future__ import annotations

import sys
import zipfile
from pathlib import Path

import psutil
import pytest
from packaging.requirements import Requirement

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import gpu_carry  # noqa: E402
import gpu_check  # noqa: E402

GLIBC_OK = "manylinux_2_17_x86_64"


def wheel(d: Path, name: str, version: str, tag: str = f"cp312-cp312-{GLIBC_OK}", requires: tuple = ()) -> Path:
    """A wheel file with just the metadata the checker reads."""
    path = d / f"{name}-{version}-{tag}.whl"
    meta = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n" + "".join(
        f"Requires-Dist: {r}\n" for r in requires
    )
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{name}-{version}.dist-info/METADATA", meta)
    return path


@pytest.fixture()
def project(monkeypatch, tmp_path):
    """A project needing alpha>=1 and numpy; the GPU machine has numpy and tqdm."""
    device = tmp_path / "device.txt"
    device.write_text("# the machine's\nnumpy\ntq*\n")
    monkeypatch.setattr(gpu_carry, "DEVICE_PACKAGES", device)
    monkeypatch.setattr(gpu_carry, "project_requirements", lambda: [Requirement("alpha>=1"), Requirement("numpy")])
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    return wheels


ALPHA_NEEDS = ("beta", "numpy>=1", "tqdm", "winonly; sys_platform == 'win32'", "docs; extra == 'docs'")


def test_a_complete_set_follows_dependencies_the_machine_lacks(project):
    wheel(project, "alpha", "1.0", "py3-none-any", ALPHA_NEEDS)
    wheel(project, "beta", "2.0", f"cp39-abi3-{GLIBC_OK}")
    needed, problems = gpu_carry.closure(project)
    assert problems == []
    assert sorted(p.name.split("-")[0] for p in needed) == ["alpha", "beta"]


@pytest.mark.parametrize(
    ("wheels", "problem"),
    [
        ([("alpha", "1.0", "py3-none-any", ALPHA_NEEDS)], "no wheel of beta (needed by alpha)"),
        ([("alpha", "0.9", "py3-none-any", ())], "alpha-0.9-py3-none-any.whl does not meet alpha>=1"),
        ([("alpha", "1.0", f"cp311-cp311-{GLIBC_OK}", ())], "is not built for CPython 3.12"),
        ([("alpha", "1.0", "cp312-cp312-manylinux_2_34_x86_64", ())], "is not built for CPython 3.12"),
        ([("alpha", "1.0", "cp312-cp312-macosx_11_0_arm64", ())], "is not built for CPython 3.12"),
        ([("alpha", "1.0", "py3-none-any", ()), ("alpha", "1.1", "py3-none-any", ())], "2 wheels of alpha"),
        ([("alpha", "1.0", "py3-none-any", ()), ("gamma", "1.0", "py3-none-any", ())], "gamma-1.0"),
    ],
)
def test_an_incomplete_or_wrong_set_is_named(project, wheels, problem):
    for w in wheels:
        wheel(project, *w)
    _, problems = gpu_carry.closure(project)
    assert any(problem in p for p in problems), problems


def test_the_carry_list_covers_the_project():
    """The real lists: every dependency of pyproject.toml is on the GPU machine or carried."""
    patterns = gpu_carry.device_patterns()
    carried = {r.name for r in gpu_carry.project_requirements() if gpu_carry.wanted(r, patterns)}
    assert {"torch", "transformers", "numpy"}.isdisjoint(carried)  # the machine's own builds
    assert {"pyzmq", "msgspec", "posix_ipc", "fastapi", "uvicorn", "llguidance", "gguf"} <= carried


def test_every_gpu_stage_flag_parses(tmp_path):
    paths = gpu_check.Paths(tmp_path, tmp_path, tmp_path)
    stages = gpu_check.gpu_stages(paths)
    assert gpu_check.parse_flags(stages) == []
    bad = gpu_check.Stage("bad", [*gpu_check.BENCH, "--model", "m", "--batch-sise", "8"], 1)
    wrong = gpu_check.Stage("wrong", [*gpu_check.BENCH, "--mode", "lockstep"], 1)
    errors = gpu_check.parse_flags([bad, wrong])
    assert errors[0].startswith("bad: unrecognized --batch-sise") and errors[1].startswith("wrong: ")
    names = [s.name for s in stages]
    assert names[:4] == ["deps", "carry", "model", "cuda-tests"]
    assert {f"bench-{b}-{g}" for b in (1, 64, 256) for g in ("graphs", "eager")} <= set(names)
    assert {"profile", "http-64", "spec-ngram"} <= set(names)


def test_summary_rows_carry_the_figures():
    run = {
        "token_gap_us": {"p50": 3.2, "p99": 41.0},
        "device_busy_fraction": 0.9951,
        "output_tokens_per_s": 12345.6,
        "cpu_per_step_us": {"scheduler": {"p50": 210.0}, "gpu_worker": {"p50": 380.0}},
    }
    sync = {**run, "token_gap_us": None, "output_tokens_per_s": 10000.0}
    figures = {"async": run, "sync": sync, "ratio_async_over_sync": {"output_tokens_per_s": 1.2345}}
    rows = gpu_check.figure_rows({"bench-256-graphs": {"figures": figures}, "model": {"status": "ok"}})
    assert rows == [
        ["bench-256-graphs", "async", "3", "41", "0.995", "12346", "210 / 380 / -", "1.23"],
        ["bench-256-graphs", "sync", "-", "-", "0.995", "10000", "210 / 380 / -", "-"],
    ]
    lines = gpu_check.table(["stage", "run"], [["a", "b"]]).splitlines()
    assert lines == ["| stage | run |", "|-------|-----|", "| a     | b   |"]


def test_a_stage_past_its_limit_is_killed_with_what_it_started(tmp_path):
    """A hung server: the bench's children sit in process groups of their own, and must end too."""
    pid_file = tmp_path / "child.pid"
    child = "import os, time; os.setpgrp(); time.sleep(60)"
    code = (
        f"import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', {child!r}]); "
        f"open({str(pid_file)!r}, 'w').write(str(p.pid)); time.sleep(60)"
    )
    stage = gpu_check.Stage("hang", [sys.executable, "-c", code], 60)
    record = gpu_check.run_stage(stage, limit_s=3)
    assert record["status"] == "TIMED OUT" and record["seconds"] < 30
    pid = int(pid_file.read_text())
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_a_failing_stage_is_marked_and_its_figures_left_out(tmp_path):
    stage = gpu_check.Stage("bench-x", [sys.executable, "-c", "raise SystemExit(3)"], 60, json=tmp_path / "none.json")
    assert gpu_check.run_stage(stage, limit_s=30) == {
        "status": "FAILED",
        "seconds": pytest.approx(0, abs=30),
        "detail": "exit 3",
    }
