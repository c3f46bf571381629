"""A small decode loop on the SimBackend: admit, extend, finish, abort, reuse ids.

Completions arrive out of order (a seeded shuffle), one request reuses the id of a
request that is still finishing, and one is aborted with a copy in flight. At the end
the ledger is checked and the statistics printed.
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
        for lc in live:
            if lc.state is not kvo.LifecycleState.FINISHING:
                lc.finish()
        backend.complete_all()
        await mgr.settle()
        mgr.check_invariants()
        stats = mgr.statistics()
    for name, value in stats.as_dict().items():
        print(f"{name:>22} {value}")
    return stats


if __name__ == "__main__":
    asyncio.run(main())
