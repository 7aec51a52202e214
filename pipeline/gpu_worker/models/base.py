"""What every family shares: embedding, decoder layers, final norm, LM head, and loading checkpoint tensors
(docs/design.md, "Model families").

Modules carry transformers' names, so checkpoint tensors map by name; each ``weight_loader`` keeps this rank's part. The
forward makes no host synchronisation on CUDA.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import ClassVar

import torch
from torch import nn

from pipeline.common.model_config import SLIDING, ModelConfig
from pipeline.gpu_worker.attention import default_backend
from pipeline.gpu_worker.attention.backend import AttentionBackend, AttentionImpl, AttentionMetadata, KVCache
from pipeline.gpu_worker.layers.embedding import VocabParallelEmbedding
from pipeline.gpu_worker.layers.linear import LinearBase, load_whole
from pipeline.gpu_worker.layers.norm import make_norm
from pipeline.gpu_worker.layers.rotary import RotaryEmbedding
from pipeline.gpu_worker.layers.tp import SINGLE_RANK, TPGroup

# A stacked expert parameter's part, by the per-expert checkpoint projection that fills it.
_EXPERT_PARTS = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1), "down_proj": ("down_proj", None)}
_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


class CheckpointError(ValueError):
    """The checkpoint does not fit the model its config describes; the message names the tensors."""


class CausalLM(nn.Module):
    """A decoder-only LM over a paged KV cache; a family sets ``decoder_layer`` and its checkpoint names.

    Parameters start uninitialised (default dtype and device) until ``load_weights``. ``max_model_len`` drops sliding
    windows at least that long and picks longrope factors.

    Raises:
        ValueError: ``tp.size`` does not fit the model (the message lists sizes that do).
    """

    decoder_layer: ClassVar[type[nn.Module]]
    # Checkpoint module name -> (our fused module, its part).
    packed_modules_mapping: ClassVar[dict[str, tuple[str, str | int]]] = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
    # (regex, replacement) applied to every checkpoint name first.
    checkpoint_renames: ClassVar[tuple[tuple[str, str], ...]] = ()
    # Checkpoint names (regex) with no parameter: buffers some exporters write, parts not served.
    ignored_checkpoint_names: ClassVar[tuple[str, ...]] = (r"rotary_emb\.inv_freq$",)

    def __init__(
        self,
        config: ModelConfig,
        tp: TPGroup = SINGLE_RANK,
        max_model_len: int | None = None,
        attn_backend: AttentionBackend | None = None,
    ) -> None:
        super().__init__()
        shape = config.tp_shape(tp.size)
        max_model_len = max_model_len or config.max_position_embeddings
        self.config, self.tp = config, tp
        self.num_heads, self.num_kv_heads, self.head_dim = shape.num_heads, shape.num_kv_heads, config.head_dim
        self.model = nn.Module()
        self.model.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        self.model.layers = nn.ModuleList(
            self.decoder_layer(config, i, max_model_len, tp) for i in range(config.num_hidden_layers)
        )
        self.model.norm = make_norm(config.norm, config.hidden_size, config.rms_norm_eps)
        # The (window, softcap) pairs the layers attend with (a backend may plan each once per step).
        self.attention_kinds = tuple(
            dict.fromkeys((layer.self_attn.window, layer.self_attn.softcap) for layer in self.model.layers)
        )
        self.lm_head = None
        if not config.tie_word_embeddings:
            self.lm_head = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        ropes = [config.rope] + ([config.rope_sliding] if config.rope_sliding else [])
        self.rotary = nn.ModuleList(RotaryEmbedding(r, config.max_position_embeddings, max_model_len) for r in ropes)
        self.layer_rope = [int(config.rope_sliding is not None and t == SLIDING) for t in config.layer_types]
        # The scale is rounded to the model dtype before it multiplies, as in transformers (on the CPU:
        # the loader first builds the model on the meta device, which holds no values).
        self.embed_scale = None
        if config.embed_scale is not None:
            self.embed_scale = float(torch.tensor(config.embed_scale, dtype=torch.get_default_dtype(), device="cpu"))
        self.attn_backend = attn_backend or default_backend()

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[KVCache],
        attn_backend: AttentionImpl | None = None,
    ) -> torch.Tensor:
        """Run one step over the flat token batch: ``input_ids`` and ``positions`` ``[T]`` int64 (positions below
        ``max_position_embeddings``); ``kv_caches`` written in place; ``attn_backend`` None: ``self.attn_backend``.

        Returns ``[T, hidden_size]`` final-normed hidden states, model dtype.
        """
        ropes = [r.lookup(positions) for r in self.rotary]
        hidden = self.model.embed_tokens(input_ids)
        if self.embed_scale is not None:
            hidden = hidden * self.embed_scale
        attn_backend = attn_backend or self.attn_backend
        for layer, kv_cache, rope in zip(self.model.layers, kv_caches, self.layer_rope, strict=True):
            hidden = layer(hidden, ropes[rope], meta, kv_cache, attn_backend)
        return self.model.norm(hidden)

    def untie_lm_head(self) -> None:
        """Give a tied model an LM head of its own, before loading: for a checkpoint that holds the head apart from
        the embedding (a GGUF file's quantized table: the embedding dequantized, the head as codes)."""
        embed = self.model.embed_tokens
        with torch.device(embed.weight.device):
            head = VocabParallelEmbedding(self.config.vocab_size, self.config.hidden_size, embed.tp)
        self.lm_head = head.to(embed.weight.dtype)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden [S, hidden_size]`` (rows to sample) -> ``[S, vocab_size]`` float32 logits, equal on every rank."""
        head = self.model.embed_tokens if self.lm_head is None else self.lm_head
        logits = head.logits(hidden)
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def allocate_kv_caches(
        self, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
    ) -> list[KVCache]:
        """Preallocate this rank's paged KV cache: per layer ``(k_cache, v_cache)``, each ``[num_blocks * block_size,
        num_kv_heads, head_dim]``, zero-filled (padded gathers never read NaN)."""
        shape = (num_blocks * block_size, self.num_kv_heads, self.head_dim)
        return [
            (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(self.config.num_hidden_layers)
        ]

    def parameter_of(self, name: str) -> tuple[str, object] | None:
        """The parameter a checkpoint tensor fills and its shard id, or None for a tensor with no parameter."""
        for pattern, replacement in self.checkpoint_renames:
            name = re.sub(pattern, replacement, name)
        if any(re.search(p, name) for p in self.ignored_checkpoint_names):
            return None
        if self.lm_head is None and name == "lm_head.weight":
            return None  # tied: the embedding is the head
        if m := _EXPERT.match(name):
            param, part = _EXPERT_PARTS[m[3]]
            expert = int(m[2])
            return f"{m[1]}.{param}", (expert,) if part is None else (expert, part)
        parts = name.split(".")
        for i, part in enumerate(parts):
            if part in self.packed_modules_mapping:
                module, shard = self.packed_modules_mapping[part]
                return ".".join([*parts[:i], module, *parts[i + 1 :]]), shard
        return name, None

    def checkpoint_name(self, param: str, shard: object) -> str:
        """The checkpoint tensor that fills ``shard`` of parameter ``param`` (for error messages)."""
        if isinstance(shard, tuple):
            head, stacked = param.rsplit(".", 1)
            proj = next(k for k, v in _EXPERT_PARTS.items() if v == (stacked, shard[1] if len(shard) > 1 else None))
            return f"{head}.{shard[0]}.{proj}.weight"
        if shard is None:
            return param
        parts = param.split(".")
        for i, part in enumerate(parts):
            for source, (module, s) in self.packed_modules_mapping.items():
                if (module, s) == (part, shard):
                    return ".".join([*parts[:i], source, *parts[i + 1 :]])
        return f"{param} ({shard})"

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Fill every parameter from ``(checkpoint name, full tensor)`` pairs (any dtype or device), one tensor at a
        time.

        Raises:
            CheckpointError: a tensor has the wrong shape, is loaded twice, has no parameter here, or a parameter is
                left unfilled; the message lists the checkpoint names.
        """
        params = dict(self.named_parameters())
        filled: dict[str, set] = {name: set() for name in params}
        unexpected: list[str] = []
        for name, tensor in weights:
            target = self.parameter_of(name)
            if target is None:
                continue
            pname, shard = target
            param = params.get(pname)
            if param is None:
                unexpected.append(name)
                continue
            loader = getattr(param, "weight_loader", load_whole)
            try:
                keys = set(loader(param, tensor, shard))
            except ValueError as e:
                raise CheckpointError(f"{name}: {e}") from None
            if keys & filled[pname]:
                raise CheckpointError(f"{name} is in the checkpoint twice")
            filled[pname] |= keys
        missing = [
            self.checkpoint_name(pname, shard)
            for pname, param in params.items()
            for shard in sorted(getattr(param, "shards", {None}) - filled[pname], key=str)
        ]
        if missing or unexpected:
            raise CheckpointError(
                f"the checkpoint does not match the {self.config.architecture} layout its config.json describes: "
                f"missing {missing or 'none'}, unexpected {sorted(unexpected) or 'none'}"
            )

    @torch.no_grad()
    def pack_weights(self) -> None:
        """Reorder every linear weight and the LM head once into oneDNN's layout (CPU float32/bfloat16; else a no-op);
        packed weights are no longer loadable."""
        for module in self.modules():
            if isinstance(module, LinearBase):
                module.pack_weights()
        if self.lm_head is None:
            self.model.embed_tokens.pack_weights(keep_dense=True)
        else:
            self.lm_head.pack_weights(keep_dense=False)
