"""Refused and large requests at the issue's full sizes (issue 40, findings 4, 5 and 8): /health and io_proc's memory.

Starts ``pipeline-serve`` (SmolLM2 by default, with ``--enable-auto-tool-choice --tool-call-parser
hermes``) and runs, one phase at a time, with ``/health`` polled from a process of its own:

- ``tools-x16``: 16 concurrent chat requests with 5,000 tools each (840 KB of schemas), too long
  to fit the context (they end in 400);
- ``chain-18``: a ``/v1/responses`` chain of 18 hops with ``store: true``, each adding 3.3 MB of
  ``reasoning`` items, then a 99-byte follow-up (timed), then four follow-ups at once;
- ``deep``: a chat request whose past call's arguments nest 100,000 deep, then a request on the same
  connection.

For each phase it prints the phase's seconds, the statuses, ``/health`` p50 / p99 / max, and io_proc's
RSS before, at its peak, and 10 s after.

    python scripts/bench_refusals.py
    python scripts/bench_refusals.py --phases tools-x16 -- --model DIR --max-model-len 512

What it printed (SmolLM2, a 2-core machine with a load average of 8-12 from other work), first the
previous code (two runs), then this one:

    tools-x16 {"body_kb": 901, "seconds": 22.45, "statuses": ["400"], "health_ms": [10, 180, 6874],
               "io_proc_rss_mb": [394, 1544, 1293]}
    tools-x16 {"body_kb": 901, "seconds": 28.76, "statuses": {"400": 16}, "health_ms": [17, 273, 6896],
               "io_proc_rss_mb": [519, 1626, 1433]}
    chain-18 {"hops": {"200": 18}, "follow_up_s": 0.865, "seconds": 1.06, "statuses": {"200": 1, "400": 4},
              "health_ms": [6, 23, 173], "io_proc_rss_mb": [450, 542, 519]}
    deep {"seconds": 0.05, "statuses": ["500", "ReadError"], "health_ms": [], "io_proc_rss_mb": [1346, 1346, 1346]}

    tools-x16 {"body_kb": 901, "seconds": 5.56, "statuses": {"400": 16}, "health_ms": [30, 341, 610],
               "io_proc_rss_mb": [394, 512, 389]}
    chain-18 {"hops": {"200": 18}, "follow_up_s": 0.633, "seconds": 1.23, "statuses": {"200": 5},
              "health_ms": [4, 23, 45], "io_proc_rss_mb": [404, 404, 404]}
    deep {"seconds": 0.53, "statuses": {"400": 1, "200": 1}, "health_ms": [], "io_proc_rss_mb": [404, 404, 403]}

(The previous code's four concurrent follow-ups got 400: the first follow-up's 60 MB entry evicted
the response they continued.)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from collections import Counter

import httpx
from bench_server import Server

TOOL_FLAGS = ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]


def tools(n: int) -> list[dict]:
    return [
        {
            "type": "function",
            "function": {
                "name": f"tool_{i}",
                "description": f"item {i}",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
            },
        }
        for i in range(n)
    ]


_POLLER = """
import select, sys, time, httpx
lat = []
with httpx.Client(timeout=120) as c:
    while not select.select([sys.stdin], [], [], 0)[0]:
        t = time.perf_counter(); c.get(sys.argv[1] + "/health"); lat.append(time.perf_counter() - t)
        time.sleep(0.02)
print(" ".join(f"{x:.4f}" for x in lat))
"""


class Phase:
    """Polls /health from a process of its own and samples io_proc's RSS while the phase runs."""

    def __init__(self, srv: Server):
        self.srv, self.before, self.peak = srv, srv.rss_mb("io_proc"), srv.rss_mb("io_proc")
        self._poller = subprocess.Popen(
            [sys.executable, "-c", _POLLER, srv.url], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        self._stop = threading.Event()
        self._watch = threading.Thread(target=self._sample)
        self._watch.start()
        self.t0 = time.perf_counter()

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.srv.rss_mb("io_proc"))
            time.sleep(0.05)

    def end(self, statuses: list) -> dict:
        seconds = time.perf_counter() - self.t0
        self._stop.set()
        self._watch.join()
        out, _ = self._poller.communicate("stop\n")
        lat = sorted(float(x) for x in out.split())
        time.sleep(10)
        return {
            "seconds": round(seconds, 2),
            "statuses": dict(Counter(str(s) for s in statuses)),
            "health_ms": [round(lat[int(q * (len(lat) - 1))] * 1e3) for q in (0.5, 0.99, 1.0)] if lat else [],
            "io_proc_rss_mb": [round(self.before), round(self.peak), round(self.srv.rss_mb("io_proc"))],
        }


def concurrently(fn, args: list) -> list:
    out: list = []
    threads = [threading.Thread(target=lambda a=a: out.append(fn(a))) for a in args]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def tools_x16(srv: Server) -> dict:
    body = json.dumps(
        {"messages": [{"role": "user", "content": "hi"}], "tools": tools(5000), "tool_choice": "required"}
    ).encode()

    def post(_):
        r = httpx.post(
            f"{srv.url}/v1/chat/completions", content=body, headers={"content-type": "application/json"}, timeout=600
        )
        return r.status_code

    phase = Phase(srv)
    return {"body_kb": len(body) // 1024, **phase.end(concurrently(post, range(16)))}


def chain_18(srv: Server) -> dict:
    c = httpx.Client(base_url=srv.url, timeout=600)
    previous, statuses = None, []
    for hop in range(18):
        reasoning = [
            {"type": "reasoning", "id": f"rs_{hop}_{i}", "summary": [], "encrypted_content": "z" * 100_000}
            for i in range(33)
        ]
        body = {
            "input": [*reasoning, {"role": "user", "content": f"Hop {hop}."}],
            "store": True,
            "max_output_tokens": 1,
        }
        if previous:
            body["previous_response_id"] = previous
        r = c.post("/v1/responses", json=body)
        statuses.append(r.status_code)
        previous = r.json()["id"]
    hops = dict(Counter(str(s) for s in statuses))
    phase = Phase(srv)
    follow = {"input": "And then?", "previous_response_id": previous, "store": True, "max_output_tokens": 1}
    t0 = time.perf_counter()
    statuses.append(c.post("/v1/responses", json=follow).status_code)
    one = time.perf_counter() - t0
    statuses += concurrently(
        lambda _: httpx.post(f"{srv.url}/v1/responses", json=follow, timeout=600).status_code, range(4)
    )
    return {"hops": hops, "follow_up_s": round(one, 3), **phase.end(statuses[18:])}


def deep(srv: Server) -> dict:
    arguments = "[" * 100_000 + "]" * 100_000
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"},
    ]
    phase = Phase(srv)
    with httpx.Client(base_url=srv.url, timeout=600) as c:
        statuses = [c.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2}).status_code]
        try:
            statuses.append(c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1}).status_code)
        except httpx.HTTPError as e:
            statuses.append(type(e).__name__)
    return phase.end(statuses)


PHASES = {"tools-x16": tools_x16, "chain-18": chain_18, "deep": deep}


def main() -> None:
    """Console entry."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--phases", nargs="+", choices=list(PHASES), default=list(PHASES))
    p.add_argument("--port", type=int, default=18765)
    p.add_argument("flags", nargs=argparse.REMAINDER, help="pipeline-serve flags, after --")
    args = p.parse_args()
    srv = Server([*TOOL_FLAGS, *(f for f in args.flags if f != "--")], args.port)
    # Ready only once a request is served (an early 200 of /health is another issue's).
    httpx.post(f"{srv.url}/v1/completions", json={"prompt": "hi", "max_tokens": 1}, timeout=600)
    try:
        results = {name: PHASES[name](srv) for name in args.phases}
    finally:
        srv.stop()
    for name, r in results.items():
        print(name, json.dumps(r))


if __name__ == "__main__":
    main()
