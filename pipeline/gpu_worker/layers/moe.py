"""A sparse mixture-of-experts MLP: softmax router, top-k, experts stacked per layer, as transformers' Qwen3-MoE and
Mixtral (docs/design.md, "Model families"). Pairs are sorted by expert; tensor parallelism splits the intermediate
dimension."""

from __future__ import annotations

import torch
from torch import nn

from pipeline.gpu_worker.layers.linear import ReplicatedLinear, check_shape, empty_parameter, linear
from pipeline.gpu_worker.layers.mlp import ACTIVATION_FNS
from pipeline.gpu_worker.layers.tp import SINGLE_RANK, TPGroup


class FusedExperts(nn.Module):
    """``E`` gated MLPs as two stacked parameters, named as transformers 5 stores them: ``gate_up_proj`` ``[E, 2 I_r,
    H]`` and ``down_proj`` ``[E, H, I_r]``, ``I_r = I / N``."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, act: str, tp: TPGroup) -> None:
        super().__init__()
        self.tp, self.num_experts, self.hidden_size = tp, num_experts, hidden_size
        self.full, self.local = intermediate_size, intermediate_size // tp.size
        self.act = ACTIVATION_FNS[act]
        self.gate_up_proj = empty_parameter(num_experts, 2 * self.local, hidden_size)
        self.gate_up_proj.weight_loader = self.load_gate_up
        self.gate_up_proj.shards = {(e, j) for e in range(num_experts) for j in (0, 1)}
        self.down_proj = empty_parameter(num_experts, hidden_size, self.local)
        self.down_proj.weight_loader = self.load_down
        self.down_proj.shards = {(e,) for e in range(num_experts)}

    def load_gate_up(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: tuple | None = None) -> tuple:
        n, start = self.local, self.tp.rank * self.local
        if shard_id is None:
            check_shape(loaded, (self.num_experts, 2 * self.full, self.hidden_size))
            for j in (0, 1):
                param[:, j * n : (j + 1) * n].copy_(loaded[:, j * self.full + start : j * self.full + start + n])
            return tuple(param.shards)
        e, j = shard_id
        check_shape(loaded, (self.full, self.hidden_size))
        param[e, j * n : (j + 1) * n].copy_(loaded[start : start + n])
        return (shard_id,)

    def load_down(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: tuple | None = None) -> tuple:
        n, start = self.local, self.tp.rank * self.local
        if shard_id is None:
            check_shape(loaded, (self.num_experts, self.hidden_size, self.full))
            param.copy_(loaded[:, :, start : start + n])
            return tuple(param.shards)
        check_shape(loaded, (self.hidden_size, self.full))
        param[shard_id[0]].copy_(loaded[:, start : start + n])
        return (shard_id,)

    def forward(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor, grouped: bool | None = None):
        """``x [T, H]``, each token's ``expert_ids`` and ``weights`` ``[T, k]`` -> ``[T, H]`` (this rank's part).

        ``grouped``: one ``torch._grouped_mm`` per projection, no host sync (default off the CPU); else a loop over
        experts with tokens (the CPU default).
        """
        if grouped is None:
            grouped = x.device.type != "cpu"
        k = expert_ids.shape[1]
        flat = expert_ids.flatten()
        order = flat.argsort(stable=True)
        token = order // k
        xs = x.index_select(0, token)
        counts = torch.bincount(flat, minlength=self.num_experts)
        n = self.local
        if grouped:
            offs = counts.cumsum(0).to(torch.int32)
            h = torch._grouped_mm(xs, self.gate_up_proj.transpose(1, 2), offs=offs)
            out = torch._grouped_mm(self.act(h[:, :n]) * h[:, n:], self.down_proj.transpose(1, 2), offs=offs)
        else:
            out = torch.empty_like(xs)
            start = 0
            for e, count in enumerate(counts.tolist()):
                if count:
                    rows = slice(start, start + count)
                    h = linear(xs[rows], self.gate_up_proj[e])
                    out[rows] = linear(self.act(h[:, :n]).mul_(h[:, n:]), self.down_proj[e])
                    start += count
        out.mul_(weights.flatten().index_select(0, order)[:, None])
        return torch.zeros_like(x).index_add_(0, token, out)


class SparseMoE(nn.Module):
    """Router ``gate`` (``[E, H]``, replicated) and the ``experts``; ``[T, H]`` -> ``[T, H]``."""

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        intermediate_size: int,
        norm_topk_prob: bool,
        act: str,
        tp: TPGroup = SINGLE_RANK,
    ) -> None:
        super().__init__()
        self.top_k, self.norm_topk_prob, self.tp = top_k, norm_topk_prob, tp
        self.gate = ReplicatedLinear(hidden_size, num_experts)
        self.experts = FusedExperts(num_experts, hidden_size, intermediate_size, act, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(self.gate(x), dim=-1, dtype=torch.float32)
        weights, expert_ids = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        out = self.experts(x, expert_ids, weights.to(x.dtype))
        return self.tp.all_reduce(out) if self.tp.size > 1 else out
