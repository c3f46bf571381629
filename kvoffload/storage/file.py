"""The embedded default store: one file per page under a root directory.

Layout: ``<root>/<key[:2]>/<key>`` (256 fan-out directories; a key that is not a
plain file name is stored under its SHA-256 instead). Each file is a record
(:mod:`kvoffload.storage._record`): a header with the key, the payload length and a
checksum, then the page.

A page is written to a temporary name in the same directory and renamed over the real
name, so a crash mid-write leaves at most a ``.tmp`` file, never a torn page under a
real key; a batch reports per page which renames happened (a page that fails does not
stop the others: :class:`~kvoffload.PartialWriteError`, F34); a truncated, corrupt or
mis-keyed file reads as missing. Temporary files of writers that died are removed when
a store opens. All file I/O runs on a worker thread, one hop per batch, so the event
loop never blocks on the disk.

Nothing outside the root is read or written: below the root every directory and file
is opened relative to its parent's descriptor with ``O_NOFOLLOW``, so a symlink (to a
directory or a file) planted inside the root is refused, never followed; a read only
takes regular files. Pages and directories are created owner-only by default.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import itertools
import mmap
import os
import re
import socket
import stat
import threading
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio.to_thread

from kvoffload.abc import Storage
from kvoffload.errors import ConfigError, PartialWriteError, StorageError
from kvoffload.pools import page_views
from kvoffload.storage._record import decode, encode_header, header_size, intact_parts, payload_offset
from kvoffload.storage.gate import WriteGate

if TYPE_CHECKING:
    from kvoffload.pools import HostPool

__all__ = ["DEFAULT_MODE", "FileStorage"]

_PLAIN_KEY = re.compile(r"[A-Za-z0-9_-]{1,200}")
_tmp_ids = itertools.count()
#: Permissions of the pages (directories get the matching search bits): owner only.
DEFAULT_MODE = 0o600
#: A temporary file this old is stale whoever wrote it (a write takes milliseconds).
STALE_TMP_S = 3600.0
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | _CLOEXEC
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | _CLOEXEC  # a FIFO must not block a read
_TMP_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | _CLOEXEC
#: O_DIRECT where the platform has it (Linux); 0 elsewhere: ``direct=True`` then writes
#: through the page cache, as without it.
_O_DIRECT = getattr(os, "O_DIRECT", 0)
#: What a direct write's buffer, length and file offset are aligned to (the largest
#: logical block size of common devices; a multiple of every smaller one).
DIRECT_ALIGN = 4096
#: What opening a symlink with O_NOFOLLOW raises (ELOOP; EMLINK on some BSDs).
_SYMLINK_ERRNOS = (errno.ELOOP, errno.EMLINK)
#: This host in temporary names, so a store shared over NFS cleans only its own dead writers.
_HOST = re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname())[:64] or "host"


def _dir_mode(mode: int) -> int:
    """A directory's mode for pages of ``mode``: search (x) wherever read (r) is given."""
    return mode | ((mode & 0o444) >> 2)


class FileStorage(Storage):
    """Pages as files under ``root`` (created if missing).

    ``mode`` (default ``0o600``) is the permission of every page file; directories
    the store creates get the same bits plus search (``0o700`` by default); the
    process umask does not narrow them. Give ``0o640`` (or ``0o660``) to share a root
    with a group. ``fsync=True`` also syncs each file and its directory before the
    rename is acknowledged, so a stored page survives a power loss, not only a process
    crash; it costs a disk flush per page. Many processes may share one root: renames
    are atomic, and two writers of one key write the same page (keys name tokens).

    ``direct=True`` writes each record with ``O_DIRECT``, around the page cache: the
    record (the same bytes as without it) is copied into an aligned buffer of the
    writing thread, padded to ``DIRECT_ALIGN``, written, and the file cut back to the
    record's length. A write then takes no new page-cache memory (what a store that
    only grows otherwise takes, page by page, from the engine's machine), and a read
    comes from the device instead of memory. Where the file system refuses
    ``O_DIRECT`` (tmpfs) the store warns once (``RuntimeWarning``; the reason stays in
    ``direct_off``) and writes through the page cache. ``direct_writes`` counts the
    records written direct.

    Opening the store removes temporary files of dead writers: this host's writers
    whose process is gone, and anyone's older than ``stale_tmp_s`` seconds.
    """

    name = "file"

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        fsync: bool = False,
        mode: int = DEFAULT_MODE,
        stale_tmp_s: float = STALE_TMP_S,
        direct: bool = False,
    ) -> None:
        if type(direct) is not bool:
            raise ConfigError(f"file storage: direct must be a bool, got {direct!r}")
        if type(mode) is not int or not 0 <= mode <= 0o777 or mode & 0o600 != 0o600:
            raise ConfigError(
                f"file storage: mode must be an int in 0o600..0o777 with owner rw, got {mode!r}"
            )
        self.root = Path(root).expanduser()
        self.fsync = fsync
        self.mode = mode
        self.dir_mode = _dir_mode(mode)
        self.stale_tmp_s = stale_tmp_s
        # direct: whether records are written with O_DIRECT; it turns False (for good,
        # warned once, the reason in direct_off) where the file system refuses it.
        # direct_writes: records so written.
        self.direct = direct and bool(_O_DIRECT)
        self.direct_writes = 0
        self.direct_off: str | None = None  # why direct writes went off, if they did
        self._bounce = threading.local()  # each writing thread's aligned buffer (reused)
        # _chmod: the umask may take bits of mode away: set them after creating.
        self._chmod = bool(mode & 0o077)
        try:
            self._make_root()
        except OSError as exc:
            raise StorageError(f"file storage: cannot create root directory {self.root}: {exc}") from exc
        self.stale_removed = self._sweep()

    def path(self, key: str) -> Path:
        """Where the page of ``key`` lives."""
        d, name = _place(key)
        return self.root / d / name

    # --- directories ---------------------------------------------------------------------

    def _make_root(self) -> None:
        if self.root.is_dir():
            return
        self.root.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.mkdir(self.root, self.dir_mode)
        except FileExistsError:
            return
        if self._chmod:
            os.chmod(self.root, self.dir_mode)

    def _open_root(self, create: bool) -> int | None:
        """A descriptor of the root (the configured path; it may be a symlink set up by
        the operator), or ``None`` when it is gone and ``create`` is false."""
        try:
            return os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | _CLOEXEC)
        except FileNotFoundError:
            if not create:
                return None
        self._make_root()  # removed while running (a cache cleaner): made again
        return os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | _CLOEXEC)

    def _open_dir(self, root_fd: int, d: str, create: bool) -> int | None:
        """A descriptor of the fan-out directory ``d`` under the root, never through a
        symlink; ``None`` when it is missing (and not ``create``) or is not a directory."""
        try:
            return os.open(d, _DIR_FLAGS, dir_fd=root_fd)
        except FileNotFoundError:
            if not create:
                return None
        except OSError as exc:
            if exc.errno in _SYMLINK_ERRNOS or exc.errno == errno.ENOTDIR:
                if create:
                    raise StorageError(
                        f"file storage: {self.root / d} is not a directory (a symlink?): "
                        "nothing is written outside the root"
                    ) from None
                return None
            raise
        try:
            os.mkdir(d, self.dir_mode, dir_fd=root_fd)
        except FileExistsError:
            pass
        else:
            if self._chmod:
                os.chmod(d, self.dir_mode, dir_fd=root_fd, follow_symlinks=False)
        return self._open_dir(root_fd, d, False)

    # --- writes --------------------------------------------------------------------------

    async def put(self, keys: Sequence[str], pages: Sequence[bytes]) -> None:
        if len(keys) != len(pages):
            raise ValueError(f"{len(keys)} keys for {len(pages)} pages")
        if keys:
            await anyio.to_thread.run_sync(self._put_sync, list(keys), list(pages))

    async def put_pages(self, keys: Sequence[str], host_pool: HostPool, host_pages: Sequence[int]) -> None:
        """Write each host page from the pool's memory (no copy): header and page go out
        in one ``writev`` on the worker thread, which also computes the checksum."""
        if len(keys) != len(host_pages):
            raise ValueError(f"{len(keys)} keys for {len(host_pages)} pages")
        if keys:
            await anyio.to_thread.run_sync(self._put_sync, list(keys), page_views(host_pool, host_pages))

    def _put_sync(self, keys: list[str], pages: Sequence[bytes | memoryview]) -> None:
        try:
            root_fd = self._open_root(create=True)
        except OSError as exc:
            raise StorageError(f"file storage: cannot write under {self.root}: {exc}") from exc
        assert root_fd is not None
        dirs: dict[str, int] = {}
        # errors[i]: why page i was not renamed into place; None once it was (F34).
        errors: list[str | None] = []
        try:
            for key, page in zip(keys, pages, strict=True):
                d, name = _place(key)
                try:
                    dfd = dirs.get(d)
                    if dfd is None:
                        dfd = dirs[d] = self._open_dir(root_fd, d, create=True)  # type: ignore[assignment]
                    assert dfd is not None
                    self._write_one(dfd, name, encode_header(key, page), page)
                except (OSError, StorageError) as exc:  # this page: the others are still written
                    errors.append(f"file storage: cannot write {self.root / d / name}: {exc}")
                else:
                    errors.append(None)
        finally:
            for fd in dirs.values():
                os.close(fd)
            os.close(root_fd)
        failed = [e for e in errors if e is not None]
        if not failed:
            return
        if len(failed) == len(errors):
            raise StorageError(failed[0] if len(failed) == 1 else f"{failed[0]} (and every other page)")
        raise PartialWriteError(
            f"file storage: {len(failed)} of {len(errors)} page(s) not stored (first: {failed[0]})",
            [e is None for e in errors],
            errors,
        )

    def _write_one(self, dfd: int, name: str, header: bytes, page: bytes | memoryview) -> None:
        tmp = f".{name}.{_HOST}.{os.getpid()}.{next(_tmp_ids)}.tmp"
        fd, direct = self._open_tmp(tmp, dfd)
        try:
            try:
                if self._chmod:
                    os.fchmod(fd, self.mode)
                (self._write_direct if direct else _write_all)(fd, header, page)
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=dfd)
            raise
        if self.fsync:
            os.fsync(dfd)

    def _open_tmp(self, tmp: str, dfd: int) -> tuple[int, bool]:
        """Create the temporary file ``tmp``: (its descriptor, whether it is opened
        ``O_DIRECT``). Direct while the store writes direct, unless the file system
        refuses it (then direct goes off for this store)."""
        if self.direct:
            try:
                return os.open(tmp, _TMP_FLAGS | _O_DIRECT, self.mode, dir_fd=dfd), True
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                self._direct_off(f"the file system refuses O_DIRECT: {exc}")
        return os.open(tmp, _TMP_FLAGS, self.mode, dir_fd=dfd), False

    def _direct_off(self, why: str) -> None:
        """Direct writes off for good: said once, as a ``RuntimeWarning`` (a store logs
        nothing itself), and kept in ``direct_off``."""
        if self.direct:
            self.direct = False
            self.direct_off = why
            warnings.warn(
                f"file storage at {self.root}: direct writes are off, writing through the page cache: {why}",
                RuntimeWarning,
                stacklevel=3,
            )

    def _write_direct(self, fd: int, header: bytes, page: bytes | memoryview) -> None:
        """The record into this thread's aligned buffer, padded to ``DIRECT_ALIGN``, one
        ``O_DIRECT`` write, then the file cut back to the record's length: the file holds
        exactly the bytes :func:`_write_all` writes. The buffer is kept for the thread's
        next record (a new one each time would take new memory each time)."""
        body = memoryview(page).cast("B")
        n = len(header) + body.nbytes
        padded = -(-n // DIRECT_ALIGN) * DIRECT_ALIGN
        buf = getattr(self._bounce, "buf", None)
        if buf is None or len(buf) < padded:
            if buf is not None:
                buf.close()
            buf = self._bounce.buf = mmap.mmap(-1, padded)  # page-aligned, so DIRECT_ALIGN-aligned
        view = memoryview(buf)
        try:
            view[: len(header)] = header
            view[len(header) : n] = body
            view[n:padded] = bytes(padded - n)
            _write_all(fd, view[:padded])
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            # The device refused the aligned write (a larger logical block): this record
            # through the page cache, on the same file from its start; direct goes off.
            self._direct_off(f"an O_DIRECT write was refused: {exc}")
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~_O_DIRECT)
            os.ftruncate(fd, 0)
            os.lseek(fd, 0, os.SEEK_SET)
            _write_all(fd, header, page)
            return
        finally:
            view.release()
        os.ftruncate(fd, n)
        self.direct_writes += 1

    # --- reads ---------------------------------------------------------------------------

    async def get(self, keys: Sequence[str]) -> list[bytes | None]:
        if not keys:
            return []
        return await anyio.to_thread.run_sync(self._get_sync, list(keys))

    def _get_sync(self, keys: list[str]) -> list[bytes | None]:
        out: list[bytes | None] = []
        with _Reader(self) as r:
            for key in keys:
                f = r.open(key)
                if f is None:
                    out.append(None)
                    continue
                with f:
                    out.append(decode(key, f.read()))
        return out

    async def get_into(self, keys: Sequence[str], dest: Sequence[memoryview]) -> int:
        if len(keys) != len(dest):
            raise ValueError(f"{len(keys)} keys for {len(dest)} buffers")
        if not keys:
            return 0
        return await anyio.to_thread.run_sync(self._read_prefix, list(keys), [[d] for d in dest])

    async def get_into_parts(self, keys: Sequence[str], dest: Sequence[Sequence[memoryview]]) -> int:
        """Each payload read straight into its parts (one ``preadv``), checked there."""
        if len(keys) != len(dest):
            raise ValueError(f"{len(keys)} keys for {len(dest)} pages of buffers")
        if not keys:
            return 0
        return await anyio.to_thread.run_sync(self._read_prefix, list(keys), [list(d) for d in dest])

    async def exists_prefix(self, keys: Sequence[str]) -> int:
        """Counts files whose header names the key and whose size matches it (a
        truncated file does not count); the payload's checksum is checked on read."""
        if not keys:
            return 0
        return await anyio.to_thread.run_sync(self._read_prefix, list(keys), None)

    def blocking_exists_prefix(self, keys: Sequence[str]) -> int:
        """:meth:`exists_prefix` on the calling thread (blocking file I/O, no event loop,
        no thread hop): for a caller already on a thread of its own that bounds its own
        wait (the vLLM connector's lookup thread)."""
        return self._read_prefix(list(keys), None) if keys else 0

    def blocking_get_into_parts(
        self,
        keys: Sequence[str],
        dest: Sequence[Sequence[memoryview]],
        *,
        cached: bool = False,
        gate: WriteGate | None = None,
    ) -> int:
        """:meth:`get_into_parts` on the calling thread (blocking file I/O, no event
        loop, no thread hop), the same checks: for a caller already on a thread of its
        own that bounds its own wait (the vLLM connector's load threads).

        ``cached``: read only what the page cache holds (``RWF_NOWAIT``): a payload that
        would wait on the disk stops it there, as a missing page does, so no write into
        ``dest`` ever waits on a device (where the kernel or file system cannot say,
        nothing is read). ``gate``: each payload's write into ``dest`` is made inside it
        (:class:`~kvoffload.storage.gate.WriteGate`); a closed gate stops the read. With
        both, memory the caller does not own is never written after the gate closed."""
        if len(keys) != len(dest):
            raise ValueError(f"{len(keys)} keys for {len(dest)} pages of buffers")
        if not keys or (cached and not _NOWAIT):
            return 0
        return self._read_prefix(list(keys), [list(d) for d in dest], cached, gate)

    def _read_prefix(
        self,
        keys: list[str],
        dest: list[list[memoryview]] | None,
        cached: bool = False,
        gate: WriteGate | None = None,
    ) -> int:
        """How many leading keys have a whole record of their key; with ``dest``, read
        each payload straight into its buffers (one ``preadv``: a host page, or an
        engine block's parts) and check its checksum there. A page costs an open, one
        ``fstat`` and a ``pread`` of its header (no file object), then the ``preadv``
        (``cached``, ``gate``: :meth:`blocking_get_into_parts`)."""
        flags = _NOWAIT if cached else 0
        with _Reader(self) as r:
            for i, key in enumerate(keys):
                opened = r.open_fd(key)
                if opened is None:
                    return i
                fd, size = opened
                try:
                    found = payload_offset(key, os.pread(fd, header_size(key), 0), size)
                    if found is None:
                        return i
                    if dest is not None:
                        parts = [_bytes_view(b) for b in dest[i]]
                        if found.length != sum(b.nbytes for b in parts):
                            return i
                        # (an older record's header is shorter than what was read: offset is exact)
                        if gate is None and not flags:
                            if os.preadv(fd, parts, found.offset) != found.length:
                                return i
                        elif not _read_payload(gate, fd, parts, found.offset, found.length, flags):
                            return i
                        if not intact_parts(found, parts):
                            return i
                except OSError as exc:
                    raise StorageError(f"file storage: cannot read {self.path(key)}: {exc}") from exc
                finally:
                    os.close(fd)
        return len(keys)

    # --- stale temporary files -----------------------------------------------------------

    def _sweep(self) -> int:
        """Remove temporary files of dead writers (this host's, by pid; anyone's, by age)
        under the root; returns how many. Never follows a symlink; never raises."""
        removed = 0
        now = time.time()
        try:
            root_fd = self._open_root(create=False)
        except OSError:
            return 0
        if root_fd is None:
            return 0
        try:
            for entry in os.scandir(root_fd):
                if not entry.is_dir(follow_symlinks=False):
                    continue
                dfd = self._open_dir(root_fd, entry.name, False)
                if dfd is None:
                    continue
                try:
                    for f in os.scandir(dfd):
                        if f.name.startswith(".") and f.name.endswith(".tmp") and self._stale(f, now):
                            with contextlib.suppress(OSError):
                                os.unlink(f.name, dir_fd=dfd)
                                removed += 1
                finally:
                    os.close(dfd)
        except OSError:
            pass
        finally:
            os.close(root_fd)
        return removed

    def _stale(self, f: os.DirEntry[str], now: float) -> bool:
        parts = f.name.split(".")  # "", name, host, pid, n, "tmp"
        if len(parts) == 6 and parts[2] == _HOST and parts[3].isdigit() and not _alive(int(parts[3])):
            return True  # this host's writer is gone
        try:
            return now - f.stat(follow_symlinks=False).st_mtime > self.stale_tmp_s
        except OSError:
            return False

    def describe(self) -> dict[str, Any]:
        return {
            "storage": self.name,
            "root": str(self.root),
            "fsync": self.fsync,
            "mode": oct(self.mode),
            "direct": self.direct,
        }

    def __repr__(self) -> str:
        return f"<FileStorage {str(self.root)!r}>"


class _Reader:
    """The descriptors one read batch needs: the root's and the fan-out directories'."""

    def __init__(self, store: FileStorage) -> None:
        self.store = store
        self.root_fd: int | None = None
        self.dirs: dict[str, int | None] = {}

    def __enter__(self) -> _Reader:
        try:
            self.root_fd = self.store._open_root(create=False)
        except NotADirectoryError:
            self.root_fd = None  # the root was replaced by a file: every page is missing
        except OSError as exc:
            raise StorageError(f"file storage: cannot read under {self.store.root}: {exc}") from exc
        return self

    def open(self, key: str) -> Any:
        """The page file of ``key`` opened for reading, or ``None`` (see :meth:`open_fd`)."""
        opened = self.open_fd(key)
        if opened is None:
            return None
        fd = opened[0]
        try:
            return open(fd, "rb", closefd=True)  # the caller closes it
        except BaseException:
            with contextlib.suppress(OSError):
                os.close(fd)
            raise

    def open_fd(self, key: str) -> tuple[int, int] | None:
        """(a descriptor of the page file of ``key`` opened for reading, its size; the
        caller closes it), or ``None``: missing, a symlink, not a regular file, or under
        a fan-out entry that is not a real directory."""
        if self.root_fd is None:
            return None
        d, name = _place(key)
        try:
            if d in self.dirs:
                dfd = self.dirs[d]
            else:
                dfd = self.dirs[d] = self.store._open_dir(self.root_fd, d, False)
            if dfd is None:
                return None
            fd = os.open(name, _READ_FLAGS, dir_fd=dfd)
        except FileNotFoundError:
            return None
        except OSError as exc:
            if exc.errno in _SYMLINK_ERRNOS or exc.errno in (errno.ENOTDIR, errno.EISDIR):
                return None
            raise StorageError(f"file storage: cannot read {self.store.root / d / name}: {exc}") from exc
        try:
            st = os.fstat(fd)
        except BaseException:
            os.close(fd)
            raise
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)
            return None
        return fd, st.st_size

    def __exit__(self, *exc: object) -> None:
        for fd in self.dirs.values():
            if fd is not None:
                os.close(fd)
        if self.root_fd is not None:
            os.close(self.root_fd)


def _place(key: str) -> tuple[str, str]:
    """(fan-out directory, file name) of ``key``: both plain names, never a path."""
    name = key if _PLAIN_KEY.fullmatch(key) else "h" + hashlib.sha256(key.encode()).hexdigest()
    return name[:2], name


#: ``preadv``'s flag that reads only what the page cache holds (0: none on this system).
_NOWAIT: int = getattr(os, "RWF_NOWAIT", 0)

#: What ``preadv`` raises where a cached-only read would have to wait, or cannot be asked.
_NOT_CACHED = (errno.EAGAIN, errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS)


def _read_payload(
    gate: WriteGate | None, fd: int, parts: list[memoryview], offset: int, length: int, flags: int
) -> bool:
    """One payload's ``preadv`` into ``parts`` (inside ``gate`` when given); whether it
    read all ``length`` bytes (False: the gate is closed, or ``flags`` asked for cached
    bytes only and the page cache did not hold them all)."""
    if gate is not None and not gate.enter():
        return False
    try:
        return os.preadv(fd, parts, offset, flags) == length
    except OSError as exc:
        if flags and exc.errno in _NOT_CACHED:
            return False
        raise
    finally:
        if gate is not None:
            gate.leave()


def _bytes_view(b: memoryview) -> memoryview:
    """``b`` as flat bytes for ``preadv`` (itself when it already is)."""
    return b if b.format == "B" and b.ndim == 1 and b.c_contiguous else b.cast("B")


def _alive(pid: int) -> bool:
    """Whether a process ``pid`` runs on this host (another user's counts as alive)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def _write_all(fd: int, *parts: bytes | memoryview) -> None:
    """Write ``parts`` in order: one ``writev`` call, more only after a short write."""
    views = [memoryview(p).cast("B") for p in parts]
    views = [v for v in views if v.nbytes]
    while views:
        n = os.writev(fd, views)
        while views and n >= views[0].nbytes:
            n -= views[0].nbytes
            views.pop(0)
        if views and n:
            views[0] = views[0][n:]
