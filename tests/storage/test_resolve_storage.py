"""storage= on the manager: a name, a directory path, a redis:// URL, or an instance."""

from __future__ import annotations

from pathlib import Path

import pytest

import kvoffload as kvo
from kvoffload.storage import resolve_storage
from kvoffload.storage.file import FileStorage
from kvoffload.storage.memory import MemoryStorage
from kvoffload.storage.redis import RedisStorage


def test_none_and_instances_pass_through() -> None:
    m = MemoryStorage()
    assert resolve_storage(None) is None
    assert resolve_storage(m) is m


def test_memory_by_name() -> None:
    assert isinstance(resolve_storage("memory"), MemoryStorage)


@pytest.mark.parametrize("form", ["pathlike", "absolute", "file-url"])
def test_a_directory_path_is_the_file_store(tmp_path: Path, form: str) -> None:
    root = tmp_path / "kv"
    arg: object = {"pathlike": root, "absolute": str(root), "file-url": f"file://{root}"}[form]
    s = resolve_storage(arg)  # type: ignore[arg-type]
    assert isinstance(s, FileStorage) and s.root == root and root.is_dir()


def test_a_relative_path_is_the_file_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    s = resolve_storage("./kv")
    assert isinstance(s, FileStorage) and (tmp_path / "kv").is_dir()


@pytest.mark.asyncio
async def test_a_redis_url_is_the_redis_store() -> None:
    s = resolve_storage("redis://127.0.0.1:1/3?prefix=w:")
    assert isinstance(s, RedisStorage) and s.prefix == "w:" and s.url == "redis://127.0.0.1:1/3"
    await s.aclose()


@pytest.mark.parametrize("bad", ["memroy", "s3://bucket/x", "", "file"])
def test_anything_else_is_a_config_error_and_creates_nothing(
    bad: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A typo never becomes a directory: a bare word must be written ./word."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(kvo.ConfigError, match="unknown storage"):
        resolve_storage(bad)
    assert list(tmp_path.iterdir()) == []
