"""A small decode loop on the SimBackend: admit, extend, finish, abort, reuse ids.

A seeded random loop admits requests under repeating ids, decodes, finishes or aborts
some, and completes half the copies in flight after each step, in shuffled order.
Then the two cases kvoffload exists for, spelled out: a request id reused while its
predecessor is still FINISHING with a copy in flight, and a request aborted with a copy
in flight. At the end every copy completes, the ledger is checked and the statistics
printed.
"""

from __future__ import annotations

import asyncio
import random

import kvoffload as kvo
from kvoffload.testing import SimBackend


async def main(requests: int = 24, seed: int = 0) -> kvo.Statistics:
    rng = random.Random(seed)
    config = kvo.OffloadConfig(page_size=4, stride=8, device_pages=512, host_pages=32)
    backend = SimBackend()
    async with kvo.OffloadManager(config, backend=backend) as mgr:
        live: list[kvo.Lifecycle] = []
        for i in range(requests):
            rid = f"req-{i % 16}"  # ids repeat: later requests reuse earlier ids
            prompt = [rng.randrange(32000) for _ in range(rng.randrange(4, 24))]
            live.append(mgr.admit(rid, prompt))
            for lc in live:  # one decode step for every running request
                if lc.state in (kvo.LifecycleState.PENDING, kvo.LifecycleState.OFFLOADING):
                    lc.extend([rng.randrange(32000) for _ in range(rng.randrange(1, 6))])
            if rng.random() < 0.3 and live:
                victim = rng.choice(live)
                if victim.state is not kvo.LifecycleState.FINISHING and not victim.released:
                    victim.finish() if rng.random() < 0.8 else victim.abort()
            pending = list(backend.pending)
            rng.shuffle(pending)  # completions in any order
            for t in pending[: len(pending) // 2]:
                backend.complete(t)
            await mgr.settle()
            mgr.check_invariants()
            live = [lc for lc in live if not lc.released]
        # A reused id: the old request's copy is still in flight when the new one comes.
        old = mgr.admit("req-reused", [1, 2, 3, 4])
        old.extend(list(range(8)))  # a stride is due: one chunk goes out
        old.finish()  # FINISHING until that copy completes
        new = mgr.admit("req-reused", [1, 2, 3, 4])  # a separate lifecycle, same id
        assert mgr.lifecycles("req-reused") == [old, new]
        # An abort with a copy in flight: the copy is discarded when it completes.
        doomed = mgr.admit("req-aborted", [5, 6, 7, 8])
        doomed.extend(list(range(8)))
        assert doomed.inflight == 1
        doomed.abort()  # FINISHING until its copy completes, then RELEASED (aborted)
        live += [old, new, doomed]
        for lc in live:
            if lc.state is not kvo.LifecycleState.FINISHING:
                lc.finish()
        backend.complete_all()
        await mgr.settle()
        mgr.check_invariants()
        assert old.released and new.released and doomed.outcome is kvo.Outcome.ABORTED
        stats = mgr.statistics()
    for name, value in stats.as_dict().items():
        print(f"{name:>22} {value}")
    return stats


if __name__ == "__main__":
    asyncio.run(main())
