"""Speculative decoding with a draft model changes no greedy token a client sees.

Servers with ``--speculative-config '{"method": "draft_model", ...}'`` (``--speculative-policy
always``, so drafts are made whatever the load) against the same model without it: the tiny
random Llama with a one-layer draft made from the same initialisation (its embeddings and first
layer; random, it rarely agrees with the model: drafts are rejected), async and in lock step, on
greedy requests with and without penalties, aborts, ``max_tokens`` met inside accepted runs and
``n`` = 3; the tiny Llama as its own draft, every greedy draft accepted; SmolLM2 as its own draft,
copying a list given in the prompt, with nearly every draft accepted; sampled requests complete;
and a draft of another vocabulary is refused at start-up with a message naming both models.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import httpx
import pytest

from tests.conftest import REPO, SMALL, make_tiny_llama
from tests.e2e.test_async import run_all, workload
from tests.e2e.test_speculative import LISTED, _server, assert_idle, post_chat, spec_counts


def draft_config(draft, k: int = 3) -> list[str]:
    spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": k}
    return ["--speculative-config", json.dumps(spec), "--speculative-policy", "always"]


@pytest.fixture(scope="module")
def tiny_draft_dir(tmp_path_factory, smol_dir):
    """The tiny Llama's first layer alone: ``make_tiny_model`` seeds the same initialisation."""
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-draft"), smol_dir, num_hidden_layers=1)


TINY = ["--max-num-batched-tokens", "32", *SMALL]


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_tiny_greedy_unchanged(request, tiny_dir, tiny_draft_dir, tiny_sync, mode):
    args = ["--model", str(tiny_dir), *TINY, *draft_config(tiny_draft_dir)]
    spec = _server(request, args + (["--no-async-scheduling"] if mode == "sync" else []))
    jobs = workload(24, seed=21)
    for i, job in enumerate(jobs):
        job["prompt"] += " the cat the cat the cat"
        job["max_tokens"] = max(job["max_tokens"], 8)
        if i % 3 == 1:
            job["sampling"] = {"presence_penalty": 1.2, "frequency_penalty": 0.4, "repetition_penalty": 1.3}
    assert asyncio.run(run_all(spec, jobs)) == asyncio.run(run_all(tiny_sync, jobs))
    assert spec_counts(spec)["num_draft_tokens_total"] > 100  # all of them rejected, or nearly

    def choices(server, body):
        r = httpx.post(f"{server.url}/v1/chat/completions", json={"model": server.model, **body}, timeout=120)
        assert r.status_code == 200, r.text
        return [ch["message"]["content"] for ch in r.json()["choices"]]

    body = {"messages": [{"role": "user", "content": "the cat the cat"}], "n": 3, "temperature": 0, "max_tokens": 30}
    assert choices(spec, body) == choices(tiny_sync, body)
    # Seeded sampling at temperature 1: verified by rejection sampling, the requests complete.
    sampled = {**body, "temperature": 1.0, "seed": 7, "max_tokens": 20, "ignore_eos": True}
    r = httpx.post(f"{spec.url}/v1/chat/completions", json={"model": spec.model, **sampled}, timeout=120).json()
    assert [ch["finish_reason"] for ch in r["choices"]] == ["length"] * 3 and r["usage"]["completion_tokens"] == 60
    assert_idle(spec, tiny_sync)


def test_tiny_as_its_own_draft_accepts_every_greedy_draft(request, tiny_dir, tiny_sync):
    spec = _server(request, ["--model", str(tiny_dir), *TINY, *draft_config(tiny_dir)])
    jobs = workload(16, seed=22)
    for job in jobs:
        job["abort_after"], job["max_tokens"] = None, max(job["max_tokens"], 8)
    assert asyncio.run(run_all(spec, jobs)) == asyncio.run(run_all(tiny_sync, jobs))
    c = spec_counts(spec)
    assert c["num_draft_tokens_total"] > 50 and c["num_accepted_tokens_total"] == c["num_draft_tokens_total"]
    assert_idle(spec, tiny_sync)


def test_smol_as_its_own_draft_accepts_nearly_every_draft(request, smol_dir, smol_sync):
    spec = _server(request, ["--model", str(smol_dir), "--served-model-name", "smol", *SMALL, *draft_config(smol_dir)])
    got = post_chat(spec)["choices"][0]["message"]["content"]
    assert got == post_chat(smol_sync)["choices"][0]["message"]["content"] == LISTED
    c = spec_counts(spec)
    assert c["num_draft_tokens_total"] > 30 and c["num_accepted_tokens_total"] / c["num_draft_tokens_total"] > 0.9
    cut = [post_chat(srv, stop=["violet"])["choices"][0] for srv in (spec, smol_sync)]
    assert cut[0]["message"] == cut[1]["message"] and cut[0]["finish_reason"] == cut[1]["finish_reason"] == "stop"
    assert_idle(spec, smol_sync)


def test_a_draft_of_another_vocabulary_is_refused_at_start_up(tiny_dir, smol_dir, tmp_path):
    other = make_tiny_llama(tmp_path / "other", smol_dir, vocab_size=1000)
    args = ["--model", str(tiny_dir), *SMALL, *draft_config(other)]
    out = subprocess.run(
        [sys.executable, "-m", "pipeline.launcher", *args], capture_output=True, text=True, cwd=REPO, timeout=120
    )
    assert out.returncode == 2
    assert f"the draft model {other} has a vocabulary of 1000 tokens and the model {tiny_dir}" in out.stderr
