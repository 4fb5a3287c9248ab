"""Cache accounting shared by the ladder and paged index modes.

Three pieces, all synchronous and owned by whoever owns the cache:

- :class:`MissTracker` remembers recently evicted keys (bounded, oldest forgotten first) so that a
  miss can be told apart as ``never_seen`` or ``evicted``;
- :class:`PrefixFootprint` measures the bytes that the distinct resident prefixes would need if
  each were stored exactly once, to compare with the bytes actually resident;
- :class:`CacheAccounting` is the frozen snapshot both modes report.
"""

from __future__ import annotations

import bisect
from collections import OrderedDict, deque
from collections.abc import Hashable, Iterable, Iterator, Sequence
from itertools import repeat
from typing import Literal, cast

import attrs
import numpy as np
import numpy.typing as npt

from stage_runtime._arrays import first_difference

# MissTracker and PrefixFootprint are building blocks of the two indexes, not public API.
__all__ = [
    "CacheAccounting",
    "MissReason",
]

MissReason = Literal["never_seen", "evicted", "rejected"]
"""Why a lookup restored nothing: never cached, evicted since, or refused by validation."""


@attrs.frozen(kw_only=True)
class CacheAccounting:
    """What one stage's activation cache did and holds, in either index mode."""

    index: str
    """``"ladder"`` or ``"paged"``."""
    lookups: int
    """Restore calls that probed the cache."""
    hits: int
    """Restores that returned a prefix."""
    misses_never_seen: int
    """Misses where the prefix was never cached (or its eviction was forgotten)."""
    misses_evicted: int
    """Misses where the prefix had been cached and was evicted since."""
    misses_rejected: int
    """Misses where a cached entry was found but validation refused it."""
    restored_tokens: int
    """Tokens handed back by all hits together."""
    entries: int
    """Resident entries (ladder entries, or pages + tails + exact entries)."""
    resident_bytes: int
    """Payload bytes held by the resident entries."""
    unique_prefix_bytes: int
    """Bytes that the distinct resident prefixes need when each token row is stored once."""
    evictions: int
    """Entries evicted by the bounds (not counting ``clear``)."""
    evicted_bytes: int
    """Payload bytes of those evictions."""

    @property
    def misses(self) -> int:
        """All misses, whatever the reason."""
        return self.misses_never_seen + self.misses_evicted + self.misses_rejected

    @property
    def residency_ratio(self) -> float:
        """Resident bytes over unique-prefix bytes (1.0 = no duplication; 0.0 when empty)."""
        if self.unique_prefix_bytes == 0:
            return 0.0
        return self.resident_bytes / self.unique_prefix_bytes


@attrs.define(eq=False)
class MissTracker:
    """Bounded memory of evicted keys, to classify misses (oldest tombstones dropped first)."""

    capacity: int = 65536
    """Tombstones kept; older ones are forgotten, so their misses count as ``never_seen``."""
    _tombstones: OrderedDict[Hashable, None] = attrs.field(factory=OrderedDict, init=False)

    def evicted(self, key: Hashable) -> None:
        """Remember that ``key`` was evicted (as the newest tombstone)."""
        tombstones = self._tombstones
        if key in tombstones:
            tombstones.move_to_end(key)
            return
        tombstones[key] = None
        while len(tombstones) > self.capacity:
            tombstones.popitem(last=False)

    def evicted_all(self, keys: Iterable[Hashable]) -> None:
        """:meth:`evicted` of each of ``keys``, in order."""
        tombstones = self._tombstones
        move = tombstones.move_to_end
        for key in keys:
            if key in tombstones:
                move(key)
            else:
                tombstones[key] = None
        capacity = self.capacity
        while len(tombstones) > capacity:
            tombstones.popitem(last=False)

    def evicted_new(self, keys: Sequence[Hashable]) -> None:
        """:meth:`evicted_all` of distinct keys none of which has a tombstone (keys cached until
        now, when caching a key forgets its tombstone), in C loops: they go in as the newest,
        in order, and the oldest past the capacity go."""
        tombstones = self._tombstones
        tombstones.update(zip(keys, repeat(None)))
        excess = len(tombstones) - self.capacity
        if excess > 0:
            deque(map(tombstones.popitem, repeat(False, excess)), maxlen=0)

    def cached(self, key: Hashable) -> None:
        """Forget ``key``'s tombstone: it is resident again."""
        self._tombstones.pop(key, None)

    def cached_all(self, keys: Sequence[Hashable]) -> None:
        """:meth:`cached` of each of ``keys`` (set operations in C: most have no tombstone)."""
        tombstones = self._tombstones
        if tombstones:
            for key in tombstones.keys() & keys:
                del tombstones[key]

    def was_evicted(self, key: Hashable) -> bool:
        """Whether ``key`` has a tombstone."""
        return key in self._tombstones

    def __len__(self) -> int:
        return len(self._tombstones)


class _Group:
    """The segments that start right after one parent page (or at the root of a namespace).

    A plain slotted class with its row widths counted in two ints while they are all one width
    (the usual case): the footprint holds one per distinct parent, hundreds of thousands over
    a long replay."""

    __slots__ = (
        "bytes_per_token",
        "ordered",
        "segments",
        "trie",
        "unique_tokens",
        "width",
        "width_refs",
        "widths",
    )

    def __init__(self, bytes_per_token: int = 0) -> None:
        self.segments: dict[bytes, int] = {}
        """Token bytes (int32 little-endian) of each distinct segment -> reference count."""
        self.ordered: list[bytes] = []
        """The distinct segments, sorted: each one's neighbours are the two it shares the most
        leading tokens with."""
        self.trie = 0
        """The size of the token trie of ``ordered``, kept as segments come and go (a shared
        system prompt's first page can have a child per request: recounting them all at each
        read would cost a sort of all of them)."""
        self.bytes_per_token = bytes_per_token
        """The widest row among the segments held now."""
        self.unique_tokens: int | None = 0
        """Cached size of the token trie of ``segments``; ``None`` when it must be recomputed."""
        self.width = 0
        self.width_refs = 0
        """While every reference has one row width: that width and how many references."""
        self.widths: dict[int, int] | None = None
        """Once widths differ: bytes per token -> references held with it."""

    def add_width(self, bytes_per_token: int) -> None:
        """Count one more reference held with rows of ``bytes_per_token``."""
        widths = self.widths
        if widths is None:
            if self.width_refs == 0 or self.width == bytes_per_token:
                self.width = bytes_per_token
                self.width_refs += 1
                return
            widths = self.widths = {self.width: self.width_refs}
        widths[bytes_per_token] = widths.get(bytes_per_token, 0) + 1

    def remove_width(self, bytes_per_token: int) -> int:
        """Count one reference less with rows of ``bytes_per_token``; the widest left (0)."""
        widths = self.widths
        if widths is None:
            self.width_refs -= 1
            return self.width if self.width_refs else 0
        left = widths[bytes_per_token] - 1
        if left:
            widths[bytes_per_token] = left
        else:
            del widths[bytes_per_token]
        return max(widths, default=0)


def _common_prefix_tokens(a: bytes, b: bytes) -> int:
    """Whole int32 tokens that two little-endian token byte strings share from the start."""
    if a[:4] != b[:4]:
        return 0  # the usual case: segments after one parent differ at their first token
    m = min(len(a), len(b))
    left = np.frombuffer(a, dtype=np.uint8, count=m)
    right = np.frombuffer(b, dtype=np.uint8, count=m)
    return first_difference(left, right) // 4


def _trie_change(ordered: list[bytes], index: int, segment: bytes) -> int:
    """How many tokens ``segment`` adds to the token trie of ``ordered`` (sorted, without it)
    when it goes in at ``index``: its own tokens, less what it shares with the segment before
    it and with the one after it, plus what those two shared with each other (no longer next
    to each other)."""
    before = ordered[index - 1] if index else None
    after = ordered[index] if index < len(ordered) else None
    change = len(segment) // 4
    if before is not None:
        change -= _common_prefix_tokens(before, segment)
    if after is not None:
        change -= _common_prefix_tokens(segment, after)
        if before is not None:
            change += _common_prefix_tokens(before, after)
    return change


def _insert_segment(group: _Group, segment: bytes) -> None:
    """Add a distinct segment to ``group``'s sorted segments and trie size."""
    ordered = group.ordered
    index = bisect.bisect_left(ordered, segment)
    group.trie += _trie_change(ordered, index, segment)
    ordered.insert(index, segment)


def _remove_segment(group: _Group, segment: bytes) -> None:
    """Take a distinct segment out of ``group``'s sorted segments and trie size."""
    ordered = group.ordered
    index = bisect.bisect_left(ordered, segment)
    del ordered[index]
    group.trie -= _trie_change(ordered, index, segment)


@attrs.define(eq=False)
class PrefixFootprint:
    """Bytes the distinct resident prefixes need, each token row counted once.

    A prefix is described as segments: each full page of ``page_tokens`` tokens, keyed by the
    chained key of the page before it (or a namespace root), plus a partial last segment. Equal
    segments after equal parents are counted once; segments after the same parent that share
    leading tokens count those tokens once (token-trie size, computed lazily by
    :meth:`unique_bytes`).
    """

    _groups: dict[bytes, _Group] = attrs.field(factory=dict, init=False)
    _singles: dict[bytes, tuple[bytes, int]] = attrs.field(factory=dict, init=False)
    """Parents after which one segment is held, once: ``(its tokens, its bytes per token)``. Most
    parents are these (a page is usually its parent's only child); their bytes are counted as
    they come, and they become a :class:`_Group` when a second reference joins them."""
    _owners: dict[Hashable, tuple[int | bytes, ...]] = attrs.field(factory=dict, init=False)
    """Owner -> its bytes per token, then the parent and the segment of each segment it holds,
    flat: one tuple of ints and bytes per owner, which the garbage collector stops tracking at
    its next pass (a footprint of a large paged cache holds one per page)."""
    _dirty: set[bytes] = attrs.field(factory=set, init=False)
    _clean_tokens_bytes: int = attrs.field(default=0, init=False)
    """Sum of ``unique_tokens * bytes_per_token`` over groups that are not dirty."""

    def add(
        self,
        owner: Hashable,
        segments: Sequence[tuple[bytes, npt.NDArray[np.int32] | bytes]],
        bytes_per_token: int,
    ) -> None:
        """Count ``owner``'s segments ``(parent key, tokens)`` (tokens as int32 ids or their
        little-endian bytes); re-adding an owner is a no-op."""
        if owner in self._owners:
            return
        held: list[int | bytes] = [bytes_per_token]
        for parent, tokens in segments:
            data = (
                tokens
                if type(tokens) is bytes
                else np.ascontiguousarray(tokens, dtype="<i4").tobytes()
            )
            self._count(parent, data, bytes_per_token)
            held += (parent, data)
        self._owners[owner] = tuple(held)

    def add_segment(
        self, owner: Hashable, parent: bytes, data: bytes, bytes_per_token: int
    ) -> None:
        """:meth:`add` of one segment given as token bytes (a page or a tail)."""
        if owner in self._owners:
            return
        self._count(parent, data, bytes_per_token)
        self._owners[owner] = (bytes_per_token, parent, data)

    def _count(self, parent: bytes, data: bytes, bytes_per_token: int) -> None:
        group = self._groups.get(parent)
        if group is None:
            single = self._singles.pop(parent, None)
            if single is None:
                self._singles[parent] = (data, bytes_per_token)
                self._clean_tokens_bytes += len(data) // 4 * bytes_per_token
                return
            # A second reference after this parent: a group, its trie computed when next read.
            held, width = single
            self._clean_tokens_bytes -= len(held) // 4 * width
            group = self._groups[parent] = _Group(width)
            group.unique_tokens = None
            self._dirty.add(parent)
            group.segments[held] = 1
            _insert_segment(group, held)
            group.width = width
            group.width_refs = 1
        segments = group.segments
        count = segments.get(data, 0)
        if count == 0 or bytes_per_token > group.bytes_per_token:
            self._invalidate(parent, group)
            if bytes_per_token > group.bytes_per_token:
                group.bytes_per_token = bytes_per_token
            if count == 0:
                _insert_segment(group, data)
        segments[data] = count + 1
        group.add_width(bytes_per_token)

    def remove(self, owner: Hashable) -> None:
        """Release what :meth:`add` counted for ``owner`` (unknown owners are ignored)."""
        entry = self._owners.pop(owner, None)
        if entry is None:
            return
        width = cast("int", entry[0])
        held = cast("Iterator[tuple[bytes, bytes]]", zip(entry[1::2], entry[2::2], strict=True))
        singles = self._singles
        for parent, data in held:
            if parent in singles:  # (then this owner holds its only reference)
                del singles[parent]
                self._clean_tokens_bytes -= len(data) // 4 * width
                continue
            group = self._groups[parent]
            widest = group.remove_width(width)
            count = group.segments[data] - 1
            if count and widest == group.bytes_per_token:
                group.segments[data] = count
                continue
            self._invalidate(parent, group)  # before the width changes: it uncounts the old
            group.bytes_per_token = widest
            if count:
                group.segments[data] = count
                continue
            del group.segments[data]
            _remove_segment(group, data)
            if not group.segments:
                self._dirty.discard(parent)
                del self._groups[parent]

    def clear(self) -> None:
        """Forget everything."""
        self._groups.clear()
        self._singles.clear()
        self._owners.clear()
        self._dirty.clear()
        self._clean_tokens_bytes = 0

    def unique_bytes(self) -> int:
        """Bytes needed to store every distinct resident prefix once."""
        groups = self._groups
        added = 0
        for parent in self._dirty:
            group = groups[parent]
            tokens = group.unique_tokens = group.trie
            added += tokens * group.bytes_per_token
        self._dirty.clear()
        self._clean_tokens_bytes += added
        return self._clean_tokens_bytes

    def _invalidate(self, parent: bytes, group: _Group) -> None:
        if group.unique_tokens is not None:
            self._clean_tokens_bytes -= group.unique_tokens * group.bytes_per_token
            group.unique_tokens = None
            self._dirty.add(parent)
