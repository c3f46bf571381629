"""A synchronous decode loop shaped like SGLang's scheduler, driving kvoffload.

No event loop anywhere: the scheduler is a plain ``while`` loop, as in SGLang and vLLM.
Per iteration it

1. checks offload progress once, before batch selection (``mgr.poll()``: completions
   are delivered on this thread, and ``on_released`` tells the loop which requests'
   slots it may reuse - SGLang's ``check_offload_progress``);
2. admits waiting requests while device pages last (a request that does not fit waits);
3. runs one forward pass: every running request decodes one token; the loop commits it
   (``lc.extend([token])`` - SGLang's ``offload_kv_cache`` after every decode step) and
   then writes the token's KV into its device page, right after the call (a copy never
   reads a page before the next ``poll()``, FAILURES F19);
4. finishes the requests that reached their length (``lc.finish()``); their slot comes
   back through ``on_released``, never earlier (F3/F4).

At the end it checks what a serving engineer would: every request released once, every
page back, and every stored page equal to the KV the engine wrote (read back with
``mgr.fetch``). Run it::

    python examples/sync_scheduler.py [requests] [seed]
"""

from __future__ import annotations

import logging
import random
import sys
from dataclasses import dataclass, field

import structlog
import torch

import kvoffload as kvo

PAGE = 8
HEADS_DIM = (2, 8)  # a toy model: 2 KV heads of 8 elements per token


@dataclass
class Request:
    rid: str
    prompt: list[int]
    output_len: int
    tokens: list[int] = field(default_factory=list)
    lc: kvo.Lifecycle | None = None


def kv_of(rid: str, position: int, token: int) -> torch.Tensor:
    """The KV a forward pass writes for one token: a function of what it is, so a page
    stored from the wrong place or the wrong time shows up."""
    seed = hash((rid, position, token)) % 10_000
    return torch.arange(HEADS_DIM[0] * HEADS_DIM[1], dtype=torch.float32).add(seed).view(HEADS_DIM)


def pages_for(tokens: int) -> int:
    return -(-tokens // PAGE)


class Engine:
    """The engine's side: the schedule and the KV writes. kvoffload owns the device pool
    here (``device_pages=N``: owned mode) and tells the engine when a slot is free."""

    def __init__(self, requests: list[Request]) -> None:
        self.waiting = list(requests)
        self.running: list[Request] = []
        self.finishing: dict[int, Request] = {}  # lifecycle id -> request whose slot is held
        self.released: list[str] = []
        config = kvo.OffloadConfig(
            page_size=PAGE,
            stride=2 * PAGE,
            device_pages=64,
            host_pages=32,
            on_host_full="wait",  # a chunk that finds the host pool full waits for pages
            kv_shape=HEADS_DIM,
            dtype="float32",
            offload_prompt=True,
        )
        self.mgr = kvo.SyncOffloadManager(
            config, backend="cpu", storage="memory", on_released=self.on_released
        )

    def on_released(self, lc: kvo.Lifecycle) -> None:
        """Called by ``poll()`` (or by the call that released it) once per request: no
        copy reads its pages any more; the engine may reuse its slot."""
        req = self.finishing.pop(lc.id)
        self.released.append(req.rid)

    def write_kv(self, req: Request, first: int) -> None:
        """The forward pass's KV of ``req.tokens[first:]`` into its device pages."""
        assert req.lc is not None
        pool = self.mgr.device_pool.tensor
        for pos in range(first, len(req.tokens)):
            page = req.lc.device_pages[pos // PAGE]
            pool[page, pos % PAGE] = kv_of(req.rid, pos, req.tokens[pos])

    def growth(self) -> int:
        """Device pages the running requests may still take before they finish."""
        total = 0
        for r in self.running:
            assert r.lc is not None
            total += pages_for(len(r.prompt) + r.output_len) - len(r.lc.device_pages)
        return total

    def step(self, rng: random.Random) -> None:
        mgr = self.mgr
        mgr.poll()  # once per iteration, before batch selection
        while self.waiting:  # admission: only what can run to its end (no preemption here)
            req = self.waiting[0]
            stats = mgr.statistics()
            free = stats.device_pages_total - stats.device_pages_used
            if pages_for(len(req.prompt) + req.output_len) + self.growth() > free:
                break  # it waits for pages that on_released will give back
            req.lc = mgr.admit(req.rid, req.prompt)
            self.waiting.pop(0)
            req.tokens = list(req.prompt)
            self.write_kv(req, 0)  # the prompt's KV (prefill), right after admit
            self.running.append(req)
        still = []
        for req in self.running:  # one forward pass: one token each
            assert req.lc is not None
            token = rng.randrange(32000)
            req.lc.extend([token])
            req.tokens.append(token)
            self.write_kv(req, len(req.tokens) - 1)  # after extend, before the next poll
            if len(req.tokens) - len(req.prompt) >= req.output_len:
                self.finishing[req.lc.id] = req
                req.lc.finish()  # its slot comes back through on_released
            else:
                still.append(req)
        self.running = still

    def run(self, seed: int = 0) -> None:
        rng = random.Random(seed)
        with self.mgr:
            while self.waiting or self.running or self.finishing:
                self.step(rng)
            self.mgr.quiesce(timeout=30)  # every copy delivered; writes may still run


def stored_pages_match(engine: Engine, requests: list[Request]) -> tuple[int, int, int]:
    """(pages checked, pages wrong, pages missing): every whole page of every request,
    read back from the store and compared with the KV the engine wrote."""
    checked = wrong = missing = 0
    with kvo.SyncOffloadManager(engine.mgr.config, backend="sim", storage=engine.mgr.storage) as reader:
        for req in requests:
            n = len(req.tokens) - len(req.tokens) % PAGE
            pages = reader.fetch(req.tokens, n)
            for i, raw in enumerate(pages):
                want = torch.stack(
                    [kv_of(req.rid, i * PAGE + k, req.tokens[i * PAGE + k]) for k in range(PAGE)]
                )
                got = torch.frombuffer(bytearray(raw), dtype=torch.float32).view(want.shape)
                checked += 1
                wrong += not torch.equal(got, want)
            missing += n // PAGE - len(pages)
    return checked, wrong, missing


def main(requests: int = 24, seed: int = 0) -> int:
    rng = random.Random(seed)
    reqs = [
        Request(f"req-{i % 8}", [rng.randrange(32000) for _ in range(rng.randint(1, 40))], rng.randint(4, 40))
        for i in range(requests)
    ]  # ids repeat: a new request may reuse the id of one still finishing
    engine = Engine(reqs)
    engine.run(seed)
    stats = engine.mgr.statistics()
    checked, wrong, missing = stored_pages_match(engine, reqs)
    once = sorted(engine.released) == sorted(r.rid for r in reqs)
    print(f"requests: {requests}, released: {len(engine.released)} (each once: {once})")
    print(f"pages: device used {stats.device_pages_used}, host used {stats.host_pages_used}")
    copied, dropped = stats.chunks_copied, stats.chunks_dropped
    print(f"chunks: submitted {stats.chunks_submitted}, copied {copied}, dropped {dropped}")
    print(f"stored pages checked against the engine's KV: {checked}, wrong: {wrong}, missing: {missing}")
    engine.mgr.check_invariants()
    ok = (
        len(engine.released) == requests
        and stats.live_lifecycles == 0
        and stats.device_pages_used == 0
        and stats.host_pages_used == 0
        and wrong == 0
        and missing == stats.pages_dropped  # only a counted drop may leave a page out
        and checked > 0
    )
    return 0 if ok else 1


if __name__ == "__main__":
    # An application chooses its log level; kvoffload never configures structlog.
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.ERROR))
    args = [int(a) for a in sys.argv[1:3]]
    raise SystemExit(main(*args))
