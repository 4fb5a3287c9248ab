"""Tests of the cache actor: the seed's scenarios through messages, log events, bad messages."""

from __future__ import annotations

import array
import collections
import re
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from typing import Any, assert_type

import attrs
import numpy as np
import pytest
import structlog
import trio

from actors import ActorRef, open_actor
from actors.testing import LogEvent, capture_actor_logs, events_named
from stage_runtime.cache import EvictedEntry, LadderIndex, ResidentCacheStats
from stage_runtime.cache_actor import (
    CacheActor,
    CacheMessage,
    CacheStats,
    CacheStatsRequest,
    ClearCache,
    RecordActivation,
    RestoreActivation,
    RestoreActivationPages,
)
from stage_runtime.config import (
    CacheMode,
    CachePayload,
    KvCacheConfig,
    LoadMode,
    MessageBase,
    StageConfig,
)
from stage_runtime.errors import ConfigError, FrameError
from stage_runtime.frames import ActivationDType, ActivationFrame, ActivationLayout
from stage_runtime.integration import (
    PagedActivationRestore,
    ResidentActivationRecord,
    ResidentActivationRestore,
)

BASE = MessageBase(session_id="session", chat_template_id="template")
WIDTH = 4096


def seed_config(**cache: Any) -> StageConfig:
    """The upstream activation tests' stage (spec §9.3), with cache overrides."""
    kv = KvCacheConfig(
        mode=CacheMode.LOOKUP_RECORD,
        payload=CachePayload.RESIDENT_KV,
        max_entries=cache.pop("max_entries", 8),
        max_bytes=cache.pop("max_bytes", 0),
        min_tokens=cache.pop("min_tokens", 256),
        shared_prefix_stride_tokens=cache.pop("stride", 128),
        shared_prefix_record_limit=2,
        index=cache.pop("index", "ladder"),
        page_eviction=cache.pop("page_eviction", "lru"),
    )
    assert not cache
    return StageConfig(
        model_id="org/model:Q4_K_M",
        stage_id="stage-0",
        stage_index=0,
        layer_start=0,
        layer_end=4,
        ctx_size=8192,
        lane_count=2,
        load_mode=LoadMode.RUNTIME_SLICE,
        kv_cache=kv,
    )


def seed_frame(tokens: int, payload_bytes: int, *, flags: int = 0) -> ActivationFrame:
    """The upstream's Frame(T, B): F32, token-major, payload of B bytes of 7."""
    return ActivationFrame.virtual(
        token_count=tokens,
        bytes_per_token=payload_bytes // tokens,
        dtype=ActivationDType.F32,
        layout=ActivationLayout.TOKEN_MAJOR,
        layer_end=4,
        flags=flags,
        fill=7,
    )


def tokens(n: int, start: int = 0) -> np.ndarray[Any, np.dtype[np.int32]]:
    return np.arange(start, start + n, dtype=np.int32)


@pytest.fixture
def logs() -> Iterator[list[LogEvent]]:
    """Capture log events with contextvars merged."""
    with capture_actor_logs() as captured:
        yield captured


@asynccontextmanager
async def cache_actor(config: StageConfig) -> AsyncIterator[ActorRef[CacheMessage, Any]]:
    with structlog.contextvars.bound_contextvars(stage=config.stage_id):
        async with open_actor(CacheActor(config), name="cache") as ref:
            yield ref


def record(
    toks: np.ndarray[Any, Any], frame: ActivationFrame, width: int = WIDTH
) -> RecordActivation:
    return RecordActivation(base=BASE, tokens=toks, activation_width=width, frame=frame)


def restore(toks: np.ndarray[Any, Any], width: int = WIDTH) -> RestoreActivation:
    return RestoreActivation(base=BASE, tokens=toks, activation_width=width)


async def stats_of(ref: ActorRef[CacheMessage, Any]) -> CacheStats:
    stats = await ref.ask(CacheStatsRequest())  # typed CacheStats | None: the message says so
    assert stats is not None
    return stats


def fields(event: LogEvent, *names: str) -> tuple[Any, ...]:
    return tuple(event[name] for name in names)


async def test_record_2214_tokens_records_2214_and_2176(logs: list[LogEvent]) -> None:
    """The seed's 2214-token prompt records its exact length and the grid floor 2176."""
    async with cache_actor(seed_config()) as ref:
        records = await ref.ask(record(tokens(2214), seed_frame(2214, 8856)))
    assert [r.token_count for r in records] == [2214, 2176]
    assert [r.payload_bytes for r in records] == [8856, 8704]
    recorded = events_named(logs, "activation_recorded")
    assert [fields(e, "token_count", "entries", "resident_bytes") for e in recorded] == [
        (2214, 1, 8856),
        (2176, 2, 8856 + 8704),
    ]
    assert all(e["decision"] == "activation_record" and e["stage"] == "stage-0" for e in recorded)
    assert recorded[0]["page_id"] == records[0].page_id


async def test_extended_2231_prompt_restores_the_2176_grid_page(logs: list[LogEvent]) -> None:
    """2214 + 17 new tokens restore 2176 tokens (8704 bytes): a prefix-short hit."""
    async with cache_actor(seed_config()) as ref:
        await ref.ask(record(tokens(2214), seed_frame(2214, 8856)))
        extended = np.concatenate([tokens(2214), tokens(17, start=100_000)])
        hit = await ref.ask(restore(extended))
    assert hit is not None
    assert (hit.token_count, hit.identity.identity.token_count) == (2176, 2176)
    assert (hit.frame.token_count, hit.frame.payload.size) == (2176, 8704)
    (event,) = events_named(logs, "activation_restored")
    assert fields(event, "token_count", "requested_tokens", "payload_bytes", "decision") == (
        2176,
        2231,
        8704,
        "activation_hit_prefix_short",
    )
    assert event["stage"] == "stage-0"


async def test_exact_restore_is_a_resident_hit(logs: list[LogEvent]) -> None:
    """Restoring the recorded prompt itself covers every token: activation_resident_hit."""
    async with cache_actor(seed_config()) as ref:
        frame = seed_frame(300, 1200)
        await ref.ask(record(tokens(300), frame))
        hit = await ref.ask(restore(tokens(300)))
    assert hit is not None
    assert hit.frame.same_content(frame)
    (event,) = events_named(logs, "activation_restored")
    assert event["decision"] == "activation_resident_hit"


async def test_width_mismatch_misses(logs: list[LogEvent]) -> None:
    """A frame recorded at width 4096 is never restored at width 8192."""
    async with cache_actor(seed_config()) as ref:
        await ref.ask(record(tokens(300), seed_frame(300, 1200)))
        assert await ref.ask(restore(tokens(300), width=8192)) is None
    (event,) = events_named(logs, "activation_missed")
    # lookup candidates of 300 at min 256 / stride 128: [300, 256]
    assert fields(event, "requested_tokens", "candidates_tried", "decision") == (
        300,
        2,
        "activation_resident_miss",
    )


async def test_eviction_log_with_max_entries_1(logs: list[LogEvent]) -> None:
    """With one entry, each ladder rung evicts the previous one: one event per eviction."""
    async with cache_actor(seed_config(max_entries=1)) as ref:
        first = await ref.ask(record(tokens(2214), seed_frame(2214, 8856)))
        second = await ref.ask(record(tokens(300, start=50_000), seed_frame(300, 1200)))
    evicted = events_named(logs, "activation_evicted")
    names = ("page_id", "token_count", "payload_bytes", "reason", "entries", "resident_bytes")
    assert [fields(e, *names) for e in evicted] == [
        (first[0].page_id, 2214, 8856, "max_entries", 0, 0),
        (first[1].page_id, 2176, 8704, "max_entries", 0, 0),
        (second[0].page_id, 300, 1200, "max_entries", 0, 0),
    ]
    assert all(e["log_level"] == "info" and e["stage"] == "stage-0" for e in evicted)
    assert [e.token_count for r in (*first, *second) for e in r.evicted] == [2214, 2176, 300]


async def test_eviction_log_with_max_bytes(logs: list[LogEvent]) -> None:
    """A byte bound evicts least recently used entries until the new one fits."""
    config = seed_config(max_bytes=100, min_tokens=4, stride=4)
    async with cache_actor(config) as ref:
        a = await ref.ask(record(tokens(10), seed_frame(10, 40)))  # rungs 10 (40 B), 8 (32 B)
        assert await ref.ask(restore(tokens(10), width=WIDTH)) is not None  # 10 is now MRU
        b = await ref.ask(record(tokens(6, start=500), seed_frame(6, 24)))  # 6 (24 B), 4 (16 B)
    evicted = events_named(logs, "activation_evicted")
    names = ("page_id", "token_count", "payload_bytes", "reason", "entries", "resident_bytes")
    # 96 B resident when the 16 B rung arrives: the LRU entry (8 tokens) goes.
    assert [fields(e, *names) for e in evicted] == [
        (a[1].page_id, 8, 32, "max_bytes", 2, 64),
    ]
    assert (b[1].entries, b[1].resident_bytes) == (3, 80)


@pytest.mark.parametrize(
    ("index", "eviction", "expected", "final"),
    [
        # Rungs 10 (40 B) and 8 (32 B) per prompt: each rung of prompts 2 and 3 past the third
        # entry evicts the oldest rung, leaving 2 entries (72 B) before it is stored.
        (
            "ladder",
            "lru",
            [
                (10, 40, "max_entries", 2, 72),
                (8, 32, "max_entries", 2, 72),
                (10, 40, "max_entries", 2, 72),
            ],
            (3, 104),
        ),
        # Pages 0+4, 4+4 (16 B each) and tail 8+2 (8 B) per prompt, evicted leaves first (tail,
        # then pages from the end). Under LRU a record makes room for its two new pages at once,
        # then for its tail.
        (
            "paged",
            "lru",
            [
                (2, 8, "max_entries", 2, 32),
                (4, 16, "max_entries", 1, 16),
                (4, 16, "max_entries", 2, 32),
                (2, 8, "max_entries", 2, 32),
                (4, 16, "max_entries", 1, 16),
                (4, 16, "max_entries", 2, 32),
            ],
            (3, 40),
        ),
        # Under reuse eviction it makes room page by page: one eviction before each entry.
        (
            "paged",
            "reuse",
            [
                (2, 8, "max_entries", 2, 32),
                (4, 16, "max_entries", 2, 32),
                (4, 16, "max_entries", 2, 32),
                (2, 8, "max_entries", 2, 32),
                (4, 16, "max_entries", 2, 32),
                (4, 16, "max_entries", 2, 32),
            ],
            (3, 40),
        ),
    ],
)
async def test_eviction_events_carry_the_cache_size_after_each_eviction(
    logs: list[LogEvent],
    index: str,
    eviction: str,
    expected: list[tuple[Any, ...]],
    final: tuple[int, int],
) -> None:
    """activation_evicted reports the true entries/resident_bytes after each eviction."""
    config = seed_config(index=index, page_eviction=eviction, max_entries=3, min_tokens=4, stride=4)
    async with cache_actor(config) as ref:
        replies = [
            await ref.ask(record(tokens(10, start=1000 * i), seed_frame(10, 40))) for i in range(3)
        ]
        stats = await stats_of(ref)
    evicted = events_named(logs, "activation_evicted")
    names = ("token_count", "payload_bytes", "reason", "entries", "resident_bytes")
    assert [fields(e, *names) for e in evicted] == expected
    keys = [entry.key for reply in replies for rec in reply for entry in rec.evicted]
    assert [e["page_id"] for e in evicted] == keys
    assert (stats.entries, stats.resident_bytes) == final


async def test_clear_logs_every_entry_as_cleared(logs: list[LogEvent]) -> None:
    """ClearCache evicts everything, one 'cleared' event per entry, sizes counting down."""
    async with cache_actor(seed_config()) as ref:
        await ref.ask(record(tokens(2214), seed_frame(2214, 8856)))
        cleared = await ref.ask(ClearCache())
        stats = await stats_of(ref)
    assert sorted(e.token_count for e in cleared) == [2176, 2214]
    evicted = events_named(logs, "activation_evicted")
    assert [e["reason"] for e in evicted] == ["cleared", "cleared"]
    assert [e["entries"] for e in evicted] == [1, 0]
    assert evicted[-1]["resident_bytes"] == 0
    assert (stats.entries, stats.resident_bytes) == (0, 0)


async def test_stats_count_records_lookups_hits_and_misses() -> None:
    """CacheStatsRequest replies the cache's counters."""
    async with cache_actor(seed_config()) as ref:
        await ref.ask(record(tokens(300), seed_frame(300, 1200)))
        await ref.ask(restore(tokens(300)))
        await ref.ask(restore(tokens(300, start=9)))
        stats = await stats_of(ref)
    assert (stats.entries, stats.records) == (2, 2)
    assert stats.hits == 1
    assert stats.misses >= 1


@pytest.mark.parametrize("index", ["ladder", "paged"])
async def test_misses_name_their_reason_never_seen_then_evicted(
    logs: list[LogEvent], index: str
) -> None:
    """activation_missed says never_seen before a record, evicted once the bound pushed it out."""
    # Ladder: 2 entries per 300-token prompt; paged: 2 pages of 128 + a tail.
    config = seed_config(index=index, max_entries=2 if index == "ladder" else 3)
    other = tokens(300, start=10_000)
    async with cache_actor(config) as ref:
        assert await ref.ask(restore(tokens(300))) is None
        await ref.ask(record(tokens(300), seed_frame(300, 1200)))
        hit = await ref.ask(restore(tokens(300)))
        await ref.ask(record(other, seed_frame(300, 1200)))  # evicts every entry of the first
        assert await ref.ask(restore(tokens(300))) is None
        stats = await stats_of(ref)
    assert hit is not None
    assert hit.token_count == 300
    missed = events_named(logs, "activation_missed")
    assert [e["reason"] for e in missed] == ["never_seen", "evicted"]
    assert all(e["decision"] == "activation_resident_miss" for e in missed)
    # The ladder probes its grid for 300 tokens (300, 256); paged walks one page chain.
    assert [e["candidates_tried"] for e in missed] == ([2, 2] if index == "ladder" else [1, 1])
    acc = stats.accounting
    assert acc.index == index
    assert (acc.lookups, acc.hits, acc.restored_tokens) == (3, 1, 300)
    assert (acc.misses_never_seen, acc.misses_evicted, acc.misses_rejected) == (1, 1, 0)


@pytest.mark.parametrize("index", ["ladder", "paged"])
async def test_stats_reply_keeps_the_counters_and_adds_the_accounting(index: str) -> None:
    """CacheStatsRequest replies CacheStats: the old counters plus resident vs unique bytes."""
    async with cache_actor(seed_config(index=index)) as ref:
        await ref.ask(record(tokens(300), seed_frame(300, 1200)))
        stats = await stats_of(ref)
    assert isinstance(stats, CacheStats)
    assert isinstance(stats, ResidentCacheStats)  # code written for the old reply still works
    assert stats.resident_bytes == stats.accounting.resident_bytes
    assert stats.entries == stats.accounting.entries
    assert stats.accounting.unique_prefix_bytes == 1200  # 300 distinct tokens x 4 bytes
    if index == "ladder":  # the 300 and 256 rungs are two full copies
        assert stats.resident_bytes == 1200 + 1024
    else:  # pages are stored once
        assert stats.resident_bytes == 1200
    assert stats.accounting.residency_ratio == pytest.approx(stats.resident_bytes / 1200)


async def test_ladder_miss_on_a_refused_entry_is_rejected(logs: list[LogEvent]) -> None:
    """A ladder entry that fails validation (token count disagrees) is a 'rejected' miss."""
    actor = CacheActor(seed_config())
    with structlog.contextvars.bound_contextvars(stage="stage-0"):
        async with open_actor(actor, name="cache") as ref:
            await ref.ask(record(tokens(300), seed_frame(300, 1200)))
            # Corrupt both rungs behind the actor's back: each now holds a 299-token frame.
            index = actor._cache.index if actor._cache is not None else None
            assert isinstance(index, LadderIndex)
            cache = index.store
            bad = seed_frame(299, 1196)
            for key in list(cache.keys()):
                cache.record(key, 299, bad.payload.size, bad)
            assert await ref.ask(restore(tokens(300))) is None
            stats = await stats_of(ref)
    (event,) = events_named(logs, "activation_missed")
    assert event["reason"] == "rejected"
    assert stats.accounting.misses_rejected == 1


async def test_paged_miss_on_a_refused_tail_is_rejected(logs: list[LogEvent]) -> None:
    """Pages re-recorded in another row size make the old tail invalid: a 'rejected' miss."""
    config = seed_config(index="paged", min_tokens=300)
    sibling = np.concatenate([tokens(256), tokens(44, start=50_000)])
    async with cache_actor(config) as ref:
        await ref.ask(record(tokens(300), seed_frame(300, 1200)))  # 4 bytes per token
        await ref.ask(record(sibling, seed_frame(300, 2400)))  # same pages, 8 bytes per token
        assert await ref.ask(restore(tokens(300))) is None
        stats = await stats_of(ref)
    (event,) = events_named(logs, "activation_missed")
    assert event["reason"] == "rejected"
    assert stats.accounting.misses_rejected == 1


async def test_disabled_cache_restores_nothing_and_has_no_stats() -> None:
    """A stage without a cache replies None/[]/None and never stores anything."""
    config = attrs.evolve(seed_config(), kv_cache=KvCacheConfig(mode=CacheMode.DISABLED))
    actor = CacheActor(config, environ={})
    assert not actor.should_lookup
    assert not actor.should_record
    async with open_actor(actor, name="cache") as ref:
        assert await ref.ask(record(tokens(300), seed_frame(300, 1200))) == []
        assert await ref.ask(restore(tokens(300))) is None
        assert await ref.ask(CacheStatsRequest()) is None
        assert await ref.ask(ClearCache()) == ()


@pytest.mark.parametrize(
    ("message", "error", "match"),
    [
        (
            RestoreActivation(base=BASE, tokens=np.array([1.5]), activation_width=WIDTH),
            ConfigError,
            "tokens must be integers",
        ),
        (
            RestoreActivation(base=BASE, tokens=tokens(300), activation_width=-1),
            ConfigError,
            "activation_width must be an integer >= 0, got -1",
        ),
        (
            RecordActivation(base=BASE, tokens=tokens(300), activation_width=WIDTH, frame="x"),  # type: ignore[arg-type]
            FrameError,
            "frame must be an ActivationFrame, got str",
        ),
        (
            RestoreActivation(base="base", tokens=tokens(300), activation_width=WIDTH),  # type: ignore[arg-type]
            ConfigError,
            "base must be a MessageBase, got str",
        ),
        (
            RestoreActivation(base=BASE, tokens=None, activation_width=WIDTH),  # type: ignore[arg-type]
            ConfigError,
            "tokens must be a sequence of integers, got NoneType",
        ),
        (
            RecordActivation(
                base=BASE, tokens=tokens(300), activation_width=WIDTH, frame=seed_frame(299, 1196)
            ),
            FrameError,
            "frame must cover the 300 tokens, got 299 tokens",
        ),
        (
            RecordActivation(
                base=BASE,
                tokens=tokens(300),
                activation_width=4,
                frame=ActivationFrame.from_array(np.zeros((300, 8), dtype=np.float32)),
            ),
            FrameError,
            "frame rows must be activation_width 4 F32 values wide, got 8",
        ),
        (
            RecordActivation(
                base=BASE,
                tokens=tokens(300),
                activation_width=4,
                frame=ActivationFrame(  # 3 bytes per token: not whole F32 values
                    desc=attrs.evolve(seed_frame(300, 900).desc),
                    payload=np.zeros(900, dtype=np.uint8),
                ),
            ),
            FrameError,
            "frame rows must be activation_width 4 F32 values wide, got 0.75",
        ),
        (
            RestoreActivation(
                base=BASE, tokens=tokens(300), activation_width=WIDTH, token_start=-1
            ),
            ConfigError,
            "token_start must be an integer >= 0, got -1",
        ),
        (
            RestoreActivation(base=BASE, tokens=tokens(300), activation_width=True),
            ConfigError,
            "activation_width must be an integer >= 0, got True",
        ),
        (
            RestoreActivation(
                base=BASE, tokens=np.zeros((2, 150), dtype=np.int32), activation_width=WIDTH
            ),
            ConfigError,
            "tokens must be 1-D, got shape (2, 150)",
        ),
        ("hello", ConfigError, "message must be RestoreActivation"),
    ],
)
async def test_malformed_message_fails_the_ask_and_leaves_the_cache_unchanged(
    logs: list[LogEvent], message: Any, error: type[Exception], match: str
) -> None:
    """A bad message raises a typed error in the caller; the actor and the cache carry on."""
    async with cache_actor(seed_config()) as ref:
        await ref.ask(record(tokens(300), seed_frame(300, 1200)))
        before = await stats_of(ref)
        with pytest.raises(error, match=re.escape(match)):
            await ref.ask(message)
        after = await stats_of(ref)
        assert await ref.ask(restore(tokens(300))) is not None
    assert (after.entries, after.resident_bytes, after.records) == (
        before.entries,
        before.resident_bytes,
        before.records,
    )
    [failed] = events_named(logs, "actor_message_failed")
    assert (failed["log_level"], failed["error_type"]) == ("warning", error.__name__)
    assert match in failed["error"]
    assert "exc_info" not in failed  # the caller has the exception: no traceback in the log


async def test_cancelled_restore_does_not_kill_the_actor() -> None:
    """Cancelling an ask midway leaves the actor serving."""
    async with cache_actor(seed_config()) as ref:
        with trio.CancelScope() as scope:
            scope.cancel()
            await ref.ask(restore(tokens(300)))
        assert scope.cancelled_caught
        assert await ref.ask(restore(tokens(300))) is None


async def test_every_cache_event_has_its_fields_and_level(logs: list[LogEvent]) -> None:
    """Each event carries exactly its documented fields (plus stage/actor) at its level."""
    bound = {"event", "log_level", "stage", "actor"}
    async with cache_actor(seed_config(max_entries=2)) as ref:
        await ref.ask(restore(tokens(300)))  # miss
        await ref.ask(record(tokens(300), seed_frame(300, 1200)))  # 2 records
        await ref.ask(restore(tokens(300)))  # resident hit
        await ref.ask(record(tokens(300, start=7), seed_frame(300, 1200)))  # evicts 2
    expected = {
        "activation_missed": (
            "debug",
            {"requested_tokens", "candidates_tried", "decision", "reason"},
        ),
        "activation_recorded": (
            "debug",
            {"page_id", "token_count", "payload_bytes", "entries", "resident_bytes", "decision"},
        ),
        "activation_restored": (
            "debug",
            {"page_id", "token_count", "requested_tokens", "payload_bytes", "decision"},
        ),
        "activation_evicted": (
            "info",
            {"page_id", "token_count", "payload_bytes", "reason", "entries", "resident_bytes"},
        ),
    }
    seen = [e["event"] for e in logs if str(e["event"]).startswith("activation_")]
    assert seen == [
        "activation_missed",
        *["activation_recorded"] * 2,
        "activation_restored",
        *["activation_evicted", "activation_recorded"] * 2,
    ]
    for event in logs:
        if event["event"] in expected:
            level, names = expected[event["event"]]
            assert (event["log_level"], set(event)) == (level, names | bound), event
            assert (event["stage"], event["actor"]) == ("stage-0", "cache")


def test_messages_are_frozen() -> None:
    """Messages are immutable: a sender cannot change one after handing it to the actor."""
    messages: list[Any] = [
        restore(tokens(3)),
        record(tokens(3), seed_frame(3, 12)),
        CacheStatsRequest(),
        ClearCache(),
    ]
    for message in messages:
        with pytest.raises(attrs.exceptions.FrozenInstanceError):
            message.token_start = 1


async def test_a_paged_restore_can_be_asked_for_page_by_page() -> None:
    """RestoreActivationPages replies with the pages (views, nothing joined) where the index is
    paged; RestoreActivation with the assembled frame."""
    config = seed_config(index="paged", min_tokens=8, stride=8)  # pages of 8 tokens
    tokens = np.arange(32, dtype=np.int32)
    frame = ActivationFrame.from_array(np.ones((32, 4), np.float32))
    base = MessageBase()
    async with open_actor(CacheActor(config, environ={}), name="cache") as ref:
        await ref.ask(RecordActivation(base=base, tokens=tokens, activation_width=4, frame=frame))
        pages = await ref.ask(RestoreActivationPages(base=base, tokens=tokens, activation_width=4))
        whole = await ref.ask(RestoreActivation(base=base, tokens=tokens, activation_width=4))
    assert isinstance(pages, PagedActivationRestore)
    assert len(pages.pages()) == 4
    assert whole is not None
    assert whole.frame.same_content(pages.frame())


async def test_the_ladder_answers_a_page_by_page_restore_with_one_frame() -> None:
    """Both indexes reply to RestoreActivationPages with the same type; a ladder hit is one
    page, its cached frame, joined without a copy."""
    config = seed_config()
    frame = seed_frame(300, 1200)
    async with cache_actor(config) as ref:
        await ref.ask(record(tokens(300), frame))
        hit = await ref.ask(
            RestoreActivationPages(base=BASE, tokens=tokens(300), activation_width=WIDTH)
        )
    assert isinstance(hit, PagedActivationRestore)
    assert hit.token_count == 300
    assert hit.copy_bytes() == 0
    assert hit.pages() == (hit.frame(),)
    assert hit.frame() is frame


async def test_each_message_declares_its_reply_type() -> None:
    """To a type checker (mypy runs over the tests), ask() returns each message's own reply
    type: no casts, no Any (the actor's general reply type is Any)."""
    async with cache_actor(seed_config()) as ref:
        records = await ref.ask(record(tokens(300), seed_frame(300, 1200)))
        assert_type(records, list[ResidentActivationRecord])
        hit = await ref.ask(restore(tokens(300)))
        assert_type(hit, ResidentActivationRestore | None)
        paged = await ref.ask(
            RestoreActivationPages(base=BASE, tokens=tokens(300), activation_width=WIDTH)
        )
        assert_type(paged, PagedActivationRestore | None)
        stats = await ref.ask(CacheStatsRequest())
        assert_type(stats, CacheStats | None)
        cleared = await ref.ask(ClearCache())
        assert_type(cleared, tuple[EvictedEntry, ...])
    assert [r.token_count for r in records] == [300, 256]
    assert hit is not None
    assert stats is not None
    assert len(cleared) == stats.entries


@pytest.mark.parametrize("index", ["ladder", "paged"])
@pytest.mark.parametrize("kind", ["array", "list", "array.array", "memoryview", "deque"])
async def test_a_message_keeps_the_tokens_it_was_made_with(index: str, kind: str) -> None:
    """A told record waits in the mailbox; a caller that reuses its token buffer for the next
    prompt meanwhile must not change what gets recorded (it recorded prompt B's tokens under A's
    rows: B restored A's activations and A missed)."""
    makers: dict[str, Callable[[], Any]] = {
        "array": lambda: tokens(300),
        "list": lambda: list(range(300)),
        "array.array": lambda: array.array("i", range(300)),
        "memoryview": lambda: memoryview(array.array("i", range(300))),
        "deque": lambda: collections.deque(range(300)),
    }
    buffer = makers[kind]()
    first = tokens(300)
    async with cache_actor(seed_config(index=index)) as ref:
        ref.tell_nowait(record(buffer, seed_frame(300, 1200)))
        for i in range(300):  # the caller's next prompt, before the actor ran
            buffer[i] = 1000 + i
        assert await ref.ask(restore(tokens(300, start=1000))) is None
        hit = await ref.ask(restore(first))
    assert hit is not None
    assert hit.token_count == 300


async def test_a_read_only_array_that_owns_its_data_is_not_copied() -> None:
    """What the pipeline passes (a private read-only array) travels as is: no copy per message."""
    owned = tokens(300)
    owned.flags.writeable = False
    assert restore(owned).tokens is owned
    assert restore(tokens(300)).tokens is not owned
    view = owned[:200]
    assert restore(view).tokens is not view  # read-only, but its base may be written
