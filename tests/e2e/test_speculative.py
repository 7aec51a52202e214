"""Speculative decoding changes no token a client sees, and shows in /metrics.

Servers with ``--speculative-config`` (prompt lookup) against the same model without it: the
simulated device (drafts right with probability 0.7, every token depending on the whole chain
before it), the tiny random Llama, SmolLM2 on a request to copy a list given in the prompt (which
it copies exactly, so drafts are accepted most), and the tiny Llama over two tensor-parallel ranks.
The servers pin K (``--speculative-policy always``), so that drafts are made whatever the machine's
load; one test runs the adaptive policy, whose choices depend on measured times, for equality. Greedy,
seeded sampling, penalties, log-probabilities, ``n`` = 3, stop tokens and stop strings met inside
an accepted run, ``max_tokens`` inside one, aborts, preemption, structured output and prompts
found in the prefix cache (blocks filled through verified drafts) must all give the tokens of the
server without speculation, async and in lock step, and every KV block and req_index must come back.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from transformers import AutoTokenizer

from tests.conftest import SIM, SMALL, Server
from tests.e2e.test_async import assert_same_logprobs, run_all, workload

CONFIG = ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, '
          '"prompt_lookup_max": 3}']  # fmt: skip
# Every row that may draft drafts K: whether drafts are made does not depend on measured step times.
SPEC = [*CONFIG, "--speculative-policy", "always"]
TINY = ["--max-num-batched-tokens", "32", *SMALL]


def _server(request, args):
    srv = Server(args)
    request.addfinalizer(srv.stop)
    return srv


@pytest.fixture(scope="module")
def sim_spec_async(request):
    return _server(request, [*SIM, *SPEC, "--sim-draft-acceptance", "0.7"])


@pytest.fixture(scope="module")
def sim_spec_sync(request):
    return _server(request, [*SIM, *SPEC, "--sim-draft-acceptance", "0.7", "--no-async-scheduling"])


@pytest.fixture(scope="module")
def tiny_spec_async(request, tiny_dir):
    return _server(request, ["--model", str(tiny_dir), *TINY, *SPEC])


@pytest.fixture(scope="module")
def tiny_spec_sync(request, tiny_dir):
    return _server(request, ["--model", str(tiny_dir), *TINY, *SPEC, "--no-async-scheduling"])


def repeating_job(model_dir, max_tokens: int) -> dict:
    """A greedy request whose output repeats " the" (a logit bias of 100), found in its prompt: it drafts."""
    the = AutoTokenizer.from_pretrained(model_dir)(" the", add_special_tokens=False).input_ids[-1]
    return {
        "prompt": "the cat the cat",
        "max_tokens": max_tokens,
        "abort_after": None,
        "sampling": {"logit_bias": {str(the): 100.0}},
    }


def spec_counts(server) -> dict[str, float]:
    m = server.metrics()
    return {k.removeprefix("pipeline_spec_decode_"): v for k, v in m.items() if "spec_decode" in k}


def assert_idle(*servers) -> None:
    for srv in servers:
        m = srv.wait_idle()
        assert m["pipeline_kv_blocks_free"] == m["pipeline_kv_blocks_total"], m
        assert m["pipeline_req_indices_free"] == m["pipeline_req_indices_total"], m


# First in the module: its two -tp 2 servers (four workers) start before the module-scoped servers below,
# which stay up until the module ends, beside the session's.
def test_tensor_parallel(request, tiny_kv4_dir):
    jobs = workload(8, seed=13)
    for job in jobs:
        job["prompt"] += " a b a b a b"
    # The workload's requests end or are aborted within 5 tokens, and the random model seldom repeats a
    # token: whether one of them drafts varies with the load. This one repeats " the" long enough to draft.
    jobs.append(repeating_job(tiny_kv4_dir, 60))
    base = ["--model", str(tiny_kv4_dir), *TINY, "-tp", "2"]
    spec = _server(request, [*base, *SPEC])
    plain = _server(request, [*base, "--no-async-scheduling"])
    assert asyncio.run(run_all(spec, jobs)) == asyncio.run(run_all(plain, jobs))
    assert spec_counts(spec)["num_draft_tokens_total"] > 0
    assert_idle(spec, plain)


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_sim_tokens_unchanged(request, sim_sync, mode):
    """64 requests at once (aborts, max_tokens 1), then one at a time, and stop tokens met mid-run."""
    spec = request.getfixturevalue(f"sim_spec_{mode}")
    before = spec_counts(spec)
    jobs = workload(64, seed=5)
    assert asyncio.run(run_all(spec, jobs)) == asyncio.run(run_all(sim_sync, jobs))
    one = workload(4, seed=6)
    assert [asyncio.run(run_all(spec, [j]))[0] for j in one] == [asyncio.run(run_all(sim_sync, [j]))[0] for j in one]
    # A stop token that comes inside an accepted run ends the request there, in both.
    ref = asyncio.run(run_all(sim_sync, [{"prompt": "stop here", "max_tokens": 40, "abort_after": None}]))[0]
    stop = {"prompt": "stop here", "max_tokens": 40, "abort_after": None, "sampling": {"stop_token_ids": [ref[17]]}}
    got = asyncio.run(run_all(spec, [{**stop, "sampling": {**stop["sampling"], "ignore_eos": False}}]))[0]
    assert got == ref[:18]
    # One request that nothing aborts, long enough for a hundred drafts whatever the load (the workload's
    # aborts land after a number of tokens that depends on it).
    long = {"prompt": "a long answer", "max_tokens": 240, "abort_after": None}
    assert asyncio.run(run_all(spec, [long])) == asyncio.run(run_all(sim_sync, [long]))
    after = spec_counts(spec)
    drafted = after["num_draft_tokens_total"] - before["num_draft_tokens_total"]
    accepted = after["num_accepted_tokens_total"] - before["num_accepted_tokens_total"]
    assert drafted > 100 and 0.3 < accepted / drafted < 0.9  # drafts right with probability 0.7, each
    per_pos = [v for k, v in after.items() if k.startswith("num_accepted_tokens_per_pos_total")]
    assert len(per_pos) == 3 and sum(per_pos) == after["num_accepted_tokens_total"]
    assert per_pos[0] >= per_pos[1] >= per_pos[2]  # a draft is accepted only after the ones before it
    assert_idle(spec, sim_sync)


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_sim_constrained_rows_draft_and_are_unchanged(request, sim_sync, mode):
    """8 constrained requests at once on the simulated device, which draws the allowed token nearest to its
    own: the rows verify drafts, each position under its own mask, and every token is that of the server
    without speculation in lock step. Half are JSON-schema rows (their drafts, the device's chain of words,
    are forbidden at once: whitespace is the allowed token nearest a word); the others a regex that forbids
    only braces, under which the chain's drafts are accepted. (8 rows leave the 32-token steps room for
    everyone's 3 drafts: with more, --speculative-policy always drafts for the rows first in line.)"""
    spec = request.getfixturevalue(f"sim_spec_{mode}")
    schema = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
    json_schema = {"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": schema}}}
    grammars = [json_schema, {"guided_regex": "[^{}]+"}]

    async def run(server):
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:

            async def one(i):
                body = {
                    "model": server.model,
                    "messages": [{"role": "user", "content": f"person {i}"}],
                    "max_tokens": 40,
                    "temperature": 0,
                    "return_token_ids": True,
                    **grammars[i % 2],
                }
                r = await client.post("/v1/chat/completions", json=body)
                assert r.status_code == 200, r.text
                return r.json()["choices"][0]

            return await asyncio.gather(*(one(i) for i in range(8)))

    before = spec_counts(spec)
    got, ref = asyncio.run(run(spec)), asyncio.run(run(sim_sync))
    assert [c["token_ids"] for c in got] == [c["token_ids"] for c in ref]
    assert all(c["message"]["content"].startswith("{") for c in got[::2])
    assert not any("{" in c["message"]["content"] for c in got[1::2])
    after = spec_counts(spec)
    accepted = after["num_accepted_tokens_total"] - before["num_accepted_tokens_total"]
    assert accepted > 20, (before, after)
    assert_idle(spec, sim_sync)


def test_sim_adaptive_policy_tokens_unchanged(request, sim_sync):
    """The adaptive policy drafts where measured times say it pays (so how much depends on the
    machine): the tokens stay the same, and its counts agree with one another."""
    spec = _server(request, [*SIM, *CONFIG, "--sim-draft-acceptance", "0.7"])
    jobs = workload(32, seed=7)
    assert asyncio.run(run_all(spec, jobs)) == asyncio.run(run_all(sim_sync, jobs))
    c = spec_counts(spec)
    per_pos = [v for k, v in c.items() if k.startswith("num_accepted_tokens_per_pos_total")]
    assert sum(per_pos) == c["num_accepted_tokens_total"] <= c["num_draft_tokens_total"]
    assert c["num_drafts_total"] <= c["num_draft_tokens_total"] <= 3 * c["num_drafts_total"]
    assert_idle(spec, sim_sync)


def test_sim_preemption(request):
    """A KV cache too small for the batch: requests are preempted while drafts are in flight, and
    recompute to the same tokens."""
    small = ["--num-kv-blocks", "24", "--max-model-len", "256"]
    spec = _server(request, [*SIM, *SPEC, *small])
    plain = _server(request, [*SIM, *small, "--no-async-scheduling"])
    jobs = [{"prompt": f"{i}: " + "the of " * 20, "max_tokens": 120, "abort_after": None} for i in range(12)]
    assert asyncio.run(run_all(spec, jobs)) == asyncio.run(run_all(plain, jobs))
    assert spec.metrics()["pipeline_num_preemptions_total"] > 0
    assert spec_counts(spec)["num_accepted_tokens_total"] > 0
    assert_idle(spec, plain)


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_tiny_greedy_sampled_penalized_unchanged(request, tiny_sync, tiny_dir, mode):
    """The tiny Llama, 25 requests at once: greedy, seeded sampling and penalties."""
    spec = request.getfixturevalue(f"tiny_spec_{mode}")
    jobs = workload(24, seed=9)
    for i, job in enumerate(jobs):
        job["prompt"] += " the cat the cat the cat"  # something to look up
        job["max_tokens"] = max(job["max_tokens"], 8)
        job["sampling"] = [
            {},
            {"temperature": 1.0, "top_p": 0.9, "seed": 100 + i},
            {"presence_penalty": 1.2, "frequency_penalty": 0.4, "repetition_penalty": 1.3},
            {"temperature": 0.8, "seed": i, "logit_bias": {"1000": 5.0}, "min_tokens": 4, "ignore_eos": False},
        ][i % 4]
    # Whether the random model repeats itself, and finds room to draft in the burst, varies with the
    # load: one row repeats " the", found in its prompt, and decodes on past the burst, so it drafts.
    jobs.append(repeating_job(tiny_dir, 200))
    assert asyncio.run(run_all(spec, jobs)) == asyncio.run(run_all(tiny_sync, jobs))
    assert spec_counts(spec)["num_draft_tokens_total"] > 0
    assert_idle(spec, tiny_sync)


def test_tiny_logprobs_n_and_structured_output(tiny_spec_async, tiny_sync):
    """Log-probabilities (to 1e-4) and echo, n = 3 seeded choices, and a JSON-constrained request."""
    jobs = workload(12, seed=11)
    for job in jobs:
        job["abort_after"] = None
        job["logprobs"] = 2
    for x, y in zip(asyncio.run(run_all(tiny_spec_async, jobs)), asyncio.run(run_all(tiny_sync, jobs))):
        assert_same_logprobs(x, y)

    def post(server, body):
        r = httpx.post(f"{server.url}/v1/chat/completions", json={"model": server.model, **body}, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()

    messages = [{"role": "user", "content": "the cat the cat the cat"}]
    choices = {"messages": messages, "n": 3, "temperature": 1.0, "seed": 4, "max_tokens": 24}
    a, b = post(tiny_spec_async, choices), post(tiny_sync, choices)
    assert [c["message"]["content"] for c in a["choices"]] == [c["message"]["content"] for c in b["choices"]]
    structured = {"messages": messages, "max_tokens": 30, "temperature": 0, "response_format": {"type": "json_object"}}
    a, b = post(tiny_spec_async, structured), post(tiny_sync, structured)
    assert a["choices"][0]["message"] == b["choices"][0]["message"]
    assert_idle(tiny_spec_async, tiny_sync)


# SmolLM2-135M copies this list exactly under greedy decoding (checked against transformers): asked
# to rewrite code, it paraphrases, and few drafts are accepted.
ITEMS = ["red", "green", "blue", "yellow", "purple", "orange", "black", "white", "silver", "golden", "pink", "brown",
         "gray", "violet", "cyan", "maroon"]  # fmt: skip
LISTED = "\n".join(f"- {c}" for c in ITEMS)
REWRITE = [{"role": "user", "content": f"Copy this list exactly, one item per line:\n{LISTED}"}]


@pytest.fixture(scope="module")
def smol_spec(request, smol_dir):
    return _server(request, ["--model", str(smol_dir), "--served-model-name", "smol", *SMALL, *SPEC])


def post_chat(server, messages=REWRITE, **extra) -> dict:
    body = {"model": "smol", "messages": messages, "max_tokens": 60, "temperature": 0, **extra}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def test_smol_copy_is_unchanged_and_accepts_drafts(smol_spec, smol_sync):
    """SmolLM2 copying a list given in the prompt: the text is the list, most drafts are accepted,
    and it is the same text without speculation, also where a stop string cuts it inside an
    accepted run."""
    spec = smol_spec

    def post(server, **extra):
        return post_chat(server, **extra)["choices"][0]

    before = spec_counts(spec)
    plain, fast = post(smol_sync), post(spec)
    assert fast["message"]["content"] == plain["message"]["content"] == LISTED
    after = spec_counts(spec)
    drafted = after["num_draft_tokens_total"] - before["num_draft_tokens_total"]
    assert drafted > 0 and (after["num_accepted_tokens_total"] - before["num_accepted_tokens_total"]) / drafted > 0.5
    cut = post(smol_sync, stop=["violet"]), post(spec, stop=["violet"])
    assert cut[0]["message"]["content"] == cut[1]["message"]["content"]
    assert cut[0]["finish_reason"] == cut[1]["finish_reason"] == "stop"
    assert_idle(spec, smol_sync)


def test_smol_prefix_cache_hits_after_drafts_unchanged(smol_spec, smol_sync):
    """The prefix cache on in both servers, greedy: the rewrite sent again finds its prompt's whole
    blocks, and a second turn (prompt, reply, a new message) finds the blocks that the reply filled
    through verified drafts; the tokens stay those of the server without speculation."""
    first = post_chat(smol_spec)
    reply = first["choices"][0]["message"]["content"]
    assert reply == post_chat(smol_sync)["choices"][0]["message"]["content"]
    prompt_tokens = first["usage"]["prompt_tokens"]
    before = spec_counts(smol_spec)
    again = post_chat(smol_spec)
    assert again["choices"][0]["message"]["content"] == reply
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == (prompt_tokens - 1) // 16 * 16
    turn = [*REWRITE, {"role": "assistant", "content": reply}, {"role": "user", "content": "Once more, exactly."}]
    got, ref = post_chat(smol_spec, turn, max_tokens=80), post_chat(smol_sync, turn, max_tokens=80)
    assert got["choices"][0]["message"]["content"] == ref["choices"][0]["message"]["content"]
    # Past the prompt's blocks: the reply's, named only from final tokens.
    assert got["usage"]["prompt_tokens_details"]["cached_tokens"] > prompt_tokens // 16 * 16
    after = spec_counts(smol_spec)
    assert after["num_accepted_tokens_total"] > before["num_accepted_tokens_total"]
    assert_idle(smol_spec, smol_sync)


def test_smol_prompt_lookup_sees_a_cached_prompt(smol_spec, smol_sync):
    """A prompt found in the prefix cache is in prompt lookup's history too (the worker keeps the token of each
    KV slot, and a row admitted after a cached prefix takes its tokens from there): the list sent again, its
    prompt now from the cache, is copied with as many drafts accepted as the first time."""
    messages = [{"role": "user", "content": "Cached. " + REWRITE[0]["content"]}]
    other = [{"role": "user", "content": "Other. " + " ".join(reversed(ITEMS * 4))}]
    accepted = []
    for _ in range(2):
        before = spec_counts(smol_spec)
        got = post_chat(smol_spec, messages)
        after = spec_counts(smol_spec)
        accepted.append(after["num_accepted_tokens_total"] - before["num_accepted_tokens_total"])
        post_chat(smol_spec, other, max_tokens=1)  # another prompt at the same req_index, over its history
    assert got["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    ref = post_chat(smol_sync, messages)
    assert got["choices"][0]["message"]["content"] == ref["choices"][0]["message"]["content"]
    assert accepted[1] >= 0.8 * accepted[0] > 0, accepted
    assert_idle(smol_spec, smol_sync)


COPY_JSON = json.dumps({"colors": ITEMS[:10]})
COLORS = {
    "type": "object",
    "properties": {"colors": {"type": "array", "items": {"type": "string"}}},
    "required": ["colors"],
    "additionalProperties": False,
}
GRAMMARS = {
    "json_schema": (
        f"Copy this JSON exactly: {COPY_JSON}",
        {"response_format": {"type": "json_schema", "json_schema": {"name": "colors", "schema": COLORS}}},
    ),
    # Prompts no other test sends: prompt lookup sees only the prompt tokens a step computed, not those
    # found in the prefix cache.
    "regex": ("Regex. " + REWRITE[0]["content"], {"guided_regex": "(- [a-z]+\n)+- [a-z]+"}),
    "choice": (
        "Choice. " + REWRITE[0]["content"],
        {"guided_choice": [LISTED, LISTED.replace("violet", "indigo"), "none"]},
    ),
    "tool_call": (
        f"Save these colors: {', '.join(ITEMS[:10])}. Call save_colors with the list {COPY_JSON}.",
        {
            "tools": [
                {
                    "type": "function",
                    "function": {"name": "save_colors", "description": "Save colors.", "parameters": COLORS},
                }
            ],
            "tool_choice": {"type": "function", "function": {"name": "save_colors"}},
        },
    ),
}


# Eight required keys of short strings and enums, compact (llguidance's "x-guidance" option): between the
# values the grammar forces the keys and their punctuation, which jump-forward verifies as drafts.
KEYS = ["name", "species", "color", "habitat", "diet", "temperament", "size", "lifespan"]
CAT = {
    "type": "object",
    "properties": {
        k: {"type": "string", "maxLength": 12} if i % 2 == 0 else {"enum": ["small", "large"]}
        for i, k in enumerate(KEYS)
    },  # fmt: skip
    "required": KEYS,
    "additionalProperties": False,
    "x-guidance": {"whitespace_flexible": False},
}
GRAMMARS["json_forced"] = (
    "Describe a cat as JSON.",
    {"response_format": {"type": "json_schema", "json_schema": {"name": "cat", "schema": CAT}}},
)


@pytest.fixture(scope="module")
def smol_spec_no_jf(request, smol_dir):
    args = ["--model", str(smol_dir), "--served-model-name", "smol", *SMALL, *SPEC, "--no-grammar-jump-forward"]
    return _server(request, args)


@pytest.mark.parametrize("jump_forward", [True, False], ids=["jump_forward", "lookup_only"])
@pytest.mark.parametrize("kind", list(GRAMMARS))
def test_smol_constrained_rows_draft_and_are_unchanged(request, smol_sync, kind, jump_forward):
    """A constrained row verifies drafts too, each position under its own mask (the grammar walks the
    drafts; one it forbids ends them there), with its grammar's forced tokens as drafts (jump-forward) or
    prompt lookup's only: the tokens are those of the server without speculation in lock step, and drafts
    of the constrained row are accepted."""
    spec = request.getfixturevalue("smol_spec" if jump_forward else "smol_spec_no_jf")
    content, extra = GRAMMARS[kind]
    messages = [{"role": "user", "content": content}]
    before = spec_counts(spec)
    got = post_chat(spec, messages, max_tokens=80, return_token_ids=True, **extra)["choices"][0]
    ref = post_chat(smol_sync, messages, max_tokens=80, return_token_ids=True, **extra)["choices"][0]
    for call in got["message"].get("tool_calls", []) + ref["message"].get("tool_calls", []):
        call.pop("id")  # random
    assert got["token_ids"] == ref["token_ids"] and got["message"] == ref["message"]
    assert got["finish_reason"] == ref["finish_reason"]
    after = spec_counts(spec)
    assert after["num_accepted_tokens_total"] - before["num_accepted_tokens_total"] >= 4, (before, after)
    assert_idle(spec, smol_sync)


def test_vllm_metric_names(request):
    """With --metrics-compat vllm the four spec_decode metrics have vLLM's names and labels."""
    srv = _server(request, [*SIM, *SPEC, "--metrics-compat", "vllm"])
    asyncio.run(run_all(srv, workload(4, seed=1)))
    families = {f.name: f for f in text_string_to_metric_families(httpx.get(f"{srv.url}/metrics").text)}
    for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        (sample,) = [s for s in families[f"vllm:spec_decode_{name}"].samples if s.name.endswith("_total")]
        assert set(sample.labels) == {"model_name", "engine"}
    per_pos = [s for s in families["vllm:spec_decode_num_accepted_tokens_per_pos"].samples if s.name.endswith("_total")]
    assert sorted(s.labels["position"] for s in per_pos) == ["0", "1", "2"]
    assert all(set(s.labels) == {"model_name", "engine", "position"} for s in per_pos)
    assert json.loads(SPEC[1])["num_speculative_tokens"] == len(per_pos)
