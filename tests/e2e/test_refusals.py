"""Refused requests are 400s naming the field, cheap, and leave nothing behind (issue 40, findings 4, 5 and 8).

One tiny-model server with tool calling on. Sizes are smaller than the issue's;
``scripts/bench_refusals.py`` runs the full ones. Every test's client is one kept-alive
``httpx.Client``: a refusal must leave its connection usable.
"""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from tests.conftest import TOOLS, Server
from tests.e2e.test_fan_out import rss_mb
from tests.e2e.test_faults import role_pid

STORE_BYTES = 4096


@pytest.fixture(scope="module")
def srv(request, tiny_dir):
    server = Server(
        [
            "--model",
            str(tiny_dir),
            *TOOLS,
            "--responses-store-max-bytes",
            str(STORE_BYTES),
            "--max-model-len",
            "1024",
            "--kv-cache-memory",
            "0.25",
        ]
    )
    request.addfinalizer(server.stop)
    return server


@pytest.fixture()
def client(srv):
    with httpx.Client(base_url=srv.url, timeout=120) as c:
        yield c


def refused(r: httpx.Response, param: str | None, says: str) -> dict:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and says in err["message"], err
    return err


def serves(c: httpx.Client) -> None:
    """The same kept-alive connection still answers."""
    assert c.get("/health").status_code == 200
    r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text


def past_call(arguments: str) -> list[dict]:
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}
    return [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"},
    ]


def nested(depth: int) -> dict:
    value: dict = {}
    for _ in range(depth - 1):
        value = {"a": value}
    return value


@pytest.mark.parametrize("depth", [65, 3000])
def test_deeply_nested_tool_arguments_are_400_and_the_connection_serves_on(client, depth):
    """The issue's repro: a 500 RecursionError, then the next request on the connection was reset."""
    arguments = '{"x": ' + "[" * depth + "]" * depth + "}"
    r = client.post("/v1/chat/completions", json={"messages": past_call(arguments), "max_tokens": 2})
    param = "messages[1].tool_calls[0].function.arguments"
    refused(r, param, "nested more than 64 levels deep")
    serves(client)


@pytest.mark.parametrize(
    "route, body, param",
    [
        (
            "/v1/chat/completions",
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": nested(65)}}]},
            "tools.0.function.parameters",
        ),
        ("/v1/chat/completions", {"response_format": nested(65)}, "response_format"),
        ("/v1/completions", {"prompt": "hi", "guided_json": "[" * 100 + "]" * 100}, "guided_json"),
        ("/v1/responses", {"input": "hi", "metadata": nested(65)}, "metadata"),
        ("/v1/responses", {"input": [nested(65)]}, "input"),
    ],
)
def test_free_form_json_nested_too_deeply_is_400_naming_the_field(client, route, body, param):
    if route == "/v1/chat/completions":
        body = {"messages": [{"role": "user", "content": "hi"}], **body}
    refused(client.post(route, json=body), param, "nested more than 64 levels deep")
    serves(client)


def test_a_body_nested_past_json_s_own_limit_is_400(client):
    body = b'{"prompt": "hi", "user": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    r = client.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    refused(r, None, "the request body is nested more than 64 levels deep")
    serves(client)


# The schema: a required property that is the object again, with no way to end.
ENDLESS = {"type": "object", "required": ["a"], "properties": {"a": {"$ref": "#"}}}


@pytest.mark.parametrize(
    "route, body, param",
    [
        ("/v1/chat/completions", {"guided_json": ENDLESS}, "guided_json"),
        (
            "/v1/chat/completions",
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": ENDLESS}}},
            "response_format",
        ),
        (
            "/v1/chat/completions",
            {
                "tools": [{"type": "function", "function": {"name": "f", "parameters": ENDLESS}}],
                "tool_choice": "required",
            },
            "tools[0].function.parameters",
        ),
        (
            "/v1/responses",
            {"tools": [{"type": "function", "name": "f", "parameters": ENDLESS}], "tool_choice": "required"},
            "tools[0].parameters",
        ),
    ],
)
@pytest.mark.parametrize("stream", [False, True])
def test_a_schema_that_admits_no_finite_value_is_400(client, route, body, param, stream):
    if route == "/v1/chat/completions":
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 60, **body}
    else:
        body = {"input": "hi", "max_output_tokens": 60, **body}
    refused(client.post(route, json={**body, "stream": stream}), param, "admits no finite value")
    serves(client)


def tools(n: int) -> list[dict]:
    return [
        {
            "type": "function",
            "function": {
                "name": f"tool_{i}",
                "description": f"Look up item {i} in the catalogue",
                "parameters": {
                    "type": "object",
                    "properties": {"city": {"type": "string"}, "count": {"type": "integer"}},
                    "required": ["city"],
                },
            },
        }
        for i in range(n)
    ]


@pytest.mark.parametrize(
    "route, body",
    [
        # A grammar llguidance refuses: compiled first, the answer would name guided_regex.
        ("/v1/completions", {"prompt": "word " * 1100, "guided_regex": "(("}),
        (
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "word " * 1100}],
                "tools": [
                    {
                        "type": "function",
                        "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": {"type": 5}}}},
                    }
                ],
                "tool_choice": "required",
            },
        ),
    ],
)
def test_the_context_length_is_checked_before_any_grammar_is_compiled(client, route, body):
    r = client.post(route, json=body)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text


def test_store_true_over_the_store_s_budget_says_it_was_not_stored(client):
    r = client.post("/v1/responses", json={"input": "word " * 800, "store": True, "max_output_tokens": 1})
    assert r.status_code == 200 and r.json()["store"] is False, r.text
    assert client.get(f"/v1/responses/{r.json()['id']}").status_code == 404
    small = client.post("/v1/responses", json={"input": "hi", "store": True, "max_output_tokens": 1}).json()
    assert small["store"] is True and client.get(f"/v1/responses/{small['id']}").status_code == 200


def test_a_chain_of_follow_ups_keeps_neither_reasoning_items_nor_copies(client):
    """Reasoning items of 3 KB per hop would fill the 4 KB store in two hops if kept, or copied per hop."""
    previous = None
    for hop in range(8):
        reasoning = {"type": "reasoning", "id": f"rs_{hop}", "summary": [], "encrypted_content": "z" * 3000}
        body = {
            "input": [reasoning, {"type": "message", "role": "user", "content": f"Hop {hop}."}],
            "store": True,
            "max_output_tokens": 2,
        }
        if previous is not None:
            body["previous_response_id"] = previous["id"]
        r = client.post("/v1/responses", json=body)
        assert r.status_code == 200 and r.json()["store"] is True, r.text
        if previous is not None:  # the follow-up saw the whole conversation
            assert r.json()["usage"]["input_tokens"] > previous["usage"]["input_tokens"] + 2
        previous = r.json()


class Health:
    """Polls ``/health`` on its own connection until stopped; ``answers`` are (status, when)."""

    def __init__(self, url: str):
        self.answers: list[tuple[int, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(url,))
        self._thread.start()

    def _run(self, url: str) -> None:
        with httpx.Client(base_url=url, timeout=60) as c:
            while not self._stop.is_set():
                self.answers.append((c.get("/health").status_code, time.monotonic()))
                time.sleep(0.05)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def tool_burst(srv: Server, n_tools: int, concurrency: int = 16) -> tuple[list[httpx.Response], float, float]:
    """``concurrency`` chat requests with ``n_tools`` tools at once: (responses, start, end)."""
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": tools(n_tools), "tool_choice": "required"}
    results: list[httpx.Response] = []

    def post() -> None:
        with httpx.Client(base_url=srv.url, timeout=300) as c:
            results.append(c.post("/v1/chat/completions", json=body))

    threads = [threading.Thread(target=post) for _ in range(concurrency)]
    start = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results, start, time.monotonic()


def test_a_burst_of_tool_lists_too_long_to_fit_is_refused_and_gives_its_memory_back(srv):
    """The issue's burst at a tenth of its size: 16 requests of 500 tools (about 140 KB each), whose prompts
    cannot fit 1,024 tokens. Each is refused for its length; /health answers while they run; io_proc's memory
    comes back near idle."""
    pid = role_pid(srv, "io_proc")
    tool_burst(srv, 500)  # warm-up: the threads, their arenas and the caches the burst uses exist before idle
    time.sleep(3)
    idle = rss_mb(pid)
    health = Health(srv.url)
    try:
        results, start, end = tool_burst(srv, 500)
    finally:
        health.stop()
    for r in results:
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    during = [status for status, when in health.answers if start <= when <= end]
    assert during and set(during) == {200}, health.answers
    # Back within 10 % of idle once the heap watch has trimmed (a second after the heap settles).
    deadline = time.monotonic() + 30
    while (after := rss_mb(pid)) > idle * 1.10 and time.monotonic() < deadline:
        time.sleep(0.5)
    print(f"\nio_proc RSS, MB: idle {idle:.0f}, after {after:.0f}; /health answers during the burst: {len(during)}")
    assert after <= idle * 1.10
