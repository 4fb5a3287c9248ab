"""Tests of a single stage task driven through its channels."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import attrs
import numpy as np
import numpy.typing as npt
import pytest
import trio
import trio.lowlevel
import trio.testing

from actors import ActorStoppedError
from actors.testing import LogEvent, capture_actor_logs, events_named
from stage_runtime.cache_actor import CacheActor, RecordActivation
from stage_runtime.config import MessageBase, StageConfig
from stage_runtime.errors import ConfigError, FrameError, StageFailedError
from stage_runtime.frames import ActivationFrame
from stage_runtime.models import CausalMixModel, StageModel
from stage_runtime.stage import PrefillRequest, Stage
from tests.stage_runtime.pipeline_helpers import (
    CountingModel,
    WrappedModel,
    mix_factory,
    prompt,
    stage_configs,
)

NO_ENV: dict[str, str] = {}


@pytest.fixture(autouse=True)
def logs() -> Iterator[list[LogEvent]]:
    """Capture every log event (keeps the output quiet; tests inspect them)."""
    with capture_actor_logs() as captured:
        yield captured


def request(n: int, *, frame: ActivationFrame | None = None) -> PrefillRequest:
    return PrefillRequest(request_id="r", session_id="s", tokens=prompt(n), frame=frame)


async def test_last_stage_settles_the_request_and_stops_on_inbox_close(
    logs: list[LogEvent],
) -> None:
    """The last stage settles requests itself; closing its inbox stops it and its cache actor."""
    config = stage_configs(1, min_tokens=8)[0]
    send, receive = trio.open_memory_channel[PrefillRequest](1)
    stage = Stage(config=config, model_factory=mix_factory(), inbox=receive, outbox=None)
    req = request(20)
    async with trio.open_nursery() as nursery:
        await nursery.start(stage.run)
        await send.send(req)
        await req.done.wait()
        await send.aclose()
    assert req.error is None
    assert req.frame is not None
    assert req.frame.token_count == 20
    (report,) = req.reports
    assert (report.restored_tokens, report.computed_tokens) == (0, 20)
    assert [r.token_count for r in report.records] == [20, 16]
    stopped = events_named(logs, "actor_stopped")
    assert [e["actor"] for e in stopped] == ["cache-stage-0"]
    assert events_named(logs, "stage_stopped")[0]["stage"] == "stage-0"
    stats = await stage.statistics()  # final statistics survive the stop
    assert stats.cache is not None
    assert stats.cache.records == 2


async def test_a_record_failing_after_the_inbox_closed_still_fails_the_stage(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The cache actor hands a record's outcome over as it replies, while the stage goes on: a
    failed record whose outcome comes in only after the stage left its inbox (its last
    request's) crashes the stage all the same, rather than letting it stop cleanly."""

    handle = CacheActor.handle

    async def slow_and_broken(self: CacheActor, message: Any) -> Any:
        if not isinstance(message, RecordActivation):
            return handle(self, message)
        await trio.sleep(1)  # long after the stage left its inbox
        raise RuntimeError("cache bug")

    config = stage_configs(1, min_tokens=8)[0]
    send, receive = trio.open_memory_channel[PrefillRequest](1)
    stage = Stage(config=config, model_factory=mix_factory(), inbox=receive, outbox=None)
    req = request(20)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(CacheActor, "handle", slow_and_broken)
        with pytest.RaisesGroup(pytest.RaisesExc(StageFailedError, match="cache bug")):
            async with trio.open_nursery() as nursery:
                await nursery.start(stage.run)
                send.send_nowait(req)  # the stage takes it, then finds its inbox closed
                send.close()
    assert not req.done.is_set()  # (the pipeline fails the requests of a crashed stage)
    with pytest.raises(ActorStoppedError):  # no final statistics from a stage that failed
        await stage.statistics()


async def test_middle_stage_uses_the_incoming_frame_and_forwards() -> None:
    """A non-first stage computes from the previous stage's frame and passes the request on."""
    configs = stage_configs(2, min_tokens=8)
    upstream = CausalMixModel.for_stage(configs[0], width=8)
    incoming = await upstream.forward(upstream.embed(prompt(12)), 0, None)
    send, receive = trio.open_memory_channel[PrefillRequest](1)
    out_send, out_receive = trio.open_memory_channel[PrefillRequest](1)
    stage = Stage(config=configs[1], model_factory=mix_factory(), inbox=receive, outbox=out_send)
    async with trio.open_nursery() as nursery:
        await nursery.start(stage.run)
        await send.send(request(12, frame=incoming))
        forwarded = await out_receive.receive()
        await send.aclose()
        with pytest.raises(trio.EndOfChannel):  # the stage closes its outbox when it stops
            await out_receive.receive()
    expected = await CausalMixModel.for_stage(configs[1], width=8).forward(incoming, 0, None)
    assert forwarded.frame is not None
    np.testing.assert_array_equal(forwarded.frame.rows(), expected.rows())
    assert not forwarded.done.is_set()  # only the last stage settles


@attrs.define(eq=False)
class WrongLengthModel(WrappedModel):
    """Returns one row too many."""

    async def forward(
        self, inputs: ActivationFrame, start: int, restored: ActivationFrame | None
    ) -> ActivationFrame:
        out = await self.inner.forward(inputs, start, restored)
        return ActivationFrame.concat(out, out.prefix(1))


async def test_malformed_model_output_fails_the_request_not_the_stage() -> None:
    """A model returning the wrong number of rows fails that request with FrameError."""
    config = stage_configs(1, min_tokens=8)[0]
    send, receive = trio.open_memory_channel[PrefillRequest](1)

    def factory(config: Any) -> StageModel:
        return WrongLengthModel(CausalMixModel(width=4))

    stage = Stage(config=config, model_factory=factory, inbox=receive, outbox=None)
    async with trio.open_nursery() as nursery:
        await nursery.start(stage.run)
        first, second = request(10), request(10)
        await send.send(first)
        await send.send(second)
        await second.done.wait()
        await send.aclose()
    for req in (first, second):
        assert isinstance(req.error, FrameError)
        assert "model output must be a frame of 10 tokens, got 11" in str(req.error)
    assert (await stage.statistics()).cache.entries == 0  # type: ignore[union-attr]


async def test_abandoned_request_is_skipped() -> None:
    """A request abandoned before the stage reaches it is neither computed nor recorded."""
    config = stage_configs(1, min_tokens=8)[0]
    send, receive = trio.open_memory_channel[PrefillRequest](2)
    stage = Stage(config=config, model_factory=mix_factory(), inbox=receive, outbox=None)
    async with trio.open_nursery() as nursery:
        await nursery.start(stage.run)
        gone, live = request(10), request(12)
        gone.abandon()
        await send.send(gone)
        await send.send(live)
        await live.done.wait()
        await send.aclose()
    assert not gone.done.is_set()
    assert gone.reports == []
    stats = await stage.statistics()
    assert stats.cache is not None
    assert stats.cache.records == 2


@attrs.define(eq=False)
class AbandoningModel(WrappedModel):
    """Abandons ``victim`` as its forward returns (after its last schedule point), once."""

    victim: PrefillRequest | None = None

    async def forward(
        self, inputs: ActivationFrame, start: int, restored: ActivationFrame | None
    ) -> ActivationFrame:
        output = await self.inner.forward(inputs, start, restored)
        if self.victim is not None:
            self.victim.abandon()
            self.victim = None
        return output


def _stage_counts(logs: list[LogEvent]) -> tuple[int, int, int]:
    (stopped,) = events_named(logs, "stage_stopped")
    return stopped["completed"], stopped["skipped"], stopped["failed"]


def _one_stage() -> StageConfig:
    return stage_configs(1, min_tokens=8)[0]


async def _first_then_second(
    model: StageModel,
    *,
    while_first_is_in: Callable[[PrefillRequest], Awaitable[None]] | None = None,
) -> tuple[Stage, PrefillRequest, PrefillRequest]:
    """Send a stage of ``model`` (:func:`_one_stage`) a 10-token request, then (after
    ``while_first_is_in`` ran, given the first) a 12-token one; check that the second was
    computed, and stop the stage."""
    send, receive = trio.open_memory_channel[PrefillRequest](2)
    stage = Stage(config=_one_stage(), model_factory=lambda _: model, inbox=receive, outbox=None)
    first, second = request(10), request(12)
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            await nursery.start(stage.run)
            await send.send(first)
            if while_first_is_in is not None:
                await while_first_is_in(first)
            await send.send(second)
            await second.done.wait()
            await send.aclose()
    assert second.error is None
    assert second.frame is not None
    assert second.frame.token_count == 12
    return stage, first, second


async def test_a_request_abandoned_mid_compute_is_interrupted_and_the_next_is_computed(
    logs: list[LogEvent], autojump_clock: trio.testing.MockClock
) -> None:
    """Abandoning the request a stage computes interrupts its model; the requests after it
    are computed as usual (one cancel scope serves many requests, and a new one is made after
    it interrupted one)."""
    gate = trio.Event()
    model = CountingModel(inner=CausalMixModel.for_stage(_one_stage(), width=8), gate=gate)

    async def abandon_at_the_gate(first: PrefillRequest) -> None:
        await trio.testing.wait_all_tasks_blocked()
        assert model.calls == [(0, 10)]  # waiting at its gate
        first.abandon()
        await trio.testing.wait_all_tasks_blocked()
        gate.set()

    _, first, _ = await _first_then_second(model, while_first_is_in=abandon_at_the_gate)
    assert not first.done.is_set()
    assert model.calls == [(0, 10), (0, 12)]
    assert _stage_counts(logs) == (1, 1, 0)


async def test_a_request_abandoned_after_its_last_schedule_point_leaves_the_next_alone(
    logs: list[LogEvent], autojump_clock: trio.testing.MockClock
) -> None:
    """Abandoned as its model returns, with no schedule point left to interrupt: the stage
    skips it (no record, nothing settled), and the next request is not interrupted by the
    cancellation meant for it."""
    model = AbandoningModel(inner=CausalMixModel.for_stage(_one_stage(), width=8))

    async def abandoned_by_the_model(first: PrefillRequest) -> None:
        model.victim = first

    stage, first, _ = await _first_then_second(model, while_first_is_in=abandoned_by_the_model)
    assert not first.done.is_set()
    assert first.reports == []
    assert _stage_counts(logs) == (1, 1, 0)
    stats = await stage.statistics()
    assert stats.cache is not None
    assert stats.cache.records == 2  # the second request's ladder only


@attrs.define(eq=False)
class StrayGroupModel(WrappedModel):
    """Raises its error grouped with a Cancelled kept from an earlier cancellation, once."""

    stray: trio.Cancelled | None = None

    async def forward(
        self, inputs: ActivationFrame, start: int, restored: ActivationFrame | None
    ) -> ActivationFrame:
        stray, self.stray = self.stray, None
        if stray is not None:
            raise BaseExceptionGroup("model", [ValueError("bad rows"), stray])
        return await self.inner.forward(inputs, start, restored)


async def test_a_model_error_grouped_with_a_stray_cancelled_fails_only_its_request(
    logs: list[LogEvent], autojump_clock: trio.testing.MockClock
) -> None:
    """A model error raised in a group with a Cancelled kept from an earlier cancellation,
    while nothing is cancelled, fails that request with the error; the stray Cancelled does
    not end the stage (it used to, and the next request never completed)."""
    stray: trio.Cancelled | None = None
    with trio.CancelScope() as earlier:
        earlier.cancel()
        try:
            await trio.lowlevel.checkpoint()
        except trio.Cancelled as cancelled:
            stray = cancelled
    assert stray is not None
    model = StrayGroupModel(inner=CausalMixModel.for_stage(_one_stage(), width=8), stray=stray)
    _, first, _ = await _first_then_second(model)
    assert isinstance(first.error, ValueError)
    assert _stage_counts(logs) == (1, 0, 1)


@pytest.mark.parametrize(
    ("field", "value", "complaint"),
    [
        ("request_id", "", "must be a non-empty string"),
        ("session_id", 7, "must be a string"),
        ("cache_salt", "", "must be a non-empty string"),
        ("request_id", "a\x1b[2Jb", "must not hold control characters"),
        ("cache_salt", "\udfff", "must be valid UTF-8"),
    ],
)
def test_a_request_refuses_ids_its_stages_would_pass_on_unchecked(
    field: str, value: object, complaint: str
) -> None:
    """A stage builds its cache messages' envelope from the request's ids without checking
    them again, so the request checks them when it is made."""
    fields: dict[str, Any] = {"request_id": "r", "session_id": "s", field: value}
    with pytest.raises(ConfigError, match=f"^{field} {complaint}"):
        PrefillRequest(tokens=prompt(4), **fields)


def test_a_stages_envelope_equals_a_checked_one() -> None:
    """The envelope a stage builds unchecked is the one MessageBase itself would build."""
    config = attrs.evolve(stage_configs(2, min_tokens=8)[1], run_id="run", topology_id="topo")
    _, inbox = trio.open_memory_channel[PrefillRequest](1)
    stage = Stage(config=config, model_factory=mix_factory(), inbox=inbox, outbox=None)
    req = PrefillRequest(request_id="r", session_id="s", tokens=prompt(4), cache_salt="tenant")
    checked = MessageBase(
        run_id="run",
        request_id="r",
        session_id="s",
        cache_salt="tenant",
        stage_id=config.stage_id,
        stage_index=config.stage_index,
        topology_id="topo",
        model_id=config.model_id,
    )
    built = stage._message_base(req)
    assert built == checked
    assert repr(built) == repr(checked)


def _read_only(array: npt.NDArray[Any]) -> npt.NDArray[Any]:
    array.flags.writeable = False
    return array


@pytest.mark.parametrize(
    ("tokens", "trusted"),
    [
        pytest.param(_read_only(prompt(20)), True, id="the-pipelines-own-read-only-int32"),
        pytest.param(prompt(20), False, id="writable-int32"),
        pytest.param(_read_only(prompt(20).astype(np.int64)), False, id="read-only-int64"),
        pytest.param(_read_only(prompt(40)[::2]), False, id="read-only-strided-view"),
    ],
)
async def test_only_tokens_a_stage_checked_go_to_its_actor_unchecked(
    tokens: npt.NDArray[Any], trusted: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stage's actor takes the stage's messages as they are only for the tokens the pipeline
    hands it (a read-only 1-D int32 array owning its data); other tokens go in checked
    messages, which the actor checks and converts. Either way, the same prompt twice records,
    then restores, alike."""
    seen: list[type[object]] = []
    handle = CacheActor.handle

    def spy(actor: CacheActor, message: Any) -> Any:
        seen.append(type(message))
        return handle(actor, message)

    monkeypatch.setattr(CacheActor, "handle", spy)
    config = stage_configs(1, min_tokens=8)[0]
    send, inbox = trio.open_memory_channel[PrefillRequest](2)
    stage = Stage(config=config, model_factory=mix_factory(), inbox=inbox, outbox=None)
    first, again = (
        PrefillRequest(request_id=f"r{i}", session_id="s", tokens=tokens) for i in range(2)
    )
    async with trio.open_nursery() as nursery:
        await nursery.start(stage.run)
        for req in (first, again):
            await send.send(req)
            await req.done.wait()
        await send.aclose()
    reports = [req.reports[0] for req in (first, again)]
    assert [(r.restored_tokens, r.computed_tokens) for r in reports] == [(0, 20), (20, 0)]
    assert [r.token_count for r in reports[0].records] == [20, 16]
    assert first.frame is not None
    assert again.frame is not None
    assert first.frame.payload.tobytes() == again.frame.payload.tobytes()
    names = [kind.__name__ for kind in seen if kind.__name__ != "CacheStatsRequest"]
    expected = (
        ["_StageRestore", "_StageRecord"]
        if trusted
        else ["RestoreActivationPages", "RecordActivation"]
    )
    assert names == expected * 2
