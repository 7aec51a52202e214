"""Tensor-parallel Llama: Megatron-style sharded layers, and loading one rank's shard.

The scheme is Megatron-LM's (Shoeybi et al. 2019, section 3; docs/design.md,
"Parallelism"). Each rank holds:

* the fused QKV projection **column-parallel**: its ``H / N`` query heads and
  its KV heads (``KV / N``, or one head replicated on ``N / KV`` ranks when
  there are more ranks than KV heads, as vLLM's ``QKVParallelLinear`` does);
  attention then runs on the rank's heads alone, with a KV cache of only
  those heads;
* ``o_proj`` **row-parallel**: the rank's heads' columns, then an all-reduce
  of the partial outputs (the bias is added once, after the sum);
* the fused gate/up projection column-parallel and ``down_proj``
  row-parallel with its all-reduce, likewise;
* the embedding and the LM head **vocabulary-parallel**: rows
  ``[r * V_r, (r + 1) * V_r)`` of the (zero-padded) vocabulary. An embedding
  lookup zeroes the ids outside the rank's rows and all-reduces; the logits
  of every rank's rows are all-gathered, so every rank samples from the same
  full ``[S, V]`` logits and draws the same token into its own token-id cache.

Two all-reduces per layer plus one all-reduce (embedding) and one all-gather
(logits) per step: the minimum for this split. Collectives are enqueued on
the current stream and never read a value on the host, so a rank never waits
for the host between steps.
"""

from __future__ import annotations

import copy
import gc
import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
import transformers
from torch import nn

from pipeline.common.tp_shape import TPShape
from pipeline.gpu_worker.attention import make_backend
from pipeline.gpu_worker.model import Linear, LlamaForCausalLM, linear


@dataclass(frozen=True)
class TPGroup:
    """This rank's place in its tensor-parallel group.

    Attributes:
        rank: 0 .. size - 1 within the group.
        size: ranks in the group (N).
        group: the torch.distributed process group; None only where no
            collective runs (building and loading a shard, in tests).
    """

    rank: int
    size: int
    group: dist.ProcessGroup | None = None

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` over the group, in place; returns ``t``."""
        dist.all_reduce(t, group=self.group)
        return t

    def all_gather_last_dim(self, t: torch.Tensor) -> torch.Tensor:
        """``[..., d]`` on each rank -> ``[..., N * d]``, rank 0's columns first."""
        parts = [torch.empty_like(t) for _ in range(self.size)]
        dist.all_gather(parts, t.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)


class RowParallelLinear(Linear):
    """Row-parallel linear: ``x [T, in / N] @ W_r.T`` summed over ranks, plus the bias once.

    ``weight`` is ``[out, in / N]``, this rank's input columns; ``bias``
    ``[out]`` is the full bias, added after the all-reduce so it counts once.
    Output ``[T, out]``, identical on every rank.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPGroup):
        super().__init__(in_features, out_features, bias=bias)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.tp.all_reduce(linear(x, self.weight))
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Embedding):
    """Embedding rows ``[vocab_start, vocab_start + num_embeddings)`` of the vocabulary.

    Input ``[T]`` int64 ids of the full vocabulary; output ``[T, hidden]``,
    the same on every rank: each rank looks up the ids it holds, zeroes the
    others, and the ranks' rows are summed by an all-reduce.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, vocab_start: int, tp: TPGroup):
        super().__init__(num_embeddings, embedding_dim)
        self.vocab_start, self.tp = vocab_start, tp

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.num_embeddings)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(out.masked_fill_(outside[:, None], 0))


class ParallelLlamaForCausalLM(LlamaForCausalLM):
    """One rank's shard of :class:`LlamaForCausalLM` (see the module docstring).

    ``config`` stays the full model's (the executor reads the vocabulary and
    positions from it); the layers are built at the rank's sizes from
    :class:`~pipeline.common.tp_shape.TPShape`. Forward takes and returns the
    same shapes as the unsharded model; :meth:`compute_logits` returns the
    full ``[S, vocab_size]`` float32 logits on every rank.

    Args:
        config: the full model's ``transformers.LlamaConfig``.
        tp: this rank's group.

    Raises:
        ValueError: ``tp.size`` does not fit the model's heads, KV heads or
            intermediate size (:meth:`TPShape.build`), or as :class:`LlamaForCausalLM`.
    """

    def __init__(self, config, tp: TPGroup, attn_backend=None) -> None:
        shape = TPShape.build(
            tp.size, config.num_attention_heads, config.num_key_value_heads, config.intermediate_size, config.vocab_size
        )
        local = copy.deepcopy(config)
        # A config without head_dim derives it from the head count: pin the full model's.
        local.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        local.num_attention_heads, local.num_key_value_heads = shape.num_heads, shape.num_kv_heads
        local.intermediate_size, local.vocab_size = shape.intermediate_size, shape.vocab_per_rank
        super().__init__(local, attn_backend)
        self.config, self.tp, self.shape = config, tp, shape
        hidden = config.hidden_size
        self.embed_tokens = VocabParallelEmbedding(shape.vocab_per_rank, hidden, tp.rank * shape.vocab_per_rank, tp)
        for layer in self.layers:
            layer.o_proj = RowParallelLinear(shape.num_heads * self.head_dim, hidden, config.attention_bias, tp)
            layer.down_proj = RowParallelLinear(shape.intermediate_size, hidden, config.mlp_bias, tp)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden [S, hidden_size]`` -> full logits ``[S, vocab_size]`` float32, the same on every rank."""
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        gathered = self.tp.all_gather_last_dim(linear(hidden, weight))
        return gathered[:, : self.shape.vocab_size].float()


def shard_of(name: str, shape: TPShape, rank: int, head_dim: int) -> tuple[int, int, int] | None:
    """Which part of the checkpoint tensor ``name`` rank ``rank`` holds.

    Args:
        name: a transformers Llama tensor name (``model.layers.0.self_attn.q_proj.weight``).
        shape: the split.
        rank: the rank.
        head_dim: the model's head dimension.

    Returns:
        ``(dim, start, stop)``: the rank holds indices ``[start, stop)`` of
        dimension ``dim`` (``stop`` may pass the tensor's end only for the
        vocabulary, whose missing rows are zero padding); None: the whole
        tensor (norms, and the biases of row-parallel layers).
    """
    r = rank
    if name.endswith(("embed_tokens.weight", "lm_head.weight")):
        return 0, r * shape.vocab_per_rank, (r + 1) * shape.vocab_per_rank
    if ".self_attn.q_proj." in name:
        n = shape.num_heads * head_dim
        return 0, r * n, (r + 1) * n
    if ".self_attn.k_proj." in name or ".self_attn.v_proj." in name:
        start = shape.kv_head_start(r) * head_dim
        return 0, start, start + shape.num_kv_heads * head_dim
    if ".mlp.gate_proj." in name or ".mlp.up_proj." in name:
        n = shape.intermediate_size
        return 0, r * n, (r + 1) * n
    if name.endswith(".self_attn.o_proj.weight"):
        n = shape.num_heads * head_dim
        return 1, r * n, (r + 1) * n
    if name.endswith(".mlp.down_proj.weight"):
        n = shape.intermediate_size
        return 1, r * n, (r + 1) * n
    return None


def _safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        return sorted({model_dir / f for f in json.loads(index.read_text())["weight_map"].values()})
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    raise ValueError(
        f"{model_dir} has no safetensors checkpoint; tensor parallelism reads each rank's shard "
        "straight from safetensors files (save the model with save_pretrained to get one)"
    )


def read_shard(model_dir: str | Path, shape: TPShape, rank: int, head_dim: int) -> dict[str, torch.Tensor]:
    """Read only rank ``rank``'s slices of a safetensors Llama checkpoint.

    Returns:
        The rank's tensors under their transformers names, at the rank's
        shapes, in the checkpoint's dtype; vocabulary rows past the model's
        vocabulary are zeros.

    Raises:
        ValueError: the directory holds no safetensors checkpoint.
    """
    from safetensors import safe_open

    out: dict[str, torch.Tensor] = {}
    for path in _safetensors_files(Path(model_dir)):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                sl = f.get_slice(name)
                full = tuple(sl.get_shape())
                part = shard_of(name, shape, rank, head_dim)
                if part is None:
                    out[name] = f.get_tensor(name)
                    continue
                dim, start, stop = part
                end = min(stop, full[dim])
                t = sl[start:end] if dim == 0 else sl[:, start:end]
                if end < stop:  # the last rank's share of a padded vocabulary
                    pad = list(t.shape)
                    pad[dim] = stop - end
                    t = torch.cat([t, t.new_zeros(pad)], dim=dim)
                out[name] = t
    return out


def load_parallel_model(
    model_dir: str, dtype: torch.dtype, device: torch.device, tp: TPGroup, attention_backend: str = "auto"
) -> ParallelLlamaForCausalLM:
    """Build rank ``tp.rank``'s shard and load its weights; no rank reads the whole model.

    Args:
        model_dir: Hugging Face directory with a safetensors checkpoint.
        dtype: parameter dtype.
        device: this rank's device.
        tp: this rank's group.
        attention_backend: a name for :func:`pipeline.gpu_worker.attention.make_backend`, built for
            this rank's heads.

    Returns:
        The shard in eval mode, ``requires_grad`` off.

    Raises:
        ValueError: not a Llama model, a size that does not fit it, or no
            safetensors checkpoint.
    """
    config = transformers.AutoConfig.from_pretrained(model_dir)
    if config.model_type != "llama":
        raise ValueError(
            f"model type {config.model_type!r} in {model_dir} is not supported: "
            "only Llama-family models (model_type 'llama') are supported"
        )
    model = ParallelLlamaForCausalLM(config, tp)
    model.attn_backend = make_backend(
        attention_backend,
        device=device,
        dtype=dtype,
        num_heads=model.shape.num_heads,
        num_kv_heads=model.shape.num_kv_heads,
        head_dim=model.head_dim,
    )
    model.load_hf_state_dict(read_shard(model_dir, model.shape, tp.rank, model.head_dim))
    gc.collect()
    model.to(dtype=dtype, device=device)
    model.eval()
    model.requires_grad_(False)
    return model
