"""The Mooncake Store tier against a real ``mooncake_master`` on loopback: its URL and
options, zero-copy batch calls on the host pool's memory, per-page truth of a batched
write (F34), records a reader checks (F38), loopback-only traffic, and a master that is
not there at open.

Without the ``kvoffload[mooncake]`` wheel (or Debian's ``libibverbs1``) the tests that need
a master skip with the reason; ``KVOFFLOAD_REQUIRE_MOONCAKE=1`` (CI, scripts/test.sh)
turns that skip into a failure (the ``mooncake_url`` / ``own_mooncake`` fixtures in
conftest.py).
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
import pytest_asyncio
from _mooncake_server import MooncakeServer
from _redis_server import free_port
from _storage_helpers import keys_of, mooncake_store, pages_of
from support import HANG_S

from kvoffload.errors import ConfigError, PartialWriteError, StorageError
from kvoffload.pools import HostPool
from kvoffload.storage import resolve_storage
from kvoffload.storage._record import encode_header
from kvoffload.storage.mooncake import OPTIONS, MooncakeStore
from kvoffload.storage.rank_keys import RankKeys

ROOT = Path(__file__).resolve().parents[2]


class Spy:
    """Stands in for the Mooncake client: records each call's arguments, then makes it."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self.calls: list[tuple[str, tuple[Any, ...]]] = []

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self.client, name)

        def call(*args: Any) -> Any:
            self.calls.append((name, args))
            return fn(*args)

        return call


class HeldReads(Spy):
    """The Mooncake client with each ``batch_get_into`` held until ``release`` is set
    (``entered`` says one is waiting): a read that outlives its caller."""

    def __init__(self, client: Any) -> None:
        super().__init__(client)
        self.release = threading.Event()
        self.entered = threading.Event()

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self.client, name)
        if name != "batch_get_into":
            return fn

        def held(*args: Any) -> Any:
            self.entered.set()
            self.release.wait(HANG_S)
            return fn(*args)

        return held


def pool_of(n: int, page_bytes: int) -> HostPool:
    import torch

    pool = HostPool.create(n, 1, (page_bytes,), "uint8")
    pool.tensor.copy_(torch.randint(0, 256, pool.tensor.shape, dtype=torch.uint8))
    return pool


def pool_page(pool: HostPool, p: int) -> bytes:
    return bytes(pool.tensor[p].numpy().tobytes())


# --- the URL and its options -------------------------------------------------------------


@pytest.mark.asyncio
async def test_a_mooncake_url_opens_the_store_with_its_options(mooncake_url: str) -> None:
    """resolve_storage takes mooncake://HOST:PORT with options as query parameters."""
    s = resolve_storage(f"{mooncake_url}?prefix=url-test:&global_segment_size=0&replicas=1&verify=1")
    try:
        assert isinstance(s, MooncakeStore)
        assert s.prefix == "url-test:" and s.settings.global_segment_size == 0
        assert s.master == mooncake_url.removeprefix("mooncake://")
        d = s.describe()
        assert d["storage"] == "mooncake" and d["master"] == s.master and d["verify"] is True
        await s.put(keys_of(1), pages_of(1))
        assert await s.get(keys_of(1)) == pages_of(1)
    finally:
        assert s is not None
        await s.aclose()


def test_unknown_options_are_refused_by_name() -> None:
    """A typo in a query parameter is a ConfigError naming it and the allowed ones
    (checked before anything connects)."""
    with pytest.raises(ConfigError, match=r"unknown option\(s\) bogus, segment_mb") as e:
        MooncakeStore("mooncake://127.0.0.1:1?segment_mb=4&bogus=1&prefix=x")
    for name in OPTIONS:
        assert name in str(e.value)


@pytest.mark.parametrize(
    "url, what",
    [
        ("mooncake://127.0.0.1", "HOST:PORT"),
        ("mooncake://127.0.0.1:1/path", "HOST:PORT"),
        ("mooncake://127.0.0.1:1?protocol=udp", "protocol"),
        ("mooncake://127.0.0.1:1?replicas=0", "replicas"),
        ("mooncake://127.0.0.1:1?timeout_s=soon", "timeout_s"),
        ("mooncake://127.0.0.1:1?timeout_s=0", "timeout_s"),
        ("mooncake://127.0.0.1:1?global_segment_size=lots", "global_segment_size"),
        ("mooncake://127.0.0.1:1?verify=maybe", "verify"),
    ],
)
def test_bad_values_are_config_errors(url: str, what: str) -> None:
    with pytest.raises(ConfigError, match=what):
        MooncakeStore(url)


def test_sizes_take_units() -> None:
    from kvoffload.storage.mooncake import _parse_size

    assert _parse_size("x", "4096") == 4096
    assert _parse_size("x", "64MiB") == 64 << 20
    assert _parse_size("x", "1GB") == 10**9
    assert _parse_size("x", "16mb") == 16 * 10**6


def test_a_master_that_is_not_there_is_a_storage_error_naming_it() -> None:
    """Nothing listens at the address: opening fails at once with the address in the
    message (no Mooncake retries; this needs no wheel)."""
    port = free_port()
    with pytest.raises(StorageError, match=f"cannot reach the master at 127.0.0.1:{port}"):
        MooncakeStore(f"mooncake://127.0.0.1:{port}?timeout_s=2")


def test_a_master_that_never_answers_is_a_storage_error_not_a_hang(mooncake_url: str) -> None:
    """Something accepts connections at the address but never speaks Mooncake's RPC:
    opening gives up within its bounds with a StorageError naming the address."""
    del mooncake_url  # the wheel must be there (the fixture skips or fails otherwise)
    with socket.socket() as mute:
        mute.bind(("127.0.0.1", 0))
        mute.listen(16)
        port = mute.getsockname()[1]
        result: list[BaseException | MooncakeStore] = []

        def open_it() -> None:
            try:
                result.append(MooncakeStore(f"mooncake://127.0.0.1:{port}?timeout_s=1"))
            except BaseException as exc:
                result.append(exc)

        t = threading.Thread(target=open_it, daemon=True)
        t.start()
        t.join(HANG_S * 2)
        assert not t.is_alive(), "opening a store on a mute master hung"
    assert isinstance(result[0], StorageError), result
    assert f"127.0.0.1:{port}" in str(result[0])


def test_import_kvoffload_loads_no_mooncake() -> None:
    """The extra is imported only when a mooncake store is made."""
    code = (
        "import sys, kvoffload, kvoffload.storage; print(sorted(m for m in sys.modules if 'mooncake' in m))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


# --- zero copy, per-page truth, records --------------------------------------------------


@pytest_asyncio.fixture
async def store(mooncake_url: str) -> AsyncIterator[MooncakeStore]:
    s = mooncake_store(mooncake_url)
    assert isinstance(s, MooncakeStore)
    try:
        yield s
    finally:
        await s.aclose()


@pytest.mark.asyncio
async def test_one_transfer_per_page_each_way_and_no_page_taken_out_as_bytes(
    store: MooncakeStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """put_pages never goes through put (no page taken out of the pool as bytes): each
    batch is one batch_upsert_from of whole records (header + page) from a registered
    arena, one transfer per page; get_into is one batch_get_into of whole records into
    an arena, the checked pages copied into the pool's pages. The bytes round-trip."""
    from kvoffload.drivers._base import load_buffers

    pool = pool_of(6, 4096)
    base, size = pool.tensor.data_ptr(), 4096

    async def no_put(*_: object) -> None:
        raise AssertionError("put_pages went through put (a copy out as bytes)")

    monkeypatch.setattr(store, "put", no_put)
    spy = Spy(store._client)
    store._client = spy  # the process's client of this master: put back below
    try:
        keys = keys_of(3)
        await store.put_pages(keys, pool, [4, 1, 2])
        want = [pool_page(pool, p) for p in (4, 1, 2)]
        records = [size + len(encode_header(k, b"")) for k in keys]
        puts = [args for name, args in spy.calls if name == "batch_upsert_from"]
        assert len(puts) == 1 and puts[0][0] == [store.prefix + k for k in keys] and puts[0][2] == records
        assert all(not base <= p < base + 6 * size for p in puts[0][1])  # from the arena
        assert not [n for n, _ in spy.calls if "multi" in n]
        pool.tensor[3:6].zero_()
        assert await store.get_into(keys, load_buffers(pool, [3, 5, 0])) == 3
        gets = [args for name, args in spy.calls if name == "batch_get_into"]
        assert len(gets) == 1 and gets[0][2] == records
        assert [pool_page(pool, p) for p in (3, 5, 0)] == want
        assert await store.get(keys) == want
    finally:
        store._client = spy.client


@pytest.mark.asyncio
async def test_a_batch_stored_in_part_says_which_pages(tmp_path: Path) -> None:
    """F34: a memory server with room for two of three pages of a batch: the put raises
    PartialWriteError whose flags say which pages Mooncake stored; those read back, the
    other is missing. A batch with no room at all is a plain StorageError. Neither hangs."""
    from _mooncake_server import MOONCAKE_BIN, MOONCAKE_MISSING

    if MOONCAKE_BIN is None:
        from _mooncake_server import mooncake_unavailable

        mooncake_unavailable(MOONCAKE_MISSING)
    server = MooncakeServer(tmp_path / "mc", memory_mb=16)  # Mooncake's smallest segment
    server.start()
    s = mooncake_store(server.url)
    try:
        big = [bytes([i]) * (6 << 20) for i in range(1, 4)]
        keys = keys_of(3)
        with anyio.fail_after(HANG_S):
            with pytest.raises(PartialWriteError) as e:
                await s.put(keys, big)
        stored = e.value.stored
        assert len(stored) == 3 and any(stored) and not all(stored)
        assert all(err is None for ok, err in zip(stored, e.value.errors, strict=True) if ok)
        assert all(
            "NO_AVAILABLE_HANDLE" in str(err)
            for ok, err in zip(stored, e.value.errors, strict=True)
            if not ok
        )
        got = await s.get(keys)
        assert [g is not None for g in got] == list(stored)
        assert [g for g in got if g is not None] == [p for p, ok in zip(big, stored, strict=True) if ok]
        with anyio.fail_after(HANG_S):
            with pytest.raises(StorageError) as none:
                await s.put(keys_of(2, salt=7), [bytes(20 << 20)] * 2)
        assert not isinstance(none.value, PartialWriteError)
    finally:
        await s.aclose()
        server.stop()


@pytest.mark.asyncio
async def test_a_corrupt_or_foreign_record_reads_as_missing_and_a_rewrite_heals_it(
    store: MooncakeStore,
) -> None:
    """F38: an object under a page's key that is not a whole, intact record of that key
    (raw bytes, another key's record, a flipped payload byte) is never served: get,
    get_into and lookups past it miss. Writing the key again replaces it."""
    keys, pages = keys_of(3), pages_of(3)
    raw = store._client
    names = [store.prefix + k for k in keys]
    header0 = encode_header(keys[0], pages[0])  # key 0's record, to be put under key 1
    flipped = bytearray(encode_header(keys[2], pages[2]) + pages[2])
    flipped[-1] ^= 0xFF
    assert raw.upsert_parts(names[0], pages[0]) == 0  # no header
    assert raw.upsert_parts(names[1], header0 + pages[0]) == 0
    assert raw.upsert_parts(names[2], bytes(flipped)) == 0
    assert await store.get(keys) == [None, None, None]
    bufs = [memoryview(bytearray(b"\x55" * len(p))) for p in pages]
    assert await store.get_into(keys, bufs) == 0
    assert await store.get_into(keys[2:], bufs[2:]) == 0
    assert all(bytes(b) == b"\x55" * len(b) for b in bufs)  # bytes that failed never landed
    await store.put(keys, pages)
    assert await store.get(keys) == pages
    assert await store.get_into(keys, bufs) == 3 and [bytes(b) for b in bufs] == pages


@pytest.mark.asyncio
async def test_records_of_versions_1_and_2_read_with_their_own_header_length(store: MooncakeStore) -> None:
    """An older record (version 2: the payload right after the key; version 1: a header
    4 bytes shorter still) is read from where its own header says the payload starts,
    not from where a version 3 header would end: get and get_into both serve it."""
    from kvoffload.storage._record import encode_v1, encode_v2

    keys, pages = keys_of(3), pages_of(3)
    await store.put(keys[:1], pages[:1])  # version 3
    for k, p, enc in zip(keys[1:], pages[1:], [encode_v2, encode_v1], strict=True):
        assert store._client.upsert_parts(store.prefix + k, enc(k, p)) == 0
    assert await store.get(keys) == pages
    bufs = [memoryview(bytearray(len(p))) for p in pages]
    assert await store.get_into(keys, bufs) == 3 and [bytes(b) for b in bufs] == pages


@pytest.mark.asyncio
async def test_a_read_that_is_abandoned_copies_nothing_into_the_host_pages(store: MooncakeStore) -> None:
    """A read whose client call outlives its bound is abandoned with a StorageError, and
    when the call does return, nothing is copied into the buffers (the pool may have
    handed them to another load by then)."""
    keys, pages = keys_of(2), pages_of(2)
    await store.put(keys, pages)
    spy = HeldReads(store._client)
    release, entered = spy.release, spy.entered
    store._client = spy
    store.timeout_s = 0.05  # the bound of this store's calls: 3x this
    bufs = [memoryview(bytearray(len(p))) for p in pages]
    try:
        with pytest.raises(StorageError, match="did not return"):
            await store.get_into(keys, bufs)
        assert entered.is_set()
    finally:
        release.set()
        store._client = spy.client
    with anyio.fail_after(HANG_S):
        while store._c.busy:  # the abandoned call returns (a condition, bounded)
            await anyio.sleep(0.01)
    assert [bytes(b) for b in bufs] == [bytes(len(p)) for p in pages]


@pytest.mark.asyncio
async def test_a_write_that_is_abandoned_reads_nothing_more_of_the_host_pages(
    store: MooncakeStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A write abandoned before its thread staged the pages (the thread started late, or
    waited on the master's TCP check) stores nothing when the thread does go on: by
    then the writer has the pages back and the pool may have handed them to another
    chunk, whose bytes would be stored under this key with a checksum that matches."""
    pool = pool_of(2, 4096)
    keys = keys_of(2)
    release = threading.Event()
    entered = threading.Event()
    arena = store._arena

    @contextlib.contextmanager
    def late_arena(nbytes: int) -> Iterator[Any]:
        entered.set()
        release.wait(HANG_S)  # the thread is held before it copies a page
        with arena(nbytes) as a:
            yield a

    monkeypatch.setattr(store, "_arena", late_arena)
    store.timeout_s = 0.05  # the bound of this store's calls: 3x this
    try:
        with pytest.raises(StorageError, match="did not return"):
            await store.put_pages(keys, pool, [0, 1])
        assert entered.is_set()
        pool.tensor[0].fill_(7)  # the pages are the pool's again: another chunk's bytes now
        pool.tensor[1].fill_(7)
    finally:
        release.set()
    with anyio.fail_after(HANG_S):
        while store._c.busy:  # the abandoned call returns (a condition, bounded)
            await anyio.sleep(0.01)
    monkeypatch.undo()
    store.timeout_s = 5.0
    assert await store.exists_prefix(keys) == 0
    assert await store.get(keys) == [None, None]


@pytest.mark.asyncio
async def test_a_cancelled_call_leaves_the_host_pages_alone_when_its_thread_goes_on(
    store: MooncakeStore,
) -> None:
    """A read or write whose caller is cancelled (a load aborted, the writer closed)
    returns at once while its thread runs on; from then on the thread copies nothing
    into the read's buffers and stages nothing of the write's pages."""
    keys, pages = keys_of(2), pages_of(2, salt=3)
    await store.put(keys, pages)
    spy = HeldReads(store._client)
    release, entered = spy.release, spy.entered
    store._client = spy
    bufs = [memoryview(bytearray(len(p))) for p in pages]
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(store.get_into, keys, bufs)
            with anyio.fail_after(HANG_S):
                while not entered.is_set():
                    await anyio.sleep(0.005)
            tg.cancel_scope.cancel()  # the load is aborted while its read runs
    finally:
        release.set()
        store._client = spy.client
    with anyio.fail_after(HANG_S):
        while store._c.busy:
            await anyio.sleep(0.01)
    assert [bytes(b) for b in bufs] == [bytes(len(p)) for p in pages]

    # A write cancelled before its thread staged the pages stores nothing of them.
    pool = pool_of(2, 4096)
    wkeys = keys_of(4)[2:]
    held = threading.Event()
    entered.clear()
    release.clear()
    arena = store._arena

    @contextlib.contextmanager
    def late_arena(nbytes: int) -> Iterator[Any]:
        entered.set()
        release.wait(HANG_S)
        with arena(nbytes) as a:
            held.set()
            yield a

    store._arena = late_arena  # type: ignore[method-assign]
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(store.put_pages, wkeys, pool, [0, 1])
            with anyio.fail_after(HANG_S):
                while not entered.is_set():
                    await anyio.sleep(0.005)
            tg.cancel_scope.cancel()
    finally:
        release.set()
    with anyio.fail_after(HANG_S):
        while store._c.busy:
            await anyio.sleep(0.01)
    del store._arena
    assert held.is_set()
    assert await store.get(wkeys) == [None, None]


@pytest.mark.asyncio
async def test_verify_0_checks_the_header_but_not_the_payload(mooncake_url: str) -> None:
    """verify=0 (documented trade) still refuses another key's record, but not a payload
    byte flipped after the checksum was taken."""
    s = mooncake_store(mooncake_url, verify=False)
    try:
        assert isinstance(s, MooncakeStore)
        keys, pages = keys_of(2), pages_of(2)
        flipped = bytearray(encode_header(keys[0], pages[0]) + pages[0])
        flipped[-1] ^= 0xFF
        assert s._client.upsert_parts(s.prefix + keys[0], bytes(flipped)) == 0
        assert s._client.upsert_parts(s.prefix + keys[1], encode_header(keys[0], pages[1]) + pages[1]) == 0
        bufs = [memoryview(bytearray(len(p))) for p in pages]
        assert await s.get_into(keys, bufs) == 1
        assert bytes(bufs[0]) == bytes(flipped[-len(pages[0]) :])
    finally:
        await s.aclose()


@pytest.mark.asyncio
async def test_tensor_parallel_ranks_keep_their_own_keys(store: MooncakeStore) -> None:
    """RankKeys on a mooncake store: each rank's shard lives under its own key; one rank
    never finds another's."""
    r0, r1 = RankKeys(store, 0, 2), RankKeys(store, 1, 2)
    keys = keys_of(2)
    await r0.put(keys, pages_of(2, salt=1))
    assert await r1.exists_prefix(keys) == 0 and await r1.get(keys) == [None, None]
    assert await r0.get(keys) == pages_of(2, salt=1)
    assert await store.exists_prefix([k + "_0_2" for k in keys]) == 2


@pytest.mark.asyncio
async def test_a_closed_store_refuses_calls(mooncake_url: str) -> None:
    s = mooncake_store(mooncake_url)
    await s.aclose()
    await s.aclose()  # twice is fine
    with pytest.raises(StorageError, match="closed"):
        await s.put(keys_of(1), pages_of(1))
    with pytest.raises(StorageError, match="closed"):
        await s.exists_prefix(keys_of(1))


# --- the network -------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_every_connection_stays_on_loopback(own_mooncake: MooncakeServer) -> None:
    """The master and its metrics listen on 127.0.0.1 only, no HTTP metadata server runs
    (P2P handshake), and every TCP connection of the master, the memory server and this
    client, once pages have gone both ways, is between loopback addresses."""
    import psutil

    s = mooncake_store(own_mooncake.url)
    try:
        await s.put(keys_of(4), pages_of(4, size=1 << 16))
        assert await s.get(keys_of(4)) == pages_of(4, size=1 << 16)
        loopback = {"127.0.0.1", "::ffff:127.0.0.1", "::1"}
        master = psutil.Process(own_mooncake.pids()[0])
        listens = [c for c in master.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN]
        assert {c.laddr.ip for c in listens} == {"127.0.0.1"}
        assert {c.laddr.port for c in listens} == {own_mooncake.port, own_mooncake.metrics_port}
        procs = [psutil.Process(p) for p in own_mooncake.pids()] + [psutil.Process()]
        conns = [c for p in procs for c in p.net_connections(kind="inet") if c.raddr]
        assert conns, "no connection seen"
        assert {c.laddr.ip for c in conns} | {c.raddr.ip for c in conns} <= loopback, conns
    finally:
        await s.aclose()


# --- CI: the guard and the script ---------------------------------------------------------


def test_every_test_file_on_the_mooncake_tier_names_its_ci_guard() -> None:
    """A test file that uses the Mooncake tier names KVOFFLOAD_REQUIRE_MOONCAKE (its
    tests go through the fixtures that honour it), so none can skip silently in CI."""
    import re

    uses = re.compile(r"mooncake://|MooncakeStore|mooncake_url|own_mooncake|storage\.mooncake|mooncake_store")
    files = [p for p in (ROOT / "tests").rglob("*.py") if uses.search(p.read_text())]
    assert len(files) >= 5
    missing = [str(p.relative_to(ROOT)) for p in files if "KVOFFLOAD_REQUIRE_MOONCAKE" not in p.read_text()]
    assert not missing, f"these use the mooncake tier without naming KVOFFLOAD_REQUIRE_MOONCAKE: {missing}"
    assert "export KVOFFLOAD_REQUIRE_MOONCAKE=1" in (ROOT / "scripts/test.sh").read_text()


def test_the_ci_guard_turns_a_skip_into_a_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    from _mooncake_server import mooncake_unavailable

    monkeypatch.delenv("KVOFFLOAD_REQUIRE_MOONCAKE", raising=False)
    with pytest.raises(pytest.skip.Exception, match="no master"):
        mooncake_unavailable("no master")
    monkeypatch.setenv("KVOFFLOAD_REQUIRE_MOONCAKE", "1")
    with pytest.raises(pytest.fail.Exception, match="KVOFFLOAD_REQUIRE_MOONCAKE=1 but no master"):
        mooncake_unavailable("no master")


@pytest.mark.asyncio
async def test_scripts_mooncake_sh_serves_on_loopback_only_and_stops_clean(mooncake_url: str) -> None:
    """What CI runs: ``scripts/mooncake.sh start`` brings up a master and a memory
    server whose every listening socket but the client's transfer ports (wildcard in
    Mooncake 0.3.13, see docs/storage.md) is on 127.0.0.1, with no HTTP metadata server;
    a store writes and reads through it; ``stop`` ends both and removes its directory."""
    import os
    import shlex

    import psutil
    from _mooncake_server import MOONCAKE_BIN

    del mooncake_url  # the wheel must be there (the fixture skips or fails otherwise)
    env = {**os.environ, "MOONCAKE_BIN": str(MOONCAKE_BIN)}
    out = subprocess.run(
        ["bash", "scripts/mooncake.sh", "start"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env=env,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    exports = dict(kv.split("=", 1) for kv in shlex.split(out.stdout.strip().removeprefix("export ")))
    url, folder = exports["KVOFFLOAD_MOONCAKE_URL"], Path(exports["KVOFFLOAD_MOONCAKE_DIR"])
    try:
        master = psutil.Process(int((folder / "master.pid").read_text()))
        memory = psutil.Process(int((folder / "memory.pid").read_text()))
        listening = [c for c in master.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN]
        assert listening and {c.laddr.ip for c in listening} == {"127.0.0.1"}
        assert "enable_http_metadata_server" not in " ".join(master.cmdline())
        assert "--host=127.0.0.1" in memory.cmdline()
        s = mooncake_store(url)
        try:
            await s.put(keys_of(2), pages_of(2))
            assert await s.get(keys_of(2)) == pages_of(2)
        finally:
            await s.aclose()
    finally:
        from kvoffload.storage.mooncake import close_clients

        close_clients(url.removeprefix("mooncake://"))
        stop = subprocess.run(
            ["bash", "scripts/mooncake.sh", "stop"],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=ROOT,
            env={**env, **exports},
        )
    assert stop.returncode == 0, stop.stderr
    assert not folder.exists()
    assert not master.is_running() and not memory.is_running()
