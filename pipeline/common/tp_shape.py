"""Tensor-parallel shard sizes, no torch, shared by the launcher's checks and the worker (docs/design.md,
"Parallelism"): Megatron-LM's scheme (Shoeybi et al. 2019, section 3), KV-head replication and vocabulary padding as
vLLM's."""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.common.constants import cdiv


@dataclass(frozen=True)
class TPShape:
    """One rank's share of a model under tensor parallelism of ``N = size`` ranks.

    ``num_kv_heads``: ``KV / N`` when N divides KV, else 1 (replicated on ``kv_replicas = N / KV`` ranks);
    ``vocab_per_rank``: ``ceil(V / N)``, the last rank zero-padded; intermediate sizes 0: none.
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
        """Split a model's dimensions over ``size`` ranks (``intermediate_size``/``moe_intermediate_size`` 0: none).

        Raises:
            ValueError: N does not divide the heads or an intermediate size, or N and the KV heads divide neither one
                the other; the message lists the sizes that would work.
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
