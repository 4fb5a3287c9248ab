"""Virtual-time costs of a simulated pipeline: prefill per token, restore per byte."""

from __future__ import annotations

import numbers
from collections.abc import Iterable, Sequence

import attrs
import numpy as np

from stage_runtime.errors import ConfigError, shown
from stage_runtime.limits import MAX_COST_S

__all__ = ["MAX_COST_S", "CostModel", "Percentiles", "percentiles", "pipeline_finish_times"]


def _non_negative_float(instance: object, attribute: attrs.Attribute[float], value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        msg = f"{attribute.name} must be a number of seconds, got {shown(value)}"
        raise ConfigError(msg)
    if value != value:  # NaN (math.isnan would overflow on an int past a float's range)
        msg = f"{attribute.name} must be a number of seconds >= 0, got nan"
        raise ConfigError(msg)
    if value < 0:
        msg = f"{attribute.name} must be >= 0, got {shown(value)}"
        raise ConfigError(msg)
    if value > MAX_COST_S:
        got = shown(value) if isinstance(value, int) else f"{value:g}"
        msg = f"{attribute.name} must be <= {MAX_COST_S:g} s, got {got}"
        raise ConfigError(msg)


def _floats(values: Iterable[float]) -> tuple[float, ...]:
    name = "stage_prefill_s_per_token"
    if isinstance(values, str | bytes) or not isinstance(values, Iterable):
        msg = f"{name} must be a sequence of numbers of seconds, got {shown(values)}"
        raise ConfigError(msg)
    costs = tuple(values)
    for position, value in enumerate(costs):
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            msg = f"{name} must hold numbers of seconds, got {shown(value)} at position {position}"
            raise ConfigError(msg)
    return tuple(float(value) for value in costs)


@attrs.frozen(kw_only=True)
class CostModel:
    """What a stage spends on one prefill, in seconds of virtual time.

    The defaults describe one quarter of a 7-8B model on a current GPU (about 40k prompt tokens
    per second per stage, so 25 us per token) restoring activations from host memory at about
    20 GB/s (0.05 ns per byte): restoring a 4,096-wide bf16 token is roughly 60 times cheaper
    than computing it.
    """

    prefill_s_per_token: float = attrs.field(default=25e-6, validator=_non_negative_float)
    """Seconds one stage spends computing one prompt token."""

    stage_prefill_s_per_token: tuple[float, ...] = attrs.field(
        default=(), converter=_floats, validator=attrs.validators.deep_iterable(_non_negative_float)
    )
    """Per-stage prefill costs for an unbalanced pipeline (one per stage, in order); empty:
    every stage costs ``prefill_s_per_token``."""

    restore_s_per_byte: float = attrs.field(default=0.05e-9, validator=_non_negative_float)
    """Seconds one stage spends restoring one byte of cached activations."""

    def prefill_for(self, stage_index: int) -> float:
        """Seconds stage ``stage_index`` spends computing one prompt token."""
        if self.stage_prefill_s_per_token:
            return self.stage_prefill_s_per_token[stage_index]
        return self.prefill_s_per_token

    def stage_cost(
        self, *, computed_tokens: int, restored_bytes: int, stage_index: int = 0
    ) -> float:
        """Seconds one stage spends on a prefill that restores some bytes and computes the rest."""
        return (
            computed_tokens * self.prefill_for(stage_index)
            + restored_bytes * self.restore_s_per_byte
        )

    def uncached_stage_cost(self, tokens: int, stage_index: int = 0) -> float:
        """Seconds one stage spends on a prefill of ``tokens`` with no cache."""
        return tokens * self.prefill_for(stage_index)


def pipeline_finish_times(
    arrivals_s: Sequence[float], stage_costs_s: Sequence[Sequence[float]], *, concurrency: int
) -> list[float]:
    """Finish times of requests through a pipeline of single-server FIFO stages.

    Request ``r`` is admitted at ``max(arrival[r], finish[r - concurrency])`` (at most
    ``concurrency`` in flight, admitted in order), then passes the stages in order; a stage works
    on one request at a time, in admission order. This is how the replay's stage tasks behave
    when every stage spends ``stage_costs_s[r][s]``, so it gives the uncached TTFT without a
    second replay.

    Args:
        arrivals_s: Arrival time of each request, in admission order.
        stage_costs_s: Per request, the time each stage spends on it.
        concurrency: Most requests in flight at once (>= 1).

    Returns:
        The time each request leaves the last stage.
    """
    if concurrency < 1:
        msg = f"concurrency must be >= 1, got {concurrency}"
        raise ConfigError(msg)
    finish: list[float] = []
    stage_free: list[float] = []
    for index, (arrival, costs) in enumerate(zip(arrivals_s, stage_costs_s, strict=True)):
        ready = arrival
        if index >= concurrency:
            ready = max(ready, finish[index - concurrency])
        if not stage_free:
            stage_free = [0.0] * len(costs)
        for stage, cost in enumerate(costs):
            ready = max(ready, stage_free[stage]) + cost
            stage_free[stage] = ready
        finish.append(ready)
    return finish


@attrs.frozen(kw_only=True)
class Percentiles:
    """p50, p90 and p99 of a sample (linear interpolation; zeros for an empty sample)."""

    p50: float
    p90: float
    p99: float


def percentiles(values: Sequence[float]) -> Percentiles:
    """Return p50/p90/p99 of ``values``."""
    if not values:
        return Percentiles(p50=0.0, p90=0.0, p99=0.0)
    p50, p90, p99 = np.percentile(np.asarray(values, dtype=np.float64), [50, 90, 99])
    return Percentiles(p50=float(p50), p90=float(p90), p99=float(p99))
