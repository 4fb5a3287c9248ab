"""Which leaf the paged index evicts first: two strategies behind one interface.

Both evict only *leaves* (entries with no cached entry after them in their chain), so a cached
chain never has a gap, and both refuse to make room by evicting the running record's own chain.

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

A strategy holds the index it serves and reads its entries and bounds; the index calls it at each
event (an entry stored, touched, evicted; a record started and ended; room needed).
"""

from __future__ import annotations

import heapq
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from typing import Final, Protocol, cast

from stage_runtime.cache.paged.entries import _Entry, _leaf_item
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


class EvictionHost(Protocol):
    """What a strategy reads and calls of the index it serves
    (:class:`~stage_runtime.cache.paged.index.PagedActivationIndex`)."""

    max_entries: int
    max_bytes: int
    _entries: OrderedDict[bytes, _Entry]
    _clock: int
    _resident_bytes: int

    def _evict_all(self, victims: _Victims, evicted: list[_Eviction]) -> None: ...


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

    def touch_order(self, used: Sequence[_Entry]) -> Sequence[_Entry]:
        """The order a restore touches the entries it used (given in token order)."""

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

    def touch_order(self, used: Sequence[_Entry]) -> Sequence[_Entry]:
        # Deepest first leaves the chain in the order record_ended gives.
        return used[::-1]

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
            resident -= victim.nbytes
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

    def touch_order(self, used: Sequence[_Entry]) -> Sequence[_Entry]:
        return used

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


_HISTORY_PER_ENTRY: Final = 8
"""Pages whose use counts :class:`AdaptiveEviction` remembers, per page the cache may hold."""


class AdaptiveEviction(ReuseEviction):
    """Recency or frequency, learnt from the workload: ARC's adaptation (Megiddo and Modha, "ARC:
    A Self-Tuning, Low Overhead Replacement Cache", FAST 2003) over two classes of pages set by
    their use counts over a long history (as LRFU and TinyLFU keep counts past eviction).

    A page used by one record so far is in the *once* class, a page used by two or more (in the
    remembered history, evicted or not) in the *again* class; within a class the least recently
    used leaf goes first. Room is made from the once class while it holds more than a target
    share ``p`` of the cache, else from the again class. ``p`` starts at 0 (one-off pages go
    first, which keeps shared prefixes against a flood of unique prompts) and moves as ARC's
    does: a page coming back soon after it was evicted from the once class raises it (recency
    would have kept it), one evicted from the again class lowers it. Leaves wait in one heap per
    class by last use; stale items are skipped. Evictions take leaves only, never the running
    record's chain. A use is one record of a prompt (its restore only refreshes recency). A
    record makes room for its new pages in one pass when it can (:meth:`room_for_pages`): a
    parent whose last child is chosen becomes a candidate of its class within the pass.
    """

    name = PageEviction.ADAPTIVE

    def __init__(self, index: EvictionHost) -> None:
        super().__init__(index)
        self._heaps: tuple[list[tuple[int, int, _Entry]], list[tuple[int, int, _Entry]]] = ([], [])
        """Leaves of the once class (0) and of the again class (1), by last use."""
        self._members = [0, 0]
        """Resident pages in each class (an entry's class is its ``tier``)."""
        self._ghosts: tuple[OrderedDict[bytes, None], OrderedDict[bytes, None]] = (
            OrderedDict(),
            OrderedDict(),
        )
        """Pages evicted lately from each class (ARC's B1 and B2), oldest first."""
        self._uses: dict[bytes, int] = {}
        """Records that used each page (evicted pages too; pages used once and no longer
        resident are forgotten when the history outgrows its bound)."""
        self.target = 0.0
        """``p``: how many entries the once class may keep before it yields."""
        self._recording = False
        self._op_clock = 0
        """The clock when the running record started: entries it touched have a later use."""
        self._seq = 0
        self._pushed: set[int] = set()
        """Parents :meth:`room_for_pages` put on their heap as the leaves they become once its
        victims go: :meth:`evicted` does not push them again."""

    def record_started(self) -> None:
        super().record_started()
        self._recording = True
        self._op_clock = self._index._clock

    def record_ended(self, last: _Entry | None) -> None:
        self._recording = False
        # Only the chain's last entry can be a leaf after the record (each one before has the
        # next as its child): pushed once here rather than for every page on the way.
        if last is not None and last.children == 0 and last.tier >= 0:
            self._push(last.tier, last)

    def stored(self, entry: _Entry, parent: _Entry | None) -> None:
        if parent is not None:
            parent.children += 1
        key = entry.key
        once, again = self._ghosts
        if key in once:
            del once[key]
            step = max(len(again) / max(len(once), 1), 1.0)
            self.target = min(float(self._index.max_entries), self.target + step)
        elif key in again:
            del again[key]
            step = max(len(once) / max(len(again), 1), 1.0)
            self.target = max(0.0, self.target - step)
        # A new entry has no class yet, and is no leaf on a heap (record_ended pushes the
        # chain's last): what _use does, without its changes of class.
        kind = 1 if self._count_use(key) >= 2 else 0
        self._members[kind] += 1
        entry.tier = kind

    def touched(self, entry: _Entry) -> None:
        if self._recording:
            self._use(entry)
        elif entry.children == 0:  # a restore: recency only
            self._push(entry.tier, entry)

    def _use(self, entry: _Entry) -> None:
        kind = 1 if self._count_use(entry.key) >= 2 else 0
        previous = entry.tier
        if previous != kind:
            if previous >= 0:
                self._members[previous] -= 1
            self._members[kind] += 1
            entry.tier = kind
            if entry.children == 0 and previous >= 0:  # a leaf changing class: its new heap
                self._push(kind, entry)

    def _count_use(self, key: bytes) -> int:
        """One more use of page ``key`` in the history; its uses so far."""
        history = self._uses
        uses = history.get(key, 0) + 1
        history[key] = uses
        if len(history) > _HISTORY_PER_ENTRY * self._index.max_entries:
            self._forget()
        return uses

    def _forget(self) -> None:
        """The use history outgrew its bound: forget pages used once that left the cache; if
        that is not enough, age every count (halved, the zeros forgotten), as TinyLFU's reset
        does."""
        bound = _HISTORY_PER_ENTRY * self._index.max_entries
        entries = self._index._entries
        kept = {k: n for k, n in self._uses.items() if n >= 2 or k in entries}
        if len(kept) > bound // 2:
            kept = {k: n >> 1 for k, n in kept.items() if n >> 1 or k in entries}
        self._uses = kept

    def _push(self, kind: int, entry: _Entry) -> None:
        self._seq += 1
        heap = self._heaps[kind]
        heapq.heappush(heap, (entry.last_used, self._seq, entry))
        if len(heap) > 2 * len(self._index._entries) + 64:
            self._compact()

    def _compact(self) -> None:
        for kind in (0, 1):
            heap = [item for item in self._heaps[kind] if self._current(kind, item)]
            heapq.heapify(heap)
            self._heaps[kind][:] = heap

    def _current(self, kind: int, item: tuple[int, int, _Entry]) -> bool:
        entry = item[2]
        return entry.tier == kind and entry.children == 0 and entry.last_used == item[0]

    def touch_order(self, used: Sequence[_Entry]) -> Sequence[_Entry]:
        return used

    def evicted(self, entry: _Entry, reason: EvictionReason) -> None:
        key = entry.key
        kind = entry.tier
        entry.tier = -1
        self._members[kind] -= 1
        parent = entry.parent
        if parent is not None:
            parent.children -= 1
            if parent.children == 0 and parent.tier >= 0 and id(parent) not in self._pushed:
                self._push(parent.tier, parent)
        if reason != "cleared":
            ghosts = self._ghosts[kind]
            ghosts[key] = None
            if len(ghosts) > self._index.max_entries:
                ghosts.popitem(last=False)

    def make_room(
        self,
        size: int,
        protect: _Entry | None,
        also: _Entry | None,
        evicted: list[_Eviction],
        *,
        new_entry: bool,
    ) -> bool:
        """Evicts leaves from the class ARC's target picks (the other one when it has none
        left), least recently used first, never the running record's chain nor ``also``."""
        index = self._index
        max_bytes = index.max_bytes
        if max_bytes and size > max_bytes:
            return False
        entries = index._entries
        limit = index.max_entries - 1 if new_entry else len(entries)
        checked = False
        while True:
            if len(entries) > limit:
                reason: EvictionReason = "max_entries"
            elif max_bytes and index._resident_bytes + size > max_bytes:
                reason = "max_bytes"
            else:
                return True
            if not checked:
                checked = True
                count, nbytes = self._pinned(protect, also)
                if count > limit or (max_bytes and nbytes + size > max_bytes):
                    return False
            once_first = self._members[0] > 0 and (
                self._members[0] > self.target or self._members[1] == 0
            )
            order = (0, 1) if once_first else (1, 0)
            victim = self._pop_class_leaf(order[0], also) or self._pop_class_leaf(order[1], also)
            if victim is None:
                return False
            index._evict_all([(victim, reason)], evicted)

    def room_for_pages(self, count: int, size: int, evicted: list[_Eviction]) -> int:
        """Room for all ``count`` new pages at once (one pass, one eviction call) when it can
        be made, else page by page (-1)."""
        index = self._index
        if index.max_bytes and count * size > index.max_bytes:
            return -1
        members = list(self._members)
        victims: list[tuple[_Entry, EvictionReason]] = []
        chosen: set[int] = set()  # (a heap may hold a leaf twice with the same last use)
        # A parent whose children are all chosen becomes a leaf, and a candidate, within the
        # pass (as it would evicting page by page): its count is lowered while the pass runs.
        bared: list[_Entry] = []
        try:
            try:
                fit = self._choose(count, size, members, victims, chosen, bared)
            finally:
                for parent in bared:
                    parent.children += 1
            if fit < 0:
                self._put_back(victims)  # not enough room: go page by page
                return -1
            if victims:
                index._evict_all(victims, evicted)
        except BaseException:
            # (An interrupt in the pass:) the chosen leaves still resident go back on their
            # heaps, so that none is lost to later evictions.
            self._put_back(victims)
            raise
        finally:
            self._pushed.clear()
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
        members: list[int],
        victims: list[tuple[_Entry, EvictionReason]],
        chosen: set[int],
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
        target = self.target
        op_clock = self._op_clock
        pushed = self._pushed
        heaps = self._heaps
        # A victim's parent that it leaves a leaf was used before it (a restore or record
        # touches a chain root first), so it is usually older than every leaf on its class's
        # heap: then it is that class's next victim, held here instead of pushed and popped.
        front: list[_Entry | None] = [None, None]
        try:
            while True:
                if entries > limit:
                    reason: EvictionReason = "max_entries"
                elif max_bytes and resident + need > max_bytes:
                    reason = "max_bytes"
                else:
                    return count
                once = members[0]
                kind = 0 if once > 0 and (once > target or members[1] == 0) else 1
                victim = self._next_leaf(kind, front)
                if victim is None:
                    kind = 1 - kind
                    victim = self._next_leaf(kind, front)
                    if victim is None:
                        return -1
                if id(victim) in chosen:
                    continue
                chosen.add(id(victim))
                victims.append((victim, reason))
                members[kind] -= 1
                entries -= 1
                resident -= victim.nbytes
                parent = victim.parent
                if parent is not None:
                    parent.children -= 1
                    bared.append(parent)
                    tier = parent.tier
                    if parent.children == 0 and tier >= 0:
                        pushed.add(id(parent))
                        heap = heaps[tier]
                        held = front[tier]
                        if (
                            held is None
                            and parent.last_used <= op_clock
                            and (not heap or parent.last_used < heap[0][0])
                        ):
                            front[tier] = parent
                        else:
                            self._push(tier, parent)
        finally:
            for held in front:  # not taken: on its heap after all
                if held is not None:
                    self._push(held.tier, held)

    def _next_leaf(self, kind: int, front: list[_Entry | None]) -> _Entry | None:
        """:meth:`_choose`'s next leaf of a class: the held parent when it is older than the
        heap's oldest leaf, else :meth:`_pop_class_leaf`."""
        held = front[kind]
        if held is not None:
            heap = self._heaps[kind]
            if not heap or held.last_used < heap[0][0]:
                front[kind] = None
                return held
            front[kind] = None
            self._push(kind, held)
        return self._pop_class_leaf(kind, None)

    def page_room(self, size: int, parent: _Entry | None, evicted: list[_Eviction]) -> bool:
        return self.make_room(size, parent, None, evicted, new_entry=True)

    def _pop_class_leaf(self, kind: int, also: _Entry | None) -> _Entry | None:
        """The least recently used evictable leaf of a class, off its heap (or None)."""
        heap = self._heaps[kind]
        op_clock = self._op_clock
        held = None
        victim = None
        pop = heapq.heappop
        while heap:
            item = pop(heap)
            entry = item[2]
            if entry.tier != kind or entry.children or entry.last_used != item[0]:
                continue  # stale: no longer a leaf of this class used then
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

    def clear(self, evicted: list[_Eviction]) -> None:
        self._op_clock = self._index._clock
        while True:
            victim = self._pop_class_leaf(0, None) or self._pop_class_leaf(1, None)
            if victim is None:
                break
            self._index._evict_all([(victim, "cleared")], evicted)
