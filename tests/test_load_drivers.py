"""The load path on both drivers: ``SyncOffloadManager.load`` / ``wait_loaded`` /
``cancel_load`` and ``OffloadManager.start_load`` / ``wait_loaded`` / ``load`` /
``cancel_load``, on the sim and cpu backends, through the file and memory stores.

What must hold (ARCHITECTURE.md "The load path", FAILURES F38): pages a request
offloaded come back byte for byte into OTHER device pages; a missing page ends the run
there (PARTIAL, the leading run loaded); a corrupt record is never loaded (the run stops
before it: never wrong bytes); a cancelled load copies nothing once it is DONE; close()
with live loads leaves nothing held; without a store, a typed error naming it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path
from typing import Any

import anyio
import pytest
import pytest_asyncio
import torch
from support import HANG_S, toks

import kvoffload as kvo
from kvoffload.abc import Storage
from kvoffload.backends import CpuBackend
from kvoffload.keys import chain_keys
from kvoffload.storage.file import FileStorage
from kvoffload.storage.memory import MemoryStorage
from kvoffload.testing import SimBackend

LoadState, LoadOutcome = kvo.LoadState, kvo.LoadOutcome
PAGE = 4
TOKENS = toks(0, 16)  # four whole pages
SOURCE_PAGES = 4


def config() -> kvo.OffloadConfig:
    return kvo.OffloadConfig(
        page_size=PAGE, stride=PAGE, device_pages=32, host_pages=16, kv_shape=(2, 3), drain_timeout_s=HANG_S
    )


def make_backend(name: str) -> Any:
    return SimBackend() if name == "sim" else CpuBackend()


def make_store(name: str, tmp_path: Path) -> Storage:
    return MemoryStorage() if name == "memory" else FileStorage(tmp_path / "kv")


def page_bytes(mgr: Any, p: int) -> bytes:
    return bytes(mgr.device_pool.tensor[p].contiguous().view(torch.uint8).numpy().tobytes())


def write_kv(mgr: Any, pages: Sequence[int], salt: float) -> list[bytes]:
    """The engine writes the KV of ``pages`` (distinct values per page); their bytes."""
    for i, p in enumerate(pages):
        row = mgr.device_pool.tensor[p]
        row.copy_(
            (torch.arange(row.numel(), dtype=torch.float32) / 7 + salt + 10 * i).view_as(row).to(row.dtype)
        )
    return [page_bytes(mgr, p) for p in pages]


def remove_page(store: Storage, key: str) -> None:
    if isinstance(store, MemoryStorage):
        del store.pages[key]
    else:
        assert isinstance(store, FileStorage)
        store.path(key).unlink()


def corrupt_page(store: FileStorage, key: str) -> None:
    """Flip one byte of the record's payload (its last byte), in the file itself."""
    path = store.path(key)
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0xFF
    path.write_bytes(bytes(raw))


# --- the sync driver ------------------------------------------------------------------------


class SyncRig:
    def __init__(self, backend: str, store: Storage, cfg: kvo.OffloadConfig | None = None, **kw: Any) -> None:
        self.backend = make_backend(backend)
        self.store = store
        self.mgr = kvo.SyncOffloadManager(cfg or config(), backend=self.backend, storage=store, **kw)
        self.mgr.open()

    def drive(self, until: Any) -> None:
        """poll (completing the sim's copies) until ``until()``, within HANG_S."""
        mgr, b = self.mgr, self.backend
        end = time.monotonic() + HANG_S
        while not until():
            assert time.monotonic() < end, "no progress within HANG_S"
            if isinstance(b, SimBackend):
                b.launch()
                b.complete_all()
            mgr.poll()
            mgr.check_invariants()
            if not until():
                mgr.wait_progress(0.01)

    def offload(self) -> list[bytes]:
        """Offload TOKENS' four pages to the store; their bytes (the lifecycle is released)."""
        mgr = self.mgr
        lc = mgr.admit("src", TOKENS, stored=0)
        want = write_kv(mgr, lc.device_pages, 1.0)  # after admit, before the next poll (F19)
        lc.finish()
        self.drive(lambda: lc.released and not mgr.writes_pending)
        assert mgr.lookup(TOKENS) == len(TOKENS)
        return want

    def load(self, pages: list[int], **kw: Any) -> kvo.Load:
        ld = self.mgr.load(TOKENS, pages, **kw)
        self.drive(lambda: ld.done)
        return ld

    def close(self) -> None:
        if self.mgr.is_open:
            self.mgr.close()


@pytest.fixture(params=["sim", "cpu"])
def backend_name(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(params=["memory", "file"])
def store_name(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def sync_rig(backend_name: str, store_name: str, tmp_path: Path) -> Iterator[SyncRig]:
    rig = SyncRig(backend_name, make_store(store_name, tmp_path))
    yield rig
    rig.close()


def test_sync_round_trip_loads_the_offloaded_bytes_into_other_pages(sync_rig: SyncRig) -> None:
    """Offload a request's four pages through the store, load them into four OTHER
    device pages: LOADED, their bytes equal, every host page back, the ledger balanced."""
    rig = sync_rig
    want = rig.offload()
    ld = rig.load([20, 25, 21, 30], rid="back", tag="T")
    assert ld.outcome is LoadOutcome.LOADED and ld.pages_loaded == 4 and (ld.rid, ld.tag) == ("back", "T")
    assert [page_bytes(rig.mgr, p) for p in (20, 25, 21, 30)] == want
    assert ld.keys == chain_keys(None, TOKENS, PAGE) and ld.first_page == 0
    s = rig.mgr.statistics()
    assert (s.loads_loaded, s.pages_loaded, s.host_pages_used, s.loads_live) == (1, 4, 0, 0)


def test_sync_skip_pages_loads_the_pages_after_them(sync_rig: SyncRig) -> None:
    """skip_pages=2: the keys of pages 2 and 3 (first_page 2) into two device pages."""
    rig = sync_rig
    want = rig.offload()
    ld = rig.load([9, 8], skip_pages=2)
    assert ld.outcome is LoadOutcome.LOADED and ld.first_page == 2
    assert ld.keys == chain_keys(None, TOKENS, PAGE)[2:]
    assert [page_bytes(rig.mgr, p) for p in (9, 8)] == want[2:]


def test_sync_a_missing_page_loads_the_leading_run_partial(sync_rig: SyncRig) -> None:
    """Page 2's record is gone: PARTIAL with pages 0 and 1 loaded; the device pages of 2
    and 3 keep what they held."""
    rig = sync_rig
    want = rig.offload()
    remove_page(rig.store, chain_keys(None, TOKENS, PAGE)[2])
    before = [page_bytes(rig.mgr, p) for p in (22, 23)]
    ld = rig.load([20, 21, 22, 23])
    assert ld.outcome is LoadOutcome.PARTIAL and ld.pages_loaded == 2
    assert [page_bytes(rig.mgr, p) for p in (20, 21)] == want[:2]
    assert [page_bytes(rig.mgr, p) for p in (22, 23)] == before
    assert rig.mgr.statistics().load_pages_missed == 2


def test_sync_a_corrupt_record_is_never_loaded_f38(backend_name: str, tmp_path: Path) -> None:
    """F38: one byte of page 1's file flipped: the run stops before it - PARTIAL with page
    0 only - and no device page ever holds the corrupt bytes; page 0 corrupt: MISSED."""
    rig = SyncRig(backend_name, FileStorage(tmp_path / "kv"))
    try:
        want = rig.offload()
        keys = chain_keys(None, TOKENS, PAGE)
        corrupt_page(rig.store, keys[1])  # type: ignore[arg-type]
        before = [page_bytes(rig.mgr, p) for p in (11, 12, 13)]
        ld = rig.load([10, 11, 12, 13])
        assert ld.outcome is LoadOutcome.PARTIAL and ld.pages_loaded == 1
        assert page_bytes(rig.mgr, 10) == want[0]
        assert [page_bytes(rig.mgr, p) for p in (11, 12, 13)] == before
        corrupt_page(rig.store, keys[0])  # type: ignore[arg-type]
        again = rig.load([14, 15, 16, 17])
        assert again.outcome is LoadOutcome.MISSED and again.pages_loaded == 0
        rig.mgr.check_invariants()
    finally:
        rig.close()


def test_sync_nothing_stored_is_a_miss(sync_rig: SyncRig) -> None:
    """A load of pages never stored: MISSED, nothing copied, nothing held."""
    ld = sync_rig.load([0, 1, 2, 3])
    assert ld.outcome is LoadOutcome.MISSED and sync_rig.mgr.statistics().host_pages_used == 0


class GatedStore(MemoryStorage):
    """A memory store whose reads wait for ``gate`` (set from the test's thread)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()

    async def get_into(self, keys: Sequence[str], dest: Sequence[memoryview]) -> int:
        self.entered.set()
        await anyio.to_thread.run_sync(self.gate.wait, HANG_S)
        return await super().get_into(keys, dest)


def test_sync_cancel_while_reading_never_copies(backend_name: str) -> None:
    """Cancelled while its read is out: CANCELLING, then - the read returning every page -
    DONE/CANCELLED with no copy submitted and no device page written."""
    store = GatedStore()
    rig = SyncRig(backend_name, store)
    try:
        rig.offload()
        submitted = rig.backend.submitted
        before = [page_bytes(rig.mgr, p) for p in range(20, 24)]
        store.gate.clear()
        store.entered.clear()
        ld = rig.mgr.load(TOKENS, [20, 21, 22, 23])
        assert store.entered.wait(HANG_S)
        rig.mgr.cancel_load(ld)
        assert ld.state is LoadState.CANCELLING and not ld.device_busy
        store.gate.set()
        rig.drive(lambda: ld.done)
        assert ld.outcome is LoadOutcome.CANCELLED and rig.backend.submitted == submitted
        assert [page_bytes(rig.mgr, p) for p in range(20, 24)] == before
        assert rig.mgr.statistics().host_pages_used == 0
    finally:
        rig.close()


def test_sync_cancel_while_copying_keeps_the_pages_busy_until_the_copy_ends(tmp_path: Path) -> None:
    """The sim holds the h2d copy: cancelled in COPYING, device_busy stays True; once
    the copy completes, DONE/CANCELLED, pages_loaded 0, device_busy False, nothing
    submitted after the cancel, every host page back."""
    rig = SyncRig("sim", MemoryStorage())
    try:
        rig.offload()
        ld = rig.mgr.load(TOKENS, [20, 21, 22, 23])
        end = time.monotonic() + HANG_S
        while ld.state is not LoadState.COPYING:  # the read returns on the writer thread
            assert time.monotonic() < end
            rig.mgr.wait_progress(0.01)
            rig.mgr.poll()
        submitted = rig.backend.submitted
        rig.mgr.cancel_load(ld)
        assert ld.state is LoadState.CANCELLING and ld.device_busy
        rig.mgr.poll()
        assert ld.device_busy and not ld.done  # the sim still holds it
        rig.drive(lambda: ld.done)
        assert ld.outcome is LoadOutcome.CANCELLED and ld.pages_loaded == 0 and not ld.device_busy
        assert rig.backend.submitted == submitted and rig.mgr.statistics().host_pages_used == 0
    finally:
        rig.close()


def test_sync_close_with_live_loads_cancels_them_and_leaves_nothing_held(backend_name: str) -> None:
    """close() with one load reading (its read held) and one done: the reading one is
    cancelled, drained once its read returns, and ends CANCELLED; no host page held."""
    store = GatedStore()
    rig = SyncRig(backend_name, store)
    rig.offload()
    store.gate.clear()
    ld = rig.mgr.load(TOKENS, [20, 21, 22, 23])
    assert store.entered.wait(HANG_S)
    opener = threading.Timer(0.0, store.gate.set)  # the read returns while close() drains
    opener.start()
    rig.mgr.close()
    opener.join()
    assert ld.done and ld.outcome is LoadOutcome.CANCELLED
    s = rig.mgr.statistics()
    assert (s.loads_live, s.host_pages_used, s.loads_cancelled) == (0, 0, 1)


def test_sync_load_needs_a_store_and_checks_its_input(tmp_path: Path) -> None:
    """No storage: StorageError naming it; bad skip_pages: InvalidTokens; more device
    pages than pages to load: PageError; a load of another manager: KVOffloadError;
    nothing held after any of them."""
    with (
        kvo.SyncOffloadManager(config(), backend=SimBackend()) as bare,
        pytest.raises(kvo.StorageError, match="no storage tier"),
    ):
        bare.load(TOKENS, [0, 1, 2, 3])
    rig = SyncRig("sim", MemoryStorage())
    try:
        mgr = rig.mgr
        with pytest.raises(kvo.InvalidTokens, match="skip_pages"):
            mgr.load(TOKENS, [0], skip_pages=5)
        with pytest.raises(kvo.PageError, match="4 key"):
            mgr.load(TOKENS, [0, 1, 2])
        with pytest.raises(kvo.PageError, match="at least one page"):
            mgr.load(toks(0, 3), [])
        assert mgr.statistics().host_pages_used == 0 and mgr.statistics().loads_begun == 0
        other = SyncRig("sim", MemoryStorage())
        try:
            ld = other.mgr.load(TOKENS, [0, 1, 2, 3])
            with pytest.raises(kvo.KVOffloadError, match="not a live load of this manager"):
                mgr.wait_loaded(ld, 1)
            other.drive(lambda: ld.done)
        finally:
            other.close()
        mgr.check_invariants()
    finally:
        rig.close()


# --- the asyncio driver ---------------------------------------------------------------------


class AsyncRig:
    def __init__(self, mgr: kvo.OffloadManager, backend: Any, store: Storage) -> None:
        self.mgr, self.backend, self.store = mgr, backend, store

    async def until(self, done: Any) -> None:
        """Complete the sim's copies and yield until ``done()``, within HANG_S (a real
        thread - a file read, a cpu copy - is waited for by this condition and bound)."""
        with anyio.fail_after(HANG_S):
            while not done():
                if isinstance(self.backend, SimBackend):
                    self.backend.complete_all()
                await anyio.sleep(0.001)
                self.mgr.check_invariants()

    async def offload(self) -> list[bytes]:
        mgr = self.mgr
        lc = mgr.admit("src", TOKENS, stored=0)
        want = write_kv(mgr, lc.device_pages, 2.0)
        lc.finish()
        await self.until(lambda: lc.released)
        await mgr.wait_drained()
        assert await mgr.lookup(TOKENS) == len(TOKENS)
        return want


@pytest_asyncio.fixture
async def async_rig(backend_name: str, store_name: str, tmp_path: Path) -> AsyncIterator[AsyncRig]:
    backend = make_backend(backend_name)
    store = make_store(store_name, tmp_path)
    async with kvo.OffloadManager(config(), backend=backend, storage=store) as mgr:
        yield AsyncRig(mgr, backend, store)


@pytest.mark.asyncio
async def test_async_round_trip_loads_the_offloaded_bytes_into_other_pages(async_rig: AsyncRig) -> None:
    """As the sync round trip, on the asyncio driver: start_load, then wait_loaded."""
    rig = async_rig
    want = await rig.offload()
    ld = rig.mgr.start_load(TOKENS, [20, 25, 21, 30], rid="back")
    assert ld.state is LoadState.READING
    await rig.until(lambda: ld.done)
    assert await rig.mgr.wait_loaded(ld) is ld
    assert ld.outcome is LoadOutcome.LOADED and ld.pages_loaded == 4
    assert [page_bytes(rig.mgr, p) for p in (20, 25, 21, 30)] == want
    assert rig.mgr.statistics().host_pages_used == 0


@pytest.mark.asyncio
async def test_async_load_waits_and_a_missing_page_is_partial(async_rig: AsyncRig) -> None:
    """await mgr.load(...) returns the load DONE; page 3 missing: PARTIAL, 3 loaded."""
    rig = async_rig
    want = await rig.offload()
    remove_page(rig.store, chain_keys(None, TOKENS, PAGE)[3])
    async with anyio.create_task_group() as tg:
        done: list[kvo.Load] = []

        async def go() -> None:
            done.append(await rig.mgr.load(TOKENS, [4, 5, 6, 7]))

        tg.start_soon(go)
        await rig.until(lambda: bool(done))
    (ld,) = done
    assert ld.outcome is LoadOutcome.PARTIAL and ld.pages_loaded == 3
    assert [page_bytes(rig.mgr, p) for p in (4, 5, 6)] == want[:3]


@pytest.mark.asyncio
async def test_async_a_corrupt_record_is_never_loaded_f38(backend_name: str, tmp_path: Path) -> None:
    """F38 on the asyncio driver: page 2's file corrupt: PARTIAL with pages 0 and 1."""
    backend = make_backend(backend_name)
    store = FileStorage(tmp_path / "kv")
    async with kvo.OffloadManager(config(), backend=backend, storage=store) as mgr:
        rig = AsyncRig(mgr, backend, store)
        want = await rig.offload()
        corrupt_page(store, chain_keys(None, TOKENS, PAGE)[2])
        before = [page_bytes(mgr, p) for p in (12, 13)]
        ld = mgr.start_load(TOKENS, [10, 11, 12, 13])
        await rig.until(lambda: ld.done)
        assert ld.outcome is LoadOutcome.PARTIAL and ld.pages_loaded == 2
        assert [page_bytes(mgr, p) for p in (10, 11)] == want[:2]
        assert [page_bytes(mgr, p) for p in (12, 13)] == before


@pytest.mark.asyncio
async def test_async_cancel_in_reading_and_in_copying(tmp_path: Path) -> None:
    """Cancelled while reading: CANCELLED, no copy; cancelled while the sim holds its
    copy: device_busy until the copy completes, then CANCELLED, pages_loaded 0."""
    backend = SimBackend()
    store = GatedStore()
    async with kvo.OffloadManager(config(), backend=backend, storage=store) as mgr:
        rig = AsyncRig(mgr, backend, store)
        await rig.offload()
        store.gate.clear()
        submitted = backend.submitted
        reading = mgr.start_load(TOKENS, [20, 21, 22, 23])
        await rig.until(store.entered.is_set)
        mgr.cancel_load(reading)
        assert reading.state is LoadState.CANCELLING
        store.gate.set()
        await rig.until(lambda: reading.done)
        assert reading.outcome is LoadOutcome.CANCELLED and backend.submitted == submitted
        copying = mgr.start_load(TOKENS, [20, 21, 22, 23])
        with anyio.fail_after(HANG_S):
            while copying.state is not LoadState.COPYING:
                await anyio.sleep(0.001)
        mgr.cancel_load(copying)
        assert copying.device_busy and copying.state is LoadState.CANCELLING
        backend.complete_all()
        assert await mgr.wait_loaded(copying) is copying
        assert copying.outcome is LoadOutcome.CANCELLED and not copying.device_busy
        assert mgr.statistics().host_pages_used == 0


@pytest.mark.asyncio
async def test_async_leaving_with_a_live_load_cancels_and_drains_it() -> None:
    """Leaving the manager with a load whose read is held: it is cancelled and drained
    (the read returns), CANCELLED, nothing held after the close."""
    backend = CpuBackend()
    store = GatedStore()
    async with kvo.OffloadManager(config(), backend=backend, storage=store) as mgr:
        rig = AsyncRig(mgr, backend, store)
        await rig.offload()
        store.gate.clear()
        ld = mgr.start_load(TOKENS, [20, 21, 22, 23])
        await rig.until(store.entered.is_set)
        threading.Timer(0.0, store.gate.set).start()  # returns while the manager drains
    assert ld.outcome is LoadOutcome.CANCELLED
    s = mgr.statistics()
    assert (s.loads_live, s.host_pages_used) == (0, 0)


@pytest.mark.asyncio
async def test_async_start_load_without_a_store_names_it() -> None:
    """No storage: StorageError naming it, nothing held."""
    async with kvo.OffloadManager(config(), backend=SimBackend()) as mgr:
        with pytest.raises(kvo.StorageError, match="no storage tier"):
            mgr.start_load(TOKENS, [0, 1, 2, 3])
        assert mgr.statistics().loads_begun == 0


def test_sync_load_under_a_tp_group_is_refused_with_a_typed_error() -> None:
    """Under a tensor-parallel group (here a gloo group of one rank) load() is refused
    with a ConfigError that says it is not supported there; nothing is begun or held."""
    import datetime

    import torch.distributed as dist

    group = dist.ProcessGroupGloo(dist.HashStore(), 0, 1, datetime.timedelta(seconds=10))
    with kvo.SyncOffloadManager(config(), backend=SimBackend(), storage=MemoryStorage(), group=group) as mgr:
        with pytest.raises(kvo.ConfigError, match="tensor-parallel group"):
            mgr.load(TOKENS, [0, 1, 2, 3])
        s = mgr.statistics()
        assert (s.loads_begun, s.host_pages_used) == (0, 0)


@pytest.mark.parametrize("backend_name", ["sim", "cpu"])
def test_sync_engine_owned_round_trip_loads_every_kv_tensor(backend_name: str, tmp_path: Path) -> None:
    """Engine-owned mode (the engine's KV tensors, device_pages=None): pages offloaded
    from the engine's pages 1..4 through the file store come back into pages 9..12 of
    every tensor, byte for byte."""
    kv = [torch.zeros(16, PAGE, 3) for _ in range(2)]
    cfg = kvo.OffloadConfig(
        page_size=PAGE, stride=PAGE, device_pages=None, host_pages=8, drain_timeout_s=HANG_S
    )
    rig = SyncRig(backend_name, FileStorage(tmp_path / "kv"), cfg, device_kv=kv)
    try:
        mgr = rig.mgr
        src = [1, 2, 3, 4]
        lc = mgr.admit("src", TOKENS, pages=src, stored=0)
        for j, t in enumerate(kv):
            for i, p in enumerate(src):
                t[p] = torch.full((PAGE, 3), 10.0 * j + i + 0.5)
        want = [[t[p].clone() for p in src] for t in kv]
        lc.finish()
        rig.drive(lambda: lc.released and not mgr.writes_pending)
        ld = mgr.load(TOKENS, [9, 10, 11, 12])
        rig.drive(lambda: ld.done)
        assert ld.outcome is LoadOutcome.LOADED
        for j, t in enumerate(kv):
            assert all(torch.equal(t[p], want[j][i]) for i, p in enumerate([9, 10, 11, 12]))
        mgr.check_invariants()
    finally:
        rig.close()
