"""Weight-only quantized linear weights: integer codes with group-wise scales, kept packed, multiplied as such.

Two layouts, both group-wise along the input dimension (a group is
``group_size`` consecutive input columns of one output row):

- int4 (uint8 codes ``q`` in 0..15): ``w = (q - 8) * scale + zero`` (torch's
  ``_weight_int4pack_mm`` formula).
- int8 (int8 codes): ``w = q * scale``, or ``w = q * scale + zero`` with a zero.

The kernels that multiply them, and why: docs/design.md, "Quantized weights".
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.gpu_worker.layers import quant_cpu

_LOG = logging.getLogger(__name__)

_aten = torch.ops.aten
# The group sizes torch's int4 kernels take.
_INT4_GROUPS = (32, 64, 128, 256)
# The dtype torch's weight-only kernels compute in, read when a weight is packed (see above); float32 runs
# them to float32 rounding, slowly.
KERNEL_DTYPE = torch.bfloat16
# Whether pack uses quant_cpu's kernel where it takes the weight; False keeps torch's ops (their tests set it).
CPU_KERNEL = True


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
    above; uint8 codes are int4)."""
    out, inp = codes.shape
    group_size = inp // scale.shape[1]
    q = codes.to(dtype).reshape(out, -1, group_size)
    if codes.dtype == torch.uint8:
        q = q - 8
    w = q * scale.to(dtype)[..., None]
    if zero is not None:
        w = w + zero.to(dtype)[..., None]
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
    def pack(
        cls, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, dtype: torch.dtype = torch.float32
    ) -> QuantizedWeight:
        """Pack ``codes``/``scale``/``zero`` (in a layout above, e.g. as ``quantize_rtn`` returns them) for the
        weight-only kernel this device and torch build run, else keep them for the dequantizing one. ``dtype`` is
        the activations': in bfloat16 or float16 the CPU rounds them to int8 where it can (``int*_vnni``)."""
        out, inp = codes.shape
        bits = 4 if codes.dtype == torch.uint8 else 8
        group_size = inp // scale.shape[1]
        device, shape = codes.device.type, (out, inp)
        vnni = quant_cpu.pack_vnni(codes, scale, zero, bits) if CPU_KERNEL and dtype != torch.float32 else None
        if vnni is not None:
            module = cls._with(shape, bits, group_size, f"int{bits}_vnni", torch.float32, codes=vnni[0], coef=vnni[1])
            module.block_size = vnni[2]
            return module
        panel = quant_cpu.pack(codes, scale, zero, bits) if CPU_KERNEL else None
        if panel is not None:
            return cls._with(shape, bits, group_size, f"int{bits}_panel", torch.float32, codes=panel[0], coef=panel[1])
        if bits == 4 and group_size in _INT4_GROUPS:
            # [groups, out, 2]: the scale and zero of each group, as both int4 kernels take them.
            scales_zeros = torch.stack([scale.t(), zero.t()], dim=-1).to(KERNEL_DTYPE).contiguous()
            packed = _pack_int4(codes, device)
            if packed is not None:
                return cls._with(
                    shape, bits, group_size, f"int4_{device}", KERNEL_DTYPE, packed=packed, scales_zeros=scales_zeros
                )
        if bits == 8 and zero is None and group_size == inp:
            kernel_scale = scale.reshape(out).to(KERNEL_DTYPE).contiguous()
            if _int8_op_runs(codes, kernel_scale):
                return cls._with(shape, bits, group_size, "int8", KERNEL_DTYPE, codes=codes, scale=kernel_scale)
        kw = {"codes": codes, "scale": scale} | ({} if zero is None else {"zero": zero})
        return cls._with(shape, bits, group_size, "dequantize", None, **kw)

    @classmethod
    def _with(cls, shape, bits, group_size, kernel, compute_dtype, **buffers: torch.Tensor) -> QuantizedWeight:
        module = cls(shape, bits, group_size, kernel)
        for name, t in buffers.items():
            module.register_buffer(name, t)
        module.compute_dtype = compute_dtype
        return module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel == "dequantize":
            return F.linear(x, self.dequantized(x.dtype))
        if self.kernel.endswith("_panel"):
            return quant_cpu.matmul(x, self.codes, self.coef, self.bits, self.group_size)
        if self.kernel.endswith("_vnni"):
            return quant_cpu.matmul_vnni(x, self.codes, self.coef, self.bits, self.group_size, self.block_size)
        xk = x.to(self.compute_dtype)
        if self.kernel == "int4_cpu":
            y = _aten._weight_int4pack_mm_for_cpu(xk, self.packed, self.group_size, self.scales_zeros)
        elif self.kernel == "int4_cuda":
            y = _aten._weight_int4pack_mm(xk, self.packed, self.group_size, self.scales_zeros)
        else:
            y = _aten._weight_int8pack_mm(xk, self.codes, self.scale)
        return y.to(x.dtype)

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight ``[out, in]`` these buffers hold, in ``dtype`` (for the fallback kernel and for checks)."""
        if self.kernel.startswith("int4") or self.kernel.endswith(("_panel", "_vnni")):
            # The packed layouts are opaque: multiply the identity through the kernel (torch's round each weight to
            # bfloat16).
            eye = torch.eye(self.shape[1], dtype=self.compute_dtype, device=next(self.buffers()).device)
            return self.forward(eye).t().to(dtype)
        if self.kernel == "int8":
            return dequantize(self.codes, self.scale[:, None], None, dtype)
        return dequantize(self.codes, self.scale, getattr(self, "zero", None), dtype)

    def nbytes(self) -> int:
        """Bytes of the buffers this weight holds."""
        return sum(b.numel() * b.element_size() for b in self.buffers())

    def extra_repr(self) -> str:
        return f"shape={self.shape}, bits={self.bits}, group_size={self.group_size}, kernel={self.kernel}"


def _pack_int4(codes: torch.Tensor, device: str) -> torch.Tensor | None:
    """The int4 kernel's packed form of ``codes [out, in]`` (0..15), or None where this build has no such op."""
    try:
        if device == "cpu":
            return _aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)
        if device == "cuda":
            # Two codes a byte, the even column in the high nibble: the layout the CUDA op documents; its tiles
            # span 16 x inner_k_tiles input columns.
            pairs = codes.to(torch.uint8).reshape(codes.shape[0], -1, 2)
            inner_k_tiles = next(t for t in (8, 4, 2) if codes.shape[1] % (16 * t) == 0)
            return _aten._convert_weight_to_int4pack((pairs[..., 0] << 4) | pairs[..., 1], inner_k_tiles)
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
