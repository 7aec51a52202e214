"""Phi-3 / Phi-4: the Llama decoder; the checkpoint already fuses ``qkv_proj`` and ``gate_up_proj``."""

from __future__ import annotations

from pipeline.gpu_worker.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    """Phi-3 and Phi-4 (``partial_rotary_factor``, ``longrope``: switches of the shared layers).

    The fused tensors load whole (shard id None): each rank's fused projection takes its part of every q/k/v (gate/up)
    section.
    """

    packed_modules_mapping = {}
