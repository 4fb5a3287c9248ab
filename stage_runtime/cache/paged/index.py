"""The paged activation index: pages of token-major rows, shared across prompts.

Restoring walks the chain from the start: the longest run of cached pages (plus the tail when the
whole prompt matches) is returned as a :class:`~stage_runtime.cache.paged.results.PagedRestore`
that hands out the page views (no copy) or assembles them (at most one copy). Eviction goes over
*leaves*: a page is never evicted while a longer entry of its chain is cached, so a cached chain
never has a gap.

Everything here is synchronous, single-owner and free of trio; the stage cache's
:class:`~stage_runtime.cache.paged.stage_index.PagedIndex` turns activation frames into payloads
and back.
"""

from __future__ import annotations

import operator
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from itertools import repeat
from typing import cast

import attrs
import numpy as np
import numpy.typing as npt

from stage_runtime._validators import check_int_in
from stage_runtime.accounting import MissReason, MissTracker, PrefixFootprint
from stage_runtime.cache.paged.chains import (
    PageChain,
    RecentChains,
    _page_chain,
    _private_tokens,
)
from stage_runtime.cache.paged.entries import (
    Footprint,
    _consume,
    _Entry,
    _footprint_segments,
    _key_of,
    _segments_of,
    _Shape,
    _Shapes,
    _stored,
)
from stage_runtime.cache.paged.eviction import EvictionStrategy, LruEviction, eviction_for
from stage_runtime.cache.paged.results import (
    EntryKind,
    EvictedPage,
    EvictedPages,
    PagedIndexStats,
    PagedLookup,
    PagedRecordOutcome,
    PagedRestore,
    Payload,
    _Eviction,
)
from stage_runtime.cache.resident import EvictionReason
from stage_runtime.config import PageEviction
from stage_runtime.errors import ConfigError, FrameError
from stage_runtime.limits import U64_MAX

__all__ = ["PagedActivationIndex"]

_shape_of = operator.attrgetter("shape")
_first = operator.itemgetter(0)
_second = operator.itemgetter(1)


def _to_eviction(value: object) -> PageEviction:
    """``"lru"``, ``"reuse"`` or a :class:`PageEviction`, as a PageEviction."""
    if isinstance(value, str) and value in PageEviction.__members__.values():
        return PageEviction(value)
    msg = f"eviction must be 'lru', 'reuse' or 'adaptive', got {value!r}"
    raise ConfigError(msg)


class _Recording:
    """The running record: its chain, row size and description, what it stored, reused and
    evicted so far."""

    __slots__ = (
        "bytes_per_token",
        "chain",
        "evicted",
        "meta",
        "page_shape",
        "reused_entries",
        "stored_bytes",
        "stored_entries",
    )

    def __init__(self, chain: PageChain, bytes_per_token: int, meta: Hashable) -> None:
        self.chain = chain
        self.bytes_per_token = bytes_per_token
        self.meta = meta
        self.page_shape: _Shape | None = None
        """The :class:`_Shape` of the record's full pages (once it pages the frame)."""
        self.evicted: list[_Eviction] = []
        self.stored_entries = 0
        self.stored_bytes = 0
        self.reused_entries = 0


# No on-setattr hooks: the index updates its counters on every page it stores.
@attrs.define(eq=False, on_setattr=attrs.setters.NO_OP)
class PagedActivationIndex:
    """Pages of token-major activation rows, shared across prompts, evicted leaf-first by LRU.

    Bounds are the ladder's: ``max_entries`` entries (pages, tails and exact entries each count
    one) and ``max_bytes`` payload bytes (``0`` = no byte bound). When the bounds cannot fit the
    next page of a prompt without evicting that prompt's own chain, recording stops there: the
    prefix recorded so far stays restorable.
    """

    page_tokens: int = attrs.field()
    max_entries: int = attrs.field()
    max_bytes: int = attrs.field(default=0)
    min_tokens: int = attrs.field(default=0)
    """Prompts shorter than this are not recorded; restores shorter than this are misses."""
    tombstones: int = attrs.field(default=65536)
    """Evicted keys remembered to classify misses as ``evicted``."""
    eviction: PageEviction = attrs.field(default=PageEviction.LRU, converter=_to_eviction)
    """``lru``: the least recently used leaf goes first; ``reuse``: the least valuable by reuse
    (GreedyDual-style). See :mod:`stage_runtime.cache.paged.eviction`."""

    _entries: OrderedDict[bytes, _Entry] = attrs.field(factory=OrderedDict, init=False)
    """Every resident entry by key (under ``lru`` also the eviction order, oldest first)."""
    _eviction: EvictionStrategy = attrs.field(init=False)
    """Which leaf goes first (:mod:`stage_runtime.cache.paged.eviction`)."""
    _clock: int = attrs.field(default=0, init=False)
    _resident_bytes: int = attrs.field(default=0, init=False)
    _kinds: dict[str, int] = attrs.field(
        factory=lambda: {"page": 0, "tail": 0, "exact": 0}, init=False
    )
    _misses: MissTracker = attrs.field(init=False)
    _footprint: PrefixFootprint = attrs.field(factory=PrefixFootprint, init=False)
    _unfootprinted: dict[bytes, Footprint] = attrs.field(factory=dict, init=False)
    """The token segments (:func:`_footprint_segments`) of the resident entries not yet added
    to the footprint, by key, in the order they were stored: the footprint's token tries are
    built only when :meth:`unique_prefix_bytes` is read, so entries evicted before never pay for
    it. (Their bytes, not the entries: a dict that holds no object the garbage collector tracks
    is not tracked itself, and its full collections would visit each entry once more.)"""
    _shapes: _Shapes = attrs.field(factory=_Shapes, init=False)
    """What the entries of a record share, one object per distinct shape."""
    _recent_chains: RecentChains = attrs.field(factory=RecentChains, init=False)
    """Chains :meth:`chain` computed lately, by first page key, oldest first."""
    _lookups: int = attrs.field(default=0, init=False)
    _hits: int = attrs.field(default=0, init=False)
    _miss_counts: dict[str, int] = attrs.field(
        factory=lambda: {"never_seen": 0, "evicted": 0, "rejected": 0}, init=False
    )
    _restored_tokens: int = attrs.field(default=0, init=False)
    _records: int = attrs.field(default=0, init=False)
    _evictions: int = attrs.field(default=0, init=False)
    _evicted_bytes: int = attrs.field(default=0, init=False)

    def __attrs_post_init__(self) -> None:
        for name, value, low in (
            ("page_tokens", self.page_tokens, 1),
            ("max_entries", self.max_entries, 1),
            ("max_bytes", self.max_bytes, 0),
            ("min_tokens", self.min_tokens, 0),
            ("tombstones", self.tombstones, 0),
        ):
            check_int_in(name, value, low=low, high=U64_MAX)
        self._misses = MissTracker(capacity=self.tombstones)
        self._eviction = eviction_for(self.eviction, self)

    # ---------------------------------------------------------------- keys

    def chain(
        self,
        namespace: bytes,
        tokens: Sequence[int] | npt.NDArray[np.integer],
        *,
        label: str = "act",
    ) -> PageChain:
        """The :class:`PageChain` of ``tokens`` with this index's page size.

        The same keys as :func:`page_chain`; the leading pages a recent prompt shared token for
        token are not hashed again (their keys are taken from that prompt's chain).
        """
        ids = _private_tokens(tokens)
        return _page_chain(
            namespace, ids, self.page_tokens, label, self._recent_chains, shared=ids is tokens
        )

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    @property
    def resident_bytes(self) -> int:
        """Payload bytes of the resident entries."""
        return self._resident_bytes

    # ---------------------------------------------------------------- record

    def record(
        self,
        chain: PageChain,
        payload: Payload,
        *,
        meta: Hashable = None,
        token_major: bool = True,
    ) -> PagedRecordOutcome:
        """Store the activation rows of ``chain``'s prompt, page by page.

        Pages already cached (recorded by any prompt with the same prefix) are only refreshed.

        Args:
            chain: the prompt's keys, from :meth:`chain`.
            payload: 1-D ``uint8`` payload of the whole prompt's activation (token-major rows when
                ``token_major``). Real bytes are copied once per new page; zero-stride (virtual)
                payloads are kept as views and allocate nothing.
            meta: anything hashable describing the rows besides their count (dtype, layers...);
                a restore only joins pages whose ``meta`` agree.
            token_major: ``False`` for payloads that cannot be cut into rows; they are stored
                whole as one exact-length entry.

        Raises:
            FrameError: ``payload`` is not a 1-D ``uint8`` array.
        """
        if payload.ndim != 1 or payload.dtype != np.uint8:
            msg = f"payload must be a 1-D uint8 array, got {payload.dtype} shape {payload.shape}"
            raise FrameError(msg)
        self._eviction.record_started()
        try:
            return self._record(chain, payload, meta, token_major)
        except BaseException:
            # Interrupted between pages (a KeyboardInterrupt, a MemoryError): the strategy
            # still hears the record end, so the pages stored so far stay evictable. LRU orders
            # the chain from its deepest entry (else its new pages would stay oldest first,
            # parents before children, and a parent could go before its child); the other
            # strategies follow the running record themselves.
            last = None
            if type(self._eviction) is LruEviction and chain.token_count:
                whole = _whole_only(payload, chain.token_count, token_major)
                last = self._deepest_resident(chain, exact=whole)
            self._eviction.record_ended(last)
            raise

    def _deepest_resident(self, chain: PageChain, *, exact: bool) -> _Entry | None:
        """Where a record of ``chain`` got to: its exact entry when ``exact``, else the deepest
        of its pages (and tail) resident now, following them from the first."""
        entries = self._entries
        if exact:
            return entries.get(chain.exact_key)
        last: _Entry | None = None
        for key in chain.page_keys:
            entry = entries.get(key)
            if entry is None:
                return last
            last = entry
        tail = None if chain.tail_key is None else entries.get(chain.tail_key)
        return tail if tail is not None and tail.parent is last else last

    def _record(
        self, chain: PageChain, payload: Payload, meta: Hashable, token_major: bool
    ) -> PagedRecordOutcome:
        n = chain.token_count
        if n == 0 or n < self.min_tokens or payload.size == 0:
            return self._outcome(_Recording(chain, 0, meta), None, truncated=False)
        if _whole_only(payload, n, token_major):
            bpt = payload.size // n if payload.size % n == 0 else 0
            op = _Recording(chain, bpt, meta)
            entry = self._put(op, chain.exact_key, "exact", None, 0, n, payload)
            return self._outcome(op, entry, truncated=entry is None)
        bpt = payload.size // n
        op = _Recording(chain, bpt, meta)
        p = chain.page_tokens
        keys = chain.page_keys
        # Pages already cached come first (a cached page's parent is always cached): refresh
        # them; every page after the first missing one is new (_put_new_pages). Under LRU, when
        # nothing can be evicted before the record ends, whose end (record_ended) makes the
        # whole chain the newest, a refresh need not touch each page.
        op.page_shape = self._shapes.get(
            (chain.label, "page", chain.root_key, p, p * bpt, bpt, meta)
        )
        touch = type(self._eviction) is not LruEviction or not self._fits_without_eviction(
            len(keys), n * bpt
        )
        parent, first_new = self._refresh(op, payload, touch=touch)
        if first_new < 0:  # the bounds refused a page re-recorded with other rows
            return self._outcome(op, parent, truncated=True)
        if first_new < len(keys):
            parent, complete = self._put_new_pages(op, first_new, parent, payload)
            if not complete:
                return self._outcome(op, parent, truncated=True)
        if chain.tail_key is not None:
            i = len(keys)
            segment = payload[i * p * bpt :]
            entry = self._put(op, chain.tail_key, "tail", parent, i * p, n - i * p, segment)
            if entry is None:
                return self._outcome(op, parent, truncated=True)
            parent = entry
        return self._outcome(op, parent, truncated=False)

    def _fits_without_eviction(self, pages: int, payload_bytes: int) -> bool:
        """Whether a record of ``pages`` pages, a tail and ``payload_bytes`` bytes in all fits
        the bounds as they are, new or not: then it evicts nothing."""
        return len(self._entries) + pages + 1 <= self.max_entries and (
            not self.max_bytes or self._resident_bytes + payload_bytes <= self.max_bytes
        )

    def _refresh(
        self, op: _Recording, payload: Payload, *, touch: bool
    ) -> tuple[_Entry | None, int]:
        """Refresh the chain's cached pages, up to the first one not cached (touching each when
        ``touch``); returns the last entry refreshed and the index of the first page not cached.
        A page with other rows is re-recorded (:meth:`_put`, which touches it either way); when
        the bounds refuse that, the index returned is -1 - the page's."""
        chain = op.chain
        keys = chain.page_keys
        entries = self._entries
        p, bpt, meta = chain.page_tokens, op.bytes_per_token, op.meta
        lru = type(self._eviction) is LruEviction  # (its touch: a move to the newest end)
        touched = entries.move_to_end if lru else self._eviction.touched
        size = p * bpt
        same = op.page_shape
        parent: _Entry | None = None
        for i, key in enumerate(keys):
            existing = entries.get(key)
            if existing is None:
                return parent, i
            shape = existing.shape
            if shape is same or (
                shape.nbytes == size
                and shape.bytes_per_token == bpt
                and (shape.meta is meta or shape.meta == meta)
            ):
                if touch:  # _put of a cached page with the same rows, inline: _touch
                    self._clock += 1
                    existing.last_used = self._clock
                    touched(key if lru else existing)  # type: ignore[arg-type]
                op.reused_entries += 1
                parent = existing
                continue
            segment = payload[i * size : (i + 1) * size]
            entry = self._put(op, key, "page", parent, i * p, p, segment)
            if entry is None:
                return parent, -1 - i
            parent = entry
        return parent, len(keys)

    def _outcome(
        self, op: _Recording, last: _Entry | None, *, truncated: bool
    ) -> PagedRecordOutcome:
        self._eviction.record_ended(last)
        return PagedRecordOutcome(
            stored_entries=op.stored_entries,
            stored_bytes=op.stored_bytes,
            reused_entries=op.reused_entries,
            covered_tokens=0 if last is None else last.token_start + last.token_count,
            truncated=truncated,
            evicted=EvictedPages(op.evicted),
            last_key=None if last is None else last.key,
            last_entry="" if last is None else last.name,
            entries=len(self._entries),
            resident_bytes=self._resident_bytes,
        )

    def _put(
        self,
        op: _Recording,
        key: bytes,
        kind: EntryKind,
        parent: _Entry | None,
        token_start: int,
        token_count: int,
        segment: Payload,
    ) -> _Entry | None:
        """Store (or refresh) one entry of the running record after ``parent``; None when the
        bounds cannot fit it without evicting the record's own chain."""
        existing = self._entries.get(key)
        if existing is None:
            if not self._eviction.make_room(
                int(segment.size), parent, None, op.evicted, new_entry=True
            ):
                return None
            return self._store_new(
                op, key, kind, parent, token_start, token_count, _stored(segment)
            )
        bpt, meta = op.bytes_per_token, op.meta
        if (
            (existing.meta is not meta and existing.meta != meta)
            or existing.bytes_per_token != bpt
            or existing.nbytes != segment.size
        ):
            # A re-record with different rows replaces them in place; like the ladder's
            # re-record, this is not an eviction, but the bounds still hold: a larger
            # replacement evicts other leaves first, and is refused (the old rows stay) when
            # only this prompt's own chain could make room.
            grow = int(segment.size) - existing.nbytes
            if grow > 0 and not self._eviction.make_room(
                grow, parent, existing, op.evicted, new_entry=False
            ):
                return None
            self._resident_bytes += grow
            op.stored_bytes += int(segment.size)
            existing.payload = _stored(segment)
            was = existing.shape
            existing.shape = self._shapes.get(
                (was.label, was.kind, was.root, was.token_count, int(segment.size), bpt, meta)
            )
            self._uncount_footprint(key)
            self._unfootprinted[key] = _footprint_segments(op.chain, existing)
        self._touch(existing)
        op.reused_entries += 1
        return existing

    def _store_new(
        self,
        op: _Recording,
        key: bytes,
        kind: EntryKind,
        parent: _Entry | None,
        token_start: int,
        token_count: int,
        payload: Payload,
        footprint: Footprint | None = None,
    ) -> _Entry:
        """Store a new entry (room already made) after ``parent``, holding ``payload`` (its own
        bytes or a virtual view: see :func:`_stored`); ``footprint``: its
        :func:`_footprint_segments`, when the caller has them."""
        self._clock += 1
        size = int(payload.size)
        chain = op.chain
        shape = self._shapes.get(
            (chain.label, kind, chain.root_key, token_count, size, op.bytes_per_token, op.meta)
        )
        entry = _Entry(key, parent, token_start, payload, shape, self._clock)
        self._entries[key] = entry
        self._kinds[kind] += 1
        self._resident_bytes += size
        self._eviction.stored(entry, parent)
        self._misses.cached(key)
        self._unfootprinted[key] = (
            _footprint_segments(chain, entry) if footprint is None else footprint
        )
        self._records += 1
        op.stored_entries += 1
        op.stored_bytes += size
        return entry

    def _put_new_pages(
        self, op: _Recording, first: int, parent: _Entry | None, payload: Payload
    ) -> tuple[_Entry | None, bool]:
        """:meth:`_store_new` of full pages ``first``.. of the chain, known not to be cached.
        Returns the last entry of the chain now stored and whether every page was."""
        chain = op.chain
        p = chain.page_tokens
        size = p * op.bytes_per_token
        keys = chain.page_keys
        stop = len(keys)
        eviction = self._eviction
        fit = eviction.room_for_pages(stop - first, size, op.evicted)
        if fit >= 0:
            stop = first + fit
        # A slice of a zero-stride payload is a zero-stride view (kept as is, see _stored), and
        # every page-sized slice of it is the same view: one is cut and shared by all the pages.
        shared = payload[:size] if size > 1 and payload.strides[0] == 0 else None
        # Each page's footprint segment (_footprint_segments), cut with the others stored.
        tokens = chain.tokens
        page_rows = _segments_of(tokens).page_rows(tokens, p, first)
        # _store_new of each page, inline (a long prompt stores hundreds of pages per stage):
        # the counters nothing reads meanwhile are added once, after the loop.
        entries = self._entries
        unfootprinted = self._unfootprinted
        stored = None if type(eviction) is LruEviction else eviction.stored  # (LRU: no-op)
        shape = op.page_shape
        assert shape is not None
        # With all the room made at once, the new pages' tombstones go in one call after the
        # loop; a strategy that makes room page by page buries other keys between pages, and
        # each page's tombstone must go before (a full tracker then drops the same ones).
        forget = None if fit >= 0 else self._misses.cached
        done = first
        try:
            for i in range(first, stop):
                if forget is not None:
                    if not eviction.page_room(size, parent, op.evicted):
                        stop = i  # the bounds cannot fit this page: the chain ends before it
                        break
                    forget(keys[i])
                segment = (
                    shared if shared is not None else _stored(payload[i * size : (i + 1) * size])
                )
                key = keys[i]
                self._clock = clock = self._clock + 1
                entry = _Entry(key, parent, i * p, segment, shape, clock)
                entries[key] = entry
                unfootprinted[key] = page_rows[i]
                self._resident_bytes += size
                done = i + 1
                if stored is not None:
                    stored(entry, parent)
                parent = entry
        finally:  # (also when interrupted: the counters cover every page stored)
            pages = done - first
            self._kinds["page"] += pages
            self._records += pages
            op.stored_entries += pages
            op.stored_bytes += pages * size
            if forget is None:
                self._misses.cached_all(keys[first:done])
        return parent, stop == len(keys)

    def _uncount_footprint(self, key: bytes) -> None:
        if self._unfootprinted.pop(key, None) is None:
            self._footprint.remove(key)

    def _count_footprint(self, footprint: Footprint, entry: _Entry) -> None:
        """Add ``entry``'s token rows (its :func:`_footprint_segments`) to the footprint."""
        bpt = entry.bytes_per_token or max(entry.nbytes // entry.token_count, 1)
        if isinstance(footprint, bytes):
            self._footprint.add_segment(entry.key, entry.group, footprint, bpt)
        else:
            self._footprint.add(entry.key, footprint, bpt)

    def _touch(self, entry: _Entry) -> None:
        """Mark ``entry`` used now by a record (the eviction strategy reorders it; a restore's
        uses are :meth:`EvictionStrategy.restored`)."""
        self._clock += 1
        entry.last_used = self._clock
        self._eviction.touched(entry)

    def _evict_all(
        self, victims: list[tuple[_Entry, EvictionReason]], evicted: list[_Eviction]
    ) -> None:
        """Remove ``victims`` in order, appending what they were to ``evicted``."""
        if not victims:
            return
        gone = list(map(_first, victims))
        keys = list(map(_key_of, gone))
        shapes = list(map(_shape_of, gone))
        reasons: list[EvictionReason] = list(map(_second, victims))
        strategy = self._eviction
        if type(strategy) is LruEviction:  # (no hook)
            self._evict_oldest(gone, keys, shapes, reasons, evicted)
            return
        entries = self._entries
        before = len(entries)
        hook = strategy.evicted
        done = 0
        try:
            # Each removed before its hook runs: a parent's hook sees its children gone.
            for entry, reason in victims:
                del entries[entry.key]
                done += 1
                hook(entry, reason)
        finally:  # (the bookkeeping covers every entry removed, even if interrupted)
            if done < len(gone):
                del gone[done:], keys[done:], shapes[done:], reasons[done:]
            self._removed(gone, keys, shapes, reasons, before, evicted)

    def _evict_oldest(
        self,
        gone: list[_Entry],
        keys: list[bytes],
        shapes: list[_Shape],
        reasons: list[EvictionReason] | EvictionReason,
        evicted: list[_Eviction],
    ) -> None:
        """Remove ``gone`` (with their ``keys`` and ``shapes``; ``reasons``: one each, or one
        for all) under LRU, which hears of no eviction: in one C loop."""
        if not gone:
            return
        before = len(self._entries)
        try:
            _consume(map(self._entries.__delitem__, keys))
        finally:  # (nothing runs between those deletions: all or none are gone)
            self._removed(gone, keys, shapes, reasons, before, evicted)

    def _removed(
        self,
        gone: list[_Entry],
        keys: list[bytes],
        shapes: list[_Shape],
        reasons: list[EvictionReason] | EvictionReason,
        entries_before: int,
        evicted: list[_Eviction],
    ) -> None:
        """The bookkeeping of ``gone`` (with their ``keys``, ``shapes`` and ``reasons``), just
        removed from the entries, of which there were ``entries_before``: the counters, the
        footprint, the tombstones, and a record of them appended to ``evicted`` (made into
        :class:`EvictedPage` records only when read). Per call where it can be, not per entry
        (a tight bound evicts some 25 pages per record)."""
        if not gone:
            return
        resident = self._resident_bytes
        nbytes = 0
        pages = 0
        counts = self._kinds
        for shape in shapes:
            nbytes += shape.nbytes
            if shape.kind == "page":
                pages += 1
            else:
                counts[shape.kind] -= 1
        counts["page"] -= pages
        self._resident_bytes = resident - nbytes
        # Entries not yet in the footprint leave only _unfootprinted (usually all of them: the
        # footprint is read rarely); the others leave the footprint.
        unfootprinted = self._unfootprinted
        waiting = len(unfootprinted)
        held = list(map(unfootprinted.pop, keys, repeat(None)))
        if waiting - len(unfootprinted) < len(keys):
            remove = self._footprint.remove
            for key, segments in zip(keys, held, strict=True):
                if segments is None:
                    remove(key)
        buried = keys
        buried_bytes = nbytes
        if reasons == "cleared" or (not isinstance(reasons, str) and "cleared" in reasons):
            # (Not the bounds' doing: no tombstone, not counted as evictions.)
            each = [reasons] * len(keys) if isinstance(reasons, str) else reasons
            buried = []
            buried_bytes = 0
            for key, shape, reason in zip(keys, shapes, each, strict=True):
                if reason != "cleared":
                    buried.append(key)
                    buried_bytes += shape.nbytes
        self._evictions += len(buried)
        self._evicted_bytes += buried_bytes
        if buried:
            self._misses.evicted_new(buried)
        starts = [entry.token_start for entry in gone]
        evicted.append(_Eviction(keys, starts, shapes, reasons, entries_before, resident, nbytes))

    # ---------------------------------------------------------------- restore

    def restore(self, chain: PageChain) -> PagedLookup:
        """Find the longest cached run of ``chain``'s pages from token 0.

        The run ends at the first page that is missing or fails validation (row size, token count
        or ``meta`` disagreeing with the first page); nothing past that point is used. The tail
        entry joins only when every page matched, making the restore cover the whole prompt. An
        exact entry (a frame that could not be paged) is used when pages do not cover the whole
        prompt. A run shorter than ``min_tokens`` is a miss. A hit refreshes the recency of every
        entry it used, in token order.
        """
        self._lookups += 1
        n = chain.token_count
        entries = self._entries
        p = chain.page_tokens
        keys = chain.page_keys
        reason: MissReason | None = None
        # The cached run, found at C speed: every page's entry (None past the run's end), and
        # then whether every one of them has the first one's rows (one shape object, usually).
        found: list[_Entry | None] = list(map(entries.get, keys))
        found.append(None)
        run = found.index(None)
        used = cast("list[_Entry]", found[:run])
        if run:
            shape = used[0].shape
            if not (
                shape.token_count == p
                and shape.bytes_per_token > 0
                and shape.nbytes == p * shape.bytes_per_token
                and list(map(_shape_of, used)).count(shape) == run
            ):
                run = self._valid_run(used, p)
                del used[run:]
        if run < len(keys):
            reason = self._probe(keys[run], p, used[0] if used else None)[1]
        elif chain.tail_key is not None:
            entry, reason = self._probe(chain.tail_key, n - run * p, used[0] if used else None)
            if entry is not None:
                used.append(entry)
        covered = n if len(used) > run else run * p
        if covered < n and self._kinds["exact"]:  # (the key is computed when first read)
            exact = self._entries.get(chain.exact_key)
            if exact is not None:
                if exact.token_count == n and (
                    exact.bytes_per_token == 0 or exact.payload.size == n * exact.bytes_per_token
                ):
                    used = [exact]
                    covered = n
                else:
                    reason = "rejected"
        if covered == 0 or covered < self.min_tokens:
            final: MissReason = reason if reason is not None else "never_seen"
            self._miss_counts[final] += 1
            return PagedLookup(restore=None, miss_reason=final)
        self._eviction.restored(used)  # (a restore touches some 40 pages: one call for all)
        self._hits += 1
        self._restored_tokens += covered
        first, last = used[0], used[-1]
        bpt = first.bytes_per_token
        # Every entry used holds whole rows of the first one's width (checked above), but an
        # exact entry that is not rows at all (bpt 0), used alone; all are pages but the last.
        counts = (p,) * (len(used) - 1) + (last.token_count,)
        return PagedLookup(
            restore=PagedRestore(
                token_count=covered,
                bytes_per_token=bpt,
                meta=first.meta,
                pages=tuple([e.payload for e in used]),
                page_token_counts=counts,
                last_key=last.key,
                entries=len(self._entries),
                payload_bytes=covered * bpt if bpt else first.nbytes,
                used=tuple(used),
            ),
            miss_reason=None,
        )

    @staticmethod
    def _valid_run(found: list[_Entry], page_tokens: int) -> int:
        """How many of ``found`` (the cached entries of a chain's first pages, in order) a
        restore may use: the first must hold whole rows of one page, and each after it rows
        like the first's (size and ``meta``); the run ends at the first that does not."""
        p = page_tokens
        first = found[0].shape
        bpt, meta = first.bytes_per_token, first.meta
        if not (first.token_count == p and bpt > 0 and found[0].payload.size == p * bpt):
            return 0
        for i, entry in enumerate(found):
            shape = entry.shape
            if shape is not first and not (
                shape.token_count == p
                and shape.bytes_per_token == bpt
                and entry.payload.size == p * bpt
                and (shape.meta is meta or shape.meta == meta)
            ):
                return i
        return len(found)

    def _probe(
        self, key: bytes, token_count: int, first: _Entry | None
    ) -> tuple[_Entry | None, MissReason | None]:
        entry = self._entries.get(key)
        if entry is None:
            return None, ("evicted" if self._misses.was_evicted(key) else "never_seen")
        valid = (
            entry.token_count == token_count
            and entry.bytes_per_token > 0
            and entry.payload.size == token_count * entry.bytes_per_token
            and (
                first is None
                or (
                    (entry.meta is first.meta or entry.meta == first.meta)
                    and entry.bytes_per_token == first.bytes_per_token
                )
            )
        )
        if not valid:
            return None, "rejected"
        return entry, None

    # ---------------------------------------------------------------- housekeeping

    def clear(self) -> tuple[EvictedPage, ...]:
        """Evict everything (reason ``"cleared"``), leaves first; counters are kept."""
        out: list[_Eviction] = []
        self._eviction.clear(out)
        return EvictedPages(out).pages

    def unique_prefix_bytes(self) -> int:
        """Bytes the distinct resident prefixes need, each token row once.

        Tails that are a prefix of a cached page (or of another tail) count once. Computed
        lazily from what changed since the last call.
        """
        count = self._count_footprint
        entries = self._entries
        for key, footprint in self._unfootprinted.items():
            count(footprint, entries[key])
        self._unfootprinted.clear()
        return self._footprint.unique_bytes()

    def statistics(self) -> PagedIndexStats:
        """Counters and residency now (cheap; see :meth:`unique_prefix_bytes` for the footprint)."""
        return PagedIndexStats(
            entries=len(self._entries),
            pages=self._kinds["page"],
            tails=self._kinds["tail"],
            exact_entries=self._kinds["exact"],
            resident_bytes=self._resident_bytes,
            lookups=self._lookups,
            hits=self._hits,
            misses_never_seen=self._miss_counts["never_seen"],
            misses_evicted=self._miss_counts["evicted"],
            misses_rejected=self._miss_counts["rejected"],
            restored_tokens=self._restored_tokens,
            records=self._records,
            evictions=self._evictions,
            evicted_bytes=self._evicted_bytes,
        )


def _whole_only(payload: Payload, token_count: int, token_major: bool) -> bool:
    """Whether a record of ``token_count`` tokens stores ``payload`` whole, as one exact entry:
    it is not token-major, or not whole rows of one width."""
    return not token_major or payload.size % token_count != 0
