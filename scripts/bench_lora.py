"""Multi-LoRA throughput: output tokens/s of 64 concurrent streams spread over 0, 1, 4 and 16 adapters.

Makes 16 rank-16 PEFT adapters on every projection (q, k, v, o, gate, up,
down) of the model (SmolLM2-135M by default) with random weights, starts one
``pipeline-serve --enable-lora`` serving them all (``--max-loras 16``), and
runs the configurations in alternating rounds on that one server (paired:
each round measures every configuration back to back). Each stream has its
own prompt (never cached across rounds) and generates ``--max-tokens`` tokens
with ``ignore_eos``; stream ``i`` uses adapter ``i mod n`` (none with 0).
Prints each round's output tokens/s, the median, and its ratio to no adapters.

    python scripts/bench_lora.py
    python scripts/bench_lora.py --rounds 3 --max-tokens 64 -- --max-num-batched-tokens 1024
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
from bench_grammar_bombs import Server

PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapters(model_dir: Path, out: Path, count: int, rank: int) -> list[Path]:
    """``count`` PEFT adapters of ``rank`` on every projection, random A and B (peft starts B at zero)."""
    import peft
    import torch
    import transformers

    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = peft.get_peft_model(base, peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=PROJECTIONS))
    dirs = []
    for i in range(count):
        torch.manual_seed(i)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_" in name:
                    p.copy_(torch.randn_like(p) * 0.02)
        model.save_pretrained(out / f"lora{i}")
        dirs.append(out / f"lora{i}")
    return dirs


def run(srv: Server, adapters: int, streams: int, max_tokens: int, tag: str) -> float:
    """Output tokens/s of ``streams`` concurrent requests over ``adapters`` adapters."""

    def one(i: int) -> int:
        body = {
            "model": f"lora{i % adapters}" if adapters else srv.model,
            "prompt": f"{tag} story {i}: once upon a time, in a land far away,",
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
        }
        r = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=600)
        r.raise_for_status()
        return r.json()["usage"]["completion_tokens"]

    start = time.perf_counter()
    with ThreadPoolExecutor(streams) as pool:
        tokens = sum(pool.map(one, range(streams)))
    return tokens / (time.perf_counter() - start)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model directory (default: SmolLM2-135M from its GGUF)")
    p.add_argument("--streams", type=int, default=64)
    p.add_argument("--adapters", type=int, nargs="+", default=[0, 1, 4, 16])
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("flags", nargs="*", help="more pipeline-serve flags, after --")
    args = p.parse_args()
    if args.model is None:
        from pipeline.common.model_files import convert_gguf, default_model_path

        args.model = str(convert_gguf(default_model_path()))
    with tempfile.TemporaryDirectory() as tmp:
        dirs = make_adapters(Path(args.model), Path(tmp), max(args.adapters), args.rank)
        modules = [f"lora{i}={d}" for i, d in enumerate(dirs)]
        flags = ["--model", args.model, "--max-num-seqs", str(args.streams), "--enable-lora"]
        flags += ["--max-loras", str(max(args.adapters)), "--max-lora-rank", str(args.rank), "--lora-modules", *modules]
        srv = Server(flags + args.flags)
        try:
            run(srv, 0, args.streams, 8, "warm-up")
            figures: dict[int, list[float]] = {n: [] for n in args.adapters}
            for r in range(args.rounds):
                for n in args.adapters:
                    figures[n].append(run(srv, n, args.streams, args.max_tokens, f"round {r} adapters {n}"))
        finally:
            srv.stop()
    base = statistics.median(figures[args.adapters[0]])
    print(f"\n{args.streams} streams x {args.max_tokens} tokens, rank-{args.rank} adapters on every projection")
    print(f"{'adapters':>8}  {'tok/s per round':<28} {'median':>8}  {'vs ' + str(args.adapters[0]):>6}")
    for n, values in figures.items():
        med = statistics.median(values)
        rounds = " ".join(f"{v:7.1f}" for v in values)
        print(f"{n:>8}  {rounds:<28} {med:8.1f}  {med / base:6.2f}")


if __name__ == "__main__":
    main()
