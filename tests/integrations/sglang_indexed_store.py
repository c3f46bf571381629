"""A zero-copy SGLang L3 backend for the CPU: it reads and writes SGLang's host pool by
page index through the pool's own ``get_page_buffer_meta`` (pointers and byte sizes),
as mooncake and 3fs do (``batch_set_v1`` / ``batch_get_v1``), and keeps the bytes in a
dict shared by every instance of one ``store`` name.

Why a stand-in: SGLang's zero-copy backends need their servers and native clients
(mooncake's transfer engine, 3fs' USRBIO), none of which run here. SGLang builds this
one through its own factory (``--hicache-storage-backend dynamic`` with
``interface_v1``), and its controller picks its zero-copy page functions for it, as it
does for mooncake. Its methods are SGLang 0.5.23's ``HiCacheStorage`` signatures.
"""

from __future__ import annotations

import ctypes
from typing import Any

from sglang.srt.mem_cache.hicache_storage import HiCacheStorage

#: store name -> key -> the page's bytes, in get_page_buffer_meta's order.
STORES: dict[str, dict[str, bytes]] = {}
#: store name -> how many pages batch_set_v1 was asked to write.
WRITES: dict[str, int] = {}


class IndexedStore(HiCacheStorage):
    def __init__(self, storage_config: Any, kwargs: Any = None) -> None:
        name = (storage_config.extra_config or {}).get("store", "default")
        self.data = STORES.setdefault(name, {})
        self.name = name
        WRITES.setdefault(name, 0)
        self.suffix = f"_{storage_config.model_name}_{storage_config.tp_rank}_{storage_config.tp_size}"

    def _meta(self, keys: list[str], host_indices: Any) -> list[list[tuple[int, int]]]:
        ptrs, sizes = self.mem_pool_host.get_page_buffer_meta(host_indices)
        per = len(ptrs) // len(keys)
        return [
            list(zip(ptrs[i * per : (i + 1) * per], sizes[i * per : (i + 1) * per], strict=True))
            for i in range(len(keys))
        ]

    def batch_set_v1(self, keys: list[str], host_indices: Any, extra_info: Any = None) -> list[bool]:
        WRITES[self.name] += len(keys)
        for key, parts in zip(keys, self._meta(keys, host_indices), strict=True):
            self.data[key + self.suffix] = b"".join(ctypes.string_at(p, n) for p, n in parts)
        return [True] * len(keys)

    def batch_get_v1(self, keys: list[str], host_indices: Any, extra_info: Any = None) -> list[bool]:
        out = []
        for key, parts in zip(keys, self._meta(keys, host_indices), strict=True):
            raw = self.data.get(key + self.suffix)
            if raw is None or len(raw) != sum(n for _, n in parts):
                out.append(False)
                continue
            at = 0
            for p, n in parts:
                ctypes.memmove(p, raw[at : at + n], n)
                at += n
            out.append(True)
        return out

    def exists(self, key: str) -> bool:
        return key + self.suffix in self.data

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> Any:
        raise NotImplementedError("zero-copy only")

    def batch_get(self, keys: list[str], target_locations: Any = None, target_sizes: Any = None) -> Any:
        raise NotImplementedError("zero-copy only")

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        raise NotImplementedError("zero-copy only")

    def batch_set(
        self, keys: list[str], values: Any = None, target_locations: Any = None, target_sizes: Any = None
    ) -> bool:
        raise NotImplementedError("zero-copy only")
