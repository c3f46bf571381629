"""Storage tiers, chosen by name and loaded lazily (one private module each).

``resolve_storage`` takes ``None``, a name (``"memory"``), a directory path (a ``str``
that looks like a path, a ``file://`` URL, or any ``os.PathLike``: the file store), a
``redis://`` / ``rediss://`` / ``unix://`` URL (the redis store), a ``mooncake://HOST:PORT``
URL (the Mooncake Store tier; HOST:PORT is its master), or an instance.
"""

from __future__ import annotations

import os

from kvoffload.abc import Storage
from kvoffload.errors import ConfigError
from kvoffload.storage.writer import WritePolicy

__all__ = ["STORAGES", "WritePolicy", "resolve_storage"]

#: Storage kind -> "module:class" (each module is imported only when chosen).
STORAGES: dict[str, str] = {
    "memory": "kvoffload.storage.memory:MemoryStorage",
    "file": "kvoffload.storage.file:FileStorage",
    "redis": "kvoffload.storage.redis:RedisStorage",
    "mooncake": "kvoffload.storage.mooncake:MooncakeStore",
}

_REDIS_SCHEMES = ("redis://", "rediss://", "unix://")


def resolve_storage(storage: str | os.PathLike[str] | Storage | None) -> Storage | None:
    """A :class:`~kvoffload.abc.Storage` from ``None``, a name, a path, a URL, or an instance.

    A bare word that is not a storage name is refused (a typo must not create a
    directory): write a relative directory as ``./name``. Raises
    :class:`~kvoffload.ConfigError` for anything else, and
    :class:`~kvoffload.MissingDependency` when the chosen store's extra is not installed.
    """
    if storage is None or isinstance(storage, Storage):
        return storage
    path: str | None = None
    options: dict[str, bool] = {}
    if isinstance(storage, os.PathLike):
        path = os.fspath(storage)
    elif isinstance(storage, str):
        if storage == "memory":
            from kvoffload.storage.memory import MemoryStorage

            return MemoryStorage()
        if storage.startswith(_REDIS_SCHEMES):
            from kvoffload.storage.redis import RedisStorage

            return RedisStorage(storage)
        if storage.startswith("mooncake://"):
            from kvoffload.storage.mooncake import MooncakeStore

            return MooncakeStore(storage)
        if storage.startswith("file://"):
            path, _, query = storage.removeprefix("file://").partition("?")
            options = _file_options(query, storage)
        elif "://" not in storage and ("/" in storage or os.sep in storage or storage[:1] in (".", "~")):
            path = storage
    if path:
        from kvoffload.storage.file import FileStorage

        return FileStorage(path, **options)
    from kvoffload.storage._url import redact

    shown = redact(storage) if isinstance(storage, str) else storage
    raise ConfigError(
        f"unknown storage {shown!r}; choose None, 'memory', a directory path (./name or /abs/path), "
        "a redis:// URL, a mooncake://HOST:PORT URL, or pass a Storage instance"
    )


#: The settings a ``file://`` URL's query may give (booleans: ``1``/``0``, ``true``/``false``).
FILE_URL_OPTIONS = ("direct", "fsync")


def _file_options(query: str, url: str) -> dict[str, bool]:
    """``file:///dir?direct=1&fsync=0``'s settings (a ``?`` in a ``file://`` URL starts
    them: give a directory whose name holds one as a path); raises
    :class:`~kvoffload.ConfigError` naming an unknown key, a value that is not a boolean,
    or a field that is not ``key=value``."""
    from urllib.parse import parse_qsl

    out: dict[str, bool] = {}
    try:
        fields = parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query))
    except ValueError as exc:  # a field without "=" (file:///dir?direct)
        raise ConfigError(f"file storage URL {url!r}: its settings must be key=value pairs ({exc})") from None
    for key, value in fields:
        if key not in FILE_URL_OPTIONS:
            raise ConfigError(
                f"file storage URL {url!r}: unknown setting {key!r}; known: {list(FILE_URL_OPTIONS)}"
            )
        flag = {"1": True, "true": True, "0": False, "false": False}.get(value.lower())
        if flag is None:
            raise ConfigError(f"file storage URL {url!r}: {key}={value!r} is not 1, 0, true or false")
        out[key] = flag
    return out
