"""scripts/gpu_check.sh --dry-run: everything the GPU check runs that needs no CUDA, so it cannot rot
between the rare runs on a GPU machine.

The wheels for that machine are not fetched here (that needs the package index and is the
GPU session's step): without .gpu-carry/wheels the dry run reports "not fetched" and checks the
rest; with them it checks the set. Their checker is tested on its own in
tests/unit/test_gpu_carry.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from pipeline.gpu_worker.models.loader import load_model
from pipeline.io_proc.tokenization import load_tokenizer
from tests.conftest import REPO, make_tiny_llama

sys.path.insert(0, str(REPO / "scripts"))
import gpu_carry  # noqa: E402

STAGES = ["flags", "syntax", "deps", "carry", "model-1b", "model", "cuda-tests", "bench", "profile"]


@pytest.mark.slow
def test_the_dry_run_passes_every_stage(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable, "OUT": str(tmp_path)}
    proc = subprocess.run(
        ["bash", "scripts/gpu_check.sh", "--dry-run"], cwd=REPO, env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    stages = summary["stages"]
    assert list(stages) == STAGES
    fetched = gpu_carry.WHEELS.is_dir()
    for name, rec in stages.items():
        expected = "ok" if fetched or name != "carry" else "not fetched"
        assert rec["status"] == expected, (name, rec)
    assert summary["device"]["cuda"] is False
    # The cuda-marked tests were collected and, without CUDA, all skipped.
    assert stages["cuda-tests"]["detail"].startswith("0 passed, 0 failed,")
    assert not stages["cuda-tests"]["detail"].endswith(" 0 skipped")
    run = stages["bench"]["figures"]["async"]
    assert run["output_tokens_per_s"] > 0 and run["num_requests"] == 2
    log = (tmp_path / "gpu_check.log").read_text()
    assert "1,235,814,400 parameters (Llama 3.2 1B: 1,235,814,400)" in log
    assert "| stage " in log.split("== summary")[1]


def test_tiny_models_build_from_the_carried_tokenizer_files(tmp_path, smol_dir):
    """What the cuda-marked tests' fixtures do on the GPU machine ($PIPELINE_TEST_TOKENIZER_DIR)."""
    carried = tmp_path / "tokenizer"
    gpu_carry.copy_tokenizer(smol_dir, carried)
    assert not {"config.json", "model.safetensors"} & {p.name for p in carried.iterdir()}
    tiny = make_tiny_llama(tmp_path / "tiny", carried)
    tokenizer, stop_ids = load_tokenizer(str(tiny))
    assert len(tokenizer) == 49152 and stop_ids
    model = load_model(str(tiny), torch.float32, torch.device("cpu"), "torch_bucketed")
    assert model.config.vocab_size == len(tokenizer)
