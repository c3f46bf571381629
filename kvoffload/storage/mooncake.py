"""A Mooncake Store tier: pages pooled in the DRAM of many machines
(``pip install 'kvoffload[mooncake]'``; Debian's ``libibverbs1`` must be installed).

Mooncake Store (kvcache-ai/Mooncake) is the distributed KV tier SGLang HiCache, vLLM,
LMCache and Dynamo use: a ``mooncake_master`` allocates space and keeps the metadata;
clients contribute DRAM segments and move bytes between them with the transfer engine.
This store is one such client.

``resolve_storage("mooncake://HOST:PORT?...")`` opens one (HOST:PORT is the master's RPC
address); :class:`MooncakeStore` is the class for those who build it themselves. Options
(query parameters, or keyword arguments of the same name; an unknown one is refused):

=======================  ===================  ======================================================
option                   default              meaning
=======================  ===================  ======================================================
``prefix``               ``kvoffload:``       put before every page key (the object's name)
``global_segment_size``  ``256MiB``           DRAM this client lends to the pool (``0``: none; then
                                              pages live in other clients' segments, e.g. a
                                              ``mooncake_client`` memory server, and outlive this
                                              process)
``local_buffer_size``    ``16MiB``            the client's staging buffer (``get`` only; writes and
                                              ``get_into`` use registered arenas)
``protocol``             ``tcp``              transfer protocol: ``tcp`` or ``rdma``
``device``               (none)               RDMA device names (``protocol=rdma``)
``local_hostname``       (route to master)    the address this client's transfer engine advertises
``metadata_server``      ``P2PHANDSHAKE``     Mooncake's metadata service: P2P handshake needs none
                                              (no etcd, no HTTP metadata server)
``replicas``             ``1``                memory replicas of each page
``timeout_s``            ``5``                bound of one master RPC (``MC_RPC_TIMEOUT_MS``) and of
                                              opening; a call is abandoned after 3x this
``verify``               ``1``                check each page's checksum on read (``0``: header only)
=======================  ===================  ======================================================

Sizes take a unit (``KB``, ``MB``, ``GB``, ``KiB``, ``MiB``, ``GiB``) or are bytes.

**Records, and why a checksum.** Each page is one Mooncake object under
``<prefix><page key>`` holding a kvoffload record (:mod:`kvoffload.storage._record`: the
key, the payload length and an XXH3-64 checksum, then the page), as on the file and
redis stores. Mooncake's own guarantees (a put is visible only after PutEnd; a read holds
a lease so the object is not removed under it; sizes are exact) make a torn *put*
unreadable, but they do not cover bytes that changed under a transfer: an upsert
that replaces a key may write where a reader is reading; a segment's memory may be
corrupt. The checksum, computed before the transfer and checked after it, turns each
of these into a miss (FAILURES F38), never into wrong KV. (A write whose call is
abandoned or cancelled is a different case: its thread may run on after the pool
took its host pages back, and a record staged from them then would carry the next
chunk's bytes under a checksum that matches. So staging happens under a gate that the
caller closes when it gives up: the thread then stages nothing and puts nothing, and
Mooncake only ever reads the arena.) ``verify=0`` keeps the header checks (key,
length) and skips the hash (XXH3-64: tens of GB/s, small beside a transfer).

**Writes** read each host page in place (never out as ``bytes``), take its checksum and
copy it once, behind its header, into a registered arena; one ``batch_upsert_from``
sends the records, one transfer each. Mooncake 0.3.13 moves every buffer of a
multi-buffer call as a transfer of its own, and over TCP a header's transfer costs
more than a memcpy of the page: ``batch_put_from_multi_buffers`` with the page in place
(zero-copy) measured about 0.5-0.85 of a raw ``batch_put_from``, the staged record
0.87-0.98 timed as whole rows per round and 0.75-0.80 paired batch by batch (64 KiB
pages; docs/storage.md says where the rest goes: one more 64 KiB socket piece for the
header, and the copy). An upsert replaces a key already stored,
so a record that is corrupt or another writer's heals on the next write of its key,
and it does not wait for a reader's lease. Mooncake answers per key, so a batch that
is stored in part raises :class:`~kvoffload.errors.PartialWriteError` (``stored``: one
flag per page), one stored not at all a plain :class:`~kvoffload.StorageError`.
**Reads** (``get_into``) bring each record into a registered arena with
``batch_get_into`` (one transfer per page, for the same reason), check it there and
only then copy the page into its host page, so bytes that fail never touch the pool;
``exists_prefix`` is one ``batch_is_exist``.

**Threads and time.** Every client call runs on a worker thread, never on the event
loop. Master RPCs are bounded by ``timeout_s`` (Mooncake's ``MC_RPC_TIMEOUT_MS``, set
for the process by the first store opened unless already set). A call that has not
returned after 3x ``timeout_s`` is abandoned (a ``StorageError``). Once a call is
abandoned or its caller cancelled, its thread - which may run on - touches the caller's
memory no more: a read copies nothing into the caller's buffers, a write stages nothing
of its host pages (both under a gate the caller closes). Opening checks that the master
answers at all (a TCP connect bounded by ``timeout_s``) before Mooncake's setup, so a
master that is not there is a ``StorageError`` naming it at once; while the master is
taken as down (Mooncake said RPC_FAIL), each call checks with a TCP connect first and
fails at once, instead of waiting out Mooncake's reconnects (about 4 s each).

**One client per process** for each master and client settings, shared by its stores:
Mooncake's close joins its threads while holding the interpreter's lock (about a
second), so ``aclose`` closes the store, not the client; :func:`close_clients` closes
the clients no store uses, and runs at exit.

**Network.** With ``P2PHANDSHAKE`` no metadata server runs. Mooncake 0.3.13's client
listens on the wildcard address for its handshake and TCP transport whatever
``local_hostname`` says; it advertises ``local_hostname``, so with a master on
127.0.0.1 every connection is on loopback (tests/storage/test_mooncake_store.py
checks this). Keep those ports off the network with a firewall or a network namespace.
"""

from __future__ import annotations

import atexit
import bisect
import contextlib
import itertools
import os
import re
import socket
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import parse_qsl, urlsplit

import anyio
import anyio.to_thread

from kvoffload.abc import Storage
from kvoffload.errors import ConfigError, MissingDependency, PartialWriteError, StorageError
from kvoffload.pools import page_views
from kvoffload.storage._record import decode, encode_header, header_size, intact, payload_offset
from kvoffload.storage._url import redact

if TYPE_CHECKING:
    import numpy as np

    from kvoffload.pools import HostPool

__all__ = ["DEFAULT_PREFIX", "OPTIONS", "MooncakeStore", "close_clients", "error_name"]

_T = TypeVar("_T")

#: Key prefix when none is given.
DEFAULT_PREFIX = "kvoffload:"

#: The options a ``mooncake://`` URL may carry, with their defaults (as written in a URL).
OPTIONS: dict[str, str | None] = {
    "prefix": DEFAULT_PREFIX,
    "global_segment_size": "256MiB",
    "local_buffer_size": "16MiB",
    "protocol": "tcp",
    "device": None,
    "local_hostname": None,
    "metadata_server": "P2PHANDSHAKE",
    "replicas": "1",
    "timeout_s": "5",
    "verify": "1",
}

#: Mooncake's error codes (mooncake-store types.h, 0.3.13) that this store names.
_ERRORS = {
    -1: "INTERNAL_ERROR",
    -200: "NO_AVAILABLE_HANDLE (no space left in the segments)",
    -600: "INVALID_PARAMS (the object is larger than the buffer)",
    -703: "REPLICA_IS_NOT_READY",
    -704: "OBJECT_NOT_FOUND",
    -705: "OBJECT_ALREADY_EXISTS",
    -706: "OBJECT_HAS_LEASE",
    -707: "LEASE_EXPIRED",
    -800: "TRANSFER_FAIL",
    -900: "RPC_FAIL (the master did not answer)",
    -901: "RPC_TIMEOUT",
}
#: Codes that say the master cannot be reached.
_UNREACHABLE = frozenset({-900, -901})

_SIZE = re.compile(r"\s*(\d+)\s*([kmgt]?i?b?)?\s*", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
#: Bytes of header room per page in an arena (a header is 24 bytes plus the key).
_ARENA_MIN = 1 << 16


def error_name(code: int) -> str:
    """Mooncake's name for an error ``code`` (a negative int), or the number."""
    return _ERRORS.get(code, f"error {code}")


def _parse_size(name: str, text: str) -> int:
    m = _SIZE.fullmatch(text)
    if m is None:
        raise ConfigError(f"mooncake storage: {name}={text!r} is not a size (bytes, or e.g. 64MiB, 1GB)")
    unit = (m.group(2) or "").lower()
    base = _UNITS.get(unit[:1], 1)
    if "i" in unit:
        base = {10**3: 1 << 10, 10**6: 1 << 20, 10**9: 1 << 30, 10**12: 1 << 40}.get(base, base)
    return int(m.group(1)) * base


def _mooncake_store() -> Any:
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as exc:
        raise MissingDependency(
            "the mooncake storage needs Mooncake's client: pip install 'kvoffload[mooncake]' "
            f"(and Debian's libibverbs1: apt-get install -y libibverbs1): {exc}"
        ) from exc
    return MooncakeDistributedStore


@dataclass(frozen=True, slots=True)
class _Settings:
    prefix: str
    global_segment_size: int
    local_buffer_size: int
    protocol: str
    device: str
    local_hostname: str | None
    metadata_server: str
    replicas: int
    timeout_s: float
    verify: bool


def _settings(query: dict[str, str], given: dict[str, Any]) -> _Settings:
    """The store's settings: keyword arguments over URL options over defaults."""
    raw: dict[str, Any] = {k: v for k, v in OPTIONS.items()}
    raw.update(query)
    raw.update({k: v for k, v in given.items() if v is not None})

    def size(name: str) -> int:
        v = raw[name]
        n = v if type(v) is int else _parse_size(name, str(v))
        if n < 0:
            raise ConfigError(f"mooncake storage: {name} must be >= 0, got {v!r}")
        return n

    protocol = str(raw["protocol"])
    if protocol not in ("tcp", "rdma"):
        raise ConfigError(f"mooncake storage: protocol must be 'tcp' or 'rdma', got {protocol!r}")
    try:
        replicas = int(raw["replicas"])
        timeout_s = float(raw["timeout_s"])
    except (TypeError, ValueError):
        raise ConfigError(
            f"mooncake storage: replicas={raw['replicas']!r} must be an int and "
            f"timeout_s={raw['timeout_s']!r} a number"
        ) from None
    if replicas < 1:
        raise ConfigError(f"mooncake storage: replicas must be >= 1, got {replicas!r}")
    if not timeout_s > 0:
        raise ConfigError(f"mooncake storage: timeout_s must be > 0, got {timeout_s!r}")
    verify = raw["verify"]
    if not isinstance(verify, bool):
        if str(verify).lower() not in ("0", "1", "true", "false"):
            raise ConfigError(f"mooncake storage: verify must be 0 or 1, got {verify!r}")
        verify = str(verify).lower() in ("1", "true")
    return _Settings(
        prefix=str(raw["prefix"]),
        global_segment_size=size("global_segment_size"),
        local_buffer_size=size("local_buffer_size"),
        protocol=protocol,
        device=str(raw["device"] or ""),
        local_hostname=None if raw["local_hostname"] is None else str(raw["local_hostname"]),
        metadata_server=str(raw["metadata_server"]),
        replicas=replicas,
        timeout_s=timeout_s,
        verify=verify,
    )


class _Arena:
    """A buffer registered with the client once, lent to one call at a time."""

    __slots__ = ("buf", "ptr", "size")

    def __init__(self, buf: np.ndarray[Any, Any]) -> None:
        self.buf = buf
        self.ptr = int(buf.ctypes.data)
        self.size = int(buf.nbytes)


class _Gate:
    """Whether a call's thread may still touch the caller's buffers - a read copy into
    them, a write stage the host pages - (closed when the caller gave up on it)."""

    __slots__ = ("closed", "lock")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.closed = False

    def close(self) -> None:
        with self.lock:  # waits for a copy under way (a memcpy)
            self.closed = True


class _Client:
    """One Mooncake client of this process and what goes with it: the buffers registered
    with it, the staging arenas, the calls running, whether its master is taken as down."""

    def __init__(self, client: Any, addr: tuple[str, int]) -> None:
        self.client = client
        self.addr = addr
        # Invariant: lock guards regions, free and refs (worker threads use them).
        self.lock = threading.Lock()
        # regions: (start, end) of every arena registered with the client, sorted, disjoint.
        self.regions: list[tuple[int, int]] = []
        # free: arenas not lent to a call right now.
        self.free: list[_Arena] = []
        # refs: stores open on this client. Invariant: refs >= 0.
        self.refs = 0
        # busy: calls running inside the client now (an abandoned one included); it is
        # closed only at 0. Invariant: busy >= 0 (under idle's lock).
        self.busy = 0
        self.idle = threading.Condition()
        # down: the last answer said the master is unreachable; until a TCP connect to it
        # succeeds again, calls fail at once instead of waiting out Mooncake's reconnects.
        self.down = False
        self.closed = False

    def release(self) -> None:
        with self.lock:
            self.refs -= 1

    def close(self, bound: float) -> bool:
        """Close the client when no call runs in it (waiting at most ``bound`` s);
        whether it was closed. A client whose abandoned call never returned stays open
        rather than freed under it."""
        with self.idle:
            if not self.idle.wait_for(lambda: self.busy == 0, timeout=bound):
                return False
            self.closed = True
        self.client.close()
        return True


#: The process's clients, by master and client settings. Invariant: every entry is open.
_CLIENTS: dict[tuple[Any, ...], _Client] = {}
_CLIENTS_LOCK = threading.Lock()


def _client_for(master: str, addr: tuple[str, int], s: _Settings, shown: str) -> _Client:
    """The open client for ``master`` with these settings (made and set up if none)."""
    key = (master, s.global_segment_size, s.local_buffer_size, s.protocol, s.device, s.local_hostname,
           s.metadata_server)  # fmt: skip
    with _CLIENTS_LOCK:
        c = _CLIENTS.get(key)
        if c is None:
            c = _CLIENTS[key] = _Client(_open(master, addr, s, shown), addr)
        with c.lock:
            c.refs += 1
        return c


def _open(master: str, addr: tuple[str, int], s: _Settings, shown: str) -> Any:
    """A new Mooncake client, set up with ``master``; a StorageError naming it if the
    master does not listen (a TCP connect bounded by ``timeout_s``) or setup fails."""
    try:
        with socket.create_connection(addr, timeout=s.timeout_s) as probe:
            local = probe.getsockname()[0]
    except OSError as exc:
        raise StorageError(
            f"mooncake storage: cannot reach the master at {master} ({shown}): {exc}"
        ) from None
    os.environ.setdefault("MC_RPC_TIMEOUT_MS", str(max(1, round(s.timeout_s * 1000))))
    os.environ.setdefault("MC_STORE_CLIENT_SETUP_RETRIES", "1")
    client = _mooncake_store()()
    rc = client.setup(
        s.local_hostname or local, s.metadata_server, s.global_segment_size, s.local_buffer_size, s.protocol,
        s.device, master,
    )  # fmt: skip
    if rc != 0:
        with contextlib.suppress(Exception):
            client.close()
        raise StorageError(
            f"mooncake storage: the client could not set up with the master at {master} "
            f"(setup returned {rc}; protocol {s.protocol}, segment {s.global_segment_size} bytes)"
        )
    return client


def close_clients(master: str | None = None, *, bound_s: float = 15.0) -> int:
    """Close the process's Mooncake clients that no open store uses (of ``master``,
    ``"HOST:PORT"``, or all): their segments leave the pool. Blocks (Mooncake's close
    takes about a second and holds the interpreter's lock). Returns how many closed.
    Runs at interpreter exit for all of them."""
    with _CLIENTS_LOCK:
        picked = [(k, c) for k, c in _CLIENTS.items() if c.refs <= 0 and (master is None or k[0] == master)]
        for k, _ in picked:
            del _CLIENTS[k]
    return sum(c.close(bound_s) for _, c in picked)


def _close_at_exit() -> None:
    with _CLIENTS_LOCK:
        for c in _CLIENTS.values():
            c.refs = 0
    close_clients(bound_s=2.0)


atexit.register(_close_at_exit)


class MooncakeStore(Storage):
    """Pages in a Mooncake Store whose master listens at ``url``
    (``mooncake://HOST:PORT?option=value&...``; options in the module's docstring; the
    keyword arguments of the same names override the URL's).

    Creating the store opens the client (Mooncake's ``setup``): it raises
    :class:`~kvoffload.StorageError` naming the master's address when the master
    cannot be reached, :class:`~kvoffload.ConfigError` for a bad URL or option (naming
    it), :class:`~kvoffload.MissingDependency` when Mooncake is not installed. Called
    where every store is (the writer's loop, ``lookup``/``fetch``); every client call
    runs on a worker thread. ``aclose`` closes the client (its segment leaves the pool).
    """

    name = "mooncake"

    def __init__(
        self,
        url: str,
        *,
        prefix: str | None = None,
        global_segment_size: int | str | None = None,
        local_buffer_size: int | str | None = None,
        protocol: str | None = None,
        device: str | None = None,
        local_hostname: str | None = None,
        metadata_server: str | None = None,
        replicas: int | None = None,
        timeout_s: float | None = None,
        verify: bool | None = None,
    ) -> None:
        self.display_url = redact(url)
        parts = urlsplit(url)
        if parts.scheme != "mooncake":
            raise ConfigError(f"mooncake storage: {self.display_url!r} is not a mooncake://HOST:PORT URL")
        try:
            host, port = parts.hostname, parts.port
        except ValueError:
            host, port = None, None
        if not host or port is None or parts.path not in ("", "/"):
            raise ConfigError(
                f"mooncake storage: {self.display_url!r} must name the master as mooncake://HOST:PORT "
                "(its RPC address), options as query parameters"
            )
        query = dict(parse_qsl(parts.query, keep_blank_values=True))
        unknown = sorted(set(query) - set(OPTIONS))
        if unknown:
            raise ConfigError(
                f"mooncake storage: unknown option(s) {', '.join(unknown)} in {self.display_url!r}; "
                f"allowed: {', '.join(OPTIONS)}"
            )
        given = {
            "prefix": prefix,
            "global_segment_size": global_segment_size,
            "local_buffer_size": local_buffer_size,
            "protocol": protocol,
            "device": device,
            "local_hostname": local_hostname,
            "metadata_server": metadata_server,
            "replicas": replicas,
            "timeout_s": timeout_s,
            "verify": verify,
        }
        s = self.settings = _settings(query, given)
        self.prefix = s.prefix
        self.master = f"{host}:{port}" if ":" not in host else f"[{host}]:{port}"
        self.timeout_s = s.timeout_s
        self.verify = s.verify
        # _closed: aclose ran; every later call of this store raises.
        self._closed = False
        # _c: the process's client for this master and these client settings (shared by
        # every store that names them; kept open until close_clients() or exit).
        self._c = _client_for(self.master, (host, port), s, self.display_url)

    @property
    def _client(self) -> Any:
        """The Mooncake client (``MooncakeDistributedStore``) this store calls."""
        return self._c.client

    @_client.setter
    def _client(self, client: Any) -> None:
        self._c.client = client

    # --- opening and closing ------------------------------------------------------------

    async def aclose(self) -> None:
        """Close this store: its later calls raise :class:`~kvoffload.StorageError`.
        The client stays open for the process's other stores of this master (and for
        the next one opened): Mooncake's close holds the interpreter's lock for about a
        second while it joins its threads, which would stall every thread at each
        close. :func:`close_clients` closes the clients no store uses (at exit too)."""
        if self._closed:
            return
        self._closed = True
        self._c.release()

    # --- buffers ------------------------------------------------------------------------

    def _registered(self, start: int, size: int) -> bool:
        i = bisect.bisect_right(self._c.regions, (start, 1 << 64)) - 1
        return i >= 0 and self._c.regions[i][0] <= start and start + size <= self._c.regions[i][1]

    def _register(self, start: int, size: int) -> bool:
        """Register ``size`` bytes at ``start`` with the client (once). Lock held."""
        end = start + size
        if self._registered(start, size):
            return True
        if any(a < end and start < b for a, b in self._c.regions):
            return False  # overlaps a live buffer registered before: not registered again
        if self._c.client.register_buffer(start, size) != 0:
            return False
        bisect.insort(self._c.regions, (start, end))
        return True

    @contextlib.contextmanager
    def _arena(self, nbytes: int) -> Iterator[_Arena]:
        """A registered buffer of at least ``nbytes`` for the length of one call."""
        import numpy as np

        with self._c.lock:
            for i, a in enumerate(self._c.free):
                if a.size >= nbytes:
                    arena = self._c.free.pop(i)
                    break
            else:
                size = max(_ARENA_MIN, 1 << (max(nbytes, 1) - 1).bit_length())
                arena = _Arena(np.empty(size, dtype=np.uint8))
                if not self._register(arena.ptr, arena.size):
                    raise StorageError("mooncake storage: could not register a staging buffer")
        try:
            yield arena
        finally:
            with self._c.lock:
                self._c.free.append(arena)

    # --- calls on threads ---------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise StorageError(f"mooncake storage at {self.master}: the store is closed")

    async def _abandonable(self, what: str, fn: Callable[..., _T], *args: Any) -> _T:
        """``fn(*args)`` on a worker thread; after 3x ``timeout_s`` the caller gets a
        StorageError and the thread is left to finish (safe for writes: see the module)."""
        self._check_open()
        bound = 3 * self.timeout_s
        with anyio.move_on_after(bound) as scope:
            return await anyio.to_thread.run_sync(self._guarded, fn, *args, abandon_on_cancel=True)
        assert scope.cancelled_caught
        raise StorageError(f"mooncake storage at {self.master}: {what} did not return within {bound:g} s")

    async def _gated(self, what: str, fn: Callable[..., _T], *args: Any) -> _T:
        """:meth:`_abandonable` of ``fn(*args, gate)``, where ``fn`` touches the caller's
        memory (host pages, read buffers) only under ``gate``'s lock and not once it is
        closed: on any exit but success - abandoned (a StorageError) or cancelled - the
        gate is closed, since the thread may run on after the caller has its memory back."""
        gate = _Gate()
        try:
            return await self._abandonable(what, fn, *args, gate)
        except BaseException:
            gate.close()  # waits for a copy under way; from now on the thread touches nothing
            raise

    def _guarded(self, fn: Callable[..., _T], *args: Any) -> _T:
        """On the worker thread: count the call as running, and while the master is taken
        as down, check with a TCP connect that it listens again before calling Mooncake."""
        with self._c.idle:
            if self._closed or self._c.closed:
                raise StorageError(f"mooncake storage at {self.master}: the store is closed")
            self._c.busy += 1
        try:
            if self._c.down:
                try:
                    socket.create_connection(self._c.addr, timeout=self.timeout_s).close()
                except OSError as exc:
                    raise self._error("call", f"RPC_FAIL: the master does not answer ({exc})") from None
                self._c.down = False
            return fn(*args)
        finally:
            with self._c.idle:
                self._c.busy -= 1
                self._c.idle.notify_all()

    def _note(self, codes: Sequence[int]) -> None:
        """Take the master as down when Mooncake said it could not reach it."""
        if any(c in _UNREACHABLE for c in codes):
            self._c.down = True

    def _k(self, keys: Sequence[str]) -> list[str]:
        p = self.prefix
        return [p + k for k in keys]

    def _error(self, what: str, detail: str) -> StorageError:
        return StorageError(f"mooncake storage at {self.master}: {what} failed: {detail}")

    # --- writes -------------------------------------------------------------------------

    async def put(self, keys: Sequence[str], pages: Sequence[bytes]) -> None:
        if len(keys) != len(pages):
            raise ValueError(f"{len(keys)} keys for {len(pages)} pages")
        if keys:
            views = [memoryview(p).cast("B") for p in pages]
            await self._gated("write", self._put_sync, list(keys), views)

    async def put_pages(self, keys: Sequence[str], host_pool: HostPool, host_pages: Sequence[int]) -> None:
        """Write each host page, read in place from the pool's memory (never taken out as
        ``bytes``): on the worker thread its checksum is taken and it is copied once, with
        its header, into a registered arena, sent in one transfer per page. A write abandoned
        or cancelled before its thread staged the pages stages and stores nothing."""
        if len(keys) != len(host_pages):
            raise ValueError(f"{len(keys)} keys for {len(host_pages)} pages")
        if not keys:
            return
        views = page_views(host_pool, host_pages)
        try:
            await self._gated("write", self._put_sync, list(keys), views)
        finally:
            del views

    def _put_sync(self, keys: list[str], views: list[memoryview], gate: _Gate) -> None:
        """Each record (header with its checksum, then the page) staged whole in a
        registered arena, then one ``batch_upsert_from``: one transfer per page, and a key
        already stored is replaced. Page by page, the checksum is taken from the host page
        and the page copied right after, while it is still in the cache.

        ``gate``: staging runs under its lock, and not at all once it is
        closed - the caller gave up on the call and the pool may have handed the pages
        to another chunk, whose bytes would go out under these keys with checksums that
        match them. Mooncake itself reads only the arena."""
        names = self._k(keys)
        lens = [header_size(k) + v.nbytes for k, v in zip(keys, views, strict=True)]
        with self._arena(sum(lens)) as arena:
            buf: memoryview = arena.buf.data
            off = 0
            at: list[int] = []
            with gate.lock:
                if gate.closed:
                    return  # abandoned: the caller has had its StorageError
                for k, v, n in zip(keys, views, lens, strict=True):
                    h = encode_header(k, v)
                    hl = len(h)
                    buf[off : off + hl] = h
                    buf[off + hl : off + n] = v
                    at.append(arena.ptr + off)
                    off += n
            codes = [int(c) for c in self._client.batch_upsert_from(names, at, lens, self._config())]
        self._raise_for(codes)

    def _config(self) -> Any:
        from mooncake.store import ReplicateConfig

        config = ReplicateConfig()
        config.replica_num = self.settings.replicas
        return config

    def _raise_for(self, codes: list[int]) -> None:
        """Nothing when every page was stored; else the per-page truth (F34)."""
        self._note(codes)
        stored = [c == 0 for c in codes]
        if all(stored):
            return
        errors = [None if ok else error_name(c) for ok, c in zip(stored, codes, strict=True)]
        first = next(e for e in errors if e is not None)
        n_bad = stored.count(False)
        if not any(stored):
            raise self._error("write", f"no page of {len(codes)} stored: {first}")
        raise PartialWriteError(
            f"mooncake storage at {self.master}: {n_bad} of {len(codes)} pages not stored: {first}",
            stored,
            errors,
        )

    # --- reads --------------------------------------------------------------------------

    async def get(self, keys: Sequence[str]) -> list[bytes | None]:
        if not keys:
            return []
        records: list[bytes] = await self._abandonable("read", self._get_sync, self._k(keys))
        return [decode(k, r if r else None) for k, r in zip(keys, records, strict=True)]

    def _get_sync(self, names: list[str]) -> list[bytes]:
        codes = self._client.batch_is_exist(names)
        self._note(codes)
        bad = [c for c in codes if c < 0]
        if bad:
            raise self._error("read", error_name(bad[0]))
        present = [n for n, c in zip(names, codes, strict=True) if c == 1]
        got = iter(self._client.get_batch(present) if present else [])
        return [next(got) if c == 1 else b"" for c in codes]

    async def get_into(self, keys: Sequence[str], dest: Sequence[memoryview]) -> int:
        """Each record into a registered arena (``batch_get_into``, one transfer per
        page), checked there - key, length and (``verify``) checksum - and only then its
        page copied into ``dest``: bytes that fail never touch the host pages. A read
        that has not returned after 3x ``timeout_s`` is abandoned (a StorageError): its
        thread then copies nothing into ``dest`` (nor when the caller is cancelled)."""
        if len(keys) != len(dest):
            raise ValueError(f"{len(keys)} keys for {len(dest)} buffers")
        if not keys:
            return 0
        return await self._gated("read", self._get_into_sync, list(keys), list(dest))

    def _get_into_sync(self, keys: list[str], dest: list[memoryview], gate: _Gate) -> int:
        outs = [d.cast("B") if d.format != "B" or d.ndim != 1 else d for d in dest]
        hlens = [header_size(k) for k in keys]
        sizes = [h + o.nbytes for h, o in zip(hlens, outs, strict=True)]
        with self._arena(sum(sizes)) as arena:
            offs = list(itertools.accumulate(sizes, initial=0))[:-1]
            codes = self._client.batch_get_into(self._k(keys), [arena.ptr + o for o in offs], sizes)
            self._note(codes)
            view: memoryview = arena.buf.data
            n = 0
            with gate.lock:  # page by page: checked, then copied while still in the cache
                if gate.closed:
                    return 0
                for key, o, h, c, off in zip(keys, outs, hlens, codes, offs, strict=True):
                    if c < 0:  # missing, another size (a failed transfer), or the master is gone
                        if c in _UNREACHABLE and n == 0:
                            raise self._error("read", error_name(int(c)))
                        break
                    found = payload_offset(key, view[off : off + h], int(c))
                    if found is None or found.length != o.nbytes:
                        break
                    at = off + found.offset  # (an older record's header is shorter)
                    payload = view[at : at + o.nbytes]
                    if self.verify and not intact(found, payload):
                        break
                    o[:] = payload
                    n += 1
        return n

    async def exists_prefix(self, keys: Sequence[str]) -> int:
        """One ``batch_is_exist``; the record itself is checked on read."""
        if not keys:
            return 0
        codes: list[int] = await self._abandonable("lookup", self._exists_sync, self._k(keys))
        n = 0
        for c in codes:
            if c == 1:
                n += 1
                continue
            if c < 0 and n == 0:
                raise self._error("lookup", error_name(int(c)))
            break
        return n

    def _exists_sync(self, names: list[str]) -> list[int]:
        codes: list[int] = self._client.batch_is_exist(names)
        self._note(codes)
        return codes

    # --- showing ------------------------------------------------------------------------

    def describe(self) -> dict[str, Any]:
        s = self.settings
        return {
            "storage": self.name,
            "url": self.display_url,
            "master": self.master,
            "prefix": self.prefix,
            "global_segment_size": s.global_segment_size,
            "protocol": s.protocol,
            "replicas": s.replicas,
            "verify": s.verify,
        }

    def __repr__(self) -> str:
        return f"<MooncakeStore {self.display_url} prefix={self.prefix!r}>"
