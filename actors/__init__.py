"""actors: a small trio actor toolkit with single-owner state, backpressure and supervision.

One task owns an actor's state and handles one message at a time, so the state needs no lock::

    async with open_actor(Counter, name="counter") as counter:
        await counter.tell(2)
        total = await counter.ask(3)
"""

from __future__ import annotations

from actors.actor import (
    Actor,
    ActorRef,
    ActorStatistics,
    Asks,
    PendingReply,
    open_actor,
    spawn,
)
from actors.errors import ActorError, ActorStoppedError, RestartLimitError
from actors.supervision import RestartPolicy

__all__ = [
    "Actor",
    "ActorError",
    "ActorRef",
    "ActorStatistics",
    "ActorStoppedError",
    "Asks",
    "PendingReply",
    "RestartLimitError",
    "RestartPolicy",
    "open_actor",
    "spawn",
]
