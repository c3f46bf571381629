"""KV events (issue 24, point 3): ``mgr.kv_events()`` and the core's room behind it.

What must hold: a page is announced stored (``BlockStored``, vLLM's shape) only once
the store confirmed it - never at the copy, never for a failed write, only the
confirmed pages of a partial write (F34) - with its chain key, its parent's key, its
tokens, the page size and its request's rid and tag; a load that finds a page gone
announces it removed (``BlockRemoved``), a read that raised announces nothing; nothing
is recorded (and the core's sink is the mover's own) before anyone subscribes or after
the buffer is closed, and subscribing attaches no listener (the fast paths stay on);
the buffer keeps the newest ``maxlen`` events and counts the dropped ones; the record
of chunks that never reach a write does not grow without bound.
"""

from __future__ import annotations

import time
from typing import Any

import anyio
import pytest
from support import HANG_S, toks

import kvoffload as kvo
from kvoffload.abc import Transfer
from kvoffload.core.offload import OffloadCore
from kvoffload.keys import chain_keys
from kvoffload.pools import DevicePool, HostPool
from kvoffload.storage.memory import MemoryStorage
from kvoffload.testing import SimBackend

PS = 4


def make_core(host: int = 16) -> tuple[OffloadCore, list[Transfer]]:
    """A bare core with a storage tier (write jobs) and a sink that keeps the jobs."""
    config = kvo.OffloadConfig(
        page_size=PS, stride=PS, device_pages=64, host_pages=host, kv_shape=(1,), dtype="float32"
    )
    jobs: list[Transfer] = []
    core = OffloadCore(
        config,
        device_pool=DevicePool.create(64, PS, (1,), "float32"),
        host_pool=HostPool.new(host, (PS, 1), "float32"),
        accept=jobs.append,
        storage=True,
    )
    return core, jobs


def copy_all(core: OffloadCore, jobs: list[Transfer]) -> list[int]:
    """Complete every copy; the ids of the write jobs that came out."""
    core.complete([(t.id, None) for t in jobs if t.id in core.inflight])
    return [w.id for w in core.take_writes()]


def test_a_page_is_announced_stored_only_when_the_store_confirmed_it() -> None:
    """Copied is not stored: no event at the copy's completion; one BlockStored at the
    write's success, with kvoffload's chain keys, the parent's key, the tokens, the
    page size, the medium, the rid, the tag and where the run starts."""
    core, jobs = make_core()
    events = core.kv.subscribe()
    prompt = toks(0, 8)
    lc = core.admit("r1", prompt, tag="T1", stored=0)  # two prompt pages out at once
    lc.extend(toks(8, 13))  # a third page (tokens 8..11) goes out
    writes = copy_all(core, jobs)
    assert len(writes) == 2 and list(events) == []
    core.write_done(writes[0], True)
    core.write_done(writes[1], True)
    keys = chain_keys(None, toks(0, 12), PS)
    got = events.drain()
    assert [type(e) for e in got] == [kvo.BlockStored, kvo.BlockStored]
    first, second = got
    assert isinstance(first, kvo.BlockStored) and isinstance(second, kvo.BlockStored)
    assert first.block_hashes == keys[:2] and first.parent_block_hash is None
    assert first.token_ids == toks(0, 8) and first.first_token == 0
    assert second.block_hashes == keys[2:] and second.parent_block_hash == keys[1]
    assert second.token_ids == toks(8, 12) and second.first_token == 8
    for e in got:
        assert (e.block_size, e.medium, e.rid, e.tag, e.lifecycle_id) == (PS, "STORAGE", "r1", "T1", lc.id)
        assert e.lora_id is None and e.lora_name is None
    assert len(events) == 0 and events.dropped == 0
    core.check_invariants()


def test_a_seeded_chain_and_a_stored_prefix_name_the_right_parent() -> None:
    """With a chain seed the first page has no parent (the seed is not a page); after a
    stored prefix the first new page's parent is the prefix's last key."""
    core, jobs = make_core()
    events = core.kv.subscribe()
    seed = kvo.namespace_seed(extra_key="tenant")
    core.admit("a", toks(0, 4), chain_seed=seed, stored=0)
    core.admit("b", toks(0, 8), stored=4)
    for w in copy_all(core, jobs):
        core.write_done(w, True)
    a, b = events.drain()
    assert isinstance(a, kvo.BlockStored) and isinstance(b, kvo.BlockStored)
    assert a.block_hashes == chain_keys(seed, toks(0, 4), PS) and a.parent_block_hash is None
    plain = chain_keys(None, toks(0, 8), PS)
    assert b.block_hashes == plain[1:] and b.parent_block_hash == plain[0] and b.first_token == 4


def test_a_failed_write_is_never_announced_and_a_partial_one_only_up_to_its_first_gap_f34() -> None:
    """F34: a write that failed announces nothing; a PartialWriteError announces the
    pages it flags stored before the first one it does not (what a lookup can reach: the
    chain breaks there, F33), never the confirmed pages after the gap."""
    core, jobs = make_core()
    events = core.kv.subscribe()
    core.admit("bad", toks(0, 8), stored=0)
    core.admit("part", toks(100, 120), stored=0)  # five pages in one chunk
    core.admit("gap0", toks(200, 208), stored=0)  # its first page unconfirmed
    bad, part, gap0 = copy_all(core, jobs)
    core.write_done(bad, False, error=kvo.StorageError("down"))
    assert list(events) == []
    flags = [True, True, False, True, False]
    core.write_done(part, False, error=kvo.PartialWriteError("3 of 5 failed", flags))
    core.write_done(gap0, False, error=kvo.PartialWriteError("1 of 2 failed", [False, True]))
    keys = chain_keys(None, toks(100, 120), PS)
    (run,) = events.drain()
    assert isinstance(run, kvo.BlockStored) and run.rid == "part"
    assert run.block_hashes == keys[:2] and run.parent_block_hash is None
    assert run.token_ids == toks(100, 108) and run.first_token == 0
    core.check_invariants()


def test_nothing_is_recorded_before_a_subscription_or_after_close_and_no_listener_is_attached() -> None:
    """Unsubscribed, the core's sink is the mover's own and no chunk is recorded;
    subscribing wraps it without attaching a listener (``observed`` stays False: the
    fast paths stay on); closing the buffer puts the mover's sink back."""
    core, jobs = make_core()
    assert core.chunks.accept == jobs.append and not core.kv.on
    core.admit("before", toks(0, 4), stored=0)
    assert core.kv.chunks == {}
    events = core.kv.subscribe()
    assert core.chunks.accept != jobs.append and not core.observed and not core.listeners
    assert core.kv.subscribe() is events  # one buffer per core
    core.accept = jobs.append  # the driver setting its sink again keeps it wrapped
    core.admit("during", toks(10, 14), stored=0)
    assert len(core.kv.chunks) == 1
    events.close()
    assert events.closed and not core.kv.on and core.chunks.accept == jobs.append
    core.admit("after", toks(20, 24), stored=0)
    for w in copy_all(core, jobs):
        core.write_done(w, True)
    assert list(events) == [] and core.kv.chunks == {}
    assert core.kv.subscribe() is not events


def test_the_buffer_keeps_the_newest_events_and_counts_the_dropped() -> None:
    """maxlen=2 and five stored runs nobody read: the last two are kept, three dropped."""
    core, jobs = make_core()
    events = core.kv.subscribe(maxlen=2)
    for i in range(5):
        core.admit(f"r{i}", toks(10 * i, 10 * i + 4), stored=0)
    for w in copy_all(core, jobs):
        core.write_done(w, True)
    assert events.dropped == 3 and len(events) == 2
    assert [e.rid for e in events] == ["r3", "r4"]
    with pytest.raises(kvo.ConfigError, match="already subscribed with maxlen=2"):
        core.kv.subscribe(maxlen=8)
    with pytest.raises(kvo.ConfigError, match="maxlen"):
        make_core()[0].kv.subscribe(maxlen=0)


def test_chunks_that_never_reach_a_write_are_forgotten() -> None:
    """Copies that fail never become write jobs: the room's record of them is pruned,
    so it stays near the number of copies and writes in flight (bounded memory)."""
    core, jobs = make_core(host=4)
    core.kv.subscribe()
    for i in range(300):
        lc = core.admit(f"r{i}", toks(i, i + 4), stored=0)
        t = jobs[-1]
        core.complete([(t.id, kvo.BackendError("copy failed"))])
        lc.abort()
    assert len(core.kv.chunks) <= 130
    core.check_invariants()


def test_a_load_that_finds_a_page_gone_announces_it_removed() -> None:
    """A short read without an error: the page after the good ones is announced removed
    (its key, its index in the chain, the load's rid and tag); a read that raised says
    nothing about what the store holds and announces nothing."""
    core, _ = make_core()
    events = core.kv.subscribe()
    keys = chain_keys(None, toks(0, 16), PS)
    ld = core.load_begin("back", keys[1:], [40, 41, 42], tag="L", first_page=1)
    core.load_read(ld, 1)  # page 2 missing or corrupt
    (gone,) = events.drain()
    assert isinstance(gone, kvo.BlockRemoved)
    assert (gone.block_hashes, gone.page, gone.rid, gone.tag) == ([keys[2]], 2, "back", "L")
    assert gone.medium == "STORAGE"
    down = core.load_begin("down", keys, [50, 51, 52, 53])
    core.load_read(down, 0, kvo.StorageError("store down"))
    assert list(events) == []


# --- both drivers ----------------------------------------------------------------------------


def driver_config() -> kvo.OffloadConfig:
    return kvo.OffloadConfig(page_size=PS, stride=PS, device_pages=32, host_pages=16, kv_shape=(2,))


def test_sync_manager_kv_events_announce_what_reached_the_store() -> None:
    """SyncOffloadManager: a finished request's pages, once written, come out of
    ``mgr.kv_events()`` as BlockStored with the keys ``lookup`` finds."""
    backend, store = SimBackend(), MemoryStorage()
    with kvo.SyncOffloadManager(driver_config(), backend=backend, storage=store) as mgr:
        events = mgr.kv_events()
        assert mgr.kv_events() is events
        lc = mgr.admit("s", toks(0, 8), stored=0, tag="req")
        lc.extend(toks(8, 12))
        lc.finish()
        end = time.monotonic() + HANG_S
        while not (lc.released and not mgr.writes_pending):
            assert time.monotonic() < end, "no progress within HANG_S"
            backend.launch()
            backend.complete_all()
            mgr.poll()
            mgr.wait_progress(0.01)
        got = [e for e in events if isinstance(e, kvo.BlockStored)]
        assert [k for e in got for k in e.block_hashes] == chain_keys(None, toks(0, 12), PS)
        assert all(e.tag == "req" for e in got) and mgr.lookup(toks(0, 12)) == 12
        mgr.check_invariants()


@pytest.mark.asyncio
async def test_async_manager_kv_events_announce_what_reached_the_store() -> None:
    """OffloadManager: the same, on the event loop."""
    backend, store = SimBackend(), MemoryStorage()
    async with kvo.OffloadManager(driver_config(), backend=backend, storage=store) as mgr:
        events = mgr.kv_events(maxlen=64)
        lc = mgr.admit("a", toks(0, 8), stored=0)
        lc.finish()
        with anyio.fail_after(HANG_S):
            while backend.pending:
                backend.complete_all()
                await anyio.sleep(0)
            await lc.wait_released()
            await mgr.settle()
            while len(events) == 0:  # the write lands on the writer's own time
                await anyio.sleep(0.01)
        (e,) = events.drain()
        assert isinstance(e, kvo.BlockStored) and e.block_hashes == chain_keys(None, toks(0, 8), PS)
        assert e.rid == "a" and e.token_ids == toks(0, 8)


def test_kv_events_from_a_foreign_thread_is_refused() -> None:
    """Like every manager call, kv_events() belongs to the owner thread (F24)."""
    import threading

    with kvo.SyncOffloadManager(driver_config(), backend=SimBackend(), storage=MemoryStorage()) as mgr:
        out: list[Any] = []
        th = threading.Thread(target=lambda: out.append(_try(mgr.kv_events)))
        th.start()
        th.join(HANG_S)
        assert len(out) == 1 and isinstance(out[0], kvo.WrongThread)
        assert not mgr.core.kv.on


def _try(f: Any) -> Any:
    try:
        return f()
    except Exception as exc:
        return exc
