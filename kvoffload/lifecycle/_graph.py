"""Reachability over a declared state graph, shared by the offload and load tables'
validators (``table.validate``, ``load_table.validate_load``)."""

from __future__ import annotations

from collections import deque
from collections.abc import Collection, Mapping
from typing import Any

__all__ = ["reachable", "reaches"]


def reachable(succ: Mapping[Any, set[Any]], initial: Any) -> set[Any]:
    """Every state reachable from ``initial`` (itself included) along ``succ``."""
    seen = {initial}
    todo = deque([initial])
    while todo:
        for nxt in succ[todo.popleft()] - seen:
            seen.add(nxt)
            todo.append(nxt)
    return seen


def reaches(succ: Mapping[Any, set[Any]], start: Any, goal: Collection[Any]) -> bool:
    """Whether a state of ``goal`` is reachable from ``start`` along ``succ``."""
    return any(s in goal for s in reachable(succ, start))
