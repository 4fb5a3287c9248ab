"""A replay collects the collector's older generations less often, and gives the thresholds
back however it ends, with replays running in threads too."""

from __future__ import annotations

import concurrent.futures
import gc
import multiprocessing
import multiprocessing.queues
import threading
from collections.abc import Iterator

import pytest

from stage_runtime.sim import SimConfig, SimRequest, replay_stages, run_replay
from stage_runtime.sim._collector import fewer_full_collections

TRACE = [
    SimRequest(index=0, arrival_s=0.0, input_length=40, block_ids=(1, 2, 3)),
    SimRequest(index=1, arrival_s=0.0, input_length=40, block_ids=(1, 2, 4)),
]


@pytest.fixture(autouse=True)
def default_thresholds() -> Iterator[None]:
    saved = gc.get_threshold()
    gc.set_threshold(700, 10, 10)
    yield
    gc.set_threshold(*saved)


def test_the_older_generations_wait_longer_inside_and_come_back_after() -> None:
    with fewer_full_collections():
        assert gc.get_threshold() == (700, 100, 100)
        with fewer_full_collections():
            assert gc.get_threshold() == (700, 100, 100)
        assert gc.get_threshold() == (700, 100, 100)  # the outer block still runs
    assert gc.get_threshold() == (700, 10, 10)


def test_thresholds_already_higher_are_kept() -> None:
    gc.set_threshold(2000, 500, 20)
    with fewer_full_collections():
        assert gc.get_threshold() == (2000, 500, 100)
    assert gc.get_threshold() == (2000, 500, 20)


def test_blocks_ending_out_of_order_in_threads_restore_once_at_the_last() -> None:
    first_in, second_in, first_out = threading.Event(), threading.Event(), threading.Event()
    seen: list[tuple[int, int, int]] = []

    def first() -> None:
        with fewer_full_collections():
            first_in.set()
            second_in.wait(10)
        first_out.set()

    def second() -> None:
        first_in.wait(10)
        with fewer_full_collections():
            second_in.set()
            first_out.wait(10)
            seen.append(gc.get_threshold())  # the first block ended: still raised

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        for future in [pool.submit(first), pool.submit(second)]:
            future.result(timeout=20)
    assert seen == [(700, 100, 100)]
    assert gc.get_threshold() == (700, 10, 10)


def test_replays_raise_them_while_they_run_and_restore_them_even_when_they_fail() -> None:
    seen: list[tuple[int, int, int]] = []

    def progress(done: int) -> None:
        seen.append(gc.get_threshold())

    run_replay(TRACE, SimConfig(stages=2), progress=progress)
    assert seen
    assert set(seen) == {(700, 100, 100)}
    assert gc.get_threshold() == (700, 10, 10)

    def failing(done: int) -> None:
        raise RuntimeError("the caller's callback failed")

    with pytest.RaisesGroup(
        pytest.RaisesExc(RuntimeError, match="callback failed"), flatten_subgroups=True
    ):
        run_replay(TRACE, SimConfig(stages=2), progress=failing)
    assert gc.get_threshold() == (700, 10, 10)
    replays = replay_stages(TRACE, SimConfig(stages=2), [0, 1])
    assert [replay.stage_id for replay in replays] == ["stage-0", "stage-1"]
    assert gc.get_threshold() == (700, 10, 10)


def _report_thresholds(results: multiprocessing.queues.Queue[tuple[int, int, int]]) -> None:
    results.put(gc.get_threshold())
    with fewer_full_collections():  # the child's own guard saves and restores its own
        results.put(gc.get_threshold())
    results.put(gc.get_threshold())


@pytest.mark.skipif(
    "fork" not in multiprocessing.get_all_start_methods(), reason="needs the fork start method"
)
def test_a_child_forked_during_a_replay_starts_with_the_thresholds_from_before() -> None:
    context = multiprocessing.get_context("fork")
    results: multiprocessing.queues.Queue[tuple[int, int, int]] = context.Queue()
    with fewer_full_collections():
        child = context.Process(target=_report_thresholds, args=(results,))
        child.start()
        seen = [results.get(timeout=20) for _ in range(3)]
        child.join(timeout=20)
    assert child.exitcode == 0
    assert seen == [(700, 10, 10), (700, 100, 100), (700, 10, 10)]
