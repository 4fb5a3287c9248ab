"""Restart policies: how often a crashed actor is rebuilt before supervision gives up."""

from __future__ import annotations

import math
from collections import deque
from typing import Any

import attrs

__all__ = ["RestartPolicy"]


def _restart_count(_instance: object, attribute: attrs.Attribute[Any], value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        msg = f"{attribute.name} must be an integer, got {value!r}"
        raise TypeError(msg)
    if value < 0:
        msg = f"{attribute.name} must be >= 0, got {value!r}"
        raise ValueError(msg)


def _seconds(attribute: attrs.Attribute[Any], value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        msg = f"{attribute.name} must be a number of seconds, got {value!r}"
        raise TypeError(msg)
    if isinstance(value, int) and value.bit_length() > _FLOAT_BITS:
        # Taken from trio's clock (a float), it would overflow at the first restart.
        msg = (
            f"{attribute.name} must be a number of seconds a float can hold, got an integer "
            f"of {value.bit_length():,} bits"
        )
        raise ValueError(msg)


_FLOAT_BITS = 1023
"""Bits of the largest integer magnitude a float holds (about 8.99e307 is 2**1023)."""


def _window(_instance: object, attribute: attrs.Attribute[Any], value: float) -> None:
    _seconds(attribute, value)
    if math.isnan(value):
        msg = f"{attribute.name} must be a number of seconds > 0, got nan"
        raise ValueError(msg)
    if value <= 0:  # (inf means "ever")
        msg = f"{attribute.name} must be > 0, got {value!r}"
        raise ValueError(msg)


def _backoff(_instance: object, attribute: attrs.Attribute[Any], value: float) -> None:
    _seconds(attribute, value)
    if not 0 <= value < math.inf:  # also refuses NaN
        msg = f"{attribute.name} must be >= 0 and finite, got {value!r}"
        raise ValueError(msg)


@attrs.frozen
class RestartPolicy:
    """Rebuild a crashed actor from its factory, up to a limit.

    An actor crashes when a handler raises while processing a ``tell`` (there is no caller to report
    to), when ``on_start`` raises, or when its factory raises. Under a policy the actor is rebuilt
    from its factory, so its state starts **fresh** (a cache actor comes back empty). Messages that
    were queued survive the restart; the message whose handler crashed is not retried. Crashes are
    counted in a sliding window of ``within_s`` seconds of ``trio.current_time()`` (virtual time in
    tests); the crash that would be restart number ``max_restarts + 1`` inside the window raises
    ``RestartLimitError`` into the owning nursery instead. An ``on_stop`` that raises is never
    restarted (the actor is stopping); its error reaches the owning nursery.

    Each crash is logged once with its traceback (``actor_message_failed`` or
    ``actor_hook_failed``), then ``actor_restarted`` or ``actor_restart_limit_reached`` names it
    as ``cause``.

    Example::

        RestartPolicy(max_restarts=3, within_s=60, backoff_s=0.5)
    """

    max_restarts: int = attrs.field(validator=_restart_count)
    """Restarts allowed inside any window of ``within_s`` seconds; ``0`` gives up at once."""

    within_s: float = attrs.field(validator=_window)
    """Length of the sliding window in which restarts are counted, in seconds."""

    backoff_s: float = attrs.field(default=0.0, validator=_backoff)
    """Pause before each restart, in seconds (``trio.sleep``, so virtual in tests)."""


@attrs.define(eq=False)
class _CrashWindow:
    """Crash times inside the policy's sliding window."""

    policy: RestartPolicy
    times: deque[float] = attrs.field(factory=deque)

    def record(self, now: float) -> bool:
        """Record a crash at ``now``; return whether a restart is still allowed."""
        self.times.append(now)
        horizon = now - self.policy.within_s
        while self.times and self.times[0] <= horizon:
            self.times.popleft()
        return len(self.times) <= self.policy.max_restarts

    @property
    def attempt(self) -> int:
        """Crashes inside the current window (the number of the restart about to happen)."""
        return len(self.times)
