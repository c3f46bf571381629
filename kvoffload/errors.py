"""One exception hierarchy, rooted at :class:`KVOffloadError`.

Every error raised at kvoffload's boundary is one of these, says what was wrong
and what is allowed, and is raised *before* any count or page changes.
"""

from __future__ import annotations

from _thread import get_ident
from collections.abc import Sequence

__all__ = [
    "wrong_thread",
    "BackendError",
    "ConfigError",
    "DrainTimeout",
    "InvalidTokens",
    "InvalidTransition",
    "InvariantViolation",
    "KVOffloadError",
    "ManagerClosed",
    "MissingDependency",
    "PageError",
    "PartialWriteError",
    "PoolExhausted",
    "RankTimeout",
    "RanksDiverged",
    "StorageError",
    "UnsupportedKVPool",
    "WrongThread",
]


class KVOffloadError(Exception):
    """Root of every error kvoffload raises on purpose."""


class ConfigError(KVOffloadError, ValueError):
    """An :class:`~kvoffload.OffloadConfig` value (or a backend/storage name, a chain
    seed or a namespace) is invalid."""


class InvalidTransition(KVOffloadError):
    """An event that is illegal in the lifecycle's current state.

    Raised before anything changes: the lifecycle, the pools and the counters are
    exactly as they were.
    """

    def __init__(self, lifecycle: object, state: object, event: str) -> None:
        self.lifecycle = lifecycle
        self.state = state
        self.event = event
        super().__init__(
            f"{lifecycle!r}: event {event!r} is not allowed in state {getattr(state, 'name', state)}"
        )


class ManagerClosed(KVOffloadError):
    """A call on a manager that was closed (``close()``, or leaving its context), or on
    a lifecycle of one: ``admit``, ``poll``, ``quiesce``, ``lc.extend()``,
    ``lc.finish()``... Closing aborted every live lifecycle; nothing was changed.
    (``lc.abort()`` after close is a no-op, as on any RELEASED or aborted lifecycle.)
    """


class InvalidTokens(KVOffloadError, ValueError):
    """Token ids that are not an ordered sequence of ints in ``[0, 2**63)`` (bools,
    floats, sets, dicts, float tensors and str are refused); the message names the
    first bad element."""


class PoolExhausted(KVOffloadError):
    """A page pool has fewer free pages than asked for; nothing was allocated."""

    def __init__(self, pool: str, wanted: int, free: int) -> None:
        self.pool = pool
        self.wanted = wanted
        self.free = free
        super().__init__(f"{pool} pool exhausted: {wanted} page(s) wanted, {free} free")


class UnsupportedKVPool(ConfigError):
    """An engine's KV pool that an integration cannot offload yet (a sliding-window or
    hybrid pool, a device other than CUDA or CPU): raised at construction, naming the
    pool and what is supported."""


class PageError(KVOffloadError):
    """A page was freed twice, or a page number that the pool never handed out."""


class BackendError(KVOffloadError):
    """An event backend is unavailable (no GPU for ``"cuda"``) or failed a copy."""


class StorageError(KVOffloadError):
    """A storage tier could not be reached or refused a write or read."""


class PartialWriteError(StorageError):
    """A batched write stored some pages of the batch and not others (FAILURES F34).

    ``stored[i]`` is whether the store confirmed page ``i`` of the batch (one flag per
    key, in the batch's order); ``errors`` holds the store's reason for each page it
    did not store (``None`` where stored). A page counts as stored only where its flag
    is True: never the whole batch because part of it succeeded.
    """

    def __init__(
        self, message: str, stored: Sequence[bool], errors: Sequence[str | None] | None = None
    ) -> None:
        super().__init__(message)
        self.stored: tuple[bool, ...] = tuple(bool(s) for s in stored)
        self.errors: tuple[str | None, ...] = (
            tuple(errors) if errors is not None else tuple(None if s else message for s in self.stored)
        )
        if len(self.errors) != len(self.stored):
            raise ValueError(f"PartialWriteError: {len(self.errors)} errors for {len(self.stored)} pages")


class MissingDependency(KVOffloadError, ImportError):
    """An optional dependency is not installed; the message names the extra."""


class DrainTimeout(KVOffloadError):
    """Leaving the manager waited ``drain_timeout_s`` and copies were still in flight.

    Their pages were *not* freed (a page is never freed under a running copy).
    """


class RankTimeout(KVOffloadError):
    """Tensor parallelism: a collective of :class:`~kvoffload.SyncOffloadManager`
    (``poll``, ``quiesce``, ``close``, ``lookup``, ``fetch``, ``wait_released``) did not
    complete within ``OffloadConfig.tp_timeout_s``, or the process group reported a peer
    gone: a rank died or stopped calling them.

    Nothing was delivered by the failed call and no page was freed: lifecycles with a
    copy in flight keep their pages. From then on every collective of the manager raises
    at once; ``close()`` drains this rank's own copies and stops.
    """


class RanksDiverged(KVOffloadError):
    """Tensor parallelism: the ranks' calls differ, so their replicated schedulers are no
    longer replicas - one rank in ``poll()`` while another is in ``quiesce()``, or ranks
    that admitted, submitted or stored different things.

    Raised by the same collective on every rank, with nothing delivered; from then on
    the manager behaves as after :class:`RankTimeout`.
    """


class InvariantViolation(KVOffloadError, AssertionError):
    """``check_invariants()`` found the ledger out of balance: a kvoffload bug."""


class WrongThread(KVOffloadError, RuntimeError):
    """A call came from a thread other than the manager's owner thread (FAILURES F24).

    The owner is the event loop's thread (:class:`~kvoffload.OffloadManager`) or the
    thread that opened a :class:`~kvoffload.SyncOffloadManager`. The message names both
    threads; nothing was changed.
    """


def wrong_thread(owner: int, what: str) -> WrongThread:
    """The error for a call from a thread other than ``owner`` (names both threads)."""
    import threading  # (the message names the threads: read, never started)

    def name(ident: int) -> str:
        for t in threading.enumerate():
            if t.ident == ident:
                return f"{t.name!r} (ident {ident})"
        return f"ident {ident}"

    return WrongThread(
        f"{what} was called from thread {name(get_ident())}, but this manager is owned by thread "
        f"{name(owner)}: every call must come from the owner thread (the event loop's thread, or the "
        "thread that opened the SyncOffloadManager); nothing was changed"
    )
