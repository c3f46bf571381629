"""The core's batch delivery (``OffloadCore.complete``): it does per batch what need
not be done per completion, and must be indistinguishable from delivering the same
completions one at a time, with the ledger balanced wherever anything can read it (a
log line, a listener) and a host double free refused with nothing freed."""

from __future__ import annotations

from typing import Any

import pytest

import kvoffload as kvo
import kvoffload.core.chunks
from kvoffload.abc import Completion, Transfer
from kvoffload.core.offload import OffloadCore
from kvoffload.pools import DevicePool, HostPool

CONFIG = kvo.OffloadConfig(page_size=4, stride=4, device_pages=64, host_pages=64)


def make_core(
    storage: bool = False, config: kvo.OffloadConfig = CONFIG
) -> tuple[OffloadCore, list[Transfer]]:
    """A bare core whose copy jobs go to a list (nothing copies: the test delivers)."""
    jobs: list[Transfer] = []
    args = (config.page_size, config.kv_shape, config.dtype)
    core = OffloadCore(
        config,
        device_pool=DevicePool.create(config.device_pages, *args),
        host_pool=HostPool.create(config.host_pages, *args),
        accept=jobs.append,
        storage=storage,
    )
    return core, jobs


def ledger_balances(core: OffloadCore) -> None:
    """Rules 1, 3 and 6: the chunk and page ledgers, and the host pages they account for."""
    c = core.counters
    assert c.chunks_submitted == c.chunks_inflight + c.chunks_copied + c.chunks_discarded + c.chunks_failed
    assert c.pages_submitted == c.pages_inflight + c.pages_copied + c.pages_discarded + c.pages_failed
    assert c.pages_copied == c.pages_stored + c.pages_store_failed + c.pages_in_write + c.pages_not_stored
    assert len(core.inflight) == c.chunks_inflight
    host_inflight = sum(len(t.host_pages) for t in core.inflight.values())
    assert host_inflight == c.pages_inflight
    assert core.host_pool.used == host_inflight + sum(len(j.host_pages) for j in core.writes.values())


def mixed_batch(core: OffloadCore, jobs: list[Transfer]) -> tuple[list[Completion], list[kvo.Lifecycle]]:
    """Copied chunks around one that releases its lifecycle, one discarded (aborted)
    and one failed: every path of a delivery, in one batch."""
    lcs = [core.admit(f"r{i}", prompt=[]) for i in range(6)]
    for lc in lcs:
        lc.extend([1, 2, 3, 4])
    lcs[1].finish()  # its completion releases it
    lcs[2].abort()  # its completion is discarded
    lcs[4].extend([5, 6, 7, 8])  # two chunks in flight: the first completing keeps it OFFLOADING
    failed = next(t for t in jobs if t.lifecycle_id == lcs[3].id)
    batch: list[Completion] = [(t.id, RuntimeError("copy failed") if t is failed else None) for t in jobs]
    jobs.clear()
    return batch, lcs


def snapshot(core: OffloadCore, lcs: list[kvo.Lifecycle]) -> tuple[Any, ...]:
    stats = core.statistics().as_dict()
    return stats, [(lc.state, lc.outcome, lc.inflight) for lc in lcs], core.host_pool.used


@pytest.mark.parametrize("storage", [False, True])
@pytest.mark.parametrize("listener", [False, True])
def test_a_batch_is_delivered_as_one_completion_at_a_time(storage: bool, listener: bool) -> None:
    """One ``complete(batch)`` leaves the counters, states, outcomes and pools exactly
    as ``complete([c])`` per completion does, with and without a listener attached;
    with one, the ledger balances at every event it sees."""
    results = []
    for one_by_one in (False, True):
        core, jobs = make_core(storage)
        seen: list[str] = []
        unbalanced: list[str] = []
        if listener:

            def check(
                name: str,
                fields: dict[str, Any],
                core: OffloadCore = core,
                seen: list[str] = seen,
                unbalanced: list[str] = unbalanced,
            ) -> None:
                seen.append(name)
                try:
                    ledger_balances(core)
                except AssertionError as exc:  # a listener's error is logged, not raised
                    unbalanced.append(f"{name}: {exc}")

            core.listeners.append(check)
        batch, lcs = mixed_batch(core, jobs)
        if one_by_one:
            for c in batch:
                core.complete([c])
        else:
            core.complete(batch)
        del batch
        ledger_balances(core)
        core.check_invariants()
        results.append(snapshot(core, lcs))
        if listener:
            assert {"transfer.completed", "transfer.failed", "transfer.discarded"} <= set(seen)
            assert "lifecycle.released" in seen
            assert not unbalanced, unbalanced
    assert results[0] == results[1]
    stats = results[0][0]
    assert stats["chunks_copied"] == 5 and stats["chunks_discarded"] == 1 and stats["chunks_failed"] == 1


def test_the_ledger_balances_when_a_failure_is_logged(monkeypatch: pytest.MonkeyPatch) -> None:
    """Copied chunks held back by the batch loop reach the counters and the host pool
    before the failure's log line runs (a log processor may read the ledger)."""
    core, jobs = make_core()
    lcs = [core.admit(f"r{i}", prompt=[]) for i in range(3)]
    for lc in lcs:
        lc.extend([1, 2, 3, 4])
    ts = list(jobs)
    logged: list[str] = []

    class Spy:
        def warning(self, event: str, **fields: Any) -> None:
            ledger_balances(core)
            logged.append(event)

    monkeypatch.setattr(kvoffload.core.chunks, "logger", Spy())
    core.complete([(ts[0].id, None), (ts[1].id, None), (ts[2].id, RuntimeError("copy failed"))])
    assert logged == ["transfer.failed"]
    ledger_balances(core)
    core.check_invariants()


def test_a_host_double_free_in_a_batch_frees_nothing() -> None:
    """Two completions naming the same host page: PageError, and the host pool is as
    it was (no page of the batch returned, none returned twice)."""
    core, jobs = make_core()
    lcs = [core.admit(f"r{i}", prompt=[]) for i in range(2)]
    for lc in lcs:
        lc.extend([1, 2, 3, 4])
    ta, tb = jobs
    tb.host_pages = list(ta.host_pages)  # a backend bug: one host page for two copies
    used = core.host_pool.used
    with pytest.raises(kvo.PageError, match="freed but not allocated"):
        core.complete([(ta.id, None), (tb.id, None)])
    assert core.host_pool.used == used
    core.host_pool.check()


def test_a_completion_named_twice_or_unknown_stops_the_batch_with_the_ledger_consistent() -> None:
    """A batch naming a transfer that is not in flight (delivered before, or named
    twice) applies the completions before it, raises at it, and leaves the ledger
    consistent; the completions after it are still in flight and can be delivered."""
    core, jobs = make_core()
    lcs = [core.admit(f"r{i}", prompt=[]) for i in range(3)]
    for lc in lcs:
        lc.extend([1, 2, 3, 4])
    ta, tb, tc = jobs
    with pytest.raises(kvo.KVOffloadError, match="completed twice"):
        core.complete([(ta.id, None), (ta.id, None), (tb.id, None)])
    core.check_invariants()
    assert (lcs[0].inflight, lcs[1].inflight) == (0, 1) and core.counters.completions_delivered == 1
    core.complete([(tb.id, None), (tc.id, None)])
    with pytest.raises(kvo.KVOffloadError, match="completed twice"):
        core.complete([(tc.id, None)])
    core.check_invariants()
    assert core.counters.completions_delivered == 3


def test_completions_delivered_counts_deliveries_when_they_pump_deferred_chunks() -> None:
    """One completion returns two host pages, and two deferred chunks (on_host_full=
    "wait") go out from inside that delivery: completions_delivered is 1, not the change
    in copies in flight (-1, which check_invariants flagged as a negative counter)."""
    cfg = kvo.OffloadConfig(
        page_size=4, stride=4, device_pages=64, host_pages=2, on_host_full="wait", host_wait_s=30
    )
    core, jobs = make_core(config=cfg)
    a, b, c = (core.admit(r, prompt=[1, 2, 3, 4]) for r in "abc")
    a.extend(list(range(8)))  # both host pages
    b.extend([1, 2, 3, 4])
    c.extend([1, 2, 3, 4])
    assert b.deferred and c.deferred and len(core.inflight) == 1
    core.complete([(jobs[0].id, None)])
    assert len(core.inflight) == 2 and core.counters.completions_delivered == 1
    core.check_invariants()
