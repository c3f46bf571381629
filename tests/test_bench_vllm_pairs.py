"""bench_vllm.py's own decode pairs, read from a run's result (no vLLM needed): the
stored batches' ms per token over the quiet ones', and no ratio at all when a batch
that asked not to be stored grew the store (the comparison would be void)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_vllm as bv


def _run(ms: dict[str, float], files: dict[str, int]) -> dict[str, Any]:
    reqs: dict[str, Any] = {}
    for phase, v in ms.items():
        for j in range(4):
            name = f"d{j}" if phase == "decode" else f"{phase}-{j}"
            reqs[name] = {"decode_s_per_token": v / 1e3}
    return {"requests": reqs, "phases": {p: 1.0 for p in ms}, "files": files}


def test_the_pair_ratio_is_stored_over_quiet() -> None:
    names = ["decode", *(n for n, _ in bv.pair_names(2))]
    assert names == [
        "decode", "decode-quiet0", "decode-quiet1", "decode-stored2",
        "decode-stored3", "decode-quiet4", "decode-quiet5", "decode-stored6",
    ]  # fmt: skip
    ms = {n: (33.0 if "quiet" in n else 36.3) for n in names}
    files = {n: 10 + 4 * sum("quiet" not in m for m in names[: i + 1]) for i, n in enumerate(names)}
    assert bv.pair_ratio(_run(ms, files)) == pytest.approx(1.1)
    assert bv.pair_ratio(_run({"decode": 30.0}, {"decode": 4})) is None  # no pairs: none


def test_a_quiet_batch_that_grew_the_store_voids_the_run() -> None:
    ms = {"decode": 30.0, "decode-quiet0": 30.0, "decode-quiet1": 30.0, "decode-stored2": 30.0}
    files = {"decode": 8, "decode-quiet0": 8, "decode-quiet1": 9, "decode-stored2": 12}
    with pytest.raises(SystemExit, match="decode-quiet1 asked not to be stored"):
        bv.pair_ratio(_run(ms, files))


def test_the_kvoffload_column_stores_direct_unless_told(tmp_path: Path) -> None:
    """The default store is the work dir's file store writing direct (``?direct=1``, a
    URL the connector's store opener takes); ``--page-cache`` drops ``direct``;
    ``--storage`` is used as given."""
    import argparse

    from kvoffload.storage import resolve_storage
    from kvoffload.storage.file import FileStorage

    def args(**kw: Any) -> argparse.Namespace:
        return argparse.Namespace(**{"storage": None, "page_cache": False, **kw})

    url = bv.kvoffload_store(args(), tmp_path)
    assert url == f"file://{tmp_path / 'kvoffload-store'}?direct=1"
    store = resolve_storage(url)
    assert isinstance(store, FileStorage) and store.root == tmp_path / "kvoffload-store"
    assert store.describe()["direct"] is bool(getattr(__import__("os"), "O_DIRECT", 0))
    assert bv.kvoffload_store(args(page_cache=True), tmp_path) == str(tmp_path / "kvoffload-store")
    assert bv.kvoffload_store(args(storage="redis://x"), tmp_path) == "redis://x"
