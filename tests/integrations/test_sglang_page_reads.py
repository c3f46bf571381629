"""How often the SGLang drop-in reads SGLang's ``req_to_token`` rows on the host.

On a GPU, ``req_to_token`` lives on the device and every host read of it (``tolist()``,
``item()``, ``int()``, ``cpu()``, ...) is a device sync. SGLang's own manager hands the
row slice to its copy as a device tensor and never reads it on the host. kvoffload's
bookkeeping needs the page ids as ints, so it reads them - at most twice per scheduler
iteration (between two ``check_offload_progress()`` calls), however many requests enter a
page: once for the pages the running requests enter, at the first call that needs one,
and once for the iteration's arrivals, at the next ``check_offload_progress()`` before it
delivers (an arrival's first call comes after the running requests' read; its copy starts
at that poll either way, as early as SGLang's) (issue 20, point 5).

The rows here are a CPU tensor wrapped in a counting subclass (the same storage, so the
engine's writes land in it); every tensor derived from it (views, gathers, concatenations)
counts too. Only reads made inside the manager's scheduler-facing calls are counted, and
not those of SGLang's release path (``free_kv_row`` reads the row itself: SGLang's code,
not the integration's). A logic test: nothing here is timed.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from typing import Any

import pytest
import torch
from sglang_fakes import Engine, Req, expected_page

import kvoffload as kvo
from kvoffload.integrations.sglang import DecodeKVCacheOffloadManager
from kvoffload.keys import page_run_keys, validate_tokens
from kvoffload.storage.memory import MemoryStorage
from kvoffload.testing import SimBackend

PS = 4


class Reads:
    """Host reads of the counted rows, while ``active`` (the name of the manager's call
    being counted, or False); ``log`` names each read as ``"<call>:<op>"``."""

    def __init__(self) -> None:
        self.active: str | bool = False
        self.log: list[str] = []

    def note(self, op: str) -> None:
        self.log.append(f"{self.active}:{op}")

    def ok(self) -> bool:
        """At most one read where the pages running requests enter are read (the
        iteration's ``offload_kv_cache`` calls, or a drain / finalize before them) and at
        most one at ``check_offload_progress`` (the iteration's arrivals, told in one
        read before the poll delivers)."""
        at_poll = sum(x.startswith("check_offload_progress:") for x in self.log)
        return at_poll <= 1 and len(self.log) - at_poll <= 1


_READS = Reads()
# Tensor methods that move a tensor's values to the host (a device sync on a GPU).
_HOST_READS = {
    torch.Tensor.tolist,
    torch.Tensor.item,
    torch.Tensor.cpu,
    torch.Tensor.numpy,
    torch.Tensor.__int__,
    torch.Tensor.__index__,
    torch.Tensor.__float__,
    torch.Tensor.__bool__,
    torch.Tensor.__repr__,
    torch.Tensor.__format__,
}


class CountedRows(torch.Tensor):
    """``req_to_token`` that counts its host reads (``_READS``)."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if _READS.active:
            name = getattr(func, "__name__", str(func))
            if func in _HOST_READS:
                _READS.note(name)
            elif name == "to" and any(_is_cpu(a) for a in (*args[1:], *(kwargs or {}).values())):
                _READS.note("to(cpu)")
        return super().__torch_function__(func, types, args, kwargs or {})


def _is_cpu(x: Any) -> bool:
    return (isinstance(x, str) and x.startswith("cpu")) or (isinstance(x, torch.device) and x.type == "cpu")


def counted(engine: Engine) -> None:
    """Wrap the engine's rows in the counting subclass (same storage, same values)."""
    engine.r2t.req_to_token = engine.r2t.req_to_token.as_subclass(CountedRows)


def instrument(mgr: DecodeKVCacheOffloadManager) -> None:
    """Count during the scheduler-facing calls only; SGLang's release path (the
    ``release=`` hook) pauses the count."""

    def during(call: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(*args: Any) -> Any:
            outer, _READS.active = _READS.active, call.__name__
            try:
                return call(*args)
            finally:
                _READS.active = outer

        return wrapped

    for name in (
        "offload_kv_cache",
        "check_offload_progress",
        "finalize_release_on_finish",
        "drain_before_retraction",
    ):
        setattr(mgr, name, during(getattr(mgr, name)))
    release = mgr._release_req

    def sglang_release(req: Any) -> object:
        outer, _READS.active = _READS.active, False
        try:
            return release(req)
        finally:
            _READS.active = outer

    mgr._release_req = sglang_release


class SGLangOrderEngine(Engine):
    """SGLang's own order inside one iteration (batch_result_processor.py,
    ``process_batch_result_decode``): the forward pass writes every request's KV and
    advances ``kv_committed_len`` (``prepare_for_decode`` did, before the forward); then,
    request by request, the sampled token is appended and that request's
    ``offload_kv_cache`` runs - so when the first call needs a page id, the requests
    after it have not been told their new token yet."""

    def forward(self) -> None:
        self._sampled: dict[int, int] = {}
        for req in self.running:
            pos = len(req.origin_input_ids) + len(req.output_ids) - 1
            self._grow(req, pos + 2)
            self._write(req, pos)
            req.kv.kv_committed_len = pos + 1
            self._sampled[id(req)] = next(self._next_token)

    def process_results(self) -> list[Req]:
        mgr = self.mgr
        assert mgr is not None
        done = []
        for req in self.running:
            req.output_ids.append(self._sampled[id(req)])
            if len(req.output_ids) >= req.max_new:
                req.finished_reason = "length"
            if not req.finished():
                mgr.offload_kv_cache(req)
            else:
                if not mgr.offload_kv_cache(req):
                    mgr.finalize_release_on_finish(req)
                done.append(req)
        self.running = [r for r in self.running if not r.finished()]
        return done


ORDERS = {"sglang-order": SGLangOrderEngine, "tokens-first": Engine}


def ref_keys(req: Req) -> list[str]:
    tokens = req.origin_input_ids + req.output_ids[:-1]
    whole = len(tokens) - len(tokens) % PS
    seed = kvo.namespace_seed(req.extra_key, req.cache_salt)
    return page_run_keys(seed, validate_tokens(tokens[:whole]), PS)


def check_every_page_stored(
    mgr: DecodeKVCacheOffloadManager, engine: Engine, storage: MemoryStorage, reqs: list[Req]
) -> None:
    """Every decode page of every request is in storage with the engine's bytes (the
    page ids kvoffload read in its batched reads are the row's own), and everything the
    engine handed out came back."""
    mgr.drain_before_retraction()
    while mgr.ongoing_offload or mgr.statistics().pages_in_write:
        mgr.check_offload_progress()
        mgr.manager.wait_progress(0.05)
    for req in reqs:
        tokens = req.origin_input_ids + req.output_ids[:-1]
        keys = ref_keys(req)
        first = len(req.origin_input_ids) // PS
        got = asyncio.run(storage.get(keys[first:]))
        for p, page in enumerate(got, start=first):
            assert page is not None, f"{req.rid}: page {p} missing from storage"
            assert page == expected_page(req.uid, tokens, p, PS, engine.n_tensors), (
                f"{req.rid}: page {p} bytes"
            )
    stats = mgr.statistics()
    assert stats.live_lifecycles == 0 and stats.pages_lost == 0, stats
    assert engine.allocator.used == set(), f"pages never freed: {sorted(engine.allocator.used)}"
    mgr.manager.check_invariants()
    mgr.release_host_resources()


def crossing(req: Req) -> bool:
    """``req`` enters a new page in the iteration about to run (its next committed
    token is the first of a page)."""
    return (len(req.origin_input_ids) + len(req.output_ids) - 1) % PS == 0


@pytest.mark.parametrize("order", list(ORDERS))
def test_one_host_read_of_the_rows_per_iteration_however_many_requests_enter_a_page(order: str) -> None:
    """Sixteen requests, four of them entering a new page in every iteration and all
    sixteen at once every fourth, others admitted and finishing in between: each
    iteration reads ``req_to_token`` on the host at most once for the pages running requests
    enter and once for its arrivals (issue 20, point 5; `Reads.ok`), and
    every page stored is the row's own (the bytes the engine wrote there)."""
    engine = ORDERS[order](page_size=PS, rows=32, n_pages=600)
    counted(engine)
    storage = MemoryStorage()
    sim = SimBackend()
    mgr = engine.manager(storage=storage, backend=sim, host_pages=256, drain_timeout_s=5.0)
    instrument(mgr)
    # prompts of 4k+3 tokens: after prefill (one output) every request's next token
    # starts a page, so all enter a page in the same iterations; the others are offset.
    same = [Req(f"s{i}", [i * 100 + j for j in range(4 * (i % 3) + 3)], max_new=30) for i in range(12)]
    offset = [Req(f"o{i}", [7000 + i * 100 + j for j in range(5 + i)], max_new=22 + i) for i in range(4)]
    late = [Req(f"l{i}", [9000 + i * 100 + j for j in range(6 + i)], max_new=9) for i in range(6)]
    everyone = same + offset + late
    for req in same + offset:
        engine.prefill(req)
    most_crossing = 0
    per_iteration: list[int] = []
    it = 0
    while engine.running or late:
        if it in (3, 6, 7) and late:  # arrivals joining the running batch
            for req in late[:2]:
                engine.prefill(req)
            del late[:2]
        most_crossing = max(most_crossing, sum(crossing(r) for r in engine.running))
        _READS.log.clear()
        engine.iteration()
        per_iteration.append(len(_READS.log))
        assert _READS.ok(), f"iteration {it}: {len(_READS.log)} host reads of req_to_token: {_READS.log}"
        sim.complete_all()
        it += 1
    assert most_crossing >= 12, "the scenario must have many requests enter a page in one iteration"
    assert sum(per_iteration) >= 5, f"pages were read at all: {per_iteration}"
    check_every_page_stored(mgr, engine, storage, everyone)


def iteration(engine: Engine, before_forward: Callable[[], None] | None = None) -> list[Req]:
    """One scheduler iteration in SGLang's order: ``check_offload_progress`` (in
    ``process_decode_queue``, where retracted requests are also resumed), then batch
    selection (``update_running_batch``: a retraction drains first), the forward pass,
    the results."""
    assert engine.mgr is not None
    engine.mgr.check_offload_progress()
    if before_forward is not None:
        before_forward()
    if not engine.running:
        return []
    engine.forward()
    return engine.process_results()


@pytest.mark.parametrize("same_rows", [False, True], ids=["other-rows", "same-rows"])
def test_a_retraction_reads_the_rows_once(same_rows: bool) -> None:
    """A retraction at batch selection (drain, the engine frees three requests' rows
    and pages) and their resumption two iterations later (other pages; the same row
    indices or others): the check of which rows were taken back reads every live
    request's page ids in the same one host read as the iteration's own page reads,
    and the chains go on with the recomputed KV."""
    engine = SGLangOrderEngine(page_size=PS, rows=16, n_pages=400)
    counted(engine)
    storage = MemoryStorage()
    mgr = engine.manager(storage=storage, backend="cpu", host_pages=128, drain_timeout_s=5.0)
    instrument(mgr)
    reqs = [Req(f"r{i}", [i * 50 + j for j in range(3 + 4 * (i % 2))], max_new=40) for i in range(8)]
    for req in reqs:
        engine.prefill(req)
    for _ in range(9):
        iteration(engine)
    victims = reqs[:3]
    rows = [v.kv.req_pool_idx for v in victims]

    def retract() -> None:
        mgr.drain_before_retraction()
        for v in victims:
            engine._take_back(v)

    def resume() -> None:
        engine.allocator.free_pages = engine.allocator.free_pages.flip(0)  # other pages than before
        if same_rows:  # rows are handed out from the tail of free_slots, as SGLang's are
            free = engine.r2t.free_slots
            for row in rows:
                free.remove(row)
            free.extend(reversed(rows))
        for v in victims:
            engine.resume(v)
        assert ([v.kv.req_pool_idx for v in victims] == rows) is same_rows

    plan = {0: retract, 2: resume}
    it = 0
    while engine.running or engine.waiting:
        _READS.log.clear()
        iteration(engine, plan.get(it))
        assert _READS.ok(), f"iteration {it}: {len(_READS.log)} host reads of req_to_token: {_READS.log}"
        it += 1
    assert mgr.statistics().released_aborted == len(victims)  # their rows were found taken back
    check_every_page_stored(mgr, engine, storage, reqs)


def test_rows_on_the_cpu_need_no_wrapper() -> None:
    """The integration takes a plain CPU ``req_to_token`` (the CPU path SGLang runs in
    tests and on CPU servers) and stores the same pages."""
    engine = SGLangOrderEngine(page_size=PS)
    storage = MemoryStorage()
    mgr = engine.manager(storage=storage, backend="cpu", host_pages=64, drain_timeout_s=5.0)
    assert type(engine.r2t.req_to_token) is torch.Tensor
    reqs = [Req(f"c{i}", list(range(i, i + 5 + i)), max_new=17) for i in range(5)]
    engine.run(reqs)
    check_every_page_stored(mgr, engine, storage, reqs)


class SpecEngine(SGLangOrderEngine):
    """Speculative decoding in SGLang's order: a request in ``accept`` commits that many
    tokens in each step (their KV written by the forward, ``kv_committed_len`` advanced
    by as many), which its row shows only once its own call comes."""

    def __init__(self, accept: dict[str, int], **kw: Any) -> None:
        super().__init__(**kw)
        self.accept = accept

    def forward(self) -> None:
        self._sampled_k: dict[int, list[int]] = {}
        for req in self.running:
            k = self.accept.get(req.rid, 1)
            pos = len(req.origin_input_ids) + len(req.output_ids) - 1
            self._grow(req, pos + k + 1)
            new = [next(self._next_token) for _ in range(k)]
            req.output_ids.extend(new)  # the verified tokens, for the KV of their positions
            for p in range(pos, pos + k):
                self._write(req, p)
            del req.output_ids[-k:]
            req.kv.kv_committed_len = pos + k
            self._sampled_k[id(req)] = new

    def process_results(self) -> list[Req]:
        mgr = self.mgr
        assert mgr is not None
        done = []
        for req in self.running:
            req.output_ids.extend(self._sampled_k[id(req)])
            if len(req.output_ids) >= req.max_new:
                req.finished_reason = "length"
            if not req.finished():
                mgr.offload_kv_cache(req)
            else:
                if not mgr.offload_kv_cache(req):
                    mgr.finalize_release_on_finish(req)
                done.append(req)
        self.running = [r for r in self.running if not r.finished()]
        return done


def test_a_request_that_commits_more_than_its_row_showed_reads_its_own() -> None:
    """Speculative decoding: requests committing three tokens a step enter pages the
    iteration's read did not foresee (their rows showed one new token); each reads its
    own page ids (one more host read for each), and every page stored is still the
    row's own."""
    engine = SpecEngine({"k0": 3, "k1": 3}, page_size=PS, rows=16, n_pages=300)
    counted(engine)
    storage = MemoryStorage()
    sim = SimBackend()
    mgr = engine.manager(storage=storage, backend=sim, host_pages=128, drain_timeout_s=5.0)
    instrument(mgr)
    reqs = [Req(f"k{i}", [i * 100 + j for j in range(5 + i)], max_new=40) for i in range(2)]
    reqs += [Req(f"n{i}", [5000 + i * 100 + j for j in range(3 + 4 * i)], max_new=30) for i in range(6)]
    for req in reqs:
        engine.prefill(req)
    most = 0
    while engine.running:
        _READS.log.clear()
        engine.iteration()
        most = max(most, len(_READS.log))
        at_poll = sum(x.startswith("check_offload_progress:") for x in _READS.log)
        assert at_poll <= 1 and len(_READS.log) - at_poll <= 1 + len(engine.accept), _READS.log
        sim.complete_all()
    assert most >= 2, "a multi-token step read its own pages at least once"
    check_every_page_stored(mgr, engine, storage, reqs)


# --- on SGLang's real classes ----------------------------------------------------------------


def _real() -> Any:
    """tests/integrations/sglang_real.py, or the skip (the failure under
    ``KVOFFLOAD_REQUIRE_SGLANG=1``) when SGLang's real classes do not import here."""
    import sglang_cpu

    ok, reason = sglang_cpu.available()
    if not ok:
        if os.environ.get("KVOFFLOAD_REQUIRE_SGLANG") == "1":
            pytest.fail(f"KVOFFLOAD_REQUIRE_SGLANG=1 but {reason}", pytrace=False)
        pytest.skip(reason)
    import sglang_real

    return sglang_real


def real_iteration(
    eng: Any, mgr: Any, reqs: list[Any], before_forward: Callable[[], None] | None = None
) -> None:
    """One iteration of SGLang's decode scheduler on the harness (``sr.Engine.step`` with
    a batch-selection hook): ``check_offload_progress``, then batch selection, SGLang's
    ``alloc_for_decode`` and the forward for every running request, then each result."""
    mgr.check_offload_progress()
    if before_forward is not None:
        before_forward()
    running = [r for r in reqs if not r.finished() and r.kv.req_pool_idx not in (None, -1)]
    for req in running:
        eng.decode_step(req)
    for req in running:
        if not req.finished():
            mgr.offload_kv_cache(req)
        elif not mgr.offload_kv_cache(req):
            mgr.finalize_release_on_finish(req)


def test_one_host_read_per_iteration_on_sglangs_real_rows() -> None:
    """SGLang's real ``ReqToTokenPool``, paged allocator (debug mode), ``Req``s and
    retraction (``release_req``, ``restore_kv_cache``): sixteen requests, twelve
    entering a page in the same iterations, arrivals, finishes, three retracted at batch
    selection and resumed: at most one host read of ``req_to_token`` per iteration for the
    pages running requests enter and one for the arrivals (``Reads.ok``), the
    pages stored are the rows' own (SGLang's keys, the bytes the engine wrote), and
    every slot comes back to the allocator once."""
    sr = _real()
    with sr.engine(page_size=PS, rows=32, slots=4096, max_context=256) as eng:
        eng.req_to_token_pool.req_to_token = eng.req_to_token_pool.req_to_token.as_subclass(CountedRows)
        storage = MemoryStorage()
        mgr = eng.manager(storage=storage, backend=SimBackend(), host_pages=512, drain_timeout_s=5.0)
        sim = mgr.manager.backend
        instrument(mgr)
        same = [eng.new_req(f"s{i}", [i * 100 + j for j in range(4 * (i % 3) + 3)], 30) for i in range(12)]
        offset = [eng.new_req(f"o{i}", [7000 + i * 100 + j for j in range(5 + i)], 22 + i) for i in range(4)]
        late = [eng.new_req(f"l{i}", [9000 + i * 100 + j for j in range(6 + i)], 9) for i in range(4)]
        everyone = same + offset + late
        running = same + offset
        for req in running:
            eng.admit(req)
        victims = offset[:3]

        def arrive() -> None:
            for req in late:
                eng.admit(req)
            running.extend(late)

        def retract() -> None:
            mgr.drain_before_retraction()
            for v in victims:
                eng.retract(v)

        def resume() -> None:
            for v in victims:
                eng.resume(v)

        plan = {3: arrive, 5: retract, 7: resume}
        most_entering, reads = 0, 0
        for it in range(200):
            live = [r for r in running if not r.finished() and r.kv.req_pool_idx not in (None, -1)]
            most_entering = max(most_entering, sum(r.kv.kv_committed_len % PS == 0 for r in live))
            _READS.log.clear()
            real_iteration(eng, mgr, running, plan.get(it))
            assert _READS.ok(), f"iteration {it}: {len(_READS.log)} host reads: {_READS.log}"
            reads += len(_READS.log)
            sim.complete_all()
            if it > 7 and all(r.finished() for r in everyone):
                break
        assert most_entering >= 12 and reads >= 5, (most_entering, reads)
        assert mgr.statistics().released_aborted == len(victims)  # their rows were found taken back
        mgr.drain_before_retraction()
        while mgr.ongoing_offload or mgr.statistics().pages_in_write:
            mgr.check_offload_progress()
            mgr.manager.wait_progress(0.05)
        for req in everyone:
            tokens = eng.tokens(req)
            keys = sr.page_keys(tokens, PS)
            first = len(req.origin_input_ids) // PS
            got = asyncio.run(storage.get(keys[first:]))
            for p, page in enumerate(got, start=first):
                assert page is not None, f"{req.rid}: page {p} missing from storage"
                assert page == eng.expected_kv_bytes(tokens, p * PS, (p + 1) * PS), (
                    f"{req.rid}: page {p} bytes"
                )
        assert mgr.statistics().live_lifecycles == 0
        mgr.release_host_resources()
        eng.check_free_list()
        assert eng.free_count() == eng.capacity
