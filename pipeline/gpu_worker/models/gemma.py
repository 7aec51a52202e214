"""Gemma 2 and Gemma 3 (text): norms on both sides of attention and of the MLP; the rest are ``ModelConfig`` switches
(docs/design.md, "Model families")."""

from __future__ import annotations

import torch
from torch import nn

from pipeline.common.model_config import ModelConfig
from pipeline.gpu_worker.attention.backend import AttentionImpl, AttentionMetadata, KVCache
from pipeline.gpu_worker.layers.attention import Attention
from pipeline.gpu_worker.layers.norm import make_norm
from pipeline.gpu_worker.layers.tp import TPGroup
from pipeline.gpu_worker.models.base import CausalLM
from pipeline.gpu_worker.models.llama import make_mlp


class GemmaDecoderLayer(nn.Module):
    """``h + post_attn(attn(input(h)))``, then ``h + post_ff(mlp(pre_ff(h)))``."""

    def __init__(self, config: ModelConfig, layer: int, max_model_len: int, tp: TPGroup) -> None:
        super().__init__()

        def norm():
            return make_norm(config.norm, config.hidden_size, config.rms_norm_eps)

        self.input_layernorm, self.post_attention_layernorm = norm(), norm()
        self.pre_feedforward_layernorm, self.post_feedforward_layernorm = norm(), norm()
        self.self_attn = Attention(config, layer, max_model_len, tp)
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
        out = self.self_attn(self.input_layernorm(hidden), rope, meta, kv_cache, attn)
        hidden = hidden + self.post_attention_layernorm(out)
        return hidden + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(hidden)))


class Gemma2ForCausalLM(CausalLM):
    """Gemma 2 and Gemma 3's text-only checkpoints (1B, and the text half of the others); see ``CausalLM``."""

    decoder_layer = GemmaDecoderLayer


class Gemma3ForConditionalGeneration(Gemma2ForCausalLM):
    """Gemma 3's multimodal checkpoints (4B and up), text only: the vision tower and its projector are not loaded."""

    checkpoint_renames = (
        (r"^language_model\.model\.", "model."),  # hub checkpoints
        (r"^model\.language_model\.", "model."),  # transformers 5's own names
        (r"^language_model\.lm_head\.", "lm_head."),
    )
    ignored_checkpoint_names = (
        *Gemma2ForCausalLM.ignored_checkpoint_names,
        r"^(model\.)?(vision_tower|multi_modal_projector)\.",
    )
