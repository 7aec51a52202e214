"""Log-probabilities and echo through the real server.

Values equal transformers' log-softmax on the same tokens (float32, 1e-4):
the tiny random Llama with a 32-token step budget (every prompt here is
prefilled in several chunks) and SmolLM2 in one chunk. Sampled tokens get the
raw model's value, not the filtered distribution's, and every value is a
finite JSON number. Also: the shapes OpenAI gives (legacy completions object,
chat ``content`` entries, streamed per chunk), ``echo`` with ``max_tokens`` 0
and 1, prompt lists, and a 400 naming the field for each invalid value.
"""

from __future__ import annotations

import json
import math
import random

import httpx
import openai
import pytest
import torch

from tests.reference import load

TOL = 1e-4


def post(server, path: str, body: dict) -> dict:
    r = httpx.post(f"{server.url}{path}", json={"model": server.model, **body}, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


@torch.inference_mode()
def reference_logprobs(model_dir, ids: list[int]) -> torch.Tensor:
    """``[len(ids), V]``: row ``j`` is transformers' log-softmax predicting ``ids[j + 1]``."""
    model, _ = load(str(model_dir))
    return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)


def check_echo_logprobs(model_dir, prompt: list[int], choice: dict, k: int) -> None:
    """``choice`` (echo, logprobs k) lists the prompt then the output, each value equal to the reference."""
    out_ids = choice["token_ids"]
    ids = prompt + out_ids
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(ids)
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    ref = reference_logprobs(model_dir, ids)
    for j in range(1, len(ids)):
        want = ref[j - 1]
        assert abs(lp["token_logprobs"][j] - want[ids[j]].item()) < TOL, j
        top = lp["top_logprobs"][j]
        # k alternatives plus the token itself when it is not among them (texts may coincide).
        assert len(top) <= k + 1
        assert abs(max(top.values()) - want.max().item()) < TOL, j
    assert lp["text_offset"] == sorted(lp["text_offset"])


@pytest.mark.parametrize("model", ["tiny", "smol"])
def test_echo_logprobs_equal_transformers(request, model, tiny_dir, smol_dir):
    server = request.getfixturevalue(f"{model}_async")
    model_dir = tiny_dir if model == "tiny" else smol_dir
    rng = random.Random(7)
    # 70 tokens: at least three prefill chunks on the tiny server (budget 32).
    prompt = [rng.randrange(10, 49000) for _ in range(70)]
    body = post(
        server,
        "/v1/completions",
        {
            "prompt": prompt,
            "max_tokens": 4,
            "temperature": 0,
            "echo": True,
            "logprobs": 5,
            "ignore_eos": True,
            "return_token_ids": True,
        },
    )
    choice = body["choices"][0]
    check_echo_logprobs(model_dir, prompt, choice, 5)
    ref = reference_logprobs(model_dir, prompt + choice["token_ids"])
    for i, t in enumerate(choice["token_ids"]):  # greedy: each output token is the reference's argmax
        assert (
            t == int(ref[len(prompt) - 1 + i].argmax())
            or ref[len(prompt) - 1 + i].max() - ref[len(prompt) - 1 + i, t] < 1e-3
        )


def test_sampled_logprobs_are_the_raw_models_and_finite(tiny_async, tiny_dir):
    """top_k 3 and top_p 0.3 leave most tokens at -inf for the sampler; the values returned are
    the unfiltered log-softmax, finite, and the alternatives are the model's most likely tokens."""
    prompt = list(range(100, 140))
    body = post(
        tiny_async,
        "/v1/completions",
        {
            "prompt": prompt,
            "max_tokens": 6,
            "temperature": 1.5,
            "top_k": 3,
            "top_p": 0.3,
            "seed": 5,
            "logprobs": 20,
            "ignore_eos": True,
            "return_token_ids": True,
        },
    )
    choice = body["choices"][0]
    ids = prompt + choice["token_ids"]
    ref = reference_logprobs(tiny_dir, ids)
    lp = choice["logprobs"]
    assert len(lp["token_logprobs"]) == 6
    for i, (value, top) in enumerate(zip(lp["token_logprobs"], lp["top_logprobs"])):
        want = ref[len(prompt) - 1 + i]
        assert math.isfinite(value) and abs(value - want[ids[len(prompt) + i]].item()) < TOL
        assert all(math.isfinite(v) for v in top.values())
        assert abs(min(top.values()) - want.topk(20).values[-1].item()) < TOL


def test_echo_with_max_tokens_0_and_1(sim_async):
    for prompt in ("The quick brown fox jumps", [5, 6, 7, 8], [42]):
        for max_tokens in (0, 1):
            body = post(
                sim_async,
                "/v1/completions",
                {"prompt": prompt, "max_tokens": max_tokens, "echo": True, "logprobs": 3, "return_token_ids": True},
            )
            choice = body["choices"][0]
            n = body["usage"]["prompt_tokens"]
            assert body["usage"]["completion_tokens"] == max_tokens and choice["finish_reason"] == "length"
            if isinstance(prompt, str):
                assert choice["text"].startswith(prompt)
            lp = choice["logprobs"]
            assert len(lp["tokens"]) == n + max_tokens
            assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
            assert all(isinstance(v, float) and math.isfinite(v) for v in lp["token_logprobs"][1:])
            assert all(len(t) in (3, 4) for t in lp["top_logprobs"][1:])
            if max_tokens:
                assert choice["text"].endswith(lp["tokens"][-1])
    # Echo without logprobs: the prompt alone, no log-probabilities.
    body = post(sim_async, "/v1/completions", {"prompt": "Hello there", "max_tokens": 0, "echo": True})
    assert body["choices"][0]["text"] == "Hello there" and body["choices"][0]["logprobs"] is None
    m = sim_async.wait_idle()
    assert m["pipeline_req_indices_free"] == m["pipeline_req_indices_total"]


def test_prompt_lists_give_one_choice_each(sim_async):
    single = [
        post(
            sim_async,
            "/v1/completions",
            {"prompt": p, "max_tokens": 5, "logprobs": 1, "echo": True, "return_token_ids": True},
        )["choices"][0]
        for p in ("alpha beta", "gamma")
    ]
    for prompt in (["alpha beta", "gamma"], [sim_tokens(sim_async, "alpha beta"), sim_tokens(sim_async, "gamma")]):
        body = post(
            sim_async,
            "/v1/completions",
            {"prompt": prompt, "max_tokens": 5, "logprobs": 1, "echo": True, "return_token_ids": True},
        )
        assert [c["index"] for c in body["choices"]] == [0, 1]
        for got, want in zip(body["choices"], single):
            assert got["token_ids"] == want["token_ids"] and got["logprobs"] == want["logprobs"]
        assert body["usage"]["completion_tokens"] == 10
        assert body["usage"]["prompt_tokens"] == sum(len(c["prompt_token_ids"]) for c in body["choices"])
        # Streamed: each choice's chunks, in order, give the same text and log-probabilities.
        text, tokens = {0: "", 1: ""}, {0: [], 1: []}
        with httpx.stream(
            "POST",
            f"{sim_async.url}/v1/completions",
            timeout=300,
            json={
                "model": sim_async.model,
                "prompt": prompt,
                "max_tokens": 5,
                "logprobs": 1,
                "echo": True,
                "stream": True,
            },
        ) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    (c,) = json.loads(line[6:])["choices"]
                    text[c["index"]] += c["text"]
                    if c["logprobs"]:
                        tokens[c["index"]] += c["logprobs"]["token_logprobs"]
        for i, want in enumerate(single):
            assert text[i] == want["text"] and tokens[i] == want["logprobs"]["token_logprobs"]


def sim_tokens(server, text: str) -> list[int]:
    body = post(server, "/v1/completions", {"prompt": text, "max_tokens": 1, "return_token_ids": True})
    return body["choices"][0]["prompt_token_ids"]


def _without_logprobs(entries) -> list:
    return [(e.token, e.bytes, [(t.token, t.bytes) for t in e.top_logprobs]) for e in entries]


def test_chat_logprobs_openai_shapes_streamed_per_chunk(tiny_async):
    client = openai.OpenAI(base_url=f"{tiny_async.url}/v1", api_key="none")
    kw = dict(
        model=tiny_async.model,
        messages=[{"role": "user", "content": "Tell me a story"}],
        max_tokens=12,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
    )
    full = client.chat.completions.create(**kw)
    content = full.choices[0].logprobs.content
    assert len(content) == full.usage.completion_tokens == 12
    for e in content:
        assert isinstance(e.token, str) and math.isfinite(e.logprob) and e.logprob <= 0
        assert bytes(e.bytes).decode("utf-8", errors="replace") == e.token
        assert len(e.top_logprobs) == 2 and e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob
        assert e.top_logprobs[0].logprob == max(e.logprob, e.top_logprobs[0].logprob)  # greedy: the top one
    streamed, text = [], ""
    for chunk in client.chat.completions.create(**kw, stream=True):
        if not chunk.choices:
            continue
        c = chunk.choices[0]
        text += c.delta.content or ""
        if c.logprobs is not None:
            assert len(c.logprobs.content) >= 1
            streamed += c.logprobs.content
    assert text == full.choices[0].message.content
    # The second request finds its prompt in the prefix cache: the same tokens, log-probabilities to 1e-5.
    assert _without_logprobs(streamed) == _without_logprobs(content)
    for a, b in zip(streamed, content):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-5)
        assert [t.logprob for t in a.top_logprobs] == pytest.approx([t.logprob for t in b.top_logprobs], abs=1e-5)
    # Without logprobs, none are returned.
    plain = client.chat.completions.create(**{**kw, "logprobs": False, "top_logprobs": None})
    assert plain.choices[0].logprobs is None


def test_completion_logprobs_through_the_openai_sdk(tiny_async):
    client = openai.OpenAI(base_url=f"{tiny_async.url}/v1", api_key="none")
    r = client.completions.create(
        model=tiny_async.model, prompt="Once upon a time", max_tokens=0, echo=True, logprobs=2
    )
    lp = r.choices[0].logprobs
    assert r.choices[0].text == "Once upon a time" and lp.token_logprobs[0] is None
    assert len(lp.tokens) == r.usage.prompt_tokens and all(len(t) <= 3 for t in lp.top_logprobs[1:])


BAD = [
    ("/v1/completions", {"prompt": "hi", "logprobs": 21}, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "logprobs": -1}, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "logprobs": True}, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": -1, "echo": True}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "echo": "yes"}, "echo"),
    ("/v1/completions", {"prompt": ["a", ""]}, "prompt"),
    ("/v1/completions", {"prompt": [[1, 2], []]}, "prompt"),
    ("/v1/completions", {"prompt": ["a", [1]], "max_tokens": 1}, "prompt"),
    ("/v1/completions", {"prompt": ["a"] * 2049}, "prompt"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": 1}, "logprobs"),
]


@pytest.mark.parametrize("path,body,param", BAD)
def test_invalid_logprob_and_prompt_values_are_400_naming_the_field(sim_async, path, body, param):
    if path.endswith("chat/completions"):
        body = {"messages": [{"role": "user", "content": "hi"}], **body}
    r = httpx.post(f"{sim_async.url}{path}", json={"model": sim_async.model, **body}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and err["message"]
    assert httpx.get(f"{sim_async.url}/health").status_code == 200
