"""What each rank runs in the tests of polls that skip the collective (F25,
kvoffload.drivers.distributed "Polls that skip"): imported by name in the spawned rank
processes."""

from __future__ import annotations

import random
from typing import Any

import kvoffload as kvo
from kvoffload._testing.ranks import RankContext
from kvoffload.drivers import distributed
from kvoffload.testing import SimBackend

#: A decode loop with quiet stretches: (step, op) ops every rank makes alike.
STEPS = 120


def _config() -> kvo.OffloadConfig:
    return kvo.OffloadConfig(
        page_size=4, stride=4, device_pages=512, host_pages=64, drain_timeout_s=10, tp_timeout_s=30
    )


def decode_with_quiet_stretches(
    ctx: RankContext, seed: int, skips: int | None, full_every: int | None = None
) -> dict[str, Any]:
    """Play one schedule (the same on every rank, from ``seed``): requests arrive,
    decode, go quiet for stretches of steps, finish; each rank's copies finish at
    rank-specific random steps. ``skips``: ``IDLE_SKIPS`` on this rank (None: as
    shipped; 0: never skip); ``full_every``: ``FULL_EVERY`` (None: as shipped; 1: every
    call takes the full exchange). Returns, per poll, whether it skipped, what it
    delivered and which lifecycles it released; the skipped total; the calls the compact
    exchange decided alone."""
    distributed.IDLE_SKIPS = 8 if skips is None else skips  # (the pool's processes are reused)
    distributed.FULL_EVERY = 64 if full_every is None else full_every
    shared = random.Random(seed)
    local = random.Random(f"{seed}/{ctx.rank}")
    backend = SimBackend()
    released: list[kvo.Lifecycle] = []
    mgr = kvo.SyncOffloadManager(_config(), backend=backend, group=ctx.group, on_released=released.append)
    mgr.open()
    tp = mgr._tp
    assert tp is not None
    lcs: list[kvo.Lifecycle] = []
    done: set[int] = set()  # lifecycles finished (by id)
    polls: list[list[Any]] = []
    quiet = 0
    try:
        for step in range(STEPS):
            if quiet:
                quiet -= 1
            else:
                roll = shared.random()
                if roll < 0.15:
                    quiet = shared.randint(3, 25)  # a stretch with no call at all
                elif roll < 0.35 or not lcs:
                    lcs.append(mgr.admit(f"r{step}", list(range(shared.randint(1, 6)))))
                else:
                    live = [lc for lc in lcs if lc.id not in done]
                    if live:
                        lc = live[shared.randrange(len(live))]
                        if shared.random() < 0.2:
                            lc.finish()
                            done.add(lc.id)
                        else:
                            lc.extend(list(range(shared.randint(1, 8))))
            pending = list(backend.pending)  # this rank's copy engine: its own pace
            local.shuffle(pending)
            for t in pending[: local.randint(0, len(pending))]:
                backend.complete(t)
            before = tp.polls_skipped
            released.clear()
            n = mgr.poll()
            polls.append([tp.polls_skipped - before, n, sorted(lc.id for lc in released)])
        for lc in lcs:
            if lc.id not in done:
                lc.finish()
        backend.complete_all()
        mgr.quiesce(30)
    finally:
        mgr.close()
    return {"polls": polls, "skipped": tp.polls_skipped, "compact": tp.compact_agreed, "calls": tp.calls}


def one_rank_never_skips(ctx: RankContext) -> dict[str, Any]:
    """Rank 1 never skips (``IDLE_SKIPS`` 0 there: a schedule computed differently),
    rank 0 skips as shipped; both poll with nothing to agree on. Returns the poll
    (1-based) at which this rank raised, and what."""
    distributed.IDLE_SKIPS = 0 if ctx.rank == 1 else 8
    mgr = kvo.SyncOffloadManager(_config(), backend=SimBackend(), group=ctx.group)
    mgr.open()
    out: dict[str, Any] = {"raised_at": None, "error": ""}
    try:
        for i in range(1, 4 * (distributed.IDLE_SKIPS + 2)):
            try:
                mgr.poll()
            except (kvo.RanksDiverged, kvo.RankTimeout) as exc:
                out["raised_at"], out["error"] = i, f"{type(exc).__name__}: {exc}"
                break
    finally:
        mgr.close()
    return out
