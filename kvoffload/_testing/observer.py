"""What the property suite checks from outside the manager, after every step.

The observer sees what a user could see: the lifecycles ``admit`` returned, the
transfers handed to the backend, the events of ``add_listener`` and the page pools.
It keeps its own model (tokens per lifecycle, the issuer of every transfer, each
lifecycle's transition log) and holds no strong reference to a lifecycle, so the
garbage check (F2) means something. Internal fields are read only where the public
surface has no equivalent (a lifecycle's flags at the moment of a transition).
"""

from __future__ import annotations

import gc
import hashlib
import struct
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvoffload.backends.sim import SimBackend
from kvoffload.lifecycle.spec import LifecycleState
from kvoffload.pools import DevicePool, HostPool

if TYPE_CHECKING:
    from kvoffload.abc import Transfer
    from kvoffload.config import OffloadConfig
    from kvoffload.lifecycle.core import Lifecycle
    from kvoffload.drivers.asyncio import OffloadManager

__all__ = ["KV_SHAPE", "CheckedSimBackend", "Observer", "reference_keys"]

#: A token's KV in the checked pools: (lifecycle id, position, token id) as int32, so a
#: page copied from the wrong place, or after it was reused, is never the expected bytes.
KV_SHAPE = (3,)

_P, _O, _F, _R = (
    LifecycleState.PENDING,
    LifecycleState.OFFLOADING,
    LifecycleState.FINISHING,
    LifecycleState.RELEASED,
)


def reference_keys(tokens: Sequence[int], page_size: int) -> list[str]:
    """The SGLang HiCache chain over the whole pages of ``tokens``, from the root.

    Written with hashlib and struct only, independently of :mod:`kvoffload.keys`:
    ``key(page) = sha256(previous key bytes + tokens as uint32 little-endian)``.
    """
    keys: list[str] = []
    prev = b""
    for off in range(0, len(tokens) - len(tokens) % page_size, page_size):
        h = hashlib.sha256(prev)
        h.update(struct.pack(f"<{page_size}I", *tokens[off : off + page_size]))
        prev = h.digest()
        keys.append(prev.hex())
    return keys


def _collect_until_dead(ref: weakref.ReferenceType[Any]) -> bool:
    """Whether ``ref``'s object is garbage: young generations first (cheap), then all.

    A caller's own reference cycles (an exception that names the lifecycle, caught in a
    task) are collectable garbage; only a live strong reference keeps it.
    """
    for generation in (0, 1, 2):
        if ref() is None:
            return True
        gc.collect(generation)
    return ref() is None


@dataclass(eq=False)
class _LcModel:
    """What the observer knows about one lifecycle, by its id (never by rid)."""

    lid: int
    rid: Any
    ref: weakref.ReferenceType[Lifecycle]
    # tokens: every token committed so far (prompt, then extends), as the caller sent them.
    tokens: list[int] = field(default_factory=list)
    # delivered: completions of this lifecycle's transfers signalled by the test.
    # Invariant (after settle): delivered == chunk_events
    delivered: int = 0
    chunk_events: int = 0
    # log: (trigger, from, to, copying, deferred) of every transition, in order.
    log: list[tuple[str, str, str, bool, bool]] = field(default_factory=list)
    replayed: int = 0
    oracle: Any = None
    dropped: bool = False


@dataclass(eq=False)
class _Submitted:
    """A transfer as it was at submit time."""

    transfer: Transfer
    issuer: int
    keys: list[str]
    device_pages: list[int]
    signalled: bool = False


class _WatchedDevicePool(DevicePool):
    """A device pool that reports every free to the observer before doing it."""

    observer: Observer | None = None

    def free(self, pages: Any) -> None:
        pages = list(pages)
        if self.observer is not None:
            self.observer.on_device_free(self, pages)
        super().free(pages)


class CheckedSimBackend(SimBackend):
    """A :class:`SimBackend` whose pools hold int32 ``KV_SHAPE`` rows and that tells
    its observer about every submit and completion."""

    def __init__(self, observer: Observer) -> None:
        super().__init__()
        self.observer = observer

    def create_pools(self, config: OffloadConfig) -> tuple[DevicePool, HostPool]:
        args = (config.page_size, config.kv_shape, config.dtype)
        device = _WatchedDevicePool.create(config.device_pages, *args)
        device.observer = self.observer
        self.observer.device = device
        host = HostPool.create(config.host_pages, *args)
        self.observer.host = host
        return device, host

    def submit(self, transfer: Transfer) -> None:
        super().submit(transfer)
        self.observer.on_submit(transfer)

    def complete(self, transfer: Transfer) -> None:
        super().complete(transfer)
        self.observer.on_signal(transfer, ok=True)

    def fail(self, transfer: Transfer, error: BaseException | None = None) -> None:
        super().fail(transfer, error)
        self.observer.on_signal(transfer, ok=False)


class Observer:
    """The outside-world model and checks of the property suite.

    Call :meth:`attach` once the manager exists, :meth:`on_admit` / :meth:`on_extend`
    after each successful admit / extend (they also write the tokens' KV into the
    device pages, as the engine would), and :meth:`check` after every step, once every
    signalled completion was delivered (``await mgr.settle()``).
    """

    def __init__(self) -> None:
        self.mgr: OffloadManager | None = None
        self.device: DevicePool | None = None
        self.host: HostPool | None = None
        self.page_size = 1
        # lcs: every lifecycle admitted, by lifecycle id.
        self.lcs: dict[int, _LcModel] = {}
        # transfers: submitted and not yet checked after delivery, by transfer id.
        self.transfers: dict[int, _Submitted] = {}
        # reached: transfer id -> lifecycle id that the manager's completion event named.
        self.reached: dict[int, int] = {}
        # violations: what went wrong inside a manager call, reported at the next check.
        self.violations: list[str] = []
        self._oracle_factory: Callable[[], Any] | None = None
        # seen: event names (and trigger: destination) that happened in this run.
        self.seen: set[str] = set()

    # --- wiring ----------------------------------------------------------------------

    def attach(self, mgr: OffloadManager) -> None:
        """Observe ``mgr``: its events go to the model from now on."""
        from kvoffload.lifecycle.table import oracle_machine

        self.mgr = mgr
        self.page_size = mgr.config.page_size
        self._oracle_factory = oracle_machine
        mgr.add_listener(self._on_event)

    def _on_event(self, name: str, fields: dict[str, Any]) -> None:
        assert self.mgr is not None
        self.seen.add(name if name != "lifecycle.transition" else f"{fields['trigger']}: {fields['to']}")
        lid: Any = fields.get("lifecycle")
        if name == "lifecycle.admitted":
            lc = self.mgr.core.live[lid]
            self.lcs[lid] = _LcModel(lid, lc.rid, weakref.ref(lc))
        elif name == "lifecycle.transition":
            m = self.lcs[lid]
            live = self.mgr.core.live.get(lid)
            copying = live is not None and live.inflight > 0
            deferred = live is not None and live.deferred
            m.log.append((fields["trigger"], fields["from"], fields["to"], copying, deferred))
            if fields["trigger"] in ("chunk_done", "chunk_failed"):
                m.chunk_events += 1
        elif name in ("transfer.completed", "transfer.failed", "transfer.discarded"):
            self.reached[fields["transfer"]] = lid

    # --- the engine's side ---------------------------------------------------------------

    def on_admit(self, lc: Lifecycle, prompt: Sequence[int]) -> None:
        """``lc`` was admitted with ``prompt``: record the tokens and write their KV."""
        self.lcs[lc.id].tokens = list(prompt)
        self._write_kv(lc, 0, prompt)

    def on_extend(self, lc: Lifecycle, tokens: Sequence[int]) -> None:
        """``lc.extend(tokens)`` succeeded: record the tokens and write their KV."""
        m = self.lcs[lc.id]
        start = len(m.tokens)
        m.tokens.extend(tokens)
        self._write_kv(lc, start, tokens)

    def _write_kv(self, lc: Lifecycle, start: int, tokens: Sequence[int]) -> None:
        import torch

        if not tokens:
            return
        assert self.device is not None
        ps = self.page_size
        pos = range(start, start + len(tokens))
        pages = torch.tensor([lc.device_pages[p // ps] for p in pos], dtype=torch.long)
        slots = torch.tensor([p % ps for p in pos], dtype=torch.long)
        rows = torch.tensor([[lc.id, p, t] for p, t in zip(pos, tokens, strict=True)], dtype=torch.int32)
        self.device.tensor[pages, slots] = rows.to(self.device.tensor.dtype)

    def expected_rows(self, lid: int, first: int, n: int) -> Any:
        """The KV rows tokens ``first..first+n`` of lifecycle ``lid`` must hold."""
        import torch

        toks = self.lcs[lid].tokens[first : first + n]
        rows = [[lid, first + i, t] for i, t in enumerate(toks)]
        return torch.tensor(rows, dtype=torch.int32).reshape(n // self.page_size, self.page_size, 3)

    # --- the backend's side ----------------------------------------------------------------

    def on_submit(self, t: Transfer) -> None:
        self.transfers[t.id] = _Submitted(t, t.lifecycle.id, list(t.keys), list(t.device_pages))
        if not set(t.device_pages) <= set(t.lifecycle.device_pages):
            self.violations.append(f"{t!r} was submitted reading device pages its lifecycle does not hold")

    def on_signal(self, t: Transfer, *, ok: bool) -> None:
        """A test signalled ``t``: check the bytes the copy moved (F3/F4)."""
        s = self.transfers[t.id]
        s.signalled = True
        self.lcs[s.issuer].delivered += 1
        if ok:
            assert self.host is not None
            import torch

            got = self.host.tensor[torch.tensor(t.host_pages, dtype=torch.long)]
            want = self.expected_rows(s.issuer, t.first_token, t.n_tokens)
            if not torch.equal(got.to(torch.int32), want):
                self.violations.append(
                    f"{t!r}: the host pages do not hold the bytes its device pages held at submit "
                    "(a device page was freed and reused while the copy read it)"
                )

    def on_device_free(self, pool: DevicePool, pages: list[int]) -> None:
        """Every device free goes through here: never twice, never under a copy."""
        reading = {p: s for s in self.transfers.values() if not s.signalled for p in s.device_pages}
        for p in pages:
            if not pool.is_allocated(p):
                self.violations.append(f"device page {p} freed twice")
            if p in reading:
                self.violations.append(f"device page {p} freed while {reading[p].transfer!r} reads it")

    # --- the check -------------------------------------------------------------------------------

    def check(self, pending: Sequence[Transfer]) -> None:
        """Raise ``AssertionError`` naming every rule of the suite that does not hold.

        ``pending`` is the backend's in-flight list; every signalled completion must have
        been delivered before this is called.
        """
        mgr = self.mgr
        assert mgr is not None
        mgr.check_invariants()
        problems = self.violations
        self.violations = []
        # Every completion reached the lifecycle that issued it, with the keys it was
        # submitted with, equal to an independent recomputation of the chain (F1, F11).
        for tid in [tid for tid, s in self.transfers.items() if s.signalled]:
            problems.extend(self._check_delivered(self.transfers.pop(tid)))
        inflight: dict[int, int] = {}
        for t in pending:
            inflight[t.lifecycle.id] = inflight.get(t.lifecycle.id, 0) + 1
        for lid, m in list(self.lcs.items()):
            lc = m.ref()
            if lc is None:
                del self.lcs[lid]
                continue
            n = inflight.get(lid, 0)
            state = lc.state
            if lc.inflight != n:
                problems.append(f"{lc!r} counts {lc.inflight} chunk(s) in flight, the backend has {n}")
            if n and state not in (_O, _F):
                problems.append(f"{lc!r} has {n} chunk(s) in flight but is {state.name}")
            if state is _F and n == 0 and not lc.deferred:
                problems.append(f"{lc!r} is left FINISHING with nothing in flight")
            if m.delivered != m.chunk_events:
                problems.append(f"{lc!r}: {m.delivered} completion(s) signalled, {m.chunk_events} applied")
            problems.extend(self._replay(lc, m))
            if state is _R and m.dropped:
                del lc
                if _collect_until_dead(m.ref):
                    del self.lcs[lid]
                else:
                    problems.append(f"lifecycle #{lid} is RELEASED and dropped but still referenced (F2)")
        if problems:
            raise AssertionError("; ".join(problems))

    def _check_delivered(self, s: _Submitted) -> list[str]:
        t = s.transfer
        ps = self.page_size
        problems = []
        reached = self.reached.pop(t.id, None)
        if reached != s.issuer:
            problems.append(f"the completion of {t!r}, issued by #{s.issuer}, reached #{reached}")
        first = t.first_token // ps
        want = reference_keys(self.lcs[s.issuer].tokens[: t.first_token + t.n_tokens], ps)[first:]
        if list(t.keys) != want or s.keys != want:
            problems.append(f"{t!r} carries keys {t.keys} (at submit {s.keys}), the chain says {want}")
        return problems

    def _replay(self, lc: Lifecycle, m: _LcModel) -> list[str]:
        """Replay ``m``'s new transitions on the ``transitions`` oracle of the spec."""
        from transitions import MachineError

        if m.oracle is None:
            assert self._oracle_factory is not None
            m.oracle = self._oracle_factory()
        oracle = m.oracle
        problems: list[str] = []
        for trigger, src, dst, copying, deferred in m.log[m.replayed :]:
            if oracle.state != src:
                problems.append(f"{lc!r}: {trigger} from {src}, but the log was at {oracle.state}")
                break
            oracle.copying, oracle.deferred = copying, deferred
            try:
                ok = oracle.trigger(trigger)
            except MachineError as exc:
                problems.append(f"{lc!r}: {src} --{trigger}--> {dst} is not declared ({exc})")
                break
            if not ok or oracle.state != dst:
                problems.append(
                    f"{lc!r}: {src} --{trigger}--> {dst} with copying={copying}, deferred={deferred}; "
                    f"the spec says {oracle.state if ok else 'no guard holds'}"
                )
                break
        m.replayed = len(m.log)
        if not problems and oracle.state != lc.state.name:
            problems.append(f"{lc!r} is {lc.state.name} but its transition log ends at {oracle.state}")
        return problems

    def dropped(self, lc: Lifecycle) -> None:
        """The caller dropped its last reference to ``lc``."""
        self.lcs[lc.id].dropped = True
