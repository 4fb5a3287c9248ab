"""The inside of a stage process placed by Ray: one :class:`Stage` in a trio run of its own.

:class:`StageWorker` is the body of a Ray actor (an async actor: its methods are coroutines on
Ray's asyncio loop). It runs the same :class:`~stage_runtime.stage.Stage` as local placement, with
its cache actor, in ``trio.run`` on a dedicated thread. The Ray methods are thin shims: each hands
its work into the trio run through the run's :class:`trio.lowlevel.TrioToken` and awaits a
:class:`concurrent.futures.Future` that the trio side settles. Nothing but the cache actor touches
the cache.

Why a thread and not trio's guest mode on Ray's loop: Ray's actor loop also dispatches the
actor's calls and answers Ray's own requests; a stage's model runs inline on the trio loop when
it is cheap, and in guest mode that would stall Ray's side too. On its own thread the trio run
is independent of Ray's loop (they share the GIL, which numpy releases for the heavy parts).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import math
import os
import socket
import threading
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import numpy.typing as npt
import ray
import structlog
import trio

from stage_runtime.cache import EvictedEntry
from stage_runtime.config import StageConfig
from stage_runtime.errors import StageFailedError
from stage_runtime.frames import ActivationFrame
from stage_runtime.models import ModelFactory
from stage_runtime.stage import PrefillRequest, Stage, StagePrefillReport, StageStats

__all__ = ["StageWorker"]

StageOutcome = tuple[StagePrefillReport, npt.NDArray[np.float32] | None]
"""A stage's report of one request, and the next-token logits when its model gives them."""

log = structlog.get_logger(__name__)


class StageWorker:
    """One stage and its cache actor in a trio run on a thread of this (Ray actor) process.

    Args:
        config: The stage's configuration.
        model_factory: Builds the stage's model (in this process).
        environ: The cache's environment, resolved by the driver.
        mailbox_size: The cache actor's mailbox size.
        log_setup: Configures logging in this process, before anything logs.
    """

    def __init__(
        self,
        config: StageConfig,
        model_factory: ModelFactory,
        environ: Mapping[str, str],
        mailbox_size: int,
        log_setup: Callable[[], None],
    ) -> None:
        log_setup()
        self._config = config
        self._token: trio.lowlevel.TrioToken | None = None
        self._inbox: trio.MemorySendChannel[PrefillRequest] | None = None
        self._nursery: trio.Nursery | None = None
        self._waiting: dict[
            int, tuple[PrefillRequest, trio.CancelScope, concurrent.futures.Future[Any]]
        ] = {}
        self._stopped: trio.Event | None = None
        self._final: StageStats | None = None
        self._crash: BaseException | None = None
        self._started = threading.Event()
        self._stage_args = (model_factory, environ, mailbox_size)
        self._stage: Stage | None = None
        self._thread = threading.Thread(
            target=self._main, name=f"trio-{config.stage_id}", daemon=True
        )
        self._thread.start()
        self._started.wait()

    # -- the trio side -------------------------------------------------------------------------

    def _main(self) -> None:
        try:
            trio.run(self._serve)
        except BaseException as exc:
            self._crash = exc
        finally:
            self._started.set()
            for _request, _scope, reply in self._waiting.values():
                if not reply.done():
                    reply.set_exception(self._failure())
            self._waiting.clear()

    async def _serve(self) -> None:
        self._token = trio.lowlevel.current_trio_token()
        self._stopped = trio.Event()
        # Unbounded: the driver bounds the prefills in flight; requests queue here in the order
        # their calls arrived (run_sync_soon callbacks run first in, first out).
        send, receive = trio.open_memory_channel[PrefillRequest](math.inf)
        self._inbox = send
        model_factory, environ, mailbox_size = self._stage_args
        self._stage = stage = Stage(
            config=self._config,
            model_factory=model_factory,
            inbox=receive,
            outbox=None,
            environ=environ,
            mailbox_size=mailbox_size,
            borrowed_inputs=True,
        )
        with structlog.contextvars.bound_contextvars(stage=self._config.stage_id):
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                await nursery.start(stage.run)
                log.info("stage_process_started", pid=os.getpid(), host=socket.gethostname())
                self._started.set()
                await self._stopped.wait()
                send.close()  # the stage finishes its queue, then stops its cache actor
            self._final = await stage.statistics()

    def _accept(
        self, key: int, request: PrefillRequest, reply: concurrent.futures.Future[Any]
    ) -> None:
        """In the trio run (FIFO with the other calls): queue ``request`` for the stage and
        start a task that settles ``reply`` when the stage settles the request."""
        assert self._inbox is not None
        assert self._nursery is not None
        scope = trio.CancelScope()
        self._waiting[key] = (request, scope, reply)
        self._inbox.send_nowait(request)
        self._nursery.start_soon(self._settle, key, request, scope, reply)

    async def _settle(
        self,
        key: int,
        request: PrefillRequest,
        scope: trio.CancelScope,
        reply: concurrent.futures.Future[Any],
    ) -> None:
        with scope:
            await request.done.wait()
        self._waiting.pop(key, None)
        if reply.done():
            return
        if request.error is not None:
            reply.set_exception(request.error)
        elif request.done.is_set():
            assert request.frame is not None
            reply.set_result((request.frame, (request.reports[-1], request.logits)))

    def _abandon(self, key: int) -> None:
        """In the trio run: the caller gave up on ``key``; the stage skips or interrupts it."""
        held = self._waiting.pop(key, None)
        if held is not None:
            request, scope, _reply = held
            request.abandon()
            scope.cancel()

    def _failure(self) -> StageFailedError:
        stage_id = self._config.stage_id
        crash = self._crash
        error = StageFailedError(f"stage {stage_id!r} failed: {crash!r}", stage_id=stage_id)
        error.__cause__ = crash
        return error

    async def _call(self, function: Callable[..., Any], *args: Any) -> Any:
        """Hand ``function(*args, reply)`` into the trio run and await its reply."""
        if self._crash is not None or self._token is None:
            raise self._failure()
        reply: concurrent.futures.Future[Any] = concurrent.futures.Future()
        try:
            self._token.run_sync_soon(functools.partial(function, *args, reply))
        except trio.RunFinishedError:
            raise self._failure() from None
        return await asyncio.wrap_future(reply)

    def _run_async(self, work: Callable[[], Any], reply: concurrent.futures.Future[Any]) -> None:
        """In the trio run: start ``await work()`` as a task that settles ``reply``."""
        assert self._nursery is not None

        async def settle() -> None:
            try:
                reply.set_result(await work())
            except Exception as exc:
                reply.set_exception(exc)

        self._nursery.start_soon(settle)

    # -- the Ray methods -----------------------------------------------------------------------

    async def ready(self) -> tuple[int, str, str]:
        """This process's pid, host and Ray node id, once the stage has started (raises its
        start error)."""
        if self._crash is not None:
            raise self._failure()
        return os.getpid(), socket.gethostname(), ray.get_runtime_context().get_node_id()

    async def ping(self) -> bool:
        """Whether the stage's trio run is alive (a health check)."""
        return self._crash is None and self._thread.is_alive()

    async def prefill(
        self,
        key: int,
        request_id: str,
        session_id: str,
        cache_salt: str | None,
        tokens: npt.NDArray[np.int32],
        frame: ActivationFrame | None,
    ) -> tuple[ActivationFrame, StageOutcome]:
        """Run one request through this stage: returns its output frame, and its report with
        the next-token logits when this stage's model gives them (a last Llama stage).

        ``frame`` is the previous stage's output (None at stage 0), received read-only; Ray
        resolves it from the previous stage's process without passing through the driver.
        """
        array = np.asarray(tokens, dtype=np.int32)
        if array.flags.writeable:
            array = array.copy()
            array.flags.writeable = False
        request = PrefillRequest(
            request_id=request_id,
            session_id=session_id,
            tokens=array,
            cache_salt=cache_salt,
            frame=frame,
        )
        try:
            result: tuple[ActivationFrame, StageOutcome] = await self._call(
                self._accept, key, request
            )
        except asyncio.CancelledError:
            # The driver cancelled (its caller gave up): the stage skips or interrupts it.
            if self._token is not None:
                with contextlib.suppress(trio.RunFinishedError):
                    self._token.run_sync_soon(self._abandon, key)
            raise
        return result

    async def statistics(self) -> StageStats:
        """The stage's cache and mailbox statistics (the final ones once it has stopped)."""
        if self._final is not None:
            return self._final
        assert self._stage is not None
        stats: StageStats = await self._call(self._run_async, self._stage.statistics)
        return stats

    async def clear_cache(self) -> tuple[EvictedEntry, ...]:
        """Evict every entry of the stage's cache; returns them."""
        assert self._stage is not None
        evicted: tuple[EvictedEntry, ...] = await self._call(
            self._run_async, self._stage.clear_cache
        )
        return evicted

    async def close(self) -> StageStats:
        """Drain the stage (it finishes what it holds), stop its cache actor and trio run;
        returns the final statistics."""
        if self._token is not None and self._stopped is not None and self._crash is None:
            with contextlib.suppress(trio.RunFinishedError):
                self._token.run_sync_soon(self._stopped.set)
        await asyncio.get_running_loop().run_in_executor(None, self._thread.join)
        if self._crash is not None:
            raise self._failure()
        assert self._final is not None
        return self._final
