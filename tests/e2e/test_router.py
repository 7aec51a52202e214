"""Two replicas on the simulated device behind SGLang's model gateway (``sglang-router``, cache-aware): a
multi-turn chat workload keeps each conversation on its replica (every turn finds its whole previous prompt
cached), the per-replica prefix-cache counters add up to what the responses report, and every call the
router makes on a replica (health, metadata) is answered."""

from __future__ import annotations

import asyncio
import re
import signal
import threading

import httpx
import pytest

from pipeline import __version__
from pipeline.bench.router import ChatWork, play_chat, prefix_counters, router_python, start_router
from tests.conftest import Server, free_port

BS = 16  # --block-size
REPLICA = ["--model", "sim", "--sim-step-us", "2000", "--max-model-len", "2048"]


@pytest.fixture(scope="module")
def python():
    try:
        return router_python()
    except RuntimeError as e:
        pytest.skip(f"sglang-router cannot be installed here: {e}")


@pytest.fixture(scope="module")
def replicas():
    out: list[Server] = [None, None]

    def start(i: int) -> None:
        out[i] = Server(REPLICA)

    threads = [threading.Thread(target=start, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    started = [s for s in out if s is not None]
    if len(started) < 2:
        for s in started:
            s.stop()
        raise RuntimeError("a replica did not start")
    yield started
    for s in started:
        assert s.stop() == 0


def test_conversations_stay_on_their_replica(python, replicas, tmp_path):
    port = free_port()
    with open(tmp_path / "router.log", "w") as log:
        router = start_router(python, port, [s.url for s in replicas], "cache_aware", log)
    try:
        work = ChatWork.synth(num_users=8, num_turns=3, system_words=120, message_words=40, max_tokens=12)
        before = [prefix_counters(s.url) for s in replicas]
        turns = asyncio.run(play_chat(f"http://127.0.0.1:{port}", "sim", work))
    finally:
        router.send_signal(signal.SIGTERM)
        router.wait(10)
    assert len(turns) == 24 and all(t.completion_tokens == 12 for t in turns)
    by = {(t.user, t.turn): t for t in turns}
    for (user, turn), t in by.items():
        if turn:  # its replica still holds every whole block of the previous turn's prompt
            previous = by[user, turn - 1].prompt_tokens
            assert t.cached_tokens >= previous // BS * BS, f"user {user} turn {turn} moved: {t}"
    after = [prefix_counters(s.url) for s in replicas]
    queries, hits, requests = (sum(a[k] - b[k] for a, b in zip(after, before)) for k in range(3))
    assert requests == 24
    assert queries == sum(t.prompt_tokens for t in turns)
    assert hits == sum(t.cached_tokens for t in turns)
    # What the router asked each replica for was answered: health and SGLang's metadata routes. Its gRPC
    # probe (an HTTP/2 preface, "PRI *") is not a route.
    for s in replicas:
        calls = re.findall(r'"(GET|POST) (\S+) HTTP/1.1" (\d+)', s.output())
        assert {path for _, path, _ in calls} >= {"/health", "/server_info", "/model_info"}
        assert [c for c in calls if not c[2].startswith("2")] == []


def test_sglang_metadata_routes(sim_async):
    """SGLang's names and shapes: the gateway labels a replica with ``served_model_name`` from ``/server_info``;
    its power_of_two policy sums ``num_tokens`` over ``/get_load``'s ranks."""
    info = httpx.get(f"{sim_async.url}/server_info", timeout=10).json()
    tokenizer = info.pop("tokenizer_path")
    assert info == {
        "model_path": "sim",
        "served_model_name": "sim",
        "tp_size": 1,
        "dp_size": 1,
        "max_running_requests": 256,
        "max_prefill_tokens": 32,
        "context_length": 1024,
        "page_size": 16,
        "disable_radix_cache": False,
        "version": __version__,
        "max_total_tokens": 256 * 1024,
    }
    model = httpx.get(f"{sim_async.url}/model_info", timeout=10).json()
    assert model == {"model_path": "sim", "tokenizer_path": tokenizer, "is_generation": True}
    sim_async.wait_idle()
    load = httpx.get(f"{sim_async.url}/get_load", timeout=10).json()
    assert load == [{"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}]


def test_get_load_counts_waiting_tokens():
    """A request waiting for a slot counts in ``/get_load``'s ``num_tokens`` by its tokens, as in SGLang (the
    gateway's power_of_two policy compares replicas by it), though it holds no KV block yet."""
    server = Server(["--model", "sim", "--sim-step-us", "2000", "--max-model-len", "2048", "--max-num-seqs", "1"])
    try:

        async def main() -> dict:
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:

                def complete(prompt: list[int], max_tokens: int):
                    body = {"model": "sim", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}
                    return asyncio.create_task(client.post("/v1/completions", json=body))

                running = complete(list(range(1, 17)), 300)  # at most 316 tokens: 20 blocks
                while (await client.get("/get_load")).json()[0]["num_reqs"] == 0:
                    await asyncio.sleep(0.01)
                waiting = complete(list(range(1, 1001)), 1)
                load = {}
                while not load.get("num_waiting_reqs"):
                    load = (await client.get("/get_load")).json()[0]
                await asyncio.gather(running, waiting)
                return load

        load = asyncio.run(main())
    finally:
        server.stop()
    assert load["num_reqs"] == 2 and load["num_waiting_reqs"] == 1
    assert 1000 + 16 <= load["num_tokens"] <= 1000 + 20 * BS
