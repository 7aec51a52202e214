"""Grammar bombs at the issue's full sizes beside a free stream: its ITL, /health and /metrics latency, memory.

Starts ``pipeline-serve`` (SmolLM2 by default) and runs, one phase at a time,
a free stream alone and then beside each bomb:

- ``choice-200k``: ``guided_choice`` of 200,000 words (2.4 MB of JSON);
- ``regex-x32``: 32 concurrent ``guided_regex "a{100000}"`` (every mask ~18 ms);
- ``anyof-n64``: ``n`` = 64 with an ``anyOf`` of 2,000 objects (27 MB to compile);
- ``anyof-n128-x2``: two such requests with ``n`` = 128 and distinct schemas;
- ``deep-json``: ``guided_json`` as JSON text nested 3,000 deep.

For each phase it prints the stream's ITL p50/p99, against the stream alone
and against the stream beside the same requests without their grammars
(which take the device as much or more: the batch alone raises the ITL), the
slowest ``/health`` and ``/metrics`` answers while the bomb ran, the bomb's
HTTP statuses, and the scheduler's RSS before, at its peak, and 15 s after
the bomb ended (unused compiled grammars are dropped 10 s after their last
use).

    python scripts/bench_grammar_bombs.py
    python scripts/bench_grammar_bombs.py --phases regex-x32 anyof-n64 --stream-tokens 200
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time

import httpx
from bench_server import Server


def any_of(title: str) -> dict:
    alternatives = [
        {
            "type": "object",
            "properties": {f"k{i}": {"type": "integer"}, f"s{i}": {"type": "string"}},
            "required": [f"k{i}"],
        }
        for i in range(2000)
    ]
    return {"title": title, "anyOf": alternatives}


PHASES = {
    "choice-200k": [{"guided_choice": [f"word{i}" for i in range(200_000)], "max_tokens": 8}],
    "regex-x32": [{"guided_regex": "a{100000}", "max_tokens": 32}] * 32,
    "anyof-n64": [{"guided_json": any_of("n64"), "n": 64, "max_tokens": 16}],
    "anyof-n128-x2": [{"guided_json": any_of(f"n128-{i}"), "n": 128, "max_tokens": 16} for i in range(2)],
    "deep-json": [{"guided_json": '{"a": ' + "[" * 3000 + "]" * 3000 + "}", "max_tokens": 8}],
}


def stream_itl(srv: Server, tokens: int) -> list[float]:
    """Gaps between a free stream's chunks from its second on, seconds."""
    body = {"model": srv.model, "prompt": "Once upon a time", "max_tokens": tokens, "ignore_eos": True, "stream": True}
    times = []
    with httpx.stream("POST", f"{srv.url}/v1/completions", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                times.append(time.perf_counter())
    return [b - a for a, b in zip(times[1:], times[2:])]


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[int(q * (len(xs) - 1))] if xs else float("nan")


def without_grammar(body: dict) -> dict:
    return {k: v for k, v in body.items() if not k.startswith("guided_")}


def run_phase(srv: Server, bodies: list[dict], tokens: int) -> dict:
    statuses, probes, stop = [], {"/health": [], "/metrics": []}, threading.Event()

    def bomb(body: dict) -> None:
        t0 = time.perf_counter()
        try:
            r = httpx.post(f"{srv.url}/v1/completions", json={"model": srv.model, "prompt": "a", **body}, timeout=600)
            statuses.append((r.status_code, time.perf_counter() - t0))
        except httpx.HTTPError as e:
            statuses.append((type(e).__name__, time.perf_counter() - t0))

    def probe() -> None:
        while not stop.is_set():
            for path, seen in probes.items():
                t0 = time.perf_counter()
                try:
                    httpx.get(f"{srv.url}{path}", timeout=60)
                except httpx.HTTPError:
                    pass
                seen.append(time.perf_counter() - t0)
            time.sleep(0.2)

    before, peak = srv.rss_mb(), srv.rss_mb()
    threads = [threading.Thread(target=bomb, args=(b,)) for b in bodies] + [threading.Thread(target=probe)]
    for t in threads:
        t.start()
    time.sleep(0.5)
    gaps = stream_itl(srv, tokens)
    while any(t.is_alive() for t in threads[:-1]):
        peak = max(peak, srv.rss_mb())
        time.sleep(0.1)
    stop.set()
    threads[-1].join()
    time.sleep(15)
    return {
        "itl_p50_ms": pct(gaps, 0.5) * 1e3,
        "itl_p99_ms": pct(gaps, 0.99) * 1e3,
        "health_max_ms": max(probes["/health"], default=float("nan")) * 1e3,
        "metrics_max_ms": max(probes["/metrics"], default=float("nan")) * 1e3,
        "statuses": sorted({str(s) for s, _ in statuses}),
        "bomb_s_max": max((d for _, d in statuses), default=0.0),
        "rss_mb": [round(before), round(peak), round(srv.rss_mb())],
    }


def main() -> None:
    """Console entry."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--phases", nargs="+", choices=list(PHASES), default=list(PHASES))
    p.add_argument("--stream-tokens", type=int, default=100, help="output tokens of the free stream")
    p.add_argument("--repeat", type=int, default=3, help="free-stream runs alone, for the baseline median")
    p.add_argument("--json", help="also write the figures here")
    p.add_argument("flags", nargs=argparse.REMAINDER, help="pipeline-serve flags, after --")
    args = p.parse_args()
    srv = Server([f for f in args.flags if f != "--"])
    try:
        stream_itl(srv, 16)  # warm-up
        alone = [stream_itl(srv, args.stream_tokens) for _ in range(args.repeat)]
        base = {"itl_p50_ms": statistics.median(pct(g, 0.5) for g in alone) * 1e3}
        base["itl_p99_ms"] = statistics.median(pct(g, 0.99) for g in alone) * 1e3
        results = {"alone": base}
        for name in args.phases:
            plain = [without_grammar(b) for b in PHASES[name]]
            results[f"{name} without grammars"] = run_phase(srv, plain, args.stream_tokens)
            results[name] = run_phase(srv, PHASES[name], args.stream_tokens)
    finally:
        srv.stop()
    print(
        "\n| phase | ITL p50 / p99 ms | p99 ÷ alone | p99 ÷ without grammars | /health max ms | /metrics max ms "
        "| bomb statuses | bomb s | scheduler RSS MB before / peak / after |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, r in results.items():
        plain = results.get(f"{name} without grammars")
        cells = [f"{r['itl_p50_ms']:.0f} / {r['itl_p99_ms']:.0f}", f"{r['itl_p99_ms'] / base['itl_p99_ms']:.2f}"]
        cells.append(f"{r['itl_p99_ms'] / plain['itl_p99_ms']:.2f}" if plain else "")
        if name != "alone":
            cells += [f"{r['health_max_ms']:.0f}", f"{r['metrics_max_ms']:.0f}", " ".join(r["statuses"])]
            cells += [f"{r['bomb_s_max']:.1f}", " / ".join(map(str, r["rss_mb"]))]
        print(f"| {name} | " + " | ".join(cells + [""] * (8 - len(cells))) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
