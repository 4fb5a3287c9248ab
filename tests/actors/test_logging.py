"""Structured log events: lifecycle, failures, restarts and backpressure, tagged with actor=."""

from __future__ import annotations

import attrs
import pytest
import structlog
import trio
import trio.testing

from actors import Actor, RestartLimitError, RestartPolicy, open_actor, spawn
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
    assert stopped[0]["log_level"] == "info"


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
    assert "in handle" in _rendered_traceback(failed[0])
    restarted = events_named(actor_logs, "actor_restarted")
    assert [r["log_level"] for r in restarted] == ["warning"] * 2
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


@attrs.define(eq=False)
class Sluggish(Actor[int, None]):
    """Takes 0.1 s (virtual) per message."""

    async def handle(self, message: int) -> None:
        await trio.sleep(0.1)


async def test_mailbox_full_warning_is_rate_limited(
    actor_logs: list[LogEvent], autojump_clock: trio.testing.MockClock
) -> None:
    """A tell that must wait logs actor_mailbox_full at most once a second, counting the rest."""

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


async def test_a_rendezvous_mailbox_never_warns_that_it_is_full(
    actor_logs: list[LogEvent], autojump_clock: trio.testing.MockClock
) -> None:
    """With mailbox_size 0 every tell waits for the actor by design: no actor_mailbox_full."""

    async with open_actor(Sluggish, name="slug", mailbox_size=0) as ref:
        for i in range(30):
            await ref.tell(i)
    assert events_named(actor_logs, "actor_mailbox_full") == []


async def test_tell_with_room_logs_nothing_per_message(actor_logs: list[LogEvent]) -> None:
    """The happy path is silent: only lifecycle events, no per-message logging."""
    async with open_actor(RecordingActor, name="quiet") as ref:
        for i in range(10):
            await ref.tell(i)
            assert await ref.ask(i) is None
    assert [e["event"] for e in actor_logs] == ["actor_started", "actor_stopped"]


def _traceback_events(logs: list[LogEvent], error: BaseException) -> list[str]:
    """Names of the events that carry ``error`` as their exc_info (its traceback)."""
    return [e["event"] for e in logs if e.get("exc_info") is error]


def _rendered_traceback(event: LogEvent) -> str:
    """What a structlog renderer would print for the event's exc_info."""
    rendered = structlog.processors.format_exc_info(None, "error", dict(event))
    return str(rendered["exception"])


@attrs.define(eq=False)
class StartFails(Actor[int, int]):
    """on_start raises ConnectionError for the first ``failures[0]`` builds."""

    failures: list[int]
    errors: list[BaseException] = attrs.field(factory=list)

    async def on_start(self) -> None:
        if self.failures[0] > 0:
            self.failures[0] -= 1
            error = ConnectionError("backend not ready")
            self.errors.append(error)
            raise error

    def handle(self, message: int) -> int:
        return message


async def test_on_start_crash_under_policy_is_logged_with_traceback(
    actor_logs: list[LogEvent],
) -> None:
    """A restarted on_start failure logs actor_hook_failed with its traceback, once per crash."""
    failures = [2]
    errors: list[BaseException] = []
    policy = RestartPolicy(max_restarts=2, within_s=10)
    async with open_actor(lambda: StartFails(failures, errors), name="db", restart=policy) as ref:
        assert await ref.ask(1) == 1
    hook_failed = events_named(actor_logs, "actor_hook_failed")
    assert [(e["actor"], e["hook"], e["log_level"]) for e in hook_failed] == [
        ("db", "on_start", "error")
    ] * 2
    assert [(e["error_type"], e["error"]) for e in hook_failed] == [
        ("ConnectionError", "backend not ready")
    ] * 2
    assert len(errors) == 2
    for error in errors:
        assert _traceback_events(actor_logs, error) == ["actor_hook_failed"]
    assert "in on_start" in _rendered_traceback(hook_failed[0])
    restarted = events_named(actor_logs, "actor_restarted")
    assert [r["cause"] for r in restarted] == [repr(e) for e in errors]
    assert all("exc_info" not in r for r in restarted)


async def test_factory_crash_under_policy_is_logged_with_traceback(
    actor_logs: list[LogEvent],
) -> None:
    """A factory that raises is a crash too, logged with hook="factory" and its traceback."""
    errors: list[BaseException] = []

    def build() -> RecordingActor:
        if not errors:
            errors.append(OSError("no config"))
            raise errors[0]
        return RecordingActor()

    policy = RestartPolicy(max_restarts=1, within_s=10)
    async with open_actor(build, name="built", restart=policy) as ref:
        await ref.tell(1)
    [failed] = events_named(actor_logs, "actor_hook_failed")
    assert (failed["hook"], failed["error_type"], failed["log_level"]) == (
        "factory",
        "OSError",
        "error",
    )
    assert _traceback_events(actor_logs, errors[0]) == ["actor_hook_failed"]
    assert "in build" in _rendered_traceback(failed)


async def test_first_on_start_failure_without_policy_is_logged_once(
    actor_logs: list[LogEvent],
) -> None:
    """spawn raises the on_start error; the log has it once with its traceback, then stopped."""
    actor = StartFails([1])
    async with trio.open_nursery() as nursery:
        with pytest.raises(ConnectionError) as info:
            await spawn(nursery, actor, name="db")
    assert _traceback_events(actor_logs, info.value) == ["actor_hook_failed"]
    assert [e["event"] for e in actor_logs] == ["actor_hook_failed", "actor_stopped"]
    assert events_named(actor_logs, "actor_hook_failed")[0]["actor"] == "db"


@attrs.define(eq=False)
class StopFails(RecordingActor):
    """on_stop raises ValueError."""

    async def on_stop(self) -> None:
        msg = "flush failed"
        raise ValueError(msg)


@pytest.mark.parametrize("policy", [None, RestartPolicy(max_restarts=3, within_s=10)])
async def test_on_stop_failure_is_logged_once_and_not_restarted(
    actor_logs: list[LogEvent], policy: RestartPolicy | None
) -> None:
    """on_stop raising reaches the nursery, logged once with traceback; never restarted."""
    with pytest.RaisesGroup(pytest.RaisesExc(ValueError, match="flush failed")) as group:
        async with open_actor(StopFails, name="flusher", restart=policy) as ref:
            await ref.tell(1)
    error = group.value.exceptions[0]
    assert _traceback_events(actor_logs, error) == ["actor_hook_failed"]
    [failed] = events_named(actor_logs, "actor_hook_failed")
    assert (failed["actor"], failed["hook"], failed["log_level"]) == ("flusher", "on_stop", "error")
    assert "in on_stop" in _rendered_traceback(failed)
    assert events_named(actor_logs, "actor_restarted") == []
    assert ref.statistics().restarts == 0
    [stopped] = events_named(actor_logs, "actor_stopped")
    assert (stopped["drained"], stopped["processed"]) == (True, 1)


async def test_restart_limit_is_logged_with_its_cause_once(
    actor_logs: list[LogEvent], autojump_clock: trio.testing.MockClock
) -> None:
    """At the limit: one actor_restart_limit_reached error; the cause's traceback logged once."""
    policy = RestartPolicy(max_restarts=1, within_s=10)
    with pytest.RaisesGroup(RestartLimitError) as group:
        async with open_actor(Picky, name="picky", restart=policy, mailbox_size=4) as ref:
            ref.tell_nowait(1)
            ref.tell_nowait(2)
            await trio.sleep_forever()
    cause = group.value.exceptions[0].__cause__
    assert isinstance(cause, TypeError)
    assert _traceback_events(actor_logs, cause) == ["actor_message_failed"]
    [limit] = events_named(actor_logs, "actor_restart_limit_reached")
    assert limit == {
        "event": "actor_restart_limit_reached",
        "actor": "picky",
        "crashes": 2,
        "within_s": 10,
        "max_restarts": 1,
        "restarts": 1,
        "cause": repr(cause),
        "log_level": "error",
    }
    assert [e["event"] for e in actor_logs if e["event"].startswith("actor_")] == [
        "actor_started",
        "actor_message_failed",
        "actor_restarted",
        "actor_message_failed",
        "actor_restart_limit_reached",
        "actor_stopped",
    ]


async def test_restart_limit_from_on_start_is_logged_with_its_cause_once(
    actor_logs: list[LogEvent],
) -> None:
    """An on_start that keeps failing: every crash's traceback once, then the limit event."""
    errors: list[BaseException] = []
    policy = RestartPolicy(max_restarts=1, within_s=10)
    async with trio.open_nursery() as nursery:
        with pytest.raises(RestartLimitError) as info:
            await spawn(nursery, lambda: StartFails([9], errors), name="db", restart=policy)
    assert info.value.__cause__ is errors[-1]
    assert len(errors) == 2
    for error in errors:
        assert _traceback_events(actor_logs, error) == ["actor_hook_failed"]
    assert [e["event"] for e in actor_logs] == [
        "actor_hook_failed",
        "actor_restarted",
        "actor_hook_failed",
        "actor_restart_limit_reached",
        "actor_stopped",
    ]
    [limit] = events_named(actor_logs, "actor_restart_limit_reached")
    assert limit["cause"] == repr(errors[-1])
    assert "exc_info" not in limit
