"""The cost model and the FIFO pipeline timing used for uncached TTFT."""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import pytest

from stage_runtime import ConfigError
from stage_runtime.sim import CostModel, percentiles, pipeline_finish_times


def test_stage_cost_charges_computed_tokens_and_restored_bytes() -> None:
    """Cost = computed tokens x prefill cost + restored bytes x restore cost."""
    cost = CostModel(prefill_s_per_token=2.0, restore_s_per_byte=0.5)
    assert cost.stage_cost(computed_tokens=3, restored_bytes=4) == 8.0
    assert cost.uncached_stage_cost(5) == 10.0


@pytest.mark.parametrize("field", ["prefill_s_per_token", "restore_s_per_byte"])
def test_negative_costs_are_refused(field: str) -> None:
    """Negative or NaN costs raise ConfigError naming the field."""
    negative: dict[str, Any] = {field: -1.0}
    with pytest.raises(ConfigError, match=f"{field} must be >= 0, got -1"):
        CostModel(**negative)
    nan: dict[str, Any] = {field: float("nan")}
    with pytest.raises(ConfigError, match=f"{field} must be a number of seconds >= 0, got nan"):
        CostModel(**nan)
    huge: dict[str, Any] = {field: 1e308}  # would overflow the virtual clock
    with pytest.raises(ConfigError, match=f"{field} must be <= 3600 s, got 1e\\+308"):
        CostModel(**huge)
    past_floats: dict[str, Any] = {field: 10**400}  # (no float conversion to overflow)
    with pytest.raises(ConfigError, match=f"{field} must be <= 3600 s, got 1000000000"):
        CostModel(**past_floats)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"prefill_s_per_token": "1"}, "prefill_s_per_token must be a number of seconds, got '1'"),
        (
            {"prefill_s_per_token": True},
            "prefill_s_per_token must be a number of seconds, got True",
        ),
        ({"restore_s_per_byte": None}, "restore_s_per_byte must be a number of seconds, got None"),
        (
            {"stage_prefill_s_per_token": "abcd"},
            "stage_prefill_s_per_token must be a sequence of numbers of seconds, got 'abcd'",
        ),
        (
            {"stage_prefill_s_per_token": 1e-3},
            "stage_prefill_s_per_token must be a sequence of numbers of seconds, got 0.001",
        ),
        (
            {"stage_prefill_s_per_token": [1e-3, None]},
            "stage_prefill_s_per_token must hold numbers of seconds, got None at position 1",
        ),
        (
            {"stage_prefill_s_per_token": ["1e-3"]},
            "stage_prefill_s_per_token must hold numbers of seconds, got '1e-3' at position 0",
        ),
    ],
)
def test_costs_that_are_not_numbers_are_refused(changes: dict[str, Any], message: str) -> None:
    """A cost of the wrong type is a ConfigError naming the field, not a TypeError or
    ValueError from comparing or converting it (nor, for True or "1e-3", a silent 1 s or
    0.001 s)."""
    with pytest.raises(ConfigError, match=re.escape(message)):
        CostModel(**changes)
    numpy_costs: tuple[Any, ...] = (1, np.float32(0.5))  # an int and a numpy float are numbers
    assert CostModel(stage_prefill_s_per_token=numpy_costs).stage_prefill_s_per_token == (1.0, 0.5)


def test_pipeline_finish_times_overlap_stages() -> None:
    """Two stages of 1 s: request 1 enters stage 0 while request 0 is in stage 1."""
    finish = pipeline_finish_times([0.0, 0.0], [[1.0, 1.0], [1.0, 1.0]], concurrency=2)
    assert finish == [2.0, 3.0]


def test_pipeline_finish_times_respect_concurrency_and_arrivals() -> None:
    """With concurrency 1 a request waits for the previous one; a late arrival waits for itself."""
    finish = pipeline_finish_times([0.0, 0.0, 10.0], [[1.0, 1.0]] * 3, concurrency=1)
    assert finish == [2.0, 4.0, 12.0]
    with pytest.raises(ConfigError, match="concurrency must be >= 1, got 0"):
        pipeline_finish_times([0.0], [[1.0]], concurrency=0)


def test_percentiles_interpolate_linearly() -> None:
    """p50/p90/p99 of 0..100 are 50/90/99; an empty sample gives zeros."""
    result = percentiles([float(v) for v in range(101)])
    assert (result.p50, result.p90, result.p99) == (50.0, 90.0, 99.0)
    empty = percentiles([])
    assert (empty.p50, empty.p90, empty.p99) == (0.0, 0.0, 0.0)


def test_per_stage_prefill_costs() -> None:
    """An unbalanced pipeline: each stage charges its own prefill cost per token."""
    cost = CostModel(prefill_s_per_token=9.0, stage_prefill_s_per_token=[1.0, 3.0])
    assert cost.stage_cost(computed_tokens=2, restored_bytes=0, stage_index=1) == 6.0
    assert cost.uncached_stage_cost(2, 0) == 2.0
    assert CostModel(prefill_s_per_token=9.0).prefill_for(3) == 9.0
    with pytest.raises(ConfigError, match="must be >= 0, got -2"):
        CostModel(stage_prefill_s_per_token=[1.0, -2.0])
