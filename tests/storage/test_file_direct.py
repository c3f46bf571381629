"""The file store's direct writes (``direct=True``, ``file:///dir?direct=1``): the same
record bytes as a write through the page cache, one reused aligned buffer per thread,
and the page cache again, said once, where the file system refuses ``O_DIRECT``."""

from __future__ import annotations

import errno
import fcntl
import os
import threading
from pathlib import Path

import pytest
from _storage_helpers import keys_of

import kvoffload.storage.file as file_mod
from kvoffload.errors import ConfigError
from kvoffload.storage import resolve_storage
from kvoffload.storage.file import DIRECT_ALIGN, FileStorage

pytestmark = pytest.mark.asyncio

#: Page sizes around the alignment: a record is cut back to its own length each time.
SIZES = [1, DIRECT_ALIGN - 90, DIRECT_ALIGN, DIRECT_ALIGN + 1, 3 * DIRECT_ALIGN - 7, 2 << 20]


def _direct_works(root: Path) -> bool:
    """Whether ``root``'s file system takes O_DIRECT writes (tmpfs does not)."""
    if not getattr(os, "O_DIRECT", 0):
        return False
    root.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(root / "probe", os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o600)
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            return False
        raise
    os.close(fd)
    os.unlink(root / "probe")
    return True


@pytest.fixture
def direct_root(tmp_path: Path) -> Path:
    root = tmp_path / "direct"
    if not _direct_works(root):
        pytest.skip(f"{tmp_path}'s file system refuses O_DIRECT (the fallback is tested apart)")
    return root


def _pages(n: int, size: int) -> list[bytes]:
    return [bytes((i * 31 + j) % 251 for j in range(min(size, 4096))) * (size // 4096 + 1) for i in range(n)]


@pytest.mark.parametrize("size", SIZES)
async def test_direct_records_are_the_bytes_a_buffered_write_makes(
    direct_root: Path, tmp_path: Path, size: int
) -> None:
    """Every record written direct is byte for byte the record written through the page
    cache (header, page, nothing after it), and reads back as the page."""
    pages = [p[:size] for p in _pages(3, size)]
    keys = keys_of(3)
    direct, plain = FileStorage(direct_root, direct=True), FileStorage(tmp_path / "plain")
    await direct.put(keys, pages)
    await plain.put(keys, pages)
    assert direct.direct and direct.direct_writes == 3
    for k in keys:
        assert direct.path(k).read_bytes() == plain.path(k).read_bytes()
    assert await direct.get(keys) == pages
    assert await FileStorage(direct_root).get(keys) == pages  # another handle, no direct
    assert not list(direct_root.rglob("*.tmp"))


async def test_host_pool_pages_go_direct_from_the_pool(direct_root: Path) -> None:
    """``put_pages`` (the writer's path: views of the host pool) writes direct and the
    pages read back into the pool."""
    import torch

    from kvoffload.drivers._base import load_buffers
    from kvoffload.pools import HostPool

    pool = HostPool(torch.zeros(4, 2, 3000))
    pool.tensor.copy_(torch.arange(pool.tensor.numel(), dtype=torch.float32).view_as(pool.tensor))
    want = pool.tensor.clone()
    store, keys = FileStorage(direct_root, direct=True), keys_of(2)
    await store.put_pages(keys, pool, [3, 1])
    assert store.direct_writes == 2
    pool.tensor.zero_()
    assert await store.get_into(keys, load_buffers(pool, [0, 2])) == 2
    assert torch.equal(pool.tensor[0], want[3]) and torch.equal(pool.tensor[2], want[1])


async def test_each_thread_reuses_its_aligned_buffer(direct_root: Path) -> None:
    """The buffer a thread writes through is kept (new memory for every record is what
    direct writes avoid) and grows only for a larger record; another thread has its own."""
    store = FileStorage(direct_root, direct=True)
    store._put_sync(keys_of(2), [b"a" * 5000, b"b" * 100])
    buf = store._bounce.buf
    assert len(buf) == 2 * DIRECT_ALIGN and buf.tell() == 0
    store._put_sync(keys_of(3)[2:], [b"c" * 10])
    assert store._bounce.buf is buf
    store._put_sync(keys_of(4)[3:], [b"d" * (3 * DIRECT_ALIGN)])
    assert store._bounce.buf is not buf and len(store._bounce.buf) == 4 * DIRECT_ALIGN
    other: list[object] = []

    def write_elsewhere() -> None:
        store._put_sync(["ee" * 32], [b"e"])
        other.append(store._bounce.buf)

    t = threading.Thread(target=write_elsewhere)
    t.start()
    t.join()
    assert other and other[0] is not store._bounce.buf
    assert store.direct_writes == 5


async def test_a_file_system_that_refuses_o_direct_gets_the_page_cache_said_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where opening with O_DIRECT is refused (EINVAL, as tmpfs does), the store writes
    through the page cache from then on, warns once (the reason kept in ``direct_off``),
    and loses no page."""
    if not getattr(os, "O_DIRECT", 0):
        pytest.skip("this platform has no O_DIRECT")
    real_open = os.open

    def refusing(path: str, flags: int, *a: object, **k: object) -> int:
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *a, **k)  # type: ignore[arg-type]

    monkeypatch.setattr(file_mod.os, "open", refusing)
    store, keys = FileStorage(tmp_path / "p", direct=True), keys_of(4)
    pages = [bytes([i]) * 9000 for i in range(4)]
    with pytest.warns(RuntimeWarning) as said:
        await store.put(keys[:2], pages[:2])
        await store.put(keys[2:], pages[2:])
    assert len(said) == 1 and "direct writes are off" in str(said[0].message)
    assert str(tmp_path / "p") in str(said[0].message) and "O_DIRECT" in (store.direct_off or "")
    assert not store.direct and store.direct_writes == 0 and store.describe()["direct"] is False
    monkeypatch.undo()
    assert await FileStorage(tmp_path / "p").get(keys) == pages


async def test_a_refused_direct_write_is_written_through_the_page_cache(
    direct_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A device that refuses the aligned write itself (EINVAL: a larger logical block):
    that page is rewritten through the page cache on the same file, whole, and direct
    goes off for the store, said once."""
    store, keys = FileStorage(direct_root, direct=True), keys_of(2)

    real_writev = os.writev

    def refuse(fd: int, buffers: list[memoryview]) -> int:
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:  # the aligned write of an O_DIRECT file
            real_writev(fd, [memoryview(bytearray(DIRECT_ALIGN))])  # a device may take some first
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_writev(fd, buffers)

    monkeypatch.setattr(file_mod.os, "writev", refuse)
    pages = [b"x" * 10_000, b"y" * 3]
    with pytest.warns(RuntimeWarning) as said:
        await store.put(keys, pages)
    assert len(said) == 1 and "write was refused" in (store.direct_off or "")
    assert await FileStorage(direct_root).get(keys) == pages
    plain = FileStorage(direct_root.parent / "plain")
    await plain.put(keys, pages)
    assert [store.path(k).read_bytes() for k in keys] == [plain.path(k).read_bytes() for k in keys]


async def test_file_urls_take_direct_and_fsync(tmp_path: Path) -> None:
    """``file:///dir?direct=1&fsync=0`` sets the store's settings; an unknown key or a
    value that is not a boolean is a ConfigError naming it; a plain URL sets neither."""
    store = resolve_storage(f"file://{tmp_path}/a?direct=1&fsync=true")
    assert isinstance(store, FileStorage) and store.root == tmp_path / "a"
    assert store.direct is bool(getattr(os, "O_DIRECT", 0)) and store.fsync is True
    plain = resolve_storage(f"file://{tmp_path}/b")
    assert isinstance(plain, FileStorage) and not plain.direct and not plain.fsync
    with pytest.raises(ConfigError, match="unknown setting 'drect'"):
        resolve_storage(f"file://{tmp_path}/c?drect=1")
    with pytest.raises(ConfigError, match="direct='yes' is not 1, 0, true or false"):
        resolve_storage(f"file://{tmp_path}/c?direct=yes")
    with pytest.raises(ConfigError, match="must be key=value pairs"):
        resolve_storage(f"file://{tmp_path}/c?direct")
    with pytest.raises(ConfigError, match="direct must be a bool"):
        FileStorage(tmp_path / "d", direct=1)  # type: ignore[arg-type]
