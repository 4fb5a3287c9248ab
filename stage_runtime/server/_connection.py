"""One HTTP connection: hypercorn's trio ``TCPServer``, with a cheaper keep-alive timer, and
each HTTP/1 answer written in one send.

Imported only once hypercorn is known to be installed (it is an optional dependency).

Hypercorn arms a connection's keep-alive timeout with its ``TrioSingleTask``: each time the
connection turns idle (after every answer) it starts a new task and waits for it to start, and
each time a request comes it cancels that task, under a lock both times. That costs about 65 us
of CPU per request (``restart`` plus ``stop``, measured alone), some 6% of what HTTP adds to a
prefill. Here one task per connection watches a cancel scope whose deadline the requests move:
``now + keep_alive_timeout`` while idle, never while a request is being answered.

Hypercorn writes an answer's head and its body in two sends: two syscalls and, for a small
answer, two TCP segments. Here the head waits for the app's first body message (as ASGI allows)
or the connection's close, so a small answer goes in one send; about 0.1 ms of server CPU per
request, measured with the two servers side by side. The connection reads without a timeout
scope per read when no read timeout is set (the server sets none).

The behaviour is hypercorn's: an idle connection closes at its keep-alive timeout, or at once
when the server stops (the worker context's ``terminated`` event); a connection answering a
request when the server stops closes once that answer is sent. The watcher also ends with the
connection's read loop, so a connection the client closed does not wait for it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import cast

import trio
from hypercorn.config import Config
from hypercorn.events import Closed, Event, RawData
from hypercorn.protocol.events import Event as StreamEvent
from hypercorn.protocol.events import Response
from hypercorn.protocol.h11 import H11Protocol
from hypercorn.trio.tcp_server import MAX_RECV, TCPServer
from hypercorn.trio.worker_context import TrioSingleTask, WorkerContext
from hypercorn.typing import (
    AppWrapper,
    ASGIReceiveCallable,
    ASGISendCallable,
    ASGISendEvent,
    LifespanState,
    Scope,
    TaskGroup,
)

from stage_runtime.server.settings import DISCONNECTS_EXTENSION, Disconnects

__all__ = ["Connection"]


class _KeepAliveTimer(TrioSingleTask):
    """Stands in for a connection's ``TrioSingleTask``: ``restart`` means "idle from now on",
    ``stop`` means "answering a request" (the only ways ``TCPServer`` uses it)."""

    def __init__(self, connection: Connection) -> None:
        super().__init__()
        self._connection = connection
        self._scope = trio.CancelScope()
        self._started = False
        self._busy = False
        self._stopping = False
        """The server stops: idle from now on means closed."""
        self._done = False
        """The connection ended on its own (its read loop returned): nothing left to close."""

    async def restart(self, task_group: TaskGroup, action: Callable[..., object]) -> None:
        """The connection is idle (``action``, hypercorn's timeout task, is not used)."""
        self._busy = False
        if self._stopping:
            self._scope.deadline = -math.inf
        else:
            self._scope.deadline = trio.current_time() + self._connection.config.keep_alive_timeout
        if not self._started:
            self._started = True
            task_group.spawn(self._watch)

    async def stop(self) -> None:
        """A request is being answered: no idle timeout until it is."""
        self._busy = True
        self._scope.deadline = math.inf

    def finish(self) -> None:
        """The connection ended: the watcher returns without closing anything."""
        self._done = True
        self._scope.cancel()

    async def _watch(self) -> None:
        with self._scope:
            await self._connection.context.terminated.wait()
            self._stopping = True
            if self._busy:
                await trio.sleep_forever()  # until the answer is sent (restart expires the scope)
        if self._done:
            return
        with trio.CancelScope(shield=True):
            await self._connection._initiate_server_close()


class _WithDisconnects:
    """The app of one connection: each HTTP/1 request's scope names the connection's
    :class:`Disconnects` (HTTP/2 streams end on their own, and keep ``http.disconnect``), and
    each body message the app sends writes the answer's head if it is still held (hypercorn
    turns an empty body message into no event at all: an app that sends one to push the head
    out, before a slow body, would otherwise wait for the body)."""

    def __init__(self, app: AppWrapper, connection: Connection) -> None:
        self._app = app
        self._connection = connection

    async def __call__(
        self,
        scope: Scope,
        receive: ASGIReceiveCallable,
        send: ASGISendCallable,
        sync_spawn: Callable[..., object],
        call_soon: Callable[..., object],
    ) -> None:
        if scope["type"] == "http" and scope["http_version"] in ("1.0", "1.1"):
            connection = self._connection
            extensions = cast("dict[str, object]", scope["extensions"])
            extensions[DISCONNECTS_EXTENSION] = connection.disconnects
            answer = send

            async def send_flushing(message: ASGISendEvent) -> None:
                await answer(message)
                if connection._held and message["type"] == "http.response.body":
                    await connection._flush()

            send = send_flushing
        await self._app(scope, receive, send, sync_spawn, call_soon)


class Connection(TCPServer):
    """Hypercorn's trio connection handler with :class:`_KeepAliveTimer` as its idle timer."""

    def __init__(
        self,
        app: AppWrapper,
        config: Config,
        context: WorkerContext,
        state: LifespanState,
        stream: trio.SSLStream[trio.SocketStream],
    ) -> None:
        self.disconnects = Disconnects()
        """Cancels the answers in progress once the client hangs up (see
        :data:`~stage_runtime.server.settings.DISCONNECTS_EXTENSION`)."""
        super().__init__(_WithDisconnects(app, self), config, context, state, stream)
        self.idle_task = _KeepAliveTimer(self)
        self._holding = False
        """A response's head is being written: keep it for the first write of its body."""
        self._held = b""
        """The head kept back, if any."""

    async def protocol_send(self, event: Event) -> None:
        if type(event) is RawData:
            if self._holding:
                self._held += event.data
                return
            if self._held:
                event = RawData(self._held + event.data)
                self._held = b""
            elif not event.data:
                # The end of a body whose length the headers gave: h11 has nothing to write,
                # and hypercorn would still take the send lock and make an empty send.
                return
        elif self._held:
            await self._flush()
        await super().protocol_send(event)

    async def _flush(self) -> None:
        held, self._held = self._held, b""
        await super().protocol_send(RawData(held))

    async def _close(self) -> None:
        if self._held:
            # An answer with a head and no body yet, its stream already closed (the client
            # half-closed; hypercorn then skips the stream's end): the head still goes out.
            await self._flush()
        await super()._close()

    def _hold_heads(self) -> None:
        """Write each HTTP/1 response's head together with its body (or its end): one send, and
        one TCP segment for a small answer, where hypercorn makes two."""
        inner = self.protocol.protocol
        if not isinstance(inner, H11Protocol):
            return
        send_event = inner.stream_send

        async def stream_send(event: StreamEvent) -> None:
            # Only the head is held here: the next write takes it along (protocol_send), as
            # does any other event of the connection, a body message (_WithDisconnects) or
            # the close (_close).
            if type(event) is Response and event.status_code >= 200:
                self._holding = True
                try:
                    await send_event(event)
                finally:
                    self._holding = False
            else:
                await send_event(event)

        inner.stream_send = stream_send  # type: ignore[method-assign]

    async def _read_data(self) -> None:
        try:
            await self._read_loop()
        finally:
            # The read loop ends when the client closes (or the connection fails): it is when
            # hypercorn tells an HTTP/1 app ``http.disconnect``.
            self.disconnects.close()
            timer = self.idle_task
            assert isinstance(timer, _KeepAliveTimer)
            timer.finish()

    async def _read_loop(self) -> None:
        """Hypercorn's read loop, with a timeout scope around each read only when a read timeout
        is set (the server sets none: an idle connection closes at the keep-alive timeout). An
        unbounded ``fail_after`` per read cost about 2% of the server's CPU per request."""
        self._hold_heads()
        timeout = self.config.read_timeout
        receive = self.stream.receive_some
        handle = self.protocol.handle
        while True:
            try:
                if not timeout:  # (hypercorn reads 0 as no timeout too)
                    data = await receive(MAX_RECV)
                else:
                    with trio.fail_after(timeout):
                        data = await receive(MAX_RECV)
            except (trio.ClosedResourceError, trio.BrokenResourceError, trio.TooSlowError):
                break
            await handle(RawData(bytes(data)))
            if not data:
                break
        await handle(Closed())
