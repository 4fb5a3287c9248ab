"""One pipeline stage: a trio task that owns its cache actor.

For each prefill request read from its inbox, a :class:`Stage`

1. asks its cache actor to restore the longest cached prefix of its output (``k`` tokens);
2. computes only tokens ``k..N-1`` with its :class:`~stage_runtime.models.StageModel`, continuing
   from the restored prefix (stage 0 first embeds the token ids);
3. asks its cache actor to record the full output frame (the ladder picks the lengths);
4. forwards the full frame (restored prefix + computed suffix) to the next stage, or, on the last
   stage, hands the result back to the caller.

The cache actor is spawned in the stage's own nursery: it lives and dies with the stage.

Failure and cancellation, per request:

- An exception from the model (``embed``/``forward``/``full_restore``) or a malformed model
  output (the wrong number of rows, or real rows not ``activation_width`` values wide) fails only
  that request: its caller's ``prefill`` raises it, nothing is recorded, and the stage moves on.
- A request whose caller gave up (cancelled its ``prefill``) is *abandoned*: stages skip it when
  it reaches them, and a stage computing it is interrupted (its compute runs in a cancel scope the
  caller cancels). A stage records only a frame it computed completely for a live request, and each
  record is one actor message applied atomically (every ladder rung or none). So a cancelled
  request leaves, at most, complete and correct records at the stages that finished it before the
  cancellation; nothing partial is ever visible.
- Anything else (a cache actor error, a bug) crashes the stage: it raises
  :class:`~stage_runtime.errors.StageFailedError` chained to the cause.
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Final, TypeVarTuple

import attrs
import numpy as np
import numpy.typing as npt
import outcome
import structlog
import trio

from actors import ActorRef, ActorStatistics, PendingReply, spawn
from actors.errors import being_cancelled, stray_cancelled_error
from stage_runtime._unchecked import unchecked_constructor
from stage_runtime._validators import check_non_negative_int
from stage_runtime.accounting import CacheAccounting
from stage_runtime.cache import EvictedEntry
from stage_runtime.cache_actor import (
    CacheActor,
    CacheMessage,
    CacheStats,
    CacheStatsRequest,
    ClearCache,
    RecordActivation,
    RestoreActivationPages,
    _StageRecord,
    _StageRestore,
)
from stage_runtime.config import SCHEMA_VERSION, MessageBase, StageConfig, check_name
from stage_runtime.errors import (
    ConfigError,
    FrameError,
    StageFailedError,
    shown,
    sole_exception,
)
from stage_runtime.frames import ActivationFrame
from stage_runtime.identity import _frozen
from stage_runtime.integration import ResidentActivationRecord
from stage_runtime.models import ModelFactory, StageModel

_Args = TypeVarTuple("_Args")

COPY_IN_THREAD_BYTES: Final = 16 << 20
"""Joining restored rows with computed ones copies them; from this many bytes on the copy runs
in a worker thread (a 12K-token prefix at width 4,096 is 192 MiB: hundreds of ms on the event
loop, which would stall every other task)."""


async def _copying(
    work: Callable[[*_Args], ActivationFrame], *args: *_Args, nbytes: int
) -> ActivationFrame:
    """``work(*args)``, which copies about ``nbytes``: inline when small, else in a worker
    thread. A cancelled stage waits for the copy (tens of ms) rather than abandoning it: a
    stage then never has more than one copy running, where abandoned ones would pile up,
    each holding its memory and a worker thread."""
    if nbytes < COPY_IN_THREAD_BYTES:
        return work(*args)
    return await trio.to_thread.run_sync(work, *args)


# Stage and PrefillRequest are the pipeline's internals (open_pipeline builds and feeds them);
# only the reports are public, re-exported from the package.
__all__ = [
    "StagePrefillReport",
    "StageStats",
]

log = structlog.get_logger(__name__)


@attrs.frozen(kw_only=True)
class StagePrefillReport:
    """What one stage did for one prefill."""

    stage_id: str
    """The stage's id."""

    stage_index: int
    """The stage's position in the pipeline."""

    restored_tokens: int
    """Tokens restored from the stage's cache (``k``; 0 on a miss)."""

    computed_tokens: int
    """Tokens the model computed: always ``N - restored_tokens``."""

    records: tuple[ResidentActivationRecord, ...]
    """The cache records made for this prefill's output (one per ladder rung)."""

    evicted: Sequence[EvictedEntry]
    """Entries those records evicted, in eviction order."""

    started_s: float = 0.0
    """``trio.current_time()`` when the stage took the request (virtual under a mock clock)."""

    finished_s: float = 0.0
    """``trio.current_time()`` when the stage had computed and recorded it."""


def _owned(output: ActivationFrame, borrowed: ActivationFrame) -> ActivationFrame:
    """``output``, or a copy of it when it shares memory with the ``borrowed`` input frame."""
    if output.is_virtual or not np.may_share_memory(output.payload, borrowed.payload):
        return output
    return ActivationFrame(desc=output.desc, payload=output.payload.copy())


def _checked_model(model: object, config: StageConfig) -> StageModel:
    """``model`` if it can serve as ``config``'s stage: with ``forward`` (and ``embed`` or
    ``embed_async`` on stage 0) and an ``activation_width`` that is an integer >= 0. Checked
    once, when the stage starts, rather than at its first prefill.

    Raises:
        ConfigError: what the model factory returned cannot serve, named.
    """
    where = f"the model factory's model for stage {config.stage_id!r}"
    missing = [] if callable(getattr(model, "forward", None)) else ["forward"]
    if config.stage_index == 0 and not any(
        callable(getattr(model, name, None)) for name in ("embed", "embed_async")
    ):
        missing.append("embed or embed_async")
    if missing:
        needed = "forward, and embed or embed_async" if config.stage_index == 0 else "forward"
        msg = (
            f"{where} must be a StageModel (with {needed}), got {shown(model)} "
            f"(no {', no '.join(missing)})"
        )
        raise ConfigError(msg)
    try:
        width = model.activation_width  # type: ignore[attr-defined]
    except AttributeError:
        msg = f"{where} must have an activation_width, got {shown(model)}"
        raise ConfigError(msg) from None
    try:
        check_non_negative_int("activation_width", width, numpy=True)
    except ConfigError as exc:
        msg = f"{where}: {exc}"
        raise ConfigError(msg) from None
    return model  # type: ignore[return-value]


def _stage_index(report: StagePrefillReport) -> int:
    return report.stage_index


def _evicted_by(records: Sequence[ResidentActivationRecord]) -> Sequence[EvictedEntry]:
    """The entries ``records`` evicted, in order (a single record's own sequence, as is)."""
    if not records:  # (a stage that records nothing: no generator to run)
        return ()
    if len(records) == 1:
        return records[0].evicted
    return tuple(e for r in records for e in r.evicted)


@attrs.frozen(kw_only=True)
class StageStats:
    """A stage's cache and mailbox statistics."""

    stage_id: str
    """The stage's id."""

    cache: CacheStats | None
    """Cache counters and accounting; None when the stage's cache is disabled."""

    mailbox: ActorStatistics
    """Statistics of the cache actor's mailbox."""

    restarts: int = 0
    """Times the stage was recreated after its process died (Ray placement with a restart
    policy); each restart started it with an empty cache."""

    @property
    def accounting(self) -> CacheAccounting | None:
        """The cache's accounting (misses by reason, unique-prefix bytes); None when disabled."""
        return None if self.cache is None else self.cache.accounting


# A stage's envelope and messages to its cache, built from every field in order, unchecked:
# the envelope's fields were checked by the stage's config and the request; the messages' one
# converter keeps a read-only array that owns its data as it is; the model's width and output
# are checked by the stage, so the actor takes these messages as they are.
_unchecked_message_base = unchecked_constructor(MessageBase)
_unchecked_restore = unchecked_constructor(_StageRestore)
_unchecked_record = unchecked_constructor(_StageRecord)
# A stage's report, likewise: its counts, records and times are the stage's own.
_unchecked_report = unchecked_constructor(StagePrefillReport)
_INT32: Final = np.dtype(np.int32)


def _optional_name(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if value is not None:
        check_name(instance, attribute, value)


@attrs.define(eq=False, on_setattr=attrs.setters.NO_OP)
class PrefillRequest:
    """One prefill travelling down the pipeline, with its own one-shot reply.

    Its ids are checked when it is made (non-empty printable text): a stage puts them in every
    message to its cache without checking them again. They are not to be changed afterwards
    (assignments are not checked: the stages set the other fields on every request).

    Created by :meth:`Pipeline.prefill <stage_runtime.pipeline.Pipeline.prefill>`; stages fill
    in ``frame`` and ``reports`` and settle it with :meth:`succeed` or :meth:`fail`; the caller
    waits on ``done`` and calls :meth:`abandon` if it gives up first.
    """

    request_id: str = attrs.field(validator=check_name)
    """Caller's request id (generated when the caller gave none)."""

    session_id: str = attrs.field(validator=check_name)
    """Caller's session id; metadata only (never part of a cache key)."""

    tokens: npt.NDArray[np.int32]
    """The prompt's token ids, validated once at pipeline entry (read-only int32)."""

    frame: ActivationFrame | None = None
    """Output of the last stage that handled the request (what the next stage reads of it);
    None before stage 0."""

    logits: npt.NDArray[np.float32] | None = None
    """The next-token logits of the prompt's last position, set by a last stage whose model
    computes them (a transformer's output head)."""

    reports: list[StagePrefillReport] = attrs.field(factory=list)
    """One report per stage that handled the request, in pipeline order."""

    error: Exception | None = None
    """Set when the request failed; the caller's ``prefill`` raises it."""

    done: trio.Event = attrs.field(factory=trio.Event)
    """Set once the request succeeded or failed."""

    abandoned: bool = False
    """Whether the caller gave up; stages skip abandoned requests."""

    cache_salt: str | None = attrs.field(default=None, validator=_optional_name)
    """Tenant salt for the cache keys (see ``MessageBase.cache_salt``); None shares."""

    outstanding: int = 0
    """Stages that passed the request on and whose record's outcome has not come in yet."""

    reached_end: bool = False
    """Whether the last stage has handled the request (it settles once nothing is
    outstanding)."""

    _scope: trio.CancelScope | None = None

    def succeed(self) -> None:
        """Settle the request successfully (its ``frame`` and ``reports`` are final)."""
        self.done.set()

    def fail(self, error: Exception) -> None:
        """Settle the request with ``error``, unless it is already settled."""
        if not self.done.is_set():
            self.error = error
            self.done.set()

    def abandon(self) -> None:
        """Mark the request abandoned and interrupt the stage computing it, if any."""
        self.abandoned = True
        if self._scope is not None:
            self._scope.cancel()

    @property
    def live(self) -> bool:
        """Whether a stage should still work on this request."""
        return not self.abandoned and not self.done.is_set()


@attrs.define(eq=False)
class Stage:
    """One pipeline stage: runs as a task (:meth:`run`) that owns its cache actor.

    Args:
        config: The stage's configuration.
        model_factory: Builds the stage's model when the task starts.
        inbox: Requests from the previous stage (or from callers, for stage 0).
        outbox: Requests to the next stage; None for the last stage, which settles them.
        environ: Environment for the cache configuration when ``config.kv_cache`` is None.
        mailbox_size: The cache actor's mailbox size.
        borrowed_inputs: Whether incoming frames are borrowed memory (another process's,
            mapped from Ray's object store): an output that shares memory with its input is
            then copied before it is recorded, so the cache never pins the borrowed buffer.
    """

    config: StageConfig
    model_factory: ModelFactory
    inbox: trio.MemoryReceiveChannel[PrefillRequest]
    outbox: trio.MemorySendChannel[PrefillRequest] | None
    environ: Mapping[str, str] | None = None
    mailbox_size: int = 64
    borrowed_inputs: bool = False
    _model: StageModel | None = attrs.field(default=None, init=False)
    _now: Callable[[], float] = attrs.field(default=trio.current_time, init=False)
    """``trio.current_time``, bound to the run's clock once the stage runs (a report's two
    times cost three calls less each)."""
    _embed_async: Callable[[npt.NDArray[np.int32]], Awaitable[ActivationFrame]] | None = (
        attrs.field(default=None, init=False)
    )
    """The model's optional ``embed_async``, looked up once when the model is built."""
    _full_restore: Callable[[ActivationFrame], Awaitable[None]] | None = attrs.field(
        default=None, init=False
    )
    """The model's optional ``full_restore``, looked up once when the model is built."""
    _downstream: Callable[[ActivationFrame], ActivationFrame] | None = attrs.field(
        default=None, init=False
    )
    """The model's optional ``downstream``: the part of its output the next stage reads (a
    transformer stage records its keys and values with its hidden states, and passes on only
    the hidden states). The whole output when the model has none."""
    _logits: Callable[[ActivationFrame], npt.NDArray[np.float32] | None] | None = attrs.field(
        default=None, init=False
    )
    """The model's optional ``logits``: the last stage's next-token logits of the prompt."""
    _cache: ActorRef[CacheMessage, Any] | None = attrs.field(default=None, init=False)
    _lookup: bool = attrs.field(default=False, init=False)
    _record: bool = attrs.field(default=False, init=False)
    _final_stats: StageStats | None = attrs.field(default=None, init=False)
    _counts: dict[str, int] = attrs.field(
        factory=lambda: {"completed": 0, "failed": 0, "skipped": 0}, init=False
    )
    _serving: trio.CancelScope | None = attrs.field(default=None, init=False)
    """The scope the stage takes requests in (cancelled when a record fails)."""
    _record_failure: BaseException | None = attrs.field(default=None, init=False)
    """What the cache actor raised for a record: the stage fails with it."""

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve requests until the inbox closes, then stop the cache actor.

        Raises:
            StageFailedError: the model could not be built, the cache actor failed, or anything
                else went wrong that is not a single request's fault. The cause is chained.
        """
        stage_id = self.config.stage_id
        with structlog.contextvars.bound_contextvars(stage=stage_id):
            try:
                await self._run(task_status)
            except Exception as exc:
                cause = sole_exception(exc)
                msg = f"stage {stage_id!r} failed: {cause!r}"
                raise StageFailedError(msg, stage_id=stage_id) from cause

    async def _run(self, task_status: trio.TaskStatus[None]) -> None:
        config = self.config
        self._model = model = _checked_model(self.model_factory(config), config)
        self._now = trio.lowlevel.current_clock().current_time
        self._embed_async = getattr(model, "embed_async", None)
        self._full_restore = getattr(model, "full_restore", None)
        self._downstream = getattr(model, "downstream", None)
        self._logits = getattr(model, "logits", None)
        actor = CacheActor(config, environ=self.environ)
        self._lookup, self._record = actor.should_lookup, actor.should_record
        async with trio.open_nursery() as nursery:
            self._cache = await spawn(
                nursery, actor, name=f"cache-{config.stage_id}", mailbox_size=self.mailbox_size
            )
            log.info(
                "stage_started",
                stage_index=config.stage_index,
                layer_start=config.layer_start,
                layer_end=config.layer_end,
                lookup=self._lookup,
                record=self._record,
            )
            task_status.started()
            with trio.CancelScope() as self._serving:
                async with self.inbox:
                    while await self._serve():
                        pass
            self._serving = None
            self._raise_record_failure()
            if self.outbox is not None:
                await self.outbox.aclose()
            # Handled after every record sent before it (the mailbox is FIFO): once it is in,
            # every record's outcome is too. (Kept only for a stage that did not fail.)
            final = await self.statistics()
            self._raise_record_failure()
            self._final_stats = final
            await self._cache.stop(drain=True)
        log.info("stage_stopped", **self._counts)

    def _raise_record_failure(self) -> None:
        failure = self._record_failure
        if failure is not None:
            raise failure

    async def clear_cache(self) -> tuple[EvictedEntry, ...]:
        """Evict every entry of the stage's cache; returns them (each logged as ``cleared``)."""
        if self._cache is None:
            msg = f"stage {self.config.stage_id!r} has not started"
            raise RuntimeError(msg)
        evicted: tuple[EvictedEntry, ...] = await self._cache.ask(ClearCache())
        return evicted

    async def statistics(self) -> StageStats:
        """The stage's cache and mailbox statistics (the final ones once it has stopped)."""
        if self._final_stats is not None:
            return self._final_stats
        if self._cache is None:
            msg = f"stage {self.config.stage_id!r} has not started"
            raise RuntimeError(msg)
        cache = await self._cache.ask(CacheStatsRequest())
        return StageStats(
            stage_id=self.config.stage_id, cache=cache, mailbox=self._cache.statistics()
        )

    async def _serve(self) -> bool:
        """Process requests from the inbox until it closes (False), or until abandoning the
        request being processed interrupts it (True: serve on, under a new cancel scope).

        One cancel scope covers many requests: it is the ``_scope`` of the request being
        processed, which abandoning it cancels. Entering and leaving a trio cancel scope costs
        about 3 us; a scope per request and stage took 12% of a replay of the synthetic trace
        with caches that do nothing (0.92 against 0.81 s of CPU). So a new one is made only
        after one has interrupted a request."""
        counts = self._counts
        receive = self.inbox.receive  # (not ``async for``: a coroutine less per request)
        current: PrefillRequest | None = None
        with trio.CancelScope() as work:
            while True:
                try:
                    request = await receive()
                except trio.EndOfChannel:
                    return False
                if request.abandoned or request.done.is_set():  # (not live: a call less)
                    counts["skipped"] += 1
                    continue
                current = request
                await self._process(request, work)
                current = None
                # Abandoned after its last schedule point? Only abandoning the request being
                # processed cancels this scope, so the flag is read first: cancel_called reads
                # the clock (for a deadline), which cost every request a few calls.
                if request.abandoned and work.cancel_called:
                    return True
        # This scope's Cancelled, caught at its end: it interrupted the request being processed.
        if current is not None:
            current._scope = None
            counts["skipped"] += 1
        return True

    async def _process(self, request: PrefillRequest, work: trio.CancelScope) -> None:
        assert self._model is not None
        assert self._cache is not None
        model, cache = self._model, self._cache
        started = self._now()
        tokens = request.tokens
        n = int(tokens.size)
        width = model.activation_width
        # Only the cache needs request metadata; an uncached stage skips building it.
        base = self._message_base(request) if self._lookup or self._record else None
        # A read-only 1-D int32 array that owns its data (what the pipeline hands every stage)
        # is what a message would keep of the tokens anyway: its messages are then built
        # unchecked, and the actor takes them as they are. (Anything else, only a caller
        # building requests itself can send: checked messages, which the actor checks.)
        frozen = (
            type(tokens) is np.ndarray
            and tokens.dtype is _INT32
            and tokens.ndim == 1
            and _frozen(tokens)
        )
        restored: ActivationFrame | None = None
        output: ActivationFrame | None = None
        failed = False
        # The serving scope (see _serve), cancelled only by abandoning this request: a
        # Cancelled from here on ends the request, which _serve then counts as skipped.
        request._scope = work
        if base is not None and self._lookup:
            restore: RestoreActivationPages
            if frozen:
                restore = _unchecked_restore(base, tokens, width, 0)
            else:
                restore = RestoreActivationPages(base=base, tokens=tokens, activation_width=width)
            hit = await cache.ask(restore)
            if hit is not None:  # join the pages (a view of one; maybe a copy of many)
                restored = await _copying(hit.frame, nbytes=hit.copy_bytes())
        k = 0 if restored is None else restored.token_count
        # A model error is that caller's error. Raised in a group with a Cancelled (the
        # model's own nursery interrupted), the Cancelled goes on to its cancel scope.
        try:
            if restored is not None and k >= n:  # (n >= 1: a whole-prompt hit)
                if self._full_restore is not None:  # optional: what taking it costs
                    await self._full_restore(restored)
                output = restored
            else:
                output = await self._compute(request, restored, k, n, width)
        except Exception as exc:
            failed = self._model_failed(request, work, exc)
        except trio.Cancelled as stray:
            if being_cancelled():
                raise  # a real cancellation: of this request, or of the stage
            error = stray_cancelled_error("the model")
            error.__cause__ = stray
            failed = self._model_failed(request, work, error)
        except BaseExceptionGroup as group:
            cancelled, rest = group.split(trio.Cancelled)
            if not isinstance(rest, ExceptionGroup):
                raise  # only Cancelled, or something that is not an Exception (^C...)
            failed = self._model_failed(request, work, sole_exception(rest))
            if cancelled is not None and being_cancelled():
                raise cancelled from None
            # (Else the Cancelled was kept from an earlier cancellation: a bug of the model's,
            # like a stray one alone. The request has its error; the stray goes no further.)
        request._scope = None
        if output is None or request.abandoned or request.done.is_set():  # (not live)
            if not failed and (output is not None or work.cancel_called):
                self._counts["skipped"] += 1  # abandoned while this stage worked on it
            return  # no record, nothing forwarded
        pending: PendingReply[list[ResidentActivationRecord]] | None = None
        if base is not None and self._record:
            if self.borrowed_inputs and request.frame is not None:
                output = _owned(output, request.frame)
            record: RecordActivation
            if frozen:
                record = _unchecked_record(base, tokens, width, output, 0)
            else:
                record = RecordActivation(
                    base=base, tokens=tokens, activation_width=width, frame=output
                )
            try:
                # No schedule point here: the next is sending downstream (when the next
                # stage's channel is full) or taking the next request.
                pending = cache.ask_later_nowait(record)
            except trio.WouldBlock:
                pending = await cache.ask_later(record)
        if self.outbox is None and self._logits is not None:
            request.logits = self._logits(output)
        request.frame = output if self._downstream is None else self._downstream(output)
        self._counts["completed"] += 1
        if self.outbox is not None:
            # The next stage starts on the frame while the cache actor records it; the record's
            # outcome joins the request's reports before the request is settled.
            request.outstanding += 1
            if pending is None:
                await self.outbox.send(request)
            else:
                try:
                    # No schedule point here: the next is taking the next request.
                    self.outbox.send_nowait(request)
                except trio.WouldBlock:
                    await self.outbox.send(request)
        if pending is None:
            self._report(request, (), k, n, started)
        elif self._lookup:
            # The record's outcome is handed over by the cache actor as it replies: the stage
            # takes its next request meanwhile, whose restore the actor handles after this
            # record (mailbox order), so a stage is never more than one record ahead of its
            # actor; and no task wakes only to file the report.
            pending.add_done_callback(functools.partial(self._recorded, request, k, n, started))
        else:
            # A stage that only records has no restore to wait behind: it waits for the record
            # itself, or it could run a mailbox of records (and their frames) ahead. A failed
            # record crashes the stage.
            self._report(request, tuple(await pending.result()), k, n, started)

    def _recorded(
        self,
        request: PrefillRequest,
        k: int,
        n: int,
        started: float,
        result: outcome.Outcome[list[ResidentActivationRecord]],
    ) -> None:
        """The cache actor's outcome of a record (called in the actor's task)."""
        try:
            # (A Value's value read as it is: unwrap() also marks it used, which no one asks.)
            records = result.value if type(result) is outcome.Value else result.unwrap()
            self._report(request, tuple(records), k, n, started)
        except BaseException as exc:
            # A failed record (or a bug filing its report) crashes the stage: a cache actor's
            # error is not one request's fault, and the pipeline then fails the requests in
            # flight. Raised here, it would only be logged, and the request never settled.
            if self._record_failure is None:
                self._record_failure = exc
            if self._serving is not None:
                self._serving.cancel()

    def _report(
        self,
        request: PrefillRequest,
        records: tuple[ResidentActivationRecord, ...],
        k: int,
        n: int,
        started: float,
    ) -> None:
        """File this stage's report of ``request``; settle it if it was the last one due."""
        config = self.config
        report = _unchecked_report(
            config.stage_id,
            config.stage_index,
            k,
            n - k,
            records,
            _evicted_by(records),
            started,
            self._now(),
        )
        reports = request.reports
        if not reports or reports[-1].stage_index < config.stage_index:
            reports.append(report)  # (the outcomes of records come back in stage order)
        else:
            bisect.insort(reports, report, key=_stage_index)
        if self.outbox is not None:
            request.outstanding -= 1
        else:
            request.reached_end = True
        if request.reached_end and request.outstanding == 0:
            request.succeed()

    def _model_failed(
        self, request: PrefillRequest, scope: trio.CancelScope, exc: Exception
    ) -> bool:
        """Settle ``request`` with the model's error; returns whether it counts as failed.

        When the model was being interrupted, the error is what interrupting it raised, not a
        failure: the caller gave up (the request's scope was cancelled: it counts as skipped), or
        the stage itself is being cancelled (the pipeline stopping: it fails the request with
        ``PipelineStoppedError``). Either way the error is logged at info level only."""
        event = dict(request_id=request.request_id, error_type=type(exc).__name__, error=str(exc))
        if scope.cancel_called or being_cancelled():
            log.info("prefill_interrupted", **event)
            return False
        request.fail(exc)
        self._counts["failed"] += 1
        log.warning("prefill_failed", **event)
        return True

    async def _compute(
        self,
        request: PrefillRequest,
        restored: ActivationFrame | None,
        k: int,
        n: int,
        width: int,
    ) -> ActivationFrame:
        """Run the model for tokens ``k..N-1`` and join the result to the restored prefix; its
        rows must be ``width`` values wide (the model's ``activation_width``)."""
        assert self._model is not None
        model = self._model
        if request.frame is not None:
            inputs = request.frame
        elif self._embed_async is not None:  # optional: may embed off the event loop
            inputs = await self._embed_async(request.tokens)
        else:
            inputs = model.embed(request.tokens)
        if not isinstance(inputs, ActivationFrame) or inputs.token_count != n:
            got = inputs.token_count if isinstance(inputs, ActivationFrame) else inputs
            msg = f"stage input must be a frame of {n} tokens, got {got!r}"
            raise FrameError(msg)
        suffix = await model.forward(inputs, k, restored)
        if not isinstance(suffix, ActivationFrame) or suffix.token_count != n - k:
            got = suffix.token_count if isinstance(suffix, ActivationFrame) else suffix
            msg = f"model output must be a frame of {n - k} tokens, got {got!r}"
            raise FrameError(msg)
        # The width the stage's messages carry (read once per request): the actor takes the
        # stage's record of this output as it is.
        suffix.check_row_width(width, what="model output")
        if restored is None:
            return suffix
        both = restored.payload_bytes + suffix.payload_bytes
        copied = 0 if restored.is_virtual and suffix.is_virtual else both
        return await _copying(ActivationFrame.concat, restored, suffix, nbytes=copied)

    def _message_base(self, request: PrefillRequest) -> MessageBase:
        # Every field was checked already: the request's ids by the request, the rest by the
        # stage's config. (MessageBase's own validators cost a few microseconds per message.)
        config = self.config
        return _unchecked_message_base(
            SCHEMA_VERSION,
            config.run_id,
            request.request_id,
            request.session_id,
            config.stage_id,
            config.stage_index,
            config.topology_id,
            config.model_id,
            None,
            None,
            None,
            request.cache_salt,
        )
