"""The helpers in actors.testing that users' own actor tests rely on."""

from __future__ import annotations

import pytest
import structlog
import trio
import trio.testing

from actors import ActorStoppedError, open_actor
from actors.testing import RecordingActor, capture_actor_logs, events_named, wait_idle


async def test_capture_actor_logs_keeps_contextvars_keys() -> None:
    """Keys bound with bound_contextvars appear in captured events."""
    with capture_actor_logs() as logs, structlog.contextvars.bound_contextvars(stage="s0"):
        structlog.get_logger().info("thing_happened", size_bytes=3)
    assert logs == [
        {"event": "thing_happened", "stage": "s0", "size_bytes": 3, "log_level": "info"}
    ]


async def test_plain_capture_logs_would_drop_them() -> None:
    """Why the helper exists: structlog's capture_logs alone loses contextvars keys."""
    with (
        structlog.testing.capture_logs() as logs,
        structlog.contextvars.bound_contextvars(stage="s0"),
    ):
        structlog.get_logger().info("thing_happened")
    assert "stage" not in logs[0]


async def test_events_named_filters_in_order() -> None:
    """events_named returns only the named events, oldest first."""
    logs: list[dict[str, object]] = [{"event": "a", "n": 1}, {"event": "b"}, {"event": "a", "n": 2}]
    assert events_named(logs, "a") == [{"event": "a", "n": 1}, {"event": "a", "n": 2}]
    assert events_named(logs, "c") == []


async def test_recording_actor_records_and_replies() -> None:
    """RecordingActor keeps messages in receive order and replies with reply(message)."""
    actor = RecordingActor(reply=lambda m: m * 2)
    async with open_actor(actor, name="rec") as ref:
        await ref.tell(1)
        assert await ref.ask(5) == 10
    assert actor.received == [1, 5]


async def test_wait_idle_returns_after_earlier_messages_are_handled() -> None:
    """wait_idle returns only once every earlier tell has been handled, and is not counted."""
    gate = trio.Event()

    class Gated(RecordingActor):
        async def on_start(self) -> None:
            await gate.wait()

    actor = Gated()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_release_later, gate)
        async with open_actor(actor, name="gated", mailbox_size=8) as ref:
            for i in range(5):
                ref.tell_nowait(i)
            await wait_idle(ref)
            assert actor.received == [0, 1, 2, 3, 4]
            assert ref.statistics().processed == 5


async def _release_later(event: trio.Event) -> None:
    await trio.testing.wait_all_tasks_blocked()
    event.set()


async def test_wait_idle_on_stopped_actor_raises() -> None:
    """wait_idle on a stopped actor raises ActorStoppedError instead of hanging."""
    async with open_actor(RecordingActor, name="rec") as ref:
        pass
    with pytest.raises(ActorStoppedError):
        await wait_idle(ref)
