"""A simulation inside your own trio program, without the command line.

The program opens a real 4-stage pipeline of simulated stages (virtual activations of 8 KiB per
token, virtual compute time of 25 us per token per stage), and serves a synthetic workload the
way a server would: each request is its own task, started at its arrival time. Alongside, a task
of the program's own samples the stage-0 cache. At the end it prints what the cache bought, and
each stage's hits and misses from ``Pipeline.statistics()``.

The stages sleep their simulated cost with ``trio.sleep``, so the ``__main__`` block runs the
program on a virtual clock (``trio.testing.MockClock(autojump_threshold=0)``): simulated seconds
pass instantly. On a real clock it works the same and takes about a second.

Run it with ``python examples/multi_stage_simulation.py``.
"""

from __future__ import annotations

import logging
import sys

import structlog
import trio
import trio.testing

from stage_runtime import open_pipeline
from stage_runtime.sim import (
    BlockTokenizer,
    CostModel,
    SimConfig,
    SimRequest,
    WorkloadSpec,
    simulated_model_factory,
    stage_configs,
    synthetic_workload,
    theoretical_max_hit_ratio,
)


async def main() -> dict[str, float]:
    """Run the simulation; return the stage-0 hit ratio, its theoretical maximum and TTFT p50."""
    config = SimConfig(stages=4, record_limit=4, capacity_tokens=32_768)
    spec = WorkloadSpec(
        groups=3, prompts_per_group=4, conversations=2, turns=3, requests_per_s=40.0, seed=7
    )
    requests = synthetic_workload(spec, block_size=config.block_size)
    tokenizer = BlockTokenizer(config.block_size)
    factory = simulated_model_factory(
        bytes_per_token=config.bytes_per_token, cost=CostModel(prefill_s_per_token=25e-6)
    )

    restored = computed = 0
    ttft: list[float] = []
    samples: list[int] = []
    async with open_pipeline(stage_configs(config), factory) as pipeline:

        async def serve(request: SimRequest, arrived: float) -> None:
            nonlocal restored, computed
            result = await pipeline.prefill(
                tokenizer.request_tokens(request), session_id=f"user-{request.index}"
            )
            ttft.append(trio.current_time() - arrived)
            restored += result.stages[0].restored_tokens
            computed += result.stages[0].computed_tokens

        async def monitor() -> None:
            # The program keeps doing its own work while the pipeline serves.
            while True:
                cache = (await pipeline.statistics()).stages[0].cache
                samples.append(0 if cache is None else cache.resident_bytes)
                await trio.sleep(0.05)

        async with trio.open_nursery() as monitoring:
            monitoring.start_soon(monitor)
            async with trio.open_nursery() as requests_nursery:
                start = trio.current_time()
                for request in requests:
                    await trio.sleep_until(start + request.arrival_s)
                    requests_nursery.start_soon(serve, request, trio.current_time())
            monitoring.cancel_scope.cancel()
    stats = await pipeline.statistics()  # the final figures, once the pipeline has drained

    theoretical = theoretical_max_hit_ratio(requests, block_size=config.block_size)
    hit_ratio = restored / (restored + computed)
    ttft.sort()
    print(
        f"{len(requests)} requests: stage 0 restored {restored:,} of {restored + computed:,} "
        f"prompt tokens ({hit_ratio:.1%}; an infinite cache: {theoretical.ratio:.1%}); "
        f"median time to first token {ttft[len(ttft) // 2] * 1000:.0f} ms; "
        f"stage-0 cache peaked at {max(samples, default=0) / 2**20:.0f} MiB"
    )
    for stage in stats.stages:
        acc = stage.accounting
        if acc is not None:
            print(
                f"  {stage.stage_id}: {acc.hits} hit / {acc.misses} missed of {acc.lookups} "
                f"restores (never seen {acc.misses_never_seen}, evicted {acc.misses_evicted}), "
                f"{acc.restored_tokens:,} tokens restored, {acc.evictions} evictions"
            )
    return {
        "hit_ratio": hit_ratio,
        "theoretical_max": theoretical.ratio,
        "ttft_p50_s": ttft[len(ttft) // 2],
    }


if __name__ == "__main__":
    # Warnings only, on stderr: the cache logs every record and eviction at info level.
    structlog.configure(
        wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
    )
    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
