"""The compression count behind bench_identity's exact-BLAKE3 floor, worked by hand."""

from __future__ import annotations

import pytest

from tests.benchmark_scripts import load_script

bench = load_script("bench_identity")


@pytest.mark.parametrize(
    ("header", "counts", "expected"),
    [
        # 1,024 bytes: one chunk of 16 blocks; the full prompt is the only candidate.
        (0, [256], (16, 0)),
        # 2,048 bytes: 32 blocks + 1 parent. The 256-token prefix is chunk 0 whole: its root
        # compression is new, nothing else.
        (0, [256, 512], (33, 1)),
        # 2,049 bytes: 33 blocks + 2 parents. The prefix ends 1 byte into chunk 1: its last block
        # again (as the chunk's end) and one merge with chunk 0.
        (1, [256, 512], (35, 2)),
        # The prefix is chunks 0-1 whole: their parent is the one-shot's node; only its root is new.
        (0, [512, 768], (50, 1)),
        # Chunks 0-5 whole: [4,6) is shared, the root over [0,4) and [4,6) is new.
        (0, [1536, 2048], (8 * 16 + 7, 1)),
        # Chunks 0-6 whole: [4,6)+[6] and the root over [0,4) are both new.
        (0, [1792, 2048], (8 * 16 + 7, 2)),
    ],
)
def test_snapshot_compressions(header: int, counts: list[int], expected: tuple[int, int]) -> None:
    assert bench.snapshot_compressions(header, counts) == expected


def test_floor_of_the_identity_goal_sizes() -> None:
    config = bench._config(limit=0)
    assert config.kv_cache is not None
    policy = bench.CandidatePolicy.from_cache_config(config.kv_cache)
    floors = [bench.snapshot_bound(policy.candidate_token_counts(n)) for n in bench.SIZES]
    assert floors == sorted(floors)
    # Whatever the header length, no exact BLAKE3 gets all of 131,072 tokens' candidates
    # under 1.5x one hash.
    assert floors[-1] > 1.5
