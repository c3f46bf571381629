"""Structured events: one stable name per kind of thing, sent to the application's
logging and to in-process listeners (the timeline recorder, tests).

The library configures no logging. An event goes to the application's structlog
configuration when it has one, else to the stdlib logger ``"kvoffload"``, which has a
NullHandler: nothing is printed unless the application configured logging. Hot-path
events (transitions, submissions, completions) are debug events, *built* only when
someone would see them - a listener is attached, or the application's logging lets
kvoffload's debug through (:data:`DEBUG`, refreshed at each admit) - so the hot path
pays one attribute read for them.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvoffload.abc import Transfer
    from kvoffload.core.lifecycle import Lifecycle

__all__ = [
    "DEBUG",
    "EVENT_NAMES",
    "Events",
    "STDLIB_LOGGER",
    "Listener",
    "Log",
    "RateLimit",
    "configured_structlog",
    "debug_enabled",
    "logger",
    "notify_listeners",
    "refresh_debug",
]

#: Every event name kvoffload emits (docs/events.md lists them; a test checks).
EVENT_NAMES: dict[str, str] = {
    "lifecycle.admitted": "a lifecycle was created (debug)",
    "lifecycle.transition": "a lifecycle changed state or took a self-transition (debug)",
    "lifecycle.released": "a lifecycle reached RELEASED; device pages returned (debug)",
    "lifecycle.stuck": "watchdog: a lifecycle stayed in OFFLOADING/FINISHING past stuck_after_s (warning)",
    "transfer.submitted": "a chunk was handed to the copy backend (debug)",
    "transfer.completed": "a chunk's copy completed and was delivered (debug)",
    "transfer.failed": "a chunk's copy failed (warning)",
    "transfer.discarded": "a chunk completed after its lifecycle was aborted (debug)",
    "transfer.refused": "the copy backend refused a chunk outside a caller's call (warning, rate-limited)",
    "chunk.dropped": "a chunk found the host pool full and was dropped (warning, rate-limited)",
    "chunk.deferred": "a chunk waits for host pages under on_host_full='wait' (debug)",
    "storage.written": "a chunk's pages were written to the storage tier (debug)",
    "storage.failed": "a storage write failed after its retries (warning, once per burst of failures)",
    "storage.recovered": "the first storage write to succeed after a burst of failures (info)",
    "manager.drain_timeout": "leaving the manager timed out with copies in flight (error)",
    "manager.closed_live": "closed with lifecycles never finished; they were aborted (warning)",
    "manager.on_released_failed": "on_released raised; the ledger was already consistent (error)",
    "listener.failed": "a listener raised; the event's step still ran to completion (error)",
    "manager.fast_paths_off": (
        "a listener or debug logging turned this manager's fast paths off (warning, once per manager)"
    ),
    "manager.step_failed": "a driver's background step failed and was contained; the manager runs on (error)",
    "sglang.rows_reclaimed_mid_copy": "SGLang took a request's rows back while a copy read them (error)",
    "sglang.storage_fallback": "SGLang's storage could not be built: HiCacheFile's format written (warning)",
}

Listener = Callable[[str, dict[str, Any]], None]


def notify_listeners(
    listeners: list[Listener],
    name: str,
    fields: dict[str, Any],
    limits: dict[str, RateLimit],
    clock: Callable[[], float],
) -> None:
    """Call every listener with event ``name``. The core calls this in the middle of a
    synchronous step: a listener that raises is logged (``listener.failed``) and the
    step goes on, so a listener's bug never leaves the ledger half changed.

    ``limits``: the caller's rate limits of ``listener.failed`` lines, by event name,
    read on the caller's ``clock`` (one manager's state: another manager's failures, or
    the wall clock, never silence this one's first line)."""
    for fn in tuple(listeners):  # a listener may remove itself (or another) while called
        try:
            fn(name, fields)
        except Exception as exc:
            limit = limits.get(name)
            if limit is None:
                limit = limits[name] = RateLimit()
            held = limit.due(clock())
            if held:  # a listener that fails on every event: a line per event name per interval
                logger.error(
                    "listener.failed",
                    listener=repr(fn),
                    event_name=name,
                    error=repr(exc),
                    failures_since_last_log=held,
                )


class RateLimit:
    """One warning line per ``interval_s`` for a kind of event that can come in bursts
    (a full host pool, a failing device): the first of a burst is logged at once, the
    rest are held back and counted, and the next line says how many there were."""

    __slots__ = ("held", "interval_s", "last")

    def __init__(self, interval_s: float = 5.0) -> None:
        self.interval_s = interval_s
        self.last = -1e18  # clock time of the last line
        self.held = 0  # events since the last line, this one included once counted

    def due(self, now: float) -> int:
        """Count one event; return how many to report if a line is due now, else 0."""
        self.held += 1
        if now - self.last < self.interval_s:
            return 0
        n, self.held, self.last = self.held, 0, now
        return n


#: The stdlib logger kvoffload writes to when the application has not configured
#: structlog. It has a NullHandler, as a library's logger should: nothing is printed
#: unless the application configured logging (then its handlers decide).
STDLIB_LOGGER = logging.getLogger("kvoffload")
STDLIB_LOGGER.addHandler(logging.NullHandler())

_LEVEL_NAMES = {
    logging.DEBUG: "debug",
    logging.INFO: "info",
    logging.WARNING: "warning",
    logging.ERROR: "error",
}


class Log:
    """kvoffload's logger. An event goes to the application's structlog configuration
    when it configured structlog (``structlog.is_configured()``), else to the stdlib
    logger ``"kvoffload"``: so kvoffload prints nothing unless the application
    configured one of them, and its warnings go where the application's logging sends
    them. Only public structlog and logging APIs are used. ``bind()`` returns a logger
    that adds its fields to every event."""

    __slots__ = ("_fields",)

    def __init__(self, fields: dict[str, Any] | None = None) -> None:
        self._fields = fields or {}

    def bind(self, **fields: Any) -> Log:
        return Log({**self._fields, **fields})

    def _log(self, level: int, event: str, fields: dict[str, Any]) -> None:
        if self._fields:
            fields = {**self._fields, **fields}
        structlog = configured_structlog()
        if structlog is not None:
            getattr(structlog.get_logger("kvoffload"), _LEVEL_NAMES[level])(event, **fields)
        elif STDLIB_LOGGER.isEnabledFor(level):
            text = " ".join(f"{k}={v!r}" for k, v in fields.items())
            STDLIB_LOGGER.log(
                level, "%s %s", event, text, extra={"kvoffload_event": event, "kvoffload": fields}
            )

    def debug(self, event: str, **fields: Any) -> None:
        self._log(logging.DEBUG, event, fields)

    def info(self, event: str, **fields: Any) -> None:
        self._log(logging.INFO, event, fields)

    def warning(self, event: str, **fields: Any) -> None:
        self._log(logging.WARNING, event, fields)

    def error(self, event: str, **fields: Any) -> None:
        self._log(logging.ERROR, event, fields)


logger = Log()


def configured_structlog() -> Any:
    """The ``structlog`` module when the application configured it, else ``None``.
    kvoffload never imports structlog itself (nor what structlog pulls in, e.g. rich
    when it is installed): an application that configured structlog has imported it."""
    structlog = sys.modules.get("structlog")
    if structlog is not None and structlog.is_configured():
        return structlog
    return None


def debug_enabled() -> bool:
    """Whether kvoffload's debug events would be seen now: the application configured
    structlog and its wrapper class lets debug through, or it set the stdlib logger
    ``"kvoffload"`` (or an ancestor) to DEBUG. Public APIs only; costs a few µs, so hot
    paths read :data:`DEBUG` instead, which :func:`refresh_debug` keeps."""
    structlog = configured_structlog()
    if structlog is not None:
        wrapper = structlog.get_config()["wrapper_class"]
        if getattr(wrapper, "is_enabled_for", None) is None:
            return True
        try:
            return bool(wrapper(structlog.PrintLogger(), [], {}).is_enabled_for(logging.DEBUG))
        except Exception:  # an exotic wrapper: assume it wants everything
            return True
    return STDLIB_LOGGER.isEnabledFor(logging.DEBUG)


class _DebugGate:
    """The hot paths' answer to "would a debug event be seen?": one attribute read.
    Refreshed (:func:`refresh_debug`) when a manager opens, at every ``admit``, and when
    a listener is added or removed - so an application that configures logging for
    debug sees the debug events of requests admitted after that."""

    __slots__ = ("on",)

    def __init__(self) -> None:
        self.on = False


DEBUG = _DebugGate()


def refresh_debug() -> bool:
    """Recompute :data:`DEBUG` from the logging configuration; return it."""
    DEBUG.on = debug_enabled()
    return DEBUG.on


class Events:
    """One core's way out, and its clock: its listeners, whether anyone observes (the
    hot paths' one read), the rate limits of its ``listener.failed`` lines, and the
    clock every room of the core reads (one owner: a virtual clock replaces it here).
    The core's rooms emit through it; the facade (``OffloadCore.refresh_observed``)
    keeps :attr:`observed`."""

    __slots__ = ("clock", "failures", "listeners", "observed", "told")

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.listeners: list[Listener] = []
        # observed: whether events are built - a listener is attached or debug logging is
        # seen (refreshed at each admit and listener change). Hot paths read only this.
        self.observed = False
        # failures: rate limits of this core's listener.failed lines, by event name, on
        # this core's clock (never shared with another core: F39).
        self.failures: dict[str, RateLimit] = {}
        # told: whether manager.fast_paths_off was logged (once per core, the first time
        # observed turned on). Invariant: self.told or not self.observed
        self.told = False

    def refresh(self) -> bool:
        """Whether events should be built now: a listener is attached to this core, or
        debug logging would be seen (:func:`refresh_debug`). Sets nothing but the debug
        gate; the facade applies the answer. The first time the answer turns this
        core's fast paths off, one ``manager.fast_paths_off`` warning says so and why
        (never again for this core: a listener that stays is no news)."""
        debug = refresh_debug()
        observed = debug or bool(self.listeners)
        if observed and not self.told:
            self.told = True
            logger.warning(
                "manager.fast_paths_off",
                listeners=len(self.listeners),
                debug_logging=debug,
                reason="debug logging is on for kvoffload" if debug else "a listener is attached",
                effect="every step of this manager takes its full path (events are built) while it lasts",
            )
        return observed

    def emit(self, name: str, lc: Lifecycle, **fields: Any) -> None:
        """Send event ``name`` about ``lc`` to the listeners and (at debug) structlog."""
        fields["lifecycle"] = lc.id
        fields["rid"] = lc.rid
        fields["t"] = self.clock()
        if self.listeners:
            notify_listeners(self.listeners, name, fields, self.failures, self.clock)
        if DEBUG.on:
            log = lc._log
            if log is None:
                log = lc._log = logger.bind(lifecycle=lc.id, rid=lc.rid)
            log.debug(name, **{k: v for k, v in fields.items() if k not in ("lifecycle", "rid")})

    def delivery(
        self, name: str, t: Transfer, lc: Lifecycle, now: float, page_bytes: int, **extra: Any
    ) -> None:
        """The event of ``lc``'s copy ``t`` delivered at ``now`` (completed, failed, discarded)."""
        npages = len(t.host_pages)
        latency = now - t.submitted_at
        self.emit(
            name, lc, transfer=t.id, pages=npages, bytes=npages * page_bytes, latency_s=latency, **extra
        )

    def notify(self, name: str, fields: dict[str, Any]) -> None:
        """Send event ``name`` (``fields`` already named) to the listeners only."""
        notify_listeners(self.listeners, name, fields, self.failures, self.clock)
