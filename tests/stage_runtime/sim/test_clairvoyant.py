"""The clairvoyant (Belady) ceiling: hand-worked cases, properties, and the replay's report."""

from __future__ import annotations

import io
import json

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from rich.console import Console

from stage_runtime import ConfigError
from stage_runtime.sim import (
    MAX_BLOCK_SIZE,
    MIN_BLOCK_SIZE,
    CostModel,
    SimConfig,
    SimRequest,
    clairvoyant_for,
    render_report,
    render_sweep,
    result_to_json,
    run_replay,
    run_sweep,
    theoretical_max_hit_ratio,
)
from stage_runtime.sim.clairvoyant import capacity_pages, clairvoyant_hits, plan

B = 4  # tokens per block in the hand-worked cases


def _request(index: int, ids: list[int], length: int | None = None) -> SimRequest:
    return SimRequest(
        index=index,
        input_length=B * len(ids) if length is None else length,
        block_ids=tuple(ids),
    )


def _hits(requests: list[SimRequest], capacity: int) -> int:
    return clairvoyant_hits(plan(requests, block_size=B), capacity).hit_tokens


def test_the_page_used_furthest_away_goes_first() -> None:
    """Capacity 2 pages. [1 2] then [3] then [1 2]: page 3 is never used again, so it goes
    (not page 1, the least recently used): the third request restores 8 tokens."""
    requests = [_request(0, [1, 2]), _request(1, [3]), _request(2, [1, 2])]
    assert _hits(requests, 2) == 8
    assert _hits(requests, 1) == 4  # only page 1 fits after the first request's eviction


def test_a_tie_evicts_the_deeper_page_and_keeps_the_cache_prefix_closed() -> None:
    """Capacity 2: [1 2 3] overflows by one page; pages 1, 2 and 3 are all used next by the
    same request, so the deepest (3) goes; the next request restores pages 1 and 2."""
    requests = [_request(0, [1, 2, 3]), _request(1, [1, 2, 3])]
    assert _hits(requests, 2) == 8


def test_next_uses_decide_between_two_prefixes() -> None:
    """Capacity 2, pages [1] [2] alternating with [1] coming back later than [2]: Belady keeps
    the one used sooner each time."""
    requests = [
        _request(0, [1]),
        _request(1, [2]),
        _request(2, [3]),  # evicts 3 itself (never used again)
        _request(3, [2]),
        _request(4, [1]),
    ]
    assert _hits(requests, 2) == 8  # both [2] and [1] restore


def test_a_partial_page_restores_only_the_tokens_seen() -> None:
    """A page first seen with 2 of its 4 tokens restores 2 to a request using all 4, and the
    run stops there, as the theoretical maximum says."""
    requests = [_request(0, [1, 2], 6), _request(1, [1, 2, 3], 12), _request(2, [1, 2, 3], 12)]
    # r1 restores 4 + 2; r2 restores 4 + 4 + 4 (r1 saw all of page 2 and page 3).
    assert _hits(requests, 0) == 18
    theory = theoretical_max_hit_ratio(requests, block_size=B)
    assert theory.hit_tokens == 18


def test_capacity_in_pages() -> None:
    """Tokens over the block size, rounded down, at least one page; 0 stays unbounded."""
    assert [capacity_pages(c, 512) for c in (0, 1, 511, 512, 1_000_000)] == [0, 1, 1, 1, 1953]


_WORKLOADS = st.lists(
    st.lists(st.integers(0, 3), min_size=1, max_size=5), min_size=1, max_size=25
).map(lambda prompts: [_request(i, ids) for i, ids in enumerate(prompts)])


def _lru_hits(requests: list[SimRequest], capacity: int) -> int:
    """A page-level LRU cache of the same model: any online policy is at most Belady."""
    resident: dict[tuple[int, ...], None] = {}
    hits = 0
    for request in requests:
        chain = [tuple(request.block_ids[: i + 1]) for i in range(len(request.block_ids))]
        for key in chain:
            if key not in resident:
                break
            hits += B
        for key in chain:
            resident.pop(key, None)
            resident[key] = None
        while len(resident) > capacity:
            del resident[next(iter(resident))]
    return hits


@settings(max_examples=200, deadline=None)
@given(requests=_WORKLOADS, capacity=st.integers(1, 8))
def test_the_ceiling_bounds_lru_and_grows_with_capacity(
    requests: list[SimRequest], capacity: int
) -> None:
    """Belady restores at least what LRU does at the same capacity, never less with more
    capacity, and, unbounded (or with room for every page: the forward pass evicting nothing),
    exactly the theoretical maximum."""
    workload = plan(requests, block_size=B)
    at = clairvoyant_hits(workload, capacity).hit_tokens
    assert at >= _lru_hits(requests, capacity)
    assert clairvoyant_hits(workload, capacity + 1).hit_tokens >= at
    theoretical = theoretical_max_hit_ratio(requests, block_size=B).hit_tokens
    unbounded = clairvoyant_hits(workload, 0)
    assert unbounded.hit_tokens == theoretical
    assert clairvoyant_hits(workload, max(len(workload.pages), 1)).hit_tokens == theoretical
    assert at <= unbounded.hit_tokens


def _config(**overrides: object) -> SimConfig:
    settings_: dict[str, object] = {
        "stages": 2,
        "block_size": 16,
        "bytes_per_token": 2,
        "index": "paged",
        "cost": CostModel(prefill_s_per_token=1e-3, restore_s_per_byte=0.0),
    }
    settings_.update(overrides)
    return SimConfig(**settings_)  # type: ignore[arg-type]


TRACE = [
    SimRequest(index=0, input_length=48, block_ids=(1, 2, 3)),
    SimRequest(index=1, input_length=32, block_ids=(7, 8)),
    SimRequest(index=2, input_length=48, block_ids=(1, 2, 4)),
    SimRequest(index=3, input_length=32, block_ids=(7, 8)),
]


def test_the_replay_reports_the_ceiling_next_to_the_hit_ratio() -> None:
    """The JSON carries clairvoyant_hit_ratio and _tokens; the text splits the gap."""
    result = run_replay(TRACE, _config(capacity_tokens=48))
    assert result.clairvoyant is not None
    assert result.clairvoyant.capacity_pages == 3
    document = json.loads(json.dumps(result_to_json(result)))
    assert document["clairvoyant_hit_tokens"] == result.clairvoyant.hit_tokens
    assert document["clairvoyant_hit_ratio"] == result.clairvoyant.ratio
    assert document["token_hit_ratio"] <= document["clairvoyant_hit_ratio"]
    assert document["clairvoyant_hit_ratio"] <= document["theoretical_max_hit_ratio"]
    out = io.StringIO()
    render_report(Console(file=out, width=200), result, title="t")
    assert "a clairvoyant cache (Belady" in out.getvalue()
    assert "is what the eviction policy loses" in out.getvalue()


@pytest.mark.parametrize(
    ("grid", "grain"),
    [({}, 16), ({"min_tokens": 8}, 8), ({"min_tokens": 8, "stride_tokens": 8}, 8)],
)
def test_a_ladder_has_a_ceiling_only_when_its_grid_is_blocks(
    grid: dict[str, int], grain: int
) -> None:
    """The ladder's grain is its grid spacing (the stride capped at min_tokens), however it is
    spelled: finer than a block, it can restore part of one, which a ceiling in whole blocks
    would not count, so there is none."""
    config = _config(capacity_tokens=48, index="ladder", **grid)
    assert config.grain == grain
    result = run_replay(TRACE, config)
    assert (result.clairvoyant is None) == (grain != 16)
    assert (result_to_json(result)["clairvoyant_hit_ratio"] is None) == (grain != 16)


def test_the_ceiling_is_null_when_pages_are_not_blocks() -> None:
    """Pages of another size than the block size: no ceiling (null in the JSON)."""
    result = run_replay(TRACE, _config(capacity_tokens=48, page_tokens=8))
    assert result.clairvoyant is None
    assert result_to_json(result)["clairvoyant_hit_ratio"] is None


def test_a_sweep_has_the_ceiling_at_every_capacity() -> None:
    """Every point of a sweep has its own ceiling; the unbounded one is the theoretical max."""
    results = run_sweep(TRACE, _config(), [16, 48, 0])
    ceilings = [r.clairvoyant for r in results]
    assert all(c is not None for c in ceilings)
    ratios = [c.ratio for c in ceilings if c is not None]
    assert ratios == sorted(ratios)
    assert ratios[-1] == results[-1].theoretical.ratio
    out = io.StringIO()
    render_sweep(Console(file=out, width=250), results, title="sweep")
    assert "clairvoyant" in out.getvalue()


def test_the_plan_of_the_same_workload_is_computed_once() -> None:
    """The replays of a sweep share one plan; another workload (or block size) gets its own."""
    from stage_runtime.sim.clairvoyant import plan_of

    first = plan_of(TRACE, block_size=16)
    assert plan_of(list(TRACE), block_size=16) is first
    assert plan_of(TRACE, block_size=8) is not first
    assert plan_of(TRACE[:3], block_size=16) is not first


@settings(max_examples=100, deadline=None)
@given(
    block_size=st.integers(-(2**21), 2**21),
    capacities=st.lists(st.integers(-(2**40), 2**40), max_size=4),
)
@example(block_size=0, capacities=[0])
@example(block_size=-1, capacities=[0])
@example(block_size=-512, capacities=[0])
@example(block_size=B, capacities=[-5])
@example(block_size=B, capacities=[0, 1, B, 3 * B + 1])
def test_clairvoyant_for_checks_its_arguments(block_size: int, capacities: list[int]) -> None:
    """clairvoyant_for takes a block size in [4, 1,048,576] (SimConfig's bounds) and capacities
    that are integers >= 0 (0: unbounded, as --sweep-capacity spells it): anything else is a
    ConfigError naming it, before any work (a block size of 0 was a ZeroDivisionError, -512 a
    KeyError, -1 a silent 0; a capacity of -5 acted unbounded). Valid ones hold
    capacity // block_size pages, at least one, and never beat the infinite cache."""
    requests = [_request(0, [1, 2]), _request(1, [3]), _request(2, [1, 2])]
    if not MIN_BLOCK_SIZE <= block_size <= MAX_BLOCK_SIZE:
        message = rf"^block_size must be an integer in \[4, 1,048,576\], got {block_size}$"
        with pytest.raises(ConfigError, match=message):
            clairvoyant_for(requests, block_size=block_size, capacities_tokens=[0])
        return
    negative = [(i, c) for i, c in enumerate(capacities) if c < 0]
    if negative:
        position, capacity = negative[0]
        message = rf"^capacities_tokens\[{position}\] must be an integer >= 0, got {capacity}$"
        with pytest.raises(ConfigError, match=message):
            clairvoyant_for(requests, block_size=block_size, capacities_tokens=capacities)
        return
    results = clairvoyant_for(requests, block_size=block_size, capacities_tokens=capacities)
    assert sorted(results) == sorted(set(capacities))
    theory = theoretical_max_hit_ratio(requests, block_size=block_size).hit_tokens
    for capacity, result in results.items():
        assert result.capacity_pages == (capacity and max(capacity // block_size, 1))
        assert 0 <= result.hit_tokens <= theory


@pytest.mark.parametrize(
    ("capacities", "message"),
    [
        ([1500.7], r"capacities_tokens\[0\] must be an integer >= 0, got 1500.7"),
        ([0, True], r"capacities_tokens\[1\] must be an integer >= 0, got True"),
        (["100"], r"capacities_tokens\[0\] must be an integer >= 0, got '100'"),
        ([None], r"capacities_tokens\[0\] must be an integer >= 0, got None"),
        (100, "capacities_tokens must be an iterable of integers, got 100"),
        ("100", "capacities_tokens must be an iterable of integers, got '100'"),
    ],
)
def test_clairvoyant_for_names_a_capacity_that_is_not_a_token_count(
    capacities: object, message: str
) -> None:
    """A float capacity (which gave capacity_pages=2.0), a bool, a string or something that
    is not a list of capacities is refused by name."""
    with pytest.raises(ConfigError, match=message):
        clairvoyant_for(TRACE, block_size=16, capacities_tokens=capacities)  # type: ignore[arg-type]


def test_clairvoyant_hits_refuses_a_negative_capacity() -> None:
    """A negative page count is named (it used to empty the heap: an IndexError)."""
    with pytest.raises(ConfigError, match="capacity must be an integer >= 0, got -1"):
        clairvoyant_hits(plan(TRACE, block_size=16), -1)
