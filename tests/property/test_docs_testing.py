"""docs/testing.md's code blocks run as written: its worked example is a test."""

from __future__ import annotations

import re
import unittest
from pathlib import Path
from typing import Any

import pytest

DOC = Path(__file__).resolve().parents[2] / "docs" / "testing.md"


def _namespace() -> dict[str, Any]:
    text = DOC.read_text()
    blocks = list(re.finditer(r"```python\n(.*?)```", text, flags=re.S))
    assert blocks, "docs/testing.md has no python blocks"
    ns: dict[str, Any] = {"__name__": "docs_testing"}
    for block in blocks:
        # Padded to its place in the page, so that a function's line numbers are its
        # lines in docs/testing.md (hypothesis and inspect read its source from there).
        padded = "\n" * text.count("\n", 0, block.start(1)) + block.group(1)
        exec(compile(padded, str(DOC), "exec"), ns)
    return ns


NS = _namespace()


@pytest.mark.parametrize("name", sorted(n for n in NS if n.startswith("test_")))
def test_doc_function(name: str) -> None:
    """Each ``test_*`` function of the page passes."""
    NS[name]()


@pytest.mark.parametrize(
    "name", sorted(n for n, v in NS.items() if isinstance(v, type) and issubclass(v, unittest.TestCase))
)
def test_doc_state_machine(name: str) -> None:
    """Each state machine test case of the page passes (the worked example)."""
    result = unittest.TextTestRunner(verbosity=0).run(
        unittest.defaultTestLoader.loadTestsFromTestCase(NS[name])
    )
    assert result.wasSuccessful(), result.failures + result.errors
