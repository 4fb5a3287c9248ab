"""What HTTP adds per request: ``/v1/prefill`` against the same prompts prefilled in-process.

Two measurements of the same work, on the same pipeline (``examples/topology.toml``: 4 stages,
the reference model at ``--width``), with the same prompts in the same order:

- **in-process**: ``Pipeline.prefill`` called by ``--concurrency`` tasks in this process;
- **HTTP**: ``stage-runtime serve`` in its own process, the same prompts POSTed to
  ``/v1/prefill`` by as many concurrent clients of one ``httpx.AsyncClient``.

Both log JSON at ``--log-level`` (the server's default, ``info``), the in-process run to
``/dev/null`` and the server to a file, so both pay for the same stage logs. The server's CPU
time is read from ``/proc/<pid>/stat`` before and after each run; the in-process run's is this
process's. Goal (issue 21): HTTP, JSON and admission add at most 1 ms of CPU per request over
the in-process prefill, at each concurrency. Throughput (requests/s, wall time) is reported for
both; medians of ``--repeat`` runs, each on a fresh pipeline or server.

The load section is issue 21's probe: ``--load-requests`` POSTs at ``--load-concurrency`` from
an ``httpx.AsyncClient`` with default settings (its 5 s keep-alive expiry, 100 connections, 5 s
timeouts) against a server with default settings; every request that ends without a response
(a reset, a disconnect, a timeout) is lost. Goal: none.

Both run with one BLAS thread (``OPENBLAS_NUM_THREADS=1`` and friends, unless set): the
reference model's products are small, and the threads of a multithreaded BLAS spin between
them, which on a 2-core machine doubled the CPU time of both runs and made their difference
measure the spinning, not HTTP (``blas_threads`` in the JSON says what was set).

Linux only (``/proc``). Usage::

    python benchmarks/bench_http.py
    python benchmarks/bench_http.py --repeat 3 --requests 1000 --json out.json
"""

from __future__ import annotations

import os

# One BLAS thread here and in the server (which inherits the environment), before numpy loads.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

import argparse
import contextlib
import json
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from functools import partial
from importlib.metadata import version
from pathlib import Path
from typing import Final

import httpx
import trio

from stage_runtime._cli_support import LOG_LEVELS, configure_logging, int_at_least, int_between
from stage_runtime.limits import MAX_REFERENCE_WIDTH
from stage_runtime.models import reference_model_factory
from stage_runtime.pipeline import load_topology, open_pipeline

NAME = "http"

BLAS_THREAD_VARIABLES: Final = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
"""Set to 1 at the top of this script unless already set (see the module docstring)."""

BLAS_THREADS: Final = {name: os.environ.get(name) for name in BLAS_THREAD_VARIABLES}
"""Their values when this script was loaded (before numpy), as the runs use them."""

ROOT: Final = Path(__file__).resolve().parents[1]
TOPOLOGY: Final = ROOT / "examples" / "topology.toml"

GOAL_OVERHEAD_CPU_MS: Final = 1.0
"""The issue's goal: server CPU per request minus in-process CPU per request, in ms."""

START_TIMEOUT_S: Final = 60.0
"""How long the server may take to start listening."""

STOP_TIMEOUT_S: Final = 30.0
"""How long the server may take to drain and exit after SIGTERM before it is killed."""

RUN_TIMEOUT_S: Final = 600.0
"""Bound on any one measured run."""


def _machine() -> dict[str, str]:
    names = ("numpy", "trio", "httpx", "hypercorn", "structlog")
    return {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "python": platform.python_version(),
        "cpus": str(os.cpu_count()),
        **{name: version(name) for name in names},
    }


def process_cpu_s(pid: int) -> float:
    """User plus system CPU time of process ``pid`` so far (``/proc/<pid>/stat``)."""
    stat = Path(f"/proc/{pid}/stat").read_text(encoding="ascii")
    # The command name (field 2) may hold spaces and parentheses: split after its last ")".
    fields = stat.rsplit(")", 1)[1].split()
    utime, stime = int(fields[11]), int(fields[12])  # fields 14 and 15 of proc(5)
    return (utime + stime) / os.sysconf("SC_CLK_TCK")


def prompts(count: int, length: int, *, offset: int) -> list[list[int]]:
    """``count`` prompts of ``length`` tokens that share no prefix (each its own first token),
    so every stage computes every token of each: the same work in-process and over HTTP."""
    return [[offset + i, *range(1, length)] for i in range(count)]


async def _run_concurrently(
    items: list[list[int]], concurrency: int, call: Callable[[list[int]], Awaitable[None]]
) -> float:
    """Call ``call`` on every item from ``concurrency`` workers; returns the wall time."""
    send, receive = trio.open_memory_channel[list[int]](len(items))
    for item in items:
        send.send_nowait(item)
    send.close()

    async def worker() -> None:
        async for item in receive:
            await call(item)

    started = time.perf_counter()
    with trio.fail_after(RUN_TIMEOUT_S):
        async with trio.open_nursery() as nursery:
            for _ in range(concurrency):
                nursery.start_soon(worker)
    return time.perf_counter() - started


@contextlib.contextmanager
def _logging_to_devnull(level: str) -> Iterator[None]:
    """The server's log configuration (JSON at ``level``), written to ``/dev/null``."""
    with open(os.devnull, "w", encoding="utf-8") as devnull:
        saved, sys.stderr = sys.stderr, devnull
        try:
            configure_logging(level=level, log_format="json")
        finally:
            sys.stderr = saved
        yield


async def in_process(
    phases: list[tuple[int, list[list[int]]]], *, warmup: list[list[int]], width: int
) -> list[tuple[float, float]]:
    """Each phase's (wall s, CPU s) of prefilling its prompts in-process, on one pipeline."""
    results = []
    factory = reference_model_factory(width=width, seed=0)
    async with open_pipeline(load_topology(TOPOLOGY), factory) as pipeline:

        async def prefill(tokens: list[int]) -> None:
            await pipeline.prefill(tokens, session_id="bench")

        await _run_concurrently(warmup, 1, prefill)
        for concurrency, items in phases:
            cpu = time.process_time()
            wall = await _run_concurrently(items, concurrency, prefill)
            results.append((wall, time.process_time() - cpu))
    return results


@contextlib.asynccontextmanager
async def server_process(
    *options: str, log_level: str, width: int
) -> AsyncIterator[tuple[str, int]]:
    """``stage-runtime serve`` on the example topology, on a free port; yields (url, pid).

    Stopped with SIGTERM on the way out (killed if it does not exit in time)."""
    with tempfile.TemporaryDirectory(prefix="bench-http-") as scratch:
        log_path = Path(scratch) / "server.log"
        argv = [
            sys.executable,
            "-m",
            "stage_runtime",
            "serve",
            "--topology",
            str(TOPOLOGY),
            "--bind",
            "127.0.0.1:0",
            "--width",
            str(width),
            "--log-level",
            log_level,
            "--log-format",
            "json",
            *options,
        ]
        with log_path.open("wb") as log_file:
            process = await trio.lowlevel.open_process(
                argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log_file
            )
        try:
            url = await _wait_for_url(log_path, process)
            yield url, process.pid
        finally:
            if process.returncode is None:
                process.send_signal(signal.SIGTERM)
                with trio.move_on_after(STOP_TIMEOUT_S):
                    await process.wait()
                if process.returncode is None:
                    process.kill()
                    await process.wait()


def _read_log(path: Path) -> str:
    """The server's log so far (a small local file: read synchronously)."""
    return path.read_text(encoding="utf-8", errors="replace")


async def _wait_for_url(log_path: Path, process: trio.Process) -> str:
    """The URL of the ``server_started`` event in the server's JSON log."""
    with trio.fail_after(START_TIMEOUT_S):
        while True:
            for line in _read_log(log_path).splitlines():
                if line.startswith("{"):
                    event = json.loads(line)
                    if event.get("event") == "server_started":
                        return str(event["url"])
            if process.poll() is not None:
                tail = _read_log(log_path)[-500:]
                msg = f"the server exited with {process.returncode} before listening: {tail}"
                raise RuntimeError(msg)
            await trio.sleep(0.05)


async def over_http(
    phases: list[tuple[int, list[list[int]]]],
    *,
    warmup: list[list[int]],
    width: int,
    log_level: str,
) -> list[tuple[float, float]]:
    """Each phase's (wall s, server CPU s) of POSTing its prompts to one fresh server."""
    results = []
    async with server_process(log_level=log_level, width=width) as (url, pid):
        limits = httpx.Limits(max_connections=max(c for c, _ in phases))
        async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as client:

            async def post(tokens: list[int]) -> None:
                answer = await client.post(
                    "/v1/prefill", json={"tokens": tokens, "session_id": "bench"}
                )
                if answer.status_code != 200:
                    msg = f"the server answered {answer.status_code}: {answer.text[:200]}"
                    raise RuntimeError(msg)

            await _run_concurrently(warmup, 1, post)
            for concurrency, items in phases:
                cpu = process_cpu_s(pid)
                wall = await _run_concurrently(items, concurrency, post)
                results.append((wall, process_cpu_s(pid) - cpu))
    return results


async def load_run(
    count: int, concurrency: int, *, length: int, width: int, log_level: str
) -> dict[str, object]:
    """Issue 21's probe: ``count`` POSTs at ``concurrency`` from a default ``httpx`` client."""
    statuses: Counter[str] = Counter()
    lost: Counter[str] = Counter()
    async with (
        server_process(log_level=log_level, width=width) as (url, _),
        httpx.AsyncClient(base_url=url) as client,  # default settings, as the probe used
    ):

        async def post(tokens: list[int]) -> None:
            try:
                answer = await client.post(
                    "/v1/prefill", json={"tokens": tokens, "session_id": "load"}
                )
            except httpx.HTTPError as exc:
                lost[f"{type(exc).__name__}: {str(exc)[:80]}"] += 1
            else:
                statuses[str(answer.status_code)] += 1

        wall = await _run_concurrently(prompts(count, length, offset=10_000_000), concurrency, post)
    return {
        "requests": count,
        "concurrency": concurrency,
        "wall_s": wall,
        "answered_by_status": dict(sorted(statuses.items())),
        "lost": sum(lost.values()),
        "lost_by_error": dict(lost.most_common()),
    }


def main(argv: list[str] | None = None) -> dict[str, object]:
    """Run the benchmark; print a table, write JSON and return the results."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--requests", type=int_at_least(1), default=500, help="prompts per concurrency"
    )
    parser.add_argument(
        "--concurrency",
        type=int_at_least(1),
        nargs="+",
        default=[1, 32],
        help="concurrent callers, one run each (default: 1 32)",
    )
    parser.add_argument("--tokens", type=int_at_least(1), default=128, help="prompt length")
    parser.add_argument(
        "--width", type=int_between(1, MAX_REFERENCE_WIDTH), default=64, help="model width"
    )
    parser.add_argument(
        "--repeat", type=int_at_least(1), default=3, help="repetitions (median reported)"
    )
    parser.add_argument("--log-level", choices=LOG_LEVELS, default="info")
    parser.add_argument("--load-requests", type=int_at_least(0), default=2000)
    parser.add_argument("--load-concurrency", type=int_at_least(1), default=200)
    parser.add_argument("--json", default=f"benchmarks/out/{NAME}.json")
    args = parser.parse_args(argv)
    if not Path("/proc/self/stat").exists():
        parser.error("the server's CPU time is read from /proc: Linux only")

    level = args.log_level
    with _logging_to_devnull(level):
        warmup = prompts(20, args.tokens, offset=20_000_000)
        phases = [
            (concurrency, prompts(args.requests, args.tokens, offset=i * args.requests))
            for i, concurrency in enumerate(args.concurrency)
        ]
        local_runs, http_runs = [], []
        for _ in range(args.repeat):
            local_runs.append(
                trio.run(partial(in_process, phases, warmup=warmup, width=args.width))
            )
            http_runs.append(
                trio.run(
                    partial(over_http, phases, warmup=warmup, width=args.width, log_level=level)
                )
            )
        load = None
        if args.load_requests:
            load = trio.run(
                partial(
                    load_run,
                    args.load_requests,
                    args.load_concurrency,
                    length=args.tokens,
                    width=args.width,
                    log_level=level,
                )
            )

    rows: list[dict[str, object]] = []
    goals: list[dict[str, object]] = []
    for index, (concurrency, _) in enumerate(phases):
        local_wall = statistics.median(run[index][0] for run in local_runs)
        local_cpu = statistics.median(run[index][1] for run in local_runs)
        http_wall = statistics.median(run[index][0] for run in http_runs)
        http_cpu = statistics.median(run[index][1] for run in http_runs)
        overhead_ms = (http_cpu - local_cpu) / args.requests * 1e3
        rows.append(
            {
                "concurrency": concurrency,
                "in_process_requests_per_s": args.requests / local_wall,
                "in_process_cpu_ms_per_request": local_cpu / args.requests * 1e3,
                "http_requests_per_s": args.requests / http_wall,
                "server_cpu_ms_per_request": http_cpu / args.requests * 1e3,
                "http_cpu_overhead_ms_per_request": overhead_ms,
                "in_process_wall_s_all": [run[index][0] for run in local_runs],
                "in_process_cpu_s_all": [run[index][1] for run in local_runs],
                "http_wall_s_all": [run[index][0] for run in http_runs],
                "server_cpu_s_all": [run[index][1] for run in http_runs],
            }
        )
        goals.append(
            {
                "name": f"server CPU per request over in-process, concurrency {concurrency} (ms)",
                "target": f"<= {GOAL_OVERHEAD_CPU_MS:g}",
                "measured": round(overhead_ms, 3),
                "met": overhead_ms <= GOAL_OVERHEAD_CPU_MS,
            }
        )
    if load is not None:
        goals.append(
            {
                "name": (
                    f"responses lost, {load['requests']:,} POSTs at concurrency "
                    f"{load['concurrency']} (default httpx client)"
                ),
                "target": "0",
                "measured": load["lost"],
                "met": load["lost"] == 0,
            }
        )
    out: dict[str, object] = {
        "benchmark": NAME,
        "topology": str(TOPOLOGY.relative_to(ROOT)),
        "requests": args.requests,
        "prompt_tokens": args.tokens,
        "width": args.width,
        "repeat": args.repeat,
        "log_level": args.log_level,
        "blas_threads": BLAS_THREADS,
        "runs": rows,
        "load": load,
        "goals": goals,
        "machine": _machine(),
    }
    print(
        f"/v1/prefill against in-process prefill: {args.requests:,} prompts of {args.tokens} "
        f"tokens per run, 4 stages, width {args.width}, logs at {args.log_level}, "
        f"median of {args.repeat}"
    )
    header = ("concurrency", "in-process req/s", "HTTP req/s", "in-proc CPU", "server CPU", "+CPU")
    print("  " + "  ".join(f"{h:>16}" for h in header))
    for row in rows:
        cells = (
            f"{row['concurrency']}",
            f"{row['in_process_requests_per_s']:,.0f}",
            f"{row['http_requests_per_s']:,.0f}",
            f"{row['in_process_cpu_ms_per_request']:.2f} ms",
            f"{row['server_cpu_ms_per_request']:.2f} ms",
            f"{row['http_cpu_overhead_ms_per_request']:.2f} ms",
        )
        print("  " + "  ".join(f"{c:>16}" for c in cells))
    if load is not None:
        print(
            f"load: {load['requests']:,} POSTs at concurrency {load['concurrency']} "
            f"(default httpx client) in {load['wall_s']:.1f} s: answered "
            f"{load['answered_by_status']}, lost {load['lost']} {load['lost_by_error'] or ''}"
        )
    for goal in goals:
        verdict = "MET" if goal["met"] else "MISSED"
        print(f"  goal {goal['name']}: {goal['measured']} ({goal['target']}) {verdict}")
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2) + "\n", encoding="utf-8")
    return out


if __name__ == "__main__":
    main()
