"""A two-stage pipeline serving a shared system prompt and multi-turn conversations.

Each stage owns a small activation cache (6 entries). Prompts that share a prefix with an earlier
one restore that prefix's activations instead of recomputing them; the table shows how many
tokens each stage restored and computed, and the log lines (on stderr) show every restore,
miss, record and eviction as structlog renders them on a console. The last lines are the
per-stage accounting from ``Pipeline.statistics()``: restores, hits and misses (by reason),
restored tokens and evictions.

Run it with ``python examples/two_stage_pipeline.py``.
"""

from __future__ import annotations

import logging
import sys

import numpy as np
import structlog
import trio

from stage_runtime import (
    CacheMode,
    KvCacheConfig,
    StageConfig,
    open_pipeline,
    reference_model_factory,
)

SYSTEM = (
    "You are a careful assistant for a railway operator. Answer briefly, cite the timetable "
    "section you used, and never guess a platform number. If a question is about tickets, "
    "point to the fares page. Keep a friendly tone and use metric units throughout."
)


def tokenize(text: str) -> np.ndarray[tuple[int], np.dtype[np.int32]]:
    """A byte-level toy tokenizer: one token per UTF-8 byte."""
    return np.frombuffer(text.encode(), dtype=np.uint8).astype(np.int32)


def conversations() -> list[tuple[str, str]]:
    """(label, prompt text) in the order they arrive: two conversations interleaved."""
    a1 = f"{SYSTEM}\nUser: When does the first train to Lyon leave on Sundays?"
    a2 = f"{a1}\nAssistant: At 06:12 from platform 3 (section 4.2).\nUser: And the last one?"
    b1 = f"{SYSTEM}\nUser: Can I take a bicycle on regional trains?"
    a3 = f"{a2}\nAssistant: At 22:40 (section 4.2).\nUser: Is there a dining car on it?"
    b2 = f"{b1}\nAssistant: Yes, outside peak hours (section 9.1).\nUser: Do I need a ticket?"
    return [("A turn 1", a1), ("A turn 2", a2), ("B turn 1", b1), ("A turn 3", a3),
            ("B turn 2", b2), ("A turn 3 again", a3)]  # fmt: skip


def configure_logging() -> None:
    """Console-rendered structlog events on stderr, debug level and up, so that stdout holds the
    example's own output (the library itself never configures logging)."""
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.dev.ConsoleRenderer(colors=False),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.DEBUG),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        cache_logger_on_first_use=False,
    )


def stages() -> list[StageConfig]:
    """Two stages of a 16-layer model, each caching on a 32-token grid, 6 entries at most."""
    cache = KvCacheConfig(
        mode=CacheMode.LOOKUP_RECORD,
        max_entries=6,
        min_tokens=64,
        shared_prefix_stride_tokens=32,
        shared_prefix_record_limit=3,
    )
    return [
        StageConfig(
            model_id="example/railway-assistant",
            stage_id=f"stage-{i}",
            stage_index=i,
            layer_start=8 * i,
            layer_end=8 * (i + 1),
            kv_cache=cache,
        )
        for i in range(2)
    ]


async def main() -> None:
    """Send the conversations through the pipeline and print what each stage did."""
    configure_logging()
    rows: list[str] = []
    total = 0  # prompt tokens sent
    async with open_pipeline(stages(), reference_model_factory(width=32), environ={}) as pipeline:
        for label, text in conversations():
            result = await pipeline.prefill(tokenize(text), session_id=label.split()[0])
            cells = "  ".join(
                f"{r.restored_tokens:>16} / {r.computed_tokens:<8}" for r in result.stages
            )
            rows.append(f"{label:<15} {result.tokens:>6}  {cells}".rstrip())
            total += result.tokens
        stats = await pipeline.statistics()
    print()
    heads = "  ".join(f"{stage.stage_id + ' restored':>16} / computed" for stage in stats.stages)
    print(f"{'prompt':<15} {'tokens':>6}  {heads}")
    print("\n".join(rows))
    print()
    for stage in stats.stages:
        acc = stage.accounting
        assert acc is not None
        print(
            f"{stage.stage_id}: {acc.lookups} restores: {acc.hits} hit, {acc.misses} missed "
            f"(never seen {acc.misses_never_seen}, evicted {acc.misses_evicted}, rejected "
            f"{acc.misses_rejected}); {acc.restored_tokens:,} of {total:,} prompt tokens restored"
        )
        print(
            f"{'':9}{acc.entries} entries resident ({acc.resident_bytes:,} bytes), "
            f"{acc.evictions} evicted, {stage.mailbox.processed} cache messages"
        )


if __name__ == "__main__":
    trio.run(main)
