"""The model families, by the architecture a checkpoint's config names (``architectures[0]``).

A family's module is imported when a model of it is loaded, so importing
this package (the launcher checks the architecture) needs no torch.
"""

from __future__ import annotations

import importlib

# architectures[0] -> (module in this package, class).
_MODELS = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("llama", "LlamaForCausalLM"),
    "Qwen3ForCausalLM": ("llama", "LlamaForCausalLM"),
    "Qwen3MoeForCausalLM": ("llama", "LlamaForCausalLM"),
    "GemmaForCausalLM": ("llama", "LlamaForCausalLM"),
    "Gemma2ForCausalLM": ("gemma", "Gemma2ForCausalLM"),
    "Gemma3ForCausalLM": ("gemma", "Gemma2ForCausalLM"),
    "Gemma3ForConditionalGeneration": ("gemma", "Gemma3ForConditionalGeneration"),
    "MixtralForCausalLM": ("mixtral", "MixtralForCausalLM"),
    "Phi3ForCausalLM": ("phi3", "Phi3ForCausalLM"),
}


def supported_architectures() -> list[str]:
    """The architectures this server runs, sorted."""
    return sorted(_MODELS)


def check_architecture(architecture: str) -> None:
    """Raises ValueError naming ``architecture`` and the supported ones unless it is supported."""
    if architecture not in _MODELS:
        raise ValueError(
            f"architecture {architecture or '(none)'!r} is not supported; supported architectures: "
            + ", ".join(supported_architectures())
        )


def model_class(architecture: str) -> type:
    """The family class serving ``architecture`` (its module imported now).

    Raises:
        ValueError: as ``check_architecture``.
    """
    check_architecture(architecture)
    module, name = _MODELS[architecture]
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
