"""ModelConfig: every switch the shared layers take, read once from a checkpoint's config without torch (docs/design.md,
"Model families"); takes transformers 5's and the older config forms."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from pipeline.common import checkpoint_quant
from pipeline.common.checkpoint_quant import CheckpointQuantization
from pipeline.common.families import family
from pipeline.common.tp_shape import TPShape

FULL = "full_attention"
SLIDING = "sliding_attention"
ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3", "longrope")
ACTIVATIONS = ("silu", "gelu_pytorch_tanh", "gelu_new", "gelu")

# The largest value each size may take: far past any released model (vocabularies reach 262,144, hidden
# sizes 16,384), and small enough that nothing sized from a corrupt config.json tries to allocate terabytes.
SIZE_LIMITS = {
    "vocab_size": 1 << 22,
    "hidden_size": 1 << 16,
    "intermediate_size": 1 << 20,
    "moe_intermediate_size": 1 << 20,
    "num_hidden_layers": 1 << 10,
    "num_attention_heads": 1 << 10,
    "num_key_value_heads": 1 << 10,
    "head_dim": 1 << 12,
    "max_position_embeddings": 1 << 26,
    "sliding_window": 1 << 26,
    "num_experts": 1 << 12,
    "num_local_experts": 1 << 12,
    "num_experts_per_tok": 1 << 12,
}


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """One rotary embedding: ``rope_type`` (one of ROPE_TYPES), base ``theta``, the first ``rotary_dim`` dimensions of
    each head rotated, and the type's own parameters (``factor``, ...) in ``scaling``."""

    rope_type: str
    theta: float
    rotary_dim: int
    scaling: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A decoder-only model's architecture, normalised (field names as transformers' where it has one).

    Others: ``norm`` "rms" or "gemma" (``x̂ (1 + w)`` in float32); ``embed_scale`` (None: unscaled); ``layer_types``
    FULL or SLIDING per layer; ``rope_sliding``: sliding layers' own RoPE (Gemma 3) or None; ``num_experts`` 0: dense;
    ``quantization``: config.json's ``quantization_config`` (``checkpoint_quant``), None for a float checkpoint.
    """

    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    hidden_act: str
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    norm: str
    embed_scale: float | None
    attn_scale: float
    attn_logit_softcapping: float | None
    final_logit_softcapping: float | None
    sliding_window: int | None
    layer_types: tuple[str, ...]
    rope: RopeConfig
    rope_sliding: RopeConfig | None
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    norm_topk_prob: bool
    moe_layers: tuple[bool, ...]
    dtype: str | None
    quantization: CheckpointQuantization | None = None

    @classmethod
    def from_hf(cls, hf: Any) -> ModelConfig:
        """Normalise a transformers config object or a ``config.json`` dict (a ``text_config`` wrapper reads as its LM).

        Raises:
            ValueError: an architecture no family serves, a required field missing, or an unsupported value; the message
                says which.
        """
        top = _Fields(hf, {})
        architecture = (top.get("architectures") or [""])[0]
        fam = family(architecture)
        quant = top.get("quantization_config")
        quantization = None if quant is None else checkpoint_quant.parse(quant)
        text = top.get("text_config")
        model_type = (_Fields(text, {}) if text is not None else top).get("model_type") or ""
        f = _Fields(text if text is not None else hf, fam.defaults)
        implied = fam.implied
        missing = [
            k
            for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
            if f.get(k) is None
        ]
        if missing:
            raise ValueError(f"the model's config.json lacks {', '.join(missing)}")
        if f.get("use_bidirectional_attention"):
            raise ValueError("bidirectional attention (an embedding model) is not supported: this server generates")
        heads = _size(f, "num_attention_heads")
        hidden = _size(f, "hidden_size")
        layers = _size(f, "num_hidden_layers")
        kv_heads = _size(f, "num_key_value_heads", 0) or heads
        if heads % kv_heads:
            raise ValueError(f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
        # transformers refuses this for Llama and Gemma 2/3 even with head_dim given; no released model has it.
        if hidden % heads:
            raise ValueError(f"hidden_size {hidden} is not a multiple of num_attention_heads {heads}")
        head_dim = _size(f, "head_dim", 0) or hidden // heads  # 0: derived, as transformers does
        max_pos = _size(f, "max_position_embeddings", 0) or 2048
        vocab = _size(f, "vocab_size")
        intermediate = _size(f, "intermediate_size")
        act = f.get("hidden_activation") or f.get("hidden_act") or "silu"
        if "gemma" in model_type and act == "gelu":
            act = "gelu_pytorch_tanh"  # Gemma's legacy value, which transformers reads as the tanh approximation
        if act not in ACTIVATIONS:
            raise ValueError(f"activation {act!r} is not supported; supported: {', '.join(ACTIVATIONS)}")
        attention_bias = bool(f.get("attention_bias", False))
        window = _size(f, "sliding_window", 0) or None
        if fam.opt_in_window and not f.get("use_sliding_window", False):
            window = None
        layer_types = tuple(f.get("layer_types") or _default_layer_types(model_type, layers, window, f))
        if window is None:
            layer_types = (FULL,) * layers
        rope = _rope(f, model_type, FULL, head_dim, max_pos)
        rope_sliding = None
        if SLIDING in layer_types and model_type == "gemma3_text":
            rope_sliding = _rope(f, model_type, SLIDING, head_dim, max_pos)
        num_experts = _size(f, "num_experts", 0) or _size(f, "num_local_experts", 0) or 0
        top_k = _size(f, "num_experts_per_tok", 0) or 0
        if num_experts and top_k > num_experts:
            raise ValueError(f"num_experts_per_tok {top_k} exceeds the {num_experts} experts")
        sparse_step = int(f.get("decoder_sparse_step") or 1)
        dense_layers = set(f.get("mlp_only_layers") or ())
        scalar = f.get("query_pre_attn_scalar")
        # A multimodal wrapper's own flag ties its language model's head.
        tie = top.get("tie_word_embeddings") if text is not None else None
        tie = f.get("tie_word_embeddings", False) if tie is None else tie
        # transformers 5 writes dtype, older versions torch_dtype (a deprecated attribute on config objects).
        dtype = f.get("dtype") or top.get("dtype") or (hf.get("torch_dtype") if isinstance(hf, Mapping) else None)
        return cls(
            architecture=architecture,
            model_type=model_type,
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=intermediate,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            max_position_embeddings=max_pos,
            rms_norm_eps=float(f.get("rms_norm_eps") or 1e-6),
            hidden_act=act,
            tie_word_embeddings=bool(tie),
            qkv_bias=implied.get("qkv_bias", attention_bias),
            o_bias=implied.get("o_bias", attention_bias),
            mlp_bias=bool(f.get("mlp_bias", False)),
            qk_norm=implied.get("qk_norm", False),
            norm=implied.get("norm", "rms"),
            embed_scale=hidden**0.5 if implied.get("embed_scale") else None,
            attn_scale=float(scalar) ** -0.5 if scalar else head_dim**-0.5,
            attn_logit_softcapping=f.get("attn_logit_softcapping"),
            final_logit_softcapping=f.get("final_logit_softcapping"),
            sliding_window=window,
            layer_types=layer_types,
            rope=rope,
            rope_sliding=rope_sliding,
            num_experts=num_experts,
            num_experts_per_tok=top_k,
            moe_intermediate_size=_size(f, "moe_intermediate_size", 0) or intermediate,
            norm_topk_prob=bool(implied.get("norm_topk_prob", f.get("norm_topk_prob", False))),
            moe_layers=tuple(
                num_experts > 0 and i not in dense_layers and (i + 1) % sparse_step == 0 for i in range(layers)
            ),
            dtype=None if dtype is None else str(dtype).removeprefix("torch."),
            quantization=quantization,
        )

    def window(self, layer: int, max_model_len: int) -> int | None:
        """Layer ``layer``'s sliding window in keys, or None when it attends its whole context (also for windows >=
        ``max_model_len``)."""
        if self.layer_types[layer] != SLIDING or self.sliding_window is None:
            return None
        return self.sliding_window if self.sliding_window < max_model_len else None

    def tp_shape(self, size: int) -> TPShape:
        """How the model splits over ``size`` ranks.

        Raises:
            ValueError: ``size`` does not fit (the message lists the sizes that do).
        """
        dense = not all(self.moe_layers)
        return TPShape.build(
            size,
            self.num_attention_heads,
            self.num_key_value_heads,
            self.intermediate_size if dense else 0,
            self.vocab_size,
            self.moe_intermediate_size if self.num_experts else 0,
        )

    def kv_bytes_per_block(self, block_size: int, dtype_bytes: int, kv_heads: int | None = None) -> int:
        """Bytes of keys plus values for one block across all layers; ``kv_heads`` per device (default all)."""
        kv_heads = kv_heads or self.num_key_value_heads
        return 2 * self.num_hidden_layers * kv_heads * self.head_dim * block_size * dtype_bytes


class _Fields:
    """Reads a config dict or object; a missing or null field is ``defaults``' value, else None."""

    def __init__(self, hf: Any, defaults: Mapping[str, Any]) -> None:
        self.hf, self.defaults = hf, defaults

    def get(self, key: str, default: Any = None) -> Any:
        value = self.hf.get(key) if isinstance(self.hf, Mapping) else getattr(self.hf, key, None)
        if value is None:
            value = self.defaults.get(key, default)
        return value


def _size(f: _Fields, key: str, minimum: int = 1) -> int | None:
    """Field ``key``, an integer from ``minimum`` to ``SIZE_LIMITS[key]``, or None when missing.

    Raises:
        ValueError: another type or a value out of bounds, naming the field.
    """
    value = f.get(key)
    if value is None:
        return None
    limit = SIZE_LIMITS[key]
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= limit:
        raise ValueError(f"{key} must be an integer from {minimum} to {limit}, got {value!r}")
    return value


def _default_layer_types(model_type: str, layers: int, window: int | None, f: _Fields) -> list[str]:
    """Per-layer attention kind for a config without ``layer_types``, as transformers derives it."""
    if window is None:
        return [FULL] * layers
    if model_type == "gemma2":
        return [SLIDING if (i + 1) % 2 else FULL for i in range(layers)]
    if model_type == "gemma3_text":
        pattern = int(f.get("sliding_window_pattern") or 6)
        return [SLIDING if (i + 1) % pattern else FULL for i in range(layers)]
    if model_type in ("qwen2", "qwen3"):
        first = int(f.get("max_window_layers", 28))
        return [SLIDING if i >= first else FULL for i in range(layers)]
    return [SLIDING] * layers


def _rope(f: _Fields, model_type: str, layer_type: str, head_dim: int, max_pos: int) -> RopeConfig:
    """The rotary embedding of ``layer_type`` layers, from ``rope_parameters`` (transformers 5, possibly nested per
    layer type) or ``rope_theta`` + ``rope_scaling`` (older checkpoints)."""
    params = f.get("rope_parameters")
    gemma3 = model_type == "gemma3_text"
    if isinstance(params, Mapping) and (FULL in params or SLIDING in params):
        params = dict(params.get(layer_type) or {})
    elif params:
        params = dict(params)
    elif gemma3 and layer_type == SLIDING:
        # Gemma 3's older configs: rope_scaling is for the global layers; local ones have their own base.
        params = {"rope_theta": f.get("rope_local_base_freq", 10_000.0)}
    else:
        params = dict(f.get("rope_scaling") or {})
    default_theta = 1_000_000.0 if gemma3 else 10_000.0
    theta = float(params.pop("rope_theta", None) or f.get("rope_theta", default_theta))
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    rope_type = {"su": "longrope", "mrope": "default"}.get(rope_type, rope_type)
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"RoPE type {rope_type!r} is not supported; supported: {', '.join(ROPE_TYPES)}")
    partial = float(params.pop("partial_rotary_factor", None) or f.get("partial_rotary_factor", 1.0))
    rotary_dim = int(head_dim * partial)
    if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
        raise ValueError(f"partial_rotary_factor {partial} gives {rotary_dim} rotated dimensions of {head_dim}")
    if rope_type in ("yarn", "llama3", "longrope"):
        # Phi-3 keeps the pre-training length at the top level, and transformers gives it priority.
        top = f.get("original_max_position_embeddings")
        params["original_max_position_embeddings"] = int(
            top or params.get("original_max_position_embeddings") or max_pos
        )
    if rope_type in ("linear", "dynamic", "llama3") and not params.get("factor"):
        raise ValueError(f"RoPE type {rope_type!r} needs a factor in the config")
    if rope_type == "longrope":
        for key in ("short_factor", "long_factor"):
            if len(params.get(key) or ()) != rotary_dim // 2:
                raise ValueError(f"RoPE type 'longrope' needs {key} with {rotary_dim // 2} entries")
    return RopeConfig(rope_type, theta, rotary_dim, params)
