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


def _row(text: str, name: str) -> str:
    """The docs/api.md table row that documents ``name`` (its first cell starts with it)."""
    rows = [line for line in text.splitlines() if re.match(rf"\| `{name}[`(]", line)]
    assert len(rows) == 1, f"docs/api.md has {len(rows)} rows for {name}"
    return rows[0]


@pytest.mark.parametrize("cls", ["Lifecycle", "Transfer", "EventBackend", "Storage"])
def test_api_doc_names_every_public_attribute(cls: str) -> None:
    """Each public method and attribute of the class is named in its docs/api.md row."""
    row = _row((DOCS / "api.md").read_text(), cls)
    public = [n for n in dir(getattr(kvoffload, cls)) if not n.startswith("_")]
    missing = [n for n in public if not re.search(rf"`(?:await )?\.?{n}\b", row)]
    assert not missing, f"docs/api.md's {cls} row does not name {missing}"


@pytest.mark.parametrize("cls", ["OffloadManager", "SyncOffloadManager"])
def test_api_doc_names_every_manager_method(cls: str) -> None:
    """Each public method of both managers appears in docs/api.md as ``mgr.<name>(``
    (``mgr.<name>`` for an attribute), and the constructor's row shows its real keyword
    parameters and defaults."""
    text = (DOCS / "api.md").read_text()
    manager = getattr(kvoffload, cls)
    public = [n for n in dir(manager) if not n.startswith("_")]
    missing = [
        n
        for n in public
        if f"mgr.{n}(" not in text and not (not callable(getattr(manager, n)) and f"`mgr.{n}`" in text)
    ]
    assert not missing, f"docs/api.md does not document mgr.{missing}"
    row = _row(text, cls)
    for p in inspect.signature(manager).parameters.values():
        shown = p.name if p.default is p.empty else f"{p.name}={p.default!r}".replace("'", '"')
        if p.name == "clock":
            shown = "clock=time.monotonic"
        assert shown in row, f"the {cls} row does not show {shown}"


def test_testing_doc_lists_every_testing_name() -> None:
    """Each name in kvoffload.testing.__all__ appears in docs/testing.md as code."""
    import kvoffload.testing

    text = (DOCS / "testing.md").read_text()
    missing = [n for n in kvoffload.testing.__all__ if not re.search(rf"`{re.escape(n)}\b", text)]
    assert not missing, f"docs/testing.md does not mention {missing}"
