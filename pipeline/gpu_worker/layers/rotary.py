"""Rotary position embeddings: each RoPE type's inverse frequencies (transformers' ``modeling_rope_utils``, bit for bit)
and cos/sin tables. Length-dependent types are fixed once per server (docs/design.md, "Model families")."""

from __future__ import annotations

import math

import torch
from torch import nn

from pipeline.common.model_config import RopeConfig


def inverse_frequencies(
    rope: RopeConfig, max_position_embeddings: int, max_model_len: int
) -> tuple[torch.Tensor, float]:
    """``(inv_freq [rotary_dim // 2] float32, attention_factor)``; cos and sin are multiplied by the factor."""
    dim, base, p = rope.rotary_dim, rope.theta, rope.scaling
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    inv_freq = 1.0 / (base**exponents)
    kind = rope.rope_type
    if kind == "linear":
        return inv_freq / p["factor"], 1.0
    if kind == "llama3":
        return _llama3(inv_freq, p), 1.0
    if kind == "yarn":
        return _yarn(base, dim, p, max_position_embeddings)
    if kind == "longrope":
        original = p["original_max_position_embeddings"]
        factor = p.get("factor") or max_position_embeddings / original
        attention_factor = p.get("attention_factor")
        if attention_factor is None:
            attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        ext = torch.tensor(p["long_factor" if max_model_len > original else "short_factor"], dtype=torch.float32)
        return 1.0 / (ext * base**exponents), attention_factor
    return inv_freq, 1.0  # default, and dynamic within max_position_embeddings


def _llama3(inv_freq: torch.Tensor, p: dict) -> torch.Tensor:
    """Llama 3.1's wavelength-banded scaling (transformers' ``_compute_llama3_parameters``)."""
    factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old_context_len = p["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_context_len / low, old_context_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn(base: float, dim: int, p: dict, max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    """YaRN (Peng et al. 2023; transformers' ``_compute_yarn_parameters``)."""
    original = p["original_max_position_embeddings"]
    factor = p.get("factor") or max_position_embeddings / original

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        if p.get("mscale") and p.get("mscale_all_dim"):
            attention_factor = mscale(factor, p["mscale"]) / mscale(factor, p["mscale_all_dim"])
        else:
            attention_factor = mscale(factor)
    beta_fast, beta_slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no singularity
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


class RotaryEmbedding(nn.Module):
    """cos and sin tables ``[max_position_embeddings, rotary_dim]`` in the model dtype; ``sin`` carries
    ``rotate_half``'s sign, so the rotation is a swap of halves."""

    def __init__(self, rope: RopeConfig, max_position_embeddings: int, max_model_len: int) -> None:
        super().__init__()
        inv_freq, attention_factor = inverse_frequencies(rope, max_position_embeddings, max_model_len)
        freqs = torch.arange(max_position_embeddings, dtype=torch.int64).float()[:, None] * inv_freq
        angles = torch.cat((freqs, freqs), dim=-1)
        cos, sin = angles.cos() * attention_factor, angles.sin() * attention_factor
        sin[:, : sin.shape[-1] // 2].neg_()
        dtype = torch.get_default_dtype()
        self.register_buffer("cos", cos.to(dtype), persistent=False)
        self.register_buffer("sin", sin.to(dtype), persistent=False)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``positions [T]`` int64 -> ``(cos, sin)``, each ``[T, rotary_dim]``."""
        return self.cos.index_select(0, positions), self.sin.index_select(0, positions)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on the first ``rotary_dim`` dimensions of ``x [T, heads, D]`` (transformers' half-split convention)."""
    rot = cos.shape[-1]
    if rot == x.shape[-1]:
        half = rot // 2
        swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
        return x * cos[:, None, :] + swapped * sin[:, None, :]
    return torch.cat((apply_rotary(x[..., :rot], cos, sin), x[..., rot:]), dim=-1)
