"""ResidentActivationCache: strict LRU on a logical clock (spec §4), against a reference model."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from stage_runtime import ActivationFrame, ConfigError, FrameError
from stage_runtime.cache import (
    CacheRecordOutcome,
    EvictedEntry,
    EvictionReason,
    ResidentActivationCache,
    ResidentCacheStats,
)

from ._seed import cache_state


def frame(tokens: int = 4, nbytes: int = 16) -> ActivationFrame:
    """A virtual frame: the cache never looks inside payloads."""
    return ActivationFrame.virtual(token_count=tokens, bytes_per_token=nbytes // tokens)


def test_lookup_miss_and_hit_return_entry_and_entry_count() -> None:
    """A miss is None; a hit returns token count, bytes, current entries and the same frame."""
    cache = ResidentActivationCache(max_entries=4)
    assert cache.lookup("a") is None
    f = frame()
    cache.record("a", 4, 16, f)
    hit = cache.lookup("a")
    assert hit is not None
    assert (hit.token_count, hit.byte_size, hit.entries) == (4, 16, 1)
    assert hit.frame is f


def test_clock_advances_on_every_lookup_and_stored_record_only() -> None:
    """Lookups (hit or miss) and stored records tick; refused records do not."""
    cache = ResidentActivationCache(max_entries=4, min_tokens=2)
    cache.lookup("x")
    assert cache.clock == 1
    cache.record("a", 1, 16, frame())  # refused: below min_tokens
    cache.record("a", 4, 0, frame())  # refused: zero bytes
    assert cache.clock == 1
    assert len(cache) == 0
    cache.record("a", 4, 16, frame())
    cache.lookup("a")
    assert cache.clock == 3


def test_refused_record_reports_nothing() -> None:
    """A refused record stores nothing and evicts nothing."""
    cache = ResidentActivationCache(max_entries=1, min_tokens=8)
    assert cache.record("a", 7, 16, frame()) == CacheRecordOutcome()
    assert cache.stats().records == 0


def test_lookup_refreshes_recency_so_the_other_entry_is_evicted() -> None:
    """Strict LRU: a looked-up entry survives; the least recently used one goes."""
    cache = ResidentActivationCache(max_entries=2)
    cache.record("a", 4, 16, frame())
    cache.record("b", 4, 16, frame())
    cache.lookup("a")
    outcome = cache.record("c", 4, 16, frame())
    assert outcome.evicted == (
        EvictedEntry(
            key="b",
            token_count=4,
            payload_bytes=16,
            reason="max_entries",
            entries_after=1,
            resident_bytes_after=16,
        ),
    )
    assert (outcome.evicted_entries, outcome.evicted_bytes) == (1, 16)
    assert cache.keys() == ["a", "c"]


def test_miss_lookup_does_not_refresh_anything() -> None:
    """A miss advances the clock but leaves recency order alone."""
    cache = ResidentActivationCache(max_entries=2)
    cache.record("a", 4, 16, frame())
    cache.record("b", 4, 16, frame())
    cache.lookup("zzz")
    assert cache.record("c", 4, 16, frame()).evicted[0].key == "a"


def test_re_record_replaces_without_counting_an_eviction() -> None:
    """Re-recording a key subtracts its old bytes and is not an eviction."""
    cache = ResidentActivationCache(max_entries=2, max_bytes=100)
    cache.record("a", 4, 40, frame())
    cache.record("b", 4, 40, frame())
    outcome = cache.record("a", 4, 60, frame(4, 60))
    assert outcome.evicted_entries == 0
    assert cache.stats().resident_bytes == 100
    assert cache.keys() == ["b", "a"]
    assert cache.stats().evictions == 0


def test_byte_bound_evicts_until_it_fits() -> None:
    """max_bytes evicts least recently used entries until the new one fits."""
    cache = ResidentActivationCache(max_entries=10, max_bytes=100)
    for key in "abc":
        cache.record(key, 4, 30, frame())
    outcome = cache.record("d", 4, 50, frame())
    assert [e.key for e in outcome.evicted] == ["a", "b"]
    assert {e.reason for e in outcome.evicted} == {"max_bytes"}
    assert cache.stats().resident_bytes == 80


def test_oversize_entry_is_inserted_after_evicting_everything() -> None:
    """An entry larger than max_bytes is stored anyway, alone, above the bound."""
    cache = ResidentActivationCache(max_entries=10, max_bytes=100)
    cache.record("a", 4, 60, frame())
    cache.record("b", 4, 30, frame())
    outcome = cache.record("big", 4, 500, frame())
    assert outcome.evicted_entries == 2
    assert cache.keys() == ["big"]
    assert cache.stats().resident_bytes == 500
    nxt = cache.record("c", 4, 10, frame())
    assert [e.key for e in nxt.evicted] == ["big"]


def test_zero_max_bytes_means_unbounded() -> None:
    """max_bytes 0 never evicts for bytes."""
    cache = ResidentActivationCache(max_entries=3, max_bytes=0)
    for key in "abc":
        assert cache.record(key, 4, 10**12, frame()).evicted_entries == 0
    assert cache.stats().resident_bytes == 3 * 10**12


def test_stats_count_lookups_hits_misses_records_and_evictions() -> None:
    """Beyond the upstream: lookups, hits, misses, records, evictions and evicted bytes."""
    cache = ResidentActivationCache(max_entries=1)
    cache.record("a", 4, 16, frame())
    cache.lookup("a")
    cache.lookup("b")
    cache.record("b", 4, 8, frame())
    assert cache.stats() == ResidentCacheStats(
        entries=1,
        resident_bytes=8,
        lookups=2,
        hits=1,
        misses=1,
        records=2,
        evictions=1,
        evicted_bytes=16,
    )


def test_clear_returns_entries_in_lru_order() -> None:
    """clear() empties the cache and returns every entry with reason cleared."""
    cache = ResidentActivationCache(max_entries=4)
    cache.record("a", 4, 16, frame())
    cache.record("b", 5, 20, frame(5, 20))
    cache.lookup("a")
    cleared = cache.clear()
    assert cleared == (
        EvictedEntry(
            key="b",
            token_count=5,
            payload_bytes=20,
            reason="cleared",
            entries_after=1,
            resident_bytes_after=16,
        ),
        EvictedEntry(
            key="a",
            token_count=4,
            payload_bytes=16,
            reason="cleared",
            entries_after=0,
            resident_bytes_after=0,
        ),
    )
    stats = cache.stats()
    assert (stats.entries, stats.resident_bytes, stats.evictions) == (0, 0, 0)
    assert "a" not in cache


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_entries": 0}, "max_entries must be >= 1, got 0"),
        ({"max_bytes": -1}, "max_bytes must be >= 0, got -1"),
        ({"min_tokens": 1.5}, "min_tokens must be an integer, got 1.5"),
    ],
)
def test_constructor_rejects_bad_bounds(kwargs: dict[str, Any], message: str) -> None:
    """Bounds are ConfigErrors naming the field; max_entries must be at least 1."""
    with pytest.raises(ConfigError, match=message):
        ResidentActivationCache(**kwargs)


@pytest.mark.parametrize(
    ("args", "error", "message"),
    [
        ((1, 4, 16, frame()), ConfigError, "key must be a string, got 1"),
        (("k", -1, 16, frame()), ConfigError, "token_count must be >= 0, got -1"),
        (("k", 4, -16, frame()), ConfigError, "byte_size must be >= 0, got -16"),
        (("k", 4, 16, b"rows"), FrameError, "frame must be an ActivationFrame, got bytes"),
    ],
)
def test_bad_record_leaves_cache_unchanged(
    args: tuple[Any, ...], error: type[Exception], message: str
) -> None:
    """A rejected record raises a typed error and changes nothing, not even the clock."""
    cache = ResidentActivationCache(max_entries=2)
    cache.record("a", 4, 16, frame())
    cache.lookup("a")
    before = cache_state(cache)
    with pytest.raises(error, match=message):
        cache.record(*args)
    assert cache_state(cache) == before
    with pytest.raises(ConfigError, match="key must be a string, got None"):
        cache.lookup(None)  # type: ignore[arg-type]
    assert cache_state(cache) == before


# --- stateful: the cache against a dict + counter reference model ---------------------------

# Half the keys look like activation keys, so the count index is exercised too.
KEYS = st.sampled_from(
    [f"k{i}" for i in range(3)] + [f"act:stage:0:{300 + i % 2}:0:ab{i}:w4" for i in range(4)]
)


class CacheMachine(RuleBasedStateMachine):
    """Every operation on the cache matches a naive dict + logical clock model."""

    def __init__(self) -> None:
        super().__init__()
        self.cache: ResidentActivationCache | None = None
        self.max_entries = 1
        self.max_bytes = 0
        self.min_tokens = 0
        self.clock = 0
        self.model: dict[str, tuple[int, int, int]] = {}  # key -> (tokens, bytes, last_used)
        self.lookups = self.hits = self.records = self.evictions = self.evicted_bytes = 0

    @precondition(lambda self: self.cache is None)
    @rule(
        max_entries=st.integers(1, 5),
        max_bytes=st.sampled_from([0, 50, 100, 250]),
        min_tokens=st.integers(0, 3),
    )
    def create(self, max_entries: int, max_bytes: int, min_tokens: int) -> None:
        self.cache = ResidentActivationCache(max_entries, max_bytes, min_tokens)
        self.max_entries, self.max_bytes, self.min_tokens = max_entries, max_bytes, min_tokens

    @precondition(lambda self: self.cache is not None)
    @rule(key=KEYS)
    def lookup(self, key: str) -> None:
        assert self.cache is not None
        self.clock += 1
        self.lookups += 1
        got = self.cache.lookup(key)
        if key not in self.model:
            assert got is None
            return
        self.hits += 1
        tokens, nbytes, _ = self.model[key]
        self.model[key] = (tokens, nbytes, self.clock)
        assert got is not None
        assert (got.token_count, got.byte_size, got.entries) == (tokens, nbytes, len(self.model))

    @precondition(lambda self: self.cache is not None)
    @rule(key=KEYS, tokens=st.integers(0, 6), nbytes=st.sampled_from([0, 10, 40, 90, 300]))
    def record(self, key: str, tokens: int, nbytes: int) -> None:
        assert self.cache is not None
        outcome = self.cache.record(key, tokens, nbytes, frame())
        if tokens < self.min_tokens or nbytes == 0:
            assert outcome == CacheRecordOutcome()
            return
        self.clock += 1
        self.model.pop(key, None)
        expected: list[EvictedEntry] = []
        while self.model:
            resident = sum(b for _, b, _ in self.model.values())
            reason: EvictionReason
            if len(self.model) + 1 > self.max_entries:
                reason = "max_entries"
            elif self.max_bytes > 0 and resident + nbytes > self.max_bytes:
                reason = "max_bytes"
            else:
                break
            victim = min(self.model, key=lambda k: self.model[k][2])
            vt, vb, _ = self.model.pop(victim)
            expected.append(
                EvictedEntry(
                    key=victim,
                    token_count=vt,
                    payload_bytes=vb,
                    reason=reason,
                    entries_after=len(self.model),
                    resident_bytes_after=resident - vb,
                )
            )
        self.model[key] = (tokens, nbytes, self.clock)
        self.records += 1
        self.evictions += len(expected)
        self.evicted_bytes += sum(e.payload_bytes for e in expected)
        assert outcome.evicted == tuple(expected)
        assert outcome.evicted_entries == len(expected)
        assert outcome.evicted_bytes == sum(e.payload_bytes for e in expected)

    @precondition(lambda self: self.cache is not None)
    @rule()
    def clear(self) -> None:
        assert self.cache is not None
        order = sorted(self.model, key=lambda k: self.model[k][2])
        cleared = self.cache.clear()
        assert [e.key for e in cleared] == order
        assert all(e.reason == "cleared" for e in cleared)
        assert [e.entries_after for e in cleared] == list(range(len(order) - 1, -1, -1))
        assert not cleared or cleared[-1].resident_bytes_after == 0
        self.model.clear()

    @invariant()
    def matches_model(self) -> None:
        if self.cache is None:
            return
        stats = self.cache.stats()
        assert stats.entries == len(self.model)
        assert stats.resident_bytes == sum(b for _, b, _ in self.model.values())
        assert self.cache.keys() == sorted(self.model, key=lambda k: self.model[k][2])
        assert self.cache.clock == self.clock
        assert (stats.lookups, stats.hits, stats.misses) == (
            self.lookups,
            self.hits,
            self.lookups - self.hits,
        )
        assert (stats.records, stats.evictions, stats.evicted_bytes) == (
            self.records,
            self.evictions,
            self.evicted_bytes,
        )
        assert stats.entries <= self.max_entries


CacheMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestCacheAgainstReferenceModel = CacheMachine.TestCase


def test_count_misses_acts_like_missed_lookups() -> None:
    """count_misses(n) advances the clock and the lookup/miss counters by n, nothing else."""
    a = ResidentActivationCache(max_entries=2)
    b = ResidentActivationCache(max_entries=2)
    for cache in (a, b):
        cache.record("x", 4, 16, frame())
    for _ in range(3):
        a.lookup("missing")
    b.count_misses(3)
    assert a.clock == b.clock == 4
    assert a.stats() == b.stats()
    with pytest.raises(ConfigError, match="count must be >= 0, got -1"):
        b.count_misses(-1)
