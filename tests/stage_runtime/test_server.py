"""The HTTP server, tested for real: hypercorn on 127.0.0.1:0, httpx clients, a real pipeline.

Real sockets mean real time, so nothing here sleeps: requests are held inside the model by a
``trio.Event`` (the gate) and the tests wait on events raised when prefills enter or leave the
pipeline. Every test is bounded by ``trio.fail_after``.
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Callable, Iterator, MutableMapping, Sequence
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any

import attrs
import httpx
import numpy as np
import numpy.typing as npt
import pytest
import structlog
import trio
import trio.lowlevel
import trio.testing
from prometheus_client.openmetrics.parser import (
    text_string_to_metric_families as openmetrics_families,
)
from prometheus_client.parser import text_string_to_metric_families

from stage_runtime.config import CacheMode, KvCacheConfig, StageConfig
from stage_runtime.errors import ConfigError
from stage_runtime.frames import ActivationFrame
from stage_runtime.models import ModelFactory, StageModel, reference_model_factory
from stage_runtime.pipeline import Pipeline, PipelineStats, PrefillResult, open_pipeline
from stage_runtime.server import RunningServer, ServerSettings, create_app, open_server
from stage_runtime.server import serve as real_serve
from stage_runtime.server.command import add_serve_arguments, run_serve
from stage_runtime.server.settings import ANSWER_MARGIN_S
from tests.benchmark_scripts import load_example
from tests.stage_runtime.pipeline_helpers import WrappedModel

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 20
LogEvents = list[MutableMapping[str, Any]]


def four_stages(*, ctx_size: int = 4096) -> list[StageConfig]:
    """A 4-stage topology with the cache on and small thresholds."""
    ids = [f"stage-{index}" for index in range(4)]
    return [
        StageConfig(
            stage_id=ids[index],
            stage_index=index,
            model_id="test/reference",
            layer_start=8 * index,
            layer_end=8 * (index + 1),
            ctx_size=ctx_size,
            kv_cache=KvCacheConfig(
                mode=CacheMode.LOOKUP_RECORD, min_tokens=8, shared_prefix_stride_tokens=16
            ),
            upstream=ids[index - 1] if index else None,
            downstream=ids[index + 1] if index < 3 else None,
        )
        for index in range(4)
    ]


@attrs.define(eq=False)
class PickyModel(WrappedModel):
    """A reference model that fails on prompts starting with token 666 (a bad input).

    ``fault``: ``"raise"`` a RuntimeError, raise a library ``"config"`` error from the model's
    own code, or return a ``"short"`` frame (one row missing).
    """

    fault: str = "raise"

    def embed(self, tokens: npt.NDArray[np.int32]) -> ActivationFrame:
        """Embed with the wrapped model, refusing the poisoned prompt."""
        if tokens[0] == 666:
            if self.fault == "short":
                return self.inner.embed(tokens[:-1])
            if self.fault == "config":
                raise ConfigError("model cannot handle token 666")
            raise RuntimeError("model cannot handle token 666")
        return self.inner.embed(tokens)


def picky_factory(fault: str = "raise") -> ModelFactory:
    """Reference models that fail on prompts starting with token 666 (see PickyModel)."""
    reference = reference_model_factory(width=16)

    def build(config: StageConfig) -> StageModel:
        return PickyModel(inner=reference(config), fault=fault)

    return build


@attrs.define(eq=False)
class GatedModel(WrappedModel):
    """A reference model whose ``forward`` first waits for ``gate``: holds requests in flight."""

    gate: trio.Event

    async def forward(
        self, inputs: ActivationFrame, start: int, restored: ActivationFrame | None
    ) -> ActivationFrame:
        """Wait for the gate, then compute with the wrapped model."""
        await self.gate.wait()
        return await self.inner.forward(inputs, start, restored)


def gated_factory(gate: trio.Event) -> ModelFactory:
    """Reference models that wait for ``gate`` before computing."""
    reference = reference_model_factory(width=16)

    def build(config: StageConfig) -> StageModel:
        return GatedModel(inner=reference(config), gate=gate)

    return build


def start_held_prefills(
    nursery: trio.Nursery, url: str, answers: list[httpx.Response], count: int = 3
) -> None:
    """Send ``count`` prefills, each from its own client, appending their responses to
    ``answers`` (with a gated model they wait in the pipeline until the gate opens)."""

    async def in_flight(index: int) -> None:
        async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT_S) as own:
            body = {"tokens": prompt(24, offset=index), "session_id": f"s{index}"}
            answers.append(await own.post("/v1/prefill", json=body))

    for index in range(count):
        nursery.start_soon(in_flight, index)


@attrs.define(eq=False)
class ObservedPipeline:
    """Delegates to a real pipeline and lets a test wait for prefills to enter or leave it."""

    inner: Pipeline
    entered: int = 0
    left: int = 0
    _changed: trio.Event = attrs.field(factory=trio.Event)

    @property
    def draining(self) -> bool:
        """The real pipeline's draining flag."""
        return self.inner.draining

    @property
    def stage_configs(self) -> Sequence[StageConfig]:
        """The real pipeline's stages."""
        return self.inner.stage_configs

    async def statistics(self) -> PipelineStats:
        """The real pipeline's statistics."""
        return await self.inner.statistics()

    async def prefill(
        self,
        tokens: npt.NDArray[np.int32],
        *,
        session_id: str,
        request_id: str | None = None,
        cache_salt: str | None = None,
    ) -> PrefillResult:
        """Count the call in and out around the real prefill."""
        self.entered += 1
        self._notify()
        try:
            return await self.inner.prefill(
                tokens, session_id=session_id, request_id=request_id, cache_salt=cache_salt
            )
        finally:
            self.left += 1
            self._notify()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def wait_until(self, predicate: Callable[[ObservedPipeline], bool]) -> None:
        """Wait until ``predicate(self)`` holds."""
        while not predicate(self):
            await self._changed.wait()


@attrs.frozen
class Harness:
    """A running server, its pipeline and a client."""

    server: RunningServer
    pipeline: ObservedPipeline
    client: httpx.AsyncClient


@asynccontextmanager
async def serving(
    *,
    settings: ServerSettings | None = None,
    model_factory: ModelFactory | None = None,
    stages: list[StageConfig] | None = None,
) -> AsyncIterator[Harness]:
    """A real 4-stage pipeline served on a free port, with an httpx client pointed at it."""
    factory = model_factory or reference_model_factory(width=16)
    async with open_pipeline(stages or four_stages(), factory, environ={}) as pipeline:
        observed = ObservedPipeline(inner=pipeline)
        app = create_app(observed, settings=settings)
        async with (
            open_server(app, bind="127.0.0.1:0") as server,
            httpx.AsyncClient(base_url=server.url, timeout=TIMEOUT_S) as client,
        ):
            yield Harness(server=server, pipeline=observed, client=client)


def prompt(length: int, *, offset: int = 0) -> list[int]:
    """Token ids ``offset .. offset + length - 1``."""
    return list(range(offset, offset + length))


def served_events(logs: LogEvents) -> list[MutableMapping[str, Any]]:
    """The ``request_served`` events among captured logs."""
    return [event for event in logs if event["event"] == "request_served"]


# -- responses and cache effects -----------------------------------------------------------------


async def test_repeated_prompt_is_restored_by_every_stage() -> None:
    """The second identical prefill restores tokens at each stage and computes only the rest."""
    with trio.fail_after(TIMEOUT_S):
        async with serving() as h:
            body = {"tokens": prompt(100), "session_id": "s1", "request_id": "first"}
            sent_at = trio.current_time()
            first = await h.client.post("/v1/prefill", json=body)
            round_trip_s = trio.current_time() - sent_at
            body["request_id"] = "second"
            second = await h.client.post("/v1/prefill", json=body)
            stats = (await h.client.get("/v1/stats")).json()

    assert first.status_code == 200
    assert second.status_code == 200
    one, two = first.json(), second.json()
    assert set(one) == {"request_id", "session_id", "tokens", "stages", "elapsed_s"}
    assert (one["request_id"], one["session_id"], one["tokens"]) == ("first", "s1", 100)
    assert [s["stage_id"] for s in one["stages"]] == [f"stage-{i}" for i in range(4)]
    assert all(s["restored_tokens"] == 0 and s["computed_tokens"] == 100 for s in one["stages"])
    assert two["request_id"] == "second"
    for stage in two["stages"]:
        assert stage["restored_tokens"] > 0
        assert stage["restored_tokens"] + stage["computed_tokens"] == 100
    assert 0 < one["elapsed_s"] <= round_trip_s + 1e-6
    cache_fields = {"entries", "resident_bytes", "lookups", "hits", "misses", "evictions"}
    assert all(cache_fields <= set(stage["cache"]) for stage in stats["stages"])
    assert all({"queued", "processed"} <= set(stage["mailbox"]) for stage in stats["stages"])
    assert [stage["cache"]["hits"] for stage in stats["stages"]] == [1, 1, 1, 1]
    # One restore missed (the first), one hit; the store counted each ladder candidate probed.
    assert [stage["cache"]["accounting"]["misses"] for stage in stats["stages"]] == [1, 1, 1, 1]
    assert all(stage["cache"]["misses"] >= 1 for stage in stats["stages"])
    assert all(stage["cache"]["entries"] > 0 for stage in stats["stages"])
    assert all(stage["mailbox"]["processed"] > 0 for stage in stats["stages"])
    assert stats["server"]["prefills"] == 2


async def test_text_prompt_is_tokenized_as_utf8_bytes() -> None:
    """A "text" prompt counts one token per UTF-8 byte and shares prefixes with its extension."""
    with trio.fail_after(TIMEOUT_S):
        async with serving() as h:
            text = "déjà vu, " * 4  # 11 bytes per repeat
            short = await h.client.post("/v1/prefill", json={"text": text, "session_id": "t"})
            long = await h.client.post(
                "/v1/prefill", json={"text": text + "again and again", "session_id": "t"}
            )
    assert short.status_code == long.status_code == 200
    assert short.json()["tokens"] == len(text.encode()) == 44
    assert long.json()["tokens"] == 44 + 15
    assert all(stage["restored_tokens"] > 0 for stage in long.json()["stages"])


async def test_request_id_is_generated_when_omitted(capture_stage_logs: LogEvents) -> None:
    """Without a request_id the server names the request http-<n>, in answers and logs alike."""
    with trio.fail_after(TIMEOUT_S):
        async with serving() as h:
            body = {"tokens": [1, 2], "session_id": "s"}
            answers = [await h.client.post("/v1/prefill", json=body) for _ in range(2)]
    assert [answer.status_code for answer in answers] == [200, 200]
    ids = [answer.json()["request_id"] for answer in answers]
    assert all(re.fullmatch(r"http-\d+", request_id) for request_id in ids)
    assert ids[0] != ids[1]
    assert [e["request_id"] for e in served_events(capture_stage_logs)] == ids


async def test_cache_salt_keeps_tenants_from_restoring_each_others_prefixes() -> None:
    """A salted prompt is restored only by requests with the same salt, never across tenants."""
    with trio.fail_after(TIMEOUT_S):
        async with serving() as h:

            async def restored(session_id: str, salt: str | None) -> list[int]:
                body: dict[str, object] = {"tokens": prompt(64), "session_id": session_id}
                if salt is not None:
                    body["cache_salt"] = salt
                answer = await h.client.post("/v1/prefill", json=body)
                assert answer.status_code == 200, answer.text
                return [stage["restored_tokens"] for stage in answer.json()["stages"]]

            first_a = await restored("a", "tenant-a")
            other_tenant = await restored("b", "tenant-b")
            unsalted = await restored("c", None)
            again_a = await restored("a2", "tenant-a")
            again_b = await restored("b2", "tenant-b")

    assert first_a == other_tenant == unsalted == [0, 0, 0, 0]
    assert all(count > 0 for count in again_a)
    assert all(count > 0 for count in again_b)


async def test_fifty_concurrent_clients_are_all_answered() -> None:
    """Fifty clients on their own connections each get their own complete answer."""
    answers: dict[int, httpx.Response] = {}

    async def one_client(url: str, index: int) -> None:
        async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT_S) as client:
            body = {
                "tokens": prompt(32) + prompt(8 + index % 5, offset=1000 + index),
                "session_id": f"client-{index}",
                "request_id": f"req-{index}",
            }
            answers[index] = await client.post("/v1/prefill", json=body)

    with trio.fail_after(TIMEOUT_S):
        async with serving() as h:
            async with trio.open_nursery() as nursery:
                for index in range(50):
                    nursery.start_soon(one_client, h.server.url, index)
            stats = (await h.client.get("/v1/stats")).json()

    assert sorted(answers) == list(range(50))
    for index, answer in answers.items():
        assert answer.status_code == 200, answer.text
        assert answer.json()["request_id"] == f"req-{index}"
        assert answer.json()["tokens"] == 32 + 8 + index % 5
    assert stats["server"]["prefills"] == 50
    assert stats["server"]["inflight"] == 0
    # They share a 32-token prefix: after the first ones recorded it, later ones restore it.
    restored = [a.json()["stages"][0]["restored_tokens"] for a in answers.values()]
    assert max(restored) >= 16


# -- bad input ------------------------------------------------------------------------------------

BAD_REQUESTS: list[tuple[str, bytes, int, str, str]] = [
    ("malformed json", b'{"tokens": [1, 2', 400, "body", "malformed_json"),
    ("not an object", b'"hello"', 400, "body", "invalid_field"),
    ("missing tokens", b'{"session_id": "s"}', 400, "tokens", "missing_field"),
    ("missing session", b'{"tokens": [1]}', 400, "session_id", "missing_field"),
    (
        "tokens wrong type",
        b'{"tokens": "1 2 3", "session_id": "s"}',
        400,
        "tokens",
        "invalid_field",
    ),
    (
        "token wrong type",
        b'{"tokens": [1, "2"], "session_id": "s"}',
        400,
        "tokens",
        "invalid_field",
    ),
    (
        "token above int32",
        b'{"tokens": [2147483648], "session_id": "s"}',
        400,
        "tokens",
        "invalid_field",
    ),
    (
        "token below int32",
        b'{"tokens": [-2147483649], "session_id": "s"}',
        400,
        "tokens",
        "invalid_field",
    ),
    ("empty tokens", b'{"tokens": [], "session_id": "s"}', 400, "tokens", "invalid_field"),
    ("empty text", b'{"text": "", "session_id": "s"}', 400, "text", "invalid_field"),
    ("session wrong type", b'{"tokens": [1], "session_id": 3}', 400, "session_id", "invalid_field"),
    (
        "request id wrong type",
        b'{"tokens": [1], "session_id": "s", "request_id": 4}',
        400,
        "request_id",
        "invalid_field",
    ),
    (
        "unknown field",
        b'{"tokens": [1], "session_id": "s", "prompt": "x"}',
        400,
        "prompt",
        "unknown_field",
    ),
    (
        "longer than ctx_size",
        json.dumps({"tokens": prompt(300), "session_id": "s"}).encode(),
        400,
        "tokens",
        "invalid_field",
    ),
    (
        "body too large",
        json.dumps({"tokens": prompt(900), "session_id": "s"}).encode(),
        413,
        "body",
        "body_too_large",
    ),
]


async def test_bad_requests_get_json_errors_naming_the_field_and_server_stays_up() -> None:
    """Every kind of bad body is answered 400/413 naming the field; good requests still work."""
    settings = ServerSettings(max_body_bytes=2048)
    with trio.fail_after(TIMEOUT_S):
        async with serving(settings=settings, stages=four_stages(ctx_size=256)) as h:
            answers = {
                name: await h.client.post("/v1/prefill", content=body)
                for name, body, *_ in BAD_REQUESTS
            }
            healthy = await h.client.get("/healthz")
            good = await h.client.post("/v1/prefill", json={"tokens": [5, 6], "session_id": "s"})
            stats = (await h.client.get("/v1/stats")).json()

    for name, _body, status, field, error in BAD_REQUESTS:
        answer = answers[name]
        assert answer.status_code == status, (name, answer.text)
        assert answer.headers["content-type"] == "application/json"
        document = answer.json()
        assert (document["field"], document["error"]) == (field, error), name
        assert field in document["message"], name
    assert healthy.status_code == 200
    assert good.status_code == 200
    assert stats["server"]["prefills"] == 1  # no bad request reached the pipeline
    assert all(stage["cache"]["lookups"] == 1 for stage in stats["stages"])


async def test_a_prefill_takes_the_direct_route_with_the_same_accounting(
    capture_stage_logs: LogEvents,
) -> None:
    """POST /v1/prefill skips Starlette's router (about 90 us of CPU a request) but not the
    middlewares: mounted under a prefix it is answered, counted and logged once, and the
    router is built only when another route is asked for."""
    async with open_pipeline(four_stages(), reference_model_factory(width=16), environ={}) as p:
        app = create_app(p)
        transport = httpx.ASGITransport(app=app, root_path="/pipeline")
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            body = {"tokens": prompt(20), "session_id": "s"}
            answer = await client.post("/pipeline/v1/prefill", json=body)
            assert answer.status_code == 200
            assert app._starlette is None
            too_large = await client.post(
                "/pipeline/v1/prefill", content=b"x" * (app.settings.max_body_bytes + 1)
            )
            assert too_large.status_code == 413
            assert (await client.get("/pipeline/v1/prefill")).status_code == 405
            assert app._starlette is not None
    served = served_events(capture_stage_logs)
    assert [(e["path"], e["status"]) for e in served] == [
        ("/pipeline/v1/prefill", 200),
        ("/pipeline/v1/prefill", 413),
        ("/pipeline/v1/prefill", 405),
    ]


async def test_unknown_paths_and_wrong_methods_get_404_and_405() -> None:
    """Routing errors are JSON too; 405 names the allowed method."""
    with trio.fail_after(TIMEOUT_S):
        async with serving() as h:
            missing = await h.client.get("/v2/prefill")
            long = await h.client.get("/" + "x" * 20_000)
            wrong = await h.client.get("/v1/prefill")
    assert missing.status_code == 404
    assert missing.json()["error"] == "not_found"
    assert missing.json()["message"].endswith(", got /v2/prefill")
    assert long.status_code == 404
    assert long.json()["message"].endswith("x... (20,001 characters)")  # not echoed whole
    assert len(long.json()["message"]) < 400
    assert wrong.status_code == 405
    assert wrong.headers["allow"] == "POST"
    assert wrong.json()["error"] == "method_not_allowed"


async def _raw_request(url: str, head: bytes, body_parts: Sequence[bytes]) -> bytes:
    """Send a request by hand (headers, then body parts) and read the response until close."""
    port = int(url.rsplit(":", 1)[1])
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        await stream.send_all(head)
        for part in body_parts:
            await stream.send_all(part)
        # The request body is never finished, so the server must close after answering.
        response = b""
        while chunk := await stream.receive_some():
            response += chunk
        return response


async def test_body_limit_is_enforced_while_reading_a_chunked_body() -> None:
    """A chunked body is refused with 413 as soon as it passes the limit, before it ends."""
    head = (
        b"POST /v1/prefill HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n"
    )
    chunk = b'{"tokens": [' + b"1, " * 200
    # 600+ bytes against a 512-byte limit, and the terminating zero-size chunk is never sent:
    # the server can only answer because it stops reading at the limit.
    part = f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n"
    with trio.fail_after(TIMEOUT_S):
        async with serving(settings=ServerSettings(max_body_bytes=512)) as h:
            response = await _raw_request(h.server.url, head, [part])
            healthy = await h.client.get("/healthz")
    assert response.startswith(b"HTTP/1.1 413 ")
    assert healthy.status_code == 200
    assert h.pipeline.entered == 0


async def test_declared_content_length_over_limit_is_refused_before_reading() -> None:
    """A Content-Length above the limit gets 413 without the server waiting for the body."""
    head = (
        b"POST /v1/prefill HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
        b"Content-Length: 100000\r\n\r\n"
    )
    with trio.fail_after(TIMEOUT_S):
        async with serving(settings=ServerSettings(max_body_bytes=512)) as h:
            response = await _raw_request(h.server.url, head, [])
    assert response.startswith(b"HTTP/1.1 413 ")
    assert b'"field":"body"' in response


async def _h2_answer_then_body(url: str, path: str, body: bytes) -> int:
    """One HTTP/2 request (prior knowledge) whose body is sent only after the whole answer
    arrived: the body reaches a stream the server has closed. Returns the answer's status."""
    import h2.config
    import h2.connection
    import h2.events

    port = int(url.rsplit(":", 1)[1])
    connection = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    connection.initiate_connection()
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        sid = connection.get_next_available_stream_id()
        headers = [(":method", "POST"), (":path", path), (":scheme", "http")]
        headers += [(":authority", "test"), ("content-length", str(len(body)))]
        connection.send_headers(sid, headers)
        await stream.send_all(connection.data_to_send())
        status, ended = 0, False
        while not ended:
            data = await stream.receive_some()
            assert data, "the server closed the connection before answering"
            for event in connection.receive_data(data):
                if isinstance(event, h2.events.ResponseReceived) and event.stream_id == sid:
                    status = int(dict(event.headers)[b":status"])
                ended |= isinstance(event, h2.events.StreamEnded) and event.stream_id == sid
            await stream.send_all(connection.data_to_send())
        connection.send_data(sid, body, end_stream=True)
        await stream.send_all(connection.data_to_send())
        with trio.move_on_after(1):  # the server may answer the late body by closing: fine
            while await stream.receive_some():
                pass
    return status


@pytest.mark.parametrize(("path", "status"), [("/healthz", 405), ("/v1/prefill", 413)])
async def test_a_body_arriving_after_an_http2_answer_does_not_stop_the_server(
    path: str, status: int
) -> None:
    """hypercorn fails on HTTP/2 body data for a stream it has answered (its issue #329): that
    connection is dropped, and the server goes on serving the others."""
    with trio.fail_after(TIMEOUT_S):
        async with serving(settings=ServerSettings(max_body_bytes=512)) as h:
            # The answer comes first: to a wrong method, or to a declared length over the limit.
            assert await _h2_answer_then_body(h.server.url, path, b"x" * 600) == status
            healthy = await h.client.get("/healthz")
            body = {"tokens": prompt(24), "session_id": "h1"}
            answer = await h.client.post("/v1/prefill", json=body)
    assert healthy.status_code == 200
    assert answer.status_code == 200


async def _call_app_with_a_stalled_body(
    app: Any, answered: list[MutableMapping[str, Any]], received: trio.Event
) -> None:
    """Call ``app`` with a prefill whose body sends 10 bytes, then nothing."""
    parts: list[MutableMapping[str, Any]] = [
        {"type": "http.request", "body": b'{"tokens":', "more_body": True}
    ]

    async def receive() -> MutableMapping[str, Any]:
        if parts:
            return parts.pop()
        received.set()
        await trio.sleep_forever()
        raise AssertionError("unreachable")

    async def send(message: MutableMapping[str, Any]) -> None:
        answered.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/prefill", "headers": []}
    await app(scope, receive, send)


async def test_a_stalled_body_is_answered_408_at_the_body_timeout(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A client that stops sending its body gets 408 naming the timeout, after body_timeout_s."""
    async with open_pipeline(four_stages(), reference_model_factory(width=16), environ={}) as p:
        app = create_app(p, settings=ServerSettings(body_timeout_s=5))
        answered: list[MutableMapping[str, Any]] = []
        started = trio.current_time()
        await _call_app_with_a_stalled_body(app, answered, trio.Event())
        assert trio.current_time() - started == pytest.approx(5)
    assert answered[0]["status"] == 408
    document = json.loads(answered[1]["body"])
    assert (document["error"], document["field"]) == ("body_timeout", "body")
    assert document["message"] == (
        "body must arrive within body_timeout_s (5 s), got 10 bytes by then"
    )


async def test_a_shutdown_answers_bodies_still_arriving_503_at_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A prefill whose body is still arriving when the shutdown starts is not admitted: 503
    draining with Retry-After, at once (the shutdown does not wait for it)."""
    async with open_pipeline(four_stages(), reference_model_factory(width=16), environ={}) as p:
        app = create_app(p, settings=ServerSettings(body_timeout_s=60))
        answered: list[MutableMapping[str, Any]] = []
        received = trio.Event()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_call_app_with_a_stalled_body, app, answered, received)
            await received.wait()
            started = trio.current_time()
            app.start_shutdown()
        assert trio.current_time() == started
        stats = await app.stats_document()
    assert answered[0]["status"] == 503
    assert (b"retry-after", b"1") in answered[0]["headers"]
    assert json.loads(answered[1]["body"])["error"] == "draining"
    assert stats["server"]["rejected"]["draining"] == 1


async def test_an_answer_the_client_does_not_take_is_dropped_at_the_body_timeout(
    autojump_clock: trio.testing.MockClock, capture_stage_logs: LogEvents
) -> None:
    """A send that never completes (over HTTP/2, hypercorn could leave one waiting on a closed
    connection) held its task forever, and with it the shutdown. It is bounded like a body."""
    async with open_pipeline(four_stages(), reference_model_factory(width=16), environ={}) as p:
        app = create_app(p, settings=ServerSettings(body_timeout_s=7))

        async def receive() -> MutableMapping[str, Any]:
            return {"type": "http.request", "body": b"", "more_body": False}

        async def send(message: MutableMapping[str, Any]) -> None:
            await trio.sleep_forever()

        scope = {"type": "http", "method": "GET", "path": "/healthz", "headers": []}
        started = trio.current_time()
        await app(scope, receive, send)
        assert trio.current_time() - started == pytest.approx(7)
        await app.wait_quiet()  # nothing is being handled any more
    [served] = served_events(capture_stage_logs)
    assert (served["status"], served["send_timed_out"]) == (499, True)


async def test_a_stuck_answer_is_given_up_soon_after_the_shutdown_starts(
    autojump_clock: trio.testing.MockClock, capture_stage_logs: LogEvents
) -> None:
    """Over HTTP/2 hypercorn can close a stream under an answer being written; at shutdown
    that send held the exit for the whole body_timeout_s (30 s). It gets the answer margin."""
    async with open_pipeline(four_stages(), reference_model_factory(width=16), environ={}) as p:
        app = create_app(p, settings=ServerSettings(body_timeout_s=600))
        sending = trio.Event()

        async def receive() -> MutableMapping[str, Any]:
            return {"type": "http.request", "body": b"", "more_body": False}

        async def send(message: MutableMapping[str, Any]) -> None:
            sending.set()
            await trio.sleep_forever()

        scope = {"type": "http", "method": "GET", "path": "/healthz", "headers": []}
        async with trio.open_nursery() as nursery:
            nursery.start_soon(app, scope, receive, send)
            await sending.wait()
            started = trio.current_time()
            app.start_shutdown()
            await app.wait_quiet()
            assert trio.current_time() - started == pytest.approx(ANSWER_MARGIN_S)
    [served] = served_events(capture_stage_logs)
    assert (served["status"], served["send_timed_out"]) == (499, True)


async def test_a_prefill_finishing_well_into_the_shutdown_is_still_answered(
    autojump_clock: trio.testing.MockClock, capture_stage_logs: LogEvents
) -> None:
    """Every answer used to be cut off ANSWER_MARGIN_S after the shutdown began, though
    prefills may run for shutdown_timeout_s: one finishing 10 s in computed its result and
    dropped it (logged 499). Each answer now gets the margin from when it is written."""
    gate = trio.Event()
    async with open_pipeline(four_stages(), gated_factory(gate), environ={}) as p:
        app = create_app(p, settings=ServerSettings(shutdown_timeout_s=30))
        body = json.dumps({"tokens": [1, 2, 3], "session_id": "s"}).encode()
        answered: list[MutableMapping[str, Any]] = []
        bodies = [body]

        async def receive() -> MutableMapping[str, Any]:
            if not bodies:
                await trio.sleep_forever()  # the client stays connected
            return {"type": "http.request", "body": bodies.pop(), "more_body": False}

        async def send(message: MutableMapping[str, Any]) -> None:
            await trio.lowlevel.checkpoint()  # (a server's write yields, as hypercorn's does)
            answered.append(message)

        scope = {"type": "http", "method": "POST", "path": "/v1/prefill", "headers": []}
        async with trio.open_nursery() as nursery:
            nursery.start_soon(app, scope, receive, send)
            await trio.testing.wait_all_tasks_blocked()
            app.start_shutdown()
            await trio.sleep(10 * ANSWER_MARGIN_S)  # well within shutdown_timeout_s
            gate.set()
    assert answered[0]["status"] == 200
    assert json.loads(answered[1]["body"])["tokens"] == 3
    [served] = served_events(capture_stage_logs)
    assert served["status"] == 200
    assert not served.get("send_timed_out", False)


async def test_a_draining_prefill_reads_the_body_before_its_503(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Answered over an unread body, the 503 was lost: HTTP/2 data for the finished stream broke
    hypercorn's connection (#329), and over HTTP/1.1 the close reset it."""
    async with open_pipeline(four_stages(), reference_model_factory(width=16), environ={}) as p:
        app = create_app(p)
        app.drain()
        chunks = [b'{"tokens": [1, 2', b', 3], "session_id": "s"}']
        read: list[bytes] = []
        answered: list[MutableMapping[str, Any]] = []

        async def receive() -> MutableMapping[str, Any]:
            read.append(chunks[len(read)])
            return {"type": "http.request", "body": read[-1], "more_body": len(read) < 2}

        async def send(message: MutableMapping[str, Any]) -> None:
            assert len(read) == 2, "answered before the body was read"
            answered.append(message)

        scope = {"type": "http", "method": "POST", "path": "/v1/prefill", "headers": []}
        await app(scope, receive, send)
    assert answered[0]["status"] == 503
    assert json.loads(answered[1]["body"])["error"] == "draining"


async def test_the_shutdown_does_not_wait_for_idle_connections() -> None:
    """A connection holding half a request (a keep-alive client that started its next one) kept
    hypercorn's connection waiting until the graceful timeout (shutdown_timeout_s + 2 s: 32 s by
    default, past a container's grace period). Once nothing is being answered, the rest close."""
    settings = ServerSettings(shutdown_timeout_s=600)  # the old wait: 602 s, past TIMEOUT_S
    with trio.fail_after(TIMEOUT_S):
        async with serving(settings=settings) as h:
            assert (await h.client.get("/healthz")).status_code == 200
            stream = await trio.open_tcp_stream(h.server.host, h.server.port)
            async with stream:
                await stream.send_all(b"POST /v1/prefill HTTP/1.1\r\nhost: x\r\n")
                h.server.shutdown()
                await h.server.wait_stopped()


# -- keep-alive -----------------------------------------------------------------------------------

HTTPX_KEEPALIVE_EXPIRY_S = 5.0
"""How long httpx (as most clients) reuses an idle connection; hypercorn's default server
keep-alive was the same 5 s, so a request sent at that boundary raced the server's close."""

_GET_HEALTHZ = b"GET /healthz HTTP/1.1\r\nHost: test\r\n\r\n"


async def _keep_alive_exchange(stream: trio.SocketStream) -> bytes:
    """Send ``GET /healthz`` on an open connection and read one answer (b"" if it was closed)."""
    try:
        await stream.send_all(_GET_HEALTHZ)
    except trio.BrokenResourceError:
        return b""
    answer = b""
    while b"\r\n\r\n" not in answer:
        try:
            chunk = await stream.receive_some()
        except trio.BrokenResourceError:
            return b""
        if not chunk:
            return b""
        answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    length = int(re.search(rb"(?i)content-length: *(\d+)", head).group(1))  # type: ignore[union-attr]
    while len(body) < length:
        chunk = await stream.receive_some()
        if not chunk:
            return b""
        body += chunk
    return head


async def test_an_idle_connection_reused_at_the_clients_keep_alive_expiry_is_answered(
    mock_clock: trio.testing.MockClock,
) -> None:
    """A connection idle for exactly httpx's keep-alive expiry is reused, not closed under the
    request: the server's keep-alive (75 s by default) outlasts common clients' (issue 21)."""
    async with serving() as h:
        stream = await trio.open_tcp_stream(h.server.host, h.server.port)
        async with stream:
            assert (await _keep_alive_exchange(stream)).startswith(b"HTTP/1.1 200 ")
            await trio.testing.wait_all_tasks_blocked()  # the server counts the idle time
            mock_clock.jump(HTTPX_KEEPALIVE_EXPIRY_S)
            await trio.testing.wait_all_tasks_blocked()
            assert (await _keep_alive_exchange(stream)).startswith(b"HTTP/1.1 200 ")
            await trio.testing.wait_all_tasks_blocked()  # the server counts the idle time
            mock_clock.jump(ServerSettings().keep_alive_timeout_s - 1)
            await trio.testing.wait_all_tasks_blocked()
            assert (await _keep_alive_exchange(stream)).startswith(b"HTTP/1.1 200 ")


async def test_an_idle_connection_is_closed_at_the_keep_alive_timeout(
    mock_clock: trio.testing.MockClock,
) -> None:
    """``keep_alive_timeout_s`` is the server's idle limit: a connection idle that long is
    closed, and the next request on it gets no answer."""
    async with serving(settings=ServerSettings(keep_alive_timeout_s=10)) as h:
        stream = await trio.open_tcp_stream(h.server.host, h.server.port)
        async with stream:
            assert (await _keep_alive_exchange(stream)).startswith(b"HTTP/1.1 200 ")
            await trio.testing.wait_all_tasks_blocked()  # the server counts the idle time
            mock_clock.jump(10)
            await trio.testing.wait_all_tasks_blocked()
            assert await _keep_alive_exchange(stream) == b""


async def test_each_answer_is_written_in_one_send_head_and_body_together(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Over HTTP/1 the server writes an answer's head with its body in one send (hypercorn
    writes them apart: two sends, and two TCP segments for a small answer), for answers with a
    body, without one (HEAD) and for errors, several on one keep-alive connection."""
    writes: list[tuple[int, bytes]] = []
    send_all = trio.SocketStream.send_all

    async def recording(self: trio.SocketStream, data: bytes | bytearray | memoryview) -> None:
        writes.append((self.socket.getsockname()[1], bytes(data)))
        await send_all(self, data)

    monkeypatch.setattr(trio.SocketStream, "send_all", recording)
    body = json.dumps({"tokens": prompt(20), "session_id": "s"}).encode()
    requests = [
        _GET_HEALTHZ,
        b"HEAD /healthz HTTP/1.1\r\nHost: test\r\n\r\n",
        b"POST /v1/prefill HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body,
        b"POST /v1/prefill HTTP/1.1\r\nHost: test\r\nContent-Length: 2\r\n\r\n{}",
        b"GET /nowhere HTTP/1.1\r\nHost: test\r\n\r\n",
    ]
    with trio.fail_after(TIMEOUT_S):
        async with serving() as h:
            stream = await trio.open_tcp_stream(h.server.host, h.server.port)
            async with stream:
                for request in requests:
                    await stream.send_all(request)
                    received = b""
                    while b"\r\n\r\n" not in received:
                        received += await stream.receive_some()
                    head, _, rest = received.partition(b"\r\n\r\n")
                    length = int(re.search(rb"(?i)content-length: *(\d+)", head).group(1))  # type: ignore[union-attr]
                    expected = 0 if request.startswith(b"HEAD") else length
                    while len(rest) < expected:
                        rest += await stream.receive_some()
                    assert len(rest) == expected
            answers = [data for port, data in writes if port == h.server.port]
    statuses = [answer.split(b" ", 2)[1] for answer in answers]
    assert statuses == [b"200", b"200", b"200", b"400", b"404"]
    for request, answer in zip(requests, answers, strict=True):
        head, _, rest = answer.partition(b"\r\n\r\n")
        length = int(re.search(rb"(?i)content-length: *(\d+)", head).group(1))  # type: ignore[union-attr]
        assert len(rest) == (0 if request.startswith(b"HEAD") else length)


def _open_connections() -> int:
    """Connection handlers running in this trio run (``trio.serve_listeners`` runs one per TCP
    connection, in a task named after its ``_run_handler``)."""
    count = 0
    root = trio.lowlevel.current_root_task()
    assert root is not None
    tasks = [root]
    while tasks:
        task = tasks.pop()
        count += task.name.endswith("._run_handler")
        for nursery in task.child_nurseries:
            tasks.extend(nursery.child_tasks)
    return count


async def test_a_connection_the_client_closes_ends_at_once(
    mock_clock: trio.testing.MockClock,
) -> None:
    """A keep-alive connection the client closes is let go at once (its task, its socket), not
    at the keep-alive timeout: hypercorn's idle timer held it 75 s, so short-lived clients
    could pile up open sockets."""
    async with serving() as h:
        stream = await trio.open_tcp_stream(h.server.host, h.server.port)
        async with stream:
            assert (await _keep_alive_exchange(stream)).startswith(b"HTTP/1.1 200 ")
            await trio.testing.wait_all_tasks_blocked()
            assert _open_connections() == 1
        for _ in range(3):  # the server reads the end of the stream, then closes its side
            await trio.testing.wait_all_tasks_blocked()
        assert _open_connections() == 0
        assert trio.current_time() == 0  # (no time passed: nothing timed out)


# -- load and faults ------------------------------------------------------------------------------


async def test_admission_control_answers_503_with_retry_after_beyond_max_inflight() -> None:
    """With max_inflight prefills held in the pipeline, the next one gets 503 + Retry-After."""
    gate = trio.Event()
    settings = ServerSettings(max_inflight=2, retry_after_s=3)
    answers: list[httpx.Response] = []
    with trio.fail_after(TIMEOUT_S):
        async with serving(settings=settings, model_factory=gated_factory(gate)) as h:

            async def held(index: int) -> None:
                body = {"tokens": prompt(20, offset=index), "session_id": "held"}
                answers.append(await h.client.post("/v1/prefill", json=body))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(held, 0)
                nursery.start_soon(held, 1)
                await h.pipeline.wait_until(lambda p: p.entered == 2)
                refused = await h.client.post(
                    "/v1/prefill", json={"tokens": [1, 2, 3], "session_id": "late"}
                )
                metrics = (await h.client.get("/metrics")).text
                gate.set()
            after = await h.client.post("/v1/prefill", json={"tokens": [1, 2], "session_id": "x"})

    assert refused.status_code == 503
    assert refused.headers["retry-after"] == "3"
    assert refused.json()["error"] == "overloaded"
    _, series = parse_prometheus_text(metrics)
    assert series['stage_runtime_prefill_rejected_total{reason="overloaded"}'] == 1
    assert series["stage_runtime_prefill_inflight"] == 2
    assert [answer.status_code for answer in answers] == [200, 200]
    assert after.status_code == 200
    assert h.pipeline.entered == 3  # the refused request never reached the pipeline


@pytest.mark.parametrize(
    ("fault", "message"),
    [
        ("raise", "RuntimeError: model cannot handle token 666"),
        # Library error types from the model are still the server's fault, not the client's
        # (400) or a stopped pipeline (503).
        ("config", "ConfigError: model cannot handle token 666"),
        ("short", "FrameError: stage input must be a frame of 3 tokens, got 2"),
    ],
)
async def test_model_error_fails_only_that_request(
    fault: str, message: str, capture_stage_logs: LogEvents
) -> None:
    """A model failing on one prompt answers that client 500; the server keeps serving."""
    with trio.fail_after(TIMEOUT_S):
        async with serving(model_factory=picky_factory(fault)) as h:
            failed = await h.client.post(
                "/v1/prefill", json={"tokens": [666, 1, 2], "session_id": "bad"}
            )
            fine = await h.client.post("/v1/prefill", json={"tokens": [1, 2], "session_id": "ok"})
            ready = await h.client.get("/readyz")
    assert failed.status_code == 500
    assert failed.json()["error"] == "prefill_failed"
    assert failed.json()["message"] == message
    assert fine.status_code == 200
    assert ready.status_code == 200
    assert [e["status"] for e in served_events(capture_stage_logs)][:2] == [500, 200]
    failures = [e for e in capture_stage_logs if e["event"] == "request_failed"]
    assert [e["session_id"] for e in failures] == ["bad"]


@pytest.mark.parametrize("notice", ["connection", "http.disconnect"])
@pytest.mark.parametrize("quitter_state", ["queued", "computing"])
async def test_client_disconnect_cancels_its_prefill_without_disturbing_others(
    quitter_state: str, notice: str, capture_stage_logs: LogEvents, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client hanging up cancels its own prefill (queued or computing); the other completes.
    The app learns of it from its connection (served by serve() over HTTP/1), or, served where
    the scope does not name the connection's disconnects, from ``http.disconnect``."""
    if notice == "http.disconnect":
        from stage_runtime.server import _connection

        async def plain(self: Any, scope: Any, *args: Any) -> None:
            await self._app(scope, *args)

        monkeypatch.setattr(_connection._WithDisconnects, "__call__", plain)
    gate = trio.Event()
    kept: list[httpx.Response] = []
    with trio.fail_after(TIMEOUT_S):
        async with serving(model_factory=gated_factory(gate)) as h:

            async def keeper() -> None:
                body = {"tokens": prompt(40), "session_id": "keeper", "request_id": "kept"}
                kept.append(await h.client.post("/v1/prefill", json=body))

            async def quitter(cancel_scope: trio.CancelScope) -> None:
                with cancel_scope:
                    async with httpx.AsyncClient(base_url=h.server.url) as own:
                        body = {"tokens": prompt(40, offset=7), "session_id": "quitter"}
                        await own.post("/v1/prefill", json=body)

            hang_up = trio.CancelScope()
            # Stage 0 works on one request at a time: the first one waits at the gate inside
            # the model, the second waits in stage 0's inbox.
            first, second = (
                (partial(quitter, hang_up), keeper)
                if quitter_state == "computing"
                else (keeper, partial(quitter, hang_up))
            )
            async with trio.open_nursery() as nursery:
                nursery.start_soon(first)
                await h.pipeline.wait_until(lambda p: p.entered == 1)
                nursery.start_soon(second)
                await h.pipeline.wait_until(lambda p: p.entered == 2)
                hang_up.cancel()  # closes the quitter's connection mid-request
                await h.pipeline.wait_until(lambda p: p.left == 1)
                await trio.testing.wait_all_tasks_blocked()  # let the handler unwind
                assert not kept  # the keeper is still held by the gate
                inflight_after_hang_up = h.server.app.inflight
                gate.set()
            stats = (await h.client.get("/v1/stats")).json()

    assert inflight_after_hang_up == 1
    assert [answer.status_code for answer in kept] == [200]
    assert kept[0].json()["request_id"] == "kept"
    assert kept[0].json()["stages"][0]["computed_tokens"] == 40
    prefills = [e for e in served_events(capture_stage_logs) if e["path"] == "/v1/prefill"]
    assert sorted((e["status"], e["session_id"]) for e in prefills) == [
        (200, "keeper"),
        (499, "quitter"),
    ]
    cancelled = [e for e in capture_stage_logs if e["event"] == "prefill_cancelled"]
    assert [e["session_id"] for e in cancelled] == ["quitter"]
    # The quitter sent no request_id: the server's generated one is in both of its log events.
    (hung_up,) = [e for e in prefills if e["status"] == 499]
    assert re.fullmatch(r"http-\d+", cancelled[0]["request_id"])
    assert hung_up["request_id"] == cancelled[0]["request_id"]
    assert stats["server"]["prefills"] == 1


async def test_a_forced_stop_counts_and_logs_each_request_it_drops(
    capture_stage_logs: LogEvents,
) -> None:
    """abort() cancels the requests in flight: each is logged as request_dropped and counted
    in app.dropped (the serve command then exits 1), where a graceful stop drops none."""
    gate = trio.Event()
    lost: list[Exception] = []

    async def held(url: str, index: int) -> None:
        async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT_S) as own:
            body = {"tokens": prompt(24, offset=index), "session_id": f"s{index}"}
            try:
                await own.post("/v1/prefill", json=body)
            except httpx.HTTPError as exc:  # the connection is dropped unanswered
                lost.append(exc)

    with trio.fail_after(TIMEOUT_S):
        async with serving(model_factory=gated_factory(gate)) as h:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(held, h.server.url, 0)
                nursery.start_soon(held, h.server.url, 1)
                await h.pipeline.wait_until(lambda p: p.entered == 2)
                h.server.abort()
                await h.server.wait_stopped()
            app = h.server.app
            gate.set()
    assert len(lost) == 2
    assert app.dropped == 2
    dropped = [e for e in capture_stage_logs if e["event"] == "request_dropped"]
    assert [(e["method"], e["path"], e["log_level"]) for e in dropped] == [
        ("POST", "/v1/prefill", "warning")
    ] * 2


def test_the_serve_command_exits_1_when_a_forced_shutdown_dropped_requests(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """A supervisor can tell a forced stop that lost requests from a clean one."""
    from stage_runtime.server import command

    topology = tmp_path / "t.toml"
    topology.write_text("")  # (read by the stubbed _serve only)

    async def served(args: argparse.Namespace) -> int:
        return 3

    monkeypatch.setattr(command, "_serve", served)
    monkeypatch.setattr(command, "configure_logging", lambda **kwargs: None)
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    assert run_serve(parser.parse_args(["--topology", str(topology)])) == 1
    assert capsys.readouterr().err == (
        "stage-runtime serve: error: a forced shutdown dropped 3 request(s) before they were "
        "answered\n"
    )


async def test_graceful_shutdown_drains_inflight_requests_then_stops_pipeline() -> None:
    """Draining fails readiness and refuses new work; in-flight requests all complete."""
    gate = trio.Event()
    answers: list[httpx.Response] = []
    with trio.fail_after(TIMEOUT_S):
        async with serving(model_factory=gated_factory(gate)) as h:
            async with trio.open_nursery() as nursery:
                start_held_prefills(nursery, h.server.url, answers)
                await h.pipeline.wait_until(lambda p: p.entered == 3)

                h.server.drain()
                ready = await h.client.get("/readyz")
                refused = await h.client.post(
                    "/v1/prefill", json={"tokens": [1], "session_id": "n"}
                )
                alive = await h.client.get("/healthz")

                h.server.shutdown()
                assert not h.pipeline.draining  # the pipeline stops only after the server
                gate.set()
            await h.server.wait_stopped()
            pipeline_running_after_server = not h.pipeline.draining
            with pytest.raises(httpx.ConnectError):
                async with httpx.AsyncClient(base_url=h.server.url) as late:
                    await late.get("/healthz")
        assert h.pipeline.draining  # leaving open_pipeline drained and stopped it

    assert ready.status_code == 503
    assert ready.json() == {"status": "draining"}
    assert refused.status_code == 503
    assert refused.json()["error"] == "draining"
    assert "retry-after" in refused.headers
    assert alive.status_code == 200
    assert [answer.status_code for answer in answers] == [200, 200, 200]  # none lost
    assert pipeline_running_after_server


async def test_prefills_still_running_at_the_shutdown_timeout_are_answered_503(
    capture_stage_logs: LogEvents,
) -> None:
    """Past shutdown_timeout_s an in-flight prefill is cancelled and answered 503, not dropped."""
    gate = trio.Event()
    answers: list[httpx.Response] = []
    settings = ServerSettings(shutdown_timeout_s=0.01, retry_after_s=7)
    with trio.fail_after(TIMEOUT_S):
        async with serving(settings=settings, model_factory=gated_factory(gate)) as h:
            async with trio.open_nursery() as nursery:
                start_held_prefills(nursery, h.server.url, answers)
                await h.pipeline.wait_until(lambda p: p.entered == 3)
                h.server.shutdown()  # the gate stays shut: no prefill can finish in time
            await h.server.wait_stopped()
            gate.set()  # let the stages finish the abandoned work so the pipeline can stop
            _, series = parse_prometheus_text(await h.server.app.metrics_text())

    assert [answer.status_code for answer in answers] == [503, 503, 503]
    for answer in answers:
        assert answer.json()["error"] == "shutdown_timeout"
        assert "shutdown_timeout_s=0.01" in answer.json()["message"]
        assert answer.headers["retry-after"] == "7"
    prefills = [e for e in served_events(capture_stage_logs) if e["path"] == "/v1/prefill"]
    assert sorted(e["session_id"] for e in prefills) == ["s0", "s1", "s2"]
    assert {(e["status"], e["error"]) for e in prefills} == {(503, "shutdown_timeout")}
    cancelled = [e for e in capture_stage_logs if e["event"] == "prefill_cancelled"]
    assert {e["reason"] for e in cancelled} == {"shutdown_timeout"}
    assert len(cancelled) == 3
    assert series['stage_runtime_prefill_rejected_total{reason="shutdown_timeout"}'] == 3
    assert series["stage_runtime_prefill_inflight"] == 0


@pytest.mark.parametrize("first", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
async def test_a_signal_drains_with_requests_in_flight_and_none_is_lost(
    first: signal.Signals, capture_stage_logs: LogEvents
) -> None:
    """SIGINT or SIGTERM: readiness 503 and new prefills refused while the held ones finish.

    The second signal ends the drain grace period and closes the listener; the held requests
    still complete with 200, and only then does the pipeline stop.
    """
    gate = trio.Event()
    answers: list[httpx.Response] = []
    with trio.fail_after(TIMEOUT_S):
        async with open_pipeline(four_stages(), gated_factory(gate), environ={}) as pipeline:
            observed = ObservedPipeline(inner=pipeline)
            app = create_app(observed)
            async with trio.open_nursery() as nursery:
                server: RunningServer = await nursery.start(
                    partial(
                        real_serve,
                        app,
                        bind="127.0.0.1:0",
                        handle_signals=True,
                        drain_grace_s=600,  # only the second signal ends it
                    )
                )
                start_held_prefills(nursery, server.url, answers)
                await observed.wait_until(lambda p: p.entered == 3)
                signal.raise_signal(first)
                async with httpx.AsyncClient(base_url=server.url, timeout=TIMEOUT_S) as client:
                    # The OS delivers the signal to trio's signal receiver asynchronously, and
                    # the app exposes no event for it: checkpoint until the flag flips.
                    while not app.draining:
                        await trio.lowlevel.checkpoint()
                    ready = await client.get("/readyz")
                    refused = await client.post(
                        "/v1/prefill", json={"tokens": [1], "session_id": "late"}
                    )
                    metrics = (await client.get("/metrics")).text
                signal.raise_signal(signal.SIGTERM)
                while not server.closing:
                    await trio.lowlevel.checkpoint()
                assert not answers  # still held at the gate
                gate.set()
            stopped_before_pipeline = server.stopped and not pipeline.draining

    assert (ready.status_code, ready.json()) == (503, {"status": "draining"})
    assert refused.status_code == 503
    assert refused.json()["error"] == "draining"
    assert parse_prometheus_text(metrics)[1]["stage_runtime_ready"] == 0
    assert [answer.status_code for answer in answers] == [200, 200, 200]  # none lost
    assert stopped_before_pipeline
    events = [e["event"] for e in capture_stage_logs]
    assert events.index("shutdown_requested") < events.index("shutdown_hastened")
    [requested] = [e for e in capture_stage_logs if e["event"] == "shutdown_requested"]
    assert requested["signal"] == first.name


# -- probes, metrics, logs ----------------------------------------------------------------------


async def test_healthz_and_readyz_report_ok_while_serving() -> None:
    """Liveness and readiness are 200 on a running server bound to the port the OS picked."""
    with trio.fail_after(TIMEOUT_S):
        async with serving() as h:
            health = await h.client.get("/healthz")
            ready = await h.client.get("/readyz")
            address = (h.server.host, h.server.port)
    assert address[0] == "127.0.0.1"
    assert address[1] > 0  # the port the OS picked for port 0
    assert h.server.url == f"http://127.0.0.1:{address[1]}"
    assert h.server.stopped
    assert (health.status_code, health.json()) == (200, {"status": "ok"})
    assert (ready.status_code, ready.json()) == (200, {"status": "ready"})


async def test_probes_answer_head_with_the_get_headers_and_no_body() -> None:
    """HEAD on the GET routes (curl -I, load-balancer checks) answers like GET, without a body."""
    with trio.fail_after(TIMEOUT_S):
        async with serving() as h:
            head = await h.client.head("/healthz")
            get = await h.client.get("/healthz")
            head_metrics = await h.client.head("/metrics")
            head_prefill = await h.client.head("/v1/prefill")
            post_probe = await h.client.post("/readyz")
    assert head.status_code == 200
    assert head.content == b""
    assert head.headers["content-length"] == get.headers["content-length"] == str(len(get.content))
    assert head_metrics.status_code == 200
    assert head_metrics.headers["content-type"].startswith("text/plain; version=0.0.4")
    assert head_prefill.status_code == 405
    assert head_prefill.headers["allow"] == "POST"
    assert post_probe.status_code == 405
    assert post_probe.headers["allow"] == "GET, HEAD"


def parse_prometheus_text(text: str) -> tuple[dict[str, str], dict[str, float]]:
    """Parse the text exposition with prometheus_client's own parser; return ``{family: type}``
    (counters under their ``_total`` name, as the text format declares them) and
    ``{series: value}`` (``name{label="value",...}``, labels sorted by name). No series may
    appear twice."""
    families: dict[str, str] = {}
    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        name = family.name + ("_total" if family.type == "counter" else "")
        assert name not in families, f"{name} declared twice"
        families[name] = family.type
        for sample in family.samples:
            labels = ",".join(f'{key}="{value}"' for key, value in sorted(sample.labels.items()))
            series = sample.name + (f"{{{labels}}}" if labels else "")
            assert series not in samples, f"duplicate series {series}"
            samples[series] = sample.value
    return families, samples


async def test_metrics_are_valid_prometheus_text_matching_stats() -> None:
    """Each family has HELP then TYPE before its samples, and counters match /v1/stats."""
    with trio.fail_after(TIMEOUT_S):
        async with serving() as h:
            body = {"tokens": prompt(64), "session_id": "m"}
            for _ in range(2):
                await h.client.post("/v1/prefill", json=body)
            await h.client.post("/v1/prefill", content=b"nope")
            response = await h.client.get("/metrics")
            stats = (await h.client.get("/v1/stats")).json()

    assert response.status_code == 200
    assert response.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    text = response.text
    assert text.endswith("\n")
    declared, samples = parse_prometheus_text(text)
    assert declared["stage_runtime_prefill_duration_seconds"] == "summary"
    for stage in stats["stages"]:
        label = f'{{stage_id="{stage["stage_id"]}"}}'
        assert samples[f"stage_runtime_cache_hits_total{label}"] == stage["cache"]["hits"]
        assert samples[f"stage_runtime_cache_entries{label}"] == stage["cache"]["entries"]
        assert samples[f"stage_runtime_mailbox_size{label}"] == stage["mailbox"]["mailbox_size"]
        # /v1/stats came after /metrics, and its own stats request is one more processed message.
        processed = samples[f"stage_runtime_mailbox_processed_total{label}"]
        assert 0 < processed < stage["mailbox"]["processed"]
    assert samples["stage_runtime_prefill_duration_seconds_count"] == 2
    assert samples['stage_runtime_http_responses_total{route="/v1/prefill",status="400"}'] == 1
    assert samples["stage_runtime_ready"] == 1


async def test_metrics_speak_openmetrics_to_a_scraper_that_asks() -> None:
    """Accept: application/openmetrics-text gets OpenMetrics (same samples, ``# EOF``); a plain
    scrape keeps the text format."""
    with trio.fail_after(TIMEOUT_S):
        async with serving() as h:
            await h.client.post("/v1/prefill", json={"tokens": prompt(64), "session_id": "m"})
            accept = "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5"
            open_metrics = await h.client.get("/metrics", headers={"accept": accept})
            plain = await h.client.get("/metrics")
    assert open_metrics.status_code == 200
    assert open_metrics.headers["content-type"].startswith("application/openmetrics-text")
    assert open_metrics.text.endswith("# EOF\n")
    assert plain.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    families = {f.name: f for f in openmetrics_families(open_metrics.text)}  # type: ignore[no-untyped-call]
    _, series = parse_prometheus_text(plain.text)
    [prefills] = families["stage_runtime_prefill_duration_seconds"].samples[-1:]
    assert prefills.name == "stage_runtime_prefill_duration_seconds_count"
    assert prefills.value == series["stage_runtime_prefill_duration_seconds_count"] == 1


@pytest.mark.parametrize("index", ["ladder", "paged"])
async def test_stats_and_metrics_expose_misses_by_reason_and_the_footprint(index: str) -> None:
    """/v1/stats and /metrics show misses by reason, restored tokens, resident vs unique bytes."""
    # 40-token prompts: ladder rungs 40 and 32 (2 entries), or 2 pages of 16 and a tail (3).
    cache = KvCacheConfig(
        mode=CacheMode.LOOKUP_RECORD,
        min_tokens=8,
        shared_prefix_stride_tokens=16,
        max_entries=2 if index == "ladder" else 3,
        index=index,
    )
    stages = [attrs.evolve(config, kv_cache=cache) for config in four_stages()]
    first = {"tokens": prompt(40), "session_id": "a"}
    other = {"tokens": prompt(40, offset=500), "session_id": "b"}
    with trio.fail_after(TIMEOUT_S):
        async with serving(stages=stages) as h:
            for body in (first, first, other, first):  # hit, then evicted by the other prompt
                assert (await h.client.post("/v1/prefill", json=body)).status_code == 200
            text = (await h.client.get("/metrics")).text
            stats = (await h.client.get("/v1/stats")).json()

    help_lines = {line.split()[2]: line for line in text.splitlines() if line.startswith("# HELP")}
    assert "by reason" in help_lines["stage_runtime_cache_restore_misses_total"]
    assert "# TYPE stage_runtime_cache_restore_misses_total counter" in text
    assert "# TYPE stage_runtime_cache_unique_prefix_bytes gauge" in text
    _, series = parse_prometheus_text(text)
    for stage in stats["stages"]:
        acc = stage["cache"]["accounting"]
        assert acc["index"] == index
        assert (acc["lookups"], acc["hits"], acc["restored_tokens"]) == (4, 1, 40)
        assert (acc["misses_never_seen"], acc["misses_evicted"], acc["misses_rejected"]) == (
            2,
            1,
            0,
        )
        assert acc["misses"] == 3
        assert acc["resident_bytes"] == stage["cache"]["resident_bytes"]
        rows = 40 + 32 if index == "ladder" else 40  # the ladder keeps a copy per rung
        assert acc["resident_bytes"] == acc["unique_prefix_bytes"] * rows // 40
        assert acc["residency_ratio"] == pytest.approx(rows / 40)
        label = f'stage_id="{stage["stage_id"]}"'
        for reason, count in (("never_seen", 2), ("evicted", 1), ("rejected", 0)):
            assert (
                series[f'stage_runtime_cache_restore_misses_total{{reason="{reason}",{label}}}']
                == count
            )
        assert series[f"stage_runtime_cache_restored_tokens_total{{{label}}}"] == 40
        assert series[f"stage_runtime_cache_restore_hits_total{{{label}}}"] == 1
        unique = acc["unique_prefix_bytes"]
        assert series[f"stage_runtime_cache_unique_prefix_bytes{{{label}}}"] == unique


async def test_each_request_logs_one_request_served_event(capture_stage_logs: LogEvents) -> None:
    """Every request logs request_served once, prefills with tokens and restored tokens."""
    with trio.fail_after(TIMEOUT_S):
        async with serving() as h:
            body = {"tokens": prompt(50), "session_id": "logs", "request_id": "r"}
            await h.client.post("/v1/prefill", json=body)
            answer = await h.client.post("/v1/prefill", json=body)
            await h.client.post("/v1/prefill", json={"tokens": []})
            await h.client.get("/healthz")
    served = served_events(capture_stage_logs)
    assert [(e["path"], e["status"]) for e in served] == [
        ("/v1/prefill", 200),
        ("/v1/prefill", 200),
        ("/v1/prefill", 400),
        ("/healthz", 200),
    ]
    assert (served[2]["error"], served[2]["field"]) == ("invalid_field", "tokens")
    second = served[1]
    assert second["tokens"] == 50
    assert second["request_id"] == "r"
    assert set(second["restored_tokens"]) == {f"stage-{i}" for i in range(4)}
    assert all(count > 0 for count in second["restored_tokens"].values())
    # The logged time covers reading the body and the prefill the answer reports, so it is longer.
    assert second["elapsed_s"] >= answer.json()["elapsed_s"] > 0


# -- command line and example --------------------------------------------------------------------


def test_serve_closes_its_socket_when_signals_cannot_be_handled() -> None:
    """handle_signals off the main thread fails (trio's rule) after the socket was bound: the
    socket is closed then, not left to the garbage collector (a ResourceWarning)."""
    import gc
    import threading
    import warnings

    errors: list[BaseException] = []

    async def main() -> None:
        async with open_pipeline(four_stages(), reference_model_factory(width=16), environ={}) as p:
            await real_serve(create_app(p), bind="127.0.0.1:0", handle_signals=True)

    def run() -> None:
        try:
            trio.run(main)
        except BaseException as exc:
            errors.append(exc)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        thread = threading.Thread(target=run)
        thread.start()
        thread.join()
        assert "main thread" in repr(errors)
        errors.clear()  # its traceback holds the frames, hence the socket
        gc.collect()
    assert [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)] == []


def test_serve_arguments_have_defaults_and_reject_bad_values() -> None:
    """The serve flags parse with sensible defaults and refuse nonsense."""
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    args = parser.parse_args(["--topology", "t.toml"])
    assert (args.bind, args.max_inflight, args.max_body_bytes) == ("127.0.0.1:8000", 64, 1 << 20)
    assert args.topology == Path("t.toml")
    assert args.body_timeout == 30.0
    assert (args.keep_alive_timeout, args.backlog) == (75.0, 1024)
    tuned = parser.parse_args(
        ["--topology", "t.toml", "--keep-alive-timeout", "120", "--backlog", "4096"]
    )
    assert (tuned.keep_alive_timeout, tuned.backlog) == (120.0, 4096)
    for bad in (
        ["--keep-alive-timeout", "0"],
        ["--backlog", "0"],
        ["--body-timeout", "0"],
        ["--max-inflight", "0"],
        ["--max-body-bytes", "many"],
        ["--bind", "localhost"],
        ["--bind", "h:99999"],
        ["--shutdown-timeout", "0"],
        ["--drain-grace", "-1"],
        ["--seed", "-1"],
    ):
        with pytest.raises(SystemExit):
            parser.parse_args(["--topology", "t.toml", *bad])


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--bind", "::1", "must put an IPv6 host in brackets, [HOST]:PORT (e.g. [::1]:8000)"),
        ("--width", "100000", "must be an integer in [1, 8,192], got 100000"),  # 80 GB matrix
        ("--width", "99999999999999999999", "must be an integer in [1, 8,192]"),
    ],
)
def test_serve_refuses_what_would_fail_after_the_pipeline_started(
    flag: str, value: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """An unbracketed IPv6 host (read as host ':' port 1) and a reference-model width whose
    matrix cannot be allocated are usage errors, not tracebacks once the stages start."""
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(["--topology", "t.toml", flag, value])
    assert message in capsys.readouterr().err
    assert parser.parse_args(["--topology", "t.toml", "--bind", "[::1]:0"]).bind == "[::1]:0"


@pytest.mark.parametrize(("value", "shown"), [("0", "0"), ("-1", "-1"), ("nan", "nan")])
def test_serve_positive_durations_word_every_refusal_alike(
    value: str, shown: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """--shutdown-timeout says the same rule whatever the bad value."""
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(["--topology", "t.toml", "--shutdown-timeout", value])
    assert f"must be a finite number > 0, got {shown}" in capsys.readouterr().err


@pytest.mark.usefixtures("restore_logging_config")
def test_serve_without_the_server_extra_fails_before_starting_the_pipeline(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without hypercorn, serve exits 2 with one line and never starts a stage."""
    monkeypatch.setitem(sys.modules, "hypercorn", None)
    monkeypatch.setitem(sys.modules, "hypercorn.trio", None)
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    args = parser.parse_args(["--topology", str(ROOT / "examples/topology.toml")])
    with structlog.testing.capture_logs() as logs:
        status = run_serve(args)
    captured = capsys.readouterr()
    assert status == 2
    assert captured.err.splitlines() == [
        "stage-runtime serve: error: the server needs the 'server' extra (hypercorn is "
        "missing): pip install 'stage-runtime[server]'"
    ]
    assert logs == []


@pytest.fixture
def restore_logging_config() -> Iterator[None]:
    """run_serve configures structlog like a program does; put the test's configuration back."""
    saved = structlog.get_config()
    yield
    structlog.reset_defaults()
    structlog.configure(**saved)


@pytest.mark.usefixtures("restore_logging_config")
def test_serve_command_exits_2_on_a_bad_topology(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A topology with a gap between stages is reported by file and field, exit status 2."""
    topology = tmp_path / "gap.toml"
    topology.write_text(
        '[[stage]]\nstage_id = "a"\nmodel_id = "m"\nlayer_start = 0\nlayer_end = 4\n'
        '[[stage]]\nstage_id = "b"\nmodel_id = "m"\nlayer_start = 5\nlayer_end = 8\n'
    )
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    status = run_serve(parser.parse_args(["--topology", str(topology), "--log-format", "json"]))
    err = capsys.readouterr().err
    assert status == 2
    assert "stage-runtime serve: error:" in err
    assert "gap.toml" in err
    assert "layer_start" in err


@pytest.mark.usefixtures("restore_logging_config")
def test_serve_command_exits_2_on_stages_past_the_models_layers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A last stage ending past a Llama model's layers is one line and exit status 2 before
    any stage starts (it was a stage failure: an exception-group traceback and exit 1)."""
    from stage_runtime.llama import write_random_llama

    write_random_llama(tmp_path / "weights", num_hidden_layers=4)
    topology = tmp_path / "too_many.toml"
    topology.write_text(
        "[model]\nkind = 'llama'\npath = 'weights'\n"
        '[[stage]]\nstage_id = "s0"\nmodel_id = "m"\nlayer_start = 0\nlayer_end = 4\n'
        '[[stage]]\nstage_id = "s1"\nmodel_id = "m"\nlayer_start = 4\nlayer_end = 8\n'
    )
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    args = parser.parse_args(["--topology", str(topology), "--bind", "127.0.0.1:0"])
    status = run_serve(args)
    assert status == 2
    assert capsys.readouterr().err == (
        f"stage-runtime serve: error: {topology}: line 13: stage[1].layer_end must be 4: the "
        "stages must cover the model's 4 layers (num_hidden_layers) to the last, got 8 "
        "(stage 's1')\n"
    )


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--width", "32"], "--width"),
        (["--seed", "0"], "--seed"),  # given, even at its default value
        (["--seed", "3", "--width", "64"], "--width and --seed"),
    ],
)
@pytest.mark.usefixtures("restore_logging_config")
def test_serve_refuses_width_and_seed_with_a_topology_that_names_its_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str], named: str
) -> None:
    """--width and --seed choose the reference model; with a topology whose [model] table
    chooses the model they were silently ignored, now they are a one-line error, exit 2."""
    topology = tmp_path / "model.toml"
    topology.write_text(
        "[model]\nkind = 'reference'\nwidth = 8\n"
        '[[stage]]\nstage_id = "a"\nmodel_id = "m"\nlayer_start = 0\nlayer_end = 4\n'
    )
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    with socket.socket() as taken:
        # Refused before the pipeline starts or the address is bound: had the flags been
        # ignored, the taken address would end serve (exit 1) instead of serving on.
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        bind = f"127.0.0.1:{taken.getsockname()[1]}"
        status = run_serve(parser.parse_args(["--topology", str(topology), "--bind", bind, *flags]))
    assert status == 2
    assert capsys.readouterr().err == (
        f"stage-runtime serve: error: {named} cannot be given with {topology}: its [model] "
        "table chooses the model (--width and --seed set the reference model of a topology "
        "without one)\n"
    )


@pytest.mark.usefixtures("restore_logging_config")
def test_serve_command_exits_1_on_a_topology_it_cannot_read(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A missing topology file, or a directory, is an unreadable file as a trace is: one line,
    exit status 1 (a topology that reads but is wrong stays a usage error, 2)."""
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    for path, reason in (
        (tmp_path / "missing.toml", "no such file"),
        (tmp_path, "it is a directory"),
    ):
        with structlog.testing.capture_logs() as logs:
            status = run_serve(parser.parse_args(["--topology", str(path)]))
        assert status == 1
        assert capsys.readouterr().err == (
            f"stage-runtime serve: error: cannot read topology {path}: {reason}\n"
        )
        assert logs == []  # refused before logging was set up or anything started


@pytest.mark.usefixtures("restore_logging_config")
def test_serve_command_exits_2_on_a_bad_cache_environment_variable(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stage without a kv_cache block takes the environment's settings; a bad one is a
    usage error in one line (it was a stage failure: a traceback and exit 1)."""
    topology = tmp_path / "nokv.toml"
    topology.write_text(
        '[[stage]]\nstage_id = "a"\nmodel_id = "m"\nlayer_start = 0\nlayer_end = 4\n'
    )
    monkeypatch.setenv("STAGE_RUNTIME_KV_CACHE", "on")
    monkeypatch.setenv("STAGE_RUNTIME_KV_CACHE_MAX_ENTRIES", "abc")
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    status = run_serve(parser.parse_args(["--topology", str(topology), "--log-format", "json"]))
    assert status == 2
    assert capsys.readouterr().err == (
        "stage-runtime serve: error: STAGE_RUNTIME_KV_CACHE_MAX_ENTRIES must be an integer, "
        "got 'abc'\n"
    )


@pytest.mark.usefixtures("restore_logging_config")
def test_serve_command_exits_1_when_the_address_is_taken(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Binding an address already in use fails cleanly with exit status 1."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        bind = f"127.0.0.1:{taken.getsockname()[1]}"
        parser = argparse.ArgumentParser()
        add_serve_arguments(parser)
        topology = str(ROOT / "examples" / "topology.toml")
        status = run_serve(
            parser.parse_args(["--topology", topology, "--bind", bind, "--log-format", "json"])
        )
    assert status == 1
    assert f"cannot listen on {bind}" in capsys.readouterr().err


@attrs.define(eq=False)
class ServeProcess:
    """``run_serve`` in a child process, with its JSON log lines readable one event at a time."""

    process: trio.Process
    events: list[dict[str, Any]] = attrs.field(factory=list)
    lines: list[str] = attrs.field(factory=list)
    """The lines of stderr that are not JSON log events."""
    _buffer: bytes = b""

    async def next_event(self, name: str) -> dict[str, Any]:
        """Read log lines until the next event called ``name``."""
        assert self.process.stderr is not None
        while True:
            while b"\n" in self._buffer:
                raw, self._buffer = self._buffer.split(b"\n", 1)
                if not raw.startswith(b"{"):
                    self.lines.append(raw.decode())
                    continue
                self.events.append(json.loads(raw))
                if self.events[-1]["event"] == name:
                    return self.events[-1]
            chunk = await self.process.stderr.receive_some()
            assert chunk, (
                f"process exited before logging {name}: events {self.events[-5:]!r}, "
                f"other lines {self.lines[-20:]!r}, unread {self._buffer!r}"
            )
            self._buffer += chunk


@asynccontextmanager
async def serve_process(
    *options: str,
    env: dict[str, str] | None = None,
    topology: Path = ROOT / "examples" / "topology.toml",
) -> AsyncIterator[ServeProcess]:
    """Start ``stage-runtime serve`` (as ``python -m stage_runtime serve``, the console script's
    entry point) on a free port (JSON logs: stderr is a pipe); kill it if needed."""
    argv = [sys.executable, "-m", "stage_runtime", "serve", "--topology", str(topology), *options]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    process = await trio.lowlevel.open_process(
        [*argv, "--bind", "127.0.0.1:0"], stderr=subprocess.PIPE, env=env
    )
    try:
        yield ServeProcess(process=process)
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


async def test_serve_command_serves_json_logs_and_drains_on_sigterm() -> None:
    """The serve command, run as a process, answers requests, logs JSON, and exits 0 on SIGTERM."""
    with trio.fail_after(60):
        async with serve_process("--keep-alive-timeout", "90", "--backlog", "300") as child:
            started = await child.next_event("server_started")
            async with httpx.AsyncClient(base_url=started["url"], timeout=TIMEOUT_S) as client:
                body = {"text": "hello, pipeline " * 4, "session_id": "cli"}
                answer = await client.post("/v1/prefill", json=body)
            served = await child.next_event("request_served")
            child.process.send_signal(signal.SIGTERM)
            await child.next_event("server_stopped")
            status = await child.process.wait()
    assert answer.status_code == 200
    assert len(answer.json()["stages"]) == 4
    assert (started["keep_alive_timeout_s"], started["backlog"]) == (90.0, 300)
    assert served["status"] == 200
    assert served["level"] == "info"
    assert served["restored_tokens"] == {f"stage-{i}": 0 for i in range(4)}
    assert any(event["event"] == "shutdown_requested" for event in child.events)
    assert status == 0


async def test_serve_refuses_text_for_a_llama_model_without_a_tokenizer(tmp_path: Path) -> None:
    """A Llama model directory without tokenizer.json: ``"text"`` is a 400 naming the field
    and saying to send ids in ``"tokens"`` (its UTF-8 bytes were taken for token ids, which
    mean nothing to the model: ``"hello"`` was refused as id 104 outside a vocabulary of 100)."""
    from stage_runtime.llama import write_random_llama

    write_random_llama(tmp_path / "weights", num_hidden_layers=2, vocab_size=100)
    topology = tmp_path / "llama.toml"
    topology.write_text(
        "[model]\nkind = 'llama'\npath = 'weights'\n"
        '[[stage]]\nstage_id = "s0"\nmodel_id = "m"\nlayer_start = 0\nlayer_end = 2\n'
    )
    with trio.fail_after(60):
        async with serve_process(topology=topology) as child:
            started = await child.next_event("server_started")
            async with httpx.AsyncClient(base_url=started["url"], timeout=TIMEOUT_S) as client:
                refused = await client.post(
                    "/v1/prefill", json={"text": "hello", "session_id": "t"}
                )
                answered = await client.post(
                    "/v1/prefill", json={"tokens": [1, 2, 3], "session_id": "t"}
                )
            child.process.send_signal(signal.SIGTERM)
            status = await child.process.wait()
    assert refused.status_code == 400
    assert refused.json()["field"] == "text"
    assert refused.json()["message"] == (
        "text needs the model's own tokenizer, and the model has none (its directory holds no "
        "tokenizer.json): send token ids in tokens"
    )
    assert answered.status_code == 200
    assert len(answered.json()["top_tokens"]) == 5
    assert status == 0


async def test_serve_command_warns_on_stderr_about_a_mistyped_cache_mode() -> None:
    """``STAGE_RUNTIME_KV_CACHE=maybe`` leaves the cache off; serve says so in a plain line on
    stderr as it starts, even when its logs are JSON, and logs the structured warning too."""
    with trio.fail_after(60):
        async with serve_process(env={"STAGE_RUNTIME_KV_CACHE": "maybe"}) as child:
            await child.next_event("server_started")
    warned = [line for line in child.lines if line.startswith("stage-runtime serve: warning:")]
    assert len(warned) == 1
    assert "STAGE_RUNTIME_KV_CACHE='maybe' is not a cache mode" in warned[0]
    assert "accepted: auto, 0, off" in warned[0]
    assert [event["event"] for event in child.events].count("cache_mode_unrecognised") == 1


def _processes_mentioning(text: str) -> list[int]:
    """Pids of the processes whose command line mentions ``text``."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                command = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if text.encode() in command:
                found.append(int(entry.name))
    return found


def _processes_with_environment(entry: str) -> list[int]:
    """Pids of this user's processes (not this one) whose environment holds ``entry``
    (``NAME=value``)."""
    found = []
    for process in Path("/proc").iterdir():
        if process.name.isdigit() and int(process.name) != os.getpid():
            try:
                environment = (process / "environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if entry.encode() in environment:
                found.append(int(process.name))
    return found


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
async def test_serve_with_ray_placement_serves_and_leaves_no_process_on_sigint() -> None:
    """``serve --placement ray`` starts its own Ray instance, answers from stage processes,
    drains on SIGINT and exits 0 with every stage and Ray process gone."""
    pytest.importorskip("ray")
    temp = Path(tempfile.mkdtemp(prefix="sr-serve-ray-"))
    env = {"RAY_TMPDIR": str(temp), "RAY_AUTH_MODE": "disabled"}
    try:
        with trio.fail_after(120):
            async with serve_process("--placement", "ray", env=env) as child:
                started = await child.next_event("server_started")
                async with httpx.AsyncClient(base_url=started["url"], timeout=60) as client:
                    body = {"tokens": prompt(80), "session_id": "ray"}
                    first = await client.post("/v1/prefill", json=body)
                    second = await client.post("/v1/prefill", json=body)
                child.process.send_signal(signal.SIGINT)
                await child.next_event("server_stopped")
                status = await child.process.wait()
        stage_pids = {
            e["pid"] for e in child.events if e["event"] == "stage_process_started" and "pid" in e
        }
        assert status == 0
        assert first.status_code == second.status_code == 200
        assert [s["restored_tokens"] for s in second.json()["stages"]] == [80] * 4
        assert len(stage_pids) == 4
        assert os.getpid() not in stage_pids
        assert _processes_mentioning(str(temp)) == []  # Ray's own processes are gone too
        for pid in stage_pids:
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)
    finally:
        # A run that failed part-way can leave Ray's processes (its agents rename themselves,
        # so their command lines no longer say where they came from; their environment does).
        for pid in _processes_with_environment(f"RAY_TMPDIR={temp}"):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(temp, ignore_errors=True)


async def test_serve_command_reports_draining_during_grace_and_a_second_signal_hastens() -> None:
    """During --drain-grace the listener stays open with readiness 503; SIGTERM again ends it."""
    with trio.fail_after(60):
        options = ("--drain-grace", "600", "--retry-after", "9", "--max-body-bytes", "64")
        async with serve_process(*options) as child:
            started = await child.next_event("server_started")
            async with httpx.AsyncClient(base_url=started["url"], timeout=TIMEOUT_S) as client:
                too_big = await client.post(
                    "/v1/prefill", json={"tokens": prompt(40), "session_id": "big"}
                )
            child.process.send_signal(signal.SIGTERM)
            await child.next_event("server_drain_started")
            async with httpx.AsyncClient(base_url=started["url"], timeout=TIMEOUT_S) as client:
                ready = await client.get("/readyz")
                health = await client.get("/healthz")
                refused = await client.post("/v1/prefill", json={"tokens": [1], "session_id": "s"})
            child.process.send_signal(signal.SIGTERM)
            await child.next_event("shutdown_hastened")
            await child.next_event("server_stopped")
            status = await child.process.wait()
    assert (ready.status_code, ready.json()) == (503, {"status": "draining"})
    assert health.status_code == 200
    assert refused.status_code == 503
    assert refused.json()["error"] == "draining"
    assert refused.headers["retry-after"] == "9"  # --retry-after reached the app
    assert (too_big.status_code, too_big.json()["field"]) == (413, "body")  # so did the limit
    assert "at most 64 bytes" in too_big.json()["message"]
    assert status == 0


async def test_http_server_example_main_restores_the_repeated_prompt() -> None:
    """examples/http_server.py main() serves, prefills twice and sees the second restored."""
    module = load_example("http_server")
    with trio.fail_after(TIMEOUT_S):
        result = await module.main()
    assert all(stage["restored_tokens"] == 0 for stage in result["first"]["stages"])
    assert all(stage["restored_tokens"] > 0 for stage in result["second"]["stages"])
    assert len(result["stats"]["stages"]) == 4


_CURL = re.compile(
    r"curl -si? localhost:8000(?P<path>/[\w/]*)(?:\s*\\\n)?(?:\s+-d '(?P<body>[^']*)')?"
    r"(?P<comment>[^\n]*)"
)


async def replay_curl_commands(text: str) -> list[tuple[str, str | None, str, httpx.Response]]:
    """Run every ``curl localhost:8000/...`` command of ``text`` against a real server.

    The server is the one the docs describe: the example topology, the reference model at
    width 64, default settings. Returns ``(path, body, trailing comment, response)`` in order.
    """
    commands = [(m["path"], m["body"], m["comment"]) for m in _CURL.finditer(text)]
    assert commands, "no curl commands found"
    replies = []
    topology = ROOT / "examples" / "topology.toml"
    with trio.fail_after(TIMEOUT_S):
        async with (
            open_pipeline(topology, reference_model_factory(width=64), environ={}) as pipeline,
            open_server(create_app(pipeline), bind="127.0.0.1:0") as server,
            httpx.AsyncClient(base_url=server.url, timeout=TIMEOUT_S) as client,
        ):
            for path, body, comment in commands:
                if body is None:
                    response = await client.get(path)
                else:
                    # curl -d sends a form content type; the server reads the body as JSON anyway.
                    response = await client.post(
                        path,
                        content=body.encode(),
                        headers={"content-type": "application/x-www-form-urlencoded"},
                    )
                replies.append((path, body, comment, response))
    return replies


def check_documented_curl_replies(
    replies: list[tuple[str, str | None, str, httpx.Response]],
) -> None:
    """Each command answers as its comment says (200 unless ``# 400: "field"``), and a prompt
    sent again right after itself is restored by every stage, as the docs promise."""
    previous_body: str | None = None
    repeats = 0
    for path, body, comment, response in replies:
        expected = re.search(r'# (\d{3}): "(\w+)"', comment)
        if expected is None:
            assert response.status_code == 200, (path, body, response.text)
        else:
            assert response.status_code == int(expected[1]), (path, body, response.text)
            assert response.json()["field"] == expected[2]
        if body is not None and body == previous_body:
            restored = [stage["restored_tokens"] for stage in response.json()["stages"]]
            assert all(count > 0 for count in restored), (body, restored)
            repeats += 1
        previous_body = body
    assert repeats >= 1, "the docs show a repeated prompt"


async def test_the_curl_commands_of_the_http_server_example_answer_as_documented() -> None:
    """examples/http_server.py's docstring: its curl commands, replayed against a real server."""
    module = load_example("http_server")
    assert module.__doc__ is not None
    replies = await replay_curl_commands(module.__doc__)
    check_documented_curl_replies(replies)
    assert {path for path, *_ in replies} >= {
        "/v1/prefill",
        "/v1/stats",
        "/metrics",
        "/readyz",
    }


async def test_the_curl_commands_of_the_docs_answer_as_documented() -> None:
    """The server page's curl commands, replayed against a real server."""
    section = (ROOT / "docs" / "server.md").read_text(encoding="utf-8")
    replies = await replay_curl_commands(section)
    check_documented_curl_replies(replies)
    assert {path for path, *_ in replies} == {
        "/v1/prefill",
        "/v1/stats",
        "/metrics",
        "/healthz",
        "/readyz",
    }


@attrs.define(eq=False)
class BrokenStatsPipeline:
    """A served pipeline whose statistics raise: a bug inside the server's own route."""

    stage_configs: Sequence[StageConfig] = attrs.field(factory=four_stages)
    draining: bool = False

    async def prefill(
        self,
        tokens: npt.NDArray[np.int32],
        *,
        session_id: str,
        request_id: str | None = None,
        cache_salt: str | None = None,
    ) -> PrefillResult:
        """Never called by the test."""
        raise AssertionError

    async def statistics(self) -> PipelineStats:
        """Fail with a message a client must not see."""
        raise RuntimeError("secret internal detail")


async def test_a_bug_answers_500_without_leaking_the_exception_text(
    capture_stage_logs: LogEvents,
) -> None:
    """An unexpected exception is a JSON 500 with a generic message; the log keeps the details."""
    app = create_app(BrokenStatsPipeline())
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        answer = await client.get("/v1/stats")
    assert answer.status_code == 500
    assert answer.json()["error"] == "internal_error"
    assert "secret" not in answer.text
    [failed] = [e for e in capture_stage_logs if e["event"] == "request_failed"]
    assert failed["path"] == "/v1/stats"


async def test_http_server_example_run_as_a_program_serves_until_sigint() -> None:
    """``python examples/http_server.py 127.0.0.1:0`` prints its real URL, serves the docs'
    repeated prompt (restored the second time) and exits 0 after draining on Ctrl-C."""
    argv = [sys.executable, str(ROOT / "examples" / "http_server.py"), "127.0.0.1:0"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with trio.fail_after(60):
        process = await trio.lowlevel.open_process(
            argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env
        )
        try:
            assert process.stdout is not None
            output = b""
            while b"\n" not in output:
                chunk = await process.stdout.receive_some()
                assert chunk, f"example exited before printing its address: {output!r}"
                output += chunk
            line = output.decode().splitlines()[0]
            match = re.fullmatch(r"serving 4 stages on (http://127\.0\.0\.1:(\d+)) \(.*\)", line)
            assert match, line
            assert int(match[2]) > 0
            async with httpx.AsyncClient(base_url=match[1], timeout=TIMEOUT_S) as client:
                body = {
                    "text": "Summarise the report in three sentences, then list its "
                    "open questions.",
                    "session_id": "s1",
                }
                answers = [(await client.post("/v1/prefill", json=body)) for _ in range(2)]
            process.send_signal(signal.SIGINT)
            status = await process.wait()
        finally:
            if process.returncode is None:
                process.kill()
                await process.wait()
    assert [answer.status_code for answer in answers] == [200, 200]
    assert all(stage["restored_tokens"] > 0 for stage in answers[1].json()["stages"])
    assert status == 0


async def test_open_server_raises_a_failure_to_start_as_itself() -> None:
    """A malformed bind is a ConfigError and a busy address an OSError, each raised as itself
    (``except OSError`` catches it), not inside the nurseries' exception groups; the pipeline
    goes on serving."""
    async with open_pipeline(four_stages(), reference_model_factory(width=16), environ={}) as pipe:
        app = create_app(pipe)
        with pytest.raises(ConfigError, match="bind must be HOST:PORT"):
            async with open_server(app, bind="nonsense"):
                pytest.fail("served on a malformed bind")
        busy = trio.socket.socket()
        with busy:
            await busy.bind(("127.0.0.1", 0))
            busy.listen()
            port = busy.getsockname()[1]
            with pytest.raises(OSError, match="in use") as caught:
                async with open_server(app, bind=f"127.0.0.1:{port}"):
                    pytest.fail("served on a busy address")
            assert not isinstance(caught.value, BaseExceptionGroup)
        result = await pipe.prefill(prompt(4), session_id="s")
        assert result.tokens == 4


async def test_open_server_keeps_the_cause_of_a_failure_to_start(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Unwrapped from its groups, a failure to start keeps its own cause (hypercorn missing:
    the ConfigError naming the extra, caused by the ModuleNotFoundError)."""
    monkeypatch.setitem(sys.modules, "hypercorn.trio", None)
    async with open_pipeline(four_stages(), reference_model_factory(width=16), environ={}) as pipe:
        with pytest.raises(ConfigError, match="server extra") as caught:
            async with open_server(create_app(pipe), bind="127.0.0.1:0"):
                pytest.fail("served without hypercorn")
    assert isinstance(caught.value.__cause__, ModuleNotFoundError)


async def test_a_compressed_body_is_refused_naming_the_encoding() -> None:
    """A gzip body is answered 415 saying to send it uncompressed (it used to be read as JSON
    and refused as 'not UTF-8 at byte 1'); identity is the body as sent, and the server goes
    on serving."""
    body = json.dumps({"tokens": [5, 6], "session_id": "s"}).encode()
    with trio.fail_after(TIMEOUT_S):
        async with serving() as h:
            gzipped = await h.client.post(
                "/v1/prefill",
                content=gzip.compress(body),
                headers={"content-encoding": "gzip"},
            )
            plain = await h.client.post(
                "/v1/prefill", content=body, headers={"content-encoding": "Identity"}
            )
            stats = (await h.client.get("/v1/stats")).json()
    assert gzipped.status_code == 415
    assert gzipped.headers["accept-encoding"] == "identity"
    assert gzipped.json() == {
        "error": "unsupported_content_encoding",
        "field": None,
        "message": "Content-Encoding must be identity (send the body uncompressed), got 'gzip'",
    }
    assert plain.status_code == 200, plain.text
    assert stats["server"]["prefills"] == 1
