"""Token sampling: greedy, temperature, min-p, top-k, top-p, per-request seeds.

A row's token depends only on its logits, seed and output position, never on the batch: the noise is a counter-based
hash of ``(seed, position, vocab index)``. The draw is the exponential race in log space, ``argmax_i(x_i - log E_i)``
with ``E_i ~ Exp(1)`` (no softmax, no underflow). Shapes of the work come from a host-side ``SamplingPlan``, never from
device values (docs/design.md, "The worker").
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

    ``rows``: ``[R]`` int64 on the logits' device, the rows with temperature > 0 (None: all greedy); ``k_max``: largest
    active top-k (0: off); ``host_reads_ok``: the device is the host, so shortcuts that read values are allowed.
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


@dataclass
class SamplingTensors:
    """The parameters of a step's ``R`` rows with temperature > 0, ``[R]`` each on the logits' device, and their plan.

    float32 ``temperature``, ``top_p``, ``min_p``; int64 ``top_k`` (0 = off) and ``seed``.
    """

    plan: SamplingPlan
    temperature: torch.Tensor
    top_p: torch.Tensor
    top_k: torch.Tensor
    min_p: torch.Tensor
    seed: torch.Tensor

    @classmethod
    def greedy(cls, device: torch.device) -> SamplingTensors:
        """No row samples: every row takes its argmax."""
        f, i = (torch.zeros(0, dtype=d, device=device) for d in (torch.float32, torch.int64))
        return cls(SamplingPlan(rows=None), f, f, i, f, i)


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    top_k: torch.Tensor,
    seeds: torch.Tensor,
    output_positions: torch.Tensor,
    min_p: torch.Tensor | None = None,
) -> torch.Tensor:
    """Pick one token per row from host (CPU) parameter tensors; validates and plans, then ``sample_rows``.

    ``temperature == 0`` rows are exactly ``logits.argmax(-1)``; others: temperature, min-p, top-k, top-p, one seeded
    draw (ties with the last token kept are kept). ``logits``: ``[S, V]`` float32; the rest ``[S]``; ``top_k`` <= 0,
    ``top_p`` 1 and ``min_p`` None/0 disable. Returns ``[S]`` int64 on ``logits.device``.

    Raises:
        ValueError: mismatched shapes, a negative or NaN temperature, top_p outside (0, 1], or min_p outside [0, 1].
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
    if not rows.numel():
        return sample_rows(logits, SamplingTensors.greedy(device), output_positions)
    top_k = top_k.long()
    plan = SamplingPlan.build(
        rows.to(device), top_k[rows].numpy(), top_p[rows].numpy(), vocab, device.type == "cpu", min_p[rows].numpy()
    )
    params = [t[rows].to(device) for t in (temperature, top_p, top_k, min_p, seeds.long())]
    return sample_rows(logits, SamplingTensors(plan, *params), output_positions[rows].to(device))


def sample_rows(logits: torch.Tensor, s: SamplingTensors, positions: torch.Tensor) -> torch.Tensor:
    """Pick one token per row with no host synchronisation: temperature, min-p (Nguyen et al. 2024; before top-k/top-p,
    as vLLM applies it), top-k, top-p, the seeded draw.

    ``logits``: ``[S, V]`` float32; ``positions`` ``[R]`` int64, the output position keying each sampled row's noise.
    Returns ``[S]`` int64.
    """
    tokens = logits.argmax(-1)
    if s.plan.rows is None:
        return tokens
    return tokens.index_copy_(0, s.plan.rows, race(filtered_logits(logits, s), s.seed, positions))


def filtered_logits(logits: torch.Tensor, s: SamplingTensors) -> torch.Tensor:
    """``[R, V]`` float32: the ``s.plan.rows`` rows of ``logits`` with temperature, min-p, top-k and top-p applied
    (dropped tokens -inf), the distribution ``race`` draws from."""
    vocab = logits.shape[1]
    x = logits.index_select(0, s.plan.rows)
    x.div_(s.temperature[:, None])
    # Logits that overflowed (a tiny temperature, an extreme penalty) or became NaN must not turn the
    # nucleus's sums into NaN: NaN cannot be drawn, and +inf becomes the largest float.
    torch.nan_to_num_(x, nan=float("-inf"), posinf=_FLOAT32_MAX, neginf=float("-inf"))
    if s.plan.use_min_p:
        apply_min_p(x, s.min_p)
    k = torch.where((s.top_k > 0) & (s.top_k < vocab), s.top_k, 0)
    _filter(x, k, s.top_p, s.plan)
    return x


def race(x: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``[R]`` int64: one draw per row from ``softmax(x)`` (the exponential race), noise keyed by (seed, position).

    ``x`` (``[R, V]`` float32 log-weights, -inf for impossible tokens) is overwritten.
    """
    return x.sub_(uniform_noise(seeds, positions, x.shape[1]).log_().neg_().log_()).argmax(-1)


def apply_min_p(x: torch.Tensor, min_p: torch.Tensor) -> None:
    """Set to -inf, in place, the logits of ``x`` (``[R, V]``) whose probability is below ``min_p`` (``[R]``) times the
    row's largest: ``x_i < x_max + log(min_p)``, no softmax (Nguyen et al. 2024). The top token is always kept."""
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

    Counter-based noise (the idea of Philox) in torch ops: a 32-bit key per row from seed and position, then
    ``mix32(mix32(index) ^ key)`` per vocabulary index, so a row draws the same noise in any batch.
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
    """Set to -inf, in place, the logits of ``x`` (``[R, V]``) outside each row's top-k (``k`` 0: off) then top-p (``p``
    1: off) set."""
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
    """Smallest prefix of ``cand`` (``[R, C]`` sorted descending, at most ``k_limit``) whose probability reaches ``p``.

    Returns ``(kept [R], threshold [R])``: prefix length (>= 1) and its last logit.
    """
    probs = (cand - lse).exp()
    mass_before = probs.cumsum(dim=-1) - probs
    index = torch.arange(cand.shape[1], device=cand.device)
    keep = (mass_before < p[:, None]) & (index[None, :] < k_limit[:, None])
    # At least one token: a row whose logits are all -inf has NaN probabilities and would keep none.
    kept = keep.sum(dim=-1).clamp_(min=1)
    return kept, cand.gather(1, (kept - 1)[:, None]).squeeze(1)
