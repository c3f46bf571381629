"""The load path in the core (``kvoffload.core.loads``, ``OffloadCore.load_begin`` /
``load_read`` / ``load_cancel``): store -> host pool -> device pages, on the sim and
cpu backends, with the ledger checked after every step.

What must hold (ARCHITECTURE.md "The load path", FAILURES F38): a load's device pages
are written only by its one h2d copy, submitted only when its read returned and it was
not cancelled; once a load is DONE no copy of it runs; its host pages are returned
exactly once, only when no read and no copy touches them; a failed, missing or corrupt
page is a miss (PARTIAL, MISSED, FAILED), never wrong bytes; bad input is a typed error
with nothing held.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import kvoffload as kvo
from kvoffload.abc import Transfer
from kvoffload.backends import CpuBackend
from kvoffload.core import OffloadCore
from kvoffload.pools import DevicePool, EnginePages, HostPool
from kvoffload.testing import SimBackend

LoadState, LoadOutcome = kvo.LoadState, kvo.LoadOutcome
BOUND_S = 20.0  # a real copy thread is waited for with a condition and this bound (STYLE 16)


class Rig:
    """An OffloadCore on a real backend (sim or cpu) and its pools; ``hold`` keeps the
    cpu backend's copies on its thread (the sim's wait for ``deliver`` anyway)."""

    def __init__(self, backend_name: str, engine: bool = False, host_pages: int = 16) -> None:
        self.name = backend_name
        self.backend: Any = SimBackend() if backend_name == "sim" else CpuBackend()
        cfg = kvo.OffloadConfig(
            page_size=4, stride=4, device_pages=None if engine else 32, host_pages=host_pages, kv_shape=(2, 3)
        )
        if engine:
            self.kv = [torch.zeros(32, cfg.page_size, 2, 3) for _ in range(2)]
            self.device: Any = EnginePages(self.kv, cfg.page_size)
            self.host = HostPool.new(host_pages, (self.device.page_bytes,), "uint8", zero=True)
        else:
            self.device = DevicePool.create(32, cfg.page_size, cfg.kv_shape, "float32")
            self.host = HostPool.new(host_pages, (cfg.page_size, *cfg.kv_shape), "float32", zero=True)
        self.backend.open(self.device, self.host)
        self.gate = threading.Event()
        self.gate.set()
        self.started: list[Transfer] = []
        if backend_name == "cpu":
            self.backend.hooks.before = self._before
        self.core = OffloadCore(cfg, device_pool=self.device, host_pool=self.host, accept=self.backend.submit)

    def _before(self, t: Transfer) -> None:
        self.started.append(t)
        self.gate.wait(BOUND_S)
        return None

    def check(self) -> None:
        self.core.check_invariants()

    def page(self, p: int) -> bytes:
        """Device page ``p``'s bytes."""
        if isinstance(self.device, EnginePages):
            return b"".join(t[p].contiguous().view(torch.uint8).numpy().tobytes() for t in self.kv)
        return self.device.tensor[p].contiguous().view(torch.uint8).numpy().tobytes()

    def host_page(self, h: int) -> bytes:
        return self.host.tensor[h].contiguous().view(torch.uint8).numpy().tobytes()

    def fill_host(self, ld: kvo.Load, n: int, base: float) -> list[bytes]:
        """What a store read does: fill the load's first ``n`` host pages; their bytes."""
        out = []
        for i, h in enumerate(ld.host_pages[:n]):
            row = self.host.tensor[h]
            if row.dtype == torch.uint8:
                vals = (torch.arange(row.numel()) + int(base) + 7 * i) % 251
                row.copy_(vals.to(torch.uint8).view_as(row))
            else:
                row.copy_((torch.arange(row.numel(), dtype=torch.float32) + base + 100 * i).view_as(row))
            out.append(self.host_page(h))
        return out

    def deliver(self, n: int | None = None) -> list[kvo.Lifecycle]:
        """Run every copy submitted (the sim: complete them now; cpu: wait for them) and
        deliver the completions to the core."""
        b = self.backend
        b.launch()
        if isinstance(b, SimBackend):
            b.complete_all()
        else:
            want = len(b.running()) if n is None else n
            got: list[Any] = []
            while len(got) < want:
                assert b.wait_ready(BOUND_S), "a copy did not complete within the bound"
                got += b.take_completions()
            released = self.core.complete(got)
            self.check()
            return released
        released = self.core.complete(b.take_completions())
        self.check()
        return released

    def close(self) -> None:
        self.gate.set()
        self.backend.close()
        assert self.backend.join(BOUND_S)


@pytest.fixture(params=["sim", "cpu"])
def rig(request: pytest.FixtureRequest) -> Iterator[Rig]:
    r = Rig(request.param)
    yield r
    r.close()


def keys(n: int, salt: str = "k") -> list[str]:
    return [f"{salt}{i:04d}" * 4 for i in range(n)]


def test_a_load_copies_the_pages_read_into_its_device_pages(rig: Rig) -> None:
    """begin -> READING with one host page per key; read of all -> COPYING with one h2d
    transfer; its completion -> DONE/LOADED: the device pages hold the bytes the read
    put in the host pages, and every host page is back."""
    core = rig.core
    ld = core.load_begin("r1", keys(3), [7, 3, 20], tag="T", first_page=2)
    rig.check()
    assert (ld.state, ld.rid, ld.tag, ld.first_page, ld.outcome) == (LoadState.READING, "r1", "T", 2, None)
    assert len(ld.host_pages) == 3 and rig.host.used == 3 and not ld.device_busy and not ld.done
    assert core.statistics().loads_live == 1 and core.statistics().load_host_pages == 3
    want = rig.fill_host(ld, 3, 5.0)
    assert core.load_read(ld, 3) == []
    rig.check()
    assert ld.state is LoadState.COPYING and ld.device_busy
    t = ld.transfer
    assert t is not None and t.direction == "h2d" and t.device_pages == [7, 3, 20] and t.lifecycle_id == ld.id
    assert t.keys == keys(3)
    rig.deliver()
    assert ld.done and ld.outcome is LoadOutcome.LOADED and ld.pages_loaded == 3 and not ld.device_busy
    assert [rig.page(p) for p in (7, 3, 20)] == want
    assert rig.host.used == 0 and ld.host_pages == [] and core.take_loads() == [ld]
    s = core.statistics()
    assert (s.loads_live, s.loads_begun, s.loads_loaded, s.pages_loaded, s.load_pages_missed) == (
        0,
        1,
        1,
        3,
        0,
    )


def test_a_short_read_loads_the_leading_run_partial_and_returns_the_rest(rig: Rig) -> None:
    """Read of 2 of 4 (page 2 missing or corrupt, F38): the host pages past it go back
    at once, only the first 2 device pages are written, PARTIAL with pages_loaded 2; the
    other device pages keep what they held."""
    core = rig.core
    before = [rig.page(p) for p in range(8)]
    ld = core.load_begin("r", keys(4), [0, 1, 2, 3])
    want = rig.fill_host(ld, 4, 1.0)  # page 2 and 3 filled too: a read that stopped there
    core.load_read(ld, 2)
    rig.check()
    assert rig.host.used == 2 and len(ld.host_pages) == 2
    rig.deliver()
    assert ld.outcome is LoadOutcome.PARTIAL and ld.pages_loaded == 2 and "page 2" in (ld.reason or "")
    assert [rig.page(p) for p in range(8)] == want[:2] + before[2:]
    s = core.statistics()
    assert (s.loads_partial, s.pages_loaded, s.load_pages_missed, s.host_pages_used) == (1, 2, 2, 0)


@pytest.mark.parametrize("how", ["missed", "failed"])
def test_a_read_of_nothing_or_an_error_ends_the_load_with_nothing_copied(rig: Rig, how: str) -> None:
    """n_ok == 0 -> MISSED; a read error -> FAILED (the error kept): no copy submitted,
    no device page written, host pages back; returned by load_read and take_loads."""
    core = rig.core
    before = [rig.page(p) for p in range(4)]
    ld = core.load_begin("r", keys(2), [0, 1])
    rig.fill_host(ld, 2, 9.0)
    boom = OSError("store unreachable")
    done = core.load_read(ld, 0) if how == "missed" else core.load_read(ld, 1, boom)
    rig.check()
    assert done == [ld] and core.take_loads() == [ld] and rig.backend.submitted == 0
    assert ld.outcome is (LoadOutcome.MISSED if how == "missed" else LoadOutcome.FAILED)
    assert ld.error is (None if how == "missed" else boom) and ld.pages_loaded == 0
    assert [rig.page(p) for p in range(4)] == before and rig.host.used == 0


def test_a_failed_copy_fails_the_load_with_nothing_usable(rig: Rig) -> None:
    """The h2d copy fails: DONE/FAILED, pages_loaded 0, its error kept, host pages back."""
    core = rig.core
    ld = core.load_begin("r", keys(2), [4, 5])
    rig.fill_host(ld, 2, 2.0)
    core.load_read(ld, 2)
    t = ld.transfer
    assert t is not None
    boom = RuntimeError("h2d copy failed")
    if isinstance(rig.backend, SimBackend):
        rig.backend.fail(t, boom)
        core.complete(rig.backend.take_completions())
    else:
        rig.backend.hooks.before = lambda tr: boom
        rig.deliver(1)
    rig.check()
    assert ld.outcome is LoadOutcome.FAILED and ld.pages_loaded == 0 and ld.error is boom
    assert rig.host.used == 0 and core.statistics().loads_failed == 1


def test_cancel_while_reading_never_copies(rig: Rig) -> None:
    """Cancelled in READING: CANCELLING while the read is out (its host pages still
    held: the read may write them); when the read returns - even with every page read -
    DONE/CANCELLED, no copy submitted, no device page written, host pages back."""
    core = rig.core
    before = [rig.page(p) for p in range(4)]
    ld = core.load_begin("r", keys(3), [1, 2, 3])
    assert core.load_cancel(ld) == []
    rig.check()
    assert ld.state is LoadState.CANCELLING and rig.host.used == 3 and ld.reading and not ld.device_busy
    assert core.load_cancel(ld) == []  # twice: nothing more
    rig.fill_host(ld, 3, 4.0)
    assert core.load_read(ld, 3) == [ld]
    rig.check()
    assert ld.outcome is LoadOutcome.CANCELLED and rig.backend.submitted == 0 and rig.host.used == 0
    rig.backend.launch()
    assert [rig.page(p) for p in range(4)] == before
    assert core.load_cancel(ld) == [] and ld.outcome is LoadOutcome.CANCELLED  # DONE: a no-op
    s = core.statistics()
    assert (s.loads_cancelled, s.pages_loaded, s.load_pages_missed) == (1, 0, 0)


def test_cancel_while_copying_keeps_the_pages_busy_until_the_copy_completed(rig: Rig) -> None:
    """Cancelled in COPYING (the copy held): CANCELLING, device_busy True, host pages
    held (the copy reads them); the copy's completion -> DONE/CANCELLED, device_busy
    False, host pages back, pages_loaded 0; nothing is submitted after the cancel."""
    core = rig.core
    ld = core.load_begin("r", keys(2), [8, 9])
    rig.fill_host(ld, 2, 3.0)
    rig.gate.clear()
    core.load_read(ld, 2)
    rig.backend.launch()
    core.load_cancel(ld)
    rig.check()
    assert ld.state is LoadState.CANCELLING and ld.device_busy and rig.host.used == 2
    submitted = rig.backend.submitted
    rig.gate.set()
    rig.deliver(1)
    assert ld.outcome is LoadOutcome.CANCELLED and not ld.device_busy and ld.pages_loaded == 0
    assert rig.host.used == 0 and rig.backend.submitted == submitted == 1 and core.take_loads() == [ld]


def test_the_host_pool_full_is_a_miss_with_a_reason_and_nothing_held() -> None:
    """A load needing more host pages than are free ends at once, MISSED, its reason
    saying so; nothing held, nothing submitted, no error raised."""
    rig = Rig("sim", host_pages=2)
    ld = rig.core.load_begin("r", keys(3), [0, 1, 2])
    rig.check()
    assert ld.done and ld.outcome is LoadOutcome.MISSED and "2 free page(s)" in (ld.reason or "")
    assert rig.host.used == 0 and rig.backend.submitted == 0 and rig.core.take_loads() == [ld]
    assert rig.core.statistics().load_pages_missed == 3


def _unchanged(rig: Rig, before: kvo.Statistics) -> None:
    rig.check()
    assert rig.core.statistics() == before and rig.host.used == before.host_pages_used


@pytest.mark.parametrize(
    ("args", "error", "match"),
    [
        ((keys(2), [0]), kvo.PageError, "2 key"),
        ((keys(1), [32]), kvo.PageError, "out of range"),
        ((keys(1), [-1]), kvo.PageError, "out of range"),
        ((keys(2), [3, 3]), kvo.PageError, "named twice"),
        (([], []), kvo.PageError, "at least one page"),
        (([b"k"], [0]), kvo.ConfigError, "keys must be"),
        (("abc", [0, 1, 2]), kvo.ConfigError, "keys must be"),
        ((iter(keys(1)), [0]), kvo.ConfigError, "keys must be"),
        ((keys(1), {0}), kvo.PageError, "ordered"),
    ],
)
def test_bad_input_is_a_typed_error_with_nothing_held(args: tuple[Any, Any], error: type, match: str) -> None:
    """Lengths that differ, a page out of range or named twice, no page, keys that are
    not strings, an unordered page collection: the typed error names it; nothing held."""
    rig = Rig("sim")
    before = rig.core.statistics()
    with pytest.raises(error, match=match):
        rig.core.load_begin("r", *args)
    _unchanged(rig, before)
    with pytest.raises(kvo.ConfigError, match="first_page"):
        rig.core.load_begin("r", keys(1), [0], first_page=-1)
    _unchanged(rig, before)


@pytest.mark.parametrize("engine", [False, True], ids=["owned", "engine-owned"])
def test_a_page_held_by_a_live_lifecycle_or_load_is_refused(engine: bool) -> None:
    """A device page a live lifecycle holds for itself (it may copy from it), or one a
    live load names, is refused with a PageError and nothing held; in engine-owned mode
    a stored prefix page (shared, never copied) may be loaded into."""
    rig = Rig("sim", engine=engine)
    core = rig.core
    if engine:
        lc = core.admit("a", list(range(12)), pages=[5, 6, 7], stored=4)  # page 5: its stored prefix
        own = 6
    else:
        lc = core.admit("a", list(range(8)))
        own = lc.device_pages[1]
    other = core.load_begin("b", keys(1), [20])
    before = core.statistics()
    with pytest.raises(kvo.PageError, match="live lifecycle"):
        core.load_begin("r", keys(2), [own, 21])
    with pytest.raises(kvo.PageError, match="live load"):
        core.load_begin("r", keys(2), [21, 20])
    _unchanged(rig, before)
    if engine:
        ok = core.load_begin("r", keys(1), [5])
        assert ok.state is LoadState.READING
        core.load_cancel(ok)
        core.load_read(ok, 0)
    core.load_cancel(other)
    core.load_read(other, 0)
    core.abort(lc)
    rig.deliver()
    rig.check()


def test_a_read_reported_twice_or_out_of_range_is_refused_and_changes_nothing() -> None:
    """load_read with n_ok outside 0..len(keys) is a ConfigError, a second load_read (or
    one of a DONE load) a KVOffloadError; neither changes anything."""
    rig = Rig("sim")
    core = rig.core
    ld = core.load_begin("r", keys(2), [0, 1])
    before = core.statistics()
    for bad in (3, -1, True, 1.0):
        with pytest.raises(kvo.ConfigError, match="n_ok"):
            core.load_read(ld, bad)
    _unchanged(rig, before)
    core.load_read(ld, 0)
    with pytest.raises(kvo.KVOffloadError, match="not outstanding"):
        core.load_read(ld, 1)
    rig.check()


def test_load_ids_are_unique_among_lifecycles_and_completions_find_their_load(rig: Rig) -> None:
    """A load's id is never a live lifecycle's; one batch mixing offload chunk and load
    completions applies each to its issuer by id (F1), in order: the chunk's lifecycle
    and the load both move on, the ledger balances."""
    core = rig.core
    lc = core.admit("same", list(range(8)), stored=0)  # its prompt chunk goes out at once
    ld = core.load_begin("same", keys(2), [20, 21])
    lc2 = core.admit("same", list(range(4)))
    assert len({lc.id, ld.id, lc2.id}) == 3
    want = rig.fill_host(ld, 2, 8.0)
    core.load_read(ld, 2)
    lc.finish()
    assert lc.inflight == 1 and ld.device_busy
    released = rig.deliver(2 + lc2.inflight)
    assert lc in released and ld.outcome is LoadOutcome.LOADED
    assert [rig.page(20), rig.page(21)] == want
    lc2.abort()
    rig.deliver()
    rig.check()


def test_a_mover_that_refuses_the_copy_fails_the_load_and_returns_its_pages() -> None:
    """The mover's submit raises on the h2d copy: the load ends FAILED at once (returned
    by load_read), its host pages back, no device page written."""
    rig = Rig("sim")
    core = rig.core
    ld = core.load_begin("r", keys(2), [0, 1])
    rig.backend.close()  # it refuses every submit from now on
    assert core.load_read(ld, 2) == [ld]
    rig.check()
    assert ld.outcome is LoadOutcome.FAILED and isinstance(ld.error, kvo.BackendError)
    assert rig.host.used == 0 and not ld.device_busy


def test_close_cancels_live_loads_and_each_ends_when_its_read_or_copy_returns(rig: Rig) -> None:
    """close() with a load READING and one COPYING: both CANCELLING; the read's return
    and the copy's completion end them CANCELLED; no load can begin after; nothing
    leaked."""
    core = rig.core
    reading = core.load_begin("a", keys(2), [0, 1])
    copying = core.load_begin("b", keys(2), [2, 3])
    rig.fill_host(copying, 2, 1.0)
    rig.gate.clear()
    core.load_read(copying, 2)
    rig.backend.launch()
    core.close()
    rig.check()
    assert reading.state is copying.state is LoadState.CANCELLING
    with pytest.raises(kvo.KVOffloadError, match="closed"):
        core.load_begin("c", keys(1), [4])
    assert core.load_read(reading, 2) == [reading]
    rig.gate.set()
    rig.deliver(1)
    assert reading.outcome is copying.outcome is LoadOutcome.CANCELLED
    s = core.statistics()
    assert (s.loads_live, s.host_pages_used, s.loads_cancelled) == (0, 0, 2)
    assert core.take_loads() == [reading, copying]


def test_owned_mode_a_live_load_holds_its_device_pages_so_no_admit_takes_them() -> None:
    """Owned mode: kvoffload's pool holds a live load's device pages (an admit meanwhile
    gets other pages, so no copy of the load writes a lifecycle's page); they are free
    again at DONE."""
    rig = Rig("sim")
    core = rig.core
    free = rig.device.free_pages
    ld = core.load_begin("r", keys(3), [31, 30, 29])  # the pool's next pages (LIFO from the top)
    assert rig.device.free_pages == free - 3 and all(rig.device.is_allocated(p) for p in (29, 30, 31))
    lc = core.admit("a", list(range(12)))
    assert not set(lc.device_pages) & {29, 30, 31}
    rig.check()
    core.load_read(ld, 3)
    rig.deliver()
    assert ld.outcome is LoadOutcome.LOADED and not any(rig.device.is_allocated(p) for p in (29, 30, 31))
    core.abort(lc)
    rig.check()
    assert rig.device.free_pages == free


def test_engine_owned_a_page_handed_to_a_lifecycle_while_reading_is_never_copied() -> None:
    """Engine-owned mode: the engine hands a load's page to a lifecycle while the load
    reads (its bug): when the read returns, no copy is submitted - FAILED, naming the
    page - so the lifecycle's page is never written by the load."""
    rig = Rig("sim", engine=True)
    core = rig.core
    ld = core.load_begin("r", keys(2), [3, 4])
    lc = core.admit("a", list(range(4)), pages=[4], stored=0)  # its own page: it copies from it
    submitted = rig.backend.submitted
    rig.fill_host(ld, 2, 1.0)
    assert core.load_read(ld, 2) == [ld]
    assert ld.outcome is LoadOutcome.FAILED and "device page 4" in (ld.reason or "")
    assert rig.backend.submitted == submitted and ld.host_pages == []
    core.abort(lc)
    rig.deliver()
    assert rig.host.used == 0


def test_take_pages_takes_exactly_free_pages_or_nothing() -> None:
    """PagePool.take_pages (what an owned-mode load holds): a page not free, out of range
    or named twice is a PageError with nothing taken; else exactly those pages."""
    pool = DevicePool.create(8, 4, (2,), "float32")
    held = pool.allocate(1)
    for bad in ([held[0]], [8], [-1], [1, 1]):
        with pytest.raises(kvo.PageError):
            pool.take_pages(bad)
        assert pool.used == 1
        pool.check()
    pool.take_pages([2, 5])
    pool.check()
    assert pool.used == 3 and pool.is_allocated(2) and pool.is_allocated(5)
    assert set(pool.allocate(5)).isdisjoint({2, 5, *held})
