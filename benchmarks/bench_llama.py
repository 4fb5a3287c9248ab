"""Llama stages: what a cached prefix saves, and the pipeline against a plain numpy forward.

Writes a random Llama-architecture model of a realistic shape (by default 8 layers, width 1,024,
16 query heads over 4 key/value heads, MLP 2,816, vocabulary 8,192) to a temporary directory
and runs, each ``--repeat`` times (medians quoted):

- **cold**: a 1,000-token prompt through a fresh 2-stage pipeline (nothing cached);
- **warm**: the same prompt right after its first 900 tokens were prefilled (each stage
  restores 900 rows: hidden states, keys and values, and computes 100);
- **plain**: the same layers' forward over the 1,000 tokens, written directly in numpy (no
  stages, no cache rows), the throughput a numpy implementation reaches on this machine.

Goals (issue 23): warm at least 5x faster than cold; cold within 1.2x of plain.

Usage::

    python benchmarks/bench_llama.py
    python benchmarks/bench_llama.py --layers 4 --hidden 512 --repeat 3 --json out.json
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Final

import numpy as np
import numpy.typing as npt
import trio

from stage_runtime import StageConfig, open_pipeline
from stage_runtime._cli_support import int_at_least
from stage_runtime.config import CacheMode, KvCacheConfig
from stage_runtime.llama import (
    LlamaConfig,
    SafetensorsFiles,
    llama_model_factory,
    split_stages,
    write_random_llama,
)

NAME = "llama"
GOAL_SPEEDUP: Final = 5.0
GOAL_PLAIN_RATIO: Final = 1.2

F32 = npt.NDArray[np.float32]


def _stages(layers: int, *, cache: bool) -> list[StageConfig]:
    kv_cache = KvCacheConfig(
        mode=CacheMode.LOOKUP_RECORD if cache else CacheMode.DISABLED,
        min_tokens=100,
        shared_prefix_stride_tokens=100,
        max_entries=16,
    )
    return split_stages(layers, 2, model_id="bench-llama", kv_cache=kv_cache, ctx_size=4096)


def plain_forward(directory: Path, tokens: npt.NDArray[np.int32]) -> tuple[F32, float]:
    """Every layer over every token, then the last position's logits: float32 numpy, no cache.
    Returns the logits and the seconds the forward took (loading the weights excluded)."""
    config = LlamaConfig.from_file(directory / "config.json")
    files = SafetensorsFiles(directory)
    d = config.head_dim
    heads, groups = config.num_attention_heads, config.num_key_value_heads
    n = tokens.size

    def load(name: str) -> F32:
        return files.load(name, files.shape(name))

    def norm(x: F32, w: F32) -> F32:
        out: F32 = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + config.rms_norm_eps) * w
        return out

    angles = np.arange(n)[:, None] * config.inverse_frequencies()[None, :]
    cos, sin = (
        np.cos(angles).astype(np.float32)[:, None],
        np.sin(angles).astype(np.float32)[:, None],
    )

    def rope(x: F32) -> F32:
        a, b = x[..., : d // 2], x[..., d // 2 :]
        return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)

    weights = {name: load(name) for name in files.names()}
    started = time.perf_counter()
    x = weights["model.embed_tokens.weight"][tokens]
    mask = np.triu(np.full((n, n), -np.inf, dtype=np.float32), 1)
    for layer in range(config.num_hidden_layers):
        p = f"model.layers.{layer}."
        hn = norm(x, weights[p + "input_layernorm.weight"])
        q = rope((hn @ weights[p + "self_attn.q_proj.weight"].T).reshape(n, heads, d))
        k = rope((hn @ weights[p + "self_attn.k_proj.weight"].T).reshape(n, groups, d))
        v = (hn @ weights[p + "self_attn.v_proj.weight"].T).reshape(n, groups, d)
        k = np.repeat(k, heads // groups, axis=1).transpose(1, 2, 0)
        v = np.repeat(v, heads // groups, axis=1).transpose(1, 0, 2)
        scores = q.transpose(1, 0, 2) @ k / np.float32(math.sqrt(d)) + mask
        scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
        scores /= scores.sum(axis=-1, keepdims=True)
        attended = (scores @ v).transpose(1, 0, 2).reshape(n, heads * d)
        x = x + attended @ weights[p + "self_attn.o_proj.weight"].T
        hn = norm(x, weights[p + "post_attention_layernorm.weight"])
        gate = hn @ weights[p + "mlp.gate_proj.weight"].T
        up = hn @ weights[p + "mlp.up_proj.weight"].T
        x = (
            x
            + (gate * (0.5 + 0.5 * np.tanh(0.5 * gate)) * up)
            @ weights[p + "mlp.down_proj.weight"].T
        )
    logits: F32 = norm(x[-1:], weights["model.norm.weight"]) @ weights["lm_head.weight"].T
    last: F32 = logits[0]
    return last, time.perf_counter() - started


async def _prefill_s(
    directory: Path, layers: int, prompt: list[int], prefix: int | None
) -> tuple[float, Any]:
    async with open_pipeline(
        _stages(layers, cache=prefix is not None), llama_model_factory(directory), environ={}
    ) as pipeline:
        if prefix is not None:
            await pipeline.prefill(prompt[:prefix], session_id="bench")
        started = time.perf_counter()
        result = await pipeline.prefill(prompt, session_id="bench")
        return time.perf_counter() - started, result


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark; print a table, write JSON and return the results."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int_at_least(1), default=8)
    parser.add_argument("--hidden", type=int_at_least(1), default=1024)
    parser.add_argument("--heads", type=int_at_least(1), default=16)
    parser.add_argument("--kv-heads", type=int_at_least(1), default=4)
    parser.add_argument("--intermediate", type=int_at_least(1), default=2816)
    parser.add_argument("--vocab", type=int_at_least(1), default=8192)
    parser.add_argument("--tokens", type=int_at_least(1), default=1000)
    parser.add_argument("--cached", type=int_at_least(1), default=900)
    parser.add_argument("--repeat", type=int_at_least(1), default=3)
    parser.add_argument("--json", default=f"benchmarks/out/{NAME}.json")
    args = parser.parse_args(argv)
    if args.cached >= args.tokens or args.heads % args.kv_heads:
        parser.error("--cached must be below --tokens, and --heads a multiple of --kv-heads")
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, args.vocab, size=args.tokens).tolist()
    runs: dict[str, list[float]] = {"cold": [], "warm": [], "plain": []}
    with tempfile.TemporaryDirectory(prefix="bench-llama-") as scratch:
        directory = write_random_llama(
            Path(scratch) / "model",
            hidden_size=args.hidden,
            intermediate_size=args.intermediate,
            num_hidden_layers=args.layers,
            num_attention_heads=args.heads,
            num_key_value_heads=args.kv_heads,
            vocab_size=args.vocab,
        )
        differences = []
        for _ in range(args.repeat):
            cold_s, cold = trio.run(_prefill_s, directory, args.layers, prompt, None)
            warm_s, warm = trio.run(_prefill_s, directory, args.layers, prompt, args.cached)
            reference, plain_s = plain_forward(directory, np.asarray(prompt, dtype=np.int32))
            runs["cold"].append(cold_s)
            runs["warm"].append(warm_s)
            runs["plain"].append(plain_s)
            differences.append(float(np.max(np.abs(warm.logits - cold.logits))))
            differences.append(float(np.max(np.abs(cold.logits - reference))))
    median = {name: statistics.median(values) for name, values in runs.items()}
    speedup = median["cold"] / median["warm"]
    plain_ratio = median["cold"] / median["plain"]
    print(
        f"Llama stages: {args.layers} layers, width {args.hidden}, {args.heads}/{args.kv_heads} "
        f"heads, MLP {args.intermediate}, 2 stages; {args.tokens}-token prompt, "
        f"{args.cached} cached; median of {args.repeat}"
    )
    print(f"  {'run':<8}{'seconds':>10}{'tokens/s':>12}")
    for name in ("cold", "warm", "plain"):
        print(f"  {name:<8}{median[name]:>10.3f}{args.tokens / median[name]:>12,.0f}")
    print(
        f"  warm vs cold: {speedup:.1f}x faster (goal >= {GOAL_SPEEDUP:g}x) "
        f"{'MET' if speedup >= GOAL_SPEEDUP else 'MISSED'}"
    )
    print(
        f"  cold vs plain numpy: {plain_ratio:.2f}x the time (goal <= {GOAL_PLAIN_RATIO:g}x) "
        f"{'MET' if plain_ratio <= GOAL_PLAIN_RATIO else 'MISSED'}"
    )
    print(f"  largest logit difference (warm/cold/plain): {max(differences):.2e}")
    document = {
        "benchmark": NAME,
        "arguments": vars(args),
        "seconds": runs,
        "median_s": median,
        "tokens_per_s": {name: args.tokens / value for name, value in median.items()},
        "warm_speedup": speedup,
        "cold_over_plain": plain_ratio,
        "max_logit_difference": max(differences),
        "goals": {"warm_speedup_min": GOAL_SPEEDUP, "cold_over_plain_max": GOAL_PLAIN_RATIO},
    }
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(document, indent=2) + "\n", encoding="utf-8")
    return document


if __name__ == "__main__":
    main()
