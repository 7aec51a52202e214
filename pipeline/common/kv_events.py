"""KV-cache events in vLLM's wire format, and ``--kv-events-config`` (docs/design.md, "KV-cache events").

A router that places requests by prefix (llm-d's precise prefix-cache
scorer, Dynamo's KV router) follows each engine's cache from the events
vLLM publishes: a ZMQ PUB socket sends ``[topic, seq, payload]``, ``seq`` an
8-byte big-endian counter and ``payload`` a msgpack ``KVEventBatch``. The
structs below encode exactly as vLLM's (``vllm/distributed/kv_events.py``):
array-like, each event an array whose first item is its class name, the
fields in vLLM's order. A block is named by the low 64 bits of its block
hash as an integer, as vLLM does by default
(``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``).
"""

from __future__ import annotations

import json
from typing import Any, Union

import msgspec

# The publishers vLLM names; "null" publishes nothing.
KV_EVENT_PUBLISHERS = ("null", "zmq")


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float  # time.time() when the batch was collected
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base of the events; the tag is the class name."""


class BlockStored(KVCacheEvent):
    """Blocks named in order: ``token_ids`` holds ``block_size`` tokens per block; ``parent_block_hash`` is
    the block before the first (None: the first is a sequence's first)."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[Union[BlockStored, BlockRemoved, AllBlocksCleared]]


def external_hash(name: bytes) -> int:
    """A block hash as events carry it: its low 64 bits, big-endian (vLLM's ``maybe_convert_block_hash``)."""
    return int.from_bytes(name[-8:], "big")


class KVEventsConfig(msgspec.Struct, frozen=True):
    """vLLM's ``--kv-events-config`` fields and defaults.

    Attributes:
        endpoint: the PUB socket: bound where it holds ``*``, ``::``, ``ipc://`` or ``inproc://``,
            connected otherwise; engine ``e`` of ``-dp`` adds ``e`` to its TCP port (as vLLM's ranks do).
        replay_endpoint: a ROUTER socket (bound) answering a subscriber's 8-byte start sequence with
            the batches it still holds from there on, then ``[-1, b""]``; empty: none.
        buffer_steps: batches held for replay.
        hwm: the PUB socket's high-water mark: a subscriber that far behind loses messages.
        max_queue_size: batches waiting for the publisher thread; one more is dropped and counted.
        topic: the first frame of every message.
    """

    endpoint: str = "tcp://*:5557"
    replay_endpoint: str = ""
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""


def parse_kv_events_config(text: str) -> KVEventsConfig | None:
    """``--kv-events-config``'s JSON; None when events are off (``enable_kv_cache_events`` false or publisher
    ``null``). Raises ``ValueError`` naming the key on anything it cannot serve."""
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f'not JSON ({e}); e.g. \'{{"enable_kv_cache_events": true, "publisher": "zmq"}}\'') from None
    if not isinstance(raw, dict):
        raise ValueError("must be a JSON object")
    fields = set(KVEventsConfig.__struct_fields__)
    known = fields | {"enable_kv_cache_events", "publisher"}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ValueError(f"unsupported key {unknown[0]!r}; the keys are {', '.join(sorted(known))}")
    enable = raw.get("enable_kv_cache_events", False)
    if not isinstance(enable, bool):
        raise ValueError(f"enable_kv_cache_events must be true or false, got {enable!r}")
    publisher = raw.get("publisher", "zmq" if enable else "null")  # vLLM's default follows the switch
    if publisher not in KV_EVENT_PUBLISHERS:
        raise ValueError(f"publisher must be one of {', '.join(KV_EVENT_PUBLISHERS)}, got {publisher!r}")
    values = {k: v for k, v in raw.items() if k in fields}
    if values.get("replay_endpoint") is None:  # vLLM's JSON null: no replay socket
        values.pop("replay_endpoint", None)
    try:
        config = msgspec.convert(values, KVEventsConfig)
    except msgspec.ValidationError as e:
        raise ValueError(str(e)) from None
    if not config.endpoint.startswith(("tcp://", "ipc://", "inproc://")):
        raise ValueError(f"endpoint must be a ZMQ address (tcp://, ipc:// or inproc://), got {config.endpoint!r}")
    for name in ("endpoint", "replay_endpoint"):
        address = getattr(config, name)
        if address.startswith("tcp://") and not address.rpartition(":")[2].isdigit():
            raise ValueError(f"{name} {address!r} needs a port, e.g. tcp://*:5557")
    for name in ("buffer_steps", "hwm", "max_queue_size"):
        if getattr(config, name) < 1:
            raise ValueError(f"{name} must be >= 1, got {getattr(config, name)}")
    return config if enable and publisher == "zmq" else None


def engine_endpoint(endpoint: str, engine_index: int) -> str:
    """``endpoint`` of ``-dp`` engine ``engine_index``: its TCP port plus the index (vLLM's
    ``offset_endpoint_port``); other transports get a ``_dp<e>`` suffix."""
    if not endpoint or not engine_index:
        return endpoint
    if endpoint.startswith("tcp://"):
        host, _, port = endpoint.rpartition(":")
        return f"{host}:{int(port) + engine_index}"
    return f"{endpoint}_dp{engine_index}"
