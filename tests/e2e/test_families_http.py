"""A tiny Qwen3 and a tiny Gemma 3 (sliding layers of 16 keys) served over HTTP with SmolLM2's tokenizer.

Greedy output equals transformers' through chunked prefill and decode past
the window, streaming equals non-streaming, log-probabilities equal
transformers' log-softmax, ``n`` returns its choices, and structured output
follows its schema, on both.
"""

from __future__ import annotations

import json
import random

import httpx
import pytest
from transformers import Gemma3TextConfig, Qwen3Config

from tests.conftest import SMALL, Server, make_tiny_model
from tests.e2e.test_logprobs import check_echo_logprobs
from tests.reference import assert_same_greedy, hf_greedy

FAMILIES = {
    "qwen3": (Qwen3Config, dict(head_dim=32)),
    "gemma3": (Gemma3TextConfig, dict(head_dim=32, num_hidden_layers=3, sliding_window=16, sliding_window_pattern=3)),
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def served(request, tmp_path_factory, smol_dir):
    cls, fields = FAMILIES[request.param]
    d = make_tiny_model(tmp_path_factory.mktemp(request.param), smol_dir, cls, **fields)
    srv = Server(["--model", str(d), "--max-num-batched-tokens", "32", *SMALL])
    request.addfinalizer(srv.stop)
    return srv, d


def post(srv, path: str, body: dict) -> dict:
    r = httpx.post(f"{srv.url}{path}", json={"model": srv.model, **body}, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def prompt(n: int = 70) -> list[int]:
    rng = random.Random(3)
    return [rng.randrange(10, 49000) for _ in range(n)]


def test_greedy_equals_transformers_and_streams_the_same(served):
    srv, d = served
    body = {"prompt": prompt(), "max_tokens": 24, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    choice = post(srv, "/v1/completions", body)["choices"][0]
    assert_same_greedy(str(d), prompt(), choice["token_ids"], hf_greedy(str(d), prompt(), 24))
    with httpx.stream("POST", f"{srv.url}/v1/completions", json={"model": srv.model, **body, "stream": True}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert "".join(c["choices"][0]["text"] for c in chunks) == choice["text"]


def test_logprobs_equal_transformers(served):
    srv, d = served
    body = {"prompt": prompt(40), "max_tokens": 4, "temperature": 0, "echo": True, "logprobs": 3}
    choice = post(srv, "/v1/completions", {**body, "ignore_eos": True, "return_token_ids": True})["choices"][0]
    check_echo_logprobs(d, prompt(40), choice, 3)


def test_n_choices(served):
    srv, _ = served
    messages = [{"role": "user", "content": "Tell me a story."}]
    body = {"messages": messages, "n": 3, "max_tokens": 8, "temperature": 1.0, "seed": 1, "ignore_eos": True}
    choices = post(srv, "/v1/chat/completions", body)["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2]
    assert all(c["finish_reason"] == "length" and c["message"]["content"] for c in choices)


def test_structured_output(served):
    """A random model would pad an object with whitespace up to max_tokens; a choice has nowhere to wander."""
    srv, _ = served
    schema = {"enum": ["red", "green", "blue"]}
    for fmt in (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "color", "schema": schema}}},
        {"guided_choice": ["red", "green", "blue"]},
    ):
        body = {"messages": [{"role": "user", "content": "A color."}], "max_tokens": 20, "temperature": 0, **fmt}
        choice = post(srv, "/v1/chat/completions", body)["choices"][0]
        text = choice["message"]["content"]
        assert (json.loads(text) if "response_format" in fmt else text) in ("red", "green", "blue"), text
        assert choice["finish_reason"] == "stop"
