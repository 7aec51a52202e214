"""--chat-template and a template without a system role; the KV cache sized by the workers."""

from __future__ import annotations

import httpx
import pytest
from transformers import AutoTokenizer

from tests.conftest import SMALL, Server

# Gemma 2's chat template: it has no system role.
GEMMA2_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}"
    "{% endif %}{{ '<start_of_turn>' + role + '\\n' + message['content'] | trim + '<end_of_turn>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{'<start_of_turn>model\\n'}}{% endif %}"
)


@pytest.fixture(scope="module")
def gemma_template_server(request, tiny_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("template") / "gemma2.jinja"
    path.write_text(GEMMA2_TEMPLATE)
    srv = Server(
        ["--model", str(tiny_dir), "--chat-template", str(path), "--attention-backend", "torch_bucketed", *SMALL]
    )
    request.addfinalizer(srv.stop)
    return srv


def test_chat_template_overrides_the_tokenizers(gemma_template_server, tiny_dir):
    srv = gemma_template_server
    messages = [{"role": "user", "content": "Hello there"}]
    got = httpx.post(f"{srv.url}/tokenize", json={"model": srv.model, "messages": messages}).json()["tokens"]
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    expected = tok.apply_chat_template(messages, chat_template=GEMMA2_TEMPLATE, add_generation_prompt=True)
    assert got == list(expected["input_ids"] if hasattr(expected, "keys") else expected)
    body = {"model": srv.model, "messages": messages, "max_tokens": 4, "temperature": 0}
    assert httpx.post(f"{srv.url}/v1/chat/completions", json=body, timeout=60).status_code == 200


def test_a_template_without_a_system_role_answers_a_system_message_with_400(gemma_template_server):
    srv = gemma_template_server
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    r = httpx.post(f"{srv.url}/v1/chat/completions", json={"model": srv.model, "messages": messages}, timeout=60)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "messages"
    assert "the chat template rejected the messages: System role not supported" in err["message"]


def test_workers_size_the_kv_cache_and_the_scheduler_gets_their_figure(tiny_kv4_dir):
    """What the workers do on CUDA after their profiling step, with a byte budget on CPU: over two ranks,
    each holding half the KV heads, 200 blocks of 4096 bytes (2 layers x K and V x 2 heads x 8 x 16 tokens x 4 B)."""
    srv = Server(
        ["--model", str(tiny_kv4_dir), "-tp", "2", "--attention-backend", "torch_bucketed", *SMALL],
        config={"num_kv_blocks": 0, "kv_cache_memory_bytes": 200 * 4096},
    )
    try:
        assert srv.metrics()["pipeline_kv_blocks_total"] == 200
        body = {"model": srv.model, "prompt": "The sky is", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        r = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
    finally:
        srv.stop()
