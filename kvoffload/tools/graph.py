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

import math
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
    "edge_label",
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


def edge_label(labels: Iterable[str]) -> str:
    """An edge's label as lines: its unguarded events first, one per line, then each
    guard's group: a ``[guard]:`` line of its own, then its events, one per line.
    ``labels`` are :func:`edges`' ``event [guard]`` strings."""
    groups: dict[str, list[str]] = {}
    for label in labels:
        event, _, guard = label.partition(" [")
        groups.setdefault(guard.rstrip("]"), []).append(event)
    lines: list[str] = []
    for guard in sorted(groups, key=lambda g: (g != "", g)):
        if guard:
            lines.append(f"[{guard}]:")
        lines += groups[guard]
    return "\\n".join(lines)  # graphviz's line break


#: The side of its box a state's own loop is drawn on, away from the edges that run past
#: it (tests/test_graph.py checks that no label prints over an edge).
_LOOP_SIDE = {"PENDING": "w", "OFFLOADING": "w", "FINISHING": "w", "CANCELLING": "e"}


def _digraph(spec: LifecycleSpec | LoadSpec, highlight: Highlight | None) -> Any:
    """The lifecycle as a graphviz ``Digraph``, top to bottom: each edge's events in
    lines grouped by guard (:func:`edge_label`), so no label prints over another or over
    an edge (``tests/test_graph.py`` checks it in the laid-out drawing)."""
    try:
        import graphviz
    except ImportError:
        raise MissingDependency(f"drawing dot/svg/png needs the graphviz package: {_GRAPHVIZ_HINT}") from None
    title = "kvoffload load lifecycle" if isinstance(spec, LoadSpec) else "kvoffload lifecycle"
    graph = graphviz.Digraph(
        title,
        graph_attr={"label": title, "labelloc": "t", "rankdir": "TB", "nodesep": "1.8", "ranksep": "0.7"},
        node_attr={"shape": "rectangle", "style": "rounded,filled", "fillcolor": "white", "color": "black"},
        edge_attr={"fontsize": "10", "color": "grey30"},
    )
    marks = _norm(highlight, spec)
    for state in spec.states:
        name = state.name
        if marks.get(name):
            graph.node(
                name,
                label=f"{name}\\n{', '.join(marks[name])}",
                fillcolor="darksalmon",
                color="red",
                peripheries="2",
            )
        else:
            graph.node(name)
    for (src, dst), labels in edges(spec).items():
        if src == dst:  # a state's own loop on the side no long edge runs (_LOOP_SIDE)
            side = _LOOP_SIDE.get(src, "e")
            graph.edge(src, dst, label=edge_label(labels), tailport=side, headport=side)
        else:
            graph.edge(src, dst, label=edge_label(labels))
    return graph


def dot(spec: LifecycleSpec | LoadSpec = SPEC, highlight: Highlight | None = None) -> str:
    """The lifecycle as graphviz dot source (needs the ``graphviz`` Python package only)."""
    source: str = _digraph(spec, highlight).source
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


# Where draw_matplotlib puts each state (x, y): top to bottom, as Graphviz lays it out
# (the happy path down the middle, the other states beside it).
_LAYOUT = {
    "PENDING": (2.0, 3.0),
    "OFFLOADING": (0.4, 2.2),
    "FINISHING": (2.0, 1.0),
    "RELEASED": (2.6, 0.0),
    "READING": (2.0, 3.0),
    "COPYING": (0.6, 2.0),
    "CANCELLING": (1.7, 1.0),
    "DONE": (1.7, 0.0),
}
# How far (and which way) an edge bows: the long edges round the states they skip.
_BOW = {("PENDING", "RELEASED"): -0.35, ("READING", "DONE"): -0.3, ("COPYING", "DONE"): 0.45}
# Straight edges whose label goes on their left: a long edge bows past their right.
_LABEL_WEST = {("FINISHING", "RELEASED"), ("CANCELLING", "DONE")}


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
        _, ax = plt.subplots(figsize=(8, 7))
    marks = _norm(highlight, spec)
    for (src, dst), names in edges(spec).items():
        (x0, y0), (x1, y1) = _LAYOUT[src], _LAYOUT[dst]
        text = edge_label(names).replace("\\n", "\n") if labels else ""
        if src == dst:  # a loop on the state's west side, its label further west
            side = -1.0 if _LOOP_SIDE.get(src, "e") == "w" else 1.0
            ax.annotate(
                "", xy=(x0 + side * 0.3, y0 - 0.1), xytext=(x0 + side * 0.3, y0 + 0.1),
                arrowprops={"arrowstyle": "->", "connectionstyle": f"arc3,rad={-2.2 * side}",
                            "color": "grey"},
            )  # fmt: skip
            ax.text(x0 + side * 0.62, y0, text, ha="right" if side < 0 else "left", va="center",
                    fontsize=7, color="dimgrey")  # fmt: skip
            continue
        rad = _BOW.get((src, dst), 0.15 if (dst, src) in edges(spec) else 0.0)
        arrow = FancyArrowPatch(
            (x0, y0), (x1, y1), arrowstyle="-|>", mutation_scale=12, color="grey",
            connectionstyle=f"arc3,rad={rad}", shrinkA=14, shrinkB=14,
        )  # fmt: skip
        ax.add_patch(arrow)
        # the label beside the curve's middle, off its outer side (a straight one: its right)
        dx, dy = x1 - x0, y1 - y0
        length = math.hypot(dx, dy)
        nx, ny = dy / length, -dx / length  # the curve's normal towards where arc3 bows it
        if rad < 0 or (rad == 0 and (nx < 0) != ((src, dst) in _LABEL_WEST)):
            nx, ny = -nx, -ny
        mx, my = x0 + dx / 2 + rad * dy * 0.5 + 0.1 * nx, y0 + dy / 2 - rad * dx * 0.5 + 0.1 * ny
        va = "bottom" if ny > 0.5 else "top" if ny < -0.5 else "center"
        ax.text(mx, my, text, ha="left" if nx >= 0 else "right", va=va, fontsize=7, color="dimgrey")
    for state in spec.states:
        x, y = _LAYOUT[state.name]
        on = bool(marks.get(state.name))
        ax.text(
            x, y, state.name + ("\n" + "\n".join(marks[state.name]) if on else ""),
            ha="center", va="center", fontsize=9, weight="bold" if on else "normal",
            bbox={"boxstyle": "round", "fc": "darksalmon" if on else "white", "ec": "red" if on else "black"},
        )  # fmt: skip
    ax.set_xlim(-0.8, 3.6)
    ax.set_ylim(-0.4, 3.4)
    ax.axis("off")
    return ax
