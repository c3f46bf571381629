"""Engine-owned KV memory (issue 10): kvoffload copies the engine's own pages, only
after their KV is written (F19), waits for what the engine says (F26), frees nothing,
and tells the engine when it may reuse them (``on_released``)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from support import PlainIssuer, toks

import kvoffload as kvo
from kvoffload.backends._cuda import order_after, queue_copy
from kvoffload.pools import DevicePool, EnginePages, HostPool, host_tensor
from kvoffload.testing import SimBackend

PAGE = 4


def engine_config(**changes: Any) -> kvo.OffloadConfig:
    fields: dict[str, Any] = dict(
        page_size=PAGE, stride=PAGE, device_pages=None, host_pages=16, drain_timeout_s=5
    )
    fields.update(changes)
    return kvo.OffloadConfig(**fields)


def engine_kv(pages: int = 32, layers: int = 2) -> list[torch.Tensor]:
    """Per-layer K and V buffers, each (num_pages, page_size, heads, dim), as SGLang's."""
    return [torch.zeros(pages, PAGE, 2, 3, dtype=torch.float16) for _ in range(2 * layers)]


def write(kv: list[torch.Tensor], page: int, slot: int, value: float) -> None:
    for i, t in enumerate(kv):
        t[page, slot] = value + i / 10


def page_bytes(kv: list[torch.Tensor], page: int) -> bytes:
    return b"".join(t[page].contiguous().view(torch.uint8).numpy().tobytes() for t in kv)


# --- configuration and bad input -----------------------------------------------------


def test_engine_owned_mode_needs_device_kv_and_owned_mode_refuses_it() -> None:
    """device_pages=None without device_kv, and device_kv with device_pages=N, are
    ConfigErrors that say what to do."""
    with pytest.raises(kvo.ConfigError, match="needs device_kv"):
        kvo.SyncOffloadManager(engine_config(), backend="sim")
    with pytest.raises(kvo.ConfigError, match="device_pages=None"):
        kvo.SyncOffloadManager(engine_config(device_pages=8), backend="sim", device_kv=engine_kv())


@pytest.mark.parametrize(
    ("kv", "words"),
    [
        ([], "non-empty"),
        ([torch.zeros(8, PAGE + 1, 2)], "page_size=4"),
        ([torch.zeros(8, PAGE, 2), torch.zeros(9, PAGE, 2)], "pages"),
        ([torch.zeros(8, PAGE, 2).transpose(1, 2)], "page_size"),
        ([torch.zeros(8, 2, PAGE).transpose(1, 2)], "contiguous"),
        (["not a tensor"], "not a torch.Tensor"),
    ],
    ids=["empty", "page-size", "page-count", "shape", "not-contiguous", "not-a-tensor"],
)
def test_bad_device_kv_is_a_config_error_naming_the_tensor(kv: Any, words: str) -> None:
    with pytest.raises(kvo.ConfigError, match=words):
        kvo.SyncOffloadManager(engine_config(), backend="sim", device_kv=kv)


def _state(mgr: kvo.SyncOffloadManager) -> tuple[Any, ...]:
    dev = mgr.device_pool
    assert isinstance(dev, EnginePages)
    return (mgr.statistics(), bytes(dev._held), dev.used)


@pytest.mark.parametrize(
    ("pages", "words"),
    [
        ([0], "start 2 new page"),
        ([0, 0], "named twice"),
        ([0, 99], "out of range"),
        ([0, 5], "held by another"),
        ([0, "1"], "not an int"),
        ([0, True], "not an int"),
        (7, "sequence"),
    ],
    ids=["count", "twice", "range", "held", "str", "bool", "not-a-list"],
)
def test_bad_pages_at_admit_raise_page_error_and_change_nothing(pages: Any, words: str) -> None:
    """A wrong count, a duplicate, an id out of range, one another live lifecycle holds,
    or not an id at all: PageError naming it, nothing changed."""
    kv = engine_kv()
    with kvo.SyncOffloadManager(engine_config(), backend="sim", device_kv=kv) as mgr:
        mgr.admit("holder", toks(0, 4), pages=[5])
        before = _state(mgr)
        with pytest.raises(kvo.PageError, match=words):
            mgr.admit("r", toks(0, 6), pages=pages)  # 6 tokens start 2 pages
        assert _state(mgr) == before
        mgr.check_invariants()


def test_bad_pages_at_extend_raise_page_error_and_change_nothing() -> None:
    """extend's pages are exactly the new pages the tokens start: none given when one is
    needed, too many, a held one - PageError, the lifecycle as it was."""
    kv = engine_kv()
    with kvo.SyncOffloadManager(engine_config(stride=8), backend="sim", device_kv=kv) as mgr:
        other = mgr.admit("o", toks(0, 4), pages=[9])
        lc = mgr.admit("r", toks(0, 3), pages=[1])
        lc.extend([3])  # fills page 1: no new page, pages=None is fine
        before = (_state(mgr), list(lc.device_pages), lc.committed)
        for kwargs, words in [
            ({}, "pass the engine's page"),
            ({"pages": []}, "start 1 new page"),
            ({"pages": [2, 3]}, "start 1 new page"),
            ({"pages": [9]}, "held by another"),
        ]:
            with pytest.raises(kvo.PageError, match=words):
                lc.extend([4], **kwargs)
            assert (_state(mgr), list(lc.device_pages), lc.committed) == before
        lc.extend([4, 5, 6, 7, 8], pages=[2, 3])  # two new pages, in token order
        assert lc.device_pages == [1, 2, 3]
        other.abort()
        lc.abort()
        mgr.backend.complete_all()  # type: ignore[attr-defined]
        mgr.poll()
        mgr.check_invariants()


def test_owned_mode_refuses_engine_pages() -> None:
    """pages= in owned mode (device_pages=N) is refused with what to do, nothing changed."""
    config = kvo.OffloadConfig(page_size=PAGE, stride=PAGE, device_pages=8, host_pages=8)
    with kvo.SyncOffloadManager(config, backend="sim") as mgr:
        with pytest.raises(kvo.KVOffloadError, match="owns its device pool"):
            mgr.admit("r", toks(0, 4), pages=[0])
        lc = mgr.admit("r", toks(0, 3))
        with pytest.raises(kvo.KVOffloadError, match="owns its device pool"):
            lc.extend([3, 4], pages=[1])
        assert mgr.statistics().device_pages_used == 1 and lc.committed == 3


# --- the engine's pages ----------------------------------------------------------------


def test_kvoffload_never_frees_engine_pages_and_tells_the_engine_once() -> None:
    """Engine pages are only recorded: at RELEASED they are forgotten and on_released is
    called exactly once, with the engine's tag; the engine's tensors are untouched."""
    kv = engine_kv()
    snapshot = [t.clone() for t in kv]
    released: list[kvo.Lifecycle] = []
    backend = SimBackend()
    with kvo.SyncOffloadManager(
        engine_config(), backend=backend, device_kv=kv, on_released=released.append
    ) as mgr:
        req = object()
        lc = mgr.admit("r", toks(0, 4), pages=[7], tag=req)
        lc.extend(toks(4, 8), pages=[3])
        (t,) = backend.pending
        assert t.tag is req and lc.tag is req and t.device_pages == [3]
        lc.finish()
        assert released == [] and mgr.device_pool.used == 2
        backend.complete(t)
        mgr.poll()
        assert released == [lc] and lc.device_pages == [] and mgr.device_pool.used == 0
        mgr.check_invariants()
    assert all(torch.equal(a, b) for a, b in zip(kv, snapshot, strict=True))
    assert released == [lc]


def test_on_released_that_raises_reaches_the_caller_with_the_ledger_consistent() -> None:
    """An on_released that raises: the error comes out of the call that released (here
    poll()), the other callbacks of the batch still ran, and the ledger balances."""
    calls: list[str] = []

    def on_released(lc: kvo.Lifecycle) -> None:
        calls.append(lc.rid)
        if lc.rid == "bad":
            raise RuntimeError("engine bug")

    backend = SimBackend()
    config = kvo.OffloadConfig(page_size=PAGE, stride=PAGE, device_pages=8, host_pages=8)
    with kvo.SyncOffloadManager(config, backend=backend, on_released=on_released) as mgr:
        for rid in ("bad", "good"):
            lc = mgr.admit(rid, toks(0, 4))
            lc.extend(toks(4, 8))
            lc.finish()
        backend.complete_all()
        with pytest.raises(RuntimeError, match="engine bug"):
            mgr.poll()
        assert calls == ["bad", "good"]
        mgr.check_invariants()
        assert mgr.statistics().live_lifecycles == 0


# --- stored= --------------------------------------------------------------------------


def test_a_resumed_request_continues_its_chain_where_it_stopped() -> None:
    """admit(stored=n): pages before n are never copied, the chain continues from the
    stored prefix's key, and the pages after it go out (at once when a stride is due)."""
    backend = SimBackend()
    tokens = toks(100, 124)  # 6 pages
    with kvo.SyncOffloadManager(engine_config(stride=8), backend=backend, device_kv=engine_kv()) as mgr:
        lc = mgr.admit("resumed", tokens[:20], pages=[0, 1, 2, 3, 4], stored=8)
        (t,) = backend.pending  # 12 unstored tokens: one stride (2 pages) is due at once
        full = kvo.chain_keys(None, tokens, PAGE)
        assert (t.first_token, t.n_tokens) == (8, 8) and t.keys == full[2:4]
        lc.extend(tokens[20:24], pages=[5])
        lc.finish()
        assert [x.keys for x in backend.pending] == [full[2:4], full[4:6]]
        backend.complete_all()
        mgr.poll()
        assert lc.outcome is kvo.Outcome.COMPLETED and mgr.statistics().pages_lost == 0


@pytest.mark.parametrize("stored", [-4, 3, 24, 4.0, True])
def test_a_bad_stored_count_is_refused_with_nothing_changed(stored: Any) -> None:
    with kvo.SyncOffloadManager(engine_config(), backend="sim", device_kv=engine_kv()) as mgr:
        before = _state(mgr)
        with pytest.raises(kvo.InvalidTokens, match="stored="):
            mgr.admit("r", toks(0, 8), pages=[0, 1], stored=stored)
        assert _state(mgr) == before


# --- F19 and F26 -----------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["owned", "engine"])
@pytest.mark.parametrize("step", [1, 4, "prompt"])
def test_f19_a_copy_never_reads_a_page_before_the_engine_could_write_it(mode: str, step: Any) -> None:
    """F19: one-token, multi-token and whole-prompt steps on the cpu backend, the KV
    written right after the call that handed the page out (as docs/integration.md
    allows): every stored page equals the engine's KV. (kvoffload v0.1 stored the
    previous occupant's bytes for 564 of 600 pages.)"""
    engine = mode == "engine"
    kv = engine_kv(pages=64) if engine else None
    config = kvo.OffloadConfig(
        page_size=PAGE,
        stride=PAGE,
        device_pages=None if engine else 64,
        host_pages=64,
        kv_shape=(2, 3),
        dtype="float16",
        offload_prompt=True,
        drain_timeout_s=10,
    )
    mgr = kvo.SyncOffloadManager(config, backend="cpu", storage="memory", device_kv=kv).open()
    free = list(range(63, -1, -1))
    written: dict[tuple[int, int], float] = {}

    def put(lc: kvo.Lifecycle, first: int, n: int, uid: int) -> None:
        for pos in range(first, first + n):
            page, slot = lc.device_pages[pos // PAGE], pos % PAGE
            value = float(uid * 100 + pos)
            if engine:
                assert kv is not None
                write(kv, page, slot, value)
            else:
                mgr.device_pool.tensor[page, slot] = value
            written[(uid, pos)] = value

    checked = 0
    try:
        for uid in range(12):  # page reuse: each request gets the pages the last one freed
            prompt = toks(uid * 1000, uid * 1000 + (12 if step == "prompt" else 1))
            need = -(-len(prompt) // PAGE)
            pages = [free.pop() for _ in range(need)] if engine else None
            lc = mgr.admit(f"r{uid % 3}", prompt, pages=pages)
            put(lc, 0, len(prompt), uid)  # after admit, before the next poll: the prompt chunk waits
            mgr.poll()
            n = len(prompt)
            for _ in range(3):
                k = 1 if step == "prompt" else step
                new = -(-(n + k) // PAGE) - -(-n // PAGE)
                pages = [free.pop() for _ in range(new)] if engine else None
                lc.extend(toks(n, n + k), pages=pages)
                put(lc, n, k, uid)  # the KV of a page this call handed out, right after it
                mgr.poll()
                n += k
            tokens = prompt + toks(len(prompt), n)
            lc.finish()
            mgr.quiesce(10)
            while mgr.writes_pending:
                mgr.wait_progress(0.01)
                mgr.poll()
            whole = n - n % PAGE
            got = mgr.fetch(tokens, whole)
            assert len(got) == whole // PAGE
            for i, raw in enumerate(got):
                arr = torch.frombuffer(bytearray(raw), dtype=torch.float16)
                want = [written[(uid, i * PAGE + s)] for s in range(PAGE)]
                if engine:  # each tensor's rows, in order: tensor j holds value + j/10
                    rows = arr.view(len(kv or []), PAGE, 6)
                    ok = all(
                        torch.allclose(rows[j, s], torch.full((6,), want[s] + j / 10, dtype=torch.float16))
                        for j in range(rows.shape[0])
                        for s in range(PAGE)
                    )
                else:
                    rows = arr.view(PAGE, 6)
                    ok = all(torch.all(rows[s] == want[s]) for s in range(PAGE))
                assert ok, f"request {uid} page {i}: stored bytes are not the engine's KV"
                checked += 1
            if engine:
                free.extend(reversed(lc.device_pages or []))
                assert lc.released
    finally:
        mgr.close()
    assert checked >= 12


class _FakeEvent:
    def __init__(self) -> None:
        self.recorded = False

    def record(self, stream: Any = None) -> None:
        self.recorded = True

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class _FakeStream:
    def __init__(self) -> None:
        self.waited: list[tuple[str, Any]] = []

    def wait_event(self, ev: Any) -> None:
        self.waited.append(("event", ev))

    def wait_stream(self, s: Any) -> None:
        self.waited.append(("stream", s))

    def query(self) -> bool:
        return True


def test_f26_the_copy_waits_on_what_the_engine_hands_over() -> None:
    """F26: the side stream waits on the event or stream passed with extend(ready=) -
    never on whatever stream happens to be current - and a ready that is neither is a
    BackendError. (The logic, on fakes; the GPU run is in test_cuda_logic.py.)"""
    side = _FakeStream()
    ev, forward = _FakeEvent(), _FakeStream()
    order_after(side, ev)
    order_after(side, forward)
    order_after(side, None)
    assert side.waited == [("event", ev), ("stream", forward)]
    with pytest.raises(kvo.BackendError, match="neither"):
        order_after(side, object())


def test_f26_ready_travels_with_the_transfer_to_the_backend() -> None:
    """extend(..., ready=x): the chunk it makes due carries x to the backend."""
    backend = SimBackend()
    ready = _FakeEvent()
    with kvo.SyncOffloadManager(engine_config(), backend=backend, device_kv=engine_kv()) as mgr:
        lc = mgr.admit("r", toks(0, 3), pages=[0])
        lc.extend([3], ready=ready)
        (t,) = backend.pending
        assert t.ready is ready
        lc.abort()
        backend.complete_all()


@pytest.mark.parametrize("engine", [False, True])
def test_the_cuda_copy_plan_moves_the_right_bytes(engine: bool) -> None:
    """queue_copy (the cuda backend's copy, device-agnostic) run on CPU tensors: owned
    pools and engine tensors, consecutive and scattered pages, the bytes land in the host
    pages the transfer names, laid out as a page of every tensor in order."""
    from kvoffload.abc import Transfer

    if engine:
        kv = [torch.randn(16, PAGE, 2, 3).to(torch.float16) for _ in range(4)]
        device: Any = EnginePages(kv, PAGE)
        host = HostPool.new(8, (device.page_bytes,), "uint8", zero=True)
    else:
        device = DevicePool.create(16, PAGE, (2, 3), "float16")
        device.tensor.normal_()
        host = HostPool.new(8, (PAGE, 2, 3), "float16", zero=True)
    for dev_pages, host_pages in ([[3, 4, 5], [0, 1, 2]], [[9, 2, 14, 7, 11, 0], [7, 3, 4, 5, 1, 6]]):
        t = Transfer(PlainIssuer(), dev_pages, host_pages, [], 0, PAGE * len(dev_pages), 0.0)
        queue_copy(device, host, t, torch.device("cpu"))
        for d, h in zip(dev_pages, host_pages, strict=True):
            got = host.tensor[h].contiguous().view(torch.uint8).numpy().tobytes()
            want = (
                page_bytes(kv, d)
                if engine
                else device.tensor[d].contiguous().view(torch.uint8).numpy().tobytes()
            )
            assert got == want


# --- the host pool ---------------------------------------------------------------------


class _FakeCudart:
    def __init__(self) -> None:
        self.registered: dict[int, int] = {}
        self.unregistered: list[int] = []

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:
        self.registered[ptr] = size
        return 0

    def cudaHostUnregister(self, ptr: int) -> int:
        self.unregistered.append(ptr)
        return 0


def test_the_pinned_host_pool_is_exactly_the_size_asked_for_and_unpinned_when_collected() -> None:
    """Pinning registers exactly the pool's bytes (no power-of-two rounding: 3 MiB + one
    page stays that, where torch's caching host allocator would take 4 MiB) and
    unregisters them when the tensor is collected."""
    import gc

    rt = _FakeCudart()
    t = host_tensor((3 * 256 + 1, 4096), torch.uint8, pin=True, zero=False, cudart=rt)
    ((ptr, size),) = rt.registered.items()
    assert size == t.nbytes == (3 * 256 + 1) * 4096 and ptr == t.data_ptr()
    del t
    gc.collect()
    assert rt.unregistered == [ptr]


def test_the_host_pool_is_not_zero_filled_unless_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    """host_zero=False (the default) allocates with torch.empty; True zero-fills."""
    made: list[str] = []
    real_empty, real_zeros = torch.empty, torch.zeros
    monkeypatch.setattr(torch, "empty", lambda *a, **k: (made.append("empty"), real_empty(*a, **k))[1])
    monkeypatch.setattr(torch, "zeros", lambda *a, **k: (made.append("zeros"), real_zeros(*a, **k))[1])
    host_tensor((4, 8), torch.uint8, pin=False, zero=False)
    host_tensor((4, 8), torch.uint8, pin=False, zero=True)
    assert made == ["empty", "zeros"]


def test_the_engines_own_host_buffer_is_used_as_is() -> None:
    """host_buffer=: the engine's (pinned) buffer becomes the host pool without a copy;
    one too small is a ConfigError with both sizes."""
    kv = engine_kv()
    need = 16 * sum(t[0].nbytes for t in kv)
    buf = torch.empty(need + 10, dtype=torch.uint8)
    with kvo.SyncOffloadManager(engine_config(), backend="sim", device_kv=kv, host_buffer=buf) as mgr:
        assert mgr.host_pool.tensor.data_ptr() == buf.data_ptr()
    with pytest.raises(kvo.ConfigError, match=f"{need:,}"):
        kvo.SyncOffloadManager(engine_config(), backend="sim", device_kv=kv, host_buffer=buf[:100])


@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA GPU here (torch.cuda.is_available() is False)"
)
def test_the_cuda_host_pool_is_pinned_and_sized_as_asked_on_a_gpu() -> None:
    """On a GPU: the cuda backend's host pool is page-locked and its pinned size is
    within 5% of what was asked (it is exact)."""
    kv = [torch.zeros(8, PAGE, 2, 3, dtype=torch.float16, device="cuda") for _ in range(2)]
    with kvo.SyncOffloadManager(engine_config(host_pages=1000), backend="cuda", device_kv=kv) as mgr:
        t = mgr.host_pool.tensor
        asked = 1000 * mgr.device_pool.page_bytes
        assert t.is_pinned() and abs(t.nbytes - asked) <= 0.05 * asked
