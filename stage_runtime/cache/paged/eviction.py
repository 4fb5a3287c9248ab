"""Which leaf the paged index evicts first: three strategies behind one interface.

All evict only *leaves* (entries with no cached entry after them in their chain), so a cached
chain never has a gap, and all refuse to make room by evicting the running record's own chain.

- :class:`LruEviction` (``"lru"``): the least recently used leaf. The index's entry dict is kept
  in eviction order, oldest first, and every operation moves the chain it used to the newest end,
  deepest entry first (:meth:`LruEviction.record_ended`), so each entry is newer than its cached
  descendants: the oldest entry is always a leaf, and it is the victim. No heap, no child counts.
- :class:`ReuseEviction` (``"reuse"``): GreedyDual-style, weighing reuse and recompute. Each
  entry's value is ``L + prior + hits``, where ``hits`` counts the restores that used it, the
  prior is 1 for a full page (it saves a page of recompute for any longer prompt) and 0 for
  tails and exact entries (they save anything only when the very same prompt returns), and ``L``
  rises to the value of each evicted entry, so old popularity ages out. Ties go to the least
  recently used. Leaves wait in a heap by (value, last use); stale items are skipped.
- :class:`AdaptiveEviction` (``"adaptive"``): which pages come back, learnt online per class
  of record (whether it continued a known prefix, and how many new pages it brought); the
  class of the lowest learnt value gives up its least recently used leaf first, and leaves
  unused for many turnovers of the cache go before any.

A strategy holds the index it serves and reads its entries and bounds; the index calls it at each
event (an entry stored, touched, evicted; a record started and ended; room needed).
"""

from __future__ import annotations

import heapq
import weakref
from collections import OrderedDict, deque
from collections.abc import Sequence
from typing import Final, Protocol, cast

from stage_runtime.cache.paged.entries import _consume, _Entry, _key_of, _leaf_item, _Shape
from stage_runtime.cache.paged.results import _Eviction
from stage_runtime.cache.resident import EvictionReason
from stage_runtime.config import PageEviction

__all__ = [
    "AdaptiveEviction",
    "EvictionHost",
    "EvictionStrategy",
    "LruEviction",
    "ReuseEviction",
    "eviction_for",
]

_Victims = list[tuple[_Entry, EvictionReason]]

_Oldest = tuple[list[_Entry], list[bytes], list[_Shape]]
"""Victims with their keys and shapes (:meth:`LruEviction._oldest`)."""


class EvictionHost(Protocol):
    """What a strategy reads and calls of the index it serves
    (:class:`~stage_runtime.cache.paged.index.PagedActivationIndex`)."""

    max_entries: int
    max_bytes: int
    _entries: OrderedDict[bytes, _Entry]
    _clock: int
    _resident_bytes: int

    def _evict_all(self, victims: _Victims, evicted: list[_Eviction]) -> None: ...

    def _evict_oldest(
        self,
        gone: list[_Entry],
        keys: list[bytes],
        shapes: list[_Shape],
        reasons: list[EvictionReason] | EvictionReason,
        evicted: list[_Eviction],
    ) -> None: ...


class EvictionStrategy(Protocol):
    """What the paged index asks of its eviction policy."""

    name: PageEviction

    def record_started(self) -> None:
        """A record begins (entries it touches from now on are its own)."""

    def record_ended(self, last: _Entry | None) -> None:
        """A record used the chain ending at ``last``."""

    def stored(self, entry: _Entry, parent: _Entry | None) -> None:
        """``entry`` was stored after ``parent`` (None at a chain's root)."""

    def touched(self, entry: _Entry) -> None:
        """``entry`` was used now (its ``last_used`` and ``hits`` are updated)."""

    def restored(self, used: Sequence[_Entry]) -> None:
        """A restore used ``used`` (in token order, none of them new): each is used now (the
        index's clock moves on one per entry, for the policies that read an entry's last use,
        which also count its ``hits``)."""

    def evicted(self, entry: _Entry, reason: EvictionReason) -> None:
        """``entry`` left the index."""

    def make_room(
        self,
        size: int,
        protect: _Entry | None,
        also: _Entry | None,
        evicted: list[_Eviction],
        *,
        new_entry: bool,
    ) -> bool:
        """Evict leaves (never ``protect`` with its chain, nor ``also``) until ``size`` more
        bytes, and one more entry when ``new_entry``, fit the bounds; False when they cannot."""

    def room_for_pages(self, count: int, size: int, evicted: list[_Eviction]) -> int:
        """Before ``count`` new pages of ``size`` bytes are stored in a row: make what room
        can be made at once and return how many of them may then be stored without
        :meth:`page_room` (all of them, or the first that fit), or -1 when each page must ask
        :meth:`page_room` itself."""

    def page_room(self, size: int, parent: _Entry | None, evicted: list[_Eviction]) -> bool:
        """Room for one more new page after ``parent``; False when there is none."""

    def clear(self, evicted: list[_Eviction]) -> None:
        """Evict everything (reason ``"cleared"``), leaves first."""


def eviction_for(policy: PageEviction, index: EvictionHost) -> EvictionStrategy:
    """The strategy ``policy`` names, for ``index``.

    The strategy holds the index weakly: the index owns its strategy, and a reference back
    would make a cycle, so that an index dropped with its hundreds of thousands of entries
    waited for the next full garbage collection instead of being freed at once."""
    host = cast("EvictionHost", weakref.proxy(index))
    if policy is PageEviction.REUSE:
        return ReuseEviction(host)
    if policy is PageEviction.ADAPTIVE:
        return AdaptiveEviction(host)
    return LruEviction(host)


class LruEviction:
    """The least recently used leaf goes first (see the module docstring)."""

    name = PageEviction.LRU

    def __init__(self, index: EvictionHost) -> None:
        self._index = index
        self._op_clock = 0
        """The clock when the running record started: entries it touched have a later use."""

    def record_started(self) -> None:
        self._op_clock = self._index._clock

    def record_ended(self, last: _Entry | None) -> None:
        """The chain ending at ``last`` becomes the newest, deepest first, so each entry comes
        after every cached entry below it. Among leaves the order is that of their last use, as
        under plain LRU: an operation leaves at most one leaf among the entries it used."""
        move = self._index._entries.move_to_end
        while last is not None:
            move(last.key)
            last = last.parent

    def stored(self, entry: _Entry, parent: _Entry | None) -> None:
        pass

    def touched(self, entry: _Entry) -> None:
        # To the newest end at once: a record must not evict what it already touched.
        self._index._entries.move_to_end(entry.key)

    def restored(self, used: Sequence[_Entry]) -> None:
        # LRU reads neither an entry's last use nor its hits: a restore only moves the pages to
        # the newest end, deepest first (the order record_ended gives), in one C loop.
        _consume(map(self._index._entries.move_to_end, map(_key_of, reversed(used))))

    def evicted(self, entry: _Entry, reason: EvictionReason) -> None:
        pass

    def make_room(
        self,
        size: int,
        protect: _Entry | None,
        also: _Entry | None,
        evicted: list[_Eviction],
        *,
        new_entry: bool,
    ) -> bool:
        if also is None:
            oldest = self._oldest(size, int(new_entry))
            if oldest is not None:
                self._index._evict_oldest(*oldest, "max_bytes", evicted)
                return True
        victims, ok, _, _ = self._victims(size, also, int(new_entry))
        if ok:  # when the room cannot be made, evicting would free it for nothing
            self._index._evict_all(victims, evicted)
        return ok

    def room_for_pages(self, count: int, size: int, evicted: list[_Eviction]) -> int:
        """The victims are the oldest entries whatever is stored meanwhile, so room for every
        page is made at once (the same victims, in the same order, as page by page); when it
        cannot be, the chain ends at the last page that fits. Each victim's reason is the first
        bound the new pages, all together, would still exceed."""
        index = self._index
        oldest = self._oldest(count * size, count)
        if oldest is not None:
            index._evict_oldest(*oldest, "max_bytes", evicted)
            return count
        victims, ok, remaining, remaining_bytes = self._victims(count * size, None, count)
        fit = count
        if not ok:
            # Only the first pages can fit, even with every evictable entry gone: evict just
            # what those need (nothing when none fits).
            fit = min(count, index.max_entries - remaining)
            if index.max_bytes:
                fit = min(fit, (index.max_bytes - remaining_bytes) // size)
            fit = max(fit, 0)
            victims = self._victims(fit * size, None, fit)[0] if fit else []
        index._evict_all(victims, evicted)
        return fit

    def page_room(self, size: int, parent: _Entry | None, evicted: list[_Eviction]) -> bool:
        return True  # room_for_pages made it

    def clear(self, evicted: list[_Eviction]) -> None:
        index = self._index
        index._evict_all([(entry, "cleared") for entry in index._entries.values()], evicted)

    def _oldest(self, size: int, new_entries: int) -> _Oldest | None:
        """:meth:`_victims` (with no ``also``) when only the byte bound needs room: the oldest
        entries until the bytes fit, if none of them is the running record's, with their keys
        and shapes (one pass; no reason each: they are all ``max_bytes``); None when that does
        not settle it (the entry bound needs room too, or the bytes would need the record's own
        chain) and :meth:`_victims` must."""
        index = self._index
        entries = index._entries
        if len(entries) + new_entries > index.max_entries:
            return None
        max_bytes = index.max_bytes
        excess = index._resident_bytes + size - max_bytes
        victims: list[_Entry] = []
        keys: list[bytes] = []
        shapes: list[_Shape] = []
        if not max_bytes or excess <= 0:
            return victims, keys, shapes
        op_clock = self._op_clock
        total = 0
        for victim in entries.values():  # oldest first
            if victim.last_used > op_clock:
                return None
            shape = victim.shape
            victims.append(victim)
            keys.append(victim.key)
            shapes.append(shape)
            total += shape.nbytes
            if total >= excess:
                return victims, keys, shapes
        return None

    def _victims(
        self, size: int, also: _Entry | None, new_entries: int
    ) -> tuple[_Victims, bool, int, int]:
        """The victims room for ``new_entries`` entries of ``size`` bytes in all would take,
        whether that makes the room, and the entries and bytes that would remain. Evicts
        nothing. Entries the running record touched are the newest (it moved them to the end),
        so meeting one means that only this prompt's own chain is left; ``also`` (an entry being
        re-recorded, not yet touched) is passed over."""
        index = self._index
        max_bytes = index.max_bytes
        count = len(index._entries)
        limit = index.max_entries - new_entries if new_entries else count
        resident = index._resident_bytes
        op_clock = self._op_clock
        victims: _Victims = []
        for victim in index._entries.values():  # oldest first
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
            resident -= victim.shape.nbytes
        ok = not (count > limit or (max_bytes and resident + size > max_bytes))
        return victims, ok, count, resident


class ReuseEviction:
    """The least valuable leaf goes first, by reuse (see the module docstring)."""

    name = PageEviction.REUSE

    def __init__(self, index: EvictionHost) -> None:
        self._index = index
        self._leaves: list[tuple[float, int, int, _Entry]] = []
        """A heap of leaves by (value, last use), with stale items skipped."""
        self._inflation = 0.0
        """``L``: the value of the latest evicted entry (it only rises)."""
        self._unpushed: _Entry | None = None
        """The entry the running record stored last, not yet in the leaf heap."""
        self._pin_memo: tuple[_Entry, int, int] | None = None
        """:meth:`_pinned`'s last sum: (protected entry, entries and bytes of its chain)."""

    def record_started(self) -> None:
        self._pin_memo = None

    def record_ended(self, last: _Entry | None) -> None:
        if self._unpushed is not None:
            self._push_if_leaf(self._unpushed)
            self._unpushed = None

    def stored(self, entry: _Entry, parent: _Entry | None) -> None:
        entry.priority = self._inflation + (1.0 if entry.kind == "page" else 0.0)
        if parent is not None:
            parent.children += 1
        # A new entry joins the leaf heap only when the record ends: the next page of the chain
        # makes it inner at once, and until then it is the protected parent of that page anyway.
        previous = self._unpushed
        if previous is not None and previous is not parent:
            self._push_if_leaf(previous)
        self._unpushed = entry

    def touched(self, entry: _Entry) -> None:
        prior = 1.0 if entry.kind == "page" else 0.0
        entry.priority = self._inflation + prior + entry.hits
        if entry.children == 0:
            heapq.heappush(self._leaves, _leaf_item(entry))
            if len(self._leaves) > 2 * len(self._index._entries) + 64:
                self._compact()

    def restored(self, used: Sequence[_Entry]) -> None:
        index = self._index
        clock = index._clock
        touched = self.touched
        try:
            for entry in used:
                clock += 1
                entry.last_used = clock
                entry.hits += 1
                touched(entry)
        finally:  # (interrupted too: no later use may take a time an entry already has)
            index._clock = clock

    def evicted(self, entry: _Entry, reason: EvictionReason) -> None:
        parent = entry.parent
        if parent is not None:
            parent.children -= 1
            if parent.children == 0 and self._index._entries.get(parent.key) is parent:
                heapq.heappush(self._leaves, _leaf_item(parent))
        if reason != "cleared" and entry.priority > self._inflation:
            self._inflation = entry.priority

    def make_room(
        self,
        size: int,
        protect: _Entry | None,
        also: _Entry | None,
        evicted: list[_Eviction],
        *,
        new_entry: bool,
    ) -> bool:
        """Evicts leaf by leaf, lowest value first, skipping ``protect`` and ``also``."""
        index = self._index
        max_bytes = index.max_bytes
        if max_bytes and size > max_bytes:
            return False  # it can never fit: evicting would free room for nothing
        entries = index._entries
        leaves = self._leaves
        limit = index.max_entries - 1 if new_entry else len(entries)  # entries that may stay
        held: list[tuple[float, int, int, _Entry]] = []
        ok = True
        checked = False
        while True:
            if len(entries) > limit:
                reason: EvictionReason = "max_entries"
            elif max_bytes and index._resident_bytes + size > max_bytes:
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
            victim = None
            while leaves:
                item = heapq.heappop(leaves)
                entry = item[3]
                if self._is_current(item):
                    if entry is protect or entry is also:
                        held.append(item)
                        continue
                    victim = entry
                    break
            if victim is None:
                ok = False
                break
            index._evict_all([(victim, reason)], evicted)
        for item in held:
            heapq.heappush(leaves, item)
        return ok

    def room_for_pages(self, count: int, size: int, evicted: list[_Eviction]) -> int:
        return -1  # room is made page by page: each new page is the protected parent of the next

    def page_room(self, size: int, parent: _Entry | None, evicted: list[_Eviction]) -> bool:
        index = self._index
        full = len(index._entries) >= index.max_entries or (
            index.max_bytes and index._resident_bytes + size > index.max_bytes
        )
        return not full or self.make_room(size, parent, None, evicted, new_entry=True)

    def clear(self, evicted: list[_Eviction]) -> None:
        self._compact()
        while (victim := self._pop_leaf()) is not None:
            self._index._evict_all([(victim, "cleared")], evicted)
        self._leaves.clear()

    def _is_current(self, item: tuple[float, int, int, _Entry]) -> bool:
        """Whether a heap item still describes a resident leaf."""
        entry = item[3]
        return (
            entry.children == 0
            and entry.last_used == item[1]
            and entry.priority == item[0]
            and self._index._entries.get(entry.key) is entry
        )

    def _pop_leaf(self) -> _Entry | None:
        """The lowest resident leaf, removed from the heap."""
        leaves = self._leaves
        while leaves:
            item = heapq.heappop(leaves)
            if self._is_current(item):
                return item[3]
        return None

    def _push_if_leaf(self, entry: _Entry) -> None:
        if entry.children == 0 and self._index._entries.get(entry.key) is entry:
            heapq.heappush(self._leaves, _leaf_item(entry))

    def _compact(self) -> None:
        self._leaves = [_leaf_item(e) for e in self._index._entries.values() if e.children == 0]
        heapq.heapify(self._leaves)

    def _pinned(self, protect: _Entry | None, also: _Entry | None) -> tuple[int, int]:
        """Entries and bytes that :meth:`make_room` can never evict: ``protect`` with its
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


_CLASSES: Final = 16
"""Classes of records (and of the pages they used): whether the record continued a prefix seen
before, times the binary order of magnitude of its new pages (0, 1, 2-3, ... 64 or more)."""

_WINDOW: Final = 256
"""Records within which a prompt's first page must come back for its record to count as
reused (the horizon of the learnt values)."""

_PRIOR: Final = (0.1, 0.4)
"""Pseudo-counts of (reused, decided) records of each class before any is decided."""

_AGE_TURNOVERS: Final = 16
"""A leaf unused for this many cache turnovers goes first, whatever its class."""

_HISTORY_PER_ENTRY: Final = 8
"""Evicted pages :class:`AdaptiveEviction` remembers, per resident page, counting at least
:data:`_MIN_HISTORY` resident (so at least 32,768 however small the cache)."""

_MIN_HISTORY: Final = 4096

_RATE: Final = 1 / 64
"""Weight of the last record in the running means of entries stored and clock ticks per
record (the cache's turnover)."""


def record_class(continuing: bool, new_pages: int) -> int:
    """The class of a record that continued a known prefix (or not) with ``new_pages`` pages
    seen neither in the cache nor among the pages it evicted lately."""
    return (8 if continuing else 0) + min(new_pages.bit_length(), 7)


class _Watch:
    """A record waiting to learn whether its prompt's first page comes back within the window."""

    __slots__ = ("kind", "root", "start")

    def __init__(self, start: int, kind: int, root: bytes) -> None:
        self.start = start
        self.kind = kind
        self.root = root


class AdaptiveEviction(ReuseEviction):
    """Which pages come back, learnt per class of record: a reuse predictor over a signature
    of the record, as SHiP (Wu et al., "SHiP: Signature-based Hit Predictor for High Performance
    Caching", MICRO 2011) learns one per signature, with the ranking by learnt hit probability
    of LHD (Beckmann et al., "LHD: Improving Cache Hit Rate by Maximizing Hit Density", NSDI
    2018) reduced to one value per class.

    A record's class is whether it continued a prefix seen before (its first page resident, or
    evicted lately) and how many new pages it brought (0, 1, 2-3, ... 64 or more): a turn that
    appends a little to a known conversation, against a one-off document. Each class's value is
    the share of its records whose first page was recorded again within :data:`_WINDOW` records,
    counted online as the windows close (starting from :data:`_PRIOR`). Every page of a record
    takes the record's class. Leaves wait in one heap per class by last use; room is made from
    the class of the lowest value first, least recently used first within it, except that a leaf
    unused for :data:`_AGE_TURNOVERS` turnovers of the cache goes before any (so a class that
    stopped coming back cannot hold its pages forever). Evictions take leaves only, never the
    running record's chain. A record makes room for its new pages in one pass when it can
    (:meth:`room_for_pages`): a parent whose last child is chosen becomes a candidate of its
    class within the pass.
    """

    name = PageEviction.ADAPTIVE

    def __init__(self, index: EvictionHost) -> None:
        super().__init__(index)
        self._heaps: list[list[tuple[int, int, _Entry]]] = [[] for _ in range(_CLASSES)]
        """Leaves of each class, by last use."""
        self._reused = [0] * _CLASSES
        """Records of each class whose first page came back within the window."""
        self._decided = [0] * _CLASSES
        """Records of each class whose window closed (or whose first page came back in it)."""
        self._order: list[int] = list(range(_CLASSES))
        """Classes by value, the lowest (the first to give up its pages) first."""
        self._watches: deque[_Watch] = deque()
        """Records whose window is open, oldest first."""
        self._watching: dict[bytes, _Watch] = {}
        """First page -> the latest record of it whose window is open."""
        self._history: OrderedDict[bytes, None] = OrderedDict()
        """Pages evicted lately, oldest first (a record that meets one continues a prefix)."""
        self._history_bound = _HISTORY_PER_ENTRY * _MIN_HISTORY
        """Pages :attr:`_history` keeps (set as each record ends, from the resident count)."""
        self._records = 0
        self._seq = 0
        self._recording = False
        self._op_clock = 0
        """The clock when the running record started: entries it touched have a later use."""
        self._root: bytes | None = None
        self._deepest: _Entry | None = None
        """The deepest page the running record reached so far (stored or refreshed)."""
        self._known = 0
        """Leading pages of the running record seen before (resident or in the history)."""
        self._pages = 0
        """Pages of the running record so far."""
        self._run = True
        """Whether every page of the running record so far was seen before."""
        self._stored = 0
        """Entries the running record stored."""
        self._in_pass = False
        """Whether :meth:`room_for_pages` is evicting the victims it chose (their parents are
        on their heaps already)."""
        self._record_clock = 0
        self._stored_rate = 0.0
        """Running mean of the entries a record stores."""
        self._tick_rate = 0.0
        """Running mean of the clock ticks from one record to the next."""

    def record_started(self) -> None:
        super().record_started()
        self._recording = True
        self._op_clock = self._index._clock
        self._root = None
        self._deepest = None
        self._known = self._pages = self._stored = 0
        self._run = True

    def stored(self, entry: _Entry, parent: _Entry | None) -> None:
        if parent is not None:
            parent.children += 1
        key = entry.key
        if self._root is None:
            self._root = key
        self._pages += 1
        self._stored += 1
        if self._run:  # the record's pages so far were all seen before: is this one?
            history = self._history
            if key in history:  # evicted lately
                del history[key]
                self._known += 1
            else:
                self._run = False
        # The record's class so far: the whole record's is set when it ends (and if it never
        # does, interrupted, its pages still have one, so a restore can make them leaves).
        entry.tier = record_class(self._known > 0, self._pages - self._known)
        self._deepest = entry

    def touched(self, entry: _Entry) -> None:
        if self._recording:  # a page of the running record, resident: seen before
            if self._root is None:
                self._root = entry.key
            self._deepest = entry
            self._pages += 1
            if self._run:
                self._known += 1
        elif entry.children == 0 and entry.tier >= 0:  # a restore: recency only
            self._push(entry.tier, entry)

    def record_ended(self, last: _Entry | None) -> None:
        self._recording = False
        root = self._root
        if last is None:  # nothing stored, or an interrupted record: up to its last page
            last = self._deepest
        self._deepest = None
        if last is None or root is None:
            return
        kind = record_class(self._known > 0, self._pages - self._known)
        # Every page of the chain takes the record's class; only its last can be a leaf.
        entry: _Entry | None = last
        while entry is not None:
            entry.tier = kind
            entry = entry.parent
        if last.children == 0:
            self._push(kind, last)
        self._learn(root, kind)
        clock = self._index._clock
        ticks = clock - self._record_clock
        self._record_clock = clock
        self._stored_rate += (self._stored - self._stored_rate) * _RATE
        self._tick_rate += (ticks - self._tick_rate) * _RATE
        self._history_bound = _HISTORY_PER_ENTRY * max(len(self._index._entries), _MIN_HISTORY)

    def _learn(self, root: bytes, kind: int) -> None:
        """The record of class ``kind`` whose first page is ``root`` ended: close the window it
        ends (its first page came back) and those that expired; open its own."""
        self._records += 1
        now = self._records
        changed = False
        watching = self._watching
        earlier = watching.get(root)
        if earlier is not None:  # came back within the window
            self._reused[earlier.kind] += 1
            self._decided[earlier.kind] += 1
            changed = True
        watch = _Watch(now, kind, root)
        watching[root] = watch
        watches = self._watches
        watches.append(watch)
        while watches[0].start <= now - _WINDOW:
            expired = watches.popleft()
            if watching.get(expired.root) is expired:
                del watching[expired.root]
                self._decided[expired.kind] += 1
                changed = True
        if changed:
            self._order.sort(key=self.value)

    def value(self, kind: int) -> float:
        """The learnt share of records of class ``kind`` whose prompt came back in the window."""
        good, prior = _PRIOR
        return (self._reused[kind] + good) / (self._decided[kind] + prior)

    def _push(self, kind: int, entry: _Entry) -> None:
        self._seq += 1
        heap = self._heaps[kind]
        heapq.heappush(heap, (entry.last_used, self._seq, entry))
        if len(heap) > 2 * len(self._index._entries) + 64:
            self._compact()

    def _compact(self) -> None:
        for kind, heap in enumerate(self._heaps):
            heap[:] = [item for item in heap if self._current(kind, item)]
            heapq.heapify(heap)

    @staticmethod
    def _current(kind: int, item: tuple[int, int, _Entry]) -> bool:
        entry = item[2]
        return entry.tier == kind and entry.children == 0 and entry.last_used == item[0]

    def evicted(self, entry: _Entry, reason: EvictionReason) -> None:
        entry.tier = -1
        parent = entry.parent
        if parent is not None:
            parent.children -= 1
            if parent.children == 0 and parent.tier >= 0 and not self._in_pass:
                self._push(parent.tier, parent)
        if reason != "cleared":
            history = self._history
            key = entry.key
            if key in history:  # evicted again: now the latest
                history.move_to_end(key)
            else:
                history[key] = None
            if len(history) > self._history_bound:
                history.popitem(last=False)

    def _age_limit(self) -> int:
        """Clock ticks after which a leaf goes first: :data:`_AGE_TURNOVERS` times the ticks the
        cache takes to store as many entries as it holds."""
        if self._stored_rate <= 0.0:
            return 1 << 62
        records = len(self._index._entries) / self._stored_rate
        return int(_AGE_TURNOVERS * records * max(self._tick_rate, 1.0)) + 1

    def _pop_class_leaf(self, kind: int, also: _Entry | None) -> _Entry | None:
        """The least recently used evictable leaf of a class, off its heap (or None)."""
        heap = self._heaps[kind]
        op_clock = self._op_clock
        held = None
        victim = None
        pop = heapq.heappop
        while heap:
            item = pop(heap)
            if not self._current(kind, item):
                continue  # stale: no longer a leaf of this class used then
            entry = item[2]
            if entry.last_used > op_clock:  # the running record's: so is everything after it
                heapq.heappush(heap, item)
                break
            if entry is also:
                held = item
                continue
            victim = entry
            break
        if held is not None:
            heapq.heappush(heap, held)
        return victim

    def _aged(self) -> list[int]:
        """Classes whose least recently used leaf is older than :meth:`_age_limit` (stale items
        at the tops of the heaps dropped on the way)."""
        cutoff = min(self._index._clock - self._age_limit(), self._op_clock)
        aged = []
        for kind, heap in enumerate(self._heaps):
            while heap and not self._current(kind, heap[0]):
                heapq.heappop(heap)
            if heap and heap[0][0] < cutoff:
                aged.append(kind)
        return aged

    def _victim(self, aged: list[int], also: _Entry | None) -> _Entry | None:
        """The next leaf to go: the oldest of an aged class while one is older than the limit
        (``aged`` is pruned as they catch up), else the least recently used leaf of the lowest
        valued class that has one."""
        if aged:
            cutoff = min(self._index._clock - self._age_limit(), self._op_clock)
            heaps = self._heaps
            while aged:
                kind = min(aged, key=lambda c: heaps[c][0][0] if heaps[c] else 1 << 62)
                heap = heaps[kind]
                while heap and not self._current(kind, heap[0]):
                    heapq.heappop(heap)
                if heap and heap[0][0] < cutoff and heap[0][2] is not also:
                    victim = self._pop_class_leaf(kind, also)
                    if victim is not None:
                        return victim
                aged.remove(kind)
        heaps = self._heaps
        for kind in self._order:
            if heaps[kind]:
                victim = self._pop_class_leaf(kind, also)
                if victim is not None:
                    return victim
        return None

    def make_room(
        self,
        size: int,
        protect: _Entry | None,
        also: _Entry | None,
        evicted: list[_Eviction],
        *,
        new_entry: bool,
    ) -> bool:
        """Evicts leaves, aged ones first, then by class value (see the class docstring), never
        the running record's chain nor ``also``."""
        index = self._index
        max_bytes = index.max_bytes
        if max_bytes and size > max_bytes:
            return False
        entries = index._entries
        limit = index.max_entries - 1 if new_entry else len(entries)
        aged: list[int] | None = None
        while True:
            if len(entries) > limit:
                reason: EvictionReason = "max_entries"
            elif max_bytes and index._resident_bytes + size > max_bytes:
                reason = "max_bytes"
            else:
                return True
            if aged is None:
                count, nbytes = self._pinned(protect, also)
                if count > limit or (max_bytes and nbytes + size > max_bytes):
                    return False
                aged = self._aged()
            victim = self._victim(aged, also)
            if victim is None:
                return False
            index._evict_all([(victim, reason)], evicted)

    def room_for_pages(self, count: int, size: int, evicted: list[_Eviction]) -> int:
        """Room for all ``count`` new pages at once (one pass, one eviction call) when it can
        be made, else page by page (-1)."""
        index = self._index
        if index.max_bytes and count * size > index.max_bytes:
            return -1
        victims: list[tuple[_Entry, EvictionReason]] = []
        # A parent whose children are all chosen becomes a leaf, and a candidate, within the
        # pass (as it would evicting page by page): its count is lowered while the pass runs.
        bared: list[_Entry] = []
        try:
            try:
                fit = self._choose(count, size, victims, bared)
            finally:
                for parent in bared:
                    parent.children += 1
            if fit < 0:
                self._put_back(victims)  # not enough room: go page by page
                return -1
            if victims:
                # The parents the victims leave leaves are on their heaps already (_choose).
                self._in_pass = True
                try:
                    index._evict_all(victims, evicted)
                finally:
                    self._in_pass = False
        except BaseException:
            # (An interrupt in the pass:) the chosen leaves still resident go back on their
            # heaps, so that none is lost to later evictions.
            self._put_back(victims)
            raise
        return count

    def _put_back(self, victims: list[tuple[_Entry, EvictionReason]]) -> None:
        """Chosen leaves that were not evicted: on their class heaps again."""
        entries = self._index._entries
        for entry, _ in victims:
            if entry.tier >= 0 and entries.get(entry.key) is entry:
                self._push(entry.tier, entry)

    def _choose(
        self,
        count: int,
        size: int,
        victims: list[tuple[_Entry, EvictionReason]],
        bared: list[_Entry],
    ) -> int:
        """:meth:`room_for_pages`' pass: choose the victims; ``count``, or -1 when the leaves
        run out first."""
        index = self._index
        max_bytes = index.max_bytes
        entries = len(index._entries)
        limit = index.max_entries - count
        resident = index._resident_bytes
        need = count * size
        chosen: set[int] = set()  # (a heap may hold a leaf twice with the same last use)
        aged: list[int] | None = None
        heaps = self._heaps
        op_clock = self._op_clock
        # A victim's parent that it leaves a leaf was used before it, so it is usually older
        # than every leaf of its class: then (no class being aged) it is the next victim, held
        # here instead of pushed and popped.
        held: _Entry | None = None
        try:
            while True:
                if entries > limit:
                    reason: EvictionReason = "max_entries"
                elif max_bytes and resident + need > max_bytes:
                    reason = "max_bytes"
                else:
                    return count
                if aged is None:
                    aged = self._aged()
                if held is not None:
                    victim: _Entry | None = held
                    held = None
                else:
                    victim = self._next_leaf(aged)
                if victim is None:
                    return -1
                if id(victim) in chosen:
                    continue
                chosen.add(id(victim))
                victims.append((victim, reason))
                entries -= 1
                resident -= victim.shape.nbytes
                parent = victim.parent
                if parent is not None:
                    parent.children -= 1
                    bared.append(parent)
                    tier = parent.tier
                    if parent.children == 0 and tier >= 0:
                        heap = heaps[tier]
                        if (
                            not aged
                            and tier == victim.tier
                            and parent.last_used <= op_clock
                            and (not heap or parent.last_used < heap[0][0])
                        ):
                            held = parent
                        else:
                            self._push(tier, parent)
        finally:
            if held is not None:  # not taken: on its heap after all
                self._push(held.tier, held)

    def _next_leaf(self, aged: list[int]) -> _Entry | None:
        """:meth:`_choose`'s next leaf (:meth:`_victim`)."""
        return self._victim(aged, None)

    def page_room(self, size: int, parent: _Entry | None, evicted: list[_Eviction]) -> bool:
        return self.make_room(size, parent, None, evicted, new_entry=True)

    def clear(self, evicted: list[_Eviction]) -> None:
        self._op_clock = self._index._clock
        while True:
            victim = None
            for kind in range(_CLASSES):
                victim = self._pop_class_leaf(kind, None)
                if victim is not None:
                    break
            if victim is None:
                break
            self._index._evict_all([(victim, "cleared")], evicted)
