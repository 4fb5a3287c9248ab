"""Structured log events: lifecycle, failures, restarts and backpressure, tagged with actor=."""

from __future__ import annotations

import attrs
import pytest
import structlog
import trio
import trio.testing

from actors import Actor, RestartPolicy, open_actor
from actors.testing import LogEvent, RecordingActor, events_named, wait_idle


@attrs.define(eq=False)
class Picky(Actor[object, str]):
    """Replies to strings; raises TypeError for anything else; logs from inside handle."""

    async def handle(self, message: object) -> str:
        structlog.get_logger("user").info("picky_handled")
        if not isinstance(message, str):
            msg = f"message must be a str, got {message!r}"
            raise TypeError(msg)
        return message


async def test_lifecycle_events_carry_actor_name(actor_logs: list[LogEvent]) -> None:
    """actor_started and actor_stopped name the actor, its mailbox and what was processed."""
    async with open_actor(RecordingActor, name="rec", mailbox_size=3) as ref:
        await ref.tell(1)
        await ref.tell(2)
    started = events_named(actor_logs, "actor_started")
    stopped = events_named(actor_logs, "actor_stopped")
    assert started == [
        {"event": "actor_started", "actor": "rec", "mailbox_size": 3, "log_level": "info"}
    ]
    assert len(stopped) == 1
    assert stopped[0]["actor"] == "rec"
    assert stopped[0]["processed"] == 2
    assert stopped[0]["drained"] is True
    assert stopped[0]["dropped"] == 0


async def test_stop_without_drain_logs_dropped_messages(actor_logs: list[LogEvent]) -> None:
    """actor_stopped reports drained=False and how many queued messages were dropped."""

    @attrs.define(eq=False)
    class Waiter(Actor[int, None]):
        release: trio.Event = attrs.field(factory=trio.Event)

        async def handle(self, message: int) -> None:
            await self.release.wait()

    actor = Waiter()
    async with open_actor(actor, name="w", mailbox_size=4) as ref:
        for i in range(3):
            ref.tell_nowait(i)
        await trio.testing.wait_all_tasks_blocked()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(ref.stop, False)
            await trio.testing.wait_all_tasks_blocked()
            actor.release.set()
    [stopped] = events_named(actor_logs, "actor_stopped")
    assert (stopped["drained"], stopped["dropped"], stopped["processed"]) == (False, 2, 1)


async def test_failed_ask_is_logged_with_message_type_and_exception(
    actor_logs: list[LogEvent],
) -> None:
    """A failed ask logs one warning with the error's type and text but no traceback."""
    async with open_actor(Picky, name="picky") as ref:
        with pytest.raises(TypeError, match="message must be a str, got 3"):
            await ref.ask(3)
    failed = events_named(actor_logs, "actor_message_failed")
    assert failed == [
        {
            "event": "actor_message_failed",
            "actor": "picky",
            "message_type": "int",
            "crashed": False,
            "error_type": "TypeError",
            "error": "message must be a str, got 3",
            "log_level": "warning",
        }
    ]


async def test_crash_and_restart_are_logged(
    actor_logs: list[LogEvent], autojump_clock: trio.testing.MockClock
) -> None:
    """A crashing tell logs an error-level failure, then actor_restarted with attempt and cause."""
    policy = RestartPolicy(max_restarts=2, within_s=10, backoff_s=1)
    async with open_actor(Picky, name="picky", restart=policy) as ref:
        await ref.tell(1)
        await ref.tell(2)
        await wait_idle(ref)
    failed = events_named(actor_logs, "actor_message_failed")
    assert [(f["crashed"], f["log_level"]) for f in failed] == [(True, "error")] * 2
    assert [(f["error_type"], f["error"]) for f in failed] == [
        ("TypeError", "message must be a str, got 1"),
        ("TypeError", "message must be a str, got 2"),
    ]
    assert all(isinstance(f["exc_info"], TypeError) for f in failed)
    restarted = events_named(actor_logs, "actor_restarted")
    assert [r["attempt"] for r in restarted] == [1, 2]
    assert [r["restarts"] for r in restarted] == [1, 2]
    assert all(r["actor"] == "picky" for r in restarted)
    assert "message must be a str, got 1" in restarted[0]["cause"]
    assert restarted[0]["backoff_s"] == 1


async def test_user_logs_inside_handle_are_tagged_with_actor(
    actor_logs: list[LogEvent],
) -> None:
    """Events logged by a handler carry actor= and it does not leak into the caller."""
    async with open_actor(Picky, name="picky") as ref:
        await ref.ask("x")
        structlog.get_logger("caller").info("caller_event")
    [handled] = events_named(actor_logs, "picky_handled")
    [caller] = events_named(actor_logs, "caller_event")
    assert handled["actor"] == "picky"
    assert "actor" not in caller


async def test_mailbox_full_warning_is_rate_limited(
    actor_logs: list[LogEvent], autojump_clock: trio.testing.MockClock
) -> None:
    """A tell that must wait logs actor_mailbox_full at most once a second, counting the rest."""

    @attrs.define(eq=False)
    class Sluggish(Actor[int, None]):
        async def handle(self, message: int) -> None:
            await trio.sleep(0.1)

    async with open_actor(Sluggish, name="slug", mailbox_size=1) as ref:
        for i in range(30):  # 3 s of work; nearly every tell has to wait
            await ref.tell(i)
    full = events_named(actor_logs, "actor_mailbox_full")
    # ~2.8 s of waiting: one warning per second, every wait accounted for.
    assert len(full) == 3
    assert all(f["log_level"] == "warning" and f["actor"] == "slug" for f in full)
    assert all(f["mailbox_size"] == 1 for f in full)
    assert full[0]["suppressed"] == 0
    # A tell waits ~0.1 s, so about ten waits fall between two warnings and are only counted.
    assert [f["suppressed"] >= 8 for f in full] == [False, True, True]
    # The first tell goes straight to the actor and the second fills the mailbox: 28 waited.
    assert sum(f["suppressed"] for f in full) + len(full) <= 28


async def test_tell_with_room_logs_nothing_per_message(actor_logs: list[LogEvent]) -> None:
    """The happy path is silent: only lifecycle events, no per-message logging."""
    async with open_actor(RecordingActor, name="quiet") as ref:
        for i in range(10):
            await ref.tell(i)
            assert await ref.ask(i) is None
    assert [e["event"] for e in actor_logs] == ["actor_started", "actor_stopped"]
