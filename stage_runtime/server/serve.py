"""Serving a :class:`PipelineApp` with hypercorn's trio worker, inside the caller's trio program.

Shutdown runs in three steps, so that no admitted request is lost:

1. :meth:`RunningServer.drain`: readiness turns ``503`` and new prefills are refused with
   ``503`` + ``Retry-After``; the listener stays open so load balancers can see the change;
2. :meth:`RunningServer.shutdown`: the listener closes, idle keep-alive connections are closed,
   and every in-flight request runs to completion; a prefill still running ``shutdown_timeout_s``
   later is cancelled and answered ``503`` (``shutdown_timeout``), so every admitted request
   gets an answer;
3. :func:`serve` returns; the caller then leaves ``open_pipeline``, which stops the stages.
"""

from __future__ import annotations

import logging
import signal
import socket
from collections.abc import AsyncIterator
from contextlib import ExitStack, asynccontextmanager
from functools import partial
from typing import TYPE_CHECKING, cast
from urllib.parse import urlsplit

import attrs
import structlog
import trio

from stage_runtime.errors import ConfigError, sole_exception
from stage_runtime.server.settings import ANSWER_MARGIN_S, ServerSettings

if TYPE_CHECKING:
    from hypercorn.config import Config
    from hypercorn.typing import ASGIFramework

    from stage_runtime.server.app import PipelineApp

__all__ = ["RunningServer", "open_server", "serve"]

log = structlog.get_logger(__name__)


@attrs.define(eq=False)
class RunningServer:
    """A server started by :func:`serve`: where it listens, and how to stop it."""

    app: PipelineApp
    """The application being served."""

    url: str
    """Base URL, e.g. ``"http://127.0.0.1:8000"`` (with the real port when bound to port 0)."""

    _shutdown_requested: trio.Event = attrs.field(alias="shutdown_requested")
    _cancel_scope: trio.CancelScope = attrs.field(alias="cancel_scope")
    _stopped: trio.Event = attrs.field(factory=trio.Event, init=False)

    @property
    def host(self) -> str:
        """The bound host."""
        return urlsplit(self.url).hostname or ""

    @property
    def port(self) -> int:
        """The bound port (the one the OS picked when binding port 0)."""
        return urlsplit(self.url).port or 0

    @property
    def stopped(self) -> bool:
        """Whether :func:`serve` has returned."""
        return self._stopped.is_set()

    @property
    def closing(self) -> bool:
        """Whether :meth:`shutdown` was called: the listener is closing or closed."""
        return self._shutdown_requested.is_set()

    def drain(self) -> None:
        """Refuse new prefills and fail readiness; keep serving in-flight and probe requests."""
        self.app.drain()

    def shutdown(self) -> None:
        """Drain, stop accepting connections, and let :func:`serve` return once in-flight
        requests are answered."""
        self.app.start_shutdown()
        self._shutdown_requested.set()

    def abort(self) -> None:
        """Stop at once: in-flight requests are cancelled and their connections dropped."""
        self.app.drain()
        self._cancel_scope.cancel()

    async def wait_stopped(self) -> None:
        """Wait until :func:`serve` has returned."""
        await self._stopped.wait()


def _parse_bind(bind: str) -> tuple[str, int]:
    host, sep, port = bind.rpartition(":")
    bracketed = host.startswith("[") and host.endswith("]")
    if ":" in host and not bracketed:
        msg = f"bind must put an IPv6 host in brackets, [HOST]:PORT (e.g. [::1]:8000), got {bind!r}"
        raise ConfigError(msg)
    host = host.removeprefix("[").removesuffix("]")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        msg = f"bind must be HOST:PORT with PORT in 0..65535, got {bind!r}"
        raise ConfigError(msg)
    return host, int(port)


def _listening_socket(host: str, port: int) -> socket.socket:
    """Bind the server's socket ourselves: hypercorn leaks its socket when ``bind()`` fails."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def _hypercorn_config(settings: ServerSettings) -> Config:
    from hypercorn.config import Config

    config = Config()
    config.graceful_timeout = settings.shutdown_timeout_s + ANSWER_MARGIN_S
    # Hypercorn's 5 s default equals httpx's keep-alive expiry: a request sent on a connection
    # idle for 5 s raced the server's close and was lost ("Server disconnected").
    config.keep_alive_timeout = settings.keep_alive_timeout_s
    config.backlog = settings.backlog
    # Hypercorn's own messages go to a stdlib logger; the application decides where they end up.
    config.errorlog = logging.getLogger("hypercorn.error")
    config.accesslog = None  # `request_served` is the access log
    # Hypercorn recycles a connection after 1,000 requests. Over HTTP/2 it closes the connection
    # as it admits the 1,001st stream, whose answer then never leaves (the client sees the
    # connection terminated, the app waits on a send that cannot complete). Nothing here needs
    # recycling, so it is off in practice.
    config.keep_alive_max_requests = 2**62
    return config


async def _serve_connections(
    app: PipelineApp,
    config: Config,
    sock: socket.socket,
    *,
    shutdown_trigger: trio.Event,
    task_status: trio.TaskStatus[str],
) -> None:
    """Serve HTTP on ``sock`` with hypercorn's trio connection handler until ``shutdown_trigger``.

    This is hypercorn's trio worker loop (``hypercorn.trio.serve``) with two differences. Each
    connection arms its keep-alive timeout without a task per request, and ends as soon as its
    client closes it (see :mod:`stage_runtime.server._connection`). An exception from one
    connection drops that connection only. Hypercorn's own loop lets it end the server, and its
    HTTP/2 code raises on body data for a stream already answered (hypercorn issue #329), so one
    HTTP/2 client could stop every other request. Served through ``hypercorn.trio.serve``
    instead, the server fails exactly the three tests that pin these two behaviours
    (``test_a_body_arriving_after_an_http2_answer_does_not_stop_the_server``, twice, and
    ``test_a_connection_the_client_closes_ends_at_once``); hence the private
    ``TCPServer``, ``WorkerContext`` and ``ASGIWrapper`` here, and the pin on hypercorn 0.18.
    The app needs no lifespan events. Once triggered: the listener closes, idle connections
    close, and connections still answering get ``config.graceful_timeout`` before they are
    cancelled; once no request is being answered, the remaining (idle) connections are closed at
    once.
    """
    from hypercorn.app_wrappers import ASGIWrapper
    from hypercorn.trio.worker_context import WorkerContext
    from hypercorn.typing import ConnectionState

    from stage_runtime.server._connection import Connection

    # PipelineApp speaks ASGI 3 with plain mappings, not hypercorn's TypedDicts.
    wrapped = ASGIWrapper(cast("ASGIFramework", app))
    context = WorkerContext(None)

    async def connection(stream: trio.SocketStream) -> None:
        # Typed for TLS streams; hypercorn serves plain ones too (it checks which it got).
        tls = cast("trio.SSLStream[trio.SocketStream]", stream)
        try:
            await Connection(wrapped, config, context, ConnectionState({}), tls)
        except Exception as exc:  # that connection's failure (hypercorn closed its stream)
            cause = sole_exception(exc)
            log.warning(
                "connection_failed", error_type=type(cause).__name__, error=repr(cause)[:200]
            )

    sock.listen(config.backlog)
    listener = trio.SocketListener(trio.socket.from_stdlib_socket(sock))
    host, port = sock.getsockname()[:2]
    url = f"http://[{host}]:{port}" if sock.family == socket.AF_INET6 else f"http://{host}:{port}"
    async with trio.open_nursery() as connections:
        try:
            async with listener, trio.open_nursery() as accepting:
                accepting.start_soon(
                    partial(
                        trio.serve_listeners, connection, [listener], handler_nursery=connections
                    )
                )
                task_status.started(url)
                await shutdown_trigger.wait()
                accepting.cancel_scope.cancel()
        finally:
            await context.terminated.set()  # idle keep-alive connections close now
            connections.cancel_scope.deadline = trio.current_time() + config.graceful_timeout
            # Once no request is being answered, only idle connections are left: close them now.
            # (Hypercorn can leave a closing keep-alive connection waiting, which held the exit
            # up to the graceful timeout, past a 30 s container grace period.)
            await app.wait_quiet()
            connections.cancel_scope.cancel()


async def serve(
    app: PipelineApp,
    *,
    bind: str = "127.0.0.1:8000",
    handle_signals: bool = False,
    drain_grace_s: float = 0.0,
    task_status: trio.TaskStatus[RunningServer] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``app`` over HTTP until :meth:`RunningServer.shutdown` (or cancellation).

    Start it with ``server = await nursery.start(partial(serve, app, bind=...))``: ``start``
    returns once the socket listens, with the real URL (bind port ``0`` to let the OS pick one).
    A program that only serves can simply ``await serve(app, handle_signals=True)``.

    With ``handle_signals``, SIGINT/SIGTERM stop the server in steps: the first drains
    (readiness fails, new prefills get ``503``) and, ``drain_grace_s`` later, closes the
    listener and waits for in-flight requests; a signal during the grace period skips the rest of
    it; a signal after the listener closed aborts the in-flight requests. Signals are only
    handled in the main thread (trio's rule).

    Args:
        app: The application, from :func:`create_app`.
        bind: ``HOST:PORT`` to listen on.
        handle_signals: Shut down on SIGINT/SIGTERM as described above.
        drain_grace_s: With ``handle_signals``, how long readiness reports draining before the
            listener closes, so that a load balancer stops sending traffic first.
        task_status: Receives the :class:`RunningServer` once listening.

    Raises:
        ConfigError: ``bind`` is malformed, or hypercorn is not installed.
        OSError: the address cannot be bound.
    """
    host, port = _parse_bind(bind)
    try:
        import hypercorn.trio  # noqa: F401
    except ModuleNotFoundError as exc:  # pragma: no cover - depends on the installed extras
        msg = "serving needs the server extra: pip install 'stage-runtime[server]'"
        raise ConfigError(msg) from exc
    config = _hypercorn_config(app.settings)
    sock = _listening_socket(host, port)

    shutdown_requested = trio.Event()
    signal_scope = trio.CancelScope()
    server: RunningServer | None = None

    async def run_hypercorn(*, task_status: trio.TaskStatus[str]) -> None:
        try:
            await _serve_connections(
                app, config, sock, shutdown_trigger=shutdown_requested, task_status=task_status
            )
        finally:
            sock.close()
            signal_scope.cancel()  # the server is done: stop listening for signals

    with ExitStack() as stack:
        stack.callback(sock.close)  # on every way out, a failure to handle signals included
        # Installed before the socket listens, so that no signal can find the default handler.
        received = (
            stack.enter_context(trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM))
            if handle_signals
            else None
        )
        try:
            async with trio.open_nursery() as nursery:
                url: str = await nursery.start(run_hypercorn)
                server = RunningServer(
                    app=app,
                    url=url,
                    shutdown_requested=shutdown_requested,
                    cancel_scope=nursery.cancel_scope,
                )
                if received is not None:
                    nursery.start_soon(
                        _stop_on_signals, received, server, drain_grace_s, signal_scope
                    )
                log.info(
                    "server_started",
                    url=server.url,
                    max_inflight=app.settings.max_inflight,
                    keep_alive_timeout_s=app.settings.keep_alive_timeout_s,
                    backlog=app.settings.backlog,
                )
                task_status.started(server)
        finally:
            if server is not None:
                server._stopped.set()
                log.info("server_stopped", url=server.url)


async def _stop_on_signals(
    received: AsyncIterator[int],
    server: RunningServer,
    drain_grace_s: float,
    cancel_scope: trio.CancelScope,
) -> None:
    async def close_after_grace() -> None:
        await trio.sleep(drain_grace_s)
        server.shutdown()

    with cancel_scope:
        async with trio.open_nursery() as nursery:
            async for signum in received:
                name = signal.Signals(signum).name
                if not server.app.draining:
                    log.info("shutdown_requested", signal=name, drain_grace_s=drain_grace_s)
                    server.drain()
                    nursery.start_soon(close_after_grace)
                elif not server.closing:
                    log.info("shutdown_hastened", signal=name, inflight=server.app.inflight)
                    server.shutdown()
                else:
                    log.warning("shutdown_forced", signal=name, inflight=server.app.inflight)
                    server.abort()


@asynccontextmanager
async def open_server(
    app: PipelineApp, *, bind: str = "127.0.0.1:8000"
) -> AsyncIterator[RunningServer]:
    """Serve ``app`` for the duration of the block; leaving it shuts down gracefully.

    Example::

        async with open_pipeline(stages, reference_model_factory()) as pipeline:
            async with open_server(create_app(pipeline), bind="127.0.0.1:0") as server:
                ...  # talk to server.url

    Raises:
        ConfigError: ``bind`` is malformed, or hypercorn is not installed.
        OSError: the address cannot be bound.

    A failure to start is raised as itself, as :func:`open_pipeline
    <stage_runtime.pipeline.open_pipeline>` raises its own: not inside the exception groups of
    the nurseries it happened in, where ``except OSError`` would miss it.
    """
    _parse_bind(bind)
    started = False
    failure: BaseException | None = None
    try:
        async with trio.open_nursery() as nursery:
            server: RunningServer = await nursery.start(partial(serve, app, bind=bind))
            started = True
            try:
                yield server
            finally:
                server.shutdown()
    except BaseExceptionGroup as group:
        failure = sole_exception(group)
        if started or isinstance(failure, BaseExceptionGroup):
            raise
    if failure is not None:
        raise failure  # (outside the handler: with its own cause, not the group as context)
