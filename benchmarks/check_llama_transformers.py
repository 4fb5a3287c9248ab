"""Check stage_runtime's Llama stages against Hugging Face ``transformers`` on the same weights.

Outside CI (it needs ``torch`` and ``transformers``, which the project does not depend on):
writes a random model with :func:`stage_runtime.llama.write_random_llama` (or takes a model
directory), runs a prompt through a 2-stage pipeline (cached prefix, then the full prompt) and
through ``AutoModelForCausalLM`` in float32, and compares the last position's logits. Exits 0
when the largest difference is at most ``--tolerance``, 1 otherwise, 2 without torch.

Usage::

    python benchmarks/check_llama_transformers.py
    python benchmarks/check_llama_transformers.py --model /models/Qwen2.5-0.5B --tokens 64
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np
import trio

from stage_runtime import open_pipeline
from stage_runtime.config import CacheMode, KvCacheConfig
from stage_runtime.llama import LlamaConfig, llama_model_factory, split_stages, write_random_llama


async def _pipeline_logits(directory: Path, tokens: list[int]) -> np.ndarray:
    layers = LlamaConfig.from_file(directory / "config.json").num_hidden_layers
    cache = KvCacheConfig(mode=CacheMode.LOOKUP_RECORD, min_tokens=4, shared_prefix_stride_tokens=4)
    stages = split_stages(layers, min(2, layers), model_id="check", kv_cache=cache)
    async with open_pipeline(stages, llama_model_factory(directory), environ={}) as pipeline:
        await pipeline.prefill(tokens[: len(tokens) * 3 // 4], session_id="check")
        result = await pipeline.prefill(tokens, session_id="check")
    assert result.logits is not None
    return result.logits


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="a model directory (default: a random one)")
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--tolerance", type=float, default=1e-3)
    args = parser.parse_args(argv)
    try:
        import torch  # type: ignore[import-not-found, unused-ignore]
        from transformers import AutoModelForCausalLM  # type: ignore[import-not-found, unused-ignore]
    except ImportError:
        print("needs torch and transformers (pip install torch transformers)", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="check-llama-") as scratch:
        directory = args.model or write_random_llama(Path(scratch) / "model", num_hidden_layers=4)
        vocab = LlamaConfig.from_file(directory / "config.json").vocab_size
        tokens = np.random.default_rng(0).integers(0, vocab, size=args.tokens).tolist()
        ours = trio.run(_pipeline_logits, directory, tokens)
        model = AutoModelForCausalLM.from_pretrained(directory, torch_dtype=torch.float32)
        with torch.no_grad():
            theirs = model(torch.tensor([tokens])).logits[0, -1].numpy()
    difference = float(np.max(np.abs(ours - theirs)))
    print(f"largest logit difference against transformers: {difference:.2e}")
    return 0 if difference <= args.tolerance else 1


if __name__ == "__main__":
    sys.exit(main())
