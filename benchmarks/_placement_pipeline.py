"""Pipeline sections of ``bench_placement.py``: hop latency, throughput and memory, local vs Ray.

``bench_placement.py`` runs this file as a child process per section, so that BLAS threads are
pinned to one before numpy loads (a stage then uses one core for its matrix products wherever it
runs; the Ray instance started here passes the same environment to the stage processes), and so
that the Ray instance, and every file it writes (under a temporary ``RAY_TMPDIR``), is gone when
the section ends. Every figure is a median over repeats, local and Ray side by side in one run::

    python benchmarks/_placement_pipeline.py hops --repeat 50 --out hops.json
    python benchmarks/_placement_pipeline.py throughput --repeat 1 --out throughput.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

BLAS_THREAD_VARIABLES = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


def pin_blas_threads() -> None:
    """One BLAS thread per process (call before numpy is imported)."""
    for name in BLAS_THREAD_VARIABLES:
        os.environ[name] = "1"


def _ray_placement(**kwargs: Any) -> Any:
    from stage_runtime.placement import RayPlacement

    return RayPlacement(**kwargs)


def _configs(count: int, ctx_size: int = 8192) -> list[Any]:
    from stage_runtime.config import CacheMode, KvCacheConfig, StageConfig

    return [
        StageConfig(
            stage_id=f"stage-{i}",
            stage_index=i,
            model_id="bench/model",
            layer_start=i,
            layer_end=i + 1,
            ctx_size=ctx_size,
            kv_cache=KvCacheConfig(mode=CacheMode.DISABLED),
        )
        for i in range(count)
    ]


class PassThrough:
    """A stage model that does no work: stage 0 hands out a precomputed frame of ``width``
    float32 values per token, later stages return their input. What a prefill then costs is
    the hops."""

    def __init__(self, width: int) -> None:
        import numpy as np

        from stage_runtime.frames import ActivationFrame

        self.activation_width = width
        self._rows = np.ones((8192, width), dtype=np.float32)
        self._frame = ActivationFrame

    def embed(self, tokens: Any) -> Any:
        return self._frame.from_array(self._rows[: len(tokens)])

    async def forward(self, inputs: Any, start: int, restored: Any) -> Any:
        return inputs


class PassThroughFactory:
    """Builds :class:`PassThrough` models (picklable: defined at module level)."""

    def __init__(self, width: int) -> None:
        self.width = width

    def __call__(self, config: Any) -> Any:
        return PassThrough(self.width)


async def _round_trips(placement: Any, tokens: int, width: int, repeats: int) -> list[float]:
    import numpy as np
    import trio

    from stage_runtime.pipeline import open_pipeline

    prompt = np.arange(tokens, dtype=np.int32)
    times = []
    async with open_pipeline(
        _configs(2), PassThroughFactory(width), placement=placement, environ={}
    ) as pipeline:
        for _ in range(3):  # warm up: connections, allocations
            await pipeline.prefill(prompt, session_id="warm")
        for _ in range(repeats):
            started = time.perf_counter()
            await pipeline.prefill(prompt, session_id="hop")
            times.append(time.perf_counter() - started)
        await trio.lowlevel.checkpoint()
    return times


def hop_rows(repeats: int) -> list[dict[str, Any]]:
    """Round trip of a 2-stage pipeline of pass-through stages (driver, stage 0, stage 1,
    driver): a small frame and a 16 MiB one, local vs Ray."""
    import trio

    rows = []
    cases = [
        ("small (1 token x 8 float32)", 1, 8),
        ("16 MiB (4,096 tokens x 1,024 float32)", 4096, 1024),
    ]
    for label, tokens, width in cases:
        local = trio.run(_round_trips, None, tokens, width, repeats)
        remote = trio.run(_round_trips, _ray_placement(), tokens, width, repeats)
        local_s, ray_s = statistics.median(local), statistics.median(remote)
        rows.append(
            {
                "case": f"2-stage round trip, {label}",
                "frame_bytes": tokens * width * 4,
                "local_us": local_s * 1e6,
                "ray_us": ray_s * 1e6,
                "ray_over_local": ray_s / local_s if local_s else None,
            }
        )
    return rows


async def _throughput(
    placement: Any,
    factory: Callable[[Any], Any],
    prompts: Sequence[Any],
    concurrency: int,
    sample: Callable[[Any], dict[str, Any]] | None = None,
) -> tuple[float, list[float], dict[str, Any]]:
    import trio

    from stage_runtime.pipeline import open_pipeline

    busy = [0.0, 0.0]
    sampled: dict[str, Any] = {}
    async with open_pipeline(_configs(2), factory, placement=placement, environ={}) as pipeline:
        await pipeline.prefill(prompts[0][:64], session_id="warm")
        limiter = trio.CapacityLimiter(concurrency)

        async def one(tokens: Any) -> None:
            async with limiter:
                result = await pipeline.prefill(tokens, session_id="bench")
            for index, report in enumerate(result.stages):
                busy[index] += report.finished_s - report.started_s

        started = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for tokens in prompts:
                nursery.start_soon(one, tokens)
        elapsed = time.perf_counter() - started
        if sample is not None:
            sampled = sample(pipeline)
    return elapsed, busy, sampled


def _peak_rss(pid: int) -> int:
    """Peak resident bytes of process ``pid`` (VmHWM), 0 when it cannot be read."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _ray_processes(temp_dir: str, exclude: set[int]) -> dict[int, str]:
    """Ray's own processes (their command lines name ``temp_dir``), by pid, with names."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) in exclude:
            continue
        try:
            command = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if temp_dir.encode() in command:
            found[int(entry.name)] = command.split(b"\0")[0].decode(errors="replace")
    return found


def _stage_compute_s(factory: Callable[[Any], Any], prompts: Sequence[Any]) -> list[float]:
    """Each of the two stages' own compute over ``prompts``, one prompt after the other, on the
    event loop (one core): stage 0 embeds and forwards, stage 1 forwards stage 0's output.
    Perfect overlap of the two stages divides their sum by the larger at most. (The stages'
    busy times in a pipeline run cannot say: a stage's includes its waits for room
    downstream.)"""
    import trio

    async def run() -> list[float]:
        configs = _configs(2)
        first, second = factory(configs[0]), factory(configs[1])
        spent = [0.0, 0.0]
        for tokens in prompts:
            started = time.perf_counter()
            output = await first.forward(first.embed(tokens), 0, None)
            middle = time.perf_counter()
            await second.forward(output, 0, None)
            spent[0] += middle - started
            spent[1] += time.perf_counter() - middle
        return spent

    result: list[float] = trio.run(run)
    return result


COMPUTE_SAMPLE = 16
"""Prompts the stages' own compute is measured over (their ratio is what the bound needs)."""


def throughput_rows(
    *, prompts: int, tokens: int, width: int, concurrency: int, repeats: int
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Prefill throughput of 2 CausalMixModel stages, local (threads), local on one core
    (model inline), and Ray (2 processes); and peak memory of the Ray run."""
    import numpy as np
    import trio

    from stage_runtime.models import reference_model_factory

    rng = np.random.default_rng(0)
    batch = [rng.integers(0, 32_000, tokens, dtype=np.int32) for _ in range(prompts)]
    temp_dir = os.environ.get("RAY_TMPDIR", "")
    memory: dict[str, Any] = {}

    def sample(pipeline: Any) -> dict[str, Any]:
        stages = {p.stage_id: _peak_rss(p.pid) for p in pipeline.stage_processes()}
        own = {os.getpid(), *(p.pid for p in pipeline.stage_processes())}
        ray_own = {
            f"{name.rsplit('/', 1)[-1]}:{pid}": _peak_rss(pid)
            for pid, name in _ray_processes(temp_dir, own).items()
        }
        return {
            "driver_peak_rss_bytes": _peak_rss(os.getpid()),
            "stage_peak_rss_bytes": stages,
            "ray_processes_peak_rss_bytes": ray_own,
            "ray_processes_total_bytes": sum(ray_own.values()),
        }

    runs: dict[str, list[float]] = {"local": [], "local_one_core": [], "ray": []}
    busy: dict[str, list[float]] = {}
    for _ in range(repeats):
        for name in runs:
            inline = name == "local_one_core"
            factory = reference_model_factory(
                width=width, thread_threshold_macs=2**62 if inline else 1 << 24
            )
            placement = _ray_placement() if name == "ray" else None
            elapsed, stage_busy, sampled = trio.run(
                _throughput,
                placement,
                factory,
                batch,
                concurrency,
                sample if name == "ray" else None,
            )
            runs[name].append(elapsed)
            busy[name] = stage_busy
            if sampled:
                memory = sampled
    compute = _stage_compute_s(
        reference_model_factory(width=width, thread_threshold_macs=2**62),
        batch[:COMPUTE_SAMPLE],
    )
    medians = {name: statistics.median(values) for name, values in runs.items()}
    total_tokens = prompts * tokens
    rows = [
        {
            "placement": name,
            "wall_s": medians[name],
            "tokens_per_s": total_tokens / medians[name],
            "stage_busy_s": busy[name],
            "speedup_over_local": medians["local"] / medians[name],
        }
        for name in runs
    ]
    summary = {
        "ray_over_local": medians["local"] / medians["ray"],
        "ray_over_local_one_core": medians["local_one_core"] / medians["ray"],
        # With each stage's own compute measured alone on one core, perfect overlap of the two
        # speeds up by at most (the sum of their compute) / (the larger one's).
        "stage_compute_s": compute,
        "two_stage_balance_bound": sum(compute) / max(compute) if max(compute) else None,
        "memory": memory,
    }
    return rows, summary


def main(argv: list[str] | None = None) -> None:
    """Run one section with Ray started here; write its result as JSON to ``--out``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("section", choices=("hops", "throughput"))
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    pin_blas_threads()
    temp = tempfile.mkdtemp(prefix="bp-ray-")
    os.environ["RAY_TMPDIR"] = temp
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # else Ray writes ~/.ray/auth_token
    import ray
    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(30))
    ray.init(include_dashboard=False, log_to_driver=False)
    try:
        result: dict[str, Any]
        if args.section == "hops":
            result = {"rows": hop_rows(args.repeat)}
        else:
            rows, summary = throughput_rows(
                prompts=args.prompts,
                tokens=args.prompt_tokens,
                width=args.width,
                concurrency=args.concurrency,
                repeats=args.repeat,
            )
            result = {"rows": rows, **summary}
    finally:
        ray.shutdown()
        shutil.rmtree(temp, ignore_errors=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
