"""Pipelines: stages that a prompt passes in order, each owning its cache actor.

:func:`open_pipeline` starts the stages where its ``placement`` says (by default, one task per
stage in the caller's trio run; with :class:`~stage_runtime.placement.RayPlacement`, one Ray
actor process per stage) and yields a :class:`Pipeline`. :meth:`Pipeline.prefill` validates the
tokens once, sends the request into stage 0 and waits for its own one-shot reply; the request
flows stage to stage, so concurrent prefills overlap across stages (stage 0 works on request
``i + 1`` while stage 1 works on request ``i``) and a slow stage pushes back on the callers.

Lifecycle:

- **Failures of one request** (bad tokens: :class:`~stage_runtime.errors.ConfigError` at once; a
  model error on that input) fail only that caller's ``prefill``; the pipeline keeps serving.
- **Cancelling a caller** abandons its request: no stage starts work on it any more, the stage
  computing it is interrupted, and no stage records it after the cancellation (see
  :mod:`stage_runtime.stage`). No task is left waiting.
- **Leaving the context** sets :attr:`Pipeline.draining`, refuses new prefills
  (``trio.ClosedResourceError``), waits for every prefill already called to finish, then closes
  stage 0's inbox; each stage finishes its queue, closes the next stage's inbox, drains and stops
  its cache actor, and exits.
- **A stage crash** (a bug, not a bad request) raises
  :class:`~stage_runtime.errors.StageFailedError` (chained to the cause) inside an exception group
  from the ``async with``; other stages are cancelled and every waiting caller is failed.
"""

from __future__ import annotations

import functools
import itertools
import os
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import attrs
import numpy as np
import numpy.typing as npt
import structlog
import trio

from actors import ActorStoppedError
from stage_runtime._config_lines import with_line
from stage_runtime._unchecked import unchecked_constructor
from stage_runtime._validators import check_non_negative_int
from stage_runtime.cache import EvictedEntry
from stage_runtime.config import (
    ConfigProblemError,
    KeyPath,
    StageConfig,
    _parse_toml,
    key_path,
    structure,
    unrecognised_cache_mode,
)
from stage_runtime.errors import (
    ConfigError,
    PipelineStoppedError,
    StageFailedError,
    shown,
    sole_exception,
)
from stage_runtime.frames import ActivationFrame
from stage_runtime.identity import _frozen, as_token_array
from stage_runtime.integration import KvStageIntegration
from stage_runtime.models import ModelFactory
from stage_runtime.placement import (
    LocalPlacement,
    Placement,
    RayPlacement,
    RunningStages,
    StageProcess,
    placement_from_mapping,
)
from stage_runtime.placement.local import open_local_stages
from stage_runtime.stage import PrefillRequest, StagePrefillReport, StageStats

__all__ = [
    "Pipeline",
    "PipelineStats",
    "PrefillResult",
    "load_model",
    "load_placement",
    "load_topology",
    "open_pipeline",
    "validate_topology",
]

log = structlog.get_logger(__name__)


@attrs.frozen(kw_only=True)
class PrefillResult:
    """The outcome of one prefill."""

    request_id: str
    """The request's id (the caller's, or a generated ``prefill-<n>``)."""

    frame: ActivationFrame
    """The last stage's output for every token of the prompt."""

    tokens: int
    """Prompt length ``N``."""

    stages: tuple[StagePrefillReport, ...]
    """What each stage restored, computed, recorded and evicted, in pipeline order."""

    logits: npt.NDArray[np.float32] | None = None
    """The next-token logits of the prompt's last position when the last stage's model gives
    them (:class:`~stage_runtime.llama.LlamaStageModel`); None for the reference models."""


_unchecked_result = unchecked_constructor(PrefillResult)
"""A prefill's result from what its stages filled in (it has no validators to skip: attrs'
own __init__ of a frozen class costs more than setting its slots)."""


@attrs.frozen(kw_only=True)
class PipelineStats:
    """Statistics of every stage, in pipeline order."""

    stages: tuple[StageStats, ...]
    """Per-stage cache and mailbox statistics."""


@attrs.define(eq=False)
class Pipeline:
    """A running pipeline; get one from :func:`open_pipeline`."""

    stage_configs: tuple[StageConfig, ...]
    """The stages' configurations, in pipeline order."""

    _stages: RunningStages = attrs.field(alias="stages")
    placement: Placement = attrs.field(factory=LocalPlacement)
    """Where the stages run."""
    vocab_size: int | None = None
    """Token ids a prompt may hold are ``0..vocab_size-1`` when the model factory declares its
    vocabulary (a ``vocab_size`` attribute, as the Llama factory does); None: any int32."""
    _pending: set[PrefillRequest] = attrs.field(factory=set, init=False)
    _draining: bool = attrs.field(default=False, init=False)
    _idle: trio.Event = attrs.field(factory=trio.Event, init=False)
    _ids: Iterator[int] = attrs.field(factory=itertools.count, init=False)
    _trio_token: trio.lowlevel.TrioToken = attrs.field(
        factory=trio.lowlevel.current_trio_token, init=False
    )
    _failure: str | None = attrs.field(default=None, init=False)
    """Why the pipeline stopped, when it stopped abnormally (a stage crashed, or the block
    that opened it raised or was cancelled)."""
    _context: tuple[tuple[StageConfig, ...], int] | None = attrs.field(default=None, init=False)
    """The stage configurations :attr:`max_prompt_tokens` was worked out from, and it (looked
    up by every prefill)."""

    @property
    def draining(self) -> bool:
        """Whether the pipeline is shutting down (or has stopped): new prefills are refused."""
        return self._draining

    @property
    def failure(self) -> str | None:
        """Why the pipeline stopped abnormally (``"stage 's1' failed: ..."``, say), or None
        while it runs or after a normal close. New prefills then raise
        :class:`~stage_runtime.errors.PipelineStoppedError` saying so, not the draining
        ``trio.ClosedResourceError``."""
        return self._failure

    def _check_run(self) -> None:
        """Refuse use from another thread or trio run (trio's channels and events are not
        thread-safe: a send from there wedged or crashed the stages); nothing is sent."""
        try:
            token = trio.lowlevel.current_trio_token()
        except RuntimeError:
            token = None
        if token is not self._trio_token:
            msg = (
                "a pipeline can only be used from the trio run that opened it; from another "
                "thread, go through trio.from_thread.run"
            )
            raise RuntimeError(msg)

    @property
    def max_prompt_tokens(self) -> int:
        """The longest prompt :meth:`prefill` accepts: the smallest ``ctx_size`` of the stages."""
        known = self._context
        if known is not None and known[0] is self.stage_configs:
            return known[1]
        configs = self.stage_configs
        context = context_tokens(configs)
        self._context = configs, context
        return context

    async def prefill(
        self,
        tokens: Sequence[int] | npt.NDArray[Any],
        *,
        session_id: str,
        request_id: str | None = None,
        cache_salt: str | None = None,
    ) -> PrefillResult:
        """Run one prompt through every stage and return the last stage's output.

        Args:
            tokens: The prompt's token ids: integers within int32, at least one and at most
                :attr:`max_prompt_tokens` (the stages' context). Copied, unless already a
                read-only int32 array that owns its memory, which is used as it is: do not
                make it writable and change it while the prefill runs.
            session_id: The caller's session (metadata; caches are shared across sessions).
            request_id: The caller's id for this request; ``prefill-<n>`` when None.
            cache_salt: Tenant salt mixed into every stage's cache keys: requests with another
                salt (or none) never share or probe this request's entries. None shares
                across sessions, as upstream.

        Returns:
            The final frame and, per stage, the restored/computed tokens, records and evictions.

        Raises:
            ConfigError: ``tokens`` is not a sequence, empty, longer than the stages' context,
                not integers, or outside int32; or ``session_id`` or ``request_id`` is not a
                non-empty string, or holds control characters.
            trio.ClosedResourceError: the pipeline is draining, or closed normally.
            PipelineStoppedError: the pipeline stopped (a stage crashed) before the request
                finished, or had stopped abnormally already (:attr:`failure` says why).
            RuntimeError: called from another thread or trio run than the one that opened
                the pipeline (nothing is sent).
            Exception: whatever the model raised for this input (only this caller sees it).
        """
        self._check_run()
        if self._failure is not None:
            msg = f"pipeline stopped ({self._failure}); prefill refused"
            raise PipelineStoppedError(msg)
        if self._draining:
            msg = "pipeline is draining; prefill refused"
            raise trio.ClosedResourceError(msg)
        token_array = _entry_tokens(tokens)
        if token_array.size > (limit := self.max_prompt_tokens):
            msg = (
                f"tokens must be at most the stages' context ({limit:,} "
                f"tokens, the smallest ctx_size), got {token_array.size:,}"
            )
            raise ConfigError(msg)
        out_of_vocabulary = vocabulary_violation(token_array, self.vocab_size)
        if out_of_vocabulary is not None:
            raise ConfigError(out_of_vocabulary)
        # Non-empty, as over HTTP: an empty id names nothing in the logs.
        if not isinstance(session_id, str) or not session_id:
            msg = f"session_id must be a non-empty string, got {session_id!r}"
            raise ConfigError(msg)
        if request_id is None:
            request_id = f"prefill-{next(self._ids)}"
        elif not isinstance(request_id, str) or not request_id:
            msg = f"request_id must be a non-empty string or None, got {request_id!r}"
            raise ConfigError(msg)
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            msg = f"cache_salt must be a non-empty string or None, got {cache_salt!r}"
            raise ConfigError(msg)
        # The request checks that the ids are printable text: here, not where a stage hashes
        # the salt or logs the ids, where a bad string would crash the stage instead of failing
        # this call.
        request = PrefillRequest(
            request_id=request_id,
            session_id=session_id,
            tokens=token_array,
            cache_salt=cache_salt,
        )
        self._pending.add(request)
        try:
            await self._stages.submit(request)
        finally:
            self._pending.discard(request)
            if not request.done.is_set():
                request.abandon()
            if self._draining and not self._pending:
                self._idle.set()
        if request.error is not None:
            raise request.error
        assert request.frame is not None
        return _unchecked_result(
            request_id, request.frame, int(token_array.size), tuple(request.reports), request.logits
        )

    async def statistics(self) -> PipelineStats:
        """Per-stage cache statistics and cache-actor mailbox statistics (asks each actor).

        After the pipeline drained and stopped normally, the final statistics.

        Raises:
            PipelineStoppedError: the pipeline stopped abnormally (a crash or a cancellation), so
                a stage's actor is gone without final statistics.
        """
        self._check_run()
        try:
            return PipelineStats(stages=await self._stages.stage_statistics())
        except ActorStoppedError as exc:
            msg = f"pipeline has stopped without final statistics ({exc})"
            raise PipelineStoppedError(msg) from None

    def stage_processes(self) -> tuple[StageProcess, ...]:
        """Where each stage runs now (pid, host and, under Ray, node id), in pipeline order.

        Under Ray placement a restarted stage shows its new process."""
        return self._stages.processes()

    async def clear_caches(self) -> tuple[tuple[EvictedEntry, ...], ...]:
        """Empty every stage's cache (each entry logged as ``cleared``).

        Returns:
            Per stage, in pipeline order, the entries that were evicted.

        Raises:
            PipelineStoppedError: the pipeline has stopped (its caches are gone).
        """
        self._check_run()
        try:
            return await self._stages.clear_caches()
        except ActorStoppedError as exc:
            msg = f"pipeline has stopped: no cache to clear ({exc})"
            raise PipelineStoppedError(msg) from None

    async def _drain(self) -> None:
        """Refuse new prefills, wait for the pending ones, then drain and stop the stages."""
        self._draining = True
        if self._pending:
            await self._idle.wait()
        await self._stages.close()

    def _fail_pending(self) -> None:
        """Fail every caller still waiting (the stages are gone)."""
        self._draining = True
        for request in list(self._pending):
            msg = f"pipeline stopped before request {request.request_id!r} finished"
            request.fail(PipelineStoppedError(msg))


def context_tokens(stages: Sequence[StageConfig]) -> int:
    """The longest prompt a pipeline of ``stages`` can take: their smallest ``ctx_size``."""
    return min(config.ctx_size for config in stages)


def vocabulary_violation(tokens: npt.NDArray[np.int32], vocab_size: int | None) -> str | None:
    """Why ``tokens`` holds an id outside ``0..vocab_size-1`` (naming the first), or None."""
    if vocab_size is None or not tokens.size:
        return None
    if int(tokens.min()) >= 0 and int(tokens.max()) < vocab_size:
        return None
    index = int(np.flatnonzero((tokens < 0) | (tokens >= vocab_size))[0])
    return (
        f"tokens[{index}] must be an id in [0, {vocab_size}) for this model's vocabulary, "
        f"got {int(tokens[index])}"
    )


def _entry_tokens(tokens: Sequence[int] | npt.NDArray[Any]) -> npt.NDArray[np.int32]:
    """Validate tokens once, as a read-only int32 array: a caller's array is copied unless it
    is frozen already (read-only, owning its memory: what the cache keeps as it is too), as a
    replay's prompts are. (Such an array's owner could make it writable again: the prefill's
    docstring asks callers not to change it while the prefill runs.)"""
    array = as_token_array(tokens)
    if isinstance(tokens, np.ndarray) and not _frozen(array) and np.may_share_memory(array, tokens):
        array = array.copy()
    if array.ndim != 1 or array.size == 0:
        msg = f"tokens must be a non-empty 1-D sequence, got shape {array.shape}"
        raise ConfigError(msg)
    array.flags.writeable = False
    return array


@asynccontextmanager
async def open_pipeline(
    stages: Sequence[StageConfig] | str | os.PathLike[str],
    model_factory: ModelFactory | None = None,
    *,
    channel_size: int = 4,
    mailbox_size: int = 64,
    environ: Mapping[str, str] | None = None,
    placement: Placement | None = None,
) -> AsyncIterator[Pipeline]:
    """Start a pipeline: one stage per configuration, each owning its cache actor.

    Args:
        stages: The stages' configurations in pipeline order, or the path of a topology file
            (see :func:`load_topology`; its ``[placement]`` table applies unless
            ``placement`` is given).
        model_factory: Builds each stage's model from its configuration; None: the topology
            file's ``[model]`` table (see :func:`load_model`), required then. A factory with
            an int ``num_layers`` attribute (the Llama factory's) has the stages checked to
            cover exactly ``[0, num_layers)``; one with an int ``vocab_size`` has prompts
            checked against its vocabulary.
        channel_size: Capacity of each channel between stages (and into stage 0); 0 makes
            every hand-off a rendezvous.
        mailbox_size: Mailbox size of each cache actor.
        environ: Environment for stages whose ``kv_cache`` is None (spec §6.1); the process
            environment when None (resolved here, in this process, for every placement).
        placement: Where the stages run: None or :class:`~stage_runtime.placement.LocalPlacement`
            (tasks of this trio run), or :class:`~stage_runtime.placement.RayPlacement` (one
            Ray actor process per stage; ``model_factory`` must then be picklable).

    Yields:
        The running :class:`Pipeline`. Leaving the block drains it (see the module docstring).

    Raises:
        ConfigError: the topology is invalid or does not cover the model's layers (names the
            stage and field), an environment variable for the cache is (names it),
            ``model_factory`` is not callable, ``channel_size``/``mailbox_size`` is not an
            integer >= 0, ``placement`` is not a placement, or Ray could not start or join its
            cluster.
        ExceptionGroup: holding :class:`~stage_runtime.errors.StageFailedError` when a stage
            crashed (or, placed by Ray, its process died with no restart left).
    """
    source = None
    if isinstance(stages, str | os.PathLike):
        source = os.fspath(stages)
        configs = load_topology(stages)
        if placement is None:
            placement = load_placement(stages)
        if model_factory is None:
            model_factory = load_model(stages)
    else:
        configs = list(stages)
        validate_topology(configs)
    if model_factory is None:
        msg = "model_factory is required unless a topology file's [model] table names the model"
        raise ConfigError(msg)
    if not callable(model_factory):
        msg = f"model_factory must be callable, got {type(model_factory).__name__}"
        raise ConfigError(msg)
    layers = getattr(model_factory, "num_layers", None)
    if isinstance(layers, int):
        _check_model_layers(configs, layers, source=source)
    check_non_negative_int("channel_size", channel_size)
    check_non_negative_int("mailbox_size", mailbox_size)
    if placement is None:
        placement = LocalPlacement()
    if not isinstance(placement, LocalPlacement | RayPlacement):
        msg = f"placement must be None, a LocalPlacement or a RayPlacement, got {placement!r}"
        raise ConfigError(msg)
    if environ is None:
        # Resolved once, here: stage processes elsewhere must see the driver's environment,
        # not their own.
        environ = dict(os.environ)
    mistyped = unrecognised_cache_mode(environ)
    if mistyped is not None:
        # The cache stays off, as upstream (spec §6.1), but a typo must not pass unnoticed.
        log.warning(
            "cache_mode_unrecognised",
            variable=mistyped.variable,
            value=mistyped.value,
            accepted=list(mistyped.accepted),
        )
    for config in configs:
        # Resolved now, not when each stage builds its cache: a bad STAGE_RUNTIME_KV_CACHE_*
        # variable is then a ConfigError here, not a stage failure inside an exception group.
        KvStageIntegration.from_config(config, environ=environ)
    if isinstance(placement, RayPlacement):
        # Imported only when asked for: Ray is an optional extra.
        from stage_runtime.placement.ray_stages import open_ray_stages

        opened: AbstractAsyncContextManager[RunningStages] = open_ray_stages(
            configs, model_factory, placement, mailbox_size=mailbox_size, environ=environ
        )
    else:
        opened = open_local_stages(
            configs,
            model_factory,
            channel_size=channel_size,
            mailbox_size=mailbox_size,
            environ=environ,
        )
    pipeline: Pipeline | None = None
    try:
        async with opened as running:
            vocab = getattr(model_factory, "vocab_size", None)
            pipeline = Pipeline(
                stage_configs=tuple(configs),
                stages=running,
                placement=placement,
                vocab_size=vocab if isinstance(vocab, int) else None,
            )
            yield pipeline
            await pipeline._drain()
    except BaseException as exc:
        if pipeline is not None:
            pipeline._failure = _failure(exc)
        raise
    finally:
        if pipeline is not None:
            pipeline._fail_pending()


def _failure(exc: BaseException) -> str:
    """What stopped a pipeline, in a few words: the first stage failure, else the exception."""
    if isinstance(exc, BaseExceptionGroup):
        failed, _ = exc.split(StageFailedError)
        if failed is not None:
            first: BaseException = failed
            while isinstance(first, BaseExceptionGroup):
                first = first.exceptions[0]
            return str(first)
        # Cancelled from outside, every stage's task and actor raises its own Cancelled.
        _, rest = exc.split(trio.Cancelled)
        if rest is None:
            return "cancelled"
    exc = sole_exception(exc)
    if isinstance(exc, trio.Cancelled):
        return "cancelled"
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def validate_topology(stages: Sequence[StageConfig], *, source: str | None = None) -> None:
    """Check that stages form one pipeline: unique ids, indices by position, contiguous layers.

    Args:
        stages: The stages in pipeline order.
        source: The file they came from, named in error messages.

    Raises:
        ConfigError: naming the file (if any), the stage and the field.
    """
    _validate_topology(stages, source=source, root=lambda position, _field: ("stages", position))


def _validate_topology(
    stages: Sequence[StageConfig],
    *,
    source: str | None,
    root: Callable[[int, str], KeyPath],
) -> None:
    """:func:`validate_topology`; ``root(position, field)`` is the key path of the table that
    holds a stage's field (``stage[1]``, or ``defaults`` in a topology file), named in the
    message."""

    where = f"{source}: " if source else ""

    def fail(position: int, field: str, problem: str) -> NoReturn:
        at = root(position, field)
        stage_id = stages[position].stage_id
        # A value from [defaults] is wrong for one stage: say which.
        label = (
            f"for stage[{position}] {stage_id!r}" if at == ("defaults",) else f"stage {stage_id!r}"
        )
        msg = f"{where}{key_path((*at, field))} {problem} ({label})"
        raise ConfigError(msg)

    if not stages:
        msg = f"{where}stages must hold at least one stage, got 0"
        raise ConfigError(msg)
    seen: set[str] = set()
    for position, config in enumerate(stages):
        if not isinstance(config, StageConfig):
            msg = f"{where}stages[{position}] must be a StageConfig, got {type(config).__name__}"
            raise ConfigError(msg)
        if config.stage_id in seen:
            fail(position, "stage_id", f"must be unique, got {config.stage_id!r} twice")
        seen.add(config.stage_id)
        if config.stage_index != position:
            fail(
                position,
                "stage_index",
                f"must equal its position {position}, got {config.stage_index}",
            )
        if position and config.layer_start != stages[position - 1].layer_end:
            fail(
                position,
                "layer_start",
                f"must equal the previous stage's layer_end "
                f"{stages[position - 1].layer_end}, got {config.layer_start}",
            )
    # Frames go from each stage to the next in list order; peers naming other stages would
    # describe a pipeline this one is not (the first stage's upstream and the last one's
    # downstream are outside the pipeline: free).
    for position, config in enumerate(stages):
        if position and config.upstream is not None:
            previous = stages[position - 1].stage_id
            if config.upstream != previous:
                fail(
                    position,
                    "upstream",
                    f"must be the previous stage {previous!r}, got {config.upstream!r}",
                )
        if position + 1 < len(stages) and config.downstream is not None:
            following = stages[position + 1].stage_id
            if config.downstream != following:
                fail(
                    position,
                    "downstream",
                    f"must be the next stage {following!r}, got {config.downstream!r}",
                )


def _check_model_layers(stages: Sequence[StageConfig], layers: int, *, source: str | None) -> None:
    """Check that stages cover exactly the model's ``layers`` layers, ``[0, layers)``.

    :func:`validate_topology` has checked that each stage starts where the previous one ends,
    so the first stage's start and the last one's end are all that is left to check.

    Raises:
        ConfigError: naming the file (with its line) when ``source`` is given, the stage and
            its field (``stage[1].layer_end``), the value and the model's layer count.
    """
    first, last = stages[0], stages[-1]
    cover = f"the stages must cover the model's {layers} layers (num_hidden_layers)"
    if first.layer_start != 0:
        position, field = 0, "layer_start"
        problem = f"must be 0: {cover} from the first, got {first.layer_start}"
    elif last.layer_end != layers:
        position, field = len(stages) - 1, "layer_end"
        problem = f"must be {layers}: {cover} to the last, got {last.layer_end}"
    else:
        return
    at = key_path(("stage" if source else "stages", position, field))
    msg = f"{at} {problem} (stage {stages[position].stage_id!r})"
    if source:
        msg = with_line(f"{source}: {msg}", source, _read_topology(source))
    raise ConfigError(msg)


def _table(_instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, dict):
        msg = f"{attribute.name} must be a table, got {shown(value)}"
        raise ConfigError(msg)


def _stage_tables(_instance: object, _attribute: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, list) or not value or not all(isinstance(t, dict) for t in value):
        msg = f"stage must be a non-empty array of tables ([[stage]]), got {shown(value)}"
        raise ConfigError(msg)


@attrs.frozen(kw_only=True)
class _TopologyFile:
    """The top level of a topology file: each table is read by its own loader."""

    defaults: dict[str, Any] = attrs.field(factory=dict, validator=_table)
    """Keys merged under every stage."""

    stage: list[dict[str, Any]] = attrs.field(factory=list, validator=_stage_tables)
    """One table per stage, in pipeline order."""

    placement: object = None
    """Where the stages run (:func:`load_placement`)."""

    model: object = None
    """What the stages run (:func:`load_model`)."""


_Loaded = TypeVar("_Loaded")


def _naming_lines(
    load: Callable[[str | os.PathLike[str]], _Loaded],
) -> Callable[[str | os.PathLike[str]], _Loaded]:
    """``load``, its errors about a key of the file (``"{file}: {key path} ..."``) also naming
    the line the key was written on (``"{file}: line 12: ..."``)."""

    @functools.wraps(load)
    def loading(path: str | os.PathLike[str]) -> _Loaded:
        try:
            return load(path)
        except ConfigError as exc:
            source = os.fspath(path)
            try:
                text = _read_topology(source)
            except ConfigError:
                text = ""  # (the error says the file cannot be read)
            located = with_line(str(exc), source, text)
            if located == str(exc):
                raise
            raise ConfigError(located) from exc.__cause__

    return loading


def _read_topology_file(source: str) -> _TopologyFile:
    """The parsed and structured top level of topology file ``source``."""
    document = _parse_toml(_read_topology(source), source=source)
    try:
        return structure(_TopologyFile, document)
    except ConfigProblemError as exc:
        msg = f"{source}: {exc}"
        raise ConfigError(msg) from None


@_naming_lines
def load_placement(path: str | os.PathLike[str]) -> Placement | None:
    """The placement a topology file's ``[placement]`` table asks for, None without one.

    See :func:`stage_runtime.placement.placement_from_mapping` for the table's keys.

    Raises:
        ConfigError: the file cannot be read or parsed, or the table is invalid; names the
            file, the line and the key path (``placement.num_cpus``).
    """
    source = os.fspath(path)
    table = _parse_toml(_read_topology(source), source=source).get("placement")
    if table is None:
        return None
    try:
        return placement_from_mapping(table)
    except ConfigError as exc:
        msg = f"{source}: {exc}"
        raise ConfigError(msg) from None


def _model_kind(_instance: object, _attribute: attrs.Attribute[Any], value: object) -> None:
    if value not in ("llama", "reference"):
        msg = f"kind must be 'llama' or 'reference', got {shown(value)}"
        raise ConfigError(msg)


def _model_path(_instance: object, _attribute: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, str) or not value:
        msg = f"path must be a model directory, got {shown(value)}"
        raise ConfigError(msg)


@attrs.frozen(kw_only=True)
class _LlamaModelTable:
    """``[model]`` with ``kind = "llama"``."""

    kind: str = attrs.field(validator=_model_kind)
    """``"llama"``."""

    path: str = attrs.field(default=None, validator=_model_path)
    """The Hugging Face model directory, relative to the topology file."""


@attrs.frozen(kw_only=True)
class _ReferenceModelTable:
    """``[model]`` with ``kind = "reference"``; :func:`reference_model_factory` checks the
    numbers."""

    kind: str = attrs.field(validator=_model_kind)
    """``"reference"``."""

    width: int = 64
    """Activation width of every stage."""

    seed: int = 0
    """Base seed."""


@_naming_lines
def load_model(path: str | os.PathLike[str]) -> ModelFactory | None:
    """The model factory a topology file's ``[model]`` table names, None without one.

    ``kind = "llama"`` with ``path`` (a Hugging Face model directory, relative to the topology
    file) runs each stage's layers of that model (:func:`stage_runtime.llama.llama_model_factory`);
    ``kind = "reference"`` (optional ``width`` and ``seed``) the reference model::

        [model]
        kind = "llama"
        path = "models/my-llama"

    Raises:
        ConfigError: the table is invalid or the model directory unusable; names the file, the
            line and the key path (``model.path``).
    """
    from stage_runtime.llama import llama_model_factory
    from stage_runtime.models import reference_model_factory

    source = os.fspath(path)
    table = _parse_toml(_read_topology(source), source=source).get("model")
    if table is None:
        return None
    kind = table.get("kind") if isinstance(table, dict) else None
    shape: type[_LlamaModelTable | _ReferenceModelTable] = (
        _LlamaModelTable if kind == "llama" else _ReferenceModelTable
    )
    try:
        model = structure(shape, table)
    except ConfigProblemError as exc:
        msg = f"{source}: {exc.problem.render(('model',))}"
        raise ConfigError(msg) from None
    try:
        if isinstance(model, _ReferenceModelTable):
            return reference_model_factory(width=model.width, seed=model.seed)
        return llama_model_factory(Path(source).parent / model.path)
    except ConfigError as exc:
        msg = (
            f"{source}: model.{exc}"
            if isinstance(model, _ReferenceModelTable)
            else f"{source}: {exc}"
        )
        raise ConfigError(msg) from None


def _read_topology(source: str) -> str:
    """The text of topology file ``source`` (UTF-8, a leading byte-order mark dropped)."""
    try:
        data = Path(source).read_bytes()
    except OSError as exc:
        msg = f"{source}: cannot read topology file: {exc.strerror or exc}"
        raise ConfigError(msg) from exc
    except ValueError as exc:  # a NUL byte in the path
        msg = f"{source!r}: cannot read topology file: {exc}"
        raise ConfigError(msg) from exc
    try:
        return data.decode("utf-8-sig")  # a leading byte-order mark is not part of the file
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        msg = f"{source}: line {line}: topology file must be UTF-8, got byte {data[exc.start]:#04x}"
        raise ConfigError(msg) from None


@_naming_lines
def load_topology(path: str | os.PathLike[str]) -> list[StageConfig]:
    """Load a pipeline's stages from a TOML topology file.

    The file holds an optional ``[defaults]`` table merged under every stage (stage keys win;
    ``kv_cache`` tables are merged key by key) and one ``[[stage]]`` table per stage, in pipeline
    order. ``stage_index`` defaults to the stage's position, ``upstream``/``downstream`` to its
    neighbours' ids. An optional ``[placement]`` table says where the stages run (read by
    :func:`load_placement`), an optional ``[model]`` table what they run (:func:`load_model`)::

        [defaults]
        model_id = "example/model"
        [defaults.kv_cache]
        mode = "lookup-record"
        [[stage]]
        stage_id = "stage-0"
        layer_start = 0
        layer_end = 8
        [[stage]]
        stage_id = "stage-1"
        layer_start = 8
        layer_end = 16

    Args:
        path: The topology file.

    Returns:
        The validated stages, in pipeline order.

    Raises:
        ConfigError: unreadable or invalid TOML, unknown top-level keys, a bad stage field,
            duplicate stage ids or non-contiguous layer ranges; names the file, the line and the
            key path of the field (``stage[1].kv_cache.max_entries``, or ``defaults.ctx_size``
            for a value every stage takes from the defaults) and the stage's id.
    """
    source = os.fspath(path)
    topology = _read_topology_file(source)
    defaults, tables = topology.defaults, topology.stage
    ids = [table.get("stage_id", defaults.get("stage_id")) for table in tables]

    def root(position: int, field: str, inner: str | int | None = None) -> KeyPath:
        """Where a stage's field was written: its own table, else the defaults."""
        table = tables[position]
        if field == "kv_cache" and isinstance(inner, str):
            own = table.get("kv_cache")
            if isinstance(own, dict) and inner in own:
                return ("stage", position)
            in_defaults = isinstance(defaults.get("kv_cache"), dict)
            return (
                ("defaults",)
                if in_defaults and inner in defaults["kv_cache"]
                else ("stage", position)
            )
        if field not in table and field in defaults:
            return ("defaults",)
        return ("stage", position)

    configs: list[StageConfig] = []
    for position, table in enumerate(tables):
        merged: dict[str, Any] = {**defaults, **table}
        if isinstance(defaults.get("kv_cache"), dict) and isinstance(table.get("kv_cache"), dict):
            merged["kv_cache"] = {**defaults["kv_cache"], **table["kv_cache"]}
        merged.setdefault("stage_index", position)
        # A neighbour's id that is not a string is that stage's error, reported when it is built.
        if position > 0 and isinstance(ids[position - 1], str):
            merged.setdefault("upstream", ids[position - 1])
        if position + 1 < len(tables) and isinstance(ids[position + 1], str):
            merged.setdefault("downstream", ids[position + 1])
        try:
            configs.append(structure(StageConfig, merged))
        except ConfigProblemError as exc:
            problem = exc.problem
            field = str(problem.path[0]) if problem.path else ""
            inner = problem.path[1] if len(problem.path) > 1 else None
            at = root(position, field, inner)
            name = f" {ids[position]!r}" if ids[position] is not None else ""
            if at == ("defaults",):  # the defaults' value is wrong for this stage
                label = f" (for stage[{position}]{name})"
            else:
                label = f" (stage{name})" if name else ""
            msg = f"{source}: {problem.render(at)}{label}"
            raise ConfigError(msg) from None
    _validate_topology(configs, source=source, root=root)
    return configs
