"""Synthetic workloads: shared system prompts and multi-turn conversations."""

from __future__ import annotations

import itertools

import pytest

from stage_runtime import ConfigError
from stage_runtime.sim import WorkloadSpec, synthetic_workload, theoretical_max_hit_ratio


def test_same_seed_same_workload_and_arrivals_are_sorted() -> None:
    """A seed fixes the workload; arrivals never go backwards; indices follow arrivals."""
    spec = WorkloadSpec(groups=3, prompts_per_group=4, conversations=2, turns=3, seed=5)
    first, second = synthetic_workload(spec), synthetic_workload(spec)
    assert first == second
    assert len(first) == spec.request_count == 18
    arrivals = [r.arrival_s for r in first]
    assert arrivals == sorted(arrivals)
    assert [r.index for r in first] == list(range(18))
    assert synthetic_workload(WorkloadSpec(groups=3, prompts_per_group=4, seed=6)) != first


def test_group_prompts_share_exactly_the_system_prompt() -> None:
    """One group of three: each later prompt can restore the 700-token system prompt only."""
    spec = WorkloadSpec(
        groups=1,
        prompts_per_group=3,
        system_prompt_tokens=700,
        question_tokens=100,
        conversations=0,
    )
    requests = synthetic_workload(spec, block_size=512)
    assert all(r.input_length == 800 for r in requests)
    assert all(r.block_lengths == (512, 188, 100) for r in requests)
    result = theoretical_max_hit_ratio(requests, block_size=512)
    assert result.hit_tokens == 2 * 700


def test_conversation_turns_extend_the_previous_turn_in_order() -> None:
    """Turn t resends every earlier turn: each prompt's blocks start with the previous one's."""
    spec = WorkloadSpec(groups=0, conversations=1, turns=4, tokens_per_turn=300)
    requests = synthetic_workload(spec, block_size=512)
    assert [r.input_length for r in requests] == [300, 600, 900, 1200]
    for previous, current in itertools.pairwise(requests):
        assert current.block_ids[: len(previous.block_ids)] == previous.block_ids
    result = theoretical_max_hit_ratio(requests, block_size=512)
    assert result.hit_tokens == 300 + 600 + 900


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"groups": -1}, "groups must be >= 0, got -1"),
        ({"question_tokens": 0}, "question_tokens must be >= 1, got 0"),
        ({"requests_per_s": 0.0}, "requests_per_s must be > 0, got 0.0"),
        ({"groups": 0, "conversations": 0}, "the workload has no requests"),
        ({"seed": -1}, "seed must be >= 0, got -1"),
        # Wrong types used to raise TypeError (from the comparison, or from numpy or range()
        # once the workload was built), or to count True as 1.
        ({"groups": 1.5}, "groups must be an integer, got 1.5"),
        ({"question_tokens": None}, "question_tokens must be an integer, got None"),
        ({"turns": True}, "turns must be an integer, got True"),
        ({"seed": 1.5}, "seed must be an integer, got 1.5"),
        ({"requests_per_s": "1"}, "requests_per_s must be a number, got '1'"),
        ({"requests_per_s": True}, "requests_per_s must be a number, got True"),
    ],
)
def test_impossible_workloads_are_refused(kwargs: dict[str, object], message: str) -> None:
    """Bad shapes raise ConfigError naming the field."""
    with pytest.raises(ConfigError, match=message):
        WorkloadSpec(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("block_size", [None, True, 512.0, 0, 3, 2**20 + 1])
def test_a_block_size_outside_the_simulation_bounds_is_refused(block_size: object) -> None:
    """synthetic_workload names a block size that is not an integer in [4, 1,048,576],
    SimConfig's bounds (None was a TypeError, True made blocks of one token)."""
    message = rf"block_size must be an integer in \[4, 1,048,576\], got {block_size!r}"
    with pytest.raises(ConfigError, match=message):
        synthetic_workload(WorkloadSpec(), block_size=block_size)  # type: ignore[arg-type]


def test_a_rate_so_small_that_arrivals_overflow_is_refused() -> None:
    """At 1e-307 requests per second the summed gaps overflowed to inf, and a replay at
    concurrency > 1 waited for those arrivals forever."""
    with pytest.raises(ConfigError, match="arrival rate of 1e-307 requests per second is too"):
        synthetic_workload(WorkloadSpec(requests_per_s=1e-307))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"groups": 100_000_000},
            "the workload would have 1,200,000,048 requests; at most 200,000 are generated",
        ),
        (  # few requests, each enormous
            {"groups": 1000, "prompts_per_group": 100, "system_prompt_tokens": 100_000},
            "the workload would have 10,038,486,016 prompt tokens; at most 1,000,000,000 are",
        ),
        (  # a conversation resends every earlier turn: tokens grow with turns squared
            {"groups": 0, "conversations": 1000, "turns": 100},
            "the workload would have 2,585,600,000 prompt tokens",
        ),
    ],
)
def test_a_workload_past_the_limits_is_refused_before_it_is_generated(
    kwargs: dict[str, object], message: str
) -> None:
    """--groups 100000000 grew to 2.3 GB in 20 s without a word, then a raw MemoryError; the
    size is computed from the shape first, and refused past the documented limits."""
    with pytest.raises(ConfigError, match=message):
        WorkloadSpec(**kwargs)  # type: ignore[arg-type]


def test_the_size_is_known_before_generating_and_matches_the_workload() -> None:
    """request_count and prompt_tokens, computed from the shape, are what gets generated."""
    spec = WorkloadSpec(groups=3, prompts_per_group=4, conversations=2, turns=5)
    requests = synthetic_workload(spec)
    assert spec.request_count == len(requests)
    assert spec.prompt_tokens == sum(request.input_length for request in requests)
    blocks = synthetic_workload(spec, block_size=100)
    assert spec.block_count(100) == sum(len(request.block_ids) for request in blocks)


def test_small_blocks_are_bounded_by_the_blocks_they_would_hold() -> None:
    """The memory a workload takes grows with its blocks: tiny blocks are refused by count."""
    spec = WorkloadSpec(groups=1000, prompts_per_group=10, system_prompt_tokens=30_000)
    assert spec.block_count(1) == spec.prompt_tokens
    with pytest.raises(ConfigError, match="block_size 4 would give the workload 75,981,504 "):
        synthetic_workload(spec, block_size=4)
