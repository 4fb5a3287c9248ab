"""Simulation: workloads, Mooncake-format trace replay, cost model and reports.

Typical use from a program (the CLI does the same)::

    from stage_runtime.sim import SimConfig, read_trace, run_replay

    trace = read_trace("trace.jsonl")
    result = run_replay(trace.requests, SimConfig(stages=4))
    print(result.token_hit_ratio, result.theoretical.ratio)

Inside a trio program, ``await replay(...)`` under a virtual clock instead (see
``examples/multi_stage_simulation.py``). To use more cores, fan the stages (and the points of a
sweep) out to other processes; the results are identical::

    from stage_runtime.sim import open_executor, run_sweep

    with open_executor(workers=4) as executor:
        results = run_sweep(trace.requests, SimConfig(stages=4), [0, 65536], executor=executor)
"""

from __future__ import annotations

from stage_runtime.sim.blocks import VOCAB_SIZE, BlockTokenizer
from stage_runtime.sim.clairvoyant import ClairvoyantResult, clairvoyant_for
from stage_runtime.sim.cost import (
    MAX_COST_S,
    CostModel,
    Percentiles,
    percentiles,
    pipeline_finish_times,
)
from stage_runtime.sim.driver import (
    MAX_ARRIVAL_SPAN_S,
    MAX_BLOCK_SIZE,
    MAX_BYTES_PER_TOKEN,
    MAX_CACHE_BYTES,
    MAX_STAGES,
    MIN_BLOCK_SIZE,
    PAGED_MAX_ENTRIES,
    OfferedLoad,
    ProgressCallback,
    ReplayResult,
    RequestOutcome,
    SimConfig,
    StageReplay,
    StageSummary,
    admission_order,
    kv_cache_config,
    replay,
    stage_configs,
    summarise_replay,
    validate_requests,
)
from stage_runtime.sim.fanout import (
    fan_out,
    open_executor,
    replay_stage,
    replay_stages,
    stage_groups,
)
from stage_runtime.sim.model import SimulatedStageModel, simulated_model_factory
from stage_runtime.sim.report import (
    plot_figure,
    render_report,
    render_sweep,
    result_to_json,
    sweep_order,
    write_plot,
)
from stage_runtime.sim.runs import run_replay, run_sweep
from stage_runtime.sim.theory import TheoreticalMax, theoretical_max_hit_ratio
from stage_runtime.sim.trace import (
    SimRequest,
    TraceReadResult,
    parse_trace_line,
    read_demo_trace,
    read_trace,
    read_trace_lines,
    total_prompt_tokens,
    trace_file_lines,
)
from stage_runtime.sim.workloads import WorkloadSpec, synthetic_workload

__all__ = [
    "ClairvoyantResult",
    "clairvoyant_for",
    "MAX_BLOCK_SIZE",
    "MAX_BYTES_PER_TOKEN",
    "MAX_CACHE_BYTES",
    "MAX_COST_S",
    "MAX_ARRIVAL_SPAN_S",
    "MAX_STAGES",
    "MIN_BLOCK_SIZE",
    "PAGED_MAX_ENTRIES",
    "VOCAB_SIZE",
    "BlockTokenizer",
    "CostModel",
    "Percentiles",
    "OfferedLoad",
    "ProgressCallback",
    "ReplayResult",
    "RequestOutcome",
    "SimConfig",
    "SimRequest",
    "SimulatedStageModel",
    "StageReplay",
    "StageSummary",
    "TheoreticalMax",
    "TraceReadResult",
    "WorkloadSpec",
    "admission_order",
    "fan_out",
    "kv_cache_config",
    "open_executor",
    "parse_trace_line",
    "percentiles",
    "pipeline_finish_times",
    "plot_figure",
    "read_demo_trace",
    "read_trace",
    "read_trace_lines",
    "trace_file_lines",
    "render_report",
    "render_sweep",
    "sweep_order",
    "replay",
    "replay_stage",
    "replay_stages",
    "result_to_json",
    "run_replay",
    "run_sweep",
    "simulated_model_factory",
    "stage_groups",
    "stage_configs",
    "summarise_replay",
    "synthetic_workload",
    "theoretical_max_hit_ratio",
    "total_prompt_tokens",
    "validate_requests",
    "write_plot",
]
