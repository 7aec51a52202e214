"""Which GGUF tensors fill which model parameters, and which of their types are served without dequantizing.

Read by the launcher (without torch) and by the worker's GGUF loader.
llama.cpp names a llama-family tensor ``blk.N.attn_q.weight`` where
transformers names it ``model.layers.N.self_attn.q_proj.weight``; the table
below is gguf-py's ``TensorNameMap`` for the tensors a llama checkpoint has.
"""

from __future__ import annotations

import re

# The model types (config.json's, GGUF's general.architecture) whose GGUF tensors are read as they are.
MODEL_TYPES = ("llama",)
# The linear weights' GGUF types kept quantized: (bits, group size, whether it has a zero) of the layout
# they repack into (gguf_loader says how).
KEPT = {
    "Q4_0": (4, 32, True),
    "Q4_1": (4, 32, True),
    "Q8_0": (8, 32, False),
    "Q4_K": (4, 32, True),
    "Q5_K": (8, 32, True),
    "Q6_K": (8, 16, False),
}
FLOAT = ("F32", "F16", "BF16")

_GLOBAL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LINEAR = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
_BLOCK_NAME = re.compile(r"^blk\.(\d+)\.(\w+)\.weight$")


def hf_name(name: str) -> str | None:
    """The transformers name of GGUF tensor ``name``, or None for one with no parameter (``rope_freqs``)."""
    if name in _GLOBAL:
        return _GLOBAL[name]
    m = _BLOCK_NAME.match(name)
    if m and m[2] in _BLOCK:
        return f"model.layers.{m[1]}.{_BLOCK[m[2]]}.weight"
    return None


def is_linear(name: str) -> bool:
    """Whether GGUF tensor ``name`` is a decoder layer's linear weight (those kept quantized)."""
    m = _BLOCK_NAME.match(name)
    return bool(m and m[2] in _LINEAR)
