"""The quantized Hugging Face checkpoints served packed: their ``quantization_config``, read without torch.

AWQ (AutoAWQ's GEMM packing), GPTQ (auto-gptq's and GPTQModel's formats) and
compressed-tensors' ``pack-quantized`` weight-only integers (llm-compressor's
W4A16 and W8A16); ``gpu_worker/models/packed_loader.py`` decodes their tensors.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

METHODS = ("awq", "gptq", "compressed-tensors")
LOADED = (
    "loaded: awq (GEMM, 4-bit), gptq (4-bit), compressed-tensors pack-quantized int4/int8 weight-only, "
    "GGUF files, and --quantization int8|int4 of a float checkpoint"
)


@dataclasses.dataclass(frozen=True)
class CheckpointQuantization:
    """A checkpoint's weight-only quantization.

    Attributes:
        method: one of ``METHODS``.
        bits: 4 or 8.
        group_size: input columns per scale; 0: one group per row.
        symmetric: no zero points in the file (compressed-tensors; AWQ and GPTQ always store them).
        zero_offset: added to each stored zero point: 1 for GPTQ's original format, whose packer stores
            ``z - 1`` (GPTQModel's ``gptq_v2`` stores ``z``).
    """

    method: str
    bits: int
    group_size: int
    symmetric: bool = False
    zero_offset: int = 0


def parse(config: Any) -> CheckpointQuantization:
    """config.json's ``quantization_config`` (a dict, or transformers' object of it).

    Raises:
        ValueError: a method, or a variant of one, that is not served packed; the message names it.
    """
    if not isinstance(config, Mapping):
        config = config.to_dict() if hasattr(config, "to_dict") else vars(config)
    method = config.get("quant_method")
    if method not in METHODS:
        raise ValueError(f"quantization_config method {method!r} is not loaded yet ({LOADED})")
    if method == "compressed-tensors":
        return _compressed_tensors(config)
    bits = config.get("bits", config.get("w_bit"))
    group = config.get("group_size", config.get("q_group_size"))
    if bits != 4:
        raise ValueError(f"quantization_config method {method!r} with {bits!r} bits is not loaded (4-bit only)")
    if method == "awq":
        version = str(config.get("version", "gemm")).lower()
        if version != "gemm":
            raise ValueError(f"awq version {version!r} is not loaded (its packing differs; GEMM only)")
        if config.get("zero_point") is False:
            raise ValueError("awq without zero points (zero_point: false) is not loaded")
        return CheckpointQuantization(method, 4, _group_size(method, group))
    fmt = config.get("checkpoint_format") or "gptq"
    if fmt not in ("gptq", "gptq_v2"):
        raise ValueError(f"gptq checkpoint_format {fmt!r} is not loaded (gptq and gptq_v2 only)")
    return CheckpointQuantization(method, 4, _group_size(method, group), zero_offset=1 if fmt == "gptq" else 0)


def _group_size(method: str, group: Any) -> int:
    if group == -1 or group is None:  # -1: AutoAWQ's and GPTQ's per-channel
        return 0
    if isinstance(group, bool) or not isinstance(group, int) or group <= 0:
        raise ValueError(f"quantization_config method {method!r}: group_size {group!r} is not a positive size")
    return group


def _compressed_tensors(config: Mapping) -> CheckpointQuantization:
    """One weight scheme for every quantized layer, weight-only, integer, ``pack-quantized``."""
    if config.get("sparsity_config"):
        raise ValueError("compressed-tensors with a sparsity_config is not loaded")
    groups = list((config.get("config_groups") or {}).values())
    if not groups:
        raise ValueError("compressed-tensors quantization_config has no config_groups")
    schemes = []
    for group in groups:
        fmt = group.get("format") or config.get("format")
        if fmt != "pack-quantized":
            raise ValueError(f"compressed-tensors format {fmt!r} is not loaded (pack-quantized only)")
        if group.get("input_activations") or group.get("output_activations"):
            raise ValueError("compressed-tensors with quantized activations is not loaded (weight-only only)")
        w = group.get("weights") or {}
        kind, bits, strategy = w.get("type"), w.get("num_bits"), w.get("strategy")
        if kind != "int" or bits not in (4, 8):
            raise ValueError(f"compressed-tensors {kind} weights of {bits} bits are not loaded (int4 and int8 only)")
        if strategy not in ("group", "channel"):
            raise ValueError(f"compressed-tensors weight strategy {strategy!r} is not loaded (group and channel only)")
        size = _group_size("compressed-tensors", w.get("group_size")) if strategy == "group" else 0
        schemes.append((bits, size, bool(w.get("symmetric", True))))
    if len(set(schemes)) > 1:
        raise ValueError(f"compressed-tensors with several weight schemes ({sorted(set(schemes))}) is not loaded")
    bits, size, symmetric = schemes[0]
    return CheckpointQuantization("compressed-tensors", bits, size, symmetric)
