"""Small helpers shared by the core tests: a virtual clock, loop spinning, tokens."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any

import anyio
import pytest

import kvoffload as kvo
from kvoffload.core.lifecycle import Lifecycle
from kvoffload.testing import SimBackend


class PlainIssuer:
    """A stand-in for the lifecycle a hand-made transfer is issued by (an
    :class:`kvoffload.abc.Issuer`): backends never read it, the transfer copies its
    ``id``, ``rid`` and ``tag``."""

    def __init__(self, id: int = 0, rid: Any = None, tag: Any = None) -> None:
        self.id = id
        self.rid = rid
        self.tag = tag


class FakeClock:
    """A virtual clock for ``OffloadManager(..., clock=...)``: moves only when told."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


async def spin(rounds: int = 20) -> None:
    """Let every other task on the loop run ``rounds`` times (no real time passes)."""
    for _ in range(rounds):
        await anyio.sleep(0)


def toks(start: int, stop: int) -> list[int]:
    """Token ids ``start..stop-1``."""
    return list(range(start, stop))


def page_bytes_of(pool_tensor: object, page: int) -> bytes:
    """The raw bytes of one page of a pool tensor (as a storage tier would get them)."""
    import torch

    assert isinstance(pool_tensor, torch.Tensor)
    return pool_tensor[page].contiguous().view(torch.uint8).numpy().tobytes()


def unchanged(mgr: kvo.OffloadManager, before: kvo.Statistics) -> None:
    """Assert the manager's statistics equal ``before`` and its ledger balances."""
    assert mgr.statistics() == before
    mgr.check_invariants()


async def complete_everything(mgr: kvo.OffloadManager, backend: SimBackend) -> None:
    """Complete every pending copy, wait for delivery, and check the ledger."""
    backend.complete_all()
    await mgr.settle()
    mgr.check_invariants()
    assert mgr.statistics().chunks_inflight == 0


#: Real seconds after which a wait that should already be satisfiable counts as hung.
#: A guard that turns a hang into a failure, never a timing assertion: generous, so
#: that a busy machine (two cores shared, a loaded CI runner) never trips it (F39).
HANG_S = 30.0


async def released(lc: Lifecycle) -> None:
    """``await lc.wait_released()``, failing (instead of hanging) if it never comes."""
    with anyio.fail_after(HANG_S):
        await lc.wait_released()


def small_config(**changes: Any) -> kvo.OffloadConfig:
    """4-token pages, a one-page stride, 64 device and host pages; ``changes`` override."""
    fields: dict[str, Any] = dict(page_size=4, stride=4, device_pages=64, host_pages=64, drain_timeout_s=5)
    fields.update(changes)
    return kvo.OffloadConfig(**fields)


@asynccontextmanager
async def open_manager(
    backend: SimBackend, config: kvo.OffloadConfig | None = None, **kwargs: Any
) -> AsyncIterator[kvo.OffloadManager]:
    """An open manager on ``backend`` for one test body (entered and left in the test's
    own task). On a clean exit every copy is completed and the ledger checked first."""
    async with kvo.OffloadManager(config or small_config(), backend=backend, **kwargs) as mgr:
        yield mgr
        await complete_everything(mgr, backend)


def run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """``kvoffload`` main(argv) -> (exit code, stdout, stderr); argparse's SystemExit
    becomes a code."""
    from kvoffload.tools.cli import main

    try:
        code = main(argv)
    except SystemExit as exc:
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


@contextmanager
def broken_parts(*parts: type) -> Iterator[None]:
    """Within the block, every core is built with ``parts`` in place of the rooms they
    subclass (``Registry``, ``Chunks``, ``Writes``, ``DecodeStep``): how the meta-tests
    inject a bug into the real core without a hook in it. The rooms come back after."""
    import kvoffload.core.offload as offload

    rooms = {"Registry", "Chunks", "Writes", "DecodeStep"}
    saved: dict[str, type] = {}
    for part in parts:
        name = next(b.__name__ for b in part.__mro__[1:] if b.__name__ in rooms)
        saved.setdefault(name, getattr(offload, name))
        setattr(offload, name, part)
    try:
        yield
    finally:
        for name, room in saved.items():
            setattr(offload, name, room)
