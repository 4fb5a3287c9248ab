"""Serve a real transformer split into two stages: a small random Llama model, over HTTP.

The program writes a Llama-architecture model with random weights (4 layers, width 128, 8
query heads over 2 key/value heads) and a word-level ``tokenizer.json`` to a temporary
directory, with a topology whose ``[model]`` table names it, then serves it. Each stage loads
only its own layers; a prompt extending an earlier one restores, at every stage, the cached
rows (hidden state plus every layer's keys and values) and computes only the new tokens. The
answer lists the likeliest next token ids (``top_tokens``).

Run it with ``python examples/llama_server.py`` (needs the ``server`` and ``llama`` extras).

For a real model, point a topology at its Hugging Face directory (``config.json``, the
``*.safetensors`` weights, and ``tokenizer.json`` for ``"text"``), splitting its
``num_hidden_layers`` between the stages::

    [model]
    kind = "llama"
    path = "/models/Qwen2.5-0.5B"   # relative paths start at the topology file

    [[stage]]
    stage_id = "stage-0"
    layer_start = 0
    layer_end = 12

    [[stage]]
    stage_id = "stage-1"
    layer_start = 12
    layer_end = 24

and run ``stage-runtime serve --topology that.toml``.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import trio

from stage_runtime.llama import write_random_llama
from stage_runtime.pipeline import open_pipeline
from stage_runtime.server import create_app, open_server
from stage_runtime.server.tokenizer import model_tokenizer

WORDS = [
    "the",
    "a",
    "cat",
    "dog",
    "sat",
    "ran",
    "on",
    "under",
    "mat",
    "rug",
    "and",
    "then",
    "slept",
    "woke",
]

TOPOLOGY = """\
[model]
kind = "llama"
path = "model"

[defaults]
model_id = "random-llama-4l"

[defaults.kv_cache]
mode = "lookup-record"
min_tokens = 4
shared_prefix_stride_tokens = 4

[[stage]]
stage_id = "stage-0"
layer_start = 0
layer_end = 2

[[stage]]
stage_id = "stage-1"
layer_start = 2
layer_end = 4
"""


def write_model(directory: Path) -> Path:
    """A random 4-layer Llama model, its word-level tokenizer and a 2-stage topology."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    model = write_random_llama(
        directory / "model",
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        vocab_size=64,
    )
    vocabulary = {"<unk>": 0, **{word: i + 1 for i, word in enumerate(WORDS)}}
    tokenizer = Tokenizer(models.WordLevel(vocabulary, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(model / "tokenizer.json"))
    topology = directory / "topology.toml"
    topology.write_text(TOPOLOGY, encoding="utf-8")
    return topology


async def main() -> list[dict[str, Any]]:
    """Serve the model on a free port, send a prompt and an extension of it, shut down."""
    import httpx

    answers = []
    with tempfile.TemporaryDirectory(prefix="llama-example-") as scratch:
        topology = write_model(Path(scratch))
        tokenizer = model_tokenizer(Path(scratch) / "model")
        async with (
            open_pipeline(topology) as pipeline,
            open_server(create_app(pipeline, tokenizer=tokenizer), bind="127.0.0.1:0") as server,
            httpx.AsyncClient(base_url=server.url) as client,
        ):
            for text in (
                "the cat sat on the mat and then",
                "the cat sat on the mat and then slept",
            ):
                request = {"text": text, "session_id": "example"}
                answer = (await client.post("/v1/prefill", json=request)).raise_for_status().json()
                restored = [stage["restored_tokens"] for stage in answer["stages"]]
                print(
                    f"{text!r}: {answer['tokens']} tokens, restored per stage {restored}, "
                    f"top next tokens {answer['top_tokens']}"
                )
                answers.append(answer)
    return answers


if __name__ == "__main__":
    from stage_runtime.server.command import configure_logging

    configure_logging(level="warning")  # the library's events on stderr, warnings and up
    trio.run(main)
