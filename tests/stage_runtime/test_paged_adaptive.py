"""The paged index's adaptive eviction (per-class reuse learnt online, see
:class:`~stage_runtime.cache.paged.eviction.AdaptiveEviction`)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stage_runtime.cache.paged import PagedActivationIndex
from stage_runtime.cache.paged import index as index_module
from stage_runtime.cache.paged.eviction import _CLASSES, AdaptiveEviction, record_class
from tests.stage_runtime.test_paged import BPT, record, restored, rows


def _index(max_entries: int, *, eviction: str = "adaptive", **bounds: int) -> PagedActivationIndex:
    return PagedActivationIndex(page_tokens=1, max_entries=max_entries, eviction=eviction, **bounds)


def test_record_classes() -> None:
    """A record's class: whether it continued a known prefix, and the binary order of magnitude
    of its new pages (0, 1, 2-3, 4-7, ... 64 or more)."""
    assert [record_class(False, n) for n in (1, 2, 3, 4, 8, 63, 64, 10_000)] == [
        1,
        2,
        2,
        3,
        4,
        6,
        7,
        7,
    ]
    assert [record_class(True, n) for n in (0, 1, 3, 64, 10_000)] == [8, 9, 10, 15, 15]


def _train(index: PagedActivationIndex, records: int = 300) -> None:
    """Conversations 1-3 come back every few records, each turn adding one page to a known
    first page (class 9); between them, one-off documents of four new pages (class 3) never
    come back."""
    for i in range(records):
        if i % 2:
            record(index, [1 + i % 3, 100 + i])
        else:
            record(index, [10_000 + 4 * i + k for k in range(4)])


def test_values_are_learnt_from_the_records_that_come_back() -> None:
    """Each class starts at the prior; a class whose first pages come back within the window
    rises, one whose windows close without a return falls, and it goes first."""
    index = _index(12)
    strategy = index._eviction
    assert isinstance(strategy, AdaptiveEviction)
    prior = strategy.value(3)
    assert strategy.value(9) == prior
    _train(index)
    assert strategy.value(9) > 0.9
    assert strategy.value(3) < 0.01
    assert strategy._order[0] == 3


def test_a_learnt_conversation_outlives_a_flood_of_one_off_documents() -> None:
    """Once the policy has learnt that documents do not come back and conversations do, a
    conversation's turn outlives three documents that fill the whole cache: LRU loses it."""
    for eviction, kept in (("lru", 0), ("adaptive", 2)):
        index = _index(12, eviction=eviction)
        _train(index)
        record(index, [1, 999])
        for doc in range(3):
            record(index, [50_000 + 4 * doc + k for k in range(4)])
        assert restored(index, [1, 999]) == kept, eviction


def test_a_leaf_unused_for_many_turnovers_goes_first() -> None:
    """Pages of a valued class are not kept forever: a conversation's turn that never comes
    back outlives a few documents, but not sixteen turnovers of the cache."""
    index = _index(12)
    _train(index)
    record(index, [1, 999])
    for doc in range(20):
        record(index, [50_000 + 4 * doc + k for k in range(4)])
    assert restored(index, [1, 999]) == 2
    for doc in range(20, 300):
        record(index, [50_000 + 4 * doc + k for k in range(4)])
    assert restored(index, [1, 999]) < 2


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
    for token in (1, 2, 3, 4):
        record(index, [token])
    calls = 0
    next_leaf = AdaptiveEviction._next_leaf

    def interrupted(self: AdaptiveEviction, aged: list[int]) -> Any:
        nonlocal calls
        calls += 1
        if calls == 3:
            raise KeyboardInterrupt
        return next_leaf(self, aged)

    monkeypatch.setattr(AdaptiveEviction, "_next_leaf", interrupted)
    with pytest.raises(KeyboardInterrupt):
        record(index, [5, 6, 7, 8])
    monkeypatch.undo()
    assert calls == 3
    strategy = index._eviction
    assert isinstance(strategy, AdaptiveEviction)
    assert not strategy._in_pass
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
    """Whatever the operations: no page is cached without its parent, the bounds hold, child
    counts are exact, and every resident page has a class and every leaf is on its heap."""
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
        children: dict[int, int] = {}
        for entry in entries.values():
            if entry.parent is not None:
                children[id(entry.parent)] = children.get(id(entry.parent), 0) + 1
        for entry in entries.values():
            assert entry.children == children.get(id(entry), 0)
            assert 0 <= entry.tier < _CLASSES
            if entry.children == 0:  # every leaf can be found on its class's heap
                assert any(
                    item[2] is entry and AdaptiveEviction._current(entry.tier, item)
                    for item in strategy._heaps[entry.tier]
                )


def _record_interrupted_at_its_third_page(
    monkeypatch: pytest.MonkeyPatch, index: PagedActivationIndex, tokens: list[int]
) -> None:
    """Record ``tokens`` (one-token pages), interrupted as its third new page is stored."""
    entry = index_module._Entry  # type: ignore[attr-defined]
    calls = 0

    def interrupted(*args: Any) -> Any:  # (each new page is made an entry first)
        nonlocal calls
        calls += 1
        if calls == 3:
            raise KeyboardInterrupt
        return entry(*args)

    with monkeypatch.context() as patched:
        patched.setattr(index_module, "_Entry", interrupted)
        with pytest.raises(KeyboardInterrupt):
            record(index, tokens)


@pytest.mark.parametrize("eviction", ["adaptive", "lru", "reuse"])
def test_pages_of_an_interrupted_record_can_still_be_evicted(
    monkeypatch: pytest.MonkeyPatch, eviction: str
) -> None:
    """A record interrupted between two pages still ends for the strategy (the index tells it
    before the interrupt goes on): the pages it stored are leaves like any other and make
    room for later records."""
    index = _index(4, eviction=eviction)
    _record_interrupted_at_its_third_page(monkeypatch, index, [1, 2, 3])
    assert index.statistics().pages == 2  # the counters hold the pages stored
    assert restored(index, [1, 2]) == 2
    outcome = record(index, [5, 6, 7, 8])
    assert outcome.stored_entries == 4  # type: ignore[attr-defined]
    assert restored(index, [5, 6, 7, 8]) == 4


@pytest.mark.parametrize("eviction", ["adaptive", "lru", "reuse"])
def test_an_interrupted_record_leaves_no_page_without_its_parent(
    monkeypatch: pytest.MonkeyPatch, eviction: str
) -> None:
    """The pages an interrupted record stored go child first like any chain's: later records
    that need room never evict a parent and keep its child (every resident page's parent is
    resident). (No restore in between: a restore would reorder the chain by itself.)"""
    index = _index(4, eviction=eviction)
    _record_interrupted_at_its_third_page(monkeypatch, index, [1, 2, 3, 4])
    assert index.statistics().pages == 2
    for tokens in ([7, 8, 9], [5], [6, 6]):
        record(index, tokens)
        for entry in index._entries.values():
            assert entry.parent is None or entry.parent.key in index._entries


@pytest.mark.parametrize("eviction", ["adaptive", "lru", "reuse"])
def test_a_record_interrupted_before_its_first_new_page_leaves_its_chain_evictable(
    monkeypatch: pytest.MonkeyPatch, eviction: str
) -> None:
    """Interrupted after refreshing cached pages but before storing any: the refreshed chain
    is still made of leaves and parents the strategy can evict, by records and by clear."""
    index = _index(4, eviction=eviction)
    record(index, [1, 2])

    def interrupted(*args: Any) -> Any:
        raise KeyboardInterrupt

    monkeypatch.setattr(index_module, "_Entry", interrupted)
    with pytest.raises(KeyboardInterrupt):
        record(index, [1, 2, 3])
    monkeypatch.undo()
    outcome = record(index, [5, 6, 7, 8])
    assert outcome.stored_entries == 4  # type: ignore[attr-defined]
    assert restored(index, [1, 2]) == 0
    record(index, [1, 2])
    index.clear()
    assert index.statistics().entries == 0
