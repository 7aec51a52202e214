"""Llama-family decoder in plain torch over a paged KV cache (one model, one module).

Numerically this follows transformers' ``LlamaForCausalLM`` (RMSNorm, RoPE in
the ``rotate_half`` convention, grouped-query attention, SwiGLU MLP), but the
step's tokens are one flat ``[T]`` batch of many requests and attention goes
through an attention backend (:class:`pipeline.gpu_worker.attention.AttentionBackend`),
so the model does not know how attention is computed.

Q, K and V share one matmul, as do the MLP's gate and up projections: matrix
multiplies dominate a CPU step and fewer, larger GEMMs run faster. On CPU,
float32 matmuls go through oneDNN rather than MKL: on this project's AMD CPU
MKL's sgemm ran 2-3x slower (see :func:`linear`).

The forward pass makes no host synchronisation (no ``.item()``, no
data-dependent Python branching), so it can be enqueued on a CUDA stream as is.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.gpu_worker.attention import default_backend
from pipeline.gpu_worker.attention.backend import AttentionBackend, AttentionMetadata, KVCache

# A private op (used by inductor's CPU backend); absent in builds without oneDNN.
_onednn_linear = getattr(getattr(torch.ops, "mkldnn", None), "_linear_pointwise", None)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [N, in] @ weight.T + bias`` -> ``[N, out]``, same dtype as ``x``.

    float32 on CPU uses oneDNN: aten's float32 matmul is MKL sgemm, which on
    this project's AMD EPYC measured 2-3x slower than oneDNN for every shape
    this model runs (bf16 already goes through oneDNN).
    """
    if _onednn_linear is not None and x.dtype == torch.float32 and x.device.type == "cpu":
        return _onednn_linear(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """``nn.Linear`` computed with :func:`linear`; input ``[N, in]``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dimension, with a learned scale."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., hidden]`` -> same shape and dtype."""
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


def rope_inverse_frequencies(config) -> torch.Tensor:
    """Inverse RoPE frequencies ``[head_dim // 2]`` float32 for a Llama config.

    Supports ``rope_type`` "default" and "llama3", read from
    ``config.rope_parameters`` (transformers >= 5) or ``config.rope_scaling``.

    Raises:
        ValueError: for any other RoPE type, or a partial rotary factor.
    """
    params = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ("default", "llama3"):
        raise ValueError(f"unsupported RoPE type {rope_type!r}: only 'default' and 'llama3' are implemented")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"partial rotary embeddings are not supported, got {params['partial_rotary_factor']}")
    base = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    dim = _head_dim(config)
    # Same float32 arithmetic as transformers, so the tables match bit for bit.
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if rope_type == "default":
        return inv_freq

    factor = params["factor"]
    low_freq_factor = params["low_freq_factor"]
    high_freq_factor = params["high_freq_factor"]
    old_context_len = params["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class LlamaDecoderLayer(nn.Module):
    """One pre-norm transformer block: attention then SwiGLU MLP, each with a residual."""

    def __init__(self, config) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = _head_dim(config)
        self.intermediate_size = config.intermediate_size
        self.scale = self.head_dim**-0.5
        qkv_size = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.qkv_proj = Linear(config.hidden_size, qkv_size, bias=config.attention_bias)
        self.o_proj = Linear(self.num_heads * self.head_dim, config.hidden_size, bias=config.attention_bias)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, bias=config.mlp_bias)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: KVCache,
        attn: AttentionBackend,
    ) -> torch.Tensor:
        """``hidden [T, hidden_size]`` -> ``[T, hidden_size]``; writes this step's K/V into ``kv_cache``."""
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(self.input_layernorm(hidden))
        qkv = qkv.view(num_tokens, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        # Q and K are adjacent in the fused output: rotate them in one go.
        qk = _apply_rope(qkv[:, : self.num_heads + self.num_kv_heads], cos, sin)
        q = qk[:, : self.num_heads]
        k = qk[:, self.num_heads :]
        v = qkv[:, self.num_heads + self.num_kv_heads :]
        out = attn.forward(q, k, v, kv_cache, meta, self.scale)
        hidden = hidden + self.o_proj(out.reshape(num_tokens, -1))

        gate_up = self.gate_up_proj(self.post_attention_layernorm(hidden))
        gate = F.silu(gate_up[:, : self.intermediate_size])
        return hidden + self.down_proj(gate.mul_(gate_up[:, self.intermediate_size :]))


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on ``x [T, heads, D]`` with ``cos``/``sin [T, D]``.

    ``sin`` carries the sign of ``rotate_half`` in its first half, so the
    rotation is a swap of halves: ``rotate_half(x) * sin_hf == swap(x) * sin``.
    """
    half = x.shape[-1] // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + swapped * sin[:, None, :]


class LlamaForCausalLM(nn.Module):
    """Llama decoder for paged, batched serving.

    Args:
        config: a ``transformers.LlamaConfig`` (any object with its fields).
        attn_backend: how attention is computed; default
            :func:`~pipeline.gpu_worker.attention.default_backend`.

    Raises:
        ValueError: for an activation other than SiLU or an unsupported RoPE type.
    """

    def __init__(self, config, attn_backend: AttentionBackend | None = None) -> None:
        super().__init__()
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {config.hidden_act!r}: only 'silu' is implemented")
        self.config = config
        self.num_layers = config.num_hidden_layers
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = _head_dim(config)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = None if self.tie_word_embeddings else Linear(config.hidden_size, config.vocab_size, bias=False)

        self.attn_backend = attn_backend or default_backend()

        inv_freq = rope_inverse_frequencies(config)
        freqs = torch.arange(config.max_position_embeddings, dtype=torch.int64).float()[:, None] * inv_freq
        angles = torch.cat((freqs, freqs), dim=-1)
        sin = angles.sin()
        half = sin.shape[-1] // 2
        sin[:, :half].neg_()
        # Buffers follow .to(dtype): like transformers, RoPE tables are rounded
        # to the model dtype before use.
        self.register_buffer("rope_cos", angles.cos(), persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[KVCache],
    ) -> torch.Tensor:
        """Run one step over the flat token batch.

        Args:
            input_ids: ``[T]`` int64 token ids, laid out as ``meta`` describes.
            positions: ``[T]`` int64, each below ``max_position_embeddings``
                (out-of-range positions are an indexing error).
            meta: the step's metadata from ``self.attn_backend.build_metadata``,
                on the model's device.
            kv_caches: one ``(k_cache, v_cache)`` per layer, as made by
                :meth:`allocate_kv_caches`; written in place.

        Returns:
            ``[T, hidden_size]`` final-normed hidden states, model dtype.
        """
        cos = self.rope_cos.index_select(0, positions)
        sin = self.rope_sin.index_select(0, positions)
        hidden = self.embed_tokens(input_ids)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden = layer(hidden, cos, sin, meta, kv_cache, self.attn_backend)
        return self.norm(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden [S, hidden_size]`` (rows to sample) -> logits ``[S, vocab_size]`` float32."""
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return linear(hidden, weight).float()

    def allocate_kv_caches(
        self, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
    ) -> list[KVCache]:
        """Preallocate the paged KV cache.

        Returns:
            One ``(k_cache, v_cache)`` per layer, each
            ``[num_blocks * block_size, num_kv_heads, head_dim]`` of ``dtype``
            on ``device``, zero-filled (so padded gathers never read NaN).
        """
        shape = (num_blocks * block_size, self.num_kv_heads, self.head_dim)
        return [
            (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(self.num_layers)
        ]

    @torch.no_grad()
    def load_hf_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Copy weights from a transformers ``LlamaForCausalLM`` state dict.

        Names are transformers' (``model.layers.0.self_attn.q_proj.weight``,
        ``lm_head.weight``, ...). Q/K/V and gate/up are concatenated into the
        fused projections. Values are cast to this module's dtype and device.
        With tied embeddings a ``lm_head.weight`` entry is accepted and ignored.

        Raises:
            ValueError: if tensors are missing or unexpected (all names are
                listed), or a tensor's shape does not match.
        """
        remaining = dict(state_dict)
        missing: list[str] = []

        def take(name: str) -> torch.Tensor | None:
            if name not in remaining:
                missing.append(name)
                return None
            return remaining.pop(name)

        def fill(target: torch.Tensor, names: list[str]) -> None:
            parts = [take(n) for n in names]
            if any(p is None for p in parts):
                return
            value = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
            if value.shape != target.shape:
                raise ValueError(f"{' + '.join(names)}: shape {tuple(value.shape)}, expected {tuple(target.shape)}")
            target.copy_(value)

        fill(self.embed_tokens.weight, ["model.embed_tokens.weight"])
        fill(self.norm.weight, ["model.norm.weight"])
        if self.lm_head is None:
            remaining.pop("lm_head.weight", None)
        else:
            fill(self.lm_head.weight, ["lm_head.weight"])
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            attn = [p + f"self_attn.{n}_proj" for n in ("q", "k", "v")]
            mlp = [p + f"mlp.{n}_proj" for n in ("gate", "up")]
            fill(layer.input_layernorm.weight, [p + "input_layernorm.weight"])
            fill(layer.post_attention_layernorm.weight, [p + "post_attention_layernorm.weight"])
            fill(layer.qkv_proj.weight, [n + ".weight" for n in attn])
            fill(layer.o_proj.weight, [p + "self_attn.o_proj.weight"])
            fill(layer.gate_up_proj.weight, [n + ".weight" for n in mlp])
            fill(layer.down_proj.weight, [p + "mlp.down_proj.weight"])
            if layer.qkv_proj.bias is not None:
                fill(layer.qkv_proj.bias, [n + ".bias" for n in attn])
                fill(layer.o_proj.bias, [p + "self_attn.o_proj.bias"])
            if layer.gate_up_proj.bias is not None:
                fill(layer.gate_up_proj.bias, [n + ".bias" for n in mlp])
                fill(layer.down_proj.bias, [p + "mlp.down_proj.bias"])
        # Non-persistent buffers some transformers versions export.
        for name in [n for n in remaining if n.endswith("rotary_emb.inv_freq")]:
            del remaining[name]
        if missing or remaining:
            raise ValueError(
                f"state dict does not match the Llama layout: missing {missing or 'none'}, "
                f"unexpected {sorted(remaining) or 'none'}"
            )
