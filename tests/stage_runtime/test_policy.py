"""Candidate policy: every vector of spec §9.1, the edge cases of §2.4, and its properties."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stage_runtime import ConfigError, KvCacheConfig
from stage_runtime.policy import (
    CandidatePolicy,
    derive_max_resident_tokens,
    round_half_away_from_zero,
)


def policy(min_tokens: int, stride: int, limit: int, hint: int = 0) -> CandidatePolicy:
    """A policy built as the upstream builds it (page size = max(min, 1))."""
    cfg = KvCacheConfig(
        min_tokens=min_tokens, shared_prefix_stride_tokens=stride, shared_prefix_record_limit=limit
    )
    base = CandidatePolicy.from_cache_config(cfg)
    return CandidatePolicy(
        min_tokens=base.min_tokens,
        stride_tokens=base.stride_tokens,
        record_limit=base.record_limit,
        page_size_tokens=base.page_size_tokens,
        max_resident_tokens_hint=hint,
    )


# --- §9.1 -------------------------------------------------------------------------------------


def test_lookup_and_record_160_with_min_64_stride_32() -> None:
    """(64, 32, 2): lookup(160) = [160,128,96,64], record(160) = [160,128]."""
    p = policy(64, 32, 2)
    assert p.candidate_token_counts(160) == [160, 128, 96, 64]
    assert p.record_candidate_token_counts(160) == [160, 128]


def test_below_min_is_exact_only() -> None:
    """(64, 32, 2): lookup(63) = record(63) = [63]."""
    p = policy(64, 32, 2)
    assert p.candidate_token_counts(63) == [63]
    assert p.record_candidate_token_counts(63) == [63]


def test_unlimited_record_takes_every_lookup_candidate() -> None:
    """(64, 32, 0): record(160) = [160,128,96,64]."""
    assert policy(64, 32, 0).record_candidate_token_counts(160) == [160, 128, 96, 64]


def test_2214_records_2176_which_2231_looks_up_first() -> None:
    """(256, 128, 2): record(2214) = [2214,2176] and 2176 is lookup(2231)'s first shared value."""
    p = policy(256, 128, 2)
    assert p.record_candidate_token_counts(2214) == [2214, 2176]
    lookup = p.candidate_token_counts(2231)
    assert lookup[:3] == [2231, 2176, 2048]
    assert lookup[-1] == 256
    assert next(c for c in lookup if c in {2214, 2176}) == 2176


def test_non_aligned_min_300() -> None:
    """(300, 128, 2): lookup(350) = record(350) = [350,300]; lookup(1000) ends at 300."""
    p = policy(300, 128, 2)
    assert p.candidate_token_counts(350) == [350, 300]
    assert p.record_candidate_token_counts(350) == [350, 300]
    assert p.candidate_token_counts(1000) == [1000, 896, 768, 640, 512, 384, 300]


def test_record_8000_limit_2() -> None:
    """(256, 128, 2): record(8000) = [8000,7936], lowest above 4000."""
    record = policy(256, 128, 2).record_candidate_token_counts(8000)
    assert record == [8000, 7936]
    assert min(record) > 4000


def test_record_8000_limit_4_is_geometric() -> None:
    """(256, 128, 4): 4 values, 8000 then 7936, a rung below 2048, all on the lookup grid."""
    p = policy(256, 128, 4)
    record = p.record_candidate_token_counts(8000)
    assert len(record) == 4
    assert record[:2] == [8000, 7936]
    assert min(record) < 2048
    assert set(record) <= set(p.candidate_token_counts(8000))
    assert record == [8000, 7936, 2560, 768]


def test_deeper_ladder_lets_a_shorter_prompt_share() -> None:
    """record(8000) shares nothing with lookup(2748) at limit 2, but does at limit 6."""
    narrow = set(policy(256, 128, 2).record_candidate_token_counts(8000))
    assert not narrow & set(policy(256, 128, 2).candidate_token_counts(2748))
    deep = policy(256, 128, 6)
    record = deep.record_candidate_token_counts(8000)
    lookup = deep.candidate_token_counts(2748)
    common = [c for c in lookup if c in record]
    assert common
    assert 1000 <= common[0] <= 2748


@pytest.mark.parametrize("limit", range(12))
@pytest.mark.parametrize("n", [300, 1000, 2214, 8000, 131072])
def test_record_ladder_shape(limit: int, n: int) -> None:
    """len <= limit, contains N, strictly descending and unique, values in (0, N]."""
    record = policy(256, 128, limit).record_candidate_token_counts(n)
    if limit > 0:
        assert len(record) <= limit
    assert n in record
    assert all(a > b for a, b in itertools.pairwise(record))
    assert all(0 < v <= n for v in record)


def test_record_budget_stops_the_geometric_rungs() -> None:
    """(256, 128, 6, hint 4096): 8000, 7936, then rungs summing to at most 4096."""
    record = policy(256, 128, 6, hint=4096).record_candidate_token_counts(8000)
    assert record[:2] == [8000, 7936]
    rest = record[2:]
    assert rest
    assert sum(rest) <= 4096
    assert record == [8000, 7936, 2048, 1024, 512]


def test_large_budget_fills_all_six_slots() -> None:
    """(256, 128, 6, hint 1e6): six values, one below 2048."""
    record = policy(256, 128, 6, hint=1_000_000).record_candidate_token_counts(8000)
    assert len(record) == 6
    assert min(record) < 2048


def test_short_prompts_are_unaffected_by_a_deeper_ladder() -> None:
    """(256, 128, 6): record(200) = [200]."""
    assert policy(256, 128, 6).record_candidate_token_counts(200) == [200]


@pytest.mark.parametrize("ctx", [8192, 16384, 32768, 131072])
def test_context_derived_ladder_reaches_below_half(ctx: int) -> None:
    """limit clamp(clamp(ctx/512,1,16)/4,2,6) with hint derive(ctx): some v with 2v < 12288."""
    limit = min(max(min(max(ctx // 512, 1), 16) // 4, 2), 6)
    assert limit == 4
    p = policy(256, 128, limit, hint=derive_max_resident_tokens(ctx))
    assert any(2 * v < 12288 for v in p.record_candidate_token_counts(12288))


def test_context_below_budget_threshold_keeps_near_tail() -> None:
    """(256, 128, 2, derive(4096) = 0): record(12288) = [12288,12160]."""
    assert derive_max_resident_tokens(4096) == 0
    p = policy(256, 128, 2, hint=derive_max_resident_tokens(4096))
    assert p.record_candidate_token_counts(12288) == [12288, 12160]


@pytest.mark.parametrize(
    ("ctx", "budget"),
    [(768, 0), (8191, 0), (4096, 0), (8192, 4096), (16384, 8192), (131072, 65536)],
)
def test_derive_max_resident_tokens(ctx: int, budget: int) -> None:
    """Spec §6.2 (V-A..V-D variant): 0 below 8192, else half the context."""
    assert derive_max_resident_tokens(ctx) == budget


def test_spec_2_1_examples_in_full() -> None:
    """The §2.1 examples, whole lists: (256, 128, N 2231) runs 2176 down to 256 by 128."""
    assert policy(64, 32, 2).candidate_token_counts(160) == [160, 128, 96, 64]
    assert policy(256, 128, 2).candidate_token_counts(2231) == [2231, *range(2176, 255, -128)]
    assert policy(300, 128, 2).candidate_token_counts(1000) == [1000, 896, 768, 640, 512, 384, 300]
    assert policy(300, 128, 2).candidate_token_counts(350) == [350, 300]


def test_v_a_vectors_are_not_reproduced() -> None:
    """§2.5: the superseded V-A answers ([160,159,127,95,64], record [160,64]) are not ours."""
    assert policy(64, 32, 2).candidate_token_counts(160) != [160, 159, 127, 95, 64]
    assert policy(64, 32, 2).record_candidate_token_counts(160) != [160, 64]
    assert policy(256, 128, 2).record_candidate_token_counts(2214) != [2214, 256]


# --- §2.4 edge cases ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("n", "record"),
    [(200, [200]), (256, [256]), (2176, [2176, 2048]), (384, [384, 256]), (257, [257, 256])],
)
def test_edge_cases_on_and_below_the_grid(n: int, record: list[int]) -> None:
    """N <= min is exact; N on the grid records one stride below itself."""
    assert policy(256, 128, 2).record_candidate_token_counts(n) == record


@pytest.mark.parametrize("limit", range(12))
@pytest.mark.parametrize("n", [1, 200, 255, 256])
def test_at_or_below_min_is_exact_at_every_limit(n: int, limit: int) -> None:
    """§2.4: (min 256) N <= 256 gives [N] for lookup and record, no phantom candidates."""
    p = policy(256, 128, limit, hint=4096)
    assert p.candidate_token_counts(n) == [n]
    assert p.record_candidate_token_counts(n) == [n]


@pytest.mark.parametrize(
    ("n", "lookup"),
    [(2176, [2176, *range(2048, 255, -128)]), (384, [384, 256]), (257, [257, 256])],
)
def test_on_the_grid_lookup_starts_one_stride_below(n: int, lookup: list[int]) -> None:
    """§2.4: N on the grid is not repeated; the grid starts at N - stride (257 floors to 256)."""
    assert policy(256, 128, 0).candidate_token_counts(n) == lookup


@pytest.mark.parametrize("stride", [0, 1])
def test_stride_zero_or_one_is_a_unit_grid(stride: int) -> None:
    """Effective stride 1: record(300) = [300,299], lookup(260) = [260..256]."""
    p = policy(256, stride, 2)
    assert p.record_candidate_token_counts(300) == [300, 299]
    assert p.candidate_token_counts(260) == [260, 259, 258, 257, 256]


def test_stride_is_capped_at_min_tokens() -> None:
    """min 64, stride 128: lookup(300) = [300,256,192,128,64], record [300,256]."""
    p = policy(64, 128, 2)
    assert p.effective_stride == 64
    assert p.candidate_token_counts(300) == [300, 256, 192, 128, 64]
    assert p.record_candidate_token_counts(300) == [300, 256]


@pytest.mark.parametrize("limit", [0, 1, 2, 6])
def test_min_tokens_zero_is_exact_only(limit: int) -> None:
    """min_tokens 0: every list is [N]."""
    p = policy(0, 128, limit)
    assert p.candidate_token_counts(5000) == [5000]
    assert p.record_candidate_token_counts(5000) == [5000]


def test_limit_zero_and_one() -> None:
    """Limit 0 records every lookup candidate; limit 1 records only N."""
    assert policy(256, 128, 0).record_candidate_token_counts(700) == [700, 640, 512, 384, 256]
    assert policy(256, 128, 1).record_candidate_token_counts(700) == [700]


def test_record_300_with_two_candidates_records_both() -> None:
    """(256, 128, 2): N = 300 has C = [300, 256], so both are recorded."""
    assert policy(256, 128, 2).record_candidate_token_counts(300) == [300, 256]


def test_zero_tokens_has_no_candidates() -> None:
    """N = 0 gives empty lists."""
    assert policy(256, 128, 2).candidate_token_counts(0) == []
    assert policy(256, 128, 2).record_candidate_token_counts(0) == []


def test_bad_token_count_is_a_config_error() -> None:
    """A negative or non-integer N names the value."""
    with pytest.raises(ConfigError, match="token_count must be an integer >= 0, got -1"):
        policy(256, 128, 2).candidate_token_counts(-1)
    with pytest.raises(ConfigError, match="min_tokens must be an integer >= 0, got -5"):
        CandidatePolicy(min_tokens=-5)


def test_rounding_is_half_away_from_zero() -> None:
    """2.5 rounds to 3 (Python's round gives 2), -2.5 to -3."""
    assert round_half_away_from_zero(2.5) == 3
    assert round_half_away_from_zero(3.5) == 4
    assert round_half_away_from_zero(2.4999) == 2
    assert round_half_away_from_zero(-2.5) == -3
    # Where |x| + 0.5 itself rounds, Rust's f64::round does not: the largest double below 0.5,
    # and odd integers in [2^52, 2^53).
    assert round_half_away_from_zero(0.49999999999999994) == 0
    assert round_half_away_from_zero(-0.49999999999999994) == 0
    assert round_half_away_from_zero(4503599627370497.0) == 4503599627370497


def test_geometric_tie_prefers_the_larger_value() -> None:
    """When two grid values are equally near a target, the larger (first) one wins."""
    p = CandidatePolicy(min_tokens=10, stride_tokens=20, record_limit=3, page_size_tokens=20)
    # grid for N 1000: 980, 960, ..., 20, 10; target round(10 * 100**0.5) = 100 -> 100 on grid.
    assert p.record_candidate_token_counts(1000) == [1000, 980, 100]
    tie = CandidatePolicy(min_tokens=1, stride_tokens=2, record_limit=3, page_size_tokens=2)
    # N 9: grid 8, 6, 4, 2, 1; target round(1 * 9**0.5) = 3: 4 and 2 are both 1 away -> 4.
    assert tie.record_candidate_token_counts(9) == [9, 8, 4]


# --- properties (§9.1) ------------------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(
    min_tokens=st.integers(0, 600),
    stride=st.integers(0, 300),
    limit=st.integers(0, 11),
    hint=st.integers(0, 20000),
    n=st.integers(0, 20000),
)
def test_policy_properties(min_tokens: int, stride: int, limit: int, hint: int, n: int) -> None:
    """Lookup and record lists: N first, strictly descending, values in (0, N], record <= limit."""
    p = policy(min_tokens, stride, limit, hint)
    lookup = p.candidate_token_counts(n)
    record = p.record_candidate_token_counts(n)
    for values in (lookup, record):
        if n == 0:
            assert values == []
            continue
        assert values[0] == n
        assert all(a > b for a, b in itertools.pairwise(values))
        assert all(0 < v <= n for v in values)
    assert set(record) <= set(lookup)
    if limit > 0:
        assert len(record) <= limit
    if n > min_tokens > 0:
        assert lookup[-1] == min_tokens
        if limit == 0 or limit >= 2:
            assert record[1] == lookup[1]


def reference_lookup(min_tokens: int, stride: int, n: int) -> list[int]:
    """Spec §2.1 read literally: walk down from the grid floor, clamping each step at min."""
    if n == 0:
        return []
    if min_tokens == 0 or n <= min_tokens:
        return [n]
    s = min(max(stride, 1), max(min_tokens, 1))
    c = n - n % s
    if c == n:
        c = n - s
    c = max(c, min_tokens)
    out = [n]
    while True:
        out.append(c)
        if c == min_tokens:
            return sorted(set(out), reverse=True)
        c = max(c - s, min_tokens)


def reference_record(min_tokens: int, stride: int, limit: int, hint: int, n: int) -> list[int]:
    """Spec §2.2 read literally (V-D/V-E), listing the grid and searching it for each target."""
    grid = reference_lookup(min_tokens, stride, n)
    if limit == 0 or len(grid) <= limit:
        return grid
    selected = [n]
    shared = grid[1:]
    if limit == 1 or not shared:
        return selected
    selected.append(shared[0])
    slots = limit - 2
    floor, ceiling = min(max(min_tokens, 1), max(n, 1)), max(n, 1)
    if ceiling <= floor:
        targets = [min_tokens]
    else:
        targets = [
            max(int(floor * (ceiling / floor) ** (i / (slots + 1)) + 0.5), 1)
            for i in range(1, slots + 1)
        ]
    pinned = 0
    for target in targets:
        if len(selected) >= limit:
            break
        left = [x for x in shared if x not in selected]
        if not left:
            break
        pick = min(left, key=lambda x: abs(x - target))  # ties: the first, i.e. larger, wins
        if hint > 0 and pinned + pick > hint:
            break
        pinned += pick
        selected.append(pick)
    return sorted(set(selected), reverse=True)


@settings(max_examples=400, deadline=None)
@given(
    min_tokens=st.integers(0, 400),
    stride=st.integers(0, 200),
    limit=st.integers(0, 12),
    hint=st.one_of(st.just(0), st.integers(1, 30000)),
    n=st.integers(0, 30000),
)
def test_lists_equal_a_literal_transcription_of_the_spec(
    min_tokens: int, stride: int, limit: int, hint: int, n: int
) -> None:
    """Lookup grid and record ladder equal §2.1/§2.2 read step by step (rounding half away
    from zero, ties to the larger value, the budget stopping the rungs)."""
    p = policy(min_tokens, stride, limit, hint)
    assert p.candidate_token_counts(n) == reference_lookup(min_tokens, stride, n)
    assert p.record_candidate_token_counts(n) == reference_record(
        min_tokens, stride, limit, hint, n
    )


@settings(max_examples=200, deadline=None)
@given(
    min_tokens=st.integers(0, 300),
    stride=st.integers(0, 200),
    n=st.integers(0, 3000),
    data=st.data(),
)
def test_is_candidate_matches_the_candidate_list(
    min_tokens: int, stride: int, n: int, data: st.DataObject
) -> None:
    """is_candidate(n, c) is membership in candidate_token_counts(n)."""
    p = policy(min_tokens, stride, 2)
    candidates = set(p.candidate_token_counts(n))
    probes = data.draw(st.lists(st.integers(-1, n + 2), max_size=30))
    for c in [*probes, *candidates, min_tokens, n]:
        assert p.is_candidate(n, c) == (c in candidates)


@settings(max_examples=300, deadline=None)
@given(
    min_tokens=st.integers(0, 300),
    stride=st.integers(0, 300),
    page=st.integers(0, 300),
    n=st.integers(0, 5000),
)
def test_count_and_index_agree_with_the_listed_grid(
    min_tokens: int, stride: int, page: int, n: int
) -> None:
    p = CandidatePolicy(min_tokens=min_tokens, stride_tokens=stride, page_size_tokens=page)
    grid = p.candidate_token_counts(n)
    assert p.candidate_count(n) == len(grid)
    for index, count in enumerate(grid):
        assert p.candidate_index(n, count) == index


@settings(max_examples=300, deadline=None)
@given(
    min_tokens=st.integers(0, 300),
    stride=st.integers(0, 300),
    limit=st.sampled_from([1, 2]),
    n=st.integers(0, 5000),
)
def test_short_ladders_are_the_head_of_the_grid(
    min_tokens: int, stride: int, limit: int, n: int
) -> None:
    # Limits 1 and 2 are computed without listing the grid; they must equal its first entries.
    p = CandidatePolicy(
        min_tokens=min_tokens,
        stride_tokens=stride,
        record_limit=limit,
        page_size_tokens=max(min_tokens, 1),
    )
    assert p.record_candidate_token_counts(n) == p.candidate_token_counts(n)[:limit]


def test_candidate_index_of_a_non_candidate_is_a_config_error() -> None:
    p = policy(64, 32, 2)
    with pytest.raises(ConfigError, match="100 is not a candidate length of a 160-token prompt"):
        p.candidate_index(160, 100)
    assert p.candidate_index(160, 128) == 1
    with pytest.raises(ConfigError, match="count must be an integer >= 0, got '128'"):
        p.candidate_index(160, "128")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="token_count must be an integer >= 0, got -160"):
        p.candidate_index(-160, 128)
