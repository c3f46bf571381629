"""No silent cliffs (issue 25, point 4): token ids as numpy arrays or torch tensors take
the same fast paths as lists, with the same result; a listener turns off only its own
manager's fast paths, DEBUG on a logger kvoffload does not write to turns off none, and
a manager that turns its fast paths off says so once (``manager.fast_paths_off``).

"The fast path was taken" is observed, not timed: the core's full path of
``Lifecycle.extend`` (``core.extend``) and the checked pass of ``extend_batch``
(``core.step._extend_checked``) are wrapped to count their calls.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import structlog

import kvoffload as kvo
from kvoffload.core.events import STDLIB_LOGGER, refresh_debug
from kvoffload.testing import SimBackend

torch = pytest.importorskip("torch")


def _mgr() -> kvo.SyncOffloadManager:
    cfg = kvo.OffloadConfig(
        page_size=4, stride=8, device_pages=4096, host_pages=4096, kv_shape=(1,), dtype="uint8"
    )
    return kvo.SyncOffloadManager(cfg, backend=SimBackend()).open()


def _count(obj: Any, name: str) -> list[int]:
    """Wrap ``obj.name`` (an instance attribute) to count its calls; returns the count."""
    calls: list[int] = []
    inner = getattr(obj, name)

    def counted(*a: Any, **k: Any) -> Any:
        calls.append(1)
        return inner(*a, **k)

    setattr(obj, name, counted)
    return calls


def _state(mgr: kvo.SyncOffloadManager, lcs: list[kvo.Lifecycle]) -> Any:
    mgr.check_invariants()
    st = mgr.statistics()
    return (
        [
            (lc.committed, lc.submitted, lc.chain_key, lc.state, list(lc._tail), len(lc.device_pages))
            for lc in lcs
        ],
        st.chunks_submitted,
        st.pages_submitted,
    )


def _close(mgr: kvo.SyncOffloadManager, lcs: list[kvo.Lifecycle]) -> None:
    mgr.backend.complete_all()  # type: ignore[attr-defined]
    mgr.poll()
    for lc in lcs:
        lc.abort()
    mgr.close()


ARRAYS: dict[str, Callable[[list[int]], Any]] = {
    "numpy int64": lambda ids: np.array(ids, dtype=np.int64),
    "numpy uint32": lambda ids: np.array(ids, dtype=np.uint32),
    "torch int64": lambda ids: torch.tensor(ids, dtype=torch.int64),
    "torch int32": lambda ids: torch.tensor(ids, dtype=torch.int32),
}


@pytest.mark.parametrize("kind", list(ARRAYS))
def test_extend_with_an_array_or_tensor_takes_the_fast_path_with_the_lists_result(kind: str) -> None:
    """``lc.extend(ids)`` with a one-dimensional integer numpy array or torch tensor (one
    token, as ``next_token_ids[i:i+1]``, or several) reaches the core's full path
    exactly when the same ids as a list do (a multi-token step that makes a chunk due;
    never a one-token one), and leaves every lifecycle, key and chunk as the list does."""
    steps = [[(7 * i + j) % 50_000 for j in range(1 + (i % 5 == 0) * 2)] for i in range(40)]
    results = []
    for convert in (list, ARRAYS[kind]):
        mgr = _mgr()
        lcs = [mgr.admit(i, list(range(6))) for i in range(3)]
        full = _count(mgr.core, "extend")
        for ids in steps:
            for lc in lcs:
                lc.extend(convert(ids))
            mgr.backend.complete_all()  # type: ignore[attr-defined]
            mgr.poll()
        results.append((_state(mgr, lcs), len(full)))
        _close(mgr, lcs)
    (listed, full_list), (arrayed, full_array) = results
    assert arrayed == listed
    assert full_array == full_list < len(steps), (full_list, full_array)


def test_extend_with_a_bad_array_still_raises_what_the_full_path_raises() -> None:
    """A float array, a bool tensor, a 2-d array and an id past 2**63 take the full path
    and raise its typed error, nothing changed."""
    mgr = _mgr()
    lc = mgr.admit(0, [1, 2])
    for bad in (np.array([1.0]), torch.tensor([True]), np.array([[1]]), np.array([2**63], dtype=np.uint64)):
        with pytest.raises(kvo.InvalidTokens):
            lc.extend(bad)
        assert lc.committed == 2 and list(lc._tail) == [1, 2]
    _close(mgr, [lc])


@pytest.mark.parametrize("n", [8, 64])  # below and above ROWS_MIN: the plain pass and the rows
@pytest.mark.parametrize(
    "make",
    [
        lambda ids: np.array(ids, dtype=np.int64),
        lambda ids: torch.tensor(ids, dtype=torch.int64),
        lambda ids: np.array(ids, dtype=np.int64).reshape(-1, 1),
        lambda ids: torch.tensor(ids, dtype=torch.int64).unsqueeze(1),
    ],
    ids=["numpy", "torch", "numpy column", "torch column"],
)
def test_extend_batch_with_an_array_or_tensor_takes_the_fast_path(
    n: int, make: Callable[[list[int]], Any]
) -> None:
    """``mgr.extend_batch(lcs, next_token_ids)`` with the ids as a numpy array or torch
    tensor - one id per lifecycle, or a column of shape (n, 1) - never takes the checked
    pass, and leaves everything exactly as a list of ints does."""
    results = []
    for convert in (list, make):
        mgr = _mgr()
        lcs = [mgr.admit(i, list(range(6))) for i in range(n)]
        checked = _count(mgr.core.step, "_extend_checked")
        for s in range(20):
            mgr.extend_batch(lcs, convert([(s * 31 + i) % 50_000 for i in range(n)]))
            mgr.backend.complete_all()  # type: ignore[attr-defined]
            mgr.poll()
        results.append((_state(mgr, lcs), len(checked)))
        _close(mgr, lcs)
    (listed, c_list), (arrayed, c_array) = results
    assert arrayed == listed
    assert c_list == 0 and c_array == 0, (c_list, c_array)


# --- listeners and logging ---------------------------------------------------------------


@pytest.fixture
def plain_logging() -> Iterator[None]:
    """structlog unconfigured and kvoffload's logger at its default (as in production),
    restored afterwards; the debug gate recomputed."""
    was = structlog.is_configured()
    cfg = structlog.get_config()
    structlog.reset_defaults()
    level = STDLIB_LOGGER.level
    try:
        refresh_debug()
        yield
    finally:
        STDLIB_LOGGER.setLevel(level)
        if was:
            structlog.configure(**cfg)
        refresh_debug()


def _fast(lc: kvo.Lifecycle) -> bool:
    """Whether ``lc``'s one-token fast path is open (its threshold: see Lifecycle)."""
    return bool(lc._quiet >= 0)


class _Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.events: list[dict[str, Any]] = []

    def emit(self, record: logging.LogRecord) -> None:
        if getattr(record, "kvoffload_event", None) == "manager.fast_paths_off":
            self.events.append(record.kvoffload)  # type: ignore[attr-defined]


@pytest.fixture
def warnings_seen(plain_logging: None) -> Iterator[_Warnings]:
    h = _Warnings()
    STDLIB_LOGGER.addHandler(h)
    try:
        yield h
    finally:
        STDLIB_LOGGER.removeHandler(h)


def test_a_listener_turns_off_only_its_own_managers_fast_paths(warnings_seen: _Warnings) -> None:
    """A listener on manager A closes A's fast paths (its steps emit events) and leaves
    manager B's open: B's one-token steps never reach its full path. Removing it opens
    A's again."""
    a, b = _mgr(), _mgr()
    la, lb = a.admit("a", [1, 2, 3]), b.admit("b", [1, 2, 3])
    seen: list[str] = []
    remove = a.add_listener(lambda name, fields: seen.append(name))
    full_b = _count(b.core, "extend")
    for t in range(5):
        la.extend([t])
        lb.extend([t])
    assert not _fast(la) and _fast(lb)
    assert "lifecycle.transition" in seen  # A's steps are observed
    assert full_b == []
    remove()
    assert _fast(la)
    assert [e["listeners"] for e in warnings_seen.events] == [1]  # A said so, B did not
    _close(a, [la])
    _close(b, [lb])


def test_kv_events_and_metrics_leave_the_fast_paths_open(warnings_seen: _Warnings) -> None:
    """``mgr.kv_events()`` and ``kvoffload.metrics.register`` attach no listener: the
    fast paths stay open and nothing warns."""
    mgr = _mgr()
    mgr.kv_events()
    try:
        from kvoffload.metrics import register
    except ImportError:  # prometheus_client absent: kv_events alone
        register = None
    if register is not None:
        import prometheus_client

        register(mgr, registry=prometheus_client.CollectorRegistry())
    lc = mgr.admit(0, [1, 2, 3])
    full = _count(mgr.core, "extend")
    for t in range(10):
        lc.extend([t])
    assert _fast(lc) and full == []
    assert warnings_seen.events == []
    _close(mgr, [lc])


def test_debug_on_a_logger_kvoffload_does_not_use_leaves_the_fast_paths_open(
    warnings_seen: _Warnings,
) -> None:
    """DEBUG on another library's logger (``sglang``) is not kvoffload's debug: admitted
    lifecycles keep their fast paths and nothing warns."""
    other = logging.getLogger("sglang")
    level = other.level
    other.setLevel(logging.DEBUG)
    try:
        mgr = _mgr()
        lc = mgr.admit(0, [1, 2, 3])
        assert _fast(lc)
        assert warnings_seen.events == []
        _close(mgr, [lc])
    finally:
        other.setLevel(level)


def test_debug_logging_of_kvoffload_warns_once_per_manager(warnings_seen: _Warnings) -> None:
    """kvoffload's logger at DEBUG turns the fast paths off (its debug events are built)
    and each manager logs ``manager.fast_paths_off`` once, naming debug logging, however
    many requests it admits and listeners come and go."""
    STDLIB_LOGGER.setLevel(logging.DEBUG)
    a, b = _mgr(), _mgr()
    lcs = [m.admit(i, [1, 2, 3]) for m in (a, b) for i in range(3)]
    assert not any(_fast(lc) for lc in lcs)
    a.add_listener(lambda *_: None)()
    a.admit(9, [1])
    events = warnings_seen.events
    assert len(events) == 2, events
    assert all(e["debug_logging"] is True and "debug logging" in e["reason"] for e in events)
    _close(a, [lc for lc in a.core.live.values()])
    _close(b, [lc for lc in b.core.live.values()])
