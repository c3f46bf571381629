"""Checks over a package's source (the house, STYLE habit 17): pure functions of a root.

Each takes the directory of a package (``kvoffload/`` or a synthetic one a test writes
under ``tmp_path``) and returns what it found, so each can be seen to fail on a small
made-up package. ``tests/test_layers.py`` runs them on the real tree.

- :func:`import_cycles`: the import circles (every import counts: top level, under
  ``if TYPE_CHECKING:``, inside functions).
- :func:`private_writes`: every place a module writes, or calls a private method of,
  an object whose field is declared in another room.
- :func:`long_files`: the files over a line limit.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

#: In-place calls on a field: ``x._f.append(...)`` writes ``x._f``.
MUTATORS = frozenset(
    {
        "append",
        "extend",
        "pop",
        "remove",
        "clear",
        "insert",
        "frombytes",
        "update",
        "setdefault",
        "add",
        "discard",
        "popleft",
        "appendleft",
    }
)
#: The names by which a method reaches its own object.
OWN = frozenset({"self", "cls"})


def is_private(name: str) -> bool:
    """``_f`` and ``__f`` are private; a dunder ``__f__`` is not."""
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


# --- reading the tree --------------------------------------------------------------


@dataclass(frozen=True)
class Module:
    name: str  # dotted: "kvoffload.core.offload"; a package's __init__ is the package
    path: Path
    rel: str  # "core/offload.py", relative to the root
    is_package: bool
    tree: ast.Module


@cache
def _parse(path: Path, mtime_ns: int) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def modules(root: Path) -> list[Module]:
    """Every ``.py`` under ``root`` (the package's directory), parsed, sorted by name."""
    root = root.resolve()
    out = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        parts = [root.name, *rel.with_suffix("").parts]
        is_package = parts[-1] == "__init__"
        if is_package:
            parts.pop()
        tree = _parse(path, path.stat().st_mtime_ns)
        out.append(Module(".".join(parts), path, rel.as_posix(), is_package, tree))
    return sorted(out, key=lambda m: m.name)


# --- 1. import circles -------------------------------------------------------------


@dataclass(frozen=True)
class Edge:
    src: str
    dst: str
    rel: str  # the importing file
    line: int

    def __str__(self) -> str:
        return f"{self.rel}:{self.line}: {self.src} -> {self.dst}"


def _ancestors(name: str) -> list[str]:
    """``a.b.c`` -> ``["a", "a.b"]``: the packages whose ``__init__`` runs first."""
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def _dynamic_import(node: ast.Call) -> str | None:
    """The module ``importlib.import_module(...)`` / ``__import__(...)`` names: a constant,
    or the constant head of an f-string (``f"p.rooms.{name}"`` imports ``p.rooms``)."""
    func = node.func
    if not node.args or not (
        (isinstance(func, ast.Attribute) and func.attr == "import_module")
        or (isinstance(func, ast.Name) and func.id in ("import_module", "__import__"))
    ):
        return None
    arg = node.args[0]
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        return arg.value
    if isinstance(arg, ast.JoinedStr) and arg.values and isinstance(arg.values[0], ast.Constant):
        head = str(arg.values[0].value)
        return head.rpartition(".")[0] or None
    return None


def import_edges(root: Path) -> list[Edge]:
    """Every import of every module under ``root`` as an edge between modules of the
    package: top level, under ``if TYPE_CHECKING:`` and inside functions alike, and
    ``importlib.import_module(...)`` of a constant name or an f-string's constant head.

    ``import p.a.b`` and ``from p.a.b import y`` run ``p/a/__init__.py`` and
    ``p/a/b/__init__.py`` too, so they are edges to those packages as well, except to a
    package that holds the importer itself (its ``__init__`` has already run by then:
    Python imports a module's parents before the module). ``from p.x import y`` is an
    edge to ``p.x.y`` when that is a module, else to ``p.x``. Relative imports are
    resolved. Imports of modules outside the package are not edges.
    """
    mods = modules(root)
    names = {m.name for m in mods}
    pkg = Path(root).resolve().name
    edges: list[Edge] = []
    for m in mods:
        here = m.name if m.is_package else m.name.rpartition(".")[0]

        def targets(node: ast.AST, m: Module = m, here: str = here) -> Iterator[str]:
            if isinstance(node, ast.Import):
                for alias in node.names:
                    yield alias.name
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base_parts = here.split(".")
                    keep = len(base_parts) - (node.level - 1)
                    base = ".".join(base_parts[: max(keep, 0)])
                    mod = f"{base}.{node.module}" if node.module else base
                else:
                    mod = node.module or ""
                for alias in node.names:
                    sub = f"{mod}.{alias.name}"
                    yield sub if sub in names else mod
            elif isinstance(node, ast.Call) and (name := _dynamic_import(node)):
                yield name

        holders = {*_ancestors(m.name), *([m.name] if m.is_package else [])}
        for node in ast.walk(m.tree):
            for target in targets(node):
                if target.split(".")[0] != pkg:
                    continue
                # The module itself if it is one, else the longest prefix that is.
                found = target
                while found and found not in names:
                    found = found.rpartition(".")[0]
                if not found:
                    continue
                for dst in [*_ancestors(found), found]:
                    if dst in names and dst not in holders:
                        edges.append(Edge(m.name, dst, m.rel, getattr(node, "lineno", 0)))
    return sorted(set(edges), key=lambda e: (e.rel, e.line, e.dst))


def _components(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components, iteratively (no recursion limit)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, it = work[-1]
            advanced = False
            for nxt in it:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph.get(nxt, ())))))
                    advanced = True
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    comp.append(top)
                    if top == node:
                        break
                out.append(sorted(comp))
    return out


def import_cycles(root: Path) -> list[list[str]]:
    """Each import circle under ``root``: a strongly connected component of more than one
    module, or a module that imports itself, as its sorted module names (see
    :func:`import_edges` for what counts as an import)."""
    graph: dict[str, set[str]] = {m.name: set() for m in modules(root)}
    for e in import_edges(root):
        graph[e.src].add(e.dst)
    return sorted(c for c in _components(graph) if len(c) > 1 or c[0] in graph[c[0]])


# --- 2. private writes -------------------------------------------------------------


def room_of(rel: str) -> str:
    """The room of a module, from its path relative to the package root: the sub-package
    directory (``"core/"``) for a module inside one, the module itself (``"abc.py"``)
    for a module directly in the package."""
    parts = rel.split("/")
    return parts[0] + "/" if len(parts) > 1 else rel


@dataclass(frozen=True)
class Declarations:
    #: private field name -> the modules (rel paths) that declare it
    fields: dict[str, set[str]]
    #: private method name -> the modules that define it in a class
    methods: dict[str, set[str]]


def _own(node: ast.expr) -> bool:
    """``self`` / ``cls`` / ``super()``: the object the method belongs to."""
    if isinstance(node, ast.Name):
        return node.id in OWN
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super"


def _setattr_name(node: ast.Call) -> tuple[ast.expr, str] | None:
    """``setattr(x, "_f", v)`` / ``delattr(x, "_f")`` / ``object.__setattr__(x, "_f", v)``."""
    func = node.func
    named = (isinstance(func, ast.Name) and func.id in ("setattr", "delattr")) or (
        isinstance(func, ast.Attribute) and func.attr in ("__setattr__", "__delattr__")
    )
    if named and len(node.args) >= 2:
        arg = node.args[1]
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
            return node.args[0], arg.value
    return None


def _targets(node: ast.expr) -> Iterator[ast.expr]:
    if isinstance(node, ast.Tuple | ast.List):
        for elt in node.elts:
            yield from _targets(elt)
    elif isinstance(node, ast.Starred):
        yield from _targets(node.value)
    else:
        yield node


def declarations(root: Path) -> Declarations:
    """Where each private field and private method is declared: a field by a class's
    ``__slots__``, a class-body annotation or assignment, or an assignment to
    ``self._f`` in one of its methods; a method by a ``def _m`` in a class body."""
    fields: dict[str, set[str]] = {}
    methods: dict[str, set[str]] = {}
    for m in modules(root):
        for cls in (n for n in ast.walk(m.tree) if isinstance(n, ast.ClassDef)):
            for stmt in cls.body:
                if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef):
                    if is_private(stmt.name):
                        methods.setdefault(stmt.name, set()).add(m.rel)
                    for sub in ast.walk(stmt):
                        named: list[ast.expr] = []
                        if isinstance(sub, ast.Assign):
                            named = [t for tt in sub.targets for t in _targets(tt)]
                        elif isinstance(sub, ast.AnnAssign | ast.AugAssign):
                            named = [sub.target]
                        elif (
                            isinstance(sub, ast.Call)
                            and (hit := _setattr_name(sub))
                            and _own(hit[0])
                            and is_private(hit[1])
                        ):
                            fields.setdefault(hit[1], set()).add(m.rel)
                        for t in named:
                            if isinstance(t, ast.Attribute) and _own(t.value) and is_private(t.attr):
                                fields.setdefault(t.attr, set()).add(m.rel)
                elif isinstance(stmt, ast.Assign | ast.AnnAssign):
                    targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
                    for t in targets:
                        if isinstance(t, ast.Name) and t.id == "__slots__" and stmt.value is not None:
                            for c in ast.walk(stmt.value):
                                if (
                                    isinstance(c, ast.Constant)
                                    and isinstance(c.value, str)
                                    and is_private(c.value)
                                ):
                                    fields.setdefault(c.value, set()).add(m.rel)
                        elif isinstance(t, ast.Name) and is_private(t.id):
                            fields.setdefault(t.id, set()).add(m.rel)
    return Declarations(fields, methods)


def _reached(node: ast.expr) -> Iterator[ast.Attribute]:
    """The private attributes of another object a write target goes through: ``x._f`` in
    ``x._f = v``, ``x._f[k] = v`` and ``x._f.y = v``. A private attribute of ``self`` /
    ``cls`` itself is the module's own (``self._f[k] = v``: none); one further along is
    another object's (``self.a._f = v``: ``_f`` of ``self.a``)."""
    while isinstance(node, ast.Attribute | ast.Subscript):
        if isinstance(node, ast.Attribute) and is_private(node.attr) and not _own(node.value):
            yield node
        node = node.value


def _reaches(
    tree: ast.Module, decl: Declarations
) -> Iterator[tuple[int, str, ast.Attribute, dict[str, set[str]]]]:
    """(line, "writes" / "calls", ``x._f``, where such names are declared) for each write
    of a private field and each call of a private method on an object not ``self``."""
    for node in ast.walk(tree):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign | ast.Delete):
            targets = [t for tt in node.targets for t in _targets(tt)]
        elif isinstance(node, ast.AnnAssign | ast.AugAssign):
            targets = [node.target]
        elif isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Attribute):
                if func.attr in MUTATORS:
                    targets = [func.value]
                elif is_private(func.attr) and func.attr in decl.methods and not _own(func.value):
                    yield node.lineno, "calls", func, decl.methods
            elif (hit := _setattr_name(node)) and is_private(hit[1]) and not _own(hit[0]):
                yield (
                    node.lineno,
                    "writes",
                    ast.Attribute(value=hit[0], attr=hit[1], ctx=ast.Store()),
                    decl.fields,
                )
        for t in targets:
            for reached in _reached(t):
                yield node.lineno, "writes", reached, decl.fields


def private_writes(root: Path, *, rooms: bool = True) -> list[str]:
    """Every place a module writes a private field of an object that is not its own, or
    calls a private method on one, where the field or method is not declared in the
    writer's room (:func:`room_of`; ``rooms=False``: the writer's own module).

    A write: an assignment, augmented assignment or ``del`` of ``x._f`` (also through a
    subscript or attribute of it: ``x._f[k] = v``, ``del x._f[k]``, ``x._f.y = v``), an
    in-place call ``x._f.append(...)`` (:data:`MUTATORS`), or ``setattr(x, "_f", v)``,
    where ``x`` is not ``self`` / ``cls``. A call: ``x._m(...)`` where ``_m`` is a
    private method of some class and ``x`` is not ``self`` / ``cls`` / ``super()``.
    Fields declared in several rooms are allowed to a writer in any of them. Each line
    reads ``rel:line: module writes <expr> (declared in <modules>)``.
    """
    decl = declarations(root)
    where = room_of if rooms else (lambda rel: rel)
    found: set[tuple[str, int, str]] = set()
    for m in modules(root):
        for line, what, node, known in _reaches(m.tree, decl):
            owners = known.get(node.attr, set())
            if any(where(o) == where(m.rel) for o in owners):
                continue
            said = ", ".join(sorted(owners)) if owners else "nowhere in the package"
            found.add(
                (m.rel, line, f"{m.rel}:{line}: module {what} {ast.unparse(node)} (declared in {said})")
            )
    return [text for _, _, text in sorted(set(found))]


# --- 3. long files -----------------------------------------------------------------


def long_files(root: Path, limit: int) -> list[str]:
    """Each ``.py`` under ``root`` with more than ``limit`` lines, as ``rel: N lines``."""
    root = root.resolve()
    out = []
    for path in sorted(root.rglob("*.py")):
        n = len(path.read_text().splitlines())
        if n > limit:
            out.append(f"{path.relative_to(root).as_posix()}: {n} lines (limit {limit})")
    return out
