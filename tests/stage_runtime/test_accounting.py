"""Tests of the accounting helpers: miss tombstones and the unique-prefix footprint."""

from __future__ import annotations

import gc

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stage_runtime import accounting as accounting_module
from stage_runtime.accounting import CacheAccounting, MissTracker, PrefixFootprint


def tokens(*values: int) -> npt.NDArray[np.int32]:
    return np.array(values, dtype=np.int32)


def test_miss_tracker_forgets_the_oldest_tombstone_first() -> None:
    """Past its capacity the tracker drops the oldest eviction; a re-cached key loses its own."""
    tracker = MissTracker(capacity=2)
    for key in ("a", "b", "c"):
        tracker.evicted(key)
    assert not tracker.was_evicted("a")
    assert tracker.was_evicted("b")
    tracker.cached("b")
    assert not tracker.was_evicted("b")
    assert len(tracker) == 1


@pytest.mark.parametrize(
    ("each", "batched"), [("evicted", "evicted_all"), ("cached", "cached_all")]
)
@settings(max_examples=200, deadline=None)
@given(
    capacity=st.integers(1, 6),
    before=st.lists(st.integers(0, 9), max_size=12),
    batch=st.lists(st.integers(0, 9), max_size=12),
)
def test_a_batch_keeps_the_tombstones_one_call_per_key_keeps(
    each: str, batched: str, capacity: int, before: list[int], batch: list[int]
) -> None:
    """evicted_all (the paged index buries a room-making's victims in one call) and cached_all
    (it forgets the tombstones of a record's new pages in one call) keep the tombstones one
    evicted or cached call per key would keep, in the same order."""
    one, many = MissTracker(capacity=capacity), MissTracker(capacity=capacity)
    for key in before:
        one.evicted(key)
        many.evicted(key)
    for key in batch:
        getattr(one, each)(key)
    getattr(many, batched)(batch)
    assert list(one._tombstones) == list(many._tombstones)


@given(
    capacity=st.integers(1, 6),
    before=st.lists(st.integers(0, 19), max_size=12),
    fresh=st.sets(st.integers(20, 39), max_size=12),
)
def test_new_keys_go_in_as_evicted_all_would_bury_them(
    capacity: int, before: list[int], fresh: set[int]
) -> None:
    """evicted_new (the paged index burying pages resident until now, which have no tombstone)
    keeps the tombstones evicted_all keeps, in the same order, the capacity's oldest dropped."""
    new, general = MissTracker(capacity=capacity), MissTracker(capacity=capacity)
    new.evicted_all(before)
    general.evicted_all(before)
    keys = sorted(fresh, key=lambda key: (key * 7) % 20)  # any order: theirs is kept
    new.evicted_new(keys)
    general.evicted_all(keys)
    assert list(new._tombstones) == list(general._tombstones)
    assert len(new) <= capacity


def test_footprint_counts_shared_leading_tokens_once() -> None:
    """Two segments after one parent that agree on 2 tokens need 2 + 2 + 1 token rows."""
    footprint = PrefixFootprint()
    footprint.add("x", [(b"root", tokens(1, 2, 3, 4))], 10)
    footprint.add("y", [(b"root", tokens(1, 2, 9))], 10)
    assert footprint.unique_bytes() == 5 * 10
    footprint.add("x", [(b"root", tokens(1, 2, 3, 4))], 10)  # re-adding an owner: no change
    assert footprint.unique_bytes() == 5 * 10
    footprint.remove("x")
    assert footprint.unique_bytes() == 3 * 10
    footprint.remove("y")
    assert footprint.unique_bytes() == 0


def test_what_the_footprint_keeps_per_owner_is_not_tracked_by_the_collector() -> None:
    """One flat tuple of ints and bytes per owner (a large paged cache holds one per page):
    after a collection none of it adds to what each full collection visits."""
    footprint = PrefixFootprint()
    footprint.add_segment("page", b"root", tokens(1, 2, 3, 4).tobytes(), 8)
    footprint.add("exact", [(b"root", tokens(1, 2, 3, 4)), (b"p1", tokens(5, 6))], 8)
    gc.collect()
    assert not any(gc.is_tracked(held) for held in footprint._owners.values())
    assert footprint.unique_bytes() == 6 * 8
    footprint.remove("exact")
    assert footprint.unique_bytes() == 4 * 8
    footprint.remove("page")
    assert footprint.unique_bytes() == 0


def test_a_read_after_one_more_child_compares_it_with_its_neighbours_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A shared first page can have a child per request: a read after one more child costs a
    few prefix comparisons, not a recount of every child (which made each statistics read of
    such a cache slower than the last)."""
    footprint = PrefixFootprint()
    for i in range(500):
        footprint.add_segment(f"child-{i}", b"system prompt", tokens(7, i, 1).tobytes(), 2)
    assert footprint.unique_bytes() == (1 + 500 * 2) * 2
    compared: list[int] = []
    real = accounting_module._common_prefix_tokens

    def counting(a: bytes, b: bytes) -> int:
        compared.append(1)
        return real(a, b)

    monkeypatch.setattr(accounting_module, "_common_prefix_tokens", counting)
    footprint.add_segment("one more", b"system prompt", tokens(7, 250, 9).tobytes(), 2)
    assert footprint.unique_bytes() == (1 + 500 * 2 + 1) * 2
    footprint.remove("child-3")
    assert footprint.unique_bytes() == (1 + 499 * 2 + 1) * 2
    assert len(compared) <= 6


def test_footprint_separates_parents() -> None:
    """Equal tokens after different parents (other prefixes) are different rows."""
    footprint = PrefixFootprint()
    footprint.add("x", [(b"p1", tokens(5, 6))], 1)
    footprint.add("y", [(b"p2", tokens(5, 6))], 1)
    assert footprint.unique_bytes() == 4


def test_residency_ratio_of_an_empty_cache_is_zero() -> None:
    """No unique bytes: the ratio is 0, not a division error."""
    empty = CacheAccounting(
        index="paged",
        lookups=0,
        hits=0,
        misses_never_seen=0,
        misses_evicted=0,
        misses_rejected=0,
        restored_tokens=0,
        entries=0,
        resident_bytes=0,
        unique_prefix_bytes=0,
        evictions=0,
        evicted_bytes=0,
    )
    assert empty.residency_ratio == 0.0
    assert empty.misses == 0


def test_footprint_width_shrinks_when_the_widest_owner_leaves() -> None:
    """A group's byte width is that of the widest segment held now, not ever: after the f32
    owner leaves, its f16 neighbour counts at 2 bytes per token (read in between or not)."""
    for read_between in (False, True):
        footprint = PrefixFootprint()
        footprint.add("f32", [(b"root", tokens(1, 2))], 4)
        footprint.add("f16", [(b"root", tokens(3, 4))], 2)
        if read_between:
            assert footprint.unique_bytes() == 4 * 4  # two 2-token segments at the widest, 4 B
        footprint.remove("f32")
        assert footprint.unique_bytes() == 2 * 2
        footprint.add("f16-b", [(b"root", tokens(5, 6))], 2)
        assert footprint.unique_bytes() == 4 * 2
        footprint.remove("f16")
        footprint.remove("f16-b")
        assert footprint.unique_bytes() == 0


def _brute_force_unique_bytes(owners: dict[str, tuple[int, list[tuple[bytes, bytes]]]]) -> int:
    """The footprint from its definition: per parent, the distinct token prefixes of the
    segments held after it, times the widest row held there."""
    prefixes: dict[bytes, set[bytes]] = {}
    widest: dict[bytes, int] = {}
    for width, held in owners.values():
        for parent, data in held:
            rows = prefixes.setdefault(parent, set())
            rows.update(data[: 4 * k] for k in range(1, len(data) // 4 + 1))
            widest[parent] = max(widest.get(parent, 0), width)
    return sum(len(rows) * widest[parent] for parent, rows in prefixes.items())


_segments = st.lists(
    st.tuples(
        st.sampled_from([b"p1", b"p2", b"p3"]),
        st.lists(st.integers(0, 2), min_size=1, max_size=4).map(lambda ids: tokens(*ids)),
    ),
    min_size=1,
    max_size=3,
)
_operations = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.sampled_from("abcdef"), _segments, st.sampled_from([1, 3])),
        st.tuples(st.just("remove"), st.sampled_from("abcdef"), st.none(), st.none()),
        st.tuples(st.just("read"), st.none(), st.none(), st.none()),
    ),
    max_size=40,
)


@settings(max_examples=300, deadline=None)
@given(_operations)
def test_footprint_matches_its_definition_after_any_adds_and_removes(
    operations: list[tuple[str, str | None, object, int | None]],
) -> None:
    """Adds (of one segment or several, by either method), removes and reads in any order: each
    read equals the footprint computed from scratch from the owners held then."""
    footprint = PrefixFootprint()
    owners: dict[str, tuple[int, list[tuple[bytes, bytes]]]] = {}
    for kind, owner, segments, width in operations:
        if kind == "add":
            assert owner is not None
            assert width is not None
            held = [(parent, ids.tobytes()) for parent, ids in segments]  # type: ignore[attr-defined]
            if len(held) == 1 and owner < "c":
                footprint.add_segment(owner, *held[0], width)
            else:
                footprint.add(owner, segments, width)  # type: ignore[arg-type]
            owners.setdefault(owner, (width, held))
        elif kind == "remove":
            assert owner is not None
            footprint.remove(owner)
            owners.pop(owner, None)
        else:
            assert footprint.unique_bytes() == _brute_force_unique_bytes(owners)
    assert footprint.unique_bytes() == _brute_force_unique_bytes(owners)
