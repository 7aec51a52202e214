"""Quantized Hugging Face checkpoints (AWQ, GPTQ, compressed-tensors) served packed: tiny models written in each
format by the tests, from the formats' public descriptions, against the same models with the dequantized float
weights; and the refusals at start-up."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import save_file

from pipeline.common.config import QuantizationConfig
from pipeline.common.model_files import read_model_config, resolve_quantization
from pipeline.gpu_worker.layers.linear import LinearBase, ReplicatedLinear
from pipeline.gpu_worker.layers.quant import QuantizedWeight
from pipeline.gpu_worker.models.base import CheckpointError
from pipeline.gpu_worker.models.loader import load_model
from tests.unit.test_quantized_weights import (
    CPU,
    PANEL,
    PROMPTS,
    _is_linear,
    _state_dict,
    _write_float,
    assert_weights_equal,
    exact_kernels,
    greedy,
    tiny_config,
)

GROUP = 32


@pytest.fixture(scope="module")
def float_dir(tmp_path_factory) -> Path:
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny-float")
    transformers.LlamaForCausalLM(tiny_config(tie_word_embeddings=True, initializer_range=0.2)).save_pretrained(path)
    return path


def quantize(w: torch.Tensor, bits: int, group: int, symmetric: bool) -> tuple[torch.Tensor, ...]:
    """Round-to-nearest of ``w [N, K]`` in ``group``-column groups (0: a row) -> unsigned codes ``q [N, K]``,
    integer zero points ``z`` and float16 scales ``s [N, G]``, with ``w ~ (q - z) s`` (the formats' formula);
    symmetric: ``z`` is the midpoint ``2^(bits - 1)``."""
    n, k = w.shape
    group = group or k
    g = w.double().reshape(n, k // group, group)
    top = (1 << bits) - 1
    if symmetric:
        s = (g.abs().amax(-1) / (top // 2)).half()
        z = torch.full(s.shape, 1 << (bits - 1), dtype=torch.int64)
    else:
        lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
        s = ((hi - lo) / top).half()
        z = (-lo / s.double()).round().clamp(0, top).long()
    q = (g / s.double()[..., None] + z[..., None]).round().clamp(0, top).long()
    return q.reshape(n, k), z, s


def reference(q: torch.Tensor, z: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """The formats' dequantization ``w = (q - z) s``, each group's ``z`` and ``s`` spread over its columns."""
    group = q.shape[1] // s.shape[1]
    return (q - z.repeat_interleave(group, 1)).float() * s.float().repeat_interleave(group, 1)


def pack(codes: torch.Tensor, bits: int, dim: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """``32 / bits`` unsigned codes per int32 along ``dim``, the first in the lowest bits (AWQ: the word's
    ``order[i]``-th code in its ``i``-th slot)."""
    per = 32 // bits
    c = codes.numpy().astype(np.uint32)
    c = c if dim == 1 else c.T
    words = np.zeros((c.shape[0], c.shape[1] // per), np.uint32)
    for i in range(per):
        words |= c[:, (order[i] if order else i) :: per] << (bits * i)
    words = words if dim == 1 else words.T
    return torch.from_numpy(np.ascontiguousarray(words).view(np.int32))


def awq_tensors(q, z, s, bits, symmetric) -> dict[str, torch.Tensor]:
    # AutoAWQ's GEMM layout: [K, N / 8], the word's columns in the order 0, 2, 4, 6, 1, 3, 5, 7.
    order = (0, 2, 4, 6, 1, 3, 5, 7)
    return {
        "qweight": pack(q.t(), 4, 1, order),
        "qzeros": pack(z.t(), 4, 1, order),
        "scales": s.t().contiguous(),
    }


def gptq_tensors(q, z, s, bits, symmetric, offset=1) -> dict[str, torch.Tensor]:
    # auto-gptq's layout: qweight [K / 8, N] along the inputs, qzeros [G, N / 8] holding z - 1 (its format's
    # offset; gptq_v2 holds z), g_idx [K].
    k, groups = q.shape[1], s.shape[1]
    return {
        "qweight": pack(q.t(), 4, 0),
        "qzeros": pack((z.t() - offset) & 0xF, 4, 1),
        "scales": s.t().contiguous(),
        "g_idx": (torch.arange(k) * groups // k).int(),
    }


def compressed_tensors(q, z, s, bits, symmetric) -> dict[str, torch.Tensor]:
    # pack-quantized: signed codes q - 2^(bits - 1) stored with that offset back, i.e. the unsigned q, along
    # the inputs; the zero point likewise along the outputs (asymmetric only).
    out = {"weight_packed": pack(q, bits, 1), "weight_scale": s, "weight_shape": torch.tensor(q.shape)}
    if not symmetric:
        out["weight_zero_point"] = pack(z, bits, 0)
    return out


def ct_config(bits: int, group: int, symmetric: bool) -> dict:
    weights = {"num_bits": bits, "type": "int", "symmetric": symmetric, "dynamic": False}
    weights |= {"strategy": "group", "group_size": group} if group else {"strategy": "channel"}
    scheme = {"targets": ["Linear"], "weights": weights, "input_activations": None, "format": "pack-quantized"}
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "config_groups": {"group_0": scheme},
        "ignore": ["lm_head"],
        "quantization_status": "compressed",
    }


# name -> (quantization_config, tensors writer, bits, group, symmetric, the kernel its layers run where quant_cpu's
# does not build; where it does, int4_cpu and int8 run on int4_panel and int8_panel)
FORMATS = {
    "awq": (
        {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True, "version": "gemm"},
        awq_tensors, 4, GROUP, False, "int4_cpu",
    ),
    "gptq": (
        {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": False, "sym": False},
        gptq_tensors, 4, GROUP, False, "int4_cpu",
    ),
    "gptq sym": (
        {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": False, "sym": True},
        gptq_tensors, 4, GROUP, True, "int4_cpu",
    ),
    "gptq_v2": (
        {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "sym": False, "checkpoint_format": "gptq_v2"},
        lambda *a: gptq_tensors(*a, offset=0), 4, GROUP, False, "int4_cpu",
    ),
    "ct w4a16": (ct_config(4, GROUP, True), compressed_tensors, 4, GROUP, True, "int4_cpu"),
    "ct w4a16 asym": (ct_config(4, GROUP, False), compressed_tensors, 4, GROUP, False, "int4_cpu"),
    "ct w8a16": (ct_config(8, 0, True), compressed_tensors, 8, 0, True, "int8"),
    "ct w8a16 asym": (ct_config(8, GROUP, False), compressed_tensors, 8, GROUP, False, "dequantize"),
}  # fmt: skip


def write_checkpoint(float_dir: Path, out: Path, fmt: str, edit=None) -> Path:
    """The float checkpoint quantized into ``fmt``'s tensors in ``out``; returns the float directory of the
    weights the format's formula gives. ``edit(tensors)`` may change the packed tensors before writing."""
    config, writer, bits, group, symmetric, _ = FORMATS[fmt]
    tensors, dequantized = {}, {}
    for name, w in _state_dict(float_dir).items():
        if not _is_linear(name):
            tensors[name] = dequantized[name] = w
            continue
        q, z, s = quantize(w, bits, group, symmetric)
        prefix = name.removesuffix(".weight")
        tensors |= {f"{prefix}.{part}": t for part, t in writer(q, z, s, bits, symmetric).items()}
        dequantized[name] = reference(q, z, s)
    if edit is not None:
        edit(tensors)
    out.mkdir()
    hf = json.loads((float_dir / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(hf | {"quantization_config": config}))
    save_file({k: v.contiguous() for k, v in tensors.items()}, out / "model.safetensors")
    return _write_float(float_dir, out.with_name(out.name + "-float"), dequantized)


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_quantized_checkpoint_decodes_as_its_dequantized_float_twin(fmt, float_dir, tmp_path):
    reference_dir = write_checkpoint(float_dir, tmp_path / "q", fmt)
    config = read_model_config(tmp_path / "q")
    quant = resolve_quantization("auto", None, str(tmp_path / "q"), tmp_path / "q", config)
    assert quant == QuantizationConfig(FORMATS[fmt][0]["quant_method"])
    float_model = load_model(reference_dir, torch.float32, CPU)
    theirs, their_logits = greedy(float_model, PROMPTS, 12)
    # The kernels in float32: every weight as the formula gives it, the same tokens, logits to float32 rounding.
    with exact_kernels():
        model = load_model(tmp_path / "q", torch.float32, CPU, quantization=quant)
    linears = [m for m in model.modules() if isinstance(m, LinearBase) and not isinstance(m, ReplicatedLinear)]
    assert len(linears) == 8 and all(isinstance(m.weight, QuantizedWeight) for m in linears)
    kernel = FORMATS[fmt][5]
    if PANEL:
        kernel = {"int4_cpu": "int4_panel", "int8": "int8_panel"}.get(kernel, kernel)
    assert {m.weight.kernel for m in linears} == {kernel}
    assert_weights_equal(model, reference_dir)
    ours, ours_logits = greedy(model, PROMPTS, 12)
    assert ours == theirs
    torch.testing.assert_close(ours_logits, their_logits, rtol=0, atol=1e-4)
    # --quantization none: the same weights expanded to float.
    expanded = load_model(tmp_path / "q", torch.float32, CPU, quantization=QuantizationConfig())
    tokens, logits = greedy(expanded, PROMPTS, 4)
    assert tokens == [t[: len(p) + 4] for t, p in zip(theirs, PROMPTS, strict=True)]
    torch.testing.assert_close(logits, their_logits, rtol=0, atol=1e-5)


def _with_config(float_dir: Path, out: Path, quantization_config: dict) -> Path:
    out.mkdir()
    hf = json.loads((float_dir / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(hf | {"quantization_config": quantization_config}))
    return out


@pytest.mark.parametrize(
    ("quantization_config", "message"),
    [
        ({"quant_method": "fp8"}, "quantization_config method 'fp8' is not loaded yet"),
        ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "method 'bitsandbytes' is not loaded yet"),
        ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "awq version 'gemv'"),
        ({"quant_method": "gptq", "bits": 8, "group_size": 128}, "method 'gptq' with 8 bits"),
        ({"quant_method": "gptq", "bits": 4, "group_size": 0}, "group_size 0 is not a positive size"),
        ({"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "marlin"}, "'marlin'"),
        (ct_config(4, GROUP, True) | {"format": "marlin-24", "config_groups": {}}, "has no config_groups"),
        (
            {**ct_config(8, 0, True), "config_groups": {"g": {**ct_config(8, 0, True)["config_groups"]["group_0"],
             "input_activations": {"num_bits": 8, "type": "int"}}}},
            "compressed-tensors with quantized activations",
        ),
        (
            {**ct_config(8, 0, True), "config_groups": {"g": {**ct_config(8, 0, True)["config_groups"]["group_0"],
             "format": "float-quantized"}}},
            "compressed-tensors format 'float-quantized'",
        ),
    ],
)  # fmt: skip
def test_a_quantization_method_not_loaded_is_refused_naming_it(float_dir, tmp_path, quantization_config, message):
    _with_config(float_dir, tmp_path / "q", quantization_config)
    with pytest.raises(ValueError, match=f"config.json: .*{message}"):
        read_model_config(tmp_path / "q")


def test_int8_or_int4_of_a_quantized_checkpoint_is_refused(float_dir, tmp_path):
    write_checkpoint(float_dir, tmp_path / "q", "awq")
    config = read_model_config(tmp_path / "q")
    with pytest.raises(ValueError, match="--quantization int4 quantizes a float checkpoint; this one is already awq"):
        resolve_quantization("int4", None, str(tmp_path / "q"), tmp_path / "q", config)
    assert resolve_quantization("none", None, str(tmp_path / "q"), tmp_path / "q", config) == QuantizationConfig()


def _truncate(name: str, part: str):
    def edit(tensors):
        tensors[f"{name}.{part}"] = tensors[f"{name}.{part}"][:-1]

    return edit


def _shuffle_g_idx(tensors):
    g_idx = tensors["model.layers.1.mlp.down_proj.g_idx"]
    tensors["model.layers.1.mlp.down_proj.g_idx"] = g_idx[torch.randperm(len(g_idx), generator=torch.Generator())]


DOWN = "model.layers.1.mlp.down_proj"


@pytest.mark.parametrize(
    ("fmt", "edit", "config_edit", "message"),
    [
        # A group size other than the tensors': a scales tensor named, with the packed one.
        ("gptq", None, {"group_size": 64}, r"\.scales has \d+ groups for the \d+ input columns .*\.qweight holds, "
         r"config\.json says group_size 64: a truncated tensor or a mismatched group size"),
        ("awq", None, {"group_size": 16}, r"\.scales has \d+ groups .*config\.json says group_size 16"),
        # Truncated packed tensors (their last rows gone), named.
        ("awq", _truncate(DOWN, "qweight"), None, rf"{DOWN}\.scales has 4 groups for the 127 input columns"),
        ("gptq", _truncate(DOWN, "qzeros"), None, rf"{DOWN}\.qzeros has shape \(3, 8\), expected \(4, 8\)"),
        ("ct w4a16", _truncate(DOWN, "weight_packed"), None,
         rf"{DOWN}\.weight_scale has shape \(64, 4\), for the 63 output rows {DOWN}\.weight_packed holds"),
        # Act-order: the inputs' groups are not runs of columns.
        ("gptq", _shuffle_g_idx, None, rf"{DOWN}\.g_idx does not take the input columns in group order"),
    ],
)  # fmt: skip
def test_a_mismatched_or_truncated_packed_tensor_is_refused_naming_it(
    float_dir, tmp_path, fmt, edit, config_edit, message
):
    write_checkpoint(float_dir, tmp_path / "q", fmt, edit)
    if config_edit:
        path = tmp_path / "q" / "config.json"
        hf = json.loads(path.read_text())
        hf["quantization_config"] |= config_edit
        path.write_text(json.dumps(hf))
    quant = QuantizationConfig(FORMATS[fmt][0]["quant_method"])
    with pytest.raises(CheckpointError, match=message):
        load_model(tmp_path / "q", torch.float32, CPU, quantization=quant)
