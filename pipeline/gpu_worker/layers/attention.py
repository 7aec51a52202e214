"""Self-attention over the paged KV cache, with the switches the families differ by."""

from __future__ import annotations

import torch
from torch import nn

from pipeline.common.model_config import ModelConfig
from pipeline.gpu_worker.attention.backend import AttentionImpl, AttentionMetadata, KVCache
from pipeline.gpu_worker.layers.linear import QKVParallelLinear, RowParallelLinear
from pipeline.gpu_worker.layers.norm import make_norm
from pipeline.gpu_worker.layers.rotary import apply_rotary
from pipeline.gpu_worker.layers.tp import SINGLE_RANK, TPGroup


class Attention(nn.Module):
    """Fused QKV, optional per-head q/k norm, RoPE, paged attention, output projection.

    Switches, from ``config``: ``qkv_bias`` and ``o_bias``; ``qk_norm`` (an RMSNorm of kind ``config.norm`` over each
    head of q and k, before RoPE); ``attn_scale``; the layer's sliding window (``config.window(layer, max_model_len)``)
    and ``attn_logit_softcapping``. Under tensor parallelism the rank attends its own heads only.
    """

    def __init__(self, config: ModelConfig, layer: int, max_model_len: int, tp: TPGroup = SINGLE_RANK) -> None:
        super().__init__()
        d = config.head_dim
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, d, config.num_attention_heads, config.num_key_value_heads, config.qkv_bias, tp
        )
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(config.num_attention_heads * d, config.hidden_size, config.o_bias, tp)
        self.q_norm = self.k_norm = None
        if config.qk_norm:
            self.q_norm = make_norm(config.norm, d, config.rms_norm_eps)
            self.k_norm = make_norm(config.norm, d, config.rms_norm_eps)
        self.head_dim, self.scale = d, config.attn_scale
        self.window = config.window(layer, max_model_len)
        self.softcap = config.attn_logit_softcapping

    def forward(
        self,
        hidden: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        kv_cache: KVCache,
        attn: AttentionImpl,
    ) -> torch.Tensor:
        """``hidden [T, hidden_size]`` (normed) -> ``[T, hidden_size]``; writes this step's K/V into ``kv_cache``."""
        num_tokens = hidden.shape[0]
        h, kv = self.num_heads, self.num_kv_heads
        qkv = self.qkv_proj(hidden).view(num_tokens, h + 2 * kv, self.head_dim)
        cos, sin = rope
        if self.q_norm is None:
            # Q and K are adjacent in the fused output: rotate them in one go.
            qk = apply_rotary(qkv[:, : h + kv], cos, sin)
            q, k = qk[:, :h], qk[:, h:]
        else:
            q = apply_rotary(self.q_norm(qkv[:, :h]), cos, sin)
            k = apply_rotary(self.k_norm(qkv[:, h : h + kv]), cos, sin)
        out = attn.forward(q, k, qkv[:, h + kv :], kv_cache, meta, self.scale, self.window, self.softcap)
        return self.o_proj(out.reshape(num_tokens, -1))
