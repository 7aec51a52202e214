"""Decode pace of tool-calling rows beside plain ones: who pays the every-other-step cost.

Starts ``pipeline-serve`` on SmolLM2 with the Hermes test template and
parser (``--enable-auto-tool-choice``), async and then lock step, and streams
one batch of chat requests at once, ``--batch`` of each kind:

- ``plain``: no tools;
- ``auto``: tools with ``tool_choice: auto``, a prompt the model answers in
  text (the grammar is inactive until ``<tool_call>``);
- ``required``: ``tool_choice: required`` (the whole call under the grammar).

Reported per kind, medians over its requests: the time per output token
between a request's first and last streamed chunks (its inter-token latency;
chunks may carry several tokens, so tokens come from the usage) and tokens per
second. Under async scheduling ``plain`` and ``auto`` should decode at the
same pace and ``required`` at about half of it; in lock step all at one pace.

    .venv/bin/python scripts/bench_tool_calls.py
    .venv/bin/python scripts/bench_tool_calls.py --batch 16 --max-tokens 128
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
TEMPLATE = REPO / "tests" / "fixtures" / "hermes_tool_chat_template.jinja"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_forecast",
            "description": "Weather forecast for a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                "required": ["city", "days"],
            },
        },
    }
]
KINDS = {
    "plain": ({"messages": [{"role": "user", "content": "Tell me a long story about the sea."}]}),
    "auto": ({"messages": [{"role": "user", "content": "Tell me a long story about the sea."}], "tools": TOOLS}),
    "required": (
        {
            "messages": [{"role": "user", "content": "Forecast for Tokyo for the next days?"}],
            "tools": TOOLS,
            "tool_choice": "required",
        }
    ),
}


def serve(port: int, extra: list[str]) -> subprocess.Popen:
    args = [sys.executable, "-m", "pipeline.launcher", "--port", str(port), "--served-model-name", "smol"]
    args += ["--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--chat-template", str(TEMPLATE), *extra]
    proc = subprocess.Popen(args, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.5)
    proc.kill()
    raise SystemExit("the server did not start")


def stream(url: str, body: dict) -> tuple[float, int]:
    """Seconds from the request's first to its last chunk with output, and its output tokens."""
    times, tokens = [], 0
    body = {**body, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            delta = chunk["choices"][0]["delta"] if chunk["choices"] else {}
            if delta.get("content") or delta.get("tool_calls"):
                times.append(time.perf_counter())
    return (times[-1] - times[0] if len(times) > 1 else 0.0), tokens


def run(url: str, batch: int, max_tokens: int) -> dict[str, list[tuple[float, int]]]:
    jobs = [
        (k, {"model": "smol", "stream": True, "temperature": 0, "max_tokens": max_tokens, **b})
        for k, b in KINDS.items()
    ]
    jobs = [j for j in jobs for _ in range(batch)]
    with ThreadPoolExecutor(len(jobs)) as ex:
        results = list(ex.map(lambda j: stream(url, j[1]), jobs))
    out: dict[str, list[tuple[float, int]]] = {k: [] for k in KINDS}
    for (k, _), result in zip(jobs, results):
        out[k].append(result)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=8, help="requests of each kind")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--port", type=int, default=8791)
    args = p.parse_args()
    print(f"{'mode':<12}{'kind':<10}{'ITL p50 ms':>12}{'tok/s/request':>15}{'tokens':>8}")
    for mode, extra in (("async", []), ("lock step", ["--no-async-scheduling"])):
        proc = serve(args.port, extra)
        try:
            run(f"http://127.0.0.1:{args.port}", 1, 8)  # warm-up
            for kind, results in run(f"http://127.0.0.1:{args.port}", args.batch, args.max_tokens).items():
                rates = [(n - 1) / s for s, n in results if s > 0 and n > 2]
                itl, n = statistics.median(1e3 / r for r in rates), sum(n for _, n in results)
                print(f"{mode:<12}{kind:<10}{itl:>12.1f}{statistics.median(rates):>15.1f}{n:>8}")
        finally:
            proc.terminate()
            proc.wait(30)


if __name__ == "__main__":
    main()
