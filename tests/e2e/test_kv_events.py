"""``--kv-events-config`` through a real server on the simulated device: a subscriber's replay of the
stream holds exactly the blocks the server reports cached; a publisher it cannot run is refused at start."""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import httpx
import msgspec
import zmq

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
