"""Replays from synchronous code: in one process on a virtual clock, or fanned out.

:func:`run_replay` and :func:`run_sweep` build on both the in-process replay
(:mod:`stage_runtime.sim.driver`) and the fan-out (:mod:`stage_runtime.sim.fanout`, which builds
on the driver too), so they live apart from both: no module of the simulator imports one that
imports it back.
"""

from __future__ import annotations

import concurrent.futures
import math
from collections.abc import Sequence

import trio

from stage_runtime.sim._collector import fewer_full_collections
from stage_runtime.sim.driver import (
    ProgressCallback,
    ReplayResult,
    SimConfig,
    replay,
)
from stage_runtime.sim.fanout import fan_out
from stage_runtime.sim.theory import TheoreticalMax, theoretical_max_hit_ratio
from stage_runtime.sim.trace import SimRequest

__all__ = ["run_replay", "run_sweep"]


def run_replay(
    requests: Sequence[SimRequest],
    config: SimConfig,
    *,
    capacity_tokens: int | None = None,
    theoretical: TheoreticalMax | None = None,
    progress: ProgressCallback | None = None,
    virtual_time: bool | None = None,
    executor: concurrent.futures.Executor | None = None,
) -> ReplayResult:
    """Run :func:`replay` in a fresh trio run on a virtual clock (from synchronous code), or
    fan it out.

    Args:
        requests: The workload, in file order.
        config: The simulation settings.
        capacity_tokens: Overrides ``config.capacity_tokens``.
        theoretical: The workload's theoretical maximum, if already computed.
        progress: Called with the count of finished requests (see :data:`ProgressCallback`).
        virtual_time: See :func:`replay` (one process only: fanned-out stages never sleep).
        executor: None: one process, one pipeline. An executor (a process pool, Ray tasks):
            one unit per stage on it, with identical results (see
            :func:`~stage_runtime.sim.fanout.fan_out`).

    Returns:
        The replay's result.
    """
    if executor is not None:
        capacity = config.capacity_tokens if capacity_tokens is None else capacity_tokens
        (result,) = fan_out(
            requests, config, [capacity], executor, theoretical=theoretical, progress=progress
        )
        return result
    clock = _VirtualClock()

    async def main() -> ReplayResult:
        return await replay(
            requests,
            config,
            capacity_tokens=capacity_tokens,
            theoretical=theoretical,
            progress=progress,
            virtual_time=virtual_time,
        )

    with fewer_full_collections():
        return trio.run(main, clock=clock)


class _VirtualClock(trio.abc.Clock):
    """Virtual time that stands still while any task can run and, once none can, jumps to the
    next deadline: the times ``trio.testing.MockClock(autojump_threshold=0)`` keeps, by the same
    arithmetic (from 0.0, each jump adding the seconds to the deadline). The run loop reads the
    time once per batch of task steps and each stage twice per request: a mock clock's reading
    (its rate applied to the real clock) cost a replay about 2% of its CPU time.

    Trio asks how long to sleep until a deadline only when no task can run: that is when it
    jumps (before waiting for I/O, where the mock clock polls for I/O once first). So it is for
    replays whose tasks wait on nothing but each other and the clock, as run_replay's do (its
    simulated stages never compute or copy in worker threads: their frames are virtual); a task
    waiting on a thread would see the clock jump first."""

    def __init__(self) -> None:
        self._now = 0.0

    def start_clock(self) -> None:
        pass

    def current_time(self) -> float:
        return self._now

    def deadline_to_sleep_time(self, deadline: float) -> float:
        seconds = deadline - self._now
        if seconds <= 0:
            return 0
        if seconds < math.inf:
            self._now += seconds
            return 0
        return 999999999  # (no deadline: wait for I/O, as the mock clock does)


def run_sweep(
    requests: Sequence[SimRequest],
    config: SimConfig,
    capacities: Sequence[int],
    *,
    progress: ProgressCallback | None = None,
    executor: concurrent.futures.Executor | None = None,
) -> list[ReplayResult]:
    """Replay the same requests once per cache capacity (tokens per stage; 0 = unbounded).

    Args:
        requests: The workload, in file order.
        config: The simulation settings.
        capacities: The capacities, in the order of the results.
        progress: Called with the count of finished requests over all the replays (see
            :data:`ProgressCallback`).
        executor: None: one replay after another in this process. An executor: every
            (stage, capacity) unit on it, with identical results (see
            :func:`~stage_runtime.sim.fanout.fan_out`).

    Returns:
        One result per capacity, in the given order.
    """
    for capacity in capacities:
        config.check_capacity(capacity)
    # Before the theoretical maximum, which would fail on a malformed request without naming it.
    config.check_requests(requests)
    theoretical = theoretical_max_hit_ratio(requests, block_size=config.block_size)
    if executor is not None:
        return fan_out(
            requests, config, capacities, executor, theoretical=theoretical, progress=progress
        )
    results = []
    for done, capacity in enumerate(capacities):
        base = done * len(requests)

        def shifted(count: int, base: int = base) -> None:
            if progress is not None:
                progress(base + count)

        results.append(
            run_replay(
                requests,
                config,
                capacity_tokens=capacity,
                theoretical=theoretical,
                progress=shifted,
            )
        )
    return results
