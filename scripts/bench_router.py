"""Replicas behind SGLang's model gateway against one server, on a multi-turn chat workload, in one invocation.

    python scripts/bench_router.py                       # the simulated device, 16 users x 4 turns
    python scripts/bench_router.py --serve-args "--model DIR"
    python scripts/bench_router.py --rounds 3 --setups balanced,round_robin \\
        --serve-args "--model sim --sim-step-us 2000 --sim-token-us 200 --max-model-len 4096"

Setups, each on fresh servers (empty caches), one after the other:
- one replica, clients straight to it;
- two replicas behind sglang-router --policy cache_aware, its balance thresholds left at their defaults;
- the same with --balance-abs-threshold / --balance-rel-threshold set for this workload (BALANCE_ABS,
  BALANCE_REL below);
- two replicas behind sglang-router --policy round_robin;
- one server with -dp 2 (its own prefix-aware routing between two engines).
Prints output tok/s, TTFT p50 per turn, the prefix-cache hit rate (hits / queries, prompt tokens, from
the servers' /metrics), how many requests each replica served, and how many later turns were moved (found
less than the whole blocks of their conversation's previous turn cached). With --failover also (or only),
it then kills one of two balanced cache_aware replicas (SIGKILL) under load, starts it again on its port,
and reports the errors, the time until requests succeed again, the time until the router lists the replica
healthy, and how the streams in flight on it ended.
sglang-router is installed on first use into a venv of its own (pipeline/bench/router.py).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench_server import free_port  # noqa: E402

from pipeline.bench.router import (  # noqa: E402
    ChatWork,
    StreamEnd,
    play_chat,
    prefix_counters,
    router_python,
    start_router,
    stream_chat,
)

# The failover's streaming users: replies long enough that some are mid-stream at the kill, and the read
# timeout that bounds a stream that neither ends nor fails.
STREAM_USERS = 8
STREAM_TOKENS = 512
STREAM_READ_TIMEOUT_S = 30.0

# cache_aware's balance thresholds for this workload (the README's "More than one machine" says why).
BALANCE_ABS = 2
BALANCE_REL = 1.5


def start_server(args: list[str], log, port: int | None = None) -> tuple[subprocess.Popen, str]:
    port = port or free_port()
    cmd = [sys.executable, "-m", "pipeline.launcher", "--port", str(port), *args]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited {proc.returncode}: {shlex.join(cmd)}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise RuntimeError("server did not become healthy")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def model_name(url: str) -> str:
    return httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]


def run_setup(
    name: str,
    serve: list[str],
    num_servers: int,
    policy: str | None,
    router_args: tuple[str, ...],
    work: ChatWork,
    python,
    logs,
):
    """Fresh servers (and a router before them, started with ``router_args``), the workload once; returns the
    row of figures."""
    servers = [start_server(serve, logs) for _ in range(num_servers)]
    router = None
    try:
        url = servers[0][1]
        if policy is not None:
            port = free_port()
            router = start_router(python, port, [u for _, u in servers], policy, logs, router_args)
            url = f"http://127.0.0.1:{port}"
        model = model_name(url)
        block_size = httpx.get(f"{servers[0][1]}/server_info", timeout=10).json()["page_size"]
        before = [prefix_counters(u) for _, u in servers]
        t0 = time.perf_counter()
        turns = asyncio.run(play_chat(url, model, work))
        wall = max(t.end for t in turns) - t0
        after = [prefix_counters(u) for _, u in servers]
    finally:
        if router is not None:
            stop(router)
        for proc, _ in servers:
            stop(proc)
    queries = sum(a[0] - b[0] for a, b in zip(after, before))
    hits = sum(a[1] - b[1] for a, b in zip(after, before))
    served = [int(a[2] - b[2]) for a, b in zip(after, before)]
    ttft = [statistics.median(t.ttft for t in turns if t.turn == k) * 1e3 for k in range(len(work.messages[0]))]
    # A later turn that found less than the whole blocks of the turn before cached went where its
    # conversation was not: the router moved it (or the cache evicted it), and it paid for the recompute.
    by = {(t.user, t.turn): t for t in turns}
    held = {(u, k + 1): t.prompt_tokens // block_size * block_size for (u, k), t in by.items()}
    moved = sum(t.cached_tokens < held[t.user, t.turn] for t in turns if t.turn)
    return {
        "setup": name,
        "tok/s": sum(t.completion_tokens for t in turns) / wall,
        "ttft_p50_ms": ttft,
        "hit_rate": hits / queries if queries else 0.0,
        "served": served,
        "moved": moved,
    }


def finished_streams(url: str, short: int, long: int) -> float:
    """How many requests of ``long`` max_tokens a replica finished, the others asking ``short``: from the sum
    and count of its max_tokens histogram."""
    total = count = 0.0
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        name, _, value = line.rpartition(" ")
        if name.startswith("pipeline_request_params_max_tokens_sum"):
            total += float(value)
        elif name.startswith("pipeline_request_params_max_tokens_count"):
            count += float(value)
    return (total - short * count) / (long - short)


def failover(
    serve: list[str], work: ChatWork, python, logs, kill_after_s: float, router_args: tuple[str, ...], health_s: int = 5
) -> dict:
    """Two replicas behind cache_aware (health checked every ``health_s`` seconds); one is killed (SIGKILL)
    ``kill_after_s`` into a closed loop of requests, then started again on its port.

    Two loops run: every user of ``work`` sends whole (non-streamed) replies to its first message, and
    ``STREAM_USERS`` more stream long replies to their last, each user its one prompt again and again (so
    the router keeps it on one replica). The replica killed is the one that finished more streams so far,
    so that streams are mid-way on it when it dies.

    Returns the non-streamed requests and errors (a hung request fails at the client's 60 s timeout) after
    the kill, the seconds from the kill to the first success after the last error, and from the restarted
    replica's first healthy /health to the router listing it healthy again (None: it never did); and for the
    streams in flight at the kill, how each ended (``StreamEnd.outcome``; a stall is cut at the client's
    ``STREAM_READ_TIMEOUT_S`` read timeout) and the most seconds from the kill to the end of one cut.
    """
    servers = [start_server(serve, logs) for _ in range(2)]
    port = free_port()
    extra = (*router_args, "--health-check-interval-secs", str(health_s))
    router = start_router(python, port, [u for _, u in servers], "cache_aware", logs, extra)
    url = f"http://127.0.0.1:{port}"
    model = model_name(url)
    events: list[tuple[float, bool]] = []  # (time, ok)
    streams: list[StreamEnd] = []
    rejoin: dict = {}

    def body(user: int, turn: int, max_tokens: int) -> dict:
        message = work.messages[user % len(work.messages)][turn]
        return {
            "model": model,
            "messages": [{"role": "system", "content": work.system}, {"role": "user", "content": message}],
            "max_tokens": max_tokens,
            "ignore_eos": True,
        }

    async def loop(user: int, until: float) -> None:
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            while time.perf_counter() < until:
                try:
                    r = await client.post("/v1/chat/completions", json=body(user, 0, work.max_tokens))
                    ok = r.status_code == 200
                except httpx.HTTPError:
                    ok = False
                events.append((time.perf_counter(), ok))
                if not ok:
                    await asyncio.sleep(0.05)

    async def stream_loop(user: int, until: float) -> None:
        timeout = httpx.Timeout(10, read=STREAM_READ_TIMEOUT_S)
        async with httpx.AsyncClient(base_url=url, timeout=timeout) as client:
            while time.perf_counter() < until:
                streams.append(await stream_chat(client, body(user, -1, STREAM_TOKENS)))
                if streams[-1].outcome != "done":
                    await asyncio.sleep(0.05)

    def healthy_in_router(worker_url: str) -> bool:
        workers = httpx.get(f"{url}/workers", timeout=5).json()["workers"]
        return any(w["url"] == worker_url and w["is_healthy"] for w in workers)

    async def main() -> float:
        start = time.perf_counter()
        until = start + kill_after_s + 60
        runs = asyncio.gather(
            *(loop(u, until) for u in range(len(work.messages))),
            *(stream_loop(u, until) for u in range(STREAM_USERS)),
        )
        await asyncio.sleep(kill_after_s)
        i = max(range(2), key=lambda k: finished_streams(servers[k][1], work.max_tokens, STREAM_TOKENS))
        servers[i][0].kill()
        killed = time.perf_counter()
        await asyncio.sleep(3)
        victim_url = servers[i][1]
        servers[i] = await asyncio.to_thread(start_server, serve, logs, int(victim_url.rsplit(":", 1)[1]))
        up = time.perf_counter()
        while time.perf_counter() < up + 6 * health_s and not await asyncio.to_thread(healthy_in_router, victim_url):
            await asyncio.sleep(0.2)
        rejoin["s"] = time.perf_counter() - up if await asyncio.to_thread(healthy_in_router, victim_url) else None
        await runs
        return killed

    try:
        killed = asyncio.run(main())
    finally:
        stop(router)
        for proc, _ in servers:
            stop(proc)
    after = [(t - killed, ok) for t, ok in events if t >= killed]
    errors = [t for t, ok in after if not ok]
    last_error = max(errors, default=0.0)
    recovered = min((t for t, ok in after if ok and t > last_error), default=float("nan"))
    in_flight = [s for s in streams if s.start < killed <= s.end]
    cut = [s.end - killed for s in in_flight if s.outcome != "done"]
    later = [s for s in streams if s.start >= killed]
    return {
        "requests_after_kill": len(after),
        "errors": len(errors),
        "recovered_after_s": round(recovered, 3),
        "rejoined_after_s": rejoin.get("s") and round(rejoin["s"], 2),
        "streams_in_flight_at_kill": dict(Counter(s.outcome for s in in_flight)),
        "cut_streams_ended_within_s": round(max(cut), 3) if cut else None,
        "streams_after_kill": dict(Counter(s.outcome for s in later)),
    }


def print_row(r: dict) -> None:
    ttft = " ".join(f"{x:7.1f}" for x in r["ttft_p50_ms"])
    hits = f"prefix hits {100 * r['hit_rate']:5.1f} %  served {r['served']}  moved {r['moved']}"
    print(f"{r['setup']:34s} {r['tok/s']:8.1f} tok/s  TTFT p50 by turn (ms): {ttft}  {hits}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--serve-args", default="--model sim --sim-step-us 2000 --sim-token-us 20 --max-model-len 4096")
    p.add_argument("--users", type=int, default=16)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--system-words", type=int, default=300)
    p.add_argument("--message-words", type=int, default=60)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument(
        "--failover",
        choices=("off", "also", "only"),
        default="off",
        help="measure a replica's SIGKILL under load and its return, after the setups or alone",
    )
    p.add_argument(
        "--balance-abs-threshold",
        type=int,
        default=BALANCE_ABS,
        help="the tuned cache_aware row's: the gateway's in-flight requests a replica may have over another "
        "before it routes by load instead of by prefix (its default, 64, is never reached by 16 users)",
    )
    p.add_argument("--balance-rel-threshold", type=float, default=BALANCE_REL, help="and the ratio it must also exceed")
    p.add_argument("--log", default=None, help="the servers' and routers' output (default: a temporary file)")
    p.add_argument(
        "--rounds", type=int, default=1, help="run the setups this many times in turn (paired); then print medians"
    )
    p.add_argument(
        "--setups",
        default=None,
        help="comma-separated subset of: replica, cache_aware, balanced, round_robin, dp (default: all)",
    )
    args = p.parse_args()
    serve = shlex.split(args.serve_args)
    work = ChatWork.synth(args.users, args.turns, args.system_words, args.message_words, args.max_tokens)
    python = router_python()
    log_path = args.log or tempfile.mkstemp(prefix="bench-router-", suffix=".log")[1]
    print(
        f"{args.users} users x {args.turns} turns, {args.max_tokens} tokens a reply; pipeline-serve {args.serve_args}"
    )
    print(f"servers' and routers' output: {log_path}")
    rows = []
    with open(log_path, "w") as logs:
        balance = (
            *("--balance-abs-threshold", str(args.balance_abs_threshold)),
            *("--balance-rel-threshold", str(args.balance_rel_threshold)),
        )
        setups = {
            "replica": ("1 replica", serve, 1, None, ()),
            "cache_aware": ("2 x gateway cache_aware, defaults", serve, 2, "cache_aware", ()),
            "balanced": ("2 x gateway cache_aware, balanced", serve, 2, "cache_aware", balance),
            "round_robin": ("2 x gateway round_robin", serve, 2, "round_robin", ()),
            "dp": ("-dp 2, our server", [*serve, "--data-parallel-size", "2"], 1, None, ()),
        }
        chosen = args.setups.split(",") if args.setups else list(setups)
        unknown = set(chosen) - set(setups)
        if unknown:
            p.error(f"unknown setups {sorted(unknown)}; choose from {','.join(setups)}")
        print(f"balanced: {shlex.join(balance)}")
        for _ in range(args.rounds if args.failover != "only" else 0):
            for name, flags, n, policy, router_args in (setups[c] for c in chosen):
                rows.append(run_setup(name, flags, n, policy, router_args, work, python, logs))
                print_row(rows[-1])
        if args.rounds > 1:
            print(f"medians of {args.rounds} rounds")
            for c in chosen:
                mine = [r for r in rows if r["setup"] == setups[c][0]]
                turns = range(len(mine[0]["ttft_p50_ms"]))
                print_row(
                    {
                        "setup": setups[c][0],
                        "tok/s": statistics.median(r["tok/s"] for r in mine),
                        "ttft_p50_ms": [statistics.median(r["ttft_p50_ms"][k] for r in mine) for k in turns],
                        "hit_rate": statistics.median(r["hit_rate"] for r in mine),
                        "served": [r["served"] for r in mine],
                        "moved": [r["moved"] for r in mine],
                    }
                )
        if args.failover != "off":
            f = failover(serve, work, python, logs, 5.0, balance)
            print(f"failover (SIGKILL of the one of 2 balanced cache_aware replicas holding more streams, "
                  f"restarted 3 s later; {STREAM_USERS} users streaming {STREAM_TOKENS} tokens): {f}")  # fmt: skip


if __name__ == "__main__":
    main()
