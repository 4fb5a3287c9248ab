"""Tests of the paged activation index (hand-built cases and a stateful model check)."""

from __future__ import annotations

import gc
import hashlib
import tracemalloc
import weakref
from collections.abc import Sequence
from typing import Any

import blake3
import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from stage_runtime.cache.paged import PagedActivationIndex, chains, page_chain
from stage_runtime.cache.paged.results import PagedRestore
from stage_runtime.errors import ConfigError, FrameError

BPT = 4  # bytes per token row in these tests


def rows(namespace: bytes, tokens: Sequence[int], bpt: int = BPT) -> npt.NDArray[np.uint8]:
    """Causal rows: row j depends only on the namespace and tokens[:j+1] (like a causal model)."""
    out = np.empty(len(tokens) * bpt, dtype=np.uint8)
    for j in range(len(tokens)):
        digest = hashlib.blake2b(namespace + bytes(str(list(tokens[: j + 1])), "ascii")).digest()
        out[j * bpt : (j + 1) * bpt] = np.frombuffer(digest[:bpt], dtype=np.uint8)
    out.flags.writeable = False
    return out


def record(index: PagedActivationIndex, tokens: Sequence[int], ns: bytes = b"ns") -> object:
    return index.record(index.chain(ns, list(tokens)), rows(ns, tokens))


def restored(index: PagedActivationIndex, tokens: Sequence[int], ns: bytes = b"ns") -> int:
    found = index.restore(index.chain(ns, list(tokens))).restore
    return 0 if found is None else found.token_count


def test_equal_prefixes_share_pages_across_prompts() -> None:
    """A second prompt with the same first pages stores only its new pages."""
    index = PagedActivationIndex(page_tokens=2, max_entries=100)
    first = record(index, [1, 2, 3, 4, 5, 6])
    second = index.record(index.chain(b"ns", [1, 2, 3, 4, 9, 9]), rows(b"ns", [1, 2, 3, 4, 9, 9]))
    assert first.stored_entries == 3  # type: ignore[attr-defined]
    assert second.stored_entries == 1
    assert second.reused_entries == 2
    assert len(index) == 4
    assert index.resident_bytes == 8 * BPT
    assert index.unique_prefix_bytes() == 8 * BPT


@pytest.mark.parametrize("eviction", ["lru", "reuse", "adaptive"])
def test_a_dropped_index_is_freed_at_once_without_the_garbage_collector(eviction: str) -> None:
    """Nothing in an index refers back to it (its eviction strategy holds it weakly), so an
    index with its entries goes when its last reference does, not at a full collection."""
    index = PagedActivationIndex(page_tokens=2, max_entries=4, eviction=eviction)
    for first in range(6):
        record(index, [first, 2, 3, 4, 5, 6])
    gone = weakref.ref(index)
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        del index
        assert gone() is None
    finally:
        if was_enabled:
            gc.enable()


def test_different_token_before_a_page_changes_every_later_key() -> None:
    """Chained keys: a difference in page 0 changes the key of page 1 with equal tokens."""
    a = page_chain(b"ns", [1, 2, 3, 4], page_tokens=2)
    b = page_chain(b"ns", [9, 2, 3, 4], page_tokens=2)
    c = page_chain(b"other", [1, 2, 3, 4], page_tokens=2)
    assert a.page_keys[0] != b.page_keys[0]
    assert a.page_keys[1] != b.page_keys[1]
    assert a.page_keys[0] != c.page_keys[0]
    assert a.page_keys == page_chain(b"ns", np.array([1, 2, 3, 4]), page_tokens=2).page_keys


@settings(max_examples=60, deadline=None)
@given(
    prompts=st.lists(
        st.tuples(
            st.sampled_from([b"ns", b"other"]),
            st.lists(st.integers(min_value=0, max_value=3), max_size=14),
        ),
        max_size=12,
    )
)
def test_index_chain_reusing_recent_prompts_gives_the_same_keys(
    prompts: list[tuple[bytes, list[int]]],
) -> None:
    """``index.chain`` takes shared leading keys from recent prompts: byte-identical keys."""
    index = PagedActivationIndex(page_tokens=2, max_entries=100)
    for ns, tokens in prompts:
        memo = index.chain(ns, tokens, label="x")
        fresh = page_chain(ns, tokens, page_tokens=2, label="x")
        assert memo.root_key == fresh.root_key
        assert memo.page_keys == fresh.page_keys
        assert memo.tail_key == fresh.tail_key
        assert memo.exact_key == fresh.exact_key
        assert memo.tokens.tolist() == tokens


@pytest.mark.parametrize("tokens", [[7, 8, 9, 10, 11], [7, 8, 9, 10], [7], []])
def test_chain_keys_follow_the_documented_chaining(tokens: list[int]) -> None:
    """Every key of a chain is the BLAKE3 chaining its module documents, recomputed here from
    the bytes (the exact key too, though it is computed only when first read): token keys
    chained over the tokens alone, each followed by 16 bytes of the namespace's root key."""

    def b3(*parts: bytes) -> bytes:
        return blake3.blake3(b"".join(parts)).digest()

    raw = np.array(tokens, dtype="<i4").tobytes()
    root = b3(b"stage-runtime/activation-root-v1", b"ns")
    tag = root[:16]
    keys, parent = [], b3(b"stage-runtime/activation-token-root-v1")
    for i in range(len(tokens) // 2):
        parent = b3(b"stage-runtime/activation-page-v1", parent, raw[8 * i : 8 * i + 8])
        keys.append(parent)
    rest = raw[8 * len(keys) :]
    tail = b3(b"stage-runtime/activation-tail-v1", parent, rest) if rest else None
    exact = b3(
        b"stage-runtime/activation-exact-v1", parent, len(tokens).to_bytes(8, "little"), rest
    )
    for chain in (
        page_chain(b"ns", tokens, page_tokens=2),
        PagedActivationIndex(page_tokens=2, max_entries=10).chain(b"ns", tokens),
    ):
        assert chain.root_key == root
        assert list(chain.page_keys) == [key + tag for key in keys]
        assert chain.tail_key == (None if tail is None else tail + tag)
        assert chain.exact_key == exact + tag


def test_stages_paging_one_prompt_array_hash_its_pages_once() -> None:
    """The token keys of a read-only prompt array are computed once for every index that pages
    it by the same page size; each namespace's keys still differ. The public ``page_chain``
    and arrays an index had to copy keep nothing."""
    tokens = np.arange(40, dtype=np.int32)
    tokens.flags.writeable = False
    first = PagedActivationIndex(page_tokens=4, max_entries=10).chain(b"stage-0", tokens)
    second = PagedActivationIndex(page_tokens=4, max_entries=10).chain(b"stage-1", tokens)
    assert second.token_chain is first.token_chain
    assert not set(first.page_keys) & set(second.page_keys)
    other_size = PagedActivationIndex(page_tokens=8, max_entries=10).chain(b"stage-1", tokens)
    assert other_size.token_chain is not first.token_chain
    alone = page_chain(b"stage-1", tokens, page_tokens=4)  # the public function: computed
    assert alone.token_chain is not first.token_chain
    assert alone.page_keys == second.page_keys
    kept = len(chains._shared_chains)
    PagedActivationIndex(page_tokens=4, max_entries=10).chain(b"stage-0", list(range(40)))
    PagedActivationIndex(page_tokens=4, max_entries=10).chain(b"stage-0", tokens.copy())
    assert len(chains._shared_chains) == kept  # private copies are never asked for again


def test_one_prompt_has_other_names_and_prefix_hashes_in_another_namespace() -> None:
    """Entry names and a hit's prefix hash come from the whole key: two tenants (namespaces)
    recording the same tokens log different names."""
    tokens = np.arange(10, dtype=np.int32)
    payload = np.zeros(10 * 4, dtype=np.uint8)
    index = PagedActivationIndex(page_tokens=4, max_entries=20)
    names = []
    for namespace in (b"tenant-a", b"tenant-b"):
        outcome = index.record(index.chain(namespace, tokens, label="act:s"), payload)
        names.append(outcome.last_entry)
        found = index.restore(index.chain(namespace, tokens, label="act:s")).restore
        assert found is not None
        assert found.last_name == outcome.last_entry
    assert names[0] != names[1]
    assert names[0].rsplit(":", 1)[0] == names[1].rsplit(":", 1)[0] == "act:s:tail:8+2"


def test_recent_chains_stay_within_their_count_and_token_bounds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The chains an index remembers are bounded by count and by tokens, oldest dropped first;
    a prompt that starts like a remembered one replaces it."""
    monkeypatch.setattr(chains, "_RECENT_CHAINS", 3)
    monkeypatch.setattr(chains, "_RECENT_TOKENS", 10)
    recent = chains.RecentChains()

    def token_chain(tokens: list[int]) -> chains.TokenChain:
        return page_chain(b"ns", tokens, page_tokens=2).token_chain

    made = [token_chain([i, i, i]) for i in range(5)]
    for chain in made[:3]:
        recent.remember(chain)
    assert (len(recent), recent._tokens) == (3, 9)
    recent.remember(made[3])  # 4 chains: over the count
    assert (len(recent), recent._tokens) == (3, 9)
    assert recent.take(made[0].page_keys[0]) is None
    assert recent.take(made[1].page_keys[0]) is made[1]
    assert (len(recent), recent._tokens) == (2, 6)
    recent.remember(token_chain([2, 2, 7, 7, 7]))  # replaces made[2]
    assert (len(recent), recent._tokens) == (2, 8)
    recent.remember(made[4])  # 11 tokens: over the budget
    assert (len(recent), recent._tokens) == (2, 8)
    assert recent.take(made[3].page_keys[0]) is None
    big = token_chain(list(range(12)))
    recent.remember(big)  # alone over the budget: kept, the only one
    assert (len(recent), recent._tokens) == (1, 12)
    assert recent.take(big.page_keys[0]) is big


@settings(max_examples=80, deadline=None)
@given(
    operations=st.lists(
        st.tuples(
            st.sampled_from(["record", "restore", "exact"]),
            st.lists(st.integers(min_value=0, max_value=2), min_size=1, max_size=9),
        ),
        max_size=20,
    ),
)
def test_a_restore_describes_the_entries_it_used(operations: list[tuple[str, list[int]]]) -> None:
    """Whatever was recorded (pages, tails, exact entries of rows or of opaque bytes), a hit's
    token counts, sizes and pages are those of the entries it used, in order."""
    index = PagedActivationIndex(page_tokens=2, max_entries=10)
    for operation, tokens in operations:
        chain = index.chain(b"ns", tokens)
        if operation == "record":
            index.record(chain, rows(b"ns", tokens))
        elif operation == "exact":  # an odd size: not rows
            index.record(chain, np.zeros(2 * len(tokens) + 1, dtype=np.uint8), token_major=False)
        found = index.restore(chain).restore
        if found is None:
            continue
        used: Sequence[Any] = found.used  # (the index's entries)
        assert found.page_token_counts == tuple(e.token_count for e in used)
        assert found.payload_bytes == sum(e.nbytes for e in used)
        assert found.pages == tuple(e.payload for e in used)
        assert found.token_count == sum(found.page_token_counts)


class _TouchingEachPage(PagedActivationIndex):
    """An index whose records always refresh their cached pages one by one."""

    __slots__ = ()

    def _fits_without_eviction(self, pages: int, payload_bytes: int) -> bool:
        return False


@settings(max_examples=80, deadline=None)
@given(
    max_entries=st.integers(3, 12),
    max_bytes=st.sampled_from([0, 0, 24, 48, 96]),
    operations=st.lists(
        st.tuples(
            st.booleans(),
            st.lists(st.integers(min_value=0, max_value=2), min_size=1, max_size=9),
            st.sampled_from([1, 2]),
        ),
        max_size=25,
    ),
)
def test_an_lru_record_with_room_to_spare_keeps_the_order_of_touching_each_page(
    max_entries: int, max_bytes: int, operations: list[tuple[bool, list[int], int]]
) -> None:
    """A record that cannot evict (the bounds fit all it could add) only checks its cached
    pages: record_ended orders the chain. Entries, their order (the LRU order) and every result
    equal an index that touches each page as it goes."""
    fast = PagedActivationIndex(page_tokens=2, max_entries=max_entries, max_bytes=max_bytes)
    slow = _TouchingEachPage(page_tokens=2, max_entries=max_entries, max_bytes=max_bytes)
    for is_record, tokens, width in operations:
        for index in (fast, slow):
            chain = index.chain(b"ns", tokens)
            if is_record:  # the same tokens with another row width: pages re-recorded
                data = np.repeat(rows(b"ns", tokens), width)
                index.record(chain, data)
            else:
                index.restore(chain)
        assert list(fast._entries) == list(slow._entries)
        assert fast.statistics() == slow.statistics()
        for key, entry in fast._entries.items():
            other = slow._entries[key]
            assert (entry.nbytes, entry.hits) == (other.nbytes, other.hits)


class _CountingFastRecords(PagedActivationIndex):
    """An index that counts the records that took the LRU fast path."""

    __slots__ = ("fast_records",)

    def _fits_without_eviction(self, pages: int, payload_bytes: int) -> bool:
        fits = super()._fits_without_eviction(pages, payload_bytes)
        self.fast_records = getattr(self, "fast_records", 0) + fits
        return fits


@pytest.mark.parametrize(
    ("max_entries", "max_bytes", "fast"), [(100, 0, 2), (100, 1000, 2), (4, 0, 1), (100, 40, 1)]
)
def test_an_lru_record_takes_the_fast_path_only_when_nothing_can_be_evicted(
    max_entries: int, max_bytes: int, fast: int
) -> None:
    """The second record of a prompt (3 pages and a tail, 28 bytes) with room for all of it
    again checks its cached pages only; with 4 entries, or 40 bytes, it could evict."""
    index = _CountingFastRecords(page_tokens=2, max_entries=max_entries, max_bytes=max_bytes)
    tokens = [1, 2, 3, 4, 5, 6, 7]
    for _ in range(2):
        record(index, tokens)
    assert index.fast_records == fast
    assert restored(index, tokens) == 7


@pytest.mark.parametrize("eviction", ["reuse", "adaptive", "lru"])
def test_new_pages_forget_their_tombstones_before_the_next_page_makes_room(
    eviction: str,
) -> None:
    """A strategy that makes room page by page buries keys between two new pages: each new
    page's tombstone goes first, so a full tracker drops the same ones as one page at a time."""
    index = PagedActivationIndex(page_tokens=1, max_entries=3, tombstones=3, eviction=eviction)
    for tokens in ([1], [2], [3], [4], [5], [6], [3, 9]):
        index.record(index.chain(b"ns", tokens), np.ones(len(tokens), dtype=np.uint8))
    reason = index.restore(index.chain(b"ns", [2])).miss_reason
    assert reason == ("evicted" if eviction == "reuse" else "never_seen")


def test_re_recording_wider_rows_under_a_tight_byte_bound_keeps_the_index_consistent() -> None:
    """Widening the rows of a cached prompt when only its first page fits: the first page is
    re-recorded (evicting the deeper page, whose rows were the old width anyway) and the record
    ends there, truncated. (The re-record used to raise a KeyError on the evicted page.)"""
    index = PagedActivationIndex(page_tokens=1, max_entries=10, max_bytes=3)
    chain = index.chain(b"ns", [1, 2])
    assert index.record(chain, np.ones(2, dtype=np.uint8)).stored_entries == 2
    outcome = index.record(chain, np.ones(6, dtype=np.uint8))  # 3-byte rows
    assert (outcome.stored_entries, outcome.reused_entries) == (0, 1)
    assert (outcome.covered_tokens, outcome.truncated) == (1, True)
    assert [page.reason for page in outcome.evicted.pages] == ["max_bytes"]
    assert (len(index), index.resident_bytes) == (1, 3)
    found = index.restore(index.chain(b"ns", [1, 2])).restore
    assert found is not None
    assert (found.token_count, found.bytes_per_token) == (1, 3)


def test_a_bytearray_namespace_keys_as_its_bytes() -> None:
    """A bytes-like namespace (not the declared bytes, but accepted) keys as its bytes."""
    namespace: Any = bytearray(b"ns")
    assert page_chain(namespace, [1, 2, 3], page_tokens=2).page_keys == (
        page_chain(b"ns", [1, 2, 3], page_tokens=2).page_keys
    )
    number: Any = 5  # (bytes(5) would be five zero bytes)
    with pytest.raises(TypeError):
        page_chain(number, [1, 2, 3], page_tokens=2)


def test_partial_tail_is_used_only_when_the_whole_prompt_matches() -> None:
    """The tail entry restores the exact prompt; an extension or a shorter prompt stops at pages."""
    index = PagedActivationIndex(page_tokens=2, max_entries=100)
    record(index, [1, 2, 3, 4, 5])
    assert index.statistics().tails == 1
    assert restored(index, [1, 2, 3, 4, 5]) == 5
    assert restored(index, [1, 2, 3, 4, 5, 6, 7]) == 4
    assert restored(index, [1, 2, 3]) == 2
    assert restored(index, [1, 2, 3, 4, 6]) == 4


def test_restore_returns_the_recorded_rows() -> None:
    """The restored payload equals the rows of the prefix, across pages recorded by two prompts."""
    index = PagedActivationIndex(page_tokens=2, max_entries=100)
    record(index, [1, 2, 3, 4])
    record(index, [1, 2, 3, 4, 5, 6, 7])
    found = index.restore(index.chain(b"ns", [1, 2, 3, 4, 5, 6, 7])).restore
    assert found is not None
    assert found.token_count == 7
    np.testing.assert_array_equal(found.payload(), rows(b"ns", [1, 2, 3, 4, 5, 6, 7]))
    assert found.page_token_counts == (2, 2, 2, 1)


def test_streaming_pages_are_views_of_the_stored_pages() -> None:
    """iter_pages hands out the stored arrays themselves; one page is returned without a copy."""
    index = PagedActivationIndex(page_tokens=2, max_entries=100)
    record(index, [1, 2, 3, 4])
    first = index.restore(index.chain(b"ns", [1, 2, 3, 4])).restore
    second = index.restore(index.chain(b"ns", [1, 2, 3, 4])).restore
    assert first is not None
    assert second is not None
    for (_, a), (_, b) in zip(first.iter_pages(), second.iter_pages(), strict=True):
        assert a is b
        assert not a.flags.writeable
    assert [start for start, _ in first.iter_pages()] == [0, 2]
    single = index.restore(index.chain(b"ns", [1, 2, 7])).restore
    assert single is not None
    assert single.payload() is single.pages[0]


def test_record_copies_real_bytes_so_pages_do_not_pin_the_frame() -> None:
    """Changing the recorder's buffer afterwards does not change what a restore returns."""
    index = PagedActivationIndex(page_tokens=2, max_entries=100)
    buffer = rows(b"ns", [1, 2, 3, 4]).copy()
    index.record(index.chain(b"ns", [1, 2, 3, 4]), buffer)
    buffer[:] = 0
    found = index.restore(index.chain(b"ns", [1, 2, 3, 4])).restore
    assert found is not None
    np.testing.assert_array_equal(found.payload(), rows(b"ns", [1, 2, 3, 4]))


def test_leaf_first_eviction_keeps_an_older_inner_page() -> None:
    """The least recently used page is inner, so its leaf goes first and the chain has no gap."""
    index = PagedActivationIndex(page_tokens=2, max_entries=2)
    record(index, [1, 2, 3, 4])  # page0 (older), page1 (leaf)
    outcome = record(index, [7, 8])
    evicted = outcome.evicted  # type: ignore[attr-defined]
    assert [(e.kind, e.token_start, e.token_count, e.reason) for e in evicted] == [
        ("page", 2, 2, "max_entries")
    ]
    assert restored(index, [1, 2, 3, 4]) == 2
    assert restored(index, [7, 8]) == 2


def test_restore_uses_the_run_before_an_evicted_inner_page() -> None:
    """After the inner page of a chain is evicted, only the pages before it are restored."""
    index = PagedActivationIndex(page_tokens=2, max_entries=3)
    record(index, [1, 2, 3, 4, 5, 6])
    record(index, [7, 8])  # evicts page 2 (the leaf)
    record(index, [9, 9])  # page 1 is now a leaf and the oldest one: evicted
    found = index.restore(index.chain(b"ns", [1, 2, 3, 4, 5, 6])).restore
    assert found is not None
    assert found.token_count == 2
    np.testing.assert_array_equal(found.payload(), rows(b"ns", [1, 2]))


def test_restore_refreshes_the_recency_of_every_page_it_used() -> None:
    """A restore makes its pages the most recently used: the other chain's leaves go first."""
    index = PagedActivationIndex(page_tokens=2, max_entries=4)
    record(index, [1, 2, 3, 4])  # oldest chain
    record(index, [5, 6, 7, 8])
    assert restored(index, [1, 2, 3, 4]) == 4  # refreshes both of its pages
    outcome = record(index, [9, 9, 9, 9])
    gone = [(e.token_start, e.token_count) for e in outcome.evicted]  # type: ignore[attr-defined]
    assert gone == [(2, 2), (0, 2)]  # the unrestored chain, leaf then its page 0
    assert restored(index, [1, 2, 3, 4]) == 4
    assert restored(index, [5, 6, 7, 8]) == 0


def test_leaf_first_eviction_under_the_byte_bound() -> None:
    """max_bytes evicts leaves too, each event reporting the residency right after it."""
    index = PagedActivationIndex(page_tokens=2, max_entries=100, max_bytes=6 * BPT)
    record(index, [1, 2, 3, 4, 5, 6])  # three pages; page 0 is the least recently used
    outcome = record(index, [7, 8])
    evicted = outcome.evicted  # type: ignore[attr-defined]
    assert [(e.token_start, e.reason) for e in evicted] == [(4, "max_bytes")]
    assert [(e.entries_after, e.resident_bytes_after) for e in evicted] == [(2, 4 * BPT)]
    assert restored(index, [1, 2, 3, 4, 5, 6]) == 4
    assert index.resident_bytes == 6 * BPT


def test_re_record_with_larger_rows_keeps_the_byte_bound() -> None:
    """Replacing a page by wider rows evicts other leaves; the footprint follows the new rows."""
    index = PagedActivationIndex(page_tokens=2, max_entries=100, max_bytes=4 * BPT)
    record(index, [1, 2])
    record(index, [3, 4])
    wide = rows(b"ns", [1, 2], bpt=2 * BPT)
    outcome = index.record(index.chain(b"ns", [1, 2]), wide, meta="wide")
    assert [(e.token_start, e.token_count, e.reason) for e in outcome.evicted] == [
        (0, 2, "max_bytes")
    ]
    assert index.resident_bytes == 4 * BPT
    assert index.unique_prefix_bytes() == 4 * BPT
    found = index.restore(index.chain(b"ns", [1, 2])).restore
    assert found is not None
    assert found.meta == "wide"
    np.testing.assert_array_equal(found.payload(), wide)


def test_re_record_that_cannot_fit_keeps_the_old_rows() -> None:
    """A replacement larger than the bound allows is refused and changes nothing."""
    index = PagedActivationIndex(page_tokens=2, max_entries=100, max_bytes=2 * BPT)
    record(index, [1, 2])
    outcome = index.record(
        index.chain(b"ns", [1, 2]), rows(b"ns", [1, 2], bpt=2 * BPT), meta="wide"
    )
    assert outcome.truncated
    assert outcome.covered_tokens == 0
    assert outcome.evicted == ()
    assert index.resident_bytes == 2 * BPT
    found = index.restore(index.chain(b"ns", [1, 2])).restore
    assert found is not None
    assert found.meta is None
    np.testing.assert_array_equal(found.payload(), rows(b"ns", [1, 2]))


def test_assembling_a_restore_copies_at_most_once() -> None:
    """payload() of a multi-page restore allocates one prefix-sized array, no more."""
    index = PagedActivationIndex(page_tokens=1024, max_entries=100)
    tokens = list(range(8 * 1024 + 100))
    bpt = 64
    data = np.arange(len(tokens) * bpt, dtype=np.uint64).astype(np.uint8)
    index.record(index.chain(b"ns", tokens), data)
    found = index.restore(index.chain(b"ns", tokens)).restore
    assert found is not None
    assert len(found.pages) == 9
    tracemalloc.start()
    try:
        assembled = found.payload()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert data.size <= peak < 1.5 * data.size
    assert not any(np.shares_memory(assembled, page) for page in found.pages)
    np.testing.assert_array_equal(assembled, data)


def test_nothing_past_a_rejected_page_is_used() -> None:
    """A page whose rows disagree with the first one ends the run; later cached pages go unused."""
    index = PagedActivationIndex(page_tokens=2, max_entries=100)
    index.record(
        index.chain(b"ns", [1, 2, 3, 4, 5, 6]), rows(b"ns", [1, 2, 3, 4, 5, 6]), meta="f32"
    )
    # Same first page recorded with another row format: replaced in place, not evicted.
    outcome = index.record(index.chain(b"ns", [1, 2]), rows(b"ns", [1, 2], bpt=8), meta="f16")
    assert outcome.evicted == ()
    lookup = index.restore(index.chain(b"ns", [1, 2, 3, 4, 5, 6]))
    assert lookup.restore is not None
    assert lookup.restore.token_count == 2
    assert lookup.restore.meta == "f16"
    assert len(index) == 3  # pages 1 and 2 are still cached, just not usable after the gap


def test_the_pages_of_like_records_share_one_shape() -> None:
    """What pages of one row format have in common is one object, whichever record stored
    them (an entry holds a reference to it, not seven fields of its own)."""
    index = PagedActivationIndex(page_tokens=2, max_entries=100)
    record(index, [1, 2, 3, 4, 5, 6])
    record(index, [7, 8, 9, 10, 11])
    pages = [entry for entry in index._entries.values() if entry.kind == "page"]
    assert len(pages) == 5
    assert len({id(entry.shape) for entry in pages}) == 1
    (tail,) = [entry for entry in index._entries.values() if entry.kind == "tail"]
    assert tail.shape is not pages[0].shape
    assert (tail.token_count, tail.nbytes, tail.group) == (
        1,
        BPT,
        index.chain(b"ns", [7, 8, 9, 10]).page_keys[1],
    )


def test_pages_alike_but_of_shapes_made_apart_restore_as_one_run() -> None:
    """Pages are told alike by their fields, not by sharing a shape object: when the shapes'
    memo has started again between two records (past its bound), a chain of both still
    restores whole."""
    index = PagedActivationIndex(page_tokens=2, max_entries=100)
    record(index, [1, 2, 3, 4])
    index._shapes.forget()
    record(index, [1, 2, 3, 4, 5, 6])
    first, _, third = (
        index._entries[key] for key in index.chain(b"ns", [1, 2, 3, 4, 5, 6]).page_keys
    )
    assert first.shape is not third.shape
    assert restored(index, [1, 2, 3, 4, 5, 6]) == 6


def test_a_restore_returns_the_meta_its_own_index_recorded() -> None:
    """Two indexes recording the same chain with equal ``meta`` values of two types each hand
    back their own (shapes are not shared across indexes, nor across types)."""
    first = PagedActivationIndex(page_tokens=2, max_entries=10)
    second = PagedActivationIndex(page_tokens=2, max_entries=10)
    for index, meta in ((first, 1), (second, True)):
        index.record(index.chain(b"ns", [1, 2, 3, 4]), rows(b"ns", [1, 2, 3, 4]), meta=meta)
    for index, meta in ((first, 1), (second, True)):
        found = index.restore(index.chain(b"ns", [1, 2, 3, 4])).restore
        assert found is not None
        assert found.meta is meta


def test_miss_reasons_never_seen_evicted_rejected() -> None:
    """Misses are counted by reason: never cached, evicted since, refused by validation."""
    index = PagedActivationIndex(page_tokens=2, max_entries=1)
    assert index.restore(index.chain(b"ns", [1, 2])).miss_reason == "never_seen"
    record(index, [1, 2])
    record(index, [3, 4])
    assert index.restore(index.chain(b"ns", [1, 2])).miss_reason == "evicted"
    # An exact entry whose size disagrees with its row count is refused.
    index.record(index.chain(b"ns", [5, 6]), np.zeros(3, dtype=np.uint8), token_major=False)
    stats = index.statistics()
    assert stats.lookups == 2
    assert (stats.misses_never_seen, stats.misses_evicted, stats.misses_rejected) == (1, 1, 0)
    assert stats.evictions == 2
    assert stats.hits == 0


def test_rejected_miss_reason() -> None:
    """A tail whose rows disagree with the first page is refused: a 'rejected' miss."""
    index = PagedActivationIndex(page_tokens=4, max_entries=10, min_tokens=5)
    index.record(index.chain(b"ns", [1, 2, 3, 4, 5]), rows(b"ns", [1, 2, 3, 4, 5]), meta="a")
    # Page 0 re-recorded in another row format; the tail keeps the old one.
    index.record(index.chain(b"ns", [1, 2, 3, 4, 6]), rows(b"ns", [1, 2, 3, 4, 6], bpt=8), meta="b")
    lookup = index.restore(index.chain(b"ns", [1, 2, 3, 4, 5]))
    assert lookup.restore is None
    assert lookup.miss_reason == "rejected"
    assert index.statistics().misses_rejected == 1


def test_a_re_record_with_other_rows_reports_the_bytes_it_stored() -> None:
    """Pages re-recorded in another row format are reused entries, but their new rows are
    stored bytes (a stage reports them as its record's payload bytes)."""
    index = PagedActivationIndex(page_tokens=4, max_entries=10)
    first = index.record(index.chain(b"ns", [1, 2, 3, 4, 5]), rows(b"ns", [1, 2, 3, 4, 5]))
    assert (first.stored_entries, first.stored_bytes) == (2, 5 * 4)
    again = index.record(index.chain(b"ns", [1, 2, 3, 4, 5]), rows(b"ns", [1, 2, 3, 4, 5]))
    assert (again.stored_entries, again.stored_bytes, again.reused_entries) == (0, 0, 2)
    wider = rows(b"ns", [1, 2, 3, 4, 5], bpt=8)
    other = index.record(index.chain(b"ns", [1, 2, 3, 4, 5]), wider, meta="f16")
    assert (other.stored_entries, other.stored_bytes, other.reused_entries) == (0, 5 * 8, 2)


def test_frames_that_cannot_be_paged_are_exact_length_entries() -> None:
    """Opaque payloads are stored whole and restore only the exact prompt."""
    index = PagedActivationIndex(page_tokens=2, max_entries=10)
    payload = np.arange(7, dtype=np.uint8)
    outcome = index.record(index.chain(b"ns", [1, 2, 3]), payload, token_major=False)
    assert outcome.stored_entries == 1
    assert index.statistics().exact_entries == 1
    found = index.restore(index.chain(b"ns", [1, 2, 3])).restore
    assert found is not None
    assert found.token_count == 3
    np.testing.assert_array_equal(found.payload(), payload)
    assert restored(index, [1, 2, 3, 4]) == 0
    assert restored(index, [1, 2]) == 0


def test_namespaces_never_share() -> None:
    """Another namespace (another tenant salt, stage or width) cannot hit or probe these pages."""
    index = PagedActivationIndex(page_tokens=2, max_entries=10)
    record(index, [1, 2, 3, 4], ns=b"tenant-a")
    lookup = index.restore(index.chain(b"tenant-b", [1, 2, 3, 4]))
    assert lookup.restore is None
    assert lookup.miss_reason == "never_seen"
    assert restored(index, [1, 2, 3, 4], ns=b"tenant-a") == 4


def test_virtual_payloads_allocate_nothing() -> None:
    """A million virtual 8 KiB rows are recorded, shared and restored as zero-stride views."""
    index = PagedActivationIndex(page_tokens=512, max_entries=10_000)
    n, bpt = 1_000_000, 8192
    virtual = np.broadcast_to(np.zeros(1, dtype=np.uint8), (n * bpt,))
    tokens = np.arange(n, dtype=np.int32)
    index.record(index.chain(b"ns", tokens), virtual)
    assert index.resident_bytes == n * bpt
    found = index.restore(index.chain(b"ns", tokens)).restore
    assert found is not None
    assembled = found.payload()
    assert assembled.size == n * bpt
    assert assembled.strides == (0,)
    assert all(page.strides == (0,) for page in found.pages)
    assert found.page_token_counts == (512,) * (n // 512) + (n % 512,)
    assert [page.size for page in found.pages] == [c * bpt for c in found.page_token_counts]


def test_virtual_pages_keep_the_fill_byte_and_their_size() -> None:
    """Pages cut from a virtual payload are page-sized zero-stride views of its fill byte."""
    index = PagedActivationIndex(page_tokens=4, max_entries=100)
    virtual = np.broadcast_to(np.full(1, 7, dtype=np.uint8), (10 * BPT,))
    index.record(index.chain(b"ns", list(range(10))), virtual)
    found = index.restore(index.chain(b"ns", list(range(10)))).restore
    assert found is not None
    assert [page.size for page in found.pages] == [4 * BPT, 4 * BPT, 2 * BPT]
    assert all(int(page[0]) == 7 and page.strides == (0,) for page in found.pages)
    assert not any(page.flags.writeable for page in found.pages)
    assert found.payload().tolist() == [7] * (10 * BPT)


def test_bounds_truncate_a_chain_that_does_not_fit() -> None:
    """When the prompt's own pages fill the bytes bound, recording stops with a usable prefix."""
    index = PagedActivationIndex(page_tokens=2, max_entries=100, max_bytes=4 * BPT)
    outcome = record(index, [1, 2, 3, 4, 5, 6, 7])
    assert outcome.truncated  # type: ignore[attr-defined]
    assert outcome.covered_tokens == 4  # type: ignore[attr-defined]
    assert restored(index, [1, 2, 3, 4, 5, 6, 7]) == 4
    assert index.resident_bytes <= 4 * BPT


def test_min_tokens_gates_records_and_restores() -> None:
    """Prompts under min_tokens are not recorded; a run under min_tokens is a miss."""
    index = PagedActivationIndex(page_tokens=2, max_entries=100, min_tokens=4)
    assert record(index, [1, 2, 3]).stored_entries == 0  # type: ignore[attr-defined]
    record(index, [1, 2, 3, 4])
    assert restored(index, [1, 2, 9, 9]) == 0
    assert restored(index, [1, 2, 3, 4, 5]) == 4


def test_clear_evicts_everything_as_cleared() -> None:
    """clear() reports every entry with reason 'cleared' and leaves counters of evictions alone."""
    index = PagedActivationIndex(page_tokens=2, max_entries=100)
    record(index, [1, 2, 3, 4, 5])
    gone = index.clear()
    assert sorted(e.kind for e in gone) == ["page", "page", "tail"]
    assert {e.reason for e in gone} == {"cleared"}
    assert len(index) == 0
    assert index.resident_bytes == 0
    assert index.statistics().evictions == 0
    assert index.unique_prefix_bytes() == 0


def test_bad_arguments_raise_typed_errors() -> None:
    """Invalid bounds, tokens and payloads raise ConfigError/FrameError naming the value."""
    with pytest.raises(ConfigError, match="page_tokens must be >= 1, got 0"):
        PagedActivationIndex(page_tokens=0, max_entries=1)
    with pytest.raises(ConfigError, match="max_entries must be >= 1, got 0"):
        PagedActivationIndex(page_tokens=1, max_entries=0)
    index = PagedActivationIndex(page_tokens=2, max_entries=4)
    with pytest.raises(ConfigError, match="int32"):
        index.chain(b"ns", [2**31])
    with pytest.raises(ConfigError, match="integers"):
        index.chain(b"ns", [1.5])  # type: ignore[list-item]
    with pytest.raises(FrameError, match="uint8"):
        index.record(index.chain(b"ns", [1, 2]), np.zeros(2, dtype=np.float32))
    assert len(index) == 0


def test_unique_prefix_bytes_counts_overlapping_tails_once() -> None:
    """A tail that is a prefix of a cached page costs nothing extra in unique-prefix bytes."""
    index = PagedActivationIndex(page_tokens=4, max_entries=100)
    record(index, [1, 2, 3, 4])
    record(index, [1, 2])
    record(index, [1, 2, 9])
    assert index.resident_bytes == (4 + 2 + 3) * BPT
    # distinct prefixes: 1 | 12 | 123 | 1234 | 129
    assert index.unique_prefix_bytes() == 5 * BPT


@pytest.mark.parametrize(("eviction", "survivor"), [("lru", [3, 4]), ("reuse", [1, 2])])
def test_reuse_eviction_keeps_a_popular_page_over_a_newer_one_off(
    eviction: str, survivor: list[int]
) -> None:
    """LRU evicts the older popular page; reuse-aware eviction evicts the newer one-off page."""
    index = PagedActivationIndex(page_tokens=2, max_entries=2, eviction=eviction)
    record(index, [1, 2])
    for _ in range(3):
        assert restored(index, [1, 2]) == 2
    record(index, [3, 4])
    record(index, [5, 6])
    assert restored(index, survivor) == 2
    assert restored(index, [5, 6]) == 2
    assert len(index) == 2


def test_reuse_eviction_ages_out_old_popularity() -> None:
    """Each eviction raises the floor, so a once-popular page cannot stay forever."""
    index = PagedActivationIndex(page_tokens=1, max_entries=2, eviction="reuse")
    record(index, [1])
    assert restored(index, [1]) == 1  # value 2
    for token in range(10, 14):  # each newcomer starts at the last victim's value + 1
        record(index, [token])
    assert restored(index, [1]) == 0


def test_unknown_eviction_policy_is_refused() -> None:
    """Only 'lru', 'reuse' and 'adaptive' exist."""
    message = "eviction must be 'lru', 'reuse' or 'adaptive', got 'mru'"
    with pytest.raises(ConfigError, match=message):
        PagedActivationIndex(page_tokens=1, max_entries=1, eviction="mru")


# ------------------------------------------------------------------ stateful model check

Key = tuple[bytes, tuple[int, ...]]


class ReferenceIndex:
    """The same policy over a dict of prefix tuples: the simplest thing that could be right."""

    def __init__(
        self, page_tokens: int, max_entries: int, max_bytes: int, min_tokens: int, eviction: str
    ) -> None:
        self.eviction = eviction
        self.hits: dict[Key, int] = {}
        self.value: dict[Key, float] = {}  # the reuse policy's priority
        self.inflation = 0.0
        self.p = page_tokens
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.min_tokens = min_tokens
        self.entries: dict[Key, int] = {}  # prefix -> last_used
        self.clock = 0
        self.tombstones: set[Key] = set()

    def parent(self, key: Key) -> Key | None:
        ns, prefix = key
        cut = (len(prefix) - 1) // self.p * self.p
        return (ns, prefix[:cut]) if cut else None

    def nbytes(self) -> int:
        return sum(len(k[1]) - (len(k[1]) - 1) // self.p * self.p for k in self.entries) * BPT

    def keys_of(self, ns: bytes, tokens: tuple[int, ...]) -> list[Key]:
        n = len(tokens)
        keys = [(ns, tokens[: i + self.p]) for i in range(0, n - n % self.p, self.p)]
        if n % self.p:
            keys.append((ns, tokens))
        return keys

    def record(self, ns: bytes, tokens: tuple[int, ...]) -> list[tuple[int, int]]:
        evicted: list[tuple[int, int]] = []
        if not tokens or len(tokens) < self.min_tokens:
            return evicted
        protect: Key | None = None
        chain_bytes = 0  # of the keys before this one: all cached, none evictable
        for i, key in enumerate(self.keys_of(ns, tokens)):
            start = (len(key[1]) - 1) // self.p * self.p
            size = (len(key[1]) - start) * BPT
            if key in self.entries:
                self.use(key, hit=False)
                protect = key
                chain_bytes += size
                continue
            if i + 1 > self.max_entries or (self.max_bytes and chain_bytes + size > self.max_bytes):
                return evicted  # no room even with every other entry gone: evict nothing
            while len(self.entries) + 1 > self.max_entries or (
                self.max_bytes and self.nbytes() + size > self.max_bytes
            ):
                parents = {self.parent(k) for k in self.entries}
                leaves = [k for k in self.entries if k not in parents and k != protect]
                assert leaves, "room that the check above found could not be made"
                victim = min(leaves, key=lambda k: (self.value[k], self.entries[k]))
                self.inflation = max(self.inflation, self.value[victim])
                del self.entries[victim]
                self.tombstones.add(victim)
                vstart = (len(victim[1]) - 1) // self.p * self.p
                evicted.append((vstart, len(victim[1]) - vstart))
            self.clock += 1
            self.entries[key] = self.clock
            self.hits[key] = 0
            self.value[key] = self.inflation + self.prior(key) if self.eviction == "reuse" else 0.0
            self.tombstones.discard(key)
            protect = key
            chain_bytes += size
        return evicted

    def restore(self, ns: bytes, tokens: tuple[int, ...]) -> tuple[int, str | None]:
        used: list[Key] = []
        reason = "never_seen"
        for key in self.keys_of(ns, tokens):
            if key not in self.entries:
                reason = "evicted" if key in self.tombstones else "never_seen"
                break
            used.append(key)
        k = len(used[-1][1]) if used else 0
        if k == 0 or k < self.min_tokens:
            return 0, reason
        for key in used:
            self.use(key, hit=True)
        return k, None

    def prior(self, key: Key) -> float:
        return 1.0 if len(key[1]) % self.p == 0 else 0.0

    def use(self, key: Key, *, hit: bool) -> None:
        self.clock += 1
        self.entries[key] = self.clock
        self.hits[key] += hit
        if self.eviction == "reuse":
            self.value[key] = self.inflation + self.prior(key) + self.hits[key]

    def unique_bytes(self) -> int:
        prefixes = {
            (ns, prefix[:j]) for ns, prefix in self.entries for j in range(1, len(prefix) + 1)
        }
        return len(prefixes) * BPT


tokens_st = st.lists(st.integers(0, 2), min_size=0, max_size=9).map(tuple)
namespace_st = st.sampled_from([b"a", b"b"])


class PagedIndexMachine(RuleBasedStateMachine):
    """The paged index behaves like the dict-of-prefix-tuples reference, step by step."""

    index: PagedActivationIndex
    ref: ReferenceIndex

    @initialize(
        page_tokens=st.integers(1, 3),
        max_entries=st.integers(1, 8),
        max_bytes=st.sampled_from([0, 6 * BPT, 12 * BPT]),
        min_tokens=st.integers(0, 3),
        eviction=st.sampled_from(["lru", "reuse"]),
    )
    def setup(
        self, page_tokens: int, max_entries: int, max_bytes: int, min_tokens: int, eviction: str
    ) -> None:
        self.index = PagedActivationIndex(
            page_tokens=page_tokens,
            max_entries=max_entries,
            max_bytes=max_bytes,
            min_tokens=min_tokens,
            eviction=eviction,
        )
        self.ref = ReferenceIndex(page_tokens, max_entries, max_bytes, min_tokens, eviction)

    @rule(ns=namespace_st, tokens=tokens_st)
    def record(self, ns: bytes, tokens: tuple[int, ...]) -> None:
        outcome = self.index.record(self.index.chain(ns, list(tokens)), rows(ns, tokens))
        expected = self.ref.record(ns, tokens)
        assert [(e.token_start, e.token_count) for e in outcome.evicted] == expected

    @rule(ns=namespace_st, tokens=tokens_st)
    def restore(self, ns: bytes, tokens: tuple[int, ...]) -> None:
        if not tokens:
            return
        lookup = self.index.restore(self.index.chain(ns, list(tokens)))
        k, reason = self.ref.restore(ns, tokens)
        if lookup.restore is None:
            assert k == 0
            assert lookup.miss_reason == reason
        else:
            assert lookup.restore.token_count == k
            np.testing.assert_array_equal(lookup.restore.payload(), rows(ns, tokens[:k]))

    @rule()
    def clear(self) -> None:
        gone = self.index.clear()
        assert len(gone) == len(self.ref.entries)
        self.ref.entries.clear()

    @invariant()
    def same_residency(self) -> None:
        if not hasattr(self, "ref"):
            return
        assert len(self.index) == len(self.ref.entries)
        assert self.index.resident_bytes == self.ref.nbytes()
        assert self.index.unique_prefix_bytes() == self.ref.unique_bytes()
        assert self.index.resident_bytes <= max(self.ref.max_bytes, 0) or not self.ref.max_bytes


TestPagedIndexMachine = PagedIndexMachine.TestCase
TestPagedIndexMachine.settings = settings(
    max_examples=150,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def test_eviction_records_are_a_sequence_built_when_read() -> None:
    """A record's evictions count and add up without building records, and read like a tuple."""
    index = PagedActivationIndex(page_tokens=2, max_entries=100, max_bytes=4 * BPT)
    record(index, [1, 2, 3, 4])
    outcome = index.record(index.chain(b"ns", [5, 6, 7, 8]), rows(b"ns", [5, 6, 7, 8]))
    evicted = outcome.evicted
    assert len(evicted) == 2
    assert evicted.payload_bytes == outcome.evicted_bytes == 4 * BPT
    assert evicted._pages is None  # nothing built yet
    assert [(e.token_start, e.token_count, e.reason) for e in evicted] == [
        (2, 2, "max_bytes"),
        (0, 2, "max_bytes"),
    ]
    assert evicted == tuple(evicted)
    assert evicted == list(evicted)
    assert evicted[0] == evicted.pages[0]
    assert evicted[-1:] == evicted.pages[-1:]
    assert evicted[0].key.startswith("act:page:2+2:")
    assert isinstance(hash(outcome), int)  # the outcome stays hashable
    assert evicted != ()
    assert outcome.evicted.pages != ()
    assert "EvictedPage(" in repr(evicted)
    empty = record(index, [5, 6])  # cached: nothing evicted
    assert empty.evicted == ()  # type: ignore[attr-defined]


def test_evicted_pages_hash_as_the_tuple_they_equal() -> None:
    """EvictedPages equals the tuple of its records, so it hashes as that tuple (a set or a dict
    key holding one finds the other)."""
    index = PagedActivationIndex(page_tokens=2, max_entries=2)
    namespace = b"ns"
    for start in (0, 100):
        tokens = list(range(start, start + 4))
        chain = index.chain(namespace, tokens)
        outcome = index.record(chain, np.zeros(4 * 8, dtype=np.uint8))
    evicted = outcome.evicted
    assert len(evicted) == 2
    as_tuple = tuple(evicted)
    assert evicted == as_tuple
    assert hash(evicted) == hash(as_tuple)
    assert {as_tuple: 1}[evicted] == 1  # type: ignore[index]


def _restore_of(pages: Sequence[npt.NDArray[np.uint8]]) -> PagedRestore:
    return PagedRestore(
        token_count=sum(p.size for p in pages),
        bytes_per_token=1,
        meta=None,
        pages=tuple(pages),
        page_token_counts=tuple(p.size for p in pages),
        last_key=b"k",
        entries=len(pages),
        payload_bytes=sum(p.size for p in pages),
        used=(),
    )


def test_pages_of_one_fill_byte_join_without_a_copy_whatever_buffer_they_view() -> None:
    """Virtual pages repeating one byte join into a zero-stride view (nothing copied), whether
    they view one single-byte buffer or several; pages of different bytes, or zero-stride
    views into one multi-byte buffer at different bytes, are copied and keep their bytes."""
    from stage_runtime.frames import ActivationFrame

    shared = ActivationFrame.virtual(token_count=10, bytes_per_token=1, fill=7).payload
    one_buffer = _restore_of([shared[:4], shared[4:10]])
    other = np.broadcast_to(np.full(1, 7, dtype=np.uint8), (5,))
    two_buffers = _restore_of([shared[:4], other])
    assert one_buffer.copy_bytes() == two_buffers.copy_bytes() == 0
    assert one_buffer.payload().strides == (0,)
    assert two_buffers.payload().tolist() == [7] * 9

    source = np.arange(8, dtype=np.uint8)  # one buffer, two different bytes
    mixed = _restore_of([np.broadcast_to(source[2:3], (3,)), np.broadcast_to(source[5:6], (3,))])
    assert mixed.copy_bytes() == 6
    assert mixed.payload().tolist() == [2, 2, 2, 5, 5, 5]
    nine = ActivationFrame.virtual(token_count=3, bytes_per_token=1, fill=9).payload
    assert _restore_of([shared[:3], nine]).payload().tolist() == [7, 7, 7, 9, 9, 9]
