"""Ray placement, the driver's side: one Ray actor process per stage, chained by object refs.

A prefill submits one call per stage at once: stage ``i`` gets stage ``i - 1``'s output frame as
an object ref, which Ray resolves in stage ``i``'s process from stage ``i - 1``'s (the frame goes
stage to stage, never through the driver). The driver awaits each stage's report and the last
stage's frame, without ever blocking its trio run: a ref's future wakes the run through its
:class:`trio.lowlevel.TrioToken`.

Failure and cancellation, per request (the local contract of :mod:`stage_runtime.stage`, plus):

- **A cancelled prefill** cancels its calls (``ray.cancel``); a stage working on it abandons it
  exactly as a local stage does, so every stage's cache stays consistent.
- **A stage process that dies** (SIGKILL, an out-of-memory kill, a lost node) fails every prefill
  in flight on it with :class:`~stage_runtime.errors.StageFailedError` naming the stage, as soon
  as Ray reports the death or the health check sees it, including prefills still in the stages
  before it (their remote work is cancelled). Under
  ``RayPlacement.restart`` the stage is then recreated, with an empty cache (logged as
  ``stage_restarted``, counted in :attr:`StageStats.restarts
  <stage_runtime.stage.StageStats.restarts>`); new prefills wait for it. Without a policy, or
  past its limit, the pipeline stops: the ``async with`` raises the ``StageFailedError`` in an
  exception group, as a local stage crash does.
- **Leaving the block** otherwise (an exception, ^C) fails the prefills still in flight with
  :class:`~stage_runtime.errors.PipelineStoppedError` before the stage processes are killed.
"""

from __future__ import annotations

import functools
import itertools
import math
import os
import socket
from collections import deque
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager, suppress
from typing import Any, Final

import attrs
import ray
import structlog
import trio
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from stage_runtime.cache import EvictedEntry
from stage_runtime.config import StageConfig
from stage_runtime.errors import ConfigError, PipelineStoppedError, StageFailedError
from stage_runtime.models import ModelFactory
from stage_runtime.placement import RayPlacement, StageProcess
from stage_runtime.placement.ray_session import ray_session
from stage_runtime.placement.ray_worker import StageWorker
from stage_runtime.placement.worker_logging import driver_log_level, stderr_json_logging
from stage_runtime.stage import PrefillRequest, StageStats

__all__ = ["RayStages", "open_ray_stages"]

log = structlog.get_logger(__name__)

START_TIMEOUT_S: Final = 120.0
"""How long a stage process may take to be placed and start (Ray may wait for resources)."""

EXIT_TIMEOUT_S: Final = 10.0
"""How long closing waits for a killed stage process on this host to exit."""

CLOSE_TIMEOUT_S: Final = 30.0
"""How long closing waits for a stage process to drain (its queue is empty by then: the
pipeline waited for every prefill) before it is killed anyway."""

FREE_WAIT_S: Final = 2.0
"""How long opening waits for CPUs that the cluster has but does not count free (yet)."""

PING_TIMEOUT_S: Final = 10.0
"""A health check that gets no answer in this long is not a death; only Ray's word is."""

_SLIVER: Final = 0.01
"""The CPUs a placement-group bundle holds for a stage that reserves nothing (a bundle must
hold some resource); the stage's actor itself still asks for none."""

_Worker: Any = ray.remote(StageWorker)

_BY_VALUE_BYTES: Final = 96 * 1024
"""Prompts of at most this many bytes (24,576 tokens) travel inside each stage's call: below
Ray's own bound for an argument sent by value (``max_direct_call_object_size``, 100 KiB), which
it applies to the serialized argument, header included."""


async def await_ref(ref: Any) -> Any:
    """The value of a Ray object ref, awaited from trio without blocking the run.

    Raises:
        Whatever ``ray.get`` would (``RayTaskError``, ``RayActorError``, ...).
    """
    future = ref.future()
    token = trio.lowlevel.current_trio_token()
    ready = trio.Event()

    def wake(_: object) -> None:
        with suppress(trio.RunFinishedError):
            token.run_sync_soon(ready.set)

    future.add_done_callback(wake)
    await ready.wait()
    return future.result()


async def _settled(ref: Any) -> Any:
    """The value of a Ray object ref that is most likely ready: read at once (``ray.get`` with
    no wait does not block the trio run), else awaited (:func:`await_ref`). Reading a ready
    ref saves the round trip through its future, about a quarter of a millisecond."""
    try:
        return ray.get(ref, timeout=0)
    except GetTimeoutError:
        return await await_ref(ref)


@attrs.define(eq=False)
class _StageProcess:
    """One stage's current actor, and what the driver knows of it."""

    index: int
    config: StageConfig
    actor: Any = None
    pid: int = 0
    host: str = ""
    node_id: str = ""
    generation: int = 0
    """Bumped when the actor is declared dead: calls made before see a stale generation."""
    restarts: int = 0
    crashes: deque[float] = attrs.field(factory=deque)
    available: trio.Event = attrs.field(factory=trio.Event)
    """Set while the actor is usable; cleared while it is being recreated."""


@attrs.define(eq=False)
class _Flight:
    """One prefill in flight: its calls, and why it failed when a stage it is on died or the
    pipeline stopped (its wait is cancelled then)."""

    request_id: str
    calls: list[tuple[_StageProcess, int, Any]]
    scope: trio.CancelScope = attrs.field(factory=trio.CancelScope)
    error: Exception | None = None


@attrs.define(eq=False)
class RayStages:
    """The running stage processes of a Ray-placed pipeline (see :func:`open_ray_stages`)."""

    _configs: tuple[StageConfig, ...] = attrs.field(alias="configs")
    _factory: ModelFactory = attrs.field(alias="factory")
    _placement: RayPlacement = attrs.field(alias="placement")
    _mailbox_size: int = attrs.field(alias="mailbox_size")
    _environ: Mapping[str, str] = attrs.field(alias="environ")
    _group: PlacementGroup | None = attrs.field(alias="group")
    _cpu_share: float = attrs.field(alias="cpu_share")
    """CPUs a stage reserves when the placement does not say."""
    _nursery: trio.Nursery = attrs.field(alias="nursery")
    _processes: list[_StageProcess] = attrs.field(init=False)
    _limiter: trio.CapacityLimiter = attrs.field(init=False)
    _keys: itertools.count[int] = attrs.field(factory=itertools.count, init=False)
    _fatal: StageFailedError | None = attrs.field(default=None, init=False)
    _fatal_event: trio.Event = attrs.field(factory=trio.Event, init=False)
    _closing: bool = attrs.field(default=False, init=False)
    _final: tuple[StageStats, ...] | None = attrs.field(default=None, init=False)
    _flights: set[_Flight] = attrs.field(factory=set, init=False)
    _log_setup: Any = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self._processes = [
            _StageProcess(index=index, config=config) for index, config in enumerate(self._configs)
        ]
        self._limiter = trio.CapacityLimiter(self._placement.max_in_flight)
        self._log_setup = self._placement.log_setup or functools.partial(
            stderr_json_logging, driver_log_level()
        )

    # -- starting and stopping processes -------------------------------------------------------

    async def _start(self, process: _StageProcess) -> None:
        """Create ``process``'s actor and wait until its stage runs."""
        config = self._configs[process.index]
        placement = self._placement
        options: dict[str, Any] = {
            "num_gpus": placement.stage_gpus(config.stage_id),
            "resources": placement.stage_resources(config.stage_id),
            # Calls queue in the stage's own inbox; the driver bounds them (max_in_flight).
            "max_concurrency": 4 * placement.max_in_flight + 16,
        }
        options["num_cpus"] = placement.stage_cpus(config.stage_id, self._cpu_share)
        if self._group is not None:
            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                placement_group=self._group, placement_group_bundle_index=process.index
            )
        actor = _Worker.options(**options).remote(
            config, self._factory, self._environ, self._mailbox_size, self._log_setup
        )
        process.actor = actor
        try:
            with trio.fail_after(START_TIMEOUT_S):
                ready = await await_ref(actor.ready.remote())
                process.pid, process.host, process.node_id = ready
        except trio.TooSlowError:
            msg = (
                f"stage {config.stage_id!r} failed: Ray could not place and start its process "
                f"within {START_TIMEOUT_S:g} s (are the resources it asks for available? "
                f"cpus={options['num_cpus']}, gpus={options['num_gpus']}, "
                f"resources={options['resources']})"
            )
            raise StageFailedError(msg, stage_id=config.stage_id) from None
        except (RayTaskError, RayActorError) as exc:
            error = _stage_error(config.stage_id, exc)
            if isinstance(exc, RayActorError):  # died starting: say why, not just that it did
                lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
                fallback = lines[-1] if lines else type(exc).__name__
                reason = next((ln for ln in reversed(lines) if "Error" in ln), fallback)
                error = StageFailedError(
                    f"stage {config.stage_id!r} failed to start: {reason}", stage_id=config.stage_id
                )
            raise error from _cause(exc)
        process.available.set()
        log.info(
            "stage_process_started",
            stage=config.stage_id,
            pid=process.pid,
            host=process.host,
            node_id=process.node_id,
            restarts=process.restarts,
        )

    async def start_all(self) -> None:
        """Start every stage's process, concurrently (each may wait for Ray to place it)."""
        async with trio.open_nursery() as nursery:
            for process in self._processes:
                nursery.start_soon(self._start, process)

    async def kill_all(self) -> None:
        """Kill every stage process and wait (briefly) for those on this host to exit."""
        here = socket.gethostname()
        for process in self._processes:
            if process.actor is not None:
                try:
                    ray.kill(process.actor, no_restart=True)
                except Exception as exc:
                    log.debug(
                        "stage_process_kill_failed", stage=process.config.stage_id, error=str(exc)
                    )
        with trio.move_on_after(EXIT_TIMEOUT_S):
            for process in self._processes:
                if process.pid and process.host == here:
                    # No event tells a process on another's pid has exited: poll it.
                    while _alive(process.pid):  # noqa: ASYNC110
                        await trio.sleep(0.02)
        for process in self._processes:
            if process.actor is not None:
                log.info("stage_process_stopped", stage=process.config.stage_id, pid=process.pid)
                process.actor = None

    def _declare_dead(self, process: _StageProcess, generation: int, exc: BaseException) -> None:
        """Handle the death of ``process`` seen by a call of ``generation`` (once per death):
        recreate it under the restart policy, else stop the pipeline."""
        if process.generation != generation or self._closing or self._fatal is not None:
            return
        process.generation += 1
        process.available = trio.Event()
        stage_id = process.config.stage_id
        log.warning("stage_process_died", stage=stage_id, pid=process.pid, error=str(exc))
        # Every prefill with a call on the dead process fails now, naming it, instead of when
        # Ray gets to its call (only once the stages before it finish their part).
        for flight in self._flights:
            if flight.error is None and any(
                p is process and g == generation for p, g, _ in flight.calls
            ):
                flight.error = _stage_error(stage_id, exc)
                flight.error.__cause__ = exc
                flight.scope.cancel()
        policy = self._placement.restart
        now = trio.current_time()
        if policy is not None:
            while process.crashes and now - process.crashes[0] > policy.within_s:
                process.crashes.popleft()
            if len(process.crashes) < policy.max_restarts:
                process.crashes.append(now)
                self._nursery.start_soon(self._restart, process, exc)
                return
            log.error("stage_restart_limit_reached", stage=stage_id, restarts=process.restarts)
        error = _stage_error(stage_id, exc)
        error.__cause__ = _cause(exc)
        self._stop(error)

    def _stop(self, error: StageFailedError) -> None:
        """Stop the pipeline for ``error``: the supervisor raises it, and callers waiting for
        a stage to come back wake up to find the pipeline stopped."""
        self._fatal = error
        self._fatal_event.set()
        for process in self._processes:
            process.available.set()

    async def _restart(self, process: _StageProcess, exc: BaseException) -> None:
        old = process.actor
        with suppress(Exception):
            ray.kill(old, no_restart=True)
        policy = self._placement.restart
        assert policy is not None
        if policy.backoff_s:
            await trio.sleep(policy.backoff_s)
        process.restarts += 1
        try:
            await self._start(process)
        except StageFailedError as error:
            self._stop(error)
            return
        log.warning(
            "stage_restarted",
            stage=process.config.stage_id,
            restarts=process.restarts,
            cache_lost=True,
            cause=str(exc),
        )

    async def supervise(self) -> None:
        """Raise the pipeline's fatal stage failure into its nursery when one happens; in the
        meantime, check idle stage processes are alive every ``health_check_s``."""
        while not self._fatal_event.is_set():
            with trio.move_on_after(self._placement.health_check_s):
                await self._fatal_event.wait()
            if self._fatal_event.is_set() or self._closing:
                break
            for process in self._processes:
                if not process.available.is_set():
                    continue
                generation = process.generation
                try:
                    with trio.move_on_after(PING_TIMEOUT_S):
                        await await_ref(process.actor.ping.remote())
                except RayActorError as exc:
                    self._declare_dead(process, generation, exc)
        if self._fatal is not None:
            raise self._fatal

    # -- the pipeline's calls ------------------------------------------------------------------

    def _check_running(self) -> None:
        if self._fatal is not None:
            msg = f"pipeline stopped ({self._fatal})"
            raise PipelineStoppedError(msg)

    async def submit(self, request: PrefillRequest) -> None:
        """Run ``request`` through every stage process (at most ``max_in_flight`` at once)."""
        async with self._limiter:
            self._check_running()
            for process in self._processes:
                await process.available.wait()
            self._check_running()  # (a stage that could not come back stopped the pipeline)
            if self._closing:
                msg = f"pipeline stopped before request {request.request_id!r} finished"
                raise PipelineStoppedError(msg)
            await self._run(request)

    async def _run(self, request: PrefillRequest) -> None:
        key = next(self._keys)
        # Ray sends an argument of under 100 KiB inside the call itself, and fetches a ref from
        # the object store before the call runs (about half a millisecond per stage here): a
        # prompt that small goes by value to each stage, a larger one once into the store.
        tokens: Any = request.tokens
        if tokens.nbytes > _BY_VALUE_BYTES:
            tokens = ray.put(tokens)
        frame = None
        calls: list[tuple[_StageProcess, int, Any]] = []
        refs: list[Any] = []
        for process in self._processes:
            frame, report = process.actor.prefill.options(num_returns=2).remote(
                key, request.request_id, request.session_id, request.cache_salt, tokens, frame
            )
            calls.append((process, process.generation, report))
            refs += (frame, report)
        flight = _Flight(request_id=request.request_id, calls=calls)
        self._flights.add(flight)
        succeeded = False
        try:
            with flight.scope:  # cancelled when a stage it is on dies, or the pipeline stops
                error = await self._outcome(request, calls, frame)
            if flight.error is not None:
                request.fail(flight.error)
            elif error is not None:
                request.fail(error)
            else:
                request.succeed()
                succeeded = True
        finally:
            self._flights.discard(flight)
            if not succeeded:
                # Cancelled or failed: stop every stage's work on it (a stage upstream of a
                # dead one would otherwise finish it for nothing).
                for _process, _generation, report in calls:
                    try:
                        ray.cancel(report)
                    except Exception as exc:
                        log.debug("prefill_cancel_failed", error=str(exc))
                _read_errors(refs)

    async def _outcome(
        self, request: PrefillRequest, calls: list[tuple[_StageProcess, int, Any]], frame: Any
    ) -> Exception | None:
        """Wait for ``request``'s calls: fill in its reports, logits and frame, or return the
        error to fail it with."""
        # The last stage's report comes once every stage has answered (each waits for the frame
        # its predecessor returned with its report) or one has failed: awaited alone, then each
        # report is read in order, so that the first failure names its stage.
        failed = False
        try:
            await await_ref(calls[-1][2])
        except (RayActorError, RayTaskError):
            failed = True
        for process, generation, report in calls:
            try:
                if failed:
                    # A report not ready yet is of a stage still working, upstream of the
                    # failure: not its cause (its work is cancelled once this fails).
                    outcome, logits = ray.get(report, timeout=0)
                else:
                    outcome, logits = await _settled(report)
                request.reports.append(outcome)
                if logits is not None:
                    request.logits = logits
            except GetTimeoutError:
                continue
            except RayActorError as exc:
                self._declare_dead(process, generation, exc)
                error = _stage_error(process.config.stage_id, exc)
                error.__cause__ = exc
                return error
            except RayTaskError as exc:
                cause = _cause(exc)
                if isinstance(cause, StageFailedError):  # the stage crashed inside
                    self._declare_dead(process, generation, exc)
                return cause if isinstance(cause, Exception) else exc
        try:
            request.frame = await _settled(frame)
        except (RayActorError, RayTaskError) as exc:
            error = _stage_error(calls[-1][0].config.stage_id, exc)
            error.__cause__ = exc
            return error
        return None

    def abort_flights(self) -> None:
        """Fail every prefill in flight with :class:`PipelineStoppedError` (the pipeline is
        stopping: its stage processes are about to be killed), as a local pipeline does."""
        for flight in self._flights:
            if flight.error is None:
                msg = f"pipeline stopped before request {flight.request_id!r} finished"
                flight.error = PipelineStoppedError(msg)
                flight.scope.cancel()

    def _check_open(self, what: str) -> None:
        """Raise :class:`PipelineStoppedError` when the stage processes are gone (the pipeline
        closed or stopped): ``what`` could not be done."""
        if self._fatal is not None:
            msg = f"pipeline has stopped ({self._fatal}): {what}"
            raise PipelineStoppedError(msg)
        if self._closing or any(process.actor is None for process in self._processes):
            msg = f"pipeline has stopped: {what}"
            raise PipelineStoppedError(msg)

    async def _ask(self, process: _StageProcess, method: str) -> Any:
        """Call ``method`` of ``process``'s stage, waiting for the stage to come back when it is
        being recreated (as a prefill does; bounded by the restart's start timeout).

        Raises:
            PipelineStoppedError: the pipeline stopped, or stops while waiting.
        """
        stage_id = process.config.stage_id
        while True:
            await process.available.wait()
            self._check_open(f"stage {stage_id!r} is gone")
            generation = process.generation
            try:
                return await await_ref(getattr(process.actor, method).remote())
            except RayActorError as exc:
                self._declare_dead(process, generation, exc)
            except RayTaskError as exc:
                if not isinstance(_cause(exc), StageFailedError):
                    msg = f"stage {stage_id!r} is unavailable: {exc}"
                    raise PipelineStoppedError(msg) from None
                self._declare_dead(process, generation, exc)  # the stage crashed inside
            if process.generation == generation:  # (a death seen while closing)
                self._check_open(f"stage {stage_id!r} is gone")
                msg = f"stage {stage_id!r} is unavailable"
                raise PipelineStoppedError(msg)

    async def stage_statistics(self) -> tuple[StageStats, ...]:
        """Each stage's statistics, asked of its process (the final ones once closed); a stage
        being recreated is waited for.

        Raises:
            PipelineStoppedError: the pipeline stopped without final statistics.
        """
        if self._final is not None:
            return self._final
        self._check_open("no final statistics")
        stats = []
        for process in self._processes:
            stage: StageStats = await self._ask(process, "statistics")
            stats.append(attrs.evolve(stage, restarts=process.restarts))
        return tuple(stats)

    async def clear_caches(self) -> tuple[tuple[EvictedEntry, ...], ...]:
        """Empty every stage's cache; per stage, the entries evicted. Waits for stages being
        recreated before clearing any, so that a stopped pipeline clears none; a stage that
        dies meanwhile comes back empty (its entries are lost, not evicted).

        Raises:
            PipelineStoppedError: the pipeline has closed or stopped (no cache to clear).
        """
        self._check_open("no cache to clear")
        for process in self._processes:
            await process.available.wait()
        self._check_open("no cache to clear")
        evicted: list[tuple[EvictedEntry, ...]] = []
        for process in self._processes:
            evicted.append(await self._ask(process, "clear_cache"))
        return tuple(evicted)

    async def close(self) -> None:
        """Drain every stage process in pipeline order and keep their final statistics."""
        self._check_running()
        self._closing = True
        final = []
        for process in self._processes:
            stage_id = process.config.stage_id
            try:
                with trio.fail_after(CLOSE_TIMEOUT_S):
                    stage: StageStats = await await_ref(process.actor.close.remote())
            except trio.TooSlowError:
                msg = f"stage {stage_id!r} failed: it did not stop within {CLOSE_TIMEOUT_S:g} s"
                raise StageFailedError(msg, stage_id=stage_id) from None
            except (RayActorError, RayTaskError) as exc:
                raise _stage_error(stage_id, exc) from _cause(exc)
            final.append(attrs.evolve(stage, restarts=process.restarts))
        self._final = tuple(final)

    def processes(self) -> tuple[StageProcess, ...]:
        """Where each stage's current process runs, in pipeline order."""
        return tuple(
            StageProcess(stage_id=p.config.stage_id, pid=p.pid, host=p.host, node_id=p.node_id)
            for p in self._processes
        )


def _cause(exc: BaseException) -> BaseException:
    """The exception a Ray error carries from the remote side (itself when none)."""
    cause = getattr(exc, "cause", None)
    return cause if isinstance(cause, BaseException) else exc


def _stage_error(stage_id: str, exc: BaseException) -> StageFailedError:
    if isinstance(exc, RayActorError):
        what = f"its process died ({type(exc).__name__})"
    else:
        what = repr(_cause(exc))
    return StageFailedError(f"stage {stage_id!r} failed: {what}", stage_id=stage_id)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _read_errors(refs: list[Any]) -> None:
    """Read each of a failed request's results that is in (none is waited for). Ray writes an
    error that nobody read to the driver's stderr, with its traceback ("Unhandled error"), when
    its ref goes: the frames of a stage that raised and of those after it. The caller has the
    error already, and the program's logging says what else to show."""
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
    for ref in ready:
        with suppress(Exception):
            ray.get(ref, timeout=0)


def _cluster_cpus() -> tuple[float, float]:
    """Logical CPUs of the Ray cluster this process is connected to: free now, and in all."""
    total = ray.cluster_resources()  # type: ignore[no-untyped-call]
    free = ray.available_resources()  # type: ignore[no-untyped-call]
    return float(free.get("CPU", 0.0)), float(total.get("CPU", 0.0))


def _check_feasible(configs: Sequence[StageConfig], placement: RayPlacement) -> None:
    """Refuse a stage whose GPUs and custom resources no live node of the cluster has in all:
    Ray would wait for such a node for ever (the stage's start for :data:`START_TIMEOUT_S`),
    saying nothing. (CPUs are checked against what is free by :func:`_reserve`.) Like that
    check, it takes the cluster's nodes as they are now: a cluster that adds nodes on demand
    must have one with the resource before the pipeline opens.

    Raises:
        ConfigError: naming the stage, what it asks for and what the nodes have.
    """
    nodes = [
        {name: float(amount) for name, amount in node.get("Resources", {}).items()}
        for node in ray.nodes()  # type: ignore[no-untyped-call]
        if node.get("Alive")
    ]
    for config in configs:
        wants = {"GPU": placement.stage_gpus(config.stage_id)}
        wants.update(placement.stage_resources(config.stage_id))
        wants = {name: amount for name, amount in wants.items() if amount}
        if not wants or any(
            all(node.get(name, 0.0) >= amount - 1e-9 for name, amount in wants.items())
            for node in nodes
        ):
            continue
        asked = ", ".join(f"{name}={amount:g}" for name, amount in sorted(wants.items()))
        has = "; ".join(
            ", ".join(f"{name}={node.get(name, 0.0):g}" for name in sorted(wants)) for node in nodes
        )
        msg = (
            f"stage {config.stage_id!r} asks for {asked} (RayPlacement.resources), which no "
            f"node of the Ray cluster has (its {len(nodes)} node(s): {has or 'none'}): Ray "
            "would wait for such a node for ever; start one first (a cluster that adds nodes "
            "on demand too), or ask for less"
        )
        raise ConfigError(msg)


def _cpu_share(stages: int, free: float) -> float:
    """An equal share of ``free`` CPUs per stage, at most one (two decimals, rounded down, so
    that the shares always fit)."""
    return max(min(1.0, math.floor(100 * free / stages) / 100), 0.01)


async def _reserve(
    configs: Sequence[StageConfig], placement: RayPlacement
) -> tuple[float, list[dict[str, float]]]:
    """The CPUs a stage reserves when the placement does not say, and each stage's bundle.

    The default share divides the CPUs free now, not the cluster's: another pipeline (or any
    Ray work) on the same instance holds its own, which the stages would wait for in vain.
    CPUs released a moment ago may take Ray a moment to count free: a reservation that fits
    the cluster but not what it has free is retried for up to :data:`FREE_WAIT_S`.

    Raises:
        ConfigError: the stages reserve more CPUs than the cluster has free.
    """
    _check_feasible(configs, placement)
    deadline = trio.current_time() + FREE_WAIT_S
    while True:
        free, total = _cluster_cpus()
        share = _cpu_share(len(configs), free)
        # A placement group's bundle must hold some resource: a stage that reserves nothing
        # gets a sliver of a CPU in its bundle (counted below).
        bundles = [
            {
                "CPU": placement.stage_cpus(c.stage_id, share),
                "GPU": placement.stage_gpus(c.stage_id),
                **placement.stage_resources(c.stage_id),
            }
            for c in configs
        ]
        bundles = [{k: v for k, v in b.items() if v} or {"CPU": _SLIVER} for b in bundles]
        wanted = (
            sum(b.get("CPU", 0.0) for b in bundles)
            if placement.strategy is not None
            else sum(placement.stage_cpus(c.stage_id, share) for c in configs)
        )
        if wanted <= free + 1e-9:
            return share, bundles
        if wanted > total + 1e-9 or trio.current_time() >= deadline:
            break
        await trio.sleep(0.1)
    taken = f" ({total - free:g} of its {total:g} are taken)" if free < total else ""
    msg = (
        f"the stages reserve {wanted:g} CPUs (RayPlacement.num_cpus and resources) but the Ray "
        f"cluster has {free:g} free{taken}: reserve fractions of a CPU per stage, close what "
        "holds them, or add nodes"
    )
    raise ConfigError(msg)


def _check_picklable(name: str, value: object) -> None:
    try:
        ray.cloudpickle.dumps(value)  # type: ignore[no-untyped-call]
    except Exception as exc:
        msg = f"{name} must be picklable to reach the stage processes, got {value!r}: {exc}"
        raise ConfigError(msg) from exc


@asynccontextmanager
async def open_ray_stages(
    configs: Sequence[StageConfig],
    model_factory: ModelFactory,
    placement: RayPlacement,
    *,
    mailbox_size: int,
    environ: Mapping[str, str],
) -> AsyncIterator[RayStages]:
    """Start one Ray actor process per stage (joining or starting Ray), and stop them all on exit.

    Raises:
        ConfigError: Ray could not start or join its cluster, or the model factory or log
            set-up cannot be pickled.
        StageFailedError: a stage could not start (in an exception group), or died with no
            restart left.
    """
    _check_picklable("model_factory", model_factory)
    unknown = sorted(set(placement.resources) - {c.stage_id for c in configs})
    if unknown:
        names = ", ".join(c.stage_id for c in configs)
        msg = (
            f"RayPlacement.resources names {', '.join(map(repr, unknown))}, not a stage of this "
            f"pipeline (its stages: {names})"
        )
        raise ConfigError(msg)
    if placement.log_setup is not None:
        _check_picklable("log_setup", placement.log_setup)
    session = ray_session(placement)
    # ray.init blocks for seconds (it may start a whole local instance): off the event loop.
    await trio.to_thread.run_sync(session.__enter__)
    group: PlacementGroup | None = None
    try:
        share, bundles = await _reserve(configs, placement)
        if placement.strategy is not None:
            group = placement_group(bundles, strategy=placement.strategy)
            with trio.move_on_after(START_TIMEOUT_S) as waited:
                await await_ref(group.ready())
            if waited.cancelled_caught:
                msg = (
                    f"placement group ({placement.strategy}, bundles {bundles}) could not be "
                    f"placed within {START_TIMEOUT_S:g} s: the cluster lacks the nodes or "
                    "resources it asks for"
                )
                raise ConfigError(msg)
        async with trio.open_nursery() as nursery:
            stages = RayStages(
                configs=tuple(configs),
                factory=model_factory,
                placement=placement,
                mailbox_size=mailbox_size,
                environ=dict(environ),
                group=group,
                cpu_share=share,
                nursery=nursery,
            )
            try:
                await stages.start_all()
                nursery.start_soon(stages.supervise)
                yield stages
            finally:
                stages._closing = True
                stages.abort_flights()
                with trio.CancelScope(shield=True):
                    await stages.kill_all()
                nursery.cancel_scope.cancel()
    finally:
        with trio.CancelScope(shield=True):
            if group is not None:
                try:
                    remove_placement_group(group)
                except Exception as exc:
                    log.debug("placement_group_remove_failed", error=str(exc))
            await trio.to_thread.run_sync(session.__exit__, None, None, None)
