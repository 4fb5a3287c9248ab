"""Actors: one trio task owns the state, every access is a message.

An actor is a plain object with a ``handle`` method. ``open_actor`` / ``spawn`` run it in its own
task behind a bounded mailbox (a trio memory channel) and hand back an ``ActorRef``, the only way to
reach it. Because exactly one task ever calls ``handle``, and calls it for one message at a time,
the state needs no lock.
"""

from __future__ import annotations

import abc
import inspect
import math
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, Final, Generic, TypeVar, cast, overload

import attrs
import outcome
import structlog
import trio

from actors._reply import Reply
from actors.errors import (
    ActorStoppedError,
    RestartLimitError,
    being_cancelled,
    stray_cancelled_error,
)
from actors.supervision import RestartPolicy, _CrashWindow

__all__ = [
    "Actor",
    "ActorRef",
    "Asks",
    "ActorStatistics",
    "PendingReply",
    "open_actor",
    "spawn",
]

log = structlog.get_logger(__name__)

_NEVER_AWAITABLE: Final = frozenset({type(None), bool, int, float, str, bytes, list, tuple, dict})
"""Result types a handler's reply is never awaited for, known without ``inspect.isawaitable``
(which costs a few ABC checks per message)."""

MessageT = TypeVar("MessageT")
ReplyT = TypeVar("ReplyT")
MessageT_contra = TypeVar("MessageT_contra", contravariant=True)
ReplyT_co = TypeVar("ReplyT_co", covariant=True)

AnswerT = TypeVar("AnswerT")


class Asks(Generic[ReplyT_co]):
    """Base class for a message that declares the type of its reply.

    ``ref.ask(message)`` is then typed as returning ``ReplyT_co`` rather than the actor's
    general reply type, so an actor that answers each kind of message with its own type needs
    no casts at the call sites::

        @attrs.frozen
        class GetCount(Asks[int]): ...

        count = await ref.ask(GetCount())  # int, to a type checker

    Only a declaration: the actor's ``handle`` must return that type (nothing checks it at run
    time). And a type checker accepts any ``Asks`` message for any actor's ``ask``: there is no
    intersection type to require the actor's message type too, so a message the actor does not
    handle is caught at run time, by ``handle``.
    """

    __slots__ = ()


MAILBOX_FULL_LOG_INTERVAL_S = 1.0
"""At most one ``actor_mailbox_full`` warning per actor in this many seconds."""


class _Barrier:
    """Internal message: replied to by the actor loop itself once everything before it ran."""

    __slots__ = ()


_BARRIER = _Barrier()

_Envelope = tuple[Any, Reply | None]


class Actor(abc.ABC, Generic[MessageT, ReplyT]):
    """Base class of actors: subclass it and implement ``handle``.

    The actor's attributes are its state. Only the actor's own task touches them, one message at a
    time, so they need no lock. ``handle`` may be ``async def`` (it may await, and no other message
    runs meanwhile) or a plain ``def``. Under a ``RestartPolicy`` a crashed actor is replaced by a
    new object from the factory, so its state starts fresh (for a cache: empty).

    Example::

        @attrs.define(eq=False)
        class Counter(Actor[int, int]):
            total: int = 0

            async def handle(self, message: int) -> int:
                self.total += message
                return self.total
    """

    __slots__ = ()

    @abc.abstractmethod
    def handle(self, message: MessageT) -> ReplyT | Awaitable[ReplyT]:
        """Process one message and return the reply (``None`` is fine for tells).

        Args:
            message: What a caller sent with ``ask`` or ``tell``.

        Returns:
            The reply that ``ask`` returns; ignored for ``tell``.

        Raises:
            Exception: During an ``ask`` the exception is raised in the caller and the actor keeps
                running; during a ``tell`` it crashes the actor (see ``RestartPolicy``).
        """

    async def on_start(self) -> None:
        """Run in the actor's task before the first message (and after every restart).

        If it raises, the actor crashes (logged as ``actor_hook_failed``): under a
        ``RestartPolicy`` it is rebuilt, otherwise ``spawn`` / ``open_actor`` raise the error.
        """

    async def on_stop(self) -> None:
        """Run in the actor's task after an orderly stop (not after a crash or cancellation).

        If it raises, the error is logged as ``actor_hook_failed`` and reaches the owning nursery,
        with or without a ``RestartPolicy``: the actor is stopping, so there is nothing to restart.
        """


@attrs.frozen(kw_only=True)
class ActorStatistics:
    """A snapshot of one actor's mailbox and counters, from ``ActorRef.statistics()``."""

    mailbox_size: int
    """Capacity of the mailbox; ``0`` is a rendezvous (each ``tell`` waits for the actor)."""

    queued: int
    """Messages waiting in the mailbox now."""

    max_queued: int
    """Most messages seen waiting in the mailbox at once."""

    processed: int
    """Messages handled so far, failed ones included."""

    failed: int
    """Messages whose handler raised."""

    restarts: int
    """Times the actor was rebuilt under its ``RestartPolicy``."""

    asks_waiting: int
    """``ask`` calls in progress: waiting for mailbox room or for their reply."""


@attrs.define(eq=False)
class _Cell:
    """Everything the actor task and its refs share: mailbox, counters and lifecycle flags."""

    name: str
    mailbox_size: int
    factory: Callable[[], Actor[Any, Any]]
    policy: RestartPolicy | None
    send: trio.MemorySendChannel[_Envelope]
    receive: trio.MemoryReceiveChannel[_Envelope]
    sent: int = 0
    received: int = 0
    max_queued: int = 0
    processed: int = 0
    failed: int = 0
    restarts: int = 0
    asks_waiting: int = 0
    drain: bool = True
    drained: bool = False
    current: Reply | None = None
    task: trio.lowlevel.Task | None = None
    asker: trio.lowlevel.Task | None = None
    """The task the last ask came from, once it passed the checks (it is not the actor's own
    task, and it runs in the actor's trio run): a task never changes runs, so its next asks
    skip them. (Held, not weakly referenced: no other task can then be this object.)"""
    stopped: trio.Event = attrs.field(factory=trio.Event)
    stop_requested: trio.Event = attrs.field(factory=trio.Event)
    trio_token: trio.lowlevel.TrioToken = attrs.field(factory=trio.lowlevel.current_trio_token)
    """The run the actor lives in; its refs work only from there."""
    full_logged_at: float = -math.inf
    full_suppressed: int = 0

    def note_sent(self) -> None:
        self.sent += 1
        queued = self.sent - self.received
        if queued > self.max_queued:
            self.max_queued = min(queued, self.mailbox_size)

    def note_full(self) -> None:
        """Log that a sender has to wait for room, at most once per interval (a rendezvous
        mailbox, size 0, always makes senders wait for the actor: not worth a warning)."""
        if self.mailbox_size == 0:
            return
        now = trio.current_time()
        if now - self.full_logged_at < MAILBOX_FULL_LOG_INTERVAL_S:
            self.full_suppressed += 1
            return
        log.warning(
            "actor_mailbox_full",
            actor=self.name,
            mailbox_size=self.mailbox_size,
            suppressed=self.full_suppressed,
        )
        self.full_logged_at = now
        self.full_suppressed = 0

    def stopped_error(self) -> ActorStoppedError:
        msg = f"actor {self.name!r} has stopped"
        return ActorStoppedError(msg)

    def request_stop(self, *, drain: bool) -> None:
        if not drain:
            self.drain = False
        self.send.close()
        self.stop_requested.set()

    async def run(self, ref: ActorRef[Any, Any], task_status: trio.TaskStatus[Any]) -> None:
        self.task = trio.lowlevel.current_task()
        with structlog.contextvars.bound_contextvars(actor=self.name):
            try:
                await self._supervise(ref, task_status)
            finally:
                self._shut_down()

    async def _supervise(self, ref: ActorRef[Any, Any], task_status: trio.TaskStatus[Any]) -> None:
        # Every crash is logged exactly once, with its traceback, where it happens: a handler's
        # by _serve (actor_message_failed), the factory's and the hooks' here (actor_hook_failed).
        # actor_restarted and actor_restart_limit_reached then only name the cause.
        window = None if self.policy is None else _CrashWindow(self.policy)
        started = False
        while True:
            hook: str | None = "factory"
            try:
                actor = self.factory()
                if not isinstance(actor, Actor):
                    msg = (
                        f"actor {self.name!r}: the factory must return an Actor, "
                        f"got {type(actor).__name__}"
                    )
                    raise TypeError(msg)
                hook = "on_start"
                await actor.on_start()
                hook = None
                if not started:
                    started = True
                    log.info("actor_started", mailbox_size=self.mailbox_size)
                    task_status.started(ref)
                self.drained = await self._serve(actor)
            except Exception as exc:
                if hook is not None:
                    _log_hook_failure(hook, exc)
                if window is None:
                    raise
                stopping = self._nothing_left_to_serve()
                if not window.record(trio.current_time()):
                    policy = window.policy
                    log.error(
                        "actor_restart_limit_reached",
                        crashes=window.attempt,
                        within_s=policy.within_s,
                        max_restarts=policy.max_restarts,
                        restarts=self.restarts,
                        cause=repr(exc),
                    )
                    msg = (
                        f"actor {self.name!r} crashed {window.attempt} times within "
                        f"{policy.within_s}s, max_restarts={policy.max_restarts}"
                    )
                    raise RestartLimitError(msg) from exc
                if stopping:
                    # Crashed while stopping (within the limit): a rebuilt actor would have
                    # nothing to do, so none is built and no restart is announced.
                    self.drained = self.drain
                    return
                log.warning(
                    "actor_restarted",
                    attempt=window.attempt,
                    restarts=self.restarts + 1,
                    cause=repr(exc),
                    backoff_s=window.policy.backoff_s,
                )
                if window.policy.backoff_s > 0:
                    # A stop ends the backoff: a shutdown must not wait it out.
                    with trio.move_on_after(window.policy.backoff_s):
                        await self.stop_requested.wait()
                if self._nothing_left_to_serve():
                    # Stopped during the backoff: do not build an actor only to stop it.
                    self.drained = self.drain
                    return
                self.restarts += 1
                continue
            # The actor is stopping: a failing on_stop is not restarted (there is nothing left to
            # serve), it propagates to the owning nursery like a crash without a policy.
            try:
                await actor.on_stop()
            except Exception as exc:
                _log_hook_failure("on_stop", exc)
                raise
            return

    def _nothing_left_to_serve(self) -> bool:
        """Stopping, and a rebuilt actor would get no message (none queued, or no drain)."""
        if not self.stop_requested.is_set():
            return False
        return not self.drain or self.receive.statistics().current_buffer_used == 0

    async def _serve(self, actor: Actor[Any, Any]) -> bool:
        """Handle messages until the mailbox ends; return whether it was drained."""
        handle = actor.handle
        is_async = inspect.iscoroutinefunction(handle)
        receive = self.receive.receive
        message: Any = None
        reply: Reply | None = None
        result: Any = None
        while self.drain:
            # Drop the previous message and reply before idling, so an idle actor keeps nothing
            # alive that a caller handed it or was handed back.
            message = reply = result = None
            try:
                message, reply = await receive()
            except trio.EndOfChannel:
                return True
            self.received += 1
            if reply is not None:
                if message is _BARRIER:
                    reply.succeed(None)
                    continue
                self.current = reply
            try:
                try:
                    result = handle(message)
                    # A plain def may still hand back an awaitable (a decorated or partial async
                    # handler); await it rather than replying with a coroutine object.
                    if is_async or (
                        type(result) not in _NEVER_AWAITABLE and inspect.isawaitable(result)
                    ):
                        result = await result
                except trio.Cancelled as cancelled:
                    if being_cancelled():
                        raise  # a real cancellation of the actor
                    error = stray_cancelled_error("the handler")
                    raise error from cancelled
            except Exception as exc:
                self.processed += 1
                self.failed += 1
                if reply is None:
                    # A told message crashes the actor: nobody else sees the traceback.
                    log.error(
                        "actor_message_failed",
                        message_type=type(message).__name__,
                        crashed=True,
                        error_type=type(exc).__name__,
                        error=str(exc),
                        exc_info=exc,
                    )
                    raise
                # The asker gets the exception itself; a traceback here would only repeat it.
                log.warning(
                    "actor_message_failed",
                    message_type=type(message).__name__,
                    crashed=False,
                    error_type=type(exc).__name__,
                    error=str(exc),
                )
                reply.fail(exc)
                self.current = None
            else:
                self.processed += 1
                if reply is not None:
                    reply.succeed(result)
                    self.current = None
        return False

    def _shut_down(self) -> None:
        """Close the mailbox and fail every ask that will never get a reply."""
        self.send.close()
        if self.current is not None:
            self.current.fail(self.stopped_error())
            self.current = None
        dropped = 0
        while True:
            try:
                message, reply = self.receive.receive_nowait()
            except (trio.WouldBlock, trio.EndOfChannel):
                break
            if message is not _BARRIER:
                dropped += 1
            if reply is not None:
                reply.fail(self.stopped_error())
        self.receive.close()
        self.stopped.set()
        log.info("actor_stopped", processed=self.processed, drained=self.drained, dropped=dropped)


class PendingReply(Generic[ReplyT_co]):
    """The reply to an :meth:`ActorRef.ask_later`, collected once: awaited with :meth:`result`,
    or handed to a callback (:meth:`add_done_callback`)."""

    __slots__ = ("_collected", "_reply")

    def __init__(self, reply: Reply) -> None:
        self._reply = reply
        self._collected = False

    @property
    def done(self) -> bool:
        """Whether the actor has replied (or failed, or stopped before replying)."""
        return self._reply.done

    async def result(self) -> ReplyT_co:
        """Wait for the reply and return it; raise what ``handle`` raised for the message, or
        :class:`ActorStoppedError` when the actor stopped before handling it.

        Raises:
            RuntimeError: the reply was collected already (by this or a callback).
        """
        self._collect()
        return cast(ReplyT_co, await self._reply.wait())

    def add_done_callback(self, callback: Callable[[outcome.Outcome[ReplyT_co]], object]) -> None:
        """Collect the reply with ``callback`` instead of awaiting it: no task waits or wakes.

        ``callback`` is called once, synchronously, with the reply's outcome
        (``outcome.Value`` of what ``handle`` returned, or ``outcome.Error`` of what it raised,
        or of :class:`ActorStoppedError`): at once when the reply is in, else by the task that
        settles it (the actor's, or the one stopping it). It must be quick and must not raise:
        an exception from it is logged (``actor_reply_callback_failed``) and dropped, so that a
        caller's bug does not crash the actor.

        Raises:
            RuntimeError: the reply was collected already (by :meth:`result` or a callback).
        """
        self._collect()
        reply = self._reply
        reply.callback = callback
        if reply.done:
            reply.call_back()

    def _collect(self) -> None:
        if self._collected:
            msg = "this reply was collected already (a reply is collected once)"
            raise RuntimeError(msg)
        self._collected = True


def _log_hook_failure(hook: str, exc: Exception) -> None:
    """Log a crash of the factory, ``on_start`` or ``on_stop`` once, with its traceback."""
    log.error(
        "actor_hook_failed",
        hook=hook,
        error_type=type(exc).__name__,
        error=str(exc),
        exc_info=exc,
    )


@attrs.define(eq=False, repr=False)
class ActorRef(Generic[MessageT, ReplyT]):
    """The handle to a running actor: send it messages, stop it, read its statistics.

    Refs are cheap to share between tasks; all of them reach the same mailbox.
    """

    _cell: _Cell
    _send: trio.MemorySendChannel[_Envelope]

    def __repr__(self) -> str:
        return f"<ActorRef {self._cell.name!r}>"

    @property
    def name(self) -> str:
        """The actor's name, as bound to ``actor=`` in its log events."""
        return self._cell.name

    @property
    def stopped(self) -> bool:
        """Whether the actor's task has finished (stopped, crashed or cancelled)."""
        return self._cell.stopped.is_set()

    def _check_run(self) -> None:
        """Refuse use from another thread or trio run: trio's channels and events are not
        thread-safe, so such a send would corrupt the mailbox or wedge the actor."""
        try:
            token = trio.lowlevel.current_trio_token()
        except RuntimeError:
            token = None
        if token is not self._cell.trio_token:
            msg = (
                f"actor {self._cell.name!r} can only be used from the trio run that spawned it; "
                "from another thread, go through trio.from_thread.run"
            )
            raise RuntimeError(msg)

    def _send_now(self, envelope: _Envelope) -> bool:
        """Put ``envelope`` in the mailbox if it has room now; return ``False`` if it is full."""
        self._check_run()
        return self._put_now(envelope)

    def _put_now(self, envelope: _Envelope) -> bool:
        """:meth:`_send_now` for a caller whose run is checked already (:meth:`_asked_cell`)."""
        try:
            self._send.send_nowait(envelope)
        except trio.WouldBlock:
            return False
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            raise self._cell.stopped_error() from None
        # note_sent(), inlined: this is the hot path of every tell and ask.
        cell = self._cell
        cell.sent += 1
        queued = cell.sent - cell.received
        if queued > cell.max_queued:
            cell.max_queued = min(queued, cell.mailbox_size)
        return True

    async def _send_later(self, envelope: _Envelope) -> None:
        """Wait for room in a full mailbox, then send (the backpressure path)."""
        cell = self._cell
        if trio.lowlevel.current_task() is cell.task:
            msg = f"actor {cell.name!r} cannot wait for room in its own full mailbox (deadlock)"
            raise RuntimeError(msg)
        cell.note_full()
        try:
            await self._send.send(envelope)
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            raise cell.stopped_error() from None
        cell.note_sent()

    @overload
    async def ask(
        self,
        message: Asks[AnswerT],
        *,
        timeout: float | None = None,  # noqa: ASYNC109
    ) -> AnswerT: ...

    @overload
    async def ask(
        self,
        message: MessageT,
        *,
        timeout: float | None = None,  # noqa: ASYNC109
    ) -> ReplyT: ...

    async def ask(
        self,
        message: Any,
        *,
        timeout: float | None = None,  # noqa: ASYNC109 - the API issue 3 fixes
    ) -> Any:
        """Send ``message`` and wait for the actor's reply.

        A message whose class derives from :class:`Asks` declares its reply's type; to a type
        checker the call returns that type instead of the actor's general reply type.

        Cancelling the caller at any point is safe: before the message is queued nothing is sent;
        after, the actor still handles it (the message was delivered) and the late reply is
        dropped. The actor keeps running either way.

        Args:
            message: Passed to the actor's ``handle``.
            timeout: Seconds to wait, for mailbox room and the reply together; ``None`` waits as
                long as it takes.

        Returns:
            What ``handle`` returned.

        Raises:
            trio.TooSlowError: ``timeout`` passed first.
            ActorStoppedError: The actor has stopped, or stopped before replying.
            RuntimeError: Called from the actor's own task (it would deadlock), or from another
                thread or trio run (nothing is sent).
            TypeError: ``timeout`` is not a number (nothing is sent).
            ValueError: ``timeout`` is negative, NaN or past a float's range (nothing is sent).
            Exception: Whatever ``handle`` raised for this message.
        """
        if timeout is not None:
            if isinstance(timeout, bool) or not isinstance(timeout, int | float):
                msg = f"timeout must be a number of seconds or None, got {timeout!r}"
                raise TypeError(msg)
            if isinstance(timeout, int) and timeout.bit_length() > 1023:  # (past a float's range)
                msg = (
                    "timeout must be a number of seconds a float can hold (None: no timeout), "
                    f"got an integer of {timeout.bit_length():,} bits"
                )
                raise ValueError(msg)
            if math.isnan(timeout):
                msg = "timeout must be a number of seconds >= 0, got nan"
                raise ValueError(msg)
            if timeout < 0:
                msg = f"timeout must be >= 0 seconds, got {timeout!r}"
                raise ValueError(msg)
            with trio.fail_after(timeout):
                return await self.ask(message)
        # Without a timeout, the ask itself (here, not in a helper: a coroutine less per ask).
        cell = self._asked_cell()
        reply = Reply()
        envelope = (message, reply)
        cell.asks_waiting += 1
        try:
            await trio.lowlevel.checkpoint_if_cancelled()
            if not self._put_now(envelope):
                await self._send_later(envelope)
            # No extra yield after a direct send: the actor cannot have replied yet, so this
            # parks, and that park is this call's schedule point. (Reply.wait, inlined: a
            # coroutine less per ask.)
            if not reply.done:
                reply.waiter = trio.lowlevel.current_task()
                await trio.lowlevel.wait_task_rescheduled(reply.abort)
            error = reply.error
            if error is not None:
                reply.error = None  # do not keep the traceback alive through the slot
                raise error
            answer: ReplyT = reply.value  # (annotated, not cast(): a call less per ask)
            reply.value = None
            return answer
        finally:
            cell.asks_waiting -= 1

    def _asked_cell(self) -> _Cell:
        """The actor's cell, unless the caller is the actor itself (its ask would wait for its
        own reply forever) or in another thread or trio run (see :meth:`_check_run`): checked
        once per asking task, which then sends with :meth:`_put_now`."""
        cell = self._cell
        task = trio.lowlevel.current_task()
        if task is not cell.asker:
            if task is cell.task:
                msg = (
                    f"actor {cell.name!r} cannot ask itself (it would wait for its own reply "
                    "forever)"
                )
                raise RuntimeError(msg)
            self._check_run()
            cell.asker = task
        return cell

    @overload
    async def ask_later(self, message: Asks[AnswerT]) -> PendingReply[AnswerT]: ...

    @overload
    async def ask_later(self, message: MessageT) -> PendingReply[ReplyT]: ...

    async def ask_later(self, message: Any) -> PendingReply[Any]:
        """Send ``message`` as :meth:`ask` does, but return once it is queued: the reply is
        collected later with ``await pending.result()`` (or handed to a callback,
        :meth:`PendingReply.add_done_callback`), so the caller can do other work (send its
        frame on) while the actor handles the message.

        Cancelling the caller before the message is queued sends nothing; cancelling
        ``result()`` drops the late reply, as with :meth:`ask`. A reply nobody collects is
        dropped with its handle.

        Raises:
            ActorStoppedError: The actor has stopped (nothing is sent).
            RuntimeError: Called from the actor's own task, or from another thread or trio run.
        """
        self._asked_cell()
        reply = Reply()
        envelope = (message, reply)
        await trio.lowlevel.checkpoint_if_cancelled()
        if self._put_now(envelope):
            await trio.lowlevel.cancel_shielded_checkpoint()
        else:
            await self._send_later(envelope)
        return PendingReply(reply)

    @overload
    def ask_later_nowait(self, message: Asks[AnswerT]) -> PendingReply[AnswerT]: ...

    @overload
    def ask_later_nowait(self, message: MessageT) -> PendingReply[ReplyT]: ...

    def ask_later_nowait(self, message: Any) -> PendingReply[Any]:
        """:meth:`ask_later` if the mailbox has room right now, without a schedule point (as
        ``send_nowait`` is to ``send``): for a caller that reaches one next anyway, or that
        collects the reply with a callback, as a stage does. ``await ask_later(...)`` is the
        fallback when full.

        Raises:
            trio.WouldBlock: The mailbox is full (nothing is sent).
            ActorStoppedError: The actor has stopped (nothing is sent).
            RuntimeError: Called from the actor's own task, or from another thread or trio run.
        """
        cell = self._asked_cell()
        reply = Reply()
        if not self._put_now((message, reply)):
            msg = f"mailbox of actor {cell.name!r} is full"
            raise trio.WouldBlock(msg)
        return PendingReply(reply)

    async def tell(self, message: MessageT) -> None:
        """Send ``message`` without waiting for it to be handled.

        Waits while the mailbox is full (backpressure) and logs ``actor_mailbox_full`` when it has
        to. If ``handle`` raises for a told message the actor crashes (see ``RestartPolicy``).
        An actor may tell itself, but not while its own mailbox is full.

        Raises:
            ActorStoppedError: The actor has stopped.
            RuntimeError: The actor told itself with its mailbox full (it would deadlock).
        """
        envelope = (message, None)
        await trio.lowlevel.checkpoint_if_cancelled()
        if self._send_now(envelope):
            await trio.lowlevel.cancel_shielded_checkpoint()
        else:
            await self._send_later(envelope)

    def tell_nowait(self, message: MessageT) -> None:
        """Send ``message`` if the mailbox has room right now.

        Raises:
            trio.WouldBlock: The mailbox is full.
            ActorStoppedError: The actor has stopped.
        """
        if not self._send_now((message, None)):
            msg = f"mailbox of actor {self._cell.name!r} is full"
            raise trio.WouldBlock(msg)

    async def stop(self, drain: bool = True) -> None:
        """Stop the actor and wait for its task to finish.

        New messages are refused at once (``ActorStoppedError``), including senders already waiting
        for mailbox room. The message being handled always finishes. Then, with ``drain=True``
        every queued message is handled; with ``drain=False`` queued messages are dropped and their
        asks raise ``ActorStoppedError``. Finally ``on_stop`` runs. Calling ``stop`` from inside the
        actor's own ``handle`` only requests the stop (waiting would deadlock).

        Args:
            drain: Handle the messages already queued before stopping.
        """
        self._check_run()
        cell = self._cell
        cell.request_stop(drain=drain)
        if trio.lowlevel.current_task() is cell.task:
            await trio.lowlevel.checkpoint()
            return
        await cell.stopped.wait()

    def statistics(self) -> ActorStatistics:
        """Return a snapshot of the mailbox and counters."""
        cell = self._cell
        return ActorStatistics(
            mailbox_size=cell.mailbox_size,
            queued=cell.receive.statistics().current_buffer_used,
            max_queued=cell.max_queued,
            processed=cell.processed,
            failed=cell.failed,
            restarts=cell.restarts,
            asks_waiting=cell.asks_waiting,
        )

    async def _barrier(self) -> None:
        """Wait until every message queued before this call has been handled."""
        if trio.lowlevel.current_task() is self._cell.task:
            msg = f"actor {self._cell.name!r} cannot wait for itself to be idle (deadlock)"
            raise RuntimeError(msg)
        reply = Reply()
        envelope = (_BARRIER, reply)
        await trio.lowlevel.checkpoint_if_cancelled()
        if not self._send_now(envelope):
            await self._send_later(envelope)
        await reply.wait()


def _factory_of(
    actor_or_factory: Actor[Any, Any] | Callable[[], Actor[Any, Any]],
    restart: RestartPolicy | None,
) -> Callable[[], Actor[Any, Any]]:
    if isinstance(actor_or_factory, Actor):
        if restart is not None:
            msg = (
                "restart needs a factory that builds a fresh actor, got an instance of "
                f"{type(actor_or_factory).__name__}"
            )
            raise ValueError(msg)
        instance = actor_or_factory

        def reuse() -> Actor[Any, Any]:
            return instance

        return reuse
    if not callable(actor_or_factory):
        msg = f"actor_or_factory must be an Actor or a callable, got {actor_or_factory!r}"
        raise TypeError(msg)
    return actor_or_factory


def _new_cell(
    actor_or_factory: Actor[Any, Any] | Callable[[], Actor[Any, Any]],
    name: str,
    mailbox_size: int,
    restart: RestartPolicy | None,
) -> _Cell:
    if not isinstance(name, str):
        msg = f"name must be a string, got {name!r}"
        raise TypeError(msg)
    if not name:
        msg = "name must be a non-empty string, got ''"
        raise ValueError(msg)
    if not isinstance(mailbox_size, int) or isinstance(mailbox_size, bool):
        msg = f"mailbox_size must be an integer, got {mailbox_size!r}"
        raise TypeError(msg)
    if mailbox_size < 0:
        msg = f"mailbox_size must be >= 0, got {mailbox_size!r}"
        raise ValueError(msg)
    if restart is not None and not isinstance(restart, RestartPolicy):
        msg = f"restart must be a RestartPolicy or None, got {restart!r}"
        raise TypeError(msg)
    factory = _factory_of(actor_or_factory, restart)
    send, receive = trio.open_memory_channel[_Envelope](mailbox_size)
    return _Cell(
        name=name,
        mailbox_size=mailbox_size,
        factory=factory,
        policy=restart,
        send=send,
        receive=receive,
    )


async def spawn(
    nursery: trio.Nursery,
    actor_or_factory: Actor[MessageT, ReplyT] | Callable[[], Actor[MessageT, ReplyT]],
    *,
    name: str,
    mailbox_size: int = 64,
    restart: RestartPolicy | None = None,
) -> ActorRef[MessageT, ReplyT]:
    """Start an actor in ``nursery`` and return its ref once ``on_start`` has run.

    The actor runs until stopped (``ActorRef.stop``) or until the nursery is cancelled. A crash
    without a ``restart`` policy propagates into ``nursery`` like any task's exception.

    Args:
        nursery: Owns the actor's task.
        actor_or_factory: An ``Actor`` instance, or a callable returning a fresh one (an ``Actor``
            subclass itself works). ``restart`` needs a factory.
        name: Bound as ``actor=`` in the actor's log events and shown in errors.
        mailbox_size: Messages that may wait in the mailbox; ``0`` makes every send a rendezvous.
        restart: Rebuild the actor when it crashes; ``None`` lets crashes propagate.

    Returns:
        The ref through which the actor is reached.

    Raises:
        TypeError: ``name`` is not a string, ``mailbox_size`` not an integer, ``restart`` not a
            ``RestartPolicy``, or ``actor_or_factory`` neither an ``Actor`` nor callable.
        ValueError: ``name`` is empty, ``mailbox_size`` is negative, or ``restart`` was given
            with an instance.
    """
    return await _start(nursery, _new_cell(actor_or_factory, name, mailbox_size, restart))


async def _start(nursery: trio.Nursery, cell: _Cell) -> ActorRef[Any, Any]:
    ref: ActorRef[Any, Any] = ActorRef(cell, cell.send)
    await nursery.start(cell.run, ref)
    return ref


@asynccontextmanager
async def open_actor(
    actor_or_factory: Actor[MessageT, ReplyT] | Callable[[], Actor[MessageT, ReplyT]],
    *,
    name: str,
    mailbox_size: int = 64,
    restart: RestartPolicy | None = None,
) -> AsyncIterator[ActorRef[MessageT, ReplyT]]:
    """Run an actor for the duration of an ``async with`` block.

    On a normal exit the mailbox is closed, every queued message is handled (drain), ``on_stop``
    runs and the actor's task is awaited. If the block raises, the actor is cancelled instead
    (queued messages are dropped) and the block's exception leaves in an exception group.
    Arguments are those of ``spawn``; failures of the actor's task (a crash, ``RestartLimitError``,
    a first ``on_start`` that raises) leave the block as an exception group, as trio nurseries do.

    Example::

        async with open_actor(Counter, name="counter") as counter:
            await counter.tell(2)
            assert await counter.ask(3) == 5
    """
    # Validate before the nursery exists, so bad arguments raise plainly, not in a group.
    cell = _new_cell(actor_or_factory, name, mailbox_size, restart)
    async with trio.open_nursery() as nursery:
        ref: ActorRef[MessageT, ReplyT] = await _start(nursery, cell)
        try:
            yield ref
        finally:
            ref._cell.request_stop(drain=True)
