"""Publishing the prefix cache's KV-cache events (docs/design.md, "KV-cache events").

The scheduler's loop only appends to a list (``stored``, ``removed``,
``cleared``) and, once a turn, hands the list to a bounded queue
(``flush``); a thread of its own builds vLLM's structs, encodes them and
sends them on the PUB socket. A step never waits on a subscriber: PUB
drops a message for a subscriber ``hwm`` messages behind, and a batch that
finds the queue full is dropped and counted (``num_dropped_events``).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque

import msgspec
import zmq

from pipeline.common.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KVEventsConfig,
    engine_endpoint,
    external_hash,
)

logger = logging.getLogger("pipeline.scheduler")

_STORED, _REMOVED, _CLEARED = range(3)
END_SEQ = (-1).to_bytes(8, "big", signed=True)  # the replay socket's last message
# The tier of the engine's own KV cache, whatever the device: vLLM's block pool names it "GPU" on its CPU build
# too, and routers read "CPU" as a host offload tier (Dynamo's indexer files such blocks as host-pinned and
# gives them no device-tier score).
MEDIUM = "GPU"


def _binds(endpoint: str) -> bool:
    """vLLM's convention: a wildcard or a local transport is bound, a host address connected to."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class KVEventPublisher:
    """Collects one engine's KV-cache events on the scheduler's loop; a thread sends them in vLLM's format.

    Args:
        config: ``--kv-events-config``.
        block_size: tokens per block (each BlockStored carries it).
        engine_index: the ``-dp`` engine: its endpoints' TCP ports are offset by it, and each batch's
            ``data_parallel_rank`` is it.

    Raises:
        zmq.ZMQError: an endpoint cannot be bound (its port is taken) or is malformed.
    """

    def __init__(self, config: KVEventsConfig, block_size: int, engine_index: int = 0):
        self.block_size, self.engine_index = block_size, engine_index
        self.num_dropped_events = 0  # events of batches that found the queue full
        self._pending: list[tuple] = []  # this turn's events, in order, as tuples: built into structs off the loop
        self._queue: queue.Queue[tuple[float, list[tuple]] | None] = queue.Queue(config.max_queue_size)
        self._topic = config.topic.encode()
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._replay = None
        try:
            self._pub.set_hwm(config.hwm)
            endpoint = engine_endpoint(config.endpoint, engine_index)
            if _binds(endpoint):
                self._pub.bind(endpoint)
            else:
                self._pub.connect(endpoint)
            if config.replay_endpoint:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.bind(engine_endpoint(config.replay_endpoint, engine_index))
        except zmq.ZMQError:
            self._ctx.destroy(linger=0)
            raise
        self._sent: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)  # (seq, payload) for replay
        self._thread = threading.Thread(target=self._send_loop, name="kv-events", daemon=True)
        self._thread.start()

    def stored(self, names: list[bytes], parent: bytes | None, token_ids: list[int], lora_id: int = 0) -> None:
        """Consecutive blocks of one sequence were named; ``parent`` names the block before the first; ``lora_id``: its
        LoRA adapter (0: none)."""
        self._pending.append((_STORED, names, parent, token_ids, lora_id))

    def removed(self, name: bytes) -> None:
        """The block named ``name`` was evicted (its name forgotten)."""
        pending = self._pending
        if pending and pending[-1][0] == _REMOVED:  # an eviction run is one event
            pending[-1][1].append(name)
        else:
            pending.append((_REMOVED, [name]))

    def cleared(self) -> None:
        """Every name was forgotten."""
        self._pending.append((_CLEARED,))

    def flush(self) -> None:
        """Queue this turn's events as one batch, or drop them (counted) if the sender is that far behind."""
        if not self._pending:
            return
        try:
            self._queue.put_nowait((time.time(), self._pending))
        except queue.Full:
            self.num_dropped_events += len(self._pending)
        self._pending = []

    def close(self) -> None:
        """Send what is queued (within a second), then close the sockets."""
        self.flush()
        try:
            self._queue.put(None, timeout=1.0)
        except queue.Full:
            pass
        self._thread.join(timeout=1.0)
        self._ctx.destroy(linger=0)

    def _batch(self, ts: float, events: list[tuple]) -> KVEventBatch:
        out = []
        for ev in events:
            if ev[0] == _STORED:
                _, names, parent, tokens, lora_id = ev
                out.append(
                    BlockStored(
                        block_hashes=[external_hash(n) for n in names],
                        parent_block_hash=None if parent is None else external_hash(parent),
                        token_ids=tokens,
                        block_size=self.block_size,
                        lora_id=lora_id or None,
                        medium=MEDIUM,
                        lora_name=None,
                    )
                )
            elif ev[0] == _REMOVED:
                out.append(BlockRemoved(block_hashes=[external_hash(n) for n in ev[1]], medium=MEDIUM))
            else:
                out.append(AllBlocksCleared())
        return KVEventBatch(ts=ts, events=out, data_parallel_rank=self.engine_index)

    def _send_loop(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        seq = 0
        while True:
            if self._replay is not None and self._replay.poll(0):
                self._serve_replay()
            try:
                item = self._queue.get(timeout=0.1)
            except queue.Empty:
                continue
            if item is None:
                return
            try:
                payload = encoder.encode(self._batch(*item))
                # PUB never blocks: a subscriber hwm messages behind loses this one.
                self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload), copy=False)
            except zmq.ZMQError as e:  # a closed or failed socket must not end the scheduler
                logger.warning("KV events: could not send batch %d: %s", seq, e)
            self._sent.append((seq, payload))
            seq += 1

    def _serve_replay(self) -> None:
        """Answer ``[identity, b"", start seq]`` with every held batch from ``start`` on, then the end marker."""
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            logger.warning("KV events: dropped a malformed replay request (%d frames)", len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in self._sent:
            if seq >= first:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_SEQ, b""))
