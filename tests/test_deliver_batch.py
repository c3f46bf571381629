"""The delivery task's batch loop (``OffloadManager._deliver_batch``): it does per batch
what need not be done per completion, and must be indistinguishable from delivering
the same completions one at a time, with the ledger balanced wherever anything can
read it (a log line, a listener) and a host double free refused with nothing freed."""

from __future__ import annotations

from typing import Any

import pytest

import kvoffload as kvo
import kvoffload._flow
from kvoffload.abc import Completion, Transfer
from kvoffload.testing import SimBackend

CONFIG = kvo.OffloadConfig(page_size=4, stride=4, device_pages=64, host_pages=64)


def ledger_balances(mgr: kvo.OffloadManager) -> None:
    """Rules 1, 3 and 6: the chunk and page ledgers, and the host pages they account for."""
    c = mgr.counters
    assert c.chunks_submitted == c.chunks_inflight + c.chunks_copied + c.chunks_discarded + c.chunks_failed
    assert c.pages_submitted == c.pages_inflight + c.pages_copied + c.pages_discarded + c.pages_failed
    assert c.pages_copied == c.pages_stored + c.pages_store_failed + c.pages_in_write + c.pages_not_stored
    assert len(mgr._inflight) == c.chunks_inflight
    host_inflight = sum(len(t.host_pages) for t in mgr._inflight.values())
    assert host_inflight == c.pages_inflight
    assert mgr.host_pool.used == host_inflight + sum(len(t.host_pages) for t in mgr._writes)


def take(backend: SimBackend) -> list[Transfer]:
    """The pending transfers, signalled without moving bytes (as the benchmark does)."""
    pending = list(backend.pending)
    backend.pending.clear()
    backend._signalled += len(pending)
    return pending


def mixed_batch(mgr: kvo.OffloadManager, backend: SimBackend) -> tuple[list[Completion], list[kvo.Lifecycle]]:
    """Copied chunks around one that releases its lifecycle, one discarded (aborted)
    and one failed: every path of a delivery, in one batch."""
    lcs = [mgr.admit(f"r{i}", prompt=[]) for i in range(6)]
    for lc in lcs:
        lc.extend([1, 2, 3, 4])
    lcs[1].finish()  # its completion releases it
    lcs[2].abort()  # its completion is discarded
    lcs[4].extend([5, 6, 7, 8])  # two chunks in flight: the first completing keeps it OFFLOADING
    ts = take(backend)
    failed = next(t for t in ts if t.lifecycle is lcs[3])
    batch: list[Completion] = [(t, RuntimeError("copy failed") if t is failed else None) for t in ts]
    return batch, lcs


def snapshot(mgr: kvo.OffloadManager, lcs: list[kvo.Lifecycle]) -> tuple[Any, ...]:
    stats = mgr.statistics().as_dict()
    return stats, [(lc.state, lc.outcome, lc.inflight) for lc in lcs], mgr.host_pool.used


@pytest.mark.asyncio
@pytest.mark.parametrize("storage", [None, "memory"])
@pytest.mark.parametrize("listener", [False, True])
async def test_a_batch_is_delivered_as_one_completion_at_a_time(storage: str | None, listener: bool) -> None:
    """The batch loop leaves the counters, states, outcomes and pools exactly as
    ``_deliver`` called per completion does, with and without a listener attached;
    with one, the ledger balances at every event it sees."""
    results = []
    for one_by_one in (False, True):
        backend = SimBackend()
        async with kvo.OffloadManager(CONFIG, backend=backend, storage=storage) as mgr:
            seen: list[str] = []
            unbalanced: list[str] = []
            if listener:

                def check(
                    name: str,
                    fields: dict[str, Any],
                    mgr: kvo.OffloadManager = mgr,
                    seen: list[str] = seen,
                    unbalanced: list[str] = unbalanced,
                ) -> None:
                    seen.append(name)
                    try:
                        ledger_balances(mgr)
                    except AssertionError as exc:  # a listener's error is logged, not raised
                        unbalanced.append(f"{name}: {exc}")

                mgr.add_listener(check)
            batch, lcs = mixed_batch(mgr, backend)
            if one_by_one:
                for t, err in batch:
                    mgr._deliver(t, err)
                mgr._delivered += len(batch)  # what the delivery task counts after a batch
            else:
                mgr._deliver_batch(batch)
            del batch
            ledger_balances(mgr)
            mgr.check_invariants()
            results.append(snapshot(mgr, lcs))
            if listener:
                assert {"transfer.completed", "transfer.failed", "transfer.discarded"} <= set(seen)
                assert "lifecycle.released" in seen
                assert not unbalanced, unbalanced
            for lc in lcs:
                if not lc.released:
                    lc.abort()
            backend.complete_all()
            await mgr.settle()
    assert results[0] == results[1]
    stats = results[0][0]
    assert stats["chunks_copied"] == 5 and stats["chunks_discarded"] == 1 and stats["chunks_failed"] == 1


@pytest.mark.asyncio
async def test_the_ledger_balances_when_a_failure_is_logged(monkeypatch: pytest.MonkeyPatch) -> None:
    """Copied chunks held back by the batch loop reach the counters and the host pool
    before the failure's log line runs (a log processor may read the ledger)."""
    backend = SimBackend()
    async with kvo.OffloadManager(CONFIG, backend=backend) as mgr:
        lcs = [mgr.admit(f"r{i}", prompt=[]) for i in range(3)]
        for lc in lcs:
            lc.extend([1, 2, 3, 4])
        ts = take(backend)
        logged: list[str] = []

        class Spy:
            def warning(self, event: str, **fields: Any) -> None:
                ledger_balances(mgr)
                logged.append(event)

        monkeypatch.setattr(kvoffload._flow, "logger", Spy())
        mgr._deliver_batch([(ts[0], None), (ts[1], None), (ts[2], RuntimeError("copy failed"))])
        assert logged == ["transfer.failed"]
        ledger_balances(mgr)
        mgr.check_invariants()
        for lc in lcs:
            lc.abort()


@pytest.mark.asyncio
async def test_a_host_double_free_in_a_batch_frees_nothing() -> None:
    """Two completions naming the same host page: PageError, and the host pool is as
    it was (no page of the batch returned, none returned twice)."""
    backend = SimBackend()
    async with kvo.OffloadManager(CONFIG, backend=backend) as mgr:
        lcs = [mgr.admit(f"r{i}", prompt=[]) for i in range(2)]
        for lc in lcs:
            lc.extend([1, 2, 3, 4])
        ta, tb = take(backend)
        tb.host_pages = list(ta.host_pages)  # a backend bug: one host page for two copies
        used = mgr.host_pool.used
        with pytest.raises(kvo.PageError, match="freed but not allocated"):
            mgr._deliver_batch([(ta, None), (tb, None)])
        assert mgr.host_pool.used == used
        mgr.host_pool.check()
        for lc in lcs:
            lc.abort()
