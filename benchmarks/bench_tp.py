"""``poll()`` under tensor parallelism against SGLang's own check, side by side on the
same gloo group (issue 25, point 1): ``ratio kvoffload/sglang tp2`` and ``tp4``.

Each rank is a spawned process (kvoffload._testing.ranks.LocalRanks, one gloo group).
On every rank, in every round, both sides run the same three cases, each call timed
from a common start (an untimed all-reduce before it, so a late rank does not inflate
the others' figures). Each step of a round is taken by both sides before either's next
call, and within each case the two sides' calls alternate one by one, the first side
alternating from round to round: so every call comes after the same history.

- ``idle``: nothing in flight, nothing ready: ``IDLE_SKIPS + 1`` calls (one whole cycle
  of kvoffload's skip schedule, so its skipped polls and the one that runs the
  collective are counted alike);
- ``in flight``: both sides send 64 copies (kvoffload: one ``extend`` per lifecycle;
  SGLang: 64 entries of ``ongoing_offload``), untimed, then each makes the untimed call
  of the step they went out in; then one timed call each, none finished;
- ``64 ready``: every rank finished the 64 on both sides: one call each delivers them.

Why paired: on 2 shared cores, an all-reduce is slower right after a burst of CPU on
the ranks (gloo's ring needs every rank's process scheduled in turn). The former
layout (one side's whole round, then the other's) timed each side after its own
sending - kvoffload's 64 extends hash and plan, about 0.6-0.7 ms of CPU, SGLang's 64
records 0.09 ms - so its ``in flight`` call carried that difference: with a busy wait
of 0.8 ms added before SGLang's untimed call, its ``in flight`` call went from 1.4 to
3.2 ms (median, 4 ranks, one run), where kvoffload's was 3.3 ms. The run prints that
layout's ratio too, without a target, and the sending time of both sides; what an
``extend`` costs is measured by ``bench_bookkeeping.py`` and ``bench_core_sglang.py``.

kvoffload's side is the real ``SyncOffloadManager.poll()`` with ``group=`` (its real
agreement, :mod:`kvoffload.drivers.distributed`, on a :class:`~kvoffload.testing.SimBackend`).
SGLang's side is ``DecodeKVCacheOffloadManager.check_offload_progress()`` of SGLang
0.5.23 as written there, with its state in plain objects: a tensor of the two
ack-queue lengths, one ``torch.distributed.all_reduce`` (MIN) of it over the group,
then ``_check_offload_progress(n_write)``: pop each ack, synchronize its event (a CPU
stand-in), pop its ``ongoing_offload`` entry, ``_mark_offload_finished``, hash its
page chain (``get_hash_str``: SHA-256 here, as SGLang's fallback) and queue its storage
backup (``write_storage``), and ``_check_backup_progress(n_backup)`` (no backup acks
are ready: kvoffload's side has no store). SGLang hashes at ack time; kvoffload hashed
the same pages at ``extend`` time, before the poll.

Per round, each side's time is the slowest rank's per call, summed over the round's
``in flight`` and ``64 ready`` calls; the ratio is kvoffload's over SGLang's, and
``ratio kvoffload/sglang tpN`` is the median of the per-round ratios, with their range.
Target: <= 1.1 at both sizes. ``ratio kvoffload/sglang idle tpN``: the same over the
idle cycle (where kvoffload skips all but one collective), same target.
Run: ``python benchmarks/bench_tp.py [rounds]``.
"""

from __future__ import annotations

import datetime
import hashlib
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from _machine import describe, spread, target_line

import kvoffload as kvo
from kvoffload._testing.ranks import LocalRanks, RankContext
from kvoffload.drivers.distributed import HEADER, IDLE_SKIPS
from kvoffload.testing import SimBackend

N = 64  # lifecycles (requests), one copy in flight each
PAGE = 16
TARGET = 1.1
CASES = ("idle", "in flight", "64 ready")
#: The cases of the headline ratio: copies in flight, none ready or 64 ready.
BUSY = ("in flight", "64 ready")
SIDES = ("kvoffload", "sglang")
#: "paired": the target's layout; "separate": the former one, printed beside it.
LAYOUTS = ("paired", "separate")


def cfg(rounds: int) -> kvo.OffloadConfig:
    return kvo.OffloadConfig(
        page_size=PAGE,
        stride=PAGE,
        device_pages=N * (rounds + 4),
        host_pages=N * 2,
        kv_shape=(1,),
        dtype="uint8",
    )


# --- SGLang's side: its check as written in 0.5.23, its state in plain objects ----------


class _Event:
    """The ack's ``finish_event`` (a CUDA event there): finished already."""

    def synchronize(self) -> None:
        return None


@dataclass
class _Ack:
    node_ids: list[int]
    finish_event: _Event = field(default_factory=_Event)


class _Req:
    def __init__(self, rid: str) -> None:
        self.rid = rid

    def finished(self) -> bool:
        return False  # decoding: not released by the ack


@dataclass
class _Offloaded:
    last_hash: str | None = None


class _Controller:
    """The cache controller's part the check reads: its two ack queues and
    ``write_storage`` (which queues a backup for the storage thread)."""

    def __init__(self) -> None:
        import queue

        self.ack_write_queue: list[_Ack] = []
        self.ack_backup_queue: queue.Queue[Any] = queue.Queue()
        self.backup_queue: list[tuple[int, Any, list[int], list[str]]] = []
        self._ids = 0

    @staticmethod
    def get_hash_str(token_ids: list[int], prior_hash: str | None = None) -> str:
        h = hashlib.sha256()
        if prior_hash:
            h.update(bytes.fromhex(prior_hash))
        for t in token_ids:
            h.update(t.to_bytes(4, "little", signed=False))
        return h.hexdigest()

    def write_storage(self, host_indices: Any, token_ids: list[int], hash_value: list[str]) -> int:
        self._ids += 1
        self.backup_queue.append((self._ids, host_indices, token_ids, hash_value))
        return self._ids


class SGLangCheck:
    """``DecodeKVCacheOffloadManager.check_offload_progress()`` and what it calls, in
    SGLang 0.5.23's shape (see the module doc)."""

    def __init__(self, group: Any, tp_world_size: int) -> None:
        self.cache_controller = _Controller()
        self.tp_group = group
        self.tp_world_size = tp_world_size
        self.page_size = PAGE
        self.ongoing_offload: dict[int, tuple[_Req, Any, list[int], float, tuple[Any, ...]]] = {}
        self.ongoing_backup: dict[int, tuple[str, Any, float, tuple[Any, ...]]] = {}
        self.offload_inflight: dict[_Req, int] = {}
        self.offloaded_state: dict[_Req, _Offloaded] = {}

    def offload(self, req: _Req, ack_id: int, host_indices: Any, tokens: list[int]) -> None:
        """A copy goes out (untimed): what ``offload_kv_cache`` records."""
        self.ongoing_offload[ack_id] = (req, host_indices, tokens, time.time(), ())
        self.offload_inflight[req] = self.offload_inflight.get(req, 0) + 1
        self.offloaded_state.setdefault(req, _Offloaded())

    def check_offload_progress(self) -> None:
        import torch

        cc = self.cache_controller
        qsizes = torch.tensor([len(cc.ack_write_queue), cc.ack_backup_queue.qsize()], dtype=torch.int)
        if self.tp_world_size > 1:
            torch.distributed.all_reduce(qsizes, op=torch.distributed.ReduceOp.MIN, group=self.tp_group)
        n_write, n_backup = map(int, qsizes.tolist())
        self._check_offload_progress(n_write)
        self._check_backup_progress(n_backup)

    def _mark_offload_finished(self, req: _Req) -> None:
        count = self.offload_inflight.get(req, 0)
        if count <= 1:
            self.offload_inflight.pop(req, None)
        else:
            self.offload_inflight[req] = count - 1

    def _has_inflight_offload(self, req: _Req) -> bool:
        return self.offload_inflight.get(req, 0) > 0

    def _check_offload_progress(self, finish_count: int) -> None:
        while finish_count > 0:
            ack = self.cache_controller.ack_write_queue.pop(0)
            ack.finish_event.synchronize()
            for ack_id in ack.node_ids:
                req, host_indices, incremental_tokens, start_time, pool_transfers = self.ongoing_offload.pop(
                    ack_id
                )
                self._mark_offload_finished(req)
                prior_hash = self.offloaded_state[req].last_hash if req in self.offloaded_state else None
                last_hash = self._trigger_backup(
                    req, host_indices, incremental_tokens, start_time, prior_hash, pool_transfers
                )
                if req in self.offloaded_state:
                    self.offloaded_state[req].last_hash = last_hash
                if req.finished() and not self._has_inflight_offload(req):
                    raise AssertionError("not reached: the requests are decoding")
            finish_count -= 1

    def _check_backup_progress(self, finish_count: int) -> None:
        for _ in range(finish_count):
            op = self.cache_controller.ack_backup_queue.get()
            self.ongoing_backup.pop(op.id)

    def _trigger_backup(
        self,
        req: _Req,
        host_indices: Any,
        incremental_tokens: list[int],
        start_time: float,
        prior_hash: str | None,
        pool_transfers: tuple[Any, ...] = (),
    ) -> str | None:
        page_hashes = self._compute_prefix_hash(incremental_tokens, prior_hash)
        ack_id = self.cache_controller.write_storage(host_indices, incremental_tokens, hash_value=page_hashes)
        self.ongoing_backup[ack_id] = (req.rid, host_indices, start_time, pool_transfers)
        return page_hashes[-1] if page_hashes else prior_hash

    def _compute_prefix_hash(self, tokens: list[int], prior_hash: str | None) -> list[str]:
        page_hashes = []
        last_hash = prior_hash
        for offset in range(0, len(tokens), self.page_size):
            page = tokens[offset : offset + self.page_size]
            last_hash = self.cache_controller.get_hash_str(page, last_hash)
            page_hashes.append(last_hash)
        return page_hashes


# --- one rank --------------------------------------------------------------------------


def measure(ctx: RankContext, rounds: int, layout: str = "paired") -> dict[str, Any]:
    """On one rank: per round, seconds of each side in each case; and the polls kvoffload
    skipped (the same on every rank). ``layout``: ``"paired"`` (both sides prepared
    first, then each case's two calls back to back, their order alternating) or
    ``"separate"`` (the former layout: each side prepares, then runs its calls)."""
    import torch
    import torch.distributed as dist

    group = ctx.group
    sync = torch.zeros(1, dtype=torch.int64)
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.MIN  # type: ignore[assignment]
    opts.timeout = datetime.timedelta(seconds=120)

    def barrier() -> None:
        group.allreduce([sync], opts).wait()

    backend = SimBackend()
    mgr = kvo.SyncOffloadManager(cfg(rounds), backend=backend, group=group).open()
    tp = mgr._tp
    assert tp is not None and tp._buf.numel() == HEADER + 2 * mgr.config.tp_window
    sgl = SGLangCheck(group, ctx.size)
    cc = sgl.cache_controller
    reqs = [_Req(f"r{i}") for i in range(N)]
    lcs = [mgr.admit(f"r{i}", list(range(PAGE))) for i in range(N)]
    mgr.poll()  # the admissions agreed: idle polls may skip from here
    host = torch.arange(PAGE)
    tok = list(range(PAGE))
    ack_ids = iter(range(1 << 40))
    times: dict[str, dict[str, list[float]]] = {s: {c: [] for c in CASES} for s in SIDES}
    # prep: per round, each side's (untimed) sending of its 64 copies.
    prep: dict[str, list[float]] = {s: [] for s in SIDES}
    delivered: list[int] = []
    sgl_ids: list[int] = []

    def timed(call: Any) -> float:
        barrier()
        t0 = time.perf_counter()
        call()
        return time.perf_counter() - t0

    def kvo_ready() -> None:
        delivered.append(mgr.poll())

    def kvo_send() -> None:  # 64 copies go out
        for lc in lcs:
            lc.extend(tok)

    def sgl_send() -> None:  # the storage thread took the last backups; 64 copies go out
        cc.backup_queue.clear()
        sgl.ongoing_backup.clear()
        sgl_ids.clear()
        for req in reqs:
            ack_id = next(ack_ids)
            sgl.offload(req, ack_id, host, tok)
            sgl_ids.append(ack_id)

    def sgl_finish() -> None:  # every rank finished all 64
        cc.ack_write_queue.extend(_Ack([i]) for i in sgl_ids)

    calls: dict[str, dict[str, Any]] = {
        "kvoffload": {"idle": mgr.poll, "in flight": mgr.poll, "64 ready": kvo_ready},
        "sglang": {c: sgl.check_offload_progress for c in CASES},
    }
    send = {"kvoffload": kvo_send, "sglang": sgl_send}
    finish = {"kvoffload": backend.complete_all, "sglang": sgl_finish}

    def run(order: tuple[str, ...], case: str) -> None:
        """Each side's calls of ``case`` (a whole skip cycle for "idle"); with two sides,
        their calls alternate one by one, the first in ``order`` going first."""
        total = dict.fromkeys(order, 0.0)
        for i in range(IDLE_SKIPS + 1 if case == "idle" else 1):
            for side in order if i % 2 == 0 else order[::-1]:
                total[side] += timed(calls[side][case])
        for side, t in total.items():
            times[side][case].append(t)

    for r in range(rounds):
        order = SIDES if r % 2 == 0 else SIDES[::-1]
        # paired: each step of the round is taken by both sides before either's next
        # call, so both call with the same history; separate: one side, then the other.
        for together in (order,) if layout == "paired" else tuple((side,) for side in order):
            run(together, "idle")
            for side in together:
                t0 = time.perf_counter()
                send[side]()
                prep[side].append(time.perf_counter() - t0)
                calls[side]["idle"]()  # the step they go out in (untimed)
            run(together, "in flight")
            for side in together:
                finish[side]()
            run(together, "64 ready")
        assert delivered == [N] * (r + 1), delivered[-3:]
        assert not sgl.ongoing_offload and not cc.ack_write_queue
    for lc in lcs:
        lc.finish()
    skipped, compact, n_calls = tp.polls_skipped, tp.compact_agreed, tp.calls
    mgr.close()
    return {"times": times, "prep": prep, "skipped": skipped, "compact": compact, "calls": n_calls}


def _ratios(res: list[dict[str, Any]], cases: tuple[str, ...]) -> list[float]:
    """Per round: kvoffload's time over SGLang's, each the slowest rank's, over ``cases``."""
    rounds = len(res[0]["times"]["kvoffload"][cases[0]])
    out = []
    for i in range(rounds):
        k = sum(max(r["times"]["kvoffload"][c][i] for r in res) for c in cases)
        s = sum(max(r["times"]["sglang"][c][i] for r in res) for c in cases)
        out.append(k / s)
    return out


def _median_us(res: list[dict[str, Any]], side: str, case: str, calls: int) -> float:
    rounds = len(res[0]["times"][side][case])
    return statistics.median(max(r["times"][side][case][i] for r in res) for i in range(rounds)) / calls * 1e6


def main(rounds: int = 60) -> None:
    print(describe())
    print(
        f"bench_tp: kvoffload poll() against SGLang 0.5.23's check_offload_progress(), side by side on "
        f"one gloo group (loopback), {rounds} rounds interleaved; the slowest rank per call"
    )
    results: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for size in (2, 4):
        with LocalRanks(size, timeout_s=900) as ranks:
            for layout in LAYOUTS:
                results[layout, size] = res = ranks.run(measure, rounds, layout, timeout=900)
                skips = {r["skipped"] for r in res}
                assert len(skips) == 1, f"ranks skipped different polls: {skips}"
        res = results["paired", size]
        skipped = res[0]["skipped"]
        print(f"tp{size}: µs per call (median over rounds)    kvoffload     sglang   ratio (per round)")
        for case in CASES:
            calls = IDLE_SKIPS + 1 if case == "idle" else 1
            xs = _ratios(res, (case,))
            k, g = _median_us(res, "kvoffload", case, calls), _median_us(res, "sglang", case, calls)
            print(
                f"tp{size}: {case:<10} ({calls} call{'s' if calls > 1 else ''}){'':<14}"
                f"{k:>10.1f} {g:>10.1f}   {statistics.median(xs):.3f} ({spread(xs)})"
            )
        print(
            f"tp{size}: kvoffload on every rank: {res[0]['calls']} calls, {skipped} polls skipped "
            f"(nothing to agree on), {res[0]['compact']} decided by the 2-int64 exchange alone"
        )
        k, g = (statistics.median(x for r in res for x in r["prep"][side]) * 1e6 for side in SIDES)
        print(
            f"tp{size}: untimed, sending the 64 copies (µs, median, any rank): "
            f"kvoffload {k:.1f}, sglang {g:.1f}"
        )
    for label, cases in (("", BUSY), ("idle ", ("idle",))):
        for size in (2, 4):
            xs = _ratios(results["paired", size], cases)
            name = f"ratio kvoffload/sglang {label}tp{size}"
            print(target_line(name, statistics.median(xs), TARGET, at_most=True, xs=xs))
    for size in (2, 4):
        xs = _ratios(results["separate", size], BUSY)
        print(
            f"each side after its own preparation, tp{size}: {statistics.median(xs):.3f} "
            f"({spread(xs)}; no target)"
        )
    print(
        "ratio tpN: per round, each side's time over its in-flight and 64-ready calls (the slowest "
        "rank's per call), kvoffload's over SGLang's; the figure is the median of the per-round "
        "ratios. 'idle tpN': the same over one cycle of the skip schedule with nothing in flight. "
        "Both sides are prepared before either calls (the 64 copies sent, then finished), and "
        "each case's calls alternate, so every call comes after the same history. 'each side "
        "after its own preparation': the same calls where one side runs its whole round, then "
        "the other (this benchmark's former layout): there each call also carries what its own "
        "untimed preparation just did to the shared cores' scheduling (the 'untimed' lines: "
        "kvoffload's 64 extends, which hash and plan, against SGLang's 64 records; what an "
        "extend costs is bench_bookkeeping's and bench_core_sglang's to measure). "
        "gloo's ring all-reduce costs by the number of ring steps, which grows with the "
        "vector's length up to the group's size: SGLang's is 2 int32; kvoffload's 2 int64, then "
        f"{HEADER} + 2 * tp_window int64 only where a rank needs the full exchange."
    )


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:2]))
