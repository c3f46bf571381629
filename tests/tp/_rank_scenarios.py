"""What each rank runs in the tensor-parallel tests (imported by name in the spawned
rank processes), and the checks the test process makes over all ranks' records.

A schedule is shared by every rank (the same ops in the same order, as replicated
schedulers make them); each rank's copy engine - a SimBackend completing its pending
copies in a rank-specific random order, at rank-specific rounds, failing some - is
seeded from the schedule's seed and the rank, or follows an explicit script.
"""

from __future__ import annotations

import random
import time
from typing import Any

import kvoffload as kvo
from kvoffload._testing.ranks import RankContext
from kvoffload.drivers.distributed import RankAgreement
from kvoffload.testing import SimBackend


class AgreesWithItself(RankAgreement):
    """The mutant: every rank delivers what it finished, without asking the others (no
    all-reduce: each rank's MIN is over itself alone). What kvoffload did before F25."""

    def _all_reduce(self, kind: int, buf: Any = None) -> None:
        pass


class UnagreedManager(kvo.SyncOffloadManager):
    """A SyncOffloadManager on the mutant agreement."""

    _agreement_class = AgreesWithItself


MANAGERS: dict[str, type[kvo.SyncOffloadManager]] = {
    "agreeing": kvo.SyncOffloadManager,
    "unagreed": UnagreedManager,
}


def config(**changes: Any) -> kvo.OffloadConfig:
    fields: dict[str, Any] = dict(
        page_size=4, stride=4, device_pages=512, host_pages=16, drain_timeout_s=10, tp_timeout_s=10
    )
    fields.update(changes)
    return kvo.OffloadConfig(**fields)


def _apply(mgr: kvo.SyncOffloadManager, lcs: list[kvo.Lifecycle], op: list[Any], step: int) -> str:
    """One op of the shared schedule; returns what happened (the same on replicas)."""
    kind = op[0]
    try:
        if kind == "admit":
            lcs.append(mgr.admit(f"r{len(lcs) % 3}", list(range(100 + step, 100 + step + op[1]))))
            return f"admit #{lcs[-1].id}"
        if not lcs:
            return "none"
        lc = lcs[op[1] % len(lcs)]
        if kind == "extend":
            lc.extend(list(range(op[2])))
        elif kind == "finish":
            lc.finish()
        else:
            lc.abort()
        return f"{kind} #{lc.id}"
    except kvo.KVOffloadError as exc:
        return f"{kind} refused: {type(exc).__name__}"


def play(ctx: RankContext, sched: dict[str, Any], variant: str = "agreeing") -> dict[str, Any]:
    """Play ``sched`` on this rank; return what it saw, round by round.

    ``sched``: ``seed``, ``steps`` (per round, a list of ops), ``limits`` (per round,
    ``max_completions``), ``fail`` (chance a copy fails on this rank), ``config``
    (OffloadConfig fields), ``storage`` (None, "memory", or a directory shared by the
    ranks), and optionally ``script``: ``{rank: {round: [[seq, failed], ...]}}`` to
    complete exactly those copies instead of random ones.
    """
    rng = random.Random(f"{sched['seed']}/{ctx.rank}")
    script = sched.get("script")
    mine = None if script is None else {int(r): v for r, v in script.get(str(ctx.rank), {}).items()}
    backend = SimBackend()
    released: list[kvo.Lifecycle] = []
    mgr = MANAGERS[variant](
        config(**sched.get("config", {})),
        backend=backend,
        group=ctx.group,
        storage=sched.get("storage"),
        on_released=released.append,
    )
    mgr.open()
    rank_fill = float(ctx.rank + 1)
    mgr.device_pool.tensor.fill_(rank_fill)  # each rank's shard holds its own bytes
    lcs: list[kvo.Lifecycle] = []
    trace: list[Any] = []
    submitted: dict[int, int] = {}  # seq -> lifecycle id, every transfer this rank copied
    finished: dict[int, list[Any]] = {}  # seq -> [round, failed] when this rank's copy ended
    errors: list[str] = []
    pages_held: list[int] = []
    steps = sched["steps"]
    rounds = len(steps) + sched.get("drain_rounds", 200)
    for r in range(rounds):
        draining = r >= len(steps)  # then: every request finishes, copies still end at random
        if not draining:
            ops = [_apply(mgr, lcs, op, r) for op in steps[r]]
        elif r == len(steps):
            ops = [_apply(mgr, lcs, ["finish", i], r) for i, lc in enumerate(lcs) if not lc.released]
        else:
            ops = []
        for t in backend.pending:
            submitted[t.seq] = t.lifecycle_id
        pending = list(backend.pending)
        if mine is not None and not draining:
            by_seq = {t.seq: t for t in pending}
            chosen = [(by_seq[s], bool(f)) for s, f in mine.get(r, []) if s in by_seq]
        elif mine is not None or r > len(steps) + 30:
            chosen = [(t, False) for t in pending]
        else:
            rng.shuffle(pending)
            fail = 0.0 if draining else sched["fail"]
            chosen = [(t, rng.random() < fail) for t in pending[: rng.randint(0, len(pending))]]
        for t, failed in chosen:
            (backend.fail if failed else backend.complete)(t)
            finished[t.seq] = [r, failed]
        limit = None if draining else sched["limits"][r]
        try:
            n = mgr.poll(limit)
        except (kvo.RankTimeout, kvo.RanksDiverged) as exc:
            errors.append(f"round {r}: {type(exc).__name__}: {exc}")
            break
        trace.append([r, ops, [[lc.id, lc.outcome.value if lc.outcome else None] for lc in released], n])
        released.clear()
        pages_held.append(mgr.statistics().device_pages_used)
        try:
            mgr.check_invariants()
        except kvo.InvariantViolation as exc:
            errors.append(f"round {r}: {exc}")
        if draining and not mgr.core.busy:  # agreed state: every rank stops in the same round
            break
        if draining:
            mgr.wait_progress(0.01)  # storage writes come back on the writer's thread
    try:
        mgr.close(timeout=10)
    except kvo.KVOffloadError as exc:
        errors.append(f"close: {type(exc).__name__}: {exc}")
    closed = [[lc.id, lc.outcome.value if lc.outcome else None] for lc in released]
    stats = mgr.statistics().as_dict()
    return {
        "rank": ctx.rank,
        "trace": trace,
        "closed": closed,
        "submitted": submitted,
        "finished": finished,
        "errors": errors,
        "stats": stats,
        "pages_held": pages_held,
    }


def releases(result: dict[str, Any]) -> list[list[Any]]:
    """Per round: (round, the ops' results, the lifecycles released with their outcome,
    the completions delivered) - what must be identical on every rank."""
    return result["trace"]


def check_agreement(results: list[dict[str, Any]]) -> None:
    """Every rank saw the same rounds; nothing was released before every rank's copies
    of it ended; a copy that failed on any rank failed its lifecycle on every rank."""
    for res in results:
        assert not res["errors"], f"rank {res['rank']}: {res['errors']}"
    first = results[0]
    for res in results[1:]:
        for mine, theirs in zip(releases(first), releases(res), strict=False):
            assert mine == theirs, f"round {mine[0]}: rank 0 saw {mine}, rank {res['rank']} saw {theirs}"
        assert len(releases(first)) == len(releases(res)), "ranks polled a different number of rounds"
        assert first["closed"] == res["closed"]
        assert first["stats"] == res["stats"], "the ranks' statistics differ"
    for res in results:  # each rank's ledger balanced to the end
        s = res["stats"]
        assert s["live_lifecycles"] == s["device_pages_used"] == s["host_pages_used"] == 0, s
    failed_anywhere: set[int] = set()
    for res in results:
        for seq, (_, failed) in res["finished"].items():
            if failed:
                failed_anywhere.add(res["submitted"][seq])
    for rnd, _ops, released, _n in releases(first):
        for lid, outcome in released:
            for res in results:
                for seq, owner in res["submitted"].items():
                    if owner != lid:
                        continue
                    ended = res["finished"].get(seq)
                    assert ended is not None and ended[0] <= rnd, (
                        f"lifecycle #{lid} released in round {rnd} but rank {res['rank']}'s copy "
                        f"(seq {seq}) ended {'never' if ended is None else f'in round {ended[0]}'}"
                    )
            if lid in failed_anywhere:
                assert outcome in ("failed", "aborted"), f"#{lid}: a copy failed on a rank, outcome {outcome}"
            else:
                assert outcome != "failed", f"#{lid} FAILED though no rank failed a copy of it"


# --- small scenarios ---------------------------------------------------------------------


def _one_copy(ctx: RankContext, **changes: Any) -> tuple[SimBackend, kvo.SyncOffloadManager, kvo.Lifecycle]:
    """An open manager on this rank's group whose one lifecycle has a copy started."""
    backend = SimBackend()
    mgr = kvo.SyncOffloadManager(config(**changes), backend=backend, group=ctx.group)
    mgr.open()
    lc = mgr.admit("a", [1, 2, 3, 4])
    lc.extend([5, 6, 7, 8])
    return backend, mgr, lc


def quiesce_timeout(ctx: RankContext, timeouts: list[float | None]) -> dict[str, Any]:
    """A copy that one rank never finishes; each rank calls quiesce with its own timeout
    (``timeouts[rank]``, None: for ever). Returns what quiesce did here, and after the
    copy finishes, whether quiesce returned."""
    backend, mgr, _ = _one_copy(ctx)
    mgr.poll()
    if ctx.rank == 0:
        backend.complete_all()  # rank 1's copy stays in flight
    t0 = time.monotonic()
    try:
        mgr.quiesce(timeouts[ctx.rank])
        first = "returned"
    except kvo.DrainTimeout:
        first = "DrainTimeout"
    waited = time.monotonic() - t0
    backend.complete_all()
    mgr.quiesce(10)
    mgr.close()
    return {"first": first, "waited": waited, "inflight": mgr.statistics().chunks_inflight}


def storage_reads(ctx: RankContext, directory: str, keys: str, lose: int | None) -> dict[str, Any]:
    """Each rank offloads one request to the file store in ``directory`` (shared by the
    ranks) under ``tp_keys=keys``; rank ``lose`` (if any) then loses its shard of the
    second page. Returns what lookup and fetch said on this rank."""
    import os

    backend = SimBackend()
    cfg = config(tp_keys=keys, offload_prompt=True)
    mgr = kvo.SyncOffloadManager(cfg, backend=backend, group=ctx.group, storage=directory)
    mgr.open()
    mgr.device_pool.tensor.fill_(float(ctx.rank + 1))
    prompt = list(range(4))
    lc = mgr.admit("a", prompt)
    lc.extend(list(range(4, 16)))  # the prompt's page, then three more
    lc.finish()
    copied_here = len(backend.pending)
    backend.complete_all()
    mgr.quiesce(10)
    for _ in range(500):  # the writes, agreed
        mgr.poll()
        if not mgr.writes_pending:
            break
        mgr.wait_progress(0.01)
    tokens = list(range(16))
    if lose is not None and ctx.rank == lose:  # this rank's shard of the third page is lost
        os.unlink(mgr.storage.inner.path(_chain(tokens)[2] + f"_{ctx.rank}_{ctx.size}"))  # type: ignore[union-attr]
    found = mgr.lookup(tokens)
    pages = mgr.fetch(tokens, found)
    mgr.close()
    return {
        "copied_here": copied_here,
        "found": found,
        "fetched": len(pages),
        "bytes": [p[:8].hex() for p in pages],
        "stats": mgr.statistics().as_dict(),
        "storage": repr(mgr.storage),
    }


def _chain(tokens: list[int]) -> list[str]:
    return kvo.chain_keys(None, tokens, 4)


def stop_polling(ctx: RankContext, how: str, done_marker: str) -> dict[str, Any]:
    """Rank 1 stops taking part (``how``: "sleep" until rank 0 is done, or "die"); rank
    0 polls with a copy finished here and in flight there. Returns what rank 0 saw: the
    error type, whether the lifecycle kept its pages, what a second poll and close did.
    Rank 0 creates the file ``done_marker`` when it is done; a sleeping rank 1 waits for
    it (at most 60 s, a hang bound), so it is late past rank 0's tp_timeout_s however
    slow the machine is (F39), never for an amount of time."""
    import os
    from pathlib import Path

    backend, mgr, lc = _one_copy(ctx, tp_timeout_s=1.0, drain_timeout_s=2)
    lc.finish()
    mgr.poll()  # both ranks: the copies start
    if ctx.rank == 1:
        if how == "die":
            os._exit(3)
        deadline = time.monotonic() + 60
        while not Path(done_marker).exists():  # rank 0 timed out, polled again and closed
            assert time.monotonic() < deadline, "rank 0 never finished"
            time.sleep(0.01)
    backend.complete_all()
    out: dict[str, Any] = {}
    try:
        out["first"], out["message"] = _attempt(mgr.poll, "delivered")
        out["state"] = lc.state.name
        out["pages_held"] = mgr.statistics().device_pages_used
        out["second"], _ = _attempt(mgr.poll, "delivered")
        out["close"], _ = _attempt(mgr.close, "closed")
        out["after_close"] = lc.state.name
        out["pages_after_close"] = mgr.statistics().device_pages_used
    finally:
        if ctx.rank == 0:
            Path(done_marker).touch()
    return out


def _attempt(call: Any, ok: str) -> tuple[str, str]:
    """(``ok``, "") if ``call()`` returns, else (the error's type name, its message)."""
    try:
        call()
        return ok, ""
    except kvo.KVOffloadError as exc:
        return type(exc).__name__, str(exc)


def mismatched_calls(ctx: RankContext) -> str:
    """Rank 0 polls while rank 1 quiesces: both raise RanksDiverged, in the same call."""
    mgr = kvo.SyncOffloadManager(config(), backend=SimBackend(), group=ctx.group)
    mgr.open()
    try:
        if ctx.rank == 0:
            mgr.poll()
        else:
            mgr.quiesce(5)
        return "no error"
    except kvo.RanksDiverged as exc:
        return f"RanksDiverged: {exc}"
    finally:
        mgr.close()


def diverged_admissions(ctx: RankContext) -> list[str]:
    """Rank 1 admits one request more than rank 0 (a scheduler that is not replicated):
    the next poll raises RanksDiverged on both; later collectives raise at once."""
    mgr = kvo.SyncOffloadManager(config(), backend=SimBackend(), group=ctx.group)
    mgr.open()
    mgr.admit("a", [1, 2, 3])
    if ctx.rank == 1:
        mgr.admit("b", [1, 2, 3])
    out = []
    for _ in range(2):
        try:
            mgr.poll()
            out.append("delivered")
        except kvo.RanksDiverged as exc:
            out.append(str(exc))
    mgr.close()
    return out


def close_while_others_poll(ctx: RankContext) -> dict[str, Any]:
    """Rank 0 closes while rank 1 polls, each with a copy finished here: both raise
    RanksDiverged, and rank 0's close still completes (its own copies delivered, the
    manager closed); rank 1 then closes alone."""
    backend, mgr, lc = _one_copy(ctx)
    lc.finish()
    mgr.poll()
    backend.complete_all()
    out: dict[str, Any] = {}
    try:
        if ctx.rank == 0:
            mgr.close()
        else:
            mgr.poll()
        out["call"] = "returned"
    except kvo.RanksDiverged as exc:
        out["call"] = f"RanksDiverged: {exc}"
    if ctx.rank == 1:
        mgr.close()
    out["state"] = lc.state.name
    out["closed"] = mgr.statistics().device_pages_used == 0 and not mgr._open
    return out


def partial_write(ctx: RankContext) -> dict[str, Any]:
    """F34 under tensor parallelism: each rank offloads the prompt page, then one chunk
    of three pages, to its own memory store; rank 1's store never confirms its shard
    of the chunk's second page (it stores the other two). Returns this rank's
    statistics, lookup and the lifecycle's loss."""
    from collections.abc import Sequence

    from kvoffload.errors import PartialWriteError
    from kvoffload.storage.memory import MemoryStorage
    from kvoffload.storage.writer import WritePolicy

    refused = _chain(list(range(16)))[2] + f"_1_{ctx.size}"

    class Refusing(MemoryStorage):
        async def put(self, keys: Sequence[str], pages: Sequence[bytes]) -> None:
            ok = [k != refused for k in keys]
            for k, p, good in zip(keys, pages, ok, strict=True):
                if good:
                    self.pages[k] = bytes(p)
            if not all(ok):
                raise PartialWriteError("scripted: one page refused", ok)

    backend = SimBackend()
    cfg = config(offload_prompt=True)
    policy = WritePolicy(attempts=2, backoff_s=0)
    mgr = kvo.SyncOffloadManager(
        cfg, backend=backend, group=ctx.group, storage=Refusing(), write_policy=policy
    )
    mgr.open()
    lc = mgr.admit("a", list(range(4)))
    lc.extend(list(range(4, 16)))
    lc.finish()
    backend.complete_all()
    mgr.quiesce(10)
    for _ in range(500):  # the writes, agreed
        mgr.poll()
        if not mgr.writes_pending:
            break
        mgr.wait_progress(0.01)
    found = mgr.lookup(list(range(16)))
    mgr.check_invariants()
    mgr.close()
    return {"found": found, "lost": lc.pages_lost, "stats": mgr.statistics().as_dict()}
