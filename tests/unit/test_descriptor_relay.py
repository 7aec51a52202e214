"""DescriptorRelay over a real two-process gloo group: a relayed step that
arrives between a receive's timeout and its check is received, not taken
for a lost head."""

from __future__ import annotations

import time
from datetime import timedelta

import torch.distributed as dist
import torch.multiprocessing as mp

from pipeline.common.config import EngineConfig
from pipeline.gpu_worker.distributed import DescriptorRelay
from tests.conftest import free_port


class _LateWork:
    """A real broadcast whose timed-out wait lets it finish before the caller looks."""

    def __init__(self, work: dist.Work):
        self.work = work

    def wait(self, timeout: timedelta | None = None) -> bool:
        if timeout is None:
            return self.work.wait()
        try:
            return self.work.wait(timeout)
        except RuntimeError:
            while not self.work.is_completed():
                time.sleep(0.01)
            raise

    def is_completed(self) -> bool:
        return self.work.is_completed()


def _rank(rank: int, port: int, result) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    config = EngineConfig(model="sim", served_model_name="sim", vocab_size=64)
    relay = DescriptorRelay(config, rank, dist.group.WORLD)
    if rank == 0:
        time.sleep(0.5)  # after rank 1's first wait has timed out
        relay.heartbeat()
        relay.send_stop()
    else:
        relay._works.append(_LateWork(dist.broadcast(relay._buf[: relay._first], 0, async_op=True)))
        first = relay.receive(timeout=0.1)  # times out; the heartbeat lands before the check
        second = None
        while not relay.head_stopped:
            second = relay.receive(timeout=5)
        result.put((first, second, relay.head_stopped))
    dist.destroy_process_group()


def test_a_step_arriving_at_the_timeout_is_received():
    ctx = mp.get_context("spawn")
    result = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, result)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0]
    assert result.get(timeout=1) == (None, None, True)
