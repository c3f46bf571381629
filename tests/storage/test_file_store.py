"""The file store: write-then-rename, and bad files read as missing, never as pages."""

from __future__ import annotations

from pathlib import Path

import pytest
from _storage_helpers import keys_of, pages_of

from kvoffload.errors import StorageError
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
