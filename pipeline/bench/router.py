"""Replicas behind SGLang's model gateway (``sglang-router``): installing it, starting it, and a multi-turn
chat workload played through any OpenAI-compatible URL (``scripts/bench_router.py``,
``tests/e2e/test_router.py``).

The router is a registry package (a Rust binary behind a Python launcher) whose dependencies are
not the project's, so it lives in a virtual environment of its own, made on first use. Its
completions route takes text prompts only, so the workload is chat: every turn resends the
conversation (a shared system prompt, the user's messages and the replies it got, as text).
Dynamo's runtime, whose KV indexer ``tests/e2e/test_kv_events.py`` runs on our KV-cache events,
gets a virtual environment of its own the same way.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

ROUTER_VERSION = "0.3.2"
DYNAMO_VERSION = "1.6.1"
DEFAULT_VENV = Path.home() / ".cache" / "pipeline" / "sglang-router-venv"


def registry_python(requirement: str, module: str, venv: Path) -> Path:
    """The interpreter of the virtual environment ``venv``, where ``requirement`` is pip-installed first if
    ``module`` does not import there.

    Raises:
        RuntimeError: the package could not be installed (no registry), with pip's message.
    """
    python = venv / "bin" / "python"
    check = [str(python), "-c", f"import {module}"]
    if python.exists() and subprocess.run(check, capture_output=True).returncode == 0:
        return python
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, capture_output=True)
    done = subprocess.run([str(python), "-m", "pip", "install", "--quiet", requirement], capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"pip install {requirement} failed:\n{done.stderr[-2000:]}")
    return python


def router_python(venv: Path | None = None) -> Path:
    """The interpreter of a virtual environment holding ``sglang-router`` (``registry_python``).

    ``venv``: default ``$VENV_SGLANG_ROUTER`` or ``~/.cache/pipeline/sglang-router-venv``.
    """
    venv = Path(venv or os.environ.get("VENV_SGLANG_ROUTER") or DEFAULT_VENV)
    return registry_python(f"sglang-router=={ROUTER_VERSION}", "sglang_router", venv)


def dynamo_python() -> Path:
    """The interpreter of a virtual environment holding Dynamo's runtime, whose standalone KV indexer
    (``python -m dynamo.indexer``) follows engines by their KV-cache events: ``$VENV_DYNAMO`` or
    ``~/.cache/pipeline/dynamo-venv`` (``registry_python``)."""
    venv = Path(os.environ.get("VENV_DYNAMO") or DEFAULT_VENV.with_name("dynamo-venv"))
    return registry_python(f"ai-dynamo-runtime=={DYNAMO_VERSION}", "dynamo.llm", venv)


def start_router(
    python: Path, port: int, worker_urls: list[str], policy: str, log, extra: tuple[str, ...] = (), timeout=90.0
) -> subprocess.Popen:
    """Start the router on ``127.0.0.1:port`` in front of ``worker_urls``; returns once it lists a model
    (every worker registered: it checks each one's health and metadata first).

    Raises:
        RuntimeError: it exited, or registered no model within ``timeout`` seconds.
    """
    args = [str(python), "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port)]
    args += ["--worker-urls", *worker_urls, "--policy", policy, "--log-level", "warn", *extra]
    proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"sglang-router exited {proc.returncode}")
        try:
            workers = httpx.get(f"http://127.0.0.1:{port}/workers", timeout=2).json()
            if sum(1 for w in workers.get("workers", []) if w.get("is_healthy")) == len(worker_urls):
                return proc
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"sglang-router registered no healthy workers within {timeout:g} s")


@dataclass
class ChatWork:
    """Users that each hold a conversation of ``len(messages[u])`` turns over one system prompt."""

    system: str
    messages: list[list[str]]  # [user][turn]
    max_tokens: int

    @classmethod
    def synth(cls, num_users: int, num_turns: int, system_words: int, message_words: int, max_tokens: int, seed=0):
        rng = random.Random(seed)
        vocab = [f"{a}{b}" for a in ("ka", "lo", "mi", "ne", "su", "te", "ru", "po") for b in ("n", "l", "r", "s", "")]

        def text(n: int) -> str:
            return " ".join(rng.choice(vocab) for _ in range(n))

        return cls(
            text(system_words),
            [[text(message_words) for _ in range(num_turns)] for _ in range(num_users)],
            max_tokens,
        )


@dataclass
class TurnResult:
    user: int
    turn: int
    ttft: float  # seconds from sending to the first content
    end: float  # time.perf_counter() at the last chunk
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int


async def play_chat(url: str, model: str, work: ChatWork) -> list[TurnResult]:
    """Every user at once, each turn after the previous reply, streamed chat completions; greedy, replies of
    ``work.max_tokens`` tokens (EOS ignored). Raises ``RuntimeError`` on a response that is not 200."""

    async def user(client: httpx.AsyncClient, u: int) -> list[TurnResult]:
        history = [{"role": "system", "content": work.system}]
        out = []
        for turn, message in enumerate(work.messages[u]):
            history.append({"role": "user", "content": message})
            body = {
                "model": model,
                "messages": history,
                "max_tokens": work.max_tokens,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            start, first, reply, usage = time.perf_counter(), None, [], None
            async with client.stream("POST", "/v1/chat/completions", json=body) as r:
                if r.status_code != 200:
                    raise RuntimeError(f"user {u} turn {turn}: HTTP {r.status_code}: {(await r.aread())[:300]!r}")
                async for line in r.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    chunk = json.loads(line[6:])
                    if chunk.get("usage"):
                        usage = chunk["usage"]
                    for choice in chunk["choices"]:
                        if choice["delta"].get("content"):
                            first = first or time.perf_counter()
                            reply.append(choice["delta"]["content"])
            history.append({"role": "assistant", "content": "".join(reply)})
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
            out.append(
                TurnResult(
                    u,
                    turn,
                    (first or time.perf_counter()) - start,
                    time.perf_counter(),
                    usage["prompt_tokens"],
                    cached,
                    usage["completion_tokens"],
                )
            )
        return out

    limits = httpx.Limits(max_connections=len(work.messages) + 4)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:
        done = await asyncio.gather(*(user(client, u) for u in range(len(work.messages))))
    return [t for ts in done for t in ts]


@dataclass
class StreamEnd:
    """How one streamed chat completion ended, as its client saw it."""

    start: float  # time.perf_counter() when sent
    end: float  # when it ended, one way or another
    outcome: str  # "done" (finish_reason and [DONE]), "cut" (the body ended without [DONE]), "error event"
    # (an SSE error object), "HTTP <status>", "timeout" (no byte within the client's read timeout), or the
    # transport error's class name


async def stream_chat(client: httpx.AsyncClient, body: dict) -> StreamEnd:
    """Send ``body`` streamed and read it to its end; a transport error or a stall past the client's read
    timeout is an outcome, not an exception, so a cut stream can be counted."""
    start, outcome, finished = time.perf_counter(), "cut", False
    try:
        async with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
            if r.status_code != 200:
                await r.aread()
                return StreamEnd(start, time.perf_counter(), f"HTTP {r.status_code}")
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    outcome = "done" if finished else "cut"
                elif line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        outcome = "error event"
                        break
                    finished |= any(c.get("finish_reason") for c in chunk.get("choices", ()))
    except httpx.TimeoutException:
        outcome = "timeout"
    except httpx.HTTPError as e:
        outcome = type(e).__name__
    return StreamEnd(start, time.perf_counter(), outcome)


def prefix_counters(url: str) -> tuple[float, float, float]:
    """A server's ``(prefix-cache queries, hits, finished requests)`` from its ``/metrics``."""
    queries = hits = finished = 0.0
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        name, _, value = line.rpartition(" ")
        if name == "pipeline_prefix_cache_queries_total":
            queries = float(value)
        elif name == "pipeline_prefix_cache_hits_total":
            hits = float(value)
        elif name.startswith("pipeline_requests_finished_total{"):
            finished += float(value)
    return queries, hits, finished
