"""The integration example: a decode scheduler loop driving kvoffload as an engine would.

The loop itself is ``kvoffload/tools/scheduler.py`` (``DecodeScheduler``): read it first. Per
decode step it admits arrived requests (``mgr.admit``), commits one token for every
running request (``lc.extend``), finishes or aborts the ones that are done
(``lc.finish`` / ``lc.abort``) and frees each request's slot when ``await
lc.wait_released()`` returns. ``kvoffload simulate`` runs the same loop with a bigger
workload and a summary table.

This script runs a small workload on the embedded defaults (the ``cpu`` backend and the
file store when this build has them, else ``sim`` and memory) and prints the summary::

    python examples/scheduler.py [requests] [seed]
"""

from __future__ import annotations

import asyncio
import logging
import sys
from contextlib import ExitStack

import structlog

import kvoffload as kvo
from kvoffload.tools.simulate import choose_backend, choose_store, print_summary, simulate
from kvoffload.tools.workload import WorkloadSpec


async def main(requests: int = 60, seed: int = 0) -> int:
    spec = WorkloadSpec(requests=requests, prompt_mean=96, output_mean=48, reuse=0.3, seed=seed)
    config = kvo.OffloadConfig(page_size=16, stride=32, device_pages=4096, host_pages=64, kv_shape=(64,))
    with ExitStack() as stack:
        backend = choose_backend("auto")
        storage, store_desc = choose_store("auto", stack)
        report = await simulate(spec, config, backend, storage, store_desc)
    print_summary(report)
    return 0 if report["ledger"]["ok"] else 1


if __name__ == "__main__":
    # An application chooses its log level; kvoffload never configures structlog.
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.ERROR))
    args = [int(a) for a in sys.argv[1:3]]
    raise SystemExit(asyncio.run(main(*args)))
