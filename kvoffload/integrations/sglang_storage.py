"""Storage that SGLang's own HiCache storage reads: what the SGLang drop-in stores goes
through SGLang's ``HiCacheStorage`` object, in SGLang's host-page layout, under
SGLang's own keys (FAILURES F30).

SGLang's prefill side finds decode-offloaded pages only through its L3 backend
(``--hicache-storage-backend``: file, mooncake, 3fs, nixl, ...), which keys every page
by its chain hash plus the backend's own suffix and holds raw page bytes in the host
pool's layout (``--hicache-mem-layout``). :class:`SGLangHiCacheStorage` is a kvoffload
:class:`~kvoffload.abc.Storage` that, for each page kvoffload writes:

1. asks SGLang's backend which leading pages it already holds (``batch_exists``, as
   SGLang's prefetch does) and skips them: a decode node never stores a page twice,
   and a page SGLang's prefill stored is found by kvoffload's lookup;
2. rewrites kvoffload's host page (layer, then K/V, then token) into SGLang's flat page
   order for the layout, and places it in a real SGLang host pool (built by SGLang's
   ``build_kv_host_pool``) with the pool's own ``set_from_flat_data_page``, at host
   indices the pool's own allocator hands out;
3. calls the backend the way SGLang's ``HiCacheController`` does for it:
   ``batch_set_v1(keys, host_indices)`` for the zero-copy backends (mooncake, hf3fs,
   nixl, ...: they read the host pool by index), ``batch_set(keys, pages)`` of
   ``get_data_page`` for the others (file);
4. counts a page stored only where the backend confirmed it (``batch_set_v1``'s
   per-page result; after a ``batch_set`` that failed, ``exists`` per page): a batch
   with an unconfirmed page raises :class:`~kvoffload.PartialWriteError` naming the
   pages confirmed (F34, SGLang #38316), so kvoffload counts exactly those.

Reads (``get`` / ``get_into``, kvoffload's load path) go the same way back, and
``exists_prefix`` is the backend's ``batch_exists``.

Where SGLang's storage object cannot be built (SGLang not importable, its runtime
config not published in this process, or its host pool not buildable: it pins memory,
which needs CUDA), :func:`sglang_storage` falls back for the
``file`` backend to :class:`SGLangFileFormat`, which writes HiCacheFile's format itself:
``<dir>/<key>_<model>_<tp_rank>_<tp_size>.bin`` (MHA) or ``<dir>/<key>_<model>.bin``
(MLA), raw page bytes in the layout's order, skipped when the file exists.

What SGLang's raw pages lack, and what is still checked: docs/integrations/sglang.md
("Storage SGLang reads"). SGLang is imported lazily: ``import kvoffload`` never needs it.

Threading: the storage writer calls ``put_pages`` and ``lookup`` calls
``exists_prefix`` on kvoffload's writer loop; every SGLang call runs on a worker thread
(``anyio.to_thread``), one batch at a time through the staging host pool (a lock).
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import anyio.to_thread

from kvoffload.abc import Storage
from kvoffload.errors import ConfigError, PartialWriteError, StorageError, UnsupportedKVPool
from kvoffload.integrations.sglang_format import (
    LAYOUTS,
    SGLANG_FILE_DIR,
    PageFormat,
    SGLangFileFormat,
    _check_sizes,
    _PutOnThread,
    _u8,
    engine_kv_tensors,
    file_suffix,
)

if TYPE_CHECKING:
    import torch


__all__ = [
    "LAYOUTS",
    "ZERO_COPY_BACKENDS",
    "PageFormat",
    "SGLangFileFormat",
    "SGLangHiCacheStorage",
    "file_suffix",
    "sglang_storage",
]

#: The backends SGLang 0.5.23's ``HiCacheController.attach_storage_backend`` writes with
#: ``batch_set_v1(keys, host_indices)`` (zero copy: they read the host pool by index);
#: every other backend gets ``batch_set(keys, [host_pool.get_data_page(i), ...])``.
#: (``"dynamic"`` too when its extra config sets ``interface_v1``.)
ZERO_COPY_BACKENDS = (
    "hf3fs",
    "mooncake",
    "npu_memcache",
    "eic",
    "nixl",
    "simm",
    "mori",
    "tensorcast",
    "seaweedfs",
)
#: Pages per SGLang storage call (SGLang's ``STORAGE_BATCH_SIZE``).
BATCH = 128


class SGLangHiCacheStorage(_PutOnThread):
    """kvoffload pages stored through SGLang's own ``HiCacheStorage`` (module docstring).

    ``backend`` is the HiCacheStorage SGLang's factory built, ``host_pool`` the SGLang
    host pool registered with it (the staging pages: at most ``host_pool``'s free pages
    per call), ``backend_name`` the ``--hicache-storage-backend`` name (it picks the
    write call, as in SGLang's controller), ``fmt`` the page format. Built by
    :func:`sglang_storage`.
    """

    name = "sglang"
    #: Keys go to SGLang's backend as they are: it adds its own model / rank suffix, so
    #: kvoffload's TP key space (``RankKeys``) must not add another.
    rank_suffixed = True

    def __init__(
        self,
        backend: Any,
        host_pool: Any,
        backend_name: str,
        fmt: PageFormat,
        *,
        zero_copy: bool | None = None,
        extra_info: Any = None,
    ) -> None:
        self.backend = backend
        self.host_pool = host_pool
        self.backend_name = backend_name
        self.fmt = fmt
        self.zero_copy = backend_name in ZERO_COPY_BACKENDS if zero_copy is None else zero_copy
        self._extra_info = extra_info
        pool_page = int(host_pool.get_size_per_token()) * int(host_pool.page_size)
        if pool_page != fmt.page_bytes:
            raise ConfigError(
                f"SGLang's host pool holds {pool_page} bytes per page, kvoffload's page format "
                f"{fmt.page_bytes}: they must describe the same KV"
            )
        # _lock: one batch at a time uses the staging host pool (writes and reads).
        self._lock = threading.Lock()
        # pages_written: pages the backend confirmed from a write of this store;
        # pages_found: pages skipped because the backend already held them (SGLang's
        #   prefill or another decode node stored them). Both only grow.
        self.pages_written = 0
        self.pages_found = 0

    # --- writes ----------------------------------------------------------------------------

    def _put_sync(self, keys: list[str], pages: Sequence[bytes | memoryview]) -> None:
        """Write every page SGLang's backend does not hold yet; raise unless the backend
        confirmed every page (F34): :class:`~kvoffload.PartialWriteError` naming the
        pages it confirmed (held already, or written and confirmed) when some were, a
        plain :class:`~kvoffload.StorageError` when none was. A batch or staging part
        that fails does not stop the others."""
        _check_sizes(self.fmt, pages)
        # ok[i]: the backend confirmed page i; why[i]: why not (None where it did).
        ok = [False] * len(keys)
        why: list[str | None] = ["not written"] * len(keys)
        with self._lock:
            for start in range(0, len(keys), BATCH):
                batch = keys[start : start + BATCH]
                try:
                    have = self._stored_prefix(batch)
                except StorageError as exc:
                    why[start : start + len(batch)] = [str(exc)] * len(batch)
                    continue
                self.pages_found += have
                for i in range(start, start + have):
                    ok[i], why[i] = True, None
                todo = list(range(start + have, start + len(batch)))
                room = max(1, self.host_pool.available_size() // self.fmt.page_size)
                for i in range(0, len(todo), room):
                    which = todo[i : i + room]
                    try:
                        got = self._write(keys, pages, which)
                        reason = f"SGLang {self.backend_name} storage did not confirm the page"
                    except StorageError as exc:
                        got, reason = [False] * len(which), str(exc)
                    for j, good in zip(which, got, strict=True):
                        ok[j], why[j] = good, None if good else reason
        bad = ok.count(False)
        if not bad:
            return
        first = keys[ok.index(False)]
        message = (
            f"SGLang {self.backend_name} storage did not confirm {bad} of {len(keys)} page(s) "
            f"(first {first[:16]}...: {why[ok.index(False)]}): not counted as stored"
        )
        if bad == len(keys):
            raise StorageError(message)
        raise PartialWriteError(message, ok, why)

    def _stored_prefix(self, keys: list[str]) -> int:
        try:
            return int(self.backend.batch_exists(keys, self._extra_info))
        except Exception as exc:
            raise StorageError(f"SGLang {self.backend_name} storage: batch_exists failed: {exc}") from exc

    def _write(self, keys: list[str], pages: Sequence[bytes | memoryview], which: list[int]) -> list[bool]:
        """Stage pages ``which`` in SGLang's host pool and write them: whether the
        backend confirmed each (F34). Raises :class:`~kvoffload.StorageError` when the
        write could not be made (no staging room, the backend raised)."""
        hp, ps = self.host_pool, self.fmt.page_size
        idx = hp.alloc(len(which) * ps)
        if idx is None:
            raise StorageError(
                f"SGLang {self.backend_name} storage: the staging host pool has no room for "
                f"{len(which)} page(s)"
            )
        batch = [keys[i] for i in which]
        try:
            for j, i in enumerate(which):
                flat = self.fmt.to_sglang(_u8(pages[i]))
                hp.set_from_flat_data_page(int(idx[j * ps]), flat.view(hp.dtype))
            ok = self._set(batch, idx)
        finally:
            hp.free(idx)
        self.pages_written += sum(ok)
        return ok

    def _set(self, keys: list[str], idx: torch.Tensor) -> list[bool]:
        """The write SGLang's controller makes for this backend; per-page results."""
        b, ps = self.backend, self.fmt.page_size
        try:
            if self.zero_copy:
                results = b.batch_set_v1(keys, idx, self._extra_info)
                if results is None or len(results) != len(keys):
                    return [False] * len(keys)
                return [bool(r) for r in results]
            data = [self.host_pool.get_data_page(idx[j * ps]) for j in range(len(keys))]
            if b.batch_set(keys, data):
                return [True] * len(keys)
            return [bool(b.exists(k)) for k in keys]  # which ones it did store (F34)
        except Exception as exc:
            raise StorageError(f"SGLang {self.backend_name} storage: write failed: {exc}") from exc

    # --- reads ------------------------------------------------------------------------------

    async def get(self, keys: Sequence[str]) -> list[bytes | None]:
        if not keys:
            return []
        return await anyio.to_thread.run_sync(self._get_sync, list(keys))

    def _get_sync(self, keys: list[str]) -> list[bytes | None]:
        out: list[bytes | None] = []
        with self._lock:
            for start in range(0, len(keys), BATCH):
                out.extend(
                    p if p is None else p.numpy().tobytes() for p in self._read(keys[start : start + BATCH])
                )
        return out

    async def get_into(self, keys: Sequence[str], dest: Sequence[memoryview]) -> int:
        if len(keys) != len(dest):
            raise ValueError(f"{len(keys)} keys for {len(dest)} buffers")
        if not keys:
            return 0
        return await anyio.to_thread.run_sync(self._get_into_sync, list(keys), list(dest))

    def _get_into_sync(self, keys: list[str], dest: list[memoryview]) -> int:
        n = 0
        with self._lock:
            for start in range(0, len(keys), BATCH):
                for page, buf in zip(self._read(keys[start : start + BATCH]), dest[start:], strict=False):
                    out = buf.cast("B")
                    if page is None or out.nbytes != page.numel():
                        return n
                    out[:] = page.numpy().data
                    n += 1
        return n

    def _read(self, keys: list[str]) -> list[torch.Tensor | None]:
        """Pages of ``keys`` as kvoffload pages (uint8), ``None`` where missing or not one
        page's size, read the way SGLang's prefetch reads them for this backend."""
        hp, ps, fmt = self.host_pool, self.fmt.page_size, self.fmt
        out: list[torch.Tensor | None] = []
        room = max(1, hp.available_size() // ps)
        for s in range(0, len(keys), room):
            batch = keys[s : s + room]
            try:
                pages = self._read_zero_copy(batch) if self.zero_copy else self._read_generic(batch)
            except StorageError:
                raise
            except Exception as exc:
                raise StorageError(f"SGLang {self.backend_name} storage: read failed: {exc}") from exc
            for p in pages:
                raw = None if p is None else p.contiguous().view(-1).view(_torch().uint8)
                out.append(None if raw is None or raw.numel() != fmt.page_bytes else fmt.to_kvoffload(raw))
        return out

    def _read_zero_copy(self, keys: list[str]) -> list[Any]:
        """``batch_get_v1`` into staging host pages, as SGLang's zero-copy prefetch."""
        hp, ps = self.host_pool, self.fmt.page_size
        idx = hp.alloc(len(keys) * ps)
        if idx is None:
            raise StorageError(
                f"SGLang {self.backend_name} storage: no staging room to read {len(keys)} page(s)"
            )
        try:
            got = list(self.backend.batch_get_v1(keys, idx, self._extra_info) or [])
            got += [False] * (len(keys) - len(got))
            return [
                hp.get_data_page(int(idx[j * ps]), flat=True).clone() if got[j] else None
                for j in range(len(keys))
            ]
        finally:
            hp.free(idx)

    def _read_generic(self, keys: list[str]) -> list[Any]:
        """``batch_get`` into dummy flat pages, as SGLang's generic prefetch; a page
        whose read raises (HiCacheFile raises on a short file) reads as missing."""
        hp, b = self.host_pool, self.backend
        try:
            got = b.batch_get(keys, [hp.get_dummy_flat_data_page() for _ in keys])
        except Exception:
            got = None
        if got is None or isinstance(got, int):
            got = []
            for k in keys:
                try:
                    got.append(b.get(k, hp.get_dummy_flat_data_page()))
                except Exception:
                    got.append(None)
        return list(got)

    async def exists_prefix(self, keys: Sequence[str]) -> int:
        """SGLang's ``batch_exists`` (in SGLang's batches): the pages its prefetch would
        find, counting from the first."""
        if not keys:
            return 0
        return await anyio.to_thread.run_sync(self._exists_sync, list(keys))

    def _exists_sync(self, keys: list[str]) -> int:
        n = 0
        for start in range(0, len(keys), BATCH):
            batch = keys[start : start + BATCH]
            hit = self._stored_prefix(batch)
            n += hit
            if hit < len(batch):
                break
        return n

    async def aclose(self) -> None:
        """Close SGLang's backend (where it has ``close``) and unregister the staging
        host pool's pinned memory (``destroy``)."""
        for part in (self.backend, self.host_pool):
            close = getattr(part, "close" if part is self.backend else "destroy", None)
            if callable(close):
                await anyio.to_thread.run_sync(close)

    def describe(self) -> dict[str, Any]:
        return {
            "storage": self.name,
            "backend": self.backend_name,
            "layout": self.fmt.layout,
            "kv": self.fmt.kind,
            "write": "batch_set_v1" if self.zero_copy else "batch_set",
            "pages_written": self.pages_written,
            "pages_found": self.pages_found,
        }

    def __repr__(self) -> str:
        return f"<SGLangHiCacheStorage {self.backend_name} {type(self.backend).__name__} {self.fmt.layout}>"


def _torch() -> Any:
    import torch

    return torch


def _parallel(name: str, default: int) -> int:
    """A value of SGLang's published parallel state, or ``default`` where unpublished."""
    try:
        from sglang.srt.runtime_context import get_parallel  # type: ignore[import-not-found, unused-ignore]

        return int(getattr(get_parallel(), name))
    except Exception:
        return default


def _published(name: str) -> Any:
    """A field of SGLang's published memory config, or ``None`` where SGLang does not
    import or nothing is published."""
    try:
        from sglang.srt.runtime_context import get_memory  # type: ignore[import-not-found, unused-ignore]

        return getattr(get_memory(), name)
    except Exception:
        return None


def _extra(extra_config: str | dict[str, Any] | None) -> dict[str, Any]:
    if extra_config is None or extra_config == "":
        return {}
    if isinstance(extra_config, dict):
        return dict(extra_config)
    try:
        value = json.loads(extra_config)
    except (TypeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"hicache_storage_backend_extra_config is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ConfigError(f"hicache_storage_backend_extra_config must be a JSON object, got {value!r:.80}")
    return value


def _kind_of(kv_pool: Any, page_size: int) -> str:
    kind, _ = engine_kv_tensors(kv_pool, page_size)
    return kind


def _row_bytes(kv_pool: Any, kind: str) -> tuple[int, int]:
    """(layers, bytes of one token's row of one buffer) of an SGLang KV pool."""
    if kind == "mla":
        t = kv_pool.kv_buffer[0]
        return len(kv_pool.kv_buffer), int(t[0].numel() * t.element_size())
    k, v = kv_pool.k_buffer[0], kv_pool.v_buffer[0]
    kb, vb = int(k[0].numel() * k.element_size()), int(v[0].numel() * v.element_size())
    if kb != vb:
        raise UnsupportedKVPool(
            f"{type(kv_pool).__name__}: K rows of {kb} bytes and V rows of {vb} bytes (head_dim != "
            "v_head_dim): SGLang's asymmetric host pool has no flat page for its L3 storage; not supported"
        )
    return len(kv_pool.k_buffer), kb


def sglang_storage(
    backend: str,
    extra_config: str | dict[str, Any] | None,
    model_name: str | None,
    tp_rank: int,
    tp_size: int,
    mem_layout: str | None,
    kv_pool: Any,
    *,
    page_size: int,
    staging_pages: int = 8,
) -> Storage:
    """A kvoffload store of SGLang's own L3 storage, as SGLang's decode offload manager
    builds it: ``backend`` (``--hicache-storage-backend``), ``extra_config``
    (``--hicache-storage-backend-extra-config``, JSON or a dict), ``model_name``
    (``served_model_name``), this rank's ``tp_rank`` of ``tp_size``, ``mem_layout``
    (``--hicache-mem-layout``: the prefill must read with the same; ``None``: SGLang's
    published one, else SGLang's default ``page_first``), the engine's KV pool, and its
    ``page_size``.

    Builds SGLang's host pool (``build_kv_host_pool``, ``staging_pages`` pages) and
    SGLang's backend (``StorageBackendFactory.create_backend``, with the storage config
    SGLang's controller makes), then :class:`SGLangHiCacheStorage`. Where SGLang's
    objects cannot be built here (SGLang not importable, its runtime config not
    published, its host pool not built: it pins memory, which needs CUDA), the ``file``
    backend falls back to :class:`SGLangFileFormat` under
    HiCacheFile's directory (``SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR``, then
    ``file_storage_path`` of the extra config, then /tmp/hicache); any other backend
    raises :class:`~kvoffload.ConfigError` saying why.

    Raises :class:`~kvoffload.UnsupportedKVPool` for a layout or pool it would not
    convert exactly (naming what is supported).
    """
    if type(tp_size) is not int or tp_size < 1 or type(tp_rank) is not int or not 0 <= tp_rank < tp_size:
        raise ConfigError(f"tp_rank must be in 0..tp_size-1 and tp_size >= 1, got {tp_rank!r} of {tp_size!r}")
    if type(staging_pages) is not int or staging_pages < 1:
        raise ConfigError(f"staging_pages must be a positive int, got {staging_pages!r}")
    if mem_layout is None:
        mem_layout = _published("hicache_mem_layout") or "page_first"
    kind = _kind_of(kv_pool, page_size)
    layers, row = _row_bytes(kv_pool, kind)
    fmt = PageFormat(kind, mem_layout, layers, page_size, row)  # refuses a layout by name
    extra = _extra(extra_config)
    try:
        return _through_sglang(backend, extra, model_name, tp_rank, tp_size, kv_pool, fmt, staging_pages)
    except _CannotBuild as why:
        if backend != "file":
            raise ConfigError(
                f"hicache_storage_backend={backend!r}: SGLang's storage object cannot be built here "
                f"({why}); kvoffload writes SGLang's own format without SGLang only for 'file'"
            ) from None
        from kvoffload.core.events import logger

        root = (
            os.environ.get("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR")
            or extra.get("file_storage_path")
            or SGLANG_FILE_DIR
        )
        logger.warning("sglang.storage_fallback", backend=backend, root=str(root), reason=str(why))
        return SGLangFileFormat(root, file_suffix(model_name, kind, tp_rank, tp_size), fmt)


class _CannotBuild(Exception):
    """SGLang's storage objects cannot be built in this process (the reason)."""


def _through_sglang(
    backend: str,
    extra: dict[str, Any],
    model_name: str | None,
    tp_rank: int,
    tp_size: int,
    kv_pool: Any,
    fmt: PageFormat,
    staging_pages: int,
) -> SGLangHiCacheStorage:
    try:
        from sglang.srt.managers.cache_controller import storage_model_name  # type: ignore[import-not-found, unused-ignore]
        from sglang.srt.mem_cache.hicache_storage import (  # type: ignore[import-not-found, unused-ignore]
            HiCacheStorageConfig,
            HiCacheStorageExtraInfo,
        )
        from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import build_kv_host_pool  # type: ignore[import-not-found, unused-ignore]
        from sglang.srt.mem_cache.storage import StorageBackendFactory  # type: ignore[import-not-found, unused-ignore]
        from sglang.srt.runtime_context import get_memory  # type: ignore[import-not-found, unused-ignore]
    except Exception as exc:
        raise _CannotBuild(f"SGLang does not import: {type(exc).__name__}: {exc}") from exc
    try:
        published = get_memory().hicache_mem_layout
    except Exception as exc:
        raise _CannotBuild(f"SGLang's runtime config is not published: {exc}") from exc
    if published != fmt.layout:
        raise ConfigError(
            f"hicache_mem_layout={fmt.layout!r} but SGLang's published config says {published!r}: "
            "the host pool is built from the published one"
        )
    if _parallel("attn_dcp_size", 1) > 1:
        raise UnsupportedKVPool(
            "decode context parallelism (DCP): SGLang's DCP storage shards are not supported"
        )
    # Room for the staging pages (SGLang sizes a host pool in GB; one page more for its
    # padding page and rounding).
    host_gb = (staging_pages + 2) * fmt.page_bytes / 1e9
    try:
        host_pool = build_kv_host_pool(
            kv_pool=kv_pool, page_size=fmt.page_size, use_mla=fmt.kind == "mla", host_size=host_gb
        )
    except Exception as exc:  # e.g. no CUDA to pin it with (a CPU-only machine)
        raise _CannotBuild(f"SGLang's build_kv_host_pool failed: {type(exc).__name__}: {exc}") from exc
    if host_pool.layout != fmt.layout:
        raise ConfigError(f"SGLang built a {host_pool.layout!r} host pool, not {fmt.layout!r}")
    tp_lcm = extra.pop("tp_lcm_size", None)
    config = HiCacheStorageConfig(
        tp_rank=tp_rank,
        tp_size=tp_size,
        pp_rank=_parallel("pp_rank", 0),
        pp_size=_parallel("pp_size", 1),
        attn_cp_rank=_parallel("attn_cp_rank", 0),
        attn_cp_size=_parallel("attn_cp_size", 1),
        is_mla_model=fmt.kind == "mla",
        enable_storage_metrics=False,
        is_page_first_layout=fmt.layout == "page_first",
        model_name=storage_model_name(model_name, host_pool),
        tp_lcm_size=tp_lcm,
        should_split_heads=False,  # only for page_head, which is refused
        dp_rank=_parallel("attn_dp_rank", 0),
        extra_config=extra,
    )
    try:
        store = StorageBackendFactory.create_backend(backend, config, host_pool)
        store.register_mem_pool_host(host_pool)
        store.on_host_pools_registered()
    except Exception as exc:
        raise ConfigError(
            f"SGLang's storage backend {backend!r} could not be built: {type(exc).__name__}: {exc}"
        ) from exc
    zero_copy = backend in ZERO_COPY_BACKENDS or (backend == "dynamic" and bool(extra.get("interface_v1", 0)))
    return SGLangHiCacheStorage(
        store,
        host_pool,
        backend,
        fmt,
        zero_copy=zero_copy,
        extra_info=HiCacheStorageExtraInfo(prefix_keys=None),
    )
