"""Weight-only quantized linear weights: integer codes with group-wise scales, kept packed, multiplied as such.

Two layouts, both group-wise along the input dimension (a group is
``group_size`` consecutive input columns of one output row):

- int4: codes ``q`` in 0..15, ``w = (q - 8) * scale + zero`` (torch's
  ``_weight_int4pack_mm`` formula); GGUF's Q4_0 (``zero = 0``) and Q4_1
  (``w = d q + m``, so ``zero = m + 8 d``) map onto it exactly.
- int8: codes ``q`` in -128..127, ``w = q * scale``, symmetric (GGUF's Q8_0
  with groups of 32; per-channel when a group is a whole row).

The matmul runs on torch's weight-only ops: on the CPU
``_weight_int4pack_mm_for_cpu`` and ``_weight_int8pack_mm`` (per-channel
scales only), on CUDA ``_weight_int4pack_mm`` (bfloat16 activations) and
``_weight_int8pack_mm``. Where the op is missing or refuses the shape, the
weight stays as codes and each call dequantizes it into the activation dtype
and multiplies (``QuantizedWeight.kernel`` says which).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

_LOG = logging.getLogger(__name__)

_aten = torch.ops.aten
# The group sizes torch's int4 kernels take.
_INT4_GROUPS = (32, 64, 128, 256)


def quantize_rtn(w: torch.Tensor, bits: int, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Round-to-nearest quantization of ``w [out, in]`` (float) -> ``(codes, scale, zero)``.

    ``codes`` is ``[out, in]`` (uint8 0..15 for 4 bits, int8 for 8 bits),
    ``scale`` and ``zero`` ``[out, in / group_size]`` float32; ``zero`` is
    None for 8 bits (symmetric). int4 is asymmetric: each group's minimum
    and maximum land on codes 0 and 15.

    Raises:
        ValueError: ``group_size`` does not divide the input width.
    """
    out, inp = w.shape
    if group_size <= 0 or inp % group_size:
        raise ValueError(f"group size {group_size} does not divide the input width {inp}")
    g = w.float().reshape(out, inp // group_size, group_size)
    if bits == 8:
        scale = g.abs().amax(-1).clamp_min(torch.finfo(torch.float32).tiny) / 127
        codes = (g / scale[..., None]).round().clamp(-128, 127).to(torch.int8)
        return codes.reshape(out, inp), scale, None
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / 15).clamp_min(torch.finfo(torch.float32).tiny)
    codes = ((g - lo[..., None]) / scale[..., None]).round().clamp(0, 15).to(torch.uint8)
    return codes.reshape(out, inp), scale, lo + 8 * scale


def dequantize(
    codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """``codes [out, in]``, ``scale``/``zero [out, groups]`` -> the weight ``[out, in]`` in ``dtype`` (formulas
    above; 4 bits when ``zero`` is given)."""
    out, inp = codes.shape
    group_size = inp // scale.shape[1]
    q = codes.to(dtype).reshape(out, -1, group_size)
    if zero is None:
        w = q * scale.to(dtype)[..., None]
    else:
        w = (q - 8) * scale.to(dtype)[..., None] + zero.to(dtype)[..., None]
    return w.reshape(out, inp)


class QuantizedWeight(nn.Module):
    """A linear weight ``[out, in]`` held as packed codes and scales; ``forward(x [N, in]) -> [N, out]``.

    Built by ``pack`` from loaded codes, once; its tensors are buffers (they
    move with the model, ``state_dict`` lists them).
    """

    def __init__(self, shape: tuple[int, int], bits: int, group_size: int, kernel: str) -> None:
        super().__init__()
        self.shape, self.bits, self.group_size, self.kernel = shape, bits, group_size, kernel

    @classmethod
    def pack(cls, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None) -> QuantizedWeight:
        """Pack ``codes``/``scale``/``zero`` (as ``quantize_rtn`` returns them, scales in the activation dtype)
        for the fastest kernel this device and torch build run, else keep them for the dequantizing one."""
        out, inp = codes.shape
        bits = 8 if zero is None else 4
        group_size = inp // scale.shape[1]
        device, shape = codes.device.type, (out, inp)
        if bits == 4 and group_size in _INT4_GROUPS:
            # [groups, out, 2]: the scale and zero of each group, as both int4 kernels take them.
            scales_zeros = torch.stack([scale.t(), zero.t()], dim=-1).contiguous()
            packed = _pack_int4(codes, device, scale.dtype)
            if packed is not None:
                return cls._with(shape, bits, group_size, f"int4_{device}", packed=packed, scales_zeros=scales_zeros)
        if bits == 8 and group_size == inp and _int8_op_runs(codes, scale):
            return cls._with(shape, bits, group_size, "int8", codes=codes, scale=scale.reshape(out).contiguous())
        kw = {"codes": codes, "scale": scale} | ({} if zero is None else {"zero": zero})
        return cls._with(shape, bits, group_size, "dequantize", **kw)

    @classmethod
    def _with(cls, shape, bits, group_size, kernel, **buffers: torch.Tensor) -> QuantizedWeight:
        module = cls(shape, bits, group_size, kernel)
        for name, t in buffers.items():
            module.register_buffer(name, t)
        return module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel == "int4_cpu":
            return _aten._weight_int4pack_mm_for_cpu(x, self.packed, self.group_size, self.scales_zeros.to(x.dtype))
        if self.kernel == "int4_cuda":
            y = _aten._weight_int4pack_mm(x.to(torch.bfloat16), self.packed, self.group_size, self.scales_zeros)
            return y.to(x.dtype)
        if self.kernel == "int8":
            return _aten._weight_int8pack_mm(x, self.codes, self.scale.to(x.dtype))
        return F.linear(x, self.dequantized(x.dtype))

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight ``[out, in]`` these buffers hold, in ``dtype`` (for the fallback kernel and for checks)."""
        if self.kernel in ("int4_cpu", "int4_cuda"):
            eye = torch.eye(self.shape[1], dtype=self.scales_zeros.dtype, device=self.packed.device)
            if self.kernel == "int4_cuda":
                eye = eye.to(torch.bfloat16)
            # The packed layout is opaque: multiply the identity through the kernel.
            return self.forward(eye).t().to(dtype)
        zero = getattr(self, "zero", None)
        if self.kernel == "int8":
            return dequantize(self.codes, self.scale[:, None], None, dtype)
        return dequantize(self.codes, self.scale, zero, dtype)

    def nbytes(self) -> int:
        """Bytes of the buffers this weight holds."""
        return sum(b.numel() * b.element_size() for b in self.buffers())

    def extra_repr(self) -> str:
        return f"shape={self.shape}, bits={self.bits}, group_size={self.group_size}, kernel={self.kernel}"


def _pack_int4(codes: torch.Tensor, device: str, dtype: torch.dtype) -> torch.Tensor | None:
    """The int4 kernel's packed form of ``codes [out, in]`` (0..15), or None where this build has no such op."""
    try:
        if device == "cpu":
            return _aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)
        if device == "cuda" and dtype == torch.bfloat16:
            # Two codes a byte, the even column in the high nibble: the layout the CUDA op documents.
            pairs = codes.to(torch.uint8).reshape(codes.shape[0], -1, 2)
            return _aten._convert_weight_to_int4pack((pairs[..., 0] << 4) | pairs[..., 1], 8)
    except (RuntimeError, NotImplementedError) as e:
        _LOG.info("int4 weights fall back to dequantize-and-multiply: %s", str(e).splitlines()[0])
    return None


def _int8_op_runs(codes: torch.Tensor, scale: torch.Tensor) -> bool:
    """Whether ``_weight_int8pack_mm`` runs here for this weight (it is absent on some devices and builds)."""
    try:
        x = torch.zeros(1, codes.shape[1], dtype=scale.dtype, device=codes.device)
        _aten._weight_int8pack_mm(x, codes, scale.reshape(-1))
    except (RuntimeError, NotImplementedError) as e:
        _LOG.info("int8 weights fall back to dequantize-and-multiply: %s", str(e).splitlines()[0])
        return False
    return True
