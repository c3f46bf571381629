"""Event backends, chosen by name and loaded lazily (one private module each).

``resolve_backend("auto" | "sim" | "cpu" | "cuda" | instance)``. Importing this package
imports no backend; ``"cuda"`` imports torch's CUDA path only when chosen. ``"auto"``
(the manager's default) is ``"cuda"`` when ``torch.cuda.is_available()``, else ``"cpu"``;
in engine-owned mode it follows the device of the engine's KV tensors.

The backends' modules (``_sim``, ``_cpu``, ``_cuda``, and ``_threaded`` and ``_base``
which they share) are private, as anyio's ``_backends``: their internals may change.
The classes are public here: ``from kvoffload.backends import CpuBackend`` (or
``CudaBackend``, ``SimBackend``) imports that one backend's module on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from kvoffload.abc import EventBackend
from kvoffload.errors import ConfigError

if TYPE_CHECKING:
    from kvoffload.backends._cpu import CpuBackend
    from kvoffload.backends._cuda import CudaBackend
    from kvoffload.backends._sim import SimBackend

__all__ = ["BACKENDS", "CpuBackend", "CudaBackend", "SimBackend", "resolve_backend"]

#: Backend name -> "module:class".
BACKENDS: dict[str, str] = {
    "sim": "kvoffload.backends._sim:SimBackend",
    "cpu": "kvoffload.backends._cpu:CpuBackend",
    "cuda": "kvoffload.backends._cuda:CudaBackend",
}

#: Public class name -> backend name (its module is loaded on first use).
_CLASSES: dict[str, str] = {"CpuBackend": "cpu", "CudaBackend": "cuda", "SimBackend": "sim"}


def __getattr__(name: str) -> object:
    """``CpuBackend``, ``CudaBackend``, ``SimBackend``: imported from their private
    module on first access (so importing this package imports no backend)."""
    if name not in _CLASSES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, _, cls = BACKENDS[_CLASSES[name]].partition(":")
    value: object = getattr(importlib.import_module(module), cls)
    globals()[name] = value  # later accesses skip this hook
    return value


def resolve_backend(backend: str | EventBackend, device: Any = None) -> EventBackend:
    """An :class:`~kvoffload.abc.EventBackend` instance from a name or an instance.

    ``device``: the torch device of the engine's KV tensors (``device_kv=``), which the
    manager passes in engine-owned mode. ``"auto"`` then follows those tensors - CPU
    tensors get ``"cpu"`` also on a machine with a GPU, CUDA tensors ``"cuda"`` on their
    GPU - and ``"cuda"`` copies on their GPU rather than the current one (a KV cache on
    ``cuda:1`` copied on streams of ``cuda:0`` would be a cross-device copy).

    Raises :class:`~kvoffload.ConfigError` for an unknown name, listing the known ones,
    and :class:`~kvoffload.BackendError` for ``"cuda"`` without a GPU.
    """
    if isinstance(backend, EventBackend):
        return backend
    kv_type = getattr(device, "type", None)
    if backend == "auto":
        if kv_type is not None:
            backend = "cuda" if kv_type == "cuda" else "cpu"
        else:
            import torch

            backend = "cuda" if torch.cuda.is_available() else "cpu"
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ConfigError(
            f"unknown backend {backend!r}; choose 'auto', one of {sorted(BACKENDS)} or pass an EventBackend"
        )
    module, _, cls = BACKENDS[backend].partition(":")
    make = getattr(importlib.import_module(module), cls)
    instance: EventBackend = make(device=device) if backend == "cuda" and kv_type == "cuda" else make()
    return instance
