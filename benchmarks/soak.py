"""Soak: many requests through one manager on the SimBackend; the ledger must balance.

100,000 requests by default, 30% of them reusing a recent request id (often while the
earlier request with that id is still live), 5% aborted mid-decode, 1% of copies failed,
completions in random order and in random batches. At the end every count in the
ledger balances, no device or host page is leaked, every released lifecycle is
garbage, and memory after garbage collection is flat across the run (measured with
tracemalloc at checkpoints). Prints the figures; exits non-zero if a check fails.

    python benchmarks/soak.py [--requests 100000] [--seed 0] [--concurrency 64]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import random
import sys
import time
import tracemalloc
import weakref
from pathlib import Path
from typing import Any

import structlog

import kvoffload as kvo
from kvoffload.testing import SimBackend


def _released(ref: weakref.ReferenceType[kvo.Lifecycle]) -> bool:
    lc = ref()
    return lc is not None and lc.released


async def soak(requests: int, seed: int, concurrency: int) -> dict[str, Any]:
    rng = random.Random(seed)
    config = kvo.OffloadConfig(
        page_size=4, stride=16, device_pages=concurrency * 48, host_pages=concurrency * 4, drain_timeout_s=60
    )
    backend = SimBackend()
    checkpoints: list[tuple[int, int, int]] = []  # (requests admitted, traced bytes, live)
    sample: list[weakref.ReferenceType[kvo.Lifecycle]] = []
    reused = aborted = refused = sampled = sampled_alive = 0
    recent: list[str] = []
    every = max(requests // 10, 1)
    async with kvo.OffloadManager(config, backend=backend) as mgr:
        # live: request -> (lifecycle, target length); the caller's only references.
        live: dict[int, tuple[kvo.Lifecycle, int, bool]] = {}
        admitted = 0
        next_rid = 0
        while admitted < requests or live:
            while admitted < requests and len(live) < concurrency:
                if recent and rng.random() < 0.30:
                    rid = rng.choice(recent)
                    reused += 1
                else:
                    rid = f"req-{next_rid}"
                    next_rid += 1
                    recent.append(rid)
                    if len(recent) > 2 * concurrency:
                        recent.pop(0)
                prompt = [rng.randrange(32000) for _ in range(rng.randrange(1, 40))]
                try:
                    lc = mgr.admit(rid, prompt)
                except kvo.PoolExhausted:
                    refused += 1
                    break
                live[admitted] = (lc, len(prompt) + rng.randrange(8, 160), rng.random() < 0.05)
                if admitted % 97 == 0:
                    sample.append(weakref.ref(lc))
                admitted += 1
                if admitted % every == 0:
                    await mgr.settle()
                    gc.collect()
                    # A released lifecycle the driver no longer holds must be garbage.
                    sampled += len(sample)
                    sampled_alive += sum(_released(r) for r in sample)
                    sample.clear()  # (so the sample itself does not grow the heap)
                    checkpoints.append((admitted, tracemalloc.get_traced_memory()[0], len(mgr)))
            for key in list(live):
                lc, target, abort = live[key]
                if lc.state not in (kvo.LifecycleState.PENDING, kvo.LifecycleState.OFFLOADING):
                    continue
                done = len(lc.device_pages) * config.page_size >= target
                if abort and (done or rng.random() < 0.1):  # aborted mid-decode
                    lc.abort()
                    aborted += 1
                    del live[key]
                    continue
                if done:
                    lc.finish()
                    del live[key]
                    continue
                try:
                    lc.extend([rng.randrange(32000) for _ in range(rng.randrange(1, 9))])
                except kvo.PoolExhausted:
                    lc.abort()
                    aborted += 1
                    del live[key]
            lc = None  # the driver keeps no lifecycle it is done with
            pending = backend.pending
            for _ in range(rng.randrange(0, len(pending) + 1)):
                t = pending[rng.randrange(len(pending))]
                if rng.random() < 0.01:
                    backend.fail(t)
                else:
                    backend.complete(t)
            del pending
            await mgr.settle()
        backend.complete_all()
        await mgr.wait_drained()
        await mgr.settle()
        mgr.check_invariants()
        stats = mgr.statistics()
    gc.collect()
    return {
        "stats": stats,
        "checkpoints": checkpoints,
        "reused": reused,
        "aborted_by_driver": aborted,
        "admission_refused": refused,
        "sampled_alive": sampled_alive + sum(r() is not None for r in sample),
        "sampled": sampled + len(sample),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=100_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--concurrency", type=int, default=64)
    args = ap.parse_args(argv)
    if str(Path(__file__).resolve().parent) not in sys.path:  # loaded by path (tests/property)
        sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _machine import describe, spread, verdict

    print(describe())
    # An application configures logging: warnings only (kvoffload's debug events are
    # then never built), as a serving process would run.
    wrapper = structlog.get_config()["wrapper_class"]
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    tracemalloc.start()
    try:
        t0 = time.perf_counter()
        out = asyncio.run(soak(args.requests, args.seed, args.concurrency))
        elapsed = time.perf_counter() - t0
    finally:
        tracemalloc.stop()
        structlog.configure(wrapper_class=wrapper)
    s: kvo.Statistics = out["stats"]
    released = s.released_completed + s.released_aborted + s.released_failed
    checks = {
        "admitted == released (nothing live)": s.admitted == released and s.live_lifecycles == 0,
        "chunks: submitted == copied + discarded + failed": s.chunks_submitted
        == s.chunks_copied + s.chunks_discarded + s.chunks_failed
        and s.chunks_inflight == 0,
        "pages: submitted == copied + discarded + failed": s.pages_submitted
        == s.pages_copied + s.pages_discarded + s.pages_failed
        and s.pages_inflight == 0,
        "pages copied == not stored (no storage tier)": s.pages_copied == s.pages_not_stored,
        "no device page leaked": s.device_pages_used == 0,
        "no host page leaked": s.host_pages_used == 0,
        "every sampled released lifecycle is garbage": out["sampled_alive"] == 0,
    }
    cps = out["checkpoints"]
    base = cps[1][1] if len(cps) > 1 else cps[0][1]
    growths = [b - base for _, b, _ in cps[1:]]
    growth = max(growths) if growths else 0
    checks["memory after GC flat (growth after warm-up < 512 KiB)"] = growth < 512 * 1024
    print(
        f"soak: {args.requests} requests, seed {args.seed}, concurrency {args.concurrency}, {elapsed:.1f} s"
    )
    print(
        f"  requests reusing a recent id: {out['reused']} ({out['reused'] / max(s.admitted, 1):.1%}); "
        f"aborted: {s.released_aborted} ({s.released_aborted / max(s.admitted, 1):.1%}); "
        f"admissions refused (device pool full, retried): {out['admission_refused']}"
    )
    print(
        f"  lifecycles: admitted {s.admitted} = completed {s.released_completed} + aborted "
        f"{s.released_aborted} + failed {s.released_failed} + live {s.live_lifecycles}"
    )
    print(
        f"  chunks: submitted {s.chunks_submitted} = copied {s.chunks_copied} + discarded "
        f"{s.chunks_discarded} + failed {s.chunks_failed} + in flight {s.chunks_inflight}; "
        f"dropped (host full) {s.chunks_dropped}"
    )
    print(
        f"  pages: submitted {s.pages_submitted} = copied {s.pages_copied} + discarded "
        f"{s.pages_discarded} + failed {s.pages_failed} + in flight {s.pages_inflight}; "
        f"copy failure rate {s.chunks_failed / max(s.chunks_submitted, 1):.2%}"
    )
    print(f"  pools at the end: device {s.device_pages_used} used, host {s.host_pages_used} used")
    print(f"  sampled released lifecycles still alive: {out['sampled_alive']} of {out['sampled']}")
    print("  traced memory after gc.collect() (requests admitted: KiB, live lifecycles):")
    print("    " + ", ".join(f"{n}: {b / 1024:.0f} ({live})" for n, b, live in cps))
    print(
        f"  growth after the first checkpoint: {growth / 1024:.1f} KiB (target < 512 KiB: "
        f"{verdict(growth < 512 * 1024)}; checkpoints: {spread([g / 1024 for g in growths], '.1f')} KiB)"
    )
    for name, ok in checks.items():
        print(f"  [{verdict(ok)}] {name}")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
