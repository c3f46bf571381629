"""Event backends, chosen by name and loaded lazily (one private module each).

``resolve_backend("sim" | "cpu" | "cuda" | instance)``. Importing this package
imports no backend; ``"cuda"`` imports torch's CUDA path only when chosen.
"""

from __future__ import annotations

import importlib

from kvoffload.abc import EventBackend
from kvoffload.errors import ConfigError

__all__ = ["BACKENDS", "resolve_backend"]

#: Backend name -> "module:class".
BACKENDS: dict[str, str] = {
    "sim": "kvoffload.backends.sim:SimBackend",
}


def resolve_backend(backend: str | EventBackend) -> EventBackend:
    """An :class:`~kvoffload.abc.EventBackend` instance from a name or an instance.

    Raises :class:`~kvoffload.ConfigError` for an unknown name, listing the known ones.
    """
    if isinstance(backend, EventBackend):
        return backend
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ConfigError(
            f"unknown backend {backend!r}; choose one of {sorted(BACKENDS)} or pass an EventBackend"
        )
    module, _, cls = BACKENDS[backend].partition(":")
    instance: EventBackend = getattr(importlib.import_module(module), cls)()
    return instance
