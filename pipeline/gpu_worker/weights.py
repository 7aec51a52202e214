"""Load a Hugging Face Llama checkpoint into :class:`LlamaForCausalLM`."""

from __future__ import annotations

import gc

import torch
import transformers

from pipeline.gpu_worker.attention import make_backend
from pipeline.gpu_worker.model import LlamaForCausalLM


def load_model(
    model_dir: str, dtype: torch.dtype, device: torch.device, attention_backend: str = "auto"
) -> LlamaForCausalLM:
    """Load a Llama-family model from a Hugging Face directory.

    transformers reads the checkpoint (any format it supports) in float32;
    the weights are copied into our module, which is then cast to ``dtype``
    and moved to ``device``. The transformers model is freed before return.

    Args:
        model_dir: directory with ``config.json`` and the weights (a GGUF file
            must have been converted to such a directory beforehand).
        dtype: parameter dtype, e.g. ``torch.float32`` or ``torch.bfloat16``.
        device: where the model runs.
        attention_backend: a name for :func:`pipeline.gpu_worker.attention.make_backend`.

    Returns:
        The model in eval mode with ``requires_grad`` off on every parameter.

    Raises:
        ValueError: if the checkpoint is not a Llama-family model, or its
            config or tensors are not supported (see :class:`LlamaForCausalLM`),
            or the attention backend cannot run here.
        OSError: if transformers cannot read ``model_dir``.
    """
    config = transformers.AutoConfig.from_pretrained(model_dir)
    if config.model_type != "llama":
        raise ValueError(
            f"model type {config.model_type!r} in {model_dir} is not supported: "
            "only Llama-family models (model_type 'llama') are supported"
        )
    # Build ours first so an unsupported config fails before the slow load.
    model = LlamaForCausalLM(config)
    model.attn_backend = make_backend(
        attention_backend,
        device=device,
        dtype=dtype,
        num_heads=config.num_attention_heads,
        num_kv_heads=model.num_kv_heads,
        head_dim=model.head_dim,
    )
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.load_hf_state_dict(hf_model.state_dict())
    del hf_model
    gc.collect()
    model.to(dtype=dtype, device=device)
    model.eval()
    model.requires_grad_(False)
    return model
