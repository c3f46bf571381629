"""What each rank runs in the tests of the ranks' settings and host pools (imported by
name in the spawned rank processes)."""

from __future__ import annotations

from typing import Any

import kvoffload as kvo
from kvoffload._testing.ranks import RankContext
from kvoffload.testing import SimBackend


def _config(**changes: Any) -> kvo.OffloadConfig:
    fields: dict[str, Any] = dict(
        page_size=4, stride=4, device_pages=64, host_pages=16, drain_timeout_s=10, tp_timeout_s=10
    )
    fields.update(changes)
    return kvo.OffloadConfig(**fields)


def _poll_one_copy(ctx: RankContext) -> str:
    """Equal settings on every rank: one copy goes out, completes and is delivered."""
    backend = SimBackend()
    mgr = kvo.SyncOffloadManager(_config(), backend=backend, group=ctx.group)
    mgr.open()
    lc = mgr.admit("a", [1, 2, 3, 4])
    lc.extend([5, 6, 7, 8])
    lc.finish()
    mgr.poll()
    backend.complete_all()
    mgr.wait_released(lc, 10)
    mgr.close()
    return lc.outcome.value if lc.outcome else "none"


def differing_settings(ctx: RankContext, changes: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Each rank builds its manager with ``changes[str(rank)]`` (OffloadConfig fields),
    opens it and polls once. Returns what that did here, and whether the group still
    works afterwards (a manager of equal settings delivers a copy)."""
    out: dict[str, Any] = {}
    try:
        mgr = kvo.SyncOffloadManager(
            _config(**changes.get(str(ctx.rank), {})), backend=SimBackend(), group=ctx.group
        )
        mgr.open()
        mgr.admit("a", [1, 2, 3, 4]).extend([5, 6, 7, 8])
        mgr.poll()
        mgr.close(timeout=0, raise_timeout=False)
        out["first"] = "built"
    except kvo.KVOffloadError as exc:
        out["first"] = f"{type(exc).__name__}: {exc}"
    out["after"] = _poll_one_copy(ctx)
    return out


def host_pool_bytes(ctx: RankContext, keys: str, engine_owned: bool) -> dict[str, Any]:
    """The bytes of memory this rank's host pool holds under ``tp_keys=keys``, in owned
    or engine-owned mode, and its page count (the bookkeeping every rank keeps)."""
    import torch

    changes: dict[str, Any] = {"tp_keys": keys}
    kv = None
    if engine_owned:
        changes["device_pages"] = None
        kv = [torch.zeros(32, 4, 2, 8) for _ in range(2)]
    mgr = kvo.SyncOffloadManager(_config(**changes), backend="cpu", group=ctx.group, device_kv=kv)
    with mgr:
        pool = mgr.host_pool
        return {"nbytes": pool.nbytes, "pages": pool.n_pages, "page_bytes": mgr.page_bytes}
