"""Benchmark: the cost of the actor layer against hand-written trio channels.

Measures, side by side in one run:

- ask round trip: ``ActorRef.ask`` vs a hand-written request/reply over two trio memory channels
  (the floor for this design) vs a ``threading.Lock``-guarded direct method call (the upstream's
  shape: shared state behind a mutex);
- tell throughput with mailbox sizes 0, 64 and 1024 vs a hand-written channel of the same size
  drained by a consumer task.

Every figure is the median over ``--reps`` repetitions. Usage::

    python benchmarks/bench_actors.py [--reps 7] [--asks 20000] [--tells 50000] [--json PATH]
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import statistics
import sys
import threading
import time
from pathlib import Path

import structlog
import trio

from actors import Actor, open_actor
from actors.testing import wait_idle
from stage_runtime._cli_support import int_at_least

DEFAULT_JSON = Path(__file__).parent / "out" / "actors.json"
ASK_GOAL_RATIO = 1.3
TELL_MAILBOX_SIZES = (0, 64, 1024)


class Echo(Actor[int, int]):
    """The actor under test: returns its message, counts what it saw."""

    def __init__(self) -> None:
        self.seen = 0

    async def handle(self, message: int) -> int:
        self.seen += 1
        return message


class LockedEcho:
    """The upstream's shape: a method guarded by a mutex, called directly."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.seen = 0

    def handle(self, message: int) -> int:
        with self.lock:
            self.seen += 1
            return message


async def ask_actor(count: int) -> float:
    """Elapsed seconds for ``count`` sequential asks through ``ActorRef.ask``."""
    async with open_actor(Echo, name="echo", mailbox_size=64) as ref:
        start = time.perf_counter()
        for i in range(count):
            await ref.ask(i)
        return time.perf_counter() - start


async def ask_channels(count: int) -> float:
    """Elapsed seconds for ``count`` request/reply round trips over two memory channels.

    Written as tight as by hand: one request is outstanding at a time, so both channels always
    have room and ``send_nowait`` does (``await send`` would add a schedule point per message
    that ``ask`` does not pay, flattering the actor)."""
    request_send, request_receive = trio.open_memory_channel[int](64)
    reply_send, reply_receive = trio.open_memory_channel[int](1)
    server = Echo()

    async def serve() -> None:
        async with reply_send:
            async for message in request_receive:
                reply_send.send_nowait(await server.handle(message))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(serve)
        start = time.perf_counter()
        for i in range(count):
            request_send.send_nowait(i)
            await reply_receive.receive()
        elapsed = time.perf_counter() - start
        await request_send.aclose()
    return elapsed


def ask_locked(count: int) -> float:
    """Elapsed seconds for ``count`` lock-guarded direct calls."""
    target = LockedEcho()
    start = time.perf_counter()
    for i in range(count):
        target.handle(i)
    return time.perf_counter() - start


async def tell_actor(count: int, mailbox_size: int) -> float:
    """Elapsed seconds to tell ``count`` messages and have all of them handled."""
    async with open_actor(Echo, name="echo", mailbox_size=mailbox_size) as ref:
        start = time.perf_counter()
        for i in range(count):
            await ref.tell(i)
        await wait_idle(ref)
        return time.perf_counter() - start


async def tell_channels(count: int, mailbox_size: int) -> float:
    """Elapsed seconds to send ``count`` messages to a consumer task and have them handled."""
    send, receive = trio.open_memory_channel[int](mailbox_size)
    consumer = Echo()
    done = trio.Event()

    async def consume() -> None:
        async for message in receive:
            await consumer.handle(message)
        done.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(consume)
        start = time.perf_counter()
        async with send:
            for i in range(count):
                await send.send(i)
        await done.wait()
        return time.perf_counter() - start


def machine() -> dict[str, object]:
    """Where and with what the figures were taken."""
    versions: dict[str, str | None] = {}
    for package in ("trio", "attrs", "structlog", "numpy", "blake3"):
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = None
    return {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "processor": platform.processor(),
        "cpu_count": os.cpu_count(),
        "python": sys.version.split()[0],
        "python_implementation": platform.python_implementation(),
        "versions": versions,
    }


def _median(samples: list[float]) -> float:
    return statistics.median(samples)


def run(reps: int, asks: int, tells: int) -> dict[str, object]:
    """Take every measurement ``reps`` times, interleaved, and summarise the medians."""
    ask_samples: dict[str, list[float]] = {"actor": [], "channels": [], "locked": []}
    tell_samples: dict[str, list[float]] = {}
    for size in TELL_MAILBOX_SIZES:
        tell_samples[f"actor/{size}"] = []
        tell_samples[f"channels/{size}"] = []

    # Warm up caches and code paths once, untimed.
    trio.run(ask_actor, 200)
    trio.run(ask_channels, 200)
    for _ in range(reps):
        ask_samples["actor"].append(trio.run(ask_actor, asks) / asks)
        ask_samples["channels"].append(trio.run(ask_channels, asks) / asks)
        ask_samples["locked"].append(ask_locked(asks) / asks)
        for size in TELL_MAILBOX_SIZES:
            tell_samples[f"actor/{size}"].append(tells / trio.run(tell_actor, tells, size))
            tell_samples[f"channels/{size}"].append(tells / trio.run(tell_channels, tells, size))

    ask_us = {name: _median(values) * 1e6 for name, values in ask_samples.items()}
    ask_ratio = ask_us["actor"] / ask_us["channels"]
    ask_goal = {
        "goal": f"ActorRef.ask round trip within {ASK_GOAL_RATIO}x of two memory channels",
        "metric": "ask.actor_vs_channels",
        "max": ASK_GOAL_RATIO,
        "value": ask_ratio,
        "met": ask_ratio <= ASK_GOAL_RATIO,
    }
    ask_result = {
        "round_trip_us": ask_us,
        "actor_vs_channels": ask_ratio,
        "actor_vs_locked": ask_us["actor"] / ask_us["locked"],
        "goal_ratio": ASK_GOAL_RATIO,
        "within_goal": ask_goal["met"],
        "goal": ask_goal,
        "samples_us": {k: [v * 1e6 for v in vs] for k, vs in ask_samples.items()},
    }
    tell_result: dict[str, object] = {}
    for size in TELL_MAILBOX_SIZES:
        actor_rate = _median(tell_samples[f"actor/{size}"])
        floor_rate = _median(tell_samples[f"channels/{size}"])
        tell_result[str(size)] = {
            "actor_msgs_per_s": actor_rate,
            "channels_msgs_per_s": floor_rate,
            "actor_vs_channels": actor_rate / floor_rate,
            "samples_msgs_per_s": {
                "actor": tell_samples[f"actor/{size}"],
                "channels": tell_samples[f"channels/{size}"],
            },
        }
    return {
        "benchmark": "actors",
        "reps": reps,
        "asks_per_rep": asks,
        "tells_per_rep": tells,
        "ask": ask_result,
        "tell": tell_result,
        # The goals, one entry each, so a summary can print MET or MISSED. Tell throughput
        # is reported against its floor but has no target of its own.
        # The shape every benchmark uses, which benchmarks/run.py summarises.
        "goals": [
            {
                "name": "ask round trip / two memory channels",
                "target": f"<= {ASK_GOAL_RATIO}",
                "measured": round(ask_ratio, 2),
                "met": ask_goal["met"],
            }
        ],
        "machine": machine(),
    }


def print_table(result: dict[str, object]) -> None:
    """Print the medians side by side."""
    ask = result["ask"]
    tell = result["tell"]
    assert isinstance(ask, dict)
    assert isinstance(tell, dict)
    us = ask["round_trip_us"]
    print(f"actors benchmark: median of {result['reps']} reps")
    print()
    print(f"{'ask round trip':<40} {'us/op':>10} {'vs floor':>10}")
    rows = [
        ("ActorRef.ask", us["actor"]),
        ("two memory channels (floor)", us["channels"]),
        ("threading.Lock direct call", us["locked"]),
    ]
    for label, value in rows:
        print(f"{label:<40} {value:>10.2f} {value / us['channels']:>9.2f}x")
    verdict = "within" if ask["within_goal"] else "NOT within"
    print(f"ask is {verdict} {ask['goal_ratio']}x of the floor")
    print()
    print(f"{'tell throughput':<20} {'actor msg/s':>14} {'floor msg/s':>14} {'actor/floor':>12}")
    for size, row in tell.items():
        print(
            f"{'mailbox ' + size:<20} {row['actor_msgs_per_s']:>14,.0f} "
            f"{row['channels_msgs_per_s']:>14,.0f} {row['actor_vs_channels']:>11.2f}x"
        )
    goals = result["goals"]
    assert isinstance(goals, list)
    print()
    for goal in goals:
        verdict = "MET" if goal["met"] else "MISSED"
        print(f"{verdict:<7} {goal['name']}: {goal['measured']}x (goal {goal['target']}x)")


def main(argv: list[str] | None = None) -> dict[str, object]:
    """Run the benchmark, print the table, write the JSON and return the result."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    positive = int_at_least(1)
    parser.add_argument("--reps", type=positive, default=7, help="repetitions; medians reported")
    parser.add_argument("--asks", type=positive, default=20_000, help="asks per repetition")
    parser.add_argument("--tells", type=positive, default=50_000, help="tells per repetition")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON, help="where to write JSON")
    args = parser.parse_args(argv)
    # The actors log only lifecycle events, never per message; capture them so the table stays
    # readable without configuring structlog for whoever imports this module.
    with structlog.testing.capture_logs():
        result = run(args.reps, args.asks, args.tells)
    print_table(result)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {args.json}")
    return result


if __name__ == "__main__":
    main()
