"""Mixtral: the Llama decoder with experts on every layer; its checkpoint names the experts its own way."""

from __future__ import annotations

from pipeline.gpu_worker.models.llama import LlamaForCausalLM


class MixtralForCausalLM(LlamaForCausalLM):
    """Mixtral 8x7B / 8x22B: ``block_sparse_moe.experts.{e}.w1`` (gate), ``w3`` (up) and ``w2`` (down)."""

    checkpoint_renames = (
        (r"\.block_sparse_moe\.", ".mlp."),
        (r"(\.experts\.\d+)\.w1\.", r"\1.gate_proj."),
        (r"(\.experts\.\d+)\.w3\.", r"\1.up_proj."),
        (r"(\.experts\.\d+)\.w2\.", r"\1.down_proj."),
    )
