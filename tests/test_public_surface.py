"""ARCHITECTURE.md's "Public surface" scenario, verbatim, and the public names."""

from __future__ import annotations

import sys

import pytest

import kvoffload as kvo
from kvoffload.testing import SimBackend


@pytest.mark.asyncio
async def test_architecture_scenario_verbatim() -> None:
    """The documented scenario runs as written: a late completion of a finished
    request reaches its own lifecycle, not the new one that reuses its id."""
    config = kvo.OffloadConfig(page_size=4, stride=4, device_pages=64, host_pages=64)
    backend = SimBackend()
    async with kvo.OffloadManager(config, backend=backend) as mgr:
        old = mgr.admit("r1", prompt=[0, 1, 2, 3])  # -> Lifecycle, LifecycleState.PENDING
        old.extend([4, 5, 6, 7, 8])  # a stride is due: tokens 4..7 go out
        assert old.state is kvo.LifecycleState.OFFLOADING and old.inflight == 1
        old.finish()  # FINISHING until its copy completes
        new = mgr.admit("r1", prompt=[0, 1, 2, 3])  # same request id, a new lifecycle
        new.extend([4, 5, 6, 7, 8])
        backend.complete(backend.pending[0])  # the old request's late completion
        await old.wait_released()
        assert old.state is kvo.LifecycleState.RELEASED
        assert new.state is kvo.LifecycleState.OFFLOADING and new.inflight == 1
        await mgr.settle()  # every signalled completion delivered
        stats = mgr.statistics()  # frozen dataclass of counters
        assert stats.live_lifecycles == 1
        assert stats.chunks_inflight == 1
        assert stats.device_pages_used == 3  # new holds 9 tokens in 3 pages
        mgr.check_invariants()
        backend.complete_all()


def test_import_is_light() -> None:
    """`import kvoffload` imports neither torch's CUDA path nor redis."""
    import subprocess

    code = "import sys, kvoffload; print('torch' in sys.modules, 'redis' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_all_is_sorted_and_resolves() -> None:
    assert list(kvo.__all__) == sorted(kvo.__all__, key=lambda s: (not s.isupper(), s))  # SPEC first
    for name in kvo.__all__:
        assert hasattr(kvo, name), name


def test_errors_form_one_hierarchy() -> None:
    for name in kvo.__all__:
        obj = getattr(kvo, name)
        if isinstance(obj, type) and issubclass(obj, Exception):
            assert issubclass(obj, kvo.KVOffloadError), name
