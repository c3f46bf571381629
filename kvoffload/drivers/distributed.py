"""Tensor parallelism: the ranks of a ``torch.distributed`` group agree, inside every
collective call of :class:`~kvoffload.SyncOffloadManager`, on what to deliver (F25).

Where it runs: on each rank's owner thread, inside ``poll()``, ``quiesce()``,
``wait_released()``, ``close()``, ``lookup()`` and ``fetch()``. Every rank runs the same
scheduler, so every rank's core gets the same calls and makes the same transfers in
the same order (``Transfer.seq``). What differs per rank is when, and whether, its copy
of its shard finishes, and when its storage write does. A rank therefore holds its
own completions back, and each collective call is ONE all-reduce (MIN) of a fixed
vector of ``2 * tp_window + HEADER`` int64:

- the header: the call's kind, the next ``seq``, transfers in flight, storage writes
  pending, lifecycles admitted - each sent as ``x`` and ``-x``, so the one MIN yields
  their min and max, equal on replicas (else :class:`~kvoffload.RanksDiverged` on
  every rank) -; the delivery limit (MIN of ``max_completions``); the elapsed time
  (MIN: the agreed clock); "my deadline passed" (sent negated: MAX); a payload (pages
  found by ``lookup``/``fetch``: MIN);
- ``copies``: slot ``i`` is the ``i``-th oldest transfer in flight (by ``seq``): 0 not
  finished here, 1 failed here, 2 copied here;
- ``writes``: slot ``i`` is the ``i``-th oldest storage write: 0 not finished here,
  1 failed here, 2 stored here.

After the MIN, a slot above 0 has finished on every rank: 1 if any rank failed it (the
chunk fails on every rank, with the same outcome), 2 if every rank succeeded. Every
rank delivers exactly those, in ``seq`` order (at most the agreed limit of copies),
so every rank releases the same lifecycles in the same call, and none before every
rank's copy of it has finished.

Why this is enough: what the ranks agree on - the transfers in flight, the writes
pending - is the same on every rank after each agreed step, so slot ``i`` names the
same transfer everywhere (the header checks it). The oldest transfer in flight is
always slot 0: once every rank's copy of it has finished, the next poll delivers it,
so the window always moves on, and the message never grows with load (no
per-transfer messages). Host pages come back only at agreed points (an agreed
delivery or write), and time-based decisions (deferral expiry, the watchdog) read
the agreed clock, so every rank's drops and deferrals - and so its next transfers -
stay the same.
"""

from __future__ import annotations

import datetime
import itertools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

from kvoffload.abc import Completion, EventBackend, Storage, Transfer, WriteJob
from kvoffload.config import OffloadConfig
from kvoffload.errors import (
    BackendError,
    ConfigError,
    KVOffloadError,
    RanksDiverged,
    RankTimeout,
    StorageError,
)

if TYPE_CHECKING:
    from kvoffload.core.offload import OffloadCore
    from kvoffload.storage.writer import WriteResult

__all__ = ["HEADER", "RankAgreement", "check_group", "join_group"]

# The kinds of collective call (the header's first field: ranks must be in the same one).
POLL, QUIESCE, WAIT, CLOSE, LOOKUP, FETCH = 1, 2, 3, 4, 5, 6
KIND_NAMES = {POLL: "poll", QUIESCE: "quiesce", WAIT: "wait_released", CLOSE: "close", LOOKUP: "lookup"}
KIND_NAMES[FETCH] = "fetch"
_DELIVERS = (POLL, QUIESCE, WAIT, CLOSE)

# Header slots. A pair (x, -x) gives min and max from the one MIN.
_KIND, _SEQ, _INFLIGHT, _WRITES, _ADMITTED = 0, 2, 4, 6, 8  # pairs
_LIMIT, _ELAPSED, _LATE, _PAYLOAD = 10, 11, 12, 13
#: int64 slots before the copy window.
HEADER = 14
_CHECKED = (
    (_SEQ, "transfers submitted"),
    (_INFLIGHT, "transfers in flight"),
    (_WRITES, "storage writes pending"),
    (_ADMITTED, "lifecycles admitted"),
)
#: Slot codes: not finished here / failed here / done here.
_WAITING, _FAILED, _DONE = 0, 1, 2
_NO_LIMIT = 1 << 62


class Agreed(NamedTuple):
    """What one collective call agreed: the copies and writes to deliver (every rank
    the same ones, in ``seq`` order), whether a deadline passed on any rank, and the
    payload's minimum over the ranks."""

    copies: list[Completion]
    writes: list[WriteResult]
    late: bool
    payload: int


def check_group(group: Any, config: OffloadConfig) -> tuple[int, int]:
    """``(rank, size)`` of ``group``, or :class:`~kvoffload.ConfigError` naming what is
    wrong: not a process group (or this process is not a member of it), a group whose
    collectives do not take CPU tensors (NCCL), a size other than ``config.tp_size``."""
    import torch.distributed as dist

    if isinstance(group, int) and group == getattr(dist.GroupMember, "NON_GROUP_MEMBER", None):
        raise ConfigError(
            "group is GroupMember.NON_GROUP_MEMBER: this process is not a member of the group "
            "(dist.new_group(ranks=...) returns it on the ranks left out); pass the group this rank is in"
        )
    if not isinstance(group, (dist.ProcessGroup, dist.ProcessGroupGloo)):
        raise ConfigError(
            f"group must be a torch.distributed ProcessGroup (e.g. dist.new_group(backend='gloo'), "
            f"SGLang's tp_cpu_group), got {type(group).__name__}: {group!r}"
        )
    name = str(group.name())
    if "gloo" not in name and "mpi" not in name:
        raise ConfigError(
            f"group's backend is {name!r}: the agreement is an all-reduce of a small CPU tensor, so it "
            "needs a gloo group (dist.new_group(backend='gloo'); SGLang passes its tp_cpu_group)"
        )
    rank, size = int(group.rank()), int(group.size())
    if not 0 <= rank < size:
        raise ConfigError(f"group says this process is rank {rank} of {size}: not a member of it")
    if config.tp_size is not None and size != config.tp_size:
        raise ConfigError(
            f"group has {size} rank(s) but config.tp_size is {config.tp_size}: pass the engine's "
            "tensor-parallel group, or fix tp_size"
        )
    return rank, size


def join_group(
    group: Any, config: OffloadConfig, clock: Callable[[], float], cls: type[RankAgreement] | None = None
) -> RankAgreement | None:
    """This rank's agreement with the others in ``group``, or ``None`` without a group.
    Raises :class:`~kvoffload.ConfigError` for a bad group (:func:`check_group`), and
    for no group when ``config.tp_size`` is above 1 (every rank would deliver alone)."""
    if not isinstance(config, OffloadConfig):
        raise KVOffloadError(f"config must be an OffloadConfig, got {type(config).__name__}")
    if group is not None:
        return (cls or RankAgreement)(group, config, clock)
    if config.tp_size is not None and config.tp_size > 1:
        raise ConfigError(
            f"config.tp_size is {config.tp_size} but no group was given: pass the tensor-parallel "
            "process group (group=...), or every rank would deliver on its own"
        )
    return None


class RankAgreement:
    """One rank's side of the agreement (see the module doc): the completions and
    storage writes this rank finished and the others may not have, and the one
    collective that decides which of them every rank delivers.

    Owned by a :class:`~kvoffload.SyncOffloadManager` with ``group=``; called on its
    owner thread only. ``clock`` is the agreed clock the manager's core runs on.
    """

    def __init__(self, group: Any, config: OffloadConfig, clock: Callable[[], float]) -> None:
        import torch
        import torch.distributed as dist

        self.rank, self.size = check_group(group, config)
        self.group = group
        self.window = config.tp_window
        self.timeout_s = config.tp_timeout_s
        self.per_rank_keys = config.tp_keys == "rank"
        # copies_here: whether this rank copies and writes ("shared" keys: rank 0 only).
        self.copies_here = self.per_rank_keys or self.rank == 0
        self._buf = torch.zeros(HEADER + 2 * self.window, dtype=torch.int64)
        self._a = self._buf.numpy()  # the same memory: filled and read without torch ops
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MIN  # type: ignore[assignment]  # torch's stubs: RedOpType
        opts.timeout = datetime.timedelta(seconds=self.timeout_s)
        self._opts = opts
        self._local_clock = clock
        self._origin = clock()
        # now: the agreed clock, seconds: the MIN over ranks of their time since they
        # were built, as of the last collective. Never goes back.
        self.now = 0.0
        # copies: this rank's finished copies (and refusals) not yet agreed, by seq.
        # Invariant: all(seq in (t.seq for t in core.inflight.values()) for seq in self.copies)
        self.copies: dict[int, Completion] = {}
        # writes: this rank's finished storage writes not yet agreed, by job id.
        # Invariant: set(self.writes) <= set(core.writes)
        self.writes: dict[int, WriteResult] = {}
        # failed: the error that broke the group (a timeout, a dead peer, diverged
        # ranks); every collective after it raises at once, and close() runs alone.
        self.failed: KVOffloadError | None = None

    def clock(self) -> float:
        """The agreed clock (the core's and the timers' clock under a group)."""
        return self.now

    def key_space(self, storage: Storage | None) -> Storage | None:
        """``storage`` as this rank reads and writes it: under ``tp_keys="rank"`` each
        key suffixed with the rank (:class:`RankKeys`); under ``"shared"`` as it is."""
        if storage is None or not self.per_rank_keys:
            return storage
        from kvoffload.storage.rank_keys import RankKeys

        return RankKeys(storage, self.rank, self.size)

    # --- what this rank finished ---------------------------------------------------------

    def accept(self, t: Transfer, backend: EventBackend) -> None:
        """The core's sink under a group: hand ``t`` to ``backend``. Never raises: a
        refusal on this rank is held as a failure of that chunk, which then fails on
        every rank (a refusal that raised would leave this rank's core one transfer
        short of the others'). A rank that copies nothing ("shared" keys, rank > 0)
        holds ``t`` as done at once."""
        if not self.copies_here:
            self.copies[t.seq] = (t, None)
            return
        try:
            backend.submit(t)
        except Exception as exc:
            self.copies[t.seq] = (t, exc)

    def hold_copies(self, batch: list[Completion]) -> None:
        """Completions this rank's backend signalled: held until every rank has them."""
        copies = self.copies
        for c in batch:
            copies[c[0].seq] = c

    def hold_writes(self, results: list[WriteResult]) -> None:
        """Storage writes this rank finished: held until every rank finished them."""
        writes = self.writes
        for r in results:
            writes[r[0].id] = r

    def skip_writes(self, jobs: list[WriteJob]) -> None:
        """A rank that stores nothing ("shared" keys, rank > 0): its part of each write
        is done at once and takes the writer's outcome (MIN: the writer's code wins)."""
        for job in jobs:
            self.writes[job.id] = (job, True, 1, None)

    # --- the collective --------------------------------------------------------------------

    def exchange(
        self,
        kind: int,
        core: OffloadCore,
        *,
        limit: int | None = None,
        late: bool = False,
        payload: int = 0,
    ) -> Agreed:
        """One collective call: send this rank's state, return what every rank agreed.

        Raises :class:`~kvoffload.RankTimeout` (the all-reduce did not complete within
        ``tp_timeout_s``, or a peer is gone) or :class:`~kvoffload.RanksDiverged` (the
        ranks' calls differ), with nothing delivered; after either, every call raises at
        once except ``close`` (kind CLOSE), which then agrees with this rank alone.
        """
        solo = self.size == 1
        if self.failed is not None:
            if kind != CLOSE:
                raise type(self.failed)(f"{self.failed} [an earlier collective failed; close() the manager]")
            solo = True
        a = self._a
        n = self.window
        delivers = kind in _DELIVERS
        window = list(itertools.islice(core.inflight.values(), n)) if delivers else []
        jobs = list(itertools.islice(core.writes.values(), n)) if delivers else []
        a[_KIND], a[_KIND + 1] = kind, -kind
        seq, inflight, writes = core.next_seq, len(core.inflight), len(core.writes)
        a[_SEQ], a[_SEQ + 1], a[_INFLIGHT], a[_INFLIGHT + 1] = seq, -seq, inflight, -inflight
        admitted = core.counters.admitted
        a[_WRITES], a[_WRITES + 1], a[_ADMITTED], a[_ADMITTED + 1] = writes, -writes, admitted, -admitted
        a[_LIMIT] = _NO_LIMIT if limit is None else min(limit, _NO_LIMIT)
        a[_ELAPSED] = max(0, int((self._local_clock() - self._origin) * 1e6))
        a[_LATE] = -int(late)
        a[_PAYLOAD] = payload
        a[HEADER:] = _WAITING
        if self.copies:
            held = self.copies
            for i, t in enumerate(window):
                c = held.get(t.seq)
                if c is not None:
                    a[HEADER + i] = _DONE if c[1] is None else _FAILED
        if self.writes:
            done = self.writes
            for i, job in enumerate(jobs, HEADER + n):
                r = done.get(job.id)
                if r is not None:
                    a[i] = _DONE if r[1] else _FAILED
        if not solo:
            self._all_reduce(kind)
            self._check_replicas(kind)
        self.now = max(self.now, int(a[_ELAPSED]) / 1e6)
        agreed = Agreed([], [], bool(a[_LATE]), int(a[_PAYLOAD]))
        if delivers:
            self._take_agreed(window, jobs, int(a[_LIMIT]), agreed)
        return agreed

    def agree_count(self, kind: int, core: OffloadCore, read: Callable[[], int]) -> int:
        """``read()`` this rank's count (pages found by a lookup or fetch), then agree on
        the smallest over the ranks (one collective). A rank whose read raised sends -1:
        every rank raises (that rank its own error, the others a
        :class:`~kvoffload.StorageError`), so the collectives stay paired."""
        error: Exception | None = None
        try:
            mine = read()
        except Exception as exc:
            error, mine = exc, -1
        agreed = self.exchange(kind, core, payload=mine).payload
        if error is not None:
            raise error
        if agreed < 0:
            raise StorageError(f"{KIND_NAMES[kind]}() failed on another rank (see its error)")
        return agreed

    def _take_agreed(self, window: list[Transfer], jobs: list[WriteJob], limit: int, out: Agreed) -> None:
        import numpy as np

        a = self._a
        base = HEADER
        codes = a[base : base + len(window)]
        for i in np.flatnonzero(codes)[:limit].tolist():  # seq order
            t, error = self.copies.pop(window[i].seq)  # held here: the MIN is above 0
            if codes[i] == _FAILED and error is None:
                error = BackendError(
                    f"the copy of {t!r} (seq {t.seq}) failed on another rank: under tensor parallelism "
                    "a chunk that fails on one rank fails on every rank"
                )
            out.copies.append((t, error))
        base += self.window
        codes = a[base : base + len(jobs)]
        for i in np.flatnonzero(codes).tolist():
            job, stored, attempts, error = self.writes.pop(jobs[i].id)
            if codes[i] == _FAILED and stored:
                stored = False
                error = StorageError(f"the storage write of {job!r} failed on another rank")
            out.writes.append((job, stored, attempts, error))

    def _all_reduce(self, kind: int) -> None:
        try:
            self.group.allreduce([self._buf], self._opts).wait()
        except Exception as exc:  # gloo: a timeout, or a peer's connection closed
            raise self._fail(
                RankTimeout(
                    f"rank {self.rank} of {self.size}: {KIND_NAMES[kind]}() did not agree with the other "
                    f"ranks within tp_timeout_s={self.timeout_s}s - a rank died or stopped calling the "
                    f"manager's collectives ({type(exc).__name__}: {exc}); nothing was delivered and no "
                    "page was freed"
                )
            ) from exc

    def _check_replicas(self, kind: int) -> None:
        a = self._a
        problems = []
        lo, hi = int(a[_KIND]), -int(a[_KIND + 1])
        if lo != hi:
            problems.append(
                f"the ranks called different collectives ({KIND_NAMES[lo]}() and {KIND_NAMES[hi]}())"
            )
        for i, what in _CHECKED:
            lo, hi = int(a[i]), -int(a[i + 1])
            if lo != hi:
                problems.append(f"{what} differ across ranks ({lo} to {hi})")
        if problems:
            raise self._fail(
                RanksDiverged(
                    f"rank {self.rank} of {self.size}, in {KIND_NAMES[kind]}(): " + "; ".join(problems) + ": "
                    "every rank must make the same calls in the same order (admit, extend, finish, abort, "
                    "then poll once per step); nothing was delivered"
                )
            )

    def _fail(self, error: KVOffloadError) -> KVOffloadError:
        self.failed = error
        return error
