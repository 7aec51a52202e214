"""KV-cache events (docs/design.md, "KV-cache events"): a subscriber that replays them follows the scheduler's
prefix cache exactly, in vLLM's wire format; a publisher that falls behind drops and counts."""

from __future__ import annotations

import random
import threading
import time
from array import array

import msgspec
import pytest
import zmq

from pipeline.common.block_hash import hash_blocks
from pipeline.common.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KVEventsConfig,
    engine_endpoint,
    external_hash,
    parse_kv_events_config,
)
from pipeline.scheduler_proc.kv_event_publisher import KVEventPublisher
from tests.unit import test_scheduler
from tests.unit.test_scheduler import BS, ROOT, chat, expected


class Subscriber:
    """What a router's indexer does: SUB to the stream, fill gaps from the replay socket, apply in order."""

    def __init__(self, ctx: zmq.Context, endpoint: str, replay: str):
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(endpoint)
        self.replay = ctx.socket(zmq.DEALER)
        self.replay.connect(replay)
        self.decoder = msgspec.msgpack.Decoder(KVEventBatch)
        self.next_seq = 0
        self.index: dict[int, tuple[int | None, list[int]]] = {}  # hash -> (parent, its tokens)
        self.num_removed = 0

    def drain(self, until_seq: int) -> None:
        """Apply every batch up to ``until_seq`` (exclusive), from the stream or, for a gap, the replay socket."""
        while self.next_seq < until_seq:
            if self.sub.poll(1000):
                topic, seq, payload = self.sub.recv_multipart()
                seq = int.from_bytes(seq, "big")
                if seq < self.next_seq:
                    continue
                if seq > self.next_seq:  # missed some (joined late): ask for them, as vLLM's example does
                    self._replay(seq)
                self._apply(payload)
                self.next_seq = seq + 1
            else:
                self._replay(until_seq)

    def _replay(self, until_seq: int) -> None:
        self.replay.send_multipart((b"", self.next_seq.to_bytes(8, "big")))
        while True:
            _, seq, payload = self.replay.recv_multipart()
            seq = int.from_bytes(seq, "big", signed=True)
            if seq < 0:
                return
            if self.next_seq <= seq < until_seq:
                self._apply(payload)
                self.next_seq = seq + 1

    def _apply(self, payload: bytes) -> None:
        for ev in self.decoder.decode(payload).events:
            if isinstance(ev, BlockStored):
                assert len(ev.token_ids) == ev.block_size * len(ev.block_hashes)
                parent = ev.parent_block_hash
                for i, h in enumerate(ev.block_hashes):
                    assert h not in self.index, "a name stored twice without its removal"
                    self.index[h] = (parent, ev.token_ids[i * ev.block_size : (i + 1) * ev.block_size])
                    parent = h
            elif isinstance(ev, BlockRemoved):
                for h in ev.block_hashes:
                    del self.index[h]
                self.num_removed += len(ev.block_hashes)
            else:
                assert isinstance(ev, AllBlocksCleared)
                self.index.clear()


@pytest.fixture
def endpoints(tmp_path):
    return f"ipc://{tmp_path}/kv-events", f"ipc://{tmp_path}/kv-replay"


def make_publisher(endpoints, **config) -> KVEventPublisher:
    pub, replay = endpoints
    return KVEventPublisher(KVEventsConfig(endpoint=pub, replay_endpoint=replay, **config), BS)


@pytest.mark.parametrize("depth", [1, 2], ids=["lock-step", "async"])
def test_replayed_events_equal_the_scheduler_cache(depth, endpoints, monkeypatch):
    """Conversations over shared system prompts, with preemptions and evictions from a small KV pool: the
    subscriber's index ends equal to the pool's names, each with its parent and tokens."""
    publisher = make_publisher(endpoints)
    ctx = zmq.Context()
    sub = Subscriber(ctx, *endpoints)

    num_batches = 0

    def flush():
        nonlocal num_batches
        num_batches += bool(publisher._pending)
        publisher.flush()

    class Publishing(test_scheduler.Scheduler):  # flushes once per turn, as the scheduler's loop does
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.set_kv_events(publisher)

        def schedule(self, desc):
            out = super().schedule(desc)
            flush()
            return out

        def process_output(self, *args):
            out = super().process_output(*args)
            flush()
            return out

    monkeypatch.setattr(test_scheduler, "Scheduler", Publishing)
    rng = random.Random(depth)
    systems = [[rng.randrange(10, 900) for _ in range(rng.randrange(2 * BS, 5 * BS))] for _ in range(3)]
    reqs, after, num = [], {}, 0
    for user in range(6):
        prompt = systems[user % 3] + [rng.randrange(10, 900) for _ in range(rng.randrange(1, 9))]
        for turn in range(3):
            num += 1
            reqs.append(chat(num, prompt, rng.randrange(3, 12)))
            if turn:
                after[num] = num - 1
            prompt = prompt + expected(reqs[-1]) + [rng.randrange(10, 900) for _ in range(3)]
    try:
        outputs, sched = test_scheduler.run(reqs, depth, budget=32, num_blocks=40, caching=(True,), after=after)
        for r in reqs:
            assert outputs[r.req_num] == expected(r)
        sub.drain(num_batches)
    finally:
        publisher.close()
        ctx.destroy(linger=0)

    assert sub.num_removed > 0, "the workload must evict"
    assert set(sub.index) == {external_hash(h) for h in sched.pool._cached}
    # Each name stands for its tokens and its parent: check them against every sequence the workload ran.
    truth = {}
    for r in reqs:
        seq = array("i", r.prompt_token_ids + expected(r))
        names = hash_blocks(seq, BS, ROOT)
        for i, h in enumerate(names):
            truth[external_hash(h)] = (external_hash(names[i - 1]) if i else None, list(seq[i * BS : (i + 1) * BS]))
    assert all(sub.index[h] == truth[h] for h in sub.index)
    assert publisher.num_dropped_events == 0


def test_the_wire_format_is_vllms(endpoints):
    """One batch as raw msgpack: [ts, [[tag, fields in vLLM's order...], ...], data_parallel_rank], sent as
    [topic, 8-byte big-endian seq, payload]."""
    pub, replay = endpoints
    publisher = KVEventPublisher(KVEventsConfig(endpoint=pub, replay_endpoint=replay, topic="kv"), BS, 1)
    names = hash_blocks(array("i", range(10, 10 + 2 * BS)), BS, ROOT)
    h0, h1 = external_hash(names[0]), external_hash(names[1])
    ctx = zmq.Context()
    try:
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"kv")
        sub.connect(engine_endpoint(pub, 1))
        for _ in range(100):  # a SUB joins asynchronously: publish until it hears
            publisher.stored(names, None, list(range(10, 10 + 2 * BS)))
            publisher.removed(names[1])
            publisher.removed(names[0])
            publisher.cleared()
            publisher.flush()
            if sub.poll(100):
                break
        topic, seq, payload = sub.recv_multipart()
    finally:
        publisher.close()
        ctx.destroy(linger=0)
    assert topic == b"kv" and len(seq) == 8 and int.from_bytes(seq, "big") < 100
    ts, events, rank = msgspec.msgpack.decode(payload)
    assert isinstance(ts, float) and rank == 1
    assert events == [
        ["BlockStored", [h0, h1], None, list(range(10, 10 + 2 * BS)), BS, None, "GPU", None],
        ["BlockRemoved", [h1, h0], "GPU"],
        ["AllBlocksCleared"],
    ]
    assert h0 == int.from_bytes(names[0], "big") & (2**64 - 1)  # vLLM's maybe_convert_block_hash


def test_a_publisher_behind_drops_and_counts(endpoints):
    """With the sender stuck and its queue full, a flush drops its batch and counts its events; the loop
    never waits."""
    release = threading.Event()

    class Stuck(KVEventPublisher):
        def _batch(self, ts, events):
            release.wait(10)
            return super()._batch(ts, events)

    pub, replay = endpoints
    publisher = Stuck(KVEventsConfig(endpoint=pub, replay_endpoint=replay, max_queue_size=1), BS)
    names = hash_blocks(array("i", range(3 * BS)), BS, ROOT)
    for n in names:  # the first batch is taken by the sender (then stuck), the second queued, the third dropped
        publisher.removed(n)
        publisher.flush()
        while n is names[0] and publisher._queue.qsize():  # until the sender holds the first
            time.sleep(0.001)
    assert publisher.num_dropped_events == 1
    release.set()
    publisher.close()
    assert [seq for seq, _ in publisher._sent] == [0, 1]


def test_config_follows_vllms_keys():
    on = '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", "topic": "t",'
    cfg = parse_kv_events_config(on + ' "replay_endpoint": "tcp://*:5558", "buffer_steps": 5, "hwm": 9}')
    assert cfg == KVEventsConfig("tcp://*:5557", "tcp://*:5558", 5, 9, 100_000, "t")
    assert parse_kv_events_config('{"enable_kv_cache_events": true}') == KVEventsConfig()  # publisher: zmq
    assert parse_kv_events_config('{"enable_kv_cache_events": false, "publisher": "zmq"}') is None
    assert parse_kv_events_config('{"enable_kv_cache_events": true, "publisher": "null"}') is None
    assert parse_kv_events_config('{"enable_kv_cache_events": true, "replay_endpoint": null}') == KVEventsConfig()
    assert engine_endpoint("tcp://*:5557", 2) == "tcp://*:5559"
    assert engine_endpoint("ipc:///tmp/kv", 1) == "ipc:///tmp/kv_dp1"


@pytest.mark.parametrize(
    "text, error",
    [
        ('{"enable_kv_cache_events": true, "publisher": "nats"}', "publisher must be one of null, zmq, got 'nats'"),
        ('{"enable_kv_cache_events": true, "endpiont": "x"}', "unsupported key 'endpiont'"),
        ('{"enable_kv_cache_events": "yes"}', "enable_kv_cache_events must be true or false"),
        ('{"enable_kv_cache_events": true, "endpoint": "tcp://*"}', "endpoint 'tcp://*' needs a port"),
        ('{"enable_kv_cache_events": true, "endpoint": "localhost:5557"}', "endpoint must be a ZMQ address"),
        ('{"enable_kv_cache_events": true, "hwm": 0}', "hwm must be >= 1"),
        ('{"enable_kv_cache_events": true, "hwm": "x"}', "Expected `int`"),
        ("[1]", "must be a JSON object"),
        ("{", "not JSON"),
    ],
)
def test_config_errors_name_the_key(text, error):
    with pytest.raises(ValueError) as e:
        parse_kv_events_config(text)
    assert error in str(e.value)
