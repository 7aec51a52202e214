"""A PEFT LoRA adapter as ``save_pretrained`` writes it, checked against the base model and read without torch
(io_proc and the launcher check adapters too; the worker copies them into its slots with ``gpu_worker.lora``).

A directory holds ``adapter_config.json`` (``r``, ``lora_alpha``,
``use_rslora``, ``target_modules``) and ``adapter_model.safetensors`` with,
per targeted projection of every decoder layer, ``...layers.{i}.{self_attn|mlp}.{proj}.lora_A.weight``
``[r, in]`` and ``lora_B.weight`` ``[out, r]``. The update of a projection is
``x @ A.T @ B.T * scaling``, with ``scaling = lora_alpha / r`` (or
``lora_alpha / sqrt(r)`` with rsLoRA, Kalajdzievski 2023); ``B`` is returned
pre-scaled.

An adapter read once is kept as a *prepared copy* (``save_weights``): its
float32 ``A`` and scaled ``B`` in a safetensors file of the instance, which
the worker reads back with a copy (``load_weights``) instead of converting
the user's checkpoint on its step loop (docs/design.md, "Multi-LoRA").
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pipeline.common.model_config import ModelConfig
from pipeline.common.model_files import read_safetensors_header

# The projections an adapter may target: the attention and dense MLP ones.
ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
PROJECTIONS = ATTENTION_PROJECTIONS + MLP_PROJECTIONS
_TENSOR = re.compile(r"\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
# adapter_config.json keys whose non-default values change the computation in ways not served here.
_UNSUPPORTED = {
    "use_dora": (False, None),
    "bias": ("none", None),
    "modules_to_save": (None, []),
    "rank_pattern": ({}, None),
    "alpha_pattern": ({}, None),
    "layers_to_transform": (None, []),
}


class LoraError(ValueError):
    """An adapter that cannot be served on this base model; the message names the cause."""


@dataclass(frozen=True)
class AdapterSpec:
    """A checked adapter, before its tensors are read.

    Attributes:
        rank: its ``r``.
        scaling: what ``B`` is multiplied by.
        tensors: ``(layer, projection, "A" or "B") -> checkpoint tensor name``.
        tensors_path: its safetensors file.
    """

    rank: int
    scaling: float
    tensors: dict[tuple[int, str, str], str]
    tensors_path: Path


@dataclass(frozen=True)
class LoraWeights:
    """An adapter's tensors, read and checked.

    Attributes:
        weights: ``(layer, projection) -> (A [r, in], B [out, r] times scaling)``, float32.
    """

    weights: dict[tuple[int, str], tuple[np.ndarray, np.ndarray]]


# Checkpoint dtypes numpy reads as they are; BF16 is widened from its bits.
_DTYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "BF16": np.uint16}


def read_weights(path: str | Path, config: ModelConfig, max_rank: int) -> LoraWeights:
    """The PEFT adapter in directory ``path`` checked (``check_adapter``) and read.

    Raises:
        LoraError: as ``check_adapter``, a dtype other than float32/16/64 or bfloat16, a tensor holding
            NaN or infinities, or a file that cannot be read.
    """
    spec = check_adapter(path, config, max_rank)
    try:
        header, start = read_safetensors_header(spec.tensors_path)
        data = np.fromfile(spec.tensors_path, dtype=np.uint8, offset=start)
        parts = {key: _float32(data, name, header[name]) for key, name in spec.tensors.items()}
    except (OSError, ValueError) as e:
        raise LoraError(f"{spec.tensors_path}: cannot read the adapter: {e}") from None
    weights = {(i, p): (a, parts[i, p, "B"] * np.float32(spec.scaling)) for (i, p, w), a in parts.items() if w == "A"}
    return LoraWeights(weights)


def _float32(data: np.ndarray, name: str, info: dict) -> np.ndarray:
    """Tensor ``name`` (header entry ``info``) of the data bytes ``data``, as float32."""
    dtype = _DTYPES.get(info["dtype"])
    if dtype is None:
        raise ValueError(f"tensor {name} has dtype {info['dtype']}; adapters must be float32, float16 or bfloat16")
    begin, end = info["data_offsets"]
    if end > len(data):
        raise ValueError(f"tensor {name} is cut short: the file changed while it was read")
    raw = data[begin:end].view(dtype)
    values = (raw.astype(np.uint32) << 16).view(np.float32) if info["dtype"] == "BF16" else raw.astype(np.float32)
    values = values.reshape(info["shape"])
    if not np.isfinite(values).all():
        raise ValueError(f"tensor {name} holds NaN or infinite values")
    return values


def save_weights(weights: LoraWeights, file: str | Path) -> None:
    """Write ``weights`` to ``file`` as a prepared copy (float32 safetensors; replaced whole, never seen half
    written)."""
    names, blobs, offset = {}, [], 0
    for (layer, proj), (a, b) in weights.weights.items():
        for which, t in (("A", a), ("B", b)):
            t = np.ascontiguousarray(t, dtype=np.float32)
            names[f"{layer}.{proj}.{which}"] = {
                "dtype": "F32",
                "shape": list(t.shape),
                "data_offsets": [offset, offset + t.nbytes],
            }
            blobs.append(t)
            offset += t.nbytes
    header = json.dumps(names).encode()
    header += b" " * (-len(header) % 8)
    tmp = f"{file}.{os.getpid()}.tmp"
    with open(tmp, "wb") as f:
        f.write(len(header).to_bytes(8, "little") + header)
        for t in blobs:
            f.write(t.data)
    os.replace(tmp, file)


def load_weights(file: str | Path) -> LoraWeights:
    """A prepared copy written by ``save_weights``.

    Raises:
        OSError, ValueError: the file is gone or damaged.
    """
    file = Path(file)
    header, start = read_safetensors_header(file)
    data = np.fromfile(file, dtype=np.uint8, offset=start)
    parts = {}
    for name, info in header.items():
        begin, end = info["data_offsets"]
        layer, proj, which = name.split(".")
        parts[int(layer), proj, which] = data[begin:end].view(np.float32).reshape(info["shape"])
    weights = {(i, p): (a, parts[i, p, "B"]) for (i, p, w), a in parts.items() if w == "A"}
    return LoraWeights(weights)


def projection_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """Each projection's full ``(in, out)`` in ``config``'s model."""
    h, d = config.hidden_size, config.head_dim
    q, kv, i = config.num_attention_heads * d, config.num_key_value_heads * d, config.intermediate_size
    return {
        "q_proj": (h, q),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "o_proj": (q, h),
        "gate_proj": (h, i),
        "up_proj": (h, i),
        "down_proj": (i, h),
    }


def check_adapter(path: str | Path, config: ModelConfig, max_rank: int) -> AdapterSpec:
    """Check the PEFT adapter in directory ``path`` against a base model of ``config`` from its config and
    its safetensors header alone (no tensor data is read, and no torch is needed).

    Raises:
        LoraError: no adapter there, a rank over ``max_rank``, a target module
            other than ``PROJECTIONS`` (or an MLP one on a mixture-of-experts
            model), a feature not served (DoRA, biases, ...), a missing or
            extra tensor, or a tensor shape that another base model implies.
    """
    path = Path(path)
    cfg_path, tensors_path = path / "adapter_config.json", path / "adapter_model.safetensors"
    if not cfg_path.is_file() or not tensors_path.is_file():
        raise LoraError(f"{path} is not a PEFT LoRA adapter: it needs {cfg_path.name} and {tensors_path.name}")
    try:
        cfg = json.loads(cfg_path.read_text())
        header, _ = read_safetensors_header(tensors_path)
    except (OSError, ValueError) as e:
        raise LoraError(f"{path}: cannot read the adapter: {e}") from None
    if not isinstance(cfg, dict):
        raise LoraError(f"{cfg_path} is not a JSON object")
    targets = _check_config(cfg, config, max_rank)
    rank = int(cfg["r"])
    alpha = float(cfg.get("lora_alpha", 8))
    scaling = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
    shapes = projection_shapes(config)
    tensors: dict[tuple[int, str, str], str] = {}
    for name, info in header.items():
        m = _TENSOR.search(name)
        if m is None or m[2] not in targets or int(m[1]) >= config.num_hidden_layers:
            raise LoraError(f"{tensors_path.name}: tensor {name} is not a LoRA weight of a targeted projection")
        layer, proj, which = int(m[1]), m[2], m[3]
        n_in, n_out = shapes[proj]
        expected = (rank, n_in) if which == "A" else (n_out, rank)
        if tuple(info["shape"]) != expected:
            raise LoraError(
                f"{name} has shape {tuple(info['shape'])}, this base model needs {expected}: "
                "the adapter was trained for another base model (or another r)"
            )
        tensors[layer, proj, which] = name
    missing = [
        f"layers.{i}.{p}.lora_{w}"
        for i in range(config.num_hidden_layers)
        for p in targets
        for w in "AB"
        if (i, p, w) not in tensors
    ]
    if missing:
        raise LoraError(f"{tensors_path.name} lacks tensors of its target modules: {', '.join(missing[:8])}")
    return AdapterSpec(rank, scaling, tensors, tensors_path)


def _check_config(cfg: dict, config: ModelConfig, max_rank: int) -> tuple[str, ...]:
    """The adapter's target projections, after refusing what this server cannot serve."""
    if cfg.get("peft_type", "LORA") != "LORA":
        raise LoraError(f"peft_type {cfg.get('peft_type')!r} is not LoRA")
    rank = cfg.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise LoraError(f"adapter_config.json: r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise LoraError(f"the adapter's rank {rank} is over --max-lora-rank {max_rank}")
    for key, defaults in _UNSUPPORTED.items():
        if cfg.get(key, defaults[0]) not in defaults:
            raise LoraError(f"adapter_config.json: {key}={cfg[key]!r} is not supported")
    targets = cfg.get("target_modules")
    if isinstance(targets, str):
        targets = [targets]
    if not targets:
        raise LoraError("adapter_config.json names no target_modules")
    served = PROJECTIONS if not any(config.moe_layers) else ATTENTION_PROJECTIONS
    unknown = sorted(set(targets) - set(served))
    if unknown:
        raise LoraError(f"target modules {unknown} are not served; adapters may target {list(served)}")
    return tuple(p for p in PROJECTIONS if p in targets)
