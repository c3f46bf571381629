"""Write-behind: a copied chunk's host pages go to the storage tier under their keys.

Runs in the manager's storage-writer task. A lifecycle never waits on this (it may
be RELEASED long before); the chunk's host pages return to the pool when the write
finishes, whether it succeeded or failed (FAILURES F15).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvoffload._events import debug_enabled, logger

if TYPE_CHECKING:
    from kvoffload.abc import Storage, Transfer
    from kvoffload.manager import OffloadManager

__all__ = ["page_bytes", "write_chunk"]


def page_bytes(mgr: OffloadManager, host_pages: list[int]) -> list[bytes]:
    """The raw bytes of each host page (a copy: the pages return to the pool after)."""
    import torch

    rows = mgr.host_pool.tensor[torch.tensor(host_pages, dtype=torch.long)]
    flat = rows.contiguous().view(torch.uint8).reshape(len(host_pages), -1)
    return [bytes(flat[i].numpy().data) for i in range(len(host_pages))]


async def write_chunk(mgr: OffloadManager, storage: Storage, t: Transfer) -> None:
    """Write ``t``'s pages under ``t.keys``; count the outcome. Never raises an
    ordinary storage failure (it is counted and logged); cancellation propagates."""
    c = mgr.counters
    n = len(t.host_pages)
    try:
        await storage.put(t.keys, page_bytes(mgr, t.host_pages))
    except Exception as exc:
        c.pages_store_failed += n
        logger.warning("storage.failed", transfer=t.id, pages=n, error=repr(exc))
        if mgr._listeners:
            _notify(mgr, "storage.failed", t, error=repr(exc))
        return
    c.pages_stored += n
    if mgr._listeners or debug_enabled():
        fields = _notify(mgr, "storage.written", t)
        if debug_enabled():
            logger.debug("storage.written", **fields)


def _notify(mgr: OffloadManager, name: str, t: Transfer, **extra: object) -> dict[str, object]:
    """Send event ``name`` about ``t`` to the listeners; return its fields."""
    n = len(t.host_pages)
    lc = t.lifecycle
    fields = {"lifecycle": lc.id, "rid": lc.rid, "transfer": t.id, "pages": n}
    fields.update(bytes=n * mgr.page_bytes, t=mgr.clock(), **extra)
    for fn in mgr._listeners:
        fn(name, fields)
    return fields
