"""Fanned-out replays: each (stage, capacity) unit of a replay or sweep in a process of its own.

Virtual time cannot cross processes, but a replay does not need it to: a stage's hits depend
only on the order in which requests reach it, which is the admission order
(:func:`~stage_runtime.sim.driver.admission_order`), never on timing; and the points of a
capacity sweep are separate replays. So a sweep of ``C`` capacities through ``S`` stages splits
into ``S x C`` independent units. Each unit (:func:`replay_stage`) runs the real
:class:`~stage_runtime.stage.Stage` with its own cache actor and simulated model, in a trio run
of its own, fed every request in admission order, and returns what that stage restored and
computed per request, its record and eviction counters and its cache's accounting at the end
(a :class:`~stage_runtime.sim.driver.StageReplay`). The driver then computes every time and load
figure once, with the code a one-process replay uses
(:func:`~stage_runtime.sim.driver.summarise_replay`): every result but the wall time is
identical to a one-process run.

Units run on any :class:`concurrent.futures.Executor` (:func:`fan_out`): a pool of local
processes or Ray tasks, both opened by :func:`open_executor`.
"""

from __future__ import annotations

import concurrent.futures
import functools
import multiprocessing
import os
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Final

import attrs
import numpy as np
import trio

from stage_runtime._validators import check_int, check_positive_int, is_int
from stage_runtime.errors import ConfigError, shown
from stage_runtime.placement import LocalPlacement, Placement, RayPlacement
from stage_runtime.placement.worker_logging import driver_log_level, stderr_json_logging
from stage_runtime.sim.blocks import BlockTokenizer
from stage_runtime.sim.driver import (
    ProgressCallback,
    ReplayResult,
    SimConfig,
    StageReplay,
    _StageTally,
    admission_order,
    stage_configs,
    summarise_replay,
    validate_requests,
)
from stage_runtime.sim.model import SimulatedStageModel, simulated_model_factory
from stage_runtime.sim.theory import TheoreticalMax, theoretical_max_hit_ratio
from stage_runtime.sim.trace import SimRequest
from stage_runtime.stage import PrefillRequest, Stage

__all__ = ["fan_out", "open_executor", "replay_stage"]

LogSetup = Callable[[], None]
"""Configures logging in a unit's process before it replays (a picklable callable)."""

_FEED_AHEAD: Final = 8
"""Requests a unit's feeder prepares ahead of its stage (token ids are generated per request,
so this bounds the memory they take)."""


def replay_stage(
    requests: Sequence[SimRequest],
    config: SimConfig,
    stage_index: int,
    capacity_tokens: int | None = None,
    log_setup: LogSetup | None = None,
) -> StageReplay:
    """Replay every request through one stage of the simulated pipeline, alone: one unit.

    The stage is the pipeline's own :class:`~stage_runtime.stage.Stage` with its cache actor
    and a :class:`~stage_runtime.sim.model.SimulatedStageModel` that does not sleep, in a trio
    run of its own (call this from synchronous code, in any process). It is fed the requests in
    admission order, as the pipeline's stage would be; a stage after the first gets, for each
    request, the virtual frame its predecessor would have sent (virtual frames carry nothing
    but their size, so that is the whole input).

    A module-level function of picklable arguments and result, so that an executor can run it
    in another process.

    Args:
        requests: The workload, in file order.
        config: The simulation settings.
        stage_index: Which stage (0-based).
        capacity_tokens: Overrides ``config.capacity_tokens`` (a sweep point).
        log_setup: Called first, to configure logging in this process (None: left as is).

    Returns:
        What the stage restored and computed per request (in admission order), its counters
        and its cache's accounting at the end.

    Raises:
        ConfigError: ``stage_index`` is not a stage of ``config``, or the requests or the
            capacity are invalid.
    """
    if log_setup is not None:
        log_setup()
    check_int("stage_index", stage_index, low=0, high=config.stages - 1)
    capacity = config.capacity_tokens if capacity_tokens is None else capacity_tokens
    config.check_capacity(capacity)
    validate_requests(requests, block_size=config.block_size)
    return trio.run(_replay_stage, requests, config, stage_index, capacity)


async def _replay_stage(
    requests: Sequence[SimRequest], config: SimConfig, stage_index: int, capacity: int
) -> StageReplay:
    configs = stage_configs(config, capacity_tokens=capacity)
    stage_config = configs[stage_index]
    factory = simulated_model_factory(
        bytes_per_token=config.bytes_per_token, cost=config.cost, sleep=False
    )
    upstream = None
    if stage_index > 0:
        previous = configs[stage_index - 1]
        upstream = SimulatedStageModel(
            bytes_per_token=config.bytes_per_token,
            cost=config.cost,
            stage_index=previous.stage_index,
            layer_start=previous.layer_start,
            layer_end=previous.layer_end,
            sleep=False,
        )
    ordered = admission_order(requests, config.concurrency)
    tokenizer = BlockTokenizer(config.block_size)
    tally = _StageTally(len(ordered))
    send_inbox, inbox = trio.open_memory_channel[PrefillRequest](_FEED_AHEAD)
    send_sent, sent = trio.open_memory_channel[PrefillRequest](_FEED_AHEAD)
    # environ={}: as in a one-process replay, the simulation is what its SimConfig says.
    stage = Stage(config=stage_config, model_factory=factory, inbox=inbox, outbox=None, environ={})

    async def feed() -> None:
        async with send_inbox, send_sent:
            for request in ordered:
                tokens = tokenizer.request_tokens(request)
                tokens.flags.writeable = False  # as the pipeline hands its stages tokens
                prefill = PrefillRequest(
                    request_id=f"request-{request.index}",
                    session_id=f"session-{request.index}",
                    tokens=tokens,
                    frame=None if upstream is None else upstream.frame(int(np.size(tokens))),
                )
                await send_sent.send(prefill)
                await send_inbox.send(prefill)

    async def collect() -> None:
        position = 0
        async with sent:
            async for prefill in sent:  # in the stage's own order: it serves its inbox FIFO
                await prefill.done.wait()
                if prefill.error is not None:
                    raise prefill.error
                tally.add(position, prefill.reports[0])
                position += 1

    async with trio.open_nursery() as nursery:
        await nursery.start(stage.run)
        nursery.start_soon(collect)
        nursery.start_soon(feed)
    # The stage has drained and stopped: these are its final statistics.
    final = await stage.statistics()
    return tally.replay(final.stage_id, final.accounting)


def fan_out(
    requests: Sequence[SimRequest],
    config: SimConfig,
    capacities: Sequence[int],
    executor: concurrent.futures.Executor,
    *,
    theoretical: TheoreticalMax | None = None,
    progress: ProgressCallback | None = None,
    max_in_flight: int | None = None,
    log_setup: LogSetup | None = None,
) -> list[ReplayResult]:
    """Replay once per capacity, every stage of every replay a unit (:func:`replay_stage`)
    run by ``executor``; then summarise each replay here, as a one-process replay does.

    Every figure of the results equals that of :func:`~stage_runtime.sim.runs.run_sweep`
    in one process, but for ``wall_s`` (and ``tokens_per_s``): the replays run side by side,
    so each is given an equal share of the fan-out's wall time (a sweep's add up to it).

    Args:
        requests: The workload, in file order.
        config: The simulation settings.
        capacities: Capacities in tokens per stage (0: unbounded), in the order of the results.
        executor: Runs the units: a :class:`concurrent.futures.ProcessPoolExecutor` (of the
            ``spawn`` context: forking a process that runs trio or threads is not safe), Ray
            tasks, any executor that can pickle them. :func:`open_executor` opens either.
        theoretical: The workload's theoretical maximum, if already computed.
        progress: Called as units finish (see
            :data:`~stage_runtime.sim.driver.ProgressCallback`).
        max_in_flight: Most units submitted at once (None: all of them at once).
        log_setup: Configures logging in each unit's process before it replays; must be
            picklable. None: structlog JSON lines on stderr at this process's level, in other
            processes only (a thread pool's units log as this process is configured to).

    Returns:
        One result per capacity, in the given order.

    Raises:
        ConfigError: the requests, a capacity or ``max_in_flight`` is invalid.
        Exception: whatever a unit raised (the units not started yet are cancelled).
    """
    if max_in_flight is not None and not (is_int(max_in_flight) and max_in_flight >= 1):
        msg = f"max_in_flight must be None or an integer >= 1, got {shown(max_in_flight)}"
        raise ConfigError(msg)
    for capacity in capacities:
        config.check_capacity(capacity)
    requests = list(requests)  # one object for every unit: Ray's executor then ships it once
    validate_requests(requests, block_size=config.block_size)
    if log_setup is None:
        log_setup = functools.partial(
            stderr_json_logging, driver_log_level(), driver_pid=os.getpid()
        )
    stages = config.stages
    # Larger caches hold more pages, so their units take longer: they go first, and the
    # shortest fill the last gaps (the results do not depend on the order).
    by_size = sorted(
        range(len(capacities)), key=lambda run: (capacities[run] != 0, -capacities[run])
    )
    units = [(run, stage) for run in by_size for stage in range(stages)]
    limit = len(units) if max_in_flight is None else max_in_flight
    waiting = iter(units)
    pending: dict[concurrent.futures.Future[StageReplay], tuple[int, int]] = {}
    done: dict[tuple[int, int], StageReplay] = {}
    left = [stages] * len(capacities)
    results: list[ReplayResult] = []
    finished_units = 0
    started = time.perf_counter()
    try:
        while True:
            while len(pending) < limit and (unit := next(waiting, None)) is not None:
                run, stage = unit
                future = executor.submit(
                    replay_stage, requests, config, stage, capacities[run], log_setup
                )
                pending[future] = unit
            if not pending:
                break
            if theoretical is None:  # while the first units run
                theoretical = theoretical_max_hit_ratio(requests, block_size=config.block_size)
            finished, _ = concurrent.futures.wait(
                pending, return_when=concurrent.futures.FIRST_COMPLETED
            )
            for future in finished:
                run, stage = pending.pop(future)
                done[run, stage] = future.result()
                finished_units += 1
                left[run] -= 1
                if not left[run]:  # summarised now, while other units run
                    replayed = [done.pop((run, index)) for index in range(stages)]
                    results.append(
                        summarise_replay(
                            requests,
                            config,
                            replayed,
                            capacity_tokens=capacities[run],
                            theoretical=theoretical,
                        )
                    )
                if progress is not None:
                    progress(finished_units * len(requests) // stages)
    except BaseException:
        for future in pending:
            future.cancel()
        raise
    # The replays ran side by side: each gets an equal share of the wall time.
    wall_s = (time.perf_counter() - started) / max(len(capacities), 1)
    by_capacity = {
        result.capacity_tokens: attrs.evolve(result, wall_s=wall_s) for result in results
    }
    return [by_capacity[capacity] for capacity in capacities]


@contextmanager
def open_executor(
    *, workers: int = 1, placement: Placement | None = None
) -> Iterator[concurrent.futures.Executor | None]:
    """The executor a fanned-out replay runs its units on, for the duration of the block.

    Args:
        workers: Local processes (with no placement or a local one). 1 yields None: replay in
            this process, as the command line does without ``--workers``. More: a
            :class:`~concurrent.futures.ProcessPoolExecutor` of that many ``spawn``-ed
            processes (never forked: this process may be running trio or threads).
        placement: A :class:`~stage_runtime.placement.RayPlacement`: Ray tasks, one logical
            CPU each (Ray started or joined for the block, as a pipeline does; ``workers`` is
            not used: bound the units in flight with ``fan_out(max_in_flight=...)``).

    Yields:
        The executor, or None for a one-process replay.

    Raises:
        ConfigError: ``workers`` is not an integer >= 1, ``placement`` is not a placement, or
            Ray could not start or join its cluster.
    """
    check_positive_int("workers", workers)
    if isinstance(placement, RayPlacement):
        # Imported only when asked for: Ray is an optional extra.
        from stage_runtime.placement.ray_session import open_ray_executor

        with open_ray_executor(placement) as executor:
            yield executor
        return
    if placement is not None and not isinstance(placement, LocalPlacement):
        msg = f"placement must be None, a LocalPlacement or a RayPlacement, got {placement!r}"
        raise ConfigError(msg)
    if workers == 1:
        yield None
        return
    pool = concurrent.futures.ProcessPoolExecutor(
        max_workers=workers, mp_context=multiprocessing.get_context("spawn")
    )
    try:
        yield pool
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
