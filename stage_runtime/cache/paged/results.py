"""What the paged index hands back: restores, record outcomes, evicted pages, statistics."""

from __future__ import annotations

from collections.abc import Hashable, Iterator, Sequence
from typing import Literal, Protocol, overload

import attrs
import numpy as np
import numpy.typing as npt

from stage_runtime.accounting import MissReason
from stage_runtime.cache.paged.chains import key_digest
from stage_runtime.cache.resident import EvictedEntry, EvictionReason

__all__ = [
    "EntryKind",
    "EvictedPage",
    "EvictedPages",
    "PagedIndexStats",
    "PagedLookup",
    "PagedRecordOutcome",
    "PagedRestore",
]

Payload = npt.NDArray[np.uint8]

EntryKind = Literal["page", "tail", "exact"]
"""A full page, the exact-length tail of a prompt, or a whole frame that could not be paged."""


@attrs.frozen(kw_only=True)
class EvictedPage(EvictedEntry):
    """One entry the index evicted: the ladder's ``EvictedEntry`` plus where it sat in its chain.

    Being an ``EvictedEntry``, it goes into records and ``activation_evicted`` events as is; its
    ``entries_after`` and ``resident_bytes_after`` are always set. Under ``lru`` a record makes
    room for all its new pages before storing them, so these are the residency before any of them;
    under ``reuse`` it makes room page by page, so they include the pages stored so far.
    """

    kind: EntryKind
    token_start: int
    """First token the entry covers."""


class _Shaped(Protocol):
    """What an evicted entry's record needs of its shape (the entries' ``_Shape``)."""

    @property
    def label(self) -> str: ...

    @property
    def kind(self) -> EntryKind: ...

    @property
    def token_count(self) -> int: ...

    @property
    def nbytes(self) -> int: ...


class _Eviction:
    """The entries one eviction call removed, in order: what their :class:`EvictedPage` records
    are made of, when something reads them. Their keys, token starts and shapes, not the
    entries (which would keep their payloads alive as long as the records); their reasons, and
    the index's entries and resident bytes before the first went (each record's residency
    after it follows from those)."""

    __slots__ = ("entries", "keys", "nbytes", "reasons", "resident", "shapes", "starts")

    def __init__(
        self,
        keys: list[bytes],
        starts: list[int],
        shapes: Sequence[_Shaped],
        reasons: list[EvictionReason] | EvictionReason,
        entries: int,
        resident: int,
        nbytes: int,
    ) -> None:
        self.keys = keys
        self.starts = starts
        self.shapes = shapes
        self.reasons = reasons
        """One reason per entry, or one for them all."""
        self.entries = entries
        """Resident entries before the first went."""
        self.resident = resident
        """Resident bytes before the first went."""
        self.nbytes = nbytes
        """Payload bytes of them all."""

    def records(self) -> Iterator[EvictedPage]:
        """Their :class:`EvictedPage` records, in order."""
        entries, resident = self.entries, self.resident
        reasons = self.reasons
        each = [reasons] * len(self.keys) if isinstance(reasons, str) else reasons
        for key, start, shape, reason in zip(
            self.keys, self.starts, self.shapes, each, strict=True
        ):
            entries -= 1
            resident -= shape.nbytes
            yield EvictedPage(
                key=_entry_name(shape.label, shape.kind, start, shape.token_count, key),
                kind=shape.kind,
                token_start=start,
                token_count=shape.token_count,
                payload_bytes=shape.nbytes,
                reason=reason,
                entries_after=entries,
                resident_bytes_after=resident,
            )


def _entry_name(label: str, kind: str, token_start: int, token_count: int, key: bytes) -> str:
    """Printable name of an entry (its ``EvictedPage.key``, its restore and record name)."""
    return f"{label}:{kind}:{token_start}+{token_count}:{key_digest(key)[:8].hex()}"


class EvictedPages(Sequence[EvictedPage]):
    """The entries one call evicted, in eviction order, each an :class:`EvictedPage` built on
    first use.

    Under a tight bound one record evicts hundreds of pages, and most readers only count them
    (``len``) or add up their bytes (:attr:`payload_bytes`): the records are made only when
    something reads them. Immutable; equal to any sequence of the same records (a tuple too).
    """

    __slots__ = ("_count", "_pages", "_runs")

    def __init__(self, runs: Sequence[_Eviction] = ()) -> None:
        self._runs = tuple(runs)
        self._count = sum(len(run.keys) for run in self._runs)
        self._pages: tuple[EvictedPage, ...] | None = None

    @property
    def pages(self) -> tuple[EvictedPage, ...]:
        """The records as a tuple."""
        if self._pages is None:
            self._pages = tuple(page for run in self._runs for page in run.records())
        return self._pages

    @property
    def payload_bytes(self) -> int:
        """Bytes of all the evicted entries."""
        return sum(run.nbytes for run in self._runs)

    def __len__(self) -> int:
        return self._count

    @overload
    def __getitem__(self, index: int) -> EvictedPage: ...

    @overload
    def __getitem__(self, index: slice) -> tuple[EvictedPage, ...]: ...

    def __getitem__(self, index: int | slice) -> EvictedPage | tuple[EvictedPage, ...]:
        return self.pages[index]

    def __iter__(self) -> Iterator[EvictedPage]:
        return iter(self.pages)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, EvictedPages):
            return self._count == other._count and self.pages == other.pages
        if isinstance(other, Sequence) and not isinstance(other, str | bytes):
            return self.pages == tuple(other)
        return NotImplemented

    def __hash__(self) -> int:
        # Equal to the tuple of its records, so hashed as that tuple (x == y => same hash).
        return hash(self.pages)

    def __repr__(self) -> str:
        return f"EvictedPages({list(self.pages)!r})"


@attrs.frozen(kw_only=True)
class PagedRecordOutcome:
    """What one :meth:`PagedActivationIndex.record` call did."""

    stored_entries: int
    """New entries stored (shared pages already cached are not stored again)."""
    stored_bytes: int
    """Payload bytes stored: of those new entries, and of cached entries re-recorded with other
    rows (a frame of another dtype or width: counted in ``reused_entries``)."""
    reused_entries: int
    """Entries that were already cached (their recency was refreshed)."""
    covered_tokens: int
    """Prompt tokens now covered from the start by cached entries of this prompt."""
    truncated: bool
    """The bounds could not fit the whole chain; pages past ``covered_tokens`` were not stored."""
    evicted: EvictedPages
    """The entries this call evicted to make room, in order."""
    last_key: bytes | None
    """Key of the last entry covering ``covered_tokens`` (None when nothing is covered)."""
    last_entry: str
    """Printable name of that entry (``""`` when nothing is covered)."""
    entries: int
    """Resident entries after the call."""
    resident_bytes: int
    """Resident payload bytes after the call."""

    @property
    def evicted_bytes(self) -> int:
        """Payload bytes evicted by this call."""
        return self.evicted.payload_bytes


class _Named(Protocol):
    @property
    def name(self) -> str: ...


@attrs.frozen(kw_only=True, eq=False)
class PagedRestore:
    """A restored prefix: the page views in order, assembled on demand."""

    token_count: int
    """Tokens restored (from token 0)."""
    bytes_per_token: int
    """Row size; 0 for an exact entry of a frame that is not token-major."""
    meta: Hashable
    """What the recorder passed as ``meta`` (the frame description minus token counts)."""
    pages: tuple[Payload, ...]
    """Read-only payload views, in token order; together exactly ``payload_bytes``."""
    page_token_counts: tuple[int, ...]
    """Tokens in each of ``pages``."""
    last_key: bytes
    """Key of the last entry used: the chained identity of the whole restored prefix."""
    entries: int
    """Resident entries at restore time."""
    payload_bytes: int
    """Bytes of the restored prefix (of all ``pages`` together)."""
    used: Sequence[_Named] = attrs.field(repr=False)
    """The entries used, in token order (their names are made only when :attr:`keys` is read)."""
    _one_fill: bool | None = attrs.field(default=None, init=False, repr=False)
    """Whether every page is virtual with one fill byte (None until asked: a stage asks twice)."""

    @property
    def keys(self) -> tuple[str, ...]:
        """Printable names of the entries used."""
        return tuple(entry.name for entry in self.used)

    @property
    def last_name(self) -> str:
        """Printable name of the last entry used."""
        return self.used[-1].name

    def iter_pages(self) -> Iterator[tuple[int, Payload]]:
        """Yield ``(token_start, payload view)`` per page, never copying."""
        start = 0
        for count, page in zip(self.page_token_counts, self.pages, strict=True):
            yield start, page
            start += count

    def copy_bytes(self) -> int:
        """Bytes :meth:`payload` copies: none for one page or for virtual pages of one fill
        value, else the whole prefix."""
        if len(self.pages) == 1 or self._virtual_fill():
            return 0
        return self.payload_bytes

    def _virtual_fill(self) -> bool:
        one = self._one_fill
        if one is None:
            one = _one_virtual_fill(self.pages)
            object.__setattr__(self, "_one_fill", one)
        return one

    def payload(self) -> Payload:
        """The whole prefix as one read-only 1-D ``uint8`` array (at most one copy).

        A single page is returned as is; virtual pages (zero-stride views) with one fill value
        give a zero-stride view of the full size, allocating nothing.
        """
        if len(self.pages) == 1:
            return self.pages[0]
        total = self.payload_bytes
        if self._virtual_fill():
            out: Payload = np.broadcast_to(self.pages[0][:1], (total,))
            return out
        joined = np.concatenate(self.pages)
        joined.flags.writeable = False
        return joined


@attrs.frozen(kw_only=True)
class PagedLookup:
    """Outcome of one restore: a prefix, or the reason for the miss."""

    restore: PagedRestore | None
    miss_reason: MissReason | None
    """Set on a miss; ``None`` on a hit."""


@attrs.frozen(kw_only=True)
class PagedIndexStats:
    """Counters and residency of a :class:`PagedActivationIndex`."""

    entries: int
    pages: int
    tails: int
    exact_entries: int
    resident_bytes: int
    lookups: int
    hits: int
    misses_never_seen: int
    misses_evicted: int
    misses_rejected: int
    restored_tokens: int
    records: int
    """Entries stored (not counting re-records of cached ones)."""
    evictions: int
    """Entries evicted by the bounds (``clear`` not included)."""
    evicted_bytes: int

    @property
    def misses(self) -> int:
        """All misses."""
        return self.misses_never_seen + self.misses_evicted + self.misses_rejected


def _is_virtual(payload: Payload) -> bool:
    return payload.size > 1 and payload.strides[0] == 0


def _one_virtual_fill(pages: tuple[Payload, ...]) -> bool:
    """Whether every page is a zero-stride view and all repeat one byte value."""
    if not pages:
        return False
    # Views of one single-byte array repeat that byte (the pages of virtual frames share one
    # per fill value): one identity test per page instead of reading a byte from each.
    base = pages[0].base
    if (
        isinstance(base, np.ndarray)
        and base.nbytes == 1
        and all(p.base is base and _is_virtual(p) for p in pages)
    ):
        return True
    return all(_is_virtual(p) for p in pages) and len({int(p[0]) for p in pages}) == 1
