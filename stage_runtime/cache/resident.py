"""The resident activation cache: strict LRU over activation frames (spec §4).

Plain single-owner state: no locks, no trio. A cache actor owns one and is the only caller.

Recency is a logical clock that advances on every lookup (hit or miss) and every stored record;
the victim is always the entry used longest ago. Entries are kept in a dict ordered from least to
most recently used, so finding the victim is O(1) and equals the upstream's "smallest last_used".
"""

from __future__ import annotations

from typing import Final, Literal

import attrs

from stage_runtime._unchecked import unchecked_constructor
from stage_runtime._validators import check_int_in
from stage_runtime.errors import ConfigError, FrameError
from stage_runtime.frames import ActivationFrame
from stage_runtime.limits import U64_MAX as _U64_MAX

__all__ = [
    "CacheLookup",
    "CacheRecordOutcome",
    "EvictedEntry",
    "EvictionReason",
    "ResidentActivationCache",
    "ResidentCacheStats",
]


EvictionReason = Literal["max_entries", "max_bytes", "cleared"]
"""Why an entry left the cache: the entry bound, the byte bound, or :meth:`clear`."""


@attrs.frozen(kw_only=True)
class EvictedEntry:
    """An entry that left the cache."""

    key: str
    """The entry's key (an ``act:...`` page id)."""

    token_count: int
    """Tokens the entry covered."""

    payload_bytes: int
    """Bytes the entry held."""

    reason: EvictionReason
    """``"max_entries"``, ``"max_bytes"`` or ``"cleared"``."""

    entries_after: int | None = None
    """Entries resident right after this one left (before the record that evicted it stores its
    own entry); None when whoever built the record did not say."""

    resident_bytes_after: int | None = None
    """Bytes resident right after this one left, as ``entries_after``."""


@attrs.frozen(kw_only=True)
class CacheRecordOutcome:
    """What one :meth:`ResidentActivationCache.record` call evicted."""

    evicted_entries: int = 0
    """Entries evicted to make room (a re-recorded key is not counted)."""

    evicted_bytes: int = 0
    """Bytes those entries held."""

    evicted: tuple[EvictedEntry, ...] = ()
    """The evicted entries, least recently used first."""

    stored: bool = False
    """Whether the entry was stored (False when refused: too few tokens or zero bytes)."""


@attrs.frozen(kw_only=True, eq=False)
class CacheLookup:
    """A hit: the stored entry and the entry count at lookup time."""

    token_count: int
    """Tokens the entry was recorded for."""

    byte_size: int
    """Bytes the entry was recorded with."""

    entries: int
    """Entries resident when the lookup happened."""

    frame: ActivationFrame
    """The stored frame (shared, read-only: never copied)."""


@attrs.frozen(kw_only=True)
class ResidentCacheStats:
    """Counters of a cache; the upstream has only ``entries`` and ``resident_bytes``."""

    entries: int
    """Entries resident now."""

    resident_bytes: int
    """Bytes resident now (may exceed ``max_bytes`` after an oversize record)."""

    lookups: int = 0
    """Lookups so far (hits + misses)."""

    hits: int = 0
    """Lookups that found their key."""

    misses: int = 0
    """Lookups that did not."""

    records: int = 0
    """Records that stored an entry (refused records are not counted)."""

    evictions: int = 0
    """Entries evicted by the entry or byte bound (not re-records, not :meth:`clear`)."""

    evicted_bytes: int = 0
    """Bytes those evictions freed."""


class _Entry:
    """A stored frame. ``cut`` is the token count to cut ``frame`` at when it is first looked
    up (the ladder index stores the prefixes of one frame that way: most are never read), or
    None when ``frame`` is stored as given."""

    __slots__ = ("byte_size", "cut", "frame", "last_used", "token_count")

    def __init__(
        self,
        token_count: int,
        byte_size: int,
        last_used: int,
        frame: ActivationFrame,
        cut: int | None = None,
    ) -> None:
        self.token_count = token_count
        self.byte_size = byte_size
        self.last_used = last_used
        self.frame = frame
        self.cut = cut


_evicted_entry = unchecked_constructor(EvictedEntry)
"""``EvictedEntry(key, token_count, payload_bytes, reason, entries_after, resident_bytes_after)``
from the cache's own values, unchecked."""

_REFUSED: Final = CacheRecordOutcome()
_STORED: Final = CacheRecordOutcome(stored=True)


def _bound(name: str, value: object, low: int) -> int:
    return check_int_in(name, value, low=low, high=_U64_MAX)


@attrs.define(eq=False, init=False)
class ResidentActivationCache:
    """Activation frames by key, bounded by entry count and bytes, evicting least recently used.

    Args:
        max_entries: Entries kept (>= 1).
        max_bytes: Bytes kept; 0 means no byte bound. An entry larger than this is still stored,
            after evicting everything else (as upstream).
        min_tokens: Records of fewer tokens are refused.

    Raises:
        ConfigError: a bound is negative, or ``max_entries`` is 0.
    """

    max_entries: int
    max_bytes: int
    min_tokens: int
    _entries: dict[str, _Entry]
    _clock: int
    _resident_bytes: int
    _lookups: int
    _hits: int
    _records: int
    _evictions: int
    _evicted_bytes: int

    def __init__(
        self,
        max_entries: int = 64,
        max_bytes: int = 0,
        min_tokens: int = 0,
    ) -> None:
        self.max_entries = _bound("max_entries", max_entries, 1)
        self.max_bytes = _bound("max_bytes", max_bytes, 0)
        self.min_tokens = _bound("min_tokens", min_tokens, 0)
        self._entries = {}
        self._clock = 0
        self._resident_bytes = 0
        self._lookups = 0
        self._hits = 0
        self._records = 0
        self._evictions = 0
        self._evicted_bytes = 0

    @property
    def clock(self) -> int:
        """The logical clock: lookups plus stored records so far."""
        return self._clock

    @property
    def resident_bytes(self) -> int:
        """Bytes resident now (``stats().resident_bytes`` without the snapshot)."""
        return self._resident_bytes

    @property
    def hits(self) -> int:
        """Lookups that found their key so far (``stats().hits`` without the snapshot)."""
        return self._hits

    @property
    def records(self) -> int:
        """Records that stored an entry so far (``stats().records`` without the snapshot)."""
        return self._records

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        """Whether ``key`` is resident; does not touch recency or counters."""
        return key in self._entries

    def keys(self) -> list[str]:
        """Resident keys, least recently used first; does not touch recency."""
        return list(self._entries)

    def lookup(self, key: str) -> CacheLookup | None:
        """Find ``key``; a hit becomes the most recently used entry.

        The clock advances on every call, hit or miss (spec §4).
        """
        if not isinstance(key, str):
            msg = f"key must be a string, got {key!r}"
            raise ConfigError(msg)
        self._clock += 1
        self._lookups += 1
        entry = self._entries.pop(key, None)
        if entry is None:
            return None
        self._hits += 1
        entry.last_used = self._clock
        self._entries[key] = entry
        if entry.cut is not None:
            entry.frame = entry.frame._cut(entry.cut)
            entry.cut = None
        return CacheLookup(
            token_count=entry.token_count,
            byte_size=entry.byte_size,
            entries=len(self._entries),
            frame=entry.frame,
        )

    def record(
        self, key: str, token_count: int, byte_size: int, frame: ActivationFrame
    ) -> CacheRecordOutcome:
        """Store ``frame`` under ``key`` as the most recently used entry (spec §4).

        Refused (nothing stored, clock unchanged) when ``token_count < min_tokens`` or
        ``byte_size == 0``. Re-recording a resident key replaces it without counting an eviction.
        Then least recently used entries are evicted while the entry bound or the byte bound
        would be exceeded; an entry larger than ``max_bytes`` is stored anyway once the cache is
        empty.

        The frame is stored as given (frames are immutable views; nothing is copied). As
        upstream, ``token_count`` and ``byte_size`` are not checked against the frame here:
        :meth:`KvStageIntegration.restore_resident_activation` validates hits instead.

        Raises:
            ConfigError: a bad key, count or size (the cache is left unchanged).
            FrameError: ``frame`` is not an ActivationFrame (the cache is left unchanged).
        """
        if not isinstance(key, str):
            msg = f"key must be a string, got {key!r}"
            raise ConfigError(msg)
        _bound("token_count", token_count, 0)
        _bound("byte_size", byte_size, 0)
        if not isinstance(frame, ActivationFrame):
            msg = f"frame must be an ActivationFrame, got {type(frame).__name__}"
            raise FrameError(msg)
        evicted = self._store(key, token_count, byte_size, frame)
        if evicted is None:
            return _REFUSED
        if not evicted:
            return _STORED
        return CacheRecordOutcome(
            evicted_entries=len(evicted),
            evicted_bytes=sum(entry.payload_bytes for entry in evicted),
            evicted=evicted,
            stored=True,
        )

    def _store(
        self,
        key: str,
        token_count: int,
        byte_size: int,
        frame: ActivationFrame,
        cut: int | None = None,
    ) -> tuple[EvictedEntry, ...] | None:
        """:meth:`record` of checked arguments (for the ladder index, which builds them):
        the entries evicted, least recently used first, or None when refused. With ``cut``,
        the entry is ``frame._cut(cut)`` (``byte_size`` its size), cut when first looked up."""
        if token_count < self.min_tokens or byte_size == 0:
            return None
        self._clock = clock = self._clock + 1
        entries = self._entries
        resident = self._resident_bytes
        previous = entries.pop(key, None)
        if previous is not None:
            resident -= previous.byte_size
        evicted: tuple[EvictedEntry, ...] = ()
        max_entries, max_bytes = self.max_entries, self.max_bytes
        left = len(entries)
        gone = 0
        while left:
            if left >= max_entries:
                reason: EvictionReason = "max_entries"
            elif max_bytes > 0 and resident + byte_size > max_bytes:
                reason = "max_bytes"
            else:
                break
            victim_key = next(iter(entries))
            victim = entries.pop(victim_key)
            left -= 1
            size = victim.byte_size
            resident -= size
            gone += size
            evicted += (
                _evicted_entry(victim_key, victim.token_count, size, reason, left, resident),
            )
        entries[key] = _Entry(token_count, byte_size, clock, frame, cut)
        self._resident_bytes = resident + byte_size
        self._records += 1
        if evicted:
            self._evictions += len(evicted)
            self._evicted_bytes += gone
        return evicted

    def clear(self) -> tuple[EvictedEntry, ...]:
        """Drop every entry; returns them (reason ``"cleared"``), least recently used first.

        Counters other than ``entries`` and ``resident_bytes`` are kept.
        """
        entries, resident_bytes = len(self._entries), self._resident_bytes
        cleared: list[EvictedEntry] = []
        for key, e in self._entries.items():
            entries -= 1
            resident_bytes -= e.byte_size
            cleared.append(
                EvictedEntry(
                    key=key,
                    token_count=e.token_count,
                    payload_bytes=e.byte_size,
                    reason="cleared",
                    entries_after=entries,
                    resident_bytes_after=resident_bytes,
                )
            )
        self._entries.clear()
        self._resident_bytes = 0
        return tuple(cleared)

    def count_misses(self, count: int) -> None:
        """Account for ``count`` lookups known to miss, exactly as that many missed
        :meth:`lookup` calls would: the clock and the lookup and miss counters advance; no entry
        changes. Lets a caller skip hashing keys that the count index rules out.

        Raises:
            ConfigError: ``count`` is negative.
        """
        _bound("count", count, 0)
        self._miss(count)

    def _miss(self, count: int) -> None:
        """:meth:`count_misses` of a checked count."""
        self._clock += count
        self._lookups += count

    def stats(self) -> ResidentCacheStats:
        """Current counters."""
        return ResidentCacheStats(
            entries=len(self._entries),
            resident_bytes=self._resident_bytes,
            lookups=self._lookups,
            hits=self._hits,
            misses=self._lookups - self._hits,
            records=self._records,
            evictions=self._evictions,
            evicted_bytes=self._evicted_bytes,
        )
