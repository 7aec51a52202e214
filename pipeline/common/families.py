"""The model families: one row per architecture (``architectures[0]``), with no torch (docs/design.md, "Model
families")."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any


@dataclasses.dataclass(frozen=True)
class Family:
    """``module``/``cls``: the serving class; ``implied``: ``ModelConfig`` switches always on; ``defaults``:
    transformers' defaults hub configs omit; ``opt_in_window``: sliding window only with ``use_sliding_window``."""

    module: str
    cls: str
    implied: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    defaults: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    opt_in_window: bool = False


_LLAMA = ("llama", "LlamaForCausalLM")
_GEMMA_NORM = {"norm": "gemma", "embed_scale": True}
_GEMMA2_DEFAULTS = {
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "tie_word_embeddings": True,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "final_logit_softcapping": 30.0,
    "attn_logit_softcapping": 50.0,
}
# Gemma 3's multimodal checkpoints list few text fields.
_GEMMA3_DEFAULTS = {
    "vocab_size": 262_208,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131_072,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
}
_GEMMA3_IMPLIED = {**_GEMMA_NORM, "qk_norm": True}

FAMILIES: Mapping[str, Family] = MappingProxyType(
    {
        "LlamaForCausalLM": Family(*_LLAMA),
        "MistralForCausalLM": Family(*_LLAMA),
        "Qwen2ForCausalLM": Family(*_LLAMA, implied={"qkv_bias": True, "o_bias": False}, opt_in_window=True),
        "Qwen3ForCausalLM": Family(*_LLAMA, implied={"qk_norm": True}, opt_in_window=True),
        "Qwen3MoeForCausalLM": Family(*_LLAMA, implied={"qk_norm": True}, opt_in_window=True),
        "GemmaForCausalLM": Family(
            *_LLAMA, implied=_GEMMA_NORM, defaults={"head_dim": 256, "tie_word_embeddings": True}
        ),
        "Gemma2ForCausalLM": Family("gemma", "Gemma2ForCausalLM", implied=_GEMMA_NORM, defaults=_GEMMA2_DEFAULTS),
        "Gemma3ForCausalLM": Family("gemma", "Gemma2ForCausalLM", implied=_GEMMA3_IMPLIED, defaults=_GEMMA3_DEFAULTS),
        "Gemma3ForConditionalGeneration": Family(
            "gemma", "Gemma3ForConditionalGeneration", implied=_GEMMA3_IMPLIED, defaults=_GEMMA3_DEFAULTS
        ),
        "MixtralForCausalLM": Family("mixtral", "MixtralForCausalLM", implied={"norm_topk_prob": True}),
        "Phi3ForCausalLM": Family("phi3", "Phi3ForCausalLM"),
    }
)


def supported_architectures() -> list[str]:
    """The architectures this server runs, sorted."""
    return sorted(FAMILIES)


def family(architecture: str) -> Family:
    """``architecture``'s row.

    Raises:
        ValueError: an unsupported ``architecture`` (the message lists the supported ones).
    """
    if architecture not in FAMILIES:
        raise ValueError(
            f"architecture {architecture or '(none)'!r} is not supported; supported architectures: "
            + ", ".join(supported_architectures())
        )
    return FAMILIES[architecture]
