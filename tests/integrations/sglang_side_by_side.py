"""kvoffload's SGLang drop-in side by side with SGLang 0.5.23's REAL
``DecodeKVCacheOffloadManager``, on the same scheduler script.

Each scenario runs twice, on two engines built the same way from SGLang's real
objects (``sglang_real``: ``ReqToTokenPool``, ``MHATokenToKVPool`` / ``MLATokenToKVPool``,
the paged or ``page_size=1`` allocator with ``SGLANG_DEBUG_MEMORY_POOL=1``, the tree
cache, ``Req``, ``release_req`` / ``restore_kv_cache``): once with SGLang's own manager,
built through its real ``__init__`` (published ``runtime_context``, a gloo TP group of
one, SGLang's ``build_kv_host_pool`` host pool, a real ``HiCacheController`` with a real
``HiCacheFile`` in a temporary directory; the CPU stand-ins of
``sglang_cpu_stand_ins``), once with kvoffload's
``kvoffload.integrations.sglang.DecodeKVCacheOffloadManager`` built by the same one-line
call. The same script drives both in SGLang's call order (``check_offload_progress()``
once per iteration, ``offload_kv_cache(req)`` per running request after its decode
step, at finish ``if not offload_kv_cache(req): finalize_release_on_finish(req)``,
``drain_before_retraction()`` before a retraction), and every KV byte an engine writes
is a function of the position and token (identical on both).

Recorded on each side: every free (``tree_cache.free_kv_row`` ranges, the allocator's
frees, ``tree_cache.unlock``, ``req_to_token_pool.free``: which request, the step, the
order) and what ends up stored (the keys, by SGLang's ``get_hash_str`` chain, and each
page's bytes, read back from the store and put in one canonical order: layer, K/V,
token). Then compared, and every difference named: the intended ones
(docs/integrations/sglang.md, "What differs, on purpose") by kind, anything else as
``unexpected:*`` - a bug in kvoffload (or in this driver).

Timing, made the same on both sides (and told, since it is a model of the device): on
this CPU SGLang's copy runs synchronously inside ``HiCacheController.write()`` (its CPU
stream and event do nothing), so its ack is in ``ack_write_queue`` when
``offload_kv_cache`` returns; kvoffload's copies run on ``SimBackend``, completed at the
same moment (right after each ``offload_kv_cache``). Storage writes run on each side's
own thread (SGLang's backup thread, kvoffload's writer); before each iteration the
driver waits, bounded, until both have finished what they were given, as a scheduler
loop slower than its store would see. ``backend="cpu"`` runs kvoffload's real copy
threads instead (frees then compared without their step).

``python tests/integrations/sglang_side_by_side.py`` (in .venv-sglang) runs every
scenario and prints the summary.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import random
import socket
import sys
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import sglang_cpu

sglang_cpu.install()

import sglang_cpu_stand_ins  # noqa: E402
import sglang_real as sr  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from sglang.srt import runtime_context  # noqa: E402
from sglang.srt.disaggregation.decode_kvcache_offload_manager import (  # noqa: E402
    DecodeKVCacheOffloadManager as SGLangManager,
)
from sglang.srt.managers.schedule_batch import FINISH_ABORT  # noqa: E402
from sglang.srt.mem_cache.utils import get_hash_str, storage_namespace_seed  # noqa: E402

from kvoffload.testing import SimBackend  # noqa: E402

sglang_cpu_stand_ins.install()

#: How long the driver waits for a thread to finish what it was given (a hang, never a
#: slow machine: no assertion depends on how fast it finishes).
HANG_S = 60.0
#: The served model name both sides' stores see (SGLang's file names carry it).
MODEL = "sbs-model"

SIDES = ("sglang", "kvoffload")
#: Builds extra keyword arguments for kvoffload's drop-in beyond SGLang's one line from
#: the engine (the driver's self-tests break kvoffload on purpose through them); None:
#: SGLang's one line exactly, as its scheduler builds its manager.
Extras = Callable[[Any], dict[str, Any]] | None
#: The engines' shape (sglang_real's defaults).
LAYERS, DTYPE = 2, torch.float16


class CopyAtSubmit(SimBackend):
    """kvoffload's simulated device, timed as SGLang's copy on this CPU: each copy runs
    when it is submitted (SGLang's runs inside ``HiCacheController.write()``), its
    completion delivered at the next ``check_offload_progress()``, as SGLang's ack is.
    Submits happen for committed tokens only, whose KV the engine wrote already, so a
    copy here reads what the engine wrote (the F19 concern does not arise)."""

    completes_on_its_own = True

    def submit(self, transfer: Any) -> None:
        super().submit(transfer)
        self.complete(transfer)


# --- the TP group ------------------------------------------------------------------------------


def tp_group() -> Any:
    """A gloo group of one rank on 127.0.0.1 (SGLang's ``dp_tp_cpu_group`` at TP 1)."""
    if not dist.is_initialized():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    global _GROUP
    if _GROUP is None:
        _GROUP = dist.new_group([0], backend="gloo")
    return _GROUP


_GROUP: Any = None


@contextlib.contextmanager
def rank_zero() -> Iterator[None]:
    """The launcher's rank bundle for world rank 0 at TP 1 (``publish(..., ranks=
    SpawnRanks(world_rank=0))`` writes these): ``HiCacheController`` reads ``tp_rank``
    for its storage config."""
    with runtime_context.get_parallel().override(
        tp_rank=0, pp_rank=0, attn_tp_rank=0, attn_dp_rank=0, attn_cp_rank=0, moe_ep_rank=0
    ):
        yield


# --- scenarios -----------------------------------------------------------------------------------


@dataclasses.dataclass
class ReqSpec:
    """One request of a scenario: ``label`` is unique in the scenario, ``rid`` may be
    reused (a new ``Req`` with an old rid)."""

    label: str
    rid: str
    prompt: list[int]
    max_new: int
    arrive: int
    extra_key: str | None = None
    cache_salt: str | None = None


@dataclasses.dataclass
class Scenario:
    """A scheduler script: engine shape, settings, requests and events by step.

    ``events[step]``: ``("abort", label)`` (``req.to_finish = FINISH_ABORT``: the
    request finishes at this step's decode, through the finish path), ``("abort_now",
    label)`` (the scheduler aborts it outside a decode step, ``finalize_release_on_finish``
    as ``_handle_sampling_mask_abort`` does), ``("retract", label)``
    (``drain_before_retraction()`` then ``release_req``), ``("resume", label)``.
    ``tokens_per_step``: tokens each request decodes per iteration (speculative
    decoding accepting several)."""

    name: str
    kv: str = "mha"
    page_size: int = 4
    stride: int | None = None  # tokens (SGLANG_HICACHE_DECODE_OFFLOAD_STRIDE); None: one page
    layout: str = "page_first"
    io: str = "kernel"
    hicache_ratio: float | None = None
    slots: int = 256
    rows: int = 16
    tokens_per_step: int = 1
    tree: str = "unified"
    decode_radix: bool = False
    tree_seed: list[list[int]] = dataclasses.field(default_factory=list)
    requests: list[ReqSpec] = dataclasses.field(default_factory=list)
    events: dict[int, list[tuple[str, str]]] = dataclasses.field(default_factory=dict)
    max_steps: int = 400


# --- what each side records ---------------------------------------------------------------


@dataclasses.dataclass
class Record:
    """What one side did: ``frees`` (step, op, request label, detail) in order,
    ``stored`` (key -> canonical page bytes), ``host_full`` (step, label) where the
    manager found no host pages, ``finished`` (label -> step it finished)."""

    side: str
    frees: list[tuple[int, str, str, Any]] = dataclasses.field(default_factory=list)
    stored: dict[str, bytes] = dataclasses.field(default_factory=dict)
    host_full: list[tuple[int, str]] = dataclasses.field(default_factory=list)
    finished: dict[str, int] = dataclasses.field(default_factory=dict)
    errors: list[str] = dataclasses.field(default_factory=list)
    returns: list[tuple[int, str, bool, bool]] = dataclasses.field(default_factory=list)
    host_pages: int = 0
    crashed: bool = False
    done: Counter[str] = dataclasses.field(default_factory=Counter)
    chains: dict[str, list[str]] = dataclasses.field(default_factory=dict)
    tokens: dict[str, list[int]] = dataclasses.field(default_factory=dict)


class _Spy:
    """Records the frees of one engine: wraps the real objects' methods on the
    instance (SGLang's own code still runs; only the call is written down)."""

    def __init__(self, eng: sr.Engine, record: Record, labels: Callable[[Any], str]) -> None:
        self.step = -1
        tree, alloc, rows = eng.tree_cache, eng.allocator, eng.req_to_token_pool

        def spy(obj: Any, name: str, describe: Callable[..., tuple[str, Any]]) -> None:
            real = getattr(obj, name)

            def call(*args: Any, **kw: Any) -> Any:
                label, detail = describe(*args, **kw)
                record.frees.append((self.step, name, label, detail))
                return real(*args, **kw)

            setattr(obj, name, call)

        def kv_label(kv: Any, ranges: Any) -> tuple[str, Any]:
            return labels(kv), [tuple(int(x) for x in r) for r in ranges]

        spy(tree, "free_kv_row", kv_label)
        spy(tree, "unlock", lambda lock: ("", None if lock is None else type(lock).__name__))
        spy(rows, "free", lambda req: (labels(req.kv), None))
        # The allocator: the outermost of its frees (free_segment calls free, or
        # free_page_ids), the slots it was given.
        depth = [0]
        for name in ("free", "free_segment", "free_page_ids"):
            real = getattr(alloc, name, None)
            if real is None:
                continue

            def call(*args: Any, __real: Any = real, __name: str = name, **kw: Any) -> Any:
                if depth[0] == 0:
                    idx = args[0] if args else next(iter(kw.values()))
                    slots = sorted(int(i) for i in idx.reshape(-1).tolist())
                    if __name == "free_page_ids":
                        ps = eng.page_size
                        slots = [p * ps + j for p in slots for j in range(ps)]
                    record.frees.append((self.step, "alloc." + __name, "", slots))
                depth[0] += 1
                try:
                    return __real(*args, **kw)
                finally:
                    depth[0] -= 1

            setattr(alloc, name, call)


# --- canonical pages ----------------------------------------------------------------------


def canonical_from_sglang_page(
    raw: bytes, layout: str, kv: str, ps: int, layers: int, dtype: torch.dtype
) -> bytes:
    """A page as SGLang's host pool lays it out (``get_data_page``: MHA ``page_first``
    is (K/V, token, layer, head, dim), ``layer_first`` (K/V, layer, token, head, dim);
    MLA ``page_first`` (token, layer, 1, dim), ``layer_first`` (layer, token, 1, dim)),
    put in the canonical order: layer, then K/V, then token (kvoffload's page)."""
    t = torch.frombuffer(bytearray(raw), dtype=dtype)
    if kv == "mha":
        if layout == "page_first":
            t = t.view(2, ps, layers, sr.HEADS, sr.HEAD_DIM).permute(2, 0, 1, 3, 4)
        elif layout == "layer_first":
            t = t.view(2, layers, ps, sr.HEADS, sr.HEAD_DIM).permute(1, 0, 2, 3, 4)
        else:
            raise ValueError(layout)
    else:
        width = sr.KV_LORA_RANK + sr.ROPE_DIM
        if layout == "page_first":
            t = t.view(ps, layers, 1, width).permute(1, 0, 2, 3)
        elif layout == "layer_first":
            t = t.view(layers, ps, 1, width)
        else:
            raise ValueError(layout)
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def read_store(root: Path, sc: Scenario, layers: int, dtype: torch.dtype) -> dict[str, bytes]:
    """Every page under ``root``, key -> canonical bytes: files in SGLang's format
    (``<key>_<suffix>.bin``, raw host pages in ``sc.layout``) and kvoffload's own records
    (read through kvoffload's ``FileStorage``; their payload is canonical already)."""
    out: dict[str, bytes] = {}
    kvo_keys = []
    for p in sorted(root.rglob("*")):
        if not p.is_file():
            continue
        if p.suffix == ".bin":
            key = p.name.split("_", 1)[0]
            out[key] = canonical_from_sglang_page(
                p.read_bytes(), sc.layout, sc.kv, sc.page_size, layers, dtype
            )
        elif len(p.name) == 64 and p.parent.name == p.name[:2]:
            kvo_keys.append(p.name)
    if kvo_keys:
        from kvoffload.storage.file import FileStorage

        pages = asyncio.run(FileStorage(root).get(kvo_keys))
        for key, page in zip(kvo_keys, pages, strict=True):
            assert page is not None, f"kvoffload record {key} unreadable"
            out[key] = bytes(page)
    return out


# --- one side, one run -------------------------------------------------------------------


class _Run:
    """One scenario on one side."""

    def __init__(self, sc: Scenario, side: str, root: Path, backend: str, extras: Extras = None) -> None:
        self.sc, self.side, self.root, self.backend_name = sc, side, root, backend
        self.extras = extras
        self.record = Record(side)
        self.reqs: dict[str, Any] = {}

    def label_of(self, kv: Any) -> str:
        for label, req in self.reqs.items():
            if req.kv is kv:
                return label
        return "?"

    # -- the managers --

    def build_manager(self, eng: sr.Engine) -> Any:
        group = tp_group()
        if self.side == "sglang":
            with rank_zero():
                mgr = SGLangManager(eng.req_to_token_pool, eng.allocator, group, eng.tree_cache)
            cc = mgr.cache_controller
            assert type(cc.storage_backend).__name__ == "HiCacheFile", cc.storage_backend
            assert Path(cc.storage_backend.file_path) == self.root, cc.storage_backend.file_path
            real_write = cc.write

            def write(*args: Any, **kw: Any) -> Any:
                out = real_write(*args, **kw)
                if out is None:
                    self.record.host_full.append((self.spy.step, self._current))
                return out

            cc.write = write
            hp = mgr.decode_host_mem_pool
            self.record.host_pages = int(hp.size) // int(hp.page_size)
            return mgr
        self.sim = CopyAtSubmit() if self.backend_name == "sim" else None
        backend: Any = self.sim if self.sim is not None else "cpu"
        mgr = eng.manager(group, backend=backend, **self.kvoffload_kw(eng))
        self.record.host_pages = int(mgr.manager.config.host_pages)
        return mgr

    def kvoffload_kw(self, eng: sr.Engine) -> dict[str, Any]:
        return self.extras(eng) if self.extras is not None else {}

    def settle(self, mgr: Any) -> None:
        """Wait (bounded) until the side's threads finished what they were given."""
        deadline = time.monotonic() + HANG_S
        if self.side == "sglang":
            cc = mgr.cache_controller

            def done() -> bool:
                return cc.backup_queue.empty() and cc.ack_backup_queue.qsize() >= len(mgr.ongoing_backup)
        else:
            core = mgr.manager
            writer = core._writer  # the storage writer thread (kvoffload's own)
            backend = core.backend

            def done() -> bool:  # copies launched (at the last poll) have finished
                copies = self.sim is not None or backend.inflight == len(backend._staged)
                return copies and (writer is None or writer.pending == 0)

        while not done():
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.side}: its threads never finished what they were given")
            time.sleep(0.001)

    # -- the script --

    def run(self) -> Record:
        sc = self.sc
        env = {
            "SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR": str(self.root),
            "SGLANG_HICACHE_DECODE_OFFLOAD_STRIDE": "" if sc.stride is None else str(sc.stride),
        }
        args: dict[str, Any] = {
            "hicache_storage_backend": "file",
            "hicache_mem_layout": sc.layout,
            "hicache_io_backend": sc.io,
            "served_model_name": MODEL,
        }
        if sc.hicache_ratio is not None:
            args["hicache_ratio"] = sc.hicache_ratio
        with (
            _env(env),
            sr.engine(
                page_size=sc.page_size,
                kv=sc.kv,
                slots=sc.slots,
                rows=sc.rows,
                tree=sc.tree,
                decode_radix=sc.decode_radix,
                **args,
            ) as eng,
        ):
            self.eng = eng
            for tokens in sc.tree_seed:
                eng.seed_tree(tokens)
            self.spy = _Spy(eng, self.record, self.label_of)
            mgr = self.build_manager(eng)
            try:
                self._drive(eng, mgr)
                self._close(mgr)
            except Exception as exc:
                if self.side == "sglang":
                    raise  # SGLang's own run is the reference: an error there is the driver's
                # kvoffload's side raised into the scheduler (or SGLang's debug allocator
                # caught what it freed): a difference, said where.
                self.record.errors.append(f"kvoffload, step {self.spy.step}: {_where(exc)}")
                self.record.crashed = True
                with contextlib.suppress(Exception):
                    mgr.release_host_resources()
                return self.record
            self.record.stored = read_store(self.root, sc, LAYERS, DTYPE)
            if sc.decode_radix:
                eng.evict()  # the tree's own pages (seeded, or inserted) back to the allocator
            leaked = eng.capacity - eng.free_count()
            if leaked:
                self.record.errors.append(f"{self.side}: {leaked} slots never came back to the allocator")
            try:
                eng.check_free_list()
            except AssertionError as exc:
                self.record.errors.append(f"{self.side}: {exc}")
        return self.record

    _current = ""

    def _offload(self, mgr: Any, req: Any) -> bool:
        self._current = self.label_of(req.kv)
        before = self._deferred(mgr)
        out = bool(mgr.offload_kv_cache(req))
        self.record.returns.append((self.spy.step, self._current, bool(req.finished()), out))
        if self._deferred(mgr) > before:
            self.record.host_full.append((self.spy.step, self._current))
        self._copied()
        return out

    def _deferred(self, mgr: Any) -> int:
        """kvoffload's count of chunks that waited for host pages (0 for SGLang, whose
        host-full answers are recorded at ``cache_controller.write``)."""
        return int(mgr.statistics().chunks_deferred) if self.side == "kvoffload" else 0

    def _copied(self) -> None:
        """After each manager call: no copy of kvoffload's is left pending (each ran at
        its submit, :class:`CopyAtSubmit`)."""
        if self.side == "kvoffload" and self.sim is not None:
            assert not self.sim.pending, self.sim.pending

    def _drive(self, eng: sr.Engine, mgr: Any) -> None:
        sc = self.sc
        running: list[str] = []
        retracted: set[str] = set()
        pending = sorted(sc.requests, key=lambda r: r.arrive)
        rec = self.record
        for step in range(sc.max_steps):
            self.spy.step = step
            self.settle(mgr)
            mgr.check_offload_progress()
            self._copied()
            for spec in [r for r in pending if r.arrive == step]:
                req = eng.new_req(
                    spec.rid, spec.prompt, spec.max_new, extra_key=spec.extra_key, cache_salt=spec.cache_salt
                )
                self.reqs[spec.label] = req
                eng.admit(req)
                running.append(spec.label)
            for op, label in sc.events.get(step, []):
                req = self.reqs.get(label)
                if req is None or label in rec.finished:
                    continue
                rec.done[op] += 1
                if op == "abort":
                    req.to_finish = FINISH_ABORT("aborted by the script")
                elif op == "abort_now" and label in running:
                    req.to_finish = FINISH_ABORT("aborted by the script")
                    req.update_finish_state()
                    self._current = label
                    mgr.finalize_release_on_finish(req)
                    self._copied()
                    running.remove(label)
                    rec.finished[label] = step
                elif op == "retract" and label in running:
                    mgr.drain_before_retraction()
                    self._copied()
                    assert eng.retract(req), f"{label}: retraction backup not saved"
                    running.remove(label)
                    retracted.add(label)
                elif op == "resume" and label in retracted:
                    eng.resume(req)
                    retracted.discard(label)
                    running.append(label)
            batch = [lab for lab in running if not self.reqs[lab].finished()]
            for label in batch:
                req = self.reqs[label]
                for _ in range(sc.tokens_per_step):
                    eng.decode_step(req)
                    if req.finished():
                        break
            for label in batch:
                req = self.reqs[label]
                if not req.finished():
                    self._offload(mgr, req)
                else:
                    if not self._offload(mgr, req):
                        self._current = label
                        mgr.finalize_release_on_finish(req)
                        self._copied()
                    rec.finished[label] = step
                    running.remove(label)
            if (
                not running
                and not retracted
                and all(r.arrive <= step for r in pending)
                and not self._busy(mgr)
            ):
                break
        for label, req in self.reqs.items():
            tokens = (
                [*req.origin_input_ids, *req.output_ids[:-1]]
                if req.output_ids
                else list(req.origin_input_ids)
            )
            rec.tokens[label] = tokens
            rec.chains[label] = chain_keys(tokens, sc.page_size, req.extra_key, req.cache_salt)

    def _busy(self, mgr: Any) -> bool:
        if self.side == "sglang":
            return bool(mgr.ongoing_offload or mgr.ongoing_backup)
        return len(mgr.ongoing_offload) > 0

    def _close(self, mgr: Any) -> None:
        """Idle iterations until nothing is pending, then SGLang's shutdown."""
        deadline = time.monotonic() + HANG_S
        step = self.spy.step
        while self._busy(mgr) and time.monotonic() < deadline:
            step += 1
            self.spy.step = step
            self.settle(mgr)
            mgr.check_offload_progress()
            self._copied()
        if self._busy(mgr):
            self.record.errors.append(f"{self.side}: work still pending at the end")
        if self.side == "sglang":
            mgr.cache_controller.detach_storage_backend()  # stops its backup/prefetch threads
        mgr.release_host_resources()


def _where(exc: BaseException) -> str:
    """``exc`` and where it was raised: the innermost frame in SGLang or kvoffload."""
    import traceback

    frames = [
        f
        for f in traceback.extract_tb(exc.__traceback__)
        if "/sglang/" in f.filename or "/kvoffload/" in f.filename
    ]
    at = f" in {Path(frames[-1].filename).name}:{frames[-1].name}" if frames else ""
    return f"{type(exc).__name__}: {exc}{at}"


@contextlib.contextmanager
def _env(values: dict[str, str]) -> Iterator[None]:
    old = {k: os.environ.get(k) for k in values}
    for k, v in values.items():
        if v:
            os.environ[k] = v
        else:
            os.environ.pop(k, None)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def chain_keys(tokens: list[int], ps: int, extra_key: str | None, cache_salt: str | None) -> list[str]:
    """SGLang's page keys of ``tokens`` (``get_hash_str`` chained from
    ``storage_namespace_seed``, as its manager's ``_compute_prefix_hash``)."""
    keys, prior = [], storage_namespace_seed(extra_key, cache_salt)
    for p in range(len(tokens) // ps):
        prior = get_hash_str(tokens[p * ps : (p + 1) * ps], prior)
        keys.append(prior)
    return keys


# --- comparison ----------------------------------------------------------------------------


@dataclasses.dataclass
class Outcome:
    """The comparison of one scenario: counts and the differences, by kind."""

    scenario: str
    events: Counter[str] = dataclasses.field(default_factory=Counter)
    frees_compared: int = 0
    keys_compared: int = 0
    bytes_compared: int = 0
    differences: Counter[str] = dataclasses.field(default_factory=Counter)
    details: list[str] = dataclasses.field(default_factory=list)
    host_pages: tuple[int, int] = (0, 0)

    @property
    def unexpected(self) -> list[str]:
        return [d for d in self.details if d.startswith("unexpected:")]

    def note(self, kind: str, text: str) -> None:
        self.differences[kind] += 1
        if len(self.details) < 200:
            self.details.append(f"{kind}: {text}")


def expected_pages(sc: Scenario, rec: Record) -> dict[str, tuple[str, int]]:
    """key -> (request label, page index) over every request's full chain."""
    out: dict[str, tuple[str, int]] = {}
    for label, keys in rec.chains.items():
        for i, k in enumerate(keys):
            out.setdefault(k, (label, i))
    return out


def compare(
    sc: Scenario, sgl: Record, kvo: Record, truth: Callable[[str, int], bytes], with_steps: bool = True
) -> Outcome:
    """Compare the two records of ``sc`` (see the module docstring); ``with_steps``:
    the step of each free too (not with kvoffload's real copy threads, whose copies
    start at the next poll and so end an iteration later than SGLang's)."""
    out = Outcome(sc.name)
    out.events = Counter(sgl.done)
    out.events["requests"] = len(sc.requests)
    out.events["reused rids"] = len(sc.requests) - len({r.rid for r in sc.requests})
    out.events["host full (SGLang)"] = len(sgl.host_full)
    for rec in (sgl, kvo):
        for e in rec.errors:
            out.note("unexpected:error", e)
    pages = expected_pages(sc, sgl)
    ps = sc.page_size
    prompt_pages = {s.label: len(s.prompt) // ps for s in sc.requests}
    # --- what is stored
    delayed: set[str] = set()  # requests whose release kvoffload delays on purpose
    host_full = {lab for _, lab in sgl.host_full}
    # From SGLang's first "Not enough host memory" on, kvoffload's deferred chunks (it
    # waits; SGLang drops and retries) hold host pages SGLang's run did not: every
    # request's chunks and releases after that may come later, by that difference.
    # kvoffload's pool can fill where SGLang's did not: it holds the tails it flushed
    # and the chunks it deferred, pages SGLang's run never held. That is the intended
    # difference only when its pool is as large as SGLang's.
    host_bound_from = min((st for st, _ in sgl.host_full + kvo.host_full), default=None)
    if kvo.host_full and kvo.host_pages < sgl.host_pages:
        out.note(
            "unexpected:host_pool_smaller",
            f"kvoffload's host pool ({kvo.host_pages} pages) is smaller than SGLang's ({sgl.host_pages}) "
            f"and filled at step {min(st for st, _ in kvo.host_full)}",
        )
    # (The host pools' sizes are compared by test_host_pool_holds_as_many_pages_as_sglangs
    # and in the summary; here a full pool shows in what each side did.)
    out.host_pages = (sgl.host_pages, kvo.host_pages)
    last_sgl_page: dict[str, int] = defaultdict(lambda: -1)
    for key in sgl.stored:
        if key in pages:
            lab, i = pages[key]
            last_sgl_page[lab] = max(last_sgl_page[lab], i)
    for key in sorted(set(sgl.stored) | set(kvo.stored)):
        where = pages.get(key)
        name = f"{key[:12]} ({f'{where[0]} page {where[1]}' if where else 'in no request chain'})"
        a, b = sgl.stored.get(key), kvo.stored.get(key)
        if a is not None and b is not None:
            out.keys_compared += 1
            out.bytes_compared += len(a)
            if a != b:
                out.note("unexpected:bytes_differ", f"{name}: SGLang's and kvoffload's pages differ")
            elif where is not None and a != truth(*where):
                out.note(
                    "unexpected:bytes_wrong_on_both", f"{name}: both stored bytes the engine never wrote"
                )
            continue
        if where is None:
            side = "sglang" if a is not None else "kvoffload"
            kind = "keys_fixed_at_submit" if side == "sglang" else "unexpected:key_in_no_chain"
            out.note(kind, f"{name}: stored only by {side}")
            continue
        lab, i = where
        data = a if a is not None else b
        assert data is not None
        if data != truth(lab, i):
            out.note(
                "unexpected:bytes_wrong", f"{name}: stored by one side with bytes the engine never wrote"
            )
        if b is not None:  # only kvoffload stored it
            if lab in host_full or (host_bound_from is not None and lab not in sgl.finished):
                out.note("host_full_waits", f"{name}: SGLang found its host pool full and never stored it")
                delayed.add(lab)
            elif i > last_sgl_page[lab] and i >= prompt_pages[lab] and lab in sgl.finished:
                out.note("tail_flushed_at_finish", f"{name}: the page-aligned tail, flushed at finish")
                delayed.add(lab)
            else:
                out.note("unexpected:only_kvoffload_stored", f"{name}: stored by kvoffload only")
        else:
            out.note("unexpected:only_sglang_stored", f"{name}: stored by SGLang only (kvoffload lost it)")
    # --- what offload_kv_cache returned (the scheduler acts on it)
    compare_returns(sgl, kvo, host_bound_from, out)
    # --- the frees
    compare_frees(sgl, kvo, delayed, out, with_steps=with_steps, host_bound_from=host_bound_from)
    return out


def compare_returns(sgl: Record, kvo: Record, host_bound_from: int | None, out: Outcome) -> None:
    """``offload_kv_cache``'s answers. Before finish both say whether a chunk went out;
    at finish SGLang says whether a chunk went out now, kvoffload whether the release
    is deferred (docs: "At finish ... True when the release is deferred"): there they
    may differ, by name."""
    ra = {(st, lab, fin): v for st, lab, fin, v in sgl.returns}
    rb = {(st, lab, fin): v for st, lab, fin, v in kvo.returns}
    for k in sorted(set(ra) | set(rb)):
        va, vb = ra.get(k), rb.get(k)
        if va == vb:
            continue
        step, label, fin = k
        if host_bound_from is not None and step >= host_bound_from:
            out.note("host_full_waits", f"{label} step {step}: offload_kv_cache SGLang {va}, kvoffload {vb}")
        elif va is None or vb is None:
            out.note("unexpected:offload_call_missing", f"{label} step {step}: SGLang {va}, kvoffload {vb}")
        elif fin:
            out.note("finish_returns_release_deferred", f"{label} step {step}: SGLang {va}, kvoffload {vb}")
        elif va and not vb and (step - 1, label, False) not in ra:
            # An arrival's first call (admission, or resume after a retraction): kvoffload
            # tells its tokens at the next check_offload_progress, in one read of the
            # arrivals' page ids, so nothing went out yet; the copy starts at that poll
            # either way. SGLang's scheduler ignores the value before finish
            # (batch_result_processor.py: `offload_kv_cache(req)` for unfinished reqs).
            out.note("arrival_told_at_next_poll", f"{label} step {step}: SGLang {va}, kvoffload {vb}")
        else:
            out.note("unexpected:offload_returns_differ", f"{label} step {step}: SGLang {va}, kvoffload {vb}")


def _free_key(e: tuple[int, str, str, Any], with_step: bool, with_slots: bool) -> tuple[Any, ...]:
    step, op, label, detail = e
    if op.startswith("alloc.") and not with_slots:
        detail = len(detail) if isinstance(detail, list) else detail
    return (step if with_step else None, op, label, json.dumps(detail))


def compare_frees(
    sgl: Record,
    kvo: Record,
    delayed: set[str],
    out: Outcome,
    with_steps: bool,
    host_bound_from: int | None = None,
) -> None:
    """The frees, in order. A request kvoffload releases later on purpose (a tail it
    flushed, a chunk it deferred) is compared without its step, and once any release
    moved, the allocator's slot ids are no longer compared (later allocations differ)."""
    a, b = sgl.frees, kvo.frees
    out.frees_compared += max(len(a), len(b))
    ka = [_free_key(e, with_steps, True) for e in a]
    kb = [_free_key(e, with_steps, True) for e in b]
    if ka == kb:
        return
    if delayed or not with_steps or host_bound_from is not None:
        # Per request: the same frees (op, ranges), kvoffload's never earlier.
        by_a: dict[str, list[tuple[int, str, Any]]] = defaultdict(list)
        by_b: dict[str, list[tuple[int, str, Any]]] = defaultdict(list)
        for step, op, label, detail in a:
            if label:
                by_a[label].append((step, op, detail))
        for step, op, label, detail in b:
            if label:
                by_b[label].append((step, op, detail))
        for label in sorted(set(by_a) | set(by_b)):
            xa, xb = by_a.get(label, []), by_b.get(label, [])
            if [(o, d) for _, o, d in xa] != [(o, d) for _, o, d in xb]:
                out.note("unexpected:frees_differ", f"{label}: SGLang {xa} kvoffload {xb}")
                continue
            steps_a, steps_b = [s for s, _, _ in xa], [s for s, _, _ in xb]
            if steps_a != steps_b:
                moved = [(sa, sb) for sa, sb in zip(steps_a, steps_b, strict=True) if sa != sb]
                later = all(sb > sa for sa, sb in moved)
                if later and host_bound_from is not None and all(sa >= host_bound_from for sa, _ in moved):
                    out.note("host_full_waits", f"{label}: freed at {steps_b}, SGLang at {steps_a}")
                elif later and label in delayed:
                    out.note(
                        "release_waits_for_its_last_copy", f"{label}: freed at {steps_b}, SGLang at {steps_a}"
                    )
                elif later and not with_steps:
                    out.note("copies_start_at_next_poll", f"{label}: freed at {steps_b}, SGLang at {steps_a}")
                elif with_steps:
                    out.note(
                        "unexpected:free_step_differs", f"{label}: freed at {steps_b}, SGLang at {steps_a}"
                    )
        na = Counter(len(d) for _, op, _, d in a if op.startswith("alloc."))
        nb = Counter(len(d) for _, op, _, d in b if op.startswith("alloc."))
        if sum(k * v for k, v in na.items()) != sum(k * v for k, v in nb.items()):
            out.note("unexpected:slots_freed_differ", f"SGLang freed {na}, kvoffload {nb}")
        return
    # No intended delay: the first place the two orders part.
    for i, (x, y) in enumerate(zip(ka, kb, strict=False)):
        if x != y:
            out.note("unexpected:frees_differ", f"free #{i}: SGLang {a[i]} kvoffload {b[i]}")
            return
    out.note(
        "unexpected:frees_differ",
        f"SGLang made {len(a)} frees, kvoffload {len(b)}; first extra: {(a + b)[min(len(a), len(b))]}",
    )


def run_scenario(
    sc: Scenario, backend: str = "sim", extras: Extras = None
) -> tuple[Outcome, dict[str, Record]]:
    """Run ``sc`` on both sides and compare (``extras``: see :data:`Extras`)."""
    records: dict[str, Record] = {}
    with tempfile.TemporaryDirectory(prefix="sbs-") as tmp:
        for side in SIDES:
            root = Path(tmp) / side
            root.mkdir()
            records[side] = _Run(sc, side, root, backend, extras).run()
    sgl, kvo = records["sglang"], records["kvoffload"]
    if kvo.crashed:  # kvoffload's run stopped at its error: that error is the difference
        out = Outcome(sc.name)
        for e in kvo.errors:
            out.note("unexpected:error", e)
        return out, records
    assert sgl.tokens == kvo.tokens, "the two engines decoded different tokens: the script is not the same"

    def truth(label: str, page: int) -> bytes:
        return truth_page(sc, sgl.tokens[label], page)

    return compare(sc, sgl, kvo, truth, with_steps=backend == "sim"), records


def truth_page(sc: Scenario, tokens: list[int], page: int) -> bytes:
    """The bytes the engine wrote for page ``page`` of a request with ``tokens``
    (``sglang_real.kv_value`` of each position's token), in the canonical order."""
    ps = sc.page_size
    heads, dim = (sr.HEADS, sr.HEAD_DIM) if sc.kv == "mha" else (1, sr.KV_LORA_RANK + sr.ROPE_DIM)
    parts = []
    for layer in range(LAYERS):
        for which in (0, 1) if sc.kv == "mha" else (0,):
            rows = [
                sr.kv_value(p, int(tokens[p]), layer, which, heads * dim).view(heads, dim).to(DTYPE)
                for p in range(page * ps, (page + 1) * ps)
            ]
            parts.append(torch.stack(rows).contiguous().view(torch.uint8).numpy().tobytes())
    return b"".join(parts)


# --- the scenarios ----------------------------------------------------------------------------


def _prompt(rng: random.Random | None, n: int, base: int) -> list[int]:
    return [base + i for i in range(n)] if rng is None else [rng.randrange(1, 30000) for _ in range(n)]


def fixed_scenarios() -> list[Scenario]:
    """The scripted scenarios: each names what it exercises."""
    R = ReqSpec
    out = [
        Scenario(
            "mha-ps4-stride1page",
            requests=[
                R("a", "a", _prompt(None, 10, 0), 14, 0),
                R("b", "b", _prompt(None, 8, 100), 9, 2),
                R("c", "c", _prompt(None, 3, 200), 11, 3),
            ],
        ),
        Scenario(
            "mla-ps4-stride1page",
            kv="mla",
            requests=[R("a", "a", _prompt(None, 10, 0), 14, 0), R("b", "b", _prompt(None, 8, 100), 9, 2)],
        ),
        Scenario(
            "mha-ps4-stride3pages-tail",
            stride=12,
            requests=[
                R("a", "a", _prompt(None, 9, 0), 30, 0),
                R("b", "b", _prompt(None, 4, 100), 7, 1),
                R("c", "c", _prompt(None, 16, 200), 13, 1),
            ],
        ),
        Scenario(
            "mla-ps2-stride2pages-tail",
            kv="mla",
            page_size=2,
            stride=4,
            requests=[R("a", "a", _prompt(None, 5, 0), 12, 0), R("b", "b", _prompt(None, 6, 100), 9, 1)],
        ),
        Scenario(
            "mha-ps1-stride1",
            page_size=1,
            requests=[R("a", "a", _prompt(None, 5, 0), 9, 0), R("b", "b", _prompt(None, 3, 100), 6, 2)],
        ),
        Scenario(
            "mla-ps1-stride4-tail",
            kv="mla",
            page_size=1,
            stride=4,
            requests=[R("a", "a", _prompt(None, 5, 0), 10, 0), R("b", "b", _prompt(None, 2, 100), 7, 1)],
        ),
        Scenario(
            "reused-rid-mid-copy",
            # "x" finishes at step 5 while its last chunk is un-acked; a new Req with the
            # same rid (same prompt: same keys) arrives in the next step.
            requests=[
                R("x1", "x", _prompt(None, 8, 0), 5, 0),
                R("x2", "x", _prompt(None, 8, 0), 9, 5),
                R("y", "y", _prompt(None, 4, 50), 12, 0),
            ],
        ),
        Scenario(
            "abort-mid-copy",
            requests=[
                R("a", "a", _prompt(None, 8, 0), 40, 0),
                R("b", "b", _prompt(None, 6, 100), 40, 0),
                R("c", "c", _prompt(None, 3, 200), 40, 0),
            ],
            # a: aborted by the scheduler at a step its chunk goes out; b: aborted outside
            # a decode step (finalize_release_on_finish) with a copy un-acked; c later.
            events={4: [("abort", "a")], 6: [("abort_now", "b")], 9: [("abort", "c")]},
        ),
        Scenario(
            "abort-mid-copy-stride2",
            stride=8,
            requests=[R("a", "a", _prompt(None, 8, 0), 40, 0), R("b", "b", _prompt(None, 6, 100), 40, 0)],
            events={7: [("abort", "a")], 10: [("abort_now", "b")]},
        ),
        Scenario(
            "retract-resume",
            requests=[R("a", "a", _prompt(None, 10, 0), 20, 0), R("b", "b", _prompt(None, 7, 100), 20, 0)],
            events={5: [("retract", "a")], 8: [("resume", "a"), ("retract", "b")], 11: [("resume", "b")]},
        ),
        Scenario(
            "retract-resume-mla-ps1",
            kv="mla",
            page_size=1,
            stride=3,
            requests=[R("a", "a", _prompt(None, 4, 0), 16, 0), R("b", "b", _prompt(None, 5, 100), 12, 1)],
            events={4: [("retract", "a")], 6: [("resume", "a")], 7: [("retract", "b")], 9: [("resume", "b")]},
        ),
        Scenario(
            "multi-token-steps",
            tokens_per_step=3,
            requests=[R("a", "a", _prompt(None, 10, 0), 25, 0), R("b", "b", _prompt(None, 5, 100), 13, 1)],
        ),
        Scenario(
            "multi-token-stride2-tail",
            tokens_per_step=5,
            stride=8,
            requests=[R("a", "a", _prompt(None, 7, 0), 27, 0), R("b", "b", _prompt(None, 12, 100), 14, 0)],
        ),
        Scenario(
            "host-pool-full",
            # 160 device slots, ratio 0.1: a host pool of 4 pages (16 slots, SGLang's padding page included).
            slots=160,
            hicache_ratio=0.1,
            tokens_per_step=4,
            requests=[R(f"r{i}", f"r{i}", _prompt(None, 4 + i, 100 * i), 16, i // 3) for i in range(6)],
        ),
        Scenario(
            "namespaces-extra-key-salt",
            requests=[
                R("a", "a", _prompt(None, 8, 0), 9, 0, extra_key="lora-7"),
                R("b", "b", _prompt(None, 8, 0), 9, 0, cache_salt="salt"),
                R("c", "c", _prompt(None, 8, 0), 9, 1),
            ],
        ),
        Scenario(
            "layer-first-direct",
            layout="layer_first",
            io="direct",
            requests=[R("a", "a", _prompt(None, 10, 0), 14, 0), R("b", "b", _prompt(None, 8, 100), 9, 2)],
        ),
        Scenario(
            "mla-layer-first-kernel",
            kv="mla",
            layout="layer_first",
            requests=[R("a", "a", _prompt(None, 10, 0), 14, 0)],
        ),
        Scenario(
            "decode-radix-prefix",
            # The decode radix cache on, a prefix of 8 tokens in the tree: the release
            # frees from cache_protected_len; the tree's pages stay the tree's.
            decode_radix=True,
            tree_seed=[_prompt(None, 8, 0)],
            requests=[R("a", "a", _prompt(None, 11, 0), 10, 0), R("b", "b", _prompt(None, 9, 0), 8, 1)],
        ),
    ]
    return out


def random_scenario(seed: int) -> Scenario:
    """A seeded random scenario: its shape, requests (rids drawn from a small set, so
    reused; prompts sharing prefixes) and events."""
    rng = random.Random(seed)
    kv = rng.choice(["mha", "mla"])
    ps = rng.choice([1, 2, 4])
    stride = rng.choice([None, ps, 2 * ps, 3 * ps])
    tps = rng.choice([1, 1, 2, 3])
    ratio = rng.choice([None, None, 0.01, 0.02, 0.05])  # of 1024 device slots
    n = rng.randrange(2, 13)
    base = _prompt(rng, 24, 0)
    reqs = []
    for i in range(n):
        plen = rng.randrange(1, 24)
        prompt = base[:plen] if rng.random() < 0.3 else _prompt(rng, plen, 0)
        reqs.append(
            ReqSpec(f"q{i}", f"rid{rng.randrange(3)}", prompt, rng.randrange(1, 40), rng.randrange(0, 12))
        )
    events: dict[int, list[tuple[str, str]]] = defaultdict(list)
    for r in reqs:
        roll = rng.random()
        at = r.arrive + rng.randrange(1, 12)
        if roll < 0.15:
            events[at].append(("abort", r.label))
        elif roll < 0.25:
            events[at].append(("abort_now", r.label))
        elif roll < 0.45:
            events[at].append(("retract", r.label))
            events[at + rng.randrange(1, 6)].append(("resume", r.label))
    return Scenario(
        f"random-{seed}",
        kv=kv,
        page_size=ps,
        stride=stride,
        tokens_per_step=tps,
        hicache_ratio=ratio,
        slots=1024,
        rows=16,
        requests=reqs,
        events=dict(events),
    )


# --- the summary -------------------------------------------------------------------------------


def summary(outcomes: list[Outcome]) -> str:
    """The side-by-side summary (pasted in the closing note)."""
    kinds: Counter[str] = Counter()
    events: Counter[str] = Counter()
    for o in outcomes:
        kinds.update(o.differences)
        events.update(o.events)
    n_random = sum(1 for o in outcomes if o.scenario.startswith("random-"))
    n_cpu = sum(1 for o in outcomes if o.scenario.endswith("@cpu"))
    lines = [
        "kvoffload's SGLang drop-in side by side with SGLang 0.5.23's real DecodeKVCacheOffloadManager",
        f"  scenarios run:   {len(outcomes)} "
        f"({n_random} seeded random, {n_cpu} on kvoffload's real copy threads)",
        "  exercised:       " + ", ".join(f"{k} {v}" for k, v in sorted(events.items())),
        f"  frees compared:  {sum(o.frees_compared for o in outcomes)} "
        "(free_kv_row ranges, allocator slots, unlock, row frees: order and step)",
        f"  keys compared:   {sum(o.keys_compared for o in outcomes)} "
        "(stored by both, SGLang's get_hash_str chain)",
        f"  bytes compared:  {sum(o.bytes_compared for o in outcomes)} "
        "(page bytes both stored, and against the engine's KV)",
        "  differences by kind:" + ("" if kinds else " none"),
    ]
    for kind, n in sorted(kinds.items()):
        lines.append(f"    {kind}: {n}")
    sized = [o for o in outcomes if o.host_pages[0] != o.host_pages[1]]
    lines.append(
        f"  host pool pages (SGLang, kvoffload): differ in {len(sized)} of {len(outcomes)} scenarios"
        + (f", e.g. {sized[0].scenario}: {sized[0].host_pages}" if sized else "")
    )
    bad = [(o.scenario, d) for o in outcomes for d in o.unexpected]
    lines.append(f"  unexpected differences: {len(bad)}")
    for name, d in bad[:40]:
        lines.append(f"    [{name}] {d}")
    lines.append(
        "  CPU stand-ins on SGLang's side: " + "; ".join(w for w, _ in sglang_cpu_stand_ins.STAND_INS)
    )
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    """``python tests/integrations/sglang_side_by_side.py [SEEDS]``: every scripted
    scenario, SEEDS (default 40) seeded random ones, and the scripted ones again on
    kvoffload's real copy threads; prints the summary; exit status 1 on an unexpected
    difference."""
    seeds = int(argv[1]) if len(argv) > 1 else 40
    runs = [(sc, "sim") for sc in [*fixed_scenarios(), *(random_scenario(s) for s in range(seeds))]]
    runs += [(dataclasses.replace(sc, name=sc.name + "@cpu"), "cpu") for sc in fixed_scenarios()]
    outcomes = []
    for sc, backend in runs:
        outcome, _ = run_scenario(sc, backend=backend)
        outcomes.append(outcome)
        print(f"{sc.name}: {dict(outcome.differences) or 'same'}", file=sys.stderr, flush=True)
    print(summary(outcomes))
    return 1 if any(o.unexpected for o in outcomes) else 0


if __name__ == "__main__":
    import logging

    logging.disable(logging.WARNING)
    sys.exit(main(sys.argv))
