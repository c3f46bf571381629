"""Tensor parallelism: the ranks of a ``torch.distributed`` group agree, inside every
collective call of :class:`~kvoffload.SyncOffloadManager`, on what to deliver (F25).

Where it runs: on each rank's owner thread, inside ``poll()``, ``quiesce()``,
``wait_released()``, ``close()``, ``lookup()`` and ``fetch()``. Every rank runs the same
scheduler, so every rank's core gets the same calls and makes the same transfers in
the same order (``Transfer.seq``). What differs per rank is when, and whether, its copy
of its shard finishes, and when its storage write does. A rank therefore holds its
own completions back, and each collective call agrees through an all-reduce (MIN) of
a fixed vector of ``2 * tp_window + HEADER`` int64 (most polls through a 2-int64 one
instead: "The compact exchange" below):

- the header: the call's kind and number (skipped polls counted), the next ``seq``,
  transfers in flight, storage writes pending, lifecycles admitted - each sent as
  ``x`` and ``-x``, so the one MIN yields their min and max, equal on replicas (else
  :class:`~kvoffload.RanksDiverged` on every rank) -; the delivery limit (MIN of
  ``max_completions``); the elapsed time (MIN: the agreed clock); "my deadline
  passed" (sent negated: MAX); a payload (pages found by ``lookup``/``fetch``: MIN);
- ``copies``: slot ``i`` is the ``i``-th oldest transfer in flight (by ``seq``): 0 not
  finished here, 1 failed here, 2 copied here;
- ``writes``: slot ``i`` is the ``i``-th oldest storage write: 0 not finished here,
  1 failed here, 2 stored here.

After the MIN, a slot above 0 has finished on every rank: 1 if any rank failed it (the
chunk fails on every rank, with the same outcome), 2 if every rank succeeded. Every
rank delivers exactly those, in ``seq`` order (at most the agreed limit of copies),
so every rank releases the same lifecycles in the same call, and none before every
rank's copy of it has finished.

Before any of it, when the managers are built, the ranks compare the settings that
decide their transfers and the size of that vector (:data:`SHARED_SETTINGS`): one
all-gather of a fixed-size digest, so ranks of other settings (another ``tp_window``:
another buffer size, which gloo answers by aborting the process) get a
:class:`~kvoffload.ConfigError` on every rank naming each field and every rank's value.
A rank that copies nothing (``tp_keys="shared"``, rank above 0) keeps the host pool's
page accounting but allocates none of its memory.

Why this is enough: what the ranks agree on - the transfers in flight, the writes
pending - is the same on every rank after each agreed step, so slot ``i`` names the
same transfer everywhere (the header checks it). The oldest transfer in flight is
always slot 0: once every rank's copy of it has finished, the next poll delivers it,
so the window always moves on, and the message never grows with load (no
per-transfer messages). Host pages come back only at agreed points (an agreed
delivery or write), and time-based decisions (deferral expiry, the watchdog) read
the agreed clock, so every rank's drops and deferrals - and so its next transfers -
stay the same.

The compact exchange. gloo's ring all-reduce costs by the vector's length up to the
group's size (on a 2-core VM at 4 ranks: 2 entries about 0.7 ms, the full vector 4-6
ms), so every collective call starts with an all-reduce (MIN) of 2 int64 - as
SGLang's check of its two ack-queue lengths - and goes on to the full vector above
only when that one says so. Each word is a 16-bit digest of the call (kind, number)
and of the replicated header state (the second word's negated) above 47 bits of
fields; after the MIN the two digests agree iff every rank sent the same one, and
then the fields below are decided by the MIN as a number (a MIN of words with equal
high bits is decided by the low bits). The fields, highest first: in the first word
"I need the full exchange" (a bit sent clear), then the leading copies of the window
this rank finished all copied (at most its ``max_completions``): the true minimum
over the ranks once no rank needs the full exchange; in the second word the leading
storage writes it stored in full (the true minimum), then its clock (ms): the
smallest among the ranks with that fewest writes - one rank's clock, the same on
every rank, which is all the agreed clock must be (it never goes back: the largest
seen so far).
A rank needs the full exchange when it holds a failed copy or write, a partial write,
or one finished out of order (beyond that leading run), in calls other than
``poll``, when its clock passed the field's range, and in each call whose number is a
multiple of :data:`FULL_EVERY` (unless that call is a poll that skips). When the
digests agree and no rank needs it, every rank delivers the leading
copies and writes every rank finished - exactly the set the full exchange would
deliver, since no rank finished any other - and the full exchange does not run; else
every rank runs it (each reads the same MIN), with its exact replica check. Both
vectors always pair: every call starts with the 2-word one, and whether the full one
follows is read from it. A digest collision lets differing ranks through one compact
exchange (a chance of 2**-16 per call, only for ranks whose calls already differ);
the full exchange every :data:`FULL_EVERY` calls still raises RanksDiverged.

Polls that skip. A :meth:`RankAgreement.exchange` of kind ``poll`` skips the
all-reduce, on every rank alike, when all of these hold:

- nothing is in flight, no storage write is pending and no chunk is deferred (the
  core's ``inflight``, ``writes`` and ``deferred``: replicated state, the same on every
  rank after the same calls - the header checks the first two at every collective);
- nothing was submitted or admitted since the last collective (``next_seq`` and the
  lifecycles admitted equal what the last collective agreed on, so the first poll
  after any new transfer or admission runs the collective and its replica check);
- fewer than :data:`IDLE_SKIPS` polls in a row skipped (then one runs).

Why it is safe (F25): the decision reads only state every rank shares and this
rank's record of those same decisions - never whether a copy or a write finished
here, which differs per rank - so ranks that make the same calls skip the same polls.
A poll that skips has nothing to deliver on any rank (nothing is in flight or
pending anywhere), so every completion is delivered at the same poll as without the
skip. What a skipped poll does not move is the agreed clock: it stays as the last
collective left it, for at most :data:`IDLE_SKIPS` polls and only while nothing is in
flight, pending or deferred (nothing then reads it but the timestamps of calls made
meanwhile, which are the same on every rank). Ranks whose calls differ (a caller's
bug) may decide differently: every collective's header carries the call's number
(skipped polls counted), so the next collective of the rank that skipped pairs with
the other's earlier one, their numbers differ, and every rank raises
:class:`~kvoffload.RanksDiverged` - at most :data:`IDLE_SKIPS` polls later, never a
hang (a rank that stops calling is a :class:`~kvoffload.RankTimeout`, as before).
"""

from __future__ import annotations

import datetime
import hashlib
import itertools
import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

from kvoffload.abc import Completion, EventBackend, Storage, Transfer, WriteJob
from kvoffload.config import OffloadConfig
from kvoffload.core.events import logger
from kvoffload.errors import (
    BackendError,
    ConfigError,
    KVOffloadError,
    PartialWriteError,
    RanksDiverged,
    RankTimeout,
    StorageError,
)
from kvoffload.storage.writer import stored_prefix

if TYPE_CHECKING:
    from kvoffload.core.offload import OffloadCore
    from kvoffload.storage.writer import WriteResult

__all__ = [
    "HEADER",
    "IDLE_SKIPS",
    "SHARED_SETTINGS",
    "RankAgreement",
    "agree_settings",
    "check_group",
    "join_group",
    "settings_digest",
]

# The kinds of collective call (the header's first field: ranks must be in the same one).
POLL, QUIESCE, WAIT, CLOSE, LOOKUP, FETCH = 1, 2, 3, 4, 5, 6
KIND_NAMES = {
    POLL: "poll",
    QUIESCE: "quiesce",
    WAIT: "wait_released",
    CLOSE: "close",
    LOOKUP: "lookup",
    FETCH: "fetch",
}
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
#: Copy slot codes: not finished here / failed here / done here. (A write's slot is
#: 0 until finished here, then 1 + its pages stored here: :func:`_write_code`.)
_WAITING, _FAILED, _DONE = 0, 1, 2
_NO_LIMIT = 1 << 62
#: Bits of the header's kind slot that hold the kind; the rest hold the call's number.
_KIND_BITS = 3
#: The compact exchange's layout (module doc): each of its 2 int64 is a 16-bit digest
#: of the call and the replicated state (the second negated) above 47 bits of fields.
_C_LOW = 47
_C_MASK = (1 << _C_LOW) - 1
_C_HASH = (1 << 16) - 1
_C_OK = 1 << 46  # first word: set unless this rank needs the full exchange
_C_COPIES = 33  # first word: the copies every rank may deliver, 13 bits
_C_WRITES = 34  # second word: the writes every rank stored, 13 bits, above the clock
_C_COUNT = (1 << 13) - 1
_C_CLOCK = (1 << 34) - 1  # second word: the clock, ms (past it: the full exchange)
#: A call whose number is a multiple of this runs the full exchange (its exact replica
#: check) whatever the compact one found (unless it is a poll that skips).
FULL_EVERY = 64
#: Polls in a row that may skip the collective when there is nothing to agree on (see
#: "Polls that skip" in the module doc); the next one runs it.
IDLE_SKIPS = 8


def _failed_elsewhere(t: Transfer) -> BackendError:
    return BackendError(
        f"the copy of {t!r} (seq {t.seq}) failed on another rank: under tensor parallelism a chunk "
        "that fails on one rank fails on every rank"
    )


def _write_code(held: WriteResult | None) -> int:
    """A write's slot: ``_WAITING`` until this rank finished it, then 1 + the pages this
    rank's store confirmed from the job's first page on (F34), so the MIN over the
    ranks is 1 + the prefix every rank stored."""
    return _WAITING if held is None else 1 + stored_prefix(held)


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


#: The settings every rank's manager must share, and why: they decide which transfers
#: the core makes, which host pages it takes, when a deferred chunk expires, and the
#: keys pages are stored and read under - or (tp_window) the size of every collective,
#: which gloo cannot survive differing. A rank's own sizes (kv_shape, dtype, the drain
#: and TP timeouts) may differ.
SHARED_SETTINGS = (
    "page_size",
    "stride",
    "device_pages",
    "host_pages",
    "offload_prompt",
    "on_host_full",
    "host_wait_s",
    "host_wait_polls",
    "stuck_after_s",
    "watchdog_interval_s",
    "namespace",
    "tp_keys",
    "tp_window",
)
#: The agreement's version: 2 numbers the calls in the header and lets idle polls skip.
_PROTOCOL = 2
#: int64 slots of the settings digest: fixed, whatever the settings, so that ranks of
#: other kvoffload versions still exchange buffers of one size (slot 0: the protocol).
_DIGEST_SLOTS = 32
#: Bytes per rank of the second exchange (only when settings differ): their values.
_VALUES_BYTES = 4096


def _digest(value: object) -> int:
    return int.from_bytes(hashlib.sha256(repr(value).encode()).digest()[:8], "little", signed=True)


def settings_digest(config: OffloadConfig) -> list[int]:
    """What ranks compare at construction: the protocol (the header's size and the
    settings' names), then a digest of each of :data:`SHARED_SETTINGS`."""
    head = _digest((HEADER, SHARED_SETTINGS, _PROTOCOL))
    return [head, *(_digest(getattr(config, name)) for name in SHARED_SETTINGS)]


def agree_settings(group: Any, config: OffloadConfig, rank: int, size: int) -> None:
    """Compare this rank's :data:`SHARED_SETTINGS` with every other rank's (one
    all-gather of a fixed-size digest, so it is safe whatever they are), before any
    collective whose size or meaning depends on them. Raises
    :class:`~kvoffload.ConfigError` on every rank, naming each field that differs and
    every rank's value (a second fixed-size all-gather, only then); a peer that never
    builds its manager: :class:`~kvoffload.RankTimeout` after ``tp_timeout_s``."""
    import torch

    mine = settings_digest(config)
    assert len(mine) <= _DIGEST_SLOTS
    buf = torch.zeros(_DIGEST_SLOTS, dtype=torch.int64)
    buf[: len(mine)] = torch.tensor(mine, dtype=torch.int64)
    rows = [r.tolist() for r in _all_gather(group, buf, size, config, rank)]
    if all(r == rows[0] for r in rows):
        return
    if any(r[0] != rows[0][0] for r in rows):  # another protocol: its values mean other things
        raise ConfigError(
            f"rank {rank} of {size}: the ranks run different kvoffload versions (their agreement "
            "protocols differ); install one version on every rank"
        )
    differ = [i for i, name in enumerate(SHARED_SETTINGS, 1) if len({r[i] for r in rows}) > 1]
    values = {SHARED_SETTINGS[i - 1]: repr(getattr(config, SHARED_SETTINGS[i - 1]))[:200] for i in differ}
    raw = json.dumps(values).encode()[:_VALUES_BYTES]
    vbuf = torch.zeros(_VALUES_BYTES, dtype=torch.uint8)
    vbuf[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    theirs = []
    for r in _all_gather(group, vbuf, size, config, rank):
        data = bytes(r.tolist()).rstrip(b"\0")
        try:
            theirs.append(json.loads(data))
        except ValueError:
            theirs.append({})
    parts = []
    for i in differ:
        name = SHARED_SETTINGS[i - 1]
        each = ", ".join(f"rank {k}: {v.get(name, '?')}" for k, v in enumerate(theirs))
        parts.append(f"{name} ({each})")
    raise ConfigError(
        f"rank {rank} of {size}: the ranks' OffloadConfig differ in {'; '.join(parts)}: every rank "
        "must build its manager with the same settings (they decide which copies each rank makes, "
        "and the size of every collective); nothing was started"
    )


def _all_gather(group: Any, buf: Any, size: int, config: OffloadConfig, rank: int) -> list[Any]:
    """Every rank's ``buf`` (each rank sends one of the same size), in rank order."""
    import torch

    out = [torch.zeros_like(buf) for _ in range(size)]
    try:
        group.allgather(out, buf, timeout=datetime.timedelta(seconds=config.tp_timeout_s)).wait()
    except Exception as exc:  # gloo: a timeout, or a peer's connection closed
        raise RankTimeout(
            f"rank {rank} of {size}: the other ranks did not build their managers within "
            f"tp_timeout_s={config.tp_timeout_s}s ({type(exc).__name__}: {exc}); every rank must "
            "build one, with the same settings"
        ) from exc
    return out


def join_group(
    group: Any, config: OffloadConfig, clock: Callable[[], float], cls: type[RankAgreement] | None = None
) -> RankAgreement | None:
    """This rank's agreement with the others in ``group``, or ``None`` without a group.
    A collective with a group of more than one rank: the ranks compare their
    :data:`SHARED_SETTINGS` (:func:`agree_settings`). Raises
    :class:`~kvoffload.ConfigError` for a bad group (:func:`check_group`), for settings
    that differ across the ranks (on every rank, naming each field and every rank's
    value), and for no group when ``config.tp_size`` is above 1 (every rank would
    deliver alone)."""
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
        if self.size > 1:
            agree_settings(group, config, self.rank, self.size)  # before any buffer sized by them
        self._buf = torch.zeros(HEADER + 2 * self.window, dtype=torch.int64)
        self._a = self._buf.numpy()  # the same memory: filled and read without torch ops
        self._cbuf = torch.zeros(2, dtype=torch.int64)  # the compact exchange's
        self._c = self._cbuf.numpy()
        # _named: how many copy and write slots the last call named (the rest are 0).
        self._named = (0, 0)
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
        # calls: the collective calls this rank made, skipped polls included (sent in
        # the header's kind slot: ranks a call apart raise RanksDiverged).
        # Invariant: the same on every rank between calls, while their calls are the same.
        self.calls = 0
        # skipped: the polls skipped in a row since the last collective; polls_skipped:
        # all of them; _agreed: (next_seq, lifecycles admitted) as the last collective
        # agreed them (None before the first). See "Polls that skip" in the module doc.
        # Invariant: 0 <= skipped <= IDLE_SKIPS; skipped, polls_skipped and _agreed are
        # computed from replicated state only, so they are the same on every rank.
        self.skipped = 0
        self.polls_skipped = 0
        self._agreed: tuple[int, int] | None = None
        # compact_agreed: the calls the compact exchange decided alone (no full one).
        # Invariant: the same on every rank (each call's path is read from the MIN).
        self.compact_agreed = 0
        # failed: the error that broke the group (a timeout, a dead peer, diverged
        # ranks); every collective after it raises at once, and close() runs alone.
        self.failed: KVOffloadError | None = None

    def clock(self) -> float:
        """The agreed clock (the core's and the timers' clock under a group)."""
        return self.now

    def host_buffer(self, buffer: Any) -> Any:
        """The host memory this rank's pool is built on: ``buffer`` (the engine's, or
        ``None``: new memory) on a rank that copies; on one that copies nothing
        ("shared" keys, rank above 0) an empty ``meta`` tensor, so its host pool keeps
        the page accounting every rank's decisions read and allocates no memory (it
        would never be written)."""
        if self.copies_here:
            return buffer
        import torch

        return torch.empty(0, dtype=torch.uint8, device="meta")

    def key_space(self, storage: Storage | None) -> Storage | None:
        """``storage`` as this rank reads and writes it: under ``tp_keys="rank"`` each
        key suffixed with the rank (:class:`RankKeys`); under ``"shared"``, or for a store
        whose ``rank_suffixed`` is true (it adds its own rank suffix), as it is."""
        if storage is None or not self.per_rank_keys or getattr(storage, "rank_suffixed", False):
            return storage  # none, shared keys, or a store that suffixes keys per rank itself (SGLang's)
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
            self.copies[t.seq] = (t.id, None)
            return
        try:
            backend.submit(t)
        except Exception as exc:
            self.copies[t.seq] = (t.id, exc)

    def hold_copies(self, batch: list[Completion], core: OffloadCore) -> None:
        """Completions this rank's backend signalled: held until every rank has them, by
        the ``seq`` of the transfer each names (``core``'s transfer of that id). One that
        names no transfer in flight (a backend's bug) is logged and dropped, as the
        drivers drop it outside a group."""
        inflight, copies = core.inflight, self.copies
        for c in batch:
            t = inflight.get(c[0])
            if t is None:
                logger.error(
                    "manager.step_failed",
                    step="deliver",
                    skipped=1,
                    error=f"transfer #{c[0]} completed twice or was never submitted",
                )
                continue
            copies[t.seq] = c

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
        seq, inflight, writes = core.next_seq, len(core.inflight), len(core.writes)
        admitted = core.counters.admitted
        self.calls += 1
        if (
            kind == POLL
            and not solo
            and self.skipped < IDLE_SKIPS
            and not inflight
            and not writes
            and not core.deferred
            and self._agreed == (seq, admitted)
        ):  # nothing to agree on, on any rank (the module doc: "Polls that skip")
            self.skipped += 1
            self.polls_skipped += 1
            return Agreed([], [], False, 0)
        self.skipped = 0
        elapsed = max(0, int((self._local_clock() - self._origin) * 1e6))
        if not solo:
            fast = self._compact(kind, core, limit, elapsed, (seq, inflight, writes, admitted))
            if fast is not None:
                return fast
        call = kind | self.calls << _KIND_BITS
        lim = _NO_LIMIT if limit is None else min(limit, _NO_LIMIT)
        a[:HEADER] = [
            *(call, -call, seq, -seq, inflight, -inflight, writes, -writes, admitted, -admitted),
            *(lim, elapsed, -int(late), payload),
        ]
        # A slot this rank holds nothing for is 0 here, so 0 after the MIN: only the
        # transfers (writes) this rank finished need naming, and only if it holds some.
        delivers = kind in _DELIVERS
        window: list[Transfer] = []
        if delivers and self.copies:
            held = self.copies
            window = list(itertools.islice(core.inflight.values(), self.window))
            get = held.get
            a[HEADER : HEADER + len(window)] = [
                _WAITING if (c := get(t.seq)) is None else _DONE if c[1] is None else _FAILED for t in window
            ]
        jobs: list[WriteJob] = []
        base = HEADER + self.window
        if delivers and self.writes:
            done = self.writes
            jobs = list(itertools.islice(core.writes.values(), self.window))
            a[base : base + len(jobs)] = [_write_code(done.get(j.id)) for j in jobs]
        self._clear(len(window), len(jobs))
        if not solo:
            self._all_reduce(kind)
        h = a[:HEADER].tolist()
        if not solo:
            self._check_replicas(kind, h)
            self._agreed = (seq, admitted)
        self.now = max(self.now, h[_ELAPSED] / 1e6)
        agreed = Agreed([], [], bool(h[_LATE]), h[_PAYLOAD])
        if window or jobs:
            self._take_agreed(window, jobs, h[_LIMIT], agreed)
        return agreed

    def _compact(
        self, kind: int, core: OffloadCore, limit: int | None, elapsed_us: int, state: tuple[int, ...]
    ) -> Agreed | None:
        """The compact exchange every collective call starts with (see "The compact
        exchange" in the module doc): one all-reduce (MIN) of 2 int64. Returns what it
        agreed, or None when every rank must go on to the full exchange (the same
        answer on every rank: it is read from the MIN)."""
        need = kind != POLL or self.calls % FULL_EVERY == 0
        window: list[Transfer] = []
        ok = 0  # the leading copies of the window this rank finished, all copied
        held = self.copies
        if held:
            window = list(itertools.islice(core.inflight.values(), self.window))
            for t in window:
                c = held.get(t.seq)
                if c is None or c[1] is not None:
                    break
                ok += 1
            if ok < len(window) and len(held) > ok:  # a failure, or finished out of order
                need = True
        jobs: list[WriteJob] = []
        stored = 0  # the leading writes of the window this rank stored in full
        done = self.writes
        if done:
            jobs = list(itertools.islice(core.writes.values(), self.window))
            for j in jobs:
                r = done.get(j.id)
                if r is None or stored_prefix(r) != len(j.host_pages):
                    break
                stored += 1
            if stored < len(jobs) and len(done) > stored:  # a failure, a partial write, out of order
                need = True
        ms = elapsed_us // 1000
        if ms > _C_CLOCK:
            need = True
            ms = _C_CLOCK
        count = ok if limit is None else min(ok, limit)
        x = (0 if need else _C_OK) | count << _C_COPIES
        y = stored << _C_WRITES | ms
        h = hash((kind, self.calls, *state)) & _C_HASH
        words = self._c
        words[0] = h << _C_LOW | x
        words[1] = -h * (1 << _C_LOW) + y
        self._all_reduce(kind, self._cbuf)
        r0, r1 = words.tolist()
        x, y = r0 & _C_MASK, r1 & _C_MASK
        if r0 >> _C_LOW != -(r1 >> _C_LOW) or not x & _C_OK:
            return None  # the ranks' states differ (or a rank asked): the full exchange
        self.now = max(self.now, (y & _C_CLOCK) / 1e3)
        self._agreed = (state[0], state[3])
        self.compact_agreed += 1
        out = Agreed([], [], False, 0)
        pop, take = held.pop, out.copies.append
        for t in window[: (x >> _C_COPIES) & _C_COUNT]:
            take(pop(t.seq))
        wpop, wtake = done.pop, out.writes.append
        for j in jobs[: (y >> _C_WRITES) & _C_COUNT]:
            wtake(wpop(j.id))
        return out

    def _clear(self, copies: int, writes: int) -> None:
        """Zero the slots named last time and not this time (the MIN keeps a zero a
        zero, so the rest of the buffer is zero already)."""
        a = self._a
        if copies < self._named[0]:
            a[HEADER + copies : HEADER + self._named[0]] = _WAITING
        base = HEADER + self.window
        if writes < self._named[1]:
            a[base + writes : base + self._named[1]] = _WAITING
        self._named = (copies, writes)

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
        a = self._a
        pop, take = self.copies.pop, out.copies.append
        for i, code in enumerate(a[HEADER : HEADER + len(window)].tolist()):  # seq order
            if not code:
                continue
            if limit <= 0:
                break
            limit -= 1
            t = window[i]
            c = pop(t.seq)  # held here: the MIN is above 0
            if code == _FAILED and c[1] is None:
                c = (c[0], _failed_elsewhere(t))
            take(c)
        base = HEADER + self.window
        for i, code in enumerate(a[base : base + len(jobs)].tolist()):
            if not code:
                continue
            held = self.writes.pop(jobs[i].id)
            job, stored, attempts, error = held
            reach, n = code - 1, len(job.host_pages)  # the prefix every rank stored (F34)
            if reach < n and (stored or isinstance(error, PartialWriteError) or stored_prefix(held) > reach):
                # Every rank counts the same pages: the agreed prefix, nothing after it.
                stored = False
                why = f"the storage write of {job!r} failed on another rank"
                if reach:
                    flags = [p < reach for p in range(n)]
                    error = PartialWriteError(f"{why} from its page {reach} on", flags)
                else:
                    error = StorageError(why)
            out.writes.append((job, stored, attempts, error))

    def _all_reduce(self, kind: int, buf: Any = None) -> None:
        """The all-reduce (MIN) of ``buf`` (the full vector by default) over the group."""
        try:
            self.group.allreduce([self._buf if buf is None else buf], self._opts).wait()
        except Exception as exc:  # gloo: a timeout, or a peer's connection closed
            raise self._fail(
                RankTimeout(
                    f"rank {self.rank} of {self.size}: {KIND_NAMES[kind]}() did not agree with the other "
                    f"ranks within tp_timeout_s={self.timeout_s}s - a rank died or stopped calling the "
                    f"manager's collectives ({type(exc).__name__}: {exc}); nothing was delivered and no "
                    "page was freed"
                )
            ) from exc

    def _check_replicas(self, kind: int, h: list[int]) -> None:
        problems = []
        lo, hi = h[_KIND], -h[_KIND + 1]
        mask = (1 << _KIND_BITS) - 1
        if lo & mask != hi & mask:
            problems.append(
                f"the ranks called different collectives ({KIND_NAMES.get(lo & mask, '?')}() and "
                f"{KIND_NAMES.get(hi & mask, '?')}())"
            )
        if lo >> _KIND_BITS != hi >> _KIND_BITS:
            problems.append(
                f"the ranks are at different collective calls (call {lo >> _KIND_BITS} to "
                f"{hi >> _KIND_BITS}: one made more calls, or skipped a poll another ran)"
            )
        for i, what in _CHECKED:
            lo, hi = h[i], -h[i + 1]
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
