"""Every interface kvoffload's layers share, in one place.

Bookkeeping (the core and its lifecycles) and data movement (event backends and
storages: the movers) meet only here. They share a tiny vocabulary of plain data: a
:class:`Transfer` (which device pages go to which host pages, under which keys), a
:data:`Completion` (that transfer's id, and the error if its copy failed) and a
:class:`WriteJob` (host pages to store under their keys). None of them holds a
lifecycle: a transfer names its issuer by id, request id and tag (copied from an
:class:`Issuer` when it is made), so a mover can live in another process than the
bookkeeping. Backends and storages never read or change lifecycle state.
"""

from __future__ import annotations

import abc
import itertools
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, NewType, Protocol, TypeAlias, cast

from kvoffload.errors import BackendError

if TYPE_CHECKING:
    from kvoffload.config import OffloadConfig
    from kvoffload.pools import DevicePool, EnginePages, HostPool

__all__ = [
    "Completion",
    "EventBackend",
    "Issuer",
    "Storage",
    "Transfer",
    "TransferId",
    "WriteChain",
    "WriteJob",
]

TransferId = NewType("TransferId", int)

#: What a :class:`Transfer` copies: device -> host (an offload chunk) or host -> device (a load).
_DIRECTIONS = ("d2h", "h2d")

#: Transfer ids, process-wide (typed as TransferId without a call per transfer).
_transfer_ids = cast("Iterator[TransferId]", itertools.count(1))


class Issuer(Protocol):
    """What a :class:`Transfer` copies from whoever issued it (a core's lifecycle
    satisfies it): its ``id`` (unique among the issuer's core's live lifecycles), its
    ``rid`` (the engine's request id, a label) and its ``tag`` (the engine's object).
    Read once, when the transfer is made; the transfer keeps no reference to it."""

    @property
    def id(self) -> int: ...

    @property
    def rid(self) -> Any: ...

    @property
    def tag(self) -> Any: ...


class Transfer:
    """One copy of whole pages between device and host, submitted as a unit: an offload
    chunk (``direction="d2h"``: device pages -> host pages) or a load's copy back
    (``direction="h2d"``: host pages -> device pages). Plain data: it holds no
    lifecycle, so it can cross a process boundary.

    Created by the core (owner thread) *after* its host pages were allocated, and
    immutable from then on except for ``completed_at`` and ``error``, which the core
    sets on delivery. ``lifecycle_id``, ``rid`` and ``tag`` are copied from the
    :class:`Issuer` it is made for: a completion names the transfer by ``id``, and the
    core finds the issuing lifecycle by ``lifecycle_id`` (never by request id, F1).
    ``id`` is process-wide (unique among all cores of a process); ``seq`` is the job
    number tensor-parallel ranks agree on (the core's submission number).
    Backends read ``device_pages``, ``host_pages``, ``direction``, ``stream`` and
    ``ready`` (what the copy must wait for on a GPU: a ``torch.cuda.Event`` or
    ``Stream``, or ``None``) and report ``id``; nothing else. For ``"h2d"`` the issuer
    is a load (``lifecycle_id`` is the load's id, unique among the core's live loads
    and lifecycles) and ``keys`` are the pages' storage keys it was read from.
    """

    __slots__ = (
        "_digests",
        "_keys",
        "completed_at",
        "device_pages",
        "direction",
        "error",
        "first_token",
        "host_pages",
        "id",
        "lifecycle_id",
        "n_tokens",
        "owned",
        "ready",
        "rid",
        "seq",
        "stream",
        "submitted_at",
        "tag",
    )

    def __init__(
        self,
        issuer: Issuer,
        device_pages: list[int],
        host_pages: list[int],
        keys: list[str] | None,
        first_token: int,
        n_tokens: int,
        submitted_at: float,
        stream: int = 0,
        ready: Any = None,
        owned: bool = False,
        digests: list[bytes] | None = None,
        direction: str = "d2h",
    ) -> None:
        self.id = next(_transfer_ids)
        # The issuer's id, request id and tag, copied: no reference to the issuer is kept.
        self.lifecycle_id: int = issuer.id
        self.rid: Any = issuer.rid
        self.tag: Any = issuer.tag
        self.device_pages = device_pages
        self.host_pages = host_pages
        # direction: "d2h" (an offload chunk: device -> host) or "h2d" (a load: host -> device).
        # Invariant: self.direction in ("d2h", "h2d")
        if direction not in _DIRECTIONS:
            raise BackendError(f"Transfer direction must be 'd2h' or 'h2d', got {direction!r}")
        self.direction = direction
        # _keys: the pages' keys (hex), or None until first read, made from _digests
        # (the core passes SHA-256 digests: hex only where a key leaves the library).
        # Invariant: self._keys is not None or self._digests is not None
        self._keys = keys
        self._digests = digests
        self.first_token = first_token
        self.n_tokens = n_tokens
        self.submitted_at = submitted_at
        self.stream = stream
        # owned: made by a core from pages of this backend's own pools, in range by
        # construction; a backend checks only transfers without it (check_fits).
        self.owned = owned
        self.ready: Any = ready
        # seq: the job number tensor-parallel ranks agree on: the core's submission
        # number (0, 1, 2, ... per core), deterministic, so ranks that made the same
        # calls name a transfer alike (``id`` comes from a process-wide counter and does not).
        self.seq = 0
        self.completed_at: float | None = None
        self.error: BaseException | None = None

    @property
    def keys(self) -> list[str]:
        """The storage key (hex) of each page, in order."""
        keys = self._keys
        if keys is None:
            assert self._digests is not None
            keys = self._keys = [d.hex() for d in self._digests]
        return keys

    @keys.setter
    def keys(self, keys: list[str]) -> None:
        self._keys = keys

    def check_fits(self, device_pages: int, host_pages: int, streams: int) -> None:
        """Raise :class:`~kvoffload.BackendError` unless this transfer can be copied between
        pools of ``device_pages`` and ``host_pages`` pages on a backend with ``streams``
        streams: page lists of equal length, every page in range, no host page named twice
        (and, for ``"h2d"``, no device page: it is written).
        Backends call it in ``submit`` before starting anything, for every transfer not
        made by the core (``owned`` False): the core's own are in range by construction."""
        dev, host = self.device_pages, self.host_pages
        if len(dev) != len(host):
            raise BackendError(f"{self!r}: {len(dev)} device page(s) but {len(host)} host page(s)")
        if not 0 <= self.stream < streams:
            raise BackendError(f"{self!r}: stream {self.stream} out of range (the backend has {streams})")
        if dev and (min(dev) < 0 or max(dev) >= device_pages):  # min/max: C loops, hot path
            raise BackendError(f"{self!r}: device page out of range [0, {device_pages}): {dev}")
        if host and (
            min(host) < 0 or max(host) >= host_pages or (len(host) > 1 and len(set(host)) != len(host))
        ):
            raise BackendError(f"{self!r}: bad host pages for a pool of {host_pages}: {host}")
        if self.direction == "h2d" and len(dev) > 1 and len(set(dev)) != len(dev):
            raise BackendError(f"{self!r}: a host->device copy writes a device page twice: {dev}")

    @property
    def pages(self) -> int:
        """Number of pages copied by this transfer."""
        return len(self.device_pages)

    def __repr__(self) -> str:
        return (
            f"<Transfer #{self.id} {'of lifecycle' if self.direction == 'd2h' else 'h2d of load'} "
            f"#{self.lifecycle_id} ({self.rid!r}) "
            f"tokens {self.first_token}..{self.first_token + self.n_tokens} "
            f"{len(self.device_pages)} page(s)>"
        )


Completion: TypeAlias = "tuple[TransferId, BaseException | None]"
"""A finished copy: the transfer's ``id`` and ``None``, or the error that failed it.
Plain data, like the transfer: it can cross a process boundary (an error that pickles)."""


class WriteChain:
    """What the write jobs of one request share: whether its chain broke in the store
    (FAILURES F33). A writer that fails a job sets ``broken``; a job whose chain is
    broken is not written (its pages would follow a page the store lacks: no lookup
    could reach them) and is reported not stored after 0 attempts. Written and read
    only by the writer, which takes one request's jobs in chain order; the core may
    subclass it to keep its own record of the request next to it.
    """

    __slots__ = ("broken",)

    def __init__(self) -> None:
        # broken: a job of this chain was not stored; set once, by the writer.
        self.broken = False


class WriteJob:
    """A copied chunk's host pages, to be written to the storage tier under ``keys``.

    Made by the core when a chunk's copy completed; its host pages stay held until the
    writer reports the job done (stored or failed). It names its lifecycle by id and
    rid only (labels for events): a writer never holds a lifecycle (F2). The core hands
    a request's jobs to the writer in chain order; ``chain`` (shared by them) and
    ``first_token`` (where the chunk starts in its request) say where each one is.
    """

    __slots__ = ("chain", "first_token", "host_pages", "id", "keys", "lifecycle_id", "resent", "rid")

    def __init__(
        self,
        tid: int,
        keys: list[str],
        host_pages: list[int],
        lifecycle_id: int,
        rid: Any,
        *,
        chain: WriteChain | None = None,
        first_token: int = 0,
    ) -> None:
        self.id = tid  # the transfer's id
        self.keys = keys
        self.host_pages = host_pages
        self.lifecycle_id = lifecycle_id
        self.rid = rid
        self.chain = chain
        self.first_token = first_token
        # resent: pages the writer re-sent by retries (a retry sends only the pages the
        # store has not confirmed, F34), set by the writer before it reports the job;
        # None: not reported (each retry then counts as the whole chunk re-sent).
        # Invariant: self.resent is None or self.resent >= 0
        self.resent: int | None = None

    def __repr__(self) -> str:
        return f"<WriteJob of transfer #{self.id} ({len(self.host_pages)} page(s))>"


class EventBackend(abc.ABC):
    """A mover: copies device pages to host pages (and, for a load, host pages back to
    device pages: ``Transfer.direction``) and signals completion.

    Where it runs: every method but the copies themselves is called on the driver's
    owner thread; the copies run on worker threads, a CUDA stream, or - for the sim
    backend - when a test says so. A submitted transfer is *accepted* at once (and may
    be refused then) but no copy reads its pages before :meth:`launch`, which the driver
    calls when control returns to it: the event loop's next turn, or the next ``poll()``
    (FAILURES F19). Completions are taken without blocking (:meth:`take_completions`);
    a driver that waits is woken through :meth:`set_waker`.

    Guarantees every backend gives (``tests/backends`` checks them on sim and cpu on
    every run, and on cuda where a GPU is present; the cuda backend has not yet run on
    a GPU, so for cuda they are its design, not yet checked):

    - ``submit`` and ``launch`` return at once; they never wait for a copy.
    - Each submitted transfer completes exactly once, as a success or as a failure of
      that transfer only; within one stream, completions come in submission order.
    - The host pages of a successful transfer hold the bytes the device pages held when
      it was launched (the engine writes a page before it hands it over, F17/F26); for
      an ``"h2d"`` transfer (a load) the device pages hold the bytes its host pages
      held (the load holds them, nobody writes them while it copies).
    - After :meth:`close`, :meth:`join` returns ``True`` only once no copy is running,
      so no buffer is freed under one; it honours its timeout.
    """

    name: ClassVar[str] = "abstract"
    #: Whether submitted copies finish without outside help. False only for the sim
    #: backend, whose copies finish when a test says so: leaving the manager because
    #: the body raised then does not wait for copies that nobody will complete.
    completes_on_its_own: ClassVar[bool] = True
    #: Whether completions are found by asking (``take_completions`` polls events)
    #: rather than posted by threads: a waiting driver then polls with backoff.
    needs_polling: ClassVar[bool] = False

    #: The torch device type of the KV it copies from (``device_kv`` must be on it).
    device_type: ClassVar[str] = "cpu"
    #: Whether its host pool is pinned (page-locked) memory.
    pins_host: ClassVar[bool] = False

    @property
    def device_name(self) -> str:
        """The torch device kvoffload's own device pool goes on (owned mode)."""
        return self.device_type

    def create_pools(self, config: OffloadConfig, host_buffer: Any = None) -> tuple[DevicePool, HostPool]:
        """Owned mode: kvoffload's own device pool (zeroed, on :attr:`device_name`) and
        the host pool (:meth:`create_host_pool`)."""
        from kvoffload.errors import ConfigError
        from kvoffload.pools import DevicePool

        if config.device_pages is None:
            raise ConfigError(
                "create_pools() is owned mode; with device_pages=None the engine owns the device pool"
            )
        device = DevicePool.create(
            config.device_pages, config.page_size, config.kv_shape, config.dtype, device=self.device_name
        )
        page_shape = (config.page_size, *config.kv_shape)
        host = self.create_host_pool(
            config.host_pages, page_shape, config.dtype, zero=config.host_zero, buffer=host_buffer
        )
        return device, host

    def create_host_pool(
        self, n_pages: int, page_shape: Sequence[int], dtype: str, *, zero: bool = False, buffer: Any = None
    ) -> HostPool:
        """The host pool: ``n_pages`` pages of ``page_shape`` ``dtype`` elements (pinned
        when :attr:`pins_host`, exactly the size asked for), or the engine's ``buffer``."""
        from kvoffload.pools import HostPool

        return HostPool.new(n_pages, page_shape, dtype, pin=self.pins_host, zero=zero, buffer=buffer)

    def open(self, device: DevicePool | EnginePages, host: HostPool) -> None:  # noqa: B027 - optional hook
        """Bind the pools before the first submit; start worker threads. Called once."""

    @abc.abstractmethod
    def set_waker(self, waker: Callable[[], None] | None) -> None:
        """Call ``waker()`` (from any thread, at most once until the completions it
        announced were taken) whenever completions become ready; ``None``: nobody waits."""

    @abc.abstractmethod
    def submit(self, transfer: Transfer) -> None:
        """Accept ``transfer``: check it and queue it; read no page yet. Never blocks.

        Raises :class:`~kvoffload.BackendError` if the copy cannot be accepted (then
        nothing was queued and the caller still owns the host pages).
        """

    def launch(self) -> None:  # noqa: B027 - optional hook
        """Start the copies of every transfer accepted since the last call. Never blocks.
        A copy that cannot start completes as a failure of that transfer (F20)."""

    @abc.abstractmethod
    def take_completions(self, max_completions: int | None = None) -> list[Completion]:
        """The completions ready now, oldest first (at most ``max_completions``), each
        returned once. Never blocks."""

    @property
    @abc.abstractmethod
    def ready(self) -> int:
        """Completions signalled and not yet taken."""

    @property
    @abc.abstractmethod
    def signalled(self) -> int:
        """Completions made available so far (monotonic)."""

    def wait_ready(self, timeout: float | None) -> bool:
        """Block this thread until a completion is ready or ``timeout`` seconds passed;
        return whether one is ready. The default sleeps in short steps."""
        import time

        deadline = None if timeout is None else time.monotonic() + timeout
        delay = 20e-6
        while not self.ready and not self.take_ready_nowait():
            if deadline is not None and time.monotonic() >= deadline:
                return False
            time.sleep(delay if deadline is None else max(0.0, min(delay, deadline - time.monotonic())))
            delay = min(delay * 2, 1e-3)
        return True

    def take_ready_nowait(self) -> bool:
        """For polling backends: look for completions now; return whether one is ready."""
        return bool(self.ready)

    @property
    def streams(self) -> int:
        """Copy streams: a transfer's ``stream`` is in ``range(streams)``. Completions of
        one stream come in submission order; streams are independent of each other."""
        return 1

    def running(self) -> list[Transfer]:
        """Transfers whose copy was accepted and has not signalled (for error messages)."""
        return []

    def close(self) -> None:  # noqa: B027 - optional hook
        """Accept nothing more; let what was accepted finish. Never blocks."""

    def join(self, timeout: float | None = None) -> bool:
        """Wait at most ``timeout`` seconds (``None``: for ever) until no copy runs;
        return whether none runs. Call after :meth:`close`."""
        return True


class Storage(abc.ABC):
    """A tier that keeps pages under their chain keys, shared by workers or not.

    Called from the event loop by the manager's storage-writer task and by
    ``lookup``/``fetch``; a store may do its I/O on threads. A store never sees
    lifecycles. A page is the raw bytes of one host page.
    """

    name: ClassVar[str] = "abstract"

    @abc.abstractmethod
    async def put(self, keys: Sequence[str], pages: Sequence[bytes]) -> None:
        """Store ``pages[i]`` under ``keys[i]``; raise :class:`~kvoffload.StorageError` on failure.

        A page is stored whole or not at all (no torn page is ever readable under a key).
        Per-page truth (FAILURES F34): returning means the store confirmed every page.
        When it stored part of the batch it raises
        :class:`~kvoffload.PartialWriteError`, whose ``stored[i]`` says whether it
        confirmed page ``i`` (and ``errors[i]`` why not); any other error confirms no
        page of the batch (some may be stored all the same). The writer counts a page
        stored only where it was confirmed and retries only the others; a retry of the
        same keys is safe (a key always names the same tokens). Raises ``ValueError``
        (nothing stored) when ``len(keys) != len(pages)``.
        """

    async def put_pages(self, keys: Sequence[str], host_pool: HostPool, host_pages: Sequence[int]) -> None:
        """Store host page ``host_pages[i]`` of ``host_pool`` (a
        :class:`~kvoffload.pools.HostPool`) under ``keys[i]``: what the storage writer
        calls for each copied chunk. The pages are held (nobody writes them) until this
        returns; a store must not keep a reference to their memory after that.

        Same guarantees and errors as :meth:`put` (a batch stored in part raises
        :class:`~kvoffload.PartialWriteError`, one flag per page). The default reads each page out as
        ``bytes`` (one copy, in the writer's own context) and calls :meth:`put`; the
        file and redis stores override it to write from the pool's memory directly. A
        store that reads pinned host memory by page index (as SGLang's do) overrides it.
        """
        from kvoffload.pools import page_views

        if len(keys) != len(host_pages):
            raise ValueError(f"{len(keys)} keys for {len(host_pages)} pages")
        views = page_views(host_pool, host_pages)
        pages = _copied(views)
        del views  # no reference to the pool's memory outlives the call
        await self.put(keys, pages)

    @abc.abstractmethod
    async def get(self, keys: Sequence[str]) -> list[bytes | None]:
        """The bytes under each key, ``None`` where missing or unreadable.

        Never returns bytes that were not stored under exactly that key: a torn,
        corrupt or mis-keyed record reads as ``None``. Raises
        :class:`~kvoffload.StorageError` when the tier cannot be reached.
        """

    async def get_into(self, keys: Sequence[str], dest: Sequence[memoryview]) -> int:
        """Read the page under ``keys[i]`` into the writable buffer ``dest[i]`` (a host
        page's bytes), counting from the first; stop at the first page that is missing,
        unreadable or not exactly ``len(dest[i])`` bytes.

        Returns how many leading buffers were filled; the contents of the others are
        unspecified. Raises :class:`~kvoffload.StorageError` when the tier cannot be
        reached.
        """
        if len(keys) != len(dest):
            raise ValueError(f"{len(keys)} keys for {len(dest)} buffers")
        n = 0
        for page, buf in zip(await self.get(keys), dest, strict=True):
            if page is None or len(page) != buf.nbytes:
                break
            buf.cast("B")[:] = page
            n += 1
        return n

    async def get_into_parts(self, keys: Sequence[str], dest: Sequence[Sequence[memoryview]]) -> int:
        """:meth:`get_into` where page ``i``'s bytes go, in order, into the writable
        buffers ``dest[i]`` (their sizes add up to the page's): an engine's block that
        lies across its layers' tensors, read with no copy through a host page.

        Returns how many leading pages were filled; a page missing, unreadable or not
        exactly the parts' size stops it, and the buffers of that page and the later
        ones hold unspecified bytes (a page that fails its check may already be in
        them: the caller recomputes those). The default reads each page with
        :meth:`get` and copies its parts; the file store reads into the parts directly
        (``preadv``) and checks them there."""
        if len(keys) != len(dest):
            raise ValueError(f"{len(keys)} keys for {len(dest)} pages of buffers")
        n = 0
        for page, parts in zip(await self.get(keys), dest, strict=True):
            if page is None or len(page) != sum(b.nbytes for b in parts):
                break
            off = 0
            for b in parts:
                b.cast("B")[:] = page[off : off + b.nbytes]
                off += b.nbytes
            n += 1
        return n

    async def exists_prefix(self, keys: Sequence[str]) -> int:
        """How many of ``keys``, counting from the first, are stored.

        With chain keys this is a prefix length: page ``i``'s key covers pages ``0..i``.
        A store may answer from metadata, so a page counted here can still read as
        missing later (corrupted, or evicted by another worker's tier).
        """
        n = 0
        for page in await self.get(keys):
            if page is None:
                break
            n += 1
        return n

    async def aclose(self) -> None:  # noqa: B027 - optional hook
        """Release connections and files."""

    def describe(self) -> dict[str, Any]:
        """A small dict for logs and summaries."""
        return {"storage": self.name}


def _copied(views: list[memoryview]) -> list[bytes]:
    """The bytes of each view (one copy each)."""
    return [v.tobytes() for v in views]
