"""A simulation inside your own trio program, without the command line.

The program opens a real 4-stage pipeline of simulated stages (virtual activations of 8 KiB per
token, virtual compute time), sends it a synthetic workload of prompts that share system prompts
while it also runs a task of its own (a monitor sampling cache statistics), and prints what each
stage's cache bought.

The stages sleep their simulated cost with ``trio.sleep``, so run it on a virtual clock: the
``__main__`` block below uses ``trio.testing.MockClock(autojump_threshold=0)`` and the whole
simulated minute passes in a blink of real time.

Run it with ``python examples/multi_stage_simulation.py``.
"""

from __future__ import annotations

import structlog
import trio
import trio.testing
from stage_runtime.pipeline import open_pipeline

from stage_runtime.sim import (
    BlockTokenizer,
    CostModel,
    SimConfig,
    WorkloadSpec,
    simulated_model_factory,
    stage_configs,
    synthetic_workload,
    theoretical_max_hit_ratio,
)


async def main() -> dict[str, float]:
    """Run the simulation; return the stage-0 hit ratio and the theoretical maximum."""
    config = SimConfig(stages=4, record_limit=4, capacity_tokens=32_768)
    spec = WorkloadSpec(groups=4, prompts_per_group=6, conversations=2, turns=4, seed=7)
    requests = synthetic_workload(spec, block_size=config.block_size)
    tokenizer = BlockTokenizer(config.block_size)
    factory = simulated_model_factory(
        bytes_per_token=config.bytes_per_token, cost=CostModel(prefill_s_per_token=25e-6)
    )

    restored = computed = 0
    samples: list[int] = []
    async with (
        open_pipeline(stage_configs(config), factory) as pipeline,
        trio.open_nursery() as nursery,
    ):

        async def monitor() -> None:
            # Your program keeps doing its own work while the pipeline serves.
            while True:
                stats = await pipeline.stats()
                cache = stats.stages[0].cache
                samples.append(0 if cache is None else cache.resident_bytes)
                await trio.sleep(0.5)

        nursery.start_soon(monitor)
        start = trio.current_time()
        for request in requests:
            await trio.sleep_until(start + request.arrival_s)
            result = await pipeline.prefill(
                tokenizer.request_tokens(request), session_id=f"user-{request.index}"
            )
            restored += result.stages[0].restored_tokens
            computed += result.stages[0].computed_tokens
        nursery.cancel_scope.cancel()

    theoretical = theoretical_max_hit_ratio(requests, block_size=config.block_size)
    hit_ratio = restored / (restored + computed)
    print(
        f"{len(requests)} requests: stage 0 restored {restored:,} of {restored + computed:,} "
        f"prompt tokens ({hit_ratio:.1%}); an infinite cache could restore "
        f"{theoretical.ratio:.1%}; "
        f"peak stage-0 cache seen by the monitor: {max(samples, default=0) / 2**20:.1f} MiB"
    )
    return {"hit_ratio": hit_ratio, "theoretical_max": theoretical.ratio}


if __name__ == "__main__":
    structlog.configure(
        wrapper_class=structlog.make_filtering_bound_logger(30)  # warnings and above
    )
    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
