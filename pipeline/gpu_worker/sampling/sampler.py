"""Token sampling: greedy, temperature, min-p, top-k, top-p, per-request seeds.

A sampled row's token depends only on its own logits, its request's seed and its output position, never on which other
rows share the batch or where the row sits in it: every batched operation is row-wise, and the noise of row ``r`` at
vocabulary index ``v`` is a counter-based hash of ``(seed_r, position_r, v)``, computed for all rows at once (no
generator per row).

Sampling is the exponential race: with ``E_i ~ Exp(1)`` i.i.d., ``argmax_i(p_i / E_i)`` is distributed as ``p``. It is
computed in log space, ``argmax_i(x_i - log E_i)`` over the filtered, temperature-scaled logits ``x`` (the softmax
normaliser is a common shift), which needs no softmax and cannot underflow.

Nothing here reads a device value on the host (docs/design.md, "The worker"): the decisions that shape the work (which
rows sample, how many top-k candidates, whether top-p runs) come from a host-side ``SamplingPlan``; the per-row values
live on the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

# On CPU a full-vocabulary sort dominates the step (110 ms for 64 x 49152
# here); top-p rows first try this many candidates via topk, which almost
# always hold the nucleus, and only rows whose nucleus is larger are sorted.
_TOP_P_CANDIDATES = 1024

_FLOAT32_MAX = float(torch.finfo(torch.float32).max)

_M32 = 0xFFFFFFFF
# Uniforms are (k + 0.5) / 2**23 for a 23-bit k: strictly inside (0, 1), so
# -log(u) is never 0 or inf and a draw cannot single out (or lose) a token.
_U_BITS = 23


@dataclass
class SamplingPlan:
    """Host-side decisions for one batch's sampling; never derived from device values.

    Attributes:
        rows: ``[R]`` int64 on the logits' device, the rows (of ``S``) with temperature > 0; None when every row is
            greedy.
        k_max: the largest active top-k among ``rows`` (0: top-k is off for all).
        use_top_p: some row in ``rows`` has top_p < 1.
        use_min_p: some row in ``rows`` has min_p > 0.
        host_reads_ok: the device is the host (CPU torch), so the sampler may take shortcuts that read values (a partial
            sort with a fallback).
    """

    rows: torch.Tensor | None
    k_max: int = 0
    use_top_p: bool = False
    use_min_p: bool = False
    host_reads_ok: bool = False

    @classmethod
    def build(
        cls,
        rows: torch.Tensor | None,
        top_k: np.ndarray,
        top_p: np.ndarray,
        vocab: int,
        host_reads_ok: bool,
        min_p: np.ndarray | None = None,
    ) -> SamplingPlan:
        """Plan from the host copies of the sampled rows' ``top_k``, ``top_p`` and ``min_p`` (``[R]`` each)."""
        if rows is None or len(top_k) == 0:
            return cls(rows=None)
        active_k = top_k[(top_k > 0) & (top_k < vocab)]
        return cls(
            rows=rows,
            k_max=int(active_k.max()) if active_k.size else 0,
            use_top_p=bool((top_p < 1).any()),
            use_min_p=min_p is not None and bool((min_p > 0).any()),
            host_reads_ok=host_reads_ok,
        )


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    top_k: torch.Tensor,
    seeds: torch.Tensor,
    output_positions: torch.Tensor,
    min_p: torch.Tensor | None = None,
) -> torch.Tensor:
    """Pick one token per row, from host (CPU) parameter tensors.

    Rows with ``temperature == 0`` are greedy: exactly ``logits.argmax(-1)``. Other rows: logits / temperature, then
    min-p, then top-k, then top-p over what top-k kept, then one seeded draw. Tokens tied with the last one kept by
    top-k or top-p are kept as well. The worker calls ``sample_rows`` with a plan and device parameters instead; this
    wrapper validates and plans.

    Args:
        logits: ``[S, V]`` float32, on any device.
        temperature: ``[S]`` float32, >= 0; 0 means greedy.
        top_p: ``[S]`` float32 in (0, 1]; 1 disables it.
        top_k: ``[S]`` int32/int64; <= 0 disables it.
        seeds: ``[S]`` int64, the request's seed (any 64-bit value).
        output_positions: ``[S]`` int64, position of the token being sampled (its output index or its sequence position:
            anything that depends only on the request and the token, never on the batch).
        min_p: ``[S]`` float32 in [0, 1]; None or 0 disables it.

    Returns:
        ``[S]`` int64 token ids on ``logits.device``.

    Raises:
        ValueError: on mismatched shapes, a negative or NaN temperature, top_p outside (0, 1], or min_p outside [0, 1].
    """
    num_rows, vocab = logits.shape
    if min_p is None:
        min_p = torch.zeros(num_rows)
    params = (temperature, top_p, top_k, seeds, output_positions, min_p)
    if any(t.shape != (num_rows,) for t in params):
        raise ValueError(f"sampling parameters must all have shape ({num_rows},)")
    temperature, top_p, top_k, seeds, output_positions, min_p = (t.cpu() for t in params)
    if not bool((temperature >= 0).all()):
        raise ValueError(f"temperature must be >= 0, got {temperature.tolist()}")
    if not bool(((top_p > 0) & (top_p <= 1)).all()):
        raise ValueError(f"top_p must be in (0, 1], got {top_p.tolist()}")
    if not bool(((min_p >= 0) & (min_p <= 1)).all()):
        raise ValueError(f"min_p must be in [0, 1], got {min_p.tolist()}")
    rows = torch.nonzero(temperature > 0).flatten()
    device = logits.device
    plan = SamplingPlan.build(
        rows.to(device) if rows.numel() else None,
        top_k[rows].long().numpy(),
        top_p[rows].numpy(),
        vocab,
        host_reads_ok=device.type == "cpu",
        min_p=min_p[rows].numpy(),
    )
    on_device = [t[rows].to(device) for t in (temperature, top_p, top_k.long(), seeds, output_positions, min_p)]
    return sample_rows(logits, plan, *on_device)


def sample_rows(
    logits: torch.Tensor,
    plan: SamplingPlan,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    top_k: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    min_p: torch.Tensor | None = None,
) -> torch.Tensor:
    """Pick one token per row with no host synchronisation.

    Temperature, then min-p (tokens whose probability is below ``min_p`` times the most likely one's are dropped: Nguyen
    et al. 2024, "Turning Up the Heat: Min-p Sampling for Creative and Coherent LLM Outputs"; after temperature and
    before top-k/top-p, as vLLM applies it), then top-k and top-p, then the seeded draw.

    Args:
        logits: ``[S, V]`` float32.
        plan: which rows sample and what filtering runs (see ``SamplingPlan``).
        temperature, top_p: ``[R]`` float32 on the logits' device, for ``plan.rows``.
        top_k, seeds, positions: ``[R]`` int64 on the logits' device.
        min_p: ``[R]`` float32 in [0, 1] on the logits' device; read only if ``plan.use_min_p``.

    Returns:
        ``[S]`` int64 token ids on the logits' device.
    """
    tokens = logits.argmax(-1)
    if plan.rows is None:
        return tokens
    x = filtered_logits(logits, plan, temperature, top_p, top_k, min_p)
    return tokens.index_copy_(0, plan.rows, race(x, seeds, positions))


def filtered_logits(
    logits: torch.Tensor,
    plan: SamplingPlan,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    top_k: torch.Tensor,
    min_p: torch.Tensor | None = None,
) -> torch.Tensor:
    """``[R, V]`` float32: the ``plan.rows`` rows of ``logits`` divided by temperature, min-p, top-k and top-p applied
    (dropped tokens -inf); a softmax of them is the distribution ``race`` draws from.

    Arguments as ``sample_rows``; ``plan.rows`` must be set.
    """
    vocab = logits.shape[1]
    x = logits.index_select(0, plan.rows)
    x.div_(temperature[:, None])
    # Logits that overflowed (a tiny temperature, an extreme penalty) or became NaN must not turn the
    # nucleus's sums into NaN: NaN cannot be drawn, and +inf becomes the largest float.
    torch.nan_to_num_(x, nan=float("-inf"), posinf=_FLOAT32_MAX, neginf=float("-inf"))
    if plan.use_min_p:
        apply_min_p(x, min_p)
    k = torch.where((top_k > 0) & (top_k < vocab), top_k, 0)
    _filter(x, k, top_p, plan)
    return x


def race(x: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``[R]`` int64: one draw per row from ``softmax(x)`` (the exponential race), noise keyed by (seed, position).

    ``x`` (``[R, V]`` float32 log-weights, -inf for impossible tokens) is overwritten.
    """
    return x.sub_(uniform_noise(seeds, positions, x.shape[1]).log_().neg_().log_()).argmax(-1)


def apply_min_p(x: torch.Tensor, min_p: torch.Tensor) -> None:
    """Set to -inf, in place, each row's logits whose probability is below ``min_p`` times its largest.

    Min-p sampling (Nguyen et al. 2024): ``p_i < min_p * p_max`` is ``x_i < x_max + log(min_p)`` in logit space, so no
    softmax is needed, and ``min_p`` 0 (``log`` = -inf) keeps every token. The most likely token is always kept.

    Args:
        x: ``[R, V]`` float32 temperature-scaled logits, modified in place.
        min_p: ``[R]`` float32 in [0, 1] on the same device.
    """
    x.masked_fill_(x < x.amax(-1, keepdim=True) + min_p.log()[:, None], float("-inf"))


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer bijection with strong avalanche (a "lowbias32" of C. Wellons), in place.

    ``x`` is int64 holding values in ``[0, 2**32)``. Both multipliers are below 2**31, so no product overflows int64
    (signed overflow would be undefined), and masking keeps the low 32 bits.
    """
    x ^= x >> 16
    x *= 0x21F0AAAD
    x &= _M32
    x ^= x >> 15
    x *= 0x735A2D97
    x &= _M32
    x ^= x >> 15
    return x


# mix32(v) for every vocabulary index, per (vocab size, device): the counter
# half of the noise hash does not depend on the row, so it is computed once.
_COUNTER_BITS: dict[tuple[int, torch.device], torch.Tensor] = {}


def _counter_bits(vocab: int, device: torch.device) -> torch.Tensor:
    bits = _COUNTER_BITS.get((vocab, device))
    if bits is None:
        # A normal tensor even when first made in inference mode: it is reused outside it.
        with torch.inference_mode(False):
            bits = _COUNTER_BITS[(vocab, device)] = _mix32(torch.arange(vocab, dtype=torch.int64, device=device))
    return bits


def uniform_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """Uniforms ``[R, vocab]`` float32 in ``[2**-24, 1 - 2**-24]``, a pure function of (seed, position, index).

    Counter-based noise (the idea of Philox) in plain torch ops, for every row at once: each row's 32-bit key comes from
    its seed and position (three rounds of ``_mix32``), the counter is the vocabulary index, and ``mix32(mix32(index) ^
    key)`` gives 32 random bits per (row, index): two rounds with the key between them. A row therefore draws the same
    noise in any batch, and no per-row generator or kernel is needed. On a GPU this is ~15 elementwise passes over ``[R,
    V]``.

    Args:
        seeds: ``[R]`` int64 (any 64-bit value).
        positions: ``[R]`` int64, the sampled token's position.
        vocab: V.
    """
    lo, hi = seeds & _M32, (seeds >> 32) & _M32
    key = _mix32(_mix32(_mix32(lo ^ 0x9E3779B9) ^ hi) ^ (positions & _M32))
    h = _counter_bits(vocab, seeds.device)[None, :] ^ key[:, None]
    return bits_to_uniform(_mix32(h))


def bits_to_uniform(h: torch.Tensor) -> torch.Tensor:
    """32-bit values (int64) -> float32 ``(k + 0.5) / 2**23`` from their top 23 bits; never 0 or 1."""
    h >>= 32 - _U_BITS
    return h.float().add_(0.5).mul_(2.0**-_U_BITS)


def _filter(x: torch.Tensor, k: torch.Tensor, p: torch.Tensor, plan: SamplingPlan) -> None:
    """Set to -inf, in place, the logits outside each row's top-k then top-p set.

    Args:
        x: ``[R, V]`` temperature-scaled logits, modified in place.
        k: ``[R]`` int64, 0 where top-k is off.
        p: ``[R]`` float32, 1 where top-p is off.
        plan: ``k_max`` and ``use_top_p`` say what runs at all.
    """
    vocab = x.shape[1]
    if plan.k_max == 0 and not plan.use_top_p:
        return
    if not plan.use_top_p:
        num_cand = plan.k_max
    elif plan.host_reads_ok:
        num_cand = max(plan.k_max, min(vocab, _TOP_P_CANDIDATES))
    else:
        # Sorting is cheap on GPUs, and a fixed length keeps the cumulative
        # sums independent of the other rows' top_k.
        num_cand = vocab
    cand = x.sort(dim=-1, descending=True).values if num_cand >= vocab else x.topk(num_cand, dim=-1).values

    use_k = k > 0
    k_limit = torch.where(use_k, k, vocab)
    if plan.k_max > 0:
        kth = cand.gather(1, (k_limit.clamp(max=num_cand) - 1)[:, None])
        kth.masked_fill_(~use_k[:, None], float("-inf"))
        x.masked_fill_(x < kth, float("-inf"))
    if not plan.use_top_p:
        return

    # Top-p sees the distribution renormalised over what top-k kept.
    use_p = p < 1
    lse = x.logsumexp(dim=-1, keepdim=True)
    kept, threshold = _top_p_threshold(cand, lse, k_limit, p)
    if num_cand < vocab:
        # Rows whose nucleus may extend past the candidates: sort them fully.
        # Only with host_reads_ok (CPU torch), where these reads cost nothing.
        short = torch.nonzero(use_p & ~use_k & (kept == num_cand)).flatten()
        if short.numel() > 0:
            full = x.index_select(0, short).sort(dim=-1, descending=True).values
            threshold[short] = _top_p_threshold(full, lse[short], k_limit[short], p[short])[1]
    threshold.masked_fill_(~use_p, float("-inf"))
    x.masked_fill_(x < threshold[:, None], float("-inf"))


def _top_p_threshold(
    cand: torch.Tensor, lse: torch.Tensor, k_limit: torch.Tensor, p: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Smallest prefix of the sorted candidates whose probability reaches ``p``.

    Args:
        cand: ``[R, C]`` logits sorted descending.
        lse: ``[R, 1]`` log-normaliser of each row.
        k_limit: ``[R]`` the prefix may not exceed this many tokens.
        p: ``[R]`` nucleus mass.

    Returns:
        ``(kept [R], threshold [R])``: prefix length (>= 1) and its last logit.
    """
    probs = (cand - lse).exp()
    mass_before = probs.cumsum(dim=-1) - probs
    index = torch.arange(cand.shape[1], device=cand.device)
    keep = (mass_before < p[:, None]) & (index[None, :] < k_limit[:, None])
    # At least one token: a row whose logits are all -inf has NaN probabilities and would keep none.
    kept = keep.sum(dim=-1).clamp_(min=1)
    return kept, cand.gather(1, (kept - 1)[:, None]).squeeze(1)
