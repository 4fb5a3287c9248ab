"""Fanned-out replays: every stage (and capacity) a unit in another process, results identical.

Worker processes cannot share a virtual clock, and need not: these tests pin that what the
units return, summarised by the driver, is exactly what one process replaying the whole
pipeline reports (every figure but the wall time), on the bundled excerpt and on hand traces.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import importlib.resources
import json
import os
import pickle
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, ParamSpec, TypeVar

import pytest
import trio

from stage_runtime import ConfigError
from stage_runtime.cli import main
from stage_runtime.data import demo_trace
from stage_runtime.sim import (
    CostModel,
    ReplayResult,
    SimConfig,
    SimRequest,
    fan_out,
    open_executor,
    read_demo_trace,
    replay_stage,
    replay_stages,
    result_to_json,
    run_replay,
    run_sweep,
    stage_groups,
)
from tests.stage_runtime.sim.conftest import QUIET

_P = ParamSpec("_P")
_T = TypeVar("_T")

EXCERPT = read_demo_trace().requests
"""The bundled 300-request excerpt of the Mooncake trace."""


def _request(index: int, ids: list[int], length: int, arrival_s: float = 0.0) -> SimRequest:
    return SimRequest(index=index, arrival_s=arrival_s, input_length=length, block_ids=tuple(ids))


# The hand-worked trace of test_replay.py: every stage restores 0, 32, 0 and 16 tokens.
HAND_TRACE = [
    _request(0, [1, 2, 3], 40),
    _request(1, [1, 2, 4], 40),
    _request(2, [1, 5], 20),
    _request(3, [1, 5, 6], 48),
]
SMALL = SimConfig(
    stages=2,
    block_size=16,
    bytes_per_token=2,
    cost=CostModel(prefill_s_per_token=1e-3, restore_s_per_byte=1e-4),
)


class Inline(concurrent.futures.Executor):
    """Runs each unit at once, in this process, and keeps the arguments it was given."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def submit(
        self, fn: Callable[_P, _T], /, *args: _P.args, **kwargs: _P.kwargs
    ) -> concurrent.futures.Future[_T]:
        self.calls.append(args)
        future: concurrent.futures.Future[_T] = concurrent.futures.Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except Exception as exc:
            future.set_exception(exc)
        return future


def _documents(results: Sequence[ReplayResult]) -> list[dict[str, object]]:
    """The results' JSON, without the two keys that measure real time."""
    documents = [result_to_json(result) for result in results]
    for document in documents:
        del document["wall_s"], document["tokens_per_s"]
    return documents


def _same(one: Sequence[ReplayResult], fanned: Sequence[ReplayResult]) -> None:
    assert _documents(fanned) == _documents(one)
    # Beyond the JSON's percentiles: every request's restored tokens and times, to the bit.
    assert [result.outcomes for result in fanned] == [result.outcomes for result in one]


def test_replay_stage_replays_one_stage_as_the_pipeline_does() -> None:
    """A unit runs one stage alone, fed in admission order: the hand-worked trace restores 0,
    32, 0 and 16 tokens at either stage, with the pipeline's counters and accounting; its
    result pickles (it comes back from another process)."""
    pipeline = run_replay(HAND_TRACE, SMALL)
    for index in range(SMALL.stages):
        alone = replay_stage(HAND_TRACE, SMALL, index)
        assert alone.stage_id == f"stage-{index}"
        assert alone.restored_tokens == (0, 32, 0, 16)
        assert alone.computed_tokens == (40, 8, 20, 32)
        summary = pipeline.stages[index]
        assert (alone.records, alone.evictions, alone.resident_bytes_max) == (8, 0, 456)
        assert alone.resident_bytes_max == summary.resident_bytes_max
        assert alone.accounting is not None
        assert alone.accounting == summary.accounting
        assert pickle.loads(pickle.dumps(alone)) == alone


def test_replay_stage_refuses_a_stage_the_pipeline_does_not_have() -> None:
    """stage_index must name a stage of the configuration; the capacity must fit a cache."""
    with pytest.raises(ConfigError, match=r"stage_index must be an integer in \[0, 1\], got 2"):
        replay_stage(HAND_TRACE, SMALL, 2)
    with pytest.raises(ConfigError, match="capacity_tokens must be an integer >= 0, got -1"):
        replay_stage(HAND_TRACE, SMALL, 0, -1)


@pytest.mark.parametrize("concurrency", [1, 8])
@pytest.mark.parametrize("index", ["ladder", "paged"])
def test_a_fanned_out_sweep_of_the_excerpt_equals_the_one_process_sweep(
    concurrency: int, index: str, process_pool: concurrent.futures.Executor
) -> None:
    """On the bundled excerpt, one capacity that evicts and one unbounded, in two worker
    processes: the same JSON as one process, and the same restores and times per request."""
    config = SimConfig(concurrency=concurrency, index=index, max_entries=512)
    capacities = [100_000, 0]
    one = run_sweep(EXCERPT, config, capacities)
    fanned = fan_out(EXCERPT, config, capacities, process_pool, log_setup=QUIET)
    _same(one, fanned)
    assert one[0].stages[0].evictions > 0  # the bounded replay did evict


@pytest.mark.parametrize("index", ["ladder", "paged"])
def test_a_thread_pool_fans_out_to_the_one_process_results(
    index: str,
) -> None:
    """Units in threads of this process (trio runs at once, sharing the module's memos of
    recent grids and segments) report what one process does, switching threads as often as
    they can."""
    config = SimConfig(index=index, stages=2, max_entries=512)
    capacities = [100_000, 0]
    requests = EXCERPT[:120]
    expected = run_sweep(requests, config, capacities)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        with concurrent.futures.ThreadPoolExecutor(max_workers=4) as pool:
            fanned = fan_out(requests, config, capacities, pool, parallelism=4)
    finally:
        sys.setswitchinterval(interval)
    _same(expected, fanned)


def test_requests_arriving_together_fan_out_in_file_order() -> None:
    """Ties of arrival go in file order in the units as in the pipeline: each prompt extends
    the previous one, so any other order would restore something else."""
    trace = [_request(i, list(range(1, i + 2)), 16 * (i + 1)) for i in range(40)]
    config = SimConfig(stages=2, block_size=16, bytes_per_token=2, concurrency=40)
    fanned = run_replay(trace, config, executor=Inline())
    _same([run_replay(trace, config)], [fanned])
    assert [o.restored_tokens for o in fanned.outcomes] == [(16 * i, 16 * i) for i in range(40)]


def test_run_replay_and_run_sweep_take_an_executor() -> None:
    """With an executor of unknown width, run_replay and run_sweep fan out (each stage and
    capacity a unit, sharing one request list) and report what they report in one process."""
    executor = Inline()
    _same([run_replay(HAND_TRACE, SMALL)], [run_replay(HAND_TRACE, SMALL, executor=executor)])
    assert [call[2:4] for call in executor.calls] == [((0,), 0), ((1,), 0)]
    executor = Inline()
    sweep = run_sweep(HAND_TRACE, SMALL, [32, 0], executor=executor)
    _same(run_sweep(HAND_TRACE, SMALL, [32, 0]), sweep)
    # The smallest caches first (they evict most: their units take longest), unbounded last.
    expected = [((0,), 32), ((1,), 32), ((0,), 0), ((1,), 0)]
    assert [call[2:4] for call in executor.calls] == expected
    assert len({id(call[0]) for call in executor.calls}) == 1  # Ray ships it once


@pytest.mark.parametrize("index", ["ladder", "paged"])
def test_a_unit_of_several_stages_replays_each_as_a_unit_of_one(index: str) -> None:
    """Stages replayed side by side in one unit, sharing each request's tokens, return what
    each returns alone: on the excerpt, with a capacity that evicts, every stage, any order."""
    config = SimConfig(stages=3, index=index, max_entries=512, capacity_tokens=100_000)
    requests = EXCERPT[:150]
    alone = [replay_stage(requests, config, stage) for stage in range(3)]
    assert replay_stages(requests, config, (0, 1, 2)) == alone
    assert replay_stages(requests, config, (2, 0)) == [alone[2], alone[0]]
    assert sum(replayed.evictions for replayed in alone) > 0
    for bad in ((), (0, 0)):
        with pytest.raises(ConfigError, match="stage_indices must name distinct stages"):
            replay_stages(requests, config, bad)
    with pytest.raises(ConfigError, match="stage_index must be"):
        replay_stages(requests, config, (0, 3))


def test_a_request_failing_in_a_unit_fails_the_unit_with_its_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A stage that fails a request (here its model, on the n-th request of stage 2) ends the
    whole unit with that error: not a hang, a short tally, or the feeder's BrokenResourceError
    from the inbox the failed stage closed (stage 0 yields in its model, as a real one would,
    which lets the feeder be woken just before the failure); the unit runs again once fixed."""
    from stage_runtime.sim.model import SimulatedStageModel

    forward = SimulatedStageModel.forward
    calls = {"stage-2": 0, "fail at": 0}

    async def failing(self: SimulatedStageModel, inputs: Any, start: int, restored: Any) -> Any:
        if self.stage_index == 0:
            await trio.lowlevel.checkpoint()
        if self.stage_index == 2:
            calls["stage-2"] += 1
            if calls["stage-2"] == calls["fail at"]:
                msg = f"stage 2 broke on its request {calls['fail at']}"
                raise ValueError(msg)
        return await forward(self, inputs, start, restored)

    config = SimConfig(stages=4, index="ladder")
    requests = EXCERPT[:60]
    expected = replay_stages(requests, config, (0, 1, 2, 3))
    monkeypatch.setattr(SimulatedStageModel, "forward", failing)
    for fail_at in range(2, 30):
        calls.update({"stage-2": 0, "fail at": fail_at})
        with pytest.raises(ValueError, match=f"stage 2 broke on its request {fail_at}$"):
            replay_stages(requests, config, (0, 1, 2, 3))
    monkeypatch.undo()
    assert replay_stages(requests, config, (0, 1, 2, 3)) == expected


@pytest.mark.parametrize(
    ("stages", "replays", "parallelism", "groups"),
    [
        (4, 4, 2, [(0, 1, 2, 3)]),  # a unit per replay: two rounds of two
        (4, 1, 2, [(0, 1), (2, 3)]),  # one replay: a unit per process
        (4, 3, 2, [(0, 1), (2, 3)]),  # three units of four stages would leave a process idle
        (4, 5, 4, [(0,), (1,), (2,), (3,)]),
        (4, 1, 8, [(0,), (1,), (2,), (3,)]),  # never more units than stages
        (3, 1, 2, [(0, 1), (2,)]),
        (4, 2, None, [(0,), (1,), (2,), (3,)]),  # width unknown: one unit per stage
        (1, 4, 2, [(0,)]),
    ],
)
def test_stage_groups_weigh_shared_work_against_idle_processes(
    stages: int, replays: int, parallelism: int | None, groups: list[tuple[int, ...]]
) -> None:
    """The units of a replay: the count that finishes soonest by the estimate, each a run of
    consecutive stages, together every stage once."""
    assert stage_groups(stages, replays, parallelism) == groups


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ((0, 1, 2), "stages must be an integer >= 1, got 0"),  # was min() of an empty range
        ((4, -1, 2), "replays must be an integer >= 0, got -1"),
        ((4, 1, 0), "parallelism must be an integer >= 1, got 0"),  # was a ZeroDivisionError
        ((4, 1, -1), "parallelism must be an integer >= 1, got -1"),  # was a silent answer
        ((4.0, 1, 2), "stages must be an integer >= 1, got 4.0"),
    ],
)
def test_stage_groups_names_an_argument_out_of_range(
    arguments: tuple[object, object, object], message: str
) -> None:
    """stage_groups refuses counts that are not counts, naming the argument and its value."""
    with pytest.raises(ConfigError, match=message):
        stage_groups(*arguments)  # type: ignore[arg-type]


def test_a_known_parallelism_groups_the_stages_with_the_same_results() -> None:
    """Given the executor's width (or from a standard pool), a sweep of two capacities on one
    process runs one unit per capacity, every stage in it, and reports what one process does."""
    executor = Inline()
    results = fan_out(HAND_TRACE, SMALL, [32, 0], executor, parallelism=1)
    _same(run_sweep(HAND_TRACE, SMALL, [32, 0]), results)
    assert [call[2:4] for call in executor.calls] == [((0, 1), 32), ((0, 1), 0)]
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        _same(run_sweep(HAND_TRACE, SMALL, [32, 0]), fan_out(HAND_TRACE, SMALL, [32, 0], pool))
    for bad in (0, True, 1.5):
        with pytest.raises(ConfigError, match="parallelism must be None or an integer >= 1"):
            fan_out(HAND_TRACE, SMALL, [0], Inline(), parallelism=bad)  # type: ignore[arg-type]


def test_progress_advances_as_units_finish() -> None:
    """Each finished unit adds its share of its replay's requests: a stage of two counts half."""
    counts: list[int] = []
    fan_out(HAND_TRACE, SMALL, [32, 0], Inline(), progress=counts.append)
    assert counts == [2, 4, 6, 8]  # 2 capacities x 4 requests, in 4 units


def test_max_in_flight_bounds_the_units_submitted_at_once() -> None:
    """Units wait for a free slot; a bound below one is refused before any work."""

    class Counting(Inline):
        def __init__(self) -> None:
            super().__init__()
            self.held: list[concurrent.futures.Future[Any]] = []

        def submit(
            self, fn: Callable[_P, _T], /, *args: _P.args, **kwargs: _P.kwargs
        ) -> concurrent.futures.Future[_T]:
            # Settled only when the next unit is submitted: at most one pending at a time
            # means the bound held.
            assert all(future.done() for future in self.held)
            future = super().submit(fn, *args, **kwargs)
            self.held.append(future)
            return future

    results = fan_out(HAND_TRACE, SMALL, [32, 0], Counting(), max_in_flight=1)
    _same(run_sweep(HAND_TRACE, SMALL, [32, 0]), results)
    for bad in (0, True, 1.5):
        with pytest.raises(ConfigError, match="max_in_flight must be None or an integer >= 1"):
            fan_out(HAND_TRACE, SMALL, [0], Inline(), max_in_flight=bad)  # type: ignore[arg-type]


def test_a_failing_unit_fails_the_fan_out_and_cancels_the_rest() -> None:
    """A unit's error reaches the caller as it was raised; units not yet run are cancelled."""

    class FailingFirst(Inline):
        def __init__(self) -> None:
            super().__init__()
            self.futures: list[concurrent.futures.Future[Any]] = []

        def submit(
            self, fn: Callable[_P, _T], /, *args: _P.args, **kwargs: _P.kwargs
        ) -> concurrent.futures.Future[_T]:
            future: concurrent.futures.Future[_T] = concurrent.futures.Future()
            if not self.futures:
                future.set_exception(RuntimeError("worker lost"))
            self.futures.append(future)
            return future

    executor = FailingFirst()
    with pytest.raises(RuntimeError, match="worker lost"):
        fan_out(HAND_TRACE, SMALL, [32, 0], executor)
    assert len(executor.futures) == 4
    assert all(future.cancelled() for future in executor.futures[1:])


def test_open_executor_gives_this_process_a_pool_or_refuses() -> None:
    """One worker is this process (None); more, a spawn pool of that many; nonsense refused."""
    with open_executor() as executor:
        assert executor is None
    with open_executor(workers=3) as executor:
        assert isinstance(executor, concurrent.futures.ProcessPoolExecutor)
        assert vars(executor)["_max_workers"] == 3
        context = executor._mp_context
        assert context is not None
        assert context.get_start_method() == "spawn"  # never fork a process running trio
    for bad in (0, -1, 1.5, True):
        with (
            pytest.raises(ConfigError, match="workers must be an integer >= 1, got "),
            open_executor(workers=bad),  # type: ignore[arg-type]
        ):
            pass
    with (
        pytest.raises(ConfigError, match="placement must be None, a LocalPlacement or a Ray"),
        open_executor(placement="ray"),  # type: ignore[arg-type]
    ):
        pass


def _cli_json(tmp_path: Path, name: str, *flags: str) -> list[dict[str, object]]:
    """Replay the first 120 requests of the excerpt through the command line (a sweep of two
    capacities at concurrency 4); its JSON without the two keys that measure real time."""
    out = tmp_path / f"{name}.json"
    with importlib.resources.as_file(demo_trace()) as path:
        argv = ["replay", str(path), "--limit-requests", "120", "--concurrency", "4"]
        argv += ["--sweep-capacity", "100000,0", "--json", str(out), *flags]
        assert main(argv) == 0
    documents: list[dict[str, object]] = json.loads(out.read_text(encoding="utf-8"))
    for document in documents:
        del document["wall_s"], document["tokens_per_s"]
    return documents


def test_replay_with_two_workers_writes_the_one_process_json(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`replay --workers 2` writes, key for key, the JSON one process writes; on a terminal
    its progress bar says where the units run and reaches every request of both replays."""
    one = _cli_json(tmp_path, "one")
    capsys.readouterr()
    monkeypatch.setenv("TTY_COMPATIBLE", "1")  # rich's switch for "this is a terminal"
    assert _cli_json(tmp_path, "workers", "--workers", "2") == one
    assert len(one) == 2
    bar = capsys.readouterr().err
    assert "replaying in 2 processes" in bar
    assert "240/240" in bar  # 2 capacities x 120 requests


def test_replay_on_ray_writes_the_one_process_json(tmp_path: Path, local_ray: None) -> None:
    """`replay --placement ray` runs the units as Ray tasks and writes the one-process JSON."""
    one = _cli_json(tmp_path, "one")
    assert _cli_json(tmp_path, "ray", "--placement", "ray") == one
    assert _cli_json(tmp_path, "ray-1", "--placement", "ray", "--workers", "1") == one


def _stat(pid: int | str) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` after the command name (state, parent pid, ...), or
    None for a process that is gone."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as stat:
            return stat.read().rsplit(")", 1)[1].split()
    except OSError:
        return None


def _children(pid: int) -> list[int]:
    """The live (not zombie) processes whose parent is ``pid``."""
    found = []
    for entry in os.listdir("/proc"):
        fields = _stat(entry) if entry.isdigit() else None
        if fields is not None and fields[0] != "Z" and int(fields[1]) == pid:
            found.append(int(entry))
    return found


def _alive(pids: Sequence[int]) -> list[int]:
    """Those of ``pids`` still running (not gone, not zombies)."""
    return [pid for pid in pids if (fields := _stat(pid)) is not None and fields[0] != "Z"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_a_signal_to_a_fanned_out_command_leaves_no_worker_behind(
    tmp_path: Path, signum: signal.Signals
) -> None:
    """A supervisor that stops ``simulate --workers 2`` by its pid alone: SIGTERM stops the
    units and exits 143 saying so (it left both workers replaying, then blocked for ever);
    SIGKILL, which no handler sees, still ends the workers (they watch their parent)."""
    command = [sys.executable, "-m", "stage_runtime", "simulate", "--workers", "2", "-v"]
    # Units of 20,000 requests: seconds of work each, still running when the signal comes.
    workload = ["--groups", "400", "--prompts-per-group", "50", "--sweep-capacity", "65536,0"]
    log = tmp_path / "stderr.txt"  # a file, not a pipe: orphans holding a pipe open would
    # keep a read of it from ever ending
    with log.open("w") as stderr:
        process = subprocess.Popen(
            [*command, *workload], cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=stderr
        )
    workers: list[int] = []
    try:
        deadline = time.monotonic() + 60
        # A unit's stage has started: the workers are replaying.
        while '"stage_started"' not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.05)  # (waiting for another process: nothing to await)
        workers = _children(process.pid)
        assert len(workers) >= 2  # (the two workers, and multiprocessing's resource tracker)
        process.send_signal(signum)
        status = process.wait(timeout=60)
        if signum == signal.SIGTERM:
            assert status == 143
            # (Searched, not read as the last line: a worker terminated mid-line leaves the
            # rest of the file after a partial log line.)
            assert "stage-runtime simulate: error: terminated\n" in log.read_text()
        else:
            assert status == -signal.SIGKILL
        deadline = time.monotonic() + 30
        while _alive(workers) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _alive(workers) == []
    finally:
        for pid in [*_alive(workers), process.pid]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        process.wait(timeout=60)
