"""The machine's rules as a program of integers: the fast way to run the core suite.

hypothesis' stateful runner has a fixed cost per example of ~17 steps before any rule
does work; a program drawn as one list of integers, each decoded into a rule and its
arguments, cost about a sixth of it (one measurement on a shared 2-core machine: 13 s
for 2,000 examples of empty rules, about 6 ms each, against about 1 ms a program). It
shrinks the same way (a shorter list, smaller integers; ``0`` decodes to a step that
does nothing). :func:`run_program` plays one on any :class:`LifecycleMachine` by
calling its rules directly - the same rules, preconditions and checks - and notes each
step as ``state.<rule>(...)``, so a failure prints a schedule that pastes into a test.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hypothesis import note
from hypothesis import strategies as st

from kvoffload._testing.machine import LifecycleMachine

__all__ = ["OPS", "decode", "open_arguments", "programs", "run_program"]

#: Rule names by op code (``0`` is a step that does nothing: what shrinking aims at).
OPS: tuple[str, ...] = (
    "nothing",
    "admit",
    "extend",
    "extend",
    "finish",
    "abort",
    "complete",
    "complete",
    "fail",
    "complete_batch",
    "drop",
    "exhaust_host_pool",
    "refuse_submissions",
    "storage_down",
    "close",
    "advance_clock",
    "write",
)


def _tokens(bits: int, min_size: int, max_size: int) -> list[int]:
    n = min_size + (bits & 15) % (max_size - min_size + 1)
    bits >>= 4
    out = []
    for _ in range(n):
        out.append(bits & 3)
        bits >>= 2
    return out


def decode(x: int) -> tuple[str, dict[str, Any]]:
    """The rule and keyword arguments an op integer stands for."""
    name = OPS[x % len(OPS)]
    a = x // len(OPS)
    slot = a % 3
    b = a // 3
    if name == "admit":
        return name, {"slot": slot, "prompt": _tokens(b, 0, 12)}
    if name == "extend":
        return name, {"slot": slot, "tokens": _tokens(b, 1, 10)}
    if name in ("finish", "abort", "drop"):
        return name, {"slot": slot}
    if name in ("complete", "fail"):
        return name, {"pos": a % 8}
    if name == "complete_batch":
        return name, {
            "positions": [(a >> (3 * i)) % 8 for i in range(2 + (a >> 12) % 3)],
            "fail_first": bool(a >> 14 & 1),
        }
    if name == "refuse_submissions":
        return name, {"on": bool(a & 1)}
    if name == "storage_down":
        return name, {"down": bool(a & 1)}
    if name == "advance_clock":
        return name, {"seconds": (1.0, 20.0)[a & 1]}
    if name == "write":
        return name, {"pos": a % 8, "stored": bool(a >> 3 & 1), "cut": a >> 4 & 3}
    return name, {}


def _enabled(m: Any, name: str) -> bool:
    """The rule's precondition, as declared on the machine (mirrored here)."""
    backend = m.backend
    if name == "nothing":
        return False
    if name in ("admit", "extend", "finish", "abort", "exhaust_host_pool", "close", "advance_clock"):
        return not m.closed
    if name == "refuse_submissions":
        return backend is not None and not m.closed
    if name == "storage_down":
        return m.storage is not None and not m.closed
    if name in ("complete", "fail"):
        return backend is not None and bool(backend.pending)
    if name == "complete_batch":
        return backend is not None and len(backend.pending) >= 2
    if name == "write":
        return bool(getattr(m, "writes", None))
    return hasattr(m, name)


def open_arguments() -> st.SearchStrategy[dict[str, Any]]:
    """The machine's ``open`` arguments (as its ``@initialize`` draws them)."""
    tokens = st.integers(0, 3)
    return st.fixed_dictionaries(
        {
            "page_size": st.integers(2, 4),
            "stride_pages": st.integers(1, 2),
            "device_pages": st.integers(6, 24),
            "spare_host_pages": st.integers(0, 4),
            "on_host_full": st.sampled_from(["drop", "wait"]),
            "offload_prompt": st.booleans(),
            "storage": st.booleans(),
            "first_prompt": st.lists(tokens, max_size=12),
            # A listener (the slow path, replayed on the oracle) in one example of four.
            "events": st.sampled_from([False, False, False, True]),
            "engine_owned": st.booleans(),
        }
    )


def programs(max_steps: int = 30) -> st.SearchStrategy[list[int]]:
    """Programs of up to ``max_steps`` op integers."""
    return st.lists(st.integers(0, 2**32 - 1), min_size=8, max_size=max_steps)


def run_program(
    machine_cls: type[LifecycleMachine], open_kwargs: dict[str, Any], program: Sequence[int]
) -> None:
    """Play ``program`` on a fresh ``machine_cls``: ``open``, then each enabled step and
    the after-step check, then ``teardown`` (as hypothesis' stateful runner would)."""
    m = machine_cls()
    try:
        note(f"state = {machine_cls.__name__}()")
        note(f"state.open({', '.join(f'{k}={v!r}' for k, v in open_kwargs.items())})")
        m.open(**open_kwargs)
        note("state.outside_rules_hold()")
        m.outside_rules_hold()
        for x in program:
            name, kwargs = decode(x)
            if not _enabled(m, name):
                continue
            note(f"state.{name}({', '.join(f'{k}={v!r}' for k, v in kwargs.items())})")
            getattr(m, name)(**kwargs)
            note("state.outside_rules_hold()")
            m.outside_rules_hold()
    finally:
        note("state.teardown()")
        m.teardown()
