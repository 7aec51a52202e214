"""Models the server cannot serve: a clear start-up error naming the cause and what would work, no traceback."""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys

import pytest
from safetensors.torch import load_file, save_file

from tests.conftest import REPO, free_port, make_tiny_llama


def serve(*args: str) -> tuple[int, str]:
    """Run pipeline-serve until it exits; its status and output."""
    cmd = [sys.executable, "-m", "pipeline.launcher", "--port", str(free_port()), "--device", "cpu"]
    cmd += ["--attention-backend", "torch_bucketed", *args]
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=600)
    out = p.stdout + p.stderr
    assert "Traceback" not in out, out
    return p.returncode, out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, smol_dir):
    return make_tiny_llama(tmp_path_factory.mktemp("tiny"), smol_dir)


def edited(tiny, tmp_path, config=None, drop=()):
    """A copy of ``tiny`` with config fields changed and checkpoint tensors removed."""
    d = tmp_path / "model"
    shutil.copytree(tiny, d)
    if config:
        cfg = json.loads((d / "config.json").read_text())
        (d / "config.json").write_text(json.dumps({**cfg, **config}))
    if drop:
        tensors = load_file(d / "model.safetensors")
        save_file({k: v for k, v in tensors.items() if k not in drop}, d / "model.safetensors")
    return d


def test_unknown_architecture(tiny, tmp_path):
    code, out = serve("--model", str(edited(tiny, tmp_path, config={"architectures": ["GPT2LMHeadModel"]})))
    assert code == 2
    assert "architecture 'GPT2LMHeadModel' is not supported; supported architectures: " in out
    assert "LlamaForCausalLM" in out and "Qwen3ForCausalLM" in out


def test_no_weights(tiny, tmp_path):
    d = edited(tiny, tmp_path)
    (d / "model.safetensors").rename(d / "pytorch_model.bin")
    code, out = serve("--model", str(d))
    assert code == 2
    assert (
        "has no safetensors weights (model.safetensors or model.safetensors.index.json) (found pytorch_model.bin)"
        in out
    )


def test_missing_tensor(tiny, tmp_path):
    code, out = serve("--model", str(edited(tiny, tmp_path, drop=["model.layers.1.mlp.up_proj.weight"])))
    assert code == 1
    assert "missing ['model.layers.1.mlp.up_proj.weight'], unexpected none" in out


def test_wrong_shape(tiny, tmp_path):
    code, out = serve("--model", str(edited(tiny, tmp_path, config={"intermediate_size": 96})))
    assert code == 1
    # The first tensor of the file that does not fit (tensors are read in file order).
    down = "model.layers.0.mlp.down_proj.weight: shape (64, 128) in the checkpoint, the model config implies (64, 96)"
    assert down in out


def test_tensor_parallel_size_that_does_not_divide(tiny):
    code, out = serve("--model", str(tiny), "-tp", "3")
    assert code == 2
    assert "tensor-parallel size 3 does not divide 4 attention heads" in out
    assert "this model supports sizes [1, 2, 4]" in out


def _empty(d):
    (d / "model.safetensors").write_bytes(b"")


def _garbage_header_length(d):
    f = d / "model.safetensors"
    f.write_bytes(struct.pack("<Q", 2**62) + f.read_bytes()[8:])


def _truncated(d):
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def _no_tokenizer(d):
    (d / "tokenizer.json").unlink()


@pytest.mark.parametrize(
    "config, damage, file, why",
    [
        (None, _empty, "model.safetensors", "0 bytes, too short for a safetensors file"),
        (None, _garbage_header_length, "model.safetensors", f"the header length reads {2**62} bytes"),
        (None, _truncated, "model.safetensors", "tensor model.embed_tokens.weight: data_offsets [0, 12582912] fall "),
        ({"num_attention_heads": 5, "num_key_value_heads": 5}, None, "config.json", "hidden_size 64 is not a multip"),
        ({"hidden_size": 2**31}, None, "config.json", "hidden_size must be an integer from 1 to 65536, got 2147"),
        ({"hidden_size": "64"}, None, "config.json", "hidden_size must be an integer from 1 to 65536, got '64'"),
        ({"vocab_size": 2**40}, None, "config.json", "vocab_size must be an integer from 1 to 4194304, got 1099"),
        (None, _no_tokenizer, "", "has no tokenizer.json (found tokenizer_config.json)"),
    ],
    ids=["empty", "header-length", "truncated", "heads", "hidden-2^31", "hidden-string", "vocab-2^40", "tokenizer"],
)
def test_broken_files_are_refused_before_any_process_starts(tiny, tmp_path, config, damage, file, why):
    """Each gets one line naming the file and the cause; status 2 is the launcher's refusal, before any child."""
    d = edited(tiny, tmp_path, config=config)
    if damage:
        damage(d)
    code, out = serve("--model", str(d))
    assert code == 2
    assert out.strip().splitlines() == [out.strip()], out
    path = str(d / file) if file else str(d)
    assert out.startswith(f"pipeline-serve: error: {path}{':' if file else ''} {why}"), out


def test_a_nan_weight_is_refused_naming_the_tensor(tiny, tmp_path):
    d = edited(tiny, tmp_path)
    tensors = load_file(d / "model.safetensors")
    tensors["model.layers.1.self_attn.k_proj.weight"][3, 7] = float("nan")
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    code, out = serve("--model", str(d))
    assert code == 1
    assert "model.safetensors: tensor model.layers.1.self_attn.k_proj.weight holds NaN or infinite values" in out
