"""The OpenAI API of the real server on SmolLM2: shapes, streaming, stops, errors."""

from __future__ import annotations

import json

import httpx
import openai
import pytest


def sse_chunks(server, path: str, body: dict) -> list[dict]:
    """POST with stream=true; return the decoded chunks, checking the SSE framing."""
    with httpx.stream("POST", f"{server.url}{path}", json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]", raw[-200:]
    out = []
    for e in events[:-2]:
        assert e.startswith("data: "), e
        out.append(json.loads(e[len("data: ") :]))
    return out


def test_paris(smol_async):
    r = httpx.post(
        f"{smol_async.url}/v1/chat/completions",
        timeout=180,
        json={
            "model": smol_async.model,
            "max_tokens": 32,
            "temperature": 0,
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
        },
    )
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "chat.completion"
    assert "Paris" in body["choices"][0]["message"]["content"]
    assert body["choices"][0]["finish_reason"] == "stop"
    u = body["usage"]
    assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]


@pytest.mark.parametrize(
    "prompt",
    [
        "Write a short poem about the sea.",
        "Say hello in Japanese and add emoji 🎉🌊",
        "List three colors in Chinese characters.",
    ],
)
def test_chat_stream_equals_non_stream(smol_async, prompt):
    body = {
        "model": smol_async.model,
        "max_tokens": 40,
        "temperature": 0,
        "messages": [{"role": "user", "content": prompt}],
    }
    full = httpx.post(f"{smol_async.url}/v1/chat/completions", json=body, timeout=180).json()
    chunks = sse_chunks(smol_async, "/v1/chat/completions", {**body, "stream_options": {"include_usage": True}})
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert "\ufffd" not in text
    assert text == full["choices"][0]["message"]["content"]
    finals = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert len(finals) == 1 and finals[0]["choices"][0]["finish_reason"] == full["choices"][0]["finish_reason"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == {
        **full["usage"],
        # The same prompt again: every whole block but the one holding its last token is found cached.
        "prompt_tokens_details": {"cached_tokens": (full["usage"]["prompt_tokens"] - 1) // 16 * 16},
    }


def test_completion_stream_equals_non_stream_and_length(smol_async):
    body = {
        "model": smol_async.model,
        "prompt": "The history of Rome",
        "max_tokens": 20,
        "temperature": 0,
        "ignore_eos": True,
    }
    full = httpx.post(f"{smol_async.url}/v1/completions", json=body, timeout=180).json()
    assert full["object"] == "text_completion"
    assert full["choices"][0]["finish_reason"] == "length"
    assert full["usage"]["completion_tokens"] == 20
    chunks = sse_chunks(smol_async, "/v1/completions", body)
    assert "".join(c["choices"][0]["text"] for c in chunks) == full["choices"][0]["text"]
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])


def test_stop_strings_cut_output(smol_async):
    base = {
        "model": smol_async.model,
        "prompt": "1, 2, 3, 4, 5, 6,",
        "max_tokens": 30,
        "temperature": 0,
        "ignore_eos": True,
    }
    free = httpx.post(f"{smol_async.url}/v1/completions", json=base, timeout=180).json()["choices"][0]["text"]
    assert " 9" in free, free  # the model counts on
    for stop in [" 9", [" 9", "zzz"], ["8, 9"]]:
        r = httpx.post(f"{smol_async.url}/v1/completions", json={**base, "stop": stop}, timeout=180).json()
        first = stop if isinstance(stop, str) else stop[0]
        assert r["choices"][0]["text"] == free[: free.index(first)]
        assert r["choices"][0]["finish_reason"] == "stop"
        assert r["usage"]["completion_tokens"] < 30
        chunks = sse_chunks(smol_async, "/v1/completions", {**base, "stop": stop})
        streamed = "".join(c["choices"][0]["text"] for c in chunks)
        assert streamed == r["choices"][0]["text"]
    m = smol_async.wait_idle()
    assert m["pipeline_kv_blocks_free"] == m["pipeline_kv_blocks_total"]


def test_seeded_sampling_is_reproducible(smol_async):
    body = {
        "model": smol_async.model,
        "prompt": "Once upon a time",
        "max_tokens": 24,
        "temperature": 1.0,
        "top_p": 0.9,
        "top_k": 50,
        "seed": 1234,
        "ignore_eos": True,
    }
    a = httpx.post(f"{smol_async.url}/v1/completions", json=body, timeout=180).json()["choices"][0]["text"]
    b = httpx.post(f"{smol_async.url}/v1/completions", json=body, timeout=180).json()["choices"][0]["text"]
    c = httpx.post(f"{smol_async.url}/v1/completions", json={**body, "seed": 99}, timeout=180).json()
    assert a == b
    assert c["choices"][0]["text"] != a


def test_models_and_health(smol_async):
    assert httpx.get(f"{smol_async.url}/health").status_code == 200
    models = httpx.get(f"{smol_async.url}/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == "smol"
    client = openai.OpenAI(base_url=f"{smol_async.url}/v1", api_key="none")
    assert [m.id for m in client.models.list()] == ["smol"]


BAD = [
    ("/v1/chat/completions", {"messages": []}),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}),
    ("/v1/chat/completions", {"messages": "hi"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "temperature": -1}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_p": 0}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": "ten"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 0}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**6}),
    ("/v1/completions", {"prompt": ""}),
    ("/v1/completions", {"prompt": [1, -5]}),
    ("/v1/completions", {"prompt": [10**9]}),
    ("/v1/completions", {"prompt": [1, 49152]}),  # SmolLM2's vocabulary is ids 0..49151
    ("/v1/completions", {"prompt": "hi", "stop": ""}),
    ("/v1/completions", {"prompt": "word " * 5000}),
    ("/v1/completions", {"prompt": "\ud800"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a\udfff"}]}),
    ("/v1/completions", {"prompt": "hi", "logprobs": 21}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "presence_penalty": 3}),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", "function": {"name": "f"}}]},
    ),
]


@pytest.mark.parametrize("path,body", BAD)
def test_bad_input_is_400_and_server_survives(smol_async, path, body):
    # json.dumps escapes non-ASCII, so lone surrogates travel as JSON allows ("\\ud800").
    r = httpx.post(
        f"{smol_async.url}{path}",
        content=json.dumps({"model": smol_async.model, **body}),
        headers={"content-type": "application/json"},
        timeout=30,
    )
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"]
    assert httpx.get(f"{smol_async.url}/health").status_code == 200


def test_bad_json_and_unknown_model(smol_async):
    r = httpx.post(
        f"{smol_async.url}/v1/completions",
        content=b"{not json",
        timeout=30,
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(f"{smol_async.url}/v1/completions", json={"model": "nope", "prompt": "hi"}, timeout=30)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    client = openai.OpenAI(base_url=f"{smol_async.url}/v1", api_key="none")
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=smol_async.model, prompt="hi", temperature=5)
    m = smol_async.wait_idle()
    assert m["pipeline_kv_blocks_free"] == m["pipeline_kv_blocks_total"]
    assert m["pipeline_req_indices_free"] == m["pipeline_req_indices_total"]


def test_extreme_but_valid_sampling_values_are_served(smol_async):
    """Values at the edges of what the descriptor stores must neither crash a process nor garble output."""
    base = {
        "model": smol_async.model,
        "prompt": "The capital of France is",
        "max_tokens": 6,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    greedy = httpx.post(f"{smol_async.url}/v1/completions", json={**base, "temperature": 0}, timeout=180).json()
    for extra in (
        {"top_k": 2**31},
        {"top_k": 10**30},
        {"top_p": 1e-46},
        {"temperature": 1e-40},
        {"temperature": 1e-40, "top_p": 0.9},
        {"temperature": 0.7, "top_p": 1e-300},
    ):
        r = httpx.post(f"{smol_async.url}/v1/completions", json={**base, **extra}, timeout=180)
        assert r.status_code == 200, (extra, r.text)
        if "temperature" in extra or "top_p" in extra:  # these all reduce to greedy
            assert r.json()["choices"][0]["token_ids"] == greedy["choices"][0]["token_ids"], extra
    assert httpx.get(f"{smol_async.url}/health").status_code == 200


def test_developer_role_is_a_system_message(smol_async):
    body = {"model": smol_async.model, "max_tokens": 8, "temperature": 0}
    dev = httpx.post(
        f"{smol_async.url}/v1/chat/completions",
        timeout=180,
        json={
            **body,
            "messages": [{"role": "developer", "content": "Answer briefly."}, {"role": "user", "content": "Hi"}],
        },
    ).json()
    sys_ = httpx.post(
        f"{smol_async.url}/v1/chat/completions",
        timeout=180,
        json={
            **body,
            "messages": [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Hi"}],
        },
    ).json()
    assert dev["choices"][0]["message"] == sys_["choices"][0]["message"]
