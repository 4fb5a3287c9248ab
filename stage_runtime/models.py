"""Stage models: what a pipeline stage computes, and reference models to run pipelines with.

A :class:`StageModel` turns a stage's input rows into its output rows. A stage restores the
longest cached prefix of its own output (``k`` rows), then asks its model only for rows
``k..N-1``; the model must therefore be able to continue from the restored prefix alone.

Two reference models ship with the library:

- :class:`CausalMixModel`: real numbers (numpy, seeded, width up to 8,192). Each output row is
  the running mean of a fixed mixing of the input rows seen so far, so row ``i`` depends only on
  inputs ``0..i`` and the whole state needed to continue is the last output row.
- :class:`VirtualStageModel`: no numbers at all. It returns *virtual* frames (zero-stride payloads
  of the right size, no memory) and spends virtual time per computed token, for simulations.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from typing import Final, Protocol, TypeVar, TypeVarTuple, runtime_checkable

import attrs
import numpy as np
import numpy.typing as npt
import trio

from stage_runtime._validators import check_int
from stage_runtime.config import StageConfig
from stage_runtime.errors import ConfigError, FrameError
from stage_runtime.frames import ActivationDType, ActivationFrame
from stage_runtime.limits import I32_MAX, MAX_REFERENCE_WIDTH

__all__ = [
    "CausalMixModel",
    "ModelFactory",
    "StageModel",
    "VirtualStageModel",
    "reference_model_factory",
    "virtual_model_factory",
]


@runtime_checkable
class StageModel(Protocol):
    """What one pipeline stage computes.

    The contract that makes caching correct: :meth:`forward` is *causal* (output row ``i``
    depends only on input rows ``0..i``) and can continue from its own restored output prefix, so
    ``concat(out[:k], forward(inputs, k, out[:k]))`` equals ``forward(inputs, 0, None)``.
    """

    @property
    def activation_width(self) -> int:
        """The width that goes into the cache key (``act:{page_id}:w{width}``).

        Real token-major rows of a known dtype that :meth:`forward` returns must be this wide (the
        stage checks); a virtual frame's bytes per token may differ.
        """
        ...

    def embed(self, tokens: npt.NDArray[np.int32]) -> ActivationFrame:
        """Turn token ids into the first stage's input frame (stage 0 only).

        Args:
            tokens: The prompt's token ids, a 1-D ``int32`` array.

        Returns:
            A frame with one row per token.
        """
        ...

    async def forward(
        self, inputs: ActivationFrame, start: int, restored: ActivationFrame | None
    ) -> ActivationFrame:
        """Compute the output rows for tokens ``start..N-1``.

        Args:
            inputs: The stage's full input frame, tokens ``0..N-1``.
            start: The first token to compute; ``0 <= start < N``.
            restored: This stage's own output for tokens ``0..start-1`` (from the cache), or
                ``None`` when ``start == 0``.

        Returns:
            A frame of ``N - start`` tokens: the output rows for tokens ``start..N-1``.
        """
        ...


ModelFactory = Callable[[StageConfig], StageModel]
"""Builds the model of one stage from its configuration (called once per stage, at start)."""

EMBED_COST_MACS: Final = 64
"""What one embedding value (a float64 sine and its argument) costs, in multiply-adds."""

THREAD_THRESHOLD_MACS: Final = 1 << 24
"""Default :attr:`CausalMixModel.thread_threshold_macs`: about 16.8M multiply-adds, a few ms of
numpy. A 4-stage pipeline at width 64 computes prompts up to 4,096 tokens inline; at width 2,048,
prompts longer than 4 tokens go to a worker thread."""

CHUNK_MACS: Final = 1 << 28
""":class:`CausalMixModel` computes in row chunks of about this many multiply-adds (tens of ms),
and of at least :data:`CHUNK_ROWS` rows; a worker thread stops between chunks once its caller is
cancelled."""

CHUNK_ROWS: Final = 256
"""Fewest rows per chunk: a product of a few rows re-reads the whole mixing matrix per chunk
(32 MB at width 2,048), which made chunked forwards up to 40x slower."""


_R = TypeVar("_R")
_Args = TypeVarTuple("_Args")


class _Interrupted(Exception):
    """Raised in an abandoned worker thread to stop it between chunks (nobody reads it)."""


def _check_forward_arguments(
    inputs: ActivationFrame, start: int, restored: ActivationFrame | None
) -> None:
    n = inputs.token_count
    if not 0 <= start < n:
        msg = f"start must be in [0, {n}) for a {n}-token input, got {start}"
        raise ConfigError(msg)
    if start == 0:
        if restored is not None:
            msg = f"restored must be None when start is 0, got {restored.token_count} tokens"
            raise FrameError(msg)
    elif restored is None or restored.token_count != start:
        got = "None" if restored is None else f"{restored.token_count} tokens"
        msg = f"restored must hold the {start} tokens before start, got {got}"
        raise FrameError(msg)


@attrs.define(eq=False)
class CausalMixModel:
    """A seeded numpy reference model whose output can continue from any restored prefix.

    Each stage squashes its input rows with ``tanh`` (the nonlinearity between stages), mixes them
    with a fixed random ``width x width`` matrix, and outputs the running mean of the mixed rows:
    ``out[i] = mean(tanh(x[0..i]) @ W)``. Row ``i`` therefore depends only on inputs ``0..i``,
    and the state needed to continue at token ``k`` is ``out[k-1]`` (times ``k``), which is
    exactly the last row of the restored prefix. Sums run in float64; outputs are float32, and a
    continuation equals the from-scratch output within ``1e-6``.

    Stage 0 embeds token ids with seeded sinusoids, so any ``int32`` token id has an embedding.

    A forward costs ``rows x width x width`` multiply-adds, an embedding about ``rows x width x``
    :data:`EMBED_COST_MACS`. Up to ``thread_threshold_macs`` either runs inline on the event loop
    (cheap, and deterministic under trio's virtual clock, where a thread would let time jump);
    above it, it runs in a worker thread (``trio.to_thread.run_sync``), so a large prompt does
    not freeze the other tasks (an HTTP server keeps answering its probes). numpy releases the
    GIL in the matrix product and the sines. Work is done in row chunks of about
    :data:`CHUNK_MACS`; cancelling the caller of a threaded forward or embedding returns at once
    and stops the thread at its next chunk, so the stage is free for the next request.

    Args:
        width: Activation width (columns per token row); in ``[1, 8,192]``
            (:data:`~stage_runtime.limits.MAX_REFERENCE_WIDTH`).
        seed: Seed of the mixing matrix and embedding frequencies; at least 0.
        stage_index: Written into produced frames as ``producer_stage_index``.
        layer_start: Written into produced frames.
        layer_end: Written into produced frames.
        thread_threshold_macs: Forwards (and, through :meth:`embed_async`, embeddings) of more
            multiply-adds than this run in a worker thread; ``0`` sends every one to a thread.
    """

    width: int = attrs.field(default=64)
    seed: int = attrs.field(default=0)
    stage_index: int = attrs.field(default=0)
    layer_start: int = attrs.field(default=0)
    layer_end: int = attrs.field(default=0)
    thread_threshold_macs: int = attrs.field(default=THREAD_THRESHOLD_MACS)
    _mix: npt.NDArray[np.float64] = attrs.field(init=False, repr=False)
    _frequencies: npt.NDArray[np.float64] = attrs.field(init=False, repr=False)
    _phases: npt.NDArray[np.float64] = attrs.field(init=False, repr=False)

    def __attrs_post_init__(self) -> None:
        self.width = _reference_width(self.width)
        self.seed = _int_at_least("seed", self.seed, 0)
        self.thread_threshold_macs = _int_at_least(
            "thread_threshold_macs", self.thread_threshold_macs, 0
        )
        rng = np.random.default_rng(self.seed)
        # Scaled so mixed rows stay O(1) whatever the width.
        self._mix = rng.standard_normal((self.width, self.width)) / np.sqrt(self.width)
        self._frequencies = rng.uniform(0.01, 1.0, self.width)
        self._phases = rng.uniform(0.0, 2.0 * np.pi, self.width)

    @classmethod
    def for_stage(
        cls,
        config: StageConfig,
        *,
        width: int = 64,
        seed: int = 0,
        thread_threshold_macs: int = THREAD_THRESHOLD_MACS,
    ) -> CausalMixModel:
        """Build the model of one stage, seeded by ``seed + config.stage_index``.

        Raises:
            ConfigError: ``width``, ``seed`` or ``thread_threshold_macs`` is out of range, as
                for the class.
        """
        return cls(
            width=width,
            seed=seed + config.stage_index,
            stage_index=config.stage_index,
            layer_start=config.layer_start,
            layer_end=config.layer_end,
            thread_threshold_macs=thread_threshold_macs,
        )

    @property
    def activation_width(self) -> int:
        """The width of the produced rows (part of the cache key)."""
        return self.width

    async def embed_async(self, tokens: npt.NDArray[np.int32]) -> ActivationFrame:
        """:meth:`embed`, in a worker thread when it is large (see ``thread_threshold_macs``).

        A stage awaits this instead of calling :meth:`embed`: one sinusoid per token and column
        costs about as much as :data:`EMBED_COST_MACS` multiply-adds, so at width 2,048 an
        8,000-token prompt would hold the event loop for about a second.
        """
        if np.size(tokens) * self.width * EMBED_COST_MACS > self.thread_threshold_macs:
            return self._frame(await _in_thread(self._embed_rows, tokens))
        return self.embed(tokens)

    def embed(self, tokens: npt.NDArray[np.int32]) -> ActivationFrame:
        """Embed token ids as seeded sinusoids, one float32 row per token."""
        return self._frame(self._embed_rows(tokens, None))

    def _embed_rows(
        self, tokens: npt.NDArray[np.int32], stop: threading.Event | None
    ) -> npt.NDArray[np.float32]:
        # The modulus keeps angles small enough that float64 keeps their fractional part.
        ids = (np.asarray(tokens, dtype=np.int64) % 65_521).astype(np.float64)
        rows = np.empty((ids.size, self.width), dtype=np.float32)
        step = max(CHUNK_ROWS, CHUNK_MACS // (self.width * EMBED_COST_MACS))
        for i in range(0, ids.size, step):
            _check_stop(stop)
            angles = ids[i : i + step, None] * self._frequencies[None, :] + self._phases[None, :]
            rows[i : i + step] = np.sin(angles)
        return rows

    async def forward(
        self, inputs: ActivationFrame, start: int, restored: ActivationFrame | None
    ) -> ActivationFrame:
        """Output rows ``start..N-1``: running mean of ``tanh(inputs) @ W``, continued."""
        _check_forward_arguments(inputs, start, restored)
        x = inputs.rows()[start:]
        if x.shape[1] != self.width:
            msg = f"inputs width must be {self.width}, got {x.shape[1]}"
            raise FrameError(msg)
        last = None if restored is None else restored.rows()[-1]
        if x.shape[0] * self.width * self.width > self.thread_threshold_macs:
            rows = await _in_thread(self._continue, x, start, last)
        else:
            rows = self._continue(x, start, last, None)
        return self._frame(rows)

    def _continue(
        self,
        x: npt.NDArray[np.floating],
        start: int,
        last: npt.NDArray[np.floating] | None,
        stop: threading.Event | None,
    ) -> npt.NDArray[np.float32]:
        """The output rows for inputs ``x`` (tokens ``start..``), after ``last`` (row start-1)."""
        mixed = np.empty((x.shape[0], self.width), dtype=np.float64)
        step = max(CHUNK_ROWS, CHUNK_MACS // (self.width * self.width))
        for i in range(0, x.shape[0], step):
            _check_stop(stop)
            mixed[i : i + step] = np.tanh(x[i : i + step].astype(np.float64)) @ self._mix
        sums = np.cumsum(mixed, axis=0)
        if last is not None:
            # The running sum up to token start-1 is the last restored mean times its count.
            sums += last.astype(np.float64) * start
        counts = np.arange(start + 1, start + x.shape[0] + 1, dtype=np.float64)
        return (sums / counts[:, None]).astype(np.float32)

    def _frame(self, rows: npt.NDArray[np.float32]) -> ActivationFrame:
        return ActivationFrame.from_array(
            rows,
            producer_stage_index=self.stage_index,
            layer_start=self.layer_start,
            layer_end=self.layer_end,
        )


def _check_stop(stop: threading.Event | None) -> None:
    if stop is not None and stop.is_set():
        raise _Interrupted


async def _in_thread(work: Callable[[*_Args, threading.Event | None], _R], *args: *_Args) -> _R:
    """``work(*args, stop)`` in a worker thread. Cancelling the caller returns at once (the
    thread is abandoned) and sets ``stop``, which ``work`` checks between chunks."""
    stop = threading.Event()
    try:
        return await trio.to_thread.run_sync(work, *args, stop, abandon_on_cancel=True)
    finally:
        stop.set()


_VIRTUAL_FRAME_MEMO = 65_536
"""Distinct frame lengths a :class:`VirtualStageModel` keeps before starting over."""


@attrs.define(eq=False)
class VirtualStageModel:
    """A model for simulations: virtual frames, and virtual time per computed token.

    Frames it returns are virtual (zero-stride payloads of the right byte size; no memory), so a
    pipeline of these moves and caches "activations" of realistic sizes at no memory cost. Each
    :meth:`forward` sleeps ``seconds_per_token * computed_tokens`` (run it under trio's
    ``MockClock`` to simulate without waiting).

    Args:
        width: Activation width used in cache keys; at least 1.
        bytes_per_token: Payload bytes per token row; defaults to ``4 * width`` (float32 rows).
        seconds_per_token: Virtual compute time per computed token; 0 means no sleep.
        stage_index: Written into produced frames as ``producer_stage_index``.
        layer_start: Written into produced frames.
        layer_end: Written into produced frames.
    """

    width: int = attrs.field(default=64)
    bytes_per_token: int = attrs.field(default=0)
    seconds_per_token: float = attrs.field(default=0.0)
    stage_index: int = attrs.field(default=0)
    layer_start: int = attrs.field(default=0)
    layer_end: int = attrs.field(default=0)
    _frames: dict[int, ActivationFrame] = attrs.field(factory=dict, init=False, repr=False)

    def __attrs_post_init__(self) -> None:
        self.width = _int_at_least("width", self.width, 1)
        self.bytes_per_token = _int_at_least("bytes_per_token", self.bytes_per_token, 0)
        if self.bytes_per_token == 0:
            self.bytes_per_token = 4 * self.width
        self.seconds_per_token = _seconds("seconds_per_token", self.seconds_per_token)

    @property
    def activation_width(self) -> int:
        """The width used in cache keys."""
        return self.width

    def embed(self, tokens: npt.NDArray[np.int32]) -> ActivationFrame:
        """A virtual frame with one row per token."""
        return self._frame(len(tokens))

    async def forward(
        self, inputs: ActivationFrame, start: int, restored: ActivationFrame | None
    ) -> ActivationFrame:
        """Sleep for the computed tokens, then return a virtual frame of ``N - start`` rows."""
        _check_forward_arguments(inputs, start, restored)
        computed = inputs.token_count - start
        if self.seconds_per_token:
            await trio.sleep(self.seconds_per_token * computed)
        return self._frame(computed)

    def _frame(self, token_count: int) -> ActivationFrame:
        # Virtual frames are immutable and hold no memory: reuse one per length (bounded).
        frame = self._frames.get(token_count)
        if frame is None:
            if len(self._frames) >= _VIRTUAL_FRAME_MEMO:
                self._frames.clear()
            frame = self._frames[token_count] = ActivationFrame.virtual(
                token_count=token_count,
                bytes_per_token=self.bytes_per_token,
                dtype=ActivationDType.F32,
                producer_stage_index=self.stage_index,
                layer_start=self.layer_start,
                layer_end=self.layer_end,
            )
        return frame


def _int_at_least(name: str, value: object, minimum: int) -> int:
    """``value`` as an int when it is an integer (numpy's too) ``>= minimum``; else ConfigError."""
    return check_int(name, value, low=minimum, numpy=True)


def _reference_width(value: object) -> int:
    """``value`` as an int when it is an integer (numpy's too) in ``[1,``
    :data:`~stage_runtime.limits.MAX_REFERENCE_WIDTH` ``]``; else ConfigError. A wider
    :class:`CausalMixModel` could not allocate its ``width x width`` matrix: each stage would
    fail at its first build with a MemoryError."""
    return check_int("width", value, low=1, high=MAX_REFERENCE_WIDTH, numpy=True)


def _seconds(name: str, value: object) -> float:
    """``value`` as a float when it is a finite number ``>= 0``; else ConfigError."""
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float | np.integer | np.floating)
        or not 0 <= value < math.inf
    ):
        msg = f"{name} must be a finite number >= 0, got {value!r}"
        raise ConfigError(msg)
    return float(value)


def reference_model_factory(
    *, width: int = 64, seed: int = 0, thread_threshold_macs: int = THREAD_THRESHOLD_MACS
) -> ModelFactory:
    """A factory building one :class:`CausalMixModel` per stage, seeded ``seed + stage_index``.

    Args:
        width: Activation width of every stage; in ``[1, 8,192]``
            (:data:`~stage_runtime.limits.MAX_REFERENCE_WIDTH`, the bound of a topology's
            ``[model]`` table and ``serve --width``).
        seed: Base seed; at least 0.
        thread_threshold_macs: Forwards of more multiply-adds (``rows x width x width``) than
            this run in a worker thread (see :class:`CausalMixModel`).

    Returns:
        A callable taking a :class:`~stage_runtime.config.StageConfig` and returning its model.

    Raises:
        ConfigError: an argument is not an integer in range, named with its value
            (``"width must be an integer in [1, 8,192], got 1000000"``).
    """
    # Checked here, not when the first stage starts: a bad argument is the caller's error.
    width = _reference_width(width)
    seed = _int_at_least("seed", seed, 0)
    thread_threshold_macs = _int_at_least("thread_threshold_macs", thread_threshold_macs, 0)

    def build(config: StageConfig) -> StageModel:
        return CausalMixModel.for_stage(
            config, width=width, seed=seed, thread_threshold_macs=thread_threshold_macs
        )

    return build


def virtual_model_factory(
    *, width: int = 64, bytes_per_token: int = 0, seconds_per_token: float = 0.0
) -> ModelFactory:
    """A factory building one :class:`VirtualStageModel` per stage.

    Args:
        width: Activation width used in cache keys.
        bytes_per_token: Payload bytes per token; 0 means ``4 * width``.
        seconds_per_token: Virtual compute time per computed token.

    Returns:
        A callable taking a :class:`~stage_runtime.config.StageConfig` and returning its model.

    Raises:
        ConfigError: an argument is not an integer (a number for ``seconds_per_token``) in range.
    """
    width = _int_at_least("width", width, 1)
    if width > I32_MAX:  # the width in every cache key: the stages would fail as they start
        msg = f"width must be <= {I32_MAX:,} (a cache key's activation_width), got {width:,}"
        raise ConfigError(msg)
    bytes_per_token = _int_at_least("bytes_per_token", bytes_per_token, 0)
    seconds_per_token = _seconds("seconds_per_token", seconds_per_token)

    def build(config: StageConfig) -> StageModel:
        return VirtualStageModel(
            width=width,
            bytes_per_token=bytes_per_token,
            seconds_per_token=seconds_per_token,
            stage_index=config.stage_index,
            layer_start=config.layer_start,
            layer_end=config.layer_end,
        )

    return build
