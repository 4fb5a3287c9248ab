"""Llama-family stages: loading, the cached state, and logits equal to a plain reference."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import numpy.typing as npt
import pytest

from stage_runtime import ConfigError, StageConfig, open_pipeline
from stage_runtime.config import CacheMode, KvCacheConfig
from stage_runtime.llama import (
    LlamaConfig,
    LlamaStageModel,
    SafetensorsFiles,
    llama_model_factory,
    split_stages,
    write_random_llama,
)
from stage_runtime.pipeline import load_model
from stage_runtime.server import create_app, open_server
from stage_runtime.server.app import TOP_TOKENS
from stage_runtime.server.tokenizer import model_tokenizer

Array = npt.NDArray[np.float64]

SHAPES: dict[str, dict[str, Any]] = {
    # grouped-query attention, 2 query heads per key/value head
    "gqa": dict(hidden_size=48, num_attention_heads=4, num_key_value_heads=2, intermediate_size=80),
    # multi-head attention, odd widths, biases (Qwen2), tied output head, llama3 rope scaling
    "mha-odd": dict(
        hidden_size=30,
        num_attention_heads=3,
        num_key_value_heads=3,
        intermediate_size=37,
        attention_bias=True,
        tie_word_embeddings=True,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
    ),
}


# ------------------------------------------------------------------ a plain reference forward


def _tensors(directory: Path) -> dict[str, Array]:
    files = SafetensorsFiles(directory)
    out: dict[str, Array] = {}  # (the test reads the header it parsed)
    for name in files.names():
        out[name] = files.load(name, files.shape(name)).astype(np.float64)
    return out


def reference_logits(directory: Path, tokens: list[int]) -> Array:
    """The last position's logits, computed the plain way: float64, one head at a time, the
    whole prompt at once, no cache (written apart from stage_runtime.llama's own maths)."""
    config = json.loads((directory / "config.json").read_text())
    w = _tensors(directory)
    heads, groups = config["num_attention_heads"], config["num_key_value_heads"]
    d = config["head_dim"]
    eps = config["rms_norm_eps"]
    n = len(tokens)

    def norm(x: Array, weight: Array) -> Array:
        normed: Array = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight
        return normed

    inverse = LlamaConfig.from_file(directory / "config.json").inverse_frequencies()
    angle = np.arange(n)[:, None] * inverse[None, :]

    def rope(x: Array) -> Array:  # (n, d)
        half = d // 2
        a, b = x[:, :half], x[:, half:]
        return np.concatenate(
            [a * np.cos(angle) - b * np.sin(angle), b * np.cos(angle) + a * np.sin(angle)], axis=1
        )

    x = w["model.embed_tokens.weight"][tokens]
    for layer in range(config["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        h = norm(x, w[p + "input_layernorm.weight"])
        q = h @ w[p + "self_attn.q_proj.weight"].T
        k = h @ w[p + "self_attn.k_proj.weight"].T
        v = h @ w[p + "self_attn.v_proj.weight"].T
        if config["attention_bias"]:
            q += w[p + "self_attn.q_proj.bias"]
            k += w[p + "self_attn.k_proj.bias"]
            v += w[p + "self_attn.v_proj.bias"]
        outputs = []
        for head in range(heads):
            group = head // (heads // groups)
            qh = rope(q[:, head * d : (head + 1) * d])
            kh = rope(k[:, group * d : (group + 1) * d])
            vh = v[:, group * d : (group + 1) * d]
            scores = qh @ kh.T / math.sqrt(d)
            scores[np.triu_indices(n, 1)] = -np.inf
            weights = np.exp(scores - scores.max(axis=1, keepdims=True))
            weights /= weights.sum(axis=1, keepdims=True)
            outputs.append(weights @ vh)
        x = x + np.concatenate(outputs, axis=1) @ w[p + "self_attn.o_proj.weight"].T
        h = norm(x, w[p + "post_attention_layernorm.weight"])
        gate = h @ w[p + "mlp.gate_proj.weight"].T
        up = h @ w[p + "mlp.up_proj.weight"].T
        x = x + (gate / (1 + np.exp(-gate)) * up) @ w[p + "mlp.down_proj.weight"].T
    head_weight = w.get("lm_head.weight", w["model.embed_tokens.weight"])
    logits: Array = norm(x[-1:], w["model.norm.weight"]) @ head_weight.T
    last: Array = logits[0]
    return last


# ------------------------------------------------------------------------------- the pipeline


def _stages(layers: int, stages: int, *, cache: bool = True) -> list[StageConfig]:
    kv_cache = (
        KvCacheConfig(
            mode=CacheMode.LOOKUP_RECORD,
            min_tokens=4,
            shared_prefix_stride_tokens=4,
            max_entries=64,
        )
        if cache
        else KvCacheConfig(mode=CacheMode.DISABLED)
    )
    return split_stages(layers, stages, model_id="random-llama", kv_cache=kv_cache)


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("stages", [1, 2, 3, 4])
async def test_cached_logits_equal_uncached_and_the_reference(
    tmp_path: Path, shape: str, stages: int
) -> None:
    """A prompt extending a cached one restores its prefix at every stage, and the last
    stage's logits equal both the uncached pipeline's and the plain reference's."""
    directory = write_random_llama(tmp_path / "model", num_hidden_layers=4, **SHAPES[shape])
    factory = llama_model_factory(directory)
    rng = np.random.default_rng(stages)
    first = rng.integers(0, 256, size=21).tolist()
    second = [*first, *rng.integers(0, 256, size=6).tolist()]
    async with open_pipeline(_stages(4, stages), factory, environ={}) as cached:
        await cached.prefill(first, session_id="t")
        warm = await cached.prefill(second, session_id="t")
    async with open_pipeline(_stages(4, stages, cache=False), factory, environ={}) as plain:
        cold = await plain.prefill(second, session_id="t")
    assert [r.restored_tokens for r in warm.stages] == [20] * stages
    assert [r.restored_tokens for r in cold.stages] == [0] * stages
    assert warm.logits is not None
    assert cold.logits is not None
    assert np.max(np.abs(warm.logits - cold.logits)) <= 1e-4
    reference = reference_logits(directory, second)
    assert np.max(np.abs(warm.logits - reference)) <= 1e-4
    assert warm.frame.rows().shape == (len(second), SHAPES[shape]["hidden_size"])


async def test_a_whole_prompt_hit_gives_the_same_logits(tmp_path: Path) -> None:
    """Restoring every token (nothing computed) still gives the last position's logits."""
    directory = write_random_llama(tmp_path / "model", num_hidden_layers=2)
    tokens = list(range(40, 56))
    async with open_pipeline(_stages(2, 2), llama_model_factory(directory), environ={}) as p:
        first = await p.prefill(tokens, session_id="t")
        again = await p.prefill(tokens, session_id="t")
    assert [r.computed_tokens for r in again.stages] == [0, 0]
    assert first.logits is not None
    assert again.logits is not None
    assert np.max(np.abs(first.logits - again.logits)) <= 1e-5


def test_rows_hold_the_hidden_state_then_each_layers_keys_and_values(tmp_path: Path) -> None:
    """The recorded row width counts the hidden state and every layer's K and V."""
    directory = write_random_llama(tmp_path / "m", hidden_size=32, num_hidden_layers=3)
    model = LlamaStageModel.load(directory, layer_start=1, layer_end=3, stage_index=1)
    config = model.config
    assert model.activation_width == 32 + 2 * 2 * config.kv_dim
    assert model.embeddings is None
    assert model.head is not None


@pytest.mark.parametrize("dtype", ["F16", "BF16"])
def test_half_precision_weights_are_upcast_once(tmp_path: Path, dtype: str) -> None:
    """float16 and bfloat16 weights load as the float32 values they hold, from shards."""
    full = write_random_llama(tmp_path / "f32", num_hidden_layers=1)
    half = write_random_llama(tmp_path / dtype, num_hidden_layers=1, dtype=dtype, shards=3)
    name = "model.layers.0.mlp.up_proj.weight"
    exact = SafetensorsFiles(full).load(name, (128, 64))
    loaded = SafetensorsFiles(half).load(name, (128, 64))
    assert loaded.dtype == np.float32
    assert np.max(np.abs(loaded - exact)) <= (1e-2 if dtype == "BF16" else 1e-3)
    assert (half / "model.safetensors.index.json").exists()


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ({"dtype": ["F32"]}, "dtype must be a string, got ['F32']"),
        ({"shape": "ab"}, "shape must be a list of integers >= 0, got 'ab'"),
        ({"shape": [-2, -2]}, "shape must be a list of integers >= 0, got [-2, -2]"),
        ({"data_offsets": [None, 16]}, "data_offsets must be two integers 0 <= begin <= end"),
        ({"data_offsets": ["x", 16]}, "data_offsets must be two integers 0 <= begin <= end"),
        # A negative begin pointed into the header: its JSON was read as the tensor's floats.
        ({"data_offsets": [-16, 0]}, "data_offsets must be two integers 0 <= begin <= end"),
    ],
)
def test_malformed_safetensors_entries_are_config_errors(
    tmp_path: Path, entry: dict[str, object], message: str
) -> None:
    """A header entry of the wrong types or with a negative offset is a ConfigError naming
    the file, the tensor and the field (it was a TypeError or ValueError, or garbage)."""
    header = json.dumps({"t": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16], **entry}})
    data = header.encode()
    (tmp_path / "model.safetensors").write_bytes(len(data).to_bytes(8, "little") + data + bytes(16))
    with pytest.raises(
        ConfigError, match=re.escape(f"malformed safetensors entry for t: {message}")
    ):
        SafetensorsFiles(tmp_path)


def test_bad_model_directories_are_config_errors(tmp_path: Path) -> None:
    """A missing file, another architecture, a wrong shape or a layer range outside the model
    is a ConfigError naming what is wrong."""
    with pytest.raises(ConfigError, match=r"config\.json"):
        llama_model_factory(tmp_path / "nothing")
    directory = write_random_llama(tmp_path / "m", num_hidden_layers=2)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "architectures": ["GPT2"]}))
    with pytest.raises(ConfigError, match="architectures must name one of"):
        LlamaStageModel.load(directory, layer_start=0, layer_end=2)
    (directory / "config.json").write_text(json.dumps({**config, "hidden_size": 65}))
    with pytest.raises(
        ConfigError,
        match=r"q_proj\.weight must have shape \[64, 65\], got \[64, 64\]",
    ):
        LlamaStageModel.load(directory, layer_start=0, layer_end=1)
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="must lie in"):
        LlamaStageModel.load(directory, layer_start=1, layer_end=3)
    (directory / "model.safetensors").unlink()
    with pytest.raises(ConfigError, match="no weights"):
        LlamaStageModel.load(directory, layer_start=0, layer_end=2)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"rope_theta": 0}, "rope_theta must be a finite number > 0, got 0.0"),
        ({"rope_theta": -1.0}, "rope_theta must be a finite number > 0, got -1.0"),
        ({"rope_theta": float("nan")}, "rope_theta must be a finite number > 0, got nan"),
        ({"rms_norm_eps": -1.0}, "rms_norm_eps must be a finite number >= 0, got -1.0"),
        ({"rms_norm_eps": float("inf")}, "rms_norm_eps must be a finite number >= 0, got inf"),
        (
            {"rope_scaling": {"rope_type": "linear", "factor": 0}},
            "rope_scaling factor must be a finite number > 0, got 0",
        ),
        (
            {"rope_scaling": {"rope_type": "linear", "factor": float("nan")}},
            "rope_scaling factor must be a finite number > 0, got nan",
        ),
        (
            {"rope_scaling": {"rope_type": "linear", "factor": "2.0"}},
            "rope_scaling factor must be a finite number > 0, got '2.0'",
        ),
        (
            {"rope_scaling": {"rope_type": "linear", "factor": 10**400}},
            "rope_scaling factor must be a finite number > 0, got 1000",
        ),
        (
            {
                "rope_scaling": {
                    "rope_type": "llama3",
                    "factor": 8,
                    "low_freq_factor": 4,
                    "high_freq_factor": 4,
                    "original_max_position_embeddings": 8192,
                }
            },
            "rope_scaling high_freq_factor must be > low_freq_factor, got 4.0 and 4.0",
        ),
    ],
)
def test_numbers_that_would_make_activations_nan_are_config_errors(
    tmp_path: Path, changes: dict[str, object], message: str
) -> None:
    """A config.json whose rotary or norm constants divide by zero or are NaN (Python's json
    reads NaN) is refused at load, naming the key; it used to load and compute NaN or inf
    activations (numpy's RuntimeWarnings at most), which the caches then recorded."""
    directory = write_random_llama(tmp_path / "m", num_hidden_layers=1)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, **changes}))
    with pytest.raises(ConfigError, match=re.escape(message)):
        LlamaConfig.from_file(directory / "config.json")


def test_token_ids_outside_the_vocabulary_are_refused(tmp_path: Path) -> None:
    directory = write_random_llama(tmp_path / "m", num_hidden_layers=1, vocab_size=100)
    model = LlamaStageModel.load(directory, layer_start=0, layer_end=1)
    with pytest.raises(ConfigError, match=r"ids in \[0, 100\).*got 100"):
        model.embed(np.array([1, 100], dtype=np.int32))


async def test_long_prompts_compute_in_worker_threads_with_the_same_result(
    tmp_path: Path,
) -> None:
    """Above the threshold a forward runs in a worker thread; the rows are the same."""
    directory = write_random_llama(tmp_path / "m", num_hidden_layers=2)
    inline = LlamaStageModel.load(directory, layer_start=0, layer_end=2)
    threaded = LlamaStageModel.load(directory, layer_start=0, layer_end=2, thread_threshold_macs=0)
    frame = inline.embed(np.arange(30, dtype=np.int32))
    a = await inline.forward(frame, 0, None)
    b = await threaded.forward(frame, 0, None)
    assert np.array_equal(a.rows(), b.rows())


def _topology(directory: Path, model: str) -> Path:
    path = directory / "topology.toml"
    path.write_text(
        f"{model}\n"
        "[defaults]\nmodel_id = 'random-llama'\n"
        "[defaults.kv_cache]\nmode = 'lookup-record'\nmin_tokens = 4\n"
        "shared_prefix_stride_tokens = 4\n"
        "[[stage]]\nstage_id = 's0'\nlayer_start = 0\nlayer_end = 1\n"
        "[[stage]]\nstage_id = 's1'\nlayer_start = 1\nlayer_end = 2\n",
        encoding="utf-8",
    )
    return path


def _layered_topology(directory: Path, first: tuple[int, int], second: tuple[int, int]) -> Path:
    """A 2-stage topology over the model in ``directory / "weights"``, with these layer ranges."""
    path = directory / "layers.toml"
    path.write_text(
        "[model]\nkind = 'llama'\npath = 'weights'\n"
        "[defaults]\nmodel_id = 'random-llama'\n"
        f"[[stage]]\nstage_id = 's0'\nlayer_start = {first[0]}\nlayer_end = {first[1]}\n"
        f"[[stage]]\nstage_id = 's1'\nlayer_start = {second[0]}\nlayer_end = {second[1]}\n",
        encoding="utf-8",
    )
    return path


@pytest.mark.parametrize(
    ("first", "second", "message"),
    [
        (  # the last stage ended early: no final norm nor head, logits None, no top_tokens
            (0, 2),
            (2, 3),
            r"line 13: stage\[1\]\.layer_end must be 4: the stages must cover the model's 4 "
            r"layers \(num_hidden_layers\) to the last, got 3 \(stage 's1'\)$",
        ),
        (  # past the model: the stage failed to load, an exception group from the pipeline
            (0, 2),
            (2, 8),
            r"line 13: stage\[1\]\.layer_end must be 4: .* got 8 \(stage 's1'\)$",
        ),
        (
            (1, 2),
            (2, 4),
            r"line 8: stage\[0\]\.layer_start must be 0: the stages must cover the model's 4 "
            r"layers \(num_hidden_layers\) from the first, got 1 \(stage 's0'\)$",
        ),
    ],
    ids=["ending-early", "ending-past-the-model", "starting-late"],
)
async def test_stages_must_cover_exactly_the_models_layers(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    first: tuple[int, int],
    second: tuple[int, int],
    message: str,
) -> None:
    """The factory knows the model's layer count: stages not covering exactly ``[0, layers)``
    are a ConfigError naming the file, line, stage, field and value before any stage loads."""
    write_random_llama(tmp_path / "weights", num_hidden_layers=4)
    topology = _layered_topology(tmp_path, first, second)
    loads: list[int] = []
    monkeypatch.setattr(LlamaStageModel, "load", lambda *_, **kw: loads.append(kw["layer_start"]))
    with pytest.raises(ConfigError, match=f"^{re.escape(str(topology))}: {message}"):
        async with open_pipeline(topology, environ={}):
            pass
    assert loads == []


async def test_stages_given_as_a_list_are_checked_against_the_models_layers(
    tmp_path: Path,
) -> None:
    """Stages passed as configurations, with the factory, are named by their list index."""
    directory = write_random_llama(tmp_path / "weights", num_hidden_layers=4)
    factory = llama_model_factory(directory)
    stages = _stages(3, 2, cache=False)
    with pytest.raises(
        ConfigError, match=r"^stages\[1\]\.layer_end must be 4: .* got 3 \(stage 's1'\)$"
    ):
        async with open_pipeline(stages, factory, environ={}):
            pass
    async with open_pipeline(_stages(4, 2, cache=False), factory, environ={}) as pipeline:
        result = await pipeline.prefill([1, 2, 3], session_id="t")
    assert result.logits is not None


async def test_a_topology_names_its_model_and_serve_answers_top_tokens(tmp_path: Path) -> None:
    """``[model] kind = "llama"`` runs the model directory (relative to the file) without a
    factory argument; over HTTP the answer lists the likeliest next tokens."""
    write_random_llama(tmp_path / "weights", num_hidden_layers=2)
    topology = _topology(tmp_path, "[model]\nkind = 'llama'\npath = 'weights'")
    tokens = list(range(10, 22))
    async with open_pipeline(topology, environ={}) as pipeline:
        result = await pipeline.prefill(tokens, session_id="t")
        assert result.logits is not None
        expected = [int(t) for t in np.argsort(result.logits)[::-1][:TOP_TOKENS]]
        app = create_app(pipeline)
        async with (
            open_server(app, bind="127.0.0.1:0") as server,
            httpx.AsyncClient(base_url=server.url) as client,
        ):
            answer = await client.post("/v1/prefill", json={"tokens": tokens, "session_id": "h"})
    assert answer.status_code == 200
    assert answer.json()["top_tokens"] == expected
    assert [s["restored_tokens"] for s in answer.json()["stages"]] == [12, 12]


async def test_out_of_vocabulary_ids_are_refused_before_any_stage_runs(tmp_path: Path) -> None:
    """The pipeline knows the model's vocabulary from its factory: an id outside it is a
    ConfigError naming the first (nothing runs, the pipeline stays usable), and over HTTP a
    400 naming the field, where the first stage's failure used to be a 500."""
    write_random_llama(tmp_path / "weights", num_hidden_layers=2, vocab_size=64)
    topology = _topology(tmp_path, "[model]\nkind = 'llama'\npath = 'weights'")
    async with open_pipeline(topology, environ={}) as pipeline:
        assert pipeline.vocab_size == 64
        with pytest.raises(ConfigError, match=r"^tokens\[2\] must be an id in \[0, 64\).*got 64$"):
            await pipeline.prefill([1, 2, 64, -1], session_id="t")
        assert (await pipeline.prefill([1, 2, 63], session_id="t")).logits is not None
        async with (
            open_server(create_app(pipeline), bind="127.0.0.1:0") as server,
            httpx.AsyncClient(base_url=server.url) as client,
        ):
            refused = await client.post("/v1/prefill", json={"tokens": [5, -3], "session_id": "h"})
            answered = await client.post("/v1/prefill", json={"tokens": [5, 6], "session_id": "h"})
        stats = await pipeline.statistics()
    assert refused.status_code == 400
    assert refused.json()["field"] == "tokens"
    assert "tokens[1] must be an id in [0, 64)" in refused.json()["message"]
    assert answered.status_code == 200
    assert all(stage.cache is None or stage.cache.lookups >= 1 for stage in stats.stages)


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ("[model]\nkind = 'gpt'", r"model\.kind must be 'llama' or 'reference', got 'gpt'"),
        ("[model]\nkind = 'llama'", r"model\.path must be a model directory, got None"),
        ("[model]\nkind = 'llama'\npath = 'nowhere'", r"nowhere/config\.json: model config not"),
        ("[model]\nkind = 'reference'\npath = 'x'", r"unknown field model\.path \(known "),
        (
            "[model]\nkind = 'reference'\nwidth = 0",
            r"model\.width must be an integer in \[1, 8,192\], got 0",
        ),
        (  # as serve --width: the stages used to fail to start with a numpy MemoryError
            "[model]\nkind = 'reference'\nwidth = 10000000",
            r"model\.width must be an integer in \[1, 8,192\], got 10000000",
        ),
    ],
)
def test_bad_model_tables_are_config_errors(tmp_path: Path, table: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_model(_topology(tmp_path, table))


def test_a_topology_without_a_model_table_needs_a_factory(tmp_path: Path) -> None:
    assert load_model(_topology(tmp_path, "")) is None
    reference = load_model(_topology(tmp_path, "[model]\nkind = 'reference'\nwidth = 8"))
    assert reference is not None


def _write_word_tokenizer(directory: Path) -> dict[str, int]:
    """A word-level tokenizer.json (whitespace-split words; unknown words are id 0)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "the": 5, "cat": 7, "sat": 9, "on": 11, "mat": 13}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(directory / "tokenizer.json"))
    return vocab


async def test_text_is_tokenized_by_the_models_own_tokenizer(tmp_path: Path) -> None:
    """With a tokenizer.json in the model directory, ``"text"`` becomes that tokenizer's ids:
    the answer counts them and equals the answer for the same ids sent as ``"tokens"``."""
    directory = write_random_llama(tmp_path / "weights", num_hidden_layers=2)
    vocab = _write_word_tokenizer(directory)
    tokenizer = model_tokenizer(directory)
    assert tokenizer is not None
    text = "the cat sat on the mat"
    ids = [vocab[word] for word in text.split()]
    assert tokenizer.encode(text).tolist() == ids
    topology = _topology(tmp_path, "[model]\nkind = 'llama'\npath = 'weights'")
    async with open_pipeline(topology, environ={}) as pipeline:
        app = create_app(pipeline, tokenizer=tokenizer)
        async with (
            open_server(app, bind="127.0.0.1:0") as server,
            httpx.AsyncClient(base_url=server.url) as client,
        ):
            by_text = await client.post("/v1/prefill", json={"text": text, "session_id": "a"})
            by_ids = await client.post("/v1/prefill", json={"tokens": ids, "session_id": "b"})
    assert by_text.status_code == 200
    assert by_text.json()["tokens"] == len(ids)
    assert by_text.json()["top_tokens"] == by_ids.json()["top_tokens"]


async def test_an_app_given_no_tokenizer_refuses_text_for_a_model_with_a_vocabulary(
    tmp_path: Path,
) -> None:
    """``create_app(pipeline)`` without a tokenizer: for a Llama model (a vocabulary of its
    own) ``"text"`` is a 400 naming the field, not bytes taken for its token ids."""
    write_random_llama(tmp_path / "weights", num_hidden_layers=2)
    topology = _topology(tmp_path, "[model]\nkind = 'llama'\npath = 'weights'")
    async with (
        open_pipeline(topology, environ={}) as pipeline,
        open_server(create_app(pipeline), bind="127.0.0.1:0") as server,
        httpx.AsyncClient(base_url=server.url) as client,
    ):
        refused = await client.post("/v1/prefill", json={"text": "hi", "session_id": "a"})
    assert refused.status_code == 400
    assert refused.json()["field"] == "text"
    assert refused.json()["message"] == (
        "text needs the model's own tokenizer, and the server was given none for this model: "
        "send token ids in tokens"
    )


def test_a_model_directory_without_tokenizer_json_has_no_tokenizer(tmp_path: Path) -> None:
    assert model_tokenizer(write_random_llama(tmp_path / "m", num_hidden_layers=1)) is None
    (tmp_path / "m" / "tokenizer.json").write_text("{not json")
    with pytest.raises(ConfigError, match="cannot load the tokenizer"):
        model_tokenizer(tmp_path / "m")


def test_the_benchmark_runs_and_writes_its_figures(tmp_path: Path) -> None:
    """bench_llama on a tiny model: cold, warm and plain timings and equal logits."""
    from tests.benchmark_scripts import load_script

    bench = load_script("bench_llama")
    out = tmp_path / "llama.json"
    shape = ["--layers", "2", "--hidden", "32", "--heads", "4", "--kv-heads", "2"]
    sizes = ["--intermediate", "48", "--vocab", "64", "--tokens", "40", "--cached", "30"]
    document = bench.main([*shape, *sizes, "--repeat", "1", "--json", str(out)])
    assert json.loads(out.read_text())["median_s"] == document["median_s"]
    assert set(document["median_s"]) == {"cold", "warm", "plain"}
    assert document["max_logit_difference"] <= 1e-4


def test_split_stages_cuts_contiguous_even_ranges() -> None:
    ranges = [(c.layer_start, c.layer_end) for c in split_stages(4, 3, model_id="m")]
    assert ranges == [(0, 1), (1, 3), (3, 4)]
    with pytest.raises(ConfigError, match=r"stages must be in \[1, 4\] for 4 layers, got 5"):
        split_stages(4, 5, model_id="m")
