"""SGLang 0.5.23's KV formats: its device KV pool as kvoffload's engine-owned
``device_kv`` (:func:`engine_kv_tensors`, re-exported by
:mod:`kvoffload.integrations.sglang`), and its L3 page format, as kvoffload writes it for
SGLang's HiCache storage (FAILURES F30): the host layouts it converts (:data:`LAYOUTS`), the conversion of one
kvoffload host page to SGLang's flat page and back (:class:`PageFormat`), HiCacheFile's
key suffix (:func:`file_suffix`), and HiCacheFile's file format written without SGLang
(:class:`SGLangFileFormat`, the fallback of
:func:`kvoffload.integrations.sglang_storage.sglang_storage`). Imports no SGLang module.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import anyio.to_thread

from kvoffload.abc import Storage
from kvoffload.errors import ConfigError, PartialWriteError, StorageError, UnsupportedKVPool

if TYPE_CHECKING:
    import torch

    from kvoffload.pools import HostPool

__all__ = ["LAYOUTS", "SGLANG_FILE_DIR", "PageFormat", "SGLangFileFormat", "engine_kv_tensors", "file_suffix"]

#: SGLang host-pool layouts (``--hicache-mem-layout``) this integration writes, per KV
#: kind, each converted exactly. Refused by name: ``page_head`` (heads before tokens:
#: kvoffload's pages never split heads), ``page_unified`` (SGLang's fused head-group
#: blocks), ``page_first_kv_split`` (Ascend NPU).
LAYOUTS = {
    "mha": ("layer_first", "page_first", "page_first_direct"),
    "mla": ("layer_first", "page_first", "page_first_direct"),
}
#: SGLang's HiCacheFile default directory.
SGLANG_FILE_DIR = "/tmp/hicache"

#: Buffers a plain MHA / MLA pool holds; any other ``*_buffer`` is per-token state this
#: integration would not copy (an indexer's keys, scales, labels): refused.
_KV_BUFFERS = {"mha": ("k_buffer", "v_buffer"), "mla": ("kv_buffer",)}


def _page_tensors(name: str, buffers: Any, page_size: int) -> list[Any]:
    """Each buffer of a pool as ``(num_pages, page_size, ...)`` views (no copy)."""
    if not isinstance(buffers, (list, tuple)) or not buffers:
        raise UnsupportedKVPool(f"the KV pool's {name} is {type(buffers).__name__}, not a list of tensors")
    views = []
    for i, t in enumerate(buffers):
        rows = int(t.shape[0])
        if rows % page_size:
            raise UnsupportedKVPool(
                f"the KV pool's {name}[{i}] has {rows} token rows, not a whole number of pages of {page_size}"
            )
        if not t.is_contiguous():
            raise UnsupportedKVPool(f"the KV pool's {name}[{i}] is not contiguous")
        views.append(t.view(rows // page_size, page_size, *t.shape[1:]))
    return views


def engine_kv_tensors(kv_pool: Any, page_size: int) -> tuple[str, list[Any]]:
    """SGLang's KV pool as engine-owned ``device_kv``: ``("mha", [K0, V0, K1, V1, ...])``
    or ``("mla", [KV0, KV1, ...])``, each a ``(num_pages, page_size, ...)`` view of the
    pool's own buffer.

    Raises :class:`~kvoffload.UnsupportedKVPool` for what this integration cannot offload
    yet, naming it: sliding-window (SWA) and hybrid (linear attention / Mamba) pools, a
    pool with per-token state besides K and V (an NSA indexer's keys, FP4 scales,
    DoubleSparse labels), SGLang's HND layout (``SGLANG_USE_HND_KVCACHE=1``: buffers of
    pages, not token rows), a device other than CUDA or CPU (NPU), buffers that are not
    whole pages.
    """
    kind_name = type(kv_pool).__name__
    if "SWA" in kind_name or hasattr(kv_pool, "swa_kv_pool") or hasattr(kv_pool, "full_kv_pool"):
        raise UnsupportedKVPool(
            f"{kind_name}: sliding-window (SWA) KV pools are not supported yet; "
            "supported: a plain MHA pool (k_buffer, v_buffer) or MLA pool (kv_buffer)"
        )
    if "Hybrid" in kind_name or "Mamba" in kind_name or hasattr(kv_pool, "mamba_pool"):
        raise UnsupportedKVPool(
            f"{kind_name}: hybrid (linear-attention / Mamba) KV pools are not supported yet; "
            "supported: a plain MHA pool (k_buffer, v_buffer) or MLA pool (kv_buffer)"
        )
    layout = getattr(kv_pool, "kv_cache_layout", None)
    if layout not in (None, "nhd"):
        # SGLang's HND layout (SGLANG_USE_HND_KVCACHE=1) holds each buffer as (pages,
        # heads, page size, head dim): its first dimension is not one row per token.
        raise UnsupportedKVPool(
            f"{kind_name} has kv_cache_layout={layout!r}: only the token-major 'nhd' layout "
            "(one row per token) is supported"
        )
    if hasattr(kv_pool, "k_buffer") and hasattr(kv_pool, "v_buffer"):
        kind = "mha"
        k = _page_tensors("k_buffer", kv_pool.k_buffer, page_size)
        v = _page_tensors("v_buffer", kv_pool.v_buffer, page_size)
        if len(k) != len(v):
            raise UnsupportedKVPool(f"{kind_name}: {len(k)} K buffers but {len(v)} V buffers")
        tensors = [t for pair in zip(k, v, strict=True) for t in pair]
    elif hasattr(kv_pool, "kv_buffer"):
        kind = "mla"
        tensors = _page_tensors("kv_buffer", kv_pool.kv_buffer, page_size)
    else:
        raise UnsupportedKVPool(
            f"{kind_name}: not a KV pool this integration knows (no k_buffer/v_buffer, no kv_buffer); "
            "supported: a plain MHA or MLA pool"
        )
    # Per-token state besides the KV: another *_buffer, or a *_cache object (DSA's NSA
    # indexer keys live in ``index_key_cache``, an IndexKeyCache; a flag such as MHA's
    # ``use_native_move_kv_cache`` is no state).
    extra = sorted(
        a
        for a, value in vars(kv_pool).items()
        if a not in _KV_BUFFERS[kind]
        and value is not None
        and (a.endswith("_buffer") or (a.endswith("_cache") and not isinstance(value, (bool, int, str))))
    )
    if extra:
        raise UnsupportedKVPool(
            f"{kind_name} holds per-token state besides the KV ({', '.join(extra)}) that this "
            "integration would not copy: not supported yet"
        )
    device = tensors[0].device
    if device.type not in ("cuda", "cpu"):
        raise UnsupportedKVPool(
            f"{kind_name} is on {device}: only CUDA (and CPU, for tests) are supported; NPU is not yet"
        )
    return kind, tensors


def _refuse_layout(kind: str, layout: str) -> UnsupportedKVPool:
    return UnsupportedKVPool(
        f"hicache_mem_layout={layout!r} is not a layout kvoffload writes for SGLang's {kind.upper()} "
        f"pages; supported: {', '.join(LAYOUTS[kind])}"
    )


class PageFormat:
    """How one kvoffload host page maps onto SGLang's flat data page (the bytes
    ``get_data_page(i).flatten()`` holds, which every SGLang backend stores).

    kvoffload's host page (``engine_kv_tensors``' order) is, for MHA, layer-major then
    K/V then token ``(L, 2, P, row)``; for MLA ``(L, P, row)``, where ``row`` is one
    token's bytes of one buffer. SGLang's flat page, per layout (SGLang 0.5.23,
    ``pool_host/mha.py`` / ``mla.py``, ``get_data_page``)::

        MHA layer_first, page_first_direct: (2, L, P, row)   page_first: (2, P, L, row)
        MLA layer_first, page_first_direct: (L, P, row)      page_first: (P, L, row)

    Pure torch on bytes (no SGLang import): the same bytes whatever the dtype.
    """

    def __init__(self, kind: str, layout: str, layers: int, page_size: int, row_bytes: int) -> None:
        if kind not in LAYOUTS:
            raise ConfigError(f"KV kind must be 'mha' or 'mla', got {kind!r}")
        if layout not in LAYOUTS[kind]:
            raise _refuse_layout(kind, layout)
        for name, v in (("layers", layers), ("page_size", page_size), ("row_bytes", row_bytes)):
            if type(v) is not int or v < 1:
                raise ConfigError(f"{name} must be a positive int, got {v!r}")
        self.kind = kind
        self.layout = layout
        self.layers = layers
        self.page_size = page_size
        self.row_bytes = row_bytes
        self.parts = 2 if kind == "mha" else 1
        self.page_bytes = self.parts * layers * page_size * row_bytes

    def to_sglang(self, page: torch.Tensor) -> torch.Tensor:
        """kvoffload's page (``page_bytes`` uint8) as SGLang's flat page (a new
        contiguous uint8 tensor)."""
        L, P, R = self.layers, self.page_size, self.row_bytes
        if self.kind == "mha":
            x = page.view(L, 2, P, R)
            y = x.permute(1, 2, 0, 3) if self.layout == "page_first" else x.permute(1, 0, 2, 3)
        else:
            x = page.view(L, P, R)
            y = x.permute(1, 0, 2) if self.layout == "page_first" else x
        return y.contiguous().view(-1)

    def to_kvoffload(self, flat: torch.Tensor) -> torch.Tensor:
        """SGLang's flat page (``page_bytes`` uint8) as kvoffload's page (contiguous uint8)."""
        L, P, R = self.layers, self.page_size, self.row_bytes
        if self.kind == "mha":
            if self.layout == "page_first":
                y = flat.view(2, P, L, R).permute(2, 0, 1, 3)
            else:
                y = flat.view(2, L, P, R).permute(1, 0, 2, 3)
        else:
            y = flat.view(P, L, R).permute(1, 0, 2) if self.layout == "page_first" else flat.view(L, P, R)
        return y.contiguous().view(-1)

    def __repr__(self) -> str:
        return (
            f"<PageFormat {self.kind} {self.layout} L={self.layers} P={self.page_size} row={self.row_bytes}B>"
        )


def _u8(buf: bytes | bytearray | memoryview) -> torch.Tensor:
    """A uint8 tensor over ``buf``'s bytes (no copy; read only by the caller)."""
    import warnings

    import torch

    with warnings.catch_warnings():  # a read-only buffer: never written through this view
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(buf, dtype=torch.uint8)


def _check_sizes(fmt: PageFormat, pages: Sequence[bytes | memoryview]) -> None:
    for i, p in enumerate(pages):
        n = memoryview(p).nbytes
        if n != fmt.page_bytes:
            raise StorageError(
                f"page {i} has {n} bytes, SGLang's {fmt.kind.upper()} page of this pool has "
                f"{fmt.page_bytes}: the KV pool and SGLang's host pool disagree"
            )


def file_suffix(model_name: str | None, kind: str, tp_rank: int, tp_size: int) -> str:
    """SGLang 0.5.23 HiCacheFile's key suffix (no pipeline or context parallelism):
    ``_<model>_<tp_rank>_<tp_size>`` for MHA (even at TP 1), ``_<model>`` for MLA
    (replicated on every rank); ``/`` in the model name becomes ``-``."""
    model = "-".join(model_name.split("/")) if model_name else ""
    return f"_{model}" if kind == "mla" else f"_{model}_{tp_rank}_{tp_size}"


class _PutOnThread(Storage):
    """``put`` and ``put_pages`` as one blocking ``_put_sync(keys, pages)`` on a worker
    thread (SGLang's storage objects are synchronous)."""

    def _put_sync(self, keys: list[str], pages: Sequence[bytes | memoryview]) -> None:
        raise NotImplementedError

    async def put(self, keys: Sequence[str], pages: Sequence[bytes]) -> None:
        if len(keys) != len(pages):
            raise ValueError(f"{len(keys)} keys for {len(pages)} pages")
        if keys:
            await anyio.to_thread.run_sync(self._put_sync, list(keys), list(pages))

    async def put_pages(self, keys: Sequence[str], host_pool: HostPool, host_pages: Sequence[int]) -> None:
        from kvoffload.pools import page_views

        if len(keys) != len(host_pages):
            raise ValueError(f"{len(keys)} keys for {len(host_pages)} pages")
        if keys:
            await anyio.to_thread.run_sync(self._put_sync, list(keys), page_views(host_pool, host_pages))


class SGLangFileFormat(_PutOnThread):
    """SGLang 0.5.23 HiCacheFile's format written by kvoffload itself (the fallback of
    :func:`sglang_storage` where SGLang's storage object cannot be built): one file per
    page, ``<root>/<key><suffix>.bin`` (:func:`file_suffix`), holding SGLang's flat page
    (no header), written to a temporary name and renamed; a key whose file exists is
    skipped, as HiCacheFile's ``set`` skips it. A read takes a file of exactly one
    page's size; nothing else about it can be checked (SGLang's files carry no key,
    length or checksum)."""

    name = "sglang-file"
    rank_suffixed = True

    def __init__(self, root: str | os.PathLike[str], suffix: str, fmt: PageFormat) -> None:
        self.root = os.fspath(root)
        self.suffix = suffix
        self.fmt = fmt
        os.makedirs(self.root, exist_ok=True)
        self.pages_written = 0
        self.pages_found = 0

    def path(self, key: str) -> str:
        """Where SGLang's HiCacheFile keeps the page of ``key``."""
        if not key or "/" in key or key.startswith("."):
            raise StorageError(f"{key!r} is not a page key SGLang's file backend can hold")
        return os.path.join(self.root, f"{key}{self.suffix}.bin")

    def _put_sync(self, keys: list[str], pages: Sequence[bytes | memoryview]) -> None:
        _check_sizes(self.fmt, pages)
        for done, (key, page) in enumerate(zip(keys, pages, strict=True)):
            path = self.path(key)
            if os.path.exists(path):
                self.pages_found += 1
                continue
            tmp = os.path.join(self.root, f".{uuid.uuid4().hex}.tmp")
            try:
                with open(tmp, "wb") as f:
                    f.write(self.fmt.to_sglang(_u8(page)).numpy().data)
                os.replace(tmp, path)
            except OSError as exc:
                with contextlib.suppress(OSError):
                    os.remove(tmp)
                message = f"SGLang file format: cannot write {path}: {exc}"
                if done:  # the pages before it are stored: say so, page by page (F34)
                    stored = [i < done for i in range(len(keys))]
                    why = [None if s else message for s in stored]
                    raise PartialWriteError(message, stored, why) from exc
                raise StorageError(message) from exc
            self.pages_written += 1

    async def get(self, keys: Sequence[str]) -> list[bytes | None]:
        return await anyio.to_thread.run_sync(self._get_sync, list(keys))

    def _get_sync(self, keys: list[str]) -> list[bytes | None]:
        out: list[bytes | None] = []
        for key in keys:
            try:
                with open(self.path(key), "rb") as f:
                    raw = f.read(self.fmt.page_bytes + 1)
            except FileNotFoundError:
                out.append(None)
                continue
            except OSError as exc:
                raise StorageError(f"SGLang file format: cannot read {self.path(key)}: {exc}") from exc
            if len(raw) != self.fmt.page_bytes:
                out.append(None)  # torn or foreign: the one thing a raw file lets us check
                continue
            out.append(self.fmt.to_kvoffload(_u8(bytearray(raw))).numpy().tobytes())
        return out

    async def exists_prefix(self, keys: Sequence[str]) -> int:
        n = 0
        for key in keys:
            if not os.path.exists(self.path(key)):
                break
            n += 1
        return n

    def describe(self) -> dict[str, Any]:
        return {"storage": self.name, "root": self.root, "suffix": self.suffix, "layout": self.fmt.layout}

    def __repr__(self) -> str:
        return f"<SGLangFileFormat {self.root!r} *{self.suffix}.bin {self.fmt.layout}>"
