"""SGLang 0.5.23's real classes on this CPU machine: what must be in place before the
first ``import sglang``.

SGLang is installed ``--no-deps`` (scripts/setup_sglang.sh): its dependency list pins a
CUDA torch and GPU kernels. The modules kvoffload's tests use (``Req``, the memory pools
and allocators, the tree caches, ``ServerArgs`` / ``runtime_context``, the HiCache
storage backends and host pools, the cache controller, SGLang's own decode offload
manager) import with torch's CPU build and the pure-Python packages listed in
scripts/sglang-requirements.txt, except for one GPU-stack package they import without
using it:

- ``torchvision``: imported at module level by SGLang's multimodal configs
  (``sglang.srt.configs.*``, pulled in by ``memory_pool``); PyPI's torchvision does not
  load beside torch 2.13.0+cpu ("operator torchvision::nms does not exist"). Nothing the
  tests run calls into it; the stub answers every attribute with another stub and reports
  version 0.0.0, so ``transformers`` takes it for an old release and never uses it.

:func:`install` puts the stub in place (idempotent); :func:`available` says whether the
real SGLang imports here, and why not.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from typing import Any

#: GPU-stack packages SGLang's import chain imports but the tests never call: stubbed.
STUBBED = ("torchvision",)
SGLANG_VERSION = "0.5.23"


class _Stub(types.ModuleType):
    """A module whose every attribute is another stub (and calling one returns itself)."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        full = f"{self.__name__}.{name}"
        mod = sys.modules.get(full)
        if mod is None:
            mod = _Stub(full)
            mod.__path__ = []
            sys.modules[full] = mod
        return mod

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if any(name == s or name.startswith(s + ".") for s in STUBBED):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec: Any) -> types.ModuleType:
        return _Stub(spec.name)

    def exec_module(self, module: types.ModuleType) -> None:
        module.__path__ = []
        module.__version__ = "0.0.0"  # type: ignore[attr-defined]


def install() -> None:
    """Put the stubs in place before SGLang is imported (idempotent)."""
    if not any(isinstance(f, _StubFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _StubFinder())


def available() -> tuple[bool, str]:
    """Whether SGLang's real classes import here; else why not (the skip reason)."""
    try:
        import importlib.metadata as md

        version = md.version("sglang")
    except Exception:
        return False, "sglang is not installed here (bash scripts/setup_sglang.sh makes .venv-sglang)"
    if version != SGLANG_VERSION:
        return False, f"sglang {version} is installed; these tests target {SGLANG_VERSION}"
    install()
    try:
        import sglang.srt.managers.schedule_batch
        import sglang.srt.mem_cache.memory_pool  # noqa: F401
    except Exception as exc:  # an import chain that does not run here: the reason
        return False, f"sglang {version} does not import here: {type(exc).__name__}: {exc}"
    return True, ""


def require() -> None:
    """Skip the calling test (module) with the reason when SGLang's real classes do not
    import here, unless ``KVOFFLOAD_REQUIRE_SGLANG=1`` (set by CI's SGLang run), which
    turns the skip into a failure."""
    import os

    import pytest

    ok, reason = available()
    if ok:
        return
    if os.environ.get("KVOFFLOAD_REQUIRE_SGLANG") == "1":
        pytest.fail(f"KVOFFLOAD_REQUIRE_SGLANG=1 but {reason}", pytrace=False)
    pytest.skip(reason, allow_module_level=True)
