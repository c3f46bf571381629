"""The file store: write-then-rename, and bad files read as missing, never as pages."""

from __future__ import annotations

import itertools
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import anyio
import pytest
from _storage_helpers import keys_of, pages_of

from kvoffload.errors import ConfigError, StorageError
from kvoffload.storage._record import decode, encode_header
from kvoffload.storage.file import FileStorage

pytestmark = pytest.mark.asyncio


@pytest.fixture
def fs(tmp_path: Path) -> FileStorage:
    return FileStorage(tmp_path / "pages")


async def _stored(fs: FileStorage, n: int = 3) -> tuple[list[str], list[bytes]]:
    keys, pages = keys_of(n), pages_of(n)
    await fs.put(keys, pages)
    return keys, pages


async def test_one_file_per_page_and_no_temporary_left(fs: FileStorage) -> None:
    """Each page is one file under <root>/<key[:2]>/<key>; no .tmp file survives a put."""
    keys, _ = await _stored(fs)
    for k in keys:
        assert fs.path(k) == fs.root / k[:2] / k and fs.path(k).is_file()
    assert not list(fs.root.rglob("*.tmp"))


async def test_a_truncated_file_reads_as_missing(fs: FileStorage) -> None:
    """A file cut short (a torn write) is neither returned nor counted as stored."""
    keys, pages = await _stored(fs)
    p = fs.path(keys[1])
    p.write_bytes(p.read_bytes()[:-1])
    assert await fs.get(keys) == [pages[0], None, pages[2]]
    assert await fs.exists_prefix(keys) == 1
    assert await fs.get_into(keys, [memoryview(bytearray(len(pg))) for pg in pages]) == 1


async def test_a_corrupt_payload_reads_as_missing(fs: FileStorage) -> None:
    """One flipped payload byte fails the CRC: the page reads as missing."""
    keys, pages = await _stored(fs)
    p = fs.path(keys[0])
    data = bytearray(p.read_bytes())
    data[-1] ^= 0xFF
    p.write_bytes(bytes(data))
    assert await fs.get(keys[:1]) == [None]
    assert await fs.get_into(keys[:1], [memoryview(bytearray(len(pages[0])))]) == 0


async def test_a_page_under_the_wrong_key_reads_as_missing(fs: FileStorage) -> None:
    """A record moved under another key's name (mis-keyed) is not returned for that key."""
    keys, pages = await _stored(fs, 2)
    fs.path(keys[1]).write_bytes(fs.path(keys[0]).read_bytes())
    assert await fs.get(keys) == [pages[0], None]
    assert await fs.exists_prefix(keys) == 1


async def test_a_headerless_or_empty_file_reads_as_missing(fs: FileStorage) -> None:
    keys, pages = await _stored(fs, 2)
    fs.path(keys[0]).write_bytes(pages[0])  # raw bytes, no header
    fs.path(keys[1]).write_bytes(b"")
    assert await fs.get(keys) == [None, None]
    assert await fs.exists_prefix(keys) == 0


async def test_a_crash_mid_write_leaves_no_page_under_the_real_key(fs: FileStorage) -> None:
    """What a crash mid-write leaves (a partial temporary file) is never read as a page:
    the real name appears only by the rename of a complete file."""
    key, page = keys_of(1)[0], pages_of(1)[0]
    record = encode_header(key, page) + page
    fs.path(key).parent.mkdir(parents=True)
    fs.path(key).with_name(f".{key}.999.0.tmp").write_bytes(record[:-7])
    assert await fs.get([key]) == [None]
    assert await fs.exists_prefix([key]) == 0
    await fs.put([key], [page])
    assert await fs.get([key]) == [page]


async def test_a_root_under_a_regular_file_is_a_storage_error(tmp_path: Path) -> None:
    """A root that cannot be a directory fails with StorageError naming the path."""
    blocker = tmp_path / "blocker"
    blocker.write_bytes(b"")
    with pytest.raises(StorageError, match="blocker"):
        FileStorage(blocker / "pages")


async def test_a_failed_put_raises_storage_error_and_leaves_no_temporary(fs: FileStorage) -> None:
    """When the directory is replaced by a regular file, put raises StorageError; reads
    report the pages missing; nothing partial is left behind."""
    keys, pages = await _stored(fs, 1)
    moved = fs.root.with_name("moved")
    fs.root.rename(moved)
    fs.root.write_bytes(b"not a directory")
    with pytest.raises(StorageError, match="cannot write"):
        await fs.put(keys_of(2, salt=3), pages_of(2))
    assert await fs.get(keys) == [None]
    fs.root.unlink()
    moved.rename(fs.root)
    assert await fs.get(keys) == pages
    assert not list(fs.root.rglob("*.tmp"))


async def test_keys_that_are_not_file_names_are_hashed(fs: FileStorage) -> None:
    """Any string is a valid key: one that is not a plain file name maps to its hash."""
    keys = ["../escape", "a/b", "x" * 300]
    pages = pages_of(3)
    await fs.put(keys, pages)
    assert await fs.get(keys) == pages
    for k in keys:
        assert fs.path(k).parent.parent == fs.root


async def test_fsync_mode_stores_the_same_pages(tmp_path: Path) -> None:
    fs = FileStorage(tmp_path / "p", fsync=True)
    keys, pages = await _stored(fs, 2)
    assert await fs.get(keys) == pages


async def test_record_decode_rejects_foreign_bytes() -> None:
    """The record check on its own: only an intact record of the asked key decodes."""
    key, page = "k1", b"payload"
    rec = encode_header(key, page) + page
    assert decode(key, rec) == page
    assert decode("k2", rec) is None
    assert decode(key, rec + b"x") is None
    assert decode(key, rec[:5]) is None
    assert decode(key, None) is None
    assert decode(key, b"XXXX" + rec[4:]) is None


# --- hygiene: permissions, symlinks, stale temporary files -----------------------------------


def _mode(p: Path) -> int:
    return stat.S_IMODE(p.lstat().st_mode)


async def test_pages_and_directories_are_owner_only_by_default(tmp_path: Path) -> None:
    """Pages are 0600 and the directories the store makes 0700, whatever the umask."""
    old = os.umask(0)
    try:
        fs = FileStorage(tmp_path / "new" / "pages")
        keys, _ = await _stored(fs)
    finally:
        os.umask(old)
    assert _mode(fs.root) == 0o700
    for k in keys:
        assert _mode(fs.path(k)) == 0o600 and _mode(fs.path(k).parent) == 0o700


async def test_a_group_mode_is_applied_in_spite_of_the_umask(tmp_path: Path) -> None:
    """mode=0o640 gives 0640 pages and 0750 directories even under umask 077."""
    old = os.umask(0o077)
    try:
        fs = FileStorage(tmp_path / "pages", mode=0o640)
        keys, pages = await _stored(fs)
    finally:
        os.umask(old)
    assert fs.describe()["mode"] == "0o640"
    assert _mode(fs.root) == 0o750
    assert {_mode(fs.path(k)) for k in keys} == {0o640} and {_mode(fs.path(k).parent) for k in keys} == {
        0o750
    }
    assert await fs.get(keys) == pages


@pytest.mark.parametrize("mode", [0o400, 0o1600, -1, "0o600", 0o200])
async def test_a_mode_without_owner_read_write_is_a_config_error(tmp_path: Path, mode: object) -> None:
    with pytest.raises(ConfigError, match="mode"):
        FileStorage(tmp_path / "pages", mode=mode)  # type: ignore[arg-type]


async def test_a_symlinked_fanout_directory_is_never_followed(fs: FileStorage, tmp_path: Path) -> None:
    """A fan-out directory replaced by a symlink to a directory outside the root: a
    write there fails (StorageError) and writes nothing outside; a valid record planted
    outside is not read through it."""
    key, page = keys_of(1)[0], pages_of(1)[0]
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / key).write_bytes(encode_header(key, page) + page)  # a valid record, outside
    fs.path(key).parent.symlink_to(outside, target_is_directory=True)
    assert await fs.get([key]) == [None]
    assert await fs.exists_prefix([key]) == 0
    assert await fs.get_into([key], [memoryview(bytearray(len(page)))]) == 0
    before = sorted(p.name for p in outside.iterdir())
    with pytest.raises(StorageError, match="not a directory"):
        await fs.put([key], [pages_of(1, salt=9)[0]])
    assert sorted(p.name for p in outside.iterdir()) == before
    assert (outside / key).read_bytes() == encode_header(key, page) + page


async def test_a_symlinked_page_is_never_read_and_a_write_replaces_the_link(
    fs: FileStorage, tmp_path: Path
) -> None:
    """A page file that is a symlink to a file outside the root (holding a valid record)
    reads as missing; storing the key replaces the link, never writing through it."""
    keys, pages = await _stored(fs, 2)
    target = tmp_path / "secret"
    record = encode_header(keys[1], pages[0]) + pages[0]
    target.write_bytes(record)
    fs.path(keys[1]).unlink()
    fs.path(keys[1]).symlink_to(target)
    assert await fs.get(keys) == [pages[0], None]
    assert await fs.exists_prefix(keys) == 1
    await fs.put(keys[1:], pages[1:])
    assert not fs.path(keys[1]).is_symlink() and target.read_bytes() == record
    assert await fs.get(keys) == pages


async def test_a_symlink_at_the_temporary_name_is_not_written_through(
    fs: FileStorage, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A symlink planted at the very temporary name the next write uses: the write
    fails (StorageError) and the link's target is untouched."""
    import kvoffload.storage.file as file_mod

    key, page = keys_of(1)[0], pages_of(1)[0]
    monkeypatch.setattr(file_mod, "_tmp_ids", itertools.count(77))
    target = tmp_path / "target"
    target.write_bytes(b"untouched")
    fs.path(key).parent.mkdir(parents=True)
    fs.path(key).with_name(f".{key}.{file_mod._HOST}.{os.getpid()}.77.tmp").symlink_to(target)
    with pytest.raises(StorageError, match="cannot write"):
        await fs.put([key], [page])
    assert target.read_bytes() == b"untouched"
    assert await fs.get([key]) == [None]


async def test_a_fifo_under_a_key_reads_as_missing_without_blocking(fs: FileStorage) -> None:
    keys, pages = await _stored(fs, 2)
    fs.path(keys[1]).unlink()
    os.mkfifo(fs.path(keys[1]))
    with anyio.fail_after(10):
        assert await fs.get(keys) == [pages[0], None]
        assert await fs.exists_prefix(keys) == 1


async def test_opening_a_store_removes_stale_temporaries_of_dead_writers(tmp_path: Path) -> None:
    """This host's temporary files whose writer is gone, and anyone's older than
    stale_tmp_s, are removed when a store opens; a live writer's fresh file, another
    host's fresh file, and anything behind a symlink stay."""
    import kvoffload.storage.file as file_mod

    fs = FileStorage(tmp_path / "pages")
    keys, pages = await _stored(fs, 2)
    d = fs.path(keys[0]).parent
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    host = file_mod._HOST
    gone = d / f".{keys[0]}.{host}.{dead.pid}.0.tmp"
    live = d / f".{keys[0]}.{host}.{os.getpid()}.1.tmp"
    other = d / f".{keys[0]}.otherhost.{dead.pid}.2.tmp"
    old = d / f".{keys[0]}.otherhost.1.3.tmp"
    v01 = d / f".{keys[0]}.999.4.tmp"  # the v0.1 name, without a host
    for p in (gone, live, other, old, v01):
        p.write_bytes(b"partial")
    two_hours_ago = time.time() - 7200
    for p in (old, v01):
        os.utime(p, (two_hours_ago, two_hours_ago))
    outside = tmp_path / "outside"
    outside.mkdir()
    behind = outside / f".{keys[0]}.{host}.{dead.pid}.5.tmp"
    behind.write_bytes(b"not ours")
    (fs.root / "zz").symlink_to(outside, target_is_directory=True)

    reopened = FileStorage(fs.root)
    assert reopened.stale_removed == 3
    assert not gone.exists() and not old.exists() and not v01.exists()
    assert live.exists() and other.exists() and behind.exists()
    assert await reopened.get(keys) == pages
