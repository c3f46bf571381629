"""OffloadCore: the bookkeeping of every lifecycle, pure, synchronous and deterministic.

The core is what the property suite checks; the drivers above it only add waiting.
It imports no anyio, starts no thread, does no I/O and never calls a mover. In:
calls (``admit``, ``extend``, ``finish``, ``abort``), completions (``complete``), the
clock (``tick``) and finished storage writes (``write_done``). Out: copy jobs, handed
to the ``accept`` sink the driver gives it (a mover's submit, which may refuse by
raising and then nothing changed), storage write jobs (``take_writes``), and the
lifecycles each call released (its return value).

Every method is a plain ``def`` that runs to completion. Each event goes through the
compiled table (:mod:`kvoffload.lifecycle.table`); no transition lives only in an
``if`` chain. The rules of ARCHITECTURE.md are meant to hold after every call;
:meth:`check_invariants` checks the ledger's part of them (``kvoffload.core.ledger``),
and the property suite checks them all after every step of the schedules it draws.
"""

from __future__ import annotations

import time
import weakref
from _thread import get_ident
from array import array
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Mapping, MappingView, Sequence, Set
from typing import TYPE_CHECKING, Any, cast

from kvoffload.abc import Completion, Transfer, WriteChain, WriteJob
from kvoffload.config import OffloadConfig
from kvoffload.core.events import DEBUG, Listener, RateLimit, logger, notify_listeners, refresh_debug
from kvoffload.core.rows import DecodeRows
from kvoffload.core.stats import Counters, Statistics
from kvoffload.errors import (
    InvalidTokens,
    InvalidTransition,
    InvariantViolation,
    KVOffloadError,
    ManagerClosed,
    PageError,
    PoolExhausted,
)
from kvoffload.keys import TOKEN_TYPECODE, WIDE_TYPECODE, page_run_digests, validate_tokens
from kvoffload.lifecycle.core import EXTEND_SELF_LOOP, STATES, Lifecycle, LifecycleHost, LifecycleId
from kvoffload.lifecycle.spec import LifecycleState, Outcome
from kvoffload.lifecycle.table import EVENT_INDEX, EVENT_NAMES, TABLE
from kvoffload.pools import page_ids

if TYPE_CHECKING:
    from kvoffload.pools import DevicePool, EnginePages, HostPool

__all__ = ["OffloadCore"]

_EXTEND = EVENT_INDEX["extend"]
_SUBMIT = EVENT_INDEX["submit"]
_DONE = EVENT_INDEX["chunk_done"]
_FAILED = EVENT_INDEX["chunk_failed"]
_DROPPED = EVENT_INDEX["chunk_dropped"]
_FINISH = EVENT_INDEX["finish"]
_ABORT = EVENT_INDEX["abort"]
_FINISHING = LifecycleState.FINISHING.value
_RELEASED = LifecycleState.RELEASED.value
_U32 = 1 << 32
#: ``lc.due`` once offload of a lifecycle stopped at a hole (F33): no chunk is ever due.
_NEVER = 1 << 62
_TOKEN_LIMIT = 1 << 63
#: extend_batch keeps array state (DecodeRows) for batches of at least this many
#: lifecycles; below it a plain loop costs less than the arrays' fixed cost (they break
#: even near 32: benchmarks/bench_bookkeeping.py prints the crossover).
ROWS_MIN = 48
#: Where submit goes from each state with a copy in flight and nothing deferred (the
#: batched submit's one lookup; -1 where submit is illegal).
_SUBMIT_DEST = tuple(row[_SUBMIT][2] for row in TABLE)
#: TABLE's chunk_done row of each state (by guard bits): the delivery loop's one lookup.
_DONE_ROWS = tuple(row[_DONE] for row in TABLE)
#: The types of extend_batch's page entries that the fast paths read as they are.
_PLAIN_ENTRIES = frozenset((type(None), list, tuple))


def _no_pages(given: Any) -> bool:
    """Whether ``pages=`` says "no pages": None or an empty sequence (owned mode takes
    nothing else; engine-owned mode, exactly the new pages)."""
    if given is None:
        return True
    if isinstance(given, (str, bytes)):
        return False
    try:
        return len(given) == 0
    except TypeError:
        return False


def _ordered(items: Any, what: str, error: type[KVOffloadError]) -> Sequence[Any]:
    """``items``, an ordered sequence with one entry per lifecycle of extend_batch, as a
    list or tuple (a numpy array or torch tensor through ``tolist()``); ``error`` for an
    unordered collection or something that is no sequence."""
    if isinstance(items, (Set, Mapping, MappingView)):
        raise error(
            f"extend_batch: {what} must be an ordered sequence (one entry per lifecycle, in order), "
            f"not a {type(items).__name__}"
        )
    if getattr(items, "dtype", None) is not None and hasattr(items, "tolist"):
        if not getattr(items, "ndim", 0):
            raise error(f"extend_batch: {what} must be a sequence with one entry per lifecycle, got a scalar")
        return cast("list[Any]", items.tolist())
    if isinstance(items, (str, bytes)) or not hasattr(items, "__len__") or not hasattr(items, "__getitem__"):
        raise error(
            f"extend_batch: {what} must be a sequence with one entry per lifecycle, "
            f"not {type(items).__name__}"
        )
    return list(items)


class _Burst:
    """The current run of failed storage writes, for logging once per burst."""

    __slots__ = ("chunks", "last_log", "logged_pages", "pages", "since")

    def __init__(self) -> None:
        # since: clock time of the burst's first failure; None while the store is healthy.
        # Invariant: (self.since is None) == (self.chunks == 0)
        self.since: float | None = None
        self.chunks = 0
        self.pages = 0
        self.last_log = 0.0
        self.logged_pages = 0  # pages of the burst already reported in a log line


class _Chain(WriteChain):
    """The core's record of one lifecycle's write jobs (F33), shared by them: the
    writer's ``broken`` flag, and what a write that finishes after the lifecycle's
    release needs - a weak reference to it (the core never keeps a released one) and
    where its stored chain ends."""

    __slots__ = ("lc", "reach")

    def __init__(self, lc: Lifecycle) -> None:
        super().__init__()
        self.lc = weakref.ref(lc)
        # reach: -1 while live (or aborted); set at RELEASED: the token where the chain
        # the store holds (or will hold) ends; moves back when a later write fails.
        self.reach = -1


class _DirectHost:
    """The :class:`LifecycleHost` of a core used without a driver (tests, tools):
    lifecycle events go straight to the core; there is nothing to wait with. What a
    lifecycle's own call releases goes to ``on_released`` when one is set."""

    def __init__(self, core: OffloadCore) -> None:
        self.core = core
        self.on_released: Callable[[Lifecycle], object] | None = None

    def finish_lifecycle(self, lc: Lifecycle) -> None:
        self._tell(self.core.finish(lc))

    def abort_lifecycle(self, lc: Lifecycle) -> None:
        self._tell(self.core.abort(lc))

    def _tell(self, released: list[Lifecycle]) -> None:
        try:
            if self.on_released is not None:
                for lc in released:
                    self.on_released(lc)
        finally:
            self.core.told(released)

    def wait_lifecycle(self, lc: Lifecycle, released: bool) -> Awaitable[None]:
        raise KVOffloadError(f"{lc!r} belongs to a bare OffloadCore: a driver waits, the core does not")


class OffloadCore:
    """Registry, chunking and keys, host-page accounting, ledger and events.

    ``OffloadCore(config, device_pool=..., host_pool=..., accept=...)``. ``accept(t)``
    takes each copy job the moment it is due; it may raise to refuse it (a mover that
    is closed or cannot start a copy), and then nothing changed. ``storage``: whether a
    storage tier takes copied pages (then their host pages are held until
    :meth:`write_done`). Called from one thread (the driver's owner thread).
    """

    def __init__(
        self,
        config: OffloadConfig,
        *,
        device_pool: DevicePool | EnginePages,
        host_pool: HostPool,
        accept: Callable[[Transfer], None],
        clock: Callable[[], float] = time.monotonic,
        storage: bool = False,
        streams: int = 1,
        page_bytes: int = 0,
        store_log_interval_s: float = 30.0,
    ) -> None:
        self.config = config
        self.clock = clock
        self.device_pool = device_pool
        self.host_pool = host_pool
        self.accept = accept
        self.has_storage = storage
        self.streams = streams
        self.page_bytes = page_bytes
        self.store_log_interval_s = store_log_interval_s
        # owner: the thread every lifecycle checks its calls against (the driver sets it).
        self.owner = get_ident()
        # host: the driver lifecycles call back into (a bare core serves them itself).
        self.host: LifecycleHost = _DirectHost(self)
        # live: every lifecycle admitted and not RELEASED, by lifecycle id (never by rid).
        # Invariant: all(lc._s != RELEASED for lc in self.live.values())
        self.live: dict[LifecycleId, Lifecycle] = {}
        self._next_id = 1
        # state_counts[s]: live lifecycles in state s.
        # Invariant: self.state_counts[s] == sum(lc._s == s for lc in self.live.values())
        self.state_counts = [0, 0, 0, 0]
        # inflight: transfers accepted and not yet delivered, by id.
        # Invariant: len(self.inflight) == self.counters.chunks_inflight == sum(lc.inflight)
        self.inflight: dict[int, Transfer] = {}
        # next_seq: the seq of the next transfer submitted; inflight is in seq order.
        # Invariant: all(t.seq < self.next_seq for t in self.inflight.values())
        self.next_seq = 0
        # deferred: lifecycles whose next chunk waits for host pages, FIFO.
        # Invariant: all(lc._deferred_since is not None for lc in self.deferred)
        self.deferred: deque[Lifecycle] = deque()
        # polls: SyncOffloadManager.poll() calls so far (scheduler steps; the same on every
        # TP rank): the clock of host_wait_polls. Only the sync driver counts it.
        self.polls = 0
        # writes: copied chunks handed to the writer (or about to be: _write_out) whose
        # storage write has not finished (host pages held), in the order handed over.
        # Invariant: sum(len(j.host_pages) for j in self.writes.values())
        #   + sum(len(j.host_pages) for d in self.held.values() for j in d.values())
        #   == counters.pages_in_write
        self.writes: dict[int, WriteJob] = {}
        # held: with storage, copied chunks whose write waits for an earlier chunk of the
        # same lifecycle to be copied (copies may complete out of order; writes go in
        # chain order, F33): by lifecycle id, then by the chunk's first token. Their host
        # pages are held; they join writes (and _write_out) when the earlier ones did, so
        # a write that waits for a copy is not pending (writes_pending, a TP window).
        # Invariant: all(job.first_token > live[lid]._front for lid, d in held.items() for job in d.values())
        self.held: dict[LifecycleId, dict[int, WriteJob]] = {}
        # _write_out: write jobs not yet taken by the driver's writer (a subset of writes).
        self._write_out: list[WriteJob] = []
        self.counters = Counters()
        self.listeners: list[Listener] = []
        # observed: whether events are built - a listener is attached or debug logging is
        # seen (refresh_observed: at each admit and listener change). Hot paths read only this.
        self.observed = False
        # closing: no copy may start (nothing would deliver it); set once by close().
        self.closing = False
        # rows: extend_batch's array state, made by the first batch of rows_min or more
        # lifecycles (kvoffload.core.rows); batches smaller than that take a plain loop.
        self.rows: DecodeRows | None = None
        self.rows_min = ROWS_MIN
        # _released: lifecycles released by the current call, returned by it.
        self._released: list[Lifecycle] = []
        # stuck_reported: ids of in-flight transfers the watchdog reported (F18).
        self.stuck_reported: set[int] = set()
        # Rate limits of the warnings that come in bursts (F9: no log line every step).
        self._drop_log = RateLimit()
        self._failure_log = RateLimit()
        # listener_failures: rate limits of this core's listener.failed lines, by event
        # name, on this core's clock (never shared with another core: F39).
        self.listener_failures: dict[str, RateLimit] = {}
        self._refusal_log = RateLimit()
        self._burst = _Burst()

    # --- registry ------------------------------------------------------------------------

    def admit(
        self,
        rid: Any,
        prompt: Sequence[int],
        *,
        pages: Any = None,
        tag: Any = None,
        chain_seed: str | None = None,
        stored: int | None = None,
    ) -> Lifecycle:
        """Admit a request and return its new lifecycle, in PENDING (or OFFLOADING when
        the prompt's unstored whole pages go out at once).

        ``rid`` is a label: it may equal a live lifecycle's rid (a reused request id);
        the two never share state. Owned mode allocates the prompt's device pages
        (``pages`` None or empty); engine-owned mode takes ``pages``, the engine's ids
        of exactly the pages the prompt fills, in token order
        (:func:`~kvoffload.pools.page_ids`). ``stored``: leading prompt tokens the
        storage tier already has (page-aligned; default the page-aligned prompt, or 0
        with ``offload_prompt``): they are never copied and the chain continues from
        their key; their pages may also be in other live lifecycles' stored prefixes
        (a prefix cache shares them), the pages after them are this lifecycle's own. Raises
        :class:`~kvoffload.InvalidTokens`, :class:`~kvoffload.PoolExhausted`,
        :class:`~kvoffload.PageError`, or the mover's error when it refuses the prompt
        chunk, with nothing changed.
        """
        if self.closing:
            raise KVOffloadError("the manager is closed: no request can be admitted")
        self.refresh_observed()
        cfg = self.config
        tokens = validate_tokens(prompt, "prompt")
        n = len(tokens)
        ps = cfg.page_size
        aligned = n - n % ps
        if stored is None:
            stored = 0 if cfg.offload_prompt else aligned
        elif type(stored) is not int or not 0 <= stored <= n or stored % ps:
            raise InvalidTokens(
                f"stored={stored!r} must be a whole number of pages (a multiple of page_size {ps}) "
                f"between 0 and the prompt's {n} tokens"
            )
        dev = self._take_pages(-(-n // ps), pages, stored // ps)
        lc = Lifecycle(self, LifecycleId(self._next_id), rid, self.clock(), self.owner)
        lc.tag = tag
        lc.device_pages = dev
        lc._cap = len(dev) * ps
        lc._committed = n
        seed = bytes.fromhex(chain_seed) if chain_seed else b""
        lc._chain = seed
        if stored:  # the stored prefix seeds the chain (its pages are never copied)
            lc._chain = page_run_digests(seed, tokens[:stored], ps)[-1]
        lc.submitted = stored
        lc._front = stored
        lc._tail = tokens[stored:]
        # offload_prompt: the prompt's unstored whole pages are the first chunk; else (or
        # when there are none) a chunk is due a stride past what is stored (at once for a
        # resumed request).
        lc.due = aligned if cfg.offload_prompt and aligned > stored else stored + cfg.stride
        self._requiet(lc)
        self._next_id += 1
        self.live[lc.id] = lc
        self.state_counts[0] += 1
        self.counters.admitted += 1
        if self.observed:
            self.emit("lifecycle.admitted", lc, prompt_tokens=n, device_pages=len(dev))
        pending = n - stored
        due = pending - pending % (ps if cfg.offload_prompt else cfg.stride)
        if due and n >= lc.due:
            try:
                self._submit(lc, due)
            except BaseException:  # the mover refused: admit is all or nothing
                del self.live[lc.id]
                self.state_counts[0] -= 1
                self.counters.admitted -= 1
                self.device_pool.free(dev)
                raise
        return lc

    def _take_pages(self, n: int, given: Any, shared: int = 0) -> list[int]:
        """Device pages for ``n`` new pages: allocated from kvoffload's own pool (owned
        mode; ``given`` must be None or empty), or the engine's ids ``given`` claimed
        (engine-owned mode; the first ``shared`` are a stored prefix, which other live
        lifecycles' stored prefixes may share). Raises with nothing taken."""
        if self.config.device_pages is None:
            if given is None:
                if n == 0:
                    return []
                raise PageError(
                    f"engine-owned mode (device_pages=None): these tokens start {n} new page(s); "
                    "pass the engine's page ids with pages="
                )
            return cast("EnginePages", self.device_pool).claim(given, n, shared)
        if not _no_pages(given):
            raise KVOffloadError(
                "pages= hands over engine pages, but this manager owns its device pool "
                "(device_pages is set): leave pages out, or use device_pages=None"
            )
        return cast("DevicePool", self.device_pool).allocate(n)

    def lifecycles(self, rid: Any = None) -> list[Lifecycle]:
        """Live lifecycles, oldest first; with ``rid``, those labelled ``rid`` (there may be
        several: a reused id). For observability: O(live)."""
        if rid is None:
            return list(self.live.values())
        return [lc for lc in self.live.values() if lc.rid == rid]

    # --- events in ---------------------------------------------------------------------

    def _check(self, lc: Lifecycle, e: int) -> None:
        if TABLE[lc._s][e][0] < 0:
            if self.closing:  # close() aborted it: say so, not which state refuses the event
                raise ManagerClosed(
                    f"{lc!r}: {EVENT_NAMES[e]}() after its manager was closed (closing aborted "
                    "every live lifecycle); nothing was changed"
                )
            self._illegal(lc, e)

    def _illegal(self, lc: Lifecycle, e: int) -> None:
        raise InvalidTransition(lc, STATES[lc._s], EVENT_NAMES[e])

    def extend(self, lc: Lifecycle, tokens: Sequence[int], *, pages: Any = None, ready: Any = None) -> None:
        """The full path of :meth:`Lifecycle.extend` (the lifecycle takes a fast path for
        the quiet decode step). All or nothing: a bad token, a full device pool or a
        refused submission raises and changes nothing."""
        self._check(lc, _EXTEND)
        toks = validate_tokens(tokens)
        if lc._row >= 0:  # its extend_batch row gives it back: this step is not the batch's
            cast("DecodeRows", self.rows).detach(lc)
        self._extend_valid(lc, toks, pages, ready)

    def extend_due(self, lc: Lifecycle, t: int) -> bool:
        """The decode step whose one token makes a chunk due, from the lifecycle's fast
        path (``lc._quiet >= 0``: extend is a self-loop of its state, its tail narrow, no
        one observes events; no ``pages`` or ``ready``): exactly what :meth:`extend` does
        for ``[t]``, without its general checks. Returns False, having changed nothing,
        when ``t`` is no narrow id or its page cannot be had (:meth:`extend` then raises
        the precise error); raises what the mover raises, with nothing changed."""
        tail = lc._tail
        try:
            tail.append(t)  # OverflowError for an id < 0 or >= 2**32: not appended
        except OverflowError:
            return False
        committed = lc._committed + 1
        held = len(lc.device_pages)
        if committed > lc._cap and not self.grow_one(lc):
            tail.pop()
            return False
        lc._committed = committed
        if lc._deferred_since is None:  # due: committed == lc.due
            pending = committed - lc.submitted
            try:
                self._submit(lc, pending - pending % self.config.stride)
            except BaseException:  # the mover refused: extend is all or nothing
                self._unextend(lc, 1, held)
                raise
        return True

    def _unextend(self, lc: Lifecycle, n: int, held: int) -> None:
        """Undo an extend of ``n`` tokens that found ``held`` device pages: the tokens
        leave the tail and the pages it added go back."""
        del lc._tail[len(lc._tail) - n :]
        lc._committed -= n
        if len(lc.device_pages) > held:
            self.device_pool.free(lc.device_pages[held:])
            del lc.device_pages[held:]
            lc._cap = held * self.config.page_size

    def _extend_valid(self, lc: Lifecycle, toks: array[int], pages: Any, ready: Any) -> None:
        """:meth:`extend` once the event is legal and the tokens are a checked array."""
        n = len(toks)
        committed = lc._committed + n
        ps = self.config.page_size
        held = len(lc.device_pages)
        need = max(0, -(-committed // ps) - held)
        if need or pages is not None:  # pages=[] (or None) is "no pages" in both modes
            lc.device_pages += self._take_pages(need, pages)
            lc._cap = len(lc.device_pages) * ps
        lc._committed = committed
        if toks.typecode != lc._tail.typecode:  # an id >= 2**32: this tail holds uint64 from now on
            if lc._tail.typecode == TOKEN_TYPECODE:
                lc._tail = array(WIDE_TYPECODE, lc._tail)
            else:
                toks = array(WIDE_TYPECODE, toks)
        lc._tail += toks
        if lc._quiet >= 0 and toks.typecode != TOKEN_TYPECODE:
            self._requiet(lc)  # a wide tail: the fast path no longer applies
        if self.observed:
            self._fire(lc, _EXTEND)  # a self-loop in every state it is legal in: only its event
        if committed >= lc.due and lc._deferred_since is None:
            pending = committed - lc.submitted
            try:
                self._submit(lc, pending - pending % self.config.stride, ready)
            except BaseException:  # the mover refused: extend is all or nothing
                self._unextend(lc, n, held)
                raise

    def extend_batch(
        self,
        lifecycles: Sequence[Lifecycle],
        tokens: Sequence[Any],
        *,
        pages: Sequence[Any] | None = None,
        ready: Any = None,
    ) -> None:
        """One decode step for many lifecycles: exactly as ``lc.extend(tokens[i],
        pages=pages[i], ready=ready)`` for each ``lc = lifecycles[i]`` in order, keys and
        chunk boundaries included, at a fraction of the cost. ``tokens[i]`` is one token
        id (an int) or a sequence of them. Bad input anywhere in the batch - a lifecycle
        of another manager or in a state that refuses extend, a bad token, a wrong or
        taken page id, not enough free device pages for the whole batch - raises before
        anything changes. A mover that refuses a chunk raises at that lifecycle, the ones
        before it extended (as the sequential calls would).

        Accepted: ``lifecycles``, ``tokens`` and ``pages`` as lists or tuples (``tokens``
        and ``pages`` also as numpy arrays or torch tensors: one row per lifecycle);
        ``tokens[i]`` an int (a numpy or torch integer scalar too) or a sequence of ids
        as :meth:`Lifecycle.extend` takes them; ``pages[i]`` None, or the page ids as
        :func:`kvoffload.pools.page_ids` takes them. Every batch size takes exactly the
        same inputs. Owned mode: ``pages`` None, or every entry None or empty."""
        if type(lifecycles) is not list and type(lifecycles) is not tuple:
            lifecycles = _ordered(lifecycles, "lifecycles", KVOffloadError)
        if type(tokens) is not list and type(tokens) is not tuple:
            tokens = _ordered(tokens, "tokens", InvalidTokens)
        if pages is not None:
            pages = self._page_entries(pages)
        n = len(lifecycles)
        if len(tokens) != n or (pages is not None and len(pages) != n):
            raise KVOffloadError(
                f"extend_batch: {n} lifecycles, {len(tokens)} token entries"
                + (f", {len(pages)} page entries" if pages is not None else "")
                + ": one entry per lifecycle"
            )
        rows = self.rows
        if n >= self.rows_min and not self.observed:
            if rows is None:
                rows = self.rows = DecodeRows(self)
            if rows.step_batch(
                lifecycles if type(lifecycles) is list else list(lifecycles), tokens, pages, ready
            ):
                return
        elif rows is not None and rows.attached:
            rows.detach_all()  # the ordinary paths below read and write the tails
        if ready is None and not self.observed and self._extend_quiet(lifecycles, tokens, pages):
            return
        self._extend_checked(lifecycles, tokens, pages, ready)

    def _page_entries(self, pages: Any) -> Sequence[Any] | None:
        """extend_batch's ``pages`` as the fast paths read them: a list or tuple whose
        entries are None, lists or tuples (anything else converted by
        :func:`~kvoffload.pools.page_ids`); None in owned mode, where every entry must
        be None or empty. Raises :class:`~kvoffload.PageError` (or, owned mode,
        :class:`~kvoffload.KVOffloadError`) before anything changes. One type check
        per call when the entries are already plain."""
        if type(pages) is not list and type(pages) is not tuple:
            pages = _ordered(pages, "pages", PageError)
        if self.config.device_pages is not None:
            for i, given in enumerate(pages):
                if not _no_pages(given):
                    raise KVOffloadError(
                        f"extend_batch: pages[{i}] hands over engine pages, but this manager owns its "
                        "device pool (device_pages is set): leave pages out, or pass None or [] entries"
                    )
            return None
        if set(map(type, pages)) <= _PLAIN_ENTRIES:
            return cast("Sequence[Any]", pages)
        return [
            given if given is None or type(given) is list else page_ids(given, f"pages[{i}]")
            for i, given in enumerate(pages)
        ]

    def _extend_quiet(self, lifecycles: Sequence[Lifecycle], tokens: Sequence[Any], pages: Any) -> bool:
        """The common decode step in one pass: every entry one narrow token id for a
        lifecycle of this core that stays under its quiet threshold (a new page is
        taken inline). Returns True when the whole batch was applied; on the first entry
        that is not such a step, every entry applied so far is undone and it returns
        False (nothing changed) for :meth:`_extend_checked`."""
        engine = self.config.device_pages is None
        ps = self.config.page_size
        done = 0
        paged: list[Lifecycle] = []  # lifecycles that took a new page, in order
        # due: (index, lifecycle) of the entries that made a chunk due, in order. Their
        # chunks are submitted after the pass, in the same order: quiet entries touch
        # neither the host pool nor the mover, so the outcome is the sequential one. A
        # due lifecycle's _quiet is -1 until then: a second entry for it in the batch
        # leaves the pass (the checked path handles it, in order).
        due: list[tuple[int, Lifecycle]] = []
        try:
            for i, lc in enumerate(lifecycles):
                t = tokens[i]
                if type(t) is not int or lc._core is not self or not 0 <= t < _U32:
                    break
                c = lc._committed + 1
                if c > lc._quiet:
                    if lc._quiet < 0:
                        break
                    lc._quiet = -1
                    due.append((i, lc))
                if c > lc._cap:
                    if not engine:
                        if (pages is not None and pages[i]) or not self.grow_one(lc):
                            break  # pages= in owned mode, or an empty pool: the checked path raises
                    elif pages is None or pages[i] is None:
                        break
                    else:
                        lc.device_pages += cast("EnginePages", self.device_pool).claim(pages[i], 1)
                        lc._cap += ps
                    paged.append(lc)
                elif pages is not None and pages[i]:
                    break  # pages given where none is needed: the checked path says so
                lc._tail.append(t)
                lc._committed = c
                done += 1
        except (KVOffloadError, AttributeError, TypeError, ValueError):
            pass  # an engine page id was refused, an entry is no lifecycle: undo, the checked path raises
        else:
            if done == len(lifecycles):
                return self._submit_due(lifecycles, due, paged)
        if due and due[-1][0] == done:  # the entry that stopped the pass was made due first
            self._requiet(due.pop()[1])
        self._undo_quiet(lifecycles, done, paged, due)
        return False

    def _submit_due(
        self, lifecycles: Sequence[Lifecycle], due: list[tuple[int, Lifecycle]], paged: list[Lifecycle]
    ) -> bool:
        """After a quiet pass: the chunks its due entries made due, in order, as each
        entry's extend would have submitted them. A mover that refuses one raises there,
        the entries from that one on undone (as the sequential calls would leave them)."""
        stride = self.config.stride
        for k, (i, lc) in enumerate(due):
            self._requiet(lc)
            if lc._committed >= lc.due and lc._deferred_since is None:
                pending = lc._committed - lc.submitted
                try:
                    self._submit(lc, pending - pending % stride, None)
                except BaseException:
                    for _, later in due[k + 1 :]:
                        self._requiet(later)
                    self._undo_quiet(lifecycles, len(lifecycles), paged, [], stop=i)
                    raise
        return True

    def _undo_quiet(
        self,
        lifecycles: Sequence[Lifecycle],
        done: int,
        paged: list[Lifecycle],
        due: list[tuple[int, Lifecycle]],
        stop: int = 0,
    ) -> None:
        """Undo entries ``stop..done`` that :meth:`_extend_quiet` applied (in reverse),
        with the pages they took; the due ones get their fast-path threshold back."""
        for _, lc in due:
            self._requiet(lc)
        ps = self.config.page_size
        for lc in reversed(lifecycles[stop:done]):
            lc._tail.pop()
            lc._committed -= 1
            if paged and paged[-1] is lc and lc._cap - ps >= lc._committed:
                paged.pop()
                self.device_pool.free([lc.device_pages.pop()])
                lc._cap -= ps
        assert stop or not paged, "a page taken by an entry that was not applied"

    def _extend_checked(
        self, lifecycles: Sequence[Lifecycle], tokens: Sequence[Any], pages: Any, ready: Any
    ) -> None:
        """extend_batch's careful path: check every entry first, then extend each."""
        n = len(lifecycles)
        ps = self.config.page_size
        engine = self.config.device_pages is None
        # Validate everything first (nothing changes on bad input).
        grown: dict[int, int] = {}  # lifecycle id -> committed after its entries so far
        new_pages = 0
        claimed: set[int] = set()
        arrays: list[array[int]] = []  # each entry's tokens, checked
        given_ids: list[list[int] | None] = []  # each entry's page ids, checked (engine-owned)
        for i in range(n):
            lc, t = lifecycles[i], tokens[i]
            if not isinstance(lc, Lifecycle):
                raise KVOffloadError(f"extend_batch: lifecycles[{i}] is {lc!r:.60}, not a Lifecycle")
            if lc._core is not self:
                raise KVOffloadError(f"extend_batch: lifecycles[{i}] {lc!r} belongs to another manager")
            self._check(lc, _EXTEND)
            scalar = type(t) is int or (hasattr(t, "__index__") and not getattr(t, "ndim", 0))
            toks = validate_tokens([t] if scalar else t, f"tokens[{i}]")
            arrays.append(toks)
            k = len(toks)
            before = grown.get(lc.id, lc._committed)
            grown[lc.id] = before + k
            need = max(0, -(-(before + k) // ps) - max(len(lc.device_pages), -(-before // ps)))
            new_pages += need
            if engine:
                given = pages[i] if pages is not None else None
                ids = None if given is None else page_ids(given, f"pages[{i}]")
                given_ids.append(ids)
                if ids is None and need:
                    raise PageError(
                        f"extend_batch: {lc!r} entry {i} starts {need} new page(s); pass them in pages"
                    )
                if ids is not None:
                    if len(ids) != need:
                        raise PageError(
                            f"extend_batch: entry {i} starts {need} new page(s); {len(ids)} given"
                        )
                    for p in ids:
                        if p in claimed:
                            raise PageError(f"extend_batch: page id {p} is named twice in the batch")
                        claimed.add(p)
            else:  # owned mode: _page_entries left no pages
                given_ids.append(None)
        if engine and claimed:  # range and held, checked before anything is claimed
            cast("EnginePages", self.device_pool).check_claim(list(claimed))
        elif not engine and new_pages > self.device_pool.free_pages:
            raise PoolExhausted("device", new_pages, self.device_pool.free_pages)
        # Apply, each entry exactly as its own extend.
        for i in range(n):
            self._extend_valid(lifecycles[i], arrays[i], given_ids[i], ready)

    def _requiet(self, lc: Lifecycle) -> None:
        """Recompute ``lc._quiet``, the fast path's one comparison (see Lifecycle). No
        fast path while someone observes events: the full path emits them."""
        quiet = (
            EXTEND_SELF_LOOP[lc._s]
            and lc._tail.typecode == TOKEN_TYPECODE
            and not self.observed
            and lc._row < 0  # a row's tokens are not in the tail yet: no fast path
        )
        lc._quiet = lc.due - 1 if quiet else -1

    def grow_one(self, lc: Lifecycle) -> bool:
        """Owned mode, a one-token step's new page (its committed passes its pages by
        one token): taken and appended, or False with nothing changed when the pool is
        empty or the engine owns the pages (the full path then raises or asks)."""
        if self.config.device_pages is None:
            return False
        page = cast("DevicePool", self.device_pool).take_one()
        if page < 0:
            return False
        lc.device_pages.append(page)
        lc._cap += self.config.page_size
        return True

    def grow(self, lc: Lifecycle, committed: int) -> bool:
        """Owned mode, the quiet step's page allocation (called by the lifecycle's fast
        path): device pages for ``committed`` tokens, or :class:`~kvoffload.PoolExhausted`
        with nothing changed. Engine-owned mode takes no page here: returns False (the
        full path then asks for the engine's)."""
        if self.config.device_pages is None:
            return False
        ps = self.config.page_size
        pages = lc.device_pages
        pages += cast("DevicePool", self.device_pool).allocate(-(-committed // ps) - len(pages))
        lc._cap = len(pages) * ps
        return True

    def finish(self, lc: Lifecycle) -> list[Lifecycle]:
        """The request finished: flush the page-aligned remainder (F12), then FINISHING,
        or RELEASED at once when nothing is in flight. Returns what it released."""
        self._check(lc, _FINISH)
        if lc._row >= 0:
            cast("DecodeRows", self.rows).detach(lc)
        self._flush(lc, refusal_raises=True)
        self._fire(lc, _FINISH)
        return self._take_released()

    def abort(self, lc: Lifecycle) -> list[Lifecycle]:
        """No new chunks; in-flight ones are discarded on completion; RELEASED (ABORTED)
        after the last one, or at once. Returns what it released."""
        self._check(lc, _ABORT)
        if lc._row >= 0:
            cast("DecodeRows", self.rows).detach(lc)
        lc._aborted = True
        if self.held:  # copied ahead of a chunk that will now be discarded: never written
            self._skip_held(lc, 0)
        if lc._deferred_since is not None:
            lc._deferred_since = None
            self.deferred.remove(lc)
            self._notify_quiet(lc)
        self._fire(lc, _ABORT)
        return self._take_released()

    def close(self) -> list[Lifecycle]:
        """The driver is closing: no copy may start from now on (nothing would deliver
        it), deferred chunks are dropped, and every live lifecycle is aborted - those
        with nothing in flight are RELEASED now (returned), the others when their last
        copy is delivered (discarded)."""
        self.closing = True
        live = list(self.live.values())
        if live:
            logger.warning("manager.closed_live", live=len(live))
        released: list[Lifecycle] = []
        for lc in live:
            if not lc._aborted:
                released += self.abort(lc)
        return released + self._take_released()

    def _flush(self, lc: Lifecycle, refusal_raises: bool = False) -> None:
        """The tail flush (F12): submit every whole page not yet submitted, one host-sized
        chunk at a time, until none is left or one finds the host pool full (then the
        policy counts a drop or defers the rest; F9). Never a silent skip. A refusal of
        the first chunk raises when ``refusal_raises`` (the caller's call changes
        nothing); a later one is contained (:meth:`_refused`)."""
        ps = self.config.page_size
        first = True
        while lc._deferred_since is None:
            pending = lc.committed - lc.submitted
            if pending < ps:
                return
            try:
                if not self._submit(lc, pending - pending % ps):
                    return
            except Exception as exc:
                if refusal_raises and first:
                    raise
                self._refused(lc, pending // ps, exc)
                return
            first = False

    # --- chunks --------------------------------------------------------------------------

    def _submit(self, lc: Lifecycle, n: int, ready: Any = None, now: float | None = None) -> bool:
        """Submit the next ``n`` tokens (page-aligned) of ``lc`` as one chunk.

        Order (F10): host pages first, then the mover's ``accept``, then the bookkeeping
        and the state. A full host pool drops (or defers) the chunk with nothing changed
        but the drop counters and ``lc.due``. Returns whether a chunk was submitted.
        Raises :class:`~kvoffload.KVOffloadError` (nothing changed) once the core is
        closing, and what ``accept`` raises (host pages returned, nothing changed).
        """
        if self.closing:
            raise KVOffloadError(f"{lc!r}: the manager is closed, no copy can start; abort() releases it")
        if lc._stop >= 0:  # offload stopped at a hole (F33): nothing after it is sent
            return False
        cfg = self.config
        ps = cfg.page_size
        wanted = n // ps  # a drop counts every page not sent, beyond one host-sized chunk too
        n = min(n, cfg.host_pages * ps)
        if n <= 0:
            return False
        npages = n // ps
        host = self.host_pool.try_allocate(npages)
        if host is None:
            self._host_full(lc, wanted)
            return False
        digests = page_run_digests(lc._chain, lc._tail[:n], ps)
        t = self._transfer(lc, n, host, digests, ready, self.clock() if now is None else now)
        try:
            self.accept(t)
        except BaseException:
            self.host_pool.free(host)
            raise
        self._accepted(lc, t, digests)
        self._requiet(lc)
        c = self.counters
        c.chunks_submitted += 1
        c.chunks_inflight += 1
        c.pages_submitted += npages
        c.pages_inflight += npages
        if self.observed:
            self.emit(
                "transfer.submitted",
                lc,
                transfer=t.id,
                pages=npages,
                bytes=npages * self.page_bytes,
                tokens=n,
                first_token=t.first_token,
                stream=t.stream,
            )
        self._fire(lc, _SUBMIT, t.submitted_at)
        return True

    def _transfer(
        self, lc: Lifecycle, n: int, host: list[int], digests: list[bytes], ready: Any, now: float
    ) -> Transfer:
        """The copy job of ``lc``'s next ``n`` tokens into ``host`` (its pages' digests
        computed): what the mover's ``accept`` is offered."""
        first = lc.submitted // self.config.page_size
        device = lc.device_pages[first : first + len(host)]
        stream = lc.id % self.streams  # a lifecycle's chunks share one stream, in order
        t = Transfer(lc, device, host, None, lc.submitted, n, now, stream, ready, True, digests)
        t.seq = self.next_seq
        return t

    def _accepted(self, lc: Lifecycle, t: Transfer, digests: list[bytes]) -> None:
        """The mover accepted ``t``, ``lc``'s copy: its tokens leave the tail, the chain
        moves on to its last page, the next chunk is due a stride on, and it is in flight."""
        del lc._tail[: t.n_tokens]
        lc.submitted += t.n_tokens
        lc._chain = digests[-1]
        lc.due = lc.submitted + self.config.stride
        lc.inflight += 1
        self.inflight[t.id] = t
        self.next_seq += 1

    def _submit_rows(self, run: list[Lifecycle], ready: Any, now: float, progress: list[int]) -> None:
        """The due chunks of one batched decode step: exactly ``_submit(lc, the due
        stride-aligned tokens)`` for each lifecycle of ``run`` in order (each synced,
        not deferred, due), in stages - host pages for all, then their keys, then each
        transfer accepted and written down - so each stage runs as one tight loop.

        ``progress[0]`` counts the lifecycles done. A mover that refuses one raises
        there: the ones before it are submitted (or dropped), it and the ones after are
        not, and every host page taken for them is back, the free list as it was.
        """
        if self.closing:
            raise KVOffloadError(f"{run[0]!r}: the manager is closed, no copy can start; abort() releases it")
        cfg = self.config
        ps = cfg.page_size
        stride = cfg.stride
        most = cfg.host_pages * ps
        take = self.host_pool.try_allocate
        plan: list[tuple[Lifecycle, int, int, list[int] | None]] = []
        for lc in run:  # host pages in order: each as its own submit would find the pool
            pending = lc._committed - lc.submitted
            want = pending - pending % stride
            n = want if want < most else most
            plan.append((lc, want, n, take(n // ps) if n > 0 else None))
        chains = [page_run_digests(lc._chain, lc._tail[:n], ps) if host else None for lc, _, n, host in plan]
        accept = self.accept
        counts = self.state_counts
        chunks = pages = 0
        try:
            for j, (lc, want, n, host) in enumerate(plan):
                if n <= 0:  # less than a stride since a dropped prompt chunk: as _submit, nothing
                    progress[0] += 1
                    continue
                if host is None:
                    self._host_full(lc, want // ps)
                    progress[0] += 1
                    continue
                digests = cast("list[bytes]", chains[j])
                t = self._transfer(lc, n, host, digests, ready, now)
                try:
                    accept(t)
                except BaseException:
                    for _, _, _, h in reversed(plan[j:]):  # last taken first: the free list as it was
                        if h is not None:
                            self.host_pool.free(h)
                    raise
                self._accepted(lc, t, digests)
                chunks += 1
                pages += len(host)
                s = lc._s  # TABLE's submit step from PENDING or OFFLOADING, copies in flight
                dest = _SUBMIT_DEST[s]
                if dest != s:
                    counts[s] -= 1
                    counts[dest] += 1
                    lc._s = dest
                    lc.state_since = now
                progress[0] += 1
        finally:
            c = self.counters
            c.chunks_submitted += chunks
            c.chunks_inflight += chunks
            c.pages_submitted += pages
            c.pages_inflight += pages

    def _host_full(self, lc: Lifecycle, npages: int) -> None:
        c = self.counters
        if self.config.on_host_full == "wait" and not self.closing:
            if lc._deferred_since is None:
                lc._deferred_since = self.clock()
                lc._deferred_poll = self.polls
                self.deferred.append(lc)
                c.chunks_deferred += 1
                if self.observed:
                    self.emit("chunk.deferred", lc, pages=npages, bytes=npages * self.page_bytes)
            return
        self._drop(lc, npages)

    def _drop(self, lc: Lifecycle, npages: int) -> None:
        c = self.counters
        c.chunks_dropped += 1
        c.pages_dropped += npages
        lc.due = lc.committed + self.config.stride  # retry one stride later (F9)
        self._requiet(lc)
        held = self._drop_log.due(self.clock())
        if held:
            logger.warning(
                "chunk.dropped",
                rid=lc.rid,
                lifecycle=lc.id,
                pages=npages,
                drops_since_last_log=held,
                host_pages_free=self.host_pool.free_pages,
            )
        if self.listeners:
            self.emit("chunk.dropped", lc, pages=npages, bytes=npages * self.page_bytes)

    def _refused(self, lc: Lifecycle, npages: int, error: BaseException) -> None:
        """The mover refused a chunk outside a caller's call (F20): the chunk is counted
        and dropped (retried one stride later while decoding); a finishing lifecycle's
        lost tail makes its outcome FAILED. Never raises."""
        c = self.counters
        c.chunks_refused += 1
        c.pages_refused += npages
        if lc._s == _FINISHING:  # its tail is lost for good
            lc._failed = True
        held = self._refusal_log.due(self.clock())
        if held:
            logger.warning(
                "transfer.refused",
                rid=lc.rid,
                lifecycle=lc.id,
                pages=npages,
                error=repr(error),
                refusals_since_last_log=held,
            )
        if self.listeners:
            self.emit("transfer.refused", lc, pages=npages, bytes=npages * self.page_bytes, error=repr(error))
        self._drop(lc, npages)

    def _pump_deferred(self) -> None:
        """Submit deferred chunks, oldest first, while host pages last; drop the expired.
        A mover's refusal fails that chunk only (F20). Once the core is closing, every
        deferred chunk is dropped: no copy may start."""
        q = self.deferred
        cfg = self.config
        now = self.clock()
        while q:
            lc = q[0]
            since = lc._deferred_since
            if since is None or lc._s == _RELEASED:
                q.popleft()
                continue
            pending = lc.committed - lc.submitted
            final = lc._s == _FINISHING
            wanted = pending - pending % (cfg.page_size if final else cfg.stride)
            n = min(wanted, cfg.host_pages * cfg.page_size)
            if (
                self.closing
                or (cfg.host_wait_s is not None and now - since > cfg.host_wait_s)
                or (cfg.host_wait_polls is not None and self.polls - lc._deferred_poll > cfg.host_wait_polls)
            ):
                q.popleft()
                lc._deferred_since = None
                self.counters.chunks_expired += 1
                self._drop(lc, wanted // cfg.page_size)  # every page not sent, as _submit counts
                self._notify_quiet(lc)
                self._fire(lc, _DROPPED)
                continue
            if n <= 0:  # nothing left to send (a prompt chunk sent with a later one; be safe)
                q.popleft()
                lc._deferred_since = None
                self._notify_quiet(lc)
                self._fire(lc, _DROPPED)
                continue
            if self.host_pool.free_pages < n // cfg.page_size:
                break  # FIFO: later ones wait behind this one
            q.popleft()
            lc._deferred_since = None
            if lc._row >= 0:  # visited every step while deferred: nothing held (made sure)
                cast("DecodeRows", self.rows).sync(lc)
            if final:
                self._flush(lc)  # may defer the rest again: it rejoins the queue
            else:
                try:
                    self._submit(lc, n)
                except Exception as exc:
                    self._refused(lc, wanted // cfg.page_size, exc)
            if lc.quiescent:  # nothing went out: a refused or dropped chunk
                self._notify_quiet(lc)
                self._fire(lc, _DROPPED)

    # --- completions ---------------------------------------------------------------------

    def complete(self, batch: Sequence[Completion], now: float | None = None) -> list[Lifecycle]:
        """Apply a batch of completions (transfer id, error), in order, each to the
        lifecycle that issued it (the transfer's ``lifecycle_id``, never its request id;
        F1). Returns the lifecycles the batch released.

        A completion that names a transfer id not in flight (delivered twice, never
        submitted: a mover's bug) raises :class:`~kvoffload.KVOffloadError` when the loop
        reaches it: the completions before it are applied, the ledger is consistent,
        and those after it are not applied (still in flight: deliver them again; the
        drivers do). :class:`~kvoffload.PageError` on a host double free.
        """
        c = self.counters
        n, submitted = len(self.inflight), c.chunks_submitted
        try:
            self._apply(batch, self.clock() if now is None else now)
        finally:  # what left flight, plus what the batch's returned host pages let go out
            c.completions_delivered += n - len(self.inflight) + c.chunks_submitted - submitted
        return self._take_released()

    def _apply(self, batch: Iterable[Completion], now: float) -> None:
        """Apply completions in order, each exactly as a batch of that one alone would,
        doing once per batch what need not be done per completion: the observed gate,
        the ledger writes and the host-page return of copied chunks (one checked
        ``PagePool.free``).

        Invariant: what the loop holds back (``chunks``/``pages``/``held``) is written
        to the counters and the host pool (``_credit``) before anything can read them -
        a log line or listener, ``_fire``'s full path (release, events),
        ``_pump_deferred`` - and on the way out, normally or by an exception.
        """
        inflight = self.inflight
        live = cast("dict[int, Lifecycle]", self.live)  # by a transfer's lifecycle_id
        rows = _DONE_ROWS
        counts = self.state_counts
        fire = self._fire
        observed = self.observed
        store = self.has_storage
        chunks = pages = 0  # copied chunks (and their pages) not yet in the counters
        held: list[int] = []  # their host pages, not yet returned (none with storage)
        try:
            for tid, error in batch:
                t = inflight.get(tid)
                if t is None:
                    raise KVOffloadError(f"transfer #{tid} completed twice or was never submitted")
                # A lifecycle with a copy in flight is never RELEASED, so it is live.
                lc = live.get(t.lifecycle_id)
                if lc is None:  # that invariant broken (a kvoffload bug): nothing applied
                    raise InvariantViolation(f"{t!r} completed, but its lifecycle is not live")
                del inflight[tid]
                t.completed_at = now
                t.error = error
                lc.inflight -= 1
                if (
                    error is None
                    and lc._stop < 0
                    and not (observed or lc._aborted or self.deferred)
                    and (not store or t.first_token == lc._front)
                ):
                    s = lc._s
                    dest = rows[s][((lc.inflight > 0) << 1) | (lc._deferred_since is not None)]
                    if 0 <= dest != _RELEASED:
                        # Copied, nothing to emit, release or pump: the ledger waits for the
                        # batch (or the next full path) and TABLE's step is applied here.
                        chunks += 1
                        host = t.host_pages
                        pages += len(host)
                        if store:
                            self._queue_write(lc, t)
                        else:
                            held += host
                        if dest != s:
                            counts[s] -= 1
                            lc._s = dest
                            lc.state_since = now
                            counts[dest] += 1
                        if lc._quiet_ev is not None:
                            self._notify_quiet(lc)
                        continue
                # The full path, one completion at a time, on a balanced ledger.
                if chunks:
                    credit = chunks, pages, held
                    chunks = pages = 0
                    held = []
                    self._credit(*credit)
                e = self._account(lc, t, error, now)
                fire(lc, e, now)
                if lc._quiet_ev is not None:
                    self._notify_quiet(lc)
                if self.deferred and (error is not None or lc._aborted or not store):
                    self._pump_deferred()  # host pages came back
                observed = self.observed
        finally:
            if chunks:
                self._credit(chunks, pages, held)

    def _queue_write(self, lc: Lifecycle, t: Transfer) -> None:
        """``t``, ``lc``'s copy, was copied: its write job goes out now when every earlier chunk of its
        lifecycle was copied (``t`` starts at ``lc._front``), followed by the later ones
        that waited for it; else it waits (held) - so a request's writes reach the store
        in chain order whatever order its copies completed in (F33)."""
        chain = lc._wchain
        if chain is None:
            chain = lc._wchain = _Chain(lc)
        first = t.first_token
        job = WriteJob(t.id, t.keys, t.host_pages, lc.id, lc.rid, chain=chain, first_token=first)
        if first != lc._front:  # an earlier chunk is still in flight
            self.held.setdefault(lc.id, {})[first] = job
            return
        self.writes[t.id] = job
        self._write_out.append(job)
        front = lc._front = first + t.n_tokens
        waiting = self.held.get(lc.id) if self.held else None
        if waiting:
            ps = self.config.page_size
            while front in waiting:
                job = waiting.pop(front)
                self.writes[job.id] = job
                self._write_out.append(job)
                front += len(job.host_pages) * ps
            lc._front = front
            if not waiting:
                del self.held[lc.id]

    def _skip_held(self, lc: Lifecycle, first: int) -> None:
        """The held write jobs of ``lc`` from token ``first`` on are never written (a hole
        or an abort before them, F33): their host pages return, counted as skipped."""
        waiting = self.held.get(lc.id)
        if not waiting:
            return
        c = self.counters
        for start in [f for f in waiting if f >= first]:
            job = waiting.pop(start)
            n = len(job.host_pages)
            c.pages_in_write -= n
            c.pages_store_skipped += n
            self.host_pool.free(job.host_pages)
        if not waiting:
            del self.held[lc.id]

    def _hole(self, lc: Lifecycle, first: int) -> bool:
        """Offload of live ``lc`` stops at token ``first`` (F33): a chunk from there was
        not copied or not stored, so no page after it could ever be reached. No chunk is
        submitted from now on, a deferred one is given up, the held ones after it are
        skipped; the chunks after it still in flight are discarded when they complete.
        Returns whether a deferred chunk was given up (the caller fires chunk_dropped
        unless an event of its own follows)."""
        if 0 <= lc._stop <= first:
            return False
        lc._stop = first
        lc.due = _NEVER
        self._requiet(lc)
        if self.held:
            self._skip_held(lc, first)
        if lc._deferred_since is None:
            return False
        lc._deferred_since = None
        self.deferred.remove(lc)
        self._notify_quiet(lc)
        return True

    def _credit(self, chunks: int, pages: int, held: list[int]) -> None:
        """Write ``chunks`` copied chunks of ``pages`` pages to the ledger and return
        ``held``, their host pages (none while a storage tier writes them behind)."""
        c = self.counters
        c.chunks_inflight -= chunks
        c.pages_inflight -= pages
        c.chunks_copied += chunks
        c.pages_copied += pages
        if self.has_storage:
            c.pages_in_write += pages
        else:
            c.pages_not_stored += pages
        if held:
            self.host_pool.free(held)

    def _account(self, lc: Lifecycle, t: Transfer, error: BaseException | None, now: float) -> int:
        """The ledger part of one completion (``t``, issued by ``lc``), written at once,
        then its log line and events (the ledger balances when they run). Returns the
        event to fire."""
        host = t.host_pages
        npages = len(host)
        c = self.counters
        if error is not None:
            lc._failed = True
            self._hole(lc, t.first_token)  # (the chunk_failed step follows: no drop event)
            c.chunks_inflight -= 1
            c.pages_inflight -= npages
            c.chunks_failed += 1
            c.pages_failed += npages
            self.host_pool.free(host)
            held = self._failure_log.due(now)
            if held:  # a failing device fails every copy: one line per burst interval
                logger.warning(
                    "transfer.failed",
                    rid=lc.rid,
                    lifecycle=lc.id,
                    transfer=t.id,
                    error=repr(error),
                    failures_since_last_log=held,
                )
            if self.listeners:
                self._emit_delivery("transfer.failed", lc, t, now, error=repr(error))
            return _FAILED
        if lc._aborted or 0 <= lc._stop <= t.first_token:  # aborted, or after a hole (F33)
            c.chunks_inflight -= 1
            c.pages_inflight -= npages
            c.chunks_discarded += 1
            c.pages_discarded += npages
            self.host_pool.free(host)
            name = "transfer.discarded"
        elif self.has_storage:
            self._queue_write(lc, t)
            self._credit(1, npages, [])
            name = "transfer.completed"
        else:
            self._credit(1, npages, host)
            name = "transfer.completed"
        if self.observed:
            self._emit_delivery(name, lc, t, now)
        return _DONE

    # --- storage write-behind ------------------------------------------------------------

    def take_writes(self) -> list[WriteJob]:
        """The storage write jobs queued since the last call, in completion order (a
        request's chunks in chain order). Their host pages stay held until
        :meth:`write_done`."""
        out, self._write_out = self._write_out, []
        return out

    def write_done(
        self, job_id: int, stored: bool, *, attempts: int = 1, error: BaseException | None = None
    ) -> list[Lifecycle]:
        """The writer finished job ``job_id`` (stored, or failed after ``attempts``
        tries): its host pages return (rule 3), the outcome is counted, and a burst of
        failures is logged once. Returns what a deferred chunk's expiry released."""
        job = self.writes.pop(job_id, None)
        if job is None:
            raise KVOffloadError(f"storage write {job_id} finished twice or was never queued")
        if self._write_out and any(j is job for j in self._write_out):  # finished before it was taken
            self._write_out = [j for j in self._write_out if j is not job]
        n = len(job.host_pages)
        c = self.counters
        c.pages_in_write -= n
        if attempts > 1:
            c.pages_store_retried += (attempts - 1) * n
        self.host_pool.free(job.host_pages)
        if not stored:
            self._write_hole(job)
        if stored:
            c.pages_stored += n
            if self._burst.since is not None:
                self._recovered(job)
            if self.observed:
                fields = self._notify_write("storage.written", job, attempts=attempts)
                if DEBUG.on:
                    logger.debug("storage.written", **fields)
        elif attempts == 0:  # not written: its chain broke before it (F33)
            c.pages_store_skipped += n
        else:
            c.pages_store_failed += n
            self._store_failed(job, attempts, error)
        if self.deferred:
            self._pump_deferred()
        return self._take_released()

    def _write_hole(self, job: WriteJob) -> None:
        """Job ``job`` was not stored: its lifecycle's chain ends before it (F33). Live:
        offload stops there. Released (not aborted): the pages from there on are lost,
        counted on the lifecycle (while anyone holds it) and in ``pages_lost``."""
        chain = job.chain
        if not isinstance(chain, _Chain):
            return
        first = job.first_token
        if chain.reach < 0:  # live (or aborted)
            lc = chain.lc()
            if lc is not None and lc._s != _RELEASED and self._hole(lc, first):
                self._fire(lc, _DROPPED)
            return
        if first < chain.reach:
            lost = (chain.reach - first) // self.config.page_size
            chain.reach = first
            self.counters.pages_lost += lost
            lc = chain.lc()
            if lc is not None:
                lc.pages_lost += lost
                lc._stop = first

    def _store_failed(self, job: WriteJob, attempts: int, error: BaseException | None) -> None:
        burst = self._burst
        n = len(job.host_pages)
        now = self.clock()
        if burst.since is None:
            burst.since = now
            burst.last_log = now
            burst.logged_pages = n
            logger.warning("storage.failed", transfer=job.id, pages=n, attempts=attempts, error=repr(error))
        elif now - burst.last_log >= self.store_log_interval_s:
            logger.warning(
                "storage.failed",
                pages_failed_since_last_log=burst.pages + n - burst.logged_pages,
                burst_s=now - burst.since,
                error=repr(error),
            )
            burst.last_log = now
            burst.logged_pages = burst.pages + n
        burst.chunks += 1
        burst.pages += n
        if self.listeners:
            self._notify_write("storage.failed", job, attempts=attempts, error=repr(error))

    def _recovered(self, job: WriteJob) -> None:
        burst = self._burst
        assert burst.since is not None
        fields = {
            "chunks_failed": burst.chunks,
            "pages_failed": burst.pages,
            "burst_s": self.clock() - burst.since,
        }
        logger.info("storage.recovered", **fields)
        burst.since = None
        burst.chunks = burst.pages = burst.logged_pages = 0
        if self.listeners:
            self._notify_write("storage.recovered", job, **fields)

    def _notify_write(self, name: str, job: WriteJob, **extra: object) -> dict[str, object]:
        n = len(job.host_pages)
        fields: dict[str, object] = {"lifecycle": job.lifecycle_id, "rid": job.rid, "transfer": job.id}
        fields.update(pages=n, bytes=n * self.page_bytes, t=self.clock(), **extra)
        notify_listeners(self.listeners, name, fields, self.listener_failures, self.clock)
        return fields

    # --- time ---------------------------------------------------------------------------

    def pump(self) -> list[Lifecycle]:
        """Retry deferred chunks now (host pages may have come back); drop the expired.
        Returns what an expired deferral released."""
        if self.deferred:
            self._pump_deferred()
        return self._take_released()

    def expire_waits(self) -> list[Lifecycle]:
        """A poll passed (``polls`` was counted): deferred chunks that waited past
        ``host_wait_polls`` are dropped (and the others retried). Returns what that
        released."""
        if self.deferred:
            self._pump_deferred()
        return self._take_released()

    def tick(self) -> list[Lifecycle]:
        """The time-based checks, now: deferral expiry (and retry) and the watchdog
        (F18). Returns what an expired deferral released."""
        if self.deferred:
            self._pump_deferred()
        if self.config.stuck_after_s is not None:
            from kvoffload.core.watchdog import report_stuck

            report_stuck(self)
        return self._take_released()

    # --- transitions ---------------------------------------------------------------------

    def _fire(self, lc: Lifecycle, e: int, now: float | None = None) -> None:
        """Apply event ``e`` to ``lc`` after its effect on the counts: one table step."""
        s = lc._s
        dest = TABLE[s][e][((lc.inflight > 0) << 1) | (lc._deferred_since is not None)]
        if dest < 0:
            self._illegal(lc, e)
        if dest != s:
            counts = self.state_counts
            counts[s] -= 1
            lc._s = dest
            lc.state_since = self.clock() if now is None else now
            if not EXTEND_SELF_LOOP[dest]:
                if lc._row >= 0:  # extend is no longer its plain step
                    cast("DecodeRows", self.rows).detach(lc)
                lc._quiet = -1
            if dest == _RELEASED:
                if self.observed:
                    self.emit_transition(lc, s, dest, e)
                self._release(lc)
                return
            counts[dest] += 1
        if self.observed:
            self.emit_transition(lc, s, dest, e)

    def _notify_quiet(self, lc: Lifecycle) -> None:
        ev = lc._quiet_ev
        if ev is not None and lc.quiescent:
            lc._quiet_ev = None
            ev.set()

    def _release(self, lc: Lifecycle) -> None:
        """RELEASED: the one place device pages are returned (F2-F8). Runs once per
        lifecycle because RELEASED is terminal in the table."""
        assert lc.inflight == 0 and lc._deferred_since is None, "released with a copy pending"
        pages = lc.device_pages  # still listed until the engine was told (on_released)
        self.device_pool.free(pages)
        lc._tail = lc._tail[:0]
        outcome = Outcome.ABORTED if lc._aborted else Outcome.FAILED if lc._failed else Outcome.COMPLETED
        lc.outcome = outcome
        del self.live[lc.id]
        c = self.counters
        if not lc._aborted:  # whole pages not offloaded: never sent, or after a hole (F33)
            reach = lc._stop if lc._stop >= 0 else lc.submitted
            lost = (lc.committed - reach) // self.config.page_size
            lc.pages_lost = lost
            lc._stop = reach
            c.pages_lost += lost
            if lc._wchain is not None:
                lc._wchain.reach = reach
        if outcome is Outcome.COMPLETED:
            c.released_completed += 1
        elif outcome is Outcome.ABORTED:
            c.released_aborted += 1
        else:
            c.released_failed += 1
        if self.observed:
            self.emit("lifecycle.released", lc, outcome=outcome.value, device_pages=len(pages))
        self._released.append(lc)
        ev = lc._released_ev
        if ev is not None:
            lc._released_ev = None
            ev.set()
        self._notify_quiet(lc)

    def told(self, released: Iterable[Lifecycle]) -> None:
        """The engine was told about ``released`` (``on_released`` ran): they stop
        listing their device pages. Until then a RELEASED lifecycle still lists the
        pages it held - already back in the pool (owned mode) or the engine's to free -
        so its callback can hand them back. Whoever receives released lifecycles from
        the core (the drivers, :class:`_DirectHost`) calls this once it told the engine."""
        for lc in released:
            if lc._s == _RELEASED:
                lc.device_pages = []

    def _take_released(self) -> list[Lifecycle]:
        out = self._released
        if out:
            self._released = []
        return out

    # --- events out ----------------------------------------------------------------------

    def emit(self, name: str, lc: Lifecycle, **fields: Any) -> None:
        """Send event ``name`` about ``lc`` to the listeners and (at debug) structlog."""
        fields["lifecycle"] = lc.id
        fields["rid"] = lc.rid
        fields["t"] = self.clock()
        if self.listeners:
            notify_listeners(self.listeners, name, fields, self.listener_failures, self.clock)
        if DEBUG.on:
            log = lc._log
            if log is None:
                log = lc._log = logger.bind(lifecycle=lc.id, rid=lc.rid)
            log.debug(name, **{k: v for k, v in fields.items() if k not in ("lifecycle", "rid")})

    def _emit_delivery(self, name: str, lc: Lifecycle, t: Transfer, now: float, **extra: Any) -> None:
        npages = len(t.host_pages)
        self.emit(
            name,
            lc,
            transfer=t.id,
            pages=npages,
            bytes=npages * self.page_bytes,
            latency_s=now - t.submitted_at,
            **extra,
        )

    def emit_transition(self, lc: Lifecycle, s: int, dest: int, e: int) -> None:
        """The ``lifecycle.transition`` event of one table step."""
        self.emit(
            "lifecycle.transition",
            lc,
            trigger=EVENT_NAMES[e],
            **{"from": STATES[s].name, "to": STATES[dest].name},
        )

    def refresh_observed(self) -> bool:
        """Recompute :attr:`observed` (listeners, and whether debug logging is seen); when
        it changes, every live lifecycle's fast-path threshold follows (O(live), rare)."""
        observed = refresh_debug() or bool(self.listeners)
        if observed != self.observed:
            if observed and self.rows is not None:
                self.rows.detach_all()  # every step of theirs emits an event from now on
            self.observed = observed
            for lc in self.live.values():
                self._requiet(lc)
        return observed

    # --- reading ---------------------------------------------------------------------------

    @property
    def busy(self) -> bool:
        """Whether a chunk is in flight, deferred, or waiting for its storage write."""
        return bool(self.inflight or self.deferred or self.writes)

    def statistics(self) -> Statistics:
        """A frozen snapshot of the state and counters."""
        sc = self.state_counts
        return Statistics(
            live_lifecycles=len(self.live),
            pending=sc[0],
            offloading=sc[1],
            finishing=sc[2],
            device_pages_used=self.device_pool.used,
            device_pages_total=self.device_pool.n_pages,
            host_pages_used=self.host_pool.used,
            host_pages_total=self.host_pool.n_pages,
            **self.counters.as_dict(),  # every counter is a Statistics field of its name
        )

    def check_invariants(self) -> None:
        """Raise :class:`~kvoffload.InvariantViolation` if the ledger does not balance
        (ARCHITECTURE.md rules 1-6). Tests call it after every step."""
        from kvoffload.core.ledger import check

        check(self)

    def __repr__(self) -> str:
        return f"<OffloadCore live={len(self.live)} inflight={len(self.inflight)}>"
