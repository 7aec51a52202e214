"""Measure paged-attention candidates on their own (no model), one layer at a time.

Shapes default to SmolLM2-135M (9 query heads, 3 KV heads, head_dim 64, 30
layers), float32, block size 16, over a paged KV cache with shuffled
(non-contiguous) block tables. Each candidate builds its per-step metadata on
the host once, then attends once per layer; layer calls rotate over several layers' caches (so the K/V being read is not
cache-hot, as in a real step), and a "step" is the build plus ``--model-layers``
times the per-layer time. Candidates run round-robin within each repeat and the
fastest repeat is reported (noise from other processes only adds time). The write of the step's own
K/V into the cache is the same for every candidate and is left out.

Cases (64 requests unless ``--batch``):

- ``u300``: every request decodes with a context of 300 tokens;
- ``tail``: long-tailed decode contexts, mean about 295, one of 1,300;
- ``u1300``: every request decodes with a context of 1,300;
- ``mixed``: ``tail``'s decode rows minus two, plus two prefill chunks in the
  same step (320 tokens at position 960 and 128 tokens at position 0).

Candidates:

- ``padded``: the ``torch_sdpa`` backend's algorithm (decode rows padded to
  the longest context, prefill rows to the longest chunk, whole padded K/V
  gathered per layer, one SDPA call per group);
- ``varlen``: gather exactly each decode row's own positions, scores by
  elementwise products, segmented softmax by ``scatter_reduce`` /
  ``index_add``; prefill rows one SDPA call each;
- ``bucket``: decode rows sorted by context into a few buckets (a row joins
  a longer bucket while that bucket's context is at most 1.25x its own or 64
  tokens longer; ``bucket<slack>p<pad>`` to vary), padded SDPA per bucket;
  prefill rows one SDPA call each (the ``torch_bucketed`` backend groups
  those too);
- ``rowloop``: one SDPA call per request over exactly its own blocks;
- ``splitP``: split-K ("flash-decoding") over partitions of P keys: every
  (request, query tile, key partition) is one item of one batched SDPA call
  per group that also returns the log-sum-exp, and the partial results are
  merged per token with ``scatter_reduce`` / ``index_add``; cost follows each
  request's own context rounded up to P;
- ``flex``: ``torch.nn.attention.flex_attention`` (compiled by inductor) over
  the gathered blocks of each row, with a block mask (``flex<q>x<kv>`` sets
  its block sizes, default 128x128); reported with its compile time.

Any candidate name ending in ``-hnd`` runs over a head-major cache
(``[KVH, slots, D]``, as ``torch_bucketed`` uses it) instead of the worker's
token-major one.

    .venv/bin/python scripts/bench_attention.py
    .venv/bin/python scripts/bench_attention.py --cases tail --candidates padded split64 --repeat 5
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import torch
import torch.nn.functional as F

_sdpa_lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


# ----------------------------------------------------------------- workloads


def long_tailed_contexts(n: int, mean: float, longest: int, seed: int = 0) -> list[int]:
    """``n`` contexts with one of ``longest`` and the rest log-normal, total ``n * mean``."""
    gen = torch.Generator().manual_seed(seed)
    rest = torch.exp(torch.randn(n - 1, generator=gen, dtype=torch.float64) * 0.7)
    target = n * mean - longest
    rest = rest / rest.sum() * target
    ctx = rest.round().clamp(16, longest - 1).long().tolist()
    ctx[-1] += int(target - sum(ctx))  # exact total
    return sorted(ctx + [longest], key=lambda _: torch.rand(1, generator=gen).item())


def make_case(name: str, batch: int) -> tuple[list[int], list[int]]:
    """``(query_lens, start_positions)`` of a case."""
    if name == "u300":
        return [1] * batch, [299] * batch
    if name == "u1300":
        return [1] * batch, [1299] * batch
    tail = long_tailed_contexts(batch, 295, 1300)
    if name == "tail":
        return [1] * batch, [c - 1 for c in tail]
    if name == "mixed":
        dec = tail[2:] if 1300 in tail[2:] else tail[:-2]
        return [1] * len(dec) + [320, 128], [c - 1 for c in dec] + [960, 0]
    raise ValueError(name)


# ----------------------------------------------------------------- helpers


def reference(q, k_cache, v_cache, query_lens, starts, block_table, bs, scale):
    """Dense causal attention per request, float64, over the positions it may see."""
    out = torch.empty_like(q)
    t = 0
    kvh = k_cache.shape[1]
    for i, (ql, st) in enumerate(zip(query_lens.tolist(), starts.tolist())):
        ctx = st + ql
        pos = torch.arange(ctx)
        idx = block_table[i, pos // bs] * bs + pos % bs
        k = k_cache[idx].double().repeat_interleave(q.shape[1] // kvh, 1)  # [C, H, D]
        v = v_cache[idx].double().repeat_interleave(q.shape[1] // kvh, 1)
        qq = q[t : t + ql].double()
        s = torch.einsum("qhd,khd->hqk", qq, k) * scale
        qpos = torch.arange(st, ctx)
        s = s.masked_fill(pos[None, None, :] > qpos[None, :, None], float("-inf"))
        out[t : t + ql] = torch.einsum("hqk,khd->qhd", s.softmax(-1), v).to(q.dtype)
        t += ql
    return out


def _block_ids(block_table, rows, n_blocks, ctx, bs):
    cols = torch.arange(n_blocks)
    needed = cols[None, :] * bs < ctx[:, None]
    return torch.where(needed, block_table[rows, :n_blocks], 0)


class _Scratch:
    """Reused gather buffers (two: keys and values), as the backends keep.

    A fresh multi-megabyte tensor per call is mmap'ed and page-faulted in on
    every use by glibc, which would swamp what is measured here.
    """

    def __init__(self):
        self.bufs = [torch.empty(0), torch.empty(0)]
        self.turn = 0

    def get(self, numel):
        i = self.turn
        self.turn ^= 1
        if self.bufs[i].numel() < numel:
            self.bufs[i] = torch.empty(numel)
        return self.bufs[i][:numel]


_SCRATCH = _Scratch()


class Hnd:
    """A head-major cache ``t [KVH, slots, D]``; ``shape`` reads like the token-major one."""

    def __init__(self, t):
        self.t = t
        self.shape = (t.shape[1], t.shape[0], t.shape[2])


def _gather(cache, block_ids, bs):
    """``[rows, n_blocks]`` block ids -> ``[rows, KVH, n_blocks * bs, D]`` view (into scratch).

    ``cache`` is ``[slots, KVH, D]`` (token-major, the worker's layout) or a
    ``Hnd`` ``[KVH, slots, D]`` (head-major: each row's keys of one head
    come out contiguous).
    """
    rows, nb = block_ids.shape
    if isinstance(cache, Hnd):
        kvh, _, d = cache.t.shape
        shape = (kvh, rows * nb, bs, d)
        out = _SCRATCH.get(math.prod(shape)).view(shape)
        g = torch.index_select(cache.t.view(kvh, -1, bs, d), 1, block_ids.flatten(), out=out)
        return g.view(kvh, rows, nb * bs, d).transpose(0, 1)
    _, kvh, d = cache.shape
    shape = (rows * nb, bs, kvh, d)
    out = _SCRATCH.get(math.prod(shape)).view(shape)
    g = torch.index_select(cache.view(-1, bs, kvh, d), 0, block_ids.flatten(), out=out)
    return g.view(rows, nb * bs, kvh, d).transpose(1, 2)


def _per_row_sdpa(q, k_cache, v_cache, rows_meta, out, bs, scale):
    """One SDPA call per request: exact blocks, causal offset mask."""
    for tok0, ql, ids, mask in rows_meta:
        k = _gather(k_cache, ids, bs)
        v = _gather(v_cache, ids, bs)
        qq = q[tok0 : tok0 + ql].transpose(0, 1)[None]
        out[tok0 : tok0 + ql] = F.scaled_dot_product_attention(qq, k, v, attn_mask=mask, scale=scale, enable_gqa=True)[
            0
        ].transpose(0, 1)


def _row_meta(i, tok0, ql, st, block_table, bs):
    ctx = st + ql
    nb = (ctx + bs - 1) // bs
    ids = block_table[i : i + 1, :nb]
    qpos = torch.arange(st, ctx)
    mask = (torch.arange(nb * bs)[None, :] <= qpos[:, None])[None, None]
    return tok0, ql, ids, mask


# ----------------------------------------------------------------- candidates


class Padded:
    """The torch_sdpa backend's algorithm."""

    def build(self, query_lens, starts, block_table, bs):
        token_starts = torch.cumsum(query_lens, 0) - query_lens
        groups = []
        for sel in (query_lens == 1, query_lens > 1):
            rows = torch.nonzero(sel).flatten()
            if rows.numel() == 0:
                groups.append(None)
                continue
            ql, st = query_lens[rows], starts[rows]
            ctx = st + ql
            q_max = int(ql.max())
            nb = (int(ctx.max()) + bs - 1) // bs
            q_off = torch.minimum(torch.arange(q_max)[None, :], (ql - 1)[:, None])
            token_index = token_starts[rows][:, None] + q_off
            qpos = st[:, None] + q_off
            ids = _block_ids(block_table, rows, nb, ctx, bs)
            mask = (torch.arange(nb * bs)[None, None, :] <= qpos[:, :, None]).unsqueeze(1)
            real = (torch.arange(q_max)[None, :] < ql[:, None]).flatten()
            out_rows = torch.nonzero(real).flatten()
            groups.append((token_index, ids, mask, out_rows, token_index.flatten()[out_rows]))
        return groups

    def forward(self, q, k_cache, v_cache, meta, bs, scale):
        t, h, d = q.shape
        kvh = k_cache.shape[1]
        out = q.new_empty(t, h, d)
        dec, pre = meta
        if dec is not None:
            token_index, ids, mask, _, out_tokens = dec
            rows = token_index.shape[0]
            k, v = _gather(k_cache, ids, bs), _gather(v_cache, ids, bs)
            qd = q.index_select(0, out_tokens).reshape(rows, kvh, h // kvh, d)
            res = F.scaled_dot_product_attention(qd, k, v, attn_mask=mask, scale=scale)
            out.index_copy_(0, out_tokens, res.reshape(rows, h, d))
        if pre is not None:
            token_index, ids, mask, out_rows, out_tokens = pre
            rows, q_max = token_index.shape
            k, v = _gather(k_cache, ids, bs), _gather(v_cache, ids, bs)
            qp = q.index_select(0, token_index.flatten()).view(rows, q_max, h, d).transpose(1, 2)
            res = F.scaled_dot_product_attention(qp, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
            res = res.transpose(1, 2).reshape(rows * q_max, h, d)
            out.index_copy_(0, out_tokens, res.index_select(0, out_rows))
        return out


class Varlen:
    """Exact per-token gather for decode rows, segmented softmax with scatter ops."""

    def build(self, query_lens, starts, block_table, bs):
        token_starts = torch.cumsum(query_lens, 0) - query_lens
        dec = torch.nonzero(query_lens == 1).flatten()
        ctx = (starts + query_lens)[dec]
        row_of_key = torch.repeat_interleave(torch.arange(dec.numel()), ctx)
        key_start = torch.cumsum(ctx, 0) - ctx
        pos = torch.arange(int(ctx.sum())) - key_start[row_of_key]
        kidx = block_table[dec[row_of_key], pos // bs] * bs + pos % bs
        pre = [
            _row_meta(int(i), int(token_starts[i]), int(query_lens[i]), int(starts[i]), block_table, bs)
            for i in torch.nonzero(query_lens > 1).flatten()
        ]
        return token_starts[dec], row_of_key, kidx, pre

    def forward(self, q, k_cache, v_cache, meta, bs, scale):
        dec_tokens, row_of_key, kidx, pre = meta
        t, h, d = q.shape
        kvh = k_cache.shape[1]
        g = h // kvh
        out = q.new_empty(t, h, d)
        b = dec_tokens.numel()
        if b:
            qd = q.index_select(0, dec_tokens).view(b, kvh, g, d) * scale
            k = torch.index_select(k_cache, 0, kidx, out=_SCRATCH.get(kidx.numel() * kvh * d).view(-1, kvh, d))
            v = torch.index_select(v_cache, 0, kidx, out=_SCRATCH.get(kidx.numel() * kvh * d).view(-1, kvh, d))
            s = (qd.index_select(0, row_of_key) * k[:, :, None, :]).sum(-1)  # [N, KVH, G]
            m = s.new_full((b, kvh, g), float("-inf")).scatter_reduce_(
                0, row_of_key[:, None, None].expand_as(s), s, "amax"
            )
            p = torch.exp(s - m.index_select(0, row_of_key))
            den = s.new_zeros(b, kvh, g).index_add_(0, row_of_key, p)
            num = s.new_zeros(b, kvh, g, d).index_add_(0, row_of_key, p[..., None] * v[:, :, None, :])
            out.index_copy_(0, dec_tokens, (num / den[..., None]).view(b, h, d))
        _per_row_sdpa(q, k_cache, v_cache, pre, out, bs, scale)
        return out


class Bucket:
    """Decode rows in a few length buckets, padded SDPA per bucket."""

    def __init__(self, slack: float = 1.25, min_pad: int = 64):
        self.slack, self.min_pad = slack, min_pad

    def build(self, query_lens, starts, block_table, bs):
        token_starts = torch.cumsum(query_lens, 0) - query_lens
        dec = torch.nonzero(query_lens == 1).flatten()
        ctx = (starts + query_lens)[dec]
        order = torch.argsort(ctx, descending=True)
        buckets = []
        i, n = 0, order.numel()
        ctx_sorted = ctx[order].tolist()
        while i < n:
            top = ctx_sorted[i]
            j = i
            while j < n and (ctx_sorted[j] * self.slack >= top or top - ctx_sorted[j] <= self.min_pad):
                j += 1
            rows = dec[order[i:j]]
            c = ctx[order[i:j]]
            nb = (top + bs - 1) // bs
            ids = _block_ids(block_table, rows, nb, c, bs)
            mask = (torch.arange(nb * bs)[None, :] < c[:, None])[:, None, None, :]
            buckets.append((token_starts[rows], ids, mask))
            i = j
        pre = [
            _row_meta(int(i), int(token_starts[i]), int(query_lens[i]), int(starts[i]), block_table, bs)
            for i in torch.nonzero(query_lens > 1).flatten()
        ]
        return buckets, pre

    def forward(self, q, k_cache, v_cache, meta, bs, scale):
        buckets, pre = meta
        t, h, d = q.shape
        kvh = k_cache.shape[1]
        out = q.new_empty(t, h, d)
        for toks, ids, mask in buckets:
            rows = toks.numel()
            k, v = _gather(k_cache, ids, bs), _gather(v_cache, ids, bs)
            qd = q.index_select(0, toks).view(rows, kvh, h // kvh, d)
            res = F.scaled_dot_product_attention(qd, k, v, attn_mask=mask, scale=scale)
            out.index_copy_(0, toks, res.reshape(rows, h, d))
        _per_row_sdpa(q, k_cache, v_cache, pre, out, bs, scale)
        return out


class RowLoop:
    """One SDPA call per request over its own blocks."""

    def build(self, query_lens, starts, block_table, bs):
        token_starts = torch.cumsum(query_lens, 0) - query_lens
        return [
            _row_meta(i, int(token_starts[i]), int(query_lens[i]), int(starts[i]), block_table, bs)
            for i in range(query_lens.numel())
        ]

    def forward(self, q, k_cache, v_cache, meta, bs, scale):
        out = torch.empty_like(q)
        _per_row_sdpa(q, k_cache, v_cache, meta, out, bs, scale)
        return out


class Split:
    """Split-K over partitions of ``P`` keys, merged by log-sum-exp."""

    def __init__(self, part: int, q_tile: int = 32):
        self.part, self.q_tile = part, q_tile

    def build(self, query_lens, starts, block_table, bs):
        P, Qt = self.part, self.q_tile
        assert P % bs == 0
        bpp = P // bs
        token_starts = torch.cumsum(query_lens, 0) - query_lens
        ctx = starts + query_lens
        num_tokens = int(query_lens.sum())
        groups = []
        for sel, qt in ((query_lens == 1, 1), (query_lens > 1, Qt)):
            rows = torch.nonzero(sel).flatten()
            if rows.numel() == 0:
                groups.append(None)
                continue
            ql, st, c = query_lens[rows], starts[rows], ctx[rows]
            # tiles of qt queries per row
            n_tiles = (ql + qt - 1) // qt
            row_of_tile = torch.repeat_interleave(torch.arange(rows.numel()), n_tiles)
            tile_idx = torch.arange(int(n_tiles.sum())) - (torch.cumsum(n_tiles, 0) - n_tiles)[row_of_tile]
            q_first = tile_idx * qt
            q_last = torch.minimum(q_first + qt, ql[row_of_tile]) - 1  # offsets in chunk
            max_pos = st[row_of_tile] + q_last
            n_parts = max_pos // P + 1
            tile_of_item = torch.repeat_interleave(torch.arange(n_tiles.sum()), n_parts)
            part = torch.arange(int(n_parts.sum())) - (torch.cumsum(n_parts, 0) - n_parts)[tile_of_item]
            r = row_of_tile[tile_of_item]
            key_pos = part[:, None] * P + torch.arange(P)[None, :]  # [I, P]
            bcol = part[:, None] * bpp + torch.arange(bpp)[None, :]
            needed = bcol * bs < c[r][:, None]
            ids = torch.where(needed, block_table[rows[r][:, None], bcol.clamp(max=block_table.shape[1] - 1)], 0)
            q_off = q_first[tile_of_item][:, None] + torch.arange(qt)[None, :]  # [I, qt]
            real_q = q_off <= q_last[tile_of_item][:, None]
            q_off = torch.minimum(q_off, q_last[tile_of_item][:, None])
            qpos = st[r][:, None] + q_off
            tok = token_starts[rows][r][:, None] + q_off  # [I, qt]
            allowed = key_pos[:, None, :] <= qpos[:, :, None]  # [I, qt, P]
            live = allowed[:, :, 0] & real_q  # has at least one key and is a real query
            tok_out = torch.where(live, tok, num_tokens)  # dead slots go to a scratch row
            mask = torch.zeros(allowed.shape, dtype=torch.float32).masked_fill_(~allowed, float("-inf"))
            groups.append((tok.flatten(), ids, mask[:, None], tok_out.flatten(), live, qt))
        return groups, num_tokens

    def forward(self, q, k_cache, v_cache, meta, bs, scale):
        groups, num_tokens = meta
        t, h, d = q.shape
        kvh = k_cache.shape[1]
        g = h // kvh
        parts = []
        for grp in groups:
            if grp is None:
                continue
            tok, ids, mask, tok_out, live, qt = grp
            items = ids.shape[0]
            k, v = _gather(k_cache, ids, bs), _gather(v_cache, ids, bs)
            qi = q.index_select(0, tok).view(items, qt, kvh, g, d).transpose(1, 2).reshape(items, kvh, qt * g, d)
            m = mask if qt == 1 else mask.repeat_interleave(g, 2)
            o, lse = _sdpa_lse(qi, k, v, 0.0, False, attn_mask=m, scale=scale)
            o = o.view(items, kvh, qt, g, d).transpose(1, 2).reshape(items * qt, h, d)
            lse = lse.view(items, kvh, qt, g).transpose(1, 2).reshape(items * qt, h)
            if qt > 1:
                lse = lse.masked_fill(~live.flatten()[:, None], float("-inf"))
            parts.append((o, lse, tok_out))
        mx = q.new_full((num_tokens + 1, h), float("-inf"))
        for _o, lse, tok_out in parts:
            mx.scatter_reduce_(0, tok_out[:, None].expand_as(lse), lse, "amax")
        den = q.new_zeros(num_tokens + 1, h)
        num = q.new_zeros(num_tokens + 1, h, d)
        for o, lse, tok_out in parts:
            w = torch.exp(lse - mx.index_select(0, tok_out))
            den.index_add_(0, tok_out, w)
            num.index_add_(0, tok_out, o * w[..., None])
        return num[:num_tokens] / den[:num_tokens, :, None]


class Flex:
    """flex_attention over the gathered blocks of each row (decode rows only)."""

    def __init__(self, q_block: int = 128, kv_block: int = 128):
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        self.block = (q_block, kv_block)
        self.create_block_mask = create_block_mask
        self.flex = torch.compile(flex_attention, dynamic=True)

    def build(self, query_lens, starts, block_table, bs):
        token_starts = torch.cumsum(query_lens, 0) - query_lens
        dec = torch.nonzero(query_lens == 1).flatten()
        ctx = (starts + query_lens)[dec]
        # one flat key sequence: the exact blocks of every row, one after another
        nbs = (ctx + bs - 1) // bs
        row_of_block = torch.repeat_interleave(torch.arange(dec.numel()), nbs)
        col = torch.arange(int(nbs.sum())) - (torch.cumsum(nbs, 0) - nbs)[row_of_block]
        ids = block_table[dec[row_of_block], col]
        key_row = torch.repeat_interleave(row_of_block, bs)
        key_pos = torch.repeat_interleave(col, bs) * bs + torch.arange(bs).repeat(col.numel())
        key_ok = key_pos < ctx[key_row]
        qrow = torch.arange(dec.numel())

        def mask_mod(b, hh, q_idx, kv_idx):
            return (key_row[kv_idx] == qrow[q_idx]) & key_ok[kv_idx]

        bm = self.create_block_mask(
            mask_mod, None, None, dec.numel(), key_row.numel(), device="cpu", BLOCK_SIZE=self.block
        )
        return token_starts[dec], ids, bm

    def forward(self, q, k_cache, v_cache, meta, bs, scale):
        toks, ids, bm = meta
        t, h, d = q.shape
        kvh = k_cache.shape[1]
        k = k_cache.view(-1, bs, kvh, d).index_select(0, ids).view(1, -1, kvh, d).transpose(1, 2)
        v = v_cache.view(-1, bs, kvh, d).index_select(0, ids).view(1, -1, kvh, d).transpose(1, 2)
        qd = q.index_select(0, toks).transpose(0, 1)[None]
        res = self.flex(qd, k, v, block_mask=bm, scale=scale, enable_gqa=True)
        out = q.new_zeros(t, h, d)
        out.index_copy_(0, toks, res[0].transpose(0, 1))
        return out


def candidates(names):
    made = {}
    for full in names:
        n = full.removesuffix("-hnd")
        if n == "padded":
            made[full] = Padded()
        elif n == "varlen":
            made[full] = Varlen()
        elif n.startswith("bucket"):  # bucket[<slack>[p<min_pad>]]
            slack, _, pad = n[6:].partition("p")
            made[full] = Bucket(float(slack or 1.25), int(pad or 64))
        elif n == "rowloop":
            made[full] = RowLoop()
        elif n.startswith("split"):
            made[full] = Split(int(n[5:]))
        elif n.startswith("flex"):  # flex or flex<q_block>x<kv_block>
            made[full] = Flex(*(int(x) for x in n[4:].split("x"))) if n != "flex" else Flex()
        else:
            raise ValueError(n)
        made[full].hnd = full.endswith("-hnd")
    return made


# ----------------------------------------------------------------- driver


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", nargs="+", default=["u300", "tail", "u1300", "mixed"])
    p.add_argument(
        "--candidates", nargs="+", default=["padded", "varlen", "bucket", "rowloop", "split32", "split64", "split128"]
    )
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--model-layers", type=int, default=30, help="layers of the model: step = build + this x layer")
    p.add_argument("--layers", type=int, default=8, help="layer calls timed per repeat")
    p.add_argument("--caches", type=int, default=4, help="distinct layer caches the layers rotate over")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--repeat", type=int, default=5, help="timed rounds per case (minimum and median reported)")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument(
        "--clock",
        choices=["wall", "cpu"],
        default="wall",
        help="cpu: this process's CPU time (with --threads 1, steadier on a loaded machine)",
    )
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    bs, h, kvh, d = args.block_size, args.heads, args.kv_heads, args.head_dim
    scale = d**-0.5
    cands = candidates(args.candidates)
    clock = time.perf_counter if args.clock == "wall" else time.process_time
    print(
        f"torch {torch.__version__} threads={torch.get_num_threads()} clock={args.clock} H={h} KVH={kvh} D={d} "
        f"layers={args.layers} block_size={bs} float32"
    )
    rows = []
    with torch.inference_mode():
        for case in args.cases:
            ql_list, st_list = make_case(case, args.batch)
            query_lens, starts = torch.tensor(ql_list), torch.tensor(st_list)
            ctx = starts + query_lens
            nbs = (ctx + bs - 1) // bs
            total_blocks = int(nbs.sum())
            gen = torch.Generator().manual_seed(1)
            perm = torch.randperm(total_blocks + 8, generator=gen)[:total_blocks] + 1  # block 0 unused
            block_table = torch.zeros(len(ql_list), int(nbs.max()) + 2, dtype=torch.int64)
            o = 0
            for i, n in enumerate(nbs.tolist()):
                block_table[i, :n] = perm[o : o + n]
                o += n
            num_slots = (total_blocks + 9) * bs
            caches = [(torch.randn(num_slots, kvh, d), torch.randn(num_slots, kvh, d)) for _ in range(args.caches)]
            hnd = [tuple(Hnd(c.transpose(0, 1).contiguous()) for c in pair) for pair in caches]
            q = torch.randn(int(query_lens.sum()), h, d)
            ref = reference(q, *caches[0], query_lens, starts, block_table, bs, scale)
            print(
                f"\ncase {case}: {len(ql_list)} rows, {int(query_lens.sum())} tokens, "
                f"contexts mean {ctx.float().mean():.0f} max {int(ctx.max())}, "
                f"keys {int(ctx.sum())} (padded to the longest: {len(ql_list) * int(ctx.max())})"
            )
            metas, errs = {}, {}
            for name, cand in list(cands.items()):
                try:
                    t0 = time.perf_counter()
                    meta = cand.build(query_lens, starts, block_table, bs)
                    out = cand.forward(q, *(hnd if cand.hnd else caches)[0], meta, bs, scale)
                    first = time.perf_counter() - t0
                except Exception as e:  # noqa: BLE001 - report and go on
                    print(f"  {name:>9}: failed: {type(e).__name__}: {str(e)[:300]}")
                    continue
                metas[name] = meta
                errs[name] = ((out - ref).abs().max().item(), first)
            # Round-robin over the candidates, so load from other processes
            # hits them alike; the minimum is the least disturbed run.
            times = {n: ([], []) for n in metas}
            for _ in range(args.repeat):
                for name in metas:
                    cand = cands[name]
                    t0 = clock()
                    meta = cand.build(query_lens, starts, block_table, bs)
                    t1 = clock()
                    for layer in range(args.layers):
                        cand.forward(q, *(hnd if cand.hnd else caches)[layer % args.caches], meta, bs, scale)
                    t2 = clock()
                    times[name][0].append(t1 - t0)
                    times[name][1].append((t2 - t1) / args.layers)
            for name in metas:
                bl, ly = times[name]
                b, l_ = min(bl) * 1e3, min(ly) * 1e3
                step = b + args.model_layers * l_
                med = statistics.median(x + args.model_layers * y for x, y in zip(bl, ly)) * 1e3
                err, first = errs[name]
                rows.append((case, name, b, l_, step, err, first))
                print(
                    f"  {name:>9}: build {b:7.2f} ms  layer {l_:7.2f} ms  step {step:8.1f} ms "
                    f"(median {med:8.1f})  max err {err:.1e}  first call {first * 1e3:.0f} ms",
                    flush=True,
                )
    print("\nstep ms (build + model layers x fastest per-layer); ratio = case / u300 of the same candidate")
    names = list(cands)
    cases = list(dict.fromkeys(r[0] for r in rows))
    print(f"{'candidate':>10} " + " ".join(f"{c:>9}" for c in cases) + "  tail/u300")
    by = {(r[0], r[1]): r[4] for r in rows}
    for n in names:
        line = f"{n:>10} " + " ".join(f"{by.get((c, n), math.nan):9.1f}" for c in cases)
        if ("tail", n) in by and ("u300", n) in by:
            line += f"  {by[('tail', n)] / by[('u300', n)]:9.2f}"
        print(line)


if __name__ == "__main__":
    main()
