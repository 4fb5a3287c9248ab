"""One-shot reply slot for ``ask``: cheaper than a memory channel pair per request.

The caller parks its own task with ``trio.lowlevel.wait_task_rescheduled``; the actor stores the
result and reschedules it. Everything runs in one trio thread, so the three outcomes (reply
delivered, caller cancelled, actor stopped) are decided without locks: whichever comes first wins
and the others become no-ops. A reply that arrives after the caller gave up is dropped.

Instead of a parked caller, a reply may have a callback (``PendingReply.add_done_callback``): the
task that settles the reply calls it with the outcome, and no task is woken.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import outcome
import structlog
import trio

log = structlog.get_logger("actors.actor")

ReplyCallback = Callable[[outcome.Outcome[Any]], object]
"""Called once with a reply's outcome (``outcome.Value`` or ``outcome.Error``)."""


class Reply:
    """The reply to one ``ask``, written once by the actor and read once by the caller."""

    __slots__ = ("abandoned", "callback", "done", "error", "value", "waiter")

    def __init__(self) -> None:
        self.waiter: trio.lowlevel.Task | None = None
        self.callback: ReplyCallback | None = None
        self.done = False
        self.abandoned = False
        self.value: Any = None
        self.error: BaseException | None = None

    def succeed(self, value: Any) -> None:
        """Deliver ``value`` unless the slot is already settled or its caller gave up."""
        if self.done or self.abandoned:
            return
        self.done = True
        self.value = value
        # (_wake, inlined: every reply of every actor comes this way.)
        if self.callback is not None:
            self.call_back()
            return
        waiter = self.waiter
        if waiter is not None:
            self.waiter = None
            trio.lowlevel.reschedule(waiter)

    def fail(self, error: BaseException) -> None:
        """Deliver ``error`` unless the slot is already settled or its caller gave up."""
        if self.done or self.abandoned:
            return
        self.done = True
        self.error = error
        self._wake()

    def _wake(self) -> None:
        if self.callback is not None:
            self.call_back()
            return
        waiter = self.waiter
        if waiter is not None:
            self.waiter = None
            trio.lowlevel.reschedule(waiter)

    def call_back(self) -> None:
        """Hand the settled reply to its callback (once). As with asyncio's future callbacks,
        an exception from the callback is logged, not raised in the task that settled the
        reply: that is the actor's, which must not crash for its caller's bug."""
        callback = self.callback
        assert callback is not None
        self.callback = None
        error = self.error
        result: outcome.Outcome[Any] = (
            outcome.Value(self.value) if error is None else outcome.Error(error)
        )
        self.value = self.error = None
        try:
            callback(result)
        except Exception as exc:
            log.error(
                "actor_reply_callback_failed",
                error_type=type(exc).__name__,
                error=str(exc),
                exc_info=exc,
            )

    async def wait(self) -> Any:
        """Wait for the reply; raise the handler's exception if it failed.

        Cancelling this wait abandons the slot, so a late reply is dropped quietly.
        """
        if not self.done:
            self.waiter = trio.lowlevel.current_task()
            await trio.lowlevel.wait_task_rescheduled(self.abort)
        error = self.error
        if error is not None:
            self.error = None  # do not keep the traceback alive through the slot
            raise error
        value = self.value
        self.value = None
        return value

    def abort(self, _raise_cancel: trio.lowlevel.RaiseCancelT) -> trio.lowlevel.Abort:
        """The abort function of a caller parked for the reply (``wait_task_rescheduled``):
        the caller gave up, so a late reply is dropped."""
        self.waiter = None
        self.abandoned = True
        return trio.lowlevel.Abort.SUCCEEDED
