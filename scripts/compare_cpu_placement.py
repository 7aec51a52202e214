"""Measure torch thread counts and CPU pinning of pipeline's processes on one workload, in one run.

Each variant is ``pipeline-serve`` with some of ``--worker-threads``,
``--worker-cpus`` and ``--frontend-cpus``; the same requests are streamed
through it as in ``compare_peers.py``. Prints output tokens/s per variant and
its ratio to the first (the defaults).

    python scripts/compare_cpu_placement.py --workload sharegpt-synth --num-requests 64
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
from compare_peers import run_pipeline  # noqa: E402

from pipeline.bench.report import summarize  # noqa: E402
from pipeline.bench.workloads import Workload  # noqa: E402


def variants(cpus: list[int]) -> dict[str, tuple[str, ...]]:
    """Flag sets to compare on this machine's allowed ``cpus``: the default first."""
    out = {"default": (), "worker 1 thread": ("--worker-threads", "1")}
    if len(cpus) >= 2:
        front, rest = str(cpus[0]), ",".join(map(str, cpus[1:]))
        out[f"worker on {rest}, others on {front}"] = ("--worker-cpus", rest, "--frontend-cpus", front)
        out[f"worker on {rest} (others anywhere)"] = ("--worker-cpus", rest)
    return out


def main() -> None:
    """Console entry."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="as pipeline-serve --model")
    p.add_argument("--workload", choices=["fixed", "sharegpt-synth"], default="sharegpt-synth")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--input-len", type=int, default=150)
    p.add_argument("--output-len", type=int, default=150)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    work = (
        Workload.fixed(args.batch_size, args.input_len, args.output_len, args.seed)
        if args.workload == "fixed"
        else Workload.sharegpt_synth(args.num_requests, args.max_model_len, args.seed)
    )
    results = {}
    for name, flags in variants(sorted(os.sched_getaffinity(0))).items():
        results[name] = summarize(run_pipeline(args.model, work, args, True, flags, label="placement"), [])
    base = results["default"]["output_tokens_per_s"]
    print(f"\n{len(work.prompts)} requests ({args.workload}, {args.dtype}), async scheduling\n")
    print("| variant | output tok/s | ÷ default | ITL p50 (ms) | ITL p99 (ms) |")
    print("| --- | --- | --- | --- | --- |")
    for name, r in results.items():
        itl = r["itl_ms"] or {"p50": float("nan"), "p99": float("nan")}
        print(
            f"| {name} | {r['output_tokens_per_s']:.1f} | {r['output_tokens_per_s'] / base:.2f} | "
            f"{itl['p50']:.0f} | {itl['p99']:.0f} |"
        )


if __name__ == "__main__":
    main()
