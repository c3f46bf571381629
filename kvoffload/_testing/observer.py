"""What the property suite checks from outside the core, after every step.

The observer sees what a user could see: the lifecycles ``admit`` returned, the
transfers handed to the backend, the page pools, and what the test itself did to each
lifecycle (finished, aborted, which copies it completed or failed). It keeps its own
model and derives from it, independently of the compiled table, what must hold:

- each lifecycle's state, from the spec's meaning of the states (PENDING: no copy in
  flight; OFFLOADING: copies in flight, still decoding; FINISHING: finished or
  aborted, copies in flight or deferred; RELEASED: finished or aborted, none left);
- each lifecycle's in-flight count equals the backend's pending transfers it issued
  (a completion delivered to the wrong lifecycle breaks two counts: F1);
- the keys of every delivered transfer equal an independent recomputation of the
  chain over the tokens that lifecycle committed (F11), and the bytes every copy moved
  are the KV written for those tokens (F3/F4; when ``check_bytes``);
- every device free happens once and never under a pending copy (F3/F4/F8);
- no holes (F33, F9): a lifecycle's chunks are contiguous, each starting where the last
  one it sent ended; no chunk is submitted for it once one of its copies or storage
  writes failed (a delivered failure); and what the store took for it is contiguous
  from its first offloaded page (a chunk stored only right after the last one stored);
- per page (F34): once every storage write finished, ``pages_stored`` is exactly the
  pages the store confirmed before the first page of their write it did not, and
  ``pages_store_unreachable`` those it confirmed after one - every page counted stored
  is one the store took, every page the store took was counted or is after a hole;
- each released lifecycle's ``pages_lost`` is what it should have offloaded and did
  not - its whole pages from the first failed copy or write, or from the first page it
  never sent, on (0 for an aborted one, 0 while live) - and ``pages_lost`` in the
  statistics is their sum;
- ``finish`` sends every whole page not yet sent, unless that call counted a drop (a
  full host pool, a refusal; F9) or the rest waits for host pages (F12);
- outcomes: ABORTED when aborted, FAILED when one of its copies failed, else COMPLETED
  (a refused tail may also make it FAILED);
- a dropped, released lifecycle is garbage (F2).

It holds no strong reference to a lifecycle. No listener is needed, so the drivers run
their production delivery path; when the machine attaches one (``events=True``) every
lifecycle's transition log is also replayed on the ``transitions`` oracle of the spec.
"""

from __future__ import annotations

import gc
import hashlib
import struct
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvoffload.backends._sim import SimBackend
from kvoffload.core.lifecycle import LifecycleId
from kvoffload.errors import BackendError
from kvoffload.lifecycle.spec import LifecycleState, Outcome
from kvoffload.pools import DevicePool, HostPool

if TYPE_CHECKING:
    from kvoffload.abc import Transfer
    from kvoffload.config import OffloadConfig
    from kvoffload.core.lifecycle import Lifecycle
    from kvoffload.core.offload import OffloadCore

__all__ = ["KV_SHAPE", "CheckedSimBackend", "Observer", "reference_keys"]

#: A token's KV in the checked pools: (lifecycle id, position, token id) as int32, so a
#: page copied from the wrong place, or after it was reused, is never the expected bytes.
KV_SHAPE = (3,)

_P, _O, _F, _R = (
    LifecycleState.PENDING,
    LifecycleState.OFFLOADING,
    LifecycleState.FINISHING,
    LifecycleState.RELEASED,
)


def reference_keys(tokens: Sequence[int], page_size: int, seed: str | None = None) -> list[str]:
    """The SGLang HiCache chain over the whole pages of ``tokens``, from ``seed`` (the
    root when ``None``).

    Written with hashlib and struct only, independently of :mod:`kvoffload.keys`:
    ``key(page) = sha256(previous key bytes + tokens as uint32 little-endian)``.
    """
    keys: list[str] = []
    prev = bytes.fromhex(seed) if seed else b""
    for off in range(0, len(tokens) - len(tokens) % page_size, page_size):
        h = hashlib.sha256(prev)
        h.update(struct.pack(f"<{page_size}I", *tokens[off : off + page_size]))
        prev = h.digest()
        keys.append(prev.hex())
    return keys


def _collect_until_dead(ref: weakref.ReferenceType[Any]) -> bool:
    """Whether ``ref``'s object is garbage: young generations first (cheap), then all.

    A caller's own reference cycles (an exception that names the lifecycle, caught in a
    task) are collectable garbage; only a live strong reference keeps it.
    """
    for generation in (0, 1, 2):
        if ref() is None:
            return True
        gc.collect(generation)
    return ref() is None


@dataclass(eq=False)
class _LcModel:
    """What the observer knows about one lifecycle, by its id (never by rid)."""

    lid: int
    rid: Any
    ref: weakref.ReferenceType[Lifecycle]
    # tokens: every token committed so far (prompt, then extends), as the caller sent them.
    tokens: list[int] = field(default_factory=list)
    # ended: finish() or abort() was accepted; aborted: abort() was.
    ended: bool = False
    aborted: bool = False
    # failed: a copy of this lifecycle was failed by the test; refused: a chunk of it
    # was refused by the backend outside a caller's call (its tail may be lost).
    failed: bool = False
    refused: bool = False
    # reported: on_released was called for it (exactly once, at RELEASED).
    reported: bool = False
    # sent: tokens covered by submitted chunks (or taken as stored at admit).
    sent: int = 0
    # failed_at: the first token of its earliest chunk a test failed (signalled), or of
    # its earliest storage write that failed; None while neither happened.
    failed_at: int | None = None
    # hole: failed_at as the core must know it - set when the failure was delivered (a
    # copy) or written (a store write); from then on no chunk of it may be submitted.
    hole: int | None = None
    # stored_end: where the run of its chunks the store took ends (starts at sent at admit).
    stored_end: int = 0
    # reach: once released (not aborted), where the chain it offloaded ends (for the
    # statistics' pages_lost: a write that fails later moves it back).
    reach: int | None = None
    # log: (trigger, from, to, copying, deferred) of every transition (events mode only).
    log: list[tuple[str, str, str, bool, bool]] = field(default_factory=list)
    replayed: int = 0
    oracle: Any = None
    dropped: bool = False


@dataclass(eq=False)
class _Submitted:
    """A transfer as it was at submit time."""

    transfer: Transfer
    issuer: int
    keys: list[str]
    device_pages: list[int]
    signalled: bool = False


class _WatchedDevicePool(DevicePool):
    """A device pool that reports every free to the observer before doing it."""

    observer: Observer | None = None

    def free(self, pages: Any) -> None:
        pages = list(pages)
        if self.observer is not None:
            self.observer.on_device_free(self, pages)
        super().free(pages)


class CheckedSimBackend(SimBackend):
    """A :class:`SimBackend` whose pools hold int32 ``KV_SHAPE`` rows and that tells
    its observer about every submit, refusal and completion. While ``refuse`` is set,
    ``submit`` refuses (a device that cannot start a copy)."""

    def __init__(self, observer: Observer) -> None:
        super().__init__()
        self.observer = observer
        self.refuse = False

    def create_host_pool(
        self, n_pages: int, page_shape: Sequence[int], dtype: str, *, zero: bool = False, buffer: Any = None
    ) -> HostPool:
        """Engine-owned mode: the host pool, zero-filled (an unwritten page reads as zeros)."""
        host = HostPool.new(n_pages, page_shape, dtype, zero=True)
        self.observer.host = host
        return host

    def create_pools(self, config: OffloadConfig, host_buffer: Any = None) -> tuple[DevicePool, HostPool]:
        assert config.device_pages is not None
        args = (config.page_size, config.kv_shape, config.dtype)
        device = _WatchedDevicePool.create(config.device_pages, *args)
        device.observer = self.observer
        self.observer.device = device
        host = HostPool.new(config.host_pages, (config.page_size, *config.kv_shape), config.dtype, zero=True)
        self.observer.host = host
        return device, host

    def submit(self, transfer: Transfer) -> None:
        if self.refuse:
            self.observer.on_refused(transfer)
            raise BackendError("simulated: the copy engine refused the submission")
        super().submit(transfer)
        self.observer.on_submit(transfer)

    def complete(self, transfer: Transfer) -> None:
        if self.observer.check_bytes:
            super().complete(transfer)
        else:  # the core alone: no bytes to move, only the completion
            self._take(transfer)
            self._signal((transfer.id, None))
        self.observer.on_signal(transfer, ok=True)

    def fail(self, transfer: Transfer, error: BaseException | None = None) -> None:
        super().fail(transfer, error)
        self.observer.on_signal(transfer, ok=False)


class Observer:
    """The outside-world model and checks of the property suite.

    Call :meth:`attach` once the manager (or core) exists, :meth:`on_admit` /
    :meth:`on_extend` after each successful admit / extend (they also write the tokens'
    KV into the device pages, as the engine would, when ``check_bytes``),
    :meth:`on_end` after a successful finish or abort, and :meth:`check` after every
    step, once every signalled completion was delivered.
    """

    def __init__(self, *, check_bytes: bool = True) -> None:
        self.core: OffloadCore | None = None
        self.check_bytes = check_bytes
        self.device: DevicePool | None = None
        self.host: HostPool | None = None
        self.page_size = 1
        # lcs: every lifecycle admitted and not yet collected, by lifecycle id.
        self.lcs: dict[int, _LcModel] = {}
        # lost: whole pages of released, not aborted lifecycles never sent (pages_lost).
        self.lost = 0
        # transfers: submitted and not yet checked after delivery, by transfer id.
        self.transfers: dict[int, _Submitted] = {}
        # violations: what went wrong inside a call, reported at the next check.
        self.violations: list[str] = []
        self.events = False
        # engine_kv: the engine's KV tensors in engine-owned mode (else None).
        self.engine_kv: list[Any] | None = None
        self._oracle_factory: Callable[[], Any] | None = None
        # seen: what happened in this run (for hypothesis' coverage statistics).
        self.seen: set[str] = set()
        # copied: (lifecycle id, first token, tokens) of each chunk a test completed, by
        # transfer id and by its host pages (what a store's put_pages names), for the
        # storage writes that follow.
        self.copied: dict[int, tuple[int, int, int]] = {}
        self.by_host: dict[tuple[int, ...], tuple[int, int, int]] = {}
        # puts: (host pages, which pages it took) of every put the store was asked for,
        # in order (the store appends, possibly on its writer thread; the check reads them).
        self.puts: list[tuple[tuple[int, ...], tuple[bool, ...]]] = []
        # confirmed: pages the store confirmed before the first page of their write it
        # did not (what pages_stored must count), and after it (pages_store_unreachable;
        # F34), over every write the store finished.
        self.confirmed = [0, 0]
        # gone: the models of collected lifecycles (with storage: their late writes).
        self.gone: dict[int, _LcModel] = {}
        # early: the first token of a prompt chunk submitted inside admit (before
        # on_admit), by lifecycle id.
        self.early: dict[int, int] = {}

    # --- wiring ----------------------------------------------------------------------

    def attach(self, core: OffloadCore, *, events: bool = False) -> None:
        """Observe ``core``. With ``events``, a listener records every transition for the
        oracle replay (it makes the core take its slow, event-building path)."""
        from kvoffload.lifecycle.table import oracle_machine

        self.core = core
        self.page_size = core.config.page_size
        self._oracle_factory = oracle_machine
        self.events = events
        if events:
            core.listeners.append(self._on_event)
            core.refresh_observed()

    def _on_event(self, name: str, fields: dict[str, Any]) -> None:
        assert self.core is not None
        if name != "lifecycle.transition":
            return
        self.seen.add(f"{fields['trigger']}: {fields['to']}")
        m = self.lcs.get(fields["lifecycle"])
        if m is None:  # the prompt chunk's submit, before admit returned
            return
        live = self.core.live.get(LifecycleId(m.lid))
        copying = live is not None and live.inflight > 0
        deferred = live is not None and live.deferred
        m.log.append((fields["trigger"], fields["from"], fields["to"], copying, deferred))

    # --- the engine's side ---------------------------------------------------------------

    def on_admit(self, lc: Lifecycle, prompt: Sequence[int]) -> None:
        """``lc`` was admitted with ``prompt``: record the tokens and write their KV."""
        base = self.early.pop(lc.id, lc.submitted)  # where its offload starts
        m = _LcModel(lc.id, lc.rid, weakref.ref(lc), tokens=list(prompt), sent=lc.submitted, stored_end=base)
        if self.events and lc.state is not _P:  # the prompt chunk's submit ran inside admit
            m.log.append(("submit", "PENDING", lc.state.name, lc.inflight > 0, lc.deferred))
        self.lcs[lc.id] = m
        self._write_kv(lc, 0, prompt)
        self.seen.add("admit")

    def on_extend(self, lc: Lifecycle, tokens: Sequence[int]) -> None:
        """``lc.extend(tokens)`` succeeded: record the tokens and write their KV."""
        m = self.lcs[lc.id]
        start = len(m.tokens)
        m.tokens.extend(tokens)
        self._write_kv(lc, start, tokens)

    def on_end(self, lc: Lifecycle, *, aborted: bool) -> None:
        """``lc.finish()`` (or ``abort()``) was accepted."""
        m = self.lcs[lc.id]
        m.ended = True
        m.aborted = m.aborted or aborted
        self.seen.add("abort" if aborted else "finish")

    def on_finished(self, lc: Lifecycle, *, dropped_before: int) -> None:
        """``lc.finish()`` was accepted; ``pages_dropped`` was ``dropped_before`` when it
        was called. The whole pages not yet sent went out (F12), or the call counted a
        drop (F9), or they wait for host pages: never a silent skip."""
        assert self.core is not None
        m = self.lcs[lc.id]
        whole = len(m.tokens) - len(m.tokens) % self.page_size
        if m.hole is not None:  # offload stopped at a hole: nothing more goes out (F33)
            return
        if m.sent < whole and not lc.deferred and self.core.counters.pages_dropped == dropped_before:
            self.violations.append(
                f"{lc!r} finished with tokens {m.sent}..{whole} (whole pages) neither sent, nor "
                "waiting for host pages, nor counted as dropped (F12)"
            )

    def on_released(self, lc: Lifecycle) -> None:
        """The driver (or core) said ``lc`` was released: once, and only at RELEASED."""
        m = self.lcs.get(lc.id)
        if m is None:
            self.violations.append(f"on_released({lc!r}) for a lifecycle admit never returned")
            return
        if m.reported:
            self.violations.append(f"on_released({lc!r}) called twice")
        if not lc.released:
            self.violations.append(f"on_released({lc!r}) called before RELEASED")
        elif not m.reported and not lc.aborted:  # its whole pages not offloaded are lost for good
            m.reach = self._reach(m)
            self.lost += (len(m.tokens) - m.reach) // self.page_size
        m.reported = True

    def on_closed(self) -> None:
        """The manager closed: every live lifecycle was aborted."""
        assert self.core is not None
        for m in self.lcs.values():
            lc = m.ref()
            if lc is not None and not m.ended:
                m.ended = m.aborted = True
            elif lc is not None and lc.aborted:
                m.aborted = True
        self.seen.add("close")

    def _write_kv(self, lc: Lifecycle, start: int, tokens: Sequence[int]) -> None:
        """The engine's forward pass: each token's KV into its device page. Owned mode:
        the pool's row is (lifecycle id, position, token id); engine-owned mode: the same
        row in the engine's first tensor and (token id, position, lifecycle id) in its
        second, so a page of the wrong tensor or in the wrong order shows up too."""
        if not tokens or not self.check_bytes:
            return
        import torch

        ps = self.page_size
        pos = range(start, start + len(tokens))
        pages = torch.tensor([lc.device_pages[p // ps] for p in pos], dtype=torch.long)
        slots = torch.tensor([p % ps for p in pos], dtype=torch.long)
        rows = torch.tensor([[lc.id, p, t] for p, t in zip(pos, tokens, strict=True)], dtype=torch.int32)
        if self.engine_kv is not None:
            self.engine_kv[0][pages, slots] = rows
            self.engine_kv[1][pages, slots] = rows.flip(1)
            return
        assert self.device is not None
        self.device.tensor[pages, slots] = rows.to(self.device.tensor.dtype)

    def expected_rows(self, lid: int, first: int, n: int) -> Any:
        """The host pages tokens ``first..first+n`` of lifecycle ``lid`` must hold, as
        int32 (owned: ``(pages, page_size, 3)``; engine-owned: ``(pages, 2 * page_size * 3)``,
        the first tensor's page then the second's)."""
        import torch

        toks = self.lcs[lid].tokens[first : first + n]
        rows = torch.tensor([[lid, first + i, t] for i, t in enumerate(toks)], dtype=torch.int32)
        rows = rows.reshape(n // self.page_size, self.page_size, 3)
        if self.engine_kv is None:
            return rows
        return torch.cat([rows.flatten(1), rows.flip(2).flatten(1)], dim=1)

    def on_engine_free(self, pages: Sequence[int]) -> None:
        """Engine-owned mode: the engine frees (and may reuse) ``pages`` after
        ``on_released``; no copy may still read them (F3/F4, the engine's side)."""
        reading = {p: s for s in self.transfers.values() if not s.signalled for p in s.device_pages}
        for p in pages:
            if p in reading:
                self.violations.append(f"the engine freed page {p} while {reading[p].transfer!r} reads it")

    # --- the backend's side ----------------------------------------------------------------

    def on_submit(self, t: Transfer) -> None:
        lid = t.lifecycle_id
        self.transfers[t.id] = _Submitted(t, lid, list(t.keys), list(t.device_pages))
        m = self.lcs.get(lid)
        if m is None:
            self.early.setdefault(lid, t.first_token)
        else:
            if t.first_token != m.sent:
                self.violations.append(
                    f"{t!r} starts at token {t.first_token}, but its lifecycle had sent up to "
                    f"{m.sent}: a hole in its chain (F9)"
                )
            if m.hole is not None:
                self.violations.append(
                    f"{t!r} was submitted after its lifecycle's chunk at token {m.hole} failed to copy "
                    "or to store: nothing after a hole can be reached (F33)"
                )
            m.sent = max(m.sent, t.first_token + t.n_tokens)
        # The issuer, by id: a lifecycle submits only while live (from admission on).
        lc = None if self.core is None else self.core.live.get(LifecycleId(lid))
        if lc is None and self.core is not None:
            self.violations.append(f"{t!r} was submitted for a lifecycle that is not live")
        elif lc is not None and not set(t.device_pages) <= set(lc.device_pages):
            self.violations.append(f"{t!r} was submitted reading device pages its lifecycle does not hold")
        self.seen.add("submit")

    def on_refused(self, t: Transfer) -> None:
        m = self.lcs.get(t.lifecycle_id)
        if m is not None:
            m.refused = True
        self.seen.add("refused")

    def on_signal(self, t: Transfer, *, ok: bool) -> None:
        """A test signalled ``t``: check the bytes the copy moved (F3/F4)."""
        s = self.transfers[t.id]
        s.signalled = True
        m = self.lcs[s.issuer]
        if not ok:
            m.failed = True
            if m.failed_at is None or t.first_token < m.failed_at:
                m.failed_at = t.first_token
            self.seen.add("fail")
            return
        self.seen.add("complete")
        if self.core is not None and self.core.has_storage:  # its write follows
            self._take_puts()  # the writes before it (settled), before its host pages are named again
            chunk = (s.issuer, t.first_token, t.n_tokens)
            self.copied[t.id] = chunk
            self.by_host[tuple(t.host_pages)] = chunk
        if self.check_bytes:
            assert self.host is not None
            import torch

            got = self.host.tensor[torch.tensor(t.host_pages, dtype=torch.long)]
            if self.engine_kv is not None:  # uint8 host pages: a page of each tensor, in order
                got = got.contiguous().view(torch.int32).view(len(t.host_pages), -1)
            want = self.expected_rows(s.issuer, t.first_token, t.n_tokens)
            if not torch.equal(got.to(torch.int32), want):
                self.violations.append(
                    f"{t!r}: the host pages do not hold the bytes its device pages held at submit "
                    "(a device page was freed and reused while the copy read it)"
                )

    # --- the store's side ------------------------------------------------------------------

    def on_write(self, tid: int, stored: bool | Sequence[bool]) -> None:
        """The store took (``stored``: a bool, or one flag per page, F34) or failed the
        write of transfer ``tid``'s chunk (the core machine's writer). A write the writer
        skipped (its chain broke, F33) is not a write: not reported."""
        chunk = self.copied.pop(tid, None)
        if chunk is None and isinstance(stored, bool):
            return
        flags = self._confirm(stored, 0 if chunk is None else chunk[2] // self.page_size)
        if chunk is not None:
            self._written(*chunk, flags)

    def on_put(self, host_pages: Sequence[int], stored: bool | Sequence[bool]) -> None:
        """A store was asked to put these host pages (a driver's writer) and took the
        pages flagged (``stored``: a bool for all, or one flag per page, F34): noted, and
        read at the next check (it may run on the writer's thread)."""
        flags = (bool(stored),) * len(host_pages) if isinstance(stored, bool) else tuple(stored)
        self.puts.append((tuple(host_pages), flags))

    def _confirm(self, stored: bool | Sequence[bool], n: int) -> tuple[bool, ...]:
        """One flag per page of a write of ``n`` pages; counted in ``confirmed``."""
        flags = (bool(stored),) * n if isinstance(stored, bool) else tuple(stored)
        reach = flags.index(False) if False in flags else len(flags)
        self.confirmed[0] += reach
        self.confirmed[1] += sum(flags[reach:])
        return flags

    def _forget(self, lid: int) -> None:
        """Lifecycle ``lid`` is garbage: its model goes; with storage it is kept aside,
        for a write of it that finishes later (its loss still counts, F33)."""
        m = self.lcs.pop(lid)
        if self.core is not None and self.core.has_storage:
            self.gone[lid] = m

    def _take_puts(self) -> None:
        """Apply the puts the store noted, each to the chunk whose host pages it named."""
        puts, self.puts = self.puts, []  # (the store appends to the new list from now on)
        for host_pages, stored in puts:
            flags = self._confirm(stored, len(host_pages))
            chunk = self.by_host.pop(host_pages, None)
            if chunk is not None:
                self._written(*chunk, flags)

    def _written(self, lid: int, first: int, n: int, flags: tuple[bool, ...]) -> None:
        """The store took the pages flagged of the chunk of ``n`` tokens at ``first``: the
        ones before the first it did not take are stored; the chain breaks there."""
        m = self.lcs.get(lid) or self.gone.get(lid)
        if m is None:
            return
        reach = flags.index(False) if False in flags else len(flags)
        partial = 0 < sum(flags) < len(flags)
        self.seen.add("stored" if reach == len(flags) else "store partial" if partial else "store failed")
        if reach:
            if first != m.stored_end:
                self.violations.append(
                    f"lifecycle #{lid}: tokens {first}..{first + reach * self.page_size} were stored, but "
                    f"its stored chain ends at {m.stored_end}: a hole in the store no lookup can pass (F33)"
                )
            m.stored_end = max(m.stored_end, first + reach * self.page_size)
        if reach == len(flags):
            return
        first += reach * self.page_size  # the hole: its first page not stored (F34)
        if m.failed_at is None or first < m.failed_at:
            m.failed_at = first
        if m.hole is None or first < m.hole:
            m.hole = first
        if m.reach is not None and first < m.reach:  # released: the loss grows (pages_lost)
            self.lost += (m.reach - first) // self.page_size
            m.reach = first

    def _reach(self, m: _LcModel) -> int:
        """Where the chain ``m``'s lifecycle offloaded ends: its first page not sent, or
        its first failed copy or write, whichever comes first."""
        return m.sent if m.failed_at is None else min(m.sent, m.failed_at)

    def expected_pages_lost(self, lc: Lifecycle) -> int:
        """What ``lc.pages_lost`` must be now: 0 while live or when aborted, else the
        whole pages from where its offloaded chain ends."""
        m = self.lcs[lc.id]
        if not lc.released or m.aborted:
            return 0
        return (len(m.tokens) - len(m.tokens) % self.page_size - self._reach(m)) // self.page_size

    def on_device_free(self, pool: DevicePool, pages: list[int]) -> None:
        """Every device free goes through here: never twice, never under a copy."""
        reading = {p: s for s in self.transfers.values() if not s.signalled for p in s.device_pages}
        for p in pages:
            if not pool.is_allocated(p):
                self.violations.append(f"device page {p} freed twice")
            if p in reading:
                self.violations.append(f"device page {p} freed while {reading[p].transfer!r} reads it")

    # --- the check -------------------------------------------------------------------------------

    def check(self, pending: Sequence[Transfer], *, delivered: bool = True) -> None:
        """Raise ``AssertionError`` naming every rule of the suite that does not hold.

        ``pending`` is the backend's in-flight list. ``delivered``: every signalled
        completion was delivered before this call (False once a closed manager stopped
        delivering; then the counts are checked against what was delivered).
        """
        core = self.core
        assert core is not None
        core.check_invariants()
        self._take_puts()
        problems = self.violations
        self.violations = []
        # The keys every completion carried equal an independent recomputation (F11).
        for tid in [tid for tid, s in self.transfers.items() if s.signalled and tid not in core.inflight]:
            problems.extend(self._delivered(self.transfers.pop(tid)))  # (no local keeps it: F2)
        inflight: dict[int, int] = {}
        for t in pending:
            inflight[t.lifecycle_id] = inflight.get(t.lifecycle_id, 0) + 1
        if not delivered:
            for s in self.transfers.values():
                if s.signalled:
                    inflight[s.issuer] = inflight.get(s.issuer, 0) + 1
        for lid, m in list(self.lcs.items()):
            lc = m.ref()
            if lc is None:
                self._forget(lid)
                continue
            n = inflight.get(lid, 0)
            if lc.inflight != n:
                problems.append(f"{lc!r} counts {lc.inflight} chunk(s) in flight, the backend has {n}")
            problems.extend(self._check_state(lc, m, n))
            if self.events:
                problems.extend(self._replay(lc, m))
            if lc.state is _R and m.dropped:
                del lc
                if _collect_until_dead(m.ref):
                    self._forget(lid)
                else:
                    problems.append(f"lifecycle #{lid} is RELEASED and dropped but still referenced (F2)")
        c = core.counters
        if not core.writes and [c.pages_stored, c.pages_store_unreachable] != self.confirmed:
            problems.append(  # every write finished: its pages were counted as the store took them (F34)
                f"pages_stored {c.pages_stored} and pages_store_unreachable {c.pages_store_unreachable}; "
                f"the store confirmed {self.confirmed[0]} page(s) before a hole in their write and "
                f"{self.confirmed[1]} after one"
            )
        if core.counters.pages_lost != self.lost:
            problems.append(
                f"pages_lost is {core.counters.pages_lost}; the pages never sent add up to {self.lost}"
            )
        if problems:
            raise AssertionError("; ".join(problems))

    def _check_state(self, lc: Lifecycle, m: _LcModel, n: int) -> list[str]:
        """The state the spec's meaning gives, from what the test did (not the table)."""
        state = lc.state
        # Decoding: OFFLOADING iff a copy is in flight. Ended: FINISHING until none is
        # in flight or deferred, then RELEASED.
        want = (_O if n else _P) if not m.ended else (_F if n or lc.deferred else _R)
        problems = []
        if state is not want:
            what = "ended" if m.ended else "decoding"
            problems.append(
                f"{lc!r} is {state.name}, but it is {what} with {n} copies in flight"
                f"{' and a deferred chunk' if lc.deferred else ''}: the spec says {want.name}"
            )
        if state is _R and not m.reported:
            problems.append(f"{lc!r} is RELEASED but on_released was never called for it")
        if state is _R:
            allowed = (
                {Outcome.ABORTED}
                if m.aborted
                else {Outcome.FAILED}
                if m.failed
                else {Outcome.COMPLETED, Outcome.FAILED}
                if m.refused
                else {Outcome.COMPLETED}
            )
            if lc.outcome not in allowed:
                problems.append(
                    f"{lc!r} ended {lc.outcome}; expected one of {sorted(o.name for o in allowed)}"
                )
            if lc.device_pages:
                problems.append(f"{lc!r} is RELEASED but holds device pages {lc.device_pages}")
        elif lc.outcome is not None:
            problems.append(f"{lc!r} is live with outcome {lc.outcome}")
        lost = self.expected_pages_lost(lc)
        if lc.pages_lost != lost:
            problems.append(
                f"{lc!r} says pages_lost={lc.pages_lost}; it should have offloaded {lost} more whole "
                "page(s) (never sent, or from a failed copy or write on)"
            )
        return problems

    def _delivered(self, s: _Submitted) -> list[str]:
        """``s`` was delivered: its keys are checked, and once a failure of its lifecycle
        was delivered the core knows the hole (no chunk may be submitted after it)."""
        m = self.lcs.get(s.issuer)
        if m is not None and m.failed_at is not None and (m.hole is None or m.failed_at < m.hole):
            m.hole = m.failed_at
        return self._check_delivered(s)

    def _check_delivered(self, s: _Submitted) -> list[str]:
        t = s.transfer
        ps = self.page_size
        first = t.first_token // ps
        want = reference_keys(self.lcs[s.issuer].tokens[: t.first_token + t.n_tokens], ps)[first:]
        if list(t.keys) != want or s.keys != want:
            return [f"{t!r} carries keys {t.keys} (at submit {s.keys}), the chain says {want}"]
        return []

    def _replay(self, lc: Lifecycle, m: _LcModel) -> list[str]:
        """Replay ``m``'s new transitions on the ``transitions`` oracle of the spec."""
        from transitions import MachineError

        if m.oracle is None:
            assert self._oracle_factory is not None
            m.oracle = self._oracle_factory()
        oracle = m.oracle
        problems: list[str] = []
        for trigger, src, dst, copying, deferred in m.log[m.replayed :]:
            if oracle.state != src:
                problems.append(f"{lc!r}: {trigger} from {src}, but the log was at {oracle.state}")
                break
            oracle.copying, oracle.deferred = copying, deferred
            try:
                ok = oracle.trigger(trigger)
            except MachineError as exc:
                problems.append(f"{lc!r}: {src} --{trigger}--> {dst} is not declared ({exc})")
                break
            if not ok or oracle.state != dst:
                problems.append(
                    f"{lc!r}: {src} --{trigger}--> {dst} with copying={copying}, deferred={deferred}; "
                    f"the spec says {oracle.state if ok else 'no guard holds'}"
                )
                break
        m.replayed = len(m.log)
        if not problems and oracle.state != lc.state.name:
            problems.append(f"{lc!r} is {lc.state.name} but its transition log ends at {oracle.state}")
        return problems

    def dropped(self, lc: Lifecycle) -> None:
        """The caller dropped its last reference to ``lc``."""
        self.lcs[lc.id].dropped = True
