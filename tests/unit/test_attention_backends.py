"""Every attention backend equals plain dense causal attention, request by request.

Random steps mix decode rows and prefill chunks of varied contexts, with
varied block sizes, GQA ratios and head sizes, over shuffled (non-contiguous)
block tables whose unused entries hold garbage, read on the device through
each request's req_index as the worker does (docs/design.md, "The worker"). Each case runs through the
backend's own cache writes: earlier steps prefill every request's history, a
few requests at a time, then comes the mixed step under test; every step's
output is compared with a float64 reference, to 1e-5 in float32. Since the
history goes in through the backend, a backend may lay out its cache memory
as it likes.

The CPU backends always run (cpu_paged where its kernel builds, also in
bfloat16 to 2e-2); flashinfer runs where it can (CUDA, the package
installed), in bfloat16 (it has no float32 kernels) to 2e-2, on the cases
whose head size it supports. Further cases give the layer a sliding window
(including windows shorter than a block, and longer than the context) and a
soft-cap on the scores.
"""

from __future__ import annotations

import random
import shutil
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from pipeline.gpu_worker.attention import cpu_paged, make_backend
from pipeline.gpu_worker.attention.backend import StepLayout
from pipeline.gpu_worker.attention.bucket_plan import plan_buckets
from pipeline.gpu_worker.attention.cpu_paged import CpuPagedBackend
from pipeline.gpu_worker.attention.prefix_table import PrefixTable
from pipeline.gpu_worker.attention.torch_bucketed import TorchBucketedBackend
from pipeline.gpu_worker.attention.torch_sdpa import TorchSDPABackend
from pipeline.server_args import build_parser
from pipeline.server_config import make_config

CPU = torch.device("cpu")


@dataclass
class Setup:
    backend: object
    device: torch.device
    dtype: torch.dtype
    atol: float


def _cpu(factory):
    return lambda heads, kv_heads, head_dim, kinds=None: Setup(factory(), CPU, torch.float32, 1e-5)


def _cpu_paged(dtype, atol):
    def setup(heads, kv_heads, head_dim, kinds=None):
        if cpu_paged.unavailable_reason() is not None:
            pytest.skip(f"cpu_paged cannot run here: {cpu_paged.unavailable_reason()}")
        return Setup(CpuPagedBackend(heads, kv_heads, head_dim), CPU, dtype, atol)

    return setup


def _flashinfer(heads, kv_heads, head_dim, kinds=None):
    from pipeline.gpu_worker.attention import flashinfer_paged

    dev = torch.device("cuda")
    if flashinfer_paged.unsupported_reason(dev, torch.bfloat16, head_dim) is not None:
        pytest.skip(f"flashinfer cannot serve head_dim {head_dim} here")
    backend = flashinfer_paged.FlashInferBackend(
        heads, kv_heads, head_dim, torch.bfloat16, dev, kinds=kinds or ((None, None),)
    )
    return Setup(backend, dev, torch.bfloat16, 2e-2)


def _flashinfer_here() -> bool:
    if not torch.cuda.is_available():
        return False
    from pipeline.gpu_worker.attention import flashinfer_paged

    return flashinfer_paged.unsupported_reason(torch.device("cuda"), torch.bfloat16, 64) is None


SETUPS = {
    "torch_sdpa": _cpu(TorchSDPABackend),
    "torch_bucketed": _cpu(TorchBucketedBackend),
    "torch_bucketed_token_major": _cpu(lambda: TorchBucketedBackend(head_major=False)),
    # Small limits, so that random steps make many buckets.
    "torch_bucketed_tight": _cpu(lambda: TorchBucketedBackend(slack=1.05, min_pad=0, min_query_pad=0)),
    "cpu_paged": _cpu_paged(torch.float32, 1e-5),
    "cpu_paged_bf16": _cpu_paged(torch.bfloat16, 2e-2),
    **({"flashinfer": _flashinfer} if _flashinfer_here() else {}),
}


def reference(q, keys, values, query_lens, starts, scale, window=None, softcap=None):
    """Dense causal attention per request in float64, as transformers' eager path with a window and a cap.

    ``keys[i]``/``values[i]`` are request ``i``'s whole ``[context, KVH, D]``.
    """
    out, t = [], 0
    heads = q.shape[1]
    for i, (ql, st) in enumerate(zip(query_lens, starts)):
        k = keys[i].double().repeat_interleave(heads // keys[i].shape[1], 1)
        v = values[i].double().repeat_interleave(heads // keys[i].shape[1], 1)
        qq = q[t : t + ql].double()
        s = torch.einsum("qhd,khd->hqk", qq, k) * scale
        if softcap is not None:
            s = torch.tanh(s / softcap) * softcap
        qpos, kpos = torch.arange(st, st + ql)[None, :, None], torch.arange(st + ql)[None, None, :]
        hidden = (kpos > qpos) | (kpos <= qpos - window if window is not None else False)
        s = s.masked_fill(hidden, float("-inf"))
        out.append(torch.einsum("hqk,khd->qhd", s.softmax(-1), v))
        t += ql
    return torch.cat(out)


class Case:
    """Requests with their whole Q/K/V, a shuffled block table and a cache, for one backend."""

    def __init__(
        self, setup: Setup, query_lens, starts, block_size, heads, kv_heads, head_dim, rng, seed, window=None, cap=None
    ):
        self.setup, self.query_lens, self.starts, self.block_size = setup, query_lens, starts, block_size
        self.window, self.softcap = window, cap
        n = len(query_lens)
        contexts = [s + q for s, q in zip(starts, query_lens)]
        need = [-(-c // block_size) for c in contexts]
        # Shuffled blocks from a pool larger than needed; unused entries are garbage.
        pool = list(range(sum(need) + 7))
        rng.shuffle(pool)
        table = torch.full((n, max(need) + 3), -1, dtype=torch.int64)
        for i, nb in enumerate(need):
            table[i, :nb] = torch.tensor([pool.pop() for _ in range(nb)])
        # Request i's row is req_index i; a step's rows are any subset, in any order.
        self.block_table = table.to(setup.device)
        self.rng = rng
        num_slots = (sum(need) + 7) * block_size
        self.cache = tuple(
            torch.zeros(num_slots, kv_heads, head_dim, dtype=setup.dtype, device=setup.device) for _ in range(2)
        )
        gen = torch.Generator().manual_seed(seed)
        # Values as the backend's dtype can hold them, so the reference sees the same inputs.
        self.q, self.k, self.v = (
            [torch.randn(c, h, head_dim, generator=gen).to(setup.dtype).float() for c in contexts]
            for h in (heads, kv_heads, kv_heads)
        )
        self.scale = head_dim**-0.5

    def step(self, rows, query_lens, starts, check=True, ahead=None, drafts=None):
        """One step of ``rows`` (through the backend's cache writes), checked against the reference.

        ``ahead``: per row, how far past its true start the host layout puts it; the backend gets it
        as the device ``shift`` that moves it back (speculative decoding's upper bounds).
        """
        s = self.setup
        q, k, v = (
            torch.cat([x[r][st : st + n] for r, st, n in zip(rows, starts, query_lens)])
            for x in (self.q, self.k, self.v)
        )
        planned = starts if ahead is None else [st + a for st, a in zip(starts, ahead)]
        layout = StepLayout.build(query_lens, planned, rows, self.block_size, self.block_table.shape[1], drafts)
        shift = None if ahead is None else torch.tensor(ahead, dtype=torch.int64, device=s.device)
        meta = s.backend.build_metadata(layout, self.block_table, self.upload, shift)
        qkv = (x.to(s.device, s.dtype) for x in (q, k, v))
        out = s.backend.forward(*qkv, self.cache, meta, self.scale, self.window, self.softcap)
        assert out.shape == q.shape and out.dtype == s.dtype
        if not check:
            return
        ref = reference(
            q,
            [self.k[r][: st + n] for r, st, n in zip(rows, starts, query_lens)],
            [self.v[r][: st + n] for r, st, n in zip(rows, starts, query_lens)],
            query_lens,
            starts,
            self.scale,
            self.window,
            self.softcap,
        )
        err = (out.cpu().double() - ref).abs().max().item()
        assert err <= s.atol, f"max abs error {err:.2e} > {s.atol:.0e}"

    def upload(self, arrays):
        """The worker's upload, plainly: int64 copies on the backend's device."""
        return [torch.from_numpy(np.asarray(a, dtype=np.int64)).to(self.setup.device) for a in arrays]

    def history(self, check=True):
        """Earlier steps: each request's positions before its start, prefilled a few requests at a time."""
        # Similar lengths together: the padded backend pads a step's prefills to the longest.
        hist = sorted((i for i in range(len(self.starts)) if self.starts[i] > 0), key=lambda i: self.starts[i])
        for j in range(0, len(hist), 4):
            rows = hist[j : j + 4]
            self.step(rows, [self.starts[i] for i in rows], [0] * len(rows), check)

    def run(self, check_history=True, shifted=False, drafts=None):
        """``drafts``: per request, the drafts its last queries verify (None: none)."""
        self.history(check_history)
        rows = list(range(len(self.starts)))
        self.rng.shuffle(rows)
        # Within the block table's three spare columns (entries past a row's context are garbage).
        ahead = [self.rng.randint(0, 3) for _ in rows] if shifted else None
        d = None if drafts is None else [drafts[i] for i in rows]
        self.step(rows, [self.query_lens[i] for i in rows], [self.starts[i] for i in rows], ahead=ahead, drafts=d)


@pytest.mark.parametrize("name", SETUPS)
@pytest.mark.parametrize("seed", range(8))
@torch.inference_mode()
def test_backend_equals_dense_reference(name, seed):
    rng = random.Random(seed)
    block_size = rng.choice([1, 4, 16, 32])
    heads, kv_heads = rng.choice([(4, 4), (8, 2), (9, 3), (6, 1), (16, 4)])
    head_dim = rng.choice([16, 64])
    query_lens, starts = [], []
    for _ in range(rng.randint(1, 12)):
        start = rng.choice([0, rng.randint(0, 40), rng.randint(0, 300), rng.randint(500, 1100)])
        ql = 1 if (start > 0 and rng.random() < 0.6) else rng.choice([2, rng.randint(2, 64), rng.randint(64, 200)])
        query_lens.append(ql)
        starts.append(start)
    setup = SETUPS[name](heads, kv_heads, head_dim)
    Case(setup, query_lens, starts, block_size, heads, kv_heads, head_dim, rng, seed).run()


@pytest.mark.parametrize("name", [n for n in SETUPS if n != "flashinfer"])
@pytest.mark.parametrize("seed", range(4))
@torch.inference_mode()
def test_shift_moves_rows_back_on_the_device(name, seed):
    """A layout planned ahead of each row's true start plus the device shift equals the exact layout: decode
    rows, rows verifying drafts (several of the same query count, as a step's drafting rows are) and
    prefill chunks."""
    rng = random.Random(100 + seed)
    block_size = rng.choice([1, 4, 16])
    query_lens, starts, drafts = [], [], []
    for _ in range(rng.randint(1, 10)):
        start = rng.choice([rng.randint(1, 40), rng.randint(40, 300)])
        query_lens.append(rng.choice([1, 1, 5, 5, rng.randint(2, 30)]))
        starts.append(start)
        drafts.append(query_lens[-1] - 1 if rng.random() < 0.7 else 0)
    setup = SETUPS[name](8, 2, 16)
    Case(setup, query_lens, starts, block_size, 8, 2, 16, rng, seed).run(
        check_history=False, shifted=True, drafts=drafts
    )


@pytest.mark.parametrize("name", SETUPS)
@pytest.mark.parametrize("seed", range(4))
@torch.inference_mode()
def test_sliding_window_and_softcap_equal_the_reference(name, seed):
    """Windows shorter than a block, across blocks, longer than any context; with and without a cap."""
    rng = random.Random(100 + seed)
    block_size = rng.choice([4, 16])
    window = [3, 8, 13, 5000][seed]
    cap = [None, 2.0, 0.5, 1.0][seed]
    query_lens, starts = [], []
    for _ in range(rng.randint(3, 8)):
        start = rng.choice([0, rng.randint(1, 30), rng.randint(30, 200)])
        query_lens.append(1 if start > 0 and rng.random() < 0.6 else rng.randint(2, 40))
        starts.append(start)
    setup = SETUPS[name](8, 2, 64, ((window, cap),))
    Case(setup, query_lens, starts, block_size, 8, 2, 64, rng, seed, window, cap).run()


@pytest.mark.parametrize("name", SETUPS)
@torch.inference_mode()
def test_long_tailed_decode_with_chunks(name):
    """62 decode rows of long-tailed contexts (one of 1,300) beside two prefill chunks, SmolLM2's GQA."""
    gen = np.random.default_rng(0)
    ctx = np.clip(np.exp(gen.normal(size=61) * 0.7) * 250, 1, 1000).astype(int).tolist() + [1300]
    query_lens = [1] * len(ctx) + [96, 17]
    starts = [c - 1 for c in ctx] + [400, 0]
    setup = SETUPS[name](9, 3, 64)
    # History unchecked here (the random cases check prefill): its reference would dominate the time.
    Case(setup, query_lens, starts, 16, 9, 3, 64, random.Random(0), 0).run(check_history=False)


# (heads, KV heads, head_dim) the kernel is compiled for: SmolLM2's, and groups of 4, 1 and 6 at two head sizes.
_KERNEL_SHAPES = [(9, 3, 64), (8, 2, 128), (8, 8, 64), (6, 1, 64)]


@pytest.mark.parametrize("name", SETUPS)
@pytest.mark.parametrize("seed", range(4))
@torch.inference_mode()
def test_rows_verifying_drafts_equal_the_reference(name, seed):
    """Rows of 1, 2, 5, 9, 16 and 32 queries (a last token and its drafts) in one step with prefill chunks,
    some as short as those rows: contexts on and off block boundaries and shorter than the window, with
    windows and soft-caps."""
    rng = random.Random(200 + seed)
    heads, kv_heads, head_dim = _KERNEL_SHAPES[seed]
    window, cap = [(None, None), (7, None), (None, 1.5), (40, 2.0)][seed]
    query_lens = [1, 2, 5, 9, 16, 32, 5, 2, 40, 100, 33, 5, 16]
    drafts = [q - 1 for q in query_lens[:11]] + [0, 0]  # the last two: short prefill chunks
    # Contexts: as short as the row (a fresh prompt), block-aligned, shorter than the window, any.
    contexts = [max(q, c) for q, c in zip(query_lens, [1, 2, 32, 16, 48, 32, 6, 300, 40, 700, 33, 5, 112])]
    contexts = [c + rng.choice([0, 0, rng.randint(1, 200)]) for c in contexts]
    starts = [c - q for q, c in zip(query_lens, contexts)]
    setup = SETUPS[name](heads, kv_heads, head_dim, ((window, cap),))
    if isinstance(setup.backend, CpuPagedBackend):
        # Every row verifying drafts with up to DECODE_QUERY_MAX queries goes to the kernel; prefill
        # chunks, however short, and longer rows to SDPA.
        table = torch.zeros(len(starts), 64, dtype=torch.int64)
        meta = setup.backend.build_from_rows(query_lens, starts, table, 16, drafts)
        assert sorted(int(q) for b in meta.decode for q in b.query_lens) == sorted(
            q for q, d in zip(query_lens, drafts) if q == d + 1 and q <= cpu_paged.DECODE_QUERY_MAX
        )
        assert len(meta.prefill) > 0
    Case(setup, query_lens, starts, 16, heads, kv_heads, head_dim, rng, seed, window, cap).run(drafts=drafts)


@pytest.mark.parametrize("threads", [1, 2, 8])
@torch.inference_mode()
def test_cpu_paged_splits_a_lone_verifying_row_over_threads(threads):
    """A step of one row has fewer (row, KV head) tasks than two per thread: its queries are split into tiles,
    each a task; every split equals the reference."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for q, ctx, window in [(9, 700, None), (5, 37, 8), (2, 2, None), (16, 16, 3)]:
            setup = SETUPS["cpu_paged"](9, 3, 64)
            case = Case(setup, [q], [ctx - q], 16, 9, 3, 64, random.Random(q), q, window)
            case.run(check_history=False, drafts=[q - 1])
    finally:
        torch.set_num_threads(before)


def test_attention_backend_flag_reaches_the_worker_config():
    parser = build_parser()
    assert "--attention-backend" in parser.format_help()
    for flags, expected in ([], "auto"), (["--attention-backend", "torch_sdpa"], "torch_sdpa"):
        config = make_config(parser.parse_args(["--model", "sim", *flags]))
        shutil.rmtree(config.ipc_dir)
        assert config.worker.attention_backend == expected
    with pytest.raises(SystemExit):
        parser.parse_args(["--attention-backend", "nope"])


def test_make_backend_picks_by_name_and_device():
    assert type(make_backend("auto")) is TorchBucketedBackend  # the simulated device: no model shape
    expected = "torch_bucketed" if cpu_paged.unavailable_reason() else "cpu_paged"
    assert make_backend("auto", num_heads=9, num_kv_heads=3, head_dim=64).name == expected
    assert make_backend("torch_bucketed", num_heads=9, num_kv_heads=3, head_dim=64).name == "torch_bucketed"
    assert isinstance(make_backend("torch_sdpa"), TorchSDPABackend)
    with pytest.raises(ValueError, match="CUDA only"):
        make_backend("flashinfer", device=CPU, dtype=torch.bfloat16, num_heads=9, num_kv_heads=3, head_dim=64)
    with pytest.raises(ValueError, match="unknown"):
        make_backend("nope")


@pytest.mark.parametrize("decode_only", [True, False])
def test_plan_buckets_bounds_padding(decode_only):
    rng = np.random.default_rng(0)
    for _ in range(200):
        n = int(rng.integers(1, 300))
        ctx = rng.integers(1, 3000, n)
        ql = np.ones(n, dtype=np.int64) if decode_only else np.where(rng.random(n) < 0.5, 1, rng.integers(1, 512, n))
        slack, min_pad, min_qpad = float(rng.choice([1.0, 1.25, 2.0])), int(rng.choice([0, 64])), 16
        buckets = plan_buckets(ctx, ql, slack, min_pad, min_qpad)
        assert np.array_equal(np.sort(np.concatenate(buckets)), np.arange(n))
        tops = [ctx[b].max() for b in buckets]
        assert tops == sorted(tops, reverse=True)
        for b in buckets:
            assert np.array_equal(b, np.sort(b))
            top = ctx[b].max()
            assert ((top <= slack * ctx[b]) | (top - ctx[b] <= min_pad)).all()
            hi, lo = ql[b].max(), ql[b].min()
            assert hi <= slack * lo or hi - lo <= min_qpad
        if decode_only:  # greedy: the next bucket's longest row did not fit the previous bucket
            for prev, nxt in zip(buckets, buckets[1:]):
                top, c = ctx[prev].max(), ctx[nxt].max()
                assert top > slack * c and top - c > min_pad


def test_plan_buckets_groups_uniform_and_long_tail():
    assert [b.tolist() for b in plan_buckets(np.full(64, 300), np.ones(64, dtype=np.int64))] == [list(range(64))]
    gen = np.random.default_rng(0)
    ctx = np.append(np.clip(np.exp(gen.normal(size=63) * 0.7) * 280, 16, 1000).astype(np.int64), 1300)
    buckets = plan_buckets(ctx, np.ones(64, dtype=np.int64))
    assert len(buckets) <= 16
    padded = sum(len(b) * ctx[b].max() for b in buckets)
    assert padded <= 1.25 * ctx.sum() + 64 * len(ctx)


def test_cpu_paged_falls_back_with_one_log_line(monkeypatch, caplog):
    """Without a compiler (or a failed build) auto keeps torch_bucketed and says why; asked for, cpu_paged refuses."""
    monkeypatch.setattr(cpu_paged, "unavailable_reason", lambda: "no C++ compiler found")
    with caplog.at_level("WARNING"):
        backend = make_backend("auto", num_heads=9, num_kv_heads=3, head_dim=64)
    assert type(backend) is TorchBucketedBackend
    assert [r.getMessage() for r in caplog.records] == [
        "cpu_paged attention unavailable (no C++ compiler found); using torch_bucketed"
    ]
    with pytest.raises(RuntimeError, match="no C\\+\\+ compiler"):
        make_backend("cpu_paged", num_heads=9, num_kv_heads=3, head_dim=64)


def test_cpu_paged_refuses_other_devices_and_dtypes():
    with pytest.raises(ValueError, match="cpu_paged runs on CPU"):
        make_backend("cpu_paged", dtype=torch.float16, num_heads=9, num_kv_heads=3, head_dim=64)


@torch.inference_mode()
def test_cpu_paged_reads_strided_queries_as_the_model_passes_them():
    """The model's q is a slice of the fused QKV output (row stride > H * D); decode rows out of step order."""
    if cpu_paged.unavailable_reason() is not None:
        pytest.skip(f"cpu_paged cannot run here: {cpu_paged.unavailable_reason()}")
    gen = torch.Generator().manual_seed(0)
    heads, kv_heads, dim, bs, slots = 9, 3, 64, 16, 64 * 16
    assert cpu_paged.supports(heads, kv_heads, dim)  # SmolLM2's shape runs the kernel, not the fallback
    qkv = torch.randn(5, heads + 2 * kv_heads, dim, generator=gen)
    q = qkv[:, :heads]
    k_cache, v_cache = (torch.randn(kv_heads, slots, dim, generator=gen) for _ in range(2))
    block_ids = torch.randperm(64, generator=gen)[:15].view(5, 3)
    context_lens = torch.tensor([33, 1, 48, 17, 20])
    token_index = torch.tensor([3, 0, 4, 1, 2])
    out = torch.full((5, heads, dim), float("nan"))
    torch.ops.pipeline_cpu.paged_decode(
        out, q, k_cache, v_cache, token_index, torch.ones(5, dtype=torch.int64), block_ids, context_lens, 0.125, bs,
        0, 0.0,
    )  # fmt: skip
    for r in range(5):
        slot = (block_ids[r][:, None] * bs + torch.arange(bs)).flatten()[: context_lens[r]]
        keys = k_cache[:, slot].repeat_interleave(heads // kv_heads, 0)
        values = v_cache[:, slot].repeat_interleave(heads // kv_heads, 0)
        t = token_index[r]
        ref = (torch.einsum("hd,hkd->hk", q[t].double(), keys.double()) * 0.125).softmax(-1)
        torch.testing.assert_close(out[t].double(), torch.einsum("hk,hkd->hd", ref, values.double()), atol=1e-5, rtol=0)


def test_prefix_table_rows_are_the_comparison_they_replace():
    """Gathered masks equal ``arange(width) < length``: first use, a wider step (the table grows), a
    narrower one (a column slice of the grown table), and past the table's limit (computed)."""
    table = PrefixTable()
    gen = torch.Generator().manual_seed(0)
    for width in (5, 300, 40, 5000):
        lengths = torch.randint(0, width + 1, (64,), generator=gen)
        assert torch.equal(table.rows(lengths, width), torch.arange(width)[None, :] < lengths[:, None])
