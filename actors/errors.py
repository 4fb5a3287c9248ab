"""Errors raised by the actor toolkit.

``ActorError`` is the one base users catch; channel misuse keeps trio's own errors
(``trio.WouldBlock`` from ``tell_nowait``, for instance).
"""

from __future__ import annotations

import math

import trio

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


def being_cancelled() -> bool:
    """Whether a cancel scope around the running trio task is cancelled (and not shielded):
    a ``trio.Cancelled`` raised now is a real cancellation."""
    return trio.current_effective_deadline() == -math.inf


def stray_cancelled_error(who: str) -> RuntimeError:
    """The error for a ``trio.Cancelled`` that ``who`` raised while nothing was cancelled (one
    kept from an earlier cancellation and raised again): a bug, to be handled like any other
    exception, where letting it through would end the task without a word."""
    return RuntimeError(
        f"{who} raised trio.Cancelled while nothing around it was cancelled (a Cancelled kept "
        "from an earlier cancellation and raised again?)"
    )
