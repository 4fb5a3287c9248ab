"""Core semantics of actors: replies, ordering, backpressure, stopping and cancel safety."""

from __future__ import annotations

import functools
import gc
import weakref
from typing import Any, assert_type

import attrs
import pytest
import trio
import trio.testing

from actors import (
    Actor,
    ActorError,
    ActorRef,
    ActorStatistics,
    ActorStoppedError,
    Asks,
    RestartLimitError,
    open_actor,
    spawn,
)
from actors._reply import Reply
from actors.testing import LogEvent, RecordingActor, capture_actor_logs, events_named, wait_idle


@attrs.frozen
class Add:
    amount: int


@attrs.frozen
class Get:
    pass


@attrs.frozen
class Boom:
    pass


@attrs.define(eq=False)
class Counter(Actor[Add | Get | Boom, int]):
    total: int = 0

    async def handle(self, message: Add | Get | Boom) -> int:
        if isinstance(message, Add):
            self.total += message.amount
        elif isinstance(message, Boom):
            raise KeyError("boom")
        return self.total


@attrs.define(eq=False)
class Slow(Actor[int, int]):
    """Sleeps ``delay_s`` then echoes; records what it finished."""

    delay_s: float = 10
    finished: list[int] = attrs.field(factory=list)

    async def handle(self, message: int) -> int:
        await trio.sleep(self.delay_s)
        self.finished.append(message)
        return message


@attrs.define(eq=False)
class Gate(Actor[object, object]):
    """Blocks in ``handle`` until ``release`` is set; records messages."""

    release: trio.Event = attrs.field(factory=trio.Event)
    received: list[object] = attrs.field(factory=list)

    async def handle(self, message: object) -> object:
        await self.release.wait()
        self.received.append(message)
        return message


async def test_ask_returns_the_handlers_reply() -> None:
    """ask returns what handle returned, with state kept between messages."""
    async with open_actor(Counter, name="counter") as ref:
        assert await ref.ask(Add(2)) == 2
        assert await ref.ask(Add(3)) == 5
        assert await ref.ask(Get()) == 5


async def test_sync_handle_is_supported() -> None:
    """A plain def handle works like an async one."""
    async with open_actor(RecordingActor(reply=str.upper), name="rec") as ref:
        assert await ref.ask("hi") == "HI"


async def test_actor_class_with_no_handle_cannot_be_built() -> None:
    """handle is abstract: forgetting it fails at construction."""

    class Empty(Actor[int, int]):
        pass

    with pytest.raises(TypeError):
        Empty()  # type: ignore[abstract]


async def test_handler_error_in_ask_is_raised_in_caller_and_actor_survives() -> None:
    """The caller gets the very exception; the actor keeps its state and runs on."""
    raised: list[BaseException] = []

    @attrs.define(eq=False)
    class Remembering(Counter):
        async def handle(self, message: Add | Get | Boom) -> int:
            try:
                return await super().handle(message)
            except KeyError as exc:
                raised.append(exc)
                raise

    async with open_actor(Remembering, name="counter") as ref:
        await ref.ask(Add(1))
        with pytest.raises(KeyError, match="boom") as info:
            await ref.ask(Boom())
        assert len(raised) == 1
        assert info.value is raised[0]
        assert await ref.ask(Get()) == 1
        stats = ref.statistics()
        assert (stats.processed, stats.failed) == (3, 1)


async def test_tell_is_handled_in_order_per_sender() -> None:
    """Messages from one sender are handled in the order they were sent."""
    actor = RecordingActor()
    async with open_actor(actor, name="rec", mailbox_size=4) as ref:
        for i in range(20):
            await ref.tell(i)
        await wait_idle(ref)
        assert actor.received == list(range(20))


async def test_one_message_at_a_time_even_when_handler_awaits(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """An awaiting handler never overlaps with another message's handler."""

    @attrs.define(eq=False)
    class Exclusive(Actor[int, None]):
        busy: bool = False
        overlaps: int = 0
        seen: list[int] = attrs.field(factory=list)

        async def handle(self, message: int) -> None:
            if self.busy:
                self.overlaps += 1
            self.busy = True
            await trio.sleep(0.01 * (message % 3))
            self.seen.append(message)
            self.busy = False

    actor = Exclusive()
    async with open_actor(actor, name="ex", mailbox_size=2) as ref:

        async def send_many(sender: int) -> None:
            for i in range(10):
                await ref.tell(sender * 100 + i)
                await trio.sleep(0.003)

        async with trio.open_nursery() as nursery:
            for sender in range(4):
                nursery.start_soon(send_many, sender)
    assert actor.overlaps == 0
    assert len(actor.seen) == 40
    for sender in range(4):
        mine = [m for m in actor.seen if m // 100 == sender]
        assert mine == sorted(mine)


async def test_open_actor_exit_drains_queued_messages_and_runs_on_stop() -> None:
    """Leaving the block handles every queued tell, then runs on_stop once."""

    @attrs.define(eq=False)
    class Hooks(Actor[int, None]):
        events: list[str] = attrs.field(factory=list)

        async def on_start(self) -> None:
            self.events.append("start")

        async def handle(self, message: int) -> None:
            await trio.lowlevel.checkpoint()
            self.events.append(f"msg{message}")

        async def on_stop(self) -> None:
            self.events.append("stop")

    actor = Hooks()
    async with open_actor(actor, name="hooks", mailbox_size=8) as ref:
        for i in range(3):
            ref.tell_nowait(i)
        assert actor.events == ["start"]
    assert actor.events == ["start", "msg0", "msg1", "msg2", "stop"]
    assert ref.stopped


async def test_mailbox_size_defaults_to_64() -> None:
    """Without mailbox_size, open_actor and spawn give a 64-message mailbox that really holds 64."""
    async with trio.open_nursery() as nursery:
        spawned = await spawn(nursery, RecordingActor, name="spawned")
        assert spawned.statistics().mailbox_size == 64
        await spawned.stop()
    actor = Gate()
    async with open_actor(actor, name="gate") as ref:
        ref.tell_nowait("taken")
        await trio.testing.wait_all_tasks_blocked()
        for i in range(64):
            ref.tell_nowait(i)
        with pytest.raises(trio.WouldBlock):
            ref.tell_nowait(64)
        assert ref.statistics().mailbox_size == 64
        actor.release.set()


async def test_spawn_returns_once_on_start_has_run() -> None:
    """spawn's ref is usable at once and on_start has already run."""

    @attrs.define(eq=False)
    class Ready(Actor[None, bool]):
        ready: bool = False

        async def on_start(self) -> None:
            await trio.lowlevel.checkpoint()
            self.ready = True

        def handle(self, message: None) -> bool:
            return self.ready

    actor = Ready()
    async with trio.open_nursery() as nursery:
        ref = await spawn(nursery, actor, name="ready")
        assert actor.ready
        assert await ref.ask(None) is True
        await ref.stop()
    assert ref.stopped


async def test_full_mailbox_blocks_tell_and_tell_nowait_raises() -> None:
    """With the mailbox full, tell waits for room and tell_nowait raises WouldBlock."""
    actor = Gate()
    async with open_actor(actor, name="gate", mailbox_size=2) as ref:
        await ref.tell("a")  # taken by the actor, which now blocks in handle
        await trio.testing.wait_all_tasks_blocked()
        ref.tell_nowait("b")
        ref.tell_nowait("c")
        with pytest.raises(trio.WouldBlock):
            ref.tell_nowait("d")
        sent = trio.Event()

        async def blocked_tell() -> None:
            await ref.tell("d")
            sent.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(blocked_tell)
            await trio.testing.wait_all_tasks_blocked()
            assert not sent.is_set()
            assert ref.statistics().queued == 2
            actor.release.set()
        assert sent.is_set()
    assert actor.received == ["a", "b", "c", "d"]
    assert ref.statistics().max_queued == 2


async def test_rendezvous_mailbox_hands_each_message_to_the_actor() -> None:
    """mailbox_size=0 accepts a tell only when the actor is ready to receive."""
    actor = Gate()
    async with open_actor(actor, name="rv", mailbox_size=0) as ref:
        await trio.testing.wait_all_tasks_blocked()
        ref.tell_nowait("a")  # the actor waits in receive: handed over directly
        await trio.testing.wait_all_tasks_blocked()
        with pytest.raises(trio.WouldBlock):
            ref.tell_nowait("b")  # the actor is busy in handle
        actor.release.set()
        assert await ref.ask("c") == "c"
        assert ref.statistics().max_queued == 0
    assert actor.received == ["a", "c"]


async def test_stop_with_drain_handles_queued_messages() -> None:
    """stop(drain=True) handles the queue before stopping; later asks raise at once."""
    actor = Gate()
    async with trio.open_nursery() as nursery:
        ref = await spawn(nursery, actor, name="gate")
        for i in range(4):
            ref.tell_nowait(i)
        await trio.testing.wait_all_tasks_blocked()
        actor.release.set()
        await ref.stop()
        assert actor.received == [0, 1, 2, 3]
        with pytest.raises(ActorStoppedError):
            await ref.ask(5)
        with pytest.raises(ActorStoppedError):
            await ref.tell(5)
        with pytest.raises(ActorStoppedError):
            ref.tell_nowait(5)


async def test_stop_without_drain_drops_queue_and_fails_its_asks() -> None:
    """stop(drain=False) lets the current message finish, drops the rest, fails their asks."""
    actor = Gate()
    outcomes: list[object] = []
    async with trio.open_nursery() as nursery:
        ref = await spawn(nursery, actor, name="gate", mailbox_size=8)
        ref.tell_nowait("current")
        await trio.testing.wait_all_tasks_blocked()
        ref.tell_nowait("queued-tell")

        async def queued_ask() -> None:
            try:
                outcomes.append(await ref.ask("queued-ask"))
            except ActorStoppedError as exc:
                outcomes.append(exc)

        nursery.start_soon(queued_ask)
        await trio.testing.wait_all_tasks_blocked()

        async def release_later() -> None:
            await trio.testing.wait_all_tasks_blocked()
            actor.release.set()

        nursery.start_soon(release_later)
        await ref.stop(drain=False)
    assert actor.received == ["current"]
    assert len(outcomes) == 1
    assert isinstance(outcomes[0], ActorStoppedError)


async def test_ask_after_stop_raises_promptly(autojump_clock: trio.testing.MockClock) -> None:
    """An ask to a stopped actor raises ActorStoppedError without waiting at all."""
    async with open_actor(Counter, name="counter") as ref:
        pass
    start = trio.current_time()
    with pytest.raises(ActorStoppedError, match="counter"):
        await ref.ask(Get())
    assert trio.current_time() == start


async def test_senders_waiting_for_room_are_refused_when_actor_stops() -> None:
    """A tell blocked on a full mailbox raises ActorStoppedError once stop is requested."""
    actor = Gate()
    errors: list[BaseException] = []
    async with trio.open_nursery() as nursery:
        ref = await spawn(nursery, actor, name="gate", mailbox_size=1)
        ref.tell_nowait(1)
        await trio.testing.wait_all_tasks_blocked()
        ref.tell_nowait(2)

        async def blocked() -> None:
            with pytest.raises(ActorStoppedError) as info:
                await ref.tell(3)
            errors.append(info.value)

        nursery.start_soon(blocked)
        await trio.testing.wait_all_tasks_blocked()
        actor.release.set()
        await ref.stop()
    assert len(errors) == 1
    assert actor.received == [1, 2]


async def test_stop_from_inside_handle_does_not_deadlock() -> None:
    """A handler may stop its own actor; the stop takes effect after the message."""

    @attrs.define(eq=False)
    class SelfStopping(Actor[str, str]):
        ref: ActorRef[str, str] | None = None

        async def handle(self, message: str) -> str:
            if message == "quit" and self.ref is not None:
                await self.ref.stop()
            return message

    actor = SelfStopping()
    async with open_actor(actor, name="self") as ref:
        actor.ref = ref
        assert await ref.ask("quit") == "quit"
        with pytest.raises(ActorStoppedError):
            await ref.ask("again")


async def test_pending_ask_fails_when_actor_is_cancelled() -> None:
    """An ask whose actor is cancelled mid-handler raises ActorStoppedError, not hangs."""
    async with trio.open_nursery() as outer:
        actor_scope = trio.CancelScope()

        async def host(task_status: trio.TaskStatus[ActorRef[int, int]]) -> None:
            with actor_scope:
                async with trio.open_nursery() as nursery:
                    task_status.started(await spawn(nursery, Slow(), name="slow"))

        ref = await outer.start(host)
        errors: list[BaseException] = []

        async def caller() -> None:
            try:
                await ref.ask(1)
            except ActorStoppedError as exc:
                errors.append(exc)

        outer.start_soon(caller)
        await trio.testing.wait_all_tasks_blocked()
        actor_scope.cancel()
    assert len(errors) == 1
    assert ref.stopped


async def test_ask_timeout_leaves_actor_running(autojump_clock: trio.testing.MockClock) -> None:
    """An ask that times out does not kill the actor or leak the late reply."""
    actor = Slow(delay_s=10)
    async with open_actor(actor, name="slow") as ref:
        with pytest.raises(trio.TooSlowError):
            await ref.ask(1, timeout=1)
        assert await ref.ask(2, timeout=30) == 2
        assert actor.finished == [1, 2]
        assert ref.statistics().asks_waiting == 0


@pytest.mark.parametrize(
    ("bad_timeout", "error", "match"),
    [
        (-1, ValueError, "timeout must be >= 0 seconds, got -1"),
        (float("nan"), ValueError, "timeout must be a number of seconds >= 0, got nan"),
        (
            10**400,
            ValueError,
            "timeout must be a number of seconds a float can hold \\(None: no timeout\\), "
            "got an integer of 1,329 bits",
        ),
        ("1", TypeError, "timeout must be a number of seconds or None, got '1'"),
        (True, TypeError, "timeout must be a number of seconds or None, got True"),
    ],
)
async def test_bad_ask_timeout_is_rejected_and_sends_nothing(
    bad_timeout: Any, error: type[Exception], match: str
) -> None:
    """A bad timeout names the field and value; the message never reaches the actor."""
    actor = RecordingActor()
    async with open_actor(actor, name="rec") as ref:
        with pytest.raises(error, match=match):
            await ref.ask("lost", timeout=bad_timeout)
        assert ref.statistics() == ActorStatistics(
            mailbox_size=64,
            queued=0,
            max_queued=0,
            processed=0,
            failed=0,
            restarts=0,
            asks_waiting=0,
        )
        assert await ref.ask("kept", timeout=0.5) is None
    assert actor.received == ["kept"]


async def test_open_actor_block_raising_cancels_the_actor(actor_logs: list[LogEvent]) -> None:
    """An exception in the block cancels the actor (queue dropped) and leaves in a group."""
    actor = Gate()
    with pytest.RaisesGroup(pytest.RaisesExc(ValueError, match="body failed")):
        async with open_actor(actor, name="gate", mailbox_size=4) as ref:
            ref.tell_nowait("current")
            await trio.testing.wait_all_tasks_blocked()
            ref.tell_nowait("queued")
            raise ValueError("body failed")
    assert actor.received == []
    assert ref.stopped
    [stopped] = [e for e in actor_logs if e["event"] == "actor_stopped"]
    assert (stopped["drained"], stopped["dropped"], stopped["processed"]) == (False, 1, 0)


async def test_cancel_before_enqueue_sends_nothing() -> None:
    """An ask cancelled while waiting for mailbox room never reaches the actor."""
    actor = Gate()
    async with open_actor(actor, name="gate", mailbox_size=1) as ref:
        ref.tell_nowait("first")
        await trio.testing.wait_all_tasks_blocked()
        ref.tell_nowait("second")
        with trio.move_on_after(0) as scope:
            await ref.ask("never")
        assert scope.cancelled_caught
        assert ref.statistics().asks_waiting == 0
        actor.release.set()
        assert await ref.ask("after") == "after"
    assert actor.received == ["first", "second", "after"]


async def test_cancel_while_queued_drops_reply_and_keeps_actor() -> None:
    """An ask cancelled while queued is still handled; its reply goes nowhere."""
    actor = Gate()
    async with open_actor(actor, name="gate", mailbox_size=4) as ref:
        ref.tell_nowait("busy")
        await trio.testing.wait_all_tasks_blocked()
        with trio.CancelScope() as scope:

            async def cancel_when_queued() -> None:
                await trio.testing.wait_all_tasks_blocked()
                assert ref.statistics().queued == 1
                scope.cancel()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(cancel_when_queued)
                await ref.ask("abandoned")
        assert scope.cancelled_caught
        actor.release.set()
        assert await ref.ask("mine") == "mine"
        assert ref.statistics().asks_waiting == 0
    assert actor.received == ["busy", "abandoned", "mine"]


async def test_cancel_while_handler_runs_drops_late_reply(actor_logs: list[LogEvent]) -> None:
    """An ask cancelled mid-handler leaves the actor running; its late reply goes quietly."""
    seq = trio.testing.Sequencer()

    @attrs.define(eq=False)
    class Stepped(Actor[str, str]):
        async def handle(self, message: str) -> str:
            if message == "slow":
                async with seq(1):
                    pass  # the handler is running now
                async with seq(3):
                    pass  # the caller has been cancelled
            return message.upper()

    async with open_actor(Stepped, name="stepped") as ref:
        async with trio.open_nursery() as nursery:
            cancelled = trio.CancelScope()

            async def caller() -> None:
                with cancelled:
                    await ref.ask("slow")
                assert cancelled.cancelled_caught

            nursery.start_soon(caller)
            async with seq(0):
                pass
            async with seq(2):
                cancelled.cancel()
        assert await ref.ask("next") == "NEXT"
        stats = ref.statistics()
        assert (stats.asks_waiting, stats.processed, stats.failed) == (0, 2, 0)
    # Quietly: nothing is logged for the dropped reply.
    assert [e["event"] for e in actor_logs] == ["actor_started", "actor_stopped"]


async def test_concurrent_asks_with_cancellations_never_cross_replies(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Each surviving ask gets the reply to its own message, whoever else was cancelled."""
    actor = Slow(delay_s=0.1)
    results: dict[int, int] = {}
    async with open_actor(actor, name="echo", mailbox_size=3) as ref:
        async with trio.open_nursery() as nursery:
            for i in range(30):

                async def one(i: int = i) -> None:
                    with trio.move_on_after(0.35 * (i % 5)):
                        results[i] = await ref.ask(i)

                nursery.start_soon(one)
        assert ref.statistics().asks_waiting == 0
    assert results
    assert all(key == value for key, value in results.items())
    assert len(results) < 30  # some were cancelled


async def test_crash_without_policy_propagates_and_fails_pending_asks() -> None:
    """A tell whose handler raises ends the actor; the owning nursery gets the exception."""
    asked: list[BaseException] = []
    with pytest.RaisesGroup(KeyError):
        async with open_actor(Counter, name="counter", mailbox_size=4) as ref:
            ref.tell_nowait(Boom())
            try:
                await ref.ask(Get())
            except ActorStoppedError as exc:
                asked.append(exc)
            await trio.sleep_forever()
    assert len(asked) == 1
    assert ref.stopped


async def test_statistics_snapshot() -> None:
    """statistics() reports mailbox size, queue, counters and waiting asks."""
    actor = Gate()
    async with open_actor(actor, name="gate", mailbox_size=5) as ref:
        ref.tell_nowait(0)
        await trio.testing.wait_all_tasks_blocked()
        ref.tell_nowait(1)
        ref.tell_nowait(2)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(ref.ask, 3)
            await trio.testing.wait_all_tasks_blocked()
            stats = ref.statistics()
            assert stats == ActorStatistics(
                mailbox_size=5,
                queued=3,
                max_queued=3,
                processed=0,
                failed=0,
                restarts=0,
                asks_waiting=1,
            )
            actor.release.set()
        stats = ref.statistics()
        assert (stats.queued, stats.processed, stats.asks_waiting) == (0, 4, 0)
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        stats.queued = 1  # type: ignore[misc]


@pytest.mark.parametrize("size", [-1, -64])
async def test_negative_mailbox_size_is_rejected(size: int) -> None:
    """mailbox_size must be >= 0, and the message names field and value."""
    with pytest.raises(ValueError, match=f"mailbox_size must be >= 0, got {size}"):
        async with open_actor(Counter, name="c", mailbox_size=size):
            pass


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"name": 5}, TypeError, "name must be a string, got 5"),
        ({"name": None}, TypeError, "name must be a string, got None"),
        ({"name": ""}, ValueError, "name must be a non-empty string, got ''"),
        ({"name": "c", "mailbox_size": 1.5}, TypeError, "mailbox_size must be an integer, got 1.5"),
        ({"name": "c", "mailbox_size": "8"}, TypeError, "mailbox_size must be an integer, got '8'"),
        ({"name": "c", "mailbox_size": True}, TypeError, "mailbox_size must be an integer"),
        ({"name": "c", "restart": 3}, TypeError, "restart must be a RestartPolicy or None, got 3"),
    ],
)
async def test_bad_name_mailbox_size_or_restart_is_rejected_plainly(
    kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    """open_actor and spawn reject a bad name, mailbox size or policy before starting anything."""
    with pytest.raises(error, match=match):
        async with open_actor(Counter, **kwargs):
            pass
    async with trio.open_nursery() as nursery:
        with pytest.raises(error, match=match):
            await spawn(nursery, Counter, **kwargs)
        assert not nursery.child_tasks


async def test_non_actor_is_rejected() -> None:
    """Something neither an Actor nor callable is a TypeError."""
    bad: Any = 42
    with pytest.raises(TypeError, match="actor_or_factory"):
        async with open_actor(bad, name="c"):
            pass


def test_error_hierarchy() -> None:
    """Both specific errors are ActorErrors, and not ValueErrors."""
    assert issubclass(ActorStoppedError, ActorError)
    assert issubclass(RestartLimitError, ActorError)
    assert not issubclass(ActorError, ValueError)


async def test_handler_returning_an_awaitable_from_plain_def_is_awaited() -> None:
    """A plain def handle that returns a coroutine (a wrapped async handler) is awaited."""

    class Wrapped(Actor[int, int]):
        async def _double(self, message: int) -> int:
            await trio.lowlevel.checkpoint()
            return message * 2

        def handle(self, message: int) -> Any:
            return self._double(message)

    async with open_actor(Wrapped, name="wrapped") as ref:
        assert await ref.ask(21) == 42


@attrs.define(eq=False)
class Selfish(Actor[str, object]):
    """Talks to itself through ``ref`` to exercise the deadlock guards."""

    ref: ActorRef[str, object] | None = None

    async def handle(self, message: str) -> object:
        assert self.ref is not None
        if message == "ask-self":
            return await self.ref.ask("inner")
        if message == "fill-self":
            self.ref.tell_nowait("filler")
            await self.ref.tell("overflow")
        if message == "tell-self":
            await self.ref.tell("inner")
        if message == "wait-self":
            await wait_idle(self.ref)
        return message


async def test_actor_asking_itself_raises_instead_of_deadlocking() -> None:
    """ask from the actor's own task is a RuntimeError, and the actor survives it."""
    actor = Selfish()
    async with open_actor(actor, name="selfish") as ref:
        actor.ref = ref
        with pytest.raises(RuntimeError, match="cannot ask itself"):
            await ref.ask("ask-self")
        assert await ref.ask("ok") == "ok"


async def test_actor_may_tell_itself_but_not_into_a_full_mailbox() -> None:
    """A self-tell with room is queued; one that would wait for room raises RuntimeError."""
    actor = Selfish()
    async with open_actor(actor, name="selfish", mailbox_size=1) as ref:
        actor.ref = ref
        assert await ref.ask("tell-self") == "tell-self"
        await wait_idle(ref)
        with pytest.raises(RuntimeError, match="its own full mailbox"):
            await ref.ask("fill-self")


def _live_replies() -> int:
    gc.collect()
    return sum(isinstance(obj, Reply) for obj in gc.get_objects())


async def test_cancelled_asks_leave_no_reply_slots_behind(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """After asks cancelled at every stage are settled, no reply slot is still referenced."""
    actor = Slow(delay_s=1)
    async with open_actor(actor, name="slow", mailbox_size=2) as ref:
        before = _live_replies()
        async with trio.open_nursery() as nursery:
            for i in range(12):

                async def one(i: int = i) -> None:
                    with trio.move_on_after(0.5 * (i % 4)):
                        await ref.ask(i)

                nursery.start_soon(one)
        await wait_idle(ref)
        assert ref.statistics().asks_waiting == 0
        assert _live_replies() == before


@attrs.define(eq=False)
class Payload:
    size_bytes: int


async def test_idle_actor_keeps_no_message_or_reply_alive() -> None:
    """Once handled, neither the last message nor the last reply is kept by the actor."""

    class Maker(Actor[Payload, Payload]):
        def handle(self, message: Payload) -> Payload:
            return Payload(size_bytes=message.size_bytes * 2)

    async with open_actor(Maker, name="maker") as ref:
        message = Payload(size_bytes=1)
        reply = await ref.ask(message)
        message_ref, reply_ref = weakref.ref(message), weakref.ref(reply)
        del message, reply
        await wait_idle(ref)
        gc.collect()
        assert message_ref() is None
        assert reply_ref() is None


async def test_a_ref_used_from_another_thread_is_refused_and_the_actor_unharmed() -> None:
    """trio's channels are not thread-safe: a send from a worker thread must fail at once,
    with a clear error, instead of corrupting the mailbox and wedging the actor."""
    async with open_actor(Counter(), name="counter") as ref:

        def from_thread() -> str:
            try:
                ref.tell_nowait(Add(5))
            except RuntimeError as exc:
                return str(exc)
            return "sent"

        outcome = await trio.to_thread.run_sync(from_thread)
        assert outcome == (
            "actor 'counter' can only be used from the trio run that spawned it; from another "
            "thread, go through trio.from_thread.run"
        )
        assert await ref.ask(Add(1)) == 1  # the thread's message was never queued

        def other_run() -> str:
            async def ask() -> object:
                return await ref.ask(Get())

            try:
                trio.run(ask)
            except RuntimeError as exc:
                return str(exc)
            return "asked"

        assert (await trio.to_thread.run_sync(other_run)).startswith("actor 'counter' can only")
        assert await ref.ask(Get()) == 1
        assert ref.statistics().asks_waiting == 0


async def test_wait_idle_from_the_actors_own_handler_is_an_error_not_a_deadlock() -> None:
    """Like ask and tell, waiting for itself to be idle would wait forever."""
    actor = Selfish()
    async with open_actor(actor, name="self-waiter") as ref:
        actor.ref = ref
        with pytest.raises(RuntimeError, match="cannot wait for itself to be idle"):
            await ref.ask("wait-self")
        assert ref.statistics().failed == 1


async def test_a_stray_cancelled_from_a_handler_is_an_error_not_a_silent_stop() -> None:
    """A handler that raises a trio.Cancelled it kept from an earlier cancellation (nothing is
    cancelled now) fails that ask with a RuntimeError saying so; the actor keeps running."""

    @attrs.define(eq=False)
    class Hoarder(Actor[str, str]):
        kept: list[trio.Cancelled] = attrs.field(factory=list)

        async def handle(self, message: str) -> str:
            if message == "keep":
                with trio.CancelScope() as scope:
                    scope.cancel()
                    try:
                        await trio.sleep(1)
                    except trio.Cancelled as cancelled:
                        self.kept.append(cancelled)
                        raise
                return "kept"
            if message == "raise it":
                raise self.kept[0]
            return message

    async with open_actor(Hoarder, name="hoarder") as ref:
        assert await ref.ask("keep") == "kept"
        with pytest.raises(RuntimeError, match=r"raised trio\.Cancelled while nothing around it"):
            await ref.ask("raise it")
        assert await ref.ask("still here") == "still here"


@attrs.frozen
class Total(Asks[int]):
    """Asks for the sum so far; declares an int reply."""


@attrs.frozen
class Describe(Asks[str]):
    """Asks for a description; declares a str reply."""


class Typed(Actor[Total | Describe | int, object]):
    """Answers each kind of message with its own type; the general reply type says little."""

    def __init__(self) -> None:
        self.total = 0

    def handle(self, message: Total | Describe | int) -> object:
        if isinstance(message, Total):
            return self.total
        if isinstance(message, Describe):
            return f"total {self.total}"
        self.total += message
        return None


async def test_a_message_deriving_from_asks_types_its_reply() -> None:
    """ask() of an Asks[T] message is typed T (mypy checks the assert_type lines; at run time
    they are no-ops), and any other message gets the actor's reply type."""
    async with open_actor(Typed(), name="typed") as ref:
        assert_type(await ref.ask(5), object)
        total = await ref.ask(Total())
        assert_type(total, int)
        description = await ref.ask(Describe(), timeout=1)
        assert_type(description, str)
    assert (total, description) == (5, "total 5")


async def test_ask_later_returns_once_queued_and_the_reply_comes_later() -> None:
    """ask_later hands back before the actor handles the message; result() gives the reply."""
    gate = Gate()
    async with open_actor(gate, name="gate") as ref:
        pending = await ref.ask_later("first")
        assert not pending.done
        assert gate.received == []
        gate.release.set()
        assert await pending.result() == "first"
        assert pending.done
        assert gate.received == ["first"]


async def test_ask_later_nowait_queues_at_once_or_raises_when_full() -> None:
    """ask_later_nowait queues without a schedule point (the actor has not run yet when it
    returns) and the reply comes through result(); with the mailbox full it raises WouldBlock
    and sends nothing; once the actor stopped it raises ActorStoppedError."""
    gate = Gate()
    async with trio.open_nursery() as nursery:
        ref = await spawn(nursery, gate, name="gate", mailbox_size=1)
        first = ref.ask_later_nowait("first")  # handed to the actor waiting in receive
        second = ref.ask_later_nowait("second")  # fills the mailbox
        assert gate.received == []
        with pytest.raises(trio.WouldBlock, match="mailbox of actor 'gate' is full"):
            ref.ask_later_nowait("third")
        gate.release.set()
        assert await first.result() == "first"
        assert await second.result() == "second"
        assert gate.received == ["first", "second"]
        await ref.stop()
        with pytest.raises(ActorStoppedError):
            ref.ask_later_nowait("late")


async def test_a_done_callback_gets_the_reply_from_the_actors_task() -> None:
    """add_done_callback hands the outcome over as the actor replies (in the actor's task, no
    other task woken): a value, the handler's exception, or ActorStoppedError for a message
    dropped by a stop; a reply already in is handed over at once. A reply is collected once."""
    seen: list[tuple[str, Any, trio.lowlevel.Task]] = []

    def keep(label: str) -> Any:
        def callback(result: Any) -> None:
            try:
                seen.append((label, result.unwrap(), trio.lowlevel.current_task()))
            except Exception as exc:
                seen.append((label, exc, trio.lowlevel.current_task()))

        return callback

    gate = Gate()
    async with trio.open_nursery() as nursery:
        ref = await spawn(nursery, gate, name="gate", mailbox_size=4)
        first = ref.ask_later_nowait("first")
        first.add_done_callback(keep("first"))
        with pytest.raises(RuntimeError, match="collected already"):
            await first.result()
        dropped = ref.ask_later_nowait("dropped")
        dropped.add_done_callback(keep("dropped"))
        assert seen == []
        gate.release.set()
        await wait_idle(ref)
        assert [(label, value) for label, value, _ in seen] == [
            ("first", "first"),
            ("dropped", "dropped"),
        ]
        assert seen[0][2] is not trio.lowlevel.current_task()  # the actor's own task
        late = ref.ask_later_nowait("late")
        await wait_idle(ref)
        late.add_done_callback(keep("late"))  # already in: handed over at once, here
        assert seen[-1] == ("late", "late", trio.lowlevel.current_task())
        gate.release = trio.Event()
        ref.ask_later_nowait("busy")  # being handled while the stop comes
        queued = ref.ask_later_nowait("queued")
        queued.add_done_callback(keep("queued"))
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(functools.partial(ref.stop, drain=False))
        await trio.testing.wait_all_tasks_blocked()
        gate.release.set()
    label, error, _ = seen[-1]
    assert label == "queued"
    assert isinstance(error, ActorStoppedError)


async def test_a_raising_done_callback_is_logged_and_the_actor_goes_on() -> None:
    """A callback's exception is the caller's bug: it is logged at error, with its traceback,
    and neither crashes the actor nor reaches whoever settled the reply."""

    def broken(result: Any) -> None:
        raise ValueError("callback bug")

    with capture_actor_logs() as logs:
        async with open_actor(Counter, name="counter") as ref:
            ref.ask_later_nowait(Add(1)).add_done_callback(broken)
            assert await ref.ask(Add(2)) == 3
    (event,) = events_named(logs, "actor_reply_callback_failed")
    assert event["log_level"] == "error"
    assert event["actor"] == "counter"
    assert event["error_type"] == "ValueError"
    assert isinstance(event["exc_info"], ValueError)


async def test_an_actor_cannot_ask_later_nowait_itself() -> None:
    """From the actor's own task ask_later_nowait is refused, as ask and ask_later are."""

    @attrs.define
    class Selfish(Actor[object, object]):
        ref: ActorRef[object, object] | None = None

        def handle(self, message: object) -> object:
            assert self.ref is not None
            with pytest.raises(RuntimeError, match="cannot ask itself"):
                self.ref.ask_later_nowait("me")
            return message

    actor = Selfish()
    async with open_actor(actor, name="selfish") as ref:
        actor.ref = ref
        assert await ref.ask("hello") == "hello"


async def test_ask_later_raises_the_handlers_error_from_result() -> None:
    """A failing handler's exception comes out of result(); the actor runs on."""
    async with open_actor(Counter, name="counter") as ref:
        pending = await ref.ask_later(Boom())
        with pytest.raises(KeyError, match="boom"):
            await pending.result()
        assert await ref.ask(Add(4)) == 4


async def test_ask_later_reply_of_a_stopped_actor_is_an_error(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A message the actor drops when stopping without drain fails its result(); the one it
    was handling finishes."""
    gate = Gate()
    async with trio.open_nursery() as nursery:
        ref = await spawn(nursery, gate, name="gate")
        first = await ref.ask_later("first")
        queued = await ref.ask_later("second")
        await trio.sleep(1)
        nursery.start_soon(ref.stop, False)
        await trio.sleep(1)
        gate.release.set()
        with pytest.raises(ActorStoppedError):
            await queued.result()
        assert await first.result() == "first"
