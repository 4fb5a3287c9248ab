"""Tests of the paged-index settings of KvCacheConfig and the cache salt of MessageBase."""

from __future__ import annotations

from pathlib import Path

import pytest

from stage_runtime import CacheIndex, ConfigError, KvCacheConfig, PageEviction, StageConfig
from stage_runtime.config import MessageBase
from stage_runtime.integration import KvStageIntegration, PagedStageIntegration


def test_index_defaults_to_the_upstream_ladder_and_pages_to_the_stride() -> None:
    """Without settings the ladder is used and a page is one stride long."""
    config = KvCacheConfig(shared_prefix_stride_tokens=512)
    assert config.index is CacheIndex.LADDER
    assert config.page_tokens is None
    assert config.effective_page_tokens == 512
    assert KvCacheConfig(shared_prefix_stride_tokens=0).effective_page_tokens == 1
    assert KvCacheConfig(page_tokens=64).effective_page_tokens == 64


def test_index_accepts_strings_and_rejects_unknown_modes() -> None:
    """The index converts from its string value and names bad values."""
    assert KvCacheConfig.from_mapping({"index": "paged"}).index is CacheIndex.PAGED
    with pytest.raises(ConfigError, match="index must be one of 'ladder', 'paged', got 'radix'"):
        KvCacheConfig(index="radix")
    with pytest.raises(ConfigError, match="page_tokens must be >= 1, got 0"):
        KvCacheConfig(page_tokens=0)


def test_index_and_page_tokens_from_the_environment() -> None:
    """STAGE_RUNTIME_KV_CACHE_INDEX and _PAGE_TOKENS configure the paged index."""
    config = KvCacheConfig.from_env(
        {
            "STAGE_RUNTIME_KV_CACHE": "on",
            "STAGE_RUNTIME_KV_CACHE_INDEX": "paged",
            "STAGE_RUNTIME_KV_CACHE_PAGE_TOKENS": "256",
        }
    )
    assert config is not None
    assert config.index is CacheIndex.PAGED
    assert config.page_tokens == 256
    with pytest.raises(ConfigError, match=r"^STAGE_RUNTIME_KV_CACHE_INDEX must be one of"):
        KvCacheConfig.from_env(
            {"STAGE_RUNTIME_KV_CACHE": "on", "STAGE_RUNTIME_KV_CACHE_INDEX": "tree"}
        )


def test_page_eviction_from_the_environment() -> None:
    """STAGE_RUNTIME_KV_CACHE_PAGE_EVICTION picks the policy; a bad value names the variable."""
    on = {"STAGE_RUNTIME_KV_CACHE": "on", "STAGE_RUNTIME_KV_CACHE_INDEX": "paged"}
    config = KvCacheConfig.from_env({**on, "STAGE_RUNTIME_KV_CACHE_PAGE_EVICTION": " Reuse "})
    assert config is not None
    assert config.page_eviction is PageEviction.REUSE
    unset = KvCacheConfig.from_env(on)
    assert unset is not None
    assert unset.page_eviction is PageEviction.LRU
    with pytest.raises(
        ConfigError, match=r"^STAGE_RUNTIME_KV_CACHE_PAGE_EVICTION must be one of .*'fifo'"
    ):
        KvCacheConfig.from_env({**on, "STAGE_RUNTIME_KV_CACHE_PAGE_EVICTION": "fifo"})


def test_a_page_eviction_policy_needs_the_paged_index(tmp_path: Path) -> None:
    """The ladder evicts by LRU only: another page eviction with it is refused, naming the
    key (and, from a file, its line), rather than ignored."""
    message = r"kv_cache.page_eviction 'reuse' applies to index 'paged' only \(index is 'ladder'\)"
    with pytest.raises(ConfigError, match=message):
        KvCacheConfig.from_mapping({"mode": "lookup-record", "page_eviction": "reuse"})
    assert KvCacheConfig(page_eviction="lru").page_eviction is PageEviction.LRU  # the default
    assert KvCacheConfig(index="paged", page_eviction="adaptive").index is CacheIndex.PAGED
    on = {"STAGE_RUNTIME_KV_CACHE": "on", "STAGE_RUNTIME_KV_CACHE_PAGE_EVICTION": "reuse"}
    with pytest.raises(ConfigError, match="applies to index 'paged' only"):
        KvCacheConfig.from_env(on)
    stage = tmp_path / "stage.toml"
    stage.write_text(
        'stage_id = "s"\nmodel_id = "m"\nlayer_start = 0\nlayer_end = 1\n\n[kv_cache]\n'
        'mode = "lookup-record"\npage_eviction = "reuse"\n',
        encoding="utf-8",
    )
    with pytest.raises(ConfigError, match=r"stage\.toml: line 8: kv_cache\.page_eviction 'reuse'"):
        StageConfig.load(stage)


def test_cache_salt_is_optional_and_must_be_a_string() -> None:
    """No salt by default (upstream sharing); a non-string salt is refused."""
    assert MessageBase().cache_salt is None
    assert MessageBase(cache_salt="tenant-a").cache_salt == "tenant-a"
    with pytest.raises(ConfigError, match="cache_salt must be a string"):
        MessageBase(cache_salt=3)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="cache_salt must be a non-empty string, got ''"):
        MessageBase(cache_salt="")


def test_page_eviction_reaches_the_paged_index() -> None:
    """page_eviction = "reuse" selects the reuse-aware policy; unknown values are named."""
    config = StageConfig(
        stage_id="s",
        model_id="m",
        layer_start=0,
        layer_end=1,
        kv_cache=KvCacheConfig(mode="lookup-record", index="paged", page_eviction="reuse"),
    )
    kv = KvStageIntegration.from_config(config, environ={})
    assert isinstance(kv, PagedStageIntegration)
    assert kv.index.eviction == "reuse"
    assert KvCacheConfig().page_eviction is PageEviction.LRU
    with pytest.raises(ConfigError, match="page_eviction must be one of 'lru', 'reuse'"):
        KvCacheConfig(page_eviction="fifo")
