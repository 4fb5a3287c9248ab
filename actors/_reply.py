"""One-shot reply slot for ``ask``: cheaper than a memory channel pair per request.

The caller parks its own task with ``trio.lowlevel.wait_task_rescheduled``; the actor stores the
result and reschedules it. Everything runs in one trio thread, so the three outcomes (reply
delivered, caller cancelled, actor stopped) are decided without locks: whichever comes first wins
and the others become no-ops. A reply that arrives after the caller gave up is dropped.
"""

from __future__ import annotations

from typing import Any

import trio


class Reply:
    """The reply to one ``ask``, written once by the actor and read once by the caller."""

    __slots__ = ("abandoned", "done", "error", "value", "waiter")

    def __init__(self) -> None:
        self.waiter: trio.lowlevel.Task | None = None
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
        self._wake()

    def fail(self, error: BaseException) -> None:
        """Deliver ``error`` unless the slot is already settled or its caller gave up."""
        if self.done or self.abandoned:
            return
        self.done = True
        self.error = error
        self._wake()

    def _wake(self) -> None:
        waiter = self.waiter
        if waiter is not None:
            self.waiter = None
            trio.lowlevel.reschedule(waiter)

    async def wait(self) -> Any:
        """Wait for the reply; raise the handler's exception if it failed.

        Cancelling this wait abandons the slot, so a late reply is dropped quietly.
        """
        if not self.done:
            self.waiter = trio.lowlevel.current_task()
            await trio.lowlevel.wait_task_rescheduled(self._abort)
        error = self.error
        if error is not None:
            self.error = None  # do not keep the traceback alive through the slot
            raise error
        value = self.value
        self.value = None
        return value

    def _abort(self, _raise_cancel: trio.lowlevel.RaiseCancelT) -> trio.lowlevel.Abort:
        self.waiter = None
        self.abandoned = True
        return trio.lowlevel.Abort.SUCCEEDED
