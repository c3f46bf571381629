"""Event backends, chosen by name and loaded lazily (one private module each).

``resolve_backend("auto" | "sim" | "cpu" | "cuda" | instance)``. Importing this package
imports no backend; ``"cuda"`` imports torch's CUDA path only when chosen. ``"auto"``
(the manager's default) is ``"cuda"`` when ``torch.cuda.is_available()``, else ``"cpu"``.
"""

from __future__ import annotations

import importlib

from kvoffload.abc import EventBackend
from kvoffload.errors import ConfigError

__all__ = ["BACKENDS", "resolve_backend"]

#: Backend name -> "module:class".
BACKENDS: dict[str, str] = {
    "sim": "kvoffload.backends.sim:SimBackend",
    "cpu": "kvoffload.backends.cpu:CpuBackend",
    "cuda": "kvoffload.backends.cuda:CudaBackend",
}


def resolve_backend(backend: str | EventBackend) -> EventBackend:
    """An :class:`~kvoffload.abc.EventBackend` instance from a name or an instance.

    Raises :class:`~kvoffload.ConfigError` for an unknown name, listing the known ones,
    and :class:`~kvoffload.BackendError` for ``"cuda"`` without a GPU.
    """
    if isinstance(backend, EventBackend):
        return backend
    if backend == "auto":
        import torch

        backend = "cuda" if torch.cuda.is_available() else "cpu"
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ConfigError(
            f"unknown backend {backend!r}; choose 'auto', one of {sorted(BACKENDS)} or pass an EventBackend"
        )
    module, _, cls = BACKENDS[backend].partition(":")
    instance: EventBackend = getattr(importlib.import_module(module), cls)()
    return instance
