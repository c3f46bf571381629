"""The worker side of the vLLM connector: the movers over vLLM's KV tensors.

Runs in each vLLM worker process (the connector's WORKER role, one per rank), on the
model runner's thread; copies and storage I/O run on threads of their own. A
:class:`Mover` holds vLLM's per-layer KV tensors seen as kvoffload engine pages (one
page = one vLLM block, every layer), the real host pool, a kvoffload copy backend
(:class:`~kvoffload.backends.CpuBackend` for a CPU engine), the storage writer
(:class:`~kvoffload.storage.writer.ThreadWriter`, whose event loop also serves the
loads' reads from a store that only reads async) and its load threads (a store with
blocking reads, the file store, is read there directly: :func:`blocking_reads`). It
does what the scheduler's :class:`~kvoffload.integrations.vllm_messages.StepPlan` says
and reports back plain data (:class:`~kvoffload.integrations.vllm_messages.RankReport`,
the request ids of finished loads and releases, and the blocks of failed loads).

When each job runs (vLLM's step on a worker: ``handle_preemptions``, ``start_load_kv``,
the forward, ``wait_for_save``, ``get_finished``, ``get_block_ids_with_load_errors``,
``build_connector_worker_meta``):

- the preemption fence (:meth:`Mover.fence`, from ``handle_preemptions``, before the
  forward): wait until the listed copies finished, so none reads a block after this
  step reuses it;
- storage writes and loads start at ``start_load_kv``: a write reads host pages only;
  a load reads the store into host pages, then copies them into the request's blocks
  (one fused job: no scheduler round trip between the read and the copy; a
  synchronous one on a CPU reads what the file store's page cache holds straight into
  the blocks). Every write into the blocks is made inside the load's gate, closed
  before the load is reported: a read that outlives its wait writes only its host
  pages, which stay the load's until it ended (``RankReport.reading``). A
  synchronous load (:attr:`LoadJob.sync`) runs there, the calling thread waiting for
  it (on the file store its reads run on the load threads, at most ``io_timeout_s``):
  vLLM calls ``start_load_kv`` before the forward of a step with synchronous loads,
  and the forward computes on the loaded KV; its request is not reported in
  ``finished_recving``. An asynchronous one runs on the load thread (or inline with
  ``inline_loads``) and its request is reported once it ended. A cancelled load copies
  nothing that was not copied yet;
- copies of blocks start at ``wait_for_save`` (:meth:`Mover.save`), after the step's
  forward wrote them, never before (F19).

A load reports how many leading pages it loaded; the blocks of the others are
reported as load errors so vLLM recomputes them (F38): a missing page, a page whose
checksum does not match (the store reads it as missing), a store that fails or times
out. Never wrong KV.
"""

from __future__ import annotations

import asyncio
import threading
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from kvoffload.abc import Storage, Transfer, WriteChain, WriteJob
from kvoffload.core.events import logger
from kvoffload.errors import ConfigError, StorageError
from kvoffload.integrations.vllm_messages import LoadJob, RankReport, StepPlan
from kvoffload.pools import EnginePages, HostPool
from kvoffload.storage.gate import WriteGate
from kvoffload.storage.writer import ThreadWriter, WritePolicy, stored_prefix

if TYPE_CHECKING:
    import torch

    from kvoffload.abc import EventBackend

__all__ = [
    "BlockingReads",
    "Mover",
    "PrefixLookup",
    "block_tensors",
    "blocking_reads",
    "copy_h2d",
    "h2d_runs",
    "open_store",
    "rank_stores",
]

#: Fewest pages a synchronous load splits into two halves read and copied at once.
_SPLIT_MIN = 8

#: Most write chains (one per request being stored) a worker remembers.
_CHAINS = 4096


def block_tensors(kv: torch.Tensor, num_blocks: int, block_size: int, name: str = "kv") -> list[torch.Tensor]:
    """One layer's KV tensor as kvoffload engine-page tensors ``(num_blocks,
    block_size, -1)`` whose row ``b`` is all of block ``b``'s bytes.

    Accepted: a tensor whose first dimension is the blocks and whose blocks are each
    contiguous (vLLM's CPU attention, ``(num_blocks, kv_heads, block_size, 2 *
    head_size)``; a ``(num_blocks, block_size, ...)`` layout), or one whose first
    dimension holds K and V (``(2, num_blocks, ...)``, FlashAttention's): two tensors.
    Raises :class:`~kvoffload.ConfigError` for any other layout, naming it."""
    shape = tuple(kv.shape)
    if kv.dim() >= 2 and shape[0] == num_blocks and kv.is_contiguous():
        return [kv.view(num_blocks, block_size, -1)]
    if kv.dim() >= 3 and shape[0] == 2 and shape[1] == num_blocks and kv[0].is_contiguous():
        return [kv[0].view(num_blocks, block_size, -1), kv[1].view(num_blocks, block_size, -1)]
    raise ConfigError(
        f"KVOffloadConnector: layer {name} has a KV tensor of shape {shape} (strides {kv.stride()}); "
        f"supported: contiguous (num_blocks={num_blocks}, ...) or (2, num_blocks, ...) with contiguous blocks"
    )


def open_store(storage: Any) -> Storage:
    """The store ``storage`` names (a directory, a URL, ``"memory"``, or an instance),
    through kvoffload's opener; raises :class:`~kvoffload.ConfigError` for none."""
    from kvoffload.storage import resolve_storage

    store = resolve_storage(storage)
    if store is None:
        raise ConfigError("KVOffloadConnector needs a storage")
    return store


def rank_stores(store: Storage, size: int) -> list[Storage]:
    """The store as each of ``size`` tensor-parallel ranks sees it (``tp_keys="rank"``:
    its shard of a page under the page key suffixed ``_<rank>_<size>``, as the other
    stores do); the store itself with one rank."""
    from kvoffload.storage.rank_keys import RankKeys

    if size <= 1:
        return [store]
    return [RankKeys(store, r, size) for r in range(size)]


class BlockingReads:
    """A store's reads that block the calling thread (no event loop, no thread hop):
    ``count(keys)`` is its ``exists_prefix``, ``read(keys, parts)`` its
    ``get_into_parts``, with the same checks; ``cached(keys, parts, gate)`` reads only
    what the page cache holds, each page's write inside ``gate`` (the file store's
    ``blocking_get_into_parts(..., cached=True, gate=gate)``: the reads that may write
    an engine's blocks directly). Only for a caller on a thread of its own that bounds
    its own wait (:class:`PrefixLookup`, the :class:`Mover`'s load threads)."""

    __slots__ = ("cached", "count", "read")

    def __init__(
        self,
        count: Callable[[list[str]], int],
        read: Callable[[list[str], list[list[memoryview]]], int],
        cached: Callable[[list[str], list[list[memoryview]], WriteGate], int],
    ) -> None:
        self.count = count
        self.read = read
        self.cached = cached


def blocking_reads(store: Storage) -> BlockingReads | None:
    """The blocking reads of ``store`` (the file store's ``blocking_exists_prefix`` /
    ``blocking_get_into_parts``; through a rank's ``RankKeys`` view too, its keys
    suffixed), or ``None`` for a store without them (its async reads are used)."""
    from kvoffload.storage.rank_keys import RankKeys

    inner, suffix = (store.inner, store.suffix) if isinstance(store, RankKeys) else (store, "")
    count = getattr(inner, "blocking_exists_prefix", None)
    read = getattr(inner, "blocking_get_into_parts", None)
    if not (callable(count) and callable(read)):
        return None

    if not suffix:  # the store's own calls: no layer on the lookup's and the load's path
        return BlockingReads(
            count, read, lambda keys, parts, gate: int(read(keys, parts, cached=True, gate=gate))
        )

    def named(keys: list[str]) -> list[str]:
        return [k + suffix for k in keys]

    return BlockingReads(
        lambda keys: int(count(named(keys))),
        lambda keys, parts: int(read(named(keys), parts)),
        lambda keys, parts, gate: int(read(named(keys), parts, cached=True, gate=gate)),
    )


class PrefixLookup:
    """The scheduler's lookup: how many leading ``keys`` every rank's store has, waited
    for at most ``timeout_s`` (a store that fails or hangs is a miss to the caller: it
    raises, and :meth:`~kvoffload.integrations.vllm_plan.Planner.matched` counts 0).

    Where every store reads blocking (:func:`blocking_reads`: the file store), one hop
    onto a lookup thread of its own, which reads the page headers itself (rank after
    rank, each asked only the prefix the ones before had); else the stores'
    ``exists_prefix`` on ``io``'s event loop, all ranks at once (a hop to the loop, and
    the store's own to its I/O thread)."""

    def __init__(self, stores: Sequence[Storage], io: ThreadWriter, timeout_s: float) -> None:
        self.stores = list(stores)
        self.io = io
        self.timeout_s = timeout_s
        found = [blocking_reads(s) for s in self.stores]
        # _counts: every store's blocking count, or None (the async route).
        self._counts = [b.count for b in found if b is not None] if all(found) else None
        self._thread = (
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvoffload.vllm-lookup")
            if self._counts is not None
            else None
        )

    def __call__(self, keys: list[str]) -> int:
        if not keys:
            return 0
        if self._thread is not None and self._counts is not None:
            counts = self._counts

            def count() -> int:
                n = len(keys)
                for c in counts:
                    n = min(n, c(keys[:n]))
                    if n <= 0:
                        return 0
                return n

            return self._thread.submit(count).result(self.timeout_s)
        stores = self.stores

        async def gathered() -> int:
            return min(await asyncio.gather(*(s.exists_prefix(keys) for s in stores)))

        return self.io.call(gathered(), self.timeout_s)

    def close(self) -> None:
        """Stop the lookup thread (a lookup still running ends on its own)."""
        if self._thread is not None:
            self._thread.shutdown(wait=False)


def h2d_runs(device_pages: Sequence[int], host_pages: Sequence[int]) -> list[tuple[int, int, int]]:
    """The pairs ``(device_pages[i], host_pages[i])`` as runs ``(device start, host start,
    count)`` consecutive on both sides (by ascending host page): each run is one block
    copy. vLLM hands a request blocks in any order (a finished request's blocks go back
    to its free queue reversed) and the host pool's free pages come out descending; as
    runs of both, a load is a few block copies, never a gather and a scatter."""
    runs: list[list[int]] = []
    for h, d in sorted(zip(host_pages, device_pages, strict=True)):
        last = runs[-1] if runs else None
        if last is not None and last[1] + last[2] == h and last[0] + last[2] == d:
            last[2] += 1
        else:
            runs.append([d, h, 1])
    return [(d, h, n) for d, h, n in runs]


def copy_h2d(
    device: EnginePages, host: HostPool, device_pages: Sequence[int], host_pages: Sequence[int]
) -> None:
    """Copy host pages ``host_pages[i]`` into engine pages ``device_pages[i]`` (every
    tensor's slice; blocking, any thread): one block copy per run of pages consecutive
    on both sides (:func:`h2d_runs`). On a CPU the copies are numpy's (single-threaded,
    the GIL released): a torch copy there runs on torch's OpenMP intra-op threads (on
    the load thread a second team, which throttles the forward's: see
    :mod:`kvoffload.backends._threaded`), and on a busy machine a load of 49 pages of
    2 MB took 100-250 ms through them (a gather and a scatter: 300 ms) against 10-30 ms
    through numpy (``docs/integrations/vllm.md``, Performance)."""
    import torch

    if not device_pages:
        return
    runs = h2d_runs(device_pages, host_pages)
    pairs = device.copy_pairs(host)
    if device.device.type == "cpu":
        import numpy as np

        for dev, src in pairs:
            dn, hn = dev.numpy(), src.numpy()
            for d, h, n in runs:
                np.copyto(dn[d : d + n], hn[h : h + n])
        return
    for dev, src in pairs:
        for d, h, n in runs:
            dev[d : d + n].copy_(src[h : h + n], non_blocking=True)
    if device.device.type == "cuda":
        torch.cuda.current_stream(device.device).synchronize()


def _writable_pages(pool: HostPool, pages: Sequence[int]) -> list[memoryview]:
    """A writable byte view of each page of ``pool`` (a contiguous CPU tensor)."""
    raw: Any = pool.tensor.view(-1).view(__import__("torch").uint8).numpy()
    flat = memoryview(raw)
    size = flat.nbytes // pool.n_pages
    return [flat[p * size : (p + 1) * size] for p in pages]


class _Run:
    """One load on one rank while its ``Mover._load`` runs: ``gate`` guards the load's
    blocks (closed before the load is reported: nothing of it writes them after that,
    the engine may recompute or reuse them), ``reads`` the futures of its reads running
    elsewhere (a piece on a load thread, a store call on the writer's loop), each of
    which may write the load's host pages until it is done; ``pieces`` those of them
    that are pieces on a load thread (one still queued is cancelled at the end)."""

    __slots__ = ("gate", "pieces", "reads")

    def __init__(self) -> None:
        self.gate = WriteGate()
        self.reads: list[Future[Any]] = []
        self.pieces: list[Future[Any]] = []


class Mover:
    """One rank's movers (see the module doc). ``Mover(kv, block_size=, host_pages=,
    storage=)``: ``kv`` are the engine-page tensors of every layer (:func:`block_tensors`);
    ``storage`` the store, already seen through this rank's keys; the host pool is
    shared by stores and loads (the scheduler's core hands its pages out);
    ``io_timeout_s``: the most one store read or one fence waits."""

    def __init__(
        self,
        kv: Sequence[torch.Tensor],
        *,
        block_size: int,
        host_pages: int,
        storage: Storage | None,
        policy: WritePolicy | None = None,
        io_timeout_s: float = 30.0,
        backend: EventBackend | None = None,
        inline_loads: bool | None = None,
    ) -> None:
        from kvoffload.backends import resolve_backend

        self.block_size = block_size
        self.device = EnginePages(list(kv), block_size)
        nb = self.device.page_bytes
        # zeroed: its memory is touched once here, at start-up, not by the first load
        # (first-touch page faults of a fresh 100 MB read cost ~30 ms on the CPU build).
        self.host = HostPool.new(host_pages, (nb,), "uint8", zero=True)
        self.io_timeout_s = io_timeout_s
        if backend is None:
            # cpu for CPU KV; cuda on the GPU that holds the KV (not the current one).
            backend = resolve_backend("auto", self.device.device)
        self.backend = backend
        backend.open(self.device, self.host)
        self.storage = storage
        self.writer: ThreadWriter | None = None
        if storage is not None:
            self.writer = ThreadWriter(storage, self.host, policy or WritePolicy())
            self.writer.start()
        # _copies: backend transfer id -> the scheduler's copy id, while in flight here.
        self._copies: dict[int, int] = {}
        # _chains: lifecycle id -> its write chain (F33), the newest _CHAINS.
        self._chains: OrderedDict[int, WriteChain] = OrderedDict()
        self._report = RankReport()
        self._fenced: StepPlan | None = None
        self._started: StepPlan | None = None
        self._saved: StepPlan | None = None
        # Loads: the thread posts (job, pages, error) to _loaded under _lock;
        # _cancelled holds the ids whose copy must not start.
        self._lock = threading.Lock()
        self._load_done = threading.Condition(self._lock)
        self._loaded: deque[tuple[LoadJob, int, str | None]] = deque()
        self._cancelled: set[int] = set()
        # _runs: job id -> its _Run while its _load runs (its gate, its reads running).
        # _late: job id -> the reads of a load posted to _loaded while they still ran
        #   (this rank gave up waiting): each may write the load's host pages until it
        #   ended, so the scheduler keeps them (RankReport.reading) until every one did.
        #   Invariant: a job is in _late only from the moment its _loaded entry is
        #   posted (both under _lock) until poll() saw all its reads done.
        self._runs: dict[int, _Run] = {}
        self._late: dict[int, list[Future[Any]]] = {}
        self._loads_running: dict[int, LoadJob] = {}
        self._recving: set[str] = set()
        self._load_errors: set[int] = set()
        self._loader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvoffload.vllm-load")
        # _block_views: per engine tensor (a host page's order), a writable byte view of
        #   each block: a synchronous load on a CPU reads what the file store's page
        #   cache holds straight into them, inside the load's gate (a page that fails its
        #   check is in its block then: reported, vLLM recomputes it).
        self._block_views: list[Any] | None = None  # numpy (n_pages, page bytes) arrays
        if self.device.device.type == "cpu":
            import torch

            self._block_views = [
                t.view(self.device.n_pages, -1).view(torch.uint8).numpy() for t in self.device.tensors
            ]
        # _blocking: the store's blocking reads (the file store's), run on _halves' threads.
        self._blocking = blocking_reads(storage) if storage is not None else None
        # _halves: the threads a load's reads run on where the store reads blocking (both
        #   halves of a split synchronous load at once), or a split load's second half
        #   (made at the first use).
        self._halves: ThreadPoolExecutor | None = None
        # inline_loads: a plan's asynchronous loads too run in start() on the calling
        # (engine) thread, not on the load thread (None: where the KV is in host memory);
        # synchronous ones always do. The connector runs asynchronous ones on the thread
        # (kvoffload.integrations.vllm_settings.Settings.loads).
        self.inline_loads = self.device.device.type == "cpu" if inline_loads is None else inline_loads
        self._closed = False

    # --- a step's jobs ------------------------------------------------------------------

    def fence(self, plan: StepPlan) -> None:
        """Before the forward: wait (at most ``io_timeout_s``) until the copies
        ``plan.flush`` names finished here, so none reads a block this step reuses."""
        if self._fenced is plan:
            return
        self._fenced = plan
        wanted = {local for local, job in self._copies.items() if job in set(plan.flush)}
        if not wanted:
            return
        import time

        deadline = time.monotonic() + self.io_timeout_s
        while wanted:
            for local in self._take_copies():
                wanted.discard(local)
            if not wanted:
                return
            left = deadline - time.monotonic()
            if left <= 0 or not self.backend.wait_ready(left):
                logger.error("vllm.fence_timeout", copies=len(wanted), timeout_s=self.io_timeout_s)
                return

    def start(self, plan: StepPlan) -> None:
        """``start_load_kv``: the fence (when ``handle_preemptions`` did not run), the
        plan's storage writes, cancels and loads."""
        if self._started is plan:
            return
        self._started = plan
        self.fence(plan)
        if plan.cancels:
            with self._lock:
                self._cancelled.update(plan.cancels)
        if plan.writes:
            jobs = []
            for w in plan.writes:
                chain = self._chains.get(w.lifecycle_id)
                if chain is None:
                    chain = self._chains[w.lifecycle_id] = WriteChain()
                    while len(self._chains) > _CHAINS:
                        self._chains.popitem(last=False)
                else:
                    self._chains.move_to_end(w.lifecycle_id)
                jobs.append(
                    WriteJob(
                        w.id,
                        w.keys,
                        w.host_pages,
                        w.lifecycle_id,
                        None,
                        chain=chain,
                        first_token=w.first_token,
                    )
                )
            if self.writer is None:
                for w in plan.writes:
                    self._report.writes[w.id] = (1, 0, "no storage")
            else:
                self.writer.put(jobs)
        for job in plan.loads:
            self._loads_running[job.id] = job
            if job.sync or self.inline_loads:
                self._load(job)  # before the forward (sync); reported by this step's get_finished
            else:
                self._loader.submit(self._load, job)

    def save(self, plan: StepPlan, ready: Any = None) -> None:
        """``wait_for_save``: start the plan's copies of blocks (the forward wrote them);
        once per plan."""
        if not plan.copies or self._saved is plan:
            return
        self._saved = plan
        issuer = SimpleNamespace(id=0, rid=None, tag=None)
        for job in plan.copies:
            issuer.id = job.lifecycle_id
            n_tokens = len(job.device_pages) * self.block_size
            t = Transfer(
                issuer,
                job.device_pages,
                job.host_pages,
                job.keys,
                job.first_token,
                n_tokens,
                0.0,
                ready=ready,
            )
            try:
                self.backend.submit(t)
            except Exception as exc:  # refused: that copy fails, the others go on (F20)
                self._report.copies[job.id] = (1, repr(exc))
                continue
            self._copies[t.id] = job.id
        self.backend.launch()

    # --- loads (the load thread) -------------------------------------------------------

    def _load(self, job: LoadJob) -> None:
        run = self._runs[job.id] = _Run()
        pages, error = 0, None
        try:
            n = min(len(job.keys), len(job.host_pages))
            if n < len(job.keys):
                error = f"no host pages for {len(job.keys) - n} of {len(job.keys)} page(s)"
            if n and self.writer is not None and self.storage is not None:
                split = job.sync and n >= _SPLIT_MIN
                pages = self._read_copy_split(job, n) if split else self._read_copy_bounded(job, n)
        except Exception as exc:  # the store or the copy failed: nothing counts as loaded
            pages, error = 0, repr(exc)
        # From here nothing of this load writes its blocks (a read still running writes
        # its host pages only: reported in RankReport.reading until it ended).
        run.gate.close()
        for f in run.pieces:
            f.cancel()  # a piece queued behind a hung read never starts (never a store
            # call's future: cancelling it ends the task, not a thread the store runs)
        with self._lock:
            del self._runs[job.id]
            running = [f for f in run.reads if not f.done()]
            if running:
                self._late[job.id] = running
            self._loaded.append((job, pages, error))
            self._load_done.notify_all()

    def _half_threads(self) -> ThreadPoolExecutor:
        if self._halves is None:
            self._halves = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvoffload.vllm-load-half")
        return self._halves

    def _piece(self, job: LoadJob, start: int, stop: int) -> Future[int]:
        """:meth:`_read_copy` of ``start:stop`` on a load thread; its future is one of the
        load's reads (it may write the load's host pages until it ended)."""
        fut = self._half_threads().submit(self._read_copy, job, start, stop)
        run = self._runs[job.id]
        with self._lock:
            run.reads.append(fut)
            run.pieces.append(fut)
        return fut

    def _timed_out(self) -> StorageError:
        return StorageError(f"a load's read took longer than io_timeout_s={self.io_timeout_s}")

    def _read_copy_bounded(self, job: LoadJob, n: int) -> int:
        """:meth:`_read_copy` of all ``n`` pages, waited for at most ``io_timeout_s``: a
        blocking read on a load thread (one hop), an async one where it is (its call to
        the store's loop is bounded)."""
        if self._blocking is None:
            return self._read_copy(job, 0, n)
        try:
            return int(self._piece(job, 0, n).result(self.io_timeout_s))
        except TimeoutError:
            raise self._timed_out() from None

    def _read(self, run: _Run, keys: list[str], parts: list[list[memoryview]]) -> int:
        """Read ``keys`` into ``parts`` (host pages: memory the load holds until every
        read of it ended): blocking where the store reads blocking (the caller is a load
        thread, its wait bounded by whoever waits on it), else on the storage writer's
        loop, waited for at most ``io_timeout_s`` (a read that outlives the wait stays
        one of the load's reads)."""
        if self._blocking is not None:
            return int(self._blocking.read(keys, parts))
        assert self.writer is not None and self.storage is not None
        if all(len(p) == 1 for p in parts):  # host pages: the store's own get_into
            read = self.storage.get_into(keys, [p[0] for p in parts])
        else:
            read = self.storage.get_into_parts(keys, parts)
        fut = self.writer.submit(read)
        with self._lock:
            run.reads.append(fut)
        try:
            return int(fut.result(self.io_timeout_s))
        except TimeoutError:
            raise self._timed_out() from None

    def _read_copy(self, job: LoadJob, start: int, stop: int) -> int:
        """Read ``job``'s pages ``start:stop`` from the store into their host pages, then
        copy the leading ones read into their blocks (none once the load is cancelled,
        or given up: its gate closed). A synchronous load on a CPU first reads straight
        into its blocks what the page cache holds (the file store: no copy, never a
        wait on a disk, each page inside the gate), the rest through its host pages.
        Returns how many leading pages of the range were loaded."""
        assert self.writer is not None and self.storage is not None
        run = self._runs.get(job.id)
        if run is None or not run.gate.open:
            return 0  # given up before this piece started: it touches nothing
        keys = list(job.keys[start:stop])
        got = 0
        if job.sync and self._block_views is not None and self._blocking is not None:
            views = self._block_views
            blocks = job.device_pages[start:stop]
            got = self._blocking.cached(keys, [[memoryview(v[b]) for v in views] for b in blocks], run.gate)
            if got == len(keys):
                return got
        first = start + got
        host = job.host_pages[first:stop]
        dest = _writable_pages(self.host, host)
        more = self._read(run, keys[got:], [[d] for d in dest])
        del dest
        with self._lock:
            cancelled = job.id in self._cancelled
        if more and not cancelled:
            if not run.gate.enter():
                return got  # given up meanwhile: the blocks are the engine's again
            try:
                copy_h2d(self.device, self.host, job.device_pages[first : first + more], host[:more])
            finally:
                run.gate.leave()
        return got + more

    def _read_copy_split(self, job: LoadJob, n: int) -> int:
        """A synchronous load's read and copy in two halves at once: it runs before the
        forward, so the engine's cores are free (each half's read and copy release the
        GIL; the copy starts no OpenMP team). Where the store reads blocking (the file
        store), both halves run on the load threads and this thread waits for them, at
        most ``io_timeout_s`` (one hop each, no event loop); else the second half runs on
        a load thread and the first here, each bounded by its call to the store's loop.

        Returns the leading pages loaded; when the first half comes back short, what the
        second copied lies past them and is reported as load errors with them (vLLM
        recomputes those blocks). Both halves have ended when this returns, unless the
        wait timed out (``StorageError``: nothing counts as loaded; the load's gate
        closes before it is reported, so a read that hangs in the kernel and returns
        later writes only its host pages, which stay the load's until it ended)."""
        half = n // 2
        second = self._piece(job, half, n)
        if self._blocking is None:
            try:
                first = self._read_copy(job, 0, half)
            finally:
                # bounded: the half's store call is; a piece still queued is cancelled
                _, pending = wait((second,), timeout=self.io_timeout_s)
            if pending:
                raise self._timed_out()
            got = second.result() if second.exception() is None else 0
            return first if first < half else half + got
        first_f = self._piece(job, 0, half)
        _, pending = wait((first_f, second), timeout=self.io_timeout_s)
        if pending:
            raise self._timed_out()
        first = first_f.result()  # raises what the half raised: nothing counts as loaded
        got = second.result() if first >= half and second.exception() is None else 0
        return first if first < half else half + got

    # --- what this rank reports -------------------------------------------------------------

    def _take_copies(self) -> list[int]:
        """Take the backend's completions into the report; returns their local ids."""
        out: list[int] = []
        for local, err in self.backend.take_completions():
            job = self._copies.pop(local, None)
            if job is None:
                continue
            self._report.copies[job] = (1, None if err is None else repr(err))
            out.append(local)
        return out

    def poll(self) -> None:
        """Collect what finished since the last call: copies, writes, loads."""
        self._take_copies()
        if self.writer is not None:
            for result in self.writer.take_results():  # per page (F34): the prefix stored
                wjob, err = result[0], result[3]
                self._report.writes[wjob.id] = (1, stored_prefix(result), None if err is None else repr(err))
        with self._lock:
            loaded = list(self._loaded)
            self._loaded.clear()
            for job, _, _ in loaded:
                self._cancelled.discard(job.id)
            late = {job.id for job, _, _ in loaded if job.id in self._late}
            ended = [jid for jid, reads in self._late.items() if all(f.done() for f in reads)]
            for jid in ended:
                del self._late[jid]
        reading = self._report.reading
        for job, pages, error in loaded:
            self._loads_running.pop(job.id, None)
            self._report.loads[job.id] = (1, pages, error)
            if job.id in late:  # reported while a read of it runs: its host pages stay held
                reading[job.id] = reading.get(job.id, 0) + 1
            if not job.sync:  # vLLM waits for an async load's request in finished_recving
                self._recving.add(job.req_id)
            self._load_errors.update(job.device_pages[pages:])
        for jid in ended:  # every read of it ended: its host pages are the scheduler's again
            left = reading.get(jid, 0) - 1
            if left:
                reading[jid] = left
            else:
                reading.pop(jid, None)

    def finished(self, plan: StepPlan | None) -> tuple[set[str], set[str]]:
        """``get_finished``: (requests released by this plan: every copy of theirs is
        delivered; requests whose load finished here, failed or cancelled ones too)."""
        self.poll()
        sending = set(plan.release) if plan is not None else set()
        recving, self._recving = self._recving, set()
        return sending, recving

    def take_load_errors(self) -> set[int]:
        """``get_block_ids_with_load_errors``: blocks of loads finished since the last
        call that hold no loaded page (reported no later than their request's
        ``finished_recving``)."""
        out, self._load_errors = self._load_errors, set()
        return out

    def take_report(self) -> RankReport | None:
        """``build_connector_worker_meta``: the jobs finished since the last report."""
        self.poll()
        if not self._report:
            return None
        out, self._report = self._report, RankReport()
        return out

    @property
    def idle(self) -> bool:
        """Whether nothing handed to this rank is still running or unreported."""
        writer = self.writer
        return not (
            self._copies
            or self._loads_running
            or self._late
            or self._report
            or self._recving
            or (writer is not None and (writer.pending or writer.has_results))
        )

    def wait_progress(self, timeout: float) -> bool:
        """Block until a copy, write or load finished here (not yet collected), or
        ``timeout`` seconds passed, or nothing is running; returns whether one did."""
        import time

        deadline = time.monotonic() + timeout
        writer = self.writer
        while True:
            if self.backend.ready or (writer is not None and writer.has_results) or self._loaded:
                return True
            if self._late and any(all(f.done() for f in reads) for reads in list(self._late.values())):
                return True  # a given-up load's reads ended: its host pages go back
            if not (
                self._copies or self._loads_running or self._late or (writer is not None and writer.pending)
            ):
                return False
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            if self._copies:
                self.backend.wait_ready(min(left, 0.01))
            elif writer is not None and writer.pending:
                writer.wait_progress(min(left, 0.01))
            else:
                with self._load_done:
                    if not self._loaded:
                        self._load_done.wait(min(left, 0.01) if self._late else left)

    def close(self, timeout: float | None = 30.0) -> None:
        """Finish what was handed over (copies, loads, writes), then stop the threads."""
        if self._closed:
            return
        self._closed = True
        self.backend.close()
        if not self.backend.join(timeout):
            logger.error("vllm.close_timeout", what="copies", timeout_s=timeout)
        self._loader.shutdown(wait=True)
        if self._halves is not None:
            # a given-up read may never return: not waited for (it writes host pages only)
            with self._lock:
                stuck = [jid for jid, reads in self._late.items() if not all(f.done() for f in reads)]
            if stuck:
                logger.error("vllm.close_reads_running", loads=len(stuck))
            self._halves.shutdown(wait=not stuck, cancel_futures=bool(stuck))
        if self.writer is not None:
            self.writer.stop()
            self.writer.join(timeout)
