"""Time the synchronous cache work alone: each stage's restore and record per request, no trio.

For each index (ladder, paged) at the command line's defaults (4 stages, capacity 0, that is
unbounded, 64 ladder entries or 1,000,000 pages: ``SimConfig()``'s defaults), every request of
the trace goes to every stage's cache (a ``StageCache`` built from the simulator's stage
configurations, as each stage's cache actor holds one) in pipeline order, with the calls the
cache actor makes for its stage:

1. restore the longest cached prefix (one ``ActivationRestore`` for either index: the paged
   index's pages, or the ladder's frame);
2. record the stage's full output frame (virtual rows, as the simulated model makes them: the
   restored prefix joined to the computed suffix).

Only those two calls are timed (``time.perf_counter`` around each); building the message
envelope, the token ids and the frames is the stage's and the model's work, done outside. The
figure is ``us_per_stage_request``: the timed seconds over requests x stages, the median of
``--repeat`` runs, each on fresh caches. No actor, no channel, no log event (nothing is built
for the actor's debug events).

One more run per index, with Python's cyclic garbage collector off, gives
``us_per_stage_request_gc_off``: the collector's share of the figure (its full collections walk
every resident entry; the paged index keeps one object per page).

Goals (issue 20): at most 30 us per stage and request with the ladder, 60 us with the paged
index. ``--profile`` adds one more run per index under cProfile (the two calls only) and prints
its top functions, sorted by own time.

Usage::

    python benchmarks/bench_cache.py ../shared/traces/synthetic_trace.jsonl
    python benchmarks/bench_cache.py --trace TRACE.jsonl --index paged --repeat 1 --profile
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import platform
import pstats
import resource
import statistics
import sys
import time
from collections.abc import Sequence
from importlib.metadata import version
from pathlib import Path
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from stage_runtime import ActivationFrame, StageConfig
from stage_runtime._cli_support import int_at_least
from stage_runtime.cache import ActivationRestore, StageCache
from stage_runtime.config import MessageBase
from stage_runtime.sim import (
    BlockTokenizer,
    SimConfig,
    SimRequest,
    SimulatedStageModel,
    read_trace,
    simulated_model_factory,
    stage_configs,
)

TAKES_TRACE = True
"""``benchmarks/run.py`` passes ``--trace PATH`` to benchmarks that set this."""

NAME = "cache"

INDEXES: Final = ("ladder", "paged")

GOAL_US: Final = {"ladder": 30.0, "paged": 60.0}
"""The issue's goals: microseconds of cache work per stage and request, per index."""


def _machine() -> dict[str, str]:
    versions = {name: version(name) for name in ("numpy", "blake3", "attrs")}
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


def _prompt(tokenizer: BlockTokenizer, request: SimRequest) -> npt.NDArray[np.int32]:
    """The request's token ids as the pipeline hands them to every stage: a read-only int32
    array that owns its data."""
    tokens = np.ascontiguousarray(tokenizer.request_tokens(request), dtype=np.int32)
    if tokens.base is not None:
        tokens = tokens.copy()
    tokens.flags.writeable = False
    return tokens


def _base(config: StageConfig, request: SimRequest) -> MessageBase:
    """The envelope a stage builds for its cache (``Stage._message_base``), as a replay's."""
    return MessageBase(
        run_id=config.run_id,
        request_id=f"request-{request.index}",
        session_id=f"session-{request.index}",
        cache_salt=None,
        stage_id=config.stage_id,
        stage_index=config.stage_index,
        topology_id=config.topology_id,
        model_id=config.model_id,
    )


class _StageCache:
    """One stage's cache and model, fed as the stage feeds them (a plain slotted class: it is
    called for every request)."""

    __slots__ = ("cache", "config", "model", "width")

    def __init__(self, config: StageConfig, model: SimulatedStageModel) -> None:
        cache = StageCache.from_config(config, environ={})
        if cache is None or not cache.should_lookup():
            msg = f"stage {config.stage_id} has no lookup-record cache"
            raise ValueError(msg)
        self.config = config
        self.cache = cache
        self.model = model
        self.width = model.activation_width


class Run:
    """The figures of one pass over the trace (all stages): timed seconds, and what the caches
    did (to check against a replay's)."""

    __slots__ = ("hits", "record_s", "records", "restore_s", "restored_tokens")

    def __init__(self, stages: int) -> None:
        self.restore_s = 0.0
        self.record_s = 0.0
        self.hits = [0] * stages
        self.restored_tokens = [0] * stages
        self.records = [0] * stages


def run_once(
    requests: Sequence[SimRequest],
    config: SimConfig,
    *,
    profiler: cProfile.Profile | None = None,
) -> Run:
    """Feed every request to fresh stage caches of ``config``, in pipeline order; time (or
    profile, when ``profiler`` is given) the restore and record calls only.

    Args:
        requests: The workload, in file order.
        config: The simulation settings the stages are built from.
        profiler: Enabled around each call instead of timing them.

    Returns:
        The timed seconds and, per stage, hits, restored tokens and records stored.
    """
    factory = simulated_model_factory(
        bytes_per_token=config.bytes_per_token, cost=config.cost, sleep=False
    )
    caches = []
    for stage in stage_configs(config):
        model = factory(stage)
        assert isinstance(model, SimulatedStageModel)
        caches.append(_StageCache(stage, model))
    tokenizer = BlockTokenizer(config.block_size)
    run = Run(len(caches))
    clock = time.perf_counter
    for request in requests:
        tokens = _prompt(tokenizer, request)
        n = int(tokens.size)
        for position, cache in enumerate(caches):
            stage, stage_cache, width = cache.config, cache.cache, cache.width
            base = _base(stage, request)
            if profiler is not None:
                profiler.enable()
            started = clock()
            hit = stage_cache.restore(base, tokens, width)
            restored_s = clock()
            if profiler is not None:
                profiler.disable()
            output = _output(cache.model, hit, n)
            if profiler is not None:
                profiler.enable()
            recording = clock()
            records = stage_cache.record(base, tokens, width, output)
            recorded_s = clock()
            if profiler is not None:
                profiler.disable()
            run.restore_s += restored_s - started
            run.record_s += recorded_s - recording
            if hit is not None:
                run.hits[position] += 1
                run.restored_tokens[position] += hit.token_count
            run.records[position] += sum(1 for record in records if record.payload_bytes)
    return run


def _output(model: SimulatedStageModel, hit: ActivationRestore | None, n: int) -> ActivationFrame:
    """The stage's full output frame: the restored prefix (the paged pages joined, as the stage
    joins them) and the model's suffix."""
    if hit is None:
        return model.frame(n)
    restored = hit.frame()
    k = restored.token_count
    if k >= n:
        return restored
    return ActivationFrame.concat(restored, model.frame(n - k))


def profile_rows(profiler: cProfile.Profile, top: int) -> tuple[list[dict[str, Any]], str]:
    """The ``top`` functions by own time: rows for the JSON, and pstats' printed table."""
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text).strip_dirs()
    stats.sort_stats("tottime").print_stats(top)
    table: dict[Any, Any] = stats.stats  # type: ignore[attr-defined]
    ordered = sorted(table.items(), key=lambda item: item[1][2], reverse=True)[:top]
    total = sum(row[2] for row in table.values())
    rows = [
        {
            "function": f"{path}:{line}({name})",
            "ncalls": calls,
            "tottime_s": own,
            "cumtime_s": cumulative,
            "tottime_share": own / total if total else None,
        }
        for (path, line, name), (_, calls, own, cumulative, _) in ordered
    ]
    return rows, text.getvalue()


def main(argv: list[str] | None = None) -> dict[str, object]:
    """Run the benchmark; print a table, write JSON and return the results."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace_path", nargs="?", help="the trace (.jsonl)")
    parser.add_argument("--trace", dest="trace_option", help="the trace (same as the positional)")
    parser.add_argument(
        "--index",
        choices=INDEXES,
        action="append",
        help="measure only this index (repeatable; default: both)",
    )
    parser.add_argument("--stages", type=int_at_least(1), default=4)
    parser.add_argument(
        "--repeat", type=int_at_least(1), default=3, help="repetitions (median reported)"
    )
    parser.add_argument("--limit-requests", type=int_at_least(1), default=None)
    parser.add_argument(
        "--profile", action="store_true", help="one more run per index under cProfile"
    )
    parser.add_argument(
        "--profile-top", type=int_at_least(1), default=25, help="functions shown (25)"
    )
    parser.add_argument("--json", default=f"benchmarks/out/{NAME}.json")
    args = parser.parse_args(argv)
    trace_path = args.trace_option or args.trace_path
    if trace_path is None:
        parser.error("a trace path is required (positional or --trace)")
    if not Path(trace_path).is_file():
        parser.error(f"cannot read trace {trace_path}: no such file")
    indexes = [index for index in INDEXES if index in (args.index or INDEXES)]

    requests = list(read_trace(trace_path, limit=args.limit_requests).requests)
    tokens = sum(request.input_length for request in requests)
    stage_requests = len(requests) * args.stages
    results: dict[str, dict[str, Any]] = {}
    profiles: dict[str, str] = {}
    runs: dict[str, list[Run]] = {index: [] for index in indexes}
    # Interleaved (ladder, paged, ladder, ...): noise from other work spreads over both. Each
    # run starts with the previous one's caches collected: the paged index's entries form
    # reference cycles, and left for the next run's collector they were charged to it (the
    # ladder read 33-34 us interleaved, 30-31 alone).
    for _ in range(args.repeat):
        for index in indexes:
            gc.collect()
            runs[index].append(run_once(requests, SimConfig(stages=args.stages, index=index)))
    for index in indexes:
        config = SimConfig(stages=args.stages, index=index)
        done = runs[index]
        totals = [run.restore_s + run.record_s for run in done]
        per = [total / stage_requests * 1e6 if stage_requests else 0.0 for total in totals]
        median = statistics.median(per)
        row: dict[str, Any] = {
            "us_per_stage_request": median,
            "us_per_stage_request_all": per,
            "restore_us_per_stage_request": statistics.median(
                run.restore_s / stage_requests * 1e6 if stage_requests else 0.0 for run in done
            ),
            "record_us_per_stage_request": statistics.median(
                run.record_s / stage_requests * 1e6 if stage_requests else 0.0 for run in done
            ),
            "cache_s": statistics.median(totals),
            "cache_s_all": totals,
            # What the caches did (the same every run): a replay's stages restore as much.
            "hits": done[0].hits,
            "restored_tokens": done[0].restored_tokens,
            "records": done[0].records,
            "config": config.as_dict(),
        }
        # Once more without the cyclic garbage collector: its share of the figure (its full
        # collections walk every resident entry, each an object of its own).
        collecting = gc.isenabled()
        gc.collect()
        gc.disable()
        try:
            without_gc = run_once(requests, config)
        finally:
            if collecting:
                gc.enable()
        row["us_per_stage_request_gc_off"] = (
            (without_gc.restore_s + without_gc.record_s) / stage_requests * 1e6
            if stage_requests
            else 0.0
        )
        if args.profile:
            profiler = cProfile.Profile()
            run_once(requests, config, profiler=profiler)
            row["profile"], profiles[index] = profile_rows(profiler, args.profile_top)
        results[index] = row
    peak = _peak_rss_bytes()
    goals = [
        {
            "name": f"{index}: cache work per stage and request (us)",
            "target": f"<= {GOAL_US[index]:g}",
            "measured": round(results[index]["us_per_stage_request"], 1),
            "met": results[index]["us_per_stage_request"] <= GOAL_US[index],
        }
        for index in indexes
    ]
    out: dict[str, object] = {
        "benchmark": NAME,
        "trace": str(trace_path),
        "requests": len(requests),
        "prompt_tokens": tokens,
        "stages": args.stages,
        "repeat": args.repeat,
        "us_per_stage_request": {
            index: results[index]["us_per_stage_request"] for index in indexes
        },
        "indexes": results,
        "timed": "restore + record calls of StageCache (time.perf_counter around each)",
        "peak_rss_bytes": peak,
        "goals": goals,
        "machine": _machine(),
    }
    print(
        f"cache work alone on {trace_path}: {len(requests):,} requests, {tokens:,} prompt "
        f"tokens, {args.stages} stages, median of {args.repeat}"
    )
    print(
        f"  {'index':<8} {'us/stage-request':>17} {'restore':>9} {'record':>9} "
        f"{'goal':>7} {'hits (stage 0)':>15} {'restored tokens (stage 0)':>26} "
        f"{'without gc (one run)':>21}"
    )
    for index in indexes:
        row = results[index]
        print(
            f"  {index:<8} {row['us_per_stage_request']:>17.1f} "
            f"{row['restore_us_per_stage_request']:>9.1f} "
            f"{row['record_us_per_stage_request']:>9.1f} {'<= ' + format(GOAL_US[index], 'g'):>7} "
            f"{row['hits'][0]:>15,} {row['restored_tokens'][0]:>26,} "
            f"{row['us_per_stage_request_gc_off']:>21.1f}"
        )
    print(f"  peak RSS {peak / 2**20:,.0f} MiB")
    for index, table in profiles.items():
        print(f"\ncProfile of the {index} index's restore and record calls (one run):")
        print(table.rstrip())
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2) + "\n", encoding="utf-8")
    return out


if __name__ == "__main__":
    main()
