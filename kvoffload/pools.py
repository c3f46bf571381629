"""Device and host page pools, and the engine's own pages.

A pool is one torch tensor of ``n_pages`` pages (page-major: a page is one
contiguous block) plus a free list. Pools only hand out and take back page numbers;
they never know about lifecycles. Allocation is all-or-nothing; freeing checks every
page before it changes anything, so a double free raises
:class:`~kvoffload.PageError` with the pool unchanged.

- :class:`DevicePool`: kvoffload's own device pool (owned mode, ``device_pages=N``),
  for simulation and tests.
- :class:`EnginePages`: the engine's KV tensors (engine-owned mode,
  ``device_pages=None``): kvoffload allocates and frees none of them; it only records
  which page ids live lifecycles hold.
- :class:`HostPool`: the host staging pages; pinned (on a GPU) by registering exactly
  the memory asked for, not through torch's caching host allocator, which rounds a
  request up to a power of two; zero-filled only when asked; or the engine's own
  buffer.

``copy_pairs(host)`` of a device side says how its pages map to host pages: a list of
(source, destination) tensors whose row ``p`` is one page, which every backend copies.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Mapping, MappingView, Sequence, Set
from typing import TYPE_CHECKING, Any, TypeVar

from kvoffload.errors import ConfigError, PageError, PoolExhausted
from kvoffload.keys import INT_DTYPES

if TYPE_CHECKING:
    import torch

__all__ = ["DevicePool", "EnginePages", "HostPool", "PagePool", "host_tensor", "page_ids", "page_views"]

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
        return self._take(n) if n else []

    def try_allocate(self, n: int) -> list[int] | None:
        """Take ``n`` pages, or return ``None`` when fewer are free (nothing taken)."""
        if n <= 0:
            return self.allocate(n)  # [] for none, PageError below that
        return self._take(n) if n <= len(self._free) else None

    def take_each(self, counts: list[int]) -> list[list[int] | None]:
        """Pages for each of ``counts`` in order, exactly as ``try_allocate(n)`` for each
        ``n`` one after another would hand them out: a list of ``n`` pages where they
        were free then, ``None`` where fewer were, ``[]`` for ``n == 0``. One pass for a
        batched step's chunks. A negative count raises :class:`PageError` (nothing
        taken)."""
        free = self._free
        left = len(free)  # free[:left] is what is still free after the counts so far
        out: list[list[int] | None] = []
        for n in counts:
            if n > left:
                out.append(None)
            elif n > 0:
                out.append(free[left - n : left])
                left -= n
            elif n == 0:
                out.append([])
            else:
                raise PageError(f"cannot allocate {n} {self.kind} pages")
        if left < len(free):
            alloc = self._allocated
            for p in free[left:]:
                alloc[p] = 1
            del free[left:]
        return out

    def take_one(self) -> int:
        """One page, or -1 when none is free (the hot path's allocation: no list)."""
        free = self._free
        if not free:
            return -1
        page = free.pop()
        self._allocated[page] = 1
        return page

    def take_pages(self, pages: list[int]) -> None:
        """Take exactly ``pages`` (distinct ints, each free): what a load holds in
        kvoffload's own device pool while it may write them. Raises
        :class:`PageError` (nothing taken) on one out of range or not free. O(free)."""
        alloc = self._allocated
        for p in pages:
            if not 0 <= p < self.n_pages or alloc[p]:
                raise PageError(f"{self.kind} page {p} is not free (or out of range [0, {self.n_pages}))")
        taken = set(pages)
        if len(taken) != len(pages):
            raise PageError(f"{self.kind} pages {pages[:8]} name a page twice")
        free = self._free
        free[:] = [q for q in free if q not in taken]
        for p in pages:
            alloc[p] = 1

    def _take(self, n: int) -> list[int]:
        """The last ``n`` free pages (0 < ``n`` <= free), marked allocated."""
        free = self._free
        pages = free[-n:]
        del free[-n:]
        alloc = self._allocated
        for p in pages:
            alloc[p] = 1
        return pages

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
    """kvoffload's own device pool (owned mode): pages of KV on the GPU with ``cuda``,
    else a CPU tensor. A page of it is a page of the host pool, element for element."""

    kind = "device"
    __slots__ = ()

    def copy_pairs(self, host: HostPool) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(source, destination) whose row ``p`` is one device / host page."""
        return [(self.tensor, host.tensor)]


class HostPool(PagePool):
    """Host staging pages that chunks are copied into (pinned with ``cuda``)."""

    kind = "host"
    __slots__ = ("__weakref__",)

    @property
    def nbytes(self) -> int:
        """Bytes of memory the pool's pages occupy: ``n_pages`` pages, or 0 for a pool
        that keeps the page accounting only (:meth:`new` with a ``meta`` buffer)."""
        t = self.tensor
        return 0 if t.is_meta else t.numel() * t.element_size()

    @classmethod
    def new(
        cls,
        n_pages: int,
        page_shape: Sequence[int],
        dtype: str,
        *,
        pin: bool = False,
        zero: bool = False,
        buffer: torch.Tensor | None = None,
        cudart: Any = None,
    ) -> HostPool:
        """A host pool of ``n_pages`` pages of ``page_shape`` ``dtype`` elements: the
        engine's ``buffer`` when given (a contiguous CPU tensor of at least that many
        bytes, used as is), else new memory of exactly that size - pinned by registering
        it with CUDA when ``pin`` (``cudart``: ``torch.cuda.cudart()`` by default), and
        zero-filled only when ``zero``.

        A ``buffer`` on torch's ``meta`` device asks for no memory at all: the pool
        keeps its page accounting (which pages are handed out) and its pages can never
        be read or written - for a tensor-parallel rank that copies nothing
        (``tp_keys="shared"``, rank above 0), whose decisions must still be the others'."""
        import math

        import torch

        shape = (n_pages, *page_shape)
        tdtype = getattr(torch, dtype)
        if buffer is not None and isinstance(buffer, torch.Tensor) and buffer.is_meta:
            return cls(torch.empty(shape, dtype=tdtype, device="meta"))
        if buffer is not None:
            nbytes = math.prod(shape) * torch.empty((), dtype=tdtype).element_size()
            if (
                not isinstance(buffer, torch.Tensor)
                or buffer.device.type != "cpu"
                or not buffer.is_contiguous()
            ):
                raise ConfigError(f"host_buffer must be a contiguous CPU tensor, got {buffer!r:.80}")
            if buffer.nbytes < nbytes:
                raise ConfigError(
                    f"host_buffer has {buffer.nbytes:,} bytes; {n_pages} host pages need {nbytes:,}"
                )
            if pin and not buffer.is_pinned():
                raise ConfigError("host_buffer must be pinned memory for the cuda backend")
            if zero:
                buffer.zero_()
            flat = buffer.view(-1).view(torch.uint8)[:nbytes]
            return cls(flat.view(tdtype).view(shape))
        return cls(host_tensor(shape, tdtype, pin=pin, zero=zero, cudart=cudart))


def host_tensor(
    shape: Sequence[int], dtype: torch.dtype, *, pin: bool, zero: bool, cudart: Any = None
) -> torch.Tensor:
    """A CPU tensor of exactly ``shape``, zero-filled only when ``zero``. With ``pin``,
    its memory is page-locked by registering it with CUDA (``cudaHostRegister``), so it
    is exactly the size asked for (torch's caching host allocator rounds a pinned
    request up to a power of two: up to 2x the memory); it is unregistered when the
    tensor is collected. Raises :class:`~kvoffload.ConfigError` when CUDA refuses."""
    import weakref

    import torch

    t = torch.zeros(tuple(shape), dtype=dtype) if zero else torch.empty(tuple(shape), dtype=dtype)
    if pin and t.numel():
        rt = cudart if cudart is not None else torch.cuda.cudart()  # type: ignore[no-untyped-call]
        ptr, size = t.data_ptr(), t.numel() * t.element_size()
        err = int(rt.cudaHostRegister(ptr, size, 0))
        if err:
            raise ConfigError(f"could not pin {size:,} bytes of host memory (cudaHostRegister error {err})")
        storage = t.untyped_storage()
        weakref.finalize(storage, rt.cudaHostUnregister, ptr)
    return t


def page_ids(pages: Any, what: str = "pages") -> list[int]:
    """The engine's page ids ``pages`` as a list of Python ints, in token order.

    Accepted: a list, tuple or range of ints (numpy or torch integer scalars too), an
    ``array.array`` of an integer typecode, a one-dimensional integer numpy array or
    torch tensor. Refused with :class:`~kvoffload.PageError` naming what is wrong: an
    unordered collection (a set, a dict or a dict view: its hash order would store each
    page's KV under another page's key), str or bytes, anything that is not a sequence
    (an iterator, an int), a float, bool or many-dimensional array, an element that is
    not an int (a bool, a float, a nested list). Range and duplicates are checked by
    :meth:`EnginePages.claim`.
    """
    kind = type(pages)
    if kind is list or kind is tuple:  # the common case: no ABC checks
        items: Any = pages
    elif isinstance(pages, (Set, Mapping, MappingView)):
        raise PageError(
            f"{what} must be an ordered sequence of page ids (in token order), not a "
            f"{kind.__name__}: its order is its hash order"
        )
    elif isinstance(pages, (str, bytes, bytearray, memoryview)) or not hasattr(pages, "__len__"):
        raise PageError(f"{what} must be a sequence of page ids, got {kind.__name__}")
    elif kind is range:
        return list(pages)
    elif getattr(pages, "dtype", None) is not None:  # a numpy array or a torch tensor
        dtype = str(pages.dtype).removeprefix("torch.")
        if dtype not in INT_DTYPES:
            raise PageError(f"{what} has dtype {dtype}: page ids are integers")
        shape = tuple(pages.shape)
        if len(shape) != 1:
            raise PageError(f"{what} must be one-dimensional, got shape {shape}")
        return list(pages.tolist())
    elif isinstance(pages, array):
        if pages.typecode not in "bBhHiIlLqQ":
            raise PageError(f"{what} is an array of typecode {pages.typecode!r}: page ids are integers")
        return pages.tolist()
    else:
        items = list(pages)
    out = list(items)  # a copy: the engine's own list may change after the call
    for i, p in enumerate(out):
        if type(p) is not int:
            if (
                isinstance(p, bool)
                or str(getattr(p, "dtype", "")) in ("bool", "torch.bool")
                or not hasattr(p, "__index__")
                or getattr(p, "ndim", None)
            ):
                raise PageError(f"page id {p!r} ({what}[{i}]) is not an int")
            out[i] = p.__index__()
    return out


class EnginePages:
    """The engine's own device pages (engine-owned mode, ``device_pages=None``).

    ``tensors`` are the engine's KV tensors, each ``(num_pages, page_size, ...)`` and
    contiguous, on one device (SGLang's per-layer K and V buffers, reshaped), with at
    least one page. kvoffload allocates none of these pages and frees none: :meth:`claim`
    records that a live lifecycle holds the ids the engine handed over (refusing an id
    out of range, named twice, or held by another live lifecycle - except that the
    pages of a stored prefix, which kvoffload never copies, may be in several live
    lifecycles' stored prefixes, as a prefix cache shares them), :meth:`free` forgets
    them at RELEASED (a shared page when its last holder is released).
    A host page holds a page's rows of every tensor, in order (``offsets``/``nbytes``).
    Owner thread only.
    """

    kind = "device"

    def __init__(self, tensors: Sequence[torch.Tensor], page_size: int) -> None:
        import torch

        if isinstance(tensors, torch.Tensor):
            tensors = [tensors]
        tensors = list(tensors) if isinstance(tensors, (list, tuple)) else tensors
        if not isinstance(tensors, list) or not tensors:
            raise ConfigError(
                f"device_kv must be a tensor or a non-empty sequence of tensors, got {tensors!r:.80}"
            )
        first = tensors[0]
        for i, t in enumerate(tensors):
            what = f"device_kv[{i}]"
            if not isinstance(t, torch.Tensor):
                raise ConfigError(f"{what} is a {type(t).__name__}, not a torch.Tensor")
            if t.dim() < 2 or t.shape[1] != page_size:
                raise ConfigError(
                    f"{what} has shape {tuple(t.shape)}: each tensor must be "
                    f"(num_pages, page_size={page_size}, ...)"
                )
            if t.shape[0] != first.shape[0]:
                raise ConfigError(
                    f"{what} has {t.shape[0]} pages, device_kv[0] has {first.shape[0]}: they must agree"
                )
            if t.device != first.device:
                raise ConfigError(f"{what} is on {t.device}, device_kv[0] on {first.device}: one device")
            if not t.is_contiguous():
                raise ConfigError(
                    f"{what} is not contiguous: pass a contiguous view (num_pages, page_size, ...)"
                )
            if t.shape[0] == 0:
                raise ConfigError(f"{what} has 0 pages: device_kv must hold at least one page")
            if t.numel() == 0:
                raise ConfigError(
                    f"{what} has shape {tuple(t.shape)}: a page of 0 bytes holds no KV; "
                    "device_kv tensors are (num_pages, page_size, ...) with every dimension above 0"
                )
        self.tensors: list[torch.Tensor] = tensors
        self.n_pages = int(first.shape[0])
        self.device = first.device
        # nbytes[i]: bytes of one page of tensors[i]; offsets[i]: where they sit in a host page.
        self.nbytes = [int(t[0].numel() * t.element_size()) for t in tensors]
        self.offsets = [sum(self.nbytes[:i]) for i in range(len(tensors))]
        self.page_bytes = sum(self.nbytes)
        # _held[p] is 1 while one live lifecycle holds page p for itself (a page it may copy).
        # _shared[p]: how many live lifecycles hold page p as part of their stored prefix
        #   (never copied: prefix caches share those pages); absent when none.
        # Invariant: not any(self._held[p] for p in self._shared) and all(self._shared.values())
        # Invariant: self.used == sum(self._held) + len(self._shared)
        self._held = bytearray(self.n_pages)
        self._shared: dict[int, int] = {}
        self.used = 0

    @property
    def free_pages(self) -> int:
        """Pages no live lifecycle holds (the engine's to allocate, not kvoffload's)."""
        return self.n_pages - self.used

    def is_allocated(self, page: int) -> bool:
        """Whether a live lifecycle holds ``page`` (for itself or in a stored prefix)."""
        return bool(self._held[page]) or page in self._shared

    def shared_count(self, page: int) -> int:
        """How many live lifecycles hold ``page`` in their stored prefix (0: none)."""
        return self._shared.get(page, 0)

    def claim(self, pages: Any, n: int, shared: int = 0) -> list[int]:
        """Record that a lifecycle holds ``pages``: exactly ``n`` page ids (an ordered
        sequence, see :func:`page_ids`), each in range and none named twice. The first
        ``shared`` of them are its stored prefix (never copied): they may also be in
        other live lifecycles' stored prefixes (what a prefix cache shares), but not
        held for itself by any. The others are pages it may copy: no other live
        lifecycle may hold them, in any way. Raises :class:`~kvoffload.PageError`
        naming the problem, with nothing recorded. Returns the ids as ints."""
        if type(pages) is list and len(pages) == n == 1 and type(pages[0]) is int and not shared:
            q = pages[0]  # the decode step's one new page: the hot path
            if 0 <= q < self.n_pages and not self._held[q] and q not in self._shared:
                self._held[q] = 1
                self.used += 1
                return [q]
        ids = page_ids(pages)
        if len(ids) != n:
            raise PageError(f"these tokens start {n} new page(s); {len(ids)} page id(s) given: {ids[:8]}")
        self.check_claim(ids, shared)
        held, share = self._held, self._shared
        for q in ids[:shared]:
            k = share.get(q, 0)
            share[q] = k + 1
            self.used += not k
        for q in ids[shared:]:
            held[q] = 1
        self.used += len(ids) - shared
        return ids

    def check_claim(self, ids: list[int], shared: int = 0) -> None:
        """Raise :class:`~kvoffload.PageError` if :meth:`claim` would refuse the page
        ids ``ids`` (ints, as :func:`page_ids` returns them); records nothing."""
        held, share = self._held, self._shared
        seen: set[int] = set()
        for i, q in enumerate(ids):
            if not 0 <= q < self.n_pages:
                raise PageError(f"page id {q} is out of range: the engine's KV has {self.n_pages} pages")
            if q in seen:
                raise PageError(f"page id {q} is named twice")
            if held[q]:
                raise PageError(f"page id {q} is held by another live lifecycle")
            if i >= shared and q in share:
                raise PageError(
                    f"page id {q} is held by another live lifecycle as a stored prefix page: only "
                    "stored (never copied) prefix pages may be shared"
                )
            seen.add(q)

    def free(self, pages: Iterable[int]) -> None:
        """Forget ``pages`` (their lifecycle was RELEASED; the engine frees them): a page
        of a stored prefix is forgotten when the last lifecycle that holds it lets go.
        Raises :class:`~kvoffload.PageError` (nothing changed) on one not held."""
        pages = pages if type(pages) is list else list(pages)
        held, share = self._held, self._shared
        own: list[int] = []
        prefix: dict[int, int] = {}  # shared page -> holds this call lets go of
        for p in pages:  # check everything first: nothing changes on a bad page
            if 0 <= p < self.n_pages and held[p]:
                own.append(p)
            elif prefix.get(p, 0) < share.get(p, 0):
                prefix[p] = prefix.get(p, 0) + 1
            else:
                raise PageError(f"device page {p} released but not held (twice?)")
        if len(own) > 1 and len(set(own)) != len(own):
            raise PageError(f"device pages {sorted(own)[:8]} released with one named twice")
        for p in own:
            held[p] = 0
        gone = 0
        for p, k in prefix.items():
            left = share[p] - k
            if left:
                share[p] = left
            else:
                del share[p]
                gone += 1
        self.used -= len(own) + gone

    def check(self) -> None:
        """Assert the record's own invariant (used by ``check_invariants``)."""
        assert self.used == sum(self._held) + len(self._shared), "engine page record out of sync"
        assert all(self._shared.values()), "a stored prefix page held by no lifecycle"
        assert not any(self._held[p] for p in self._shared), "a page both shared and held for one"

    def copy_pairs(self, host: HostPool) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(source, destination) per KV tensor, row ``p`` one page: the tensor's page
        as bytes, and its slice of a (uint8) host page."""
        import torch

        dst = host.tensor.view(host.n_pages, -1).view(torch.uint8)
        return [
            (t.view(self.n_pages, -1).view(torch.uint8), dst[:, off : off + nb])
            for t, off, nb in zip(self.tensors, self.offsets, self.nbytes, strict=True)
        ]

    def __repr__(self) -> str:
        return f"<EnginePages {self.used}/{self.n_pages} held, {len(self.tensors)} tensor(s)>"


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
