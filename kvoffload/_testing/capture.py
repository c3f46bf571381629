"""capture_transitions(): the lifecycle transitions a block of code caused."""

from __future__ import annotations

import logging
from collections.abc import Iterator, MutableMapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvoffload.drivers.asyncio import OffloadManager

__all__ = ["TransitionRecord", "capture_transitions"]


@dataclass(frozen=True, slots=True)
class TransitionRecord:
    """One ``lifecycle.transition`` event: ``source --trigger--> dest`` of a lifecycle."""

    lifecycle: int
    rid: Any
    trigger: str
    source: str
    dest: str


def _record(fields: MutableMapping[str, Any]) -> TransitionRecord:
    return TransitionRecord(
        fields["lifecycle"], fields["rid"], fields["trigger"], fields["from"], fields["to"]
    )


@contextmanager
def capture_transitions(mgr: OffloadManager | None = None) -> Iterator[list[TransitionRecord]]:
    """Collect every lifecycle transition made inside the ``with`` block, in order.

    Without ``mgr``, through structlog (every manager in the process): for its duration
    the configured processors are replaced by a collector (as
    ``structlog.testing.capture_logs`` does) and the level filter is opened to debug,
    since transitions are debug events; both are restored on exit. With ``mgr``,
    through ``mgr.add_listener`` (that manager only; independent of structlog's
    configuration, so also right when a cached logger keeps an older level filter).
    Not thread-safe, like ``capture_logs``.
    """
    records: list[TransitionRecord] = []
    if mgr is not None:

        def listener(name: str, fields: dict[str, Any]) -> None:
            if name == "lifecycle.transition":
                records.append(_record(fields))

        remove = mgr.add_listener(listener)
        try:
            yield records
        finally:
            remove()
        return

    import structlog

    def collect(logger: Any, method: str, event_dict: MutableMapping[str, Any]) -> Any:
        if event_dict.get("event") == "lifecycle.transition":
            records.append(_record(event_dict))
        raise structlog.DropEvent

    config = structlog.get_config()
    processors = config["processors"]
    saved = list(processors)
    wrapper = config["wrapper_class"]
    # Keep the list instance: bound loggers hold a reference to it (as capture_logs does).
    processors.clear()
    processors.append(collect)
    structlog.configure(
        processors=processors, wrapper_class=structlog.make_filtering_bound_logger(logging.NOTSET)
    )
    try:
        yield records
    finally:
        processors.clear()
        processors.extend(saved)
        structlog.configure(processors=processors, wrapper_class=wrapper)
