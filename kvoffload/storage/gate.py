"""A gate on memory a reader writes but does not own (an engine's KV blocks).

A store read can outlive whoever waits for it: a read that hangs in the kernel cannot
be stopped, and when it returns it writes its destination. Where that destination is
an engine's block the engine may own again by then (it recomputed the block, or gave
it to another request), so a late write would be wrong KV. A :class:`WriteGate` stands
between such readers and the memory: each write into it is short and bounded (a copy,
or a read that never waits on a device), made between :meth:`WriteGate.enter` and
:meth:`WriteGate.leave`, and :meth:`WriteGate.close` waits for the writes in progress,
then refuses every later one. Whoever gives up waiting closes the gate before it says
the memory is the engine's again.
"""

from __future__ import annotations

import threading

__all__ = ["WriteGate"]


class WriteGate:
    """``if gate.enter(): try: <write> finally: gate.leave()``; ``gate.close()``.

    Invariant: once :meth:`close` returned, no writer is inside and none enters again.
    Writers may be inside at once (the halves of a load); each keeps its write short."""

    __slots__ = ("_cv", "_inside", "_open")

    def __init__(self) -> None:
        self._cv = threading.Condition(threading.Lock())
        self._open = True
        self._inside = 0  # writers between enter() and leave()

    @property
    def open(self) -> bool:
        """Whether a writer may still enter."""
        return self._open

    def enter(self) -> bool:
        """Whether the caller may write now; True obliges it to :meth:`leave`."""
        with self._cv:
            if not self._open:
                return False
            self._inside += 1
            return True

    def leave(self) -> None:
        """The write that :meth:`enter` let in is over."""
        with self._cv:
            if self._inside <= 0:
                raise RuntimeError("WriteGate.leave() without a matching enter()")
            self._inside -= 1
            if not self._inside:
                self._cv.notify_all()

    def close(self) -> None:
        """Refuse every later writer, and wait for those inside to leave."""
        with self._cv:
            self._open = False
            while self._inside:
                self._cv.wait()
