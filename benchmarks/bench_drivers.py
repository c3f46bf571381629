"""The drivers' own cost, measured side by side in one run (issue 9).

1. Per request-step: 512 lifecycles decode one token each per step; after each step
   the driver gets its turn - ``poll()`` for the sync driver, two event-loop turns for
   the asyncio one (its launch callback, then its delivery callback). A backend that
   completes every copy the moment it is launched (no bytes) makes each stride's chunks
   complete within the step that submitted them. The two drivers alternate within
   every round; the ratio is the median of per-round ratios.
2. ``poll()`` with nothing ready (cpu backend; with no store and with a file store),
   against the way a sync engine drove v0.1: a private event loop held open with the
   manager in a task, polled with ``runner.run(mgr.settle())``. Interleaved likewise.

Targets: sync per request-step <= 1.1x the asyncio driver's; ``poll()`` with nothing
ready <= 2 µs and <= 1/20 of the ``runner.run(settle())`` round trip.
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
import time
from typing import Any

from _machine import describe, spread, verdict

import kvoffload as kvo
from kvoffload.testing import ManagerHost, SimBackend

N = 512
PAGE = 16
STRIDE = 64
ROUNDS = 9
POLLS = 20_000
SETTLES = 2_000


def cfg() -> kvo.OffloadConfig:
    return kvo.OffloadConfig(
        page_size=PAGE,
        stride=STRIDE,
        device_pages=N * 4 * (ROUNDS + 2),
        host_pages=N * 8,
        kv_shape=(1,),
        dtype="uint8",
    )


class InstantBackend(SimBackend):
    """Completes every copy the moment it is launched, moving no bytes."""

    def launch(self) -> None:
        if self.pending:
            pending, self.pending = self.pending, []
            self.inbox.post([(t.id, None) for t in pending])


def _stride_sync(mgr: kvo.SyncOffloadManager, lcs: list[kvo.Lifecycle]) -> float:
    tok = [7]
    t0 = time.perf_counter()
    for _ in range(STRIDE // 1):
        for lc in lcs:
            lc.extend(tok)
        mgr.poll()
    return (time.perf_counter() - t0) / (N * STRIDE)


async def _stride_async(lcs: list[kvo.Lifecycle]) -> float:
    tok = [7]
    t0 = time.perf_counter()
    for _ in range(STRIDE):
        for lc in lcs:
            lc.extend(tok)
        await asyncio.sleep(0)  # the launch callback
        await asyncio.sleep(0)  # the delivery callback
    return (time.perf_counter() - t0) / (N * STRIDE)


async def per_request_step() -> tuple[float, float, list[float]]:
    """(sync µs, asyncio µs, the per-round ratios sync/asyncio)."""
    smgr = kvo.SyncOffloadManager(cfg(), backend=InstantBackend()).open()
    async with kvo.OffloadManager(cfg(), backend=InstantBackend()) as amgr:
        slcs = [smgr.admit(f"s{i}", list(range(PAGE))) for i in range(N)]
        alcs = [amgr.admit(f"a{i}", list(range(PAGE))) for i in range(N)]
        _stride_sync(smgr, slcs)  # warm-up
        await _stride_async(alcs)
        rows: list[tuple[float, float]] = []
        for r in range(ROUNDS):
            if r % 2:
                a = await _stride_async(alcs)
                s = _stride_sync(smgr, slcs)
            else:
                s = _stride_sync(smgr, slcs)
                a = await _stride_async(alcs)
            rows.append((s, a))
        assert smgr.statistics().chunks_copied == amgr.statistics().chunks_copied > 0
        for lc in alcs:
            lc.abort()
        await amgr.settle()
    for lc in slcs:
        lc.abort()
    smgr.close()
    return (
        statistics.median(s for s, _ in rows),
        statistics.median(a for _, a in rows),
        [s / a for s, a in rows],
    )


def _time_polls(mgr: kvo.SyncOffloadManager) -> float:
    poll = mgr.poll
    t0 = time.perf_counter()
    for _ in range(POLLS):
        poll()
    return (time.perf_counter() - t0) / POLLS


def _time_settles(host: ManagerHost) -> float:
    mgr = host.mgr
    runner = host._runner
    assert runner is not None
    t0 = time.perf_counter()
    for _ in range(SETTLES):
        runner.run(mgr.settle())
    return (time.perf_counter() - t0) / SETTLES


def idle_poll(storage: Any) -> tuple[list[float], float, list[float]]:
    """(poll seconds per round, runner.run(settle()) µs, the per-round ratios) with
    nothing ready."""
    config = kvo.OffloadConfig(page_size=PAGE, stride=STRIDE, device_pages=64, host_pages=64)
    smgr = kvo.SyncOffloadManager(config, backend="cpu", storage=storage()).open()
    host = ManagerHost(kvo.OffloadManager(config, backend="cpu", storage=storage()))
    try:
        _time_polls(smgr), _time_settles(host)  # warm-up
        rows = []
        for r in range(ROUNDS):
            if r % 2:
                b = _time_settles(host)
                a = _time_polls(smgr)
            else:
                a = _time_polls(smgr)
                b = _time_settles(host)
            rows.append((a, b))
    finally:
        smgr.close()
        host.close()
    return (
        [a for a, _ in rows],
        statistics.median(b for _, b in rows),
        [a / b for a, b in rows],
    )


def main() -> int:
    import platform

    py = platform.python_version()
    print(describe())
    print(f"drivers, python {py}, {ROUNDS} rounds interleaved; ratios: median of per-round")
    s, a, ratios = asyncio.run(per_request_step())
    ratio = statistics.median(ratios)
    ok1 = ratio <= 1.1
    print(f"per request-step ({N} lifecycles, one token a step, stride {STRIDE}, copies complete at launch)")
    print(f"  sync driver (extend + poll)            {s * 1e6:8.3f} µs")
    print(f"  asyncio driver (extend + loop turns)   {a * 1e6:8.3f} µs")
    print(
        f"  sync / asyncio                          {ratio:8.2f}x   (target <= 1.10x: {verdict(ok1)}; "
        f"{spread(ratios)})"
    )
    ok = ok1
    with tempfile.TemporaryDirectory(prefix="kvoffload-bench-") as tmp:
        stores = {"no store": lambda: None, "file store": lambda: tmp}
        for name, storage in stores.items():
            ps, r, qs = idle_poll(storage)
            p, q = statistics.median(ps), statistics.median(qs)
            okp = p <= 2e-6 and q <= 1 / 20
            ok = ok and okp
            print(f"poll() with nothing ready, cpu backend, {name}")
            print(
                f"  poll()                                  {p * 1e6:8.3f} µs   "
                f"(target <= 2 µs: {verdict(p <= 2e-6)}; {spread([x * 1e6 for x in ps], '.3f')} µs)"
            )
            print(f"  runner.run(mgr.settle()) (v0.1's way)   {r * 1e6:8.3f} µs")
            print(
                f"  poll / runner.run(settle)               {q:8.4f}    "
                f"(targets: <= 2 µs and <= 0.05: {verdict(okp)}; {spread(qs, '.4f')})"
            )
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
