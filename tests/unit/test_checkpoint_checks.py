"""Checkpoint files checked before they are read: safetensors headers, config sizes, the tokenizer."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors.torch import save_file

from pipeline.common.model_config import ModelConfig
from pipeline.common.model_files import check_tokenizer, read_safetensors_header

LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


@pytest.fixture
def st_file(tmp_path):
    """A valid two-tensor safetensors file."""
    path = tmp_path / "model.safetensors"
    save_file({"a": torch.zeros(3, 4), "b": torch.ones(5, dtype=torch.bfloat16)}, path)
    return path


def with_header(path, header: bytes, data: bytes = b"", length: int | None = None) -> None:
    path.write_bytes(struct.pack("<Q", len(header) if length is None else length) + header + data)


def test_a_valid_header_reads_as_safetensors_writes_it(st_file):
    header, start = read_safetensors_header(st_file)
    assert header == {
        "a": {"dtype": "F32", "shape": [3, 4], "data_offsets": [0, 48]},
        "b": {"dtype": "BF16", "shape": [5], "data_offsets": [48, 58]},
    }
    assert start == st_file.stat().st_size - 58


def test_empty_and_short_files(tmp_path):
    path = tmp_path / "model.safetensors"
    for content in (b"", b"\x01\x02\x03"):
        path.write_bytes(content)
        with pytest.raises(ValueError) as e:
            read_safetensors_header(path)
        assert str(e.value) == (
            f"{path}: {len(content)} bytes, too short for a safetensors file (it starts with an 8-byte length)"
        )


def test_a_header_length_past_the_file(tmp_path):
    path = tmp_path / "model.safetensors"
    with_header(path, b"{}", length=2**62)
    with pytest.raises(ValueError) as e:
        read_safetensors_header(path)
    assert str(e.value) == (
        f"{path}: the header length reads {2**62} bytes, but the file has 2 after it "
        "(at most 104857600 allowed): truncated, or not a safetensors file"
    )


@pytest.mark.parametrize(
    "header, why",
    [
        (b"{not json", "the safetensors header is not JSON"),
        (b"\xff\xfe", "the safetensors header is not JSON"),
        (b"[1, 2]", "the safetensors header is not a JSON object"),
    ],
)
def test_a_header_that_is_not_a_json_object(tmp_path, header, why):
    path = tmp_path / "model.safetensors"
    with_header(path, header)
    with pytest.raises(ValueError) as e:
        read_safetensors_header(path)
    assert str(e.value).startswith(f"{path}: {why}")


@pytest.mark.parametrize(
    "entry, data, why",
    [
        ("x", 0, "its header entry is not a JSON object"),
        ({"dtype": "F17", "shape": [1], "data_offsets": [0, 4]}, 4, "unknown dtype 'F17'"),
        ({"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}, 4, "shape [-1] is not a list of sizes"),
        ({"dtype": "F32", "shape": ["2"], "data_offsets": [0, 8]}, 8, "shape ['2'] is not a list of sizes"),
        ({"dtype": "F32", "shape": [2], "data_offsets": [0]}, 8, "data_offsets [0] is not [begin, end]"),
        (
            {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
            8,
            "data_offsets [0, 16] fall outside the file's 8 bytes of data: the file is truncated",
        ),
        (
            {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]},
            8,
            "8 bytes of data for shape (3,) of F32",
        ),
    ],
)
def test_a_broken_tensor_entry_names_the_tensor(tmp_path, entry, data, why):
    path = tmp_path / "model.safetensors"
    with_header(path, json.dumps({"__metadata__": {"format": "pt"}, "w": entry}).encode(), b"\0" * data)
    with pytest.raises(ValueError) as e:
        read_safetensors_header(path)
    assert str(e.value) == f"{path}: tensor w: {why}"


def test_a_truncated_file_names_the_first_tensor_cut_off(st_file):
    content = st_file.read_bytes()
    st_file.write_bytes(content[:-20])  # cuts into tensor a's data
    with pytest.raises(ValueError) as e:
        read_safetensors_header(st_file)
    assert str(e.value).endswith("fall outside the file's 38 bytes of data: the file is truncated")
    assert ": tensor a: data_offsets [0, 48]" in str(e.value)


@pytest.mark.parametrize(
    "fields, why",
    [
        ({"hidden_size": 2**31}, "hidden_size must be an integer from 1 to 65536, got 2147483648"),
        ({"hidden_size": "64"}, "hidden_size must be an integer from 1 to 65536, got '64'"),
        ({"hidden_size": 64.0}, "hidden_size must be an integer from 1 to 65536, got 64.0"),
        ({"hidden_size": 0}, "hidden_size must be an integer from 1 to 65536, got 0"),
        ({"num_hidden_layers": True}, "num_hidden_layers must be an integer from 1 to 1024, got True"),
        ({"vocab_size": 2**40}, "vocab_size must be an integer from 1 to 4194304, got 1099511627776"),
        ({"num_attention_heads": 5}, "num_attention_heads 5 is not a multiple of num_key_value_heads 2"),
        (
            {"num_attention_heads": 5, "num_key_value_heads": 5},
            "hidden_size 64 is not a multiple of num_attention_heads 5",
        ),
        ({"head_dim": -16}, "head_dim must be an integer from 0 to 4096, got -16"),
        ({"max_position_embeddings": 2**40}, "max_position_embeddings must be an integer from 0 to 67108864, got"),
        ({"num_local_experts": 4, "num_experts_per_tok": 8}, "num_experts_per_tok 8 exceeds the 4 experts"),
    ],
)
def test_config_sizes_are_checked_for_type_and_bounds(fields, why):
    with pytest.raises(ValueError) as e:
        ModelConfig.from_hf({**LLAMA, **fields})
    assert str(e.value).startswith(why)


def test_config_sizes_left_out_or_zero_are_derived():
    cfg = ModelConfig.from_hf({**LLAMA, "head_dim": 0, "num_key_value_heads": None, "sliding_window": 0})
    assert (cfg.head_dim, cfg.num_key_value_heads, cfg.sliding_window, cfg.max_position_embeddings) == (
        16,
        4,
        None,
        2048,
    )


def test_a_model_without_tokenizer_json(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(FileNotFoundError) as e:
        check_tokenizer(tmp_path)
    assert str(e.value) == (
        f"{tmp_path} has no tokenizer.json (found tokenizer_config.json): this server needs a fast tokenizer's "
        "file (transformers' save_pretrained of the tokenizer writes it)"
    )
    (tmp_path / "tokenizer.json").write_text("{}")
    check_tokenizer(tmp_path)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_weights_are_refused_as_they_stream_in(tmp_path, dtype, bad):
    from pipeline.gpu_worker.models.base import CheckpointError
    from pipeline.gpu_worker.models.loader import iter_tensors

    path = tmp_path / "model.safetensors"
    w = torch.randn(4, 8).to(dtype)
    w[2, 5] = bad
    save_file({"a": torch.randn(3).to(dtype), "b": w, "ids": torch.arange(3)}, path)
    names = []
    with pytest.raises(CheckpointError) as e:
        for name, _ in iter_tensors(path):
            names.append(name)
    assert str(e.value) == "model.safetensors: tensor b holds NaN or infinite values"
    assert "b" not in names  # refused before the tensor is handed to a weight loader
    # Ranks other than 0 leave the check to rank 0 (they read only their part of each tensor).
    assert sorted(name for name, _ in iter_tensors(path, check_finite=False)) == ["a", "b", "ids"]


def test_shapes_are_checked_against_the_config_before_anything_is_allocated(tiny_dir, tmp_path):
    """Sizes within bounds that the file does not have: named by tensor, not a terabyte allocation failing."""
    import shutil

    from pipeline.gpu_worker.models.base import CheckpointError
    from pipeline.gpu_worker.models.loader import load_model

    d = shutil.copytree(tiny_dir, tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "vocab_size": 2**22, "hidden_size": 2**16, "head_dim": 16}))
    with pytest.raises(CheckpointError) as e:
        load_model(d, torch.float32, torch.device("cpu"), "torch_sdpa")
    assert str(e.value).startswith("model.")
    assert "in the checkpoint, the model config implies" in str(e.value)
    assert "65536" in str(e.value)
