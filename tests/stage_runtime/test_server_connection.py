"""The server's connection handler (hypercorn's, with each HTTP/1 answer in one send) against
small ASGI apps, over real sockets: the head is held only until the app sends a body message,
and it is never lost."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trio
import trio.testing
from hypercorn.app_wrappers import ASGIWrapper
from hypercorn.config import Config
from hypercorn.trio.worker_context import WorkerContext
from hypercorn.typing import ConnectionState

from stage_runtime.server._connection import Connection

TIMEOUT_S = 20
_Send = Callable[[dict[str, Any]], Awaitable[None]]
_App = Callable[[dict[str, Any], Any, _Send], Awaitable[None]]
_HEAD = (b"content-type", b"text/plain")


@asynccontextmanager
async def serving(app: _App, config: Config | None = None) -> AsyncIterator[trio.SocketStream]:
    """``app`` behind one :class:`Connection`; yields the client's end of the connection."""
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    wrapped = ASGIWrapper(app)  # type: ignore[arg-type]
    context = WorkerContext(None)

    async def handle(stream: trio.SocketStream) -> None:
        await Connection(wrapped, config or Config(), context, ConnectionState({}), stream)  # type: ignore[arg-type]

    async with trio.open_nursery() as nursery:
        await nursery.start(trio.serve_listeners, handle, listeners)
        client = await trio.open_tcp_stream("127.0.0.1", port)
        async with client:
            yield client
        nursery.cancel_scope.cancel()


async def _read_until(stream: trio.SocketStream, marker: bytes) -> bytes:
    data = b""
    while marker not in data:
        chunk = await stream.receive_some()
        if not chunk:
            break
        data += chunk
    return data


async def test_an_empty_body_message_sends_the_head_before_a_slow_body() -> None:
    """ASGI apps send an empty ``more_body`` message to push the head out before a slow body
    (hypercorn makes no event of it): the head goes at once, as hypercorn's own handler sends."""
    release = trio.Event()

    async def app(scope: dict[str, Any], receive: Any, send: _Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": [_HEAD]})
        await send({"type": "http.response.body", "body": b"", "more_body": True})
        await release.wait()
        await send({"type": "http.response.body", "body": b"late"})

    with trio.fail_after(TIMEOUT_S):
        async with serving(app) as client:
            await client.send_all(b"GET / HTTP/1.1\r\nHost: t\r\n\r\n")
            head = await _read_until(client, b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 200 ")
            assert not release.is_set()  # the head came while the body was still held back
            release.set()
            rest = await _read_until(client, b"late")
            assert b"late" in head + rest


async def test_a_head_without_a_body_still_goes_out_when_the_client_half_closed() -> None:
    """The client sends its request and closes its side; the app answers with a head and no
    body. Hypercorn then skips the stream's end: the held head is written as the connection
    closes, not dropped."""

    async def app(scope: dict[str, Any], receive: Any, send: _Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": [_HEAD]})
        while (await receive())["type"] != "http.disconnect":
            pass

    with trio.fail_after(TIMEOUT_S):
        async with serving(app) as client:
            await client.send_all(b"GET / HTTP/1.1\r\nHost: t\r\n\r\n")
            await client.send_eof()
            answer = await _read_until(client, b"\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 200 ")


@pytest.mark.parametrize("read_timeout", [None, 0])
async def test_no_read_timeout_means_none_whether_unset_or_zero(read_timeout: int | None) -> None:
    """As in hypercorn, a read timeout of 0 is no timeout (not an immediate one)."""

    async def app(scope: dict[str, Any], receive: Any, send: _Send) -> None:
        headers = [_HEAD, (b"content-length", b"2")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": b"ok"})

    config = Config()
    config.read_timeout = read_timeout
    with trio.fail_after(TIMEOUT_S):
        async with serving(app, config) as client:
            await client.send_all(b"GET / HTTP/1.1\r\nHost: t\r\n\r\n")
            answer = await _read_until(client, b"ok")
    assert answer.startswith(b"HTTP/1.1 200 ")
    assert answer.endswith(b"ok")
