"""Benchmark: prefix identities in one pass, and restore cost against prefix length.

Run: ``python benchmarks/bench_identity.py [--repeat 7] [--json PATH]``.

Part 1 hashes every lookup candidate of an N-token prompt (stride 128, min 256, record limit 0)
in one pass (:func:`stage_runtime.identity.prefix_hashes`) and compares it with hashing the N
tokens once (:func:`stage_runtime.identity.prefix_hash`), and with the naive
one-pass-per-candidate approach; for
scale, it also times feeding a bare BLAKE3 hasher the same steps without reading it out (what the
one-pass method costs before any snapshot, against the one-shot hash's SIMD across chunks). Part 2
restores a cached 2,048-token and a cached 131,072-token prefix of an 8,192-byte-per-token frame:
restores return views, so the cost must not grow with the payload. Part 3 times the stage hot
path for a prompt extending a cached one (restore, then record the full frame) against hashing
the prompt once: the restore hashes only the candidate lengths the cache could hold, and the
record reuses that pass.

Numbers are medians over ``--repeat`` samples; each sample loops enough calls to last ~20 ms.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any, TypeVar

import blake3
import numpy as np

from stage_runtime import ActivationFrame, KvCacheConfig, StageConfig
from stage_runtime._cli_support import int_at_least
from stage_runtime.config import MessageBase
from stage_runtime.identity import _prelude, prefix_hash, prefix_hashes
from stage_runtime.integration import KvStageIntegration
from stage_runtime.policy import CandidatePolicy

SIZES = (2048, 32768, 131072)
BYTES_PER_TOKEN = 8192
RESTORE_SIZES = (2048, 131072)
RESTORE_GOAL = 2.0  # "about the same" read as at most twice the 2,048-token restore
_T = TypeVar("_T")
NAIVE_MAX = 32768  # one pass per candidate is quadratic; skip it above this size


def _config(limit: int) -> StageConfig:
    return StageConfig(
        stage_id="stage-0",
        model_id="example/model",
        layer_start=0,
        layer_end=8,
        ctx_size=262_144,
        kv_cache=KvCacheConfig(
            mode="lookup-record",
            max_entries=64,
            min_tokens=256,
            shared_prefix_stride_tokens=128,
            shared_prefix_record_limit=limit,
        ),
    )


def _median_seconds(fn: Callable[[], object], repeat: int, budget_s: float = 0.02) -> float:
    """Median seconds per call over ``repeat`` samples of enough calls to fill ``budget_s``."""
    fn()  # warm up caches (namespace prelude, lru caches)
    start = time.perf_counter()
    fn()
    once = max(time.perf_counter() - start, 1e-7)
    loops = max(1, int(budget_s / once))
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        for _ in range(loops):
            fn()
        samples.append((time.perf_counter() - start) / loops)
    return statistics.median(samples)


def _median_seconds_each(
    setup: Callable[[], _T], fn: Callable[[_T], object], repeat: int, budget_s: float = 0.02
) -> float:
    """Like :func:`_median_seconds`, for calls that each need a fresh ``setup()`` (untimed)."""
    fn(setup())  # warm up
    state = setup()
    start = time.perf_counter()
    fn(state)
    once = max(time.perf_counter() - start, 1e-7)
    loops = max(1, int(budget_s / once))
    samples = []
    for _ in range(repeat):
        states = [setup() for _ in range(loops)]
        start = time.perf_counter()
        for state in states:
            fn(state)
        samples.append((time.perf_counter() - start) / loops)
    return statistics.median(samples)


def _versions() -> dict[str, str]:
    out = {"python": sys.version.split()[0], "platform": platform.platform()}
    out["machine"] = platform.machine()
    out["processor"] = platform.processor() or "unknown"
    for dist in ("numpy", "trio", "blake3", "attrs", "stage-runtime"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = "not installed"
    return out


_CHUNK = 1024  # BLAKE3 chunk length in bytes
_BLOCK = 64  # BLAKE3 block length in bytes


def _one_shot_compressions(length: int) -> int:
    """Compressions BLAKE3 spends on a ``length``-byte input: every block of every chunk, plus
    one parent node per chunk after the first."""
    chunks = max(1, -(-length // _CHUNK))
    last = length - _CHUNK * (chunks - 1)
    return _CHUNK // _BLOCK * (chunks - 1) + max(1, -(-last // _BLOCK)) + chunks - 1


def snapshot_compressions(header: int, counts: list[int]) -> tuple[int, int]:
    """(one-shot, extra): the compressions of one hash of ``header`` bytes then ``max(counts)``
    int32 tokens, and the fewest more that any exact BLAKE3 must spend to also output the hash of
    every shorter prefix in ``counts``, however it shares work with the one-shot pass.

    A prefix ending inside chunk ``j`` needs its own compression of that last block (flagged as
    the chunk's end: the one-shot pass compressed it without), then one parent compression per
    complete subtree to its left (a set bit of ``j``), each fed that new value, so none is
    shared. A prefix ending on a chunk boundary reuses chunk ``j``'s value; its merges with
    equal-sized subtrees (the trailing set bits of ``j``) build nodes the one-shot pass built too,
    and the rest are new, its root always (the root compression carries its own flag).
    """
    counts = sorted(set(counts))
    extra = 0
    for count in counts[:-1]:
        length = header + 4 * count
        last_chunk = (length - 1) // _CHUNK
        merges = last_chunk.bit_count()
        if length % _CHUNK:
            extra += 1 + merges
        else:
            trailing_ones = (last_chunk ^ (last_chunk + 1)).bit_length() - 1
            extra += max(1, merges - trailing_ones)
    return _one_shot_compressions(header + 4 * counts[-1]), extra


def snapshot_bound(counts: list[int]) -> float:
    """The least (one-shot + extra) / one-shot over every header length below 1 KiB: what the
    all-candidates / hash-once ratio cannot go under, even with the snapshot work at the
    one-shot's SIMD speed and nothing else counted."""
    totals = (snapshot_compressions(header, counts) for header in range(_CHUNK))
    return min((once + extra) / once for once, extra in totals)


def _identity_row(
    config: StageConfig, policy: CandidatePolicy, tokens: np.ndarray, repeat: int
) -> dict[str, Any]:
    n = int(tokens.size)
    counts = policy.candidate_token_counts(n)
    once = _median_seconds(lambda: prefix_hash(config, 0, tokens, "ns"), repeat)
    one_pass = _median_seconds(lambda: prefix_hashes(config, 0, tokens, counts, "ns"), repeat)
    data = np.ascontiguousarray(tokens, dtype="<i4").data.cast("B")
    ends = [count * 4 for count in sorted(counts)]

    def feed_only() -> None:
        hasher = blake3.blake3()
        update, done = hasher.update, 0
        for end in ends:
            update(data[done:end])
            done = end
        hasher.digest()

    feed = _median_seconds(feed_only, repeat)
    prelude = blake3.blake3(_prelude(config, 0, "ns", None))

    def unaligned() -> None:  # the prelude fed first, then the tokens: misaligned subtrees
        hasher = prelude.copy()
        hasher.update(data)
        hasher.digest()

    misaligned = _median_seconds(unaligned, repeat)
    row: dict[str, Any] = {
        "tokens": n,
        "candidates": len(counts),
        "hash_once_s": once,
        "all_candidates_s": one_pass,
        "hash_once_tokens_per_s": n / once,
        "all_candidates_tokens_per_s": n / one_pass,
        "ratio": one_pass / once,
        "feed_only_s": feed,
        "feed_only_over_once": feed / once,
        "unaligned_s": misaligned,
        "unaligned_over_once": misaligned / once,
        # The floor of the ratio for any exact BLAKE3 (compressions counted, see
        # snapshot_bound); not a timing.
        "exact_blake3_ratio_floor": snapshot_bound(counts),
    }
    if n <= NAIVE_MAX:
        naive = _median_seconds(
            lambda: [prefix_hash(config, 0, tokens[:c], "ns") for c in counts],
            max(3, repeat // 2),
        )
        row["naive_per_candidate_s"] = naive
        row["naive_over_one_pass"] = naive / one_pass
    return row


def bench_identities(repeat: int) -> list[dict[str, Any]]:
    """All lookup candidates in one pass vs the N tokens hashed once (and vs naive)."""
    config = _config(limit=0)
    assert config.kv_cache is not None
    policy = CandidatePolicy.from_cache_config(config.kv_cache)
    rng = np.random.default_rng(0)
    return [
        _identity_row(config, policy, rng.integers(0, 150_000, size=n, dtype=np.int32), repeat)
        for n in SIZES
    ]


def _restore_row(config: StageConfig, n: int, repeat: int) -> dict[str, Any]:
    base = MessageBase(session_id="bench", chat_template_id="ns")
    kv = KvStageIntegration.from_config(config, environ={})
    assert kv is not None
    tokens = np.arange(n, dtype=np.int32)
    tokens.flags.writeable = False  # as the pipeline hands a prompt to its stages
    # np.zeros maps untouched pages: a real (non-virtual) 1 GiB payload that costs nothing
    # unless someone copies it, which is exactly what this measures.
    payload = np.zeros(n * BYTES_PER_TOKEN, dtype=np.uint8)
    frame = ActivationFrame.from_array(
        payload.view(np.float32).reshape(n, BYTES_PER_TOKEN // 4), layer_end=8
    )
    kv.record_resident_activation(config, base, 0, tokens, 4096, frame)

    def restore() -> None:
        hit = kv.restore_resident_activation(config, base, 0, tokens, 4096)
        assert hit is not None
        assert hit.token_count == n

    def restore_cold() -> None:
        kv.stage_cache.forget_prompt()  # force the identity pass, as for a new prompt
        restore()

    warm = _median_seconds(restore, repeat)
    cold = _median_seconds(restore_cold, repeat)
    # For scale: what restoring by copy would cost (only where the copy fits comfortably).
    copy_s = (
        _median_seconds(lambda: frame.payload.copy(), max(3, repeat // 2))
        if n * BYTES_PER_TOKEN <= 64 * 2**20
        else None
    )
    hit = kv.restore_resident_activation(config, base, 0, tokens, 4096)
    assert hit is not None
    return {
        "tokens": n,
        "payload_bytes": n * BYTES_PER_TOKEN,
        "restore_s": warm,
        "restore_with_identity_pass_s": cold,
        "copy_payload_s": copy_s,
        "shares_memory": bool(np.shares_memory(hit.frame.payload, payload)),
    }


def _prefill_row(config: StageConfig, n: int, repeat: int) -> dict[str, Any]:
    """One stage's cache work for a prompt extending a cached one: restore, then record.

    Every timed call gets a cache of its own holding only the earlier, 17-token shorter prompt
    (built untimed): reusing one cache would make every call after the first an exact repeat
    of the prompt the previous call recorded, which restores whole and records nothing new."""
    base = MessageBase(session_id="bench", chat_template_id="ns")
    rng = np.random.default_rng(n)
    prompt = rng.integers(0, 150_000, size=n, dtype=np.int32)
    earlier = prompt[: n - 17]
    frame_of = {
        size: ActivationFrame.virtual(token_count=size, bytes_per_token=BYTES_PER_TOKEN)
        for size in (n, n - 17)
    }
    grid = config.kv_cache.shared_prefix_stride_tokens if config.kv_cache else 1
    expected_hit = (n - 17) // grid * grid  # the longest recorded rung below the earlier prompt

    def seeded() -> KvStageIntegration:
        kv = KvStageIntegration.from_config(config, environ={})
        assert kv is not None
        kv.record_resident_activation(config, base, 0, earlier, 4096, frame_of[n - 17])
        kv.stage_cache.forget_prompt()  # the prompt arrives later: this stage has not hashed it yet
        return kv

    def prefill(kv: KvStageIntegration) -> None:
        hit = kv.restore_resident_activation(config, base, 0, prompt, 4096)
        assert hit is not None
        assert hit.token_count == expected_hit, (hit.token_count, expected_hit)
        kv.record_resident_activation(config, base, 0, prompt, 4096, frame_of[n])

    work = _median_seconds_each(seeded, prefill, repeat)
    once = _median_seconds(lambda: prefix_hash(config, 0, prompt, "ns"), repeat)
    return {
        "tokens": n,
        "restore_and_record_s": work,
        "hash_once_s": once,
        "ratio": work / once,
    }


def bench_prefill(repeat: int) -> list[dict[str, Any]]:
    """Restore + record of an extended prompt (the stage hot path) vs hashing it once."""
    config = _config(limit=2)
    return [_prefill_row(config, n, repeat) for n in SIZES]


def bench_restore(repeat: int) -> list[dict[str, Any]]:
    """Restore cost of a cached prefix of 2,048 vs 131,072 tokens at 8,192 bytes per token."""
    config = _config(limit=2)
    return [_restore_row(config, n, repeat) for n in RESTORE_SIZES]


def main(argv: list[str] | None = None) -> dict[str, object]:
    """Run both parts, print a table, write JSON; returns the JSON document."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument(
        "--repeat", type=int_at_least(1), default=7, help="samples per measurement (median)"
    )
    parser.add_argument(
        "--json", type=Path, default=Path("benchmarks/out/identity.json"), help="output file"
    )
    args = parser.parse_args(argv)

    identities = bench_identities(args.repeat)
    restores = bench_restore(args.repeat)
    prefills = bench_prefill(args.repeat)
    small, large = restores[0], restores[-1]
    result: dict[str, object] = {
        "benchmark": "identity",
        "repeat": args.repeat,
        "environment": _versions(),
        "identities": identities,
        "restore": restores,
        "prefill_hot_path": prefills,
        "restore_large_over_small": large["restore_s"] / small["restore_s"],
        # Reported next to the goal's figure: with the identity pass (hashing the prompt's
        # candidate lengths, which grows with the tokens).
        "restore_with_identity_pass_large_over_small": large["restore_with_identity_pass_s"]
        / small["restore_with_identity_pass_s"],
    }
    result["goals"] = [
        {
            "name": f"restore {large['tokens']:,} / {small['tokens']:,} tokens (8,192 B/token; "
            "identities already computed)",
            "target": f"about the same: <= {RESTORE_GOAL}x, payload not copied",
            "measured": round(large["restore_s"] / small["restore_s"], 2),
            "met": large["restore_s"] / small["restore_s"] <= RESTORE_GOAL
            and all(r["shares_memory"] for r in restores),
        },
    ]

    print("prefix identities: all lookup candidates (stride 128, min 256, limit 0), medians")
    print(
        f"{'tokens':>8} {'cands':>6} {'hash once':>11} {'all cands':>11} "
        f"{'ratio':>6} {'Mtok/s once':>12} {'Mtok/s all':>11} {'naive/one':>10} "
        f"{'feed only':>10} {'floor':>6} {'unaligned':>10}"
    )
    for r in identities:
        naive = f"{r['naive_over_one_pass']:.0f}x" if "naive_over_one_pass" in r else "-"
        print(
            f"{r['tokens']:>8} {r['candidates']:>6} {r['hash_once_s'] * 1e6:>9.1f}us "
            f"{r['all_candidates_s'] * 1e6:>9.1f}us {r['ratio']:>6.2f} "
            f"{r['hash_once_tokens_per_s'] / 1e6:>12.1f} "
            f"{r['all_candidates_tokens_per_s'] / 1e6:>11.1f} {naive:>10} "
            f"{r['feed_only_over_once']:>9.1f}x {r['exact_blake3_ratio_floor']:>6.2f} "
            f"{r['unaligned_over_once']:>9.2f}x"
        )
    print(
        "floor: the least ratio any exact BLAKE3 can reach here, counting compressions only "
        "(benchmarks/bench_identity.py: snapshot_bound)"
    )
    print()
    print(f"restore of a cached prefix at {BYTES_PER_TOKEN} B/token, medians")
    print(
        f"{'tokens':>8} {'payload':>10} {'restore':>11} {'+identity pass':>15} {'view':>5} "
        f"{'copy instead':>13}"
    )
    for r in restores:
        print(
            f"{r['tokens']:>8} {r['payload_bytes'] / 2**20:>7.0f}MiB "
            f"{r['restore_s'] * 1e6:>9.1f}us "
            f"{r['restore_with_identity_pass_s'] * 1e6:>13.1f}us {r['shares_memory']!s:>5} "
            + (f"{r['copy_payload_s'] * 1e6:>11.1f}us" if r["copy_payload_s"] else f"{'-':>13}")
        )
    print(
        f"restore {large['tokens']} / {small['tokens']}: {result['restore_large_over_small']:.2f}x"
        " (identities computed); with the identity pass "
        f"{result['restore_with_identity_pass_large_over_small']:.2f}x"
    )

    print()
    print("stage hot path: restore + record of a prompt extending a cached one, medians")
    print(f"{'tokens':>8} {'restore+record':>15} {'hash once':>11} {'ratio':>6}")
    for r in prefills:
        print(
            f"{r['tokens']:>8} {r['restore_and_record_s'] * 1e6:>13.1f}us "
            f"{r['hash_once_s'] * 1e6:>9.1f}us {r['ratio']:>6.2f}"
        )

    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.json}")
    return result


if __name__ == "__main__":
    main()
