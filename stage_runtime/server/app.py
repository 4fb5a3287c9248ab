"""The HTTP application that embeds one pipeline: Starlette routes behind two ASGI middlewares.

:class:`PipelineApp` is an ASGI application. Inside, a Starlette application routes five
endpoints (:attr:`PipelineApp.routes`) behind two pure-ASGI middlewares: one bounds every body a
client sends (``max_body_bytes``: ``413``), the other accounts for each request (responses by
route and status, a ``request_served`` event, JSON ``500`` answers for bugs, a bounded write of
each answer, a client that hung up). Mount the app in your own Starlette or FastAPI app
(``Mount("/pipeline", app=create_app(pipeline))``) to serve the pipeline next to your routes.

Routes:

``POST /v1/prefill``
    ``{"tokens": [...] | "text": "...", "session_id": "...", "request_id": "...",
    "cache_salt": "..."}`` (``request_id`` and ``cache_salt`` optional) →
    ``{"request_id", "session_id", "tokens", "stages": [...], "elapsed_s"}``. Without a
    ``request_id`` the server generates ``http-<n>``, so every log line names the request.
``GET /v1/stats``
    Per-stage cache and mailbox statistics (the cache's ``accounting``: misses by reason,
    restored tokens, resident vs unique-prefix bytes), plus the server's own counters.
``GET /healthz``
    Liveness: the process answers.
``GET /readyz``
    Readiness: ``200`` while the pipeline runs and the server is not draining, else ``503``.
``GET /metrics``
    The same counters for Prometheus (written by ``prometheus_client``: the text format, or
    OpenMetrics when the ``Accept`` header asks for it).
"""

from __future__ import annotations

import itertools
import json
import math
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator, Mapping, MutableMapping, Sequence
from typing import TYPE_CHECKING, Any, Final, Protocol

import attrs
import numpy as np
import numpy.typing as npt
import structlog
import trio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from stage_runtime.errors import PipelineStoppedError, shown
from stage_runtime.pipeline import context_tokens
from stage_runtime.server.metrics import MetricFamily, MetricsExporter, MetricType, Sample
from stage_runtime.server.requests import (
    InvalidRequestError,
    PrefillBody,
    parse_prefill_request,
)
from stage_runtime.server.settings import (
    ANSWER_MARGIN_S,
    DISCONNECTS_EXTENSION,
    Disconnects,
    ServerSettings,
)
from stage_runtime.server.tokenizer import ByteTokenizer, NoTokenizer, TextTokenizer

if TYPE_CHECKING:
    from stage_runtime.cache_actor import CacheStats
    from stage_runtime.config import StageConfig
    from stage_runtime.pipeline import PipelineStats, PrefillResult

__all__ = ["PipelineApp", "ServedPipeline", "ServerSettings", "create_app"]

log = structlog.get_logger(__name__)

TOP_TOKENS: Final = 5
"""Next-token ids a ``/v1/prefill`` answer lists (``top_tokens``) when the model gives logits."""

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

CLIENT_CLOSED_REQUEST: Final = 499
"""Status logged (never sent) for a request whose client hung up first (nginx's convention)."""

_PROBE_PATHS: Final = frozenset({"/healthz", "/readyz", "/metrics"})


class ServedPipeline(Protocol):
    """What the app needs from a pipeline; :class:`stage_runtime.Pipeline` provides it."""

    @property
    def draining(self) -> bool:
        """Whether the pipeline has started to shut down."""
        ...

    @property
    def stage_configs(self) -> Sequence[StageConfig]:
        """The stages' configurations, in pipeline order."""
        ...

    async def prefill(
        self,
        tokens: npt.NDArray[np.int32],
        *,
        session_id: str,
        request_id: str | None = None,
        cache_salt: str | None = None,
    ) -> PrefillResult:
        """Run one prompt through every stage."""
        ...

    async def statistics(self) -> PipelineStats:
        """Per-stage cache and mailbox statistics."""
        ...


class _Answer(Response):
    """A JSON (or metrics) response carrying the fields its ``request_served`` event logs."""

    def __init__(
        self,
        status: int,
        body: bytes,
        *,
        media_type: str = "application/json",
        headers: Mapping[str, str] | None = None,
        log_fields: Mapping[str, object] | None = None,
    ) -> None:
        super().__init__(content=body, status_code=status, media_type=media_type, headers=headers)
        self.log_fields: dict[str, object] = dict(log_fields or {})


def _json(status: int, document: object, **headers: str) -> _Answer:
    body = json.dumps(document, separators=(",", ":")).encode()
    return _Answer(status, body, headers=headers)


def _error(
    status: int,
    error: str,
    message: str,
    *,
    field: str | None = None,
    headers: Mapping[str, str] | None = None,
) -> _Answer:
    body = json.dumps({"error": error, "field": field, "message": message}, separators=(",", ":"))
    log_fields: dict[str, object] = {"error": error}
    if field is not None:
        log_fields["field"] = field
    return _Answer(status, body.encode(), headers=headers, log_fields=log_fields)


_LOG_FIELDS: Final = "stage_runtime.log_fields"
"""Scope key under which an endpoint leaves its answer's log fields for the accounting."""


class _ShuttingDownError(Exception):
    """A prefill's body was still arriving when the shutdown started: it is not admitted."""


class _ClientDisconnectedError(Exception):
    """The client hung up before the response was ready."""

    def __init__(self, log_fields: Mapping[str, object] | None = None) -> None:
        super().__init__("client disconnected")
        self.log_fields = dict(log_fields or {})


@attrs.define(eq=False)
class PipelineApp:
    """ASGI application serving one running pipeline (build it with :func:`create_app`).

    The app does not own the pipeline: whoever opened it closes it. :func:`serve` returns only
    once in-flight requests are answered, so leaving ``open_pipeline`` after ``serve`` stops the
    stages in the right order.
    """

    pipeline: ServedPipeline
    """The pipeline requests run on."""

    settings: ServerSettings = attrs.field(factory=ServerSettings)
    """Limits and timeouts."""

    tokenizer: TextTokenizer = attrs.field(factory=ByteTokenizer)
    """Tokenizer for the ``"text"`` field."""

    _draining: bool = attrs.field(default=False, init=False)
    _inflight: int = attrs.field(default=0, init=False)
    _responses: Counter[tuple[str, int]] = attrs.field(factory=Counter, init=False)
    _rejected: Counter[str] = attrs.field(factory=Counter, init=False)
    _request_ids: Iterator[int] = attrs.field(factory=itertools.count, init=False)
    _prefill_count: int = attrs.field(default=0, init=False)
    _prefill_seconds: float = attrs.field(default=0.0, init=False)
    _prefill_tokens: int = attrs.field(default=0, init=False)
    _restored_tokens: Counter[str] = attrs.field(factory=Counter, init=False)
    _computed_tokens: Counter[str] = attrs.field(factory=Counter, init=False)
    _shutdown_deadline: float = attrs.field(default=math.inf, init=False)
    _prefill_deadlines: set[trio.CancelScope] = attrs.field(factory=set, init=False)
    _dropped: int = attrs.field(default=0, init=False)
    _body_reads: set[trio.CancelScope] = attrs.field(factory=set, init=False)
    """Scopes of the bodies being read: a shutdown cuts them short (not admitted yet)."""
    _sends: set[trio.CancelScope] = attrs.field(factory=set, init=False)
    """Scopes of the answers being written: a client that does not take one within
    ``body_timeout_s`` (or by the shutdown deadline) loses it."""
    _active: int = attrs.field(default=0, init=False)
    """HTTP requests being handled (any route)."""
    _quiet: trio.Event | None = attrs.field(default=None, init=False)
    _exporter: MetricsExporter = attrs.field(factory=MetricsExporter, init=False)
    _starlette: Starlette | None = attrs.field(default=None, init=False)
    _prefill_route: _ASGIApp | None = attrs.field(default=None, init=False)
    """``POST /v1/prefill`` behind the same middlewares, without Starlette's router."""
    _answer_deadline: float = attrs.field(default=math.inf, init=False)
    """The shutdown deadline plus :data:`ANSWER_MARGIN_S`: no answer is written after it."""

    @property
    def draining(self) -> bool:
        """Whether :meth:`drain` was called: readiness fails and new prefills get ``503``."""
        return self._draining

    @property
    def ready(self) -> bool:
        """Whether the server takes new prefills (pipeline running, nobody draining)."""
        return not self._draining and not self.pipeline.draining

    @property
    def inflight(self) -> int:
        """Prefills admitted and not yet answered."""
        return self._inflight

    @property
    def max_tokens(self) -> int:
        """Longest accepted prompt: the smallest context size among the stages."""
        return context_tokens(self.pipeline.stage_configs)

    async def wait_quiet(self) -> None:
        """Return once no HTTP request is being handled (at once if none is).

        Quiet must last a few scheduler turns: hypercorn starts a parsed request's task with
        ``start_soon``, so a request can be on its way without being counted yet."""
        while True:
            while self._active:
                if self._quiet is None:
                    self._quiet = trio.Event()
                await self._quiet.wait()
            for _ in range(3):
                await trio.lowlevel.checkpoint()
            if not self._active:
                return

    def drain(self) -> None:
        """Start draining: readiness reports it, new prefills get ``503``, in-flight ones finish."""
        if not self._draining:
            self._draining = True
            log.info("server_drain_started", inflight=self._inflight)

    def start_shutdown(self) -> None:
        """Drain, and give in-flight prefills ``shutdown_timeout_s`` more to finish.

        A prefill still running at that deadline is cancelled and its client answered ``503``
        with ``Retry-After`` (``"error": "shutdown_timeout"``), so no admitted request goes
        unanswered. Calling it again keeps the first deadline.
        """
        self.drain()
        if self._shutdown_deadline == math.inf:
            self._shutdown_deadline = trio.current_time() + self.settings.shutdown_timeout_s
            log.info(
                "server_shutdown_started",
                inflight=self._inflight,
                shutdown_timeout_s=self.settings.shutdown_timeout_s,
            )
            for scope in self._prefill_deadlines:
                scope.deadline = self._shutdown_deadline
            for scope in self._body_reads:
                scope.cancel()
            # An answer written from now on gets ANSWER_MARGIN_S to leave (its own deadline,
            # set as it starts), and none past the margin after the shutdown deadline, when
            # hypercorn drops the connections; one being written now gets the margin from now.
            self._answer_deadline = self._shutdown_deadline + ANSWER_MARGIN_S
            stuck = trio.current_time() + ANSWER_MARGIN_S
            for scope in self._sends:  # a small JSON answer leaves in well under that
                scope.deadline = min(scope.deadline, stuck)

    @property
    def routes(self) -> list[Route]:
        """The five endpoints as Starlette routes (what :meth:`__call__` serves behind its
        middlewares; mount the app itself rather than these to keep the limits and accounting)."""
        return [
            Route("/v1/prefill", self._endpoint(self._prefill), methods=["POST"]),
            Route("/v1/stats", self._endpoint(self._stats), methods=["GET"]),
            Route("/healthz", self._endpoint(self._healthz), methods=["GET"]),
            Route("/readyz", self._endpoint(self._readyz), methods=["GET"]),
            Route("/metrics", self._endpoint(self._metrics), methods=["GET"]),
        ]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The ASGI entry point."""
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
        elif scope["type"] == "http":
            if scope["method"] == "POST" and _route_path(scope) == "/v1/prefill":
                # The hot route goes straight through the same two middlewares: Starlette's
                # router and its error and exception layers cost about 90 us of CPU per request
                # and do nothing for it (the accounting middleware answers an error with a JSON
                # 500; the route raises no HTTPException).
                if self._prefill_route is None:
                    self._prefill_route = self._middlewares(self._direct(self._prefill))
                await self._prefill_route(scope, receive, send)
                return
            if self._starlette is None:
                self._starlette = Starlette(
                    routes=self.routes,
                    middleware=[
                        Middleware(_ServedRequests, served=self),
                        Middleware(_BodyLimit, max_bytes=self.settings.max_body_bytes),
                    ],
                    exception_handlers={HTTPException: self._http_exception},
                )
            await self._starlette(scope, receive, send)
        # Other scope types (websocket) are not served; returning closes them.

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                self.drain()
                await send({"type": "lifespan.shutdown.complete"})
                return

    @property
    def dropped(self) -> int:
        """Requests cancelled before they were answered (a forced shutdown), each logged as
        ``request_dropped``; a graceful shutdown drops none."""
        return self._dropped

    def _middlewares(self, app: _ASGIApp) -> _ASGIApp:
        """``app`` behind the middlewares every route has (outermost first, as in Starlette)."""
        return _ServedRequests(_BodyLimit(app, max_bytes=self.settings.max_body_bytes), self)

    def _direct(self, handler: Callable[[Request], Awaitable[_Answer]]) -> _ASGIApp:
        """``handler`` as a plain ASGI app: what Starlette's route does with its endpoint."""
        endpoint = self._endpoint(handler)

        async def app(scope: Scope, receive: Receive, send: Send) -> None:
            answer = await endpoint(Request(scope, receive, send))
            await answer(scope, receive, send)

        return app

    def _endpoint(
        self, handler: Callable[[Request], Awaitable[_Answer]]
    ) -> Callable[[Request], Awaitable[_Answer]]:
        """A Starlette endpoint leaving its answer's log fields where the accounting reads them."""

        async def endpoint(request: Request) -> _Answer:
            answer = await handler(request)
            request.scope[_LOG_FIELDS] = answer.log_fields
            return answer

        return endpoint

    async def _http_exception(self, request: Request, exc: Exception) -> Response:
        """Starlette's 404 and 405, as JSON errors naming what was wrong."""
        assert isinstance(exc, HTTPException)
        path: str = request.scope["path"]
        if exc.status_code == 405:
            allowed = _ROUTES[_route_path(request.scope)]
            if "GET" in allowed:
                allowed = (*allowed, "HEAD")
            message = f"method must be {' or '.join(allowed)} for {path}, got {request.method}"
            answer = _error(
                405, "method_not_allowed", message, headers={"allow": ", ".join(allowed)}
            )
        elif exc.status_code == 404:
            quoted = path if len(path) <= 200 else f"{path[:200]}... ({len(path):,} characters)"
            answer = _error(
                404, "not_found", f"path must be one of {', '.join(_ROUTES)}, got {quoted}"
            )
        else:
            answer = _error(exc.status_code, "http_error", exc.detail)
        request.scope[_LOG_FIELDS] = answer.log_fields
        return answer

    async def _stats(self, request: Request) -> _Answer:
        return _json(200, await self.stats_document())

    async def _healthz(self, request: Request) -> _Answer:
        return _json(200, {"status": "ok"})

    async def _readyz(self, request: Request) -> _Answer:
        if self.ready:
            return _json(200, {"status": "ready"})
        return _json(503, {"status": "draining"}, **{"retry-after": self._retry_after})

    async def _metrics(self, request: Request) -> _Answer:
        body, content_type = await self.metrics(request.headers.get("accept", ""))
        return _Answer(200, body, media_type=content_type)

    @property
    def _retry_after(self) -> str:
        return str(self.settings.retry_after_s)

    def _draining_response(self) -> _Answer:
        self._rejected["draining"] += 1
        return _error(
            503,
            "draining",
            "server is draining: retry on another instance",
            headers={"retry-after": self._retry_after},
        )

    async def _read_body(self, receive: Receive) -> bytes:
        """The request's body, arriving within ``body_timeout_s`` (its size is bounded by
        :class:`_BodyLimit`, which raises :class:`InvalidRequestError` past it)."""
        chunks: list[bytes] = []
        size = 0
        timeout = self.settings.body_timeout_s
        with trio.move_on_after(timeout) as reading:
            self._body_reads.add(reading)
            try:
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        raise _ClientDisconnectedError
                    chunk: bytes = message.get("body", b"")
                    size += len(chunk)
                    chunks.append(chunk)
                    if not message.get("more_body", False):
                        return b"".join(chunks)
            finally:
                self._body_reads.discard(reading)
        if self._shutdown_deadline != math.inf:  # cut short by a shutdown: never admitted
            raise _ShuttingDownError
        msg = f"body must arrive within body_timeout_s ({timeout:g} s), got {size} bytes by then"
        raise InvalidRequestError(msg, field="body", error="body_timeout", status=408)

    async def _discard_body(self, receive: Receive) -> None:
        """Read what the client sends of its body (up to ``max_body_bytes``, for at most
        :data:`ANSWER_MARGIN_S`) before an early answer: answered over an unread body, HTTP/2
        data for the finished stream broke hypercorn's connection (issue #329) and HTTP/1.1 reset
        it, losing the answer."""
        with trio.move_on_after(ANSWER_MARGIN_S):
            try:
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        return
                    if not message.get("more_body", False):
                        return
            except InvalidRequestError:  # past max_body_bytes: stop reading
                return

    async def _prefill(self, http_request: Request) -> _Answer:
        receive = http_request.receive
        if not self.ready:
            await self._discard_body(receive)
            return self._draining_response()
        encoding = http_request.headers.get("content-encoding", "identity").strip().lower()
        if encoding != "identity":
            # A compressed body read as JSON was refused as "not UTF-8 at byte 1": say why.
            await self._discard_body(receive)
            message = (
                f"Content-Encoding must be identity (send the body uncompressed), "
                f"got {shown(encoding)}"
            )
            return _error(
                415,
                "unsupported_content_encoding",
                message,
                headers={"accept-encoding": "identity"},
            )
        try:
            body = await self._read_body(receive)
            request = parse_prefill_request(
                body,
                max_tokens=self.max_tokens,
                tokenizer=self.tokenizer,
                vocab_size=getattr(self.pipeline, "vocab_size", None),
            )
        except InvalidRequestError as exc:
            return _error(exc.status, exc.error, str(exc), field=exc.field)
        except _ShuttingDownError:
            return self._draining_response()
        if self._inflight >= self.settings.max_inflight:
            self._rejected["overloaded"] += 1
            message = (
                f"inflight prefills must stay <= max_inflight ({self.settings.max_inflight}): "
                "retry later"
            )
            return _error(503, "overloaded", message, headers={"retry-after": self._retry_after})
        self._inflight += 1
        try:
            extensions = http_request.scope.get("extensions") or {}
            disconnects = extensions.get(DISCONNECTS_EXTENSION)
            return await self._run_prefill(
                request, receive, disconnects if isinstance(disconnects, Disconnects) else None
            )
        finally:
            self._inflight -= 1

    async def _run_prefill(
        self, request: PrefillBody, receive: Receive, disconnects: Disconnects | None
    ) -> _Answer:
        started = trio.current_time()
        if request.request_id is None:
            # Named here, not by the pipeline, so a cancelled or failed request logs its id too.
            request = attrs.evolve(request, request_id=f"http-{next(self._request_ids)}")
        request_fields: dict[str, object] = {
            "session_id": request.session_id,
            "request_id": request.request_id,
            "tokens": int(request.tokens.size),
        }
        result: PrefillResult | None = None
        error: Exception | None = None
        shutdown_cut = False
        if disconnects is not None:
            # Served by serve() over HTTP/1: the connection cancels this scope when the client
            # hangs up, so no task need wait for http.disconnect (about 0.13 ms of CPU a request).
            with trio.CancelScope() as hang_up:
                disconnects.watch(hang_up)
                try:
                    result, error, shutdown_cut = await self._prefill_until_shutdown(request)
                finally:
                    disconnects.unwatch(hang_up)
        else:

            async def cancel_on_disconnect(cancel_scope: trio.CancelScope) -> None:
                # The body is fully read, so the next event the server delivers is the hang-up.
                while (await receive())["type"] != "http.disconnect":
                    pass
                cancel_scope.cancel()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(cancel_on_disconnect, nursery.cancel_scope)
                result, error, shutdown_cut = await self._prefill_until_shutdown(request)
                nursery.cancel_scope.cancel()
        if error is not None:
            response = self._prefill_error(error, request)
            response.log_fields = {**request_fields, **response.log_fields}
            return response
        if shutdown_cut:
            log.warning(
                "prefill_cancelled",
                reason="shutdown_timeout",
                session_id=request.session_id,
                request_id=request.request_id,
            )
            self._rejected["shutdown_timeout"] += 1
            message = (
                f"server shut down before the prefill finished (shutdown_timeout_s="
                f"{self.settings.shutdown_timeout_s}): retry on another instance"
            )
            response = _error(
                503, "shutdown_timeout", message, headers={"retry-after": self._retry_after}
            )
            response.log_fields = {**request_fields, **response.log_fields}
            return response
        if result is None:
            # Only a hang-up cancels the prefill before a result exists (any other way out
            # raises).
            log.info(
                "prefill_cancelled",
                reason="client_disconnected",
                session_id=request.session_id,
                request_id=request.request_id,
            )
            raise _ClientDisconnectedError(request_fields)
        elapsed_s = trio.current_time() - started
        self._record(result, elapsed_s)
        stages = [
            {
                "stage_id": report.stage_id,
                "stage_index": report.stage_index,
                "restored_tokens": report.restored_tokens,
                "computed_tokens": report.computed_tokens,
            }
            for report in result.stages
        ]
        document = {
            "request_id": result.request_id,
            "session_id": request.session_id,
            "tokens": result.tokens,
            "stages": stages,
            "elapsed_s": round(elapsed_s, 6),
        }
        if result.logits is not None:
            # A model with an output head (a Llama stage): the likeliest next tokens, best first.
            best = np.argsort(result.logits)[::-1][:TOP_TOKENS]
            document["top_tokens"] = [int(token) for token in best]
        answer = _json(200, document)
        answer.log_fields = {
            "session_id": request.session_id,
            "request_id": result.request_id,
            "tokens": result.tokens,
            "restored_tokens": {r.stage_id: r.restored_tokens for r in result.stages},
        }
        return answer

    async def _prefill_until_shutdown(
        self, request: PrefillBody
    ) -> tuple[PrefillResult | None, Exception | None, bool]:
        """Prefill ``request``: its result, or the error it raised, and whether a shutdown's
        deadline cut it short. A hang-up (a cancellation from outside) passes through."""
        result = error = None
        # Its deadline is the shutdown's (see start_shutdown); a hang-up cancels an outer scope,
        # which this one does not catch, so the two causes stay apart.
        with trio.CancelScope(deadline=self._shutdown_deadline) as shutdown_scope:
            self._prefill_deadlines.add(shutdown_scope)
            try:
                result = await self.pipeline.prefill(
                    request.tokens,
                    session_id=request.session_id,
                    request_id=request.request_id,
                    cache_salt=request.cache_salt,
                )
            except Exception as exc:
                # Kept out of the caller's nursery, which would wrap it in an exception group.
                error = exc
            finally:
                self._prefill_deadlines.discard(shutdown_scope)
        return result, error, shutdown_scope.cancelled_caught

    def _prefill_error(self, error: Exception, request: PrefillBody) -> _Answer:
        if isinstance(error, trio.ClosedResourceError):
            # The pipeline started draining between our readiness check and its admission.
            self._rejected["draining"] += 1
            return _error(
                503,
                "draining",
                "pipeline is draining: retry on another instance",
                headers={"retry-after": self._retry_after},
            )
        log.error(
            "request_failed",
            session_id=request.session_id,
            request_id=request.request_id,
            exc_info=error,
        )
        message = f"{type(error).__name__}: {error}"
        if isinstance(error, PipelineStoppedError):
            # The pipeline itself stopped (a stage crashed): not this request's fault.
            return _error(503, "pipeline_failed", message)
        # The request was validated before it went in, so whatever a stage raised (the model
        # failing on this input, a malformed model output, even a ConfigError from the model's
        # own code) is the server's fault, and only this caller sees it.
        return _error(500, "prefill_failed", message)

    def _record(self, result: PrefillResult, elapsed_s: float) -> None:
        self._prefill_count += 1
        self._prefill_seconds += elapsed_s
        self._prefill_tokens += result.tokens
        for report in result.stages:
            self._restored_tokens[report.stage_id] += report.restored_tokens
            self._computed_tokens[report.stage_id] += report.computed_tokens

    async def stats_document(self) -> dict[str, Any]:
        """The ``GET /v1/stats`` document: per-stage cache and mailbox statistics, server state."""
        stats = await self.pipeline.statistics()
        stages = [
            {
                "stage_id": stage.stage_id,
                "cache": None if stage.cache is None else _cache_document(stage.cache),
                "mailbox": attrs.asdict(stage.mailbox),
            }
            for stage in stats.stages
        ]
        return {
            "ready": self.ready,
            "draining": self._draining or self.pipeline.draining,
            "stages": stages,
            "server": {
                "inflight": self._inflight,
                "max_inflight": self.settings.max_inflight,
                "prefills": self._prefill_count,
                "prefill_tokens": self._prefill_tokens,
                "rejected": dict(self._rejected),
            },
        }

    async def metrics(self, accept: str = "") -> tuple[bytes, str]:
        """The ``GET /metrics`` document and its content type: the Prometheus text format, or
        OpenMetrics when ``accept`` (the request's ``Accept`` header) asks for it."""
        stats = await self.pipeline.statistics()
        return self._exporter.render(self._metric_families(stats), accept)

    async def metrics_text(self) -> str:
        """The ``GET /metrics`` document in the Prometheus text format."""
        body, _ = await self.metrics()
        return body.decode()

    def _metric_families(self, stats: PipelineStats) -> list[MetricFamily]:
        families: list[MetricFamily] = []
        for field, kind, text in _CACHE_METRICS:
            samples = [
                Sample(value=getattr(stage.cache, field), labels=(("stage_id", stage.stage_id),))
                for stage in stats.stages
                if stage.cache is not None
            ]
            name = f"stage_runtime_cache_{field}" + ("_total" if kind == "counter" else "")
            families.append(MetricFamily(name=name, help=text, type=kind, samples=samples))
        families += _accounting_families(stats)
        for field, kind, text in _MAILBOX_METRICS:
            samples = [
                Sample(value=getattr(stage.mailbox, field), labels=(("stage_id", stage.stage_id),))
                for stage in stats.stages
            ]
            base = field.removeprefix("mailbox_")
            name = f"stage_runtime_mailbox_{base}" + ("_total" if kind == "counter" else "")
            families.append(MetricFamily(name=name, help=text, type=kind, samples=samples))
        per_stage = (
            ("restored", self._restored_tokens, "Prompt tokens restored from a stage's cache."),
            ("computed", self._computed_tokens, "Prompt tokens a stage computed."),
        )
        for what, counter, text in per_stage:
            families.append(
                MetricFamily(
                    name=f"stage_runtime_prefill_{what}_tokens_total",
                    help=text,
                    type="counter",
                    samples=[
                        Sample(
                            value=counter[stage.stage_id], labels=(("stage_id", stage.stage_id),)
                        )
                        for stage in stats.stages
                    ],
                )
            )
        families += [
            MetricFamily(
                name="stage_runtime_prefill_tokens_total",
                help="Prompt tokens of answered prefills.",
                type="counter",
                samples=[Sample(value=self._prefill_tokens)],
            ),
            MetricFamily(
                name="stage_runtime_prefill_duration_seconds",
                help="Time from admission to result of answered prefills.",
                type="summary",
                samples=[
                    Sample(value=self._prefill_seconds, suffix="_sum"),
                    Sample(value=self._prefill_count, suffix="_count"),
                ],
            ),
            MetricFamily(
                name="stage_runtime_prefill_inflight",
                help="Prefills admitted and not yet answered.",
                type="gauge",
                samples=[Sample(value=self._inflight)],
            ),
            MetricFamily(
                name="stage_runtime_prefill_max_inflight",
                help="Admission limit on concurrent prefills.",
                type="gauge",
                samples=[Sample(value=self.settings.max_inflight)],
            ),
            MetricFamily(
                name="stage_runtime_prefill_rejected_total",
                help=(
                    "Prefills answered 503, by reason: overloaded, draining, or shutdown_timeout "
                    "(still running when a shutdown's timeout expired)."
                ),
                type="counter",
                samples=[
                    Sample(value=self._rejected[reason], labels=(("reason", reason),))
                    for reason in ("overloaded", "draining", "shutdown_timeout")
                ],
            ),
            MetricFamily(
                name="stage_runtime_http_responses_total",
                help="HTTP responses by route and status (499: client closed the connection).",
                type="counter",
                samples=[
                    Sample(value=count, labels=(("route", route), ("status", str(status))))
                    for (route, status), count in sorted(self._responses.items())
                ],
            ),
            MetricFamily(
                name="stage_runtime_ready",
                help="1 while the server takes new prefills, 0 while it drains.",
                type="gauge",
                samples=[Sample(value=int(self.ready))],
            ),
        ]
        return families


_ROUTES: Final[dict[str, tuple[str, ...]]] = {
    "/v1/prefill": ("POST",),
    "/v1/stats": ("GET",),
    "/healthz": ("GET",),
    "/readyz": ("GET",),
    "/metrics": ("GET",),
}

_CACHE_METRICS: Final[tuple[tuple[str, MetricType, str], ...]] = (
    ("entries", "gauge", "Entries resident in a stage's activation cache."),
    ("resident_bytes", "gauge", "Payload bytes resident in a stage's activation cache."),
    ("lookups", "counter", "Cache lookups made by a stage."),
    ("hits", "counter", "Cache lookups that found an entry."),
    ("misses", "counter", "Cache lookups that found nothing."),
    ("records", "counter", "Activation prefixes recorded into a stage's cache."),
    ("evictions", "counter", "Entries evicted from a stage's cache."),
    ("evicted_bytes", "counter", "Payload bytes evicted from a stage's cache."),
)

_MISS_REASONS: Final = ("never_seen", "evicted", "rejected")


def _cache_document(cache: CacheStats) -> dict[str, Any]:
    """A stage's cache statistics as JSON; the accounting also gets its miss total and ratio."""
    document: dict[str, Any] = attrs.asdict(cache)
    document["accounting"]["misses"] = cache.accounting.misses
    document["accounting"]["residency_ratio"] = cache.accounting.residency_ratio
    return document


def _accounting_families(stats: PipelineStats) -> list[MetricFamily]:
    """The caches' accounting (both index modes): restores by outcome, miss reasons, footprint."""
    accounted = [(s.stage_id, s.cache.accounting) for s in stats.stages if s.cache is not None]

    def per_stage(field: str) -> list[Sample]:
        return [
            Sample(value=getattr(acc, field), labels=(("stage_id", stage_id),))
            for stage_id, acc in accounted
        ]

    misses = [
        Sample(
            value=getattr(acc, f"misses_{reason}"),
            labels=(("stage_id", stage_id), ("reason", reason)),
        )
        for stage_id, acc in accounted
        for reason in _MISS_REASONS
    ]
    return [
        MetricFamily(
            name="stage_runtime_cache_restore_lookups_total",
            help="Restores that probed a stage's cache (one per restore, both index modes).",
            type="counter",
            samples=per_stage("lookups"),
        ),
        MetricFamily(
            name="stage_runtime_cache_restore_hits_total",
            help="Restores that returned a cached prefix.",
            type="counter",
            samples=per_stage("hits"),
        ),
        MetricFamily(
            name="stage_runtime_cache_restore_misses_total",
            help=(
                "Restores that returned nothing, by reason: never_seen, evicted (pushed out by "
                "a bound since it was cached) or rejected (a cached entry failed validation)."
            ),
            type="counter",
            samples=misses,
        ),
        MetricFamily(
            name="stage_runtime_cache_restored_tokens_total",
            help="Tokens handed back by a stage cache's hits.",
            type="counter",
            samples=per_stage("restored_tokens"),
        ),
        MetricFamily(
            name="stage_runtime_cache_unique_prefix_bytes",
            help=(
                "Bytes the distinct resident prefixes of a stage's cache would need if each "
                "token row were stored once (compare with stage_runtime_cache_resident_bytes)."
            ),
            type="gauge",
            samples=per_stage("unique_prefix_bytes"),
        ),
    ]


_MAILBOX_METRICS: Final[tuple[tuple[str, MetricType, str], ...]] = (
    ("mailbox_size", "gauge", "Capacity of a stage's cache-actor mailbox."),
    ("queued", "gauge", "Messages waiting in a stage's cache-actor mailbox."),
    ("max_queued", "gauge", "Most messages seen waiting in a stage's cache-actor mailbox at once."),
    ("processed", "counter", "Messages handled by a stage's cache actor."),
    ("failed", "counter", "Messages whose handling raised in a stage's cache actor."),
    ("restarts", "counter", "Restarts of a stage's cache actor."),
    ("asks_waiting", "gauge", "Requests waiting on a stage's cache actor for room or a reply."),
)


_ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]
"""What the middlewares wrap: :meth:`PipelineApp.__call__` hands them HTTP scopes only (it
answers lifespan itself, and Starlette's Mount sends none), so they need no other branch."""


def _route_path(scope: Scope) -> str:
    """The request's path below the app's mount point (the whole path when not mounted)."""
    path: str = scope["path"]
    root: str = scope.get("root_path", "")
    return path[len(root) :] if root and path.startswith(root) else path


class _BodyLimit:
    """Bounds what a client may send as a body: ``max_body_bytes``, refused as ``413`` when the
    ``content-length`` says more (before anything is read) or when more arrives, so a client
    streaming gigabytes is cut off after the limit. The endpoint reading the body gets an
    :class:`InvalidRequestError` from ``receive``; one that never reads reads nothing."""

    def __init__(self, app: _ASGIApp, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        limit = self.max_bytes
        declared = next(
            (int(v) for k, v in scope["headers"] if k.lower() == b"content-length" and v.isdigit()),
            None,
        )
        received = 0

        async def bounded_receive() -> Message:
            nonlocal received
            if declared is not None and declared > limit:
                msg = f"body must be at most {limit} bytes, got content-length {declared}"
                raise InvalidRequestError(msg, field="body", error="body_too_large", status=413)
            message = await receive()
            received += len(message.get("body", b""))
            if received > limit:
                msg = f"body must be at most {limit} bytes, got more than {limit}"
                raise InvalidRequestError(msg, field="body", error="body_too_large", status=413)
            return message

        await self.app(scope, bounded_receive, send)


@attrs.define(eq=False)
class _GuardedSend:
    """``send`` for one answer: a client that does not take it within ``body_timeout_s`` (or
    once a shutdown's margin is over) loses it, one that hung up is noticed, and a ``HEAD``
    answer keeps its headers but drops its body."""

    send: Send
    served: PipelineApp
    head: bool
    status: int | None = None
    complete: bool = False
    abandoned: bool = False
    timed_out: bool = False
    _deadline: float = math.inf

    async def __call__(self, message: Message) -> None:
        if self.abandoned:
            return
        served = self.served
        if message["type"] == "http.response.start":
            self.status = message["status"]
            self._deadline = trio.current_time() + (
                served.settings.body_timeout_s if not served.draining else ANSWER_MARGIN_S
            )
        elif self.head and message.get("body"):
            message = {**message, "body": b""}
        # A client that does not take its answer (or a connection hypercorn closed under it,
        # over HTTP/2) would hold this task forever: bounded like a body's arrival.
        with trio.CancelScope(deadline=min(self._deadline, served._answer_deadline)) as sending:
            served._sends.add(sending)
            try:
                await self.send(message)
            except (trio.BrokenResourceError, trio.BusyResourceError, trio.ClosedResourceError):
                # The client hung up while the answer was being written (hypercorn can then
                # race its own close against our write); nobody is left to read it.
                self.abandoned = True
            finally:
                served._sends.discard(sending)
        if sending.cancelled_caught:
            self.abandoned = self.timed_out = True
        elif message["type"] == "http.response.body" and not message.get("more_body", False):
            self.complete = not self.abandoned


class _ServedRequests:
    """Accounts for every HTTP request: counts it while it runs (:meth:`PipelineApp.wait_quiet`),
    answers a bug with a JSON ``500`` (the traceback goes to the log, not the client), bounds the
    answer's write (:class:`_GuardedSend`), and logs one ``request_served`` event with the
    status (``499`` when the client hung up) and counts it by route, or ``request_dropped``
    when a forced shutdown cancels it."""

    def __init__(self, app: _ASGIApp, served: PipelineApp) -> None:
        self.app = app
        self.served = served

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        served = self.served
        served._active += 1
        try:
            await self._handle(scope, receive, send)
        finally:
            served._active -= 1
            if not served._active and served._quiet is not None:
                served._quiet.set()
                served._quiet = None

    async def _handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = trio.current_time()
        method: str = scope["method"]
        path: str = scope["path"]
        try:
            await self._serve(scope, receive, send, started, method, path)
        except (trio.Cancelled, BaseExceptionGroup) as exc:
            # A Cancelled, or (out of the prefill's nursery) a group of nothing else.
            if isinstance(exc, BaseExceptionGroup) and exc.split(trio.Cancelled)[1] is not None:
                raise
            self.served._dropped += 1
            log.warning(
                "request_dropped",
                method=method,
                path=path,
                elapsed_s=round(trio.current_time() - started, 6),
            )
            raise

    async def _serve(
        self, scope: Scope, receive: Receive, send: Send, started: float, method: str, path: str
    ) -> None:
        writer = _GuardedSend(send=send, served=self.served, head=method == "HEAD")
        fields: dict[str, object]
        try:
            await self.app(scope, receive, writer)
            fields = dict(scope.get(_LOG_FIELDS, {}))
        except _ClientDisconnectedError as exc:
            fields = dict(exc.log_fields)
        except Exception:
            # Bugs must not take the server down; the client gets a 500 and the log a traceback
            # (the exception's text stays in the log: it may show internals).
            log.exception("request_failed", method=method, path=path)
            answer = _error(500, "internal_error", "internal server error: see the server log")
            fields = dict(answer.log_fields)
            if writer.status is None:
                await answer(scope, receive, writer)
        if writer.timed_out:
            fields["send_timed_out"] = True
        status = writer.status if writer.complete and writer.status else CLIENT_CLOSED_REQUEST
        route_path = _route_path(scope)
        route = route_path if route_path in _ROUTES else "other"
        self.served._responses[(route, status)] += 1
        emit = log.debug if route_path in _PROBE_PATHS and status < 500 else log.info
        emit(
            "request_served",
            method=method,
            path=path,
            status=status,
            elapsed_s=round(trio.current_time() - started, 6),
            **fields,
        )


def create_app(
    pipeline: ServedPipeline,
    *,
    settings: ServerSettings | None = None,
    tokenizer: TextTokenizer | None = None,
) -> PipelineApp:
    """Build the ASGI application for a running pipeline.

    Args:
        pipeline: An open pipeline (from :func:`stage_runtime.open_pipeline`).
        settings: Limits and timeouts; defaults when ``None``.
        tokenizer: Tokenizer for the ``"text"`` field. ``None``: the byte-level one for a
            model without a vocabulary of its own (the pipeline has no ``vocab_size``, as with
            the reference models); for one with (a Llama model), ``"text"`` is refused (a
            ``400`` naming the field), since byte ids mean nothing to it: pass its tokenizer
            (:func:`~stage_runtime.server.tokenizer.model_tokenizer`).

    Returns:
        The ASGI application; serve it with :func:`stage_runtime.server.serve`, or mount it in
        your own Starlette or FastAPI app (``Mount("/pipeline", app=...)``).
    """
    if tokenizer is None:
        has_vocabulary = getattr(pipeline, "vocab_size", None) is not None
        tokenizer = (
            NoTokenizer(reason="the server was given none for this model")
            if has_vocabulary
            else ByteTokenizer()
        )
    return PipelineApp(
        pipeline=pipeline, settings=settings or ServerSettings(), tokenizer=tokenizer
    )
