"""Fanned-out replays: the (stages, capacity) units of a replay or sweep in processes of their own.

Virtual time cannot cross processes, but a replay does not need it to: a stage's hits depend
only on the order in which requests reach it, which is the admission order
(:func:`~stage_runtime.sim.driver.admission_order`), never on timing; and the points of a
capacity sweep are separate replays. So a sweep of ``C`` capacities through ``S`` stages splits
into up to ``S x C`` independent units. Each unit (:func:`replay_stages`) runs the real
:class:`~stage_runtime.stage.Stage` of one or more stages, each with its own cache actor and
simulated model, in a trio run of its own, fed every request in admission order, and returns
what each stage restored and computed per request, its record and eviction counters and its
cache's accounting at the end (a :class:`~stage_runtime.sim.driver.StageReplay`). The driver
then computes every time and load figure once, with the code a one-process replay uses
(:func:`~stage_runtime.sim.driver.summarise_replay`): every result but the wall time is
identical to a one-process run.

Units run on any :class:`concurrent.futures.Executor` (:func:`fan_out`): a pool of local
processes or Ray tasks, both opened by :func:`open_executor`. How many stages a unit takes is
:func:`stage_groups`' choice: a unit of several stages shares their per-request work, more
units keep more processes busy.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import multiprocessing
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Final

import attrs
import numpy as np
import numpy.typing as npt
import trio

from stage_runtime._validators import check_int, check_positive_int, is_int
from stage_runtime.cache.prompt import owned_tokens
from stage_runtime.config import StageConfig
from stage_runtime.errors import ConfigError, shown
from stage_runtime.models import ModelFactory
from stage_runtime.placement import LocalPlacement, Placement, RayPlacement
from stage_runtime.placement.worker_logging import driver_log_level, stderr_json_logging
from stage_runtime.sim._collector import fewer_full_collections
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
)
from stage_runtime.sim.model import SimulatedStageModel, simulated_model_factory
from stage_runtime.sim.theory import TheoreticalMax, theoretical_max_hit_ratio
from stage_runtime.sim.trace import SimRequest
from stage_runtime.stage import PrefillRequest, Stage

__all__ = ["fan_out", "open_executor", "replay_stage", "replay_stages", "stage_groups"]

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
    (replayed,) = replay_stages(requests, config, (stage_index,), capacity_tokens, log_setup)
    return replayed


def replay_stages(
    requests: Sequence[SimRequest],
    config: SimConfig,
    stage_indices: Sequence[int],
    capacity_tokens: int | None = None,
    log_setup: LogSetup | None = None,
) -> list[StageReplay]:
    """:func:`replay_stage` for several stages in one trio run: one unit, cheaper than one per
    stage.

    The stages replay side by side, each alone as in :func:`replay_stage` (with its own cache
    actor, fed every request in admission order), but they share what depends on the request
    only: its token ids are generated once and handed to every stage as one read-only array, so
    the caches' per-prompt work that depends on the tokens alone (the grid fingerprints) is
    done once too, as in the pipeline.

    Args:
        requests: The workload, in file order.
        config: The simulation settings.
        stage_indices: Which stages (0-based, distinct).
        capacity_tokens: Overrides ``config.capacity_tokens`` (a sweep point).
        log_setup: Called first, to configure logging in this process (None: left as is).

    Returns:
        One :class:`~stage_runtime.sim.driver.StageReplay` per stage, in the given order.

    Raises:
        ConfigError: a stage index is not a stage of ``config`` or is given twice, or the
            requests or the capacity are invalid.
    """
    if log_setup is not None:
        log_setup()
    stages = tuple(stage_indices)
    for stage_index in stages:
        check_int("stage_index", stage_index, low=0, high=config.stages - 1)
    if not stages or len(set(stages)) != len(stages):
        msg = f"stage_indices must name distinct stages, at least one, got {stages!r}"
        raise ConfigError(msg)
    capacity = config.capacity_tokens if capacity_tokens is None else capacity_tokens
    config.check_capacity(capacity)
    config.check_requests(requests)
    with fewer_full_collections():
        return trio.run(_replay_stages, requests, config, stages, capacity)


async def _replay_stages(
    requests: Sequence[SimRequest],
    config: SimConfig,
    stage_indices: tuple[int, ...],
    capacity: int,
) -> list[StageReplay]:
    configs = stage_configs(config, capacity_tokens=capacity)
    factory = simulated_model_factory(
        bytes_per_token=config.bytes_per_token, cost=config.cost, sleep=False
    )
    ordered = admission_order(requests, config.concurrency)
    tokenizer = BlockTokenizer(config.block_size)
    lanes = [_Lane(configs, index, factory, config, len(ordered)) for index in stage_indices]

    async def feed() -> None:
        with contextlib.ExitStack() as stack:
            for lane in lanes:
                stack.enter_context(lane.send_inbox)
            for position, request in enumerate(ordered):
                # Read-only and owning its memory, as the pipeline hands its stages tokens:
                # every stage then keeps this array, no copy of its own.
                tokens = owned_tokens(tokenizer.request_tokens(request))
                try:
                    for lane in lanes:
                        await lane.send(position, request.index, tokens)
                except trio.BrokenResourceError:
                    # A stage stopped (it failed, or a failed request cancelled the unit)
                    # and closed its inbox before this task saw the cancellation (a send
                    # without room for it is no cancel point): its own error, or its
                    # lane's, says why.
                    return

    async with trio.open_nursery() as nursery:
        for lane in lanes:
            lane.abort = nursery.cancel_scope.cancel
            await nursery.start(lane.stage.run)
        nursery.start_soon(feed)
    for lane in lanes:
        if lane.error is not None:
            raise lane.error
    # The stages have drained and stopped: these are their final statistics.
    replayed = []
    for lane in lanes:
        final = await lane.stage.statistics()
        if lane.settled != len(ordered):  # (every request is settled before its stage stops)
            msg = f"stage {final.stage_id} settled {lane.settled} of {len(ordered)} requests"
            raise RuntimeError(msg)
        replayed.append(lane.tally.replay(final.stage_id, final.accounting))
    return replayed


class _Lane:
    """One stage of a unit: the stage, its inbox and its tally, which each request joins as
    the stage settles it (:class:`_UnitPrefill`: no task waits on a request)."""

    def __init__(
        self,
        configs: Sequence[StageConfig],
        stage_index: int,
        factory: ModelFactory,
        config: SimConfig,
        requests: int,
    ) -> None:
        self.upstream: SimulatedStageModel | None = None
        if stage_index > 0:
            previous = configs[stage_index - 1]
            self.upstream = SimulatedStageModel(
                bytes_per_token=config.bytes_per_token,
                cost=config.cost,
                stage_index=previous.stage_index,
                layer_start=previous.layer_start,
                layer_end=previous.layer_end,
                sleep=False,
            )
        self.tally = _StageTally(requests)
        self.settled = 0
        self.error: Exception | None = None
        self.abort: Callable[[], None] | None = None
        self.send_inbox, inbox = trio.open_memory_channel[PrefillRequest](_FEED_AHEAD)
        # environ={}: as in a one-process replay, the simulation is what its SimConfig says.
        self.stage = Stage(
            config=configs[stage_index],
            model_factory=factory,
            inbox=inbox,
            outbox=None,
            environ={},
        )

    async def send(self, position: int, index: int, tokens: npt.NDArray[np.int32]) -> None:
        """Hand the stage request ``index`` (its tokens, and its predecessor's frame), the
        ``position``-th in admission order."""
        upstream = self.upstream
        prefill = _UnitPrefill(
            request_id=f"request-{index}",
            session_id=f"session-{index}",
            tokens=tokens,
            frame=None if upstream is None else upstream.frame(int(tokens.size)),
        )
        prefill._lane, prefill._position = self, position
        try:
            # No schedule point while the inbox has room: the stage takes a batch of requests
            # per wake-up (hits do not depend on when it takes them, only on their order).
            self.send_inbox.send_nowait(prefill)
        except trio.WouldBlock:
            await self.send_inbox.send(prefill)

    def succeeded(self, position: int, prefill: PrefillRequest) -> None:
        """Tally the stage's report on the request at ``position``."""
        self.tally.add(position, prefill.reports[0])
        self.settled += 1

    def failed(self, error: Exception) -> None:
        """A request failed: the unit fails with its error (the first one)."""
        if self.error is None:
            self.error = error
        if self.abort is not None:
            self.abort()


class _UnitPrefill(PrefillRequest):
    """A unit's request: settling it files the stage's report with its lane at once."""

    __slots__ = ("_lane", "_position")

    _lane: _Lane
    _position: int

    def succeed(self) -> None:
        super().succeed()
        self._lane.succeeded(self._position, self)

    def fail(self, error: Exception) -> None:
        if not self.done.is_set():
            super().fail(error)
            self._lane.failed(error)


def fan_out(
    requests: Sequence[SimRequest],
    config: SimConfig,
    capacities: Sequence[int],
    executor: concurrent.futures.Executor,
    *,
    theoretical: TheoreticalMax | None = None,
    progress: ProgressCallback | None = None,
    max_in_flight: int | None = None,
    parallelism: int | None = None,
    log_setup: LogSetup | None = None,
) -> list[ReplayResult]:
    """Replay once per capacity, the stages of every replay split into units
    (:func:`replay_stages`) run by ``executor``; then summarise each replay here, as a
    one-process replay does.

    A unit of several stages costs less than as many units of one (they share each request's
    token ids and fingerprints), but a unit per stage leaves more units to spread over the
    executor's processes. Given ``parallelism``, each replay is split into the number of units
    that finishes soonest by that estimate (a sweep of 4 capacities on 2 processes: one unit
    per capacity); without it, one unit per stage.

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
        parallelism: How many units the executor runs side by side (its processes); None:
            ``max_in_flight``, else the ``max_workers`` of a standard library pool, else
            unknown (one unit per stage).
        log_setup: Configures logging in each unit's process before it replays; must be
            picklable. None: structlog JSON lines on stderr at this process's level, in other
            processes only (a thread pool's units log as this process is configured to).

    Returns:
        One result per capacity, in the given order.

    Raises:
        ConfigError: the requests, a capacity, ``max_in_flight`` or ``parallelism`` is
            invalid.
        Exception: whatever a unit raised (the units not started yet are cancelled).
    """
    for name, value in (("max_in_flight", max_in_flight), ("parallelism", parallelism)):
        if value is not None and not (is_int(value) and value >= 1):
            msg = f"{name} must be None or an integer >= 1, got {shown(value)}"
            raise ConfigError(msg)
    if parallelism is None:
        parallelism = max_in_flight or _pool_workers(executor)
    for capacity in capacities:
        config.check_capacity(capacity)
    requests = list(requests)  # one object for every unit: Ray's executor then ships it once
    config.check_requests(requests)
    if log_setup is None:
        log_setup = functools.partial(
            stderr_json_logging, driver_log_level(), driver_pid=os.getpid()
        )
    stages = config.stages
    # Bounded caches evict pages on most requests, so their units take longer: they go first
    # (smallest first), and the unbounded ones, the shortest, fill the last gaps (the paged
    # synthetic trace's 4-stage units at 1M, 3M, 10M tokens and unbounded: 2.35, 2.52, 2.36
    # and 2.16 s of CPU). The results do not depend on the order.
    by_size = sorted(
        range(len(capacities)), key=lambda run: (capacities[run] == 0, capacities[run])
    )
    groups = stage_groups(stages, len(capacities), parallelism)
    units = [(run, group) for run in by_size for group in groups]
    limit = len(units) if max_in_flight is None else max_in_flight
    waiting = iter(units)
    pending: dict[concurrent.futures.Future[list[StageReplay]], tuple[int, Stages]] = {}
    done: dict[tuple[int, int], StageReplay] = {}
    left = [stages] * len(capacities)
    results: list[ReplayResult] = []
    finished_stages = 0
    started = time.perf_counter()
    try:
        while True:
            while len(pending) < limit and (unit := next(waiting, None)) is not None:
                run, group = unit
                future = executor.submit(
                    replay_stages, requests, config, group, capacities[run], log_setup
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
                run, group = pending.pop(future)
                for stage, stage_replay in zip(group, future.result(), strict=True):
                    done[run, stage] = stage_replay
                finished_stages += len(group)
                left[run] -= len(group)
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
                    progress(finished_stages * len(requests) // stages)
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


Stages = tuple[int, ...]
"""The stages of one unit (0-based, ascending)."""

_SHARED_WORK: Final = 0.42
"""A unit's work on each request that does not depend on its stages (token ids, fingerprints,
feeding), as a share of one stage's: measured on the synthetic trace, 4 stages of the paged
index at 1M, 3M, 10M tokens and unbounded, a unit of one stage costs 1.33 to 1.47 times a
quarter of a unit of four (CPU time, best of two)."""


def stage_groups(stages: int, replays: int, parallelism: int | None) -> list[Stages]:
    """How to split each replay's ``stages`` into units for ``parallelism`` processes.

    Every count of units from 1 to ``stages`` is weighed by the time it would take: rounds of
    units (``ceil(replays x units / parallelism)``), each as long as its largest unit (its
    stages, plus the work a unit shares among them). The soonest wins, fewer units on ties.
    Unknown parallelism: one unit per stage, the most there can be.

    Returns:
        The units of one replay, each a run of consecutive stages, together every stage once.

    Raises:
        ConfigError: ``stages`` is not an integer >= 1, ``replays`` not an integer >= 0, or
            ``parallelism`` not None or an integer >= 1.
    """
    check_int("stages", stages, low=1)
    check_int("replays", replays, low=0)
    if parallelism is not None:
        check_int("parallelism", parallelism, low=1)
    if parallelism is None:
        return [(stage,) for stage in range(stages)]

    def estimate(units: int) -> float:
        rounds = -(-replays * units // parallelism)
        return rounds * (-(-stages // units) + _SHARED_WORK)

    units = min(range(1, stages + 1), key=estimate)
    return [tuple(int(s) for s in part) for part in np.array_split(np.arange(stages), units)]


def _pool_workers(executor: concurrent.futures.Executor) -> int | None:
    """The processes or threads of a standard library pool; None for other executors."""
    if isinstance(
        executor, concurrent.futures.ProcessPoolExecutor | concurrent.futures.ThreadPoolExecutor
    ):
        # Private, but set by both pools' constructors since Python 3.2.
        workers = getattr(executor, "_max_workers", None)
        return workers if isinstance(workers, int) else None
    return None


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
        max_workers=workers,
        mp_context=multiprocessing.get_context("spawn"),
        initializer=_exit_with_parent,
    )
    try:
        yield pool
    except BaseException:
        # Interrupted (Ctrl-C, SIGTERM turned into an exception) or failed: the units running
        # now are not waited for, which could take minutes.
        _stop_workers(pool)
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _stop_workers(pool: concurrent.futures.ProcessPoolExecutor) -> None:
    """Terminate ``pool``'s worker processes, whatever they are running."""
    # Private, but the pool's own record of its processes since Python 3.2. (Python 3.14's
    # terminate_workers() would also shut the pool down without waiting for them.)
    processes: dict[int, multiprocessing.process.BaseProcess] = (
        getattr(pool, "_processes", None) or {}
    )
    for process in list(processes.values()):
        with contextlib.suppress(OSError, ValueError):  # (already gone, or closed)
            process.terminate()


def _exit_with_parent() -> None:
    """Run in each worker of a pool as it starts: end the worker when the process that made
    the pool is gone, as it is after a SIGKILL (which no handler sees). A worker in the middle
    of a unit would otherwise run it to the end and then block forever writing a result no one
    reads, as an orphan."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        parent.join()  # returns when the parent's sentinel closes: when the parent has exited
        os._exit(1)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()
