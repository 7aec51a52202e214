"""The Llama decoder, which also serves Mistral, Qwen2, Qwen3, Qwen3-MoE and Gemma (1) through its switches.

Pre-norm blocks: ``h + attn(norm(h))``, then ``h + mlp(norm(h))``. What the families change is a switch of the shared
layers, set in ``ModelConfig``: q/k/v and o biases (Qwen2), per-head q/k norms (Qwen3), a sliding window (Mistral),
experts instead of the MLP (Qwen3-MoE), Gemma's norm, embedding scale and GeGLU (docs/design.md, "Model families").
"""

from __future__ import annotations

import torch
from torch import nn

from pipeline.common.model_config import ModelConfig
from pipeline.gpu_worker.attention.backend import AttentionImpl, AttentionMetadata, KVCache
from pipeline.gpu_worker.layers.attention import Attention
from pipeline.gpu_worker.layers.mlp import GatedMLP
from pipeline.gpu_worker.layers.moe import SparseMoE
from pipeline.gpu_worker.layers.norm import make_norm
from pipeline.gpu_worker.layers.tp import TPGroup
from pipeline.gpu_worker.models.base import CausalLM


def make_mlp(config: ModelConfig, layer: int, tp: TPGroup) -> nn.Module:
    """Layer ``layer``'s MLP: the experts where ``config.moe_layers`` says so, else the dense gated MLP."""
    if config.moe_layers[layer]:
        return SparseMoE(
            config.hidden_size,
            config.num_experts,
            config.num_experts_per_tok,
            config.moe_intermediate_size,
            config.norm_topk_prob,
            config.hidden_act,
            tp,
        )
    return GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act, config.mlp_bias, tp)


class LlamaDecoderLayer(nn.Module):
    """One pre-norm block: attention then the MLP, each with a residual."""

    def __init__(self, config: ModelConfig, layer: int, max_model_len: int, tp: TPGroup) -> None:
        super().__init__()
        self.input_layernorm = make_norm(config.norm, config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer, max_model_len, tp)
        self.post_attention_layernorm = make_norm(config.norm, config.hidden_size, config.rms_norm_eps)
        self.mlp = make_mlp(config, layer, tp)

    def forward(
        self,
        hidden: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        kv_cache: KVCache,
        attn: AttentionImpl,
    ) -> torch.Tensor:
        """``hidden [T, hidden_size]`` -> ``[T, hidden_size]``; writes this step's K/V into ``kv_cache``."""
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), rope, meta, kv_cache, attn)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class LlamaForCausalLM(CausalLM):
    """Llama 2/3/3.1+, Mistral, Qwen2/2.5, Qwen3, Qwen3-MoE, Gemma (1); see ``CausalLM``."""

    decoder_layer = LlamaDecoderLayer
