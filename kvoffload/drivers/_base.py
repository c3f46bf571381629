"""What both drivers share: building the core and its movers, the owner thread, the
lifecycle protocol, ``on_released``, and parking buffers a wedged copy may still read.

A driver owns threads and tasks and nothing else: every decision is the core's. It
hands the core's copy jobs to the backend (``submit`` accepts; ``launch`` starts them
when control returns to the driver, F19), takes completions and finished storage
writes back to the core, and tells the engine which lifecycles were released.
"""

from __future__ import annotations

import math
import numbers
import os
import threading
import time
from _thread import get_ident
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from kvoffload.abc import Completion, EventBackend, Storage, Transfer
from kvoffload.config import OffloadConfig, physical_memory
from kvoffload.core.events import Listener, logger
from kvoffload.core.kv_events import DEFAULT_MAXLEN, KVEvents
from kvoffload.core.lifecycle import Lifecycle
from kvoffload.core.loads import Load
from kvoffload.core.offload import OffloadCore
from kvoffload.core.stats import Counters, Statistics
from kvoffload.errors import ConfigError, KVOffloadError, ManagerClosed, StorageError, wrong_thread
from kvoffload.keys import check_seed, namespace_seed, page_run_keys, validate_tokens
from kvoffload.lifecycle.load_table import validate_load
from kvoffload.lifecycle.table import validate
from kvoffload.pools import EnginePages

if TYPE_CHECKING:
    from kvoffload.pools import DevicePool, HostPool
    from kvoffload.storage.writer import WritePolicy

__all__ = ["DriverBase", "check_timeout", "first_error", "load_buffers", "parked"]

_spec_validated = False

#: Buffers (pools) and backends left behind by a close that timed out while a copy
#: still ran: kept referenced here so nothing frees them under the copy (F21). An
#: entry goes once its backend's threads have ended.
_PARKED: list[tuple[EventBackend, tuple[Any, ...]]] = []
_PARKED_LOCK = threading.Lock()


def park(backend: EventBackend, *buffers: Any) -> None:
    """Keep ``buffers`` alive until ``backend`` has no copy running."""
    with _PARKED_LOCK:
        _PARKED[:] = [(b, bufs) for b, bufs in _PARKED if not b.join(0)]
        _PARKED.append((backend, buffers))


def parked() -> int:
    """How many closed managers' buffers are parked under a copy still running."""
    with _PARKED_LOCK:
        _PARKED[:] = [(b, bufs) for b, bufs in _PARKED if not b.join(0)]
        return len(_PARKED)


def first_error(errors: list[BaseException], done: str | None = None) -> BaseException:
    """The first of ``errors`` (callback errors, in order), with a note naming the
    others and, with ``done``, a note saying what completed regardless."""
    first = errors[0]
    if done is not None:
        first.add_note(f"kvoffload: raised by an on_released callback during {done}")
    if len(errors) > 1:
        rest = "; ".join(repr(e) for e in errors[1:8])
        more = f" (and {len(errors) - 8} more)" if len(errors) > 8 else ""
        first.add_note(f"kvoffload: {len(errors) - 1} more callback error(s): {rest}{more}")
    return first


def check_timeout(what: str, timeout: object) -> float | None:
    """``timeout`` as seconds: ``None`` (for ever) or a number >= 0 (``inf`` is for
    ever too). A bool, a str, nan or a negative number raises
    :class:`~kvoffload.ConfigError` naming ``what``: nothing was waited for."""
    if timeout is None:
        return None
    seconds = float(timeout) if isinstance(timeout, numbers.Real) and not isinstance(timeout, bool) else -1.0
    if not seconds >= 0:  # nan, negative, or not a number
        raise ConfigError(
            f"{what}: timeout must be None or a number of seconds >= 0 (not nan), got {timeout!r}"
        )
    return None if math.isinf(seconds) else seconds


def load_buffers(pool: HostPool, pages: Sequence[int]) -> list[memoryview]:
    """A writable, contiguous byte view of each host page of ``pool`` (no copy), for a
    load's store read (``Storage.get_into``). The load holds the pages while its read
    runs; the caller drops the views when the read returned."""
    import torch

    t = pool.tensor
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError(f"{pool!r}: pages can be read into only in a contiguous CPU tensor")
    raw: Any = t.view(-1).view(torch.uint8).numpy()  # the pool's own memory, as bytes
    flat = memoryview(raw)
    size = flat.nbytes // pool.n_pages
    return [flat[p * size : (p + 1) * size] for p in pages]


class DriverBase:
    """The parts of :class:`~kvoffload.OffloadManager` and
    :class:`~kvoffload.SyncOffloadManager` that do not depend on how they wait."""

    #: What the driver is called in errors.
    _kind: ClassVar[str] = "manager"

    def __init__(
        self,
        config: OffloadConfig,
        *,
        backend: str | EventBackend = "auto",
        storage: str | os.PathLike[str] | Storage | None = None,
        clock: Callable[[], float] = time.monotonic,
        write_policy: WritePolicy | None = None,
        on_released: Callable[[Lifecycle], object] | None = None,
        device_kv: Any = None,
        host_buffer: Any = None,
    ) -> None:
        global _spec_validated
        if not _spec_validated:
            validate()
            validate_load()
            _spec_validated = True
        from kvoffload.backends import resolve_backend
        from kvoffload.storage import resolve_storage
        from kvoffload.storage.writer import WritePolicy

        if not isinstance(config, OffloadConfig):
            raise KVOffloadError(f"config must be an OffloadConfig, got {type(config).__name__}")
        if on_released is not None and not callable(on_released):
            raise KVOffloadError(
                f"on_released must be callable (called with each released lifecycle), got {on_released!r}"
            )
        self.config = config
        # _namespace_seed: the chain seed of every call that passes none (F22).
        self._namespace_seed = namespace_seed(extra_key=config.namespace)
        # Engine-owned mode: "auto" (and "cuda") follow the device of the engine's KV.
        kv = device_kv if config.device_pages is None else None
        kv_first = kv[0] if isinstance(kv, (list, tuple)) and kv else kv
        self.backend: EventBackend = resolve_backend(backend, getattr(kv_first, "device", None))
        self.storage: Storage | None = resolve_storage(storage)
        self.write_policy = write_policy if write_policy is not None else WritePolicy()
        self.clock = clock
        self.on_released = on_released
        device, host = self._pools(config, device_kv, host_buffer)
        self.device_pool: DevicePool | EnginePages = device
        self.host_pool: HostPool = host
        page_bytes = host.tensor[0].numel() * host.tensor.element_size() if host.n_pages else 0
        self.page_bytes = page_bytes
        self.core: OffloadCore = OffloadCore(
            config,
            device_pool=device,
            host_pool=host,
            accept=self._accept,
            clock=clock,
            storage=self.storage is not None,
            streams=self.backend.streams,
            page_bytes=page_bytes,
            store_log_interval_s=self.write_policy.log_interval_s,
        )
        self.core.host = self
        # _owner: the owner thread's ident, set when the manager opens.
        self._owner: int | None = None
        self._open = False
        self._closed = False
        # _calls: lc.finish() / lc.abort() made by a listener while the driver applies a
        # delivery step to the core (completions, finished writes, timers): applied, in
        # order, once the step is done (_apply_calls); None outside such a step.
        # Invariant: self._calls is None or the driver is inside _delivering()
        self._calls: list[tuple[bool, Lifecycle]] | None = None
        # _errors: while a wait or a close runs to its end, the errors of on_released
        # callbacks (and of deferred calls), raised once it is done; None otherwise.
        self._errors: list[BaseException] | None = None

    def _pools(self, config: OffloadConfig, device_kv: Any, host_buffer: Any) -> tuple[Any, HostPool]:
        """Owned mode: the backend's device and host pools. Engine-owned mode
        (``device_pages=None``): the engine's ``device_kv`` (checked) and a host pool of
        pages laid out as a page of every KV tensor, in order."""
        backend = self.backend
        if config.device_pages is not None:
            if device_kv is not None:
                raise ConfigError(
                    "device_kv= hands over the engine's KV memory: use it with device_pages=None "
                    "(engine-owned mode); device_pages=N makes kvoffload own its device pool"
                )
            return backend.create_pools(config, host_buffer)
        if device_kv is None:
            raise ConfigError(
                "device_pages=None (engine-owned mode) needs device_kv=: the engine's KV tensors, "
                "each (num_pages, page_size, ...)"
            )
        device = EnginePages(device_kv, config.page_size)
        if device.device.type != backend.device_type:
            raise ConfigError(
                f"device_kv is on {device.device}, but the {backend.name} backend copies from "
                f"{backend.device_type} tensors"
            )
        size = config.host_pages * device.page_bytes
        ram = physical_memory()
        if ram is not None and size > ram:
            raise ConfigError(
                f"host_pages={config.host_pages} is a pool of {size:,} bytes ({device.page_bytes:,} bytes a "
                f"page of device_kv), more than this machine's {ram:,} bytes of RAM"
            )
        host = backend.create_host_pool(
            config.host_pages, (device.page_bytes,), "uint8", zero=config.host_zero, buffer=host_buffer
        )
        return device, host

    # --- the core's job output -----------------------------------------------------------

    def _accept(self, t: Transfer) -> None:
        """The core's sink: the backend accepts the job now (or refuses: nothing changed);
        the copy starts when control returns to the driver (:meth:`_launch_soon`)."""
        self.backend.submit(t)
        self._launch_soon()

    def _launch_soon(self) -> None:
        raise NotImplementedError

    def _complete(self, batch: list[Completion]) -> list[Lifecycle]:
        """Apply ``batch`` to the core. A completion the core refuses (delivered twice,
        never submitted: a backend's bug) is logged and skipped, and the rest are
        applied, so one bad completion never strands the others (F20)."""
        core = self.core
        try:
            return core.complete(batch)
        except KVOffloadError as exc:
            seen: set[int] = set()
            known = []
            for tid, e in batch:
                if (tid in core.inflight or tid in core.loads.copying) and tid not in seen:
                    seen.add(tid)
                    known.append((tid, e))
            logger.error(
                "manager.step_failed", step="deliver", skipped=len(batch) - len(known), error=repr(exc)
            )
            return core.complete(known)

    # --- state shared with tests and tools -----------------------------------------------

    @property
    def counters(self) -> Counters:
        """The core's live counters (read them through :meth:`statistics`)."""
        return self.core.counters

    # --- the owner thread ------------------------------------------------------------------

    def _check_owner(self, what: str) -> None:
        owner = self._owner
        if owner is not None and get_ident() != owner:
            raise wrong_thread(owner, what)

    def _check_open(self, what: str) -> None:
        self._check_owner(what)
        if not self._open:
            if self._closed:
                raise ManagerClosed(
                    f"{what} needs an open manager, but this {self._kind} is closed (closing aborted "
                    "every live lifecycle); nothing was changed"
                )
            raise KVOffloadError(f"{what} needs an open manager: {self._open_hint()}")

    def _open_hint(self) -> str:
        raise NotImplementedError

    def wait_lifecycle(self, lc: Lifecycle, released: bool) -> Awaitable[None]:
        """``await lc.wait_released()`` / ``wait_quiescent()`` (the driver's way of waiting)."""
        raise NotImplementedError

    # --- registry ------------------------------------------------------------------------

    def admit(
        self,
        rid: Any,
        prompt: Sequence[int],
        *,
        pages: Sequence[int] | None = None,
        tag: Any = None,
        chain_seed: str | None = None,
        stored: int | None = None,
    ) -> Lifecycle:
        """Admit a request: its new lifecycle, in PENDING (or OFFLOADING when the
        prompt's unstored whole pages go out at once).

        ``rid`` is a label: it may equal a live lifecycle's rid (a reused request id);
        the two never share state. ``pages``: engine-owned mode, the engine's ids of
        exactly the pages the prompt fills (``[]`` for an empty prompt). ``tag`` is the
        engine's handle, carried as ``lc.tag``; ``chain_seed`` seeds the page-key chain
        (default: the config's ``namespace`` seed; ``""`` for none); ``stored``: leading
        prompt tokens the tier already has (page-aligned; default the page-aligned
        prompt, or 0 with ``offload_prompt``), never copied, the chain continuing from
        their key. Raises :class:`~kvoffload.ConfigError` for a seed that is not hex,
        :class:`~kvoffload.InvalidTokens`, :class:`~kvoffload.PoolExhausted`,
        :class:`~kvoffload.PageError` (a page id out of range, named twice or held by
        another live lifecycle; a wrong count), or the backend's error when it refuses
        the prompt chunk, with nothing changed; :class:`~kvoffload.WrongThread` off the
        owner thread.
        """
        self._check_open("admit()")
        return self.core.admit(
            rid, prompt, pages=pages, tag=tag, chain_seed=self._seed(chain_seed), stored=stored
        )

    def extend_batch(
        self,
        lifecycles: Sequence[Lifecycle],
        tokens: Sequence[Any],
        *,
        pages: Sequence[Any] | None = None,
        ready: Any = None,
    ) -> None:
        """One decode step for many lifecycles at once: exactly as ``lc.extend(tokens[i],
        pages=pages[i], ready=ready)`` for each lifecycle in order (keys and chunk
        boundaries included), at a fraction of the per-request cost. ``tokens[i]`` is a
        token id or a sequence of them. Bad input anywhere in the batch raises before
        anything changes (:class:`~kvoffload.InvalidTransition`,
        :class:`~kvoffload.InvalidTokens`, :class:`~kvoffload.PageError`,
        :class:`~kvoffload.PoolExhausted`, :class:`~kvoffload.KVOffloadError`)."""
        self._check_open("extend_batch()")
        self.core.extend_batch(lifecycles, tokens, pages=pages, ready=ready)

    def _seed(self, chain_seed: str | None) -> str | None:
        """``chain_seed`` (checked), or the namespace's seed when it is None."""
        return self._namespace_seed if chain_seed is None else check_seed(chain_seed)

    def lifecycles(self, rid: Any = None) -> list[Lifecycle]:
        """Live lifecycles, oldest first; with ``rid``, those labelled ``rid`` (there may be
        several: a reused id). For observability: O(live)."""
        self._check_owner("lifecycles()")
        return self.core.lifecycles(rid)

    def __iter__(self) -> Iterator[Lifecycle]:
        self._check_owner("iter(mgr)")
        return iter(list(self.core.live.values()))

    def __len__(self) -> int:
        self._check_owner("len(mgr)")
        return len(self.core.live)

    # --- the lifecycle protocol (kvoffload.core.lifecycle.LifecycleHost) ---------------------

    def finish_lifecycle(self, lc: Lifecycle) -> None:
        """``lc.finish()``: the core's step, then ``on_released`` if it released ``lc``.
        From a listener during a delivery step (or another finish or abort): applied
        once that step is done. A listener's calls during this one wait for it."""
        self._end_lifecycle(lc, abort=False)

    def abort_lifecycle(self, lc: Lifecycle) -> None:
        """``lc.abort()``: as :meth:`finish_lifecycle`, with the core's abort."""
        self._end_lifecycle(lc, abort=True)

    def _end_lifecycle(self, lc: Lifecycle, *, abort: bool) -> None:
        calls = self._calls
        if calls is not None:
            calls.append((abort, lc))
            return
        self._calls = []  # a listener's call during this step waits for it
        try:
            released = self.core.abort(lc) if abort else self.core.finish(lc)
        finally:
            more, errors = self._apply_calls()
        self._released(released + more, raise_errors=True, errors=errors)

    def _delivering(self) -> bool:
        """Start a delivery step: from now on a listener's ``lc.finish()`` / ``lc.abort()``
        is held (it would change a lifecycle the core is in the middle of changing, and
        lose the rest of the batch) until :meth:`_apply_calls`. False when a step is
        already under way (a nested one leaves the applying to the outer)."""
        if self._calls is not None:
            return False
        self._calls = []
        return True

    def _apply_calls(self) -> tuple[list[Lifecycle], list[BaseException]]:
        """End a delivery step: apply the calls held during it, in order; returns what
        they released and the errors of the calls no longer legal (``finish()`` of a
        lifecycle the step released), each logged (``manager.step_failed``); the driver
        raises those like ``on_released`` errors (:meth:`_released`)."""
        released: list[Lifecycle] = []
        errors: list[BaseException] = []
        core = self.core
        while self._calls:  # a call may release a lifecycle whose listener calls again
            calls, self._calls = self._calls, []
            for abort, lc in calls:
                try:
                    if abort:
                        if not lc.released:  # released by the step itself: a no-op
                            released += core.abort(lc)
                    else:
                        released += core.finish(lc)
                except KVOffloadError as exc:
                    logger.error(
                        "manager.step_failed",
                        step="abort" if abort else "finish",
                        lifecycle=lc.id,
                        error=repr(exc),
                    )
                    errors.append(exc)
        self._calls = None
        return released, errors

    def _released(
        self, released: list[Lifecycle], raise_errors: bool = False, errors: list[BaseException] | None = None
    ) -> None:
        """Tell the engine: ``on_released(lc)`` for each, on the owner thread, after the
        core's ledger is consistent. ``lc.device_pages`` still lists the lifecycle's
        pages while its callback runs and is ``[]`` once every callback returned. A
        callback that raises is logged (``manager.on_released_failed``) and the others
        still run; with ``raise_errors`` the first error then reaches the caller of the
        call that released (the others in its notes) - or, while a wait or a close runs
        to its end (:attr:`_errors`), is kept for it to raise at the end. ``errors``:
        earlier errors of the same step (held calls), which come first."""
        errors = [] if errors is None else list(errors)
        cb = self.on_released
        try:
            if cb is not None:
                for lc in released:
                    try:
                        cb(lc)
                    except Exception as exc:
                        logger.error(
                            "manager.on_released_failed", lifecycle=lc.id, rid=lc.rid, error=repr(exc)
                        )
                        errors.append(exc)
        finally:
            self.core.told(released)  # the engine was told: no page id stays listed
        if not errors:
            return
        if self._errors is not None:
            self._errors += errors
        elif raise_errors:
            raise first_error(errors)

    # --- storage reads (keys) ---------------------------------------------------------------

    def _read_keys(self, tokens: Sequence[int], n: int | None, chain_seed: str | None) -> list[str]:
        """Chain keys of the whole pages of ``tokens[:n]`` (all whole pages when ``n`` is None)."""
        from kvoffload.errors import InvalidTokens

        ps = self.config.page_size
        toks = validate_tokens(tokens)
        if n is None:
            n = len(toks) - len(toks) % ps
        elif type(n) is not int or not 0 <= n <= len(toks) or n % ps:
            raise InvalidTokens(
                f"fetch n={n!r} must be a multiple of page_size ({ps}) "
                f"between 0 and len(tokens) ({len(toks)})"
            )
        return page_run_keys(self._seed(chain_seed), toks[:n], ps)

    def _store(self) -> Storage:
        if self.storage is None:
            raise StorageError(f"this {self._kind} has no storage tier (storage=None): nothing to look up")
        return self.storage

    def _fetched(self, pages: list[bytes | None]) -> list[bytes]:
        size = self.host_pool.tensor[0].nbytes if self.host_pool.n_pages else -1
        out: list[bytes] = []
        for page in pages:
            if page is None or len(page) != size:
                break
            out.append(page)
        return out

    # --- loads (the way back: store -> host pool -> device pages) -------------------------

    def _begin_load(
        self,
        what: str,
        tokens: Sequence[int],
        device_pages: Any,
        chain_seed: str | None,
        skip_pages: int,
        rid: Any,
        tag: Any,
    ) -> Load:
        """The core's ``load_begin`` of the whole pages of ``tokens`` from page
        ``skip_pages`` on, under their chain keys (exactly those ``lookup``/``fetch``
        compute; namespaced). Raises (nothing held) :class:`~kvoffload.StorageError`
        without a storage tier, :class:`~kvoffload.InvalidTokens` for bad tokens or
        ``skip_pages``, and what ``load_begin`` raises."""
        from kvoffload.errors import InvalidTokens

        self._check_open(what)
        if self.storage is None:
            raise StorageError(
                f"{what}: this {self._kind} has no storage tier (storage=None): nothing to load from"
            )
        keys = self._read_keys(tokens, None, chain_seed)
        if type(skip_pages) is not int or not 0 <= skip_pages <= len(keys):
            raise InvalidTokens(
                f"{what}: skip_pages={skip_pages!r} must be an int between 0 and the {len(keys)} whole "
                "page(s) of tokens"
            )
        return self.core.load_begin(rid, keys[skip_pages:], device_pages, tag=tag, first_page=skip_pages)

    def _check_load(self, load: Load, what: str) -> None:
        if not isinstance(load, Load) or (not load.done and self.core.loads.live.get(load.id) is not load):
            raise KVOffloadError(
                f"{what}({load!r}): not a live load of this manager (another manager began it)"
            )

    def cancel_load(self, load: Load) -> None:
        """The engine takes ``load``'s device pages back (an abort, a preemption): no copy
        of it starts from now on; it ends CANCELLED once its store read returned or its
        copy in flight completed (``load.device_busy`` stays True until then: do not
        reuse its pages before). On a DONE load a no-op."""
        self._check_owner("cancel_load()")
        if load.done:
            return
        self._check_load(load, "cancel_load")
        self.core.load_cancel(load)

    # --- observability -------------------------------------------------------------------

    def add_listener(self, listener: Listener) -> Callable[[], None]:
        """Call ``listener(event_name, fields)`` for every event; returns a remover.
        Listeners are called on the owner thread; attaching one makes every step build
        its events (the slow path)."""
        self._check_owner("add_listener()")
        core = self.core
        listeners = core.listeners
        listeners.append(listener)
        core.refresh_observed()

        def remove() -> None:
            if listener in listeners:
                listeners.remove(listener)
                core.refresh_observed()

        return remove

    def kv_events(self, maxlen: int = DEFAULT_MAXLEN) -> KVEvents:
        """Subscribe to the manager's KV events and return its one buffer
        (:class:`~kvoffload.KVEvents`; the same one on every call, until it is closed):
        a :class:`~kvoffload.BlockStored` for each run of pages the store confirmed, a
        :class:`~kvoffload.BlockRemoved` for a page a load found gone (vLLM's shapes; see
        :mod:`kvoffload.core.kv_events`). Iterating the buffer drains it; it keeps the
        newest ``maxlen`` events (the oldest dropped and counted). Nothing is recorded,
        and nothing costs, before the first call. Owner thread; raises
        :class:`~kvoffload.ConfigError` for a bad ``maxlen``."""
        self._check_owner("kv_events()")
        return self.core.kv.subscribe(maxlen)

    @property
    def is_open(self) -> bool:
        """Whether the manager is open (entered and not yet closed)."""
        return self._open

    @property
    def copies_in_flight(self) -> int:
        """Copies submitted and not yet delivered: while non-zero, some device page is
        being read (the engine must not move or free a lifecycle's pages). O(1)."""
        return len(self.core.inflight)

    @property
    def outstanding(self) -> int:
        """Work that only :meth:`poll` (or the event loop) moves on: copies in flight,
        chunks deferred for host pages, storage writes not yet collected, live loads. A scheduler
        that sleeps when idle must not sleep while this is non-zero. O(1)."""
        core = self.core
        return len(core.inflight) + len(core.deferred) + len(core.writes) + len(core.loads.live)

    def statistics(self) -> Statistics:
        """A frozen snapshot of the manager's state and counters."""
        self._check_owner("statistics()")
        return self.core.statistics()

    def check_invariants(self) -> None:
        """Raise :class:`~kvoffload.InvariantViolation` if the ledger does not balance
        (ARCHITECTURE.md rules 1-6). Tests call it after every step."""
        self._check_owner("check_invariants()")
        self.core.check_invariants()

    def _drain_error(self, what: str, timeout: float | None) -> str:
        core = self.core
        stuck = list(core.inflight.values())
        return (
            f"{what} after {timeout}s with {len(stuck)} copies in flight, {len(core.deferred)} chunks "
            f"waiting for host pages, {len(core.writes)} storage writes unfinished: {stuck[:4]!r}; "
            "the pages they use were not freed"
        )

    def _park(self) -> str:
        """Park this manager's buffers under the copies still running; describe them."""
        running = self.backend.running()
        park(self.backend, self.device_pool, self.host_pool)
        return f"wedged copies: {running[:4]!r}; their buffers are parked, never freed"

    def __repr__(self) -> str:
        core = self.core
        name = type(self).__name__
        return f"<{name} backend={self.backend.name} live={len(core.live)} inflight={len(core.inflight)}>"
