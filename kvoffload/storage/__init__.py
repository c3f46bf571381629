"""Storage tiers, chosen by name and loaded lazily (one private module each).

``resolve_storage(None | "memory" | instance)``; later: a directory path (file store)
or a ``redis://`` URL.
"""

from __future__ import annotations

import importlib

from kvoffload.abc import Storage
from kvoffload.errors import ConfigError

__all__ = ["STORAGES", "resolve_storage"]

#: Storage name -> "module:class".
STORAGES: dict[str, str] = {
    "memory": "kvoffload.storage.memory:MemoryStorage",
}


def resolve_storage(storage: str | Storage | None) -> Storage | None:
    """A :class:`~kvoffload.abc.Storage` from ``None``, a name, or an instance."""
    if storage is None or isinstance(storage, Storage):
        return storage
    if isinstance(storage, str) and storage in STORAGES:
        module, _, cls = STORAGES[storage].partition(":")
        instance: Storage = getattr(importlib.import_module(module), cls)()
        return instance
    raise ConfigError(
        f"unknown storage {storage!r}; choose None, one of {sorted(STORAGES)}, or pass a Storage"
    )
