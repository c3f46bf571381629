"""The independent check behind ``kvoffload simulate``'s delivery figures.

:class:`EngineRecord` is what the simulated engine committed to each lifecycle, kept
apart from the core: the tokens it passed to ``admit`` and ``extend``, and the KV it
wrote for them. :meth:`EngineRecord.check` says whether a delivered transfer carries
what a given lifecycle committed - its page keys, recomputed with hashlib only
(:func:`kvoffload.testing.reference_keys`), and its host bytes. The
:class:`~kvoffload.tools.workload.RunMonitor` runs it on every completion.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvoffload.errors import InvariantViolation

if TYPE_CHECKING:
    import torch

    from kvoffload.abc import Transfer
    from kvoffload.core.lifecycle import Lifecycle
    from kvoffload.pools import DevicePool, HostPool

__all__ = ["EngineRecord", "fingerprint"]

#: Bytes of a token's KV row that carry its fingerprint (fewer when the row is smaller).
_FINGERPRINT_BYTES = 8


def fingerprint(lifecycle: int, position: int, token: int) -> int:
    """The simulated engine's KV for one token: a 64-bit value naming the lifecycle,
    the position and (the low 16 bits of) the token id, so KV read from another
    lifecycle, another position or a reused page is not the expected value."""
    return ((lifecycle & 0x7FFFFF) << 40) | ((position & 0xFFFFFF) << 16) | (token & 0xFFFF)


def _as_bytes(fps: Sequence[int]) -> torch.Tensor:
    """Fingerprints as (n, 8) uint8 rows, little-endian (as the KV rows hold them)."""
    import torch

    return torch.tensor(fps, dtype=torch.int64).view(torch.uint8).reshape(-1, 8)


def _row_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` (pages, page_size, *kv_shape) as uint8 rows, one per token."""
    import torch

    return tensor.view(tensor.shape[0], tensor.shape[1], -1).view(torch.uint8)


class EngineRecord:
    """What the simulated engine committed to each lifecycle: the tokens it passed to
    ``admit`` and ``extend`` and, when ``device`` is given, the KV it wrote for them:
    the first bytes (up to 8) of each token's row in the device pool hold
    :func:`fingerprint` of (lifecycle, position, token).

    The engine calls :meth:`commit` after each successful ``admit`` / ``extend`` and
    :meth:`write_kv` before it yields (the rows of a step are written in one go; the
    driver's next turn is when a copy may read them, FAILURES F19). :meth:`check`
    tells whether a delivered transfer carries what a lifecycle committed: its page
    keys against an independent recomputation of the chain over that lifecycle's
    tokens (:func:`kvoffload.testing.reference_keys`, hashlib only) and, with
    ``host``, its host pages against the engine's KV. Both pools must be on the CPU.
    """

    def __init__(
        self,
        page_size: int,
        *,
        seed: str | None = None,
        device: DevicePool | None = None,
        host: HostPool | None = None,
    ) -> None:
        self.page_size = page_size
        self.seed = seed
        self._device = None if device is None else _row_bytes(device.tensor)
        self._host = None if host is None or device is None else _row_bytes(host.tensor)
        self.width = 0 if self._device is None else min(_FINGERPRINT_BYTES, int(self._device.shape[2]))
        # tokens[lid]: every token committed to lifecycle lid, in order (until released).
        self.tokens: dict[int, list[int]] = {}
        # _keys[lid]: the reference chain over lid's whole pages, extended as needed.
        self._keys: dict[int, list[str]] = {}
        # _rows: (device page, slot, fingerprint) of KV committed and not yet written.
        self._rows: list[tuple[int, int, int]] = []
        # _writers: the lifecycles whose rows are in _rows (none may be RELEASED at
        # write_kv: its pages may already be another request's).
        # Invariant: every lifecycle with a row in _rows is in _writers
        self._writers: list[Lifecycle] = []

    @property
    def checks_bytes(self) -> bool:
        """Whether the engine writes KV and completions' host pages are checked."""
        return self._host is not None

    def commit(self, lc: Lifecycle, tokens: Sequence[int]) -> None:
        """``lc`` accepted ``tokens`` (after its prompt, or after an ``extend``): record
        them, and queue their KV rows for :meth:`write_kv`."""
        toks = self.tokens.setdefault(lc.id, [])
        start = len(toks)
        toks.extend(tokens)
        if self._device is not None:
            ps = self.page_size
            pages = lc.device_pages
            for i, tok in enumerate(tokens, start):
                self._rows.append((pages[i // ps], i % ps, fingerprint(lc.id, i, tok)))
            self._writers.append(lc)

    def write_kv(self) -> None:
        """Write the queued KV rows into the device pool, in one indexed store.

        Raises :class:`~kvoffload.InvariantViolation` when a lifecycle with a queued row
        was released meanwhile: an engine that writes a request's KV after telling
        kvoffload it finished writes into pages that may be another request's (in one
        indexed store with that request's rows, which of the two lands is undefined)."""
        writers, self._writers = self._writers, []
        late = [lc for lc in writers if lc.released]
        if late:
            self._rows.clear()
            raise InvariantViolation(
                f"the engine wrote KV of {late[0]!r} after it was released: its device pages "
                "may already hold another request's KV (write a step's KV before finish/abort)"
            )
        if not self._rows or self._device is None:
            self._rows.clear()
            return
        import torch

        pages, slots, fps = zip(*self._rows, strict=True)
        self._rows.clear()
        self._device[torch.tensor(pages), torch.tensor(slots), : self.width] = _as_bytes(fps)[:, : self.width]

    def forget(self, lid: int) -> None:
        """Lifecycle ``lid`` was released: nothing more is delivered to it."""
        self.tokens.pop(lid, None)
        self._keys.pop(lid, None)

    def reference_keys(self, lid: int, pages: int) -> list[str]:
        """The first ``pages`` keys of the chain over ``lid``'s committed tokens."""
        from kvoffload.testing import reference_keys

        keys = self._keys.setdefault(lid, [])
        if len(keys) < pages:
            ps = self.page_size
            toks = self.tokens.get(lid, [])[len(keys) * ps : pages * ps]
            keys += reference_keys(toks, ps, keys[-1] if keys else self.seed)
        return keys[:pages]

    def check(self, t: Transfer, lid: int, *, with_bytes: bool) -> str | None:
        """What is wrong with ``t`` as a delivery to lifecycle ``lid`` (None: nothing):
        its keys are not the chain over the tokens ``lid`` committed at its positions,
        or (``with_bytes``, when the engine writes KV) its host pages do not hold the KV
        the engine wrote for them."""
        ps = self.page_size
        if lid not in self.tokens:
            return f"{t!r} was delivered to lifecycle #{lid}, which the engine never admitted"
        page = t.first_token // ps
        if list(t.keys) != self.reference_keys(lid, page + t.n_tokens // ps)[page:]:
            return f"{t!r} delivered to lifecycle #{lid} carries keys that are not the chain over its tokens"
        if with_bytes and self._host is not None:
            import torch

            first = t.first_token
            toks = self.tokens[lid][first : first + t.n_tokens]
            want = _as_bytes([fingerprint(lid, first + i, tok) for i, tok in enumerate(toks)])
            got = self._host[torch.tensor(t.host_pages, dtype=torch.long), :, : self.width]
            if not torch.equal(got, want[:, : self.width].reshape(got.shape)):
                return f"{t!r} delivered to lifecycle #{lid}: its host pages do not hold the engine's KV"
        return None
