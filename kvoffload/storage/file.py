"""The embedded default store: one file per page under a root directory.

Layout: ``<root>/<key[:2]>/<key>`` (256 fan-out directories; a key that is not a
plain file name is stored under its SHA-256 instead). Each file is a record
(:mod:`kvoffload.storage._record`): a header with the key, the payload length and a
CRC-32, then the page.

A page is written to a temporary name in the same directory and renamed over the
real name, so a crash mid-write leaves at most a ``.tmp`` file, never a torn page
under a real key; a truncated, corrupt or mis-keyed file reads as missing. All file
I/O runs on a worker thread, one hop per batch, so the event loop never blocks on
the disk.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import os
import re
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio.to_thread

from kvoffload.abc import Storage
from kvoffload.errors import StorageError
from kvoffload.storage._record import decode, encode_header, header_size, payload_offset

__all__ = ["FileStorage"]

_PLAIN_KEY = re.compile(r"[A-Za-z0-9_-]{1,200}")
_tmp_ids = itertools.count()


class FileStorage(Storage):
    """Pages as files under ``root`` (created if missing).

    ``fsync=True`` also syncs each file and its directory before the rename is
    acknowledged, so a stored page survives a power loss, not only a process crash;
    it costs a disk flush per page. Many processes may share one root: renames are
    atomic, and two writers of one key write the same page (keys name tokens).
    """

    name = "file"

    def __init__(self, root: str | os.PathLike[str], *, fsync: bool = False) -> None:
        self.root = Path(root).expanduser()
        self.fsync = fsync
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StorageError(f"file storage: cannot create root directory {self.root}: {exc}") from exc

    def path(self, key: str) -> Path:
        """Where the page of ``key`` lives."""
        name = key if _PLAIN_KEY.fullmatch(key) else "h" + hashlib.sha256(key.encode()).hexdigest()
        return self.root / name[:2] / name

    # --- writes --------------------------------------------------------------------------

    async def put(self, keys: Sequence[str], pages: Sequence[bytes]) -> None:
        if len(keys) != len(pages):
            raise ValueError(f"{len(keys)} keys for {len(pages)} pages")
        if keys:
            await anyio.to_thread.run_sync(self._put_sync, list(keys), list(pages))

    def _put_sync(self, keys: list[str], pages: list[bytes]) -> None:
        for key, page in zip(keys, pages, strict=True):
            path = self.path(key)
            try:
                self._write_one(path, encode_header(key, page), page)
            except FileNotFoundError:
                try:  # first page under this fan-out directory (or the root was removed)
                    path.parent.mkdir(parents=True, exist_ok=True)
                    self._write_one(path, encode_header(key, page), page)
                except OSError as exc:
                    raise StorageError(f"file storage: cannot write {path}: {exc}") from exc
            except OSError as exc:
                raise StorageError(f"file storage: cannot write {path}: {exc}") from exc

    def _write_one(self, path: Path, header: bytes, page: bytes) -> None:
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{next(_tmp_ids)}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            try:
                _write_all(fd, header)
                _write_all(fd, page)
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        if self.fsync:
            dfd = os.open(path.parent, os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)

    # --- reads ---------------------------------------------------------------------------

    async def get(self, keys: Sequence[str]) -> list[bytes | None]:
        if not keys:
            return []
        return await anyio.to_thread.run_sync(self._get_sync, list(keys))

    def _get_sync(self, keys: list[str]) -> list[bytes | None]:
        return [decode(key, self._read(self.path(key))) for key in keys]

    def _read(self, path: Path) -> bytes | None:
        try:
            with open(path, "rb") as f:
                return f.read()
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            return None
        except OSError as exc:
            raise StorageError(f"file storage: cannot read {path}: {exc}") from exc

    async def get_into(self, keys: Sequence[str], dest: Sequence[memoryview]) -> int:
        if len(keys) != len(dest):
            raise ValueError(f"{len(keys)} keys for {len(dest)} buffers")
        if not keys:
            return 0
        return await anyio.to_thread.run_sync(self._read_prefix, list(keys), list(dest))

    async def exists_prefix(self, keys: Sequence[str]) -> int:
        """Counts files whose header names the key and whose size matches it (a
        truncated file does not count); the payload's CRC is checked on read."""
        if not keys:
            return 0
        return await anyio.to_thread.run_sync(self._read_prefix, list(keys), None)

    def _read_prefix(self, keys: list[str], dest: list[memoryview] | None) -> int:
        """How many leading keys have a whole record of their key; with ``dest``, read
        each payload straight into its buffer and check its CRC there."""
        for i, key in enumerate(keys):
            path = self.path(key)
            try:
                with open(path, "rb") as f:
                    found = payload_offset(key, f.read(header_size(key)), os.fstat(f.fileno()).st_size)
                    if found is None:
                        return i
                    if dest is not None:
                        out = dest[i].cast("B")
                        if found[1] != out.nbytes or f.readinto(out) != out.nbytes:
                            return i
                        if zlib.crc32(out) != found[2]:
                            return i
            except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
                return i
            except OSError as exc:
                raise StorageError(f"file storage: cannot read {path}: {exc}") from exc
        return len(keys)

    def describe(self) -> dict[str, Any]:
        return {"storage": self.name, "root": str(self.root), "fsync": self.fsync}

    def __repr__(self) -> str:
        return f"<FileStorage {str(self.root)!r}>"


def _write_all(fd: int, data: bytes | memoryview) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]
