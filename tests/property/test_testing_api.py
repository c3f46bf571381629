"""kvoffload.testing's user-facing helpers do what docs/testing.md says."""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys

import structlog
from hypothesis import given, settings
from hypothesis import strategies as st

import kvoffload as kvo
from kvoffload.testing import (
    Request,
    SimBackend,
    capture_transitions,
    completion_orders,
    reference_keys,
    request_streams,
)


def test_simbackend_import_does_not_need_hypothesis() -> None:
    """`from kvoffload.testing import SimBackend` stays light: hypothesis loads on use."""
    code = "import sys; from kvoffload.testing import SimBackend; print('hypothesis' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@settings(max_examples=50)
@given(st.lists(st.integers(0, 2**32 - 1), max_size=20), st.integers(1, 5))
def test_reference_keys_agree_with_the_library_chain(tokens: list[int], page_size: int) -> None:
    """The independent chain equals kvoffload's own, page for page."""
    whole = tokens[: len(tokens) - len(tokens) % page_size]
    assert reference_keys(tokens, page_size) == kvo.chain_keys(None, whole, page_size)


@settings(max_examples=30)
@given(request_streams(min_size=6, max_size=6, rids=2))
def test_request_streams_reuse_ids(requests: list[Request]) -> None:
    """Six requests over two ids: some id is reused."""
    assert len({r.rid for r in requests}) < len(requests)


@settings(max_examples=30)
@given(st.data())
def test_completion_orders_are_permutations(data: st.DataObject) -> None:
    n = data.draw(st.integers(0, 6))
    assert sorted(data.draw(completion_orders(n))) == list(range(n))


def test_capture_transitions_opens_and_restores_a_configured_level_filter() -> None:
    """Under an INFO-level structlog configuration (debug filtered out) the capture
    still sees the debug transitions, and the configuration is restored after."""
    before = structlog.get_config()
    info = structlog.make_filtering_bound_logger(logging.INFO)
    structlog.configure(wrapper_class=info)
    try:

        async def main() -> list[tuple[str, str, str]]:
            config = kvo.OffloadConfig(page_size=2, stride=2, device_pages=8, host_pages=2)
            backend = SimBackend()
            async with kvo.OffloadManager(config, backend=backend) as mgr:
                with capture_transitions() as seen:
                    lc = mgr.admit("r1", prompt=[0, 1])
                    lc.extend([2, 3])
                    backend.complete(backend.pending[0])
                    await mgr.settle()
                    lc.finish()
            return [(r.source, r.trigger, r.dest) for r in seen]

        assert asyncio.run(main()) == [
            ("PENDING", "extend", "PENDING"),
            ("PENDING", "submit", "OFFLOADING"),
            ("OFFLOADING", "chunk_done", "PENDING"),
            ("PENDING", "finish", "RELEASED"),
        ]
        assert structlog.get_config()["wrapper_class"] is info
    finally:
        structlog.configure(wrapper_class=before["wrapper_class"])


def test_capture_transitions_of_one_manager() -> None:
    """With a manager, only that manager's transitions, whatever structlog's config."""

    async def main() -> list[int]:
        config = kvo.OffloadConfig(page_size=2, stride=2, device_pages=8, host_pages=2)
        async with (
            kvo.OffloadManager(config, backend=SimBackend()) as a,
            kvo.OffloadManager(config, backend=SimBackend()) as b,
        ):
            with capture_transitions(a) as seen:
                a.admit("x", prompt=[]).finish()
                b.admit("y", prompt=[]).finish()
            return [r.lifecycle for r in seen]

    assert asyncio.run(main()) == [1]
