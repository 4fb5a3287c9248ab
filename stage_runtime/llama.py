"""Llama-family transformer stages on CPU: layer ranges of a Hugging Face model directory.

A :class:`LlamaStageModel` runs layers ``layer_start..layer_end-1`` of a Llama-architecture
model (Llama, Mistral, Qwen2 and most open models share it): RMSNorm, rotary position
embeddings, grouped-query causal attention and a SwiGLU MLP, in numpy float32 with BLAS matrix
products. The first stage (``layer_start == 0``) embeds the token ids; the last
(``layer_end == num_hidden_layers``) applies the final norm and the output head and gives the
next-token logits of the prompt's last position (:meth:`LlamaStageModel.logits`).

**What the cache keeps.** To compute tokens ``k..N-1`` a layer needs the keys and values of
tokens ``0..k-1``, not only the stage's output for them. So a stage's output row for a token is
its output hidden state followed by, for each of its layers, that token's key (after the rotary
embedding) and value::

    [hidden (hidden_size) | K layer 0 | V layer 0 | K layer 1 | V layer 1 | ...]

Rows stay token-major, so a restored prefix of ``k`` rows is exactly the state needed to
continue at token ``k``, and prefix cuts, pages and byte accounting count whole rows as for any
model. Only the hidden part goes to the next stage (:meth:`LlamaStageModel.downstream`).

**Weights** come from a model directory: ``config.json`` and ``model.safetensors`` (or shards
listed in ``model.safetensors.index.json``). Each stage reads only its own layers' tensors
through a memory map of the files (the safetensors format's lazy per-tensor access), so no
process holds the whole model; ``bfloat16`` and ``float16`` tensors are upcast to float32 once,
at load. :func:`write_random_llama` writes a random model directory (tests, examples,
benchmarks).
"""

from __future__ import annotations

import itertools
import json
import math
import mmap
import os
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Final

import attrs
import numpy as np
import numpy.typing as npt

from stage_runtime._validators import is_int
from stage_runtime.config import KvCacheConfig, StageConfig
from stage_runtime.errors import ConfigError, FrameError, shown
from stage_runtime.frames import ActivationFrame
from stage_runtime.models import (
    THREAD_THRESHOLD_MACS,
    ModelFactory,
    StageModel,
    _check_forward_arguments,
    _check_stop,
    _in_thread,
)

__all__ = [
    "ARCHITECTURES",
    "LlamaConfig",
    "LlamaModelFactory",
    "LlamaStageModel",
    "SafetensorsFiles",
    "llama_model_factory",
    "split_stages",
    "write_random_llama",
]

ARCHITECTURES: Final = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
"""``architectures`` values of ``config.json`` this module runs."""

_ATTENTION_ELEMENTS: Final = 1 << 24
"""Attention scores computed at once (heads x query rows x keys): queries go in chunks so that
a long prompt does not allocate a quadratic score matrix in one piece (64 MiB of float32)."""


# ------------------------------------------------------------------------------------ config


def _field(
    document: Mapping[str, Any], key: str, kind: type, source: str, default: Any = None
) -> Any:
    value = document.get(key, default)
    if value is None:
        msg = f"{source}: {key} is missing"
        raise ConfigError(msg)
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or isinstance(value, bool) != (kind is bool):
        msg = f"{source}: {key} must be {kind.__name__}, got {value!r}"
        raise ConfigError(msg)
    return value


@attrs.frozen(kw_only=True)
class LlamaConfig:
    """The fields of a Hugging Face ``config.json`` that a Llama-family forward needs."""

    architecture: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: Mapping[str, Any] | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    """Biases on the query, key and value projections (Qwen2 has them)."""

    @property
    def kv_dim(self) -> int:
        """Width of one layer's keys (and of its values) for one token."""
        return self.num_key_value_heads * self.head_dim

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> LlamaConfig:
        """Read and check a model directory's ``config.json``.

        Raises:
            ConfigError: the file is missing or malformed, the architecture is not one of
                :data:`ARCHITECTURES`, or a field is missing or of the wrong type (names the
                file and the field).
        """
        source = os.fspath(path)
        try:
            document = json.loads(Path(source).read_text(encoding="utf-8"))
        except FileNotFoundError:
            msg = f"{source}: model config not found (a model directory holds config.json)"
            raise ConfigError(msg) from None
        except (OSError, ValueError) as exc:
            msg = f"{source}: cannot read the model config: {exc}"
            raise ConfigError(msg) from None
        if not isinstance(document, dict):
            msg = f"{source}: the model config must be a JSON object"
            raise ConfigError(msg)
        architectures = document.get("architectures") or [document.get("model_type", "?")]
        architecture = str(architectures[0]) if isinstance(architectures, list) else "?"
        if architecture not in ARCHITECTURES:
            msg = (
                f"{source}: architectures must name one of {', '.join(ARCHITECTURES)}, "
                f"got {architectures!r}"
            )
            raise ConfigError(msg)
        heads = _field(document, "num_attention_heads", int, source)
        hidden = _field(document, "hidden_size", int, source)
        kv_heads = _field(document, "num_key_value_heads", int, source, heads)
        head_dim = _field(document, "head_dim", int, source, hidden // max(heads, 1))
        scaling = document.get("rope_scaling")
        if scaling is not None and not isinstance(scaling, dict):
            msg = f"{source}: rope_scaling must be an object or null, got {scaling!r}"
            raise ConfigError(msg)
        config = cls(
            architecture=architecture,
            hidden_size=hidden,
            intermediate_size=_field(document, "intermediate_size", int, source),
            num_hidden_layers=_field(document, "num_hidden_layers", int, source),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            vocab_size=_field(document, "vocab_size", int, source),
            rms_norm_eps=_field(document, "rms_norm_eps", float, source, 1e-6),
            rope_theta=_field(document, "rope_theta", float, source, 10000.0),
            rope_scaling=scaling,
            tie_word_embeddings=_field(document, "tie_word_embeddings", bool, source, False),
            attention_bias=_field(
                document, "attention_bias", bool, source, architecture == "Qwen2ForCausalLM"
            ),
        )
        for name in ("hidden_size", "intermediate_size", "num_hidden_layers", "vocab_size"):
            if getattr(config, name) < 1:
                msg = f"{source}: {name} must be >= 1, got {getattr(config, name)}"
                raise ConfigError(msg)
        if heads < 1 or kv_heads < 1 or heads % kv_heads:
            msg = (
                f"{source}: num_attention_heads ({heads}) must be a multiple of "
                f"num_key_value_heads ({kv_heads}), both >= 1"
            )
            raise ConfigError(msg)
        if head_dim < 2 or head_dim % 2:
            msg = f"{source}: head_dim must be even and >= 2, got {head_dim}"
            raise ConfigError(msg)
        # Python's json reads NaN and Infinity; these would make every activation NaN or inf.
        if not (math.isfinite(config.rope_theta) and config.rope_theta > 0):
            msg = f"{source}: rope_theta must be a finite number > 0, got {config.rope_theta!r}"
            raise ConfigError(msg)
        if not (math.isfinite(config.rms_norm_eps) and config.rms_norm_eps >= 0):
            msg = (
                f"{source}: rms_norm_eps must be a finite number >= 0, got {config.rms_norm_eps!r}"
            )
            raise ConfigError(msg)
        config.inverse_frequencies(source=source)  # a bad rope_scaling fails here, at load
        return config

    def inverse_frequencies(self, *, source: str = "config.json") -> npt.NDArray[np.float64]:
        """The rotary embedding's inverse frequencies, ``head_dim / 2`` of them, with
        ``rope_scaling`` applied (none, ``linear`` or ``llama3``).

        Raises:
            ConfigError: another scaling type, or a malformed scaling object.
        """
        exponents = np.arange(0, self.head_dim, 2, dtype=np.float64) / self.head_dim
        inverse: npt.NDArray[np.float64] = 1.0 / (self.rope_theta**exponents)
        scaling = self.rope_scaling
        if not scaling:
            return inverse
        kind = scaling.get("rope_type", scaling.get("type"))
        try:
            if kind in (None, "default"):
                return inverse
            factor = _positive_scaling(scaling, "factor", scaling["factor"], source)
            if kind == "linear":
                return inverse / factor
            if kind == "llama3":
                low = _positive_scaling(
                    scaling, "low_freq_factor", scaling.get("low_freq_factor", 1.0), source
                )
                high = _positive_scaling(
                    scaling, "high_freq_factor", scaling.get("high_freq_factor", 4.0), source
                )
                context = _positive_scaling(
                    scaling,
                    "original_max_position_embeddings",
                    scaling["original_max_position_embeddings"],
                    source,
                )
                if not high > low:  # the blend below divides by high - low
                    msg = (
                        f"{source}: rope_scaling high_freq_factor must be > low_freq_factor, "
                        f"got {high!r} and {low!r}"
                    )
                    raise ConfigError(msg)
                wavelength = 2 * math.pi / inverse
                scaled = np.where(wavelength > context / low, inverse / factor, inverse)
                blend = (context / wavelength - low) / (high - low)
                smoothed = (1 - blend) * scaled / factor + blend * scaled
                medium = (wavelength >= context / high) & (wavelength <= context / low)
                result: npt.NDArray[np.float64] = np.where(medium, smoothed, scaled)
                return result
        except ConfigError:
            raise  # already names the key (it is a ValueError too)
        except (KeyError, TypeError, ValueError) as exc:
            msg = f"{source}: rope_scaling {dict(scaling)!r} is malformed: {exc!r}"
            raise ConfigError(msg) from None
        msg = f"{source}: rope_scaling type must be linear or llama3, got {kind!r}"
        raise ConfigError(msg)


def _positive_scaling(scaling: Mapping[str, Any], key: str, value: Any, source: str) -> float:
    """``rope_scaling[key]`` as a float, which must be finite and > 0 (a factor of 0 divides
    by zero; NaN, which Python's json reads, would make every activation NaN)."""
    msg = f"{source}: rope_scaling {key} must be a finite number > 0, got {value!r}"
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(msg)  # (a string such as "2.0" too: JSON has numbers for that)
    try:
        number = float(value)
    except OverflowError:  # an int beyond any float
        raise ConfigError(msg) from None
    if not (math.isfinite(number) and number > 0):
        raise ConfigError(msg)
    return number


# ------------------------------------------------------------------------------- safetensors

_DTYPES: Final[dict[str, np.dtype[Any]]] = {
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype("<u2"),
    "F64": np.dtype("<f8"),
}


@attrs.define(eq=False)
class _Tensor:
    file: Path
    dtype: str
    shape: tuple[int, ...]
    start: int


class SafetensorsFiles:
    """The tensors of a model directory, read one at a time through a memory map.

    The directory holds ``model.safetensors``, or shards named by
    ``model.safetensors.index.json`` (its ``weight_map``), or other ``*.safetensors`` files.
    Only each file's header is read up front; :meth:`load` maps the file and copies out one
    tensor (upcast to float32).

    Raises:
        ConfigError: no weights, an unreadable or malformed file, a shard named by the index
            that is missing (names the file).
    """

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)
        index = self.directory / "model.safetensors.index.json"
        if index.exists():
            try:
                weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
                files = sorted({self.directory / str(name) for name in weight_map.values()})
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
                msg = f"{index}: malformed safetensors index: {exc!r}"
                raise ConfigError(msg) from None
        else:
            files = sorted(self.directory.glob("*.safetensors"))
        if not files:
            msg = f"{self.directory}: no weights (model.safetensors or an index of shards)"
            raise ConfigError(msg)
        self._tensors: dict[str, _Tensor] = {}
        for file in files:
            self._tensors.update(_read_header(file))

    def __contains__(self, name: object) -> bool:
        return name in self._tensors

    def shape(self, name: str) -> tuple[int, ...]:
        """The shape tensor ``name`` has in its file.

        Raises:
            ConfigError: no such tensor.
        """
        tensor = self._tensors.get(name)
        if tensor is None:
            msg = f"{self.directory}: tensor {name} is missing from the weights"
            raise ConfigError(msg)
        return tensor.shape

    def names(self) -> list[str]:
        """Every tensor name, sorted."""
        return sorted(self._tensors)

    def load(self, name: str, shape: tuple[int, ...]) -> npt.NDArray[np.float32]:
        """Tensor ``name`` as a float32 array, which must have ``shape``.

        Raises:
            ConfigError: no such tensor, or another shape (names the file, the tensor and both
                shapes).
        """
        if self.shape(name) != shape:
            msg = (
                f"{self._tensors[name].file}: tensor {name} must have shape {list(shape)}, "
                f"got {list(self.shape(name))}"
            )
            raise ConfigError(msg)
        tensor = self._tensors[name]
        with (
            tensor.file.open("rb") as handle,
            mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as mapped,
        ):
            raw = np.frombuffer(
                mapped, dtype=_DTYPES[tensor.dtype], count=math.prod(shape), offset=tensor.start
            )
            if tensor.dtype == "BF16":
                # bfloat16 is the top half of a float32: shift it into place.
                out = (raw.astype(np.uint32) << 16).view(np.float32)
            else:
                out = raw.astype(np.float32)  # a copy: the map closes on return
            del raw
        result: npt.NDArray[np.float32] = out.reshape(shape)
        return result


def _read_header(file: Path) -> Iterator[tuple[str, _Tensor]]:
    try:
        with file.open("rb") as handle:
            size = int.from_bytes(handle.read(8), "little")
            if not 2 <= size <= 100_000_000:
                msg = f"{file}: not a safetensors file (header size {size})"
                raise ConfigError(msg)
            header = json.loads(handle.read(size))
            total = file.stat().st_size
    except FileNotFoundError:
        msg = f"{file}: weights file not found"
        raise ConfigError(msg) from None
    except (OSError, ValueError) as exc:
        msg = f"{file}: cannot read safetensors header: {exc}"
        raise ConfigError(msg) from None
    if not isinstance(header, dict):
        msg = f"{file}: malformed safetensors header"
        raise ConfigError(msg)
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (start, end) = (
                entry["dtype"],
                tuple(entry["shape"]),
                entry["data_offsets"],
            )
        except (KeyError, TypeError, ValueError):
            msg = f"{file}: malformed safetensors entry for {name}: {entry!r}"
            raise ConfigError(msg) from None
        # As the format says: a string shape, an unhashable dtype or a None offset raised
        # TypeError or ValueError below, and a negative offset read the header's bytes as the
        # tensor's.
        where = f"{file}: malformed safetensors entry for {name}:"
        if not isinstance(dtype, str):
            msg = f"{where} dtype must be a string, got {shown(dtype)}"
            raise ConfigError(msg)
        if not isinstance(entry["shape"], list) or not all(
            is_int(size) and size >= 0 for size in shape
        ):
            msg = f"{where} shape must be a list of integers >= 0, got {shown(entry['shape'])}"
            raise ConfigError(msg)
        if not (is_int(start) and is_int(end) and 0 <= start <= end):
            msg = (
                f"{where} data_offsets must be two integers 0 <= begin <= end, "
                f"got {shown(entry['data_offsets'])}"
            )
            raise ConfigError(msg)
        if dtype not in _DTYPES:
            msg = f"{file}: tensor {name} has dtype {dtype}; supported: {', '.join(_DTYPES)}"
            raise ConfigError(msg)
        begin, stop = 8 + size + int(start), 8 + size + int(end)
        if stop - begin != math.prod(shape) * _DTYPES[dtype].itemsize or stop > total:
            msg = (
                f"{file}: tensor {name} has data_offsets {[start, end]} that do not fit its "
                f"shape {list(shape)}"
            )
            raise ConfigError(msg)
        yield name, _Tensor(file=file, dtype=dtype, shape=shape, start=begin)


# ------------------------------------------------------------------------------------- model


@attrs.define(eq=False)
class _Layer:
    """One decoder layer's weights, transposed for ``rows @ weight`` and fused where a single
    product serves several projections (query/key/value, gate/up)."""

    input_norm: npt.NDArray[np.float32]
    qkv: npt.NDArray[np.float32]
    """``(hidden, q + 2 kv)``."""
    qkv_bias: npt.NDArray[np.float32] | None
    output: npt.NDArray[np.float32]
    post_norm: npt.NDArray[np.float32]
    gate_up: npt.NDArray[np.float32]
    """``(hidden, 2 intermediate)``."""
    down: npt.NDArray[np.float32]


def _rms_norm(
    x: npt.NDArray[np.float32], weight: npt.NDArray[np.float32], eps: float
) -> npt.NDArray[np.float32]:
    variance = np.mean(np.square(x), axis=-1, keepdims=True, dtype=np.float32)
    normed = (x / np.sqrt(variance + np.float32(eps))) * weight
    return normed.astype(np.float32, copy=False)


@attrs.define(eq=False)
class LlamaStageModel:
    """Layers ``layer_start..layer_end-1`` of a Llama-family model; see the module docstring.

    Build one with :meth:`load` (or :func:`llama_model_factory` for a pipeline).
    """

    config: LlamaConfig
    layer_start: int
    layer_end: int
    stage_index: int = 0
    layers: list[_Layer] = attrs.field(factory=list, repr=False)
    embeddings: npt.NDArray[np.float32] | None = attrs.field(default=None, repr=False)
    """``(vocab, hidden)`` on the first stage, else None."""
    final_norm: npt.NDArray[np.float32] | None = attrs.field(default=None, repr=False)
    head: npt.NDArray[np.float32] | None = attrs.field(default=None, repr=False)
    """``(hidden, vocab)`` on the last stage, else None."""
    thread_threshold_macs: int = THREAD_THRESHOLD_MACS
    """Forwards of more multiply-adds than this run in a worker thread (numpy releases the GIL
    in its products), so a long prompt does not hold the event loop."""
    _inverse_frequencies: npt.NDArray[np.float64] = attrs.field(init=False, repr=False)

    def __attrs_post_init__(self) -> None:
        self._inverse_frequencies = self.config.inverse_frequencies()

    @classmethod
    def load(
        cls,
        directory: str | os.PathLike[str],
        *,
        layer_start: int,
        layer_end: int,
        stage_index: int = 0,
        thread_threshold_macs: int = THREAD_THRESHOLD_MACS,
    ) -> LlamaStageModel:
        """Load layers ``layer_start..layer_end-1`` of the model in ``directory`` (and the
        embeddings for the first layer, the final norm and output head for the last).

        Raises:
            ConfigError: a missing file, an unsupported architecture, a layer range outside
                the model, or a tensor missing or of the wrong shape.
        """
        root = Path(directory)
        config = LlamaConfig.from_file(root / "config.json")
        layers = config.num_hidden_layers
        if not 0 <= layer_start < layer_end <= layers:
            msg = (
                f"{root}: a stage's layers must lie in [0, {layers}) and be at least one, "
                f"got layer_start {layer_start} and layer_end {layer_end}"
            )
            raise ConfigError(msg)
        files = SafetensorsFiles(root)
        h, q, kv, inter = (
            config.hidden_size,
            config.num_attention_heads * config.head_dim,
            config.kv_dim,
            config.intermediate_size,
        )
        loaded: list[_Layer] = []
        for index in range(layer_start, layer_end):
            prefix = f"model.layers.{index}."

            def weight(
                name: str, shape: tuple[int, ...], prefix: str = prefix
            ) -> npt.NDArray[np.float32]:
                return files.load(prefix + name, shape)

            wq = weight("self_attn.q_proj.weight", (q, h))
            wk = weight("self_attn.k_proj.weight", (kv, h))
            wv = weight("self_attn.v_proj.weight", (kv, h))
            bias = None
            if config.attention_bias:
                bias = np.concatenate(
                    [
                        weight(f"self_attn.{p}_proj.bias", (n,))
                        for p, n in (("q", q), ("k", kv), ("v", kv))
                    ]
                )
            gate = weight("mlp.gate_proj.weight", (inter, h))
            up = weight("mlp.up_proj.weight", (inter, h))
            loaded.append(
                _Layer(
                    input_norm=weight("input_layernorm.weight", (h,)),
                    qkv=np.ascontiguousarray(np.concatenate([wq, wk, wv]).T),
                    qkv_bias=bias,
                    output=np.ascontiguousarray(weight("self_attn.o_proj.weight", (h, q)).T),
                    post_norm=weight("post_attention_layernorm.weight", (h,)),
                    gate_up=np.ascontiguousarray(np.concatenate([gate, up]).T),
                    down=np.ascontiguousarray(weight("mlp.down_proj.weight", (h, inter)).T),
                )
            )
        embeddings = final_norm = head = None
        if layer_start == 0:
            embeddings = files.load("model.embed_tokens.weight", (config.vocab_size, h))
        if layer_end == layers:
            final_norm = files.load("model.norm.weight", (h,))
            if "lm_head.weight" in files or not config.tie_word_embeddings:
                head = np.ascontiguousarray(files.load("lm_head.weight", (config.vocab_size, h)).T)
            else:
                head = np.ascontiguousarray(
                    files.load("model.embed_tokens.weight", (config.vocab_size, h)).T
                )
        return cls(
            config=config,
            layer_start=layer_start,
            layer_end=layer_end,
            stage_index=stage_index,
            layers=loaded,
            embeddings=embeddings,
            final_norm=final_norm,
            head=head,
            thread_threshold_macs=thread_threshold_macs,
        )

    @property
    def activation_width(self) -> int:
        """Columns of an output row: the hidden state, then each layer's key and value."""
        return self.config.hidden_size + 2 * self.config.kv_dim * len(self.layers)

    # -------------------------------------------------------------------------- the stage API

    def embed(self, tokens: npt.NDArray[np.int32]) -> ActivationFrame:
        """The token embeddings (first stage only).

        Raises:
            ConfigError: this stage does not start at layer 0, or a token id is outside the
                vocabulary.
        """
        if self.embeddings is None:
            msg = (
                "only the stage starting at layer 0 embeds tokens; "
                f"this one starts at {self.layer_start}"
            )
            raise ConfigError(msg)
        ids = np.asarray(tokens)
        vocab = self.config.vocab_size
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
            bad = int(ids[(ids < 0) | (ids >= vocab)][0])
            msg = f"tokens must be ids in [0, {vocab}) for this model, got {bad}"
            raise ConfigError(msg)
        return self._frame(self.embeddings[ids])

    async def forward(
        self, inputs: ActivationFrame, start: int, restored: ActivationFrame | None
    ) -> ActivationFrame:
        """Rows ``start..N-1``: this stage's hidden states, keys and values, continuing from
        the restored rows' keys and values."""
        _check_forward_arguments(inputs, start, restored)
        x = inputs.rows()
        if x.shape[1] != self.config.hidden_size:
            msg = f"inputs width must be hidden_size {self.config.hidden_size}, got {x.shape[1]}"
            raise FrameError(msg)
        past = None
        if restored is not None:
            past = restored.rows()
            if past.shape[1] != self.activation_width:
                msg = f"restored rows must be {self.activation_width} wide, got {past.shape[1]}"
                raise FrameError(msg)
        rows = x.shape[0] - start
        macs = rows * sum(
            layer.qkv.size + layer.output.size + layer.gate_up.size + layer.down.size
            for layer in self.layers
        )
        if macs > self.thread_threshold_macs:
            out = await _in_thread(self.compute, x[start:], start, past)
        else:
            out = self.compute(x[start:], start, past, None)
        return self._frame(out)

    def downstream(self, output: ActivationFrame) -> ActivationFrame:
        """What the next stage reads of this stage's output: the hidden states alone."""
        rows = output.rows()
        return self._frame(np.ascontiguousarray(rows[:, : self.config.hidden_size]))

    def logits(self, output: ActivationFrame) -> npt.NDArray[np.float32] | None:
        """The next-token logits of the last position (``vocab_size`` float32), on the last
        stage; None on the others."""
        if self.head is None or self.final_norm is None:
            return None
        last = output.rows()[-1, : self.config.hidden_size].astype(np.float32)
        normed = _rms_norm(last[None, :], self.final_norm, self.config.rms_norm_eps)
        result: npt.NDArray[np.float32] = (normed @ self.head)[0]
        return result

    # ---------------------------------------------------------------------------- the maths

    def compute(
        self,
        x: npt.NDArray[np.floating[Any]],
        start: int,
        past: npt.NDArray[np.floating[Any]] | None,
        stop: threading.Event | None,
    ) -> npt.NDArray[np.float32]:
        """Output rows for input rows ``x`` (tokens ``start..``) after the restored rows
        ``past`` (tokens ``0..start-1``, or None when ``start`` is 0)."""
        config = self.config
        h, kv, heads = config.hidden_size, config.kv_dim, config.num_attention_heads
        t = x.shape[0]
        out = np.empty((t, self.activation_width), dtype=np.float32)
        hidden = np.array(x, dtype=np.float32)
        cos, sin = self._rotary(start, start + t)
        for number, layer in enumerate(self.layers):
            _check_stop(stop)
            column = h + 2 * kv * number
            normed = _rms_norm(hidden, layer.input_norm, config.rms_norm_eps)
            qkv = normed @ layer.qkv
            if layer.qkv_bias is not None:
                qkv += layer.qkv_bias
            q = _rotate(
                qkv[:, : heads * config.head_dim].reshape(t, heads, config.head_dim), cos, sin
            )
            k = _rotate(
                qkv[:, heads * config.head_dim : heads * config.head_dim + kv].reshape(
                    t, -1, config.head_dim
                ),
                cos,
                sin,
            )
            v = qkv[:, heads * config.head_dim + kv :]
            out[:, column : column + kv] = k.reshape(t, kv)
            out[:, column + kv : column + 2 * kv] = v
            if past is not None:
                keys = np.concatenate([past[:, column : column + kv], out[:, column : column + kv]])
                values = np.concatenate([past[:, column + kv : column + 2 * kv], v])
            else:
                keys, values = out[:, column : column + kv], v
            attended = self._attention(q, keys, values, start)
            hidden += attended @ layer.output
            normed = _rms_norm(hidden, layer.post_norm, config.rms_norm_eps)
            gate_up = normed @ layer.gate_up
            inter = config.intermediate_size
            gate = gate_up[:, :inter]
            # silu(gate) = gate * sigmoid(gate), with sigmoid(x) = (1 + tanh(x / 2)) / 2 (no
            # overflow for large negative gates, unlike 1 / (1 + exp(-x))).
            activated = gate * (0.5 + 0.5 * np.tanh(0.5 * gate)) * gate_up[:, inter:]
            hidden += activated @ layer.down
        out[:, :h] = hidden
        return out

    def _rotary(
        self, first: int, stop: int
    ) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.float32]]:
        angles = (
            np.arange(first, stop, dtype=np.float64)[:, None] * self._inverse_frequencies[None, :]
        )
        return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)

    def _attention(
        self,
        q: npt.NDArray[np.float32],
        keys: npt.NDArray[np.floating[Any]],
        values: npt.NDArray[np.floating[Any]],
        start: int,
    ) -> npt.NDArray[np.float32]:
        """Causal grouped-query attention of ``q`` (tokens ``start..``) over every key and value
        so far; returns ``(rows, heads * head_dim)``."""
        config = self.config
        t, heads, d = q.shape
        groups = config.num_key_value_heads
        per_group = heads // groups
        n = keys.shape[0]
        k = np.ascontiguousarray(keys, dtype=np.float32).reshape(n, groups, d).transpose(1, 2, 0)
        v = np.ascontiguousarray(values, dtype=np.float32).reshape(n, groups, d).transpose(1, 0, 2)
        # Query head g * per_group + j reads key/value head g (the layout repeat_kv assumes).
        grouped = q.reshape(t, groups, per_group, d).transpose(1, 2, 0, 3)
        out = np.empty((t, groups, per_group, d), dtype=np.float32)
        scale = np.float32(1.0 / math.sqrt(d))
        step = max(1, _ATTENTION_ELEMENTS // max(heads * n, 1))
        for first in range(0, t, step):
            last = min(t, first + step)
            rows = last - first
            scores = (
                grouped[:, :, first:last] @ k[:, None]
            ) * scale  # (groups, per_group, rows, n)
            positions = np.arange(start + first, start + last)[:, None]
            scores += np.where(np.arange(n)[None, :] > positions, -np.inf, 0.0).astype(np.float32)
            scores -= scores.max(axis=-1, keepdims=True)
            np.exp(scores, out=scores)
            scores /= scores.sum(axis=-1, keepdims=True)
            out[first:last] = (
                (scores @ v[:, None]).transpose(2, 0, 1, 3).reshape(rows, groups, per_group, d)
            )
        return out.reshape(t, heads * d)

    def _frame(self, rows: npt.NDArray[np.float32]) -> ActivationFrame:
        return ActivationFrame.from_array(
            np.ascontiguousarray(rows, dtype=np.float32),
            producer_stage_index=self.stage_index,
            layer_start=self.layer_start,
            layer_end=self.layer_end,
        )


def _rotate(
    x: npt.NDArray[np.float32], cos: npt.NDArray[np.float32], sin: npt.NDArray[np.float32]
) -> npt.NDArray[np.float32]:
    """The rotary embedding of ``(rows, heads, head_dim)``, pairing each dimension of the first
    half with its partner in the second half (the Hugging Face Llama layout)."""
    half = x.shape[-1] // 2
    first, second = x[..., :half], x[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    rotated: npt.NDArray[np.float32] = np.concatenate(
        [first * c - second * s, second * c + first * s], axis=-1
    )
    return rotated


# --------------------------------------------------------------------------------- factories


@attrs.frozen
class LlamaModelFactory:
    """Builds each stage's :class:`LlamaStageModel` from its ``layer_start``/``layer_end``;
    picklable, so a stage placed in another process loads only its own layers there."""

    path: str
    thread_threshold_macs: int = THREAD_THRESHOLD_MACS
    vocab_size: int | None = None
    """The model's vocabulary: the pipeline refuses token ids outside it before any stage runs
    (a ``400`` over HTTP), instead of the first stage failing on them."""
    num_layers: int | None = None
    """The model's ``num_hidden_layers``: the pipeline refuses stages that do not cover exactly
    ``[0, num_layers)`` before any stage starts (a last stage ending early would give no
    logits; one ending past the model would fail to load)."""

    def __call__(self, config: StageConfig) -> StageModel:
        return LlamaStageModel.load(
            self.path,
            layer_start=config.layer_start,
            layer_end=config.layer_end,
            stage_index=config.stage_index,
            thread_threshold_macs=self.thread_threshold_macs,
        )


def llama_model_factory(
    path: str | os.PathLike[str], *, thread_threshold_macs: int = THREAD_THRESHOLD_MACS
) -> ModelFactory:
    """A model factory for the Llama-family model in directory ``path``.

    The model's ``config.json`` is checked here (a bad directory is the caller's error, found
    before any stage starts); each stage loads its own layers when it is built.

    Raises:
        ConfigError: the directory has no readable, supported ``config.json``.
    """
    config = LlamaConfig.from_file(Path(path) / "config.json")
    return LlamaModelFactory(
        os.fspath(path), thread_threshold_macs, config.vocab_size, config.num_hidden_layers
    )


def split_stages(
    layers: int,
    stages: int,
    *,
    model_id: str,
    kv_cache: KvCacheConfig | None = None,
    ctx_size: int = 8192,
) -> list[StageConfig]:
    """``stages`` stages ``s0``, ``s1``... over a model's ``layers`` layers, in contiguous
    ranges as even as can be (stage ``i`` starts at ``round(i * layers / stages)``).

    Raises:
        ConfigError: ``stages`` is not in ``[1, layers]``.
    """
    if not 1 <= stages <= layers:
        msg = f"stages must be in [1, {layers}] for {layers} layers, got {stages}"
        raise ConfigError(msg)
    bounds = [round(i * layers / stages) for i in range(stages + 1)]
    return [
        StageConfig(
            stage_id=f"s{i}",
            stage_index=i,
            model_id=model_id,
            layer_start=start,
            layer_end=end,
            kv_cache=kv_cache,
            ctx_size=ctx_size,
        )
        for i, (start, end) in enumerate(itertools.pairwise(bounds))
    ]


def write_random_llama(
    directory: str | os.PathLike[str],
    *,
    hidden_size: int = 64,
    intermediate_size: int = 128,
    num_hidden_layers: int = 4,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    head_dim: int | None = None,
    vocab_size: int = 256,
    rope_theta: float = 10000.0,
    rope_scaling: Mapping[str, Any] | None = None,
    tie_word_embeddings: bool = False,
    attention_bias: bool = False,
    dtype: str = "F32",
    shards: int = 1,
    seed: int = 0,
) -> Path:
    """Write a random Llama-architecture model directory (``config.json`` and safetensors
    weights, sharded with an index when ``shards > 1``); returns the directory.

    Weights are drawn with a scale that keeps activations of order one through the layers.
    ``dtype`` is ``F32``, ``F16`` or ``BF16`` (bfloat16 written as the top half of float32).
    """
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    head_dim = head_dim or hidden_size // num_attention_heads
    rng = np.random.default_rng(seed)
    q, kv, h = num_attention_heads * head_dim, num_key_value_heads * head_dim, hidden_size

    def matrix(rows: int, columns: int) -> npt.NDArray[np.float32]:
        return (rng.standard_normal((rows, columns)) / math.sqrt(columns)).astype(np.float32)

    def norm(size: int) -> npt.NDArray[np.float32]:
        return (1.0 + 0.1 * rng.standard_normal(size)).astype(np.float32)

    tensors: dict[str, npt.NDArray[np.float32]] = {
        "model.embed_tokens.weight": rng.standard_normal((vocab_size, h)).astype(np.float32)
    }
    for index in range(num_hidden_layers):
        prefix = f"model.layers.{index}."
        tensors[prefix + "input_layernorm.weight"] = norm(h)
        tensors[prefix + "self_attn.q_proj.weight"] = matrix(q, h)
        tensors[prefix + "self_attn.k_proj.weight"] = matrix(kv, h)
        tensors[prefix + "self_attn.v_proj.weight"] = matrix(kv, h)
        if attention_bias:
            for name, size in (("q", q), ("k", kv), ("v", kv)):
                tensors[prefix + f"self_attn.{name}_proj.bias"] = (
                    0.1 * rng.standard_normal(size)
                ).astype(np.float32)
        tensors[prefix + "self_attn.o_proj.weight"] = matrix(h, q) / math.sqrt(
            2 * num_hidden_layers
        )
        tensors[prefix + "post_attention_layernorm.weight"] = norm(h)
        tensors[prefix + "mlp.gate_proj.weight"] = matrix(intermediate_size, h)
        tensors[prefix + "mlp.up_proj.weight"] = matrix(intermediate_size, h)
        tensors[prefix + "mlp.down_proj.weight"] = matrix(h, intermediate_size) / math.sqrt(
            2 * num_hidden_layers
        )
    tensors["model.norm.weight"] = norm(h)
    if not tie_word_embeddings:
        tensors["lm_head.weight"] = matrix(vocab_size, h)
    config = {
        "architectures": ["Qwen2ForCausalLM" if attention_bias else "LlamaForCausalLM"],
        "hidden_size": h,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": num_hidden_layers,
        "num_attention_heads": num_attention_heads,
        "num_key_value_heads": num_key_value_heads,
        "head_dim": head_dim,
        "vocab_size": vocab_size,
        "rms_norm_eps": 1e-5,
        "rope_theta": rope_theta,
        "rope_scaling": dict(rope_scaling) if rope_scaling else None,
        "tie_word_embeddings": tie_word_embeddings,
        "attention_bias": attention_bias,
        "torch_dtype": {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}[dtype],
    }
    (root / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    names = list(tensors)
    groups = [names[i::shards] for i in range(shards)]
    weight_map: dict[str, str] = {}
    for number, group in enumerate(groups, start=1):
        file = (
            "model.safetensors"
            if shards == 1
            else f"model-{number:05d}-of-{shards:05d}.safetensors"
        )
        _write_safetensors(root / file, {name: tensors[name] for name in group}, dtype)
        weight_map.update(dict.fromkeys(group, file))
    if shards > 1:
        listing: dict[str, Any] = {"metadata": {}, "weight_map": weight_map}
        (root / "model.safetensors.index.json").write_text(
            json.dumps(listing, indent=2), encoding="utf-8"
        )
    return root


def _write_safetensors(
    path: Path, tensors: Mapping[str, npt.NDArray[np.float32]], dtype: str
) -> None:
    """Write ``tensors`` in the safetensors format: an 8-byte header size, a JSON header of
    dtypes, shapes and byte offsets, then the raw little-endian data."""
    header: dict[str, Any] = {}
    blobs: list[bytes] = []
    offset = 0
    for name, array in tensors.items():
        if dtype == "BF16":
            data = (array.astype("<f4").view(np.uint32) >> 16).astype("<u2").tobytes()
        else:
            data = array.astype(_DTYPES[dtype]).tobytes()
        header[name] = {
            "dtype": dtype,
            "shape": list(array.shape),
            "data_offsets": [offset, offset + len(data)],
        }
        blobs.append(data)
        offset += len(data)
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # data aligned to 8 bytes
    with path.open("wb") as handle:
        handle.write(len(encoded).to_bytes(8, "little"))
        handle.write(encoded)
        for blob in blobs:
            handle.write(blob)
