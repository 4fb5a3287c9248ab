"""KvStageIntegration: modes, restore/record rules (spec §5), §9.2/§9.3 vectors, bad input."""

from __future__ import annotations

from typing import Any

import attrs
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stage_runtime import (
    ActivationFrame,
    ActivationLayout,
    CacheMode,
    ConfigError,
    FrameError,
    KvCacheConfig,
    StageConfig,
)
from stage_runtime.cache import ResidentActivationCache
from stage_runtime.cache import prompt as prompt_module
from stage_runtime.config import CachePayload, MessageBase
from stage_runtime.identity import activation_page_id, page_id, prefix_hash, prefix_namespace_hash
from stage_runtime.integration import (
    KvStageIntegration,
    ResidentActivationRecord,
    effective_cache_payload,
    summarize_records,
)

from ._seed import activation_frame, cache_state, seed_base, seed_config, seed_integration


def with_cache(**changes: Any) -> StageConfig:
    """The seed config with some kv_cache fields changed."""
    config = seed_config()
    assert config.kv_cache is not None
    return attrs.evolve(config, kv_cache=attrs.evolve(config.kv_cache, **changes))


# --- from_config and modes (spec §6) ----------------------------------------------------------


def test_from_config_none_without_settings_or_when_disabled() -> None:
    """No kv_cache and no environment, mode disabled, or mode auto: no integration."""
    config = seed_config()
    assert KvStageIntegration.from_config(attrs.evolve(config, kv_cache=None), environ={}) is None
    for mode in (CacheMode.DISABLED, CacheMode.AUTO):
        cfg = attrs.evolve(config, kv_cache=KvCacheConfig(mode=mode))
        assert KvStageIntegration.from_config(cfg, environ={}) is None


def test_a_kv_cache_block_without_mode_is_disabled() -> None:
    """§6: the serde default mode is auto, so a block that omits mode turns nothing on."""
    config = StageConfig.from_mapping(
        {
            "stage_id": "stage-0",
            "model_id": "org/model",
            "layer_start": 0,
            "layer_end": 4,
            "kv_cache": {"min_tokens": 256, "max_entries": 8},
        }
    )
    assert config.kv_cache is not None
    assert KvStageIntegration.from_config(config, environ={}) is None
    # The environment is read only without a block: "on" does not enable this one.
    assert KvStageIntegration.from_config(config, environ={"STAGE_RUNTIME_KV_CACHE": "on"}) is None


@pytest.mark.parametrize(("value", "enabled"), [("", False), ("auto", False), ("record", True)])
def test_environment_auto_is_disabled_and_record_records(value: str, enabled: bool) -> None:
    """§6.1 without a block: ""/auto give auto (off); record gives a record-only cache."""
    config = attrs.evolve(seed_config(), kv_cache=None)
    kv = KvStageIntegration.from_config(config, environ={"STAGE_RUNTIME_KV_CACHE": value})
    assert (kv is not None) is enabled
    if kv is not None:
        assert (kv.should_lookup(), kv.should_record()) == (False, True)


def test_from_config_reads_environment_when_no_block() -> None:
    """Without a kv_cache block the environment configures the cache."""
    config = attrs.evolve(seed_config(), kv_cache=None)
    kv = KvStageIntegration.from_config(
        config,
        environ={"STAGE_RUNTIME_KV_CACHE": "on", "STAGE_RUNTIME_KV_CACHE_MAX_ENTRIES": "3"},
    )
    assert kv is not None
    assert kv.should_lookup()
    assert kv.cache.max_entries == 3
    assert kv.policy.effective_stride == 64  # env defaults: min 64, stride 128


@pytest.mark.parametrize(
    ("kv_var", "prefix_var", "enabled"),
    [
        (None, None, True),
        ("on", None, True),
        ("off", None, False),
        (None, "off", False),
        ("on", "off", False),
        ("off", "on", False),
    ],
)
def test_kill_switch_overrides_a_kv_cache_block(
    kv_var: str | None, prefix_var: str | None, enabled: bool
) -> None:
    """Spec §6.1 vectors: either variable set to off disables a configured cache."""
    env = {}
    if kv_var is not None:
        env["STAGE_RUNTIME_KV_CACHE"] = kv_var
    if prefix_var is not None:
        env["STAGE_RUNTIME_PREFIX_CACHE"] = prefix_var
    assert (KvStageIntegration.from_config(seed_config(), environ=env) is not None) is enabled


def test_record_mode_records_but_never_looks_up() -> None:
    """There is no lookup-only mode; record mode stores but restore returns None."""
    config = attrs.evolve(seed_config(), kv_cache=KvCacheConfig(mode="record", min_tokens=256))
    kv = seed_integration(config)
    assert (kv.should_lookup(), kv.should_record()) == (False, True)
    tokens = list(range(300))
    assert (
        len(
            kv.record_resident_activation(
                config, seed_base(), 0, tokens, 4096, activation_frame(300, 1200)
            )
        )
        == 2
    )
    assert kv.restore_resident_activation(config, seed_base(), 0, tokens, 4096) is None
    assert kv.stats().lookups == 0


def test_unhealthy_cache_neither_looks_up_nor_records() -> None:
    """The V-E health gate turns both off."""
    kv = seed_integration()
    kv.cache_healthy = False
    assert (kv.should_lookup(), kv.should_record()) == (False, False)
    config = seed_config()
    assert (
        kv.record_resident_activation(
            config, seed_base(), 0, list(range(300)), 4096, activation_frame(300, 1200)
        )
        == []
    )


def test_policy_and_cache_come_from_the_config() -> None:
    """Bounds go to the cache; the ladder budget is derived from ctx_size (§6.2)."""
    kv = seed_integration()
    assert (kv.cache.max_entries, kv.cache.max_bytes, kv.cache.min_tokens) == (8, 0, 256)
    assert kv.policy.max_resident_tokens_hint == 4096
    assert kv.policy.page_size_tokens == 256
    assert kv.payload is CachePayload.RESIDENT_KV


@pytest.mark.parametrize(
    ("model_id", "payload"),
    [
        ("Qwen/Qwen3-8B-GGUF:Q4_K_M", CachePayload.RESIDENT_KV),
        ("Qwen/Qwen3-5B-GGUF:Q4_K_M", CachePayload.RESIDENT_KV),
        ("qwen38b", CachePayload.RESIDENT_KV),
        ("qwen35moe", CachePayload.KV_RECURRENT),
        ("qwen35", CachePayload.KV_RECURRENT),
        ("unsloth/Qwen3.8-A3B-GGUF", CachePayload.KV_RECURRENT),
        ("tiiuae/Falcon-H1-7B", CachePayload.KV_RECURRENT),
        ("example/model", CachePayload.RESIDENT_KV),
    ],
)
def test_auto_payload_resolution(model_id: str, payload: CachePayload) -> None:
    """Spec §9.5 payload inference; unknown models resolve to resident-kv (documented)."""
    assert effective_cache_payload(CachePayload.AUTO, model_id) is payload
    assert effective_cache_payload(CachePayload.FULL_STATE, model_id) is CachePayload.FULL_STATE


# --- identities (spec §3, §9.2) ---------------------------------------------------------------


def small_config() -> StageConfig:
    """§9.2: ctx 512, min 64, stride 32, limit 2, max_entries 8."""
    return attrs.evolve(
        seed_config(),
        ctx_size=512,
        kv_cache=KvCacheConfig(
            mode="lookup-record",
            payload="resident-kv",
            max_entries=8,
            min_tokens=64,
            shared_prefix_stride_tokens=32,
            shared_prefix_record_limit=2,
        ),
    )


def test_identity_counts_for_160_tokens() -> None:
    """§9.2: lookup identities [160,128,96,64], record identities [160,128]."""
    config = small_config()
    kv = seed_integration(config)
    tokens = list(range(160))
    lookup = kv.activation_lookup_identities(config, seed_base(), 0, tokens)
    record = kv.activation_record_identities(config, seed_base(), 0, tokens)
    assert [i.identity.token_count for i in lookup] == [160, 128, 96, 64]
    assert [i.identity.token_count for i in record] == [160, 128]
    assert [i.page_id for i in record] == [i.page_id for i in lookup[:2]]


def test_2176_page_id_is_shared_between_2214_record_and_2231_lookup() -> None:
    """§9.2: the 2176 page ids agree; the 2214 and 2231 ids differ."""
    config = seed_config()
    kv = seed_integration(config)
    recorded = list(range(2214))
    extended = recorded + list(range(100_000, 100_017))
    record = {
        i.identity.token_count: i.page_id
        for i in kv.activation_record_identities(config, seed_base(), 0, recorded)
    }
    lookup = {
        i.identity.token_count: i.page_id
        for i in kv.activation_lookup_identities(config, seed_base(), 0, extended)
    }
    assert sorted(record) == [2176, 2214]
    assert record[2176] == lookup[2176]
    assert record[2214] != lookup[2231]
    assert 2214 not in lookup
    # V-E: both prompts live in one namespace (same stage, start and chat template).
    spaces = {
        i.namespace
        for tokens in (recorded, extended)
        for i in kv.activation_lookup_identities(config, seed_base(), 0, tokens)
    }
    assert spaces == {prefix_namespace_hash(config, 0, "template")}


def test_prefill_identity_metadata() -> None:
    """PageIdentity carries metadata; token_ids is a read-only view of the prefix."""
    config = seed_config()
    kv = seed_integration(config)
    tokens = np.arange(300, dtype=np.int32)
    ident = kv.prefill_identity(config, seed_base(), 5, tokens)
    meta = ident.identity
    assert (meta.token_start, meta.token_count, meta.session_id) == (5, 300, "session")
    assert meta.tokenizer_id == config.model_id
    assert (meta.chat_template_id, meta.position_config_hash) == ("template", "ctx:8192")
    assert (meta.generation, meta.model_revision) == (1, "unknown")
    assert meta.prefix_hash.startswith("blake3:")
    assert ident.page_id == f"stage-0:5:300:0:{meta.prefix_hash[7:23]}"
    assert ident.namespace == prefix_namespace_hash(config, 5, "template")
    assert not ident.token_ids.flags.writeable
    np.testing.assert_array_equal(ident.token_ids, tokens)
    assert (meta.topology_id, meta.stage_id, meta.stage_index) == ("topology", "stage-0", 0)
    assert (meta.layer_start, meta.layer_end, meta.model_id) == (0, 4, config.model_id)
    assert meta.runtime_abi_version == "stage-abi-0.1/native-kv-page-v2"
    assert (meta.layout, meta.codec, meta.kv_dtype) == (
        "layer-contiguous",
        "fp16",
        "ggml-native-kv",
    )
    other = attrs.evolve(seed_base(), tokenizer_id="tok", chat_template_id=None)
    meta = kv.prefill_identity(config, other, 0, tokens).identity
    assert (meta.tokenizer_id, meta.chat_template_id) == ("tok", "")


def test_prefix_is_shared_across_sessions() -> None:
    """A prefix recorded by one session restores for another (session is not hashed)."""
    config = seed_config()
    kv = seed_integration(config)
    tokens = list(range(300))
    kv.record_resident_activation(config, seed_base(), 0, tokens, 4096, activation_frame(300, 1200))
    other = attrs.evolve(seed_base(), session_id="someone-else", request_id="r2")
    assert kv.restore_resident_activation(config, other, 0, tokens, 4096) is not None
    no_namespace = attrs.evolve(seed_base(), chat_template_id=None)
    assert kv.restore_resident_activation(config, no_namespace, 0, tokens, 4096) is None


# --- §9.3 -------------------------------------------------------------------------------------


def test_extended_prompt_restores_2176_with_8704_bytes() -> None:
    """§9.3.3: 2214 recorded, 2231 restored -> 2176 tokens, payload 8704 bytes."""
    config = seed_config()
    kv = seed_integration(config)
    recorded = list(range(2214))
    records = kv.record_resident_activation(
        config, seed_base(), 0, recorded, 4096, activation_frame(2214, 8856)
    )
    assert [(r.token_count, r.payload_bytes) for r in records] == [(2214, 8856), (2176, 8704)]
    assert [(r.entries, r.resident_bytes) for r in records] == [(1, 8856), (2, 17560)]
    restored = kv.restore_resident_activation(
        config, seed_base(), 0, recorded + list(range(100_000, 100_017)), 4096
    )
    assert restored is not None
    assert (restored.token_count, restored.payload_bytes, restored.entries) == (2176, 8704, 2)
    assert restored.frame.payload.size == 8704
    assert restored.page_id.startswith("act:stage-0:0:2176:0:")
    assert restored.page_id.endswith(":w4096")


SPEC_MODEL = "org/model:Q4_K_M"


def spec_9_3() -> tuple[KvStageIntegration, StageConfig]:
    """§9.3's config: the seed's with model "org/model:Q4_K_M" (V-C/V-E tests)."""
    config = attrs.evolve(seed_config(), model_id=SPEC_MODEL)
    return seed_integration(config), config


def test_spec_9_3_vectors_with_the_spec_model() -> None:
    """§9.3 vectors 1-7, same inputs and outputs, each on a fresh cache of the §9.3 config."""
    base = seed_base()
    t300, t2214 = list(range(300)), list(range(2214))
    t2231 = t2214 + list(range(100_000, 100_017))
    # 1. Frame(300, 1200): two records; the restore equals the original frame.
    kv, config = spec_9_3()
    frame = activation_frame(300, 1200)
    assert len(kv.record_resident_activation(config, base, 0, t300, 4096, frame)) == 2
    restored = kv.restore_resident_activation(config, base, 0, t300, 4096)
    assert restored is not None
    assert restored.frame.same_content(frame)
    # 2. Frame(128, 64) for 300 tokens: nothing recorded, nothing restored.
    kv, config = spec_9_3()
    assert (
        kv.record_resident_activation(config, base, 0, t300, 4096, activation_frame(128, 64)) == []
    )
    assert kv.restore_resident_activation(config, base, 0, t300, 4096) is None
    # 3 and 4. Frame(2214, 8856): records [2214, 2176]; 2231 tokens restore 2176 (8704 bytes).
    kv, config = spec_9_3()
    records = kv.record_resident_activation(
        config, base, 0, t2214, 4096, activation_frame(2214, 8856)
    )
    assert [r.token_count for r in records] == [2214, 2176]
    assert len(records) == 2
    restored = kv.restore_resident_activation(config, base, 0, t2231, 4096)
    assert restored is not None
    assert restored.identity.identity.token_count == restored.token_count == 2176
    assert restored.frame.desc.token_count == 2176
    assert restored.frame.payload.size == 8704
    # 5. Recorded at width 4096, restored at 8192: None.
    kv, config = spec_9_3()
    kv.record_resident_activation(config, base, 0, t300, 4096, activation_frame(300, 1200))
    assert kv.restore_resident_activation(config, base, 0, t300, 8192) is None
    # 6. A 256-token, 64-byte entry under the 300-token key: None.
    kv, config = spec_9_3()
    key = activation_page_id(kv.prefill_identity(config, base, 0, t300).page_id, 4096)
    kv.cache.record(key, 256, 64, activation_frame(256, 64))
    assert kv.restore_resident_activation(config, base, 0, t300, 4096) is None
    # 7. Frame(300, 600) with flags 1: exactly one record, of 300 tokens.
    kv, config = spec_9_3()
    flagged = activation_frame(300, 600, flags=1)
    records = kv.record_resident_activation(config, base, 0, t300, 4096, flagged)
    assert [r.token_count for r in records] == [300]


def test_the_model_id_is_part_of_every_key() -> None:
    """The seed's model and §9.3's model never share an entry (same tokens, same stage)."""
    kv, spec_config = spec_9_3()
    tokens = list(range(300))
    kv.record_resident_activation(
        spec_config, seed_base(), 0, tokens, 4096, activation_frame(300, 1200)
    )
    assert kv.restore_resident_activation(seed_config(), seed_base(), 0, tokens, 4096) is None


def test_binary_stats_summary() -> None:
    """§9.3 binary stats: two records evicting 1 entry / 4 bytes each sum as upstream."""
    records = [
        ResidentActivationRecord(
            page_id="a",
            token_count=2214,
            payload_bytes=8856,
            evicted_entries=1,
            evicted_bytes=4,
            entries=1,
            resident_bytes=0,
        ),
        ResidentActivationRecord(
            page_id="b",
            token_count=2176,
            payload_bytes=8704,
            evicted_entries=1,
            evicted_bytes=4,
            entries=1,
            resident_bytes=0,
        ),
    ]
    summary = summarize_records(records)
    assert (summary.recorded_frames, summary.recorded_bytes) == (2, 17560)
    assert (summary.evicted_entries, summary.evicted_bytes) == (2, 8)


def test_records_report_their_evictions() -> None:
    """A full cache reports, per record, which entries it evicted."""
    config = with_cache(max_entries=2)
    kv = seed_integration(config)
    kv.record_resident_activation(
        config, seed_base(), 0, list(range(300)), 4096, activation_frame(300, 1200)
    )
    records = kv.record_resident_activation(
        config, seed_base(), 0, list(range(1, 301)), 4096, activation_frame(300, 1200)
    )
    assert [r.evicted_entries for r in records] == [1, 1]
    assert [e.token_count for r in records for e in r.evicted] == [300, 256]
    assert all(e.reason == "max_entries" for r in records for e in r.evicted)
    assert kv.stats().evictions == 2


# --- restore validation (§5.1) ----------------------------------------------------------------


def _key(kv: KvStageIntegration, tokens: list[int], width: int = 4096) -> str:
    return activation_page_id(
        kv.prefill_identity(seed_config(), seed_base(), 0, tokens).page_id, width
    )


@pytest.mark.parametrize(
    ("token_count", "byte_size", "frame_tokens", "frame_bytes"),
    [
        (256, 1200, 300, 1200),  # (a) recorded token count differs
        (300, 1200, 256, 1200),  # (b) frame token count differs
        (300, 1100, 300, 1200),  # (c)/(d) recorded byte size differs from the frame
    ],
)
def test_restore_skips_a_bad_hit_to_the_shorter_candidate(
    token_count: int, byte_size: int, frame_tokens: int, frame_bytes: int
) -> None:
    """A hit failing validation falls back to the next shorter candidate, which restores."""
    config = seed_config()
    kv = seed_integration(config)
    tokens = list(range(300))
    short = tokens[:256]
    kv.cache.record(_key(kv, short), 256, 1024, activation_frame(256, 1024))
    kv.cache.record(
        _key(kv, tokens), token_count, byte_size, activation_frame(frame_tokens, frame_bytes)
    )
    restored = kv.restore_resident_activation(config, seed_base(), 0, tokens, 4096)
    assert restored is not None
    assert restored.token_count == 256
    assert kv.stats().hits == 2  # the rejected hit counts as a cache hit


def test_rejected_hit_still_refreshes_recency() -> None:
    """The failed lookup made the bad entry recent, so the other entry is evicted next."""
    config = with_cache(max_entries=2)
    kv = seed_integration(config)
    tokens = list(range(300))
    bad = _key(kv, tokens)
    kv.cache.record(bad, 256, 64, activation_frame(256, 64))
    kv.cache.record("other", 300, 64, activation_frame(300, 600))
    assert kv.restore_resident_activation(config, seed_base(), 0, tokens, 4096) is None
    outcome = kv.cache.record("new", 300, 64, activation_frame(300, 600))
    assert [e.key for e in outcome.evicted] == ["other"]


# --- record rules (§5.2) ----------------------------------------------------------------------


def test_record_is_all_or_nothing_on_frame_mismatch() -> None:
    """A frame whose token count is not len(tokens) records nothing and changes nothing."""
    config = seed_config()
    kv = seed_integration(config)
    before = cache_state(kv.cache)
    assert (
        kv.record_resident_activation(
            config, seed_base(), 0, list(range(300)), 4096, activation_frame(299, 1196)
        )
        == []
    )
    assert cache_state(kv.cache) == before


def test_record_skips_short_prompts_empty_tokens_and_empty_payloads() -> None:
    """N < min_tokens, no tokens, or an empty payload: nothing recorded."""
    config = seed_config()
    kv = seed_integration(config)
    base = seed_base()
    assert (
        kv.record_resident_activation(
            config, base, 0, list(range(255)), 4096, activation_frame(255, 1020)
        )
        == []
    )
    assert kv.record_resident_activation(config, base, 0, [], 4096, activation_frame(0, 0)) == []
    assert (
        kv.record_resident_activation(
            config, base, 0, list(range(300)), 4096, activation_frame(300, 0)
        )
        == []
    )
    assert kv.restore_resident_activation(config, base, 0, [], 4096) is None
    assert kv.stats().entries == 0


def test_uncuttable_frames_record_only_their_exact_length() -> None:
    """Opaque layouts and ragged payloads skip the shorter candidates only."""
    config = seed_config()
    kv = seed_integration(config)
    tokens = list(range(300))
    frame = activation_frame(300, 1200)
    opaque = ActivationFrame(
        desc=attrs.evolve(frame.desc, layout=ActivationLayout.OPAQUE), payload=frame.payload
    )
    assert [
        r.token_count
        for r in kv.record_resident_activation(config, seed_base(), 0, tokens, 4096, opaque)
    ] == [300]
    ragged = activation_frame(300, 1201)
    assert [
        r.token_count
        for r in kv.record_resident_activation(config, seed_base(), 0, tokens, 8, ragged)
    ] == [300]


def test_recorded_prefixes_are_zero_copy_views() -> None:
    """Each stored candidate shares the recorded frame's memory (no copy per entry)."""
    config = seed_config()
    kv = seed_integration(config)
    tokens = list(range(300))
    frame = activation_frame(300, 1200)
    kv.record_resident_activation(config, seed_base(), 0, tokens, 4096, frame)
    restored = kv.restore_resident_activation(config, seed_base(), 0, tokens[:256] + [9] * 44, 4096)
    assert restored is not None
    assert restored.token_count == 256
    assert np.shares_memory(restored.frame.payload, frame.payload)


def test_virtual_frames_record_and_restore_without_memory() -> None:
    """A 131072-token virtual frame of 8192 B/token records and restores as virtual views."""
    config = attrs.evolve(seed_config(), ctx_size=262_144)
    kv = seed_integration(config)
    tokens = np.arange(131_072, dtype=np.int32)
    frame = ActivationFrame.virtual(token_count=131_072, bytes_per_token=8192, layer_end=4)
    records = kv.record_resident_activation(config, seed_base(), 0, tokens, 4096, frame)
    assert [r.token_count for r in records] == [131_072, 130_944]
    assert kv.stats().resident_bytes == (131_072 + 130_944) * 8192
    longer = np.concatenate([tokens, np.arange(5, dtype=np.int32)])
    restored = kv.restore_resident_activation(config, seed_base(), 0, longer, 4096)
    assert restored is not None
    assert restored.token_count == 131_072
    assert restored.frame.payload_bytes == 131_072 * 8192
    assert restored.frame.is_virtual


# --- the hash memo ----------------------------------------------------------------------------


def test_restore_then_record_hashes_the_tokens_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """record reuses the hashes restore computed for the same tokens."""
    calls: list[int] = []
    real = prompt_module._hash_counts  # type: ignore[attr-defined]

    def counting(*args: Any, **kwargs: Any) -> dict[int, str]:
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(prompt_module, "_hash_counts", counting)
    config = seed_config()
    kv = seed_integration(config)
    tokens = np.arange(2214, dtype=np.int32)
    assert kv.restore_resident_activation(config, seed_base(), 0, tokens, 4096) is None
    kv.record_resident_activation(
        config, seed_base(), 0, tokens, 4096, activation_frame(2214, 8856)
    )
    assert len(calls) == 1
    assert kv.restore_resident_activation(config, seed_base(), 0, tokens.copy(), 4096) is not None
    assert len(calls) == 1


def test_memo_keys_on_content_not_identity() -> None:
    """Mutating the caller's array in place between calls gives the new tokens' keys."""
    config = seed_config()
    kv = seed_integration(config)
    fresh = seed_integration(config)
    tokens = np.arange(300, dtype=np.int32)
    kv.restore_resident_activation(config, seed_base(), 0, tokens, 4096)
    tokens[10] = 999_999
    got = kv.record_resident_activation(
        config, seed_base(), 0, tokens, 4096, activation_frame(300, 1200)
    )
    want = fresh.record_resident_activation(
        config, seed_base(), 0, tokens, 4096, activation_frame(300, 1200)
    )
    assert [r.page_id for r in got] == [r.page_id for r in want]
    other_start = kv.record_resident_activation(
        config, seed_base(), 1, tokens, 4096, activation_frame(300, 1200)
    )
    assert {r.page_id for r in other_start}.isdisjoint({r.page_id for r in got})


def test_clear_returns_everything_and_restores_miss() -> None:
    """clear() drops all entries (reason cleared); later restores miss."""
    config = seed_config()
    kv = seed_integration(config)
    tokens = list(range(300))
    kv.record_resident_activation(config, seed_base(), 0, tokens, 4096, activation_frame(300, 1200))
    cleared = kv.clear()
    assert sorted(e.token_count for e in cleared) == [256, 300]
    assert {e.reason for e in cleared} == {"cleared"}
    assert kv.restore_resident_activation(config, seed_base(), 0, tokens, 4096) is None


# --- bad input leaves the cache unchanged -----------------------------------------------------

GOOD_TOKENS = list(range(300))


@pytest.mark.parametrize(
    ("changes", "error", "message"),
    [
        ({"tokens": [*GOOD_TOKENS[:-1], 2**31]}, ConfigError, "got 2147483648 at index 299"),
        ({"tokens": [0.5] * 300}, ConfigError, "tokens must be integers, got 0.5 at index 0"),
        ({"tokens": [*GOOD_TOKENS[:-1], True]}, ConfigError, "got True at index 299"),
        ({"tokens": np.zeros(300)}, ConfigError, "tokens must be integers, got 0.0 at index 0"),
        ({"tokens": None}, ConfigError, "tokens must be a sequence of integers, got NoneType"),
        (
            {"width": -1},
            ConfigError,
            r"activation_width must be an integer in \[0, 2,147,483,647\], got -1",
        ),
        ({"width": 4096.0}, ConfigError, "activation_width must be an integer in .*, got 4096.0"),
        ({"token_start": -1}, ConfigError, "token_start must be an integer in"),
        ({"base": "session"}, ConfigError, "base must be a MessageBase, got str"),
        ({"config": {"stage_id": "x"}}, ConfigError, "config must be a StageConfig, got dict"),
    ],
)
@pytest.mark.parametrize("call", ["restore", "record"])
def test_bad_input_raises_and_leaves_cache_unchanged(
    changes: dict[str, Any], error: type[Exception], message: str, call: str
) -> None:
    """Each bad argument raises a typed error naming it; entries, recency, counters unchanged."""
    config = seed_config()
    kv = seed_integration(config)
    kv.record_resident_activation(
        config, seed_base(), 0, GOOD_TOKENS, 4096, activation_frame(300, 1200)
    )
    kv.restore_resident_activation(config, seed_base(), 0, GOOD_TOKENS, 4096)
    before = cache_state(kv.cache)
    args: dict[str, Any] = {
        "config": config,
        "base": seed_base(),
        "token_start": 0,
        "tokens": GOOD_TOKENS,
        "width": 4096,
    }
    args.update(changes)
    if call == "restore":
        with pytest.raises(error, match=message):
            kv.restore_resident_activation(
                args["config"], args["base"], args["token_start"], args["tokens"], args["width"]
            )
    else:
        frame = activation_frame(300, 1200)
        with pytest.raises(error, match=message):
            kv.record_resident_activation(
                args["config"],
                args["base"],
                args["token_start"],
                args["tokens"],
                args["width"],
                frame,
            )
    assert cache_state(kv.cache) == before


def test_record_of_a_non_frame_raises_frame_error_and_changes_nothing() -> None:
    """A payload that is not an ActivationFrame is a FrameError; the cache is untouched."""
    config = seed_config()
    kv = seed_integration(config)
    before = cache_state(kv.cache)
    not_a_frame: Any = np.zeros(1200, dtype=np.uint8)
    with pytest.raises(FrameError, match="frame must be an ActivationFrame, got ndarray"):
        kv.record_resident_activation(config, seed_base(), 0, GOOD_TOKENS, 4096, not_a_frame)
    assert cache_state(kv.cache) == before


def test_message_base_is_validated_by_its_own_type() -> None:
    """A malformed envelope never reaches the cache."""
    with pytest.raises(ConfigError, match="chat_template_id must be a string, got 3"):
        MessageBase(chat_template_id=3)  # type: ignore[arg-type]


@pytest.mark.parametrize("n", [0, 1, 255, 256, 300, 2214])
def test_memo_answers_equal_fresh_answers(n: int) -> None:
    """After a restore warms the memo, every identity query equals a fresh integration's."""
    config = seed_config()
    warm = seed_integration(config)
    tokens = list(range(7, 7 + n))
    warm.restore_resident_activation(config, seed_base(), 0, tokens, 4096)
    warm.activation_lookup_identities(config, seed_base(), 0, tokens)
    for query in (
        "prefill_identity",
        "activation_lookup_identities",
        "activation_record_identities",
    ):
        fresh = seed_integration(config)
        got = getattr(warm, query)(config, seed_base(), 0, tokens)
        want = getattr(fresh, query)(config, seed_base(), 0, tokens)
        if query == "prefill_identity":
            got, want = [got], [want]
        assert [i.page_id for i in got] == [i.page_id for i in want]
        assert [i.identity.prefix_hash for i in got] == [i.identity.prefix_hash for i in want]


def test_record_only_cache_hashes_only_record_lengths(monkeypatch: pytest.MonkeyPatch) -> None:
    """In record mode only the record candidates are hashed; later queries still agree."""
    asked: list[set[int]] = []
    real = prompt_module._hash_counts  # type: ignore[attr-defined]

    def spy(h: Any, data: Any, counts: Any, *into: Any) -> dict[int, str]:
        asked.append(set(counts))
        return real(h, data, counts, *into)

    monkeypatch.setattr(prompt_module, "_hash_counts", spy)
    config = with_cache(mode=CacheMode.RECORD)
    kv = seed_integration(config)
    tokens = list(range(2214))
    kv.record_resident_activation(
        config, seed_base(), 0, tokens, 4096, activation_frame(2214, 8856)
    )
    assert asked == [{2214, 2176}]
    lookup = kv.activation_lookup_identities(config, seed_base(), 0, tokens)
    assert len(asked) == 2
    assert len(lookup) == len(kv.policy.candidate_token_counts(2214))
    fresh = seed_integration(config).activation_lookup_identities(config, seed_base(), 0, tokens)
    assert [i.page_id for i in lookup] == [i.page_id for i in fresh]


def test_a_frame_disagreeing_with_its_payload_never_reaches_the_cache() -> None:
    """payload_bytes != payload size fails at construction with FrameError; cache untouched."""
    kv = seed_integration()
    before = cache_state(kv.cache)
    good = activation_frame(300, 1200)
    with pytest.raises(
        FrameError, match="payload_bytes must equal the payload size 1200, got 1199"
    ):
        ActivationFrame(desc=attrs.evolve(good.desc, payload_bytes=1199), payload=good.payload)
    assert cache_state(kv.cache) == before


BLOCKS = st.lists(st.integers(0, 3), min_size=1, max_size=12)


@settings(max_examples=60, deadline=None)
@given(prompts=st.lists(BLOCKS, min_size=1, max_size=6))
def test_restored_rows_always_belong_to_the_query_prefix(prompts: list[list[int]]) -> None:
    """Whatever was recorded before, a restore returns exactly the rows of the query's first k
    tokens (rows here are a function of the token prefix, as a causal model's are)."""
    config = with_cache(min_tokens=32, shared_prefix_stride_tokens=16, max_entries=6)
    kv = seed_integration(config)
    base = seed_base()
    for blocks in prompts:
        # 32-token blocks drawn from 4 kinds: prompts share prefixes block-wise.
        tokens = np.concatenate([np.arange(32, dtype=np.int32) + 100 * b for b in blocks])
        rows = np.cumsum(tokens.astype(np.float64))[:, None].astype(np.float32) * np.ones(
            (1, 4), dtype=np.float32
        )
        restored = kv.restore_resident_activation(config, base, 0, tokens, 4)
        if restored is not None:
            k = restored.token_count
            assert 0 < k <= tokens.size
            np.testing.assert_array_equal(restored.frame.rows(), rows[:k])
            np.testing.assert_array_equal(restored.identity.token_ids, tokens[:k])
        frame = ActivationFrame.from_array(rows, layer_end=4)
        kv.record_resident_activation(config, base, 0, tokens, 4, frame)


def reference_restore(
    kv: KvStageIntegration,
    config: StageConfig,
    base: MessageBase,
    start: int,
    tokens: np.ndarray[Any, Any],
    width: int,
) -> tuple[int, str] | None:
    """Spec §5.1 read literally: hash and look up every candidate, longest first."""
    if not kv.should_lookup() or tokens.size == 0:
        return None
    for count in kv.policy.candidate_token_counts(int(tokens.size)):
        digest = prefix_hash(config, start, tokens[:count], base.chat_template_id)
        key = activation_page_id(page_id(config, start, count, digest), width)
        hit = kv.cache.lookup(key)
        if hit is None:
            continue
        if (
            hit.token_count == count
            and hit.frame.desc.token_count == count
            and hit.frame.desc.payload_bytes == hit.byte_size
            and hit.frame.payload.size == hit.byte_size
        ):
            return count, key
    return None


OPS = st.lists(
    st.tuples(
        st.sampled_from(["record", "restore", "restore", "plant"]),
        st.lists(st.integers(0, 3), min_size=1, max_size=10),
        st.sampled_from([0, 32]),
        st.sampled_from([4, 8]),
        st.integers(0, 31),
    ),
    min_size=1,
    max_size=12,
)
# (min_tokens, stride, record limit): on-grid and off-grid minimums, capped and unit strides.
SHAPES = st.sampled_from([(32, 16, 2), (33, 16, 2), (32, 40, 3), (5, 0, 0), (0, 16, 2)])


@settings(max_examples=80, deadline=None)
@given(ops=OPS, shape=SHAPES)
def test_restore_matches_the_literal_spec_reading(
    ops: list[tuple[str, list[int], int, int, int]], shape: tuple[int, int, int]
) -> None:
    """The index-pruned restore gives the same answers, clock, recency and counters as probing
    every candidate, whatever was recorded, planted or evicted before, for prompt lengths on
    and off the grid."""
    min_tokens, stride, limit = shape
    config = with_cache(
        min_tokens=min_tokens,
        shared_prefix_stride_tokens=stride,
        shared_prefix_record_limit=limit,
        max_entries=5,
    )
    base = seed_base()
    fast, slow, full = seed_integration(config), seed_integration(config), seed_integration(config)
    full.probe_all = True
    for op, blocks, start, width, cut in ops:
        tokens = np.concatenate([np.arange(32, dtype=np.int32) + 100 * b for b in blocks])
        tokens = tokens[: tokens.size - cut]  # 0 to 31 tokens short of a block boundary
        frame = ActivationFrame.virtual(token_count=tokens.size, bytes_per_token=width * 4)
        if op == "record":
            for kv in (fast, slow, full):
                kv.record_resident_activation(config, base, start, tokens, width, frame)
        elif op == "plant":
            # an entry under the exact key whose frame is one token short (fails validation)
            short = ActivationFrame.virtual(token_count=tokens.size - 1, bytes_per_token=4)
            ident = fast.prefill_identity(config, base, start, tokens)
            key = activation_page_id(ident.page_id, width)
            for kv in (fast, slow, full):
                kv.cache.record(key, tokens.size, short.payload_bytes, short)
        else:
            got = fast.restore_resident_activation(config, base, start, tokens, width)
            want = reference_restore(slow, config, base, start, tokens, width)
            assert (None if got is None else (got.token_count, got.page_id)) == want
            every = full.restore_resident_activation(config, base, start, tokens, width)
            assert (None if every is None else (every.token_count, every.page_id)) == want
        assert cache_state(fast.cache) == cache_state(slow.cache) == cache_state(full.cache)


def test_cache_without_key_index_is_probed_fully() -> None:
    """An integration built by hand around a plain cache still finds its entries."""
    config = seed_config()
    built = seed_integration(config)
    kv = KvStageIntegration.around(
        config,
        built.cache_config,
        built.policy,
        ResidentActivationCache(max_entries=8, min_tokens=256),
    )
    tokens = list(range(2214))
    kv.record_resident_activation(
        config, seed_base(), 0, tokens, 4096, activation_frame(2214, 8856)
    )
    restored = kv.restore_resident_activation(config, seed_base(), 0, [*tokens, 5, 6], 4096)
    assert restored is not None
    assert restored.token_count == 2176
    assert kv.stats().lookups == 2


@pytest.mark.parametrize("index", ["ladder", "paged"])
def test_tokens_given_as_an_iterator_are_read_once(index: str) -> None:
    """An iterator of tokens (documented as accepted) records and restores like a list; the
    ladder's bookkeeping used to read it a second time, after the cache had consumed it."""
    config = StageConfig.from_mapping(
        {
            "stage_id": "s0",
            "model_id": "m",
            "layer_start": 0,
            "layer_end": 2,
            "kv_cache": {
                "mode": "lookup-record",
                "min_tokens": 2,
                "shared_prefix_stride_tokens": 2,
                "index": index,
            },
        }
    )
    kv = KvStageIntegration.from_config(config, environ={})
    assert kv is not None
    frame = ActivationFrame.from_array(np.ones((6, 2), np.float32))
    records = kv.record_resident_activation(config, MessageBase(), 0, iter(range(6)), 2, frame)  # type: ignore[arg-type]
    assert records[0].token_count == 6
    hit = kv.restore_resident_activation(config, MessageBase(), 0, (t for t in range(6)), 2)  # type: ignore[arg-type]
    assert hit is not None
    assert hit.token_count == 6
    accounting, stats = kv.accounting(), kv.stats()
    assert (accounting.lookups, accounting.hits) == (stats.lookups, stats.hits) == (1, 1)
    assert accounting.unique_prefix_bytes == accounting.resident_bytes or index == "ladder"
    assert 0 < accounting.unique_prefix_bytes <= accounting.resident_bytes
