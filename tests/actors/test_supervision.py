"""Supervision: restarts under a RestartPolicy, the sliding window, backoff and the limit."""

from __future__ import annotations

import math

import attrs
import pytest
import trio
import trio.testing

from actors import Actor, ActorRef, RestartLimitError, RestartPolicy, open_actor, spawn
from actors.testing import RecordingActor, capture_actor_logs, events_named, wait_idle


@attrs.define(eq=False)
class Ledger(Actor[object, int]):
    """Adds ints; raises on the string "crash"; replies the running total."""

    total: int = 0
    log: list[tuple[float, object]] = attrs.field(factory=list)

    async def handle(self, message: object) -> int:
        self.log.append((trio.current_time(), message))
        if message == "slow crash":
            await trio.sleep(1)
        if message in ("crash", "slow crash"):
            msg = "crash requested"
            raise RuntimeError(msg)
        if isinstance(message, int):
            self.total += message
        return self.total


@attrs.define(eq=False)
class Built:
    """A factory that remembers every actor it built."""

    actors: list[Ledger] = attrs.field(factory=list)

    def __call__(self) -> Ledger:
        actor = Ledger()
        self.actors.append(actor)
        return actor


async def test_restart_rebuilds_fresh_state(autojump_clock: trio.testing.MockClock) -> None:
    """After a crash the actor comes back from its factory with empty state."""
    built = Built()
    policy = RestartPolicy(max_restarts=3, within_s=60)
    async with open_actor(built, name="ledger", restart=policy) as ref:
        assert await ref.ask(5) == 5
        await ref.tell("crash")
        assert await ref.ask(1) == 1  # the 5 was lost with the old instance
        assert ref.statistics().restarts == 1
        assert ref.statistics().failed == 1
    assert len(built.actors) == 2


async def test_queued_messages_survive_restart(autojump_clock: trio.testing.MockClock) -> None:
    """Messages queued behind the crashing one are handled by the new instance."""
    built = Built()
    policy = RestartPolicy(max_restarts=1, within_s=60)
    async with open_actor(built, name="ledger", restart=policy, mailbox_size=8) as ref:
        for message in ("crash", 1, 2, 3):
            ref.tell_nowait(message)
        assert await ref.ask(0) == 6
    assert [m for _, m in built.actors[0].log] == ["crash"]
    assert [m for _, m in built.actors[1].log] == [1, 2, 3, 0]


async def test_ask_failure_is_not_a_crash() -> None:
    """A handler error during an ask goes to the caller and never triggers a restart."""
    policy = RestartPolicy(max_restarts=0, within_s=1)
    async with open_actor(Ledger, name="ledger", restart=policy) as ref:
        await ref.ask(2)
        with pytest.raises(RuntimeError, match="crash requested"):
            await ref.ask("crash")
        assert await ref.ask(0) == 2
        assert ref.statistics().restarts == 0


async def test_restart_limit_raises_into_owning_nursery(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The crash beyond max_restarts within the window raises RestartLimitError."""
    built = Built()
    policy = RestartPolicy(max_restarts=2, within_s=10)
    with pytest.RaisesGroup(pytest.RaisesExc(RestartLimitError, match="3 times")) as group:
        async with open_actor(built, name="ledger", restart=policy, mailbox_size=8) as ref:
            for _ in range(3):
                ref.tell_nowait("crash")
            await trio.sleep_forever()
    assert len(built.actors) == 3
    assert ref.statistics().restarts == 2
    error = group.value.exceptions[0]
    assert isinstance(error.__cause__, RuntimeError)


async def test_zero_restarts_gives_up_on_first_crash() -> None:
    """max_restarts=0 turns the first crash into RestartLimitError."""
    with pytest.RaisesGroup(RestartLimitError):
        async with open_actor(Ledger, name="ledger", restart=RestartPolicy(0, 1)) as ref:
            await ref.tell("crash")
            await trio.sleep_forever()


async def test_crashes_outside_the_window_do_not_add_up(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Crashes spaced wider than within_s never reach the limit."""
    policy = RestartPolicy(max_restarts=1, within_s=5)
    async with open_actor(Ledger, name="ledger", restart=policy) as ref:
        for _ in range(4):
            await ref.tell("crash")
            await wait_idle(ref)
            await trio.sleep(6)
        assert ref.statistics().restarts == 4
        assert await ref.ask(7) == 7


async def test_crashes_inside_the_window_do_add_up(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Two crashes 4 s apart with within_s=5 and max_restarts=1 hit the limit."""
    policy = RestartPolicy(max_restarts=1, within_s=5)
    with pytest.RaisesGroup(RestartLimitError):
        async with open_actor(Ledger, name="ledger", restart=policy) as ref:
            await ref.tell("crash")
            await wait_idle(ref)
            await trio.sleep(4)
            await ref.tell("crash")
            await trio.sleep_forever()


async def test_backoff_delays_the_restart_in_virtual_time(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The next message is handled backoff_s after the crash, not before."""
    built = Built()
    policy = RestartPolicy(max_restarts=5, within_s=100, backoff_s=2.5)
    async with open_actor(built, name="ledger", restart=policy, mailbox_size=4) as ref:
        ref.tell_nowait("crash")
        ref.tell_nowait(1)
        await wait_idle(ref)
    crashed_at = built.actors[0].log[0][0]
    handled_at = built.actors[1].log[0][0]
    assert handled_at - crashed_at == pytest.approx(2.5)


async def test_a_stop_during_the_backoff_ends_it_without_a_rebuild(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A shutdown must not wait out a long backoff, nor build an actor only to stop it."""
    built = Built()
    with capture_actor_logs() as logs:
        assert await _stop_during_backoff(built, [], drain=False) < 0.01
    assert len(built.actors) == 1
    # The restart was announced at the crash, with its backoff; it never happened.
    assert [e["restarts"] for e in events_named(logs, "actor_restarted")] == [1]
    assert _last_ref[0].statistics().restarts == 0


async def test_a_draining_stop_during_the_backoff_still_serves_what_is_queued(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """With messages queued, stop(drain=True) rebuilds the actor at once to handle them."""
    built = Built()
    assert await _stop_during_backoff(built, [5], drain=True) < 0.01
    assert [message for _, message in built.actors[1].log] == [5]


_last_ref: list[ActorRef[object, int]] = []
"""The ref :func:`_stop_during_backoff` used last (its statistics outlive it)."""


async def test_a_crash_while_stopping_is_not_a_restart(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A message that crashes the actor while it stops, with nothing queued behind it, ends it:
    no rebuild, no restart counted or announced, and the crash still logged."""
    built = Built()
    policy = RestartPolicy(max_restarts=3, within_s=60)
    with capture_actor_logs() as logs:
        async with trio.open_nursery() as nursery:
            ref = await spawn(nursery, built, name="ledger", restart=policy)
            ref.tell_nowait("slow crash")
            await trio.sleep(0.5)  # handling it
            await ref.stop(drain=True)
    assert len(built.actors) == 1
    assert ref.statistics().restarts == 0
    assert ref.statistics().failed == 1
    assert events_named(logs, "actor_restarted") == []
    assert len(events_named(logs, "actor_message_failed")) == 1


async def test_a_crash_while_stopping_still_counts_toward_the_limit(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Stopping does not exempt a crash from the policy: with max_restarts=0 ("give up at
    once") a crash while stopping raises RestartLimitError as it would at any other time."""
    policy = RestartPolicy(max_restarts=0, within_s=60)
    with pytest.RaisesGroup(RestartLimitError):
        async with trio.open_nursery() as nursery:
            ref = await spawn(nursery, Built(), name="ledger", restart=policy)
            ref.tell_nowait("slow crash")
            await trio.sleep(0.5)
            await ref.stop(drain=True)


def test_a_factory_that_returns_no_actor_is_named() -> None:
    """A factory returning something else fails with a TypeError naming the actor."""

    async def main() -> None:
        async with open_actor(lambda: 42, name="answer"):  # type: ignore[arg-type,return-value]
            pass

    with pytest.raises(BaseExceptionGroup) as caught:
        trio.run(main)
    error = caught.value.exceptions[0]
    while isinstance(error, BaseExceptionGroup):
        error = error.exceptions[0]
    assert isinstance(error, TypeError)
    assert str(error) == "actor 'answer': the factory must return an Actor, got int"


async def _stop_during_backoff(built: Built, queued: list[object], *, drain: bool) -> float:
    """Crash a ledger with a 30 s restart backoff, queue ``queued`` behind the crash, stop it
    during the backoff; returns how long the stop took (virtual seconds)."""
    policy = RestartPolicy(max_restarts=3, within_s=60, backoff_s=30)
    async with trio.open_nursery() as nursery:
        ref = await spawn(nursery, built, name="ledger", restart=policy)
        _last_ref[:] = [ref]
        ref.tell_nowait("crash")
        for message in queued:
            ref.tell_nowait(message)
        await trio.sleep(0.01)  # the crash happened; the backoff runs
        stopping_at = trio.current_time()
        await ref.stop(drain=drain)
        return trio.current_time() - stopping_at


@attrs.define(eq=False)
class FlakyStart(Actor[int, int]):
    """on_start fails for the first ``failures[0]`` builds."""

    failures: list[int]
    started: list[int]

    async def on_start(self) -> None:
        self.started.append(1)
        if self.failures[0] > 0:
            self.failures[0] -= 1
            msg = "not ready"
            raise ConnectionError(msg)

    def handle(self, message: int) -> int:
        return message * 2


async def test_on_start_failure_is_restarted() -> None:
    """A hook that raises counts as a crash and is retried under the policy."""
    failures: list[int] = [2]
    started: list[int] = []
    policy = RestartPolicy(max_restarts=2, within_s=10)
    async with open_actor(
        lambda: FlakyStart(failures, started), name="flaky", restart=policy
    ) as ref:
        assert await ref.ask(4) == 8
        assert ref.statistics().restarts == 2
    assert len(started) == 3


async def test_first_on_start_failure_without_policy_raises_from_spawn() -> None:
    """spawn re-raises an on_start failure itself (the actor never ran)."""
    async with trio.open_nursery() as nursery:
        with pytest.raises(ConnectionError, match="not ready"):
            await spawn(nursery, FlakyStart([1], []), name="flaky")


async def test_on_stop_runs_only_on_orderly_stop(autojump_clock: trio.testing.MockClock) -> None:
    """on_stop is skipped for a crashed instance and runs for the final one."""
    stops: list[int] = []

    @attrs.define(eq=False)
    class Tracked(Ledger):
        async def on_stop(self) -> None:
            stops.append(self.total)

    policy = RestartPolicy(max_restarts=1, within_s=10)
    async with open_actor(Tracked, name="tracked", restart=policy) as ref:
        await ref.tell(3)
        await ref.tell("crash")
        await ref.tell(4)
    assert stops == [4]


def test_restart_requires_a_factory() -> None:
    """Passing an instance with a restart policy is rejected: it cannot be rebuilt."""
    with pytest.raises(ValueError, match="restart needs a factory"):
        trio.run(_open_instance_with_policy)


async def _open_instance_with_policy() -> None:
    async with open_actor(RecordingActor(), name="x", restart=RestartPolicy(1, 1)):
        pass


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"max_restarts": -1, "within_s": 1}, ValueError, "max_restarts must be >= 0, got -1"),
        (
            {"max_restarts": 1.5, "within_s": 1},
            TypeError,
            "max_restarts must be an integer, got 1.5",
        ),
        (
            {"max_restarts": "3", "within_s": 1},
            TypeError,
            "max_restarts must be an integer, got '3'",
        ),
        (
            {"max_restarts": True, "within_s": 1},
            TypeError,
            "max_restarts must be an integer, got True",
        ),
        ({"max_restarts": 1, "within_s": 0}, ValueError, "within_s must be > 0, got 0"),
        (
            {"max_restarts": 1, "within_s": math.nan},
            ValueError,
            "within_s must be a number of seconds > 0, got nan",
        ),
        ({"max_restarts": 1, "within_s": "9"}, TypeError, "within_s must be a number of seconds"),
        (  # past a float's range: trio's clock minus it would overflow at the first restart
            {"max_restarts": 1, "within_s": 10**400},
            ValueError,
            "within_s must be a number of seconds a float can hold, got an integer of 1,329 bits",
        ),
        (
            {"max_restarts": 1, "within_s": 1, "backoff_s": 10**5000},
            ValueError,
            "backoff_s must be a number of seconds a float can hold, got an integer of 16,610 bits",
        ),
        (
            {"max_restarts": 1, "within_s": 1, "backoff_s": -0.5},
            ValueError,
            "backoff_s must be >= 0 and finite, got -0.5",
        ),
        (
            {"max_restarts": 1, "within_s": 1, "backoff_s": math.nan},
            ValueError,
            "backoff_s must be >= 0 and finite, got nan",
        ),
        (
            {"max_restarts": 1, "within_s": 1, "backoff_s": math.inf},
            ValueError,
            "backoff_s must be >= 0 and finite, got inf",
        ),
        (
            {"max_restarts": 1, "within_s": 1, "backoff_s": None},
            TypeError,
            "backoff_s must be a number of seconds, got None",
        ),
    ],
)
def test_restart_policy_validates_fields(
    kwargs: dict[str, object], error: type[Exception], message: str
) -> None:
    """Each bad field is named with its value, with a TypeError for the wrong kind of value."""
    with pytest.raises(error, match=message):
        RestartPolicy(**kwargs)  # type: ignore[arg-type]


def test_restart_policy_accepts_an_unbounded_window() -> None:
    """within_s=inf counts every crash ever; ints and floats are both fine."""
    policy = RestartPolicy(max_restarts=2, within_s=math.inf, backoff_s=1)
    assert (policy.max_restarts, policy.within_s, policy.backoff_s) == (2, math.inf, 1)


def test_restart_policy_is_frozen() -> None:
    """A policy is an immutable value."""
    policy = RestartPolicy(max_restarts=3, within_s=60)
    assert policy == RestartPolicy(3, 60, 0)
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        policy.max_restarts = 4  # type: ignore[misc]
