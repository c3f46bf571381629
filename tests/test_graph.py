"""The lifecycle diagrams come from the one declaration, and the checked-in copy in
docs/lifecycle.md is what ``kvoffload graph`` prints."""

from __future__ import annotations

import importlib.util
import itertools
import re
import shutil
from pathlib import Path
from typing import Any

import pytest

from kvoffload.errors import MissingDependency
from kvoffload.lifecycle.load_spec import LOAD_SPEC, LoadState
from kvoffload.lifecycle.spec import SPEC, LifecycleState
from kvoffload.tools import graph

DOC = Path(__file__).resolve().parent.parent / "docs" / "lifecycle.md"
EDGE = re.compile(r"^\s*(\w+) --> (\w+): (.*)$")


def _mermaid_edges(text: str) -> dict[tuple[str, str], list[str]]:
    out = {}
    for line in text.splitlines():
        m = EDGE.match(line)
        if m:
            out[(m.group(1), m.group(2))] = [label.strip() for label in m.group(3).split("|")]
    return out


def test_mermaid_draws_every_declared_transition_and_nothing_else() -> None:
    """Each (source, dest) edge lists exactly the declared events with their guards."""
    drawn = _mermaid_edges(graph.mermaid())
    declared = graph.edges(SPEC)
    assert {k: sorted(v) for k, v in drawn.items()} == {k: sorted(v) for k, v in declared.items()}
    assert "[*] --> PENDING" in graph.mermaid()
    assert len(declared) == len({(t.source, t.dest) for t in SPEC.transitions})


def test_mermaid_marks_no_state_unless_asked_and_labels_highlighted_ones() -> None:
    """Without highlight every state is plain; with one, the state is filled and
    names the lifecycles in it."""
    plain = graph.mermaid()
    assert "s_active" not in plain.split("classDef s_active", 1)[1]
    marked = graph.mermaid(highlight={LifecycleState.FINISHING: ["#1 r1"], "OFFLOADING": ["#2 r1"]})
    assert "class FINISHING s_active" in marked and "class OFFLOADING s_active" in marked
    assert "class PENDING s_default" in marked
    assert 'state "FINISHING: #1 r1" as FINISHING' in marked
    with pytest.raises(ValueError, match="unknown state"):
        graph.mermaid(highlight={"NOPE": ["x"]})


def test_docs_lifecycle_diagram_is_the_generated_one() -> None:
    """docs/lifecycle.md carries exactly `kvoffload graph --format mermaid`; regenerate
    it (see the doc) when the declaration changes."""
    text = DOC.read_text()
    m = re.search(
        r"<!-- BEGIN kvoffload graph --format mermaid -->\n```mermaid\n(.*?)```\n<!-- END", text, re.S
    )
    assert m, "docs/lifecycle.md lost its generated-diagram markers"
    assert m.group(1) == graph.mermaid(), "docs/lifecycle.md drifted from the declaration"


def test_dot_source_has_every_edge() -> None:
    """The graphviz source (python package only, no binary needed) draws each edge."""
    pytest.importorskip("graphviz", reason="the graphviz extra is not installed")
    source = graph.dot(highlight={"PENDING": ["#1 r1"]})
    for src, dst in graph.edges(SPEC):
        assert f"{src} -> {dst}" in source
    assert "darksalmon" in source


def test_svg_without_the_dot_program_names_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    """svg/png need Graphviz's dot; without it the error says how to get it."""
    pytest.importorskip("graphviz", reason="the graphviz extra is not installed")
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(MissingDependency, match="apt-get install graphviz"):
        graph.render("svg")


@pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz's dot program is not installed")
def test_svg_renders_with_graphviz() -> None:
    pytest.importorskip("graphviz")
    out = graph.render("svg")
    assert isinstance(out, bytes) and b"<svg" in out and b"FINISHING" in out


def test_unknown_format_is_rejected() -> None:
    with pytest.raises(ValueError, match="unknown format"):
        graph.render("gif")


def test_matplotlib_drawing_shows_each_state_and_highlights() -> None:
    """draw_matplotlib needs no system package; highlighted states list their lifecycles."""
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    ax = graph.draw_matplotlib(highlight={"OFFLOADING": ["#3 r2"]})
    texts = [t.get_text() for t in ax.texts]
    for state in LifecycleState:
        assert any(t.startswith(state.name) for t in texts)
    assert "OFFLOADING\n#3 r2" in texts
    import matplotlib.pyplot as plt

    plt.close("all")


# --- the load lifecycle -------------------------------------------------------------------


def test_the_load_lifecycle_mermaid_draws_every_declared_transition() -> None:
    """``graph.mermaid(LOAD_SPEC)`` draws each declared load transition (source, dest,
    event) and nothing else, starting in READING; highlighting marks a load state."""
    text = graph.mermaid(LOAD_SPEC)
    drawn = _mermaid_edges(text)
    declared = graph.edges(LOAD_SPEC)
    assert {k: sorted(v) for k, v in drawn.items()} == {k: sorted(v) for k, v in declared.items()}
    assert "[*] --> READING" in text and "title: kvoffload load lifecycle" in text
    assert len(declared) == len({(t.source, t.dest) for t in LOAD_SPEC.transitions})
    marked = graph.mermaid(LOAD_SPEC, highlight={LoadState.COPYING: ["#4 r1"]})
    assert 'state "COPYING: #4 r1" as COPYING' in marked and "class COPYING s_active" in marked
    with pytest.raises(ValueError, match="unknown state"):
        graph.mermaid(LOAD_SPEC, highlight={"PENDING": ["x"]})  # an offload state


def test_docs_load_lifecycle_diagram_is_the_generated_one() -> None:
    """docs/lifecycle.md carries exactly `kvoffload graph --lifecycle load`."""
    text = DOC.read_text()
    m = re.search(
        r"<!-- BEGIN kvoffload graph --lifecycle load --format mermaid -->\n```mermaid\n(.*?)```\n<!-- END",
        text,
        re.S,
    )
    assert m, "docs/lifecycle.md lost the load diagram's markers"
    assert m.group(1) == graph.mermaid(LOAD_SPEC), "docs/lifecycle.md drifted from LOAD_SPEC"


def test_the_cli_draws_the_load_lifecycle(capsys: pytest.CaptureFixture[str]) -> None:
    """``kvoffload graph --lifecycle load`` prints the load lifecycle; the default is
    still the offload lifecycle."""
    from kvoffload.tools.cli import main

    assert main(["graph", "--lifecycle", "load"]) == 0
    assert capsys.readouterr().out == graph.mermaid(LOAD_SPEC)
    assert main(["graph"]) == 0
    assert capsys.readouterr().out == graph.mermaid()


def test_load_dot_source_and_matplotlib_draw_every_load_state() -> None:
    """The graphviz source has each load edge; draw_matplotlib places each load state."""
    if importlib.util.find_spec("graphviz") is not None:
        source = graph.dot(LOAD_SPEC)
        for src, dst in graph.edges(LOAD_SPEC):
            assert f"{src} -> {dst}" in source
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    ax = graph.draw_matplotlib(LOAD_SPEC, highlight={"CANCELLING": ["#2 r"]})
    texts = [t.get_text() for t in ax.texts]
    for state in LoadState:
        assert any(t.startswith(state.name) for t in texts)
    import matplotlib.pyplot as plt

    plt.close("all")


def _laid_out(source: str) -> dict[str, Any]:
    """Graphviz's own layout of ``source`` (``dot -Tjson``: positions in points)."""
    import json

    import graphviz

    out: dict[str, Any] = json.loads(graphviz.Source(source).pipe(format="json"))
    return out


def _label_boxes(laid: dict[str, Any]) -> list[tuple[int, tuple[float, float, float, float]]]:
    """(edge index, box x0 y0 x1 y1) of every text line of every edge label."""
    boxes = []
    for i, e in enumerate(laid.get("edges", [])):
        size = 14.0
        for op in e.get("_ldraw_", []):
            if op["op"] == "F":
                size = float(op["size"])
            elif op["op"] == "T":
                x, y = op["pt"]
                w = float(op["width"])
                x0 = {"l": x, "r": x - w}.get(op["align"], x - w / 2)
                boxes.append((i, (x0, y - 0.25 * size, x0 + w, y + 0.75 * size)))
    return boxes


def _curve_points(laid: dict[str, Any]) -> list[tuple[int, float, float]]:
    """(edge index, x, y) sampled along every edge's splines and arrowheads."""
    pts = []
    for i, e in enumerate(laid.get("edges", [])):
        for op in [*e.get("_draw_", []), *e.get("_hdraw_", [])]:
            p = op.get("points") or []
            if op["op"] in ("b", "B"):
                for k in range(0, len(p) - 3, 3):
                    (ax, ay), (bx, by), (cx, cy), (dx, dy) = p[k : k + 4]
                    for j in range(25):
                        t = j / 24
                        u = 1 - t
                        x = u**3 * ax + 3 * u * u * t * bx + 3 * u * t * t * cx + t**3 * dx
                        y = u**3 * ay + 3 * u * u * t * by + 3 * u * t * t * cy + t**3 * dy
                        pts.append((i, x, y))
            else:
                pts += [(i, float(x), float(y)) for x, y in p]
    return pts


def _overlaps(a: tuple[float, float, float, float], b: tuple[float, float, float, float]) -> bool:
    return a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]


def _clashes(source: str) -> list[str]:
    """Where a label line prints over another edge's label, a state, or an edge."""
    laid = _laid_out(source)
    boxes = _label_boxes(laid)
    objs = laid.get("objects", [])
    names = {
        i: f"{objs[e['tail']]['name']}->{objs[e['head']]['name']}"
        for i, e in enumerate(laid.get("edges", []))
    }
    nodes = []
    for n in laid.get("objects", []):
        if "pos" in n:
            x, y = (float(v) for v in n["pos"].split(","))
            w, h = float(n["width"]) * 36, float(n["height"]) * 36
            nodes.append((n["name"], (x - w, y - h, x + w, y + h)))
    out = []
    for k, (i, a) in enumerate(boxes):
        out += [
            f"label of {names[i]} over label of {names[j]}"
            for j, b in boxes[k + 1 :]
            if j != i and _overlaps(a, b)
        ]
        out += [f"label of {names[i]} over state {n}" for n, b in nodes if _overlaps(a, b)]
        inner = (a[0] + 1, a[1] + 1, a[2] - 1, a[3] - 1)
        out += [
            f"label of {names[i]} over edge {names[j]}"
            for j, x, y in _curve_points(laid)
            if inner[0] < x < inner[2] and inner[1] < y < inner[3]
        ]
    return sorted(set(out))


@pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz's dot program is not installed")
@pytest.mark.parametrize("spec", [SPEC, LOAD_SPEC], ids=["lifecycle", "load"])
def test_no_label_prints_over_another_a_state_or_an_edge(spec: Any) -> None:
    """Issue 24 point 6: in the laid-out drawing (Graphviz's own positions, what the PNG
    and the SVG show) no edge label's line overlaps another edge's label, a state's
    box, or any edge's curve; every event of every edge is in a label."""
    pytest.importorskip("graphviz")
    source = graph.dot(spec, highlight={spec.states[0].name: ["#1 r1"]})
    assert _clashes(source) == []
    laid = _laid_out(source)
    text = {op["text"] for e in laid["edges"] for op in e.get("_ldraw_", []) if op["op"] == "T"}
    for labels in graph.edges(spec).values():
        for label in labels:
            assert label.partition(" [")[0] in text


@pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz's dot program is not installed")
def test_the_overlap_check_sees_labels_printed_over_each_other() -> None:
    """The check above can fail: the old one-row drawing (every event of an edge on one
    line, left to right) prints FINISHING's self-loop label over other labels or edges."""
    pytest.importorskip("graphviz")
    lines = [f'  {s} -> {d} [label="{" | ".join(ls)}"]' for (s, d), ls in graph.edges(SPEC).items()]
    old = "digraph g {\n  rankdir=LR\n  node [shape=rectangle]\n" + "\n".join(lines) + "\n}\n"
    assert _clashes(old) != []


def _matplotlib_clashes(spec: Any) -> list[str]:
    """Where a label of the matplotlib drawing prints over another label, a state or an
    edge's curve (in display pixels, as drawn)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyArrowPatch

    fig, ax = plt.subplots(figsize=(8, 7))
    try:
        graph.draw_matplotlib(spec, ax=ax)
        fig.canvas.draw()
        r = fig.canvas.get_renderer()
        states = {s.name for s in spec.states}
        texts = [t for t in ax.texts if t.get_text()]
        boxes = []
        for t in texts:
            bb = t.get_window_extent(r)
            if t.get_text().split("\n")[0] in states:
                bb = t.get_bbox_patch().get_window_extent(r)
            boxes.append((t.get_text().split("\n")[0], bb.x0, bb.y0, bb.x1, bb.y1))
        curves = []
        for p in [*ax.patches, *(a.arrow_patch for a in ax.texts if getattr(a, "arrow_patch", None))]:
            if isinstance(p, FancyArrowPatch):
                for poly in p.get_path().to_polygons(closed_only=False):  # curves flattened
                    pts = p.get_transform().transform(poly)
                    for (ax0, ay0), (ax1, ay1) in itertools.pairwise(pts):
                        curves += [(ax0 + (ax1 - ax0) * j / 8, ay0 + (ay1 - ay0) * j / 8) for j in range(8)]
        out = []
        for k, a in enumerate(boxes):
            for b in boxes[k + 1 :]:
                if a[1] < b[3] and b[1] < a[3] and a[2] < b[4] and b[2] < a[4]:
                    out.append(f"{a[0]!r} over {b[0]!r}")
            if a[0] in states:
                continue
            out += [
                f"{a[0]!r} over an edge"
                for x, y in curves
                if a[1] + 1 < x < a[3] - 1 and a[2] + 1 < y < a[4] - 1
            ][:1]
        return out
    finally:
        plt.close(fig)


@pytest.mark.parametrize("spec", [SPEC, LOAD_SPEC], ids=["lifecycle", "load"])
def test_the_matplotlib_drawing_prints_no_label_over_another_a_state_or_an_edge(spec: Any) -> None:
    """Issue 24 point 6, for the notebooks' drawing: no label overlaps another label, a
    state's box or an edge's curve, as drawn."""
    pytest.importorskip("matplotlib")
    assert _matplotlib_clashes(spec) == []
