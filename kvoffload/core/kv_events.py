"""KV events: a page the store confirmed (:class:`BlockStored`) or a page found gone
from it (:class:`BlockRemoved`), in the shape of vLLM's ``BlockStored`` /
``BlockRemoved`` (``vllm.distributed.kv_events``), which KV-aware routers (Dynamo's)
read.

Who sees them: ``mgr.kv_events()`` (both drivers) subscribes and returns the manager's
one :class:`KVEvents` buffer; iterating it drains it. The vLLM connector subscribes its
planner's core when vLLM's ``kv_events_config`` enables KV cache events and hands the
events to vLLM's publisher (``take_events``, :mod:`kvoffload.integrations.vllm_events`).

What counts (one place each, in :class:`KVEventSource`):

- *stored*: the store confirmed the page - ``OffloadCore.write_done`` of a write job
  reported stored; a :class:`~kvoffload.PartialWriteError` as the write's error says
  which pages of the batch it stored (F34): the ones before the first page it did not
  confirm are announced (the chain breaks there, F33: no lookup reaches a page after
  it, so a router is never told of one);
- *removed*: a load's read found a page missing or corrupt in the store (a short read
  without an error; ``OffloadCore.load_read``): the first page it could not read is no
  longer in the tier (the store evicted it, or it is unusable). A read that *raised*
  (store down, timeout) says nothing about residency and announces nothing. No path of
  kvoffload deletes from a store (stores evict on their own: Redis' TTL or maxmemory,
  Mooncake's eviction; kvoffload learns of it only by reading), and the host pool is a
  staging area (a page stays there only until its write), not a tier a router could
  send a request to: it is never announced.

The cost. Nothing until someone subscribes: the core reads one flag (:attr:`KVEventSource.on`)
per finished write and per load read, none per token or per step, and uses no listener
(a listener turns the core's fast paths off). Once subscribed, each d2h copy job the
core hands to the mover records its tokens and parent key (one slice per chunk) until
its write finishes; the buffer holds at most ``maxlen`` events, dropping the oldest
(counted in :attr:`KVEvents.dropped`) when nobody reads.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvoffload.errors import ConfigError, PartialWriteError

if TYPE_CHECKING:
    from array import array

    from kvoffload.abc import Transfer
    from kvoffload.core.chunks import Chunks
    from kvoffload.core.lifecycle import Lifecycle
    from kvoffload.core.loads import Load
    from kvoffload.core.writes import Writes

__all__ = ["MEDIUM_STORAGE", "BlockRemoved", "BlockStored", "KVEventSource", "KVEvents"]

#: The medium of every kvoffload event: vLLM's ``MEDIUM_STORAGE`` (the tier behind the
#: host staging pool), the vocabulary routers match on.
MEDIUM_STORAGE = "STORAGE"

#: The default bound of a :class:`KVEvents` buffer.
DEFAULT_MAXLEN = 4096


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Pages the store confirmed: a run of consecutive pages of one request (one copy
    job's, up to its first page the store did not confirm).

    vLLM's fields: ``block_hashes`` (the pages' keys, hex: kvoffload's chain, what
    ``lookup()`` / ``fetch()`` and every kvoffload store use), ``parent_block_hash``
    (the key of the page before the first one; ``None`` for a request's first page),
    ``token_ids`` (the run's tokens, ``block_size`` per page), ``block_size`` (the page
    size), ``lora_id`` / ``lora_name`` (``None``: kvoffload folds an adapter into the
    chain seed, so the keys already differ), ``medium`` (:data:`MEDIUM_STORAGE`).
    kvoffload's own: ``rid`` (the request id, a label), ``lifecycle_id``, ``transfer``
    (the copy job's id), ``first_token`` (where the run starts in its request),
    ``tag`` (the lifecycle's tag: the engine's handle, held while the event waits in
    the buffer) and ``t`` (the core's clock when the store's answer was delivered)."""

    block_hashes: list[str]
    parent_block_hash: str | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str
    lora_name: str | None
    rid: Any
    lifecycle_id: int
    transfer: int
    first_token: int
    tag: Any
    t: float


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Pages no longer in the store: ``block_hashes`` (keys, hex) and ``medium`` as
    vLLM's; ``rid``, ``page`` (the first page's index in the request's chain),
    ``tag`` (the load's tag) and ``t`` are kvoffload's (see the module doc for when)."""

    block_hashes: list[str]
    medium: str
    rid: Any
    page: int
    tag: Any
    t: float


KVEvent = BlockStored | BlockRemoved


class KVEvents:
    """A manager's KV events, oldest first, at most ``maxlen`` (the oldest are dropped
    and counted in :attr:`dropped` when nobody reads). Iterating drains it (each event
    is yielded once); :meth:`drain` returns them as a list. Events are appended on the
    manager's owner thread; appending and draining are single deque operations, so a
    consumer thread may drain while the manager runs. :meth:`close` stops recording."""

    __slots__ = ("_buf", "_source", "dropped", "maxlen")

    def __init__(self, source: KVEventSource, maxlen: int) -> None:
        self._source = source
        self.maxlen = maxlen
        # _buf: events not yet read. Invariant: len(self._buf) <= self.maxlen
        self._buf: deque[KVEvent] = deque(maxlen=maxlen)
        # dropped: events pushed out unread by newer ones (only ever grows).
        self.dropped = 0

    def _push(self, event: KVEvent) -> None:
        if len(self._buf) == self.maxlen:
            self.dropped += 1
        self._buf.append(event)

    def __iter__(self) -> Iterator[KVEvent]:
        buf = self._buf
        while buf:
            try:
                yield buf.popleft()
            except IndexError:  # another thread drained the last one
                return

    def drain(self) -> list[KVEvent]:
        """Every event not yet read, oldest first (they leave the buffer)."""
        return list(self)

    def __len__(self) -> int:
        return len(self._buf)

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` ran (nothing is recorded any more)."""
        return self._source.buffer is not self

    def close(self) -> None:
        """Stop recording (the events still buffered stay readable); the core goes back
        to paying nothing. A later ``kv_events()`` starts a new buffer."""
        self._source.unsubscribe(self)

    def __repr__(self) -> str:
        return f"<KVEvents {len(self._buf)}/{self.maxlen} dropped={self.dropped}>"


class KVEventSource:
    """The core's room for KV events (see the module doc): whether anyone subscribed,
    the chunks it saw go out, and the buffer it fills. Called on the owner thread.

    It reads the registry's ``live`` lifecycles (a copy job's lifecycle), and the
    chunks' ``inflight`` copies and the writes' ``jobs`` and ``held`` jobs (to forget
    chunks that never reach a write: a failed or discarded copy). ``chunks.accept``, the
    core's sink for copy jobs, is the one slot it sets: the wrapper while subscribed,
    the mover's own sink otherwise (the facade's setter goes through :meth:`wrap`)."""

    def __init__(
        self, live: Mapping[Any, Lifecycle], chunks: Chunks, writes: Writes, clock: Callable[[], float]
    ) -> None:
        self.live = live
        self.sink = chunks
        self.writes = writes
        self.page_size = chunks.config.page_size
        self.clock = clock
        # on: someone subscribed (the core's one read). Invariant: self.on == (self.buffer is not None)
        self.on = False
        self.buffer: KVEvents | None = None
        # chunks: d2h copy jobs handed to the mover since the subscription whose write has
        # not finished: transfer id -> (tokens, parent key, tag). Pruned of the jobs that
        # never reach a write once it doubles.
        self.chunks: dict[int, tuple[array[int], str | None, Any]] = {}
        self._prune_at = 64
        # _sinks: (the mover's accept, the wrapper the core uses instead) while on.
        # Invariant: self._sinks is None or self.sink.accept is self._sinks[1]
        self._sinks: tuple[Callable[[Transfer], None], Callable[[Transfer], None]] | None = None

    # --- subscription ----------------------------------------------------------------

    def subscribe(self, maxlen: int = DEFAULT_MAXLEN) -> KVEvents:
        """The core's buffer, made on the first call (``maxlen`` >= 1; a later call must
        pass the same or the default). Raises :class:`~kvoffload.ConfigError`."""
        if type(maxlen) is not int or maxlen < 1:
            raise ConfigError(f"kv_events(maxlen=) must be an int >= 1, got {maxlen!r}")
        buf = self.buffer
        if buf is not None:
            if maxlen not in (buf.maxlen, DEFAULT_MAXLEN):
                raise ConfigError(f"kv_events() is already subscribed with maxlen={buf.maxlen}, not {maxlen}")
            return buf
        buf = self.buffer = KVEvents(self, maxlen)
        self.on = True
        self.sink.accept = self.wrap(self.sink.accept)
        return buf

    def unsubscribe(self, buf: KVEvents) -> None:
        """``buf`` closed: the core's sink is the mover's own again."""
        if self.buffer is buf:
            inner = self.inner
            self.buffer = None
            self.on = False
            self.chunks.clear()
            if inner is not None:
                self.sink.accept = self.wrap(inner)

    def wrap(self, accept: Callable[[Transfer], None]) -> Callable[[Transfer], None]:
        """The sink the core hands copy jobs to: ``accept`` itself while nobody
        subscribed, else a wrapper that records each d2h job's tokens once ``accept``
        took it (a refusal records nothing). The core calls this whenever its sink is
        set, and reads :attr:`on` to know when to ask again."""
        if not self.on:
            self._sinks = None
            return accept
        if self._sinks is not None and accept in self._sinks:
            return self._sinks[1]
        record = self._record

        def accept_and_record(t: Transfer) -> None:
            accept(t)
            if t.direction == "d2h":
                record(t)

        self._sinks = (accept, accept_and_record)
        return accept_and_record

    @property
    def inner(self) -> Callable[[Transfer], None] | None:
        """The mover's own sink under the wrapper (``None`` while nothing is wrapped)."""
        return None if self._sinks is None else self._sinks[0]

    def _record(self, t: Transfer) -> None:
        lc = self.live.get(t.lifecycle_id)
        if lc is None:  # (not a live lifecycle's: nothing to say about it)
            return
        # accept runs before the chunk leaves the tail and the chain moves (Chunks.send)
        parent = lc.chain_key if t.first_token else None
        self.chunks[t.id] = (lc._tail[: t.n_tokens], parent, t.tag)
        if len(self.chunks) > self._prune_at:
            w = self.writes
            inflight, jobs = self.sink.inflight, w.jobs
            held = {j.id for d in w.held.values() for j in d.values()}
            for tid in [i for i in self.chunks if i not in inflight and i not in jobs and i not in held]:
                del self.chunks[tid]
            self._prune_at = max(64, 2 * len(self.chunks))

    # --- events ----------------------------------------------------------------------

    def written(self, job_id: int, stored: bool, error: BaseException | None) -> None:
        """Write job ``job_id`` (still queued) finished: announce the pages the store
        confirmed, up to the first one it did not (all of them when ``stored``; the
        leading ones a :class:`PartialWriteError` flags; none otherwise) - the pages a
        lookup can reach: the chain breaks at the first unconfirmed page (F33, F34). The
        one place a write's result becomes an event; a job id not queued is ignored
        (the core's own call raises for it)."""
        job = self.writes.jobs.get(job_id)
        chunk = self.chunks.pop(job_id, None)
        buf = self.buffer
        if job is None or chunk is None or buf is None:
            return
        n = len(job.keys)
        if isinstance(error, PartialWriteError) and len(error.stored) == n:
            ok = next((i for i, s in enumerate(error.stored) if not s), n)
        else:
            ok = n if stored else 0
        if ok == 0:
            return
        tokens, parent, tag = chunk
        ps = self.page_size
        buf._push(
            BlockStored(
                block_hashes=job.keys[:ok],
                parent_block_hash=parent,
                token_ids=tokens[: ok * ps].tolist(),
                block_size=ps,
                lora_id=None,
                medium=MEDIUM_STORAGE,
                lora_name=None,
                rid=job.rid,
                lifecycle_id=job.lifecycle_id,
                transfer=job.id,
                first_token=job.first_token,
                tag=tag,
                t=self.clock(),
            )
        )

    def wrap_read(self, read: Callable[..., list[Load]]) -> Callable[..., list[Load]]:
        """The core's ``load_read``: ``read`` (the load room's), then, while subscribed,
        :meth:`read` of its result (a read that raised changed nothing: no event)."""

        def load_read(ld: Load, n_ok: int, error: BaseException | None = None) -> list[Load]:
            done = read(ld, n_ok, error)
            if self.on:
                self.read(ld, n_ok, error)
            return done

        load_read.__doc__ = read.__doc__
        return load_read

    def read(self, ld: Load, n_ok: int, error: BaseException | None) -> None:
        """Load ``ld``'s read returned ``n_ok`` good pages: short without an error, the
        page after them is gone from the store (see the module doc)."""
        buf = self.buffer
        if buf is None or error is not None or n_ok >= len(ld.keys):
            return
        buf._push(
            BlockRemoved(
                block_hashes=[ld.keys[n_ok]],
                medium=MEDIUM_STORAGE,
                rid=ld.rid,
                page=ld.first_page + n_ok,
                tag=ld.tag,
                t=self.clock(),
            )
        )
