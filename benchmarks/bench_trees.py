"""The bookkeeping of two source trees of kvoffload, side by side in one run (issue 21).

    python benchmarks/bench_trees.py BEFORE_TREE AFTER_TREE [--rounds N]

A restructuring must not make the decode step dearer. Both trees are imported into one
process (each tree's ``kvoffload`` modules are put in place in ``sys.modules`` for its
own turn, so every import a call makes at run time finds its own tree), and each gets,
on a ``SyncOffloadManager`` over a ``SimBackend``, 512 requests (16-token prompts, page
16, stride 64: every request's chunk is due once per stride, and its completion is
delivered). A round is one stride of decode steps per tree, per request
(``lc.extend([token])``) and batched (``mgr.extend_batch(lifecycles, tokens)``), the
trees' turns alternating in order every round; the copies end untimed, their delivery
(``poll()``) is timed. The ratios printed are the medians of the per-round ratios
after/before - on a shared machine absolute times drift by 2x between minutes, the
ratio of neighbours does not - and the run checks that both trees did the same work:

    ratio after/before per-request: X (target <= 1.05: ok; rounds A..B (N))
    ratio after/before batched: Y (target <= 1.05: ok; rounds A..B (N))

Only public API is used, so any two trees since v2 can be compared. Target of issue 21:
both within 1.05.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

from _machine import describe, target_line

N, PAGE, STRIDE = 512, 16, 64
KINDS = ("per-request", "batched")
#: Issue 21's target: after/before within 1.05.
TARGET = 1.05


def _ours(name: str) -> bool:
    return name == "kvoffload" or name.startswith("kvoffload.")


def activate(modules: dict[str, ModuleType]) -> None:
    """Put one tree's kvoffload modules in place (and no other tree's)."""
    for name in [m for m in sys.modules if _ours(m)]:
        del sys.modules[name]
    sys.modules.update(modules)


def load(tree: Path) -> dict[str, ModuleType]:
    """Import kvoffload (and its testing helpers) from ``tree``; its modules."""
    activate({})
    sys.path.insert(0, str(tree))
    try:
        import kvoffload
        import kvoffload.testing

        assert Path(kvoffload.__file__).resolve().is_relative_to(tree.resolve()), kvoffload.__file__
    finally:
        sys.path.remove(str(tree))
    return {m: mod for m, mod in sys.modules.items() if _ours(m)}


class Side:
    """One tree's managers (one per kind), built with that tree's modules in place."""

    def __init__(self, modules: dict[str, ModuleType], rounds: int) -> None:
        self.modules = modules
        activate(modules)
        kvo = modules["kvoffload"]
        sim: Any = modules["kvoffload.testing"].SimBackend
        config = kvo.OffloadConfig(
            page_size=PAGE,
            stride=STRIDE,
            device_pages=N * (1 + (rounds + 4) * STRIDE // PAGE),
            host_pages=N * STRIDE // PAGE * 2,
            kv_shape=(1,),
            dtype="uint8",
        )
        self.runs: dict[str, tuple[Any, Any, list[Any]]] = {}
        for kind in KINDS:
            backend = sim()
            mgr = kvo.SyncOffloadManager(config, backend=backend).open()
            self.runs[kind] = (backend, mgr, [mgr.admit(f"r{i}", list(range(16))) for i in range(N)])

    def round(self, kind: str) -> float:
        """Seconds per request-step of one stride (chunks and their delivery included)."""
        activate(self.modules)
        backend, mgr, lcs = self.runs[kind]
        tokens, one = [7] * N, [7]
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
        return ((t1 - t0) + (t3 - t2)) / (N * STRIDE)

    def work(self, kind: str) -> list[int]:
        activate(self.modules)
        _, mgr, _ = self.runs[kind]
        mgr.check_invariants()
        st = mgr.statistics()
        return [st.chunks_submitted, st.pages_copied, st.completions_delivered, st.live_lifecycles]


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("before", type=Path)
    ap.add_argument("after", type=Path)
    ap.add_argument("--rounds", type=int, default=40)
    args = ap.parse_args()
    print(describe())
    sides = {
        name: Side(load(tree), args.rounds + 1)
        for name, tree in (("before", args.before), ("after", args.after))
    }
    for side in sides.values():  # a warm-up round each
        for kind in KINDS:
            side.round(kind)
    seen: dict[str, dict[str, list[float]]] = {name: {k: [] for k in KINDS} for name in sides}
    ratios: dict[str, list[float]] = {k: [] for k in KINDS}
    gc.disable()  # (a collection lands in one side's round or the other's)
    try:
        for r in range(args.rounds):
            for kind in KINDS:
                order = ["before", "after"] if r % 2 == 0 else ["after", "before"]
                got = {name: sides[name].round(kind) for name in order}
                ratios[kind].append(got["after"] / got["before"])
                for name, t in got.items():
                    seen[name][kind].append(t)
            gc.collect()
    finally:
        gc.enable()
    for kind in KINDS:
        if sides["before"].work(kind) != sides["after"].work(kind):
            works = [s.work(kind) for s in sides.values()]
            raise SystemExit(f"{kind}: the trees did different work: {works}")
    print(f"{args.rounds} rounds, the trees' turns alternating; median us per request-step:")
    for name in sides:
        medians = ", ".join(f"{k} {statistics.median(v) * 1e6:.3f}" for k, v in seen[name].items())
        print(f"  {name}: {medians}")
    for kind, rs in ratios.items():
        q = statistics.quantiles(rs, n=4)
        print(f"  per-round ratios {kind}: quartiles {q[0]:.3f} {q[1]:.3f} {q[2]:.3f}")
    for kind, rs in ratios.items():
        print(target_line(f"ratio after/before {kind}", statistics.median(rs), TARGET, at_most=True, xs=rs))


if __name__ == "__main__":
    main()
