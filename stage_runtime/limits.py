"""Every numeric limit the package checks, in one place (no imports, so the command line can
read them without importing the simulator: ``--help`` and usage errors stay fast)."""

from __future__ import annotations

from typing import Final

U64_MAX: Final = 2**64 - 1
"""Largest value of the upstream's u64 fields (counts, bounds, positions)."""

U32_MAX: Final = 2**32 - 1
"""Largest value of the upstream's u32 fields (layers, indices, versions)."""

I32_MIN: Final = -(2**31)
"""Smallest int32 (token ids, widths)."""

I32_MAX: Final = 2**31 - 1
"""Largest int32 (token ids, widths)."""

MIN_BLOCK_SIZE: Final = 4
"""Smallest simulation ``block_size``: blocks of fewer tokens cannot keep every two hash ids
apart (see :class:`~stage_runtime.sim.blocks.BlockTokenizer`), so the replay would share
prefixes the trace does not."""

MAX_BLOCK_SIZE: Final = 1 << 20
"""Largest simulation ``block_size``: a million tokens per hash id (the Mooncake traces use
512). Token blocks are generated at this size, so an absurd value would exhaust memory, not
fail."""

MAX_TRACE_LINE_BYTES: Final = 64 << 20
"""Longest trace line read (64 MiB; a line of the synthetic trace is under 1 KB, and a
262,144-token prompt in 4-token blocks of 20-digit ids about 1.4 MB): a file with no line
breaks (``/dev/zero``, a binary file) is refused at its first line instead of read whole into
memory."""

MAX_STAGES: Final = 256
"""Most pipeline stages in a simulation (each is a trio task with its own cache actor)."""

MAX_BYTES_PER_TOKEN: Final = 1 << 24
"""Largest simulated ``bytes_per_token``: 16 MiB, an 8-million-wide bf16 activation (a
4,096-wide model needs 8,192). Frames must keep their width within int32."""

MAX_CACHE_BYTES: Final = U64_MAX
"""Largest per-stage byte bound (``capacity_tokens * bytes_per_token``) a cache accepts."""

SIM_CTX_SIZE: Final = 262_144
"""The simulated stages' context (``SimConfig.ctx_size``): no synthetic prompt may be longer."""

MAX_ARRIVAL_SPAN_S: Final = 1e9
"""Longest span of arrival times a replay paced by its arrivals (concurrency above 1) accepts
(seconds, about 31 years): the virtual clock counts from the first arrival in floating point,
which still resolves microseconds there. One request at a time, arrivals are not used."""

MAX_COST_S: Final = 3600.0
"""Largest simulated cost per token or per byte: an hour. Larger values (``1e308``) would
overflow the virtual clock to infinity."""

MAX_REFERENCE_WIDTH: Final = 8192
"""Widest reference model (:class:`~stage_runtime.models.CausalMixModel`,
:func:`~stage_runtime.models.reference_model_factory`, and so a topology's ``[model]`` table and
``serve --width``): it holds a ``width x width`` float64 matrix per stage (512 MiB at 8,192)."""

MAX_REQUESTS: Final = 200_000
"""Most requests a synthetic workload may have (100,000 take about 100 MB and 1 s to build)."""

MAX_PROMPT_TOKENS: Final = 1_000_000_000
"""Most prompt tokens, summed over the requests, a synthetic workload may have."""

MAX_BLOCKS: Final = 20_000_000
"""Most blocks, summed over the requests' prompts, a synthetic workload may hold: what its
memory grows with (a small ``block_size`` makes many)."""

MAX_VIRTUAL_BYTES: Final = 2**63 - 1
"""Largest virtual frame payload: numpy cannot index an array longer than this."""
