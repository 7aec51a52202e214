"""RoPE tables of every type against transformers' rotary embeddings, and the two config formats."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

from pipeline.common.model_config import FULL, SLIDING, ModelConfig
from pipeline.gpu_worker.layers.rotary import RotaryEmbedding

MAX_POS = 256
FIELDS = dict(
    architectures=["LlamaForCausalLM"],
    vocab_size=64,
    hidden_size=64,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=2,
    max_position_embeddings=MAX_POS,
)
CASES = {
    "default": dict(rope_type="default", rope_theta=10000.0),
    "linear": dict(rope_type="linear", rope_theta=10000.0, factor=4.0),
    "dynamic": dict(rope_type="dynamic", rope_theta=10000.0, factor=2.0),
    "yarn": dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64),
    "yarn-untruncated-mscale": dict(
        rope_type="yarn",
        rope_theta=150000.0,
        factor=8.0,
        original_max_position_embeddings=32,
        mscale=0.707,
        mscale_all_dim=0.707,
        beta_fast=16,
        truncate=False,
    ),
    "llama3": dict(
        rope_type="llama3",
        rope_theta=500000.0,
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=64,
    ),
    "longrope": dict(
        rope_type="longrope",
        rope_theta=10000.0,
        short_factor=[1.0 + i / 16 for i in range(16)],
        long_factor=[1.0 + i / 4 for i in range(16)],
        original_max_position_embeddings=64,
    ),
}
PARTIAL = dict(rope_type="longrope", rope_theta=10000.0, partial_rotary_factor=0.5, original_max_position_embeddings=64)
PARTIAL.update(short_factor=[1.0 + i / 16 for i in range(8)], long_factor=[1.0 + i / 4 for i in range(8)])


def hf_tables(config, seq_len: int, cls=LlamaRotaryEmbedding) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' cos and sin for positions 0 .. seq_len - 1 of one forward pass."""
    positions = torch.arange(seq_len)[None]
    cos, sin = cls(config)(torch.zeros(1, dtype=torch.float32), positions)
    return cos[0], sin[0]


def ours(config, max_model_len: int = MAX_POS) -> RotaryEmbedding:
    return RotaryEmbedding(ModelConfig.from_hf(config).rope, MAX_POS, max_model_len)


def assert_same(rope: RotaryEmbedding, cos: torch.Tensor, sin: torch.Tensor) -> None:
    n, half = cos.shape[0], cos.shape[1] // 2
    torch.testing.assert_close(rope.cos[:n], cos, atol=0, rtol=0)
    # Our sin carries rotate_half's sign in its first half.
    torch.testing.assert_close(torch.cat((-rope.sin[:n, :half], rope.sin[:n, half:]), -1), sin, atol=0, rtol=0)


@pytest.mark.parametrize("case", CASES)
def test_tables_match_transformers(case):
    config = transformers.LlamaConfig(**FIELDS, rope_parameters=dict(CASES[case]))
    # A forward pass within the pre-training length (longrope's short factors, dynamic unscaled).
    assert_same(ours(config, max_model_len=64), *hf_tables(config, 64))


def test_longrope_long_factors_when_the_server_runs_past_the_pretraining_length():
    config = transformers.LlamaConfig(**FIELDS, rope_parameters=dict(CASES["longrope"]))
    # transformers switches to the long factors for a pass longer than 64 positions; we do for max_model_len > 64.
    assert_same(ours(config, max_model_len=128), *hf_tables(config, 100))
    assert not torch.equal(ours(config, max_model_len=64).cos[:100], ours(config, max_model_len=128).cos[:100])


def test_partial_rotary_factor_rotates_the_first_dimensions_only():
    config = transformers.Phi3Config(**{**FIELDS, "architectures": ["Phi3ForCausalLM"]}, rope_parameters=dict(PARTIAL))
    rope = ours(config, max_model_len=64)
    assert rope.cos.shape == (MAX_POS, 16)
    assert_same(rope, *hf_tables(config, 64, Phi3RotaryEmbedding))


@pytest.mark.parametrize("case", ["linear", "yarn", "llama3", "longrope"])
def test_older_configs_rope_theta_and_rope_scaling_read_the_same(case):
    """A hub config.json of before transformers 5 (rope_theta + rope_scaling with "type") normalises the same."""
    params = dict(CASES[case])
    v4 = {**FIELDS, "rope_theta": params.pop("rope_theta"), "model_type": "llama"}
    params["type"] = params.pop("rope_type")
    v4["rope_scaling"] = params
    new = transformers.LlamaConfig(**FIELDS, rope_parameters=dict(CASES[case]))
    assert ModelConfig.from_hf(v4).rope == ModelConfig.from_hf(new).rope
    assert ModelConfig.from_hf(v4).rope == ModelConfig.from_hf(new.to_dict()).rope


def test_gemma3_local_and_global_bases_in_both_formats():
    text = dict(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=6,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        sliding_window=16,
    )
    v5 = transformers.Gemma3TextConfig(
        **text,
        rope_parameters={
            FULL: dict(rope_type="linear", factor=8.0, rope_theta=1e6),
            SLIDING: dict(rope_type="default", rope_theta=1e4),
        },
    )
    v5.architectures = ["Gemma3ForCausalLM"]
    old = {
        **text,
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "rope_theta": 1e6,
        "rope_local_base_freq": 1e4,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0},
    }
    for cfg in (ModelConfig.from_hf(v5), ModelConfig.from_hf(old), ModelConfig.from_hf(v5.to_dict())):
        assert (cfg.rope.rope_type, cfg.rope.theta, cfg.rope.scaling["factor"]) == ("linear", 1e6, 8.0)
        assert (cfg.rope_sliding.rope_type, cfg.rope_sliding.theta) == ("default", 1e4)
        assert cfg.layer_types == (SLIDING,) * 5 + (FULL,)
