"""The seed's seven tests (resident_activation.rs), ported one to one."""

from __future__ import annotations

import numpy as np

from stage_runtime.identity import activation_page_id

from ._seed import activation_frame, seed_base, seed_config, seed_integration


def test_resident_activation_records_and_restores_exact_frame() -> None:
    """A 300-token frame records two entries and restores by exact identity."""
    config = seed_config()
    kv = seed_integration(config)
    tokens = list(range(300))
    frame = activation_frame(len(tokens), len(tokens) * 4)
    record = kv.record_resident_activation(config, seed_base(), 0, tokens, 4096, frame)
    assert len(record) == 2
    restored = kv.restore_resident_activation(config, seed_base(), 0, tokens, 4096)
    assert restored is not None, "activation frame should restore by exact identity"
    assert restored.frame.same_content(frame)
    assert restored.frame.desc == frame.desc
    np.testing.assert_array_equal(restored.frame.payload, frame.payload)


def test_resident_activation_rejects_mismatched_frame_token_count() -> None:
    """A 128-token frame for 300 tokens records nothing and restores nothing."""
    config = seed_config()
    kv = seed_integration(config)
    tokens = list(range(300))
    frame = activation_frame(128, 64)
    record = kv.record_resident_activation(config, seed_base(), 0, tokens, 4096, frame)
    assert record == []
    assert kv.restore_resident_activation(config, seed_base(), 0, tokens, 4096) is None


def test_resident_activation_records_identity_matched_shared_prefix_frame() -> None:
    """2214 records [2214, 2176]; the 2231-token extension restores the 2176 prefix."""
    config = seed_config()
    kv = seed_integration(config)
    recorded_tokens = list(range(2214))
    lookup_tokens = recorded_tokens + list(range(100_000, 100_017))
    frame = activation_frame(len(recorded_tokens), len(recorded_tokens) * 4)
    record = kv.record_resident_activation(config, seed_base(), 0, recorded_tokens, 4096, frame)
    assert [r.token_count for r in record] == [2214, 2176]
    restored = kv.restore_resident_activation(config, seed_base(), 0, lookup_tokens, 4096)
    assert restored is not None, "grid-floor activation should restore via a lookup candidate"
    assert restored.identity.identity.token_count == 2176
    assert restored.token_count == 2176
    assert restored.frame.desc.token_count == 2176
    assert restored.frame.payload.size == 2176 * 4


def test_restore_hits_shared_prefix_activation_for_extended_prompt() -> None:
    """Two records for 2214 tokens; the extended prompt restores the shared 2176 prefix."""
    config = seed_config()
    kv = seed_integration(config)
    recorded_tokens = list(range(2214))
    extended_lookup_tokens = recorded_tokens + list(range(100_000, 100_017))
    frame = activation_frame(len(recorded_tokens), len(recorded_tokens) * 4)
    records = kv.record_resident_activation(config, seed_base(), 0, recorded_tokens, 4096, frame)
    assert len(records) == 2
    restored = kv.restore_resident_activation(config, seed_base(), 0, extended_lookup_tokens, 4096)
    assert restored is not None, "extended prompt should restore the shared grid-floor activation"
    assert restored.identity.identity.token_count == 2176
    assert restored.token_count == 2176
    assert restored.frame.desc.token_count == 2176
    assert restored.frame.payload.size == 2176 * 4


def test_resident_activation_keys_include_activation_width() -> None:
    """Recorded at width 4096, a restore at width 8192 misses."""
    config = seed_config()
    kv = seed_integration(config)
    tokens = list(range(300))
    frame = activation_frame(len(tokens), len(tokens) * 4)
    record = kv.record_resident_activation(config, seed_base(), 0, tokens, 4096, frame)
    assert len(record) == 2
    assert kv.restore_resident_activation(config, seed_base(), 0, tokens, 8192) is None


def test_resident_activation_rejects_ambiguous_cached_token_count() -> None:
    """A 256-token entry stored under the 300-token key is not restored."""
    config = seed_config()
    kv = seed_integration(config)
    tokens = list(range(300))
    identity = kv.prefill_identity(config, seed_base(), 0, tokens)
    page_id = activation_page_id(identity.page_id, 4096)
    kv.cache.record(page_id, 256, 64, activation_frame(256, 64))
    assert kv.restore_resident_activation(config, seed_base(), 0, tokens, 4096) is None


def test_resident_activation_does_not_alias_flagged_frame_to_shorter_identity() -> None:
    """A flagged 300-token frame records only its exact length."""
    config = seed_config()
    kv = seed_integration(config)
    tokens = list(range(300))
    frame = activation_frame(len(tokens), 600, flags=1)
    records = kv.record_resident_activation(config, seed_base(), 0, tokens, 4096, frame)
    assert len(records) == 1
    assert records[0].token_count == len(tokens)
