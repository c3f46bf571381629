"""Bad input at the core's boundary (issue 19): every path that takes tokens or pages
agrees on what it accepts, and refuses the rest with a typed error before anything
changes - no half-applied batch, no page left recorded as held, counts as before.

The paths: ``admit``; ``Lifecycle.extend``'s one-token fast path, the step that makes
a chunk due (``OffloadCore.extend_due``), the multi-token fast path and the full path
(``OffloadCore.extend``); ``extend_batch``'s quiet pass, its checked path and its
array state (``kvoffload.core.rows``, from ``rows_min`` lifecycles).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from test_manager import snapshot as lifecycle_snapshot

import kvoffload as kvo
from kvoffload.abc import Transfer
from kvoffload.core.offload import OffloadCore
from kvoffload.pools import DevicePool, EnginePages, HostPool

PS = 2  # page size
PAGES = 1024  # device pages


def make_core(
    engine: bool, *, stride: int = 4, host: int = 16, rows_min: int | None = None, **cfg: Any
) -> tuple[OffloadCore, list[Transfer]]:
    """A bare core with a sim-like sink; engine-owned (``device_pages=None``) or owned."""
    config = kvo.OffloadConfig(
        page_size=PS,
        stride=stride,
        device_pages=None if engine else PAGES,
        host_pages=host,
        kv_shape=(1,),
        dtype="float32",
        **cfg,
    )
    device: Any
    if engine:
        device = EnginePages([torch.zeros(PAGES, PS, 1)], PS)
        hostpool = HostPool.new(host, (device.page_bytes,), "uint8")
    else:
        device = DevicePool.create(PAGES, PS, (1,), "float32")
        hostpool = HostPool.new(host, (PS, 1), "float32")
    jobs: list[Transfer] = []
    core = OffloadCore(config, device_pool=device, host_pool=hostpool, accept=jobs.append)
    if rows_min is not None:
        core.step.rows_min = rows_min
    return core, jobs


def observe(core: OffloadCore) -> list[str]:
    """Attach a listener (as ``mgr.add_listener`` does); returns the event names seen."""
    seen: list[str] = []
    core.listeners.append(lambda name, fields: seen.append(name))
    core.refresh_observed()
    return seen


def snapshot(core: OffloadCore, jobs: list[Transfer]) -> Any:
    """Everything an input error must leave as it was."""
    dev = core.device_pool
    held = bytes(dev._held) if isinstance(dev, EnginePages) else bytes(dev._allocated)
    shared = dict(getattr(dev, "_shared", {}))
    lcs = [(lc.id, *lifecycle_snapshot(lc)) for lc in core.live.values()]
    sent = [(t.keys, t.first_token, t.n_tokens, list(t.device_pages)) for t in jobs]
    return lcs, sent, core.statistics(), held, shared, dev.used


def outcome(f: Callable[[], object]) -> type[BaseException] | None:
    try:
        f()
    except Exception as exc:
        return type(exc)
    return None


# --- 1-3: owned mode, pages=[] ---------------------------------------------------------

#: Each path of owned mode: (name, setup) where ``setup(core)`` admits what the path
#: needs and returns the call to make with ``pages``. Page size 2, stride 4, nothing
#: stored: a 4-token prompt sends its chunk at admit (the next is due at 8); a 3-token
#: prompt holds 2 pages and its 4th token makes a chunk due.
Setup = Callable[[OffloadCore], Callable[[Any], object]]


def _lc(core: OffloadCore, n: int) -> kvo.Lifecycle:
    """A fresh lifecycle of ``n`` prompt tokens (nothing stored: every page counts)."""
    return core.admit(f"r{len(core.live)}", list(range(1, n + 1)), stored=0)


def _extend(n: int, tokens: list[int]) -> Setup:
    def setup(core: OffloadCore) -> Callable[[Any], object]:
        lc = _lc(core, n)
        return lambda pages: lc.extend(tokens, pages=pages)

    return setup


def _batch(prompts: list[int], tokens: list[Any], rows: bool = False) -> Setup:
    def setup(core: OffloadCore) -> Callable[[Any], object]:
        lcs = [_lc(core, n) for n in prompts]
        if rows:  # seat the rows with a step that needs no page
            core.extend_batch(lcs, [9] * len(lcs))
        return lambda pages: core.extend_batch(lcs, tokens, pages=[pages] * len(lcs))

    return setup


OWNED_PATHS = {
    "admit": lambda core: lambda pages: core.admit("x", [1, 2, 3], pages=pages),
    "extend-1": _extend(4, [5]),  # the one-token fast path, a new page
    "extend-due": _extend(3, [4]),  # the token that makes a chunk due (extend_due)
    "extend-multi": _extend(4, [5, 6]),  # the multi-token fast path, a new page
    "extend-full": _extend(3, [4, 5]),  # the full path: a new page and a chunk due
    "batch-quiet": _batch([4, 4], [5, 5]),
    "batch-checked": _batch([4, 3], [[5, 6], [4, 5, 6]]),
    "batch-rows": _batch([3, 3, 3], [5, 5, 5], rows=True),
}


@pytest.mark.parametrize("path", list(OWNED_PATHS))
@pytest.mark.parametrize("empty", [[], ()], ids=["list", "tuple"])
def test_owned_mode_empty_pages_mean_no_pages_on_every_path(path: str, empty: Any) -> None:
    """Owned mode (``device_pages=N``): ``pages=[]`` (or ``()``) is the same as leaving
    ``pages`` out, on every path - admit, the one-token and multi-token extends, the step
    that makes a chunk due, the full path, and extend_batch's quiet, checked and
    array-state paths. It was refused by admit and by a full-path step that took a new
    page (a listener puts every step there)."""
    results = []
    for pages in (None, empty):
        core, jobs = make_core(False, rows_min=1 if path == "batch-rows" else None)
        OWNED_PATHS[path](core)(pages)
        core.check_invariants()
        results.append(snapshot(core, jobs))
    assert results[0] == results[1]


@pytest.mark.parametrize("path", list(OWNED_PATHS))
def test_owned_mode_refuses_page_ids_on_every_path_with_nothing_changed(path: str) -> None:
    """Owned mode: a non-empty ``pages`` is refused on every path, naming what to do,
    with nothing changed."""
    core, jobs = make_core(False, rows_min=1 if path == "batch-rows" else None)
    call = OWNED_PATHS[path](core)
    before = snapshot(core, jobs)
    with pytest.raises(kvo.KVOffloadError, match="owns its device pool"):
        call([0])
    assert snapshot(core, jobs) == before
    core.check_invariants()


def test_extend_batch_never_half_applies_a_batch_it_validated() -> None:
    """Owned mode: a batch whose second entry takes a new page with ``pages=[]`` passed
    validation, then its first entry was applied and the second raised. A batch is
    applied whole or not at all (apart from a mover that refuses a chunk)."""
    core, _ = make_core(False)
    a, b = _lc(core, 3), _lc(core, 3)
    core.extend_batch([a, b], [[4], [4, 5]], pages=[[], []])
    assert (a.committed, b.committed) == (4, 5)
    assert len(b.device_pages) == 3
    core.check_invariants()


#: Inputs for extend, each on a fresh lifecycle of 3 prompt tokens (stride 4, so the
#: fast path applies below 4 + 4 tokens): (mode, tokens, pages).
EXTEND_INPUTS = [
    ("owned", [4, 5], []),
    ("owned", [4, 5], None),
    ("owned", [4, 5], [0]),
    ("owned", [4], np.array([], dtype=np.int64)),
    ("owned", [4, 5, 6], np.array([7])),
    ("owned", [4, 5], 0),
    ("owned", [True], None),
    ("owned", [4, 2**32], None),
    ("owned", [np.int64(4), 5], None),
    ("owned", [4.0], None),
    ("engine", [4], None),
    ("engine", [4], []),
    ("engine", [4, 5], []),
    ("engine", [4, 5], [9]),
    ("engine", [4, 5], np.array([9])),
    ("engine", [4, 5], np.array([0])),
    ("engine", [4], np.array([0])),
    ("engine", [4], [0]),
    ("engine", [4, 5, 6, 7, 8], [9, 10]),
    ("engine", [4, 5], {9}),
    ("engine", [4, 5], [[9]]),
    ("engine", [4, 5], [np.int64(9)]),
    ("engine", [4, 5], [True]),
]


@pytest.mark.parametrize(("mode", "tokens", "pages"), EXTEND_INPUTS)
def test_a_listener_never_changes_whether_extend_raises(mode: str, tokens: Any, pages: Any) -> None:
    """The quiet fast path (no one observes events) and the observed path accept and
    refuse exactly the same extends, with the same effect. Owned mode's multi-token step
    with ``pages=[]`` was applied quietly and refused once a listener was attached."""
    for prompt in ([1, 2, 3], [1, 2, 3, 4]):  # a chunk due at the next token; due at 8
        results = []
        for listen in (False, True):
            core, jobs = make_core(mode == "engine", stride=4)
            if listen:
                observe(core)
            lc = core.admit("r", prompt, pages=[1, 2] if mode == "engine" else None, stored=0)
            before = snapshot(core, jobs)
            err = outcome(lambda: lc.extend(tokens, pages=pages))  # noqa: B023
            if err is not None:
                assert issubclass(err, kvo.KVOffloadError), err
                assert snapshot(core, jobs) == before
            core.check_invariants()
            results.append((err, snapshot(core, jobs)[:2], lc.device_pages))
        assert results[0] == results[1], prompt


# --- 4: engine pages must be ordered ---------------------------------------------------

UNORDERED: dict[str, Callable[[list[int]], Any]] = {
    "set": set,
    "frozenset": frozenset,
    "dict": dict.fromkeys,
    "keys": lambda ids: dict.fromkeys(ids).keys(),
    "values": lambda ids: {i: p for i, p in enumerate(ids)}.values(),
    "items": lambda ids: dict.fromkeys(ids).items(),
}


@pytest.mark.parametrize("kind", list(UNORDERED))
@pytest.mark.parametrize("path", ["admit", "extend", "batch", "batch-pages"])
def test_engine_pages_in_an_unordered_collection_are_refused(kind: str, path: str) -> None:
    """A set (or a dict, or a dict view) of page ids has no token order: its hash order
    stored each page's KV under another page's key. Refused with a PageError that says
    so, on every path, before anything changes."""
    core, jobs = make_core(True)
    ids = [17, 3, 9]
    lc = core.admit("a", [1, 2], pages=[40], stored=0)
    other = core.admit("b", [1, 2], pages=[41], stored=0)
    before = snapshot(core, jobs)
    with pytest.raises(kvo.PageError, match="order"):
        if path == "admit":
            core.admit("r", list(range(6)), pages=UNORDERED[kind](ids), stored=0)
        elif path == "extend":
            lc.extend(list(range(6)), pages=UNORDERED[kind](ids))
        elif path == "batch":
            core.extend_batch([lc, other], [list(range(6)), [5]], pages=[UNORDERED[kind](ids), [20]])
        else:  # the batch's own list of entries
            core.extend_batch(
                [lc], [[5]], pages=UNORDERED[kind]([20]) if kind != "values" else {0: [20]}.values()
            )
    assert snapshot(core, jobs) == before
    core.check_invariants()


ORDERED: dict[str, Callable[[list[int]], Any]] = {
    "list": list,
    "tuple": tuple,
    "range": lambda ids: range(ids[0], ids[0] + len(ids)),
    "numpy": lambda ids: np.array(ids, dtype=np.int64),
    "numpy-uint32": lambda ids: np.array(ids, dtype=np.uint32),
    "torch": lambda ids: torch.tensor(ids),
    "numpy-ints": lambda ids: [np.int64(p) for p in ids],
}


@pytest.mark.parametrize("kind", list(ORDERED))
@pytest.mark.parametrize("path", ["admit", "extend", "batch"])
def test_engine_pages_in_an_ordered_sequence_are_taken_in_order(kind: str, path: str) -> None:
    """Lists, tuples, ranges, integer numpy arrays and torch tensors (and numpy ints in
    a list) are page ids in token order, on every path; the ids recorded are Python ints."""
    core, _ = make_core(True)
    ids = [10, 11, 12]
    lc = core.admit("a", [1, 2], pages=[40], stored=0)
    if path == "admit":
        lc = core.admit("r", list(range(6)), pages=ORDERED[kind](ids), stored=0)
        got = lc.device_pages
    elif path == "extend":
        lc.extend(list(range(6)), pages=ORDERED[kind](ids))
        got = lc.device_pages[1:]
    else:
        core.extend_batch([lc], [list(range(6))], pages=[ORDERED[kind](ids)])
        got = lc.device_pages[1:]
    assert got == ids and all(type(p) is int for p in got)
    core.check_invariants()


@pytest.mark.parametrize(
    ("pages", "words"),
    [
        (np.array([1.0, 2.0, 3.0]), "integer"),
        (np.array([True, False, True]), "integer"),
        (np.array([[1, 2, 3]]), "one-dimensional"),
        ([1, 2, 3.0], "not an int"),
        ([1, 2, np.float64(3)], "not an int"),
        ([1, 2, np.True_], "not an int"),
        ("abc", "sequence"),
        (iter([1, 2, 3]), "sequence"),
    ],
    ids=["float-array", "bool-array", "2d-array", "float", "numpy-float", "numpy-bool", "str", "iterator"],
)
def test_engine_page_ids_that_are_not_integers_are_refused(pages: Any, words: str) -> None:
    core, jobs = make_core(True)
    before = snapshot(core, jobs)
    with pytest.raises(kvo.PageError, match=words):
        core.admit("r", list(range(6)), pages=pages, stored=0)
    assert snapshot(core, jobs) == before


# --- 5: device_kv with no pages ---------------------------------------------------------


@pytest.mark.parametrize(
    "kv",
    [torch.zeros(0, PS, 1), [torch.zeros(0, PS, 2), torch.zeros(0, PS, 2)], torch.zeros(8, PS, 0)],
    ids=["no-pages", "no-pages-two", "empty-page"],
)
def test_device_kv_with_no_pages_or_empty_pages_is_a_config_error(kv: Any) -> None:
    """A device_kv of 0 pages (or of 0-byte pages) passed validation and failed at the
    first copy with torch's raw RuntimeError: it is a ConfigError at construction."""
    with pytest.raises(kvo.ConfigError, match="device_kv"):
        EnginePages(kv if isinstance(kv, list) else [kv], PS)
    config = kvo.OffloadConfig(page_size=PS, stride=4, device_pages=None, host_pages=4)
    with pytest.raises(kvo.ConfigError, match="device_kv"):
        kvo.SyncOffloadManager(config, backend="sim", device_kv=kv)


# --- 6: extend_batch, the same inputs on every path ------------------------------------


def test_extend_batch_numpy_page_ids_on_a_multi_token_step_are_taken_and_not_leaked() -> None:
    """numpy page ids on a multi-token step raised a false PageError ("held by another
    live lifecycle") and the ids stayed recorded as held for good. They are taken as
    the engine's pages, and an input error leaves none recorded."""
    core, jobs = make_core(True)
    lcs = [core.admit(f"r{i}", [1, 2], pages=[i], stored=0) for i in range(3)]
    pages = [np.array([10 + i]) for i in range(3)]
    core.extend_batch(lcs, [[3, 4]] * 3, pages=pages)
    assert [lc.device_pages for lc in lcs] == [[0, 10], [1, 11], [2, 12]]
    assert core.device_pool.used == 6
    core.check_invariants()
    before = snapshot(core, jobs)
    with pytest.raises(kvo.InvalidTokens):  # the last entry is bad: nothing claimed
        core.extend_batch(lcs, [[5, 6], [5, 6], [5, -1]], pages=[np.array([20 + i]) for i in range(3)])
    assert snapshot(core, jobs) == before
    core.extend_batch(lcs, [[5, 6]] * 3, pages=[[20 + i] for i in range(3)])  # the ids are free
    core.check_invariants()


@pytest.mark.parametrize("bad", [None, "a string", 7, object()], ids=["None", "str", "int", "object"])
@pytest.mark.parametrize("where", [0, 2])
@pytest.mark.parametrize("n", [3, 50], ids=["loop", "rows"])
def test_extend_batch_an_entry_that_is_not_a_lifecycle_changes_nothing(bad: Any, where: int, n: int) -> None:
    """A None (or anything else) among the lifecycles applied the entries before it,
    then raised AttributeError: an engine that retried the step gave those requests the
    token twice. It is a KVOffloadError naming the entry, raised before any entry."""
    core, jobs = make_core(False)
    lcs: list[Any] = [_lc(core, 3) for _ in range(n)]
    core.extend_batch(lcs, [4] * n)
    lcs[where] = bad
    before = snapshot(core, jobs)
    with pytest.raises(kvo.KVOffloadError, match=rf"lifecycles\[{where}\]"):
        core.extend_batch(lcs, [5] * n)
    assert snapshot(core, jobs) == before
    core.check_invariants()


@pytest.mark.parametrize(
    "pages",
    [[[[10]], None, None], [[10, [11]], None, None], [None, None, [[12]]]],
    ids=["nested", "inner", "last"],
)
def test_extend_batch_a_nested_page_list_is_a_page_error(pages: Any) -> None:
    """A page list inside a page list raised TypeError (unhashable): a PageError naming
    the entry, nothing changed."""
    core, jobs = make_core(True)
    lcs = [core.admit(f"r{i}", [1, 2], pages=[i], stored=0) for i in range(3)]
    before = snapshot(core, jobs)
    with pytest.raises(kvo.PageError):
        core.extend_batch(lcs, [[3, 4], [3, 4], [3, 4]], pages=pages)
    assert snapshot(core, jobs) == before


TOKEN_KINDS: dict[str, Callable[[list[int]], Any]] = {
    "list": list,
    "tuple": tuple,
    "numpy-ints": lambda ids: [np.int64(t) for t in ids],
    "numpy-uint32-ints": lambda ids: [np.uint32(t) for t in ids],
    "numpy": lambda ids: np.array(ids, dtype=np.int64),
    "numpy-uint32": lambda ids: np.array(ids, dtype=np.uint32),
    "torch": lambda ids: torch.tensor(ids),
    "column": lambda ids: np.array(ids, dtype=np.int64)[:, None],  # one row per lifecycle
}


@pytest.mark.parametrize("kind", list(TOKEN_KINDS))
@pytest.mark.parametrize("n", [3, 47, 48, 60])
def test_extend_batch_takes_the_same_tokens_below_and_above_rows_min(kind: str, n: int) -> None:
    """numpy token ids were accepted from 48 lifecycles up (the array state) and refused
    below, so a scheduler crashed when its batch shrank. Every batch size takes integer
    numpy arrays, numpy ints and torch tensors as it takes a list of ints, with the
    same result as the per-request extends."""
    core, jobs = make_core(False, host=64)
    ref, ref_jobs = make_core(False, host=64)
    lcs = [_lc(core, 3) for _ in range(n)]
    refs = [_lc(ref, 3) for _ in range(n)]
    for step in range(6):
        ids = [(7 * i + step) % 50 for i in range(n)]
        core.extend_batch(lcs, TOKEN_KINDS[kind](ids))
        for lc, t in zip(refs, ids, strict=True):
            lc.extend([t])
        core.check_invariants()
    assert snapshot(core, jobs) == snapshot(ref, ref_jobs)


BAD_TOKENS: dict[str, Callable[[list[int]], Any]] = {
    "float-array": lambda ids: np.array(ids, dtype=np.float64),
    "bool-array": lambda ids: np.ones(len(ids), dtype=bool),
    "numpy-bool": lambda ids: [*ids[:-1], np.True_],
    "bool": lambda ids: [*ids[:-1], True],
    "negative-array": lambda ids: np.array([*ids[:-1], -1]),
    "wide-array": lambda ids: np.array([*ids[:-1], 2**63]),
    "numpy-float": lambda ids: [*ids[:-1], np.float64(3)],
    "none": lambda ids: [*ids[:-1], None],
    "set": lambda ids: set(range(len(ids))),
    "3d": lambda ids: np.zeros((len(ids), 1, 1), dtype=np.int64),
}


@pytest.mark.parametrize("kind", list(BAD_TOKENS))
@pytest.mark.parametrize("n", [3, 60], ids=["loop", "rows"])
def test_extend_batch_refuses_the_same_bad_tokens_below_and_above_rows_min(kind: str, n: int) -> None:
    """Bad token ids are refused with InvalidTokens by every batch size, before anything
    changes."""
    core, jobs = make_core(False, host=64)
    lcs = [_lc(core, 3) for _ in range(n)]
    core.extend_batch(lcs, [4] * n)  # seats the rows (n >= rows_min)
    before = snapshot(core, jobs)
    with pytest.raises(kvo.InvalidTokens):
        core.extend_batch(lcs, BAD_TOKENS[kind](list(range(n))))
    assert snapshot(core, jobs) == before
    core.check_invariants()


# --- 7: a stored prefix is shared -------------------------------------------------------


def _engine_mgr(**changes: Any) -> tuple[kvo.SyncOffloadManager, list[kvo.Lifecycle]]:
    released: list[kvo.Lifecycle] = []
    config = kvo.OffloadConfig(
        page_size=PS, stride=4, device_pages=None, host_pages=16, drain_timeout_s=5, **changes
    )
    kv = [torch.zeros(PAGES, PS, 2)]
    mgr = kvo.SyncOffloadManager(config, backend="sim", device_kv=kv, on_released=released.append)
    return mgr, released


def test_two_live_lifecycles_may_share_their_stored_prefix_pages() -> None:
    """Two requests whose prompts match a prefix cache's entry name the same page ids
    for the stored prefix (never copied by kvoffload): both are admitted; each keeps
    its own pages for what it will copy; on_released comes once per lifecycle and the
    shared pages stay recorded until the last of them is released."""
    mgr, released = _engine_mgr()
    with mgr:
        prompt = list(range(9))  # 4 whole pages stored (the default), the 5th is the lifecycle's
        a = mgr.admit("a", prompt, pages=[1, 2, 3, 4, 10])
        b = mgr.admit("b", prompt, pages=[1, 2, 3, 4, 11])
        c = mgr.admit("c", prompt[:5], pages=[1, 2, 12], stored=4)  # a shorter match
        mgr.check_invariants()
        assert mgr.statistics().device_pages_used == 7
        for lc, page in ((a, 20), (b, 21), (c, 22)):
            lc.extend([1, 2], pages=[page])
        mgr.check_invariants()
        assert all(t.device_pages[0] in (10, 11, 12) for t in mgr.backend.pending)  # type: ignore[attr-defined]
        a.abort()
        mgr.backend.complete_all()  # type: ignore[attr-defined]
        mgr.poll()
        assert released == [a]
        assert mgr.statistics().device_pages_used == 10 - 2  # a's own two went; the prefix stays
        mgr.check_invariants()
        with pytest.raises(kvo.PageError, match="held by another"):
            b.extend([3, 4, 5], pages=[2])  # a prefix page is no page to write into
        b.finish()
        c.finish()
        mgr.backend.complete_all()  # type: ignore[attr-defined]
        mgr.poll()
        assert released == [a, b, c]
        assert mgr.statistics().device_pages_used == 0
        mgr.check_invariants()


@pytest.mark.parametrize(
    ("first", "second", "stored"),
    [
        ([1, 2, 3, 4, 10], [1, 2, 3, 10, 11], None),  # b names a's own (copied) page as stored
        ([1, 2, 3, 4, 10], [5, 6, 7, 8, 1], None),  # b would copy a's shared prefix page
        ([1, 2, 3, 4, 10], [1, 2, 3, 4, 11], 0),  # b copies its prompt: pages exclusive
        ([1, 2, 3, 4, 10], [5, 5, 6, 7, 11], None),  # named twice in one prefix
    ],
    ids=["stored-over-copied", "copied-over-stored", "nothing-stored", "twice"],
)
def test_pages_kvoffload_will_copy_stay_exclusive(first: list[int], second: list[int], stored: Any) -> None:
    """Only a stored prefix is shared: a page kvoffload will copy is held by one live
    lifecycle and is no other's page, stored or not. Refused with PageError, nothing
    changed."""
    mgr, _ = _engine_mgr()
    with mgr:
        prompt = list(range(9))
        mgr.admit("a", prompt, pages=first)
        before = (mgr.statistics(), bytes(mgr.device_pool._held), dict(mgr.device_pool._shared))  # type: ignore[attr-defined]
        with pytest.raises(kvo.PageError, match=r"held by another|named twice"):
            mgr.admit("b", prompt, pages=second, stored=stored)
        assert (mgr.statistics(), bytes(mgr.device_pool._held), dict(mgr.device_pool._shared)) == before  # type: ignore[attr-defined]
        mgr.check_invariants()


def test_a_shared_prefix_survives_an_admit_the_mover_refuses() -> None:
    """offload_prompt=False, a resumed request's prompt chunk refused by the mover: the
    admit changes nothing, the other lifecycle's shared prefix pages included."""
    core, jobs = make_core(True)
    a = core.admit("a", list(range(9)), pages=[1, 2, 3, 4, 10])

    def refuse(t: Transfer) -> None:
        raise kvo.BackendError("refused")

    core.accept = refuse
    before = snapshot(core, jobs)
    with pytest.raises(kvo.BackendError):
        core.admit("b", [*range(9), 9, 9, 9], pages=[1, 2, 11, 12, 13, 14], stored=4)
    assert snapshot(core, jobs) == before
    core.check_invariants()
    assert a.device_pages == [1, 2, 3, 4, 10]


# --- every bad entry, every position, every batch size ---------------------------------

BAD_ENTRIES = [
    "lifecycle-none",
    "lifecycle-finished",
    "token-bool",
    "token-negative",
    "token-float",
    "token-none",
    "token-nested",
    "pages-set",
    "pages-nested",
    "pages-range-out",
    "pages-held",
    "pages-missing",
    "pages-twice",
    "pages-owned",
]


#: (mode, bad entry): engine page ids are bad in engine-owned mode, any page id in owned mode.
MODE_BAD = [
    (mode, bad)
    for mode in ("owned", "engine")
    for bad in BAD_ENTRIES
    if not bad.startswith("pages-") or (bad == "pages-owned") == (mode == "owned")
]


@pytest.mark.parametrize(("mode", "bad"), MODE_BAD)
@pytest.mark.parametrize("where", ["first", "middle", "last"])
@pytest.mark.parametrize("n", [3, 60], ids=["loop", "rows"])
def test_extend_batch_one_bad_entry_anywhere_changes_nothing(mode: str, bad: str, where: str, n: int) -> None:
    """A step where every entry takes a new page, with one bad entry (first, in the
    middle, last) at a batch size below and above rows_min: a typed error, and nothing
    applied - no token, no page recorded, counts as before."""
    engine = mode == "engine"
    core, jobs = make_core(engine, host=64)
    pages0 = [[2 * i, 2 * i + 1] for i in range(n)] if engine else [None] * n
    lcs: list[Any] = [core.admit(f"r{i}", [1, 2, 3], pages=pages0[i], stored=0) for i in range(n)]
    core.extend_batch(lcs, [4] * n)  # fills each second page; seats the rows (n >= rows_min)
    at = {"first": 0, "middle": n // 2, "last": n - 1}[where]
    tokens: list[Any] = [5] * n
    pages: list[Any] | None = [[500 + i] for i in range(n)] if engine else None
    if bad == "lifecycle-none":
        lcs[at] = None
    elif bad == "lifecycle-finished":
        lcs[at].finish()
    elif bad.startswith("token-"):
        tokens[at] = {"bool": True, "negative": -5, "float": 5.0, "none": None, "nested": [[5]]}[bad[6:]]
    elif bad == "pages-owned":
        pages = [None] * n
        pages[at] = [0]
    else:
        assert pages is not None
        pages[at] = {
            "set": {500 + at},
            "nested": [[500 + at]],
            "range-out": [PAGES],
            "held": [0 if at else 2],
            "missing": None,
            "twice": pages[(at + 1) % n],
        }[bad[6:]]
    before = snapshot(core, jobs)
    with pytest.raises(kvo.KVOffloadError):
        core.extend_batch(lcs, tokens, pages=pages)
    assert snapshot(core, jobs) == before
    core.check_invariants()
    if bad != "lifecycle-finished":  # the step, put right, applies whole
        good = [core.lifecycles()[i] for i in range(n)]
        core.extend_batch(good, [5] * n, pages=[[500 + i] for i in range(n)] if engine else None)
        assert all(lc.committed == 5 for lc in good)
        core.check_invariants()


@pytest.mark.parametrize("view", ["keys", "values", "items"])
def test_tokens_in_a_dict_view_are_refused(view: str) -> None:
    """Token ids in a dict view have no order of their own (a set's, or the dict's): the
    same InvalidTokens as a set or a dict, on extend and on extend_batch."""
    core, jobs = make_core(False)
    lc = _lc(core, 3)
    ids = getattr({5: 6, 7: 8}, view)()
    before = snapshot(core, jobs)
    with pytest.raises(kvo.InvalidTokens, match="order"):
        lc.extend(ids)
    with pytest.raises(kvo.InvalidTokens, match="order"):
        core.extend_batch([lc], [ids])
    assert snapshot(core, jobs) == before


def test_numpy_page_ids_keep_the_array_state() -> None:
    """Engine-owned mode, from rows_min lifecycles: a page step whose ids are numpy
    integers is taken by the array state itself (before, every such step gave every
    row back), with the same pages as a list of ints."""
    sides = []
    for kind in (int, np.int64):
        core, jobs = make_core(True, host=64, rows_min=1)
        lcs = [core.admit(f"r{i}", [1, 2, 3], pages=[2 * i, 2 * i + 1], stored=0) for i in range(4)]
        core.extend_batch(lcs, [4] * 4)
        rows = core.rows
        assert rows is not None and rows.attached == 4
        core.extend_batch(lcs, [5] * 4, pages=[[kind(100 + i)] for i in range(4)])
        assert rows.attached == 4  # no row given back
        assert all(type(p) is int for lc in lcs for p in lc.device_pages)
        core.check_invariants()
        sides.append(snapshot(core, jobs))
    assert sides[0] == sides[1]


@pytest.mark.parametrize("seed", range(12))
def test_shared_stored_prefixes_over_random_schedules(seed: int) -> None:
    """Random admits of requests that share one of a few cached prompt prefixes (their
    stored pages), decode steps with the engine's new pages, finishes, aborts and
    completions in any order: after every step the ledger holds, the record of every
    engine page is exactly what the live lifecycles hold (a shared page once, with its
    number of holders), no copy reads a shared page, and each lifecycle is released
    exactly once (its own pages go back to the engine then)."""
    import random

    rng = random.Random(seed)
    core, jobs = make_core(True, stride=4, host=32)
    released: list[kvo.Lifecycle] = []
    prefixes = [[100 + 10 * k + j for j in range(2 * (k + 1))] for k in range(3)]  # 2, 4, 6 pages
    free = list(range(200, PAGES))
    rng.shuffle(free)
    cached_of: dict[int, list[int]] = {}  # lifecycle id -> its stored prefix pages
    own_of: dict[int, list[int]] = {}  # lifecycle id -> the pages it was handed for itself

    def on_released(lc: kvo.Lifecycle) -> None:
        released.append(lc)
        free.extend(own_of.pop(lc.id))
        del cached_of[lc.id]

    core.host.on_released = on_released  # type: ignore[attr-defined]
    most = 0  # the most live lifecycles that shared one page at once
    for _ in range(150):
        running = [lc for lc in core.live.values() if lc.state.name in ("PENDING", "OFFLOADING")]
        op = rng.choice(["admit", "admit", "extend", "extend", "extend", "finish", "abort", "complete"])
        if op == "admit":
            k = rng.randrange(3)
            cached = prefixes[k][: rng.randint(0, len(prefixes[k]))]
            extra = rng.randint(0, 5)
            own = [free.pop() for _ in range(-(-extra // PS))]
            lc = core.admit(
                "r", list(range(len(cached) * PS + extra)), pages=cached + own, stored=len(cached) * PS
            )
            cached_of[lc.id], own_of[lc.id] = cached, own
        elif op == "extend" and running:
            lc = rng.choice(running)
            n = rng.randint(1, 5)
            new = [free.pop() for _ in range(-(-(lc.committed + n) // PS) - len(lc.device_pages))]
            lc.extend(list(range(n)), pages=new)
            own_of[lc.id] += new
        elif op in ("finish", "abort") and running:
            lc = rng.choice(running)
            (lc.finish if op == "finish" else lc.abort)()
        elif op == "complete" and jobs:
            rng.shuffle(jobs)
            done = [jobs.pop() for _ in range(rng.randint(1, len(jobs)))]
            for lc in core.complete([(t.id, None) for t in done]):
                on_released(lc)
        pool = core.device_pool
        assert isinstance(pool, EnginePages)
        for t in jobs:
            assert not any(pool.shared_count(p) for p in t.device_pages)
        core.check_invariants()
        want: dict[int, int] = {}
        for cached in cached_of.values():
            for p in cached:
                want[p] = want.get(p, 0) + 1
        assert pool._shared == want
        assert pool.used == len(want) + sum(map(len, own_of.values()))
        most = max(most, *want.values(), 0)
    for lc in list(core.live.values()):
        lc.abort()
    for lc in core.complete([(t.id, None) for t in jobs]):
        on_released(lc)
    assert core.device_pool.used == 0 and not core.live and not own_of
    assert len(released) == len({lc.id for lc in released}) == core.counters.admitted
    assert most >= 2  # the schedule did share pages
