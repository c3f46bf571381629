"""The load path under any interleaving: several loads (begin, read returning, cancel,
copy completing or failing, in any order) beside offloading lifecycles, on one core with
the sim backend, with the ledger and the load invariants checked after every step.

What must hold (ARCHITECTURE.md "The load path", FAILURES F38), derived here from what
the test did, not from the table (an observer, as kvoffload/_testing/observer.py is for
the offload lifecycle):

- a load's h2d copy is submitted only when its read returned, it was not cancelled and
  it read at least one page; once it is DONE no copy of it is pending;
- ``device_busy`` is exactly "its copy is still pending";
- its device pages hold their old bytes until its copy ran; when it ends LOADED or
  PARTIAL the leading ``pages_loaded`` pages hold what the read put in its host pages
  and the rest their old bytes (never a byte of a page not read);
- its outcome is the one the observer expects; its host pages are back at DONE;
- at the end (close, every read returned, every copy completed) nothing is held.
"""

from __future__ import annotations

import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import kvoffload as kvo
from kvoffload.abc import Transfer
from kvoffload.core import OffloadCore
from kvoffload.pools import DevicePool, HostPool
from kvoffload.testing import SimBackend

LoadOutcome = kvo.LoadOutcome
PAGES = 12
HOST = 7


class _Seen:
    """What the observer knows of one load."""

    def __init__(self, ld: kvo.Load, old: list[bytes]) -> None:
        self.ld = ld
        self.old = old  # its device pages' bytes at begin
        self.cancelled = False
        self.read: tuple[int, bool] | None = None  # (pages read, raised)
        self.host: list[bytes] = []  # what the read put in its host pages
        self.copy_failed = False
        self.submitted = False  # its h2d copy was handed to the mover
        self.checked = False


class LoadInterleavings(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        cfg = kvo.OffloadConfig(page_size=4, stride=4, device_pages=PAGES, host_pages=HOST, kv_shape=(2,))
        self.device = DevicePool.create(PAGES, 4, (2,), "float32")
        self.host = HostPool.new(HOST, (4, 2), "float32", zero=True)
        self.backend = SimBackend()
        self.backend.open(self.device, self.host)
        self.core = OffloadCore(cfg, device_pool=self.device, host_pool=self.host, accept=self.accept)
        self.seen: dict[int, _Seen] = {}
        self.lifecycles: list[kvo.Lifecycle] = []
        self.stamp = 0.0
        # violations: what accept() saw wrong (a mover's refusal would hide an assert there)
        self.violations: list[str] = []

    # --- the observer's hooks ---------------------------------------------------------

    def accept(self, t: Transfer) -> None:
        if t.direction == "h2d":
            s = self.seen[t.lifecycle_id]
            if s.cancelled:
                self.violations.append(f"{s.ld!r}: a copy submitted after its cancel")
            if s.read is None or s.read[0] == 0 or s.read[1]:
                self.violations.append(f"{s.ld!r}: a copy submitted before a read of some page")
            elif t.device_pages != s.ld.device_pages[: s.read[0]] or len(t.host_pages) != s.read[0]:
                self.violations.append(f"{s.ld!r}: its copy copies pages its read did not fill (F38)")
            s.submitted = True
        self.backend.submit(t)

    def page(self, p: int) -> bytes:
        return self.device.tensor[p].numpy().tobytes()

    def fresh(self, n: int) -> torch.Tensor:
        self.stamp += 1.0
        return torch.arange(n, dtype=torch.float32) + 1000.0 * self.stamp

    def expected(self, s: _Seen) -> LoadOutcome:
        if s.cancelled:
            return LoadOutcome.CANCELLED
        assert s.read is not None
        n, raised = s.read
        if raised or s.copy_failed:
            return LoadOutcome.FAILED
        if n == 0:
            return LoadOutcome.MISSED
        return LoadOutcome.LOADED if n == len(s.ld.keys) else LoadOutcome.PARTIAL

    def ended(self, s: _Seen) -> None:
        """``s``'s load just reached DONE: its outcome and its device pages' bytes, now
        (before anything else may reuse its pages)."""
        ld = s.ld
        assert ld.done and ld.host_pages == [] and not ld.device_busy
        assert ld.outcome is self.expected(s), (ld, ld.outcome, s.cancelled, s.read, s.copy_failed)
        got = [self.page(p) for p in ld.device_pages]
        if ld.outcome in (LoadOutcome.LOADED, LoadOutcome.PARTIAL):
            n = ld.pages_loaded
            assert s.read is not None and n == s.read[0]
            assert got == s.host[:n] + s.old[n:], f"{ld!r}: wrong bytes in its device pages"
        elif not (s.cancelled and s.submitted):
            assert got == s.old, f"{ld!r} ended {ld.outcome} but a device page was written"
        else:  # cancelled while its copy was in flight: only the pages it copied may differ
            assert s.read is not None
            assert got[s.read[0] :] == s.old[s.read[0] :]
        s.checked = True

    def settle(self) -> None:
        for s in self.seen.values():
            if s.ld.done and not s.checked:
                self.ended(s)

    # --- rules ------------------------------------------------------------------------

    @rule(n=st.integers(1, 3), rid=st.sampled_from(["a", "b"]))
    def begin(self, n: int, rid: str) -> None:
        free = [p for p in range(PAGES) if not self.device.is_allocated(p)]
        if len(free) < n:
            return
        pages = free[-n:][::-1]
        for p in pages:  # what the device page held before the load (the engine's old KV)
            self.device.tensor[p] = self.fresh(8).view(4, 2)
        old = [self.page(p) for p in pages]
        keys = [f"{rid}{self.stamp:08.0f}{i}".ljust(64, "0") for i in range(n)]
        host_free = self.host.free_pages
        ld = self.core.load_begin(rid, keys, pages)
        s = self.seen[ld.id] = _Seen(ld, old)
        if host_free < n:
            assert ld.done and ld.outcome is LoadOutcome.MISSED
            s.read = (0, False)
            self.ended(s)
        else:
            assert not ld.done and len(ld.host_pages) == n

    @rule(data=st.data())
    def bad_begin(self, data: st.DataObject) -> None:
        """A bad load (lengths differ, a page out of range or held) changes nothing."""
        before = self.core.statistics()
        held = [p for p in range(PAGES) if self.device.is_allocated(p)]
        bad = data.draw(
            st.sampled_from(
                [(["k" * 64] * 2, [0]), (["k" * 64], [PAGES])] + ([(["k" * 64], [held[0]])] if held else [])
            )
        )
        try:
            self.core.load_begin("x", *bad)
        except kvo.PageError:
            pass
        else:
            raise AssertionError(f"load_begin{bad} did not raise")
        assert self.core.statistics() == before

    @precondition(lambda self: any(s.ld.reading for s in self.seen.values()))
    @rule(data=st.data(), raised=st.booleans())
    def read_returns(self, data: st.DataObject, raised: bool) -> None:
        s = data.draw(st.sampled_from([s for s in self.seen.values() if s.ld.reading]))
        ld = s.ld
        n = data.draw(st.integers(0, len(ld.keys)))
        s.host = []
        for h in ld.host_pages[:n]:  # the store's checked bytes
            self.host.tensor[h] = self.fresh(8).view(4, 2)
            s.host.append(self.host.tensor[h].numpy().tobytes())
        s.read = (n, raised)
        done = self.core.load_read(ld, n, OSError("store down") if raised else None)
        assert all(d.done for d in done)
        self.settle()

    @precondition(lambda self: bool(self.seen))
    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        s = data.draw(st.sampled_from(list(self.seen.values())))
        if not s.ld.done:
            s.cancelled = True
        busy = s.ld.device_busy
        assert self.core.load_cancel(s.ld) == []
        assert s.ld.device_busy == busy, f"{s.ld!r}: a cancel never stops a copy in flight"
        self.settle()

    @precondition(lambda self: bool(self.backend.pending))
    @rule(data=st.data(), ok=st.booleans())
    def copy_ends(self, data: st.DataObject, ok: bool) -> None:
        t = data.draw(st.sampled_from(self.backend.pending))
        if t.direction == "h2d" and not ok:
            self.seen[t.lifecycle_id].copy_failed = not self.seen[t.lifecycle_id].cancelled
        if ok:
            self.backend.complete(t)
        else:
            self.backend.fail(t)
        self.core.complete(self.backend.take_completions())
        self.core.told(self.core.registry.take_released())
        self.settle()

    @precondition(lambda self: bool(self.backend.pending))
    @rule()
    def every_copy_ends_in_one_batch(self) -> None:
        self.backend.complete_all()
        self.core.told(self.core.complete(self.backend.take_completions()))
        self.settle()

    @rule(n=st.integers(4, 9))
    def admit(self, n: int) -> None:
        if self.device.free_pages < -(-n // 4):
            return
        self.lifecycles.append(self.core.admit("a", list(range(n)), stored=0))

    @precondition(lambda self: any(not lc.released for lc in self.lifecycles))
    @rule(data=st.data(), abort=st.booleans())
    def end_lifecycle(self, data: st.DataObject, abort: bool) -> None:
        lc = data.draw(st.sampled_from([lc for lc in self.lifecycles if not lc.released]))
        if lc.state is kvo.LifecycleState.FINISHING:
            abort = True
        self.core.told(self.core.abort(lc) if abort else self.core.finish(lc))

    # --- after every step -------------------------------------------------------------

    @invariant()
    def the_ledger_and_the_load_invariants_hold(self) -> None:
        assert not self.violations, self.violations
        self.core.check_invariants()
        pending = {t.lifecycle_id: t for t in self.backend.pending if t.direction == "h2d"}
        for lid, s in self.seen.items():
            ld = s.ld
            assert ld.device_busy == (lid in pending), ld
            if ld.done:
                assert lid not in pending and s.checked, f"{ld!r} is DONE with its copy pending"
            else:  # (the sim copies when a copy ends, and that delivers it: this load's is pending)
                assert [self.page(p) for p in ld.device_pages] == s.old, f"{ld!r}: a page written early"

    def teardown(self) -> None:
        if self.violations:  # already reported by the invariant: no second failure over it
            return
        core = self.core
        for s in self.seen.values():
            s.cancelled = s.cancelled or not s.ld.done  # close() cancels every live load
        core.told(core.close())
        for s in self.seen.values():
            if s.ld.reading:
                s.read = (0, False)
                core.load_read(s.ld, 0)
        self.backend.complete_all()
        core.told(core.complete(self.backend.take_completions()))
        self.settle()
        core.check_invariants()
        stats = core.statistics()
        assert (stats.loads_live, stats.host_pages_used, stats.device_pages_used) == (0, 0, 0), stats
        assert all(s.ld.done for s in self.seen.values())


TestLoadInterleavings = LoadInterleavings.TestCase
TestLoadInterleavings.settings = settings(settings.default, max_examples=300, stateful_step_count=40)
