"""Unit tests of ``pipeline.common.shm_ring.ShmRing``: FIFO over wrap-around, back-pressure, timeouts, cleanup.

The last test drives a writer in a second process (spawn) with random payloads,
sleeps and timeouts, and checks that every reader sees exactly the published
sequence, in order.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import time
from uuid import uuid4

import numpy as np
import posix_ipc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.common.layouts import Layout
from pipeline.common.shm_ring import RingTimeout, ShmRing

DATA_LEN = 64
LAYOUT = Layout.of([("header", np.int64, 8), ("data", np.int32, DATA_LEN)])


def ring_name() -> str:
    return f"/pipeline-test-{os.getpid()}-{uuid4().hex[:8]}"


def shm_files(name: str) -> list[str]:
    """Entries in /dev/shm that belong to ring ``name`` (segment ``name``, semaphores ``sem.name-*``)."""
    base = name.lstrip("/")
    return sorted(f for f in os.listdir("/dev/shm") if f == base or f.startswith(f"sem.{base}-"))


@pytest.fixture
def make_ring():
    """Create rings (and attach to them) with unique names; unlink and close them all afterwards."""
    rings: list[ShmRing] = []

    def make(num_entries: int, num_readers: int = 1, name: str | None = None, create: bool = True) -> ShmRing:
        ring = ShmRing(name or ring_name(), LAYOUT, num_entries, num_readers, create)
        rings.append(ring)
        return ring

    yield make
    for ring in rings:
        ring.unlink()
    for ring in rings:
        ring.close()


def write(ring: ShmRing, seq: int, timeout: float | None = 0) -> None:
    """Publish message ``seq``: header[0] = seq, data = seq * 1000 + i."""
    v = ring.acquire_write(timeout)
    v["header"][0] = seq
    v["data"][:] = seq * 1000 + np.arange(DATA_LEN, dtype=np.int32)
    ring.publish()


def read(ring: ShmRing, reader: int = 0, timeout: float | None = 0) -> int:
    """Consume one message, check its payload matches its sequence number, and return the number."""
    v = ring.acquire_read(reader, timeout)
    seq = int(v["header"][0])
    assert np.array_equal(v["data"], seq * 1000 + np.arange(DATA_LEN, dtype=np.int32)), f"payload of {seq} torn"
    ring.release_read(reader)
    return seq


def test_name_must_start_with_slash():
    with pytest.raises(ValueError):
        ShmRing("pipeline-test-no-slash", LAYOUT, 2, 1, True)


def test_wraparound_keeps_values_and_order(make_ring):
    """Many more publishes than entries, in bursts of varying size: every reader sees 0, 1, 2, ... intact."""
    writer = make_ring(num_entries=3, num_readers=2)
    reader = make_ring(num_entries=3, num_readers=2, name=writer.name, create=False)
    seen: list[list[int]] = [[], []]
    seq = 0
    for burst in [1, 3, 2, 3, 1, 1, 3, 2] * 8:
        for _ in range(burst):
            write(writer, seq)
            seq += 1
        for r in (1, 0):
            for _ in range(burst):
                seen[r].append(read(reader, r))
    assert seq > 10 * writer.num_entries
    assert seen[0] == seen[1] == list(range(seq))


def test_full_ring_blocks_writer(make_ring):
    """With every entry published and unreleased, acquire_write times out; one release frees exactly one entry."""
    ring = make_ring(num_entries=4)
    for i in range(4):
        write(ring, i)
    with pytest.raises(RingTimeout):
        ring.acquire_write(0)
    with pytest.raises(RingTimeout):
        ring.acquire_write(0.02)

    assert read(ring) == 0
    write(ring, 4)
    with pytest.raises(RingTimeout):
        ring.acquire_write(0)
    assert [read(ring) for _ in range(4)] == [1, 2, 3, 4]


def test_entry_held_by_a_reader_is_not_overwritten(make_ring):
    """A reader that acquired but did not release keeps its entry: the writer waits and the data stays intact."""
    ring = make_ring(num_entries=2)
    write(ring, 0)
    write(ring, 1)
    held = ring.acquire_read(0, 0)
    with pytest.raises(RingTimeout):
        ring.acquire_write(0)
    assert held["header"][0] == 0 and held["data"][5] == 5
    ring.release_read(0)
    write(ring, 2)  # reuses entry 0 now
    assert [read(ring), read(ring)] == [1, 2]


def test_entry_reusable_only_after_every_reader_released(make_ring):
    """With two readers, an entry comes back to the writer only once both released it."""
    ring = make_ring(num_entries=2, num_readers=2)
    write(ring, 0)
    write(ring, 1)
    assert [read(ring, 0), read(ring, 0)] == [0, 1]
    with pytest.raises(RingTimeout):
        ring.acquire_write(0)  # reader 1 has released nothing yet

    v = ring.acquire_read(1, 0)  # reader 1 holds entry 0 ...
    with pytest.raises(RingTimeout):
        ring.acquire_write(0)
    assert v["header"][0] == 0
    ring.release_read(1)  # ... and gives it back
    write(ring, 2)
    with pytest.raises(RingTimeout):
        ring.acquire_write(0)  # entry 1 is still reader 1's

    assert read(ring, 1) == 1
    assert read(ring, 0) == 2
    write(ring, 3)
    assert [read(ring, 1), read(ring, 1)] == [2, 3]
    assert read(ring, 0) == 3


@pytest.mark.parametrize("retries", [1, 5])
def test_timed_out_acquire_write_resumes_without_losing_an_entry(make_ring, retries):
    """acquire_write that took reader 0's semaphore and timed out on reader 1's resumes later; none leaks.

    Afterwards exactly ``num_entries`` publishes fit before the ring is full
    again: one fewer would mean a semaphore was lost, one more that an entry
    was handed out twice.
    """
    num_entries = 3
    ring = make_ring(num_entries=num_entries, num_readers=2)
    for i in range(num_entries):
        write(ring, i)
    assert [read(ring, 0) for _ in range(num_entries)] == [0, 1, 2]
    for _ in range(retries):  # each call takes reader 0's empty (only the first time) and waits on reader 1's
        with pytest.raises(RingTimeout):
            ring.acquire_write(0.005)
    assert [read(ring, 1) for _ in range(num_entries)] == [0, 1, 2]

    published = 0
    while True:
        try:
            write(ring, num_entries + published)
        except RingTimeout:
            break
        published += 1
        assert published <= num_entries, "more publishes than entries fit"
    assert published == num_entries

    # A second timed-out wait after a full ring (nothing taken this time) also leaves the count intact.
    with pytest.raises(RingTimeout):
        ring.acquire_write(0)
    for r in (0, 1):
        assert [read(ring, r) for _ in range(num_entries)] == [3, 4, 5]
    for i in range(num_entries):
        write(ring, 6 + i)
    with pytest.raises(RingTimeout):
        ring.acquire_write(0)


def test_acquire_read_timeout(make_ring):
    ring = make_ring(num_entries=2, num_readers=2)
    with pytest.raises(RingTimeout):
        ring.acquire_read(0, 0)
    with pytest.raises(RingTimeout):
        ring.acquire_read(1, 0.02)
    write(ring, 0)
    assert read(ring, 1) == 0
    with pytest.raises(RingTimeout):
        ring.acquire_read(1, 0)  # reader 1 consumed it; nothing new
    assert read(ring, 0) == 0  # a timed-out wait took nothing from reader 0
    with pytest.raises(RingTimeout):
        ring.acquire_read(0, 0)


def test_unlink_is_idempotent_and_leaves_nothing(make_ring):
    """unlink removes the segment and every semaphore; calling it again is harmless; mapped memory keeps working."""
    ring = make_ring(num_entries=2, num_readers=3)
    base = ring.name.lstrip("/")
    assert shm_files(ring.name) == sorted(
        [base] + [f"sem.{base}-full{r}" for r in range(3)] + [f"sem.{base}-empty{r}" for r in range(3)]
    )
    ring.unlink()
    assert shm_files(ring.name) == []
    ring.unlink()
    assert shm_files(ring.name) == []
    assert not [f for f in os.listdir("/dev/shm") if base in f]

    with pytest.raises(posix_ipc.ExistentialError):
        ShmRing(ring.name, LAYOUT, 2, 3, False)
    # The memory and open semaphores live on in this process after unlink.
    write(ring, 7)
    assert [read(ring, r) for r in range(3)] == [7, 7, 7]


def test_create_existing_name_raises_and_close_with_a_held_view(make_ring):
    ring = make_ring(num_entries=1)
    with pytest.raises(posix_ipc.ExistentialError):
        ShmRing(ring.name, LAYOUT, 1, 1, True)
    other = ShmRing(ring.name, LAYOUT, 1, 1, False)
    write(ring, 1)
    view = other.acquire_read(0, 0)
    other.close()  # a view still exported: close must not raise, and the view stays readable
    assert view["header"][0] == 1


# -- two processes, random interleavings ---------------------------------------


def _publish(name: str, num_entries: int, num_readers: int, payloads: list[list[int]], seed: int) -> None:
    """Publish ``payloads`` in order on ring ``name`` with random sleeps and random (retried) acquire timeouts."""
    rng = random.Random(seed)
    ring = ShmRing(name, LAYOUT, num_entries, num_readers, False)
    try:
        for seq, payload in enumerate(payloads):
            if rng.random() < 0.3:
                time.sleep(rng.choice([0.0, 0.0002, 0.001]))
            deadline = time.monotonic() + 10.0  # a hang guard, not a timing check
            while True:
                try:
                    v = ring.acquire_write(rng.choice([0, 0, 0.0005, 0.002, None if rng.random() < 0.2 else 0.001]))
                    break
                except RingTimeout:
                    if time.monotonic() > deadline:
                        raise
            n = len(payload)
            v["header"][0], v["header"][1], v["header"][2] = seq, n, sum(payload)
            v["data"][:] = -1 - seq  # junk past the payload, so a stale or torn entry shows
            v["data"][:n] = payload
            ring.publish()
    finally:
        ring.close()


def _writer_main(conn) -> None:
    """Writer process: run each publishing job received on ``conn`` and answer "ok" or the error."""
    while (job := conn.recv()) is not None:
        try:
            _publish(*job)
            conn.send("ok")
        except BaseException as e:  # reported to the test process, which fails the example
            conn.send(repr(e))


class WriterProcess:
    """A spawned writer process, reused across Hypothesis examples (spawning one per example is slow)."""

    def __init__(self):
        self.proc = None

    def start(self) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_writer_main, args=(child,), daemon=True)
        self.proc.start()
        child.close()

    def submit(self, *job) -> None:
        if self.proc is None or not self.proc.is_alive():
            self.start()
        self.conn.send(job)

    def stop(self) -> None:
        """End the process, whatever state it is in (a failed example may leave it waiting on a ring)."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.join()
            self.conn.close()
            self.proc = None


@pytest.fixture(scope="module")
def writer_process():
    w = WriterProcess()
    yield w
    w.stop()


_payloads = st.lists(st.lists(st.integers(-(2**31), 2**31 - 1), max_size=DATA_LEN), max_size=40)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    payloads=_payloads,
    num_entries=st.integers(1, 4),
    num_readers=st.integers(1, 2),
    writer_seed=st.integers(0, 2**32 - 1),
    reader_seed=st.integers(0, 2**32 - 1),
)
def test_two_processes_random_interleavings(
    writer_process, payloads, num_entries, num_readers, writer_seed, reader_seed
):
    """A writer process and this process as reader(s): each reader gets exactly the published sequence, in order.

    The readers' choices come from a seeded ``random.Random``, not from
    Hypothesis, since how many waits time out depends on the scheduling of
    the two processes.
    """
    reader_rng = random.Random(reader_seed)
    name = ring_name()
    ring = ShmRing(name, LAYOUT, num_entries, num_readers, True)
    writer = writer_process
    reply = None
    try:
        writer.submit(name, num_entries, num_readers, payloads, writer_seed)
        got: list[list[tuple[int, list[int]]]] = [[] for _ in range(num_readers)]
        deadline = time.monotonic() + 10.0  # a hang guard, not a timing check
        while any(len(g) < len(payloads) for g in got):
            assert time.monotonic() < deadline, "readers did not get every message"
            if reply is None and writer.conn.poll():
                reply = writer.conn.recv()
                assert reply == "ok", f"writer failed: {reply}"
            assert writer.proc.is_alive(), f"writer process died with exit code {writer.proc.exitcode}"
            r = reader_rng.choice([i for i in range(num_readers) if len(got[i]) < len(payloads)])
            try:
                v = ring.acquire_read(r, reader_rng.choice([0, 0.0005, 0.002, 0.01]))
            except RingTimeout:
                continue
            seq, n, checksum = (int(x) for x in v["header"][:3])
            data = v["data"].tolist()
            if reader_rng.random() < 0.2:
                time.sleep(reader_rng.choice([0.0002, 0.001]))  # a slow reader holds its entry
                assert v["data"].tolist() == data and int(v["header"][0]) == seq, "entry rewritten while held"
            ring.release_read(r)
            assert 0 <= n <= DATA_LEN
            assert data[n:] == [-1 - seq] * (DATA_LEN - n)
            assert sum(data[:n]) == checksum
            got[r].append((seq, data[:n]))
        if reply is None:
            assert writer.conn.poll(10), "writer did not finish"
            reply = writer.conn.recv()
        assert reply == "ok", f"writer failed: {reply}"
        expected = list(enumerate(payloads))
        for r in range(num_readers):
            assert got[r] == expected
            with pytest.raises(RingTimeout):  # nothing extra, nothing duplicated
                ring.acquire_read(r, 0)
    finally:
        if reply != "ok":
            writer.stop()  # it may still be waiting on this ring; the next example starts a fresh one
        ring.unlink()
        ring.close()
    assert shm_files(name) == []
