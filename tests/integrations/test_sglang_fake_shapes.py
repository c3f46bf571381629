"""Every fake of sglang_fakes.py against the SGLang 0.5.23 class it stands in for, so a
fake can never drift from SGLang's shape again (issue 20; F28 was a fake ``unlock(req)``
where SGLang's tree caches take ``unlock(lock)``).

For each pair: the names the drop-in (kvoffload/integrations/sglang.py) and the fake
engine read must exist on both, a method must be a method on both with the same
parameters (names, kinds, defaults; annotations aside), a value must start as the same
type, and a name only the fake has must be declared here with the reason it may exist.
Every difference found must be one of ``KNOWN`` (each with why it is tolerated for
now); a difference fixed in the fake must be removed from ``KNOWN`` (the test fails on
a stale entry too), so the list only ever shrinks.

Constructors are not compared: test_sglang.py builds its requests and pools through an
engine (sglang_engines.py: ``new_req``, the engine's own pools), so a fake's
``__init__`` may take what the fake engine has (SGLang's ``Req`` takes
``origin_input_text`` and ``SamplingParams``; the fake takes ``max_new``).
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
from typing import Any

import pytest
import sglang_cpu

sglang_cpu.require()

import sglang_fakes as fakes  # noqa: E402
import torch  # noqa: E402

_MISSING = object()


def _real(path: str) -> Any:
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def _params(fn: Any) -> list[tuple[str, str, str]]:
    """A callable's parameters as (name, kind, default), ``self`` and annotations aside."""
    sig = inspect.signature(fn)
    out = []
    for i, p in enumerate(sig.parameters.values()):
        if i == 0 and p.name == "self":
            continue
        default = "" if p.default is inspect.Parameter.empty else repr(p.default)
        out.append((p.name, p.kind.name, default))
    return out


def _kind(owner: Any, name: str) -> str:
    """'method', 'property' or 'value' for ``name`` on ``owner`` (an instance or class)."""
    cls = owner if isinstance(owner, type) else type(owner)
    static = inspect.getattr_static(cls, name, _MISSING)
    if isinstance(static, property):
        return "property"
    if inspect.isfunction(static) or isinstance(static, (staticmethod, classmethod)):
        return "method"
    return "value"


def _type_name(value: Any) -> str | None:
    """A value's shape for the comparison: a builtin's type, a tensor's dtype and shape, a
    list of either; None for another object (a fake of its own, compared as its pair)."""
    if isinstance(value, torch.Tensor):  # the last dimension's width is a setting (heads, rank)
        return f"{str(value.dtype).removeprefix('torch.')}{(*value.shape[:-1], '...')}"
    if isinstance(value, (list, tuple)):
        kinds = sorted({str(_type_name(v)) for v in value})
        return f"{type(value).__name__}[{len(value)} x {' | '.join(kinds) or '-'}]"
    if type(value).__module__ in ("builtins", "array"):
        return type(value).__name__
    return None


def differences(fake: Any, real: Any, names: list[str], fake_only_ok: dict[str, str]) -> set[str]:
    """Where ``fake`` (an instance or class) differs from ``real`` (the same) on
    ``names``, and the public names only the fake has that ``fake_only_ok`` does not
    declare. Each difference is one short line naming the attribute."""
    out: set[str] = set()
    for name in names:
        f = getattr(fake, name, _MISSING)
        r = getattr(real, name, _MISSING)
        if r is _MISSING:
            out.add(f"{name}: SGLang has no such attribute")
            continue
        if f is _MISSING:
            out.add(f"{name}: the fake lacks it")
            continue
        fk, rk = _kind(fake, name), _kind(real, name)
        if fk != rk:
            out.add(f"{name}: a {fk} on the fake, a {rk} in SGLang")
            continue
        if fk == "method":
            fp, rp = _params(f), _params(r)
            if fp != rp:
                out.add(f"{name}{_sig(fp)}: SGLang's is {name}{_sig(rp)}")
        elif fk == "value" and not isinstance(fake, type) and _type_name(f) != _type_name(r) is not None:
            out.add(f"{name}: {_type_name(f)} on the fake, {_type_name(r)} in SGLang")
    own = {n for n in dir(fake) if not n.startswith("_")}
    for name in sorted(own - set(names)):
        if getattr(real, name, _MISSING) is _MISSING and name not in fake_only_ok:
            out.add(f"{name}: only the fake has it")
    return out


def _sig(params: list[tuple[str, str, str]]) -> str:
    return "(" + ", ".join(n + (f"={d}" if d else "") for n, _, d in params) + ")"


# --- the pairs ------------------------------------------------------------------------

PS, N_PAGES, LAYERS = 4, 16, 2


def _real_objects(stack: contextlib.ExitStack) -> dict[str, Any]:
    """One of each real class, built by sglang_real.py's harness as SGLang's decode
    scheduler builds them (CPU)."""
    import sglang_real as sr

    def eng(**kw: Any) -> Any:
        kw.setdefault("slots", N_PAGES * PS)
        kw.update(rows=4, max_context=64, layers=LAYERS)
        # float32 as the fakes' (SGLang's is the model's dtype: a setting, not a shape)
        return stack.enter_context(sr.engine(dtype=torch.float32, **kw))

    mha = eng(page_size=PS)
    return {
        "KV": type(mha.new_req("r", [1], 1).kv)(),
        "Req": mha.new_req("r", [1, 2, 3], 4),
        "ReqToTokenPool": mha.req_to_token_pool,
        "MHAPool": mha.kv_pool,
        "MLAPool": eng(page_size=PS, kv="mla").kv_pool,
        "Allocator": mha.allocator,
        "Allocator/page_size=1": eng(page_size=1).allocator,
        "TreeCache/RadixCache": eng(page_size=PS, tree="radix").tree_cache,
        "TreeCache/UnifiedRadixCache": mha.tree_cache,
        "TreeLock": _real("sglang.srt.mem_cache.base_prefix_cache.TreeLock")(node=0, receipt=None),
        # SGLang's own, with the values the fake holds (the types compared are the fields')
        "ServerArgs": sr.server_args(hicache_ratio=0.5, hicache_size=0, hicache_storage_backend="file"),
    }


def _fake_objects() -> dict[str, Any]:
    engine = fakes.Engine(page_size=PS, n_pages=N_PAGES, layers=LAYERS, rows=4, max_context=64)
    ps1 = fakes.Engine(page_size=1, n_pages=N_PAGES * PS, layers=LAYERS, rows=4, max_context=64)
    return {
        "KV": fakes.KV(),
        "Req": fakes.Req("r", [1, 2, 3], max_new=4),
        "ReqToTokenPool": engine.r2t,
        "MHAPool": engine.pool,
        "MLAPool": fakes.MLAPool(N_PAGES, PS, LAYERS),
        "Allocator": engine.allocator,
        "Allocator/page_size=1": ps1.allocator,
        "TreeCache/RadixCache": engine.tree,
        "TreeCache/UnifiedRadixCache": engine.tree,
        "ServerArgs": fakes.ServerArgs(),
        "TreeLock": fakes.TreeLock(0),
    }


#: What the drop-in and the fake engine read on each object (the names compared).
NAMES: dict[str, list[str]] = {
    "KV": ["req_pool_idx", "kv_committed_len", "kv_allocated_len", "cache_protected_len", "mark_kv_released"],
    "Req": ["rid", "origin_input_ids", "output_ids", "kv", "extra_key", "cache_salt", "lock", "finished"],
    "ReqToTokenPool": ["req_to_token", "alloc", "free", "free_slots", "free_rows"],
    "MHAPool": ["k_buffer", "v_buffer"],
    "MLAPool": ["kv_buffer"],
    "Allocator": ["page_size", "get_kvcache", "alloc", "free", "free_pages"],
    "Allocator/page_size=1": ["page_size", "get_kvcache", "alloc", "free", "free_pages"],
    "TreeCache/RadixCache": ["free_kv_row", "unlock", "lock"],
    "TreeCache/UnifiedRadixCache": ["free_kv_row", "unlock", "lock"],
    "ServerArgs": ["hicache_ratio", "hicache_size", "hicache_storage_backend"],
    "TreeLock": ["node"],
}

_USED = "the pages handed out and not given back (the fake engine's leak check)"
_RELEASED = "the rids whose lock was dropped, in order (the fake's own tests)"

#: Public names only a fake has, and why each may exist (test-side bookkeeping that
#: SGLang's object does not need and the drop-in never reads).
FAKE_ONLY: dict[str, dict[str, str]] = {
    "Req": {
        "uid": "the fake engine's identity of the request's KV content (the bytes it writes)",
        "max_new": "when the fake engine finishes the request (SGLang: sampling_params.max_new_tokens)",
        "tokens": "the tokens whose KV is written (a test helper)",
    },
    "MHAPool": {"tensors": "the buffers in the drop-in's order, for the tests' expected bytes"},
    "Allocator": {"used": _USED},
    "Allocator/page_size=1": {"used": _USED},
    "TreeCache/RadixCache": {"released": _RELEASED},
    "TreeCache/UnifiedRadixCache": {"released": _RELEASED},
    "MLAPool": {"tensors": "the buffers in the drop-in's order, for the tests' expected bytes"},
    "TreeLock": {"unlocked": "the fake tree's double-unlock check (SGLang's lock counts refs on the node)"},
}

REAL_TREES = {
    "TreeCache/RadixCache": "sglang.srt.mem_cache.radix_cache.RadixCache",
    "TreeCache/UnifiedRadixCache": "sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache",
}

#: The differences still in sglang_fakes.py, each with why it stays. A fixed one must be
#: removed here (a stale entry fails the test): the list only shrinks.
KNOWN: dict[str, set[str]] = {
    # One fake TreeCache stands in for both of SGLang's tree caches, whose lock()
    # signatures differ from each other; the drop-in never takes a lock (the engine does).
    "TreeCache/UnifiedRadixCache": {"lock(node): SGLang's is lock(node_id, skip_lock_components=())"},
}


def _behaviour(pair: str, objs: dict[str, Any], new_req: Any) -> dict[str, Any]:
    """The same calls on one side's objects (fake or real): what they return and leave.
    An exception is a result too (its type)."""
    try:
        if pair == "KV":
            kv = objs["KV"]
            kv.kv_allocated_len = 8
            kv.mark_kv_released()
            return {"after mark_kv_released": (kv.req_pool_idx, kv.kv_allocated_len)}
        if pair == "ReqToTokenPool":
            pool, a, b = objs["ReqToTokenPool"], new_req(), new_req()
            first = pool.alloc([a, b])
            pool.free(a)
            row = a.kv.req_pool_idx
            return {"alloc([a, b])": first, "a's row after free(a)": row, "then alloc([a])": pool.alloc([a])}
        if pair.startswith("Allocator"):
            alloc = objs[pair]
            ps = alloc.page_size
            two = alloc.alloc(2 * ps)
            alloc.free(two[:ps])
            again = alloc.alloc(ps)
            return {"alloc(2 pages)": two.tolist(), "free(first), alloc(1 page)": again.tolist()}
    except Exception as exc:
        return {"raises": type(exc).__name__}
    return {}


def _found() -> dict[str, set[str]]:
    """Every pair's differences (the real objects built fresh, in their published
    runtime context, restored after)."""
    with contextlib.ExitStack() as stack:
        real, fake = _real_objects(stack), _fake_objects()
        req_cls, params = type(real["Req"]), real["Req"].sampling_params
        found = {
            name: differences(fake[name], real[name], NAMES[name], FAKE_ONLY.get(name, {})) for name in real
        }
        for name in real:
            want = _behaviour(name, real, lambda: req_cls("r", "", [1, 2], params))
            got = _behaviour(name, fake, lambda: fakes.Req("r", [1, 2], max_new=4))
            if "raises" in got:
                found[name].add(f"the calls raise {got['raises']} on the fake")
                continue
            for call in sorted(set(got) | set(want)):
                if got.get(call) != want.get(call):
                    found[name].add(f"{call}: {got.get(call)} on the fake, {want.get(call)} in SGLang")
    return found


@pytest.mark.parametrize("pair", sorted(NAMES))
def test_a_fake_has_sglangs_shape(pair: str) -> None:
    """The fake standing in for an SGLang class reads, takes and returns what SGLang's
    does on every name the drop-in and the fake engine use; what still differs is
    exactly what ``KNOWN`` records."""
    got = _found()[pair]
    assert got == KNOWN.get(pair, set()), (
        f"{pair}: new differences {sorted(got - KNOWN.get(pair, set()))}, "
        f"fixed (remove from KNOWN) {sorted(KNOWN.get(pair, set()) - got)}"
    )


def test_the_comparison_sees_a_wrong_signature() -> None:
    """The comparer itself: a fake ``unlock(req)`` beside SGLang's ``unlock(lock)`` (F28)
    is a difference, and a matching one is not."""

    class Wrong:
        def unlock(self, req: Any) -> None: ...

    class Right:
        def unlock(self, lock: Any) -> None: ...

    real = _real(REAL_TREES["TreeCache/RadixCache"])
    assert differences(Wrong, real, ["unlock"], {}) == {"unlock(req): SGLang's is unlock(lock)"}
    assert differences(Right, real, ["unlock"], {}) == set()


def test_the_comparison_sees_a_wrong_starting_value_and_an_undeclared_extra() -> None:
    """The comparer itself: the old fake KV (``req_pool_idx`` starting at -1 where
    SGLang's starts at None, a ``released`` counter SGLang's lacks) differs on both."""
    from sglang.srt.managers.schedule_batch import ReqKvInfo

    old = fakes.KV()
    old.req_pool_idx = -1
    old.released = 0  # type: ignore[attr-defined]
    assert differences(old, ReqKvInfo(), ["req_pool_idx"], {}) == {
        "req_pool_idx: int on the fake, NoneType in SGLang",
        "released: only the fake has it",
    }
    assert differences(fakes.KV(), ReqKvInfo(), ["req_pool_idx"], {}) == set()
