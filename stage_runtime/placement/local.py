"""Local placement: every stage a task of the trio run that opened the pipeline.

The stages are wired by bounded trio memory channels: a request flows stage to stage, so
concurrent prefills overlap across stages (stage 0 works on request ``i + 1`` while stage 1 works
on request ``i``) and a slow stage pushes back on the callers.
"""

from __future__ import annotations

import os
import socket
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager

import attrs
import trio

from stage_runtime.cache import EvictedEntry
from stage_runtime.config import StageConfig
from stage_runtime.errors import PipelineStoppedError
from stage_runtime.models import ModelFactory
from stage_runtime.placement import StageProcess
from stage_runtime.stage import PrefillRequest, Stage, StageStats

__all__ = ["LocalStages", "open_local_stages"]


@attrs.define(eq=False)
class LocalStages:
    """The running stages of a locally placed pipeline (see :func:`open_local_stages`)."""

    _stages: tuple[Stage, ...] = attrs.field(alias="stages")
    _entry: trio.MemorySendChannel[PrefillRequest] = attrs.field(alias="entry")

    async def submit(self, request: PrefillRequest) -> None:
        """Send ``request`` into stage 0 and wait until a stage settles it.

        Raises:
            PipelineStoppedError: stage 0's inbox is closed or broken (the stages are gone).
        """
        try:
            # send() would yield after a direct send, and the caller's task would take a turn
            # only to start waiting: a task step more per prefill. A cancelled caller still
            # sends nothing, and waiting for the request is the schedule point.
            await trio.lowlevel.checkpoint_if_cancelled()
            try:
                self._entry.send_nowait(request)
            except trio.WouldBlock:
                await self._entry.send(request)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            msg = f"pipeline stopped before request {request.request_id!r} finished"
            raise PipelineStoppedError(msg) from None
        await request.done.wait()

    async def stage_statistics(self) -> tuple[StageStats, ...]:
        """Each stage's statistics, in pipeline order (raises ``ActorStoppedError`` when a
        stage's cache actor is gone without final statistics)."""
        return tuple([await stage.statistics() for stage in self._stages])

    async def clear_caches(self) -> tuple[tuple[EvictedEntry, ...], ...]:
        """Empty every stage's cache; per stage, the entries evicted."""
        return tuple([await stage.clear_cache() for stage in self._stages])

    async def close(self) -> None:
        """Close stage 0's inbox: each stage finishes its queue, closes the next one's inbox,
        drains and stops its cache actor, and exits (the nursery of
        :func:`open_local_stages` then waits for them)."""
        await self._entry.aclose()

    def processes(self) -> tuple[StageProcess, ...]:
        """Every stage runs in this process."""
        pid, host = os.getpid(), socket.gethostname()
        return tuple(
            StageProcess(stage_id=stage.config.stage_id, pid=pid, host=host)
            for stage in self._stages
        )


@asynccontextmanager
async def open_local_stages(
    configs: Sequence[StageConfig],
    model_factory: ModelFactory,
    *,
    channel_size: int,
    mailbox_size: int,
    environ: Mapping[str, str] | None,
) -> AsyncIterator[LocalStages]:
    """Start one task per stage in a nursery of the current trio run.

    A stage crash raises :class:`~stage_runtime.errors.StageFailedError` (in an exception group)
    out of the block, after cancelling it.
    """
    channels = [trio.open_memory_channel[PrefillRequest](channel_size) for _ in configs]
    runners = tuple(
        Stage(
            config=config,
            model_factory=model_factory,
            inbox=channels[i][1],
            outbox=channels[i + 1][0] if i + 1 < len(configs) else None,
            environ=environ,
            mailbox_size=mailbox_size,
        )
        for i, config in enumerate(configs)
    )
    async with trio.open_nursery() as nursery:
        # Last stage first, so that every stage's downstream is running when it starts.
        for runner in reversed(runners):
            await nursery.start(runner.run)
        yield LocalStages(stages=runners, entry=channels[0][0])
