"""``--kv-events-config`` through a real server on the simulated device: a subscriber's replay of the
stream holds exactly the blocks the server reports cached; Dynamo's KV indexer finds each conversation on
its engine from the events; a publisher it cannot run is refused at start."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import msgspec
import pytest
import zmq

from pipeline.bench.router import dynamo_python
from pipeline.common.kv_events import BlockRemoved, BlockStored, KVEventBatch
from tests.conftest import REPO, SIM, Server, free_port


def replay_all(ctx: zmq.Context, endpoint: str) -> list[KVEventBatch]:
    """Every batch the publisher at ``endpoint`` (its replay socket) holds: all since the start, numbered
    from 0 without a gap."""
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(endpoint)
    dealer.send_multipart((b"", (0).to_bytes(8, "big")))
    decoder, out = msgspec.msgpack.Decoder(KVEventBatch), []
    while True:
        assert dealer.poll(10_000), "no end marker from the replay socket"
        _, seq, payload = dealer.recv_multipart()
        if int.from_bytes(seq, "big", signed=True) < 0:
            return out
        assert int.from_bytes(seq, "big") == len(out)
        out.append(decoder.decode(payload))


def test_a_subscriber_follows_the_server_cache():
    """Eight users of one system prompt through a pool of 64 blocks (evictions): replaying the published
    batches gives as many blocks as ``pipeline_kv_blocks_cached``, every removal of a stored one, all in
    vLLM's device tier though the simulated device runs on the CPU."""
    pub, replay = free_port(), free_port()
    config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{pub}",
        "replay_endpoint": f"tcp://*:{replay}",
        "topic": "kv@test",
    }
    srv = Server([*SIM, "--num-kv-blocks", "64", "--max-model-len", "256", "--kv-events-config", json.dumps(config)])
    ctx = zmq.Context()
    try:
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"kv@test")
        sub.connect(f"tcp://127.0.0.1:{pub}")
        system = [1000 + i for i in range(70)]
        for user in range(8):
            r = httpx.post(
                f"{srv.url}/v1/completions",
                json={"model": srv.model, "prompt": system + [2000 + user] * 170, "max_tokens": 8},
                timeout=60,
            )
            assert r.status_code == 200, r.text
        cached = srv.wait_idle()["pipeline_kv_blocks_cached"]
        # Every batch since the start, from the replay socket (the stream may have started before we joined).
        index, removed = set(), 0
        for batch in replay_all(ctx, f"tcp://127.0.0.1:{replay}"):
            for ev in batch.events:
                if isinstance(ev, BlockStored):
                    assert ev.block_size == 16 and len(ev.token_ids) == 16 * len(ev.block_hashes)
                    # The engine's own cache is vLLM's "GPU" tier on any device: "CPU" means a host offload tier.
                    assert ev.medium == "GPU"
                    index.update(ev.block_hashes)
                elif isinstance(ev, BlockRemoved):
                    assert ev.medium == "GPU" and set(ev.block_hashes) <= index
                    index.difference_update(ev.block_hashes)
                    removed += len(ev.block_hashes)
                else:
                    index.clear()
        assert removed > 0 and len(index) == cached > 0
        assert sub.poll(5000), "nothing on the PUB socket"
        topic, seq, _ = sub.recv_multipart()
        assert topic == b"kv@test" and len(seq) == 8
        assert srv.metrics()["pipeline_kv_events_dropped_total"] == 0
    finally:
        ctx.destroy(linger=0)
        assert srv.stop() == 0


def test_each_data_parallel_engine_publishes_its_own_cache(tmp_path):
    """With -dp 2 each engine publishes on its own endpoint (``_dp1`` for ipc), its index as the batches'
    ``data_parallel_rank``, and each stream follows that engine's cache."""
    config = {
        "enable_kv_cache_events": True,
        "endpoint": f"ipc://{tmp_path}/kv",
        "replay_endpoint": f"ipc://{tmp_path}/replay",
    }
    srv = Server([*SIM, "--data-parallel-size", "2", "--kv-events-config", json.dumps(config)])
    ctx = zmq.Context()
    try:

        def send(user: int) -> httpx.Response:
            system = [1000 + 100 * (user % 2) + i for i in range(40)]
            body = {"model": srv.model, "prompt": system + [3000 + user] * 20, "max_tokens": 64}
            return httpx.post(f"{srv.url}/v1/completions", json=body, timeout=60)

        with ThreadPoolExecutor(8) as pool:  # at once: the engine router spreads what it has not cached
            for r in pool.map(send, range(8)):
                assert r.status_code == 200, r.text
        metrics = srv.wait_idle()
        for engine, suffix in ((0, ""), (1, "_dp1")):
            index = set()
            for batch in replay_all(ctx, f"ipc://{tmp_path}/replay{suffix}"):
                assert batch.data_parallel_rank == engine
                for ev in batch.events:
                    if isinstance(ev, BlockStored):
                        index.update(ev.block_hashes)
                    elif isinstance(ev, BlockRemoved):
                        index.difference_update(ev.block_hashes)
                    else:
                        index.clear()
            assert len(index) == metrics[f'pipeline_engine_kv_blocks_cached{{engine="{engine}"}}'] > 0, engine
    finally:
        ctx.destroy(linger=0)
        assert srv.stop() == 0


def test_an_unknown_publisher_is_refused_at_start():
    bad = json.dumps({"enable_kv_cache_events": True, "publisher": "nats"})
    out = subprocess.run(
        [sys.executable, "-m", "pipeline.launcher", *SIM, "--kv-events-config", bad],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
    )
    assert out.returncode == 2
    assert "--kv-events-config: publisher must be one of null, zmq, got 'nats'" in out.stderr


def test_an_endpoint_in_use_is_refused_at_start():
    ctx = zmq.Context()
    try:
        taken = ctx.socket(zmq.PUB)  # held until the server has tried
        port = taken.bind_to_random_port("tcp://*")
        config = json.dumps({"enable_kv_cache_events": True, "endpoint": f"tcp://*:{port}"})
        out = subprocess.run(
            [sys.executable, "-m", "pipeline.launcher", *SIM, "--kv-events-config", config],
            capture_output=True,
            text=True,
            cwd=REPO,
            timeout=120,
        )
    finally:
        taken.close(linger=0)
        ctx.destroy(linger=0)
    assert out.returncode == 1
    assert f"--kv-events-config: cannot open tcp://*:{port}: Address already in use" in out.stdout + out.stderr


def test_dynamo_indexer_finds_each_conversation_on_its_engine(tmp_path):
    """Dynamo's standalone KV indexer (a registry package) subscribed to both engines of a ``-dp 2`` server
    builds its index from our events alone: for each conversation's second turn it finds every whole block
    of the first on one engine and none on the other, which is what its KV router routes by; the server's
    own engine router sends that turn there (its cached tokens)."""
    try:
        python = dynamo_python()
    except RuntimeError as e:
        pytest.skip(f"ai-dynamo-runtime cannot be installed here: {e}")
    kv = f"ipc://{tmp_path}/kv"  # engine 1 publishes on kv_dp1
    config = {"enable_kv_cache_events": True, "endpoint": kv}
    srv = Server([*SIM, "--data-parallel-size", "2", "--kv-events-config", json.dumps(config)])
    port = free_port()
    args = ["--port", str(port), "--block-size", "16", "--model-name", srv.model, "--workers", f"1:0={kv},1:1={kv}_dp1"]
    with open(tmp_path / "indexer.log", "w") as log:
        indexer = subprocess.Popen([python, "-m", "dynamo.indexer", *args], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert indexer.poll() is None and time.monotonic() < deadline, (tmp_path / "indexer.log").read_text()
            try:
                workers = httpx.get(f"{url}/workers", timeout=2).json()
                if sorted(workers[0]["listeners"]) == ["0", "1"]:
                    if all(w["status"] == "active" for w in workers[0]["listeners"].values()):
                        break
            except (httpx.HTTPError, ValueError, IndexError, KeyError):
                pass
            time.sleep(0.2)
        time.sleep(1)  # a SUB socket's subscription reaches the publisher a moment after it connects

        def first_turn(user: int) -> list[int]:
            prompt = [1000 + 100 * user + i for i in range(70)]
            body = {"model": srv.model, "prompt": prompt, "max_tokens": 8, "ignore_eos": True, "return_token_ids": True}
            r = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
            return prompt + r.json()["choices"][0]["token_ids"]

        with ThreadPoolExecutor(8) as pool:  # at once: the engine router spreads what it has not cached
            histories = list(pool.map(first_turn, range(8)))
        srv.wait_idle()
        time.sleep(0.5)  # the last batches' way to the indexer
        engines = set()
        for user, history in enumerate(histories):
            second = history + [3000 + user] * 10
            scores = httpx.post(f"{url}/query", json={"model_name": srv.model, "token_ids": second}, timeout=10)
            matched = {int(rank): tokens for rank, tokens in scores.json()["scores"].get("1", {}).items()}
            # The first turn's KV: its prompt and all its output but the last token (never fed back).
            held = (len(history) - 1) // 16 * 16
            assert sorted(matched.values()) == [held], (user, scores.json())
            engines |= matched.keys()
            body = {"model": srv.model, "prompt": second, "max_tokens": 1}
            r = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=60)
            assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == held
        assert engines == {0, 1}
    finally:
        indexer.terminate()
        indexer.wait(10)
        assert srv.stop() == 0
