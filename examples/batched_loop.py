"""One extend_batch call per decode step, from a plain synchronous loop, for an engine
that owns its KV: 64 requests decode at once, each finishes at its own length and a
waiting one takes its place, so the batch changes as an engine's does.

Every step the forward pass has written one more token's KV for each running request;
the loop hands kvoffload the batch's new token ids (``next_token_ids.tolist()``) and the
engine pages that step started, in one call. From 48 requests on, extend_batch keeps
array state (docs/integration.md, "One call per decode step"). At the end every page of
every request is read back from the file store and compared with what the engine wrote,
and every engine page is back in the engine's free list.

    python examples/batched_loop.py          # prints one line; exit 0 when all checks hold
"""

from __future__ import annotations

import random
import sys
import tempfile

import torch

import kvoffload as kvo

PAGE, STRIDE, PAGES = 4, 8, 2048
RUNNING, REQUESTS = 64, 112


def main(requests: int = REQUESTS, running: int = RUNNING, seed: int = 0) -> int:
    rng = random.Random(seed)
    kv = [torch.randn(PAGES, PAGE, 2, 8) for _ in range(4)]  # the engine's per-layer K and V
    free = list(range(PAGES - 1, -1, -1))  # the engine's page allocator
    tokens: dict[str, list[int]] = {}  # each request's token ids: prompt, then one a step
    written: dict[str, list[bytes]] = {}  # each request's whole pages, as the engine wrote them

    def page_bytes(p: int) -> bytes:
        return torch.cat([t[p].flatten() for t in kv]).numpy().tobytes()

    def released(lc: kvo.Lifecycle) -> None:  # on_released: no copy reads these pages now
        n = lc.committed // PAGE
        written[lc.rid] = [page_bytes(p) for p in lc.tag[:n]]
        free.extend(lc.tag)

    cfg = kvo.OffloadConfig(  # a chunk that finds the host pool full waits for pages (as SGLang's)
        page_size=PAGE,
        stride=STRIDE,
        device_pages=None,
        host_pages=512,
        offload_prompt=True,
        on_host_full="wait",
        # Every page must be stored: a chunk waits until the store's writes give host
        # pages back, however slow the disk or the machine. The bound only turns a
        # store that never answers into drops (the default, 1 s, drops pages when a
        # busy store takes 30 ms a write: FAILURES F39).
        host_wait_s=600.0,
    )
    with (
        tempfile.TemporaryDirectory() as store,
        kvo.SyncOffloadManager(cfg, backend="cpu", storage=store, device_kv=kv, on_released=released) as mgr,
    ):
        waiting = [f"r{i}" for i in range(requests)]
        batch: list[kvo.Lifecycle] = []
        left: dict[int, int] = {}  # decode steps each running request has left

        def admit(rid: str) -> None:
            prompt = [rng.randrange(50_000) for _ in range(rng.randrange(1, 12))]
            pages = [free.pop() for _ in range(-(-len(prompt) // PAGE))]
            lc = mgr.admit(rid, prompt, pages=pages, tag=pages)  # after prefill wrote their KV
            tokens[rid] = prompt
            batch.append(lc)
            left[lc.id] = rng.randrange(8, 60)

        while waiting or batch:
            while waiting and len(batch) < running:  # the engine fills its batch
                admit(waiting.pop(0))
            new_ids = [rng.randrange(50_000) for _ in batch]  # the forward pass: one token each
            pages: list[list[int]] = []
            for lc, t in zip(batch, new_ids, strict=True):
                new = [free.pop()] if lc.committed % PAGE == 0 else []  # the token starts a page
                lc.tag.extend(new)
                pages.append(new)
                tokens[lc.rid].append(t)
            mgr.extend_batch(batch, new_ids, pages=pages)
            for lc in batch:
                left[lc.id] -= 1
                if not left[lc.id]:
                    lc.finish()  # the page-aligned tail goes out; released after its last copy
            batch = [lc for lc in batch if left[lc.id]]  # order kept, as engines filter
            mgr.poll()  # once per iteration: start copies, deliver completions, release
        while mgr.outstanding:  # copies in flight, storage writes not yet collected
            mgr.wait_progress(0.05)
            mgr.poll()
        stats = mgr.statistics()
        wrong = sum(mgr.fetch(tokens[rid], len(pages) * PAGE) != pages for rid, pages in written.items())
        whole = sum(len(t) // PAGE for t in tokens.values())
    ok = (
        len(written) == requests
        and wrong == 0
        and stats.pages_stored == whole
        and sorted(free) == list(range(PAGES))
    )
    print(
        f"batched loop {'ok' if ok else 'FAILED'}: {requests} requests, {running} at a time; "
        f"{stats.pages_stored} of {whole} pages stored and read back, {wrong} wrong; "
        f"engine pages all free: {sorted(free) == list(range(PAGES))}"
    )
    if not ok:
        print(stats)  # what went wrong: drops, losses, failed writes
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
