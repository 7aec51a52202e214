"""Loading a model with weight-only quantized linear layers: which layers, and the checkpoint tensors that fill them.

``--quantization int8|int4`` quantizes a float checkpoint's linear weights
round-to-nearest as they stream in (one float tensor at a time, before the
weight loader shards it); ``gguf`` reads a GGUF file's quantized weights as
they are (``gguf_loader``), ``awq``, ``gptq`` and ``compressed-tensors``
those of a Hugging Face checkpoint (``packed_loader``). The MoE router (a
``ReplicatedLinear``), the experts, the embeddings and the LM head stay in
the model dtype, unless the file holds them otherwise.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from pipeline.common.config import QuantizationConfig
from pipeline.gpu_worker.layers.linear import LinearBase, ReplicatedLinear
from pipeline.gpu_worker.layers.quant import QuantizedWeight, quantize_rtn
from pipeline.gpu_worker.models.base import CausalLM, CheckpointError
from pipeline.gpu_worker.models.quant_layout import full_groups, quantized_layer

# Group size of --quantization int4 when --quantization-group-size is not given (int8 is per-channel then).
DEFAULT_INT4_GROUP = 128


def prepare_layers(model: CausalLM, quant: QuantizationConfig, model_dir: Path) -> None:
    """Switch the layers this quantization covers to codes and scales (``LinearBase.quantize``), before loading.

    Raises:
        CheckpointError: a group size that does not divide a layer's input width (naming the layer), or as
            the format's ``layer_quantization``.
    """
    if quant.method == "gguf":
        from pipeline.gpu_worker.models.gguf_loader import layer_quantization

        layers = layer_quantization(Path(quant.gguf_file), model)
    elif quant.method in ("int8", "int4"):
        bits = int(quant.method[3:])
        group = quant.group_size or (DEFAULT_INT4_GROUP if bits == 4 else None)
        layers = {name: (bits, group, bits == 4) for name, m in _linears(model)}
    elif quant.method != "none":
        from pipeline.gpu_worker.models.packed_loader import layer_quantization

        layers = layer_quantization(model_dir, model)
    else:
        return
    if "lm_head" in layers and model.lm_head is None:
        model.untie_lm_head()
    modules = dict(model.named_modules())
    for name, (bits, group, zero) in layers.items():
        try:
            modules[name].quantize(bits, group, zero)
        except ValueError as e:
            fix = "pass --quantization-group-size with one that does" if quant.method in ("int8", "int4") else ""
            raise CheckpointError(f"{name}: {e}{'; ' if fix else ''}{fix}") from None


def checkpoint_tensors(
    model: CausalLM,
    quant: QuantizationConfig,
    float_weights: Iterable[tuple[str, torch.Tensor]],
    model_dir: Path,
    shapes_only: bool = False,
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint tensors ``model.load_weights`` takes for a model ``prepare`` switched, given the
    checkpoint's (unread for ``gguf``; a packed Hugging Face checkpoint's are decoded, to float for ``none``)."""
    if quant.method == "gguf":
        from pipeline.gpu_worker.models.gguf_loader import read_gguf

        yield from read_gguf(Path(quant.gguf_file), model, shapes_only)
        return
    if model.config.quantization is not None:
        from pipeline.gpu_worker.models.packed_loader import read_packed

        yield from read_packed(model_dir, model, float_weights, dequantize_all=quant.method == "none")
        return
    modules = dict(model.named_modules())
    for name, tensor in float_weights:
        layer = quantized_layer(model, modules, name)
        if layer is None or not tensor.is_floating_point():
            yield name, tensor
            continue
        codes, scale, zero = quantize_rtn(tensor, layer.quant_bits, tensor.shape[1] // full_groups(layer))
        yield name, codes
        yield name + "_scale", scale
        if zero is not None:
            yield name + "_zero", zero


def _linears(model: CausalLM) -> Iterator[tuple[str, LinearBase]]:
    for name, m in model.named_modules():
        if isinstance(m, LinearBase) and not isinstance(m, ReplicatedLinear):
            yield name, m


def describe(model: CausalLM) -> str:
    """One line for the log: how many linear layers are quantized, with which kernels, and their bytes; the LM
    head's where it is quantized."""
    weights = [m.weight for _, m in _linears(model) if isinstance(m.weight, QuantizedWeight)]
    if not weights:
        return "linear weights: not quantized"
    kinds = Counter(_kind(w) for w in weights)
    mib = sum(w.nbytes() for w in weights) / 2**20
    line = f"linear weights: {', '.join(f'{n} x {k}' for k, n in kinds.items())}, {mib:.1f} MiB"
    head = getattr(model.lm_head, "weight", None)
    if isinstance(head, QuantizedWeight):
        line += f"; LM head: {_kind(head)}, {head.nbytes() / 2**20:.1f} MiB"
    return line


def _kind(w: QuantizedWeight) -> str:
    return f"int{w.bits} group {w.group_size} ({w.kernel})"
