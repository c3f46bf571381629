"""extend_batch's array state: a decode step of a large batch as one column write.

Most of a decode step commits one token to every running request and does nothing
else. :class:`DecodeRows` keeps the lifecycles of the batch it last saw as *rows*: a
step writes the batch's token ids into one column of a ring log and advances one step
counter, and only the rows that need something this step - a new device page, a chunk
due, a full ring - are visited, in batch order, exactly as their own ``extend`` would
have run. A row's tokens reach its lifecycle's tail lazily (``sync``); what anyone
can read stays exact meanwhile: ``lc.committed`` adds the row's pending tokens, and
pages, chunks, keys, state and counters are applied at the step that makes them due.

A lifecycle holds a row only while every one of its steps is that plain step:
extend is a self-loop of its state, its tail is narrow and no one observes events
(they would be emitted per step). A row whose chunk waits for host pages is visited
every step, so its tail is current when the pages return. Anything else - an extend
outside the batch, finish, abort, a state change, leaving the batch, a step of another
shape - first gives the row back (``detach``: its tokens written to its tail), and the
lifecycle takes the ordinary paths. Pure: numpy arrays and Python objects, no I/O.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable
from itertools import compress
from operator import attrgetter, is_not
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from kvoffload.core.lifecycle import EXTEND_SELF_LOOP, Lifecycle, LifecycleCore, requiet
from kvoffload.errors import PageError
from kvoffload.keys import TOKEN_TYPECODE
from kvoffload.pools import page_ids

if TYPE_CHECKING:
    from kvoffload.config import OffloadConfig
    from kvoffload.core.chunks import Chunks
    from kvoffload.core.events import Events
    from kvoffload.pools import DevicePool, EnginePages

__all__ = ["DecodeRows"]

_ROW = attrgetter("_row")
_BOOL_DTYPES = ("bool", "torch.bool")
#: Steps a row may go without a sync at most (its ring is this wide, or the stride).
_MAX_WIDTH = 256


def token_column(tokens: Any) -> np.ndarray | None:
    """One narrow token id per entry as a uint32 array, or None when some entry is not
    one (a sequence, a bool, an id >= 2**32, not an integer): the ordinary paths then
    take the batch, and raise where they should."""
    if type(tokens) is not list and type(tokens) is not tuple:
        return None
    try:
        ids = array(TOKEN_TYPECODE, tokens)  # every entry an integer (__index__) in [0, 2**32)
    except (TypeError, OverflowError, ValueError):
        return None
    col = np.frombuffer(ids, dtype=np.uint32)
    if len(col) and col.min() <= 1:  # a bool converts to 0 or 1: look only there
        for i in np.flatnonzero(col <= 1).tolist():
            t = tokens[i]
            if type(t) is not int and (type(t) is bool or str(getattr(t, "dtype", "")) in _BOOL_DTYPES):
                return None  # (a numpy or torch integer 0 or 1 is a token id, as everywhere)
    return col


class DecodeRows:
    """The rows of one core (see the module doc), owned by its decode step
    (:class:`~kvoffload.core.step.DecodeStep`): the due chunks go out through the
    chunks' planner (``chunks.submit_run``), a refused one is undone by the step's
    ``undo``.

    ``step_batch(lifecycles, tokens, pages, ready)`` applies a decode step of one token
    per lifecycle and returns True, or returns False having changed nothing when the
    batch is not such a step (every row is given back then: the caller takes the
    ordinary path).
    """

    def __init__(
        self,
        core: LifecycleCore,
        config: OffloadConfig,
        device_pool: DevicePool | EnginePages,
        chunks: Chunks,
        events: Events,
        undo: Callable[[Lifecycle, int, int], None],
    ) -> None:
        # core: the core whose lifecycles hold these rows (``lc._core``).
        self.core = core
        self.device_pool = device_pool
        self.chunks = chunks
        self.events = events
        self.undo = undo
        cfg = config
        self.page_size = cfg.page_size
        self.engine = cfg.device_pages is None
        # width: steps a row may hold; a row is synced at least every width steps.
        self.width = max(1, min(cfg.stride, _MAX_WIDTH))
        # step: decode steps applied since the rows were made; a row holds the tokens of
        # the steps since its lifecycle's _from.
        # Invariant: for every attached lc: 0 <= self.step - lc._from < self.width
        self.step = 0
        # log[r, s % width] and log[r, s % width + width]: the token row r took at step s
        # (written twice, so a row's held tokens are one slice whatever step it starts).
        self.log = np.zeros((0, 2 * self.width), dtype=np.uint32)
        # row_lc[r]: the lifecycle of row r, None for a free row.
        # Invariant: row_lc[r] is lc  <=>  lc._row == r
        self.row_lc: list[Lifecycle | None] = []
        self.free_rows: list[int] = []
        # paging[f]: the rows that take a new device page at every step s with
        #   s % page_size == f (one token a step: a row's committed passes its pages
        #   every page_size steps, for as long as it holds its row).
        # Invariant: every attached row r is in paging[page_phase(lc)], once, and no other
        # other_at[r]: the step row r's chunk is due or its ring is full, whichever first;
        # visits[s]: the rows whose other_at is s.
        # Invariant: every attached row r has other_at[r] > step and is listed in
        #   visits[other_at[r]], once, and nowhere else (no row is ever missed)
        self.paging: list[list[int]] = [[] for _ in range(self.page_size)]
        self.other_at: list[int] = []
        self.visits: dict[int, list[int]] = {}
        # batch: the lifecycles of the last step, in order (a copy); rows[i] is
        # batch[i]'s row and at[r] row r's position (ident: rows is 0..n-1).
        # None: the next step seats its batch afresh.
        # Invariant: the attached lifecycles are exactly those of batch
        self.batch: list[Lifecycle] | None = None
        self.rows = np.zeros(0, dtype=np.intp)
        self.at = np.zeros(0, dtype=np.intp)
        # seated: the rows held (a set, for the batch that changes every few steps).
        # Invariant: seated == {r for r, lc in enumerate(row_lc) if lc is not None}
        self.seated: set[int] = set()
        self.ident = True
        self.attached = 0

    # --- a step ----------------------------------------------------------------------

    def step_batch(self, lcs: list[Lifecycle], tokens: Any, pages: Any, ready: Any) -> bool:
        col = token_column(tokens)
        if col is None or len(col) != len(lcs):
            self.detach_all()
            return False
        if not self.engine and pages is not None and any(pages):
            self.detach_all()  # pages= in owned mode: the checked path says what is wrong
            return False
        if lcs != self.batch and not self._seat(lcs):
            self.detach_all()
            return False
        s1 = self.step + 1
        paged = self.paging[s1 % self.page_size]
        listed = self.visits.pop(s1, None)
        if paged or listed:
            return self._visit(lcs, paged, listed or [], col, pages, ready)
        if self.engine and pages is not None and any(pages):  # (owned mode: checked above)
            self.detach_all()  # pages where none is needed: the checked path says so
            return False
        self._write(col, len(lcs))
        return True

    def _write(self, col: np.ndarray, n: int) -> None:
        c = self.step % self.width
        log = self.log
        if self.ident:
            log[:n, c] = col
            log[:n, c + self.width] = col
        else:
            log[self.rows, c] = col
            log[self.rows, c + self.width] = col
        self.step += 1

    def _visit(
        self,
        lcs: list[Lifecycle],
        paged: list[int],
        listed: list[int],
        col: np.ndarray,
        pages: Any,
        ready: Any,
    ) -> bool:
        """A step with rows to visit, as one extend after another would run them: the
        rows of ``paged`` take a new page each, checked and taken first, in batch order;
        then the rows ``listed`` (a chunk due or a ring full) have their tokens written
        to their tails, and the due chunks go out in batch order."""
        s1 = self.step + 1
        at, row_lc, other_at = self.at, self.row_lc, self.other_at
        if self.ident:
            paged = sorted(paged)
            listed = sorted(listed)
        else:
            paged = sorted(paged, key=at.__getitem__)
            listed = sorted(listed, key=at.__getitem__)
        new_pages = self._take_pages(lcs, [at[r] for r in paged] if self.engine else paged, pages)
        if new_pages is None:
            if listed:
                self.visits[s1] = listed  # as it was
            self.detach_all()
            return False
        self._write(col, len(lcs))
        ps = self.page_size
        held = cast("list[Lifecycle]", row_lc)  # (paged and listed rows are attached: a lifecycle each)
        for r, page in zip(paged, new_pages, strict=True):  # nothing here can fail
            lc = held[r]
            lc.device_pages.append(page)
            lc._cap += ps
        if not listed:
            return True
        visited = [held[r] for r in listed]
        log, w = self.log, self.width
        due = []
        for lc in visited:  # sync (inline): the row's tokens to its tail
            f = lc._from
            k = s1 - f
            if k:
                a = f % w
                lc._tail.frombytes(log[lc._row, a : a + k].tobytes())
                lc._committed += k
                lc._from = s1
            if lc._committed >= lc.due and lc._deferred_since is None:
                due.append(lc)
        if due:
            progress = [0]
            try:
                self.chunks.submit_run(due, ready, self.events.clock(), progress)
            except BaseException:
                self._undo_step(lcs, at[due[progress[0]]._row], paged, new_pages)
                raise
        visits = self.visits
        for lc in visited:
            r = lc._row
            if r < 0:
                continue
            other = self._next_visit(lc, s1)
            other_at[r] = other
            if other in visits:
                visits[other].append(r)
            else:
                visits[other] = [r]
        return True

    def _next_visit(self, lc: Lifecycle, s: int) -> int:
        """The step after ``s`` (``lc`` synced at it) at which ``lc``'s row must be
        visited: its chunk due, its log full, or - while its chunk waits for host pages
        (deferred) - the next one, so that its tail is current whenever pages return."""
        if lc._deferred_since is not None:
            return s + 1
        return s + min(max(lc.due - lc._committed, 1), self.width)

    def _take_pages(self, lcs: list[Lifecycle], page_pos: list[int], pages: Any) -> list[int] | None:
        """The new device page of the entry at each of ``page_pos`` (batch order), taken
        as ``extend`` would take them one by one; None, with nothing taken, when they
        cannot all be had (the checked path then raises the precise error)."""
        k = len(page_pos)  # (owned mode: only the count matters)
        if not self.engine:
            if not k:
                return []
            pool = cast("DevicePool", self.device_pool)
            if k > pool.free_pages:
                return None
            got = pool.allocate(k)
            got.reverse()  # allocate(1) k times hands out the free list's end first
            return got
        if pages is None:
            return [] if not k else None
        if list(compress(range(len(lcs)), pages)) != page_pos:
            return None  # pages given where none starts, or missing where one does
        pool_e = cast("EnginePages", self.device_pool)
        ids: list[int] = []
        for p in page_pos:
            given = pages[p]
            if isinstance(given, (str, bytes)) or not hasattr(given, "__len__") or len(given) != 1:
                return None
            q = given[0]
            if type(q) is not int:  # a numpy or torch integer id: as every other path reads it
                try:
                    (q,) = page_ids(given)
                except PageError:
                    return None
            if not 0 <= q < pool_e.n_pages or pool_e.is_allocated(q):
                return None
            ids.append(q)
        if len(set(ids)) != k:
            return None
        for q in ids:
            pool_e.claim([q], 1)
        return ids

    def _undo_step(self, lcs: list[Lifecycle], p: int, paged: list[int], new_pages: list[int]) -> None:
        """The mover refused the chunk of the entry at position ``p``: the entries before
        it keep this step (as the sequential extends would), it and the ones after do
        not - no token, no new page, each through the step's ``undo``, last first (the
        pool's free list as it was) - and every row is given back."""
        s1 = self.step
        took = {self.row_lc[r]: True for r in paged if self.at[r] >= p}
        for i in range(len(lcs) - 1, p - 1, -1):
            lc = lcs[i]
            synced = lc._from == s1  # this step's token is the last of its tail
            self.undo(lc, 1 if synced else 0, len(lc.device_pages) - took.pop(lc, False))
            if synced:
                lc._from = s1 - 1
        for lc in lcs[:p]:  # keeps this step's token
            self.sync(lc)
            lc._from = s1 - 1
        self.step = s1 - 1
        self.detach_all()

    # --- rows ------------------------------------------------------------------------

    def _seat(self, lcs: list[Lifecycle]) -> bool:
        """Make ``lcs`` the batch: rows for the new ones, the rows of those gone given
        back. False (nothing changed) when one of them cannot take the plain step.
        Engines change their batch every few steps (requests finish and join): the
        lifecycles that hold a row are recognised by identity in C-level loops, and
        only the new and the gone ones are looked at one by one."""
        core = self.core
        if self.events.observed:
            return False
        n = len(lcs)
        row_lc = self.row_lc
        try:
            rows = list(map(_ROW, lcs))
            # An entry holds its row when the row holds it (row_lc[r] is lc <=> lc._row == r).
            fresh = (
                list(compress(range(n), map(is_not, map(row_lc.__getitem__, rows), lcs)))
                if row_lc
                else [*range(n)]
            )
        except (AttributeError, IndexError, TypeError):
            return False  # not a lifecycle (or not one of this core's)
        for i in fresh:
            lc = lcs[i]
            if (
                type(lc) is not Lifecycle
                or lc._core is not core
                or lc._row >= 0
                or lc._quiet < 0
                or not EXTEND_SELF_LOOP[lc._s]
            ):
                return False
        keep = set(rows)
        if len(keep) != n - len(fresh) + (1 if fresh else 0) or (
            len(fresh) > 1 and len(set(map(id, map(lcs.__getitem__, fresh)))) != len(fresh)
        ):
            return False  # a lifecycle twice in one step: the ordinary paths, in order
        for r in self.seated - keep:
            self.detach(cast("Lifecycle", row_lc[r]))
        for i in fresh:
            rows[i] = self._attach(lcs[i])
        order = np.array(rows, dtype=np.intp)
        if len(self.at) < len(row_lc):
            self.at = np.zeros(len(row_lc), dtype=np.intp)
        self.at[order] = np.arange(n)
        self.batch = list(lcs)
        self.rows = order
        self.ident = bool(np.array_equal(order, np.arange(n)))
        return True

    def _attach(self, lc: Lifecycle) -> int:
        if not self.free_rows:
            self._grow_rows()
        r = self.free_rows.pop()
        self.row_lc[r] = lc
        self.seated.add(r)
        lc._row = r
        lc._from = self.step
        lc._quiet = -1  # the per-request fast path would write past the row's tokens
        self.attached += 1
        self.paging[self.page_phase(lc)].append(r)
        self.other_at[r] = other = self._next_visit(lc, self.step)
        self.visits.setdefault(other, []).append(r)
        return r

    def page_phase(self, lc: Lifecycle) -> int:
        """``s % page_size`` of the steps ``s`` at which ``lc``'s row takes a page: where
        its committed passes its capacity (unchanged by a sync, which moves both)."""
        return (lc._cap + 1 - lc._committed + lc._from) % self.page_size

    def _grow_rows(self) -> None:
        old = len(self.row_lc)
        new = max(64, 2 * old)
        log = np.zeros((new, 2 * self.width), dtype=np.uint32)
        log[:old] = self.log
        self.log = log
        grow = new - old
        self.row_lc += [None] * grow
        self.other_at += [0] * grow
        self.free_rows += range(new - 1, old - 1, -1)  # the lowest row first

    def sync(self, lc: Lifecycle) -> None:
        """Write ``lc``'s held tokens to its tail (nothing else changes: the steps at
        which its row is visited stay the same)."""
        s, f = self.step, lc._from
        k = s - f
        if k > 0:
            a = f % self.width
            lc._tail.frombytes(self.log[lc._row, a : a + k].tobytes())
            lc._committed += k
            lc._from = s

    def detach(self, lc: Lifecycle) -> None:
        """Give ``lc``'s row back: its tokens to its tail, its fast path back."""
        r = lc._row
        self.paging[self.page_phase(lc)].remove(r)
        listed = self.visits.get(self.other_at[r])
        if listed is not None and r in listed:  # (not in a step's list being visited)
            listed.remove(r)
        self._give_back(lc)

    def _give_back(self, lc: Lifecycle) -> None:
        self.sync(lc)
        r = lc._row
        self.row_lc[r] = None
        self.seated.discard(r)
        self.free_rows.append(r)
        lc._row = -1
        self.attached -= 1
        self.batch = None  # the next step seats its batch afresh
        requiet(lc, self.events.observed)

    def detach_all(self) -> None:
        """Give every row back (their lifecycles' steps no longer line up with the
        schedule: nothing of it is read)."""
        if self.attached:
            self.visits.clear()
            for rows in self.paging:
                rows.clear()
            for lc in self.row_lc:
                if lc is not None:
                    self._give_back(lc)
        self.batch = None

    def pending(self, lc: Lifecycle) -> int:
        """Tokens ``lc``'s row holds that its tail does not have yet."""
        return self.step - lc._from if lc._row >= 0 else 0
