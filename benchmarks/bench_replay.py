"""Replay a whole trace through a 4-stage pipeline and compare with the hashing floor.

The floor is the least work any replay must do: BLAKE3-hash every prompt token once per stage
(each stage derives its cache keys from a hash of the prompt). The replay does that plus
everything else (token blocks, cache lookups and records, the trio pipeline and actors, virtual
time), with the ladder index or the paged one (``--index``) at the command line's defaults.
Goals (issue 20): the replay's process CPU time within 6x of the floor's with the ladder index,
8x with the paged one (``ratio_to_floor_cpu``), and peak RSS under 2 GB. CPU time rather than
wall time: on a shared machine wall time also counts other processes' turns. The replay's CPU
time is this process's over ``run_replay`` (the report's theoretical maximum, the same every
run, is computed once beforehand).

Next to it, what the design itself costs: the replay's own message pattern with no cache work
(two actor asks and a channel hop per stage and request), and the least messaging the design
needs in bare trio (one round trip, one one-way message, one hop; the fastest run). The latter
plus the hashing floor is the *design floor*: no replay built this way can be faster, whatever
its cache does. What the goal leaves beyond it, per stage and request, is what all the cache's
own work (probing, recording, accounting, messages and frames) would have to fit in. And the
replay itself with caches that do nothing (every restore misses, every record stores nothing;
the messages, prompts, frames, token ids and summary are all still made): what the pipeline
around the cache costs (``null_cache_cpu_s``), and so the share of the replay's CPU time that
is the cache's (``cache_share_cpu``).

Usage::

    python benchmarks/bench_replay.py ../shared/traces/synthetic_trace.jsonl
    python benchmarks/bench_replay.py --trace TRACE.jsonl --index paged --repeat 3 --json out.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from importlib.metadata import version
from pathlib import Path
from typing import Final

import blake3
import structlog
import trio

from actors import Actor, open_actor
from stage_runtime._cli_support import int_at_least
from stage_runtime.cache.stage_cache import StageCache
from stage_runtime.sim import (
    BlockTokenizer,
    SimConfig,
    SimRequest,
    TheoreticalMax,
    read_trace,
    run_replay,
    theoretical_max_hit_ratio,
)

TAKES_TRACE = True
"""``benchmarks/run.py`` passes ``--trace PATH`` to benchmarks that set this."""

NAME = "replay"

RUNS: Final = {"replay": [], "replay_paged": ["--index", "paged"]}
"""What ``benchmarks/run.py`` runs of this script: each name with its extra arguments."""

GOAL_CLI_RSS_BYTES: Final = {"paged": 400 * 2**20}
"""The issue's goal, per index: peak RSS of ``stage-runtime replay TRACE --stages 4 --index I``
(the command line's defaults otherwise)."""

GOAL_CPU_RATIO: Final = {"ladder": 6.0, "paged": 8.0}
"""The issue's goals, per index: the replay's CPU time at most this many times the hashing
floor's CPU time."""


def _machine() -> dict[str, str]:
    versions = {name: version(name) for name in ("numpy", "trio", "blake3", "attrs", "structlog")}
    return {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "processor": platform.processor() or "unknown",
        "python": platform.python_version(),
        **versions,
    }


def _peak_rss_bytes() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports KiB, macOS bytes.
    return int(peak) if sys.platform == "darwin" else int(peak) * 1024


def cli_peak_rss_bytes(trace_path: str, *, stages: int, index: str) -> int:
    """Peak RSS of ``stage-runtime replay TRACE --stages N --index I`` run as a user would (its
    report written to a temporary directory), read from the kernel as the process exits. Call
    it while the calling process is small: Linux counts the child's memory before it runs the
    command, a copy of its parent, in the child's peak."""
    with tempfile.TemporaryDirectory(prefix="bench-replay-") as scratch:
        argv = [
            sys.executable,
            "-m",
            "stage_runtime",
            "replay",
            str(Path(trace_path).resolve()),
            "--stages",
            str(stages),
            "--index",
            index,
        ]
        log_path = Path(scratch) / "stderr.log"
        with log_path.open("wb") as log:
            process = subprocess.Popen(argv, cwd=scratch, stdout=subprocess.DEVNULL, stderr=log)
            _, status, usage = os.wait4(process.pid, 0)
        process.returncode = os.waitstatus_to_exitcode(status)
        if process.returncode != 0:
            errors = log_path.read_text(encoding="utf-8", errors="replace")[-500:]
            msg = f"{' '.join(argv[2:])} exited with {process.returncode}: {errors}"
            raise RuntimeError(msg)
    # Linux reports KiB, macOS bytes.
    return int(usage.ru_maxrss) if sys.platform == "darwin" else int(usage.ru_maxrss) * 1024


def floor_seconds(
    requests: list[SimRequest], *, stages: int, block_size: int
) -> tuple[float, float, float]:
    """Time BLAKE3 over every prompt token once per stage; return (hash_s, token_generation_s,
    hash_cpu_s): wall and CPU time of the hashing (CPU time does not count other processes'
    turns on a shared machine, which wall time over a 0.2 s total does)."""
    tokenizer = BlockTokenizer(block_size)
    hashing = generating = hashing_cpu = 0.0
    for request in requests:
        started = time.perf_counter()
        tokens = tokenizer.request_tokens(request)
        data = tokens.tobytes() if not tokens.flags.c_contiguous else tokens.data.cast("B")
        generated = time.perf_counter()
        cpu = time.process_time()
        for _ in range(stages):
            blake3.blake3(data).digest()
        hashing_cpu += time.process_time() - cpu
        hashing += time.perf_counter() - generated
        generating += generated - started
    return hashing, generating, hashing_cpu


class _Nothing(Actor[object, None]):
    """A cache actor that does no cache work: what the message pattern costs on its own."""

    def handle(self, message: object) -> None:
        return None


_Inbox = trio.MemoryReceiveChannel[trio.Event]
_Outbox = trio.MemorySendChannel[trio.Event] | None
_StageTask = Callable[[_Inbox, _Outbox, trio.Nursery], Awaitable[None]]


async def _drive(
    stage: _StageTask, requests: int, stages: int, channel_size: int
) -> tuple[float, float]:
    """Wall and CPU seconds for ``requests`` requests, one at a time, through ``stages`` tasks
    running ``stage`` and chained by channels (the last one sets the request's event)."""
    channels = [trio.open_memory_channel[trio.Event](channel_size) for _ in range(stages)]
    async with trio.open_nursery() as nursery:
        for i in range(stages):
            following = channels[i + 1][0] if i + 1 < stages else None
            nursery.start_soon(stage, channels[i][1], following, nursery)
        entry = channels[0][0]
        started, cpu = time.perf_counter(), time.process_time()
        for _ in range(requests):
            done = trio.Event()
            await entry.send(done)
            await done.wait()
        elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu
        await entry.aclose()
    return elapsed, cpu


async def _forward(done: trio.Event, outbox: _Outbox) -> None:
    if outbox is None:
        done.set()
    else:
        await outbox.send(done)


async def _actor_stage(inbox: _Inbox, outbox: _Outbox, nursery: trio.Nursery) -> None:
    """The replay's message pattern: a stage that owns an actor and, per request, asks it twice
    (restore, record) and forwards over a channel."""
    async with open_actor(_Nothing, name="nothing") as actor, inbox:
        async for done in inbox:
            await actor.ask(done)
            await actor.ask(done)
            await _forward(done, outbox)
    if outbox is not None:
        await outbox.aclose()


def message_floor_seconds(requests: int, *, stages: int, channel_size: int = 4) -> float:
    """The architecture's own floor: the replay's trio messages with no cache or model work."""
    return trio.run(_drive, _actor_stage, requests, stages, channel_size)[0]


def _wait_for_the_answer(_: object) -> trio.lowlevel.Abort:
    # The owner holds the parked task and will wake it: a cancel waits for that answer.
    return trio.lowlevel.Abort.FAILED


async def _owner(mail: trio.MemoryReceiveChannel[trio.lowlevel.Task | None]) -> None:
    async for asker in mail:
        if asker is not None:
            trio.lowlevel.reschedule(asker)


async def _bare_stage(inbox: _Inbox, outbox: _Outbox, nursery: trio.Nursery) -> None:
    """The least messaging the design allows, in trio's cheapest terms.

    Per request: one round trip to the task that owns the cache (a restore needs its answer
    before the stage can compute), one one-way message to it (a record) and one channel hop
    downstream. No actor toolkit, no reply objects: the owner wakes the parked stage task
    directly, which is what any reply on trio costs at the least. The hop is a ``send_nowait``,
    which skips the checkpoint of ``send``: one request at a time, a channel never fills."""
    send_mail, mail = trio.open_memory_channel[trio.lowlevel.Task | None](4)
    nursery.start_soon(_owner, mail)
    async with inbox, send_mail:
        async for done in inbox:
            send_mail.send_nowait(trio.lowlevel.current_task())  # restore: a round trip
            await trio.lowlevel.wait_task_rescheduled(_wait_for_the_answer)
            send_mail.send_nowait(None)  # record: one way
            if outbox is None:
                done.set()
            else:
                outbox.send_nowait(done)
    if outbox is not None:
        await outbox.aclose()


def bare_message_floor_seconds(
    requests: int, *, stages: int, channel_size: int = 4
) -> tuple[float, float]:
    """The design's own floor: the least messaging it needs, in bare trio (see _bare_stage);
    wall and CPU seconds."""
    return trio.run(_drive, _bare_stage, requests, stages, channel_size)


@contextlib.contextmanager
def _caches_doing_nothing() -> Iterator[None]:
    """Within: every stage cache restores nothing and records nothing (its actor still gets
    both messages and builds the prompt), so a replay costs what the pipeline does alone."""
    restore, record = StageCache.restore_prompt, StageCache.record_prompt
    StageCache.restore_prompt = lambda self, prompt: None  # type: ignore[method-assign]
    StageCache.record_prompt = lambda self, prompt, frame: []  # type: ignore[method-assign]
    try:
        yield
    finally:
        StageCache.restore_prompt = restore  # type: ignore[method-assign]
        StageCache.record_prompt = record  # type: ignore[method-assign]


def null_cache_cpu_seconds(
    requests: list[SimRequest], config: SimConfig, theoretical: TheoreticalMax
) -> float:
    """CPU seconds of the same replay with caches that do nothing: the pipeline's own cost
    (stages, models, frames, messages, token ids, summary), which a replay with any cache
    pays too."""
    with _caches_doing_nothing():
        started = time.process_time()
        run_replay(requests, config, theoretical=theoretical)
        return time.process_time() - started


def main(argv: list[str] | None = None) -> dict[str, object]:
    """Run the benchmark; print a table, write JSON and return the results."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace_path", nargs="?", help="the trace (.jsonl)")
    parser.add_argument("--trace", dest="trace_option", help="the trace (same as the positional)")
    parser.add_argument("--stages", type=int_at_least(1), default=4)
    parser.add_argument(
        "--index",
        choices=sorted(GOAL_CPU_RATIO),
        default="ladder",
        help="cache index, at the command line's defaults otherwise (ladder)",
    )
    parser.add_argument(
        "--repeat", type=int_at_least(1), default=3, help="repetitions (median reported)"
    )
    parser.add_argument("--limit-requests", type=int_at_least(1), default=None)
    parser.add_argument("--json", default=f"benchmarks/out/{NAME}.json")
    args = parser.parse_args(argv)
    trace_path = args.trace_option or args.trace_path
    if trace_path is None:
        parser.error("a trace path is required (positional or --trace)")
    if not Path(trace_path).is_file():
        parser.error(f"cannot read trace {trace_path}: no such file")

    # Warnings only: the library logs every record and eviction at info/debug.
    structlog.configure(
        wrapper_class=structlog.make_filtering_bound_logger(30), cache_logger_on_first_use=True
    )
    # First, while this process is small: Linux counts a child's memory before it runs the
    # command (a copy of this process) in the child's peak RSS.
    cli_goal = GOAL_CLI_RSS_BYTES.get(args.index)
    cli_peak = (
        cli_peak_rss_bytes(trace_path, stages=args.stages, index=args.index)
        if cli_goal is not None and args.limit_requests is None
        else None
    )
    trace = read_trace(trace_path, limit=args.limit_requests)
    requests = list(trace.requests)
    tokens = sum(request.input_length for request in requests)
    config = SimConfig(stages=args.stages, index=args.index)
    goal_ratio = GOAL_CPU_RATIO[args.index]

    floors: list[float] = []
    floor_cpus: list[float] = []
    message_floors: list[float] = []
    bare_floors: list[float] = []
    bare_floor_cpus: list[float] = []
    generation: list[float] = []
    walls: list[float] = []
    cpus: list[float] = []
    null_cpus: list[float] = []
    result = None
    # A report figure, the same every run: computed once, outside the replay's timed CPU.
    theoretical = theoretical_max_hit_ratio(requests, block_size=config.block_size)
    for _ in range(args.repeat):
        hash_s, gen_s, hash_cpu_s = floor_seconds(
            requests, stages=config.stages, block_size=config.block_size
        )
        floors.append(hash_s)
        floor_cpus.append(hash_cpu_s)
        generation.append(gen_s)
        message_floors.append(message_floor_seconds(len(requests), stages=config.stages))
        bare_wall, bare_cpu = bare_message_floor_seconds(len(requests), stages=config.stages)
        bare_floors.append(bare_wall)
        bare_floor_cpus.append(bare_cpu)
        cpu_start = time.process_time()
        result = run_replay(requests, config, theoretical=theoretical)
        # CPU time too: on a shared machine wall time also counts other processes' turns.
        cpus.append(time.process_time() - cpu_start)
        walls.append(result.wall_s)
        null_cpus.append(null_cache_cpu_seconds(requests, config, theoretical))
    assert result is not None
    wall = statistics.median(walls)
    cpu = statistics.median(cpus)
    floor = statistics.median(floors)
    floor_cpu = statistics.median(floor_cpus)
    message_floor = statistics.median(message_floors)
    # A floor, so the fastest run: noise on a shared machine only ever adds time.
    bare_floor = min(bare_floors)
    bare_floor_cpu = min(bare_floor_cpus)
    # What any replay of this design takes at the least: the hashing floor plus the least
    # messaging the design needs, with no cache work at all.
    design_floor_ratio = (floor + bare_floor) / floor if floor > 0 else None
    design_floor_ratio_cpu = (floor_cpu + bare_floor_cpu) / floor_cpu if floor_cpu > 0 else None
    ratio_cpu = cpu / floor_cpu if floor_cpu > 0 else None
    null_cpu = statistics.median(null_cpus)
    null_ratio_cpu = null_cpu / floor_cpu if floor_cpu > 0 else None
    # What the goal leaves for everything else a stage does per request (probing, hashing
    # beyond one pass, recording, accounting, building messages and frames), in CPU time, and
    # what all of that takes now.
    stage_requests = len(requests) * config.stages
    budget_us = max(goal_ratio * floor_cpu - floor_cpu - bare_floor_cpu, 0.0) / stage_requests
    budget_us *= 1e6
    beyond_us = max(cpu - floor_cpu - bare_floor_cpu, 0.0) / stage_requests * 1e6
    peak = _peak_rss_bytes()
    cli_goals: list[dict[str, object]] = []
    cli_rows: list[tuple[str, str]] = []
    if cli_peak is not None and cli_goal is not None:
        cli_goals.append(
            {
                "name": f"peak RSS of stage-runtime replay --index {args.index} (MiB)",
                "target": f"<= {cli_goal // 2**20}",
                "measured": round(cli_peak / 2**20),
                "met": cli_peak <= cli_goal,
            }
        )
        shown = f"{cli_peak / 2**20:,.0f} MiB (goal <= {cli_goal // 2**20} MiB)"
        cli_rows.append(("peak RSS of the CLI's replay", shown))
    out: dict[str, object] = {
        "benchmark": NAME,
        "trace": str(trace_path),
        "index": args.index,
        "requests": len(requests),
        "prompt_tokens": tokens,
        "stages": config.stages,
        "repeat": args.repeat,
        "wall_s": wall,
        "wall_s_all": walls,
        "cpu_s": cpu,
        "cpu_s_all": cpus,
        "floor_s": floor,
        "floor_s_all": floors,
        "floor_description": "BLAKE3 over every prompt token once per stage",
        "token_generation_s": statistics.median(generation),
        # Not the floor: the same trio messages (two actor asks and a channel hop per
        # stage and request) with no cache work, to show what the architecture alone costs.
        "message_floor_s": message_floor,
        "message_floor_s_all": message_floors,
        "ratio_to_message_floor": wall / message_floor if message_floor > 0 else None,
        # The least messaging the design needs (one round trip, one one-way message and one
        # hop per stage and request) in bare trio, without the actor toolkit.
        "bare_message_floor_s": bare_floor,
        "bare_message_floor_s_all": bare_floors,
        "bare_message_floor_cpu_s": bare_floor_cpu,
        "bare_message_floor_cpu_s_all": bare_floor_cpus,
        "design_floor_ratio": design_floor_ratio,
        "design_floor_ratio_cpu": design_floor_ratio_cpu,
        "ratio_to_messages_plus_floor": (
            wall / (message_floor + floor) if message_floor + floor > 0 else None
        ),
        # The goal's ratio: CPU time (medians of each), less sensitive to other processes.
        "floor_cpu_s": floor_cpu,
        "floor_cpu_s_all": floor_cpus,
        "ratio_to_floor_cpu": ratio_cpu,
        # The same replay with caches that restore and record nothing: what the pipeline costs
        # around the cache (a replay with any cache pays it too).
        "null_cache_cpu_s": null_cpu,
        "null_cache_cpu_s_all": null_cpus,
        "null_cache_ratio_to_floor_cpu": null_ratio_cpu,
        "cache_share_cpu": (cpu - null_cpu) / cpu if cpu > 0 else None,
        "goal_budget_cpu_us_per_stage_request": budget_us,
        "beyond_design_floor_cpu_us_per_stage_request": beyond_us,
        "ratio_to_floor": wall / floor if floor > 0 else None,
        "tokens_per_s": tokens / wall if wall > 0 else None,
        "peak_rss_bytes": peak,
        "cli_peak_rss_bytes": cli_peak,
        "goal": {"ratio_to_floor_cpu_max": goal_ratio, "peak_rss_bytes_max": 2 * 1024**3},
        "goals": [
            {
                "name": f"replay CPU time / hashing floor CPU time ({args.index})",
                "target": f"<= {goal_ratio:g}",
                "measured": None if ratio_cpu is None else round(ratio_cpu, 2),
                "met": ratio_cpu is not None and ratio_cpu <= goal_ratio,
            },
            {
                "name": "peak RSS (MiB)",
                "target": "< 2048",
                "measured": round(peak / 2**20),
                "met": peak < 2 * 1024**3,
            },
            *cli_goals,
        ],
        "token_hit_ratio": result.token_hit_ratio,
        "theoretical_max_hit_ratio": result.theoretical.ratio,
        "config": config.as_dict(),
        "machine": _machine(),
    }
    print(
        f"replay of {trace_path}: {len(requests):,} requests, {tokens:,} prompt tokens, "
        f"{config.stages} stages, {args.index} index, median of {args.repeat}"
    )
    rows = [
        ("replay wall time", f"{wall:.2f} s"),
        ("replay CPU time", f"{cpu:.2f} s"),
        ("floor (BLAKE3 once per stage)", f"{floor:.2f} s (CPU {floor_cpu:.2f} s)"),
        (
            "ratio to floor in CPU time",
            f"{ratio_cpu:.1f}x (goal <= {goal_ratio:g}x)" if ratio_cpu is not None else "n/a",
        ),
        ("ratio to floor in wall time", f"{wall / floor:.1f}x" if floor > 0 else "n/a"),
        ("token generation (not in floor)", f"{statistics.median(generation):.2f} s"),
        ("messages alone (2 asks + 1 hop)", f"{message_floor:.2f} s"),
        ("ratio to messages + floor", f"{wall / (message_floor + floor):.1f}x"),
        (
            "least messaging, bare trio (fastest)",
            f"{bare_floor:.2f} s (CPU {bare_floor_cpu:.2f} s)",
        ),
        (
            "design floor / floor (no cache work)",
            f"{design_floor_ratio_cpu:.2f}x in CPU time"
            if design_floor_ratio_cpu is not None
            else "n/a",
        ),
        (
            "caches doing nothing (CPU)",
            f"{null_cpu:.2f} s = {null_ratio_cpu:.1f}x floor"
            if null_ratio_cpu is not None
            else f"{null_cpu:.2f} s",
        ),
        (
            f"{goal_ratio:g}x goal leaves for cache work",
            f"{budget_us:.2f} us CPU per stage and request",
        ),
        ("beyond the design floor now", f"{beyond_us:.2f} us CPU per stage and request"),
        ("replay speed", f"{tokens / wall:,.0f} tokens/s"),
        ("peak RSS", f"{peak / 2**20:,.0f} MiB (goal < 2048 MiB)"),
        *cli_rows,
        (
            "token hit ratio / theoretical max",
            f"{result.token_hit_ratio:.1%} / {result.theoretical.ratio:.1%}",
        ),
    ]
    for label, value in rows:
        print(f"  {label:<36} {value}")
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2) + "\n", encoding="utf-8")
    return out


if __name__ == "__main__":
    main()
