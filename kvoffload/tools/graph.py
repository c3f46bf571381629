"""The lifecycles drawn from their one declaration: mermaid, graphviz dot, svg / png.

Two lifecycles are declared: the offload lifecycle (``SPEC``, the default everywhere
here) and the load lifecycle (``LOAD_SPEC``: store -> host pool -> device pages; pass
it as ``spec``, or ``kvoffload graph --lifecycle load``).

Every drawing goes through ``transitions``' diagram support
(:class:`transitions.extensions.diagrams.GraphMachine`), built from the same
transition list as the runtime table (:func:`kvoffload.lifecycle.table.build_machine`),
so the picture cannot drift from the code. ``mermaid`` needs no system package;
``dot`` needs the ``graphviz`` Python package (``pip install 'kvoffload[graph]'``);
``svg`` and ``png`` also need Graphviz's ``dot`` program (``apt-get install graphviz``).

``highlight`` marks states that some lifecycles are in (the notebook uses it to show
where each lifecycle of the rid-reuse story is); :func:`draw_matplotlib` draws the
same graph with matplotlib, for notebooks on machines without Graphviz.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from kvoffload.errors import MissingDependency
from kvoffload.lifecycle.load_spec import LOAD_SPEC, LoadSpec, LoadState
from kvoffload.lifecycle.load_table import build_load_machine
from kvoffload.lifecycle.spec import SPEC, LifecycleSpec, LifecycleState
from kvoffload.lifecycle.table import build_machine

if TYPE_CHECKING:
    from kvoffload.core.lifecycle import Lifecycle

__all__ = [
    "FORMATS",
    "LIFECYCLES",
    "Highlight",
    "draw_matplotlib",
    "dot",
    "edges",
    "highlight_of",
    "mermaid",
    "render",
]

#: Output formats of :func:`render` (and ``kvoffload graph --format``).
FORMATS = ("mermaid", "dot", "svg", "png")

#: The declared lifecycles by name (``kvoffload graph --lifecycle``).
LIFECYCLES: dict[str, LifecycleSpec | LoadSpec] = {"offload": SPEC, "load": LOAD_SPEC}

#: State -> labels of the lifecycles in it (e.g. ``{"OFFLOADING": ["#1 r1"]}``).
Highlight = Mapping[LifecycleState | LoadState | str, Iterable[str]]

_TITLE = "kvoffload lifecycle"
_LOAD_TITLE = "kvoffload load lifecycle"
_GRAPHVIZ_HINT = (
    "install the graphviz extra (pip install 'kvoffload[graph]') and Graphviz's dot program "
    "(apt-get install graphviz, brew install graphviz, or https://graphviz.org/download/); "
    "`kvoffload graph --format mermaid` needs neither"
)


def _graph_machine(spec: LifecycleSpec | LoadSpec, engine: str) -> Any:
    """A ``GraphMachine`` of the declaration, with one model whose graph we draw."""
    from transitions.extensions.diagrams import GraphMachine

    class _Model:
        pass

    model = _Model()
    if isinstance(spec, LoadSpec):
        build_load_machine(
            spec, model=model, machine_cls=GraphMachine, graph_engine=engine, title=_LOAD_TITLE
        )
        return model
    build_machine(
        spec,
        model=model,
        machine_cls=GraphMachine,
        graph_engine=engine,
        show_conditions=True,
        title=_TITLE,
    )
    return model


def _norm(highlight: Highlight | None, spec: LifecycleSpec | LoadSpec = SPEC) -> dict[str, list[str]]:
    names = [s.name for s in spec.states]
    out: dict[str, list[str]] = {}
    for state, labels in (highlight or {}).items():
        name = state.name if isinstance(state, (LifecycleState, LoadState)) else str(state)
        if name not in names:
            raise ValueError(f"unknown state {name!r} in highlight; states are {names}")
        out[name] = list(labels)
    return out


def mermaid(spec: LifecycleSpec | LoadSpec = SPEC, highlight: Highlight | None = None) -> str:
    """The lifecycle as a mermaid ``stateDiagram-v2`` (as drawn by ``transitions``).

    Guards read ``[idle]`` etc. (see ``kvoffload.lifecycle.spec.GUARDS``). States in
    ``highlight`` are filled and labelled with the lifecycles in them; without it no
    state is marked.
    """
    text = _graph_machine(spec, "mermaid").get_graph().draw(None)
    marks = _norm(highlight, spec)
    lines = []
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("Class "):  # transitions writes "Class"; mermaid's keyword is "class"
            _, state, _ = stripped.split()
            cls = "s_active" if state in marks else "s_default"
            line = f"  class {state} {cls}"
        elif stripped.startswith("state ") and " as " in stripped:
            state = stripped.rsplit(" as ", 1)[1]
            if marks.get(state):
                label = f"{state}: {', '.join(marks[state])}"
                line = f'  state "{label}" as {state}'
        lines.append(line.replace("[guard_", "[").rstrip())
    if len(lines) > 2 and lines[0] == lines[2] == "---" and ":" not in lines[1]:
        lines[1] = f"title: {lines[1]}"  # mermaid front matter is YAML: a title key
    return "\n".join(lines).strip() + "\n"


def _digraph(spec: LifecycleSpec | LoadSpec, highlight: Highlight | None) -> Any:
    try:
        import graphviz  # noqa: F401 - transitions imports it; fail here with the hint
    except ImportError:
        raise MissingDependency(f"drawing dot/svg/png needs the graphviz package: {_GRAPHVIZ_HINT}") from None
    graph = _graph_machine(spec, "graphviz").get_graph()
    marks = _norm(highlight, spec)
    for state in spec.states:
        name = state.name
        if marks.get(name):
            graph.node(
                name,
                label=f"{name}\\n{', '.join(marks[name])}",
                style="filled",
                fillcolor="darksalmon",
                color="red",
            )
        else:
            graph.node(name, style="rounded,filled", fillcolor="white", color="black")
    return graph


def dot(spec: LifecycleSpec | LoadSpec = SPEC, highlight: Highlight | None = None) -> str:
    """The lifecycle as graphviz dot source (needs the ``graphviz`` Python package only)."""
    source: str = _digraph(spec, highlight).source.replace("[guard_", "[")
    return source


def render(
    fmt: str, spec: LifecycleSpec | LoadSpec = SPEC, highlight: Highlight | None = None
) -> str | bytes:
    """The lifecycle in ``fmt`` (one of :data:`FORMATS`): text for mermaid/dot, bytes
    for svg/png. Raises :class:`~kvoffload.MissingDependency` naming what to install,
    ``ValueError`` for an unknown format."""
    if fmt == "mermaid":
        return mermaid(spec, highlight)
    if fmt == "dot":
        return dot(spec, highlight)
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; choose one of {', '.join(FORMATS)}")
    source = dot(spec, highlight)
    if shutil.which("dot") is None:
        raise MissingDependency(f"--format {fmt} needs Graphviz's dot program on PATH: {_GRAPHVIZ_HINT}")
    import graphviz

    out: bytes = graphviz.Source(source).pipe(format=fmt)
    return out


def highlight_of(lifecycles: Iterable[Lifecycle]) -> dict[str, list[str]]:
    """Group lifecycles by state, labelled ``#id rid`` (for ``highlight=``)."""
    out: dict[str, list[str]] = {}
    for lc in lifecycles:
        out.setdefault(lc.state.name, []).append(f"#{lc.id} {lc.rid}")
    return out


def edges(spec: LifecycleSpec | LoadSpec = SPEC) -> dict[tuple[str, str], list[str]]:
    """(source, dest) -> the labels ``event [guard]`` of every declared transition (the
    load lifecycle has no guards: ``event``)."""
    out: dict[tuple[str, str], list[str]] = {}
    for t in spec.transitions:
        guard = getattr(t, "guard", None)
        label = t.event if guard is None else f"{t.event} [{guard}]"
        out.setdefault((t.source.name, t.dest.name), []).append(label)
    return out


# Where draw_matplotlib puts each state (x, y): the happy path left to right.
_LAYOUT = {
    "PENDING": (0.0, 0.0),
    "OFFLOADING": (1.0, 0.8),
    "FINISHING": (2.0, 0.0),
    "RELEASED": (3.0, 0.0),
    "READING": (0.0, 0.0),
    "COPYING": (1.5, 0.8),
    "CANCELLING": (1.5, -0.5),
    "DONE": (3.0, 0.0),
}


def draw_matplotlib(
    spec: LifecycleSpec | LoadSpec = SPEC,
    highlight: Highlight | None = None,
    ax: Any = None,
    labels: bool = True,
) -> Any:
    """Draw the lifecycle on a matplotlib axis (created if ``ax`` is None) and return it.

    No system package needed. Highlighted states are filled and list their lifecycles.
    Raises :class:`~kvoffload.MissingDependency` without matplotlib.
    """
    try:
        import matplotlib.pyplot as plt
        from matplotlib.patches import FancyArrowPatch
    except ImportError:
        raise MissingDependency("draw_matplotlib needs matplotlib: pip install matplotlib") from None
    if ax is None:
        _, ax = plt.subplots(figsize=(11, 4.5))
    marks = _norm(highlight, spec)
    for (src, dst), names in edges(spec).items():
        (x0, y0), (x1, y1) = _LAYOUT[src], _LAYOUT[dst]
        text = "\n".join(names) if labels else ""
        if src == dst:
            ax.annotate(
                "", xy=(x0 + 0.12, y0 + 0.12), xytext=(x0 - 0.12, y0 + 0.12),
                arrowprops={"arrowstyle": "->", "connectionstyle": "arc3,rad=-1.6", "color": "grey"},
            )  # fmt: skip
            ax.text(x0, y0 + 0.42, text, ha="center", va="bottom", fontsize=6, color="dimgrey")
            continue
        rad = 0.25 if (dst, src) in edges(spec) else 0.0
        arrow = FancyArrowPatch(
            (x0, y0), (x1, y1), arrowstyle="-|>", mutation_scale=12, color="grey",
            connectionstyle=f"arc3,rad={rad}", shrinkA=28, shrinkB=28,
        )  # fmt: skip
        ax.add_patch(arrow)
        mx, my = (x0 + x1) / 2, (y0 + y1) / 2 + (rad * (x1 - x0) * -0.6)
        ax.text(mx, my, text, ha="center", va="center", fontsize=6, color="dimgrey")
    for state in spec.states:
        x, y = _LAYOUT[state.name]
        on = bool(marks.get(state.name))
        ax.text(
            x, y, state.name + ("\n" + "\n".join(marks[state.name]) if on else ""),
            ha="center", va="center", fontsize=9, weight="bold" if on else "normal",
            bbox={"boxstyle": "round", "fc": "darksalmon" if on else "white", "ec": "red" if on else "black"},
        )  # fmt: skip
    ax.set_xlim(-0.6, 3.6)
    ax.set_ylim(-0.7, 1.5)
    ax.axis("off")
    return ax
