"""The decode step: every path that commits tokens to a lifecycle, and the one undo.

``extend`` (the full path: any tokens, pages and ``ready``, every check), ``extend_due``
(the one-token step that makes a chunk due, from the lifecycle's fast path) and
``extend_batch`` (one step for many lifecycles: the quiet pass, the checked pass that
runs the full path entry by entry, or the batch rows of :mod:`kvoffload.core.rows` for
large batches). The quiet fast paths are inlined where the state they touch lives
(``Lifecycle.extend`` for one lifecycle, :meth:`DecodeStep._extend_quiet` and the rows
for a batch); every path takes device pages through :meth:`DecodeStep.take_pages` (or
the inline one-page steps), submits what it made due through the chunks' one planner,
and a mover's refusal is undone by :meth:`DecodeStep.undo`: all or nothing.
"""

from __future__ import annotations

from array import array
from collections.abc import Mapping, MappingView, Sequence, Set
from typing import TYPE_CHECKING, Any, cast

from kvoffload.core.chunks import Chunks
from kvoffload.core.events import Events
from kvoffload.core.lifecycle import Lifecycle, LifecycleCore, requiet
from kvoffload.core.registry import Registry
from kvoffload.core.rows import DecodeRows
from kvoffload.errors import InvalidTokens, KVOffloadError, PageError, PoolExhausted
from kvoffload.keys import TOKEN_TYPECODE, WIDE_TYPECODE, validate_tokens
from kvoffload.lifecycle.table import EVENT_INDEX
from kvoffload.pools import page_ids

if TYPE_CHECKING:
    from kvoffload.config import OffloadConfig
    from kvoffload.pools import DevicePool, EnginePages

__all__ = ["ROWS_MIN", "DecodeStep"]

_EXTEND = EVENT_INDEX["extend"]
_U32 = 1 << 32
#: extend_batch keeps array state (DecodeRows) for batches of at least this many
#: lifecycles; below it a plain loop costs less than the arrays' fixed cost (they break
#: even near 32: benchmarks/bench_bookkeeping.py prints the crossover).
ROWS_MIN = 48
#: The types of extend_batch's page entries that the fast paths read as they are.
_PLAIN_ENTRIES = frozenset((type(None), list, tuple))


def _no_pages(given: Any) -> bool:
    """Whether ``pages=`` says "no pages": None or an empty sequence (owned mode takes
    nothing else; engine-owned mode, exactly the new pages)."""
    if given is None:
        return True
    if isinstance(given, (str, bytes)):
        return False
    try:
        return len(given) == 0
    except TypeError:
        return False


def _ordered(items: Any, what: str, error: type[KVOffloadError]) -> Sequence[Any]:
    """``items``, an ordered sequence with one entry per lifecycle of extend_batch, as a
    list or tuple (a numpy array or torch tensor through ``tolist()``); ``error`` for an
    unordered collection or something that is no sequence."""
    if isinstance(items, (Set, Mapping, MappingView)):
        raise error(
            f"extend_batch: {what} must be an ordered sequence (one entry per lifecycle, in order), "
            f"not a {type(items).__name__}"
        )
    if getattr(items, "dtype", None) is not None and hasattr(items, "tolist"):
        if not getattr(items, "ndim", 0):
            raise error(f"extend_batch: {what} must be a sequence with one entry per lifecycle, got a scalar")
        return cast("list[Any]", items.tolist())
    if isinstance(items, (str, bytes)) or not hasattr(items, "__len__") or not hasattr(items, "__getitem__"):
        raise error(
            f"extend_batch: {what} must be a sequence with one entry per lifecycle, "
            f"not {type(items).__name__}"
        )
    return list(items)


class DecodeStep:
    """The decode step of one core; it owns the batch rows (``rows``, made by the first
    batch of ``rows_min`` or more lifecycles) and the device pages a step takes."""

    def __init__(
        self,
        config: OffloadConfig,
        device_pool: DevicePool | EnginePages,
        registry: Registry,
        chunks: Chunks,
        events: Events,
        core: LifecycleCore,
    ) -> None:
        # core: the core (facade) whose lifecycles this step extends (``lc._core``).
        self.core = core
        self.config = config
        self.device_pool = device_pool
        self.registry = registry
        self.chunks = chunks
        self.events = events
        # rows: extend_batch's array state (kvoffload.core.rows); batches smaller than
        # rows_min take a plain loop.
        self.rows: DecodeRows | None = None
        self.rows_min = ROWS_MIN

    def detach(self, lc: Lifecycle) -> None:
        """``lc`` gives its batch row back (the registry's and the chunks' slot)."""
        cast("DecodeRows", self.rows).detach(lc)

    def sync(self, lc: Lifecycle) -> None:
        """``lc``'s batch row writes its held tokens to its tail (the chunks' slot)."""
        cast("DecodeRows", self.rows).sync(lc)

    def take_pages(self, n: int, given: Any, shared: int = 0) -> list[int]:
        """Device pages for ``n`` new pages: allocated from kvoffload's own pool (owned
        mode; ``given`` must be None or empty), or the engine's ids ``given`` claimed
        (engine-owned mode; the first ``shared`` are a stored prefix, which other live
        lifecycles' stored prefixes may share). Raises with nothing taken."""
        if self.config.device_pages is None:
            if given is None:
                if n == 0:
                    return []
                raise PageError(
                    f"engine-owned mode (device_pages=None): these tokens start {n} new page(s); "
                    "pass the engine's page ids with pages="
                )
            return cast("EnginePages", self.device_pool).claim(given, n, shared)
        if not _no_pages(given):
            raise KVOffloadError(
                "pages= hands over engine pages, but this manager owns its device pool "
                "(device_pages is set): leave pages out, or use device_pages=None"
            )
        return cast("DevicePool", self.device_pool).allocate(n)

    def extend(self, lc: Lifecycle, tokens: Sequence[int], *, pages: Any = None, ready: Any = None) -> None:
        """The full path of :meth:`Lifecycle.extend` (the lifecycle takes a fast path for
        the quiet decode step). All or nothing: a bad token, a full device pool or a
        refused submission raises and changes nothing."""
        self.registry.check(lc, _EXTEND)
        toks = validate_tokens(tokens)
        if lc._row >= 0:  # its extend_batch row gives it back: this step is not the batch's
            cast("DecodeRows", self.rows).detach(lc)
        self._extend_valid(lc, toks, pages, ready)

    def extend_due(self, lc: Lifecycle, t: int) -> bool:
        """The decode step whose one token makes a chunk due, from the lifecycle's fast
        path (``lc._quiet >= 0``: extend is a self-loop of its state, its tail narrow, no
        one observes events; no ``pages`` or ``ready``): exactly what :meth:`extend` does
        for ``[t]``, without its general checks. Returns False, having changed nothing,
        when ``t`` is no narrow id or its page cannot be had (:meth:`extend` then raises
        the precise error); raises what the mover raises, with nothing changed."""
        tail = lc._tail
        try:
            tail.append(t)  # OverflowError for an id < 0 or >= 2**32: not appended
        except OverflowError:
            return False
        committed = lc._committed + 1
        held = len(lc.device_pages)
        if committed > lc._cap and not self.grow_one(lc):
            tail.pop()
            return False
        lc._committed = committed
        if lc._deferred_since is None:  # due: committed == lc.due
            pending = committed - lc.submitted
            try:
                self.chunks.submit(lc, pending - pending % self.config.stride)
            except BaseException:  # the mover refused: extend is all or nothing
                self.undo(lc, 1, held)
                raise
        return True

    def undo(self, lc: Lifecycle, n: int, held: int) -> None:
        """Undo an extend of ``n`` tokens that found ``held`` device pages: the tokens
        leave the tail and the pages it added go back."""
        del lc._tail[len(lc._tail) - n :]
        lc._committed -= n
        if len(lc.device_pages) > held:
            self.device_pool.free(lc.device_pages[held:])
            del lc.device_pages[held:]
            lc._cap = held * self.config.page_size

    def _extend_valid(self, lc: Lifecycle, toks: array[int], pages: Any, ready: Any) -> None:
        """:meth:`extend` once the event is legal and the tokens are a checked array."""
        n = len(toks)
        committed = lc._committed + n
        ps = self.config.page_size
        held = len(lc.device_pages)
        need = max(0, -(-committed // ps) - held)
        if need or pages is not None:  # pages=[] (or None) is "no pages" in both modes
            lc.device_pages += self.take_pages(need, pages)
            lc._cap = len(lc.device_pages) * ps
        lc._committed = committed
        if toks.typecode != lc._tail.typecode:  # an id >= 2**32: this tail holds uint64 from now on
            if lc._tail.typecode == TOKEN_TYPECODE:
                lc._tail = array(WIDE_TYPECODE, lc._tail)
            else:
                toks = array(WIDE_TYPECODE, toks)
        lc._tail += toks
        if lc._quiet >= 0 and toks.typecode != TOKEN_TYPECODE:
            requiet(lc, self.events.observed)  # a wide tail: the fast path no longer applies
        if self.events.observed:
            self.registry.fire(lc, _EXTEND)  # a self-loop in every state it is legal in: only its event
        if committed >= lc.due and lc._deferred_since is None:
            pending = committed - lc.submitted
            try:
                self.chunks.submit(lc, pending - pending % self.config.stride, ready)
            except BaseException:  # the mover refused: extend is all or nothing
                self.undo(lc, n, held)
                raise

    def extend_batch(
        self,
        lifecycles: Sequence[Lifecycle],
        tokens: Sequence[Any],
        *,
        pages: Sequence[Any] | None = None,
        ready: Any = None,
    ) -> None:
        """One decode step for many lifecycles: exactly as ``lc.extend(tokens[i],
        pages=pages[i], ready=ready)`` for each ``lc = lifecycles[i]`` in order, keys and
        chunk boundaries included, at a fraction of the cost. ``tokens[i]`` is one token
        id (an int) or a sequence of them. Bad input anywhere in the batch - a lifecycle
        of another manager or in a state that refuses extend, a bad token, a wrong or
        taken page id, not enough free device pages for the whole batch - raises before
        anything changes. A mover that refuses a chunk raises at that lifecycle, the ones
        before it extended (as the sequential calls would).

        Accepted: ``lifecycles``, ``tokens`` and ``pages`` as lists or tuples (``tokens``
        and ``pages`` also as numpy arrays or torch tensors: one row per lifecycle);
        ``tokens[i]`` an int (a numpy or torch integer scalar too) or a sequence of ids
        as :meth:`Lifecycle.extend` takes them; ``pages[i]`` None, or the page ids as
        :func:`kvoffload.pools.page_ids` takes them. Every batch size takes exactly the
        same inputs. Owned mode: ``pages`` None, or every entry None or empty."""
        if type(lifecycles) is not list and type(lifecycles) is not tuple:
            lifecycles = _ordered(lifecycles, "lifecycles", KVOffloadError)
        if type(tokens) is not list and type(tokens) is not tuple:
            if getattr(tokens, "ndim", 0) == 2 and tokens.shape[1] == 1:  # type: ignore[attr-defined]
                tokens = tokens.reshape(-1)  # type: ignore[attr-defined]  # a column: one id each
            tokens = _ordered(tokens, "tokens", InvalidTokens)
        if pages is not None:
            pages = self._page_entries(pages)
        n = len(lifecycles)
        if len(tokens) != n or (pages is not None and len(pages) != n):
            raise KVOffloadError(
                f"extend_batch: {n} lifecycles, {len(tokens)} token entries"
                + (f", {len(pages)} page entries" if pages is not None else "")
                + ": one entry per lifecycle"
            )
        rows = self.rows
        if n >= self.rows_min and not self.events.observed:
            if rows is None:
                rows = self.rows = DecodeRows(
                    self.core, self.config, self.device_pool, self.chunks, self.events, self.undo
                )
            if rows.step_batch(
                lifecycles if type(lifecycles) is list else list(lifecycles), tokens, pages, ready
            ):
                return
        elif rows is not None and rows.attached:
            rows.detach_all()  # the ordinary paths below read and write the tails
        if ready is None and not self.events.observed and self._extend_quiet(lifecycles, tokens, pages):
            return
        self._extend_checked(lifecycles, tokens, pages, ready)

    def _page_entries(self, pages: Any) -> Sequence[Any] | None:
        """extend_batch's ``pages`` as the fast paths read them: a list or tuple whose
        entries are None, lists or tuples (anything else converted by
        :func:`~kvoffload.pools.page_ids`); None in owned mode, where every entry must
        be None or empty. Raises :class:`~kvoffload.PageError` (or, owned mode,
        :class:`~kvoffload.KVOffloadError`) before anything changes. One type check
        per call when the entries are already plain."""
        if type(pages) is not list and type(pages) is not tuple:
            pages = _ordered(pages, "pages", PageError)
        if self.config.device_pages is not None:
            for i, given in enumerate(pages):
                if not _no_pages(given):
                    raise KVOffloadError(
                        f"extend_batch: pages[{i}] hands over engine pages, but this manager owns its "
                        "device pool (device_pages is set): leave pages out, or pass None or [] entries"
                    )
            return None
        if set(map(type, pages)) <= _PLAIN_ENTRIES:
            return cast("Sequence[Any]", pages)
        return [
            given if given is None or type(given) is list else page_ids(given, f"pages[{i}]")
            for i, given in enumerate(pages)
        ]

    def _extend_quiet(self, lifecycles: Sequence[Lifecycle], tokens: Sequence[Any], pages: Any) -> bool:
        """The common decode step in one pass: every entry one narrow token id for a
        lifecycle of this core that stays under its quiet threshold (a new page is
        taken inline). Returns True when the whole batch was applied; on the first entry
        that is not such a step, every entry applied so far is undone and it returns
        False (nothing changed) for :meth:`_extend_checked`."""
        engine = self.config.device_pages is None
        ps = self.config.page_size
        core = self.core
        done = 0
        paged: list[int] = []  # the entries that took a new page, in order
        # due: (index, lifecycle) of the entries that made a chunk due, in order. Their
        # chunks are submitted after the pass, in the same order: quiet entries touch
        # neither the host pool nor the mover, so the outcome is the sequential one. A
        # due lifecycle's _quiet is -1 until then: a second entry for it in the batch
        # leaves the pass (the checked path handles it, in order).
        due: list[tuple[int, Lifecycle]] = []
        try:
            for i, lc in enumerate(lifecycles):
                t = tokens[i]
                if type(t) is not int or lc._core is not core or not 0 <= t < _U32:
                    break
                c = lc._committed + 1
                if c > lc._quiet:
                    if lc._quiet < 0:
                        break
                    lc._quiet = -1
                    due.append((i, lc))
                if c > lc._cap:
                    if not engine:
                        if (pages is not None and pages[i]) or not self.grow_one(lc):
                            break  # pages= in owned mode, or an empty pool: the checked path raises
                    elif pages is None or pages[i] is None:
                        break
                    else:
                        lc.device_pages += cast("EnginePages", self.device_pool).claim(pages[i], 1)
                        lc._cap += ps
                    paged.append(i)
                elif pages is not None and pages[i]:
                    break  # pages given where none is needed: the checked path says so
                lc._tail.append(t)
                lc._committed = c
                done += 1
        except (KVOffloadError, AttributeError, TypeError, ValueError):
            pass  # an engine page id was refused, an entry is no lifecycle: undo, the checked path raises
        else:
            if done == len(lifecycles):
                return self._submit_due(lifecycles, due, paged)
        if due and due[-1][0] == done:  # the entry that stopped the pass was made due first
            requiet(due.pop()[1], self.events.observed)
        self._undo_quiet(lifecycles, done, paged, due)
        return False

    def _submit_due(
        self, lifecycles: Sequence[Lifecycle], due: list[tuple[int, Lifecycle]], paged: list[int]
    ) -> bool:
        """After a quiet pass: the chunks its due entries made due, in order, as each
        entry's extend would have submitted them. A mover that refuses one raises there,
        the entries from that one on undone (as the sequential calls would leave them)."""
        stride = self.config.stride
        for k, (i, lc) in enumerate(due):
            requiet(lc, self.events.observed)
            if lc._committed >= lc.due and lc._deferred_since is None:
                pending = lc._committed - lc.submitted
                try:
                    self.chunks.submit(lc, pending - pending % stride, None)
                except BaseException:
                    for _, later in due[k + 1 :]:
                        requiet(later, self.events.observed)
                    self._undo_quiet(lifecycles, len(lifecycles), paged, [], stop=i)
                    raise
        return True

    def _undo_quiet(
        self,
        lifecycles: Sequence[Lifecycle],
        done: int,
        paged: list[int],
        due: list[tuple[int, Lifecycle]],
        stop: int = 0,
    ) -> None:
        """Undo entries ``stop..done`` that :meth:`_extend_quiet` applied, last first (each
        through :meth:`undo`, with the page it took); the due ones get their fast-path
        threshold back."""
        for _, lc in due:
            requiet(lc, self.events.observed)
        for i in range(done - 1, stop - 1, -1):
            lc = lifecycles[i]
            took = bool(paged) and paged[-1] == i
            if took:
                paged.pop()
            self.undo(lc, 1, len(lc.device_pages) - took)
        assert stop or not paged, "a page taken by an entry that was not applied"

    def _extend_checked(
        self, lifecycles: Sequence[Lifecycle], tokens: Sequence[Any], pages: Any, ready: Any
    ) -> None:
        """extend_batch's careful path: check every entry first, then extend each."""
        n = len(lifecycles)
        ps = self.config.page_size
        engine = self.config.device_pages is None
        # Validate everything first (nothing changes on bad input).
        grown: dict[int, int] = {}  # lifecycle id -> committed after its entries so far
        new_pages = 0
        claimed: set[int] = set()
        arrays: list[array[int]] = []  # each entry's tokens, checked
        given_ids: list[list[int] | None] = []  # each entry's page ids, checked (engine-owned)
        for i in range(n):
            lc, t = lifecycles[i], tokens[i]
            if not isinstance(lc, Lifecycle):
                raise KVOffloadError(f"extend_batch: lifecycles[{i}] is {lc!r:.60}, not a Lifecycle")
            if lc._core is not self.core:
                raise KVOffloadError(f"extend_batch: lifecycles[{i}] {lc!r} belongs to another manager")
            self.registry.check(lc, _EXTEND)
            scalar = type(t) is int or (hasattr(t, "__index__") and not getattr(t, "ndim", 0))
            toks = validate_tokens([t] if scalar else t, f"tokens[{i}]")
            arrays.append(toks)
            k = len(toks)
            before = grown.get(lc.id, lc._committed)
            grown[lc.id] = before + k
            need = max(0, -(-(before + k) // ps) - max(len(lc.device_pages), -(-before // ps)))
            new_pages += need
            if engine:
                given = pages[i] if pages is not None else None
                ids = None if given is None else page_ids(given, f"pages[{i}]")
                given_ids.append(ids)
                if ids is None and need:
                    raise PageError(
                        f"extend_batch: {lc!r} entry {i} starts {need} new page(s); pass them in pages"
                    )
                if ids is not None:
                    if len(ids) != need:
                        raise PageError(
                            f"extend_batch: entry {i} starts {need} new page(s); {len(ids)} given"
                        )
                    for p in ids:
                        if p in claimed:
                            raise PageError(f"extend_batch: page id {p} is named twice in the batch")
                        claimed.add(p)
            else:  # owned mode: _page_entries left no pages
                given_ids.append(None)
        if engine and claimed:  # range and held, checked before anything is claimed
            cast("EnginePages", self.device_pool).check_claim(list(claimed))
        elif not engine and new_pages > self.device_pool.free_pages:
            raise PoolExhausted("device", new_pages, self.device_pool.free_pages)
        # Apply, each entry exactly as its own extend.
        for i in range(n):
            self._extend_valid(lifecycles[i], arrays[i], given_ids[i], ready)

    def grow_one(self, lc: Lifecycle) -> bool:
        """Owned mode, a one-token step's new page (its committed passes its pages by
        one token): taken and appended, or False with nothing changed when the pool is
        empty or the engine owns the pages (the full path then raises or asks)."""
        if self.config.device_pages is None:
            return False
        page = cast("DevicePool", self.device_pool).take_one()
        if page < 0:
            return False
        lc.device_pages.append(page)
        lc._cap += self.config.page_size
        return True

    def grow(self, lc: Lifecycle, committed: int) -> bool:
        """Owned mode, the quiet step's page allocation (called by the lifecycle's fast
        path): device pages for ``committed`` tokens, or :class:`~kvoffload.PoolExhausted`
        with nothing changed. Engine-owned mode takes no page here: returns False (the
        full path then asks for the engine's)."""
        if self.config.device_pages is None:
            return False
        ps = self.config.page_size
        pages = lc.device_pages
        pages += cast("DevicePool", self.device_pool).allocate(-(-committed // ps) - len(pages))
        lc._cap = len(pages) * ps
        return True
