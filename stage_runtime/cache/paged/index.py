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

import heapq
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from typing import Literal

import attrs
import numpy as np
import numpy.typing as npt

from stage_runtime.accounting import MissReason, MissTracker, PrefixFootprint
from stage_runtime.cache.paged.chains import PageChain, _page_chain, _private_tokens
from stage_runtime.cache.paged.entries import _Entry, _footprint_segments, _leaf_item, _stored
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
from stage_runtime.errors import ConfigError, FrameError

__all__ = ["EvictionPolicy", "PagedActivationIndex"]

EvictionPolicy = Literal["lru", "reuse"]
"""Which leaf goes first: least recently used, or least valuable by reuse (see the index)."""


@attrs.define(eq=False)
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
    eviction: EvictionPolicy = attrs.field(default="lru")
    """``lru``: the least recently used leaf goes first. ``reuse``: a GreedyDual-style policy
    weighing reuse and recompute; each entry's value is ``L + prior + hits``, where ``hits``
    counts the restores that used it, the prior is 1 for a full page (it saves a page of
    recompute for any longer prompt) and 0 for tails and exact entries (they save anything only
    when the very same prompt returns), and ``L`` rises to the value of each evicted entry, so
    old popularity ages out. Ties go to the least recently used."""

    _entries: OrderedDict[bytes, _Entry] = attrs.field(factory=OrderedDict, init=False)
    """Every resident entry by key. Under ``lru`` this is also the eviction order, oldest first,
    kept so that an entry always comes after every cached entry of its chain past it (see
    :meth:`_settle`): the oldest entry is then always a leaf, and it is the victim."""
    _leaves: list[tuple[float, int, int, _Entry]] = attrs.field(factory=list, init=False)
    """Under ``reuse``: a heap of leaves by (priority, last use), with stale items skipped."""
    _lru: bool = attrs.field(default=True, init=False)
    _op_clock: int = attrs.field(default=0, init=False)
    """The clock when the running record started: entries it touched have a later last use."""
    _inflation: float = attrs.field(default=0.0, init=False)
    _clock: int = attrs.field(default=0, init=False)
    _resident_bytes: int = attrs.field(default=0, init=False)
    _kinds: dict[str, int] = attrs.field(
        factory=lambda: {"page": 0, "tail": 0, "exact": 0}, init=False
    )
    _misses: MissTracker = attrs.field(init=False)
    _footprint: PrefixFootprint = attrs.field(factory=PrefixFootprint, init=False)
    _pin_memo: tuple[_Entry, int, int] | None = attrs.field(default=None, init=False)
    """:meth:`_pinned`'s last sum: (protected entry, entries and bytes of its chain)."""
    _unpushed: _Entry | None = attrs.field(default=None, init=False)
    """The entry the running record stored last, not yet in the leaf heap."""
    _unfootprinted: dict[bytes, tuple[list[tuple[bytes, bytes]], _Entry]] = attrs.field(
        factory=dict, init=False
    )
    """Resident entries not yet added to the footprint, in the order they were stored, with
    their token segments (:func:`_footprint_segments`): the footprint's token tries are built
    only when :meth:`unique_prefix_bytes` is read, so entries evicted before never pay for it."""
    _recent_chains: dict[bytes, PageChain] = attrs.field(factory=dict, init=False)
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
            if value < low:
                msg = f"{name} must be >= {low}, got {value}"
                raise ConfigError(msg)
        self._misses = MissTracker(capacity=self.tombstones)
        if self.eviction not in ("lru", "reuse"):
            msg = f"eviction must be 'lru' or 'reuse', got {self.eviction!r}"
            raise ConfigError(msg)
        self._lru = self.eviction == "lru"

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
        return _page_chain(
            namespace, _private_tokens(tokens), self.page_tokens, label, self._recent_chains
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
        n = chain.token_count
        evicted: list[_Eviction] = []
        stored = [0, 0, 0]  # entries, bytes, reused
        self._op_clock = self._clock
        self._pin_memo = None
        if n == 0 or n < self.min_tokens or payload.size == 0:
            return self._outcome(stored, None, truncated=False, evicted=evicted)
        if not token_major or payload.size % n:
            bpt = payload.size // n if payload.size % n == 0 else 0
            entry = self._put(
                chain,
                chain.exact_key,
                "exact",
                None,
                chain.root_key,
                0,
                n,
                payload,
                bpt,
                meta,
                evicted,
                stored,
            )
            return self._outcome(stored, entry, truncated=entry is None, evicted=evicted)
        bpt = payload.size // n
        p = chain.page_tokens
        parent: _Entry | None = None
        keys = chain.page_keys
        entries = self._entries
        first_new = 0
        # Pages already cached come first (a cached page's parent is always cached): refresh them
        # through _put; every page after the first missing one is new, and takes the fast path.
        while first_new < len(keys) and keys[first_new] in entries:
            first_new += 1
        for i, key in enumerate(keys[:first_new]):
            segment = payload[i * p * bpt : (i + 1) * p * bpt]
            entry = self._put(
                chain,
                key,
                "page",
                parent,
                chain.parent_key(i),
                i * p,
                p,
                segment,
                bpt,
                meta,
                evicted,
                stored,
            )
            if entry is None:
                return self._outcome(stored, parent, truncated=True, evicted=evicted)
            parent = entry
        if first_new < len(keys):
            parent, complete = self._put_new_pages(
                chain, first_new, parent, payload, bpt, meta, evicted, stored
            )
            if not complete:
                return self._outcome(stored, parent, truncated=True, evicted=evicted)
        if chain.tail_key is not None:
            i = len(chain.page_keys)
            segment = payload[i * p * bpt :]
            entry = self._put(
                chain,
                chain.tail_key,
                "tail",
                parent,
                chain.parent_key(i),
                i * p,
                n - i * p,
                segment,
                bpt,
                meta,
                evicted,
                stored,
            )
            if entry is None:
                return self._outcome(stored, parent, truncated=True, evicted=evicted)
            parent = entry
        return self._outcome(stored, parent, truncated=False, evicted=evicted)

    def _outcome(
        self,
        stored: list[int],
        last: _Entry | None,
        *,
        truncated: bool,
        evicted: list[_Eviction],
    ) -> PagedRecordOutcome:
        if self._lru:
            self._settle(last)
        elif self._unpushed is not None:
            self._push_if_leaf(self._unpushed)
            self._unpushed = None
        return PagedRecordOutcome(
            stored_entries=stored[0],
            stored_bytes=stored[1],
            reused_entries=stored[2],
            covered_tokens=0 if last is None else last.token_start + last.token_count,
            truncated=truncated,
            evicted=EvictedPages(evicted),
            last_key=None if last is None else last.key,
            last_entry="" if last is None else last.name,
            entries=len(self._entries),
            resident_bytes=self._resident_bytes,
        )

    def _put(
        self,
        chain: PageChain,
        key: bytes,
        kind: EntryKind,
        parent: _Entry | None,
        group: bytes,
        token_start: int,
        token_count: int,
        segment: Payload,
        bpt: int,
        meta: Hashable,
        evicted: list[_Eviction],
        stored: list[int],
    ) -> _Entry | None:
        existing = self._entries.get(key)
        if existing is not None:
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
                if grow > 0 and not self._make_room(
                    grow, parent, existing, evicted, new_entry=False
                ):
                    return None
                self._resident_bytes += grow
                existing.payload = _stored(segment)
                existing.nbytes = int(segment.size)
                existing.meta = meta
                existing.bytes_per_token = bpt
                self._uncount_footprint(key)
                self._unfootprinted[key] = (_footprint_segments(chain, existing), existing)
            self._touch(existing, hit=False)
            stored[2] += 1
            return existing
        if not self._make_room(int(segment.size), parent, None, evicted, new_entry=True):
            return None
        self._clock += 1
        entry = _Entry(
            key=key,
            label=chain.label,
            kind=kind,
            parent=parent,
            group=group,
            token_start=token_start,
            token_count=token_count,
            payload=_stored(segment),
            nbytes=int(segment.size),
            bytes_per_token=bpt,
            meta=meta,
            last_used=self._clock,
        )
        if self.eviction == "reuse":
            entry.priority = self._inflation + (1.0 if kind == "page" else 0.0)
        self._entries[key] = entry
        self._kinds[kind] += 1
        self._resident_bytes += int(segment.size)
        if not self._lru:
            if parent is not None:
                parent.children += 1
            # The new entry joins the leaf heap only when the record ends (:meth:`_outcome`): the
            # next page of the chain makes it inner at once, and until then it is the protected
            # parent of that page anyway.
            previous = self._unpushed
            if previous is not None and previous is not parent:
                self._push_if_leaf(previous)
            self._unpushed = entry
        self._misses.cached(key)
        self._unfootprinted[key] = (_footprint_segments(chain, entry), entry)
        self._records += 1
        stored[0] += 1
        stored[1] += int(segment.size)
        return entry

    def _put_new_pages(
        self,
        chain: PageChain,
        first: int,
        parent: _Entry | None,
        payload: Payload,
        bpt: int,
        meta: Hashable,
        evicted: list[_Eviction],
        stored: list[int],
    ) -> tuple[_Entry | None, bool]:
        """:meth:`_put` of full pages ``first``.. of ``chain``, known not to be cached (the hot
        path). Returns the last entry of the chain now stored and whether every page was."""
        p = chain.page_tokens
        size = p * bpt
        keys = chain.page_keys
        entries = self._entries
        max_entries = self.max_entries
        max_bytes = self.max_bytes
        label = chain.label
        # A slice of a zero-stride payload is a zero-stride view (kept as is, see _stored), and
        # every page-sized slice of it is the same view: one is cut and shared by all the pages.
        virtual = size > 1 and payload.strides[0] == 0
        shared = payload[:size] if virtual else None
        prior = 1.0 if self.eviction == "reuse" else None
        cached = self._misses.cached
        unfootprinted = self._unfootprinted
        group = chain.root_key if first == 0 else keys[first - 1]
        lru = self._lru
        unpushed = self._unpushed
        stop = len(keys)
        if lru:
            # Under LRU the victims are the oldest entries whatever is stored meanwhile, so room
            # for every page is made at once (the same victims, in the same order, as page by
            # page); when it cannot be, the chain ends at the last page that fits.
            count = stop - first
            victims, ok, remaining, remaining_bytes = self._lru_victims(count * size, None, count)
            if not ok:
                # Only the first pages can fit, even with every evictable entry gone: evict
                # just what those need (nothing when none fits), and end the chain there.
                fit = min(count, max_entries - remaining)
                if max_bytes:
                    fit = min(fit, (max_bytes - remaining_bytes) // size)
                fit = max(fit, 0)
                victims = self._lru_victims(fit * size, None, fit)[0] if fit else []
                stop = first + fit
            self._evict_all(victims, evicted)
        for i in range(first, stop):
            full = not lru and (
                len(entries) >= max_entries
                or (max_bytes and self._resident_bytes + size > max_bytes)
            )
            if full and not self._make_room(size, parent, None, evicted, new_entry=True):
                stop = i  # the bounds cannot fit this page: the chain ends before it
                break
            key = keys[i]
            if shared is not None:
                segment = shared
            else:
                segment = np.array(payload[i * size : (i + 1) * size], dtype=np.uint8, copy=True)
                segment.flags.writeable = False
            self._clock += 1
            start = i * p
            entry = _Entry(
                key,
                label,
                "page",
                parent,
                group,
                start,
                p,
                segment,
                size,
                bpt,
                meta,
                self._clock,
            )
            if prior is not None:
                entry.priority = self._inflation + prior
            entries[key] = entry
            self._resident_bytes += size
            if not lru:
                if parent is not None:
                    parent.children += 1
                # A new entry joins the leaf heap only when the record ends (:meth:`_outcome`):
                # the next page of the chain makes it inner at once.
                if unpushed is not None and unpushed is not parent:
                    self._push_if_leaf(unpushed)
                unpushed = entry
            cached(key)
            unfootprinted[key] = (_footprint_segments(chain, entry), entry)
            parent = entry
            group = key
        self._unpushed = unpushed
        count = stop - first
        self._kinds["page"] += count
        self._records += count
        stored[0] += count
        stored[1] += count * size
        return parent, stop == len(keys)

    def _uncount_footprint(self, key: bytes) -> None:
        if self._unfootprinted.pop(key, None) is None:
            self._footprint.remove(key)

    def _count_footprint(self, segments: list[tuple[bytes, bytes]], entry: _Entry) -> None:
        """Add ``entry``'s token rows (its :func:`_footprint_segments`) to the footprint."""
        size = entry.nbytes
        bpt = entry.bytes_per_token or max(size // entry.token_count, 1)
        self._footprint.add(entry.key, segments, bpt)

    def _push_if_leaf(self, entry: _Entry) -> None:
        if entry.children == 0 and self._entries.get(entry.key) is entry:
            heapq.heappush(self._leaves, _leaf_item(entry))

    def _make_room(
        self,
        size: int,
        protect: _Entry | None,
        also: _Entry | None,
        evicted: list[_Eviction],
        *,
        new_entry: bool,
    ) -> bool:
        """Evict leaves (never ``protect`` or ``also``) until ``size`` more bytes, and one more
        entry when ``new_entry``, fit the bounds; False when only protected leaves remain."""
        if self._lru:
            return self._make_room_lru(size, also, evicted, new_entries=int(new_entry))
        if self.max_bytes and size > self.max_bytes:
            return False  # it can never fit: evicting would free room for nothing
        entries = self._entries
        leaves = self._leaves
        max_bytes = self.max_bytes
        limit = self.max_entries - 1 if new_entry else len(entries)  # entries that may stay
        held: list[tuple[float, int, int, _Entry]] = []
        ok = True
        checked = False
        while True:
            if len(entries) > limit:
                reason: Literal["max_entries", "max_bytes"] = "max_entries"
            elif max_bytes and self._resident_bytes + size > max_bytes:
                reason = "max_bytes"
            else:
                break
            if not checked:
                # Evicting is only worth it if it can make the room: what can never go (this
                # prompt's chain so far and the entry being replaced) must leave enough.
                checked = True
                count, nbytes = self._pinned(protect, also)
                if count > limit or (max_bytes and nbytes + size > max_bytes):
                    return False
            # The least recently used resident leaf (as _pop_leaf), skipping the protected ones.
            victim = None
            while leaves:
                item = heapq.heappop(leaves)
                entry = item[3]
                if (
                    entry.children == 0
                    and entry.last_used == item[1]
                    and entry.priority == item[0]
                    and entries.get(entry.key) is entry
                ):
                    if entry is protect or entry is also:
                        held.append(item)
                        continue
                    victim = entry
                    break
            if victim is None:
                ok = False
                break
            self._evict_all([(victim, reason)], evicted)
        for item in held:
            heapq.heappush(leaves, item)
        return ok

    def _pinned(self, protect: _Entry | None, also: _Entry | None) -> tuple[int, int]:
        """Entries and bytes that :meth:`_make_room` can never evict: ``protect`` with its
        ancestors (a cached entry's parent is cached, and is never a leaf), and ``also``.

        Pages of one record are protected in chain order, so the sum is carried over from the
        previous call of the record (reset when a record starts) instead of walking the chain."""
        memo = self._pin_memo
        if protect is None:
            count = nbytes = 0
        elif memo is not None and memo[0] is protect:
            _, count, nbytes = memo
        elif memo is not None and protect.parent is memo[0]:
            count, nbytes = memo[1] + 1, memo[2] + protect.nbytes
        else:
            count = nbytes = 0
            entry: _Entry | None = protect
            while entry is not None:
                count += 1
                nbytes += entry.nbytes
                entry = entry.parent
        if protect is not None:
            self._pin_memo = (protect, count, nbytes)
        if also is not None and also is not protect:
            count += 1
            nbytes += also.nbytes
        return count, nbytes

    def _make_room_lru(
        self, size: int, also: _Entry | None, evicted: list[_Eviction], *, new_entries: int
    ) -> bool:
        """:meth:`_make_room` under ``lru`` for ``new_entries`` entries of ``size`` bytes in all:
        the victims are the oldest entries, in order.

        Entries the running record touched are the newest (it moved them to the end), so meeting
        one means that only this prompt's own chain is left: nothing more can go. ``also`` (an
        entry being re-recorded, not yet touched) is passed over; the entry after it is still a
        leaf, since ``also``'s parent, if any, was touched. Each victim's reason is the first bound
        (entries, then bytes) that the new entries, all together, would still exceed; it can
        differ from page-by-page making room only when both bounds bind.
        """
        victims, ok, _, _ = self._lru_victims(size, also, new_entries)
        if ok:  # when the room cannot be made, evicting would free it for nothing
            self._evict_all(victims, evicted)
        return ok

    def _lru_victims(
        self, size: int, also: _Entry | None, new_entries: int
    ) -> tuple[list[tuple[_Entry, EvictionReason]], bool, int, int]:
        """The victims :meth:`_make_room_lru` would evict, whether that makes the room, and the
        entries and bytes that would remain. Evicts nothing."""
        max_bytes = self.max_bytes
        count = len(self._entries)
        limit = self.max_entries - new_entries if new_entries else count  # entries that may stay
        resident = self._resident_bytes
        op_clock = self._op_clock
        victims: list[tuple[_Entry, EvictionReason]] = []
        for victim in self._entries.values():  # oldest first
            if count > limit:
                reason: EvictionReason = "max_entries"
            elif max_bytes and resident + size > max_bytes:
                reason = "max_bytes"
            else:
                break
            if victim is also:
                continue
            if victim.last_used > op_clock:
                break
            victims.append((victim, reason))
            count -= 1
            resident -= victim.nbytes
        ok = not (count > limit or (max_bytes and resident + size > max_bytes))
        return victims, ok, count, resident

    def _settle(self, last: _Entry | None) -> None:
        """Under ``lru``, end an operation that used the chain ending at ``last``: its entries
        become the newest, deepest first, so each comes after every cached entry below it.

        Every entry is then newer than its cached descendants (an operation that uses an entry
        uses its whole chain from the root), so the oldest entry is always a leaf. Among leaves
        the order is that of their last use, as under plain LRU: an operation leaves at most one
        leaf among the entries whose last use it was.
        """
        move = self._entries.move_to_end
        while last is not None:
            move(last.key)
            last = last.parent

    def _pop_leaf(self) -> _Entry | None:
        """The least recently used resident entry with no cached child, removed from the heap."""
        while self._leaves:
            priority, stamp, _, entry = heapq.heappop(self._leaves)
            if (
                self._entries.get(entry.key) is entry
                and entry.children == 0
                and entry.last_used == stamp
                and entry.priority == priority
            ):
                return entry
        return None

    def _touch(self, entry: _Entry, *, hit: bool) -> None:
        """Mark ``entry`` used now. Under ``lru`` it moves to the newest end at once (a record
        must not evict what it already touched); :meth:`_settle` orders the whole chain when the
        operation ends. Under ``reuse`` its priority is recomputed and it rejoins the leaf heap."""
        self._clock += 1
        entry.last_used = self._clock
        if hit:
            entry.hits += 1
        if self._lru:
            self._entries.move_to_end(entry.key)
            return
        prior = 1.0 if entry.kind == "page" else 0.0
        entry.priority = self._inflation + prior + entry.hits
        if entry.children == 0:
            heapq.heappush(self._leaves, _leaf_item(entry))
            if len(self._leaves) > 2 * len(self._entries) + 64:
                self._compact_leaves()

    def _compact_leaves(self) -> None:
        self._leaves = [_leaf_item(e) for e in self._entries.values() if e.children == 0]
        heapq.heapify(self._leaves)

    def _evict_all(
        self, victims: list[tuple[_Entry, EvictionReason]], evicted: list[_Eviction]
    ) -> None:
        """Remove ``victims`` in order, appending what each was to ``evicted``."""
        entries = self._entries
        kinds = self._kinds
        unfootprinted = self._unfootprinted
        tombstone = self._misses.evicted
        reuse = not self._lru
        resident = self._resident_bytes
        for entry, reason in victims:
            key = entry.key
            del entries[key]
            kind = entry.kind
            kinds[kind] -= 1
            size = entry.nbytes
            resident -= size
            parent = entry.parent
            if reuse and parent is not None:
                parent.children -= 1
                if parent.children == 0 and entries.get(parent.key) is parent:
                    heapq.heappush(self._leaves, _leaf_item(parent))
            if unfootprinted.pop(key, None) is None:
                self._footprint.remove(key)
            if reason != "cleared":
                if entry.priority > self._inflation:
                    self._inflation = entry.priority
                tombstone(key)
                self._evictions += 1
                self._evicted_bytes += size
            evicted.append(
                (
                    entry.label,
                    kind,
                    entry.token_start,
                    entry.token_count,
                    key,
                    size,
                    reason,
                    len(entries),
                    resident,
                )
            )
        self._resident_bytes = resident

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
        used: list[_Entry] = []
        reason: MissReason | None = None
        covered = 0
        for key in chain.page_keys:
            entry, reason = self._probe(key, chain.page_tokens, used[0] if used else None)
            if entry is None:
                break
            used.append(entry)
            covered += chain.page_tokens
        else:
            if chain.tail_key is not None:
                entry, reason = self._probe(chain.tail_key, n - covered, used[0] if used else None)
                if entry is not None:
                    used.append(entry)
                    covered = n
        if covered < n:
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
        # Under LRU, touching the chain deepest first leaves it in the order _settle gives.
        for entry in reversed(used) if self._lru else used:
            self._touch(entry, hit=True)
        self._hits += 1
        self._restored_tokens += covered
        first = used[0]
        return PagedLookup(
            restore=PagedRestore(
                token_count=covered,
                bytes_per_token=first.bytes_per_token,
                meta=first.meta,
                pages=tuple(e.payload for e in used),
                page_token_counts=tuple(e.token_count for e in used),
                keys=tuple(e.name for e in used),
                last_key=used[-1].key,
                entries=len(self._entries),
            ),
            miss_reason=None,
        )

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
        if self._lru:
            self._evict_all([(entry, "cleared") for entry in self._entries.values()], out)
        else:
            self._compact_leaves()
            while (victim := self._pop_leaf()) is not None:
                self._evict_all([(victim, "cleared")], out)
            self._leaves.clear()
        return EvictedPages(out).pages

    def unique_prefix_bytes(self) -> int:
        """Bytes the distinct resident prefixes need, each token row once.

        Tails that are a prefix of a cached page (or of another tail) count once. Computed
        lazily from what changed since the last call.
        """
        for segments, entry in self._unfootprinted.values():
            self._count_footprint(segments, entry)
        self._unfootprinted.clear()
        return self._footprint.unique_bytes()

    def stats(self) -> PagedIndexStats:
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
