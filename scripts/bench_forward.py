"""Time bare forward steps of the paged Llama model.

Decode: one step of ``batch`` sequences, each with ``--context`` tokens already
cached (the cache content does not change the cost, so it is left as zeros).
Prefill: one ``--prefill-chunk``-token chunk of a fresh sequence.
The step time includes the metadata build, the forward and the logits of the
sampled rows, not sampling.

    python scripts/bench_forward.py --model-dir DIR --batch 1 8 64 --dtype float32

``--cases`` instead times steps of ``--batch`` requests (64 by default) with
different context mixes, for each ``--attention-backends`` backend, round-robin
in one run (on a shared machine only figures measured together compare), and
prints each case's step time and its ratio to ``u300`` for the same backend:

- ``u300``: every request decodes with 300 tokens of context;
- ``tail``: long-tailed contexts of the same mean (about 295), one of 1,300;
- ``u1300``: every request decodes with 1,300 tokens of context;
- ``mixed``: ``tail`` less one short decode row, plus two prefill chunks in
  the same step (320 tokens at position 960, 128 tokens at position 0);
- ``chunks``: those two prefill chunks alone (``mixed`` should cost about
  ``tail`` + ``chunks``);
- ``verify``: every request verifies 4 drafts (query 5, speculative
  decoding's verify row) with 300 tokens of context; ``--batch 1`` is
  speculation at concurrency 1;
- ``spec<q>c<ctx>``, e.g. ``spec5c700``: every request verifies speculative
  drafts, ``q`` queries (its last token and ``q - 1`` drafts) ending at a context
  of ``ctx`` tokens.

    python scripts/bench_forward.py --cases u300 tail u1300 mixed chunks \
        --attention-backends torch_sdpa torch_bucketed --repeat 5

``cpu_paged_q<N>`` is ``cpu_paged`` sending rows of up to ``N`` queries to its
kernel (``cpu_paged_q1``: verify rows take the SDPA path); with the ``spec``
cases it compares the two paths in one run:

    python scripts/bench_forward.py --batch 1 --cases spec5c700 spec16c300 \
        --attention-backends cpu_paged cpu_paged_q1 --repeat 20

With several ``--dtype`` (``float32 bfloat16``) or ``--weights`` (``packed
dense``: the linear weights packed for oneDNN after loading, as served, or
left dense) each case is timed for each model too, and each column's time is
also given as a ratio to the first model's; ``--greedy-agreement N`` then
compares N greedy tokens of each model with the first's on a few fixed
prompts: the fraction of the first model's tokens the other picks given the
same context, and how many tokens it generates free-running before the first
difference.

    python scripts/bench_forward.py --cases u300 tail --attention-backends torch_bucketed \
        --dtype float32 bfloat16 --greedy-agreement 32
    python scripts/bench_forward.py --cases u300 verify --batch 1 --weights packed dense --repeat 20
"""

from __future__ import annotations

import argparse
import re
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from pipeline.gpu_worker.attention import make_backend
from pipeline.gpu_worker.attention.cpu_paged import CpuPagedBackend
from pipeline.gpu_worker.attention.torch_bucketed import TorchBucketedBackend
from pipeline.gpu_worker.models.loader import build_model, load_config, read_checkpoint


def _step(model, kv_caches, query_lens, starts, block_table, block_size, drafts=None) -> None:
    meta = model.attn_backend.build_from_rows(query_lens, starts, block_table, block_size, drafts)
    input_ids = torch.zeros(meta.num_tokens, dtype=torch.int64)
    hidden = model(input_ids, meta.positions, meta, kv_caches)
    last = torch.cumsum(query_lens, 0) - 1
    model.compute_logits(hidden.index_select(0, last))


def _time(fn, warmup: int, iters: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def long_tailed_contexts(n: int, mean: float, longest: int, seed: int = 0) -> list[int]:
    """``n`` contexts: one of ``longest``, the rest log-normal (sigma 0.7), ``n * mean`` in all, shuffled."""
    rng = np.random.default_rng(seed)
    rest = np.exp(rng.normal(size=n - 1) * 0.7)
    target = n * mean - longest
    ctx = np.clip(np.round(rest / rest.sum() * target), 16, longest - 1).astype(int)
    ctx[-1] += int(target - ctx.sum())  # exact total
    out = np.append(ctx, longest)
    rng.shuffle(out)
    return out.tolist()


def make_case(name: str, batch: int) -> tuple[list[int], list[int]]:
    """``(query_lens, start_positions)`` of one of the ``--cases`` (see the module docstring)."""
    if m := re.fullmatch(r"spec(\d+)c(\d+)", name):
        q, ctx = int(m[1]), int(m[2])
        if not 1 <= q <= ctx:
            raise ValueError(f"case {name!r}: need 1 <= queries <= context")
        return [q] * batch, [ctx - q] * batch
    if name in ("u300", "u1300"):
        ctx = int(name[1:])
        return [1] * batch, [ctx - 1] * batch
    if name == "verify":
        return [5] * batch, [295] * batch
    tail = long_tailed_contexts(batch, 295, 1300)
    if name == "tail":
        return [1] * batch, [c - 1 for c in tail]
    if name == "mixed":
        dec = sorted(tail)[:1] + sorted(tail)[2:]  # drop one short row, keep the long one
        return [1] * len(dec) + [320, 128], [c - 1 for c in dec] + [960, 0]
    if name == "chunks":
        return [320, 128], [960, 0]
    raise ValueError(f"unknown case {name!r}")


def load(model_dir: str, dtype: torch.dtype, weights: str) -> torch.nn.Module:
    """The model as ``load_model`` makes it, its linear weights ``packed`` (as served) or left ``dense``."""
    model = build_model(load_config(model_dir), dtype, torch.device("cpu"))
    model.load_weights(read_checkpoint(Path(model_dir)))
    if weights == "packed":
        model.pack_weights()
    return model


def _dtype(model: torch.nn.Module) -> torch.dtype:
    return model.model.norm.weight.dtype


def run_cases(args, models: dict[str, torch.nn.Module]) -> None:
    """Time ``args.cases`` x ``models`` (by label) x ``args.attention_backends``, round-robin; print the table."""
    bs = args.block_size
    batch = args.batch[0] if len(args.batch) == 1 else 64
    cases = {c: make_case(c, batch) for c in args.cases}
    need = {c: [-(-(s + q) // bs) for q, s in zip(*cases[c], strict=True)] for c in cases}
    num_blocks = max(sum(n) for n in need.values())
    gen = torch.Generator().manual_seed(0)
    tables = {}
    for c, n in need.items():  # shuffled block ids: a real cache is fragmented
        perm = torch.randperm(num_blocks, generator=gen)
        table = torch.zeros(len(n), max(n), dtype=torch.int64)
        o = 0
        for i, k in enumerate(n):
            table[i, :k] = perm[o : o + k]
            o += k
        tables[c] = table
    # One column per (model, backend); each model has its own cache.
    columns = {}
    for label, model in models.items():
        dtype = _dtype(model)
        kv_caches = model.allocate_kv_caches(num_blocks, bs, dtype, torch.device("cpu"))
        cfg = model.config
        for name in args.attention_backends:
            shape = (cfg.num_attention_heads, cfg.num_key_value_heads, model.head_dim)
            if name == "torch_bucketed_token_major":
                backend = TorchBucketedBackend(head_major=False)
            elif m := re.fullmatch(r"cpu_paged_q(\d+)", name):
                backend = CpuPagedBackend(*shape, decode_query_max=int(m[1]))
            else:
                backend = make_backend(name, dtype=dtype, num_heads=shape[0], num_kv_heads=shape[1], head_dim=shape[2])
            columns[(name, label)] = (model, kv_caches, backend)
    times: dict[tuple[str, str], list[float]] = {(c, b): [] for c in cases for b in columns}
    clock = time.perf_counter if args.clock == "wall" else time.process_time
    print(
        f"threads={torch.get_num_threads()} models={' '.join(models)} batch={batch} block_size={bs} "
        f"repeat={args.repeat} clock={args.clock} (ms per step: median, min)"
    )
    with torch.inference_mode():
        for r in range(args.warmup + args.repeat):
            for c, (q, s) in cases.items():
                ql, st = torch.tensor(q), torch.tensor(s)
                # The verify cases' rows are a last token and its drafts; the others decode or prefill.
                drafts = ql - 1 if c == "verify" or c.startswith("spec") else None
                for b, (model, kv_caches, backend) in columns.items():
                    model.attn_backend = backend
                    t0 = clock()
                    _step(model, kv_caches, ql, st, tables[c], bs, drafts)
                    if r >= args.warmup:
                        times[(c, b)].append((clock() - t0) * 1e3)
    base = "u300" if "u300" in cases else next(iter(cases))
    names = {b: b[0] if len(models) == 1 else "/".join(b) for b in columns}
    print(
        f"{'case':>6} {'rows':>5} {'tokens':>7} {'ctx mean':>9} {'ctx max':>8}  "
        + "  ".join(f"{names[b]:>26}" for b in columns)
    )
    for c, (q, s) in cases.items():
        ctx = np.array(q) + np.array(s)
        cells = []
        for b in columns:
            med, low = statistics.median(times[(c, b)]), min(times[(c, b)])
            ratio = med / statistics.median(times[(base, b)])
            cells.append(f"{med:8.1f} {low:8.1f} ({ratio:4.2f}x {base})")
        print(f"{c:>6} {len(q):>5} {sum(q):>7} {ctx.mean():>9.0f} {ctx.max():>8}  " + "  ".join(cells))
    if len(models) > 1:
        first = next(iter(models))
        print(f"step time / {first}'s, same case and backend (below 1: faster than {first})")
        for c in cases:
            cells = []
            for b in columns:
                ref = (b[0], first)
                cells.append(f"{names[b]}: {statistics.median(times[(c, b)]) / statistics.median(times[(c, ref)]):.2f}")
            print(f"{c:>6}  " + "  ".join(cells))


GREEDY_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea,",
    "Translate to French: I like apples.",
    "The three primary colors are",
    "import numpy as np\nx = np.arange(10)\nprint(",
]


@torch.inference_mode()
def _greedy(model, prompt: list[int], new_tokens: int, block_size: int) -> list[int]:
    """``new_tokens`` greedy tokens after ``prompt`` through the paged model (prefill, then one decode per token)."""
    total = len(prompt) + new_tokens
    kv = model.allocate_kv_caches(-(-total // block_size), block_size, _dtype(model), torch.device("cpu"))
    table = torch.arange(-(-total // block_size))[None]
    ids, start, out = list(prompt), 0, []
    while len(out) < new_tokens:
        chunk = ids[start:]
        meta = model.attn_backend.build_from_rows(torch.tensor([len(chunk)]), torch.tensor([start]), table, block_size)
        hidden = model(torch.tensor(chunk), meta.positions, meta, kv)
        nxt = int(model.compute_logits(hidden[-1:]).argmax())
        start = len(ids)
        ids.append(nxt)
        out.append(nxt)
    return out


@torch.inference_mode()
def _forced_argmax(model, ids: list[int], block_size: int) -> list[int]:
    """Each position's argmax next token, with ``ids`` as the context (one prefill)."""
    blocks = -(-len(ids) // block_size)
    kv = model.allocate_kv_caches(blocks, block_size, _dtype(model), torch.device("cpu"))
    meta = model.attn_backend.build_from_rows(
        torch.tensor([len(ids)]), torch.tensor([0]), torch.arange(blocks)[None], block_size
    )
    return model.compute_logits(model(torch.tensor(ids), meta.positions, meta, kv)).argmax(-1).tolist()


def greedy_agreement(args, models: dict[str, torch.nn.Module]) -> None:
    """Greedy tokens of each model against the first one's, on ``GREEDY_PROMPTS``; print the agreement.

    Two figures per model: the fraction of the first model's greedy tokens
    this one also picks given the same (first model's) context, and the
    tokens generated free-running before the first difference.
    """
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.model_dir)
    first, *others = models
    n = args.greedy_agreement
    print(f"greedy agreement with {first}: {len(GREEDY_PROMPTS)} prompts x {n} tokens")
    refs = []
    for text in GREEDY_PROMPTS:
        prompt = tok(text)["input_ids"]
        refs.append((prompt, _greedy(models[first], prompt, n, args.block_size)))
    for dt in others:
        same = total = 0
        prefixes = []
        for prompt, ref in refs:
            forced = _forced_argmax(models[dt], prompt + ref[:-1], args.block_size)[len(prompt) - 1 :]
            same += sum(a == b for a, b in zip(forced, ref, strict=True))
            total += len(ref)
            free = _greedy(models[dt], prompt, n, args.block_size)
            prefixes.append(next((i for i, (a, b) in enumerate(zip(free, ref, strict=True)) if a != b), n))
        print(
            f"{dt:>9}: same next token given {first}'s context {same}/{total} ({same / total:.1%}); "
            f"free-running tokens before the first difference per prompt {prefixes}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--model-dir", default=None, help="Hugging Face Llama directory (default: the default model, SmolLM2-135M)"
    )
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--context", type=int, default=300, help="cached tokens per sequence")
    parser.add_argument("--prefill-chunk", type=int, default=512, help="0 to skip the prefill row")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument(
        "--dtype",
        nargs="+",
        choices=["float32", "bfloat16"],
        default=["float32"],
        help="with --cases or --greedy-agreement, several: each is measured against the first",
    )
    parser.add_argument(
        "--weights",
        nargs="+",
        choices=["packed", "dense"],
        default=["packed"],
        help="linear weights packed for oneDNN after loading (as served) or left dense; with --cases "
        "or --greedy-agreement, several: each is measured against the first",
    )
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch default)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument(
        "--cases",
        nargs="+",
        default=None,
        help="time these context mixes instead of the batch sweep: u300 tail u1300 mixed chunks verify spec<q>c<ctx> "
        "(see above)",
    )
    parser.add_argument(
        "--attention-backends",
        nargs="+",
        default=["auto"],
        help="with --cases: the backends to compare (names as --attention-backend, or "
        "torch_bucketed_token_major: torch_bucketed on the cache's token-major layout; cpu_paged_q<N>: cpu_paged "
        "with rows of up to N queries in its kernel)",
    )
    parser.add_argument("--repeat", type=int, default=5, help="with --cases: timed rounds")
    parser.add_argument(
        "--greedy-agreement",
        type=int,
        default=0,
        metavar="N",
        help="with several --dtype: also compare N greedy tokens of each with the first's on a few prompts",
    )
    parser.add_argument(
        "--clock",
        choices=["wall", "cpu"],
        default="wall",
        help="with --cases: cpu times this process's CPU time (with --threads 1, steadier "
        "than wall time on a machine shared with other work)",
    )
    args = parser.parse_args()
    for c in args.cases or []:
        try:
            make_case(c, 64)
        except ValueError as e:
            parser.error(f"--cases: {e}")
    if args.model_dir is None:
        from pipeline.common.model_files import convert_gguf, default_model_path

        args.model_dir = str(convert_gguf(default_model_path()))

    if args.threads:
        torch.set_num_threads(args.threads)
    models = {}
    for dt in args.dtype:
        for w in args.weights:
            label = "/".join(x for x, many in ((dt, len(args.dtype) > 1), (w, len(args.weights) > 1)) if many)
            models[label or dt] = load(args.model_dir, getattr(torch, dt), w)
    if args.cases or args.greedy_agreement:
        if args.warmup == 3:
            args.warmup = 1
        if args.cases:
            run_cases(args, models)
        if args.greedy_agreement:
            greedy_agreement(args, models)
        return
    if len(models) > 1:
        parser.error("the batch sweep takes one --dtype and one --weights")
    (model,) = models.values()
    dtype = _dtype(model)
    bs = args.block_size
    blocks_per_seq = (max(args.context + 1, args.prefill_chunk) + bs - 1) // bs
    max_batch = max(args.batch)
    kv_caches = model.allocate_kv_caches(max_batch * blocks_per_seq, bs, dtype, torch.device("cpu"))
    # Shuffled block ids: a real cache is fragmented.
    gen = torch.Generator().manual_seed(0)
    all_blocks = torch.randperm(max_batch * blocks_per_seq, generator=gen).view(max_batch, blocks_per_seq)

    print(
        f"threads={torch.get_num_threads()} dtype={args.dtype[0]} weights={args.weights[0]} "
        f"context={args.context} block_size={bs}"
    )
    print(f"{'step':>10} {'batch':>6} {'tokens':>7} {'ms/step':>9} {'tok/s':>9}")
    with torch.inference_mode():
        for batch in args.batch:
            query_lens = torch.ones(batch, dtype=torch.int64)
            starts = torch.full((batch,), args.context, dtype=torch.int64)
            table = all_blocks[:batch]
            ms = _time(
                lambda q=query_lens, s=starts, t=table: _step(model, kv_caches, q, s, t, bs),
                args.warmup,
                args.iters,
            )
            print(f"{'decode':>10} {batch:>6} {batch:>7} {ms:>9.1f} {batch / ms * 1e3:>9.0f}")
        if args.prefill_chunk:
            chunk = args.prefill_chunk
            query_lens = torch.tensor([chunk])
            starts = torch.zeros(1, dtype=torch.int64)
            ms = _time(
                lambda: _step(model, kv_caches, query_lens, starts, all_blocks[:1], bs),
                1,
                max(2, args.iters // 3),
            )
            print(f"{'prefill':>10} {1:>6} {chunk:>7} {ms:>9.1f} {chunk / ms * 1e3:>9.0f}")


if __name__ == "__main__":
    main()
