"""The paged index's adaptive eviction (ARC's rule over pages used once or again)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stage_runtime.cache.paged import PagedActivationIndex
from stage_runtime.cache.paged.eviction import AdaptiveEviction
from tests.stage_runtime.test_paged import BPT, record, restored, rows


def _index(max_entries: int, *, eviction: str = "adaptive", **bounds: int) -> PagedActivationIndex:
    return PagedActivationIndex(page_tokens=1, max_entries=max_entries, eviction=eviction, **bounds)


def test_a_prefix_used_twice_outlives_a_flood_of_one_off_prompts() -> None:
    """Page 1 is recorded twice, then four one-off pages flood a 3-page cache: LRU loses page
    1 to them; the adaptive policy evicts the one-off pages first and keeps it."""
    for eviction, kept in (("lru", 0), ("adaptive", 1)):
        index = _index(3, eviction=eviction)
        record(index, [1])
        record(index, [1])
        for token in (10, 11, 12, 13):
            record(index, [token])
        assert restored(index, [1]) == kept, eviction


def test_a_one_off_page_that_comes_back_teaches_it_recency() -> None:
    """A page evicted from the once class and recorded again raises the target share of the
    once class (ARC's B1 hit); one evicted from the again class lowers it (B2)."""
    index = _index(2)
    strategy = index._eviction
    assert isinstance(strategy, AdaptiveEviction)
    record(index, [1])
    record(index, [2])
    record(index, [3])  # evicts page 1 (once class, oldest)
    assert strategy.target == 0.0
    record(index, [1])  # back soon after: recency would have kept it
    assert strategy.target > 0.0
    raised = strategy.target
    for token in (1, 5, 5, 6, 6, 7, 7):  # 1 and the again-class pages churn through the cache
        record(index, [token])
    record(index, [5])
    assert strategy.target <= raised


def test_a_long_record_makes_its_room_in_one_pass_deepest_first(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A chain has one leaf, yet a record of four new pages needs all four of its pages gone:
    each parent a victim leaves a leaf is a candidate within the same pass, so the room is
    made at once (one eviction call), the chain going deepest first."""
    index = _index(4)
    record(index, [1, 2, 3, 4])
    calls: list[list[int]] = []
    evict_all = PagedActivationIndex._evict_all

    def counting(
        self: PagedActivationIndex, victims: list[tuple[Any, Any]], evicted: list[Any]
    ) -> None:
        calls.append([entry.token_start for entry, _ in victims])
        evict_all(self, victims, evicted)

    monkeypatch.setattr(PagedActivationIndex, "_evict_all", counting)
    outcome = record(index, [5, 6, 7, 8])
    assert calls == [[3, 2, 1, 0]]
    assert outcome.stored_entries == 4  # type: ignore[attr-defined]
    assert restored(index, [5, 6, 7, 8]) == 4
    assert restored(index, [1]) == 0


def test_an_interrupted_pass_loses_no_leaf(monkeypatch: pytest.MonkeyPatch) -> None:
    """An exception in the middle of the one-pass choice (an interrupt) leaves every chosen
    leaf on its heap: the next records still make their room and store their pages."""
    index = _index(4)
    record(index, [1, 2, 3, 4])
    calls = 0
    next_leaf = AdaptiveEviction._next_leaf

    def interrupted(self: AdaptiveEviction, kind: int, front: list[Any]) -> Any:
        nonlocal calls
        calls += 1
        if calls == 3:
            raise KeyboardInterrupt
        return next_leaf(self, kind, front)

    monkeypatch.setattr(AdaptiveEviction, "_next_leaf", interrupted)
    with pytest.raises(KeyboardInterrupt):
        record(index, [5, 6, 7, 8])
    monkeypatch.undo()
    strategy = index._eviction
    assert isinstance(strategy, AdaptiveEviction)
    assert not strategy._pushed
    outcome = record(index, [9, 10, 11, 12])
    assert outcome.stored_entries == 4  # type: ignore[attr-defined]
    assert restored(index, [9, 10, 11, 12]) == 4


@settings(max_examples=150, deadline=None)
@given(
    prompts=st.lists(
        st.tuples(
            st.sampled_from(["record", "restore", "clear"]), st.lists(st.integers(0, 3), max_size=6)
        ),
        max_size=40,
    ),
    max_entries=st.integers(1, 6),
    max_bytes=st.sampled_from([0, 5 * BPT, 9 * BPT]),
)
def test_the_cache_stays_prefix_closed_and_within_its_bounds(
    prompts: list[tuple[str, list[int]]], max_entries: int, max_bytes: int
) -> None:
    """Whatever the operations: no page is cached without its parent, the bounds hold, and the
    classes count exactly the resident pages."""
    index = _index(max_entries, max_bytes=max_bytes)
    strategy = index._eviction
    assert isinstance(strategy, AdaptiveEviction)
    for op, tokens in prompts:
        if op == "record":
            outcome = index.record(index.chain(b"ns", tokens), rows(b"ns", tokens))
            covered = outcome.covered_tokens
            if tokens and covered:
                lookup = index.restore(index.chain(b"ns", tokens[:covered]))
                assert lookup.restore is not None
                np.testing.assert_array_equal(
                    lookup.restore.payload(), rows(b"ns", tokens[:covered])
                )
        elif op == "restore" and tokens:
            index.restore(index.chain(b"ns", tokens))
        elif op == "clear":
            index.clear()
        entries = index._entries
        assert len(entries) <= max_entries
        if max_bytes:
            assert index.resident_bytes <= max_bytes
        for entry in entries.values():
            assert entry.parent is None or entries.get(entry.parent.key) is entry.parent
        assert sum(strategy._members) == len(entries)
        assert sorted(e.tier for e in entries.values()) == sorted(
            [0] * strategy._members[0] + [1] * strategy._members[1]
        )
