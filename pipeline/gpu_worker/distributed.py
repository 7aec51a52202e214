"""The tensor-parallel process group of one engine's worker ranks, and the descriptor relay between nodes
(docs/design.md, "Parallelism").

One node meets over a private ``file://`` store with sockets on 127.0.0.1; several meet at the head's TCP store on
``master_addr:master_port``. Collectives run on gloo (CPU) or NCCL (CUDA).
"""

from __future__ import annotations

import fcntl
import functools
import logging
import os
import socket
import struct
import time
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from pipeline.common.config import EngineConfig
from pipeline.common.constants import cdiv
from pipeline.common.step_protocol import (
    MASK_BITS,
    PACKED_HEADER_NBYTES,
    StepDescriptor,
    pack_descriptor,
    packed_descriptor_nbytes,
    unpack_descriptor,
)
from pipeline.gpu_worker.layers.tp import TPGroup

log = logging.getLogger(__name__)

# The first broadcast of every relayed step has this fixed size: the header
# and, for most steps, the whole packed descriptor (a decode step of about 60
# requests), so a step usually costs one broadcast; a larger one sends the
# rest in a second broadcast sized from the header.
_FIRST_NBYTES = 4096
# An idle rank 0 sends an empty message this often, so that the loss of a
# node's ranks is noticed (the send fails) within about this long, not only
# at the next request.
HEARTBEAT_S = 1.0
_HEARTBEAT_STEP_ID = -1
# Sent by rank 0 as it stops, so the other nodes stop too instead of reporting a lost peer.
_STOP_STEP_ID = -2
# Settings every node must share for the ranks to run the same steps: the
# descriptor layout, the KV cache geometry and what the model computes.
_SHARED_FIELDS = (
    "dtype",
    "device",
    "scheduler.max_num_seqs",
    "scheduler.max_num_batched_tokens",
    "scheduler.block_size",
    "max_model_len",
    "num_kv_blocks",
    "vocab_size",
    "worker.debug_token_cache_poison",
    "worker.sim_step_us",
    "worker.sim_token_us",
    "parallel.tensor_parallel_size",
    "parallel.nnodes",
)


class DescriptorRelay:
    """Rank 0's copy of every StepDescriptor, broadcast (asynchronously) to the ranks on other nodes, as vLLM's message
    queue does for remote readers.

    Messages are the packed descriptor as uint8 CPU tensors on a gloo group apart from the model's: a fixed first
    broadcast of ``min(4096, entry size)`` bytes, then the rest if larger.

    Raises (from ``send``, ``heartbeat`` and ``receive``): RuntimeError: a peer's connection failed (its process died or
        the network is down).
    """

    def __init__(self, config: EngineConfig, rank: int, group: dist.ProcessGroup):
        layout = config.descriptor_layout
        self.rank, self.group = rank, group
        self._mask_words = cdiv(config.vocab_size, MASK_BITS)
        self._sent_masks: torch.Tensor | None = None
        self._first = min(_FIRST_NBYTES, layout.nbytes)
        self._buf = torch.zeros(max(layout.nbytes, self._first), dtype=torch.uint8)
        self._np = self._buf.numpy()
        self._entry = StepDescriptor(layout.views(bytearray(layout.nbytes)))  # receivers unpack here
        self._works: list[dist.Work] = []
        self._last_send = time.monotonic()
        self.head_stopped = False  # receivers: rank 0 said it stops

    def send(self, desc: StepDescriptor) -> None:
        """Rank 0: broadcast ``desc``'s live bytes (copied out of the ring entry before this returns)."""
        self._wait_sent()
        n = pack_descriptor(desc, self._np)
        self._broadcast_async(n)

    def heartbeat(self) -> None:
        """Rank 0, idle: send an empty message if nothing went out for ``HEARTBEAT_S`` seconds."""
        if time.monotonic() - self._last_send < HEARTBEAT_S:
            return
        self._send_empty(_HEARTBEAT_STEP_ID)

    def send_stop(self) -> None:
        """Rank 0, stopping: tell the other nodes' ranks to stop; a peer already gone is ignored."""
        try:
            self._send_empty(_STOP_STEP_ID)
            self._wait_sent()
        except RuntimeError:
            pass

    def _send_empty(self, step_id: int) -> None:
        self._wait_sent()
        header = self._np[:PACKED_HEADER_NBYTES].view(np.int64)
        header[:] = 0  # no rows, tokens, blocks or masks
        header[0] = step_id
        self._broadcast_async(PACKED_HEADER_NBYTES)

    def _wait_sent(self) -> None:
        # The buffer is rewritten only once the previous step has left it.
        for w in self._works:
            w.wait()
        self._works.clear()

    def _broadcast_async(self, n: int) -> None:
        self._works.append(dist.broadcast(self._buf[: self._first], 0, group=self.group, async_op=True))
        if n > self._first:
            self._works.append(dist.broadcast(self._buf[self._first : n], 0, group=self.group, async_op=True))
        self._last_send = time.monotonic()

    def send_masks(self, words: np.ndarray) -> None:
        """Rank 0: broadcast a step's ``[M, W]`` int32 bitmasks (``TokenMasks``), after its descriptor."""
        self._wait_sent()
        self._sent_masks = torch.from_numpy(words).reshape(-1)  # alive until the broadcast is done
        self._works.append(dist.broadcast(self._sent_masks, 0, group=self.group, async_op=True))

    def receive_masks(self, num_masks: int) -> np.ndarray:
        """Ranks on other nodes: the ``[num_masks, W]`` int32 bitmasks of the step last received."""
        words = torch.empty((num_masks, self._mask_words), dtype=torch.int32)
        dist.broadcast(words.reshape(-1), 0, group=self.group)
        return words.numpy()

    def receive(self, timeout: float) -> StepDescriptor | None:
        """Ranks on other nodes: the next relayed descriptor (valid until the next call), or None after ``timeout``
        seconds (``head_stopped`` set: rank 0 stopped)."""
        if not self._works:
            self._works.append(dist.broadcast(self._buf[: self._first], 0, group=self.group, async_op=True))
        work = self._works[0]
        try:
            work.wait(timedelta(seconds=timeout))
        except RuntimeError:
            if not work.is_completed():
                return None  # timed out; it stays posted
            # Failed, or it arrived between the timeout and the check: waiting
            # again raises only if it failed.
            work.wait()
        self._works.clear()
        header = self._np[:PACKED_HEADER_NBYTES].view(np.int64)
        if header[0] < 0:  # a heartbeat or the stop
            self.head_stopped = header[0] == _STOP_STEP_ID
            return None
        n = packed_descriptor_nbytes(header)
        if n > self._first:
            dist.broadcast(self._buf[self._first : n], 0, group=self.group)
        unpack_descriptor(self._np, self._entry)
        return self._entry


def init_tensor_parallel(config: EngineConfig, rank: int) -> tuple[TPGroup, DescriptorRelay | None]:
    """Join the engine's process group as ``rank`` (on CUDA, device ``config.device_index(rank)``); with several nodes,
    rank 0 and remote ranks also get a ``DescriptorRelay``.

    Raises:
        RuntimeError: the rendezvous or the backend failed (from torch.distributed).
        ValueError: a node's settings differ from the head's; the message names them.
    """
    backend = "gloo"
    if config.device == "cuda":
        torch.cuda.set_device(config.device_index(rank))
        backend = "nccl"
    try:
        bind_sockets_to(
            "127.0.0.1"
            if config.parallel.nnodes == 1
            else _route_source(config.parallel.master_addr, config.parallel.master_port)
        )
    except OSError as e:  # an IPv6 or unresolvable --master-addr: gloo and NCCL keep their own choice
        log.warning("cannot tell this node's address towards %s (%s)", config.parallel.master_addr, e)
    world = config.parallel.tensor_parallel_size
    if config.parallel.nnodes == 1:
        dist.init_process_group(backend, init_method=config.tp_init_method, rank=rank, world_size=world)
    else:
        dist.init_process_group(backend, store=_tcp_store(config, rank), rank=rank, world_size=world)
    tp = TPGroup(rank, config.parallel.tensor_parallel_size, dist.group.WORLD)
    if config.parallel.nnodes == 1:
        return tp, None
    members = [0, *range(config.ranks_per_node, config.parallel.tensor_parallel_size)]
    # Every rank must take part in creating a group, members or not. One
    # relay message may take gloo's default timeout (30 minutes) to come:
    # rank 0's heartbeats keep an idle wait to about a second, and a dead
    # peer's closed connection fails it at once.
    group = dist.new_group(members, backend="gloo")
    if rank not in members:
        return tp, None
    _check_same_settings(config, group, len(members))
    return tp, DescriptorRelay(config, rank, group)


def _check_same_settings(config: EngineConfig, group: dist.ProcessGroup, size: int) -> None:
    """Compare every relay member's ``_SHARED_FIELDS`` with the head's; raise on all members if any differs."""
    mine = {k.rpartition(".")[2]: functools.reduce(getattr, k.split("."), config) for k in _SHARED_FIELDS}
    head = [mine]
    dist.broadcast_object_list(head, 0, group=group)
    diff = [f"{k}={mine[k]!r} (head: {v!r})" for k, v in head[0].items() if mine[k] != v]
    complaints: list[str] = [""] * size
    dist.all_gather_object(
        complaints, f"node {config.parallel.node_rank}: {', '.join(diff)}" if diff else "", group=group
    )
    if bad := [c for c in complaints if c]:
        raise ValueError(
            "the nodes were started with different settings: "
            + "; ".join(bad)
            + "; start every node with the same flags (model, sizes, dtype)"
        )


def bind_sockets_to(address: str) -> None:
    """Make gloo's and NCCL's sockets bind ``address`` (an IPv4 address of this host), unless the user set their
    ``*_SOCKET_IFNAME``."""
    name = interface_of(address)
    if name is None:
        log.warning("no network interface has the address %s; gloo and NCCL choose their own", address)
        return
    for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        os.environ.setdefault(var, name)


_SIOCGIFADDR = 0x8915


def interface_of(address: str) -> str | None:
    """The name of the network interface that holds the IPv4 ``address`` (``lo`` for 127.0.0.1), or None."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                info = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:  # no IPv4 address on it
                continue
            if socket.inet_ntoa(info[20:24]) == address:
                return name
    return None


def _route_source(host: str, port: int) -> str:
    """This host's IPv4 address on the route to ``host`` (``host`` itself on the head); no packet is sent."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, port))
        return s.getsockname()[0]


def _tcp_store(config: EngineConfig, rank: int) -> dist.TCPStore:
    """The ranks' rendezvous over several nodes, rank 0 serving it on ``master_addr:master_port`` only (torch's own
    listens on every address)."""
    host, port, world = config.parallel.master_addr, config.parallel.master_port, config.parallel.tensor_parallel_size
    timeout = dist.constants.default_pg_timeout
    if rank != 0:
        return dist.TCPStore(host, port, world, is_master=False, timeout=timeout)
    listener = socket.create_server((host, port))
    return dist.TCPStore(host, port, world, is_master=True, timeout=timeout, master_listen_fd=listener.detach())
