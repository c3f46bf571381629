"""Structured events: one stable name per kind of thing, sent to structlog and to
in-process listeners (the timeline recorder, tests).

The library never configures structlog. Hot-path events (transitions, submissions,
completions) are logged at debug level and are only *built* when someone would see
them: when the application configured structlog and its wrapper class lets debug
through, or when a listener is attached. An application that never configured
structlog (structlog's default prints every level to stdout) gets kvoffload's
warnings and errors, not a line per decode step. The gate costs a few attribute
reads while its answer is cached.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import structlog

__all__ = ["EVENT_NAMES", "STRUCTLOG", "Listener", "RateLimit", "debug_enabled", "logger", "notify_listeners"]

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
    "manager.step_failed": "a driver's background step failed and was contained; the manager runs on (error)",
}

Listener = Callable[[str, dict[str, Any]], None]

#: Rate limits of ``listener.failed`` lines, by event name.
_LISTENER_FAILURES: dict[str, RateLimit] = {}


def notify_listeners(listeners: list[Listener], name: str, fields: dict[str, Any]) -> None:
    """Call every listener with event ``name``. The core calls this in the middle of a
    synchronous step: a listener that raises is logged (``listener.failed``) and the
    step goes on, so a listener's bug never leaves the ledger half changed."""
    for fn in tuple(listeners):  # a listener may remove itself (or another) while called
        try:
            fn(name, fields)
        except Exception as exc:
            limit = _LISTENER_FAILURES.get(name)
            if limit is None:
                limit = _LISTENER_FAILURES[name] = RateLimit()
            held = limit.due(time.monotonic())
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


logger = structlog.get_logger("kvoffload")

try:  # structlog's live configuration; read-only use, with a public fallback.
    from structlog import _config as _structlog_config

    _STRUCTLOG_CONFIG: Any = _structlog_config._CONFIG
except (ImportError, AttributeError):  # pragma: no cover - a future structlog
    _STRUCTLOG_CONFIG = None


class _AskEveryTime:
    is_configured = True


#: structlog's live configuration object. Hot paths read ``STRUCTLOG.is_configured``
#: first (one attribute read) and call :func:`debug_enabled` only when it is true, so
#: with structlog unconfigured - its default - a level-off event costs one read.
STRUCTLOG: Any = _STRUCTLOG_CONFIG if _STRUCTLOG_CONFIG is not None else _AskEveryTime()

_cached_wrapper: object = None
_cached_configured: object = None
_cached_debug = False


def debug_enabled() -> bool:
    """Whether kvoffload's debug events would be seen: structlog was configured by the
    application and its wrapper class lets debug through."""
    cfg = _STRUCTLOG_CONFIG
    if (
        cfg is not None
        and cfg.default_wrapper_class is _cached_wrapper
        and cfg.is_configured is _cached_configured
    ):
        return _cached_debug
    return _recompute()


def _recompute() -> bool:
    global _cached_wrapper, _cached_configured, _cached_debug
    if _STRUCTLOG_CONFIG is None:  # pragma: no cover
        wrapper, configured = structlog.get_config()["wrapper_class"], structlog.is_configured()
    else:
        wrapper, configured = _STRUCTLOG_CONFIG.default_wrapper_class, _STRUCTLOG_CONFIG.is_configured
    enabled = bool(configured)
    if enabled and getattr(wrapper, "is_enabled_for", None) is not None:
        try:
            enabled = bool(wrapper(structlog.PrintLogger(), [], {}).is_enabled_for(logging.DEBUG))
        except Exception:  # an exotic wrapper: assume it wants everything
            enabled = True
    _cached_wrapper, _cached_configured, _cached_debug = wrapper, configured, enabled
    return enabled
