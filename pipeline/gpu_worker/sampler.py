"""Token sampling: greedy, temperature, top-k, top-p, per-request seeds.

A sampled row's token depends only on its own logits, its request's seed and
its output position, never on which other rows share the batch or where the
row sits in it: each row's noise comes from a generator seeded with
``mix(seed, position)``, and every batched operation is row-wise.

Sampling is the exponential race: with ``E_i ~ Exp(1)`` i.i.d.,
``argmax_i(p_i / E_i)`` is distributed as ``p``. It is computed in log space,
``argmax_i(x_i - log E_i)`` over the filtered, temperature-scaled logits
``x`` (the softmax normaliser is a common shift), which needs no softmax and
cannot underflow.
"""

from __future__ import annotations

import torch

_MASK64 = (1 << 64) - 1

# On CPU a full-vocabulary sort dominates the step (110 ms for 64 x 49152
# here); top-p rows first try this many candidates via topk, which almost
# always hold the nucleus, and only rows whose nucleus is larger are sorted.
_TOP_P_CANDIDATES = 1024


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def noise_seed(seed: int, position: int) -> int:
    """64-bit generator seed for one draw of request ``seed`` at output ``position``.

    Well mixed in every bit: CPU generators keep only the low 32.
    """
    return _splitmix64(_splitmix64(seed & _MASK64) ^ (position & _MASK64))


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    top_k: torch.Tensor,
    seeds: torch.Tensor,
    output_positions: torch.Tensor,
) -> torch.Tensor:
    """Pick one token per row.

    Rows with ``temperature == 0`` are greedy: exactly ``logits.argmax(-1)``.
    Other rows: logits / temperature, then top-k, then top-p over what top-k
    kept, then one seeded draw. Tokens tied with the last one kept by top-k or
    top-p are kept as well.

    The five parameter tensors should be host (CPU) tensors: they decide on
    the host which rows to sample and how to seed the generators. Tensors on
    ``logits.device`` also work but are read back (a device sync on CUDA).
    Give unseeded requests a random seed when they are admitted.

    Args:
        logits: ``[S, V]`` float32, on any device.
        temperature: ``[S]`` float32, >= 0; 0 means greedy.
        top_p: ``[S]`` float32 in (0, 1]; 1 disables it.
        top_k: ``[S]`` int32/int64; <= 0 disables it.
        seeds: ``[S]`` int64, the request's seed (any 64-bit value).
        output_positions: ``[S]`` int64, position of the token being sampled
            (its output index or its sequence position: anything that
            depends only on the request and the token, never on the batch).

    Returns:
        ``[S]`` int64 token ids on ``logits.device``.

    Raises:
        ValueError: on mismatched shapes, a negative or NaN temperature, or
            top_p outside (0, 1].
    """
    num_rows, vocab = logits.shape
    params = (temperature, top_p, top_k, seeds, output_positions)
    if any(t.shape != (num_rows,) for t in params):
        raise ValueError(f"sampling parameters must all have shape ({num_rows},)")
    temperature, top_p, top_k, seeds, output_positions = (t.cpu() for t in params)
    if not bool((temperature >= 0).all()):
        raise ValueError(f"temperature must be >= 0, got {temperature.tolist()}")
    if not bool(((top_p > 0) & (top_p <= 1)).all()):
        raise ValueError(f"top_p must be in (0, 1], got {top_p.tolist()}")

    tokens = logits.argmax(-1)
    rows = torch.nonzero(temperature > 0).flatten()
    if rows.numel() == 0:
        return tokens

    device = logits.device
    rows_dev = rows.to(device)
    x = logits.index_select(0, rows_dev)
    x.div_(temperature[rows].to(device=device, dtype=x.dtype)[:, None])
    k = top_k[rows].long()
    k = torch.where((k > 0) & (k < vocab), k, 0)
    _filter(x, k, top_p[rows])

    race = torch.empty_like(x)
    generator = torch.Generator(device=device)
    for i, (seed, position) in enumerate(zip(seeds[rows].tolist(), output_positions[rows].tolist(), strict=True)):
        generator.manual_seed(noise_seed(seed, position))
        race[i].uniform_(generator=generator)
    # E = -log U is Exp(1); U < 1 so E > 0 and log E is finite or +inf (U == 0),
    # so no NaN can reach the argmax. (exponential_ is 8x slower on CPU.)
    x.sub_(race.log_().neg_().log_())
    return tokens.index_copy_(0, rows_dev, x.argmax(-1))


def _filter(x: torch.Tensor, k: torch.Tensor, p: torch.Tensor) -> None:
    """Set to -inf, in place, the logits outside each row's top-k then top-p set.

    Args:
        x: ``[R, V]`` temperature-scaled logits, modified in place.
        k: ``[R]`` int64 on the host, 0 where top-k is off.
        p: ``[R]`` float32 on the host, 1 where top-p is off.
    """
    vocab = x.shape[1]
    use_k = k > 0
    use_p = p < 1
    if not bool((use_k | use_p).any()):
        return
    device = x.device
    k_max = int(k.max())
    if not bool(use_p.any()):
        num_cand = k_max
    elif x.is_cpu:
        num_cand = max(k_max, min(vocab, _TOP_P_CANDIDATES))
    else:
        # Sorting is cheap on GPUs, and a fixed length keeps the cumulative
        # sums independent of the other rows' top_k.
        num_cand = vocab
    cand = x.sort(dim=-1, descending=True).values if num_cand >= vocab else x.topk(num_cand, dim=-1).values

    k_limit = torch.where(use_k, k, vocab).to(device)
    if bool(use_k.any()):
        kth = cand.gather(1, (k_limit.clamp(max=num_cand) - 1)[:, None])
        kth.masked_fill_(~use_k.to(device)[:, None], float("-inf"))
        x.masked_fill_(x < kth, float("-inf"))
    if not bool(use_p.any()):
        return

    # Top-p sees the distribution renormalised over what top-k kept.
    lse = x.logsumexp(dim=-1, keepdim=True)
    p_dev = p.to(device=device, dtype=x.dtype)
    kept, threshold = _top_p_threshold(cand, lse, k_limit, p_dev)
    if num_cand < vocab:
        # Rows whose nucleus may extend past the candidates: sort them fully.
        # Only reached on CPU, where these reads are not device syncs.
        short = torch.nonzero(use_p & ~use_k & (kept == num_cand)).flatten()
        if short.numel() > 0:
            full = x.index_select(0, short).sort(dim=-1, descending=True).values
            threshold[short] = _top_p_threshold(full, lse[short], k_limit[short], p_dev[short])[1]
    threshold.masked_fill_(~use_p.to(device), float("-inf"))
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
    kept = keep.sum(dim=-1)
    return kept, cand.gather(1, (kept - 1)[:, None]).squeeze(1)
