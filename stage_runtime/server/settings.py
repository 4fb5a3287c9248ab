"""The HTTP server's limits and timeouts (no web framework needed to read or validate them)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Final

import attrs

from stage_runtime._validators import positive_int
from stage_runtime.errors import ConfigError

if TYPE_CHECKING:
    import trio

__all__ = ["ANSWER_MARGIN_S", "DISCONNECTS_EXTENSION", "Disconnects", "ServerSettings"]

DISCONNECTS_EXTENSION: Final = "stage_runtime.disconnects"
"""The ASGI scope extension :func:`~stage_runtime.server.serve` gives each HTTP/1 request: its
connection's :class:`Disconnects`, which cancels the scopes an answer registers once the client
hangs up, so that a prefill need not keep a task waiting for ``http.disconnect``."""


class Disconnects:
    """The answers in progress on one HTTP/1 connection: :meth:`watch` a cancel scope, and it is
    cancelled when the client goes (:meth:`close`, called as the connection's read loop ends),
    at once if it has gone already."""

    __slots__ = ("_scopes", "closed")

    def __init__(self) -> None:
        self._scopes: set[trio.CancelScope] = set()
        self.closed = False

    def watch(self, scope: trio.CancelScope) -> None:
        """Cancel ``scope`` when the client hangs up (now, if it has)."""
        if self.closed:
            scope.cancel()
        else:
            self._scopes.add(scope)

    def unwatch(self, scope: trio.CancelScope) -> None:
        """``scope`` is done: forget it."""
        self._scopes.discard(scope)

    def close(self) -> None:
        """The client has gone: cancel every scope watched, and any watched from now on."""
        self.closed = True
        for scope in self._scopes:
            scope.cancel()
        self._scopes.clear()


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
