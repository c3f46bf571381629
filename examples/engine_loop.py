"""An engine's own KV offloaded from a plain synchronous loop (no event loop): what
scripts/wheel_check.sh runs against the installed wheel beside another torch."""

import tempfile

import torch

import kvoffload as kvo

PAGE, PAGES = 4, 64
kv = [torch.randn(PAGES, PAGE, 2, 8) for _ in range(4)]  # the engine's per-layer K and V
free = list(range(PAGES))  # the engine's page allocator: kvoffload allocates nothing
cfg = kvo.OffloadConfig(
    page_size=PAGE, stride=2 * PAGE, device_pages=None, host_pages=32, offload_prompt=True
)
release = free.extend  # on_released(lc): the engine frees the request's pages (lc.tag)
with (
    tempfile.TemporaryDirectory() as store,
    kvo.SyncOffloadManager(
        cfg, backend="cpu", storage=store, device_kv=kv, on_released=lambda lc: release(lc.tag)
    ) as mgr,
):
    reqs = []
    for r in range(4):  # admitted after prefill: a 6-token prompt fills 2 of the engine's pages
        pages = [free.pop(), free.pop()]
        reqs.append(mgr.admit(f"r{r}", list(range(r, r + 6)), pages=pages, tag=pages))
    for step in range(24):  # a decode step: the forward wrote one more token's KV per request
        for lc in reqs:
            new = [free.pop()] if lc.committed % PAGE == 0 else []
            lc.tag.extend(new)
            lc.extend([100 + step], pages=new or None)
        mgr.poll()  # once per iteration: start copies, deliver completions, release
    for lc in reqs:
        lc.finish()  # the page-aligned tail goes out; released after its last copy
    while mgr.outstanding:  # copies in flight, storage writes not yet collected
        mgr.wait_progress(0.05)
        mgr.poll()
    stats = mgr.statistics()
    stored = mgr.fetch([0, 1, 2, 3, 4, 5, *range(100, 124)], 28)  # request r0's 7 whole pages
    engine = [torch.cat([t[p].flatten() for t in kv]).numpy().tobytes() for p in reqs[0].tag[:7]]
assert stored == engine, "the stored pages are not the engine's KV"
assert stats.pages_stored == 4 * 7 and sorted(free) == list(range(PAGES)), (stats, free)
print(f"engine loop ok: {stats.pages_stored} pages stored, read back, all freed; torch {torch.__version__}")
