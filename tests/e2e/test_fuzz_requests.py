"""No request body raises past the validation layer (issue 40, finding 4): fuzzed chat, completions and
responses requests get a 2xx or 4xx answer, never a 500, and one kept-alive connection serves them all.

Each body is a valid request of its route (past calls, tools, structured output, streams) with up to
two fields replaced by hostile values: arbitrary JSON where a shape is expected, wrong types,
out-of-range numbers, lone surrogates, nesting past the 64-level bound and past ``json``'s own limit,
schemas that admit no finite value, past calls whose arguments are deep or not JSON. A body that is
valid but for one field reaches the code behind validation, where the 500s were. Output lengths stay
small, so the examples run in seconds against one tiny-model server.
"""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import TOOLS, Server

DEPTHS = (65, 1000, 5000)
DEEP = "__deep_{}__"  # a placeholder string, replaced by an array nested that deep in the encoded body

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=12),
    st.sampled_from(["\ud800", "\x00", "<tool_call>", "{{ raise }}", "}", ""]),
)
json_values = st.recursive(
    scalars,
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=6), children, max_size=3),
    max_leaves=12,
)
hostile = st.one_of(json_values, st.sampled_from(DEPTHS).map(DEEP.format))

ENDLESS = {"type": "object", "required": ["a"], "properties": {"a": {"$ref": "#"}}}
CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
schemas = st.one_of(st.sampled_from([CITY, ENDLESS, {"type": "object"}, {"$ref": "#"}, {"type": 5}]), hostile)
# JSON as text (a past call's arguments): nested in the text itself, as the repro sent it.
arguments = st.one_of(
    st.just('{"city": "Paris"}'),
    st.text(max_size=10),
    st.sampled_from(DEPTHS).map(lambda d: '{"x": ' + "[" * d + "]" * d + "}"),
)


def call(args: str) -> list[dict]:
    """A past call of ``f`` and its answer."""
    tool_call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": args}}
    return [
        {"role": "assistant", "content": None, "tool_calls": [tool_call]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"},
    ]


messages = st.one_of(
    st.text(min_size=1, max_size=20).map(lambda t: [{"role": "user", "content": t}]),
    arguments.map(lambda a: [{"role": "user", "content": "hi"}, *call(a)]),
)
sampling = {
    "stream": st.booleans(),
    "n": st.integers(1, 2),
    "temperature": st.floats(0, 2),
    "stop": st.lists(st.text(min_size=1, max_size=3), max_size=2),
    "logit_bias": st.dictionaries(st.integers(0, 40_000).map(str), st.floats(-100, 100), max_size=2),
    "response_format": st.one_of(
        st.sampled_from([{"type": "text"}, {"type": "json_object"}]),
        schemas.map(lambda s: {"type": "json_schema", "json_schema": {"name": "x", "schema": s}}),
    ),
    "guided_json": st.one_of(schemas, schemas.map(json.dumps)),
    "guided_regex": st.sampled_from(["[a-z]{2}", "(("]),
}
chat_tools = st.lists(
    schemas.map(lambda s: {"type": "function", "function": {"name": "f", "parameters": s}}), min_size=1, max_size=2
)
chat = st.fixed_dictionaries(
    {"messages": messages, "max_tokens": st.integers(1, 3)},
    optional={
        **sampling,
        "tools": chat_tools,
        "tool_choice": st.sampled_from(["auto", "required", "none", {"type": "function", "function": {"name": "f"}}]),
        "logprobs": st.booleans(),
    },
)
completion = st.fixed_dictionaries(
    {
        "prompt": st.one_of(st.text(min_size=1, max_size=20), st.lists(st.integers(0, 60_000), min_size=1, max_size=3)),
        "max_tokens": st.integers(1, 3),
    },
    optional={**sampling, "echo": st.booleans(), "logprobs": st.integers(0, 3)},
)
items = st.one_of(
    st.text(min_size=1, max_size=20),
    arguments.map(
        lambda a: [
            {"type": "message", "role": "user", "content": "hi"},
            {"type": "reasoning", "id": "rs_1", "summary": []},
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": a},
            {"type": "function_call_output", "call_id": "c1", "output": "ok"},
        ]
    ),
)
responses = st.fixed_dictionaries(
    {"input": items, "max_output_tokens": st.integers(1, 3)},
    optional={
        "tools": st.lists(schemas.map(lambda s: {"type": "function", "name": "f", "parameters": s}), max_size=2),
        "tool_choice": st.sampled_from(["auto", "required", "none", {"type": "function", "name": "f"}]),
        "text": schemas.map(lambda s: {"format": {"type": "json_schema", "name": "x", "schema": s}}),
        "store": st.booleans(),
        "metadata": st.dictionaries(st.text(max_size=5), st.text(max_size=5), max_size=2),
        "stream": st.booleans(),
    },
)
FIELDS = {
    "/v1/chat/completions": ["messages", "max_tokens", "tools", "tool_choice", *sampling, "logprobs", "top_k", "user"],
    "/v1/completions": ["prompt", "max_tokens", *sampling, "echo", "logprobs", "top_p", "min_tokens"],
    "/v1/responses": ["input", "max_output_tokens", "tools", "tool_choice", "text", "store", "metadata", "stream"],
}


@st.composite
def requests(draw) -> tuple[str, dict]:
    """A valid request of a route, with up to two of its fields (or of its first message) made hostile."""
    route, body = draw(
        st.one_of(
            st.tuples(st.just("/v1/chat/completions"), chat),
            st.tuples(st.just("/v1/completions"), completion),
            st.tuples(st.just("/v1/responses"), responses),
        )
    )
    for _ in range(draw(st.integers(0, 2))):
        field = draw(st.sampled_from(FIELDS[route] + ["message"] * (route == "/v1/chat/completions")))
        if field == "message":
            key = draw(st.sampled_from(["role", "content", "tool_calls", "tool_call_id"]))
            body["messages"] = [{**body["messages"][0], key: draw(hostile)}, *body["messages"][1:]]
        else:
            body[field] = draw(hostile)
    return route, body


def encode(body: dict) -> bytes:
    """The body as JSON (lone surrogates escaped), each placeholder replaced by an array nested that deep."""
    text = json.dumps(body)
    for depth in DEPTHS:
        text = text.replace(json.dumps(DEEP.format(depth)), "[" * depth + "]" * depth)
    return text.encode()


@pytest.fixture(scope="module")
def client(request, tiny_dir):
    srv = Server(["--model", str(tiny_dir), *TOOLS, "--max-model-len", "512", "--kv-cache-memory", "0.25"])
    request.addfinalizer(srv.stop)
    with httpx.Client(base_url=srv.url, timeout=120) as c:
        yield c


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)
@given(request=requests())
def test_no_body_gets_a_500_or_resets_the_connection(client, request):
    route, body = request
    content = encode(body)
    with client.stream("POST", route, content=content, headers={"content-type": "application/json"}) as r:
        text = r.read().decode()
    assert r.status_code < 500, (route, content[:2000], text)
    if r.status_code >= 400:
        error = json.loads(text)["error"]
        assert error["type"] == "invalid_request_error" or r.status_code == 404, error
        assert isinstance(error["message"], str) and error["message"], error
    else:
        assert "internal_server_error" not in text and '"code":"500"' not in text, text[-2000:]
