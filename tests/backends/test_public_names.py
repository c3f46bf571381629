"""The backends' public names live on ``kvoffload.backends``; their modules are private
(anyio's ``_backends`` is the model), and importing the package imports no backend."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

import kvoffload.backends as backends
from kvoffload.testing import SimBackend


def test_importing_the_package_imports_no_backend() -> None:
    """``import kvoffload.backends`` loads none of ``_sim``, ``_cpu``, ``_cuda``; asking for
    ``CpuBackend`` loads ``_cpu`` (and what it shares), not the others."""
    code = (
        "import sys, kvoffload.backends as b\n"
        "mods = lambda: sorted(m for m in sys.modules if m.startswith('kvoffload.backends.'))\n"
        "print(mods())\n"
        "b.CpuBackend\n"
        "print(mods())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    before, after = out.stdout.splitlines()
    assert before == "[]"
    assert "'kvoffload.backends._cpu'" in after
    assert "_sim" not in after and "_cuda" not in after


CLASSES = [("sim", "SimBackend"), ("cpu", "CpuBackend"), ("cuda", "CudaBackend")]


@pytest.mark.parametrize(("name", "cls"), CLASSES)
def test_each_class_is_public_on_the_package_and_alone_in_its_module(name: str, cls: str) -> None:
    """``from kvoffload.backends import <Class>`` is the class ``BACKENDS`` names; the
    private module's ``__all__`` names only that class (its helpers are internals)."""
    module_name, _, class_name = backends.BACKENDS[name].partition(":")
    assert module_name == f"kvoffload.backends._{name}" and class_name == cls
    module = importlib.import_module(module_name)
    assert getattr(backends, cls) is getattr(module, cls)
    assert module.__all__ == [cls]
    assert cls in backends.__all__


def test_testing_sim_backend_is_the_same_class() -> None:
    assert backends.SimBackend is SimBackend


def test_an_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no attribute 'EventStream'"):
        _ = backends.EventStream
