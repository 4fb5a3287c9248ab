"""KvStageIntegration in paged mode, accounting in both modes, and tenant salts."""

from __future__ import annotations

import tracemalloc
from typing import Any

import attrs
import numpy as np
import numpy.typing as npt
import pytest

from stage_runtime import (
    ActivationFrame,
    ActivationLayout,
    CacheIndex,
    CacheMode,
    ConfigError,
    KvCacheConfig,
    StageConfig,
)
from stage_runtime.cache.results import ActivationRestore, prefill_kv_identity
from stage_runtime.config import MessageBase
from stage_runtime.integration import (
    KvStageIntegration,
    LadderStageIntegration,
    PagedStageIntegration,
)
from stage_runtime.tenancy import salted_prefix_hash

WIDTH = 4


def stage(index: str = "paged", **cache: object) -> StageConfig:
    """A stage with a small paged (or ladder) cache: pages of 4 tokens, min 4."""
    settings: dict[str, object] = {
        "mode": CacheMode.LOOKUP_RECORD,
        "min_tokens": 4,
        "shared_prefix_stride_tokens": 4,
        "max_entries": 1000,
        "index": index,
    }
    settings.update(cache)
    return StageConfig(
        stage_id="stage-0",
        model_id="test/model",
        layer_start=0,
        layer_end=4,
        downstream="stage-1",
        kv_cache=KvCacheConfig(**settings),  # type: ignore[arg-type]
    )


def integration(index: str = "paged", **cache: object) -> tuple[KvStageIntegration, StageConfig]:
    config = stage(index, **cache)
    kv = KvStageIntegration.from_config(config, environ={})
    assert kv is not None
    return kv, config


def causal_rows(tokens: list[int]) -> npt.NDArray[np.float32]:
    """Row j depends only on tokens[:j+1] (a running sum), like a causal model's output."""
    sums = np.cumsum(np.asarray(tokens, dtype=np.float32))
    return np.stack([sums + k for k in range(WIDTH)], axis=1).astype(np.float32)


def frame_of(tokens: list[int]) -> ActivationFrame:
    return ActivationFrame.from_array(causal_rows(tokens))


def envelope(base: dict[str, str]) -> MessageBase:
    return MessageBase(session_id=base.get("session_id", ""), cache_salt=base.get("cache_salt"))


def record(kv: KvStageIntegration, config: StageConfig, tokens: list[int], **base: str) -> None:
    kv.record_resident_activation(config, envelope(base), 0, tokens, WIDTH, frame_of(tokens))


def restored(kv: KvStageIntegration, config: StageConfig, tokens: list[int], **base: str) -> int:
    hit = kv.restore_resident_activation(config, envelope(base), 0, tokens, WIDTH)
    return 0 if hit is None else hit.token_count


def test_from_config_builds_the_index_the_config_names() -> None:
    """index = "paged" gives a PagedStageIntegration with pages of page_tokens; ladder does not."""
    kv, _ = integration("paged", page_tokens=8)
    assert isinstance(kv, PagedStageIntegration)
    assert kv.index.page_tokens == 8
    ladder, _ = integration("ladder")
    assert isinstance(ladder, LadderStageIntegration)
    assert not isinstance(ladder, PagedStageIntegration)
    assert stage("paged").kv_cache is not None
    assert stage("paged").kv_cache.index is CacheIndex.PAGED  # type: ignore[union-attr]


def test_paged_restores_any_page_boundary_and_the_exact_prompt() -> None:
    """A later prompt restores its longest cached run of pages, and the recorded rows."""
    kv, config = integration()
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    record(kv, config, prompt)
    assert restored(kv, config, prompt) == 10
    longer = [*prompt, 11, 12, 13]
    hit = kv.restore_resident_activation(config, MessageBase(), 0, longer, WIDTH)
    assert hit is not None
    assert hit.token_count == 8
    np.testing.assert_array_equal(hit.frame.rows(), causal_rows(longer)[:8])
    assert hit.identity.identity.token_count == 8
    assert hit.identity.identity.prefix_hash.startswith("blake3:")


@pytest.mark.parametrize("index", ["paged", "ladder"])
def test_a_hit_computes_its_identity_when_first_read(index: str) -> None:
    """A hit's identity is computed from its inputs when first read, once: the identity of the
    restored prefix, as prefill_kv_identity gives it; a restore takes one of the two forms."""
    kv, config = integration(index)
    prompt = list(range(1, 11))
    record(kv, config, prompt, session_id="s")
    base = envelope({"session_id": "s"})
    hit = kv.stage_cache.restore(base, prompt, WIDTH)
    assert hit is not None
    assert hit._identity is None
    assert "identity_of" not in repr(hit)
    inputs = hit._identity_of
    identity = hit.identity
    assert hit.identity is identity
    assert attrs.evolve(hit, entries=0).identity is identity  # (only the identity is kept)
    assert hit._identity_of is None
    count = hit.token_count
    again = prefill_kv_identity(config, base, 0, np.array(prompt, dtype=np.int32), count, "x")
    assert attrs.evolve(identity.identity, prefix_hash="x") == again.identity
    assert identity.namespace == again.namespace
    assert identity.token_ids.tolist() == prompt[:count]
    assert not identity.token_ids.flags.writeable
    assert identity.page_id.startswith(f"stage-0:0:{count}:0:")
    assert identity.identity.prefix_hash.startswith("blake3:")
    given = ActivationRestore(
        identity=again,
        page_id=hit.page_id,
        token_count=count,
        payload_bytes=hit.payload_bytes,
        entries=hit.entries,
        desc=hit.desc,
        whole=hit.frame(),
    )
    assert given.identity is again
    neither: dict[str, Any] = {}
    both: dict[str, Any] = {"identity": again, "identity_of": inputs}
    for given_ids in (neither, both):
        with pytest.raises(TypeError, match="exactly one of identity and identity_of"):
            ActivationRestore(
                page_id="p", token_count=1, payload_bytes=0, entries=0, desc=hit.desc, **given_ids
            )


def test_paged_mode_hits_where_the_ladder_cannot() -> None:
    """Ladder records only [N, near-tail]; paged also restores shorter shared prefixes."""
    tokens = list(range(1, 21))
    other = [*tokens[:9], 99, 98, 97]  # shares 9 tokens: 2 pages
    paged, pconfig = integration("paged")
    ladder, lconfig = integration("ladder")
    for kv, config in ((paged, pconfig), (ladder, lconfig)):
        record(kv, config, tokens)
    assert restored(paged, pconfig, other) == 8
    assert restored(ladder, lconfig, other) == 0


def test_paged_record_reports_new_bytes_and_shares_pages() -> None:
    """The second prompt's record stores only its new pages; resident equals unique bytes."""
    kv, config = integration()
    first = list(range(1, 13))
    second = [*first[:8], 50, 51, 52, 53, 54]
    records_1 = kv.record_resident_activation(
        config, MessageBase(), 0, first, WIDTH, frame_of(first)
    )
    records_2 = kv.record_resident_activation(
        config, MessageBase(), 0, second, WIDTH, frame_of(second)
    )
    bpt = WIDTH * 4
    assert [(r.token_count, r.payload_bytes) for r in records_1] == [(12, 12 * bpt)]
    assert [(r.token_count, r.payload_bytes) for r in records_2] == [(13, 5 * bpt)]
    acc = kv.accounting()
    assert acc.resident_bytes == 17 * bpt
    assert acc.unique_prefix_bytes == 17 * bpt


def test_ladder_accounting_shows_duplicate_prefix_bytes() -> None:
    """The ladder keeps N and its near-tail rung: about twice the unique-prefix bytes."""
    kv, config = integration("ladder")
    tokens = list(range(1, 14))
    record(kv, config, tokens)
    acc = kv.accounting()
    bpt = WIDTH * 4
    assert acc.index == "ladder"
    assert acc.entries == 2
    assert acc.resident_bytes == (13 + 12) * bpt
    assert acc.unique_prefix_bytes == 13 * bpt
    assert acc.residency_ratio == pytest.approx(25 / 13)


@pytest.mark.parametrize("index", ["ladder", "paged"])
def test_accounting_counts_hits_misses_and_restored_tokens(index: str) -> None:
    """Both modes count lookups, hits, restored tokens and misses by reason."""
    kv, config = integration(index, max_entries=2 if index == "ladder" else 3)
    a = list(range(1, 13))
    assert restored(kv, config, a) == 0  # never seen
    record(kv, config, a)
    assert restored(kv, config, a) == 12
    record(kv, config, list(range(100, 113)))  # evicts a's entries
    assert restored(kv, config, a) == 0  # evicted
    acc = kv.accounting()
    assert acc.lookups == 3
    assert acc.hits == 1
    assert acc.restored_tokens == 12
    assert (acc.misses_never_seen, acc.misses_evicted, acc.misses_rejected) == (1, 1, 0)
    assert acc.misses == 2
    assert kv.stats().hits == 1


def test_ladder_rejected_miss_reason() -> None:
    """A ladder entry whose token count disagrees with its key is a rejected miss."""
    kv, config = integration("ladder", min_tokens=4)
    tokens = list(range(1, 7))
    record(kv, config, tokens)
    keys = list(kv.cache.keys())
    assert len(keys) == 2
    bad = ActivationFrame.from_array(causal_rows(tokens[:5]))
    for key in keys:  # both candidates now hold a 5-token frame
        kv.cache.record(key, 5, bad.payload.size, bad)
    assert restored(kv, config, tokens) == 0
    assert kv.accounting().misses_rejected == 1


@pytest.mark.parametrize("index", ["ladder", "paged"])
def test_salted_tenant_cannot_hit_another_tenants_prefix(index: str) -> None:
    """Different salts (or salt vs none) never share; the same salt does."""
    kv, config = integration(index)
    tokens = list(range(1, 13))
    record(kv, config, tokens, cache_salt="tenant-a")
    assert restored(kv, config, tokens, cache_salt="tenant-b") == 0
    assert restored(kv, config, tokens) == 0
    assert restored(kv, config, tokens, cache_salt="tenant-a") == 12
    record(kv, config, tokens)
    assert restored(kv, config, tokens, session_id="another-session") == 12
    assert kv.accounting().misses_never_seen == 2


@pytest.mark.parametrize("index", ["ladder", "paged"])
def test_a_salted_tenant_cannot_probe_another_tenants_evictions(index: str) -> None:
    """Another tenant's evicted prefix is a never_seen miss, not evicted: nothing leaks."""
    kv, config = integration(index, max_entries=2 if index == "ladder" else 3)
    tokens = list(range(1, 13))
    record(kv, config, tokens, cache_salt="tenant-a")
    record(kv, config, list(range(100, 113)), cache_salt="tenant-a")  # evicts the first prompt
    reasons = []
    for salt in ("tenant-b", None, "tenant-a"):
        assert restored(kv, config, tokens, **({} if salt is None else {"cache_salt": salt})) == 0
        reasons.append(kv.last_miss_reason)
    assert reasons == ["never_seen", "never_seen", "evicted"]
    acc = kv.accounting()
    assert (acc.misses_never_seen, acc.misses_evicted, acc.misses_rejected) == (2, 1, 0)


def test_a_ladder_restore_does_no_more_work_when_another_tenant_holds_the_same_tokens(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Whether tenant b recorded the same prompt must not change what tenant a's (missing)
    restore computes, or its latency would tell: the ladder used to hash and probe the lengths
    where b's key had the same token fingerprint."""
    from stage_runtime.cache import prompt as prompt_module

    tokens = list(range(1, 13))
    hashed: list[list[int]] = []
    real = prompt_module._hash_counts  # type: ignore[attr-defined]

    def spy(*args: Any) -> Any:
        hashed.append(list(args[2]))  # the lengths asked for
        return real(*args)

    for b_sent in (False, True):
        kv, config = integration("ladder")
        if b_sent:
            record(kv, config, tokens, cache_salt="tenant-b")
        with monkeypatch.context() as patch:
            patch.setattr(prompt_module, "_hash_counts", spy)
            assert restored(kv, config, tokens, cache_salt="tenant-a") == 0
        assert kv.last_miss_reason == "never_seen"
    assert hashed == []  # neither restore hashed anything


@pytest.mark.parametrize("index", ["ladder", "paged"])
def test_a_salted_tenant_cannot_hit_another_tenants_shorter_prefix(index: str) -> None:
    """A longer prompt of tenant b over tenant a's cached prefix restores nothing of it."""
    kv, config = integration(index)
    shared = list(range(1, 13))
    record(kv, config, shared, cache_salt="tenant-a")
    record(kv, config, [*shared, 77, 78, 79, 80], cache_salt="tenant-a")
    longer = [*shared, 77, 78, 79, 80]
    assert restored(kv, config, longer, cache_salt="tenant-b") == 0
    assert restored(kv, config, shared, cache_salt="tenant-b") == 0
    assert restored(kv, config, longer, cache_salt="tenant-a") == 16
    assert kv.accounting().hits == 1


def test_salted_hash_is_domain_separated_and_stable() -> None:
    """No salt keeps the upstream hash; salts give distinct, deterministic hashes."""
    h = "blake3:" + "ab" * 32
    assert salted_prefix_hash(h, None) == h
    assert salted_prefix_hash(h, "a") == salted_prefix_hash(h, "a")
    assert salted_prefix_hash(h, "a") != salted_prefix_hash(h, "b")
    with pytest.raises(ConfigError, match="cache_salt must be a non-empty string or None"):
        salted_prefix_hash(h, "")  # "" would be a tenant of its own, as MessageBase refuses


def test_streaming_restore_hands_out_page_views() -> None:
    """restore_resident_pages gives one frame per page, sharing memory with the cache."""
    kv, config = integration()
    assert isinstance(kv, PagedStageIntegration)
    tokens = list(range(1, 11))
    record(kv, config, tokens)
    first = kv.restore_resident_pages(config, MessageBase(), 0, tokens, WIDTH)
    second = kv.restore_resident_pages(config, MessageBase(), 0, tokens, WIDTH)
    assert first is not None
    assert second is not None
    assert [p.token_count for p in first.pages()] == [4, 4, 2]
    for a, b in zip(first.pages(), second.pages(), strict=True):
        assert np.shares_memory(a.payload, b.payload)
    np.testing.assert_array_equal(first.frame().rows(), causal_rows(tokens))


def test_a_paged_restore_is_assembled_with_at_most_one_copy() -> None:
    """restore_resident_activation over several pages allocates one prefix-sized payload."""
    kv, config = integration(page_tokens=256)
    tokens = list(range(1, 2049))
    frame = frame_of(tokens)
    kv.record_resident_activation(config, MessageBase(), 0, tokens, WIDTH, frame)
    tracemalloc.start()
    try:
        hit = kv.restore_resident_activation(config, MessageBase(), 0, tokens, WIDTH)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert hit is not None
    assert hit.token_count == 2048
    assert frame.payload.size <= peak < 1.5 * frame.payload.size
    np.testing.assert_array_equal(hit.frame.payload, frame.payload)


def test_opaque_and_flagged_frames_are_exact_length_entries_in_paged_mode() -> None:
    """Frames that cannot be paged restore only at their exact length."""
    kv, config = integration()
    tokens = list(range(1, 11))
    base = frame_of(tokens)
    for desc in (
        attrs.evolve(base.desc, layout=ActivationLayout.OPAQUE),
        attrs.evolve(base.desc, flags=1),
    ):
        kv.clear()
        frame = ActivationFrame(desc=desc, payload=base.payload)
        kv.record_resident_activation(config, MessageBase(), 0, tokens, WIDTH, frame)
        assert kv.accounting().entries == 1
        hit = kv.restore_resident_activation(config, MessageBase(), 0, tokens, WIDTH)
        assert hit is not None
        assert hit.frame.desc == desc
        assert restored(kv, config, [*tokens, 11]) == 0


def test_virtual_frames_restore_without_allocating() -> None:
    """A 200k-token virtual frame at 8 KiB per token records and restores as a zero-stride view."""
    kv, config = integration(page_tokens=512, max_entries=10_000)
    tokens = np.arange(200_000, dtype=np.int32)
    frame = ActivationFrame.virtual(token_count=tokens.size, bytes_per_token=8192)
    kv.record_resident_activation(config, MessageBase(), 0, tokens, WIDTH, frame)
    hit = kv.restore_resident_activation(config, MessageBase(), 0, tokens, WIDTH)
    assert hit is not None
    assert hit.frame.is_virtual
    assert hit.payload_bytes == tokens.size * 8192
    assert kv.accounting().resident_bytes == tokens.size * 8192


def test_paged_clear_and_bounds_report_evicted_entries() -> None:
    """Evictions and clear() come back as EvictedEntry values like the ladder's."""
    kv, config = integration(max_entries=2)
    records = kv.record_resident_activation(
        config, MessageBase(), 0, list(range(1, 13)), WIDTH, frame_of(list(range(1, 13)))
    )
    assert records[0].token_count == 8  # the third page did not fit beside its own chain
    records = kv.record_resident_activation(
        config, MessageBase(), 0, [7, 7, 7, 7], WIDTH, frame_of([7, 7, 7, 7])
    )
    assert [(e.token_count, e.reason) for e in records[0].evicted] == [(4, "max_entries")]
    assert records[0].evicted_entries == 1
    cleared = kv.clear()
    assert {e.reason for e in cleared} == {"cleared"}
    assert len(cleared) == 2
    assert kv.stats().entries == 0


def test_reused_token_buffer_is_not_mistaken_for_the_previous_prompt() -> None:
    """A caller refilling one token buffer between restore and record gets the new prompt's keys."""
    kv, config = integration()
    buffer = np.arange(1, 13, dtype=np.int32)
    assert kv.restore_resident_activation(config, MessageBase(), 0, buffer, WIDTH) is None
    buffer[:] = np.arange(101, 113, dtype=np.int32)
    frame = frame_of([int(t) for t in buffer])
    kv.record_resident_activation(config, MessageBase(), 0, buffer, WIDTH, frame)
    assert restored(kv, config, list(range(101, 113))) == 12
    assert restored(kv, config, list(range(1, 13))) == 0


def test_pages_of_one_row_description_share_one_meta_object() -> None:
    """Records with equal row descriptions (counts aside) store one shared ``meta``; another
    dtype gets its own, and a restore still joins only pages that agree."""
    kv, config = integration()
    assert isinstance(kv, PagedStageIntegration)
    record(kv, config, [1, 2, 3, 4])
    record(kv, config, [1, 2, 3, 4, 5, 6, 7, 8])
    half = ActivationFrame.from_array(causal_rows([9, 9, 9, 9]).astype(np.float16))
    kv.record_resident_activation(config, MessageBase(), 0, [9, 9, 9, 9], WIDTH, half)
    metas = [entry.meta for entry in kv.index._entries.values()]
    assert len(metas) == 3
    assert len({id(m) for m in metas}) == 2  # the two float32 pages share one object
    assert metas[0] == metas[1]
    assert metas[0] != metas[2]
    assert restored(kv, config, [1, 2, 3, 4, 5, 6, 7, 8]) == 8


def _bounded_paged(
    max_bytes: int, page_tokens: int, eviction: str = "lru"
) -> tuple[KvStageIntegration, StageConfig]:
    return integration(
        "paged",
        min_tokens=0,
        page_tokens=page_tokens,
        shared_prefix_stride_tokens=page_tokens,
        max_bytes=max_bytes,
        page_eviction=eviction,
    )


@pytest.mark.parametrize("eviction", ["lru", "reuse", "adaptive"])
def test_a_record_that_can_store_nothing_evicts_nothing(eviction: str) -> None:
    """32-byte pages under a 20-byte bound never fit: the cached 16-byte tail must stay."""
    kv, config = _bounded_paged(max_bytes=20, page_tokens=4, eviction=eviction)
    base = MessageBase()
    short = np.array([7, 7], np.int32)
    kv.record_resident_activation(
        config, base, 0, short, 2, ActivationFrame.from_array(np.ones((2, 2), np.float32))
    )
    long = np.arange(12, dtype=np.int32)
    records = kv.record_resident_activation(
        config, base, 0, long, 2, ActivationFrame.from_array(np.ones((12, 2), np.float32))
    )
    assert sum(record.evicted_entries for record in records) == 0
    stats = kv.stats()
    assert (stats.entries, stats.resident_bytes, stats.evictions) == (1, 16, 0)
    hit = kv.restore_resident_activation(config, base, 0, short, 2)
    assert hit is not None
    assert hit.token_count == 2


@pytest.mark.parametrize("eviction", ["lru", "reuse", "adaptive"])
def test_a_refused_re_record_evicts_nothing(eviction: str) -> None:
    """Re-recording a cached page with rows too large for the bound keeps the old rows, and no
    other entry is evicted for a room that is then not used."""
    kv, config = _bounded_paged(max_bytes=24, page_tokens=2, eviction=eviction)
    base = MessageBase()
    prompt, other = np.array([1, 2], np.int32), np.array([9], np.int32)
    f16 = np.float16
    kv.record_resident_activation(
        config, base, 0, other, 4, ActivationFrame.from_array(np.ones((1, 4), f16))
    )
    kv.record_resident_activation(
        config, base, 0, prompt, 4, ActivationFrame.from_array(np.ones((2, 4), f16))
    )
    kv.record_resident_activation(
        config, base, 0, prompt, 4, ActivationFrame.from_array(np.ones((2, 4), np.float32))
    )
    assert kv.stats().evictions == 0
    kept = kv.restore_resident_activation(config, base, 0, prompt, 4)
    assert kept is not None
    assert kept.frame.desc.dtype.name == "F16"
    assert kv.restore_resident_activation(config, base, 0, other, 4) is not None
