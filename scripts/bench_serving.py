"""Serving throughput through the HTTP API, async vs lock-step, in one run.

Starts `pipeline-serve` once per mode (or uses --url), sends N concurrent
chat requests whose prompts are about --input-len tokens and whose outputs
are exactly --output-len tokens (ignore_eos), and prints output tokens/s,
TTFT and ITL per mode plus the async/sync ratio.

    python scripts/bench_serving.py --num-requests 64 --input-len 150 --output-len 150
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path

import httpx
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.conftest import Server  # noqa: E402  (the same launcher wrapper the tests use)

WORDS = ("time person year way day thing man world life hand part child eye woman place work week case "
         "point government company number group problem fact").split()


def make_prompts(n: int, input_len: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    # ~1 token per word for these common words, minus the chat template's ~30 tokens.
    return [f"Request {i}. Continue this list: " + " ".join(rng.choice(WORDS) for _ in range(input_len - 40))
            for i in range(n)]


async def one(client, model, prompt, output_len, bar):
    t0 = time.perf_counter()
    times = []
    async with client.stream("POST", "/v1/chat/completions", json={
            "model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": output_len,
            "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}) as r:
        r.raise_for_status()
        usage = None
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                times.append(time.perf_counter())
                bar.update(0)
    bar.update(1)
    return t0, times, usage


async def run_mode(url, model, prompts, output_len, label):
    async with httpx.AsyncClient(base_url=url, timeout=3600) as client:
        with tqdm(total=len(prompts), desc=label, unit="req") as bar:
            t0 = time.perf_counter()
            res = await asyncio.gather(*(one(client, model, p, output_len, bar) for p in prompts))
            wall = time.perf_counter() - t0
    out_tokens = sum(u["completion_tokens"] for _, _, u in res)
    prompt_tokens = sum(u["prompt_tokens"] for _, _, u in res)
    ttft = [ts[0] - s for s, ts, _ in res if ts]
    itl = [b - a for _, ts, _ in res for a, b in zip(ts, ts[1:])]
    q = lambda xs, p: statistics.quantiles(xs, n=100)[p - 1] * 1000 if len(xs) > 1 else float("nan")  # noqa: E731
    return {"mode": label, "requests": len(res), "prompt_tokens": prompt_tokens, "output_tokens": out_tokens,
            "wall_s": wall, "output_tokens_per_s": out_tokens / wall, "ttft_ms_p50": q(ttft, 50),
            "ttft_ms_p99": q(ttft, 99), "itl_ms_p50": q(itl, 50), "itl_ms_p99": q(itl, 99)}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=150, help="approximate prompt tokens")
    ap.add_argument("--output-len", type=int, default=150, help="output tokens per request (ignore_eos)")
    ap.add_argument("--mode", choices=["async", "sync", "both"], default="both")
    ap.add_argument("--url", default=None, help="benchmark a running server instead of starting one")
    ap.add_argument("--server-args", default="", help="extra pipeline-serve flags, e.g. '--dtype bfloat16'")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args()

    prompts = make_prompts(args.num_requests, args.input_len, args.seed)
    modes = ["async", "sync"] if args.mode == "both" else [args.mode]
    results = []
    for mode in modes:
        srv = None
        if args.url:
            url = args.url
            model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        else:
            flags = args.server_args.split() + ([] if mode == "async" else ["--no-async-scheduling"])
            srv = Server(flags)
            url, model = srv.url, srv.model
        try:
            results.append(asyncio.run(run_mode(url, model, prompts, args.output_len, mode)))
        finally:
            if srv:
                srv.stop()
    cols = ["mode", "requests", "prompt_tokens", "output_tokens", "wall_s", "output_tokens_per_s",
            "ttft_ms_p50", "ttft_ms_p99", "itl_ms_p50", "itl_ms_p99"]
    print(" | ".join(cols))
    for r in results:
        print(" | ".join(f"{r[c]:.1f}" if isinstance(r[c], float) else str(r[c]) for c in cols))
    if len(results) == 2:
        print(f"async/sync output tokens/s: {results[0]['output_tokens_per_s'] / results[1]['output_tokens_per_s']:.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
