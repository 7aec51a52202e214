"""Linear layers that know their tensor-parallel shard at construction, and load it from full checkpoint tensors.

Megatron-LM's split (Shoeybi et al. 2019, section 3; docs/design.md,
"Parallelism"): column-parallel layers hold a slice of the output rows, and
the row-parallel layer after them a slice of the input columns, then sums
the ranks' partial outputs. With one rank every layer is a plain linear.

Each parameter carries ``weight_loader(param, loaded, shard_id)``, which
copies the rank's part of a full checkpoint tensor ``loaded`` into the
parameter (casting to its dtype and device), checks the full tensor's shape,
and returns the shard keys it filled; a parameter filled from several
tensors lists them all in ``param.shards`` (docs/design.md, "Model families").
``loaded`` may be a view of a memory-mapped file: only the rows or columns
the rank keeps are read. After loading, ``pack_weights`` reorders each weight
on the CPU into oneDNN's blocked layout once (docs/design.md, "Layers take
switches").
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.gpu_worker.layers.quant import QuantizedWeight
from pipeline.gpu_worker.layers.tp import SINGLE_RANK, TPGroup

_LOG = logging.getLogger(__name__)

# Private ops (used by inductor's CPU backend); absent in builds without oneDNN.
_mkldnn = getattr(torch.ops, "mkldnn", None)
_onednn_linear = getattr(_mkldnn, "_linear_pointwise", None)
_reorder_linear_weight = getattr(_mkldnn, "_reorder_linear_weight", None)
# The dtypes whose packed weights measured faster than dense ones here (float16 needs
# AVX-512 FP16 or AVX-NE-CONVERT, which this project's CPUs lack).
_PACKED_DTYPES = (torch.float32, torch.bfloat16)
# oneDNN picks the blocked layout for this many rows; vLLM's CPU build uses 32 too.
_PACK_BATCH_HINT = 32


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [N, in] @ weight.T + bias`` -> ``[N, out]``, same dtype as ``x``.

    ``weight`` is dense ``[out, in]`` or the form ``packed`` makes. float32
    on CPU uses oneDNN: aten's float32 matmul is MKL sgemm, which on this
    project's AMD EPYC measured 2-3x slower than oneDNN for every shape these
    models run (bf16 already goes through oneDNN).
    A ``QuantizedWeight`` multiplies with its own kernel.
    """
    if isinstance(weight, QuantizedWeight):
        y = weight(x)
        return y if bias is None else y + bias
    if weight.is_mkldnn or (_onednn_linear is not None and x.dtype == torch.float32 and x.device.type == "cpu"):
        return _onednn_linear(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


def packed(weight: torch.Tensor) -> torch.Tensor | None:
    """``weight [out, in]`` reordered into oneDNN's blocked layout for ``linear``: an opaque mkldnn tensor
    of the same shape and dtype (about the same bytes), which oneDNN would otherwise reorder on every call.

    None (keep the dense weight) off the CPU, for other dtypes, and where
    this torch build cannot reorder (logged once, at debug level).
    """
    if weight.device.type != "cpu" or weight.dtype not in _PACKED_DTYPES:
        return None
    if _reorder_linear_weight is None or _onednn_linear is None:
        _log_unpacked("this torch build has no oneDNN linear ops")
        return None
    try:
        return _reorder_linear_weight(weight.detach(), _PACK_BATCH_HINT)
    except RuntimeError as e:
        _log_unpacked(str(e).splitlines()[0])
        return None


_logged_unpacked = False


def _log_unpacked(reason: str) -> None:
    global _logged_unpacked
    if not _logged_unpacked:
        _logged_unpacked = True
        _LOG.debug("linear weights stay dense, oneDNN could not pack them: %s", reason)


def check_shape(loaded: torch.Tensor, expected: Sequence[int]) -> None:
    """Raises ValueError naming both shapes when a checkpoint tensor's shape is not ``expected``."""
    if tuple(loaded.shape) != tuple(expected):
        raise ValueError(f"shape {tuple(loaded.shape)} in the checkpoint, the model config implies {tuple(expected)}")


def empty_parameter(*shape: int) -> nn.Parameter:
    """An uninitialised parameter of the default dtype and device; the loader fills it."""
    return nn.Parameter(torch.empty(shape), requires_grad=False)


def load_whole(param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> tuple:
    """The weight loader of a replicated parameter: the whole tensor."""
    check_shape(loaded, param.shape)
    param.copy_(loaded)
    return (None,)


class LinearBase(nn.Module):
    """What every linear layer shares: ``forward`` over ``weight`` and ``bias``, and packing the weight."""

    weight: nn.Parameter
    bias: nn.Parameter | None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)

    def quantize(self, bits: int, group_size: int | None, zero: bool | None = None) -> None:
        """Hold ``weight`` as integer codes (``hold_codes``), before loading."""
        hold_codes(self, bits, group_size, zero)

    def pack_weights(self) -> None:
        """Replace ``weight`` by its ``packed`` form where there is one, freeing the dense one; after loading."""
        if pack_codes(self):
            return
        weight = packed(self.weight)
        if weight is not None:
            self.weight = nn.Parameter(weight, requires_grad=False)


def hold_codes(module: nn.Module, bits: int, group_size: int | None, zero: bool | None = None) -> None:
    """Hold ``module.weight [out, in]`` as integer codes plus ``weight_scale`` (and ``weight_zero``), before loading.

    The three parameters share the weight's loader, so the checkpoint
    tensors ``<name>.weight``, ``<name>.weight_scale`` and
    ``<name>.weight_zero`` (see ``quant.quantize_rtn`` for their layout)
    are sharded like the weight; ``pack_codes`` packs them.

    Args:
        bits: 4 or 8.
        group_size: input columns per scale; None: one group per row of this rank's shard.
        zero: whether the layout has ``weight_zero``; None: for 4 bits only (int4 always has one).

    Raises:
        ValueError: ``group_size`` does not divide this rank's input width.
    """
    out, inp = module.weight.shape
    group_size = group_size or inp
    if inp % group_size:
        raise ValueError(f"quantization group size {group_size} does not divide the input width {inp}")
    loader, shards = module.weight.weight_loader, getattr(module.weight, "shards", None)
    dtype, device = module.weight.dtype, module.weight.device

    def param(cols: int, dtype: torch.dtype) -> nn.Parameter:
        return nn.Parameter(torch.empty(out, cols, dtype=dtype, device=device), requires_grad=False)

    del module.weight
    module.weight = param(inp, torch.uint8 if bits == 4 else torch.int8)
    # Scales and zeros in float32 whatever the model's dtype: in bfloat16 a group's zero (Q4_1's m + 8 d) is
    # off by up to 2^-9 of itself, which can be a tenth of a step, the same for every weight of the group
    # (SmolLM2's Q4_1 in bfloat16 stopped answering "Paris").
    module.weight_scale = param(inp // group_size, torch.float32)
    if bits == 4 or zero:
        module.weight_zero = param(inp // group_size, torch.float32)
    for p in (module.weight, module.weight_scale, getattr(module, "weight_zero", None)):
        if p is not None:
            p.weight_loader = _same_dtype(loader)
            if shards is not None:
                p.shards = set(shards)
    module.quant_bits, module.quant_group, module.quant_dtype = bits, group_size, dtype


def pack_codes(module: nn.Module) -> bool:
    """Replace the codes ``hold_codes`` gave ``module`` by a ``QuantizedWeight``, after loading; False where it
    holds none."""
    if not (isinstance(module.weight, nn.Parameter) and hasattr(module, "weight_scale")):
        return False
    codes, scale, zero = module.weight, module.weight_scale, getattr(module, "weight_zero", None)
    del module.weight, module.weight_scale
    if zero is not None:
        del module.weight_zero
    zero = None if zero is None else zero.data
    module.weight = QuantizedWeight.pack(codes.data, scale.data, zero, module.quant_dtype)
    return True


def _same_dtype(loader):
    """``loader`` refusing a tensor of another dtype than its parameter (codes are never cast from floats)."""

    def load(param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> tuple:
        if param.dtype.is_floating_point != loaded.dtype.is_floating_point or (
            not param.dtype.is_floating_point and loaded.dtype != param.dtype
        ):
            raise ValueError(f"dtype {loaded.dtype} in the checkpoint, the quantized layer holds {param.dtype}")
        return loader(param, loaded, shard_id)

    return load


class ReplicatedLinear(LinearBase):
    """The same ``[out, in]`` weight on every rank (a MoE router)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = empty_parameter(out_features, in_features)
        self.weight.weight_loader = load_whole
        self.bias = None
        if bias:
            self.bias = empty_parameter(out_features)
            self.bias.weight_loader = load_whole


class MergedColumnParallelLinear(LinearBase):
    """Several column-parallel outputs in one matmul, e.g. an MLP's gate and up projections.

    Each rank holds ``size / N`` rows of every part, the parts one after
    another: output ``[T, sum(output_sizes) / N]``.

    Args:
        in_features: the input width.
        output_sizes: each part's full output rows, each divisible by ``tp.size``.
        bias: whether the parts have a bias.
        tp: this rank's group.
    """

    def __init__(self, in_features: int, output_sizes: Sequence[int], bias: bool, tp: TPGroup = SINGLE_RANK):
        super().__init__()
        self.tp, self.output_sizes = tp, list(output_sizes)
        self.local_sizes = [n // tp.size for n in output_sizes]
        self.weight = empty_parameter(sum(self.local_sizes), in_features)
        self.bias = empty_parameter(sum(self.local_sizes)) if bias else None
        for p in (self.weight, self.bias):
            if p is not None:
                p.weight_loader, p.shards = self.weight_loader, set(range(len(output_sizes)))

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | None = None) -> tuple:
        """Part ``shard_id`` (full rows), or every part of a checkpoint that fuses them (``shard_id`` None)."""
        if shard_id is None:
            check_shape(loaded, (sum(self.output_sizes), *param.shape[1:]))
            for i, part in enumerate(loaded.split(self.output_sizes, dim=0)):
                self.weight_loader(param, part, i)
            return tuple(range(len(self.output_sizes)))
        check_shape(loaded, (self.output_sizes[shard_id], *param.shape[1:]))
        n = self.local_sizes[shard_id]
        param.narrow(0, sum(self.local_sizes[:shard_id]), n).copy_(loaded.narrow(0, self.tp.rank * n, n))
        return (shard_id,)


class QKVParallelLinear(LinearBase):
    """The fused query, key and value projection, column-parallel by heads.

    Each rank holds its ``H / N`` query heads and its KV heads: ``KV / N``,
    or one head replicated on ``N / KV`` ranks when there are more ranks than
    KV heads (as vLLM's ``QKVParallelLinear``). Output ``[T, (Hr + 2 KVr) D]``,
    queries then keys then values.

    Args:
        hidden_size: the input width.
        head_dim: D.
        num_heads, num_kv_heads: the full model's H and KV.
        bias: whether q, k and v have a bias.
        tp: this rank's group (its size fits the heads: ``TPShape.build`` checked).
    """

    def __init__(
        self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool, tp: TPGroup = SINGLE_RANK
    ) -> None:
        super().__init__()
        self.tp, self.head_dim = tp, head_dim
        self.num_heads = num_heads // tp.size
        self.num_kv_heads = max(1, num_kv_heads // tp.size)
        replicas = max(1, tp.size // num_kv_heads)
        self.kv_head_start = (tp.rank // replicas) * self.num_kv_heads
        self.full_rows = {"q": num_heads * head_dim, "k": num_kv_heads * head_dim, "v": num_kv_heads * head_dim}
        q, kv = self.num_heads * head_dim, self.num_kv_heads * head_dim
        # Per shard: (rows in this rank's output, first of them, first row in the full tensor).
        self.layout = {
            "q": (q, 0, tp.rank * q),
            "k": (kv, q, self.kv_head_start * head_dim),
            "v": (kv, q + kv, self.kv_head_start * head_dim),
        }
        self.weight = empty_parameter(q + 2 * kv, hidden_size)
        self.bias = empty_parameter(q + 2 * kv) if bias else None
        for p in (self.weight, self.bias):
            if p is not None:
                p.weight_loader, p.shards = self.weight_loader, set(self.full_rows)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | None = None) -> tuple:
        """Shard ``"q"``, ``"k"`` or ``"v"`` (full rows), or all three of a fused ``qkv_proj`` (``shard_id`` None)."""
        if shard_id is None:
            sizes = list(self.full_rows.values())
            check_shape(loaded, (sum(sizes), *param.shape[1:]))
            for sid, part in zip(self.full_rows, loaded.split(sizes, dim=0), strict=True):
                self.weight_loader(param, part, sid)
            return tuple(self.full_rows)
        check_shape(loaded, (self.full_rows[shard_id], *param.shape[1:]))
        n, dst, src = self.layout[shard_id]
        param.narrow(0, dst, n).copy_(loaded.narrow(0, src, n))
        return (shard_id,)


class RowParallelLinear(LinearBase):
    """``x [T, in / N] @ W_r.T`` summed over the ranks, plus the bias once: output ``[T, out]`` on every rank.

    ``weight`` is ``[out, in / N]``, this rank's input columns; ``bias``
    ``[out]`` is the full bias, added after the all-reduce so it counts once.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPGroup = SINGLE_RANK) -> None:
        super().__init__()
        self.tp = tp
        self.in_features = in_features
        self.weight = empty_parameter(out_features, in_features // tp.size)
        self.weight.weight_loader = self.weight_loader
        self.bias = None
        if bias:
            self.bias = empty_parameter(out_features)
            self.bias.weight_loader = load_whole

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return linear(x, self.weight, self.bias)
        y = self.tp.all_reduce(linear(x, self.weight))
        return y if self.bias is None else y + self.bias

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> tuple:
        # A quantized layer's scales have a column per group: the same split.
        n = param.shape[1]
        check_shape(loaded, (param.shape[0], n * self.tp.size))
        param.copy_(loaded.narrow(1, self.tp.rank * n, n))
        return (None,)
