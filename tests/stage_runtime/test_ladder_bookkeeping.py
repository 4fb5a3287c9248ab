"""The ladder integration's deferred footprint and fingerprint-filtered miss classification."""

from __future__ import annotations

import numpy as np

from stage_runtime import ActivationDType, ActivationFrame, CacheMode, KvCacheConfig, StageConfig
from stage_runtime.accounting import PrefixFootprint
from stage_runtime.cache.paged.chains import page_chain
from stage_runtime.config import MessageBase
from stage_runtime.identity import activation_page_id, page_id, prefix_hash
from stage_runtime.integration import KvStageIntegration
from stage_runtime.tenancy import paged_namespace

WIDTH = 4
BASE = MessageBase(session_id="s")


def ladder(max_entries: int = 1000) -> tuple[KvStageIntegration, StageConfig]:
    config = StageConfig(
        stage_id="stage-0",
        model_id="test/model",
        layer_start=0,
        layer_end=4,
        kv_cache=KvCacheConfig(
            mode=CacheMode.LOOKUP_RECORD,
            min_tokens=4,
            shared_prefix_stride_tokens=4,
            max_entries=max_entries,
        ),
    )
    kv = KvStageIntegration.from_config(config, environ={})
    assert kv is not None
    return kv, config


def frame(n: int, bytes_per_token: int = 16) -> ActivationFrame:
    return ActivationFrame.virtual(
        token_count=n, bytes_per_token=bytes_per_token, dtype=ActivationDType.F16
    )


def record(kv: KvStageIntegration, config: StageConfig, tokens: list[int], bpt: int = 16) -> None:
    kv.record_resident_activation(config, BASE, 0, tokens, WIDTH, frame(len(tokens), bpt))


def key_of(config: StageConfig, prefix: list[int]) -> str:
    """The ladder's cache key of a prefix (no namespace, no salt)."""
    digest = prefix_hash(config, 0, prefix)
    return activation_page_id(page_id(config, 0, len(prefix), digest), WIDTH)


def miss(kv: KvStageIntegration, config: StageConfig, tokens: list[int]) -> None:
    assert kv.restore_resident_activation(config, BASE, 0, tokens, WIDTH) is None


def eager_footprint(
    kv: KvStageIntegration, config: StageConfig, recorded: list[tuple[list[int], int]]
) -> int:
    """Unique bytes of the resident entries, added one by one as the eager bookkeeping did."""
    footprint = PrefixFootprint()
    resident = set(kv.cache.keys())
    namespace = paged_namespace(config, 0, BASE, WIDTH)
    for tokens, bpt in recorded:
        chain = page_chain(namespace, np.asarray(tokens), page_tokens=4)
        for count in kv.policy.record_candidate_token_counts(len(tokens)):
            key = key_of(config, tokens[:count])
            if key in resident:
                footprint.add(key, chain.segments(count), bpt)
    return footprint.unique_bytes()


def test_deferred_footprint_counts_only_resident_entries() -> None:
    """Entries evicted before accounting() is read never reach the footprint."""
    kv, config = ladder(max_entries=3)
    prompts = [list(range(s, s + 10)) for s in (1, 100, 200, 300)]
    for tokens in prompts:
        record(kv, config, tokens)
    acc = kv.accounting()
    assert acc.entries == 3
    assert acc.unique_prefix_bytes == eager_footprint(kv, config, [(t, 16) for t in prompts])
    assert acc.unique_prefix_bytes > 0


def test_footprint_with_two_row_sizes_in_one_namespace() -> None:
    """A second bytes-per-token in one namespace still gives the eager footprint."""
    kv, config = ladder()
    first, second = list(range(1, 11)), [*range(1, 9), 50, 51]
    record(kv, config, first, bpt=16)
    record(kv, config, second, bpt=32)
    # The shared first page is counted once at the wider row size, as eager adds did.
    shared = 8 * 32
    assert kv.accounting().unique_prefix_bytes == shared + 2 * 32 + 2 * 32


def test_miss_after_eviction_of_a_key_recorded_behind_the_integration() -> None:
    """A key put in the cache directly has no fingerprint: its eviction still counts."""
    kv, config = ladder(max_entries=2)
    tokens = list(range(1, 9))
    key = key_of(config, tokens)
    kv.cache.record(key, 8, 8 * 16, frame(8))
    record(kv, config, list(range(100, 110)))  # two entries: evicts the direct one
    assert key not in kv.cache
    miss(kv, config, tokens)
    assert kv.accounting().misses_evicted == 1


def test_same_fingerprint_different_prefix_is_never_seen() -> None:
    """Prompts sharing the sampled tokens but not the prefix are told apart by their keys."""
    kv, config = ladder(max_entries=2)
    evicted = [1, 2, 3, 4, 5, 6, 7, 8]
    record(kv, config, evicted)
    record(kv, config, list(range(100, 110)))  # evicts both entries of `evicted`
    lookalike = [1, 9, 3, 4, 5, 6, 7, 8]  # differs at index 1 only, which no sample reads
    miss(kv, config, lookalike)
    miss(kv, config, evicted)
    acc = kv.accounting()
    assert (acc.misses_never_seen, acc.misses_evicted) == (1, 1)


def test_restore_finds_a_key_recorded_behind_the_integration() -> None:
    """A resident key of unknown fingerprint next to a known one at the same length still hits."""
    kv, config = ladder()
    record(kv, config, list(range(1, 9)))  # a known key at length 8
    other = list(range(20, 28))
    kv.cache.record(key_of(config, other), 8, 8 * 16, frame(8))  # an unknown key at length 8
    hit = kv.restore_resident_activation(config, BASE, 0, other, WIDTH)
    assert hit is not None
    assert hit.token_count == 8


def test_restore_skips_lengths_held_only_by_other_prefixes() -> None:
    """A length whose resident keys belong to other prefixes counts a miss, as a probe would."""
    kv, config = ladder()
    record(kv, config, list(range(1, 9)))
    before = kv.cache.stats()
    miss(kv, config, list(range(50, 58)))
    after = kv.cache.stats()
    assert (after.lookups - before.lookups, after.misses - before.misses) == (2, 2)
    assert after.hits == before.hits
