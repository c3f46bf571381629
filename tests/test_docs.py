"""The docs name what the code exports."""

from __future__ import annotations

import ast
import asyncio
import inspect
import re
import tempfile
from pathlib import Path
from typing import Any

import pytest
import structlog

import kvoffload

DOCS = Path(__file__).resolve().parent.parent / "docs"


def test_api_doc_lists_every_exported_name() -> None:
    """Each name in kvoffload.__all__ appears in docs/api.md as code."""
    text = (DOCS / "api.md").read_text()
    missing = [n for n in kvoffload.__all__ if not re.search(rf"`{re.escape(n)}\b", text)]
    assert not missing, f"docs/api.md does not mention {missing}"


def test_index_links_every_doc_page() -> None:
    """docs/index.md links the other pages the issue asks for."""
    text = (DOCS / "index.md").read_text()
    for page in ("lifecycle", "api", "backends", "storage", "events", "testing"):
        assert f"({page}.md)" in text


ROOT = DOCS.parent
# docs/testing.md runs its own blocks (tests/property/test_docs_testing.py).
SNIPPET_PAGES = [ROOT / "README.md", *sorted(p for p in DOCS.glob("*.md") if p.name != "testing.md")]


def _python_blocks() -> list[tuple[str, int, str]]:
    out = []
    for page in SNIPPET_PAGES:
        blocks = re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S)
        out += [(page.relative_to(ROOT).as_posix(), i, b) for i, b in enumerate(blocks)]
    return out


@pytest.mark.parametrize(("page", "index", "code"), _python_blocks(), ids=lambda v: str(v)[:20])
def test_doc_python_block_runs(
    page: str, index: int, code: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every ```python block of README.md and docs/ runs as written, top-level ``await``
    included (as in ``python -m asyncio`` or a notebook), and its asserts hold."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # a block's temp dirs go here
    monkeypatch.chdir(tmp_path)
    flags = ast.PyCF_ALLOW_TOP_LEVEL_AWAIT
    compiled = compile(code, f"{page} python block {index}", "exec", flags=flags)
    ns: dict[str, Any] = {"__name__": f"doc_block_{index}"}
    was_configured = structlog.is_configured()
    saved = structlog.get_config()
    try:
        result = eval(compiled, ns)  # a coroutine when the block awaits
        if inspect.iscoroutine(result):
            asyncio.run(result)
    finally:  # a block may configure structlog (docs/events.md): put it back
        if was_configured:
            structlog.configure(**saved)
        else:
            structlog.reset_defaults()


def test_doc_snippet_pages_have_python_blocks() -> None:
    """The snippet test above really runs the pages that carry examples."""
    pages = {page for page, _, _ in _python_blocks()}
    assert {"README.md", "docs/index.md", "docs/backends.md", "docs/storage.md", "docs/events.md"} <= pages
