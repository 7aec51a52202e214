"""Greedy outputs through the real server equal transformers' `generate`.

Prompts are sent as token ids to /v1/completions with ignore_eos, so the
comparison is exact over all 48 tokens; all prompts run concurrently, so
batching, chunked prefill and placeholders are all exercised.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.reference import assert_same_greedy, hf_greedy, load

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea,",
    "1, 2, 3, 4, 5,",
    "Translate to French: I like apples.",
    "The three primary colors are",
    "Water boils at",
    "import numpy as np\nx = np.arange(10)\nprint(",
]
NEW_TOKENS = 48


def complete_ids(server, prompt_ids: list[int], max_tokens: int) -> list[int]:
    r = httpx.post(f"{server.url}/v1/completions", timeout=300, json={
        "model": server.model, "prompt": prompt_ids, "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True, "return_token_ids": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["usage"]["completion_tokens"] == max_tokens
    assert body["choices"][0]["finish_reason"] == "length"
    return body["choices"][0]["token_ids"]


def check_against_hf(server, model_dir):
    _, tok = load(str(model_dir))
    prompts = [tok(p)["input_ids"] for p in PROMPTS]
    with ThreadPoolExecutor(len(prompts)) as pool:
        ours = list(pool.map(lambda p: complete_ids(server, p, NEW_TOKENS), prompts))
    for p, o in zip(prompts, ours):
        assert_same_greedy(str(model_dir), p, o, hf_greedy(str(model_dir), p, NEW_TOKENS))
    m = server.wait_idle()
    assert m["pipeline_kv_blocks_free"] == m["pipeline_kv_blocks_total"]
    assert m["pipeline_slots_free"] == m["pipeline_slots_total"]


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_tiny_llama_equals_hf(mode, tiny_async, tiny_sync, tiny_dir):
    check_against_hf(tiny_async if mode == "async" else tiny_sync, tiny_dir)


def test_smollm2_async_equals_hf(smol_async, smol_dir):
    check_against_hf(smol_async, smol_dir)


def test_smollm2_sync_equals_hf(request, smol_dir):
    from tests.conftest import SMALL, Server
    srv = Server(["--model", str(smol_dir), "--no-async-scheduling", *SMALL])
    request.addfinalizer(srv.stop)
    check_against_hf(srv, smol_dir)
