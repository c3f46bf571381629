"""The ledger check behind ``check_invariants()`` (ARCHITECTURE.md rules 1-6), over the core's state."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from kvoffload.core.lifecycle import EXTEND_SELF_LOOP, LifecycleId
from kvoffload.errors import InvariantViolation
from kvoffload.keys import TOKEN_TYPECODE
from kvoffload.lifecycle.spec import LifecycleState

if TYPE_CHECKING:
    from kvoffload.core.chunks import Chunks
    from kvoffload.core.loads import Loads
    from kvoffload.core.registry import Registry
    from kvoffload.core.rows import DecodeRows
    from kvoffload.core.step import DecodeStep

__all__ = ["check"]


def check(registry: Registry, chunks: Chunks, step: DecodeStep, loads: Loads | None = None) -> None:
    """Raise :class:`InvariantViolation` listing every broken rule (the load path's too,
    with ``loads``)."""
    problems: list[str] = []

    def expect(ok: bool, what: Callable[[], str]) -> None:
        if not ok:  # messages are built only when a rule is broken
            problems.append(what())

    c = registry.counters
    cfg = registry.config
    ps = cfg.page_size
    live = list(registry.live.values())
    released = c.released_completed + c.released_aborted + c.released_failed
    # Rule 6: admitted = live + released.
    expect(
        c.admitted == len(live) + released,
        lambda: f"admitted {c.admitted} != live {len(live)} + released {released}",
    )
    for name in c.names:
        expect(getattr(c, name) >= 0, lambda: f"counter {name} is negative: {getattr(c, name)}")
    rows = step.rows
    if rows is not None:
        _check_rows(rows, expect)
    counts = [0, 0, 0, 0]
    dev_pages: set[int] = set()
    # A stored prefix page may be held by several lifecycles (engine-owned mode: what a
    # prefix cache shares); names: how many hold each page held by more than one.
    sharing = hasattr(registry.device_pool, "shared_count")
    shared = getattr(registry.device_pool, "shared_count", lambda p: 0)
    names: dict[int, int] = {}
    inflight_sum = 0
    for lc in live:
        counts[lc._s] += 1
        expect(lc._s != 3, lambda: f"{lc!r} is RELEASED but still registered")
        expect(lc.outcome is None, lambda: f"{lc!r} is live with outcome {lc.outcome}")
        expect(
            0 <= lc.submitted <= lc.committed,
            lambda: f"{lc!r}: submitted {lc.submitted} / committed {lc.committed}",
        )
        expect(lc.submitted % ps == 0, lambda: f"{lc!r}: submitted {lc.submitted} is not page-aligned")
        held = rows.pending(lc) if rows is not None else 0  # tokens its batch row holds
        expect(
            len(lc._tail) + held == lc.committed - lc.submitted,
            lambda: f"{lc!r}: tail length {len(lc._tail)} (+{held} in its row)",
        )
        expect(
            len(lc.device_pages) == -(-lc.committed // ps),
            lambda: f"{lc!r}: {len(lc.device_pages)} device pages for {lc.committed} tokens",
        )
        expect(lc._cap == len(lc.device_pages) * ps, lambda: f"{lc!r}: capacity {lc._cap} out of sync")
        narrow = lc._tail.typecode == TOKEN_TYPECODE
        quiet = (
            lc.due - 1 if lc._s in (0, 1) and narrow and not registry.events.observed and lc._row < 0 else -1
        )
        expect(lc._quiet == quiet, lambda: f"{lc!r}: fast-path threshold {lc._quiet}, should be {quiet}")
        expect(lc.inflight >= 0, lambda: f"{lc!r}: negative inflight")
        if lc._s == LifecycleState.PENDING.value:
            expect(lc.inflight == 0, lambda: f"{lc!r} is PENDING with {lc.inflight} chunks in flight")
        if lc._s == LifecycleState.OFFLOADING.value:
            expect(lc.inflight > 0, lambda: f"{lc!r} is OFFLOADING with nothing in flight")
        if lc._s == LifecycleState.FINISHING.value:  # nothing would ever release it (F20)
            expect(
                lc.inflight > 0 or lc._deferred_since is not None,
                lambda: f"{lc!r} is FINISHING with nothing in flight and nothing deferred",
            )
        if lc._deferred_since is not None:
            expect(lc in chunks.wait.queue, lambda: f"{lc!r} is deferred but not queued")
        # No holes (F33): offload stopped at a hole submits nothing and waits for nothing.
        expect(lc.pages_lost == 0, lambda: f"{lc!r} is live with pages_lost {lc.pages_lost}")
        if lc._stop >= 0:
            expect(
                lc._stop <= lc.submitted and lc._deferred_since is None and lc.due >= 1 << 62,
                lambda: f"{lc!r} stopped at token {lc._stop} but may still send (due {lc.due})",
            )
        for p in lc.device_pages:
            if p in dev_pages:  # only a stored prefix page may be (engine-owned mode)
                names[p] = names.get(p, 1) + 1
                expect(shared(p) > 0, lambda: f"device page {p} held by two lifecycles")
            dev_pages.add(p)
            expect(
                registry.device_pool.is_allocated(p),
                lambda: f"{lc!r} holds device page {p} that the pool thinks is free",
            )
        inflight_sum += lc.inflight
    dev_total = len(dev_pages)
    for p in dev_pages if sharing else ():  # each shared page: held by exactly its holders
        k = shared(p)
        expect(
            k == 0 or k == names.get(p, 1),
            lambda: f"device page {p} is shared by {k} lifecycles, {names.get(p, 1)} hold it",
        )
    expect(
        counts == registry.state_counts, lambda: f"state counts {registry.state_counts} != registry {counts}"
    )
    # Rule 2: device pages are held by live lifecycles only, exactly (and, in owned mode,
    # by live loads: kvoffload's pool holds the pages they may write).
    load_dev = sum(len(ld.device_pages) for ld in loads.live.values()) if loads and loads.owned else 0
    expect(
        registry.device_pool.used == dev_total + load_dev,
        lambda: (
            f"device pool used {registry.device_pool.used} != held by live lifecycles {dev_total}"
            + (f" + live loads {load_dev}" if load_dev else "")
        ),
    )
    # Rule 1 and 6: every in-flight transfer belongs to a live lifecycle; counts agree.
    expect(
        len(chunks.inflight) == c.chunks_inflight == inflight_sum,
        lambda: (
            f"in flight: {len(chunks.inflight)} transfers, counter {c.chunks_inflight}, "
            f"lifecycles {inflight_sum}"
        ),
    )
    host_inflight = 0
    prev_seq = -1  # in flight in submission order (tensor-parallel ranks agree by it)
    for t in chunks.inflight.values():
        expect(prev_seq < t.seq < chunks.next_seq, lambda: f"{t!r}: seq {t.seq} out of submission order")
        prev_seq = t.seq
        # Its lifecycle, by id: a lifecycle with a copy in flight is never RELEASED (live).
        owner = registry.live.get(LifecycleId(t.lifecycle_id))
        expect(owner is not None, lambda: f"{t!r} in flight for an unregistered lifecycle")
        if owner is not None:
            expect(owner._s != 3, lambda: f"{t!r} in flight for a RELEASED lifecycle")
            expect(
                set(t.device_pages) <= set(owner.device_pages),
                lambda: f"{t!r} reads device pages its lifecycle does not hold",
            )
        expect(
            not sharing or not any(shared(p) for p in t.device_pages),
            lambda: f"{t!r} reads a stored prefix page (shared, never copied)",
        )
        host_inflight += len(t.host_pages)
    expect(
        host_inflight == c.pages_inflight, lambda: f"pages in flight {c.pages_inflight} != {host_inflight}"
    )
    # Writes wait in chain order (F33): a held job is not handed out (nor in writes) and
    # starts after its live lifecycle's oldest chunk still in flight.
    out = {id(j) for j in chunks.writes.out}
    held_pages = 0
    for lid, waiting in chunks.writes.held.items():
        owner = registry.live.get(lid)
        expect(owner is not None and bool(waiting), lambda: f"write jobs held for lifecycle #{lid}, not live")
        front = owner._front if owner is not None else -1
        for first, job in waiting.items():
            expect(
                job.id not in chunks.writes.jobs and id(job) not in out and job.first_token == first,
                lambda: f"{job!r} is held but also handed out",
            )
            held_pages += len(job.host_pages)
            expect(first > front >= 0, lambda: f"{job!r} is held but nothing before it is in flight")
    host_writes = sum(len(j.host_pages) for j in chunks.writes.jobs.values()) + held_pages
    expect(host_writes == c.pages_in_write, lambda: f"pages in write {c.pages_in_write} != {host_writes}")
    # Rule 3: host pages are held by in-flight chunks, pending writes and live loads, exactly.
    host_loads = _check_loads(loads, registry, dev_pages, expect) if loads is not None else 0
    expect(
        chunks.host_pool.used == host_inflight + host_writes + host_loads,
        lambda: (
            f"host pool used {chunks.host_pool.used} != in flight {host_inflight} + in write "
            f"{host_writes} + loads {host_loads}"
        ),
    )
    # Rule 6: the chunk and page ledgers.
    expect(
        c.chunks_submitted == c.chunks_inflight + c.chunks_copied + c.chunks_discarded + c.chunks_failed,
        lambda: "chunks: submitted != inflight + copied + discarded + failed",
    )
    expect(
        c.pages_submitted == c.pages_inflight + c.pages_copied + c.pages_discarded + c.pages_failed,
        lambda: "pages: submitted != inflight + copied + discarded + failed",
    )
    expect(
        c.pages_copied
        == c.pages_stored
        + c.pages_store_failed
        + c.pages_store_unreachable
        + c.pages_store_skipped
        + c.pages_in_write
        + c.pages_not_stored,
        lambda: (
            "pages: copied != stored + store_failed + store_unreachable + store_skipped + in_write "
            "+ not_stored"
        ),
    )
    expect(  # per page (F34): a partial chunk has a page its store did not confirm
        c.chunks_store_partial <= c.pages_store_unconfirmed <= c.pages_store_failed,
        lambda: "chunks_store_partial <= pages_store_unconfirmed <= pages_store_failed does not hold",
    )
    expect(
        all(lc._deferred_since is not None for lc in chunks.wait.queue),
        lambda: "a non-deferred lifecycle is queued as deferred",
    )
    try:
        registry.device_pool.check()
        chunks.host_pool.check()
    except AssertionError as exc:
        problems.append(str(exc))
    if problems:
        raise InvariantViolation("; ".join(problems))


def _check_loads(
    loads: Loads, registry: Registry, held: set[int], expect: Callable[[bool, Callable[[], str]], None]
) -> int:
    """The load path (kvoffload.core.loads): each live load's state agrees with what
    touches its pages, no two name one device page, no lifecycle holds one for itself,
    and the load ledger balances. Returns the host pages the live loads hold."""
    from kvoffload.lifecycle.load_spec import LoadState

    c = registry.counters
    reading, copying, cancelling = (
        s.value for s in (LoadState.READING, LoadState.COPYING, LoadState.CANCELLING)
    )
    host: list[int] = []
    device: dict[int, int] = {}
    inflight = 0
    pool = registry.device_pool
    shared = getattr(pool, "shared_count", None)
    for lid, ld in loads.live.items():
        s = ld._s
        expect(lid == ld.id and s in (reading, copying, cancelling), lambda: f"{ld!r} is live in {ld.state}")
        expect(lid not in registry.live, lambda: f"{ld!r} shares its id with a live lifecycle")
        t = ld._transfer
        expect(not (ld._reading and t is not None), lambda: f"{ld!r} is read and copied at once")
        expect(s != reading or ld._reading, lambda: f"{ld!r} is READING with no read outstanding")
        expect(s != copying or t is not None, lambda: f"{ld!r} is COPYING with no copy in flight")
        expect(
            s != cancelling or ld._reading or t is not None,
            lambda: f"{ld!r} is CANCELLING with nothing to wait for (nothing would end it)",
        )
        n_host = len(ld.keys) if ld._reading else len(t.host_pages) if t is not None else -1
        expect(len(ld._host) == n_host, lambda: f"{ld!r} holds {len(ld._host)} host pages, not {n_host}")
        if t is not None:
            inflight += len(t.device_pages)
            expect(loads.copying.get(t.id) is ld, lambda: f"{ld!r}'s copy {t!r} is not listed in flight")
            expect(
                t.direction == "h2d"
                and t.host_pages == ld._host
                and t.device_pages == ld.device_pages[: len(t.host_pages)],
                lambda: (
                    f"{ld!r}'s copy {t!r} does not copy its held host pages into its leading device pages"
                ),
            )
        host += ld._host
        for p in ld.device_pages:
            expect(
                p not in device, lambda: f"device page {p} is named by loads #{device.get(p)} and #{ld.id}"
            )
            device[p] = ld.id
            expect(
                p not in held or (shared is not None and shared(p) > 0) or not ld.device_busy,
                lambda: f"device page {p} of {ld!r} is held by a live lifecycle while a copy may write it",
            )
            expect(
                not loads.owned or pool.is_allocated(p),
                lambda: f"device page {p} of {ld!r} is free in kvoffload's pool while the load holds it",
            )
    expect(len(set(host)) == len(host), lambda: "a host page is held by two loads")
    expect(device == loads.device, lambda: "the loads' device page record is out of sync")
    expect(
        len(loads.copying) == sum(ld._transfer is not None for ld in loads.live.values()),
        lambda: f"{len(loads.copying)} h2d copies listed in flight, not those of the live loads",
    )
    expect(
        inflight == c.load_pages_inflight,
        lambda: f"load pages in flight {c.load_pages_inflight} != {inflight}",
    )
    ended = c.loads_loaded + c.loads_partial + c.loads_missed + c.loads_failed + c.loads_cancelled
    expect(
        c.loads_begun == len(loads.live) + ended,
        lambda: f"loads begun {c.loads_begun} != live {len(loads.live)} + ended {ended}",
    )
    return len(host)


def _check_rows(rows: DecodeRows, expect: Callable[[bool, Callable[[], str]], None]) -> None:
    """extend_batch's rows (kvoffload.core.rows): rows and lifecycles agree, every row
    is listed for its next visit and its pages, and none is ever missed."""
    n = 0
    listed: dict[int, set[int]] = {}
    for s, rs in rows.visits.items():
        for r in rs:
            listed.setdefault(r, set()).add(s)
    for r, lc in enumerate(rows.row_lc):
        if lc is None:
            continue
        n += 1
        expect(lc._row == r, lambda: f"{lc!r} is in row {r} but says {lc._row}")
        k = rows.step - lc._from
        expect(0 <= k < rows.width, lambda: f"{lc!r}: its row holds {k} tokens, at most {rows.width - 1}")
        other = rows.other_at[r]
        expect(other > rows.step, lambda: f"{lc!r}: its row's visit at step {other} has passed")
        expect(
            listed.get(r) == {other},
            lambda: f"{lc!r}: its row's visit at {other}, listed at {listed.get(r)}",
        )
        phase = (rows.step + lc._cap + 1 - lc._committed - k) % rows.page_size
        expect(
            [f for f, rs in enumerate(rows.paging) for q in rs if q == r] == [phase],
            lambda: f"{lc!r}: its row does not take its pages at steps {phase} mod {rows.page_size}",
        )
        expect(
            EXTEND_SELF_LOOP[lc._s] and not rows.events.observed,
            lambda: f"{lc!r} holds a row but extend is not its plain step",
        )
        expect(
            lc._deferred_since is None or other == rows.step + 1,
            lambda: f"{lc!r} is deferred but its row is not visited at the next step",
        )
        expect(k == 0 or lc._deferred_since is None, lambda: f"{lc!r} is deferred with {k} tokens held")
        expect(lc._quiet == -1, lambda: f"{lc!r} holds a row but its fast path is open")
        expect(lc._core is rows.core, lambda: f"{lc!r} holds a row of another core")
    expect(n == rows.attached, lambda: f"{rows.attached} rows counted, {n} held")
    seated = {r for r, lc in enumerate(rows.row_lc) if lc is not None}
    expect(rows.seated == seated, lambda: f"rows {sorted(rows.seated)} listed as held, {sorted(seated)} held")
    entries = sum(map(len, rows.visits.values()))
    expect(entries == n, lambda: f"{entries} visits listed for {n} rows")
    paging = sum(map(len, rows.paging))
    expect(paging == n, lambda: f"{paging} rows take pages, {n} held")
    if rows.batch is not None:
        expect(
            sorted(lc._row for lc in rows.batch) == sorted(r for r, lc in enumerate(rows.row_lc) if lc),
            lambda: "the rows held are not those of the last batch",
        )
