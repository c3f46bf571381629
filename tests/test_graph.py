"""The lifecycle diagrams come from the one declaration, and the checked-in copy in
docs/lifecycle.md is what ``kvoffload graph`` prints."""

from __future__ import annotations

import importlib.util
import re
import shutil
from pathlib import Path

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
