"""An 8-token chat's latency with a CPU hog on one core, against an idle machine, per worker-thread setting.

Variants, each its own ``pipeline-serve`` (SmolLM2 by default):

- ``default``: the defaults (libgomp's short spin at a barrier; one thread
  per usable CPU, less those other programs keep busy);
- ``passive``: the same, with the worker's OpenMP threads sleeping at every
  barrier (``OMP_WAIT_POLICY=PASSIVE KMP_BLOCKTIME=0``);
- ``passive, fixed``: passive, one thread per CPU whatever the load (the
  defaults before the thread count followed the load);
- ``spin, fixed``: libgomp's spin (``OMP_WAIT_POLICY=ACTIVE
  GOMP_SPINCOUNT=300000``), one thread per CPU whatever the load;
- ``1 thread``: ``--worker-threads 1``.

For each variant the requests alternate in pairs, one on the idle machine,
one while a busy-looping process pinned to ``--hog-cpu`` runs, so both sides
see the same drift. The hog starts ``--settle`` seconds before its request
and each idle request waits as long after the hog stops, as a program that
keeps running would (the worker looks at the load every 0.25 s). It prints the median latency of each side, each
variant's hog latency over the best one's (the default should be within 2x)
and each idle latency over the default's. Run it on an otherwise idle machine.

    python scripts/bench_cpu_contention.py
    python scripts/bench_cpu_contention.py --pairs 10 --variants default "1 thread"
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import time

import httpx

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_FIXED = ["--worker-threads", str(len(os.sched_getaffinity(0)))]
_PASSIVE = {"OMP_WAIT_POLICY": "PASSIVE", "KMP_BLOCKTIME": "0"}
VARIANTS = {
    "default": ([], {}),
    "passive": ([], _PASSIVE),
    "passive, fixed": (_FIXED, _PASSIVE),
    "spin, fixed": (_FIXED, {"OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": "300000"}),
    "1 thread": (["--worker-threads", "1"], {}),
}
HOG = "import os, sys; os.sched_setaffinity(0, {int(sys.argv[1])})\nwhile True: pass"


def serve(flags: list[str], env: dict[str, str]) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "pipeline.launcher", "--port", str(port), *flags], cwd=REPO, env={**os.environ, **env}
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"the server did not start: {flags} {env}")
        time.sleep(0.5)


def chat_s(url: str) -> float:
    """Seconds for one non-streaming chat of exactly 8 output tokens."""
    body = {
        "messages": [{"role": "user", "content": "Tell me about the sea."}],
        "max_tokens": 8,
        "temperature": 0,
        "ignore_eos": True,
    }
    t0 = time.perf_counter()
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=600)
    r.raise_for_status()
    return time.perf_counter() - t0


def measure(url: str, pairs: int, hog_cpu: int, settle: float) -> tuple[list[float], list[float]]:
    idle, hogged = [], []
    for _ in range(pairs):
        time.sleep(settle)
        idle.append(chat_s(url))
        hog = subprocess.Popen([sys.executable, "-c", HOG, str(hog_cpu)])
        try:
            time.sleep(settle)
            hogged.append(chat_s(url))
        finally:
            hog.kill()
            hog.wait()
    return idle, hogged


def main() -> None:
    """Console entry."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    p.add_argument("--pairs", type=int, default=6, help="idle / hog pairs per variant")
    p.add_argument("--hog-cpu", type=int, default=0, help="the CPU the hog is pinned to")
    p.add_argument("--settle", type=float, default=1.0, help="seconds between the hog's start or stop and a request")
    p.add_argument("flags", nargs=argparse.REMAINDER, help="pipeline-serve flags for every variant, after --")
    args = p.parse_args()
    common = [f for f in args.flags if f != "--"]
    results = {}
    for name in args.variants:
        flags, env = VARIANTS[name]
        proc, url = serve([*common, *flags], env)
        try:
            for _ in range(2):
                chat_s(url)  # warm-up
            results[name] = measure(url, args.pairs, args.hog_cpu, args.settle)
        finally:
            proc.terminate()
            proc.wait(60)
    med = {name: (statistics.median(i), statistics.median(h)) for name, (i, h) in results.items()}
    best_hog = min(h for _, h in med.values())
    base_idle = med.get("default", next(iter(med.values())))[0]
    print(f"\n8-token chat, {args.pairs} idle / hog pairs, hog on CPU {args.hog_cpu}, {os.cpu_count()} CPUs\n")
    print("| variant | idle median s | hog median s | hog ÷ best hog | idle ÷ default idle |")
    print("| --- | --- | --- | --- | --- |")
    for name, (i, h) in med.items():
        print(f"| {name} | {i:.3f} | {h:.3f} | {h / best_hog:.2f} | {i / base_idle:.2f} |")


if __name__ == "__main__":
    main()
