"""Helpers that keep tests of actors short.

Example::

    async def test_counter_logs_its_name() -> None:
        with capture_actor_logs() as logs:
            async with open_actor(RecordingActor, name="rec") as ref:
                await ref.tell("hello")
                await wait_idle(ref)
        assert events_named(logs, "actor_stopped")[0]["actor"] == "rec"
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, MutableMapping
from contextlib import contextmanager
from typing import Any, TypeVar

import attrs
import structlog

from actors.actor import Actor, ActorRef

__all__ = ["LogEvent", "RecordingActor", "capture_actor_logs", "events_named", "wait_idle"]

LogEvent = MutableMapping[str, Any]
"""One captured event: the structlog event dict (``event``, ``log_level`` and the keys)."""

EventT = TypeVar("EventT", bound=Mapping[str, Any])


@contextmanager
def capture_actor_logs() -> Iterator[list[LogEvent]]:
    """Capture structlog events, keeping keys bound with contextvars (such as ``actor=``).

    ``structlog.testing.capture_logs()`` on its own drops contextvars-bound keys; this merges them
    first. Events are captured as dicts: ``exc_info`` keeps the exception object itself. Events
    of every level are captured, also when the program configured a level-filtering logger
    (``make_filtering_bound_logger(INFO)`` drops debug events before any processor sees them),
    except from loggers structlog cached before (``cache_logger_on_first_use=True``).
    """
    wrapper_class = structlog.get_config()["wrapper_class"]
    with structlog.testing.capture_logs(
        processors=[structlog.contextvars.merge_contextvars]
    ) as logs:
        structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(0))
        try:
            yield logs
        finally:
            structlog.configure(wrapper_class=wrapper_class)


def events_named(logs: Iterable[EventT], event: str) -> list[EventT]:
    """Return the captured events called ``event``, in order."""
    return [entry for entry in logs if entry.get("event") == event]


async def wait_idle(ref: ActorRef[Any, Any]) -> None:
    """Wait until the actor has handled every message sent to it before this call.

    A marker goes through the mailbox like any message (waiting for room if it is full) and the
    actor answers it itself; it is not passed to ``handle`` and not counted as processed.

    Raises:
        ActorStoppedError: The actor has stopped.
    """
    await ref._barrier()


@attrs.define(eq=False)
class RecordingActor(Actor[Any, Any]):
    """An actor that records every message it handles and replies with ``reply(message)``.

    Pass the class itself as a factory (``open_actor(RecordingActor, name=...)``) or an instance
    (``open_actor(RecordingActor(reply=str.upper), name=...)``) to read ``received`` afterwards.
    """

    reply: Callable[[Any], Any] | None = None
    """Computes the reply to each message; ``None`` replies ``None``."""

    received: list[Any] = attrs.field(factory=list)
    """Messages handled so far, in the order the actor received them."""

    def handle(self, message: Any) -> Any:
        """Record ``message`` and reply."""
        self.received.append(message)
        return None if self.reply is None else self.reply(message)
