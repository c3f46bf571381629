"""The core's meters (kvoffload.core.meters) as the series show them: the load path's
legs, a failed store write, the release delay, a scrape while the owner thread runs."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import pytest

pytest.importorskip("prometheus_client")

from _prom import scrape, value
from prometheus_client import CollectorRegistry
from support import HANG_S, FakeClock, small_config, toks

import kvoffload as kvo
from kvoffload import metrics
from kvoffload.core.offload import OffloadCore
from kvoffload.errors import StorageError
from kvoffload.pools import DevicePool, HostPool
from kvoffload.storage.memory import MemoryStorage
from kvoffload.storage.writer import WritePolicy
from kvoffload.testing import SimBackend

TOKENS = toks(0, 16)  # four pages of 4 tokens


def drive(mgr: kvo.SyncOffloadManager, backend: SimBackend, until: Callable[[], bool]) -> None:
    """poll (completing the sim's copies) until ``until()``, within HANG_S."""
    end = time.monotonic() + HANG_S
    while not until():
        assert time.monotonic() < end, "no progress within HANG_S"
        backend.launch()
        backend.complete_all()
        mgr.poll()
        if not until():
            mgr.wait_progress(0.01)


def offload(mgr: kvo.SyncOffloadManager, backend: SimBackend) -> None:
    lc = mgr.admit("src", TOKENS, stored=0)
    lc.finish()
    drive(mgr, backend, lambda: lc.released and not mgr.writes_pending)


def test_a_load_round_trip_meters_s2h_and_h2d() -> None:
    """Four pages offloaded, then loaded back: one store read of 4 pages (s2h, a read
    hit) and one host->device copy of 4 pages (h2d), a loaded load, nothing live."""
    backend = SimBackend()
    reg = CollectorRegistry()
    with kvo.SyncOffloadManager(small_config(), backend=backend, storage=MemoryStorage()) as mgr:
        metrics.register(mgr, reg)
        offload(mgr, backend)
        ld = mgr.load(TOKENS, [20, 21, 22, 23])
        drive(mgr, backend, lambda: ld.done)
        assert ld.outcome is kvo.LoadOutcome.LOADED
        s = scrape(reg)
        pb = mgr.page_bytes
        for leg in ("d2h", "h2s", "s2h", "h2d"):
            assert value(s, "kvoffload_pages_total", direction=leg) == 4, leg
            assert value(s, "kvoffload_transfer_bytes_total", direction=leg) == 4 * pb, leg
        assert value(s, "kvoffload_transfer_size_bytes_count", direction="s2h") == 1
        assert value(s, "kvoffload_transfer_size_bytes_sum", direction="h2d") == 4 * pb
        assert value(s, "kvoffload_transfer_duration_seconds_count", direction="h2d") == 1
        assert value(s, "kvoffload_store_operations_total", backend="memory", op="read", outcome="hit") == 1
        assert value(s, "kvoffload_loads_total", outcome="loaded") == 1
        assert value(s, "kvoffload_load_lifecycles") == 0
        assert not mgr.core.meters.reading and not mgr.core.meters.writing


def test_a_load_of_nothing_stored_is_a_read_miss() -> None:
    """A load whose first page is not in the store: a read miss, no s2h pages."""
    backend = SimBackend()
    reg = CollectorRegistry()
    with kvo.SyncOffloadManager(small_config(), backend=backend, storage=MemoryStorage()) as mgr:
        metrics.register(mgr, reg)
        ld = mgr.load(TOKENS, [20, 21, 22, 23])
        drive(mgr, backend, lambda: ld.done)
        s = scrape(reg)
        assert value(s, "kvoffload_store_operations_total", backend="memory", op="read", outcome="miss") == 1
        assert value(s, "kvoffload_pages_total", direction="s2h") == 0
        assert value(s, "kvoffload_loads_total", outcome="missed") == 1
        assert not mgr.core.meters.reading


def test_a_load_with_no_host_pages_leaves_no_read_open() -> None:
    """A host pool too full to read into ends the load at once (MISSED): the meters keep
    no start time for a read that never runs."""
    backend = SimBackend()
    cfg = small_config(host_pages=2)
    with kvo.SyncOffloadManager(cfg, backend=backend, storage=MemoryStorage()) as mgr:
        ld = mgr.load(TOKENS, [20, 21, 22, 23])
        assert ld.done and not mgr.core.meters.reading


class FailingStore(MemoryStorage):
    async def put(self, keys: Sequence[str], pages: Sequence[bytes]) -> None:
        raise StorageError("the store is down")


def test_a_failed_write_is_a_store_error() -> None:
    """Every write fails (after its retries): the pages are dropped for store_error,
    each job a failed write operation; no h2s pages, no h2s duration."""
    backend = SimBackend()
    reg = CollectorRegistry()
    policy = WritePolicy(attempts=2, backoff_s=0.0, backoff_max_s=0.0)
    store = FailingStore()
    with kvo.SyncOffloadManager(small_config(), backend=backend, storage=store, write_policy=policy) as mgr:
        metrics.register(mgr, reg)
        offload(mgr, backend)
        st = mgr.statistics()
        s = scrape(reg)
        assert st.pages_store_failed > 0
        assert value(s, "kvoffload_pages_dropped_total", reason="store_error") == st.pages_store_failed
        failed = value(s, "kvoffload_store_operations_total", backend="memory", op="write", outcome="failed")
        assert failed >= 1
        assert value(s, "kvoffload_pages_total", direction="h2s") == 0
        assert value(s, "kvoffload_transfer_duration_seconds_count", direction="h2s") == 0


def _core(clock: FakeClock) -> tuple[OffloadCore, list[Any]]:
    device = DevicePool.create(64, 4, (1,), "float32")
    host = HostPool.new(64, (4, 1), "float32")
    jobs: list[Any] = []
    cfg = small_config(offload_prompt=True)
    core = OffloadCore(
        cfg, device_pool=device, host_pool=host, accept=jobs.append, clock=clock, page_bytes=16
    )
    return core, jobs


def test_release_delay_is_finish_to_released_on_the_cores_clock() -> None:
    """finish() with a copy in flight, its completion 2.5 s later: one release delay of
    2.5 s (le=5 bucket, not le=1); a request released at its finish adds a 0. The copy's
    own duration (submitted 1 s before the finish) is 3.5 s."""
    clock = FakeClock()
    core, jobs = _core(clock)
    reg = CollectorRegistry()
    metrics.register(core, reg)
    lc = core.admit("a", toks(0, 8))  # its two pages go out at once
    clock.advance(1.0)
    core.finish(lc)
    clock.advance(2.5)
    core.complete([(jobs[0].id, None)])
    assert lc.released
    other = core.admit("b", toks(0, 3))  # no whole page: nothing in flight
    core.finish(other)
    s = scrape(reg)
    assert value(s, "kvoffload_release_delay_seconds_count") == 2
    assert value(s, "kvoffload_release_delay_seconds_sum") == pytest.approx(2.5)
    assert value(s, "kvoffload_release_delay_seconds_bucket", le="1.0") == 1  # (the 0)
    assert value(s, "kvoffload_release_delay_seconds_bucket", le="5.0") == 2
    assert value(s, "kvoffload_transfer_duration_seconds_sum", direction="d2h") == pytest.approx(3.5)
    assert value(s, "kvoffload_lifecycle_transitions_total", **{"from": "finishing", "to": "released"}) == 1
    assert value(s, "kvoffload_lifecycle_transitions_total", **{"from": "pending", "to": "released"}) == 1


def test_oldest_inflight_age_follows_the_clock() -> None:
    """The oldest copy in flight's age is read at scrape time from the core's clock."""
    clock = FakeClock()
    core, jobs = _core(clock)
    reg = CollectorRegistry()
    metrics.register(core, reg)
    core.admit("a", toks(0, 8))
    clock.advance(7.0)
    core.admit("b", toks(100, 108))
    clock.advance(1.0)
    assert value(scrape(reg), "kvoffload_oldest_inflight_age_seconds") == pytest.approx(8.0)
    core.complete([(jobs[0].id, None)])
    assert value(scrape(reg), "kvoffload_oldest_inflight_age_seconds") == pytest.approx(1.0)


def test_scraping_from_another_thread_while_the_owner_runs() -> None:
    """A scraper thread scrapes while the owner thread decodes (as a Prometheus does):
    no scrape raises, and every counter it reads only ever grows."""
    backend = SimBackend()
    reg = CollectorRegistry()
    errors: list[BaseException] = []
    seen: list[float] = []
    stop = threading.Event()

    def scraper() -> None:
        try:
            while not stop.is_set():
                seen.append(value(scrape(reg), "kvoffload_pages_total", direction="d2h"))
        except BaseException as exc:  # reported below
            errors.append(exc)

    with kvo.SyncOffloadManager(small_config(host_pages=256, device_pages=1024), backend=backend) as mgr:
        metrics.register(mgr, reg)
        thread = threading.Thread(target=scraper)
        thread.start()
        try:
            lcs = [mgr.admit(f"r{i}", toks(0, 8)) for i in range(16)]
            for t in range(8, 200):
                for lc in lcs:
                    lc.extend([t])
                backend.complete_all()
                mgr.poll()
                if t % 50 == 0:  # (let the scraper in, whatever the machine's speed)
                    n = len(seen)
                    end = time.monotonic() + HANG_S
                    while len(seen) == n and not errors and time.monotonic() < end:
                        mgr.wait_progress(0.01)
            for lc in lcs:
                lc.abort()
            drive(mgr, backend, lambda: not mgr.core.busy)
        finally:
            stop.set()
            thread.join(timeout=HANG_S)
    assert not errors, errors
    assert len(seen) >= 3 and seen == sorted(seen)
