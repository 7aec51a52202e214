"""The default model served as its GGUF file holds it (Q4_1 linear weights on torch's int4 kernel), over HTTP."""

from __future__ import annotations

import httpx
import pytest

from tests.conftest import SMALL, Server


@pytest.fixture(scope="module")
def q4_server(request):
    srv = Server(["--quantization", "auto", *SMALL])
    request.addfinalizer(srv.stop)
    return srv


def test_the_default_model_runs_as_q4_1_and_answers(q4_server):
    # The worker's start-up line: every decoder linear layer (30 layers x qkv, o, gate/up, down) holds int4
    # codes in groups of 32 (Q4_1's blocks) on torch's CPU int4 kernel, with bfloat16 scales and zeros: 63.3 MiB
    # against 405 MiB of float32.
    assert "linear weights: 120 x int4 group 32 (int4_cpu), 63.3 MiB" in q4_server.output()
    body = {
        "model": q4_server.model,
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "max_tokens": 16,
        "temperature": 0,
    }
    r = httpx.post(f"{q4_server.url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200
    assert "Paris" in r.json()["choices"][0]["message"]["content"]
