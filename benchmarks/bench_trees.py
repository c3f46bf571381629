"""The bookkeeping of two source trees of kvoffload, side by side in one run (issue 21).

    python benchmarks/bench_trees.py BEFORE_TREE AFTER_TREE [--rounds N]

A restructuring must not make the decode step dearer. Each round runs one worker
process per tree (the order alternates every round), each importing kvoffload from its
own tree; a worker times, on a ``SyncOffloadManager`` over a ``SimBackend``, one stride
of decode steps for 512 requests (16-token prompts, page 16, stride 64: every request's
chunk is due once per stride, and its completion is delivered), per request
(``lc.extend([token])``) and batched (``mgr.extend_batch(lifecycles, tokens)``), and
prints its median seconds per request-step. The ratios printed are the medians of the
per-round ratios after/before - on a shared machine absolute times drift by 2x between
minutes, the ratio of neighbours does not:

    ratio after/before per-request: X
    ratio after/before batched: Y

Only public API is used, so any two trees since v2 can be compared. Target of issue 21:
both within 1.05.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

WORKER = r"""
import json, statistics, time
import kvoffload as kvo
from kvoffload.testing import SimBackend

N, PAGE, STRIDE, INNER = 512, 16, 64, 12
config = kvo.OffloadConfig(
    page_size=PAGE, stride=STRIDE, device_pages=N * (1 + (3 * INNER + 4) * STRIDE // PAGE),
    host_pages=N * STRIDE // PAGE * 2, kv_shape=(1,), dtype="uint8",
)
out = {}
for kind in ("per-request", "batched"):
    backend = SimBackend()
    mgr = kvo.SyncOffloadManager(config, backend=backend).open()
    lcs = [mgr.admit(f"r{i}", list(range(16))) for i in range(N)]
    tokens, one = [7] * N, [7]
    times = []
    for r in range(INNER + 1):
        t0 = time.perf_counter()
        for _ in range(STRIDE):
            if kind == "batched":
                mgr.extend_batch(lcs, tokens)
            else:
                for lc in lcs:
                    lc.extend(one)
            mgr.poll()
        t1 = time.perf_counter()
        backend.complete_all()  # the copies end (not timed) ...
        t2 = time.perf_counter()
        mgr.poll()  # ... and their completions are delivered
        t3 = time.perf_counter()
        if r:  # the first round warms up
            times.append(((t1 - t0) + (t3 - t2)) / (N * STRIDE))
    mgr.check_invariants()
    st = mgr.statistics()
    out[kind + " work"] = [st.chunks_submitted, st.pages_copied, st.completions_delivered]
    for lc in lcs:
        lc.abort()
    mgr.close()
    out[kind] = statistics.median(times)
print(json.dumps(out))
"""


def run(tree: Path) -> dict[str, float | list[int]]:
    env = {**os.environ, "PYTHONPATH": str(tree), "PYTHONHASHSEED": "0"}  # the same dict layout in both
    done = subprocess.run(
        [sys.executable, "-c", WORKER], env=env, cwd=tree, capture_output=True, text=True, check=True
    )
    out: dict[str, float | list[int]] = json.loads(done.stdout.strip().splitlines()[-1])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("before", type=Path)
    ap.add_argument("after", type=Path)
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args()
    ratios: dict[str, list[float]] = {"per-request": [], "batched": []}
    seen: dict[str, dict[str, list[float]]] = {
        "before": {k: [] for k in ratios},
        "after": {k: [] for k in ratios},
    }
    for r in range(args.rounds):
        order = [("before", args.before), ("after", args.after)]
        if r % 2:
            order.reverse()
        got = {name: run(tree) for name, tree in order}
        for kind in ratios:
            work = got["before"][kind + " work"]
            if got["after"][kind + " work"] != work:  # the same steps must do the same work
                raise SystemExit(f"{kind}: the trees did different work: {got}")
            before, after = got["before"][kind], got["after"][kind]
            assert isinstance(before, float) and isinstance(after, float)
            ratios[kind].append(after / before)
            seen["before"][kind].append(before)
            seen["after"][kind].append(after)
    print(f"{args.rounds} rounds, interleaved; median us per request-step:")
    for name in ("before", "after"):
        print(
            "  "
            + name
            + ": "
            + ", ".join(f"{k} {statistics.median(v) * 1e6:.3f}" for k, v in seen[name].items())
        )
    for kind, rs in ratios.items():
        print(f"  rounds {kind}: " + " ".join(f"{x:.3f}" for x in rs))
    for kind, rs in ratios.items():
        print(f"ratio after/before {kind}: {statistics.median(rs):.3f}")


if __name__ == "__main__":
    main()
