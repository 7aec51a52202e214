"""Non-finite logits at run time end only their request, with finish reason "error" (issue 40, finding 7).

The model is real and its weights are finite: a tiny Llama served in float16 whose token ``BAD`` embeds at
65,504 (float16's largest value) in every dimension, and whose first layer's output projection is 20x
larger. Any other token's residual stream stays small; ``BAD``'s overflows to infinity when the first
attention output is added to it, and the next RMSNorm turns that into NaN, so every position from ``BAD``
on has NaN logits: float16 overflow, as large activations give real models.
"""

from __future__ import annotations

import json
import threading

import httpx
import pytest
from safetensors.torch import load_file, save_file

from tests.conftest import Server, make_tiny_llama

BAD = 1000
FLAGS = ["--dtype", "float16", "--attention-backend", "torch_bucketed", "--max-model-len", "256"]


@pytest.fixture(scope="module")
def overflow_dir(tmp_path_factory, smol_dir):
    d = make_tiny_llama(tmp_path_factory.mktemp("overflow"), smol_dir, tie_word_embeddings=False)
    tensors = load_file(d / "model.safetensors")
    tensors["model.embed_tokens.weight"][BAD] = 65504.0
    tensors["model.layers.0.self_attn.o_proj.weight"] *= 20
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    return d


@pytest.fixture(scope="module")
def overflowing(request, overflow_dir):
    d = overflow_dir
    # Few blocks, handed out last freed first: the failed requests' blocks are the next ones used.
    srv = Server(["--model", str(d), *FLAGS, "--num-kv-blocks", "32", "--block-size", "16"])
    request.addfinalizer(srv.stop)
    return srv


def complete(srv: Server, prompt: list[int], **body) -> httpx.Response:
    payload = {"model": srv.model, "prompt": prompt, "max_tokens": 12, "temperature": 0, **body}
    return httpx.post(f"{srv.url}/v1/completions", json=payload, timeout=120)


def stream_events(srv: Server, prompt: list[int], **body) -> list:
    payload = {"model": srv.model, "prompt": prompt, "max_tokens": 12, "temperature": 0, "stream": True, **body}
    with httpx.stream("POST", f"{srv.url}/v1/completions", json=payload, timeout=120) as r:
        assert r.status_code == 200, r.read()
        return [
            line[6:] if line == "data: [DONE]" else json.loads(line[6:])
            for line in r.iter_lines()
            if line.startswith("data: ")
        ]


GOOD = [5, 6, 7, 8, 9]


# BAD ends the prompt (the prefill's sampled position overflows), or the bias makes it the first output
# token (the next decode step's position overflows, with a step already planned after it).
CASES = {"prompt": (GOOD + [BAD], {}), "output": (GOOD, {"logit_bias": {str(BAD): 100}})}


@pytest.mark.parametrize("case", CASES)
def test_a_request_whose_logits_overflow_ends_with_an_error(overflowing, case):
    prompt, body = CASES[case]
    r = complete(overflowing, prompt, **body)
    assert r.status_code == 500, r.text
    err = r.json()["error"]
    assert err["type"] == "internal_server_error", err
    assert err["message"] == (
        "the request failed: the model's logits were not finite (NaN or infinite): its output cannot be sampled"
    )
    events = stream_events(overflowing, prompt, **body)
    finishes = [c["finish_reason"] for e in events if isinstance(e, dict) and "choices" in e for c in e["choices"]]
    assert finishes[-1] == "error" and "stop" not in finishes and "length" not in finishes, events
    assert "logits were not finite" in events[-2]["error"]["message"] and events[-1] == "[DONE]", events


def test_a_request_beside_an_overflowing_one_is_untouched(overflowing):
    """Its output is the same alone, beside the failing ones, and after them (their KV blocks reused)."""
    solo = complete(overflowing, GOOD, logprobs=1).json()["choices"][0]
    assert solo["finish_reason"] == "length" and len(solo["logprobs"]["tokens"]) == 12, solo
    # BAD at position 10 leaves NaN keys and values in slot 10 of its block, which the next owner of the
    # block (a 5-token prompt) has not written when its masked gather reads the whole block.
    bad = [threading.Thread(target=complete, args=(overflowing, [i, *[7] * 9, BAD])) for i in range(3, 7)]
    for t in bad:
        t.start()
    beside = complete(overflowing, GOOD, logprobs=1).json()["choices"][0]
    for t in bad:
        t.join()
    # Four at once take the eight blocks freed last: the failed requests' among them.
    after = []
    threads = [threading.Thread(target=lambda: after.append(complete(overflowing, GOOD, logprobs=1))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [r.status_code for r in after] == [200] * 4, [r.text for r in after]
    for other in [beside, *(r.json()["choices"][0] for r in after)]:  # float16 rounding varies with the batch
        assert other["text"] == solo["text"] and other["finish_reason"] == "length", other
        assert other["logprobs"]["token_logprobs"] == pytest.approx(solo["logprobs"]["token_logprobs"], abs=0.02)
    m = overflowing.metrics()
    assert m['pipeline_requests_finished_total{finished_reason="error"}'] >= 4, m


def test_speculating_the_request_with_non_finite_logits_ends_alone(overflow_dir):
    """A row verifying drafts has several sampled positions: any of them non-finite ends its request."""
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1})
    srv = Server(["--model", str(overflow_dir), *FLAGS, "--speculative-config", spec])
    try:
        solo = complete(srv, GOOD * 3)
        assert solo.status_code == 200, solo.text
        for prompt, body in CASES.values():
            r = complete(srv, prompt * 2, **body)
            assert r.status_code == 500 and "logits were not finite" in r.json()["error"]["message"], r.text
        assert complete(srv, GOOD * 3).json()["choices"][0]["text"] == solo.json()["choices"][0]["text"]
    finally:
        srv.stop()
