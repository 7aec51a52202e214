"""The token embedding and the LM head, vocabulary-parallel: rank ``r`` holds rows ``[r V_r, (r + 1) V_r)``."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.common.constants import cdiv
from pipeline.gpu_worker.layers.linear import check_shape, empty_parameter, hold_codes, linear, pack_codes, packed
from pipeline.gpu_worker.layers.tp import SINGLE_RANK, TPGroup


class VocabParallelEmbedding(nn.Module):
    """``V_r = ceil(V / N)`` rows of a ``[V, hidden]`` table (last rank zero-padded): the embedding (``forward``) and
    the LM head (``logits``)."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TPGroup = SINGLE_RANK) -> None:
        super().__init__()
        self.vocab_size, self.tp = vocab_size, tp
        self.rows = cdiv(vocab_size, tp.size)
        self.start = tp.rank * self.rows
        self.weight = empty_parameter(self.rows, hidden_size)
        self.weight.weight_loader = self.weight_loader
        # The table in oneDNN's layout for ``logits``, beside the dense one (see ``pack_weights``).
        self.register_buffer("packed_weight", None, persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """``ids [T]`` int64 of the full vocabulary -> ``[T, hidden]``, the same on every rank (lookup, then
        all-reduce)."""
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.rows)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(out.masked_fill_(outside[:, None], 0))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden [S, hidden]`` -> ``[S, V]`` float32 logits over the full vocabulary, the same on every rank."""
        out = linear(hidden, self.weight if self.packed_weight is None else self.packed_weight)
        if self.tp.size > 1:
            out = self.tp.all_gather_last_dim(out)[:, : self.vocab_size]
        return out.float()

    def quantize(self, bits: int, group_size: int | None, zero: bool | None = None) -> None:
        """Hold the table as integer codes (``linear.hold_codes``), before loading: an LM head that the checkpoint
        holds quantized, used for ``logits`` only."""
        hold_codes(self, bits, group_size, zero)

    def pack_weights(self, keep_dense: bool) -> None:
        """Pack the table for ``logits`` where ``linear.packed`` can, after loading; a tied table (``keep_dense``) keeps
        its dense copy beside ``packed_weight`` (as vLLM). Codes become a ``QuantizedWeight`` where a kernel takes
        them, else the dense table they dequantize to (rather than dequantizing it on every call)."""
        if pack_codes(self):
            if self.weight.kernel != "dequantize":
                return
            self.weight = nn.Parameter(self.weight.dequantized(self.quant_dtype), requires_grad=False)
        weight = packed(self.weight)
        if weight is None:
            return
        if keep_dense:
            self.packed_weight = weight
        else:
            self.weight = nn.Parameter(weight, requires_grad=False)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> tuple:
        check_shape(loaded, (self.vocab_size, param.shape[1]))
        n = max(0, min(self.rows, self.vocab_size - self.start))
        param[:n].copy_(loaded[self.start : self.start + n])
        param[n:].zero_()
        return (None,)
