"""Arrows point down (STYLE.md habits 12-14): a test over every import line.

Layers, bottom up: the shared vocabulary (``abc``, ``errors``, ``config``, ``keys``,
``pools``); the core (``core``, ``lifecycle``: pure, no anyio, no threads, no I/O);
the movers (``backends``, ``storage``: they import only the vocabulary); the drivers
(``drivers``); and what sits on the drivers (``integrations``, ``scheduler``,
``simulate``, ``cli``, ``workload``, ``trace``, ``graph``, ``testing``). An import
under ``if TYPE_CHECKING:`` is a type annotation, not an arrow, and is not counted;
every other import is, function-local ones included.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "kvoffload"

VOCABULARY = {"abc", "errors", "config", "keys", "pools", "py"}
CORE = {"core", "lifecycle"}
MOVERS = {"backends", "storage"}
DRIVERS = {"drivers"}

#: Which top-level rooms (and outside modules) each layer may import at run time.
ALLOWED: dict[str, set[str]] = {
    "vocabulary": VOCABULARY,
    "core": VOCABULARY | CORE,
    "movers": VOCABULARY | MOVERS,
    "drivers": VOCABULARY | CORE | MOVERS | DRIVERS,
}
#: Outside modules a layer must never import at run time.
FORBIDDEN_OUTSIDE: dict[str, set[str]] = {
    "vocabulary": {"anyio", "asyncio", "concurrent"},
    "core": {"anyio", "asyncio", "concurrent", "socket", "redis", "selectors"},
    "movers": set(),
    "drivers": set(),
}
#: Names that start threads or I/O, which the core never mentions (it may read the
#: current thread's ident and name, for its owner check).
CORE_NEVER = {"Thread", "Timer", "ThreadPoolExecutor", "open", "run_sync", "sleep"}


def _layer(module: Path) -> str | None:
    rel = module.relative_to(PKG)
    room = rel.parts[0].removesuffix(".py")
    if room in VOCABULARY:
        return "vocabulary"
    if room in CORE:
        return "core"
    if room in MOVERS:
        return "movers"
    if room in DRIVERS:
        return "drivers"
    return None  # above the drivers: may import anything


def _runtime_imports(tree: ast.Module) -> list[tuple[int, str]]:
    """(line, module) of every import not under ``if TYPE_CHECKING:``."""
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for sub in ast.walk(node):
                skip.add(id(sub))
    out = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.lineno, node.module))
    return out


MODULES = sorted(p for p in PKG.rglob("*.py") if _layer(p) is not None)


@pytest.mark.parametrize("module", MODULES, ids=lambda p: str(p.relative_to(PKG)))
def test_imports_point_down(module: Path) -> None:
    """A module imports only its own layer and the layers below it."""
    layer = _layer(module)
    assert layer is not None
    bad = []
    for line, name in _runtime_imports(ast.parse(module.read_text())):
        parts = name.split(".")
        if parts[0] == "kvoffload":
            room = parts[1] if len(parts) > 1 else "__init__"
            if room not in ALLOWED[layer]:
                bad.append(f"line {line}: {name} (a {layer} module may import {sorted(ALLOWED[layer])})")
        elif parts[0] in FORBIDDEN_OUTSIDE[layer]:
            bad.append(f"line {line}: {name} (the {layer} layer does not use {parts[0]})")
    assert not bad, f"{module.relative_to(PKG)} imports upward or outside its layer: " + "; ".join(bad)


@pytest.mark.parametrize(
    "module", [m for m in MODULES if _layer(m) == "core"], ids=lambda p: str(p.relative_to(PKG))
)
def test_the_core_starts_no_thread_and_does_no_io(module: Path) -> None:
    """No core module names a thread, a timer, a file open, a worker-thread hop or a sleep."""
    tree = ast.parse(module.read_text())
    used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    used |= {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    assert not (used & CORE_NEVER), f"{module.relative_to(PKG)} uses {sorted(used & CORE_NEVER)}"


def test_the_check_can_fail() -> None:
    """The checker sees an upward import (a core module importing a driver) and a
    forbidden one (anyio in the core), and skips type-only imports."""
    tree = ast.parse(
        "from typing import TYPE_CHECKING\n"
        "import anyio\n"
        "from kvoffload.drivers.asyncio import OffloadManager\n"
        "if TYPE_CHECKING:\n    from kvoffload.backends._sim import SimBackend\n"
        "def f():\n    import kvoffload.storage\n"
    )
    names = [name for _, name in _runtime_imports(tree)]
    assert names == ["typing", "anyio", "kvoffload.drivers.asyncio", "kvoffload.storage"]
    assert _layer(PKG / "core" / "offload.py") == "core"
    assert "drivers" not in ALLOWED["core"] and "anyio" in FORBIDDEN_OUTSIDE["core"]


def test_no_layer_imports_the_tools() -> None:
    """The tools (``kvoffload/tools/``) sit on the layers: no module of kvoffload outside
    them imports ``kvoffload.tools``, at run time or under ``TYPE_CHECKING``, nor
    ``from kvoffload import tools``. Aside: the test helpers (``_testing``,
    ``testing.py``) and ``__main__.py``, which is the command (``python -m kvoffload``
    runs ``kvoffload.tools.cli``)."""

    def imports_tools(tree: ast.Module) -> list[int]:
        lines = []
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            if any(n == "kvoffload.tools" or n.startswith("kvoffload.tools.") for n in names):
                lines.append(node.lineno)
        return lines

    sample = "import kvoffload.tools.cli\nfrom kvoffload import tools\nfrom kvoffload import core\n"
    assert imports_tools(ast.parse(sample)) == [1, 2]  # the check can fail
    excluded = {PKG / "tools", PKG / "_testing", PKG / "testing.py", PKG / "__main__.py"}
    modules = [p for p in sorted(PKG.rglob("*.py")) if not any(p == e or e in p.parents for e in excluded)]
    assert PKG / "core" / "offload.py" in modules and PKG / "__init__.py" in modules
    hits = {str(p.relative_to(PKG)): imports_tools(ast.parse(p.read_text())) for p in modules}
    bad = {name: lines for name, lines in hits.items() if lines}
    assert not bad, f"layer modules import kvoffload.tools (file: lines): {bad}"
