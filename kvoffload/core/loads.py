"""Loads: the way back, store -> host pool -> the engine's device pages.

A :class:`Load` is one run of stored pages read back into device pages the engine
names, driven by the compiled load table (:mod:`kvoffload.lifecycle.load_table`,
declared in :mod:`kvoffload.lifecycle.load_spec`). :class:`Loads` is the one owner of
the live loads and of their host pages. The core's part is bookkeeping only:

1. :meth:`Loads.begin` allocates the load's host pages and returns it in READING;
   whoever reads the store (the driver's writer thread, or a remote worker) fills
   ``load.host_pages[i]`` with the page stored under ``load.keys[i]`` - checked bytes
   only, stopping at the first missing or corrupt one (F38);
2. :meth:`Loads.read` takes the read's result: the host pages past the pages read go
   back, and ONE ``"h2d"`` :class:`~kvoffload.abc.Transfer` of the pages read is handed
   to the mover (the core's ``accept``, the same sink the offload chunks use): COPYING;
3. the copy's completion comes through ``OffloadCore.complete`` (:meth:`Loads.complete`):
   DONE, LOADED or PARTIAL (FAILED on a copy error).

The engine may take its device pages back at any time (:meth:`Loads.cancel`): the load
is CANCELLING until the read returns or the copy completes, then DONE (CANCELLED);
nothing is submitted for it after the cancel. Every load that reaches DONE is listed
once by :meth:`Loads.take` (``OffloadCore.take_loads``), whichever call finished it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from kvoffload.abc import Completion, Transfer
from kvoffload.core.lifecycle import Waker
from kvoffload.core.stats import Counters
from kvoffload.errors import ConfigError, InvariantViolation, KVOffloadError, PageError
from kvoffload.lifecycle.load_spec import LoadOutcome, LoadState
from kvoffload.lifecycle.load_table import LOAD_EVENT_INDEX, LOAD_EVENT_NAMES, LOAD_OUTCOMES, LOAD_TABLE
from kvoffload.pools import page_ids

if TYPE_CHECKING:
    from kvoffload.core.events import Events
    from kvoffload.core.registry import Registry
    from kvoffload.pools import DevicePool, EnginePages, HostPool

__all__ = ["Load", "Loads"]

_STATES = tuple(LoadState)
_READING, _COPYING, _CANCELLING, _DONE = (s.value for s in _STATES)
_HOST_FULL = LOAD_EVENT_INDEX["host_full"]
_READ_OK = LOAD_EVENT_INDEX["read_ok"]
_READ_MISSED = LOAD_EVENT_INDEX["read_missed"]
_READ_FAILED = LOAD_EVENT_INDEX["read_failed"]
_COPY_DONE = LOAD_EVENT_INDEX["copy_done"]
_COPY_FAILED = LOAD_EVENT_INDEX["copy_failed"]
_CANCEL = LOAD_EVENT_INDEX["cancel"]


class Load:
    """One load: the pages stored under ``keys`` read back into ``device_pages``.

    Made by ``OffloadCore.load_begin`` (never by the caller); every field is written by
    the core's :class:`Loads` room only, on the core's owner thread, and read by anyone
    through the read-only properties. ``waker`` is the driver's slot: its ``set()`` is
    called once, when the load reaches DONE.

    Invariant (the load path's promise, F38): a device page of a load is written only by
    its one h2d copy, which is submitted only on READING -> COPYING (``read_ok``),
    never after a cancel; its host pages are freed exactly once, only when no read and
    no copy touches them; after DONE nothing touches any of its pages.
    """

    __slots__ = (
        "_error",
        "_host",
        "_loaded",
        "_outcome",
        "_reading",
        "_reason",
        "_s",
        "_transfer",
        "device_pages",
        "first_page",
        "id",
        "keys",
        "rid",
        "tag",
        "waker",
    )

    def __init__(
        self, lid: int, rid: Any, tag: Any, keys: list[str], device_pages: list[int], first_page: int
    ) -> None:
        # Plain data, fixed at begin (read as attributes; never rebound).
        self.id = lid
        self.rid = rid
        self.tag = tag
        self.keys = keys
        self.device_pages = device_pages
        self.first_page = first_page
        # _s: the LoadState's value; changed only by Loads.fire (one table step).
        self._s = _READING
        # _host: the host pages it holds, one per key until the read returns, then one
        # per page read until the copy completes; [] once returned (at DONE).
        # Invariant: self._s != DONE or self._host == []
        self._host: list[int] = []
        # _reading: the store read may still write its host pages (READING, or
        # CANCELLING from READING). Invariant: self._reading -> self._s in (READING, CANCELLING)
        self._reading = True
        # _transfer: its h2d copy while in flight (COPYING, or CANCELLING from COPYING).
        # Invariant: self._transfer is None or self._s in (COPYING, CANCELLING)
        # Invariant: not (self._reading and self._transfer is not None)
        self._transfer: Transfer | None = None
        # _loaded: leading pages whose bytes landed in device pages (set at DONE).
        self._loaded = 0
        self._outcome: LoadOutcome | None = None
        self._error: BaseException | None = None
        self._reason: str | None = None
        self.waker: Waker | None = None

    @property
    def state(self) -> LoadState:
        """Where the load is (READING, COPYING, CANCELLING, DONE)."""
        return _STATES[self._s]

    @property
    def outcome(self) -> LoadOutcome | None:
        """How it ended: None until DONE."""
        return self._outcome

    @property
    def done(self) -> bool:
        """Whether it reached DONE (nothing touches any of its pages any more)."""
        return self._s == _DONE

    @property
    def host_pages(self) -> list[int]:
        """The host pages it holds (a store read fills ``host_pages[i]`` with the page
        stored under ``keys[i]``); ``[]`` once returned. A copy: changing it changes nothing."""
        return list(self._host)

    @property
    def pages_loaded(self) -> int:
        """Leading pages of ``keys`` whose bytes are now in their device pages (final at
        DONE: ``len(keys)`` for LOADED, fewer for PARTIAL, 0 otherwise)."""
        return self._loaded

    @property
    def device_busy(self) -> bool:
        """Whether a copy may still write its device pages: the engine must not reuse
        them while True (it stays True after a cancel until the copy completed)."""
        return self._transfer is not None

    @property
    def reading(self) -> bool:
        """Whether the store read may still write its host pages."""
        return self._reading

    @property
    def transfer(self) -> Transfer | None:
        """Its h2d copy while in flight, else None."""
        return self._transfer

    @property
    def error(self) -> BaseException | None:
        """What failed it (the read's or the copy's error), else None."""
        return self._error

    @property
    def reason(self) -> str | None:
        """Why it ended without loading every page (missing, corrupt, no host pages,
        cancelled, failed), else None."""
        return self._reason

    def __repr__(self) -> str:
        return f"<Load #{self.id} ({self.rid!r}) {self.state.name} {len(self.keys)} page(s)>"


class Loads:
    """The live loads of one core: their host pages, their h2d copies in flight, the
    one table step, and the loads that reached DONE (see the module doc).

    ``accept()`` returns the mover's submit (the core's ``accept`` slot, read at each
    submit); ``take_id()`` draws an id from the lifecycles' own numbering, so a load's
    id is unique among the core's live loads and lifecycles (a completion finds its
    issuer by that id, F1). Called from the core's owner thread only."""

    def __init__(
        self,
        counters: Counters,
        host_pool: HostPool,
        device_pool: DevicePool | EnginePages,
        registry: Registry,
        events: Events,
        accept: Callable[[], Callable[[Transfer], None]],
        page_bytes: int,
    ) -> None:
        self.counters = counters
        self.host_pool = host_pool
        self.device_pool = device_pool
        self.registry = registry
        self.events = events
        self.accept = accept
        self.page_bytes = page_bytes
        # live: loads begun and not DONE, by id.
        # Invariant: all(ld._s != DONE for ld in self.live.values())
        self.live: dict[int, Load] = {}
        # copying: the h2d transfers in flight, by transfer id -> their load.
        # Invariant: all(ld._transfer.id == tid for tid, ld in self.copying.items())
        self.copying: dict[int, Load] = {}
        # device: device page -> the id of the live load that names it.
        # Invariant: set(self.device) == {p for ld in self.live.values() for p in ld.device_pages}
        self.device: dict[int, int] = {}
        # finished: loads that reached DONE since the last take(), in that order.
        self.finished: list[Load] = []
        # next_seq: the seq of the next h2d transfer (its own numbering, beside the chunks').
        self.next_seq = 0
        # owned: kvoffload's own device pool (owned mode): a live load holds its device
        # pages there (taken at begin, returned at DONE); engine-owned mode: the engine's.
        self.owned = not hasattr(device_pool, "shared_count")

    # --- begin --------------------------------------------------------------------------

    def begin(
        self, rid: Any, keys: Sequence[str], device_pages: Any, *, tag: Any = None, first_page: int = 0
    ) -> Load:
        """Begin a load of the pages stored under ``keys`` into ``device_pages`` (one
        each, in order), and return it in READING with ``len(keys)`` host pages held.

        When the host pool cannot hold them the load ends at once, MISSED (``reason``
        says why), nothing held: that is a miss the engine recomputes, never an error.
        Raises (nothing held, nothing changed) :class:`~kvoffload.ConfigError` for keys
        that are not a list of strings or a bad ``first_page``,
        :class:`~kvoffload.PageError` when ``len(keys) != len(device_pages)``, for no
        page at all, for a device page out of range or named twice, held by a live
        lifecycle for itself (a page it may copy from: engine-owned mode; owned mode:
        any page kvoffload's pool handed out: the load then holds its pages there until
        DONE, so no admit takes them), or named by another live load, and
        :class:`~kvoffload.KVOffloadError` once the core is closing."""
        if self.registry.closing:
            raise KVOffloadError("the manager is closed: no load can begin")
        if not isinstance(keys, (list, tuple)) or not all(type(k) is str for k in keys):
            raise ConfigError(f"keys must be a list of page keys (str), got {keys!r:.80}")
        if type(first_page) is not int or first_page < 0:
            raise ConfigError(
                f"first_page must be an int >= 0 (the page index of keys[0]), got {first_page!r}"
            )
        keys = list(keys)
        pages = page_ids(device_pages, "device_pages")
        self.check_pages(keys, pages)
        ld = Load(self.registry.take_id(), rid, tag, keys, pages, first_page)
        self.counters.loads_begun += 1
        host = self.host_pool.try_allocate(len(keys))
        if host is None:
            ld._reading = False
            ld._reason = (
                f"the host pool has {self.host_pool.free_pages} free page(s); the load needs {len(keys)}"
            )
            self.fire(ld, _HOST_FULL, LoadOutcome.MISSED)
            return ld
        if self.owned:  # kvoffload's own pool: the load holds its pages (no admit takes them)
            self.device_pool.take_pages(pages)  # type: ignore[union-attr]
        ld._host = host
        self.live[ld.id] = ld
        for p in pages:
            self.device[p] = ld.id
        return ld

    def check_pages(self, keys: list[str], pages: list[int]) -> None:
        """Raise :class:`~kvoffload.PageError` unless ``pages`` can take ``keys``' pages
        (see :meth:`begin`); changes nothing."""
        if len(keys) != len(pages):
            raise PageError(
                f"a load of {len(keys)} key(s) into {len(pages)} device page(s): one page per key"
            )
        if not pages:
            raise PageError("a load needs at least one page (keys and device_pages are empty)")
        pool = self.device_pool
        n = pool.n_pages
        shared = getattr(pool, "shared_count", None)
        seen: set[int] = set()
        for p in pages:
            if not 0 <= p < n:
                raise PageError(f"device page {p} is out of range: the device pool has {n} pages")
            if p in seen:
                raise PageError(f"device page {p} is named twice: a load writes each page once")
            if p in self.device:
                raise PageError(f"device page {p} is named by live load #{self.device[p]}")
            if pool.is_allocated(p) and (shared is None or not shared(p)):
                raise PageError(
                    f"device page {p} is held by a live lifecycle that may copy from it; a load "
                    "writes only pages no lifecycle holds for itself"
                )
            seen.add(p)

    # --- events in ----------------------------------------------------------------------

    def read(self, ld: Load, n_ok: int, error: BaseException | None = None) -> list[Load]:
        """The store read of ``ld`` returned: its first ``n_ok`` host pages hold checked
        bytes (the page stored under each key), or it raised ``error``. Cancelled
        meanwhile: DONE, CANCELLED. ``error``: DONE, FAILED. ``n_ok == 0``: DONE,
        MISSED. Else the host pages past ``n_ok`` go back and one h2d copy of the first
        ``n_ok`` is submitted: COPYING (a mover that refuses it fails the load).
        Returns the loads that reached DONE. Raises :class:`~kvoffload.KVOffloadError`
        (nothing changed) when ``ld`` is not this core's, or its read already returned,
        and :class:`~kvoffload.ConfigError` for ``n_ok`` not in ``0..len(keys)``."""
        if self.live.get(ld.id) is not ld or not ld._reading:
            raise KVOffloadError(f"{ld!r}: load_read() of a load whose read is not outstanding")
        if type(n_ok) is not int or not 0 <= n_ok <= len(ld.keys):
            raise ConfigError(f"n_ok must be an int in 0..{len(ld.keys)} (pages read), got {n_ok!r}")
        mark = len(self.finished)
        ld._reading = False
        if ld._s == _CANCELLING:
            e = _READ_FAILED if error is not None else _READ_MISSED if n_ok == 0 else _READ_OK
            self.fire(ld, e, LoadOutcome.CANCELLED)
        elif error is not None:
            ld._error = error
            ld._reason = f"the store read raised {error!r}"
            self.fire(ld, _READ_FAILED, LoadOutcome.FAILED)
        elif n_ok == 0:
            ld._reason = f"the first page ({ld.keys[0][:16]}...) is missing or corrupt in the store"
            self.fire(ld, _READ_MISSED, LoadOutcome.MISSED)
        else:
            self.copy(ld, n_ok)
        return self.finished[mark:]

    def copy(self, ld: Load, n_ok: int) -> None:
        """READING -> COPYING: return the host pages past ``n_ok``, submit the one h2d
        copy of the others (the only place a load's copy is made)."""
        assert ld._s == _READING and ld._transfer is None
        taken = self.taken(ld)
        if taken is not None:  # the engine handed a page to a lifecycle meanwhile: never copy
            ld._reason = f"device page {taken} was handed to a live lifecycle while the load read"
            ld._error = PageError(ld._reason)
            self.fire(ld, _READ_FAILED, LoadOutcome.FAILED)
            return
        host = ld._host
        if n_ok < len(host):
            self.host_pool.free(host[n_ok:])
            ld._host = host = host[:n_ok]
        now = self.events.clock()
        t = Transfer(
            ld, ld.device_pages[:n_ok], host, ld.keys[:n_ok], 0, n_ok, now, 0, None, True, direction="h2d"
        )
        t.seq = self.next_seq
        try:
            self.accept()(t)
        except Exception as e:  # the mover refused it: nothing copies; the load failed
            ld._error = e
            ld._reason = f"the mover refused the host->device copy: {e!r}"
            self.fire(ld, _READ_OK, None)  # the step to COPYING, then the copy's failure
            self.fire(ld, _COPY_FAILED, LoadOutcome.FAILED)
            return
        self.next_seq += 1
        ld._transfer = t
        self.copying[t.id] = ld
        self.counters.load_pages_inflight += n_ok
        self.fire(ld, _READ_OK, None)

    def taken(self, ld: Load) -> int | None:
        """A device page of ``ld`` a live lifecycle now holds for itself (engine-owned
        mode: the engine handed it over while the load read), else None."""
        if self.owned:
            return None  # the load holds its pages in kvoffload's pool
        pool = self.device_pool
        shared = getattr(pool, "shared_count")  # noqa: B009 - EnginePages only
        for p in ld.device_pages:
            if pool.is_allocated(p) and not shared(p):
                return p
        return None

    def cancel(self, ld: Load) -> list[Load]:
        """The engine takes ``ld``'s device pages back: READING or COPYING -> CANCELLING
        (DONE when the read returns or the copy completes; ``device_busy`` stays True
        until then); DONE: nothing. Nothing is submitted for it after this call.
        Returns the loads that reached DONE."""
        if ld._s == _DONE:
            return []
        if self.live.get(ld.id) is not ld:
            raise KVOffloadError(f"{ld!r} is not a live load of this manager")
        if ld._s != _CANCELLING:
            ld._reason = "cancelled: the engine took its device pages back"
            self.fire(ld, _CANCEL, None)
        return []  # (a cancel only ends a load when its read or copy returns)

    def complete(
        self, batch: Sequence[Completion], others: Callable[[Sequence[Completion], float], None], now: float
    ) -> None:
        """Apply ``batch`` in order: the completions of h2d copies here, each run of the
        others (offload chunks) by ``others`` - so each is applied as it would be alone."""
        copying = self.copying
        run: list[Completion] = []
        for c in batch:
            if c[0] in copying:
                if run:
                    others(run, now)
                    run = []
                self.copied(copying.pop(c[0]), c[1], now)
            else:
                run.append(c)
        if run:
            others(run, now)

    def copied(self, ld: Load, error: BaseException | None, now: float) -> None:
        """``ld``'s h2d copy completed (``error`` None) or failed: DONE."""
        t = ld._transfer
        assert t is not None and ld._s in (_COPYING, _CANCELLING)
        t.completed_at = now
        t.error = error
        ld._transfer = None
        self.counters.load_pages_inflight -= len(t.device_pages)
        if ld._s == _CANCELLING:
            self.fire(ld, _COPY_DONE if error is None else _COPY_FAILED, LoadOutcome.CANCELLED)
        elif error is not None:
            ld._error = error
            ld._reason = f"the host->device copy failed: {error!r}"
            self.fire(ld, _COPY_FAILED, LoadOutcome.FAILED)
        else:
            n = len(t.device_pages)
            ld._loaded = n
            if n < len(ld.keys):
                ld._reason = f"page {n} of {len(ld.keys)} (key {ld.keys[n][:16]}...) is missing or corrupt"
            self.fire(ld, _COPY_DONE, LoadOutcome.LOADED if n == len(ld.keys) else LoadOutcome.PARTIAL)

    def close(self) -> list[Load]:
        """The core is closing: every live load is cancelled (those whose read or copy
        is still out end when it returns). Returns the loads that reached DONE."""
        for ld in list(self.live.values()):
            self.cancel(ld)
        return []

    # --- the one table step -------------------------------------------------------------

    def fire(self, ld: Load, e: int, outcome: LoadOutcome | None) -> None:
        """Apply event ``e`` to ``ld``: one step of the load table, the only one. A step
        into DONE records ``outcome`` (one the declaration allows for that step), returns
        the host pages, forgets its device pages and lists it in ``finished``."""
        s = ld._s
        dest = LOAD_TABLE[s][e]
        if dest < 0:
            raise InvariantViolation(f"{ld!r}: {LOAD_EVENT_NAMES[e]} is illegal in {_STATES[s].name}")
        if dest != _DONE:
            ld._s = dest
            return
        allowed = LOAD_OUTCOMES[s][e]
        if outcome not in allowed:
            raise InvariantViolation(
                f"{ld!r}: {LOAD_EVENT_NAMES[e]} from {_STATES[s].name} cannot end {outcome}"
            )
        assert not ld._reading and ld._transfer is None, "a load ended while its pages are touched"
        ld._s = dest
        ld._outcome = outcome
        if outcome is not LoadOutcome.LOADED and outcome is not LoadOutcome.PARTIAL:
            ld._loaded = 0
        if ld._host:
            self.host_pool.free(ld._host)
            ld._host = []
        if self.live.pop(ld.id, None) is not None:
            device = self.device
            for p in ld.device_pages:
                if device.get(p) == ld.id:
                    del device[p]
            if self.owned:
                self.device_pool.free(ld.device_pages)
        self.count(ld, outcome)
        self.finished.append(ld)
        if ld.waker is not None:
            ld.waker.set()

    def count(self, ld: Load, outcome: LoadOutcome) -> None:
        c = self.counters
        if outcome is LoadOutcome.LOADED:
            c.loads_loaded += 1
        elif outcome is LoadOutcome.PARTIAL:
            c.loads_partial += 1
        elif outcome is LoadOutcome.MISSED:
            c.loads_missed += 1
        elif outcome is LoadOutcome.FAILED:
            c.loads_failed += 1
        else:
            c.loads_cancelled += 1
        c.pages_loaded += ld._loaded
        if outcome is not LoadOutcome.CANCELLED:
            c.load_pages_missed += len(ld.keys) - ld._loaded

    def take(self) -> list[Load]:
        """The loads that reached DONE since the last call (from any call: begin, read,
        cancel, a completion), each handed over once: what the drivers drain."""
        out = self.finished
        if out:
            self.finished = []
        return out

    # --- reading ------------------------------------------------------------------------

    @property
    def host_held(self) -> int:
        """Host pages the live loads hold."""
        return sum(len(ld._host) for ld in self.live.values())
