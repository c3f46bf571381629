"""docs/events.md and the code agree: the same event names, each emitted by the code,
and the documented fields exactly the fields a listener receives."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest
import structlog

import kvoffload as kvo
from kvoffload.abc import Storage
from kvoffload.core.events import EVENT_NAMES
from kvoffload.errors import StorageError
from kvoffload.testing import SimBackend

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "events.md"
COMMON = {"lifecycle", "rid", "t"}


def documented() -> dict[str, tuple[set[str], bool]]:
    """event name -> (documented extra fields, log-only?) from the table in events.md."""
    rows: dict[str, tuple[set[str], bool]] = {}
    for line in DOC.read_text().splitlines():
        m = re.match(r"^\| `([a-z_]+\.[a-z_]+)` \| (\w+) \| ([^|]*) \|", line)
        if m:
            rows[m.group(1)] = (set(re.findall(r"`(\w+)`", m.group(3))), "log only" in m.group(3))
    return rows


def test_the_doc_lists_exactly_the_declared_event_names() -> None:
    """Every name in EVENT_NAMES is documented, and the doc lists no other."""
    assert set(documented()) == set(EVENT_NAMES)


class _FailingStorage(Storage):
    """Fails the first three writes (one chunk's every attempt), then works: a burst
    of failures and its recovery."""

    name = "failing"

    def __init__(self) -> None:
        self.n = 0

    async def put(self, keys: Any, pages: Any) -> None:
        self.n += 1
        if self.n <= 3:
            raise StorageError("disk on fire")

    async def get(self, keys: Any) -> list[bytes | None]:
        return [None] * len(keys)

    async def exists_prefix(self, keys: Any) -> int:
        return 0


class _RefusingSim(SimBackend):
    """A SimBackend whose ``submit`` refuses while ``refuse`` is set."""

    refuse = False

    def submit(self, transfer: kvo.Transfer) -> None:
        if self.refuse:
            raise kvo.BackendError("simulated: refused")
        super().submit(transfer)


async def _scenario(on_host_full: str) -> list[tuple[str, dict[str, Any]]]:
    """Drive one manager through every listener event of its policy; return them."""
    now = [0.0]
    config = kvo.OffloadConfig(
        page_size=4,
        stride=4,
        device_pages=64,
        host_pages=2,
        on_host_full=on_host_full,  # type: ignore[arg-type]
        stuck_after_s=1.0,
        host_wait_s=5.0,
        watchdog_interval_s=1000,
    )
    backend = _RefusingSim()
    seen: list[tuple[str, dict[str, Any]]] = []
    async with kvo.OffloadManager(
        config, backend=backend, storage=_FailingStorage(), clock=lambda: now[0]
    ) as mgr:
        mgr.add_listener(lambda name, fields: seen.append((name, dict(fields))))
        a = mgr.admit("r1", list(range(4)))
        a.extend(list(range(8)))  # one chunk of 2 pages: host pool now full
        b = mgr.admit("r2", list(range(4)))
        b.extend(list(range(4)))  # host full: dropped or deferred
        now[0] = 2.0
        mgr.tick()  # a is stuck in OFFLOADING
        backend.refuse = on_host_full == "wait"  # b's deferred retry will be refused
        backend.complete(backend.pending[0])
        await mgr.settle()
        backend.refuse = False
        c = mgr.admit("r3", list(range(4)))
        c.extend(list(range(4)))
        c.abort()
        backend.complete_all()
        await mgr.settle()
        d = mgr.admit("r4", list(range(4)))
        d.extend(list(range(4)))
        if backend.pending:
            backend.fail(backend.pending[0])
        await mgr.settle()
        for lc in (a, b, d):
            if not lc.released and lc.state is not kvo.LifecycleState.FINISHING:
                lc.finish()
        for _ in range(3):
            backend.complete_all()
            await mgr.settle()
            mgr.tick()
        await anyio.sleep(0)
    return seen


@pytest.mark.asyncio
async def test_listener_events_carry_exactly_the_documented_fields() -> None:
    """For every event a listener receives, its fields are lifecycle, rid, t and the
    fields the doc lists; the two host-full policies together produce every listener
    event the doc lists."""
    doc = documented()
    seen: set[str] = set()
    for policy in ("drop", "wait"):
        for name, fields in await _scenario(policy):
            extra, log_only = doc[name]
            assert not log_only, f"{name} is documented as log-only but reached a listener"
            want = COMMON | extra
            assert set(fields) == want, f"{name}: got {sorted(fields)}, doc says {sorted(want)}"
            seen.add(name)
    expected = {name for name, (_, log_only) in doc.items() if not log_only}
    assert expected - seen == set(), "the scenario no longer produces these events"


class _DuplicatingSim(SimBackend):
    """A broken backend: it delivers its first completion twice."""

    def complete(self, transfer: kvo.Transfer) -> None:
        super().complete(transfer)
        if self.signalled == 1:
            self._signal((transfer, None))


async def _log_only_scenarios() -> list[dict[str, Any]]:
    """Runs that make every log-only event happen; the structlog entries they logged."""
    config = kvo.OffloadConfig(page_size=4, stride=4, device_pages=8, host_pages=4, drain_timeout_s=0.01)
    with structlog.testing.capture_logs() as logs:
        # manager.closed_live: left with a live lifecycle.
        async with kvo.OffloadManager(config, backend="sim") as mgr:
            mgr.admit("r1", [1, 2, 3])
        # manager.drain_timeout: left with a copy nobody completes.
        backend = SimBackend()
        with pytest.raises(kvo.DrainTimeout):
            async with kvo.OffloadManager(config, backend=backend) as mgr:
                mgr.admit("r1", [1, 2, 3, 4]).extend([5, 6, 7, 8])
        # listener.failed and manager.on_released_failed: a raising listener and callback.

        def boom(*_: Any) -> None:
            raise RuntimeError("observer bug")

        async with kvo.OffloadManager(config, backend="sim", on_released=boom) as mgr:
            mgr.add_listener(boom)
            with pytest.raises(RuntimeError, match="observer bug"):
                mgr.admit("r1", [1]).finish()
        # manager.step_failed: a backend that delivers a completion twice.
        dup = _DuplicatingSim()
        async with kvo.OffloadManager(config, backend=dup) as mgr:
            lc = mgr.admit("r1", [1, 2, 3, 4])
            lc.extend([5, 6, 7, 8])
            dup.complete(dup.pending[0])
            await anyio.sleep(0.01)
            lc.finish()
        # sglang.rows_reclaimed_mid_copy: SGLang retracts without draining first.
        _retract_mid_copy()
        # sglang.storage_fallback: SGLang's storage built where its config is not published.
        _storage_fallback()
    return logs


def _storage_fallback() -> None:
    """The SGLang integration's storage where SGLang's runtime config is not published:
    the file backend falls back to writing HiCacheFile's format itself."""
    import tempfile

    from kvoffload.integrations.sglang_storage import sglang_storage

    sys.path.insert(0, str(Path(__file__).parent / "integrations"))
    try:
        from sglang_fakes import MHAPool
    finally:
        sys.path.pop(0)
    with tempfile.TemporaryDirectory() as root:
        extra = {"file_storage_path": root}
        sglang_storage("file", extra, "m", 0, 1, "page_first", MHAPool(4, 4, 1), page_size=4)


def _retract_mid_copy() -> None:
    """The SGLang integration on its fake engine: a request's row is taken back (and the
    request resumed on a new row) while its copy still runs."""
    sys.path.insert(0, str(Path(__file__).parent / "integrations"))
    try:
        from sglang_fakes import Engine, Req
    finally:
        sys.path.pop(0)
    engine, sim = Engine(page_size=4), SimBackend()
    mgr = engine.manager(backend=sim, storage=None, host_pages=16)
    req = Req("r", list(range(6)), max_new=50)
    engine.prefill(req)
    while not sim.pending:
        engine.iteration()
    engine.running.remove(req)  # retracted without drain_before_retraction()
    engine.tree.free_kv_row(req.kv, [(0, req.kv.kv_allocated_len)])
    engine.r2t.free(req)
    req.kv.kv_allocated_len = 0
    rows = engine.r2t.free_slots  # SGLang's pool hands the freed row out first: another one
    rows.insert(0, rows.pop())
    engine.prefill(req)
    sim.complete_all()  # the copy ends, but is not delivered yet: still in flight to kvoffload
    engine.iteration()  # check_offload_progress sees the new row: the lifecycle is aborted
    sim.complete_all()
    engine.running.clear()
    mgr.release_host_resources()


@pytest.mark.asyncio
async def test_every_declared_event_is_really_emitted_with_its_documented_fields() -> None:
    """Each name in EVENT_NAMES is emitted by a run: listener events reach a listener in
    the two policy scenarios, log-only events are logged by the runs above with at least
    their documented fields (and a structlog line names every listener event too)."""
    doc = documented()
    emitted = {name for policy in ("drop", "wait") for name, _ in await _scenario(policy)}
    logs = await _log_only_scenarios()
    for name, (extra, log_only) in doc.items():
        if not log_only:
            continue
        entries = [e for e in logs if e["event"] == name]
        assert entries, f"{name} was never logged"
        assert extra <= set(entries[0]), f"{name}: logged {sorted(entries[0])}, doc says {sorted(extra)}"
        emitted.add(name)
    assert set(EVENT_NAMES) - emitted == set(), "declared but never emitted"


@pytest.mark.asyncio
async def test_log_only_events_reach_structlog_with_their_documented_fields() -> None:
    """manager.closed_live is logged with the documented field when a manager is left live."""
    config = kvo.OffloadConfig(page_size=4, stride=4, device_pages=8, host_pages=4)
    with structlog.testing.capture_logs() as logs:
        async with kvo.OffloadManager(config, backend="sim") as mgr:
            mgr.admit("r1", [1, 2, 3])
    entries = [e for e in logs if e["event"] == "manager.closed_live"]
    assert entries and {"live"} <= set(entries[0])
    assert documented()["manager.closed_live"][0] == {"live"}
