"""Greedy outputs through the real server equal transformers' `generate`.

Prompts are sent as token ids to /v1/completions with ignore_eos, so the
comparison is exact over all 48 tokens; all prompts run concurrently, so
batching, chunked prefill and placeholders are all exercised. A long-tailed
mix (one prompt of 1,000 tokens beside short ones) checks that attention is
exact when the requests of one step have very different contexts.
"""

from __future__ import annotations

import time
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
    r = httpx.post(
        f"{server.url}/v1/completions",
        timeout=300,
        json={
            "model": server.model,
            "prompt": prompt_ids,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
        },
    )
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
    assert m["pipeline_req_indices_free"] == m["pipeline_req_indices_total"]


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_tiny_llama_equals_hf(mode, tiny_async, tiny_sync, tiny_dir):
    check_against_hf(tiny_async if mode == "async" else tiny_sync, tiny_dir)


def test_smollm2_async_equals_hf(smol_async, smol_dir):
    check_against_hf(smol_async, smol_dir)


def test_smollm2_sync_equals_hf(smol_sync, smol_dir):
    check_against_hf(smol_sync, smol_dir)


LONG_PROMPT_TOKENS = 1000
LONG_NEW_TOKENS = 12
SHORT_NEW_TOKENS = NEW_TOKENS  # the continuations check_against_hf already asked the reference for


def long_prompt_ids(tok) -> list[int]:
    """A prompt of exactly ``LONG_PROMPT_TOKENS`` ids of ordinary text."""
    text = " ".join(f"Note {i}: {PROMPTS[i % len(PROMPTS)]} {i * 7 % 13} apples." for i in range(200))
    ids = tok(text)["input_ids"]
    assert len(ids) >= LONG_PROMPT_TOKENS
    return ids[:LONG_PROMPT_TOKENS]


@pytest.mark.parametrize("case", ["tiny-async", "tiny-sync", "smol-async", "smol-sync"])
def test_long_tailed_mix_equals_hf(case, request, tiny_dir, smol_dir):
    """One request of 1,000 prompt tokens beside short ones: steps mix its prefill chunks with the
    short requests' decodes, then its decodes at ~1,000 tokens of context with theirs at a few
    dozen (attention whose cost follows each request's own context must still be exact)."""
    server = request.getfixturevalue(case.replace("-", "_"))
    model_dir = tiny_dir if case.startswith("tiny") else smol_dir
    _, tok = load(str(model_dir))
    shorts = [tok(p)["input_ids"] for p in PROMPTS[:4]]
    long_ids = long_prompt_ids(tok)
    with ThreadPoolExecutor(len(shorts) + 1) as pool:
        futures = [pool.submit(complete_ids, server, p, SHORT_NEW_TOKENS) for p in shorts]
        time.sleep(0.5)  # the short ones are decoding when the long prompt's chunks arrive
        long_out = pool.submit(complete_ids, server, long_ids, LONG_NEW_TOKENS).result()
        ours = [f.result() for f in futures]
    for p, o in zip(shorts, ours):
        assert_same_greedy(str(model_dir), p, o, hf_greedy(str(model_dir), p, SHORT_NEW_TOKENS))
    assert_same_greedy(str(model_dir), long_ids, long_out, hf_greedy(str(model_dir), long_ids, LONG_NEW_TOKENS))
    m = server.wait_idle()
    assert m["pipeline_kv_blocks_free"] == m["pipeline_kv_blocks_total"]
