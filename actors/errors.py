"""Errors raised by the actor toolkit.

``ActorError`` is the one base users catch; channel misuse keeps trio's own errors
(``trio.WouldBlock`` from ``tell_nowait``, for instance).
"""

from __future__ import annotations

__all__ = ["ActorError", "ActorStoppedError", "RestartLimitError"]


class ActorError(Exception):
    """Base class of every error the actor toolkit raises itself."""


class ActorStoppedError(ActorError):
    """The actor has stopped, or stopped before it replied.

    Raised by ``ask``/``tell``/``tell_nowait`` on a stopped (or stopping) actor, and by a pending
    ``ask`` whose message was dropped because the actor stopped without draining, crashed or was
    cancelled.
    """


class RestartLimitError(ActorError):
    """Supervision gave up: the actor crashed more often than its ``RestartPolicy`` allows.

    The last crash is the ``__cause__``.
    """
