"""Tensor-parallel shard sizes: how a model's dimensions split over ranks (no torch).

The launcher checks a tensor-parallel size against the model before any process starts, and sizes the KV cache per rank,
with the same arithmetic the worker uses to build its shard (docs/design.md, "Parallelism"). The scheme is Megatron-LM's
(Shoeybi et al. 2019, "Megatron-LM: Training Multi-Billion Parameter Language Models Using Model Parallelism", section
3): attention heads and the MLP's intermediate dimension are split evenly; vLLM's parallel layers were read as a
reference for replicating KV heads when there are more ranks than KV heads, and for padding the vocabulary to a multiple
of the size.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.common.constants import cdiv


@dataclass(frozen=True)
class TPShape:
    """One rank's share of a model under tensor parallelism of ``size`` ranks.

    Attributes:
        size: ranks (N).
        num_heads: query heads per rank, ``H / N``.
        num_kv_heads: KV heads per rank: ``KV / N`` when N divides KV, else 1 (each KV head replicated on ``N / KV``
            ranks).
        kv_replicas: ranks holding each KV head (1 unless replicated).
        intermediate_size: dense MLP intermediate width per rank, ``I / N`` (0: no dense MLP).
        vocab_size: the model's vocabulary (V).
        vocab_per_rank: embedding / LM-head rows per rank, ``ceil(V / N)``; the last rank's rows past V are zero
            padding.
        moe_intermediate_size: each expert's intermediate width per rank (0: no experts).
    """

    size: int
    num_heads: int
    num_kv_heads: int
    kv_replicas: int
    intermediate_size: int
    vocab_size: int
    vocab_per_rank: int
    moe_intermediate_size: int = 0

    @classmethod
    def build(
        cls,
        size: int,
        num_heads: int,
        num_kv_heads: int,
        intermediate_size: int,
        vocab_size: int,
        moe_intermediate_size: int = 0,
    ) -> TPShape:
        """Split a model's dimensions over ``size`` ranks.

        Args:
            size: tensor-parallel size N >= 1.
            num_heads, num_kv_heads, intermediate_size, vocab_size: the full model's (``intermediate_size`` 0 when no
                layer has a dense MLP).
            moe_intermediate_size: each expert's intermediate width; 0 for a dense model.

        Raises:
            ValueError: N does not divide the attention heads or an intermediate size, or N and the KV heads divide
                neither one the other (a KV head would straddle two ranks); the message lists the sizes that would work.
        """
        if size < 1:
            raise ValueError(f"tensor-parallel size must be at least 1, got {size}")

        def problems(n: int) -> list[str]:
            out = []
            if num_heads % n:
                out.append(f"{num_heads} attention heads")
            if intermediate_size % n:
                out.append(f"an intermediate size of {intermediate_size}")
            if moe_intermediate_size % n:
                out.append(f"an expert intermediate size of {moe_intermediate_size}")
            if num_kv_heads % n and n % num_kv_heads:
                out.append(f"{num_kv_heads} KV heads (nor is it a multiple of them)")
            return out

        if wrong := problems(size):
            valid = [n for n in range(1, num_heads + 1) if not problems(n)]
            raise ValueError(
                f"tensor-parallel size {size} does not divide {' and '.join(wrong)}; this model supports sizes {valid}"
            )
        return cls(
            size=size,
            num_heads=num_heads // size,
            num_kv_heads=max(1, num_kv_heads // size),
            kv_replicas=max(1, size // num_kv_heads),
            intermediate_size=intermediate_size // size,
            vocab_size=vocab_size,
            vocab_per_rank=cdiv(vocab_size, size),
            moe_intermediate_size=moe_intermediate_size // size,
        )

    def kv_head_start(self, rank: int) -> int:
        """Index of rank ``rank``'s first KV head in the full model."""
        return (rank // self.kv_replicas) * self.num_kv_heads
