"""Write-behind (FAILURES F15): copied chunks go to the store in the background; host
pages return after the write, stored or failed; lifecycles never wait on storage;
failures are retried a bounded number of times, counted, and logged once per burst."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import anyio
import pytest
import pytest_asyncio
import structlog
from _storage_helpers import ScriptedStore, device_bytes, fill_device
from support import HANG_S

import kvoffload as kvo
from kvoffload.storage import WritePolicy
from kvoffload.testing import SimBackend, manager_in_task

pytestmark = pytest.mark.asyncio

FAST = WritePolicy(attempts=3, backoff_s=0, log_interval_s=10)


class Clock:
    """A virtual clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def scripted() -> ScriptedStore:
    return ScriptedStore()


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest_asyncio.fixture
async def smgr(
    config: kvo.OffloadConfig, backend: SimBackend, scripted: ScriptedStore, clock: Clock
) -> AsyncIterator[kvo.OffloadManager]:
    """An open manager on the sim backend writing to the scripted store."""
    kw: dict[str, Any] = {"backend": backend, "storage": scripted, "clock": clock, "write_policy": FAST}
    async with manager_in_task(config, **kw) as m:
        yield m
        if scripted.gate is not None:
            scripted.gate.set()
        scripted.down = False
        backend.complete_all()
        await m.settle()
        m.check_invariants()


def one_chunk(mgr: kvo.OffloadManager, rid: str, seed: int = 0) -> kvo.Lifecycle:
    """Admit a request and commit one stride: one chunk (one page) in flight."""
    lc = mgr.admit(rid, [seed, 1, 2, 3])
    lc.extend([seed, 5, 6, 7, 8])
    fill_device(mgr, lc, seed)
    return lc


async def test_a_copied_chunk_is_stored_under_its_keys_and_host_pages_return(
    smgr: kvo.OffloadManager, backend: SimBackend, scripted: ScriptedStore
) -> None:
    """After the copy and the write: the store holds the device bytes under the chunk's
    keys, host pages are back, and the ledger balances."""
    lc = one_chunk(smgr, "r1", seed=3)
    t = backend.pending[0]
    expected = device_bytes(smgr, t.device_pages)
    backend.complete(t)
    await smgr.settle()
    assert await scripted.get(t.keys) == expected
    s = smgr.statistics()
    assert (s.pages_stored, s.pages_in_write, s.host_pages_used) == (1, 0, 0)
    smgr.check_invariants()
    lc.finish()
    await lc.wait_released()


async def test_release_never_waits_for_storage(
    smgr: kvo.OffloadManager, backend: SimBackend, scripted: ScriptedStore
) -> None:
    """A lifecycle reaches RELEASED while its chunk's write is still held; the host
    pages are held by the write until it finishes, then return."""
    scripted.gate = anyio.Event()
    lc = one_chunk(smgr, "r1")
    lc.finish()
    backend.complete_all()
    with anyio.fail_after(HANG_S):
        await lc.wait_released()
    assert lc.outcome is kvo.Outcome.COMPLETED
    s = smgr.statistics()
    assert (s.pages_in_write, s.host_pages_used, s.pages_stored) == (1, 1, 0)
    smgr.check_invariants()
    scripted.gate.set()
    await smgr.settle()
    s = smgr.statistics()
    assert (s.pages_in_write, s.host_pages_used, s.pages_stored) == (0, 0, 1)


async def test_aborted_and_failed_chunks_are_never_written(
    smgr: kvo.OffloadManager, backend: SimBackend, scripted: ScriptedStore
) -> None:
    """A chunk whose lifecycle was aborted, or whose copy failed, is not stored; its
    host pages return at once."""
    a = one_chunk(smgr, "aborted")
    b = one_chunk(smgr, "failed", seed=1)
    a.abort()
    ta, tb = backend.pending
    backend.complete(ta)
    backend.fail(tb)
    await smgr.settle()
    assert scripted.calls == 0 and scripted.pages == {}
    s = smgr.statistics()
    assert (s.pages_stored, s.host_pages_used, s.pages_discarded, s.pages_failed) == (0, 0, 1, 1)
    b.finish()
    assert a.outcome is kvo.Outcome.ABORTED and b.outcome is kvo.Outcome.FAILED


async def test_a_transient_failure_is_retried_and_counted(
    smgr: kvo.OffloadManager, backend: SimBackend, scripted: ScriptedStore
) -> None:
    """One failed put, then success: stored, one retry counted, nothing logged."""
    scripted.fail_next = 1
    one_chunk(smgr, "r1")
    with structlog.testing.capture_logs() as logs:
        backend.complete_all()
        await smgr.settle()
    s = smgr.statistics()
    assert (s.pages_stored, s.pages_store_failed, s.pages_store_retried) == (1, 0, 1)
    assert scripted.calls == 2
    assert not [e for e in logs if e["event"].startswith("storage.") and e["log_level"] != "debug"]


async def test_a_dead_store_costs_bounded_tries_frees_everything_and_logs_once(
    smgr: kvo.OffloadManager, backend: SimBackend, scripted: ScriptedStore
) -> None:
    """Store down: the first chunk is tried `attempts` times, later ones once each (the
    queue never stalls); every page is counted failed, every host page returns, every
    lifecycle is released; one warning for the whole burst; the first success after
    it logs storage.recovered with the burst's totals."""
    scripted.down = True
    events: list[tuple[str, dict[str, Any]]] = []
    smgr.add_listener(lambda name, f: events.append((name, f)) if name.startswith("storage.") else None)
    lcs = [one_chunk(smgr, f"r{i}", seed=i) for i in range(5)]
    for lc in lcs:
        lc.finish()
    with structlog.testing.capture_logs() as logs:
        backend.complete_all()
        await smgr.settle()
        assert all(lc.outcome is kvo.Outcome.COMPLETED for lc in lcs)
        s = smgr.statistics()
        assert (s.pages_store_failed, s.pages_store_retried, s.pages_stored) == (5, 2, 0)
        assert (s.host_pages_used, s.pages_in_write, s.live_lifecycles) == (0, 0, 0)
        assert scripted.calls == 3 + 4
        smgr.check_invariants()
        scripted.down = False
        one_chunk(smgr, "after", seed=9)
        backend.complete_all()
        await smgr.settle()
    warnings = [e for e in logs if e["event"] == "storage.failed"]
    assert len(warnings) == 1 and warnings[0]["log_level"] == "warning" and warnings[0]["pages"] == 1
    recovered = [e for e in logs if e["event"] == "storage.recovered"]
    assert len(recovered) == 1 and recovered[0]["pages_failed"] == 5 and recovered[0]["chunks_failed"] == 5
    assert [n for n, _ in events].count("storage.failed") == 5  # listeners see every chunk
    assert smgr.statistics().pages_stored == 1


async def test_a_long_burst_logs_a_reminder_per_interval(
    smgr: kvo.OffloadManager, backend: SimBackend, scripted: ScriptedStore, clock: Clock
) -> None:
    """While the store stays down, at most one reminder per log_interval_s (virtual
    clock), carrying the pages failed since the last line."""
    scripted.down = True
    with structlog.testing.capture_logs() as logs:
        for i, now in enumerate([0.0, 4.0, 8.0, 12.0, 13.0]):
            clock.now = now
            one_chunk(smgr, f"r{i}", seed=i)
            backend.complete_all()
            await smgr.settle()
    warnings = [e for e in logs if e["event"] == "storage.failed"]
    assert len(warnings) == 2
    assert warnings[1]["pages_failed_since_last_log"] == 3  # the chunks at 4, 8 and 12


async def test_any_exception_from_a_store_is_a_counted_failure(
    smgr: kvo.OffloadManager, backend: SimBackend, scripted: ScriptedStore
) -> None:
    """A store that raises something other than StorageError does not kill the writer."""
    scripted.error = RuntimeError
    scripted.fail_next = 3
    one_chunk(smgr, "r1")
    one_chunk(smgr, "r2", seed=2)
    backend.complete_all()
    await smgr.settle()
    s = smgr.statistics()
    assert (s.pages_store_failed, s.pages_stored, s.host_pages_used) == (1, 1, 0)


async def test_writes_go_in_completion_order(
    smgr: kvo.OffloadManager, backend: SimBackend, scripted: ScriptedStore
) -> None:
    """Chunks are written one at a time, in the order their copies completed."""
    one_chunk(smgr, "a", seed=1)
    one_chunk(smgr, "b", seed=2)
    ta, tb = backend.pending
    backend.complete(tb)
    backend.complete(ta)
    await smgr.settle()
    assert scripted.order == [tb.keys, ta.keys]


async def test_leaving_the_manager_waits_for_queued_writes(
    config: kvo.OffloadConfig, backend: SimBackend, scripted: ScriptedStore
) -> None:
    """Exiting the context drains pending writes: the pages are stored when it returns."""
    scripted.gate = anyio.Event()

    async def open_gate_once_writing() -> None:
        for _ in range(1000):  # bounded
            if scripted.calls:
                break
            await anyio.sleep(0)
        assert scripted.gate is not None
        scripted.gate.set()

    async with anyio.create_task_group() as tg:
        async with kvo.OffloadManager(config, backend=backend, storage=scripted, write_policy=FAST) as m:
            lc = one_chunk(m, "r1")
            lc.finish()
            t = backend.pending[0]
            backend.complete_all()
            tg.start_soon(open_gate_once_writing)
        assert await scripted.get(t.keys) != [None]
        assert m.statistics().host_pages_used == 0


async def test_write_policy_rejects_bad_values() -> None:
    with pytest.raises(kvo.ConfigError, match="attempts"):
        WritePolicy(attempts=0)
    with pytest.raises(kvo.ConfigError, match="backoff_s"):
        WritePolicy(backoff_s=-1)
    assert WritePolicy(backoff_s=0.1, backoff_max_s=0.3).backoff(5) == 0.3


async def test_a_chunk_over_a_mib_is_stored_intact() -> None:
    """A chunk bigger than 1 MiB is read out of the host pool on a worker thread (the
    pages are held, so stable): the stored bytes are still exactly the device's."""
    cfg = kvo.OffloadConfig(page_size=4, stride=12, device_pages=8, host_pages=4, kv_shape=(65536,))
    backend = SimBackend()
    store = ScriptedStore()
    async with manager_in_task(cfg, backend=backend, storage=store, write_policy=FAST) as m:
        lc = m.admit("big", [0, 1, 2, 3])
        lc.extend(list(range(4, 17)))
        fill_device(m, lc, seed=5)
        t = backend.pending[0]
        assert len(t.host_pages) * m.host_pool.tensor[0].nbytes > 1 << 20
        expected = device_bytes(m, t.device_pages)
        backend.complete_all()
        await m.settle()
        assert await store.get(t.keys) == expected
        lc.finish()
        backend.complete_all()
