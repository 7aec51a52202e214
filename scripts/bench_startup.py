"""Seconds from ``pipeline-serve``'s launch to its first ``/health`` 200, for each of several flag sets, interleaved.

One start of the first flag set warms the kernel cache and the page cache (and converts a GGUF file once);
then each round starts every flag set in turn (the order alternating by round) and the medians are printed.

    python scripts/bench_startup.py --rounds 3 --flags "--quantization auto" "--quantization none"
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import time

from bench_server import Server


def start_seconds(flags: list[str]) -> float:
    t0 = time.perf_counter()
    server = Server(flags)
    seconds = time.perf_counter() - t0
    server.stop()
    return seconds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--flags", nargs="+", required=True, help="pipeline-serve flag sets, one string each")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    sets = {f: shlex.split(f) for f in args.flags}
    start_seconds(sets[args.flags[0]])
    seconds: dict[str, list[float]] = {f: [] for f in sets}
    for r in range(args.rounds):
        for f in args.flags if r % 2 == 0 else args.flags[::-1]:
            seconds[f].append(start_seconds(sets[f]))
    for f, s in seconds.items():
        print(f"{f!r}: {' '.join(f'{x:.1f}' for x in s)} s, median {statistics.median(s):.1f} s")


if __name__ == "__main__":
    main()
