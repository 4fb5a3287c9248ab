"""Property: concurrent asks and tells equal the same messages applied one by one.

Many sender tasks issue random asks and tells (some asks with timeouts that cancel them) against
one actor. Whatever the interleaving, the final state and every reply a caller received must be
exactly what a sequential replay of the messages, in the order the actor received them, produces.
"""

from __future__ import annotations

import attrs
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

from actors import Actor, open_actor


@attrs.frozen
class Op:
    """One operation on a small key-value store."""

    kind: str
    key: int
    amount: int
    cost_s: float
    """Virtual time the handler spends, so other senders interleave."""


@attrs.frozen
class Envelope:
    sender: int
    index: int
    op: Op


def apply(store: dict[int, int], op: Op) -> int | None:
    """The reference semantics: mutate ``store`` and return the reply."""
    if op.kind == "put":
        old = store.get(op.key)
        store[op.key] = op.amount
        return old
    if op.kind == "add":
        store[op.key] = store.get(op.key, 0) + op.amount
        return store[op.key]
    if op.kind == "pop":
        return store.pop(op.key, None)
    return store.get(op.key)


@attrs.define(eq=False)
class Store(Actor[Envelope | None, int | dict[int, int] | None]):
    """The actor under test: the same semantics, with awaits inside the handler."""

    store: dict[int, int] = attrs.field(factory=dict)
    received: list[Envelope] = attrs.field(factory=list)

    async def handle(self, message: Envelope | None) -> int | dict[int, int] | None:
        if message is None:
            return dict(self.store)
        self.received.append(message)
        if message.op.cost_s:
            await trio.sleep(message.op.cost_s)
        else:
            await trio.lowlevel.checkpoint()
        return apply(self.store, message.op)


ops = st.builds(
    Op,
    kind=st.sampled_from(["put", "add", "pop", "get"]),
    key=st.integers(0, 3),
    amount=st.integers(-5, 5),
    cost_s=st.sampled_from([0.0, 0.0, 0.01, 0.05]),
)
actions = st.tuples(
    ops,
    st.sampled_from(["ask", "tell"]),
    st.sampled_from([None, None, None, 0.0, 0.02, 0.1]),  # ask timeout
    st.sampled_from([0.0, 0.0, 0.01, 0.03]),  # pause before the next action
)
senders = st.lists(st.lists(actions, max_size=12), min_size=1, max_size=6)


@settings(max_examples=60, deadline=None)
@given(plan=senders, mailbox_size=st.sampled_from([0, 1, 4, 64]))
def test_concurrent_messages_equal_sequential_replay(
    plan: list[list[tuple[Op, str, float | None, float]]], mailbox_size: int
) -> None:
    """Final state and every delivered reply match a sequential replay in receive order."""
    actor = Store()
    replies: dict[tuple[int, int], int | dict[int, int] | None] = {}
    final: list[int | dict[int, int] | None] = []

    async def main() -> None:
        async with open_actor(actor, name="store", mailbox_size=mailbox_size) as ref:

            async def run_sender(sender: int) -> None:
                for index, (op, mode, timeout, pause) in enumerate(plan[sender]):
                    envelope = Envelope(sender, index, op)
                    if mode == "tell":
                        await ref.tell(envelope)
                    elif timeout is None:
                        replies[sender, index] = await ref.ask(envelope)
                    else:
                        with trio.move_on_after(timeout):
                            replies[sender, index] = await ref.ask(envelope)
                    if pause:
                        await trio.sleep(pause)

            async with trio.open_nursery() as nursery:
                for sender in range(len(plan)):
                    nursery.start_soon(run_sender, sender)
            final.append(await ref.ask(None))
            assert ref.statistics().asks_waiting == 0

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))

    # Every tell and every un-cancelled ask reached the actor exactly once.
    seen = [(e.sender, e.index) for e in actor.received]
    assert len(seen) == len(set(seen))
    must_arrive = {
        (s, i)
        for s, actions_ in enumerate(plan)
        for i, (_, mode, _, _) in enumerate(actions_)
        if mode == "tell" or (s, i) in replies
    }
    assert must_arrive <= set(seen)
    # FIFO per sender.
    for sender in range(len(plan)):
        mine = [i for s, i in seen if s == sender]
        assert mine == sorted(mine)
    # Sequential replay in receive order.
    store: dict[int, int] = {}
    expected: dict[tuple[int, int], int | None] = {}
    for envelope in actor.received:
        expected[envelope.sender, envelope.index] = apply(store, envelope.op)
    assert final == [store]
    for key, reply in replies.items():
        assert reply == expected[key]
