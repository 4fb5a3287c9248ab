"""The HTTP server's limits and timeouts (no web framework needed to read or validate them)."""

from __future__ import annotations

from typing import Any, Final

import attrs

from stage_runtime._validators import positive_int
from stage_runtime.errors import ConfigError

__all__ = ["ANSWER_MARGIN_S", "ServerSettings"]

ANSWER_MARGIN_S: Final = 2.0
"""Hypercorn's own shutdown timeout exceeds the app's by this much, so that the ``503`` answers
of prefills cut off at ``shutdown_timeout_s`` are written before hypercorn drops connections
(and an answer being written at the shutdown deadline gets this long to leave)."""


def _positive(_instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        msg = f"{attribute.name} must be a number > 0, got {value!r}"
        raise ConfigError(msg)


@attrs.frozen(kw_only=True)
class ServerSettings:
    """Limits and timeouts of the HTTP server."""

    max_inflight: int = attrs.field(default=64, validator=positive_int)
    """Prefills admitted at once (running or queued in the pipeline); more get ``503``."""

    max_body_bytes: int = attrs.field(default=1 << 20, validator=positive_int)
    """Largest accepted request body; larger ones get ``413`` before they are fully read."""

    retry_after_s: int = attrs.field(default=1, validator=positive_int)
    """``Retry-After`` sent with ``503`` answers."""

    shutdown_timeout_s: float = attrs.field(default=30.0, validator=_positive)
    """How long a graceful shutdown lets in-flight prefills run; those still running then are
    cancelled and answered ``503`` (``"error": "shutdown_timeout"``)."""

    body_timeout_s: float = attrs.field(default=30.0, validator=_positive)
    """How long a client may take to send a prefill's body; a slower or stalled one is answered
    ``408`` (``"error": "body_timeout"``) and its connection closed, so stalled uploads cannot
    pile up."""

    keep_alive_timeout_s: float = attrs.field(default=75.0, validator=_positive)
    """How long an idle keep-alive connection stays open. Longer than clients keep theirs
    (httpx: 5 s) so that a client never reuses a connection the server is closing under it; 75 s
    as nginx."""

    backlog: int = attrs.field(default=1024, validator=positive_int)
    """Connections the kernel queues before the server accepts them (capped by
    ``net.core.somaxconn``); a burst of simultaneous connects beyond it is refused or retried."""
