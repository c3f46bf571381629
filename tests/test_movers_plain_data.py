"""Movers work from plain data (issue 21): a copy job (:class:`~kvoffload.abc.Transfer`)
carries what a mover needs - a job number tensor-parallel ranks agree on, device and
host page ids, keys, ``ready``, the issuer's id, request id and tag - and no
``Lifecycle``; a completion is a transfer id and an error. That is what lets the
scheduler side and the worker side of an engine live in different processes.
"""

from __future__ import annotations

import ast
import gc
import pickle
import weakref
from pathlib import Path
from typing import Any

import pytest

import kvoffload as kvo
import kvoffload.abc
from kvoffload.abc import Completion, Transfer
from kvoffload.core.lifecycle import Lifecycle
from kvoffload.core.offload import OffloadCore
from kvoffload.pools import DevicePool, HostPool
from kvoffload.testing import SimBackend

CONFIG = kvo.OffloadConfig(page_size=4, stride=4, device_pages=64, host_pages=64)

#: What a mover reads of a transfer (and reports back: ``id``).
MOVER_FIELDS = (
    "id",
    "seq",
    "lifecycle_id",
    "rid",
    "device_pages",
    "host_pages",
    "keys",
    "first_token",
    "n_tokens",
    "stream",
)


class Recording(SimBackend):
    """A sim backend that keeps every transfer it is given and every completion it hands
    to the driver."""

    def __init__(self) -> None:
        super().__init__()
        self.given: list[Transfer] = []
        self.handed: list[Completion] = []

    def submit(self, transfer: Transfer) -> None:
        super().submit(transfer)
        self.given.append(transfer)

    def take_completions(self, max_completions: int | None = None) -> list[Completion]:
        out = super().take_completions(max_completions)
        self.handed.extend(out)
        return out


def _values(obj: Any) -> list[Any]:
    """Every value held in ``obj``'s slots, the items of lists and tuples included."""
    out: list[Any] = []
    for cls in type(obj).__mro__:
        for name in getattr(cls, "__slots__", ()):
            if hasattr(obj, name):
                out.append(getattr(obj, name))
    flat: list[Any] = []
    while out:
        v = out.pop()
        flat.append(v)
        if isinstance(v, list | tuple):
            out.extend(v)
    return flat


def _busy_run(backend: Recording) -> None:
    """Copies of every kind: copied, failed, discarded (aborted), a finish's flush."""
    with kvo.SyncOffloadManager(CONFIG, backend=backend) as mgr:
        lcs = [mgr.admit(f"r{i}", list(range(8)), tag=f"req{i}") for i in range(4)]
        for lc in lcs:
            lc.extend([1, 2, 3, 4])
        backend.fail(backend.pending[0], kvo.BackendError("simulated copy failure"))
        lcs[1].abort()
        lcs[2].finish()
        backend.complete_all()
        mgr.poll()
        lcs[3].extend([5, 6, 7, 8, 9, 10])
        lcs[3].finish()
        backend.complete_all()
        mgr.poll()
        lcs[0].finish()
        mgr.check_invariants()


def test_a_backend_is_given_no_lifecycle_and_hands_back_ids() -> None:
    """Every transfer a backend is given holds no Lifecycle in any slot (lists
    included), and every completion it hands back is a transfer id (an int) and an
    error: nothing of the bookkeeping reaches the mover."""
    backend = Recording()
    _busy_run(backend)
    assert len(backend.given) >= 5 and len(backend.handed) == len(backend.given)
    for t in backend.given:
        held = [type(v).__name__ for v in _values(t) if isinstance(v, Lifecycle)]
        assert not held, f"{t!r} holds {held}"
    ids = {t.id for t in backend.given}
    for tid, error in backend.handed:
        assert type(tid) is int and tid in ids
        assert error is None or isinstance(error, BaseException)


def test_what_a_mover_reads_survives_pickle() -> None:
    """The cross-process shape: a transfer made by a real core (``ready`` None) and its
    completions pickle, and what a mover reads of it comes back equal."""
    backend = Recording()
    with kvo.SyncOffloadManager(CONFIG, backend=backend) as mgr:
        lc = mgr.admit("r", list(range(8)))
        lc.extend([1, 2, 3, 4])
        assert backend.given
        for t in backend.given:
            u = pickle.loads(pickle.dumps(t))
            assert type(u) is Transfer
            assert {f: getattr(u, f) for f in MOVER_FIELDS} == {f: getattr(t, f) for f in MOVER_FIELDS}
            assert u.lifecycle_id == lc.id and u.rid == "r" and u.ready is None
        t = backend.given[0]
        for c in [(t.id, None), (t.id, kvo.BackendError("copy failed"))]:
            tid, err = pickle.loads(pickle.dumps(c))
            assert tid == t.id and (err is None) is (c[1] is None)
        backend.complete_all()


def test_a_transfer_copies_its_issuer_and_keeps_no_reference_to_it() -> None:
    """``Transfer(issuer, ...)`` copies the issuer's id, rid and tag; once the issuer is
    dropped, the transfer does not keep it alive (it holds no reference)."""

    class Issuer:
        def __init__(self) -> None:
            self.id = 7
            self.rid = "r7"
            self.tag = ("the", "engine's", "request")

    issuer = Issuer()
    gone = weakref.ref(issuer)
    t = Transfer(issuer, [1], [2], ["k"], 0, 4, 0.0)
    del issuer
    gc.collect()
    assert gone() is None, "the transfer keeps its issuer alive"
    assert (t.lifecycle_id, t.rid, t.tag) == (7, "r7", ("the", "engine's", "request"))
    assert "lifecycle #7" in repr(t) and "'r7'" in repr(t)


def test_the_mover_interface_imports_nothing_of_the_lifecycle() -> None:
    """``kvoffload/abc.py`` (what movers share with the bookkeeping) imports nothing of
    ``kvoffload.lifecycle``, not even for type checking."""
    tree = ast.parse(Path(kvoffload.abc.__file__).read_text())
    imported = [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    imported += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    assert not [m for m in imported if m.startswith(("kvoffload.lifecycle", "kvoffload.core"))], imported


def _core() -> tuple[OffloadCore, list[Transfer]]:
    jobs: list[Transfer] = []
    args = (CONFIG.page_size, CONFIG.kv_shape, CONFIG.dtype)
    core = OffloadCore(
        CONFIG,
        device_pool=DevicePool.create(CONFIG.device_pages, *args),
        host_pool=HostPool.create(CONFIG.host_pages, *args),
        accept=jobs.append,
    )
    return core, jobs


def test_a_completion_naming_an_unknown_id_is_refused_and_changes_nothing() -> None:
    """A completion whose id names no transfer in flight (a mover's bug) raises a typed
    error naming the id; the ledger, the lifecycles and the host pool are as they were,
    and the copies in flight still complete."""
    core, jobs = _core()
    lcs = [core.admit(f"r{i}", prompt=[]) for i in range(2)]
    for lc in lcs:
        lc.extend([1, 2, 3, 4])
    before = (
        core.statistics().as_dict(),
        [(lc.state, lc.inflight) for lc in lcs],
        core.host_pool.used,
        list(core.inflight),
    )
    unknown = max(t.id for t in jobs) + 1000
    with pytest.raises(kvo.KVOffloadError, match=f"#{unknown} completed twice or was never submitted"):
        core.complete([(unknown, None)])  # type: ignore[list-item]
    after = (
        core.statistics().as_dict(),
        [(lc.state, lc.inflight) for lc in lcs],
        core.host_pool.used,
        list(core.inflight),
    )
    assert after == before
    core.check_invariants()
    core.complete([(t.id, None) for t in jobs])
    assert not core.inflight and core.host_pool.used == 0
    core.check_invariants()


def test_a_completion_whose_lifecycle_is_not_live_is_refused_and_changes_nothing() -> None:
    """The core finds a completion's lifecycle by the transfer's ``lifecycle_id`` among
    the live ones (a lifecycle with a copy in flight is never RELEASED). Should that
    break (a kvoffload bug, stood in for here by a rewritten id), the completion raises
    :class:`~kvoffload.InvariantViolation` naming the transfer, and nothing is applied:
    the transfer stays in flight, the ledger and the lifecycles are as they were."""
    core, jobs = _core()
    lc = core.admit("r", prompt=[])
    lc.extend([1, 2, 3, 4])
    (t,) = jobs
    real = t.lifecycle_id
    t.lifecycle_id = real + 1000  # no such live lifecycle
    before = (core.statistics().as_dict(), lc.state, lc.inflight, core.host_pool.used, list(core.inflight))
    with pytest.raises(kvo.InvariantViolation, match="its lifecycle is not live"):
        core.complete([(t.id, None)])
    after = (core.statistics().as_dict(), lc.state, lc.inflight, core.host_pool.used, list(core.inflight))
    assert after == before
    t.lifecycle_id = real
    core.check_invariants()
    core.complete([(t.id, None)])
    assert not core.inflight and lc.inflight == 0
    core.check_invariants()
