"""Penalties and biases through the server: min_tokens, stop_token_ids, logit_bias, and 400s naming the field.

On the tiny Llama with greedy decoding, so each expectation follows from the
plain output of the same prompt.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

PROMPT = "the of and to in is was"


def complete(srv, **body) -> dict:
    r = httpx.post(
        f"{srv.url}/v1/completions",
        timeout=180,
        json={"model": srv.model, "prompt": PROMPT, "temperature": 0, "return_token_ids": True, **body},
    )
    assert r.status_code == 200, r.text
    return r.json()


def test_stop_token_ids_and_min_tokens(tiny_async):
    plain = complete(tiny_async, max_tokens=8, ignore_eos=True)["choices"][0]["token_ids"]
    # A stop id ends the output on its first occurrence (also with ignore_eos), and counts as a token.
    stop = plain[2]
    first = plain.index(stop)
    r = complete(tiny_async, max_tokens=8, ignore_eos=True, stop_token_ids=[stop])
    assert r["choices"][0]["token_ids"] == plain[: first + 1]
    assert r["choices"][0]["finish_reason"] == "stop" and r["usage"]["completion_tokens"] == first + 1
    # min_tokens: the stop id (here greedy's first token) cannot come before that many tokens.
    r = complete(tiny_async, max_tokens=8, ignore_eos=True, stop_token_ids=[plain[0]], min_tokens=4)
    ids = r["choices"][0]["token_ids"]
    assert plain[0] not in ids[:4] and len(ids) >= 4
    assert r["choices"][0]["finish_reason"] == ("stop" if ids[-1] == plain[0] else "length")


def test_logit_bias_steers_greedy(tiny_async):
    plain = complete(tiny_async, max_tokens=4, ignore_eos=True)["choices"][0]["token_ids"]
    forced = 1234 if plain[0] != 1234 else 1235
    r = complete(tiny_async, max_tokens=4, ignore_eos=True, logit_bias={str(forced): 100})
    assert r["choices"][0]["token_ids"] == [forced] * 4
    r = complete(tiny_async, max_tokens=1, ignore_eos=True, logit_bias={str(plain[0]): -100})
    assert r["choices"][0]["token_ids"] != plain[:1]


@pytest.mark.parametrize(
    "field, value",
    [
        ("presence_penalty", 3),
        ("frequency_penalty", -2.5),
        ("repetition_penalty", 0),
        ("repetition_penalty", 1e-38),
        ("repetition_penalty", 101),
        ("min_p", 1.5),
        ("min_tokens", -1),
        ("min_tokens", 9),
        ("logit_bias", {"abc": 1}),
        ("logit_bias", {"5": 101}),
        ("logit_bias", {"99999999": 1}),
        ("logit_bias", {str(i): 1 for i in range(301)}),
        ("stop_token_ids", [-1]),
        ("stop_token_ids", [99999999]),
    ],
)
def test_bad_values_are_400_naming_the_field(tiny_async, field, value):
    for path, base in (
        ("/v1/completions", {"prompt": PROMPT}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ):
        r = httpx.post(
            f"{tiny_async.url}{path}",
            timeout=60,
            json={"model": tiny_async.model, "max_tokens": 8, **base, field: value},
        )
        assert r.status_code == 400, (path, r.text)
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and err["param"] == field, err


def _stream_text(srv, body: dict) -> tuple[str, str, int]:
    """A streamed completion's text, finish reason and completion tokens."""
    text, finish, usage = [], None, None
    with httpx.stream(
        "POST",
        f"{srv.url}/v1/completions",
        timeout=60,
        json={**body, "stream": True, "stream_options": {"include_usage": True}},
    ) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for c in chunk["choices"]:
                text.append(c["text"])
                finish = c["finish_reason"] or finish
            usage = chunk.get("usage") or usage
    return "".join(text), finish, usage["completion_tokens"]


@pytest.mark.parametrize("stream", [False, True])
def test_min_tokens_holds_off_stop_strings(sim_async, smol_dir, stream):
    """A one-character stop string completed before min_tokens output tokens is ignored (vLLM's rule)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smol_dir)
    body = {"model": sim_async.model, "prompt": PROMPT, "max_tokens": 40, "ignore_eos": True}
    plain = httpx.post(f"{sim_async.url}/v1/completions", json={**body, "return_token_ids": True}, timeout=60).json()
    ids, full = plain["choices"][0]["token_ids"], plain["choices"][0]["text"]
    stop = " "  # the simulated device's words mostly start with one
    early = full.find(stop)
    assert 0 <= early < len(tok.decode(ids[:3])), "the stop string must occur in the first tokens"
    for min_tokens in (0, 16):
        start = len(tok.decode(ids[:min_tokens]))
        cut = full.find(stop, start)
        assert cut >= 0
        want_tokens = next(k for k in range(1, len(ids) + 1) if len(tok.decode(ids[:k])) > cut)
        req = {**body, "stop": [stop], "min_tokens": min_tokens}
        if stream:
            got = _stream_text(sim_async, req)
        else:
            r = httpx.post(f"{sim_async.url}/v1/completions", json=req, timeout=60).json()
            got = r["choices"][0]["text"], r["choices"][0]["finish_reason"], r["usage"]["completion_tokens"]
        assert got == (full[:cut], "stop", want_tokens)
        assert want_tokens > min_tokens


def test_extreme_sampling_values_beside_a_request_leave_its_output_and_the_server_alone(tiny_async):
    """The request that once stopped the server (a 400 now) and the extremes the edge accepts, sent at once."""
    solo = complete(tiny_async, max_tokens=12, ignore_eos=True)["choices"][0]["token_ids"]
    crash = {"temperature": 1, "top_p": 0.9, "repetition_penalty": 1e-38}
    extremes = [
        {"temperature": 1, "top_p": 1e-6, "repetition_penalty": 0.01, "presence_penalty": 2, "seed": 1},
        {"temperature": 2, "top_k": 1, "min_p": 1, "repetition_penalty": 100, "frequency_penalty": -2, "seed": 2},
        {"temperature": 1e-7, "logit_bias": {"5": 100, "6": 100, "7": -100}, "min_tokens": 3, "seed": 3},
        {"temperature": 0.01, "top_p": 0.5, "min_p": 0.999, "top_k": 2**40, "seed": 4},
    ]

    def post(body):
        return httpx.post(
            f"{tiny_async.url}/v1/completions",
            timeout=180,
            json={"model": tiny_async.model, "prompt": PROMPT, "max_tokens": 12, "return_token_ids": True, **body},
        )

    with ThreadPoolExecutor(len(extremes) + 2) as pool:
        bad = pool.submit(post, crash)
        odd = [pool.submit(post, body) for body in extremes]
        plain = pool.submit(post, {"temperature": 0, "ignore_eos": True})
        assert bad.result().status_code == 400 and bad.result().json()["error"]["param"] == "repetition_penalty"
        for f in odd:
            r = f.result()
            assert r.status_code == 200, r.text
            assert len(r.json()["choices"][0]["token_ids"]) >= 1
        assert plain.result().json()["choices"][0]["token_ids"] == solo
    assert httpx.get(f"{tiny_async.url}/health", timeout=10).status_code == 200
    assert complete(tiny_async, max_tokens=12, ignore_eos=True)["choices"][0]["token_ids"] == solo
