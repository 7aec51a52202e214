"""Reading a quantized Hugging Face checkpoint's linear weights (AWQ, GPTQ, compressed-tensors) as codes and scales.

Each quantized linear layer ``<m>`` is stored as several tensors in place of
``<m>.weight``: K input columns, N output rows, G groups of ``group_size``
inputs; an int32 word holds ``32 / bits`` codes, the first in its lowest bits
(config.json's ``quantization_config``, read by ``common/checkpoint_quant``):

- AWQ (AutoAWQ's GEMM packing): ``qweight [K, N / 8]`` packed along the
  outputs, a word's nibbles holding its columns 0, 2, 4, 6, 1, 3, 5, 7;
  ``qzeros [G, N / 8]`` the same; ``scales [G, N]``; ``w = (q - z) s``.
- GPTQ: ``qweight [K / 8, N]`` packed along the inputs, ``qzeros [G, N / 8]``
  along the outputs, ``scales [G, N]``, ``g_idx [K]`` each input's group;
  ``w = (q - z) s``, ``z`` the stored zero plus ``zero_offset`` (1 in
  auto-gptq's format, whose packer stores ``z - 1``).
- compressed-tensors ``pack-quantized``: ``weight_packed [N, K / (32 / bits)]``
  along the inputs, each code stored as ``q + 2^(bits - 1)``, ``weight_scale
  [N, G]``, ``weight_zero_point [N / (32 / bits), G]`` (asymmetric only,
  packed along the outputs likewise), ``weight_shape`` (N, K); ``w = (q - z) s``
  in signed ``q`` and ``z``.

They map exactly onto the layouts of ``layers/quant.py``: 4 bits on int4
(the stored unsigned codes, ``zero = (8 - z) s``; compressed-tensors' signed
``z`` gives ``-z s``), 8 bits on int8 (``zero = -z s`` when asymmetric). A
``g_idx`` that is not the groups in order (GPTQ's ``desc_act``, act-order)
is refused naming it: its groups are not runs of inputs, as the layouts' are.
Tensors the format leaves alone (embeddings, norms, an unquantized LM head or
layer) pass as they are; a packed tensor of a layer the model keeps in its
dtype (an LM head, MoE experts) is dequantized to float.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from pipeline.common.checkpoint_quant import CheckpointQuantization
from pipeline.common.model_files import checkpoint_files, read_safetensors_header
from pipeline.gpu_worker.layers.linear import LinearBase, ReplicatedLinear
from pipeline.gpu_worker.layers.quant import dequantize
from pipeline.gpu_worker.models.base import CausalLM, CheckpointError
from pipeline.gpu_worker.models.quant_layout import Layout, quantized_layer, to_layout

# Per method: the tensors replacing a layer's weight, those of them always present, and the one holding the codes.
_PARTS = {
    "awq": ("qweight", "qzeros", "scales"),
    "gptq": ("qweight", "qzeros", "scales", "g_idx"),
    "compressed-tensors": ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx"),
}
_REQUIRED = {
    "awq": {"qweight", "qzeros", "scales"},
    "gptq": {"qweight", "qzeros", "scales"},
    "compressed-tensors": {"weight_packed", "weight_scale", "weight_shape"},
}
# AutoAWQ's order of a word's eight columns: column c of a word is its nibble _AWQ_NIBBLE[c].
_AWQ_NIBBLE = (0, 4, 1, 5, 2, 6, 3, 7)


def layer_quantization(model_dir: Path, model: CausalLM) -> dict[str, Layout]:
    """``{module name: layout}`` of the model's linear layers the checkpoint holds packed (from its headers)."""
    spec = model.config.quantization
    layout = (spec.bits, spec.group_size or None, spec.bits == 4 or not spec.symmetric)
    modules = dict(model.named_modules())
    layers = {}
    for prefix in _packed_modules(model_dir, spec):
        target = model.parameter_of(prefix + ".weight")
        module = None if target is None else target[0].removesuffix(".weight")
        if isinstance(modules.get(module), LinearBase) and not isinstance(modules[module], ReplicatedLinear):
            layers[module] = layout
    return layers


def read_packed(
    model_dir: Path, model: CausalLM, tensors: Iterable[tuple[str, torch.Tensor]], dequantize_all: bool = False
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's ``tensors`` with each packed layer's replaced by ``<m>.weight`` codes, ``<m>.weight_scale``
    and ``<m>.weight_zero`` in the layout of the layer ``layer_quantization`` switched; by the float weight for
    a layer the model keeps in its dtype, and for every layer with ``dequantize_all``. Meta tensors (the
    shape pass) give meta tensors.

    Raises:
        CheckpointError: a layer's tensors missing, of the wrong dtype, truncated or of another group size
            than config.json's, or a ``g_idx`` out of group order; the message names the tensor.
    """
    spec = model.config.quantization
    expected = _packed_modules(model_dir, spec)
    modules = dict(model.named_modules())
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors:
        prefix, _, part = name.rpartition(".")
        if prefix not in expected or part not in _PARTS[spec.method]:
            yield name, tensor
            continue
        # The tensor is a view of a mapping that the next step drops: keep a copy until its layer is whole.
        parts = pending.setdefault(prefix, {})
        parts[part] = tensor if tensor.is_meta else tensor.clone()
        if set(parts) != expected[prefix]:
            continue
        del pending[prefix]
        weight = prefix + ".weight"
        if model.parameter_of(weight) is None:
            continue
        required = _REQUIRED[spec.method]
        if spec.method == "compressed-tensors" and not spec.symmetric:
            required = required | {"weight_zero_point"}
        if missing := required - set(parts):
            raise CheckpointError(
                f"{prefix}: the checkpoint has {', '.join(sorted(parts))} but no {', '.join(sorted(missing))}"
            )
        try:
            codes, scale, zero = _DECODE[spec.method](spec, prefix, parts)
        except ValueError as e:
            raise CheckpointError(str(e)) from None
        layer = None if dequantize_all else quantized_layer(model, modules, weight)
        if layer is None:
            yield weight, dequantize(codes, scale, zero)
            continue
        try:
            codes, scale, zero = to_layout(layer, codes, scale, zero)
        except ValueError as e:
            raise CheckpointError(f"{prefix}: {e}") from None
        yield weight, codes
        yield weight + "_scale", scale
        if zero is not None:
            yield weight + "_zero", zero


def _packed_modules(model_dir: Path, spec: CheckpointQuantization) -> dict[str, set[str]]:
    """``{layer prefix: the names of its packed tensors}`` in the checkpoint, from the safetensors headers."""
    found: dict[str, set[str]] = {}
    for path in checkpoint_files(model_dir):
        for name in read_safetensors_header(path)[0]:
            prefix, _, part = name.rpartition(".")
            if part in _PARTS[spec.method]:
                found.setdefault(prefix, set()).add(part)
    return found


def _unpack(words: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 ``words [R, C]`` -> their unsigned codes (int32), ``32 / bits`` per word along ``dim`` (0 or 1)."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=words.device)
    if dim == 0:
        return ((words[:, None, :] >> shifts[:, None]) & ((1 << bits) - 1)).flatten(0, 1)
    return ((words[:, :, None] >> shifts) & ((1 << bits) - 1)).flatten(1, 2)


def _check_int32(prefix: str, parts: dict[str, torch.Tensor], names: tuple[str, ...]) -> None:
    for name in names:
        if name in parts and parts[name].dtype != torch.int32:
            raise ValueError(f"{prefix}.{name} has dtype {parts[name].dtype}, the format packs codes in int32")


def _check_groups(spec: CheckpointQuantization, prefix: str, scales: str, groups: int, packed: str, k: int) -> None:
    """Raises ValueError unless ``groups`` groups of config.json's size make the ``k`` input columns."""
    if (groups != 1) if spec.group_size == 0 else (groups * spec.group_size != k):
        size = "one group a row" if spec.group_size == 0 else f"group_size {spec.group_size}"
        raise ValueError(
            f"{prefix}.{scales} has {groups} groups for the {k} input columns {prefix}.{packed} holds, "
            f"config.json says {size}: a truncated tensor or a mismatched group size"
        )


def _awq(spec: CheckpointQuantization, prefix: str, parts: dict[str, torch.Tensor]) -> tuple:
    qweight, qzeros, scales = parts["qweight"], parts["qzeros"], parts["scales"]
    _check_int32(prefix, parts, ("qweight", "qzeros"))
    k, n = qweight.shape[0], qweight.shape[1] * 8
    _check_scales_and_zeros(spec, prefix, scales, qzeros, k, n)
    nibble = torch.tensor(_AWQ_NIBBLE, device=qweight.device)
    columns = (torch.arange(0, n, 8, device=qweight.device)[:, None] + nibble).flatten()
    q = _unpack(qweight, 4, 1)[:, columns]
    z = _unpack(qzeros, 4, 1)[:, columns]
    s = scales.float()
    return q.t().to(torch.uint8).contiguous(), s.t().contiguous(), ((8 - z) * s).t().contiguous()


def _gptq(spec: CheckpointQuantization, prefix: str, parts: dict[str, torch.Tensor]) -> tuple:
    qweight, qzeros, scales = parts["qweight"], parts["qzeros"], parts["scales"]
    _check_int32(prefix, parts, ("qweight", "qzeros"))
    k, n = qweight.shape[0] * 8, qweight.shape[1]
    _check_scales_and_zeros(spec, prefix, scales, qzeros, k, n)
    _check_g_idx(prefix + ".g_idx", parts.get("g_idx"), k, scales.shape[0])
    q = _unpack(qweight, 4, 0)
    z = _unpack(qzeros, 4, 1) + spec.zero_offset
    s = scales.float()
    return q.t().to(torch.uint8).contiguous(), s.t().contiguous(), ((8 - z) * s).t().contiguous()


def _check_scales_and_zeros(
    spec: CheckpointQuantization, prefix: str, scales: torch.Tensor, qzeros: torch.Tensor, k: int, n: int
) -> None:
    """Raises ValueError unless AWQ's or GPTQ's ``scales`` are ``[groups, n]`` in groups of the spec's size over the
    ``k`` input columns, and ``qzeros`` ``[groups, n / 8]`` (eight 4-bit zeros an int32)."""
    if scales.dim() != 2 or scales.shape[1] != n:
        raise ValueError(f"{prefix}.scales has shape {tuple(scales.shape)}, {prefix}.qweight packs {n} output rows")
    groups = scales.shape[0]
    _check_groups(spec, prefix, "scales", groups, "qweight", k)
    if tuple(qzeros.shape) != (groups, n // 8):
        raise ValueError(f"{prefix}.qzeros has shape {tuple(qzeros.shape)}, expected {(groups, n // 8)}")


def _check_g_idx(name: str, g_idx: torch.Tensor | None, k: int, groups: int) -> None:
    """Raises ValueError unless ``g_idx`` (when there is one) gives input ``i`` the group ``i * groups // k``."""
    if g_idx is None:
        return
    if tuple(g_idx.shape) != (k,):
        raise ValueError(f"{name} has shape {tuple(g_idx.shape)}, for {k} input columns")
    if not g_idx.is_meta and not torch.equal(g_idx.long(), torch.arange(k) * groups // k):
        raise ValueError(
            f"{name} does not take the input columns in group order (desc_act / act-order): not loaded, since "
            "its groups are not runs of columns; a checkpoint quantized without desc_act is"
        )


def _compressed_tensors(spec: CheckpointQuantization, prefix: str, parts: dict[str, torch.Tensor]) -> tuple:
    packed, scale, shape = parts["weight_packed"], parts["weight_scale"], parts["weight_shape"]
    _check_int32(prefix, parts, ("weight_packed",))
    bits, per = spec.bits, 32 // spec.bits
    n, k = (packed.shape[0], packed.shape[1] * per) if shape.is_meta else (int(shape[0]), int(shape[1]))
    if tuple(packed.shape) != (n, -(-k // per)):
        raise ValueError(
            f"{prefix}.weight_packed has shape {tuple(packed.shape)}, {prefix}.weight_shape ({n}, {k}) packs into "
            f"{(n, -(-k // per))}: truncated"
        )
    if scale.dim() != 2 or scale.shape[0] != n:
        raise ValueError(
            f"{prefix}.weight_scale has shape {tuple(scale.shape)}, "
            f"for the {n} output rows {prefix}.weight_packed holds"
        )
    groups = scale.shape[1]
    _check_groups(spec, prefix, "weight_scale", groups, "weight_packed", k)
    _check_g_idx(prefix + ".weight_g_idx", parts.get("weight_g_idx"), k, groups)
    offset = 1 << (bits - 1)
    q = _unpack(packed, bits, 1)[:, :k] - offset
    s = scale.float()
    zero = None
    if not spec.symmetric:
        zp = parts["weight_zero_point"]
        # Packed along the outputs in int32, as the codes; older writers kept it unpacked (int8).
        z = _unpack(zp, bits, 0)[:n] - offset if zp.dtype == torch.int32 else zp.to(torch.int32)
        if tuple(z.shape) != (n, groups):
            raise ValueError(f"{prefix}.weight_zero_point has shape {tuple(zp.shape)}, for {n} x {groups} zero points")
        zero = -z * s
    if bits == 4:
        return (q + 8).to(torch.uint8), s, torch.zeros_like(s) if zero is None else zero
    return q.to(torch.int8), s, zero


_DECODE = {"awq": _awq, "gptq": _gptq, "compressed-tensors": _compressed_tensors}
