"""Placement: the same pipeline API with stages in this trio run or in Ray actor processes.

Ray tests run on the real clock (virtual time cannot cross processes); every wait on a stage
process is bounded by ``trio.fail_after`` so a regression fails instead of hanging.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import re
import shutil
import signal
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TypeVar

import attrs
import numpy as np
import pytest
import trio
import trio.testing

from actors import RestartPolicy
from actors.testing import LogEvent, capture_actor_logs, events_named
from stage_runtime.config import CacheIndex, StageConfig
from stage_runtime.errors import ConfigError, PipelineStoppedError, StageFailedError
from stage_runtime.llama import llama_model_factory, write_random_llama
from stage_runtime.models import virtual_model_factory
from stage_runtime.pipeline import PrefillResult, load_placement, load_topology, open_pipeline
from stage_runtime.placement import (
    LocalPlacement,
    Placement,
    RayPlacement,
    _installed,
    choose_placement,
)
from tests.stage_runtime.pipeline_helpers import prompt, stage_configs, uncached
from tests.stage_runtime.ray_helpers import (
    FAIL_TOKEN,
    SLOW_LENGTH,
    Failing,
    LogToFile,
    ProbeModels,
)

NO_ENV: dict[str, str] = {}
WAIT_S = 60.0
"""Bound on any wait for stage processes (Ray starts them in a second or two)."""


@pytest.fixture(autouse=True)
def logs() -> Iterator[list[LogEvent]]:
    """Capture the driver's log events (keeps the output quiet; tests inspect them)."""
    with capture_actor_logs() as captured:
        yield captured


@pytest.fixture(params=["local", "ray"])
def placement(request: pytest.FixtureRequest) -> Placement:
    """Each behaviour test runs with local placement and with one Ray process per stage."""
    if request.param == "local":
        return LocalPlacement()
    request.getfixturevalue("ray_cluster")
    return RayPlacement(num_cpus=0.25)


def counts(result: PrefillResult) -> list[tuple[int, int]]:
    return [(report.restored_tokens, report.computed_tokens) for report in result.stages]


STREAM = [prompt(300), prompt(420), prompt(420), prompt(300, start=5), prompt(512)]


async def run_stream(
    placement: Placement, configs: list[StageConfig]
) -> list[tuple[np.ndarray[Any, Any], list[tuple[int, int]]]]:
    out = []
    with trio.fail_after(WAIT_S):
        async with open_pipeline(
            configs, ProbeModels(), environ=NO_ENV, placement=placement
        ) as pipeline:
            for tokens in STREAM:
                result = await pipeline.prefill(tokens, session_id="s")
                out.append((np.array(result.frame.rows()), counts(result)))
    return out


@pytest.mark.parametrize("index", [CacheIndex.LADDER, CacheIndex.PAGED])
async def test_ray_placement_gives_byte_identical_frames_and_counts(
    ray_cluster: Any, index: CacheIndex, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same request stream gives the same bytes and restored/computed counts per stage,
    whether a prompt travels inside each stage's call or, past the by-value bound (lowered
    here to 1,600 bytes: 400 tokens), once through Ray's object store."""
    import ray

    from stage_runtime.placement import ray_stages

    puts: list[int] = []
    put = ray.put

    def counting_put(value: Any) -> Any:
        puts.append(int(value.size))
        return put(value)

    monkeypatch.setattr(ray_stages, "_BY_VALUE_BYTES", 1_600)
    monkeypatch.setattr(ray, "put", counting_put)
    configs = [
        attrs.evolve(c, kv_cache=attrs.evolve(kv, index=index))
        for c in stage_configs(3, max_entries=64)
        if (kv := c.kv_cache) is not None
    ]
    local = await run_stream(LocalPlacement(), configs)
    remote = await run_stream(RayPlacement(num_cpus=0.25), configs)
    assert puts == [420, 420, 512]  # the prompts of 300 tokens went by value
    assert [c for _, c in remote] == [c for _, c in local]
    assert any(restored for _, c in local for restored, _ in c)  # the stream does hit
    for (a, _), (b, _) in zip(local, remote, strict=True):
        assert a.tobytes() == b.tobytes()


class _Gate:
    """A Ray actor whose ``wait`` answers only once ``open`` was called."""

    def __init__(self) -> None:
        import asyncio

        self._open = asyncio.Event()

    async def wait(self) -> str:
        await self._open.wait()
        return "open"

    async def open(self) -> None:
        self._open.set()


async def test_a_ref_is_read_at_once_when_ready_and_awaited_when_not(ray_cluster: Any) -> None:
    """The driver reads the stages' reports without a round trip through each ref's future
    when they are ready (the last one's arrival says they are), and awaits one that is not,
    without blocking the trio run."""
    import ray

    from stage_runtime.placement.ray_stages import _settled, await_ref

    assert await _settled(ray.put(5)) == 5
    gate: Any = ray.remote(_Gate).remote()
    try:
        waiting = gate.wait.remote()
        got: list[str] = []
        with trio.fail_after(WAIT_S):
            async with trio.open_nursery() as nursery:

                async def read() -> None:
                    got.append(await _settled(waiting))

                nursery.start_soon(read)
                await trio.testing.wait_all_tasks_blocked()
                assert got == []  # not ready: awaited, and the run goes on meanwhile
                await await_ref(gate.open.remote())
        assert got == ["open"]
    finally:
        ray.kill(gate)


async def test_cached_output_equals_uncached_output(placement: Placement) -> None:
    """With the cache on, each output equals the output of stages with the cache off."""
    cached = await run_stream(placement, stage_configs(2))
    plain = await run_stream(LocalPlacement(), uncached(stage_configs(2)))
    for (a, _), (b, _) in zip(cached, plain, strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)


async def test_model_error_fails_only_that_caller(placement: Placement) -> None:
    """A model error reaches its caller as itself; the pipeline serves the next prompt. Under
    Ray nothing else is written about it: the failed stage's results are read, so Ray has no
    "Unhandled error" (with its traceback) to write to the driver's stderr."""
    ray_said: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: ray_said.append(record.getMessage())  # type: ignore[method-assign]
    ray_logger = logging.getLogger("ray")
    ray_logger.addHandler(handler)
    try:
        with trio.fail_after(WAIT_S):
            async with open_pipeline(
                stage_configs(3), ProbeModels(), environ=NO_ENV, placement=placement
            ) as pipeline:
                bad = prompt(300)
                bad[3] = FAIL_TOKEN
                with pytest.raises(ValueError, match=f"cannot embed token {FAIL_TOKEN}"):
                    await pipeline.prefill(bad, session_id="s")
                gc.collect()  # (the failed request's refs are gone)
                result = await pipeline.prefill(prompt(300), session_id="s")
                assert counts(result) == [(0, 300), (0, 300), (0, 300)]
                assert pipeline.failure is None
    finally:
        ray_logger.removeHandler(handler)
    assert [said for said in ray_said if "Unhandled error" in said] == []


async def test_bad_tokens_are_refused_before_any_stage(placement: Placement) -> None:
    """Bad tokens are a ConfigError at the caller, with any placement."""
    with trio.fail_after(WAIT_S):
        async with open_pipeline(
            stage_configs(2), ProbeModels(), environ=NO_ENV, placement=placement
        ) as pipeline:
            with pytest.raises(ConfigError, match="int32"):
                await pipeline.prefill([1, 2**40], session_id="s")
            result = await pipeline.prefill(prompt(300), session_id="s")
            assert result.tokens == 300


async def test_stats_and_clear_caches_reach_every_stage(placement: Placement) -> None:
    """Statistics count each stage's records; clearing empties every stage's cache."""
    with trio.fail_after(WAIT_S):
        async with open_pipeline(
            stage_configs(2), ProbeModels(), environ=NO_ENV, placement=placement
        ) as pipeline:
            await pipeline.prefill(prompt(300), session_id="s")
            stats = await pipeline.statistics()
            assert [s.stage_id for s in stats.stages] == ["stage-0", "stage-1"]
            assert all(s.cache is not None and s.cache.entries == 2 for s in stats.stages)
            assert all(s.restarts == 0 for s in stats.stages)
            cleared = await pipeline.clear_caches()
            assert [len(evicted) for evicted in cleared] == [2, 2]
            again = await pipeline.prefill(prompt(300), session_id="s")
            assert counts(again) == [(0, 300), (0, 300)]
        final = await pipeline.statistics()
        assert all(s.cache is not None and s.cache.entries == 2 for s in final.stages)
        with pytest.raises(PipelineStoppedError, match="no cache to clear"):
            await pipeline.clear_caches()


async def test_leaving_the_block_drains_prefills_in_flight(placement: Placement) -> None:
    """Prefills called before the block ends all finish; later ones are refused."""
    results: list[PrefillResult] = []
    with trio.fail_after(WAIT_S):
        async with (
            trio.open_nursery() as nursery,
            open_pipeline(
                stage_configs(3), ProbeModels(), environ=NO_ENV, placement=placement
            ) as pipeline,
        ):

            async def one(n: int) -> None:
                results.append(await pipeline.prefill(prompt(n), session_id="s"))

            for n in range(260, 270):
                nursery.start_soon(one, n)
            await trio.testing.wait_all_tasks_blocked()
    assert sorted(r.tokens for r in results) == list(range(260, 270))
    with pytest.raises(trio.ClosedResourceError):
        await pipeline.prefill(prompt(300), session_id="s")


async def test_stage_processes_name_where_each_stage_runs(placement: Placement) -> None:
    """``stage_processes`` gives each stage's pid and host (another process under Ray)."""
    with trio.fail_after(WAIT_S):
        async with open_pipeline(
            stage_configs(2), ProbeModels(), environ=NO_ENV, placement=placement
        ) as pipeline:
            where = pipeline.stage_processes()
    assert [p.stage_id for p in where] == ["stage-0", "stage-1"]
    if isinstance(placement, LocalPlacement):
        assert {p.pid for p in where} == {os.getpid()}
    else:
        assert len({p.pid for p in where}) == 2
        assert os.getpid() not in {p.pid for p in where}
        assert all(p.node_id for p in where)


# -- Ray only ------------------------------------------------------------------------------------


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


async def test_closing_leaves_no_stage_process(ray_cluster: Any) -> None:
    """After the block, every stage process has exited; the joined Ray instance runs on."""
    import ray

    with trio.fail_after(WAIT_S):
        async with open_pipeline(
            stage_configs(3), ProbeModels(), environ=NO_ENV, placement=RayPlacement(num_cpus=0.25)
        ) as pipeline:
            pids = [p.pid for p in pipeline.stage_processes()]
            await pipeline.prefill(prompt(300), session_id="s")
    assert all(_gone(pid) for pid in pids)
    assert ray.is_initialized()  # a Ray instance the pipeline joined is left running


_OWN_INSTANCE = """
import os, subprocess, sys, threading
import trio
import trio._core._thread_cache as thread_cache
from stage_runtime.pipeline import open_pipeline
from stage_runtime.placement import RayPlacement
from tests.stage_runtime.pipeline_helpers import prompt, stage_configs
from tests.stage_runtime.ray_helpers import ProbeModels

# trio ends an idle worker thread after 10 s; here at once, so that a Ray instance started
# from one (whose processes die with the thread that started them) would be gone below.
thread_cache.IDLE_TIMEOUT = 0.05

def ray_processes():
    found = subprocess.run(["pgrep", "-af", sys.argv[1]], capture_output=True, text=True)
    lines = found.stdout.splitlines()
    return [line[:150] for line in lines if line.split()[0] != str(os.getpid())]

def gcs_state():
    pids = [line.split()[0] for line in ray_processes() if "gcs_server" in line]
    states = [subprocess.run(["ps", "-o", "stat=", "-p", pid], capture_output=True,
                             text=True).stdout.strip() for pid in pids]
    return states

async def main():
    placement = RayPlacement(num_cpus=0.5, init_options={"num_cpus": 2})
    with trio.fail_after(120):
        async with open_pipeline(
            stage_configs(2), ProbeModels(), environ={}, placement=placement
        ) as pipeline:
            await pipeline.prefill(prompt(300), session_id="s")
            while any(t.name.startswith("Trio thread") for t in threading.enumerate()):
                await trio.sleep(0.05)  # until every idle worker thread has ended
            print("gcs alive", [s[:1] for s in gcs_state()] in (["S"], ["R"]))
            owners = [t for t in threading.enumerate() if t.name == "stage-runtime-ray"]
            print("owner alive", len(owners) == 1 and owners[0].is_alive())
            again = await pipeline.prefill(prompt(300), session_id="s")
            print("restored", [r.restored_tokens for r in again.stages])
    owners = [t.name for t in threading.enumerate() if t.name == "stage-runtime-ray"]
    print("owner after close", owners)
    print("ray processes after close", ray_processes())

trio.run(main)
"""


def test_a_pipeline_that_starts_ray_keeps_it_until_it_closes_then_stops_it(
    tmp_path: Path,
) -> None:
    """A pipeline that starts its own Ray instance (in a process not connected to Ray) starts it
    from a thread that lives as long as the instance: the instance outlives the trio worker
    thread that opened the pipeline. Closing stops it: no Ray process is left (every file Ray
    writes is under this test's temporary directory)."""
    pytest.importorskip("ray")
    import subprocess
    import sys

    # (Ray's socket paths under it must stay short: an AF_UNIX path holds 107 bytes.)
    temp = Path(tempfile.mkdtemp(prefix="sr-own-"))
    env = {
        **os.environ,
        "RAY_TMPDIR": str(temp),
        "RAY_AUTH_MODE": "disabled",
        "HOME": str(tmp_path),
        "PYTHONPATH": str(Path(__file__).resolve().parents[2]),
    }
    try:
        done = subprocess.run(
            [sys.executable, "-c", _OWN_INSTANCE, str(temp)],
            capture_output=True,
            text=True,
            env=env,
            timeout=240,
            check=False,
        )
    finally:
        shutil.rmtree(temp, ignore_errors=True)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert "gcs alive True" in lines  # after the thread that opened the pipeline ended
    assert "owner alive True" in lines
    assert "restored [300, 300]" in lines
    assert "owner after close []" in lines
    assert "ray processes after close []" in lines


async def test_unknown_stage_ids_in_resources_are_refused() -> None:
    """Resources for a stage the pipeline does not have are a ConfigError naming it (before
    Ray is started or joined)."""
    placement = RayPlacement(resources={"stage-9": {"GPU": 1}})
    with pytest.raises(ConfigError, match=r"names 'stage-9', not a stage of this pipeline"):
        async with open_pipeline(
            stage_configs(2), ProbeModels(), environ=NO_ENV, placement=placement
        ):
            pytest.fail("the pipeline must not open")


async def test_stages_reserving_no_cpu_still_get_a_placement_group(ray_cluster: Any) -> None:
    """With num_cpus=0 and a strategy, each stage's bundle holds a sliver of a CPU (a bundle
    cannot be empty) and the pipeline runs."""
    placement = RayPlacement(num_cpus=0, strategy="PACK")
    with trio.fail_after(WAIT_S):
        async with open_pipeline(
            stage_configs(2), ProbeModels(), environ=NO_ENV, placement=placement
        ) as pipeline:
            result = await pipeline.prefill(prompt(300), session_id="s")
    assert counts(result) == [(0, 300), (0, 300)]


async def test_the_cpu_check_counts_the_slivers_of_stages_reserving_none(
    ray_cluster: Any,
) -> None:
    """Two stages take the cluster's 8 CPUs; the third, reserving none, still needs a sliver in
    its bundle: refused at once, not after the placement group's long wait."""
    placement = RayPlacement(num_cpus=4, strategy="PACK", resources={"stage-2": {"CPU": 0}})
    with trio.fail_after(WAIT_S), pytest.raises(ConfigError, match=r"reserve 8\.01 CPUs"):
        async with open_pipeline(
            stage_configs(3), ProbeModels(), environ=NO_ENV, placement=placement
        ):
            pytest.fail("the pipeline must not open")


async def test_a_resource_no_node_has_is_refused_at_once_naming_the_stage(
    ray_cluster: Any,
) -> None:
    """A stage asking for a GPU (or a custom resource) that no node has: Ray would wait for
    such a node for ever, and the pipeline for its start timeout, silently. Refused at once,
    naming the stage, what it asks and what the nodes have; the cluster runs the next
    pipeline."""
    for resources, asked in (
        ({"stage-1": {"GPU": 1}}, "GPU=1"),
        ({"stage-0": {"accelerator": 2}}, "accelerator=2"),
    ):
        placement = RayPlacement(num_cpus=0.5, resources=resources)
        stage = next(iter(resources))
        with trio.fail_after(WAIT_S), pytest.raises(ConfigError) as refused:
            async with open_pipeline(
                stage_configs(2), ProbeModels(), environ=NO_ENV, placement=placement
            ):
                pytest.fail("the pipeline must not open")
        message = str(refused.value)
        assert f"stage {stage!r} asks for {asked} (RayPlacement.resources)" in message
        assert "which no node of the Ray cluster has" in message
    with trio.fail_after(WAIT_S):
        async with open_pipeline(
            stage_configs(2),
            ProbeModels(),
            environ=NO_ENV,
            placement=RayPlacement(num_cpus=0.5),
        ) as pipeline:
            result = await pipeline.prefill(prompt(300), session_id="s")
    assert counts(result) == [(0, 300), (0, 300)]


async def _until_free_cpus_at_most(cpus: float) -> None:
    """Wait until Ray counts at most ``cpus`` CPUs free (it learns of reservations late)."""
    import ray

    while ray.available_resources().get("CPU", 0.0) > cpus + 1e-6:  # type: ignore[no-untyped-call]  # noqa: ASYNC110
        await trio.sleep(0.05)


async def test_the_default_cpu_share_divides_the_cpus_left_free(ray_cluster: Any) -> None:
    """Beside a pipeline holding 6 of the cluster's 8 CPUs, a pipeline's stages share the 2
    left; beside one holding all 8, it is refused at once, saying they are taken."""
    with trio.fail_after(WAIT_S):
        async with open_pipeline(
            stage_configs(3), ProbeModels(), environ=NO_ENV, placement=RayPlacement(num_cpus=2)
        ):
            await _until_free_cpus_at_most(2)
            async with open_pipeline(
                stage_configs(4), ProbeModels(), environ=NO_ENV, placement=RayPlacement()
            ) as second:
                assert second._stages._cpu_share == 0.5  # type: ignore[attr-defined]
                result = await second.prefill(prompt(300), session_id="s")
                assert counts(result) == [(0, 300)] * 4
                await _until_free_cpus_at_most(0)
                with (
                    trio.fail_after(10),
                    pytest.raises(ConfigError, match=r"0 free \(8 of its 8 are taken\)"),
                ):
                    async with open_pipeline(
                        stage_configs(2), ProbeModels(), environ=NO_ENV, placement=RayPlacement()
                    ):
                        pytest.fail("the pipeline must not open")


async def test_stages_spread_over_distinct_nodes(ray_cluster: Any) -> None:
    """A STRICT_SPREAD placement group puts each stage on its own node."""
    placement = RayPlacement(num_cpus=0.5, strategy="STRICT_SPREAD")
    with trio.fail_after(WAIT_S):
        async with open_pipeline(
            stage_configs(2), ProbeModels(), environ=NO_ENV, placement=placement
        ) as pipeline:
            result = await pipeline.prefill(prompt(300), session_id="s")
            nodes = {p.node_id for p in pipeline.stage_processes()}
    assert len(nodes) == 2
    assert counts(result) == [(0, 300), (0, 300)]


async def test_per_stage_resources_pin_a_stage_to_a_node(ray_cluster: Any) -> None:
    """A stage asking for a custom resource runs on the node that has it."""
    import ray

    nodes = ray.nodes()  # type: ignore[no-untyped-call]
    node_b = next(n["NodeID"] for n in nodes if n["Resources"].get("node-b"))
    placement = RayPlacement(num_cpus=0.25, resources={"stage-1": {"node-b": 0.5}})
    with trio.fail_after(WAIT_S):
        async with open_pipeline(
            stage_configs(2), ProbeModels(), environ=NO_ENV, placement=placement
        ) as pipeline:
            where = pipeline.stage_processes()
    assert where[1].node_id == node_b


async def test_virtual_frames_cross_processes_without_memory(ray_cluster: Any) -> None:
    """A 100K-token virtual frame goes stage to stage as a descriptor, and arrives virtual."""
    configs = [attrs.evolve(c, ctx_size=262_144) for c in stage_configs(2)]
    factory = virtual_model_factory(width=4096)
    with trio.fail_after(WAIT_S):
        async with open_pipeline(
            configs, factory, environ=NO_ENV, placement=RayPlacement(num_cpus=0.25)
        ) as pipeline:
            result = await pipeline.prefill(prompt(100_000), session_id="s")
    assert result.frame.is_virtual
    assert result.frame.payload_bytes == 100_000 * 4096 * 4


async def test_sigkill_fails_prefills_in_flight_and_stops_the_pipeline(
    ray_cluster: Any,
) -> None:
    """A killed stage process fails the prefill in flight on it with StageFailedError naming
    the stage within 10 s; without a restart policy the pipeline then stops."""
    errors: list[BaseException] = []
    configs = stage_configs(2)
    placement = RayPlacement(num_cpus=0.25)
    with pytest.RaisesGroup(
        pytest.RaisesExc(StageFailedError, match="stage 'stage-1' failed: its process died"),
        flatten_subgroups=True,
    ):
        async with open_pipeline(
            configs, ProbeModels(slow_stage=1), environ=NO_ENV, placement=placement
        ) as pipeline:

            async def slow() -> None:
                try:
                    await pipeline.prefill(prompt(SLOW_LENGTH), session_id="s")
                except StageFailedError as exc:
                    errors.append(exc)

            with trio.fail_after(WAIT_S):
                await pipeline.prefill(prompt(300), session_id="s")
            victim = pipeline.stage_processes()[1].pid
            async with trio.open_nursery() as nursery:
                nursery.start_soon(slow)
                await trio.testing.wait_all_tasks_blocked()
                os.kill(victim, signal.SIGKILL)
                with trio.fail_after(10):
                    await trio.sleep_forever()  # until the pipeline stops and cancels this
    assert len(errors) == 1
    assert errors[0].stage_id == "stage-1"  # type: ignore[attr-defined]
    assert pipeline.failure is not None
    assert "stage-1" in pipeline.failure
    with pytest.raises(PipelineStoppedError):
        await pipeline.prefill(prompt(300), session_id="s")
    with pytest.raises(PipelineStoppedError, match="stage-1"):
        await pipeline.statistics()
    with pytest.raises(PipelineStoppedError, match="no cache to clear"):
        await pipeline.clear_caches()
    assert _gone(victim)


async def test_sigkill_under_a_restart_policy_recreates_the_stage_empty(
    ray_cluster: Any, logs: list[LogEvent]
) -> None:
    """Under a restart policy a killed stage comes back with an empty cache; the restart is
    logged as ``stage_restarted`` and counted in the statistics."""
    failed: list[str] = []
    placement = RayPlacement(
        num_cpus=0.25, restart=RestartPolicy(max_restarts=2, within_s=60), health_check_s=0.1
    )
    with trio.fail_after(WAIT_S):
        async with open_pipeline(
            stage_configs(2), ProbeModels(), environ=NO_ENV, placement=placement
        ) as pipeline:
            await pipeline.prefill(prompt(300), session_id="s")
            victim = pipeline.stage_processes()[1].pid
            os.kill(victim, signal.SIGKILL)
            while True:  # a prefill sent before the death is noticed fails; later ones wait
                try:
                    result = await pipeline.prefill(prompt(300), session_id="s")
                except StageFailedError as exc:
                    failed.append(exc.stage_id)
                    continue
                break
            assert counts(result) == [(300, 0), (0, 300)]
            assert set(failed) <= {"stage-1"}
            stats = await pipeline.statistics()
            assert [s.restarts for s in stats.stages] == [0, 1]
            assert pipeline.stage_processes()[1].pid != victim
    restarted = events_named(logs, "stage_restarted")
    assert [(e["stage"], e["restarts"], e["cache_lost"]) for e in restarted] == [
        ("stage-1", 1, True)
    ]
    assert pipeline.failure is None


async def test_statistics_and_clearing_wait_for_a_stage_being_recreated(
    ray_cluster: Any,
) -> None:
    """While a killed stage is recreated, statistics and clear_caches wait for it (as prefills
    do) instead of failing, and clearing empties every stage, not only those before it."""
    placement = RayPlacement(
        num_cpus=0.25,
        restart=RestartPolicy(max_restarts=2, within_s=60, backoff_s=1),
        health_check_s=0.1,
    )
    with trio.fail_after(WAIT_S):
        async with open_pipeline(
            stage_configs(2), ProbeModels(), environ=NO_ENV, placement=placement
        ) as pipeline:
            await pipeline.prefill(prompt(300), session_id="s")
            stage_1 = pipeline._stages._processes[1]  # type: ignore[attr-defined]
            os.kill(pipeline.stage_processes()[1].pid, signal.SIGKILL)
            # Until the health check sees the death (the driver's own state: no event says it).
            while stage_1.available.is_set():  # noqa: ASYNC110
                await trio.sleep(0.02)
            stats = await pipeline.statistics()
            assert [s.restarts for s in stats.stages] == [0, 1]
            assert [s.cache.entries if s.cache else 0 for s in stats.stages] == [2, 0]
            await pipeline.prefill(prompt(300), session_id="s")
            os.kill(pipeline.stage_processes()[1].pid, signal.SIGKILL)
            while stage_1.available.is_set():  # noqa: ASYNC110
                await trio.sleep(0.02)
            cleared = await pipeline.clear_caches()
            assert [len(evicted) for evicted in cleared] == [2, 0]
            again = await pipeline.prefill(prompt(300), session_id="s")
            assert counts(again) == [(0, 300), (0, 300)]


async def test_a_dead_stage_fails_the_prefills_waiting_before_it_at_once(
    ray_cluster: Any,
) -> None:
    """Prefills held up in the stages before a stage that dies fail within 10 s naming it
    (not once those stages finish them), and their work there is cancelled."""
    placement = RayPlacement(
        num_cpus=0.25, restart=RestartPolicy(max_restarts=1, within_s=60), health_check_s=0.2
    )
    errors: list[StageFailedError] = []
    with trio.fail_after(WAIT_S):
        async with open_pipeline(
            stage_configs(3),
            ProbeModels(slow_stage=0, delay_s=3600),
            environ=NO_ENV,
            placement=placement,
        ) as pipeline:

            async def slow(n: int) -> None:
                with pytest.raises(StageFailedError) as info:
                    await pipeline.prefill(prompt(SLOW_LENGTH), session_id=f"s{n}")
                errors.append(info.value)

            victim = pipeline.stage_processes()[2].pid
            async with trio.open_nursery() as nursery:
                for n in range(4):
                    nursery.start_soon(slow, n)
                await trio.testing.wait_all_tasks_blocked()
                os.kill(victim, signal.SIGKILL)
                with trio.fail_after(10):
                    while len(errors) < 4:  # noqa: ASYNC110
                        await trio.sleep(0.05)
            assert [e.stage_id for e in errors] == ["stage-2"] * 4
            assert all("its process died" in str(e) for e in errors)
            # Stage 0 gave up the slow prompts: it serves the next one at once.
            with trio.fail_after(10):
                result = await pipeline.prefill(prompt(300), session_id="s")
            assert counts(result) == [(0, 300)] * 3


class _Interrupted(Exception):
    pass


_E = TypeVar("_E", bound=BaseException)


def _start_failing_callers(
    nursery: trio.Nursery,
    pipeline: Any,
    count: int,
    error_type: type[_E],
    errors: list[_E],
) -> None:
    """Start ``count`` callers of slow prefills in ``nursery`` (outside the pipeline's block),
    each expecting its prefill to fail with ``error_type``, which it appends to ``errors``."""

    async def slow(n: int) -> None:
        with pytest.raises(error_type) as info:
            await pipeline.prefill(prompt(SLOW_LENGTH), session_id=f"s{n}")
        errors.append(info.value)

    for n in range(count):
        nursery.start_soon(slow, n)


async def test_callers_outside_the_block_see_the_pipeline_stop(placement: Placement) -> None:
    """An exception leaving the pipeline's block fails the prefills that callers in other tasks
    have in flight with PipelineStoppedError, under either placement (no stage failed)."""
    errors: list[BaseException] = []
    with trio.fail_after(WAIT_S), pytest.RaisesGroup(_Interrupted, flatten_subgroups=True):
        async with (
            trio.open_nursery() as callers,
            open_pipeline(
                stage_configs(3),
                ProbeModels(slow_stage=1, delay_s=3600),
                environ=NO_ENV,
                placement=placement,
            ) as pipeline,
        ):
            _start_failing_callers(callers, pipeline, 4, PipelineStoppedError, errors)
            await trio.testing.wait_all_tasks_blocked()
            raise _Interrupted
    assert len(errors) == 4
    assert all("pipeline stopped before request" in str(e) for e in errors)


async def test_a_stage_death_stopping_the_pipeline_fails_outside_callers_naming_it(
    ray_cluster: Any,
) -> None:
    """Callers in other tasks whose prefills wait before a stage that dies (no restart) are
    failed naming that stage, not the stages the pipeline kills as it stops."""
    errors: list[StageFailedError] = []
    placement = RayPlacement(num_cpus=0.25, health_check_s=0.2)
    with (
        trio.fail_after(WAIT_S),
        pytest.RaisesGroup(
            pytest.RaisesExc(StageFailedError, match="stage 'stage-1' failed"),
            flatten_subgroups=True,
        ),
    ):
        async with (
            trio.open_nursery() as callers,
            open_pipeline(
                stage_configs(2),
                ProbeModels(slow_stage=0, delay_s=3600),
                environ=NO_ENV,
                placement=placement,
            ) as pipeline,
        ):
            _start_failing_callers(callers, pipeline, 6, StageFailedError, errors)
            await trio.testing.wait_all_tasks_blocked()
            os.kill(pipeline.stage_processes()[1].pid, signal.SIGKILL)
            with trio.fail_after(10):
                await trio.sleep_forever()  # until the pipeline stops and cancels this
    assert [e.stage_id for e in errors] == ["stage-1"] * 6


async def test_cancelled_prefill_interrupts_the_remote_stage(ray_cluster: Any) -> None:
    """A caller giving up cancels its remote work: the sleeping stage is interrupted, records
    nothing, and serves the next prompt at once; caches stay consistent."""
    placement = RayPlacement(num_cpus=0.25)
    with trio.fail_after(WAIT_S):
        async with open_pipeline(
            stage_configs(2),
            ProbeModels(slow_stage=1, delay_s=3600),
            environ=NO_ENV,
            placement=placement,
        ) as pipeline:
            with trio.move_on_after(1):
                await pipeline.prefill(prompt(SLOW_LENGTH), session_id="s")
            result = await pipeline.prefill(prompt(300), session_id="s")
            assert counts(result) == [(0, 300), (0, 300)]
            stats = await pipeline.statistics()
            # Stage 0 finished and recorded the cancelled prompt; stage 1 recorded nothing.
            entries = [s.cache.entries if s.cache else 0 for s in stats.stages]
            assert entries[1] == 2
            reference = await run_stream(LocalPlacement(), stage_configs(2))
            again = await pipeline.prefill(prompt(300), session_id="s")
            assert counts(again) == [(300, 0), (300, 0)]
            assert again.frame.rows().tobytes() == reference[0][0].tobytes()


async def test_in_flight_prefills_are_bounded(ray_cluster: Any) -> None:
    """At most ``max_in_flight`` prefills are sent to the stages; the rest wait their turn."""
    placement = RayPlacement(num_cpus=0.25, max_in_flight=2)
    results: list[PrefillResult] = []
    with trio.fail_after(WAIT_S):
        async with (
            open_pipeline(
                stage_configs(2),
                ProbeModels(slow_stage=0, delay_s=0.5),
                environ=NO_ENV,
                placement=placement,
            ) as pipeline,
            trio.open_nursery() as nursery,
        ):

            async def one() -> None:
                results.append(await pipeline.prefill(prompt(SLOW_LENGTH), session_id="s"))

            for _ in range(5):
                nursery.start_soon(one)
            await trio.testing.wait_all_tasks_blocked()
            limiter = pipeline._stages._limiter  # type: ignore[attr-defined]
            assert limiter.statistics().borrowed_tokens == 2
            assert limiter.statistics().tasks_waiting == 3
    assert len(results) == 5


async def test_stage_logs_come_from_the_stage_process(ray_cluster: Any, tmp_path: Path) -> None:
    """The logging set-up runs in each stage process; events carry their stage."""
    path = tmp_path / "stages.jsonl"
    placement = RayPlacement(num_cpus=0.25, log_setup=LogToFile(str(path)))
    with trio.fail_after(WAIT_S):
        async with open_pipeline(
            stage_configs(2, max_entries=1), ProbeModels(), environ=NO_ENV, placement=placement
        ) as pipeline:
            await pipeline.prefill(prompt(300), session_id="s")
            await pipeline.prefill(prompt(400, start=1), session_id="s")
    events = [json.loads(line) for line in path.read_text().splitlines()]
    evicted = [e for e in events if e["event"] == "activation_evicted" and e["stage"] == "stage-1"]
    assert evicted
    assert {e["pid"] for e in events if e["event"] == "stage_process_started"} != {os.getpid()}


async def test_a_stage_that_cannot_start_is_a_stage_failure(ray_cluster: Any) -> None:
    """A model factory raising in the stage process fails the pipeline, naming the stage.
    (Both stages fail; whether the second's failure is in the group too depends on timing.)"""
    with trio.fail_after(WAIT_S), pytest.raises(BaseExceptionGroup) as caught:
        async with open_pipeline(
            stage_configs(2), Failing(), environ=NO_ENV, placement=RayPlacement(num_cpus=0.25)
        ):
            pytest.fail("the pipeline must not open")
    _, rest = caught.value.split(StageFailedError)
    assert rest is None  # nothing but stage failures
    failures = _leaves(caught.value)
    assert 1 <= len(failures) <= 2
    for failure in failures:
        assert isinstance(failure, StageFailedError)
        assert re.search(r"stage 'stage-[01]' failed: .*no weights for stage-[01]", str(failure))


def _leaves(group: BaseExceptionGroup[BaseException]) -> list[BaseException]:
    """The exceptions inside ``group`` and its subgroups."""
    found: list[BaseException] = []
    for error in group.exceptions:
        found.extend(_leaves(error) if isinstance(error, BaseExceptionGroup) else [error])
    return found


async def test_an_unpicklable_model_factory_is_a_config_error(ray_cluster: Any) -> None:
    """The model factory must reach the stage processes: refused at once if it cannot."""
    lock = threading.Lock()

    def factory(config: StageConfig) -> Any:
        with lock:
            return ProbeModels()(config)

    with pytest.raises(ConfigError, match="model_factory must be picklable"):
        async with open_pipeline(
            stage_configs(2), factory, environ=NO_ENV, placement=RayPlacement(num_cpus=0.25)
        ):
            pytest.fail("the pipeline must not open")


def test_ray_placement_without_ray_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without Ray installed, RayPlacement is a ConfigError saying what to install."""
    monkeypatch.setattr("stage_runtime.placement.ray_available", lambda: False)
    with pytest.raises(ConfigError, match=r"stage-runtime\[ray\]"):
        RayPlacement()


def test_a_directory_named_like_ray_is_not_ray(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Python imports a bare directory as an empty namespace package: one named ``ray`` on the
    path (Ray leaves one in /tmp) is not Ray installed, while a real package is."""
    (tmp_path / "stray_ray_like").mkdir()
    (tmp_path / "real_ray_like").mkdir()
    (tmp_path / "real_ray_like" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert not _installed("stray_ray_like")
    assert _installed("real_ray_like")
    assert not _installed("no_such_module_here")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_cpus": -1}, "num_cpus must be a finite number >= 0, got -1"),
        ({"strategy": "EVERYWHERE"}, "strategy must be None or one of"),
        ({"max_in_flight": 0}, "max_in_flight must be an integer >= 1, got 0"),
        ({"resources": {"stage-0": {"GPU": -1}}}, r"resources\['stage-0'\]\['GPU'\]"),
        (
            {"resources": {"stage-0": {"": 1}}},
            r"^resources\['stage-0'\] resource names must be non-empty strings, got ''$",
        ),
        (
            {"resources": {"stage-0": {7: 1}}},
            r"^resources\['stage-0'\] resource names must be non-empty strings, got 7$",
        ),
        (
            {"resources": {"stage-0": {"accel\n": 1}}},
            r"^resources\['stage-0'\] resource name 'accel\\n' must not hold control "
            r"characters, got '\\n' at index 5$",
        ),
        ({"address": ""}, "address must be None or a non-empty string"),
        ({"init_options": {"address": "auto"}}, "init_options must not hold 'address'"),
        ({"init_options": "abc"}, "^init_options must be a mapping of ray.init argument names"),
        ({"init_options": {1: 2}}, "^init_options must be a mapping of ray.init argument names"),
        (
            {"resources": {"st\x00age": {"GPU": 1}}},
            r"^resources stage id 'st\\x00age' must not hold control characters",
        ),
        ({"resources": {"": {"GPU": 1}}}, "^resources must map stage ids to tables"),
        ({"log_setup": 3}, "log_setup must be None or a callable"),
    ],
)
def test_bad_ray_placement_settings_name_the_field(kwargs: dict[str, Any], match: str) -> None:
    """Each bad setting is a ConfigError naming the field and the value."""
    with pytest.raises(ConfigError, match=match):
        RayPlacement(**kwargs)


async def test_a_placement_that_is_not_one_is_refused() -> None:
    """``placement`` must be a placement object."""
    with pytest.raises(ConfigError, match="placement must be None, a LocalPlacement"):
        async with open_pipeline(stage_configs(1), ProbeModels(), placement="ray"):  # type: ignore[arg-type]
            pytest.fail("the pipeline must not open")


# -- topology files and the command line ----------------------------------------------------------

TOPOLOGY = """
[defaults]
model_id = "m"

[[stage]]
stage_id = "stage-0"
layer_start = 0
layer_end = 4

[[stage]]
stage_id = "stage-1"
layer_start = 4
layer_end = 8
"""


def write_topology(tmp_path: Path, placement: str) -> Path:
    path = tmp_path / "topology.toml"
    path.write_text(TOPOLOGY + placement, encoding="utf-8")
    return path


def test_a_topology_without_placement_table_has_none(tmp_path: Path) -> None:
    """No ``[placement]`` table: the caller (or local placement) decides."""
    assert load_placement(write_topology(tmp_path, "")) is None


def test_a_ray_placement_table_sets_every_field(tmp_path: Path) -> None:
    """Every key of the table reaches the RayPlacement."""
    path = write_topology(
        tmp_path,
        """
[placement]
engine = "ray"
address = "auto"
num_cpus = 0.5
strategy = "SPREAD"
max_in_flight = 4
health_check_s = 2.5

[placement.resources]
"stage-1" = { GPU = 1, accel = 2 }

[placement.restart]
max_restarts = 3
within_s = 60
""",
    )
    placement = load_placement(path)
    assert placement == RayPlacement(
        address="auto",
        num_cpus=0.5,
        strategy="SPREAD",
        max_in_flight=4,
        health_check_s=2.5,
        resources={"stage-1": {"GPU": 1, "accel": 2}},
        restart=RestartPolicy(max_restarts=3, within_s=60),
    )
    assert len(load_topology(path)) == 2  # the stages load as before


@pytest.mark.parametrize(
    ("table", "match"),
    [
        (
            'engine = "ray"\nnodes = 3',
            r"topology\.toml: line \d+: placement\.nodes is not a setting of engine",
        ),
        (
            'engine = "local"\naddress = "auto"',
            r"toml: line \d+: placement\.address .* \(a Ray setting\)",
        ),
        ('engine = "kubernetes"', r"toml: line \d+: placement\.engine must be 'local' or 'ray'"),
        ('engine = "ray"\nnum_cpus = -2', r"toml: line \d+: placement\.num_cpus must be a finite"),
        (
            'engine = "ray"\nrestart = { max_restarts = -1, within_s = 1 }',
            r"placement\.restart\.max_restarts must be >= 0, got -1$",
        ),
        (
            'engine = "ray"\nrestart = { tries = 1 }',
            r"unknown field placement\.restart\.tries \(known fields: backoff_s, max_restarts",
        ),
        ('engine = "ray"\nrestart = 3', r"placement\.restart must be a table of .*, got 3$"),
        ('engine = "ray"\nmax_in_flight = true', r"placement\.max_in_flight must be an integer"),
        (
            'engine = "ray"\nresources = { stage-0 = { CPU = -1 } }',
            r"toml: line \d+: "
            r"placement\.resources\['stage-0'\]\['CPU'\] must be a finite number >= 0",
        ),
        (
            'engine = "ray"\n[placement.resources]\n"stage-1" = { "" = 1 }',
            r"toml: line \d+: placement\.resources\['stage-1'\] resource names must be "
            r"non-empty strings, got ''$",
        ),
    ],
)
def test_a_bad_placement_table_names_file_and_key_path(
    tmp_path: Path, table: str, match: str
) -> None:
    """Each mistake is a ConfigError naming the file and the key path."""
    path = write_topology(tmp_path, "\n[placement]\n" + table + "\n")
    with pytest.raises(ConfigError, match=match) as caught:
        load_placement(path)
    assert str(caught.value).startswith(f"{path}: ")


def test_an_empty_resource_name_is_named_at_its_line(tmp_path: Path) -> None:
    """An empty resource name is the error, not its (good) amount, at the line that holds it."""
    path = write_topology(
        tmp_path,
        '\n[placement]\nengine = "ray"\n[placement.resources]\n'
        '"stage-0" = { GPU = 1 }\n"stage-1" = { "" = 1 }\n',
    )
    line = path.read_text(encoding="utf-8").splitlines().index('"stage-1" = { "" = 1 }') + 1
    with pytest.raises(ConfigError) as caught:
        load_placement(path)
    assert str(caught.value) == (
        f"{path}: line {line}: placement.resources['stage-1'] resource names must be "
        "non-empty strings, got ''"
    )


async def test_a_topology_files_local_placement_opens_a_local_pipeline(tmp_path: Path) -> None:
    """``open_pipeline(path)`` takes the file's placement."""
    path = write_topology(tmp_path, '\n[placement]\nengine = "local"\n')
    async with open_pipeline(path, ProbeModels(), environ=NO_ENV) as pipeline:
        assert pipeline.placement == LocalPlacement()
        result = await pipeline.prefill(prompt(10), session_id="s")
    assert result.tokens == 10


def test_command_line_choices_override_the_topology() -> None:
    """``--placement`` and ``--ray-address`` win over the file; an address implies Ray."""
    configured = RayPlacement(num_cpus=0.5, address="auto")
    assert choose_placement(None) == LocalPlacement()
    assert choose_placement(configured) is configured
    assert choose_placement(configured, engine="local") == LocalPlacement()
    assert choose_placement(None, engine="ray") == RayPlacement()
    assert choose_placement(configured, address="ray://head:10001") == attrs.evolve(
        configured, address="ray://head:10001"
    )
    assert choose_placement(LocalPlacement(), address="auto") == RayPlacement(address="auto")
    with pytest.raises(ConfigError, match="needs the ray placement"):
        choose_placement(None, engine="local", address="auto")


async def test_llama_stages_in_ray_processes_give_the_local_logits(
    ray_cluster: Any, tmp_path: Path
) -> None:
    """Each Ray stage process loads its own layers of a Llama model directory; a prompt
    extending a cached one gives the logits local placement gives (to float32 rounding: a Ray
    worker runs one BLAS thread, this process may run several, which sum in another order)."""
    directory = write_random_llama(tmp_path / "model", num_hidden_layers=2, vocab_size=512)
    configs = stage_configs(2, layers_per_stage=1)
    tokens = prompt(300)
    results = []
    for where in (LocalPlacement(), RayPlacement(num_cpus=0.25)):
        with trio.fail_after(WAIT_S):
            async with open_pipeline(
                configs, llama_model_factory(directory), environ=NO_ENV, placement=where
            ) as pipeline:
                await pipeline.prefill(tokens[:256], session_id="s")
                results.append(await pipeline.prefill(tokens, session_id="s"))
    local, remote = results
    assert counts(remote) == counts(local)
    assert remote.stages[0].restored_tokens > 0
    assert local.logits is not None
    assert remote.logits is not None
    np.testing.assert_allclose(local.logits, remote.logits, rtol=1e-5, atol=1e-6)
