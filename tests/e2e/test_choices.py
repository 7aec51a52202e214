"""n > 1 through the server: one prefill for all choices, each its own index, seeds, usage, and frees.

On the tiny Llama with poison mode on and a 32-token step budget; the
prompts are longer than a KV block, so the choices share the prompt's
blocks (docs/design.md, "Parallel choices").
"""

from __future__ import annotations

import json

import httpx
import openai

PROMPT = "the of and to in is was for on that with as by at from his her an be this " * 3


def complete(srv, **body) -> dict:
    r = httpx.post(
        f"{srv.url}/v1/completions",
        timeout=180,
        json={"model": srv.model, "prompt": PROMPT, "return_token_ids": True, "ignore_eos": True, **body},
    )
    assert r.status_code == 200, r.text
    return r.json()


def test_greedy_choices_are_identical_and_equal_n1(tiny_async):
    one = complete(tiny_async, max_tokens=8, temperature=0)
    three = complete(tiny_async, max_tokens=8, temperature=0, n=3)
    assert [c["index"] for c in three["choices"]] == [0, 1, 2]
    assert all(c["token_ids"] == one["choices"][0]["token_ids"] for c in three["choices"])
    assert three["usage"]["prompt_tokens"] == one["usage"]["prompt_tokens"]
    assert three["usage"]["completion_tokens"] == 3 * 8
    m = tiny_async.wait_idle()
    assert m["pipeline_kv_blocks_free"] == m["pipeline_kv_blocks_total"], m
    assert m["pipeline_req_indices_free"] == m["pipeline_req_indices_total"], m


def test_seeded_choice_i_equals_a_request_with_seed_plus_i(tiny_async):
    sampling = {"max_tokens": 10, "temperature": 1.0, "top_p": 0.95}
    three = complete(tiny_async, n=3, seed=41, **sampling)
    alone = [complete(tiny_async, seed=41 + i, **sampling)["choices"][0]["token_ids"] for i in range(3)]
    assert [c["token_ids"] for c in three["choices"]] == alone
    assert len({tuple(a) for a in alone}) > 1  # the seeds give distinct streams
    # A list of prompts: prompt-major choices.
    two = complete(tiny_async, n=2, seed=41, **{**sampling, "prompt": [PROMPT, PROMPT + " again"]})
    assert [c["index"] for c in two["choices"]] == [0, 1, 2, 3]
    assert [c["token_ids"] for c in two["choices"][:2]] == alone[:2]


def test_streamed_chat_choices(tiny_async):
    client = openai.OpenAI(base_url=f"{tiny_async.url}/v1", api_key="none")
    msgs = [{"role": "user", "content": PROMPT}]
    whole = client.chat.completions.create(
        model=tiny_async.model, messages=msgs, max_tokens=6, temperature=0, n=2, extra_body={"ignore_eos": True}
    )
    texts = {0: "", 1: ""}
    finishes = {}
    stream = client.chat.completions.create(
        model=tiny_async.model,
        messages=msgs,
        max_tokens=6,
        temperature=0,
        n=2,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    usage = None
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            if c.finish_reason:
                finishes[c.index] = c.finish_reason
        usage = chunk.usage or usage
    assert [texts[i] for i in (0, 1)] == [c.message.content for c in whole.choices]
    assert finishes == {0: "length", 1: "length"}
    assert usage.completion_tokens == 12 and usage.prompt_tokens == whole.usage.prompt_tokens


def test_aborted_stream_of_choices_frees_everything(tiny_async):
    body = {
        "model": tiny_async.model,
        "prompt": PROMPT,
        "max_tokens": 200,
        "n": 4,
        "stream": True,
        "ignore_eos": True,
        "temperature": 1.0,
    }
    seen = 0
    with httpx.stream("POST", f"{tiny_async.url}/v1/completions", json=body, timeout=180) as r:
        for line in r.iter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"]:
                seen += 1
                if seen >= 8:
                    break  # closing the stream aborts all four choices
    m = tiny_async.wait_idle()
    assert m["pipeline_num_requests_running"] == 0 and m["pipeline_num_requests_waiting"] == 0, m
    assert m["pipeline_kv_blocks_free"] == m["pipeline_kv_blocks_total"], m
    assert m["pipeline_req_indices_free"] == m["pipeline_req_indices_total"], m


def test_bad_n_and_best_of_are_400(tiny_async):
    for field, value in (("n", 0), ("n", 129), ("best_of", 3)):
        r = httpx.post(
            f"{tiny_async.url}/v1/completions",
            timeout=60,
            json={"model": tiny_async.model, "prompt": "hi", "max_tokens": 2, field: value},
        )
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == field
