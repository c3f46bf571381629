"""Host pages as bytes-like views of the pool's own memory, for stores that write
without copying (``Storage.put_pages``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvoffload.pools import PagePool

__all__ = ["page_views"]


def page_views(pool: PagePool, pages: Sequence[int]) -> list[memoryview]:
    """A read-only, contiguous byte view of each page of ``pool`` (no copy).

    A pool is page-major, so a page is one contiguous block of its CPU tensor. The
    views are valid while the pool lives and show what the pages hold when read: the
    caller holds the pages (a storage write holds its chunk's host pages until it has
    finished) and drops the views when done. Raises ``ValueError`` for a pool that is
    not a contiguous CPU tensor.
    """
    import torch

    t = pool.tensor
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError(f"{pool!r}: pages can be viewed only in a contiguous CPU tensor")
    if not pages:
        return []
    raw: Any = t.view(-1).view(torch.uint8).numpy()  # the pool's own memory, as bytes
    flat = memoryview(raw).toreadonly()
    size = flat.nbytes // pool.n_pages
    return [flat[p * size : (p + 1) * size] for p in pages]
