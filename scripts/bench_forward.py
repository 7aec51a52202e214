"""Time bare forward steps of the paged Llama model.

Decode: one step of ``batch`` sequences, each with ``--context`` tokens already
cached (the cache content does not change the cost, so it is left as zeros).
Prefill: one ``--prefill-chunk``-token chunk of a fresh sequence.
The step time includes the metadata build, the forward and the logits of the
sampled rows, not sampling.

    python scripts/bench_forward.py --model-dir DIR --batch 1 8 64 --dtype float32
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pipeline.gpu_worker.weights import load_model


def _step(model, kv_caches, query_lens, starts, block_table, block_size) -> None:
    meta = model.attn_backend.build_from_rows(query_lens, starts, block_table, block_size)
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", required=True, help="Hugging Face Llama directory")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--context", type=int, default=300, help="cached tokens per sequence")
    parser.add_argument("--prefill-chunk", type=int, default=512, help="0 to skip the prefill row")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch default)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=10)
    args = parser.parse_args()

    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    model = load_model(args.model_dir, dtype, torch.device("cpu"))
    bs = args.block_size
    blocks_per_seq = (max(args.context + 1, args.prefill_chunk) + bs - 1) // bs
    max_batch = max(args.batch)
    kv_caches = model.allocate_kv_caches(max_batch * blocks_per_seq, bs, dtype, torch.device("cpu"))
    # Shuffled block ids: a real cache is fragmented.
    gen = torch.Generator().manual_seed(0)
    all_blocks = torch.randperm(max_batch * blocks_per_seq, generator=gen).view(max_batch, blocks_per_seq)

    print(f"threads={torch.get_num_threads()} dtype={args.dtype} context={args.context} block_size={bs}")
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
