"""Device and host page pools.

A pool is one torch tensor of ``n_pages`` pages (page-major: a page is one
contiguous block of ``(page_size, *kv_shape)`` elements) plus a free list. Pools
only hand out and take back page numbers; they never know about lifecycles.
Allocation is all-or-nothing; freeing checks every page before it changes anything,
so a double free raises :class:`~kvoffload.PageError` with the pool unchanged.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from kvoffload.errors import PageError, PoolExhausted

if TYPE_CHECKING:
    import torch

__all__ = ["DevicePool", "HostPool", "PagePool", "page_views"]

_P = TypeVar("_P", bound="PagePool")


class PagePool:
    """A fixed set of equally sized pages backed by one tensor.

    Called from the event loop thread only (bookkeeping); backends read and write
    ``tensor`` rows on their own threads, never the free list.
    """

    kind = "page"

    __slots__ = ("_allocated", "_free", "n_pages", "page_shape", "tensor")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self.n_pages = int(tensor.shape[0])
        self.page_shape = tuple(tensor.shape[1:])
        # The free list, popped from the end (LIFO: a freed page is reused first, so
        # a page freed too early is overwritten as soon as possible and shows up).
        self._free: list[int] = list(range(self.n_pages - 1, -1, -1))
        # _allocated[p] is 1 while page p is handed out.
        # Invariant: len(self._free) + sum(self._allocated) == self.n_pages
        self._allocated = bytearray(self.n_pages)

    @classmethod
    def create(
        cls: type[_P],
        n_pages: int,
        page_size: int,
        kv_shape: Sequence[int],
        dtype: str,
        device: str = "cpu",
        pin_memory: bool = False,
    ) -> _P:
        """Allocate a zeroed pool tensor of ``n_pages`` pages."""
        import torch

        t = torch.zeros(
            (n_pages, page_size, *kv_shape),
            dtype=getattr(torch, dtype),
            device=device,
            pin_memory=pin_memory,
        )
        return cls(t)

    @property
    def used(self) -> int:
        """Pages handed out and not yet returned."""
        return self.n_pages - len(self._free)

    @property
    def free_pages(self) -> int:
        """Pages available to allocate."""
        return len(self._free)

    def is_allocated(self, page: int) -> bool:
        """Whether ``page`` is currently handed out."""
        return bool(self._allocated[page])

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` pages or raise :class:`PoolExhausted` (nothing taken); a negative
        ``n`` raises :class:`PageError`."""
        free = self._free
        if n < 0:
            raise PageError(f"cannot allocate {n} {self.kind} pages")
        if n > len(free):
            raise PoolExhausted(self.kind, n, len(free))
        if n == 0:
            return []
        pages = free[-n:]
        del free[-n:]
        alloc = self._allocated
        for p in pages:
            alloc[p] = 1
        return pages

    def try_allocate(self, n: int) -> list[int] | None:
        """Take ``n`` pages, or return ``None`` when fewer are free (nothing taken)."""
        if n > len(self._free):
            return None
        return self.allocate(n)

    def free(self, pages: Iterable[int]) -> None:
        """Return pages. Raises :class:`PageError` (nothing returned) on a page that is
        not allocated, out of range, or named twice."""
        pages = pages if type(pages) is list else list(pages)
        alloc = self._allocated
        n = self.n_pages
        for i, p in enumerate(pages):
            if p < 0 or p >= n or not alloc[p]:  # not allocated, out of range, or named twice
                for q in pages[:i]:
                    alloc[q] = 1  # undo: the pool is as it was
                raise PageError(f"{self.kind} page {p} freed but not allocated (double free?)")
            alloc[p] = 0
        self._free.extend(pages)

    def check(self) -> None:
        """Assert the pool's own invariant (used by ``check_invariants``)."""
        assert len(self._free) + sum(self._allocated) == self.n_pages, "pool free list out of sync"
        assert len(set(self._free)) == len(self._free), "page on the free list twice"

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.used}/{self.n_pages} used>"


class DevicePool(PagePool):
    """Pages of the engine's KV memory (on the GPU with ``cuda``, else a CPU tensor)."""

    kind = "device"
    __slots__ = ()


class HostPool(PagePool):
    """Host staging pages (pinned with ``cuda``) that chunks are copied into."""

    kind = "host"
    __slots__ = ()


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
