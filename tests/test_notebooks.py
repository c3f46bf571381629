"""The example notebooks run top to bottom (so they cannot rot); outputs are not kept."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
NOTEBOOKS = sorted(EXAMPLES.glob("*.ipynb"))


def test_there_are_example_notebooks() -> None:
    assert {p.name for p in NOTEBOOKS} >= {"lifecycle.ipynb", "simulation.ipynb"}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_executes_and_has_no_committed_outputs(path: Path) -> None:
    """Every cell runs without error within 60 s; the checked-in file has no outputs."""
    nbformat = pytest.importorskip("nbformat", reason="the test extra (nbformat) is not installed")
    nbclient = pytest.importorskip("nbclient", reason="the test extra (nbclient) is not installed")
    pytest.importorskip("ipykernel", reason="the test extra (ipykernel) is not installed")
    nb = nbformat.read(path, as_version=4)
    committed = [
        c for c in nb.cells if c.cell_type == "code" and (c.get("outputs") or c.get("execution_count"))
    ]
    assert not committed, f"{path.name} has committed outputs; clear them"
    os.environ.setdefault("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    client = nbclient.NotebookClient(
        nb, timeout=60, kernel_name="python3", resources={"metadata": {"path": str(EXAMPLES)}}
    )
    client.execute()
    errors = [o for c in nb.cells for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors
