"""A load's read that outlives the worker's wait for it (no vLLM needed): issue 22
point 3, "never write a block after vLLM took it back".

A read that hangs cannot be stopped: it returns when the kernel or the store lets it,
and then writes its destination. After ``io_timeout_s`` the worker reports the load
failed (every block a load error), so vLLM recomputes those blocks, or frees them.

What must hold: once the load is reported, nothing of it writes the engine's blocks
again, on every route (a synchronous load read straight into its blocks from the page
cache, a synchronous or asynchronous one read into host pages and copied, the file
store's blocking reads and a store's async reads on the writer's loop); the host pages
a late read still writes stay the load's (the worker says so in
``RankReport.reading``, the scheduler keeps them) until it ended, then go back, none
leaked; the file store's cached read (``RWF_NOWAIT``) never reads what the page cache
does not hold, and writes nothing through a closed gate.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from pathlib import Path

import pytest
import torch
from connector_fakes import BS, FakeRequest, HeldReads, Rig, fill_store

from kvoffload.abc import Storage
from kvoffload.integrations.vllm_messages import LoadJob, RankReport
from kvoffload.integrations.vllm_worker import Mover, block_tensors
from kvoffload.storage.file import FileStorage
from kvoffload.storage.gate import WriteGate

NB, N = 40, 12
SENTINEL = 0x5A


class _LateByConstruction(Mover):
    """A mover whose ``io_timeout_s`` starts counting only once a store read entered
    (``entered``, bounded): the read outlives the wait however slowly the machine starts
    the load thread, so the test never depends on how fast it runs."""

    entered: threading.Event

    @property
    def io_timeout_s(self) -> float:
        self.entered.wait(30)
        return self._timeout

    @io_timeout_s.setter
    def io_timeout_s(self, value: float) -> None:
        self._timeout = value


def _mover(store: Storage, io_timeout_s: float, entered: threading.Event) -> tuple[Mover, list[torch.Tensor]]:
    layers = [torch.zeros(NB, 2, BS, 8) for _ in range(3)]
    tensors = [t for i, kv in enumerate(layers) for t in block_tensors(kv, NB, BS, f"l{i}")]
    m = _LateByConstruction(tensors, block_size=BS, host_pages=32, storage=store, io_timeout_s=io_timeout_s)
    m.entered = entered
    return m, layers


def _reports_until(m: Mover, done: object, timeout: float = 30.0) -> list[RankReport]:
    """The mover's reports until ``done(reports)`` holds (bounded)."""
    out: list[RankReport] = []
    deadline = time.monotonic() + timeout
    while not done(out):  # type: ignore[operator]
        assert time.monotonic() < deadline, f"no such report came: {out}"
        m.wait_progress(0.05)
        r = m.take_report()
        if r is not None:
            out.append(r)
    return out


def _hang_blocking_reads(m: Mover, release: threading.Event, entered: threading.Event) -> None:
    """Both of the file store's blocking reads wait for ``release``, then really read."""
    b = m._blocking
    assert b is not None
    real, real_cached = b.read, b.cached

    def read(keys: list[str], parts: list[list[memoryview]]) -> int:
        entered.set()
        release.wait(30)
        return real(keys, parts)

    def cached(keys: list[str], parts: list[list[memoryview]], gate: WriteGate) -> int:
        entered.set()
        release.wait(30)  # its open or header read waited on the disk
        return real_cached(keys, parts, gate)

    b.read, b.cached = read, cached


@pytest.mark.parametrize(
    ("sync", "n"), [(True, N), (True, 3), (False, 3)], ids=["sync split", "sync", "async"]
)
def test_a_late_file_read_never_writes_the_blocks_and_holds_its_host_pages(
    tmp_path: Path, sync: bool, n: int
) -> None:
    store = FileStorage(tmp_path)
    release, entered = threading.Event(), threading.Event()
    m, layers = _mover(store, io_timeout_s=0.1, entered=entered)
    try:
        keys = [f"p{i}" for i in range(n)]
        pages = fill_store(m, store, keys, 3)
        _hang_blocking_reads(m, release, entered)
        blocks, host = list(range(n)), list(range(20, 20 + n))
        job = LoadJob(7, "r7", keys, blocks, host, sync=sync)
        m._load(job)  # gives up after io_timeout_s
        assert entered.is_set()
        ((_, loaded, error),) = list(m._loaded)
        assert loaded == 0 and error is not None and "io_timeout_s" in error
        first = m.take_report()
        assert first is not None and first.loads[7][1:] == (0, error) and first.reading == {7: 1}
        assert m.finished(None)[1] == (set() if sync else {"r7"})  # vLLM goes on at once
        assert m.take_load_errors() == set(blocks)  # and recomputes the blocks ...
        for kv in layers:
            kv[:n].fill_(SENTINEL)  # ... here, as the engine's forward would
        assert not m.idle  # a read of the load still runs
        release.set()
        later = _reports_until(m, lambda rs: any(r.reading for r in rs))
        assert [r.reading for r in later if r.reading] == [{7: -1}]
        assert all(torch.all(kv[:n] == SENTINEL) for kv in layers), "a late read wrote the engine's blocks"
        # the late read did run, into the host pages the scheduler kept for it
        view = m.host.tensor.view(m.host.n_pages, -1)
        assert any(view[h].numpy().tobytes() == p for h, p in zip(host, pages, strict=True))
        assert m.idle
    finally:
        release.set()
        m.close()


@pytest.mark.parametrize("sync", [True, False], ids=["sync", "async"])
def test_through_the_scheduler_a_late_read_keeps_its_host_pages_until_it_ended(
    tmp_path: Path, sync: bool
) -> None:
    """The whole loop (planner and mover) on a store whose async read hangs past
    io_timeout_s: the request goes on at once (its blocks recomputed, the right KV),
    the load's host pages stay out of the pool while the read runs, and come back
    when it ended: none leaked, the ledger whole."""
    prompt = list(range(1400, 1413))  # 3 whole blocks + 1
    first = Rig(FileStorage(tmp_path))
    try:
        first.add(FakeRequest("a", prompt))
        first.step()
        first.finish("a")
        first.settle()
    finally:
        first.close()
    slow = HeldReads(FileStorage(tmp_path))
    rig = Rig(slow, sync_loads=sync)
    for m in rig.movers:
        m.io_timeout_s = 0.1
    try:
        req = FakeRequest("b", [*prompt[:12], 9, 9])
        assert rig.add(req) == 3 * BS
        deadline = time.monotonic() + 30
        while not rig.load_errors:
            assert time.monotonic() < deadline, "the load was never given up"
            rig.step() if sync else rig.step_idle()
        assert rig.load_errors >= set(rig.blocks["b"][:3])
        # the read was given up, not cancelled: it starts, however late the writer's
        # loop gets to it (on a busy machine, after io_timeout_s), and then hangs
        assert slow.reading.wait(30), "the given-up read never started"
        core = rig.planner.core
        assert core.statistics().load_host_pages == 3, "the late read's host pages went back to the pool"
        for _ in range(3):  # the engine recomputes and decodes on
            rig.step()
        assert req.num_computed_tokens >= 12
        blocks = list(rig.blocks["b"][:3])
        kv_after = [rig.block_kv(0, b) for b in blocks]
        assert any(torch.any(t != 0) for kv in kv_after for t in kv)  # recomputed: not blank
        slow.go.set()
        rig.settle()
        assert core.statistics().load_host_pages == 0  # the read ended: its pages went back
        # nothing of the late read reached the blocks
        for b, was in zip(blocks, kv_after, strict=True):
            assert all(torch.equal(x, y) for x, y in zip(was, rig.block_kv(0, b), strict=True)), b
        rig.finish("b")
        rig.settle()
        assert core.statistics().host_pages_used == 0
        rig.planner.check_invariants()
    finally:
        slow.go.set()
        rig.close()


def _cache_dropped(path: Path) -> bool:
    """Drop ``path``'s pages from the page cache; whether a cached-only read now misses."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        try:
            os.preadv(fd, [bytearray(4096)], 0, os.RWF_NOWAIT)
        except BlockingIOError:
            return True
        return False
    finally:
        os.close(fd)


@pytest.mark.skipif(not hasattr(os, "RWF_NOWAIT"), reason="no RWF_NOWAIT on this system")
def test_the_file_stores_cached_read_reads_only_the_page_cache(tmp_path: Path) -> None:
    store = FileStorage(tmp_path)
    body = os.urandom(64 * 1024)
    asyncio.run(store.put(["a", "b"], [body, body]))
    dest = [[memoryview(bytearray(len(body)))] for _ in range(2)]
    assert store.blocking_get_into_parts(["a", "b"], dest, cached=True) == 2
    assert bytes(dest[1][0]) == body
    if not _cache_dropped(store.path("b")):
        pytest.skip("this file system keeps the file in the page cache (fadvise DONTNEED did not drop it)")
    fresh = [[memoryview(bytearray(len(body)))] for _ in range(2)]
    assert store.blocking_get_into_parts(["a", "b"], fresh, cached=True) == 1  # b would wait on the disk
    assert bytes(fresh[1][0]) != body
    assert store.blocking_get_into_parts(["a", "b"], fresh) == 2 and bytes(fresh[1][0]) == body


def test_a_closed_gate_writes_nothing(tmp_path: Path) -> None:
    store = FileStorage(tmp_path)
    body = os.urandom(4096)
    asyncio.run(store.put(["a"], [body]))
    gate = WriteGate()
    gate.close()
    dest = [[memoryview(bytearray(len(body)))]]
    for cached in (True, False):
        assert store.blocking_get_into_parts(["a"], dest, cached=cached, gate=gate) == 0
        assert bytes(dest[0][0]) == bytes(len(body))
    with pytest.raises(RuntimeError, match="without a matching enter"):
        gate.leave()


def test_closing_a_gate_waits_for_the_write_inside() -> None:
    gate = WriteGate()
    assert gate.enter()
    closed = threading.Event()
    t = threading.Thread(target=lambda: (gate.close(), closed.set()))
    t.start()
    assert not closed.wait(0.2) and not gate.open  # refuses new writers at once ...
    assert not gate.enter()
    gate.leave()  # ... and returns once the one inside left
    assert closed.wait(30)
    t.join(30)


def test_reading_counts_merge_across_ranks() -> None:
    a, b = RankReport(reading={1: 1, 2: 1}), RankReport(reading={1: -1, 3: 1})
    assert a.merge(b).reading == {2: 1, 3: 1}
    assert RankReport(reading={4: 1}) and not RankReport()
