"""Where a pipeline's stages run: in this trio run, or one Ray actor process per stage.

:func:`~stage_runtime.pipeline.open_pipeline` takes ``placement=``:

- ``None`` or :class:`LocalPlacement`: every stage is a task of the caller's trio run (one
  process, one core).
- :class:`RayPlacement`: every stage runs in its own Ray actor process, on this host or on the
  nodes of a Ray cluster, with the same :class:`~stage_runtime.stage.Stage` and cache actor inside
  a trio run of that process. Ray is an optional extra: ``pip install 'stage-runtime[ray]'``.

Both give the same :class:`~stage_runtime.pipeline.Pipeline`: the same ``prefill``, results,
statistics, ``clear_caches`` and drain on close.
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Final, Protocol

import attrs

from actors import RestartPolicy
from stage_runtime._validators import positive_int
from stage_runtime.config import ConfigProblemError, check_id, structure
from stage_runtime.errors import ConfigError, shown

if TYPE_CHECKING:
    from stage_runtime.cache import EvictedEntry
    from stage_runtime.stage import PrefillRequest, StageStats

__all__ = [
    "PLACEMENT_STRATEGIES",
    "LocalPlacement",
    "Placement",
    "RayPlacement",
    "RunningStages",
    "StageProcess",
    "choose_placement",
    "placement_from_mapping",
    "ray_available",
]

PLACEMENT_STRATEGIES: Final = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
"""Ray placement-group strategies :attr:`RayPlacement.strategy` accepts."""

RAY_EXTRA_HINT: Final = "install the ray extra: pip install 'stage-runtime[ray]'"


def ray_available() -> bool:
    """Whether Ray can be imported here (the ``stage-runtime[ray]`` extra is installed)."""
    return _installed("ray")


def _installed(name: str) -> bool:
    """Whether ``name`` is a module or regular package that can be imported, without importing
    it (Ray takes a second): not a mere directory of that name on the path, which Python would
    import as an empty namespace package (Ray itself leaves a ``ray`` directory in ``/tmp``)."""
    spec = importlib.util.find_spec(name)
    return spec is not None and spec.origin is not None


@attrs.frozen(kw_only=True)
class LocalPlacement:
    """Every stage is a task of the trio run that opened the pipeline (the default)."""


def _address(_instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if value is not None and (not isinstance(value, str) or not value.strip()):
        msg = f"{attribute.name} must be None or a non-empty string, got {shown(value)}"
        raise ConfigError(msg)


def _optional_cpus(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if value is not None:
        _cpus(instance, attribute, value)


def _cpus(_instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value < 0
    ):
        msg = f"{attribute.name} must be a finite number >= 0, got {shown(value)}"
        raise ConfigError(msg)


def _resources(value: object) -> dict[str, dict[str, float]]:
    """Per-stage resources as ``{stage_id: {resource: amount}}``, checked."""
    if not isinstance(value, Mapping):
        msg = f"resources must be a mapping of stage id to resources, got {shown(value)}"
        raise ConfigError(msg)
    checked: dict[str, dict[str, float]] = {}
    for stage_id, wants in value.items():
        if not isinstance(stage_id, str) or not stage_id or not isinstance(wants, Mapping):
            msg = (
                f"resources must map stage ids to tables of resource amounts, got "
                f"{shown(stage_id)}: {shown(wants)}"
            )
            raise ConfigError(msg)
        check_id(f"resources stage id {shown(stage_id)}", stage_id)
        amounts: dict[str, float] = {}
        for name, amount in wants.items():
            if not isinstance(name, str) or not name:
                msg = (
                    f"resources[{stage_id!r}] resource names must be non-empty strings, "
                    f"got {shown(name)}"
                )
                raise ConfigError(msg)
            # Ray takes any string as a resource name; a control character would reach the
            # logs and error messages that show the stage's resources raw.
            check_id(f"resources[{stage_id!r}] resource name {shown(name)}", name)
            if (
                isinstance(amount, bool)
                or not isinstance(amount, int | float)
                or not math.isfinite(amount)
                or amount < 0
            ):
                msg = (
                    f"resources[{stage_id!r}][{shown(name)}] must be a finite number >= 0, "
                    f"got {shown(amount)}"
                )
                raise ConfigError(msg)
            amounts[name] = float(amount)
        checked[stage_id] = amounts
    return checked


def _init_options(value: object) -> dict[str, Any]:
    """``ray.init``'s keyword arguments, as a dict with names for keys."""
    if not isinstance(value, Mapping) or not all(isinstance(key, str) for key in value):
        msg = f"init_options must be a mapping of ray.init argument names, got {shown(value)}"
        raise ConfigError(msg)
    return dict(value)


def _strategy(_instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if value is not None and value not in PLACEMENT_STRATEGIES:
        choices = ", ".join(PLACEMENT_STRATEGIES)
        msg = f"{attribute.name} must be None or one of {choices}, got {shown(value)}"
        raise ConfigError(msg)


def _optional_restart(_instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if value is not None and not isinstance(value, RestartPolicy):
        msg = f"{attribute.name} must be None or an actors.RestartPolicy, got {shown(value)}"
        raise ConfigError(msg)


def _optional_callable(_instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if value is not None and not callable(value):
        msg = f"{attribute.name} must be None or a callable, got {shown(value)}"
        raise ConfigError(msg)


@attrs.frozen(kw_only=True)
class RayPlacement:
    """Every stage in its own Ray actor process, placed by Ray on this host or a cluster.

    Constructing one without Ray installed raises :class:`~stage_runtime.errors.ConfigError`
    naming the extra to install.
    """

    address: str | None = attrs.field(default=None, validator=_address)
    """``None``: start a local Ray instance (or use the one this process already joined);
    ``"auto"``: join the cluster running on this host; ``"ray://host:port"`` (Ray Client) or
    ``"host:port"``: join that cluster. A Ray instance the pipeline started is shut down when
    the pipeline closes; one it joined is left running."""

    num_cpus: float | None = attrs.field(default=None, validator=_optional_cpus)
    """Logical CPUs each stage's actor reserves (fractions let several stages share a core).
    ``None``: an equal share of the CPUs the cluster has free when the pipeline opens, at most
    one per stage (four stages on a two-core machine reserve half a CPU each; beside another
    pipeline holding some, a share of the rest)."""

    resources: Mapping[str, Mapping[str, float]] = attrs.field(factory=dict, converter=_resources)
    """Per stage id, extra resources its actor needs (``{"stage-1": {"GPU": 1}}``); a ``CPU``
    entry overrides :attr:`num_cpus` for that stage. A resource name is non-empty text without
    control characters; an amount is a finite number >= 0."""

    strategy: str | None = attrs.field(default=None, validator=_strategy)
    """A placement-group strategy for the stages' bundles (``"STRICT_SPREAD"``: one stage per
    node); ``None``: no placement group, Ray places each actor where it fits."""

    restart: RestartPolicy | None = attrs.field(default=None, validator=_optional_restart)
    """What to do when a stage process dies: recreate it (with an empty cache) up to the
    policy's limit, or, with None, stop the pipeline."""

    max_in_flight: int = attrs.field(default=16, validator=positive_int)
    """Prefills the pipeline keeps in flight at once; later callers wait for a slot (Ray queues
    actor calls without limit, the pipeline does not)."""

    log_setup: Callable[[], None] | None = attrs.field(default=None, validator=_optional_callable)
    """Run once in each stage process before the stage starts, to configure logging there. The
    default writes structlog JSON lines to stderr at this process's structlog level; Ray forwards
    worker stderr to the driver. Must be picklable (a module-level function, or a
    ``functools.partial`` of one)."""

    init_options: Mapping[str, Any] = attrs.field(factory=dict, converter=_init_options)
    """Extra keyword arguments for ``ray.init`` (``num_cpus``, ``_temp_dir``,
    ``include_dashboard``...); the pipeline passes ``address`` itself."""

    health_check_s: float = attrs.field(default=1.0, validator=_cpus)
    """How often an idle pipeline checks that its stage processes are alive (seconds); a death
    is noticed at once by the prefills it breaks."""

    def __attrs_post_init__(self) -> None:
        if not ray_available():
            msg = f"RayPlacement needs Ray, which is not installed; {RAY_EXTRA_HINT}"
            raise ConfigError(msg)
        if not self.health_check_s > 0:
            msg = f"health_check_s must be > 0, got {self.health_check_s!r}"
            raise ConfigError(msg)
        if "address" in self.init_options:
            msg = "init_options must not hold 'address'; set RayPlacement.address instead"
            raise ConfigError(msg)

    def stage_cpus(self, stage_id: str, share: float = 1.0) -> float:
        """Logical CPUs the actor of ``stage_id`` reserves (``share`` when not set)."""
        cpus = self.resources.get(stage_id, {}).get("CPU", self.num_cpus)
        return share if cpus is None else cpus

    def stage_resources(self, stage_id: str) -> dict[str, float]:
        """Custom resources (besides CPU and GPU) the actor of ``stage_id`` reserves."""
        wants = self.resources.get(stage_id, {})
        return {name: amount for name, amount in wants.items() if name not in ("CPU", "GPU")}

    def stage_gpus(self, stage_id: str) -> float:
        """GPUs the actor of ``stage_id`` reserves (0 unless its resources ask)."""
        return self.resources.get(stage_id, {}).get("GPU", 0.0)


Placement = LocalPlacement | RayPlacement
"""Where a pipeline's stages run."""

_RAY_KEYS: Final = (
    "address",
    "num_cpus",
    "resources",
    "strategy",
    "max_in_flight",
    "health_check_s",
    "restart",
)
_RESTART_KEYS: Final = ("max_restarts", "within_s", "backoff_s")


def choose_placement(
    configured: Placement | None, *, engine: str | None = None, address: str | None = None
) -> Placement:
    """The placement a command line asks for, over the one a topology file configured.

    Args:
        configured: The topology file's placement (None: it has none).
        engine: ``"local"`` or ``"ray"`` (``--placement``); None keeps the file's choice.
        address: A Ray address (``--ray-address``); implies ``engine="ray"``.

    Returns:
        ``LocalPlacement()`` for ``"local"``; for Ray, the file's Ray settings (or defaults)
        with the address replaced when one is given.

    Raises:
        ConfigError: ``engine`` is unknown, ``address`` comes with ``engine="local"``, or Ray
            is not installed.
    """
    if engine not in (None, "local", "ray"):
        msg = f"placement must be 'local' or 'ray', got {shown(engine)}"
        raise ConfigError(msg)
    if engine == "local":
        if address is not None:
            msg = f"a Ray address ({address!r}) needs the ray placement, not local"
            raise ConfigError(msg)
        return LocalPlacement()
    if engine == "ray" or address is not None:
        base = configured if isinstance(configured, RayPlacement) else RayPlacement()
        return base if address is None else attrs.evolve(base, address=address)
    return configured if configured is not None else LocalPlacement()


def placement_from_mapping(table: Mapping[str, Any]) -> Placement:
    """Build a placement from a topology file's ``[placement]`` table::

        [placement]
        engine = "ray"           # "local" (the default) or "ray"
        address = "auto"         # omit to start a local Ray instance
        num_cpus = 1             # logical CPUs per stage
        strategy = "SPREAD"      # optional placement group: PACK, SPREAD, STRICT_*
        max_in_flight = 16
        [placement.resources]
        "stage-1" = { GPU = 1 }
        [placement.restart]      # recreate a dead stage process (empty cache)
        max_restarts = 3
        within_s = 60

    Raises:
        ConfigError: an unknown key or a bad value, named (``placement.<key>``); Ray keys with
            ``engine = "local"``; ``engine = "ray"`` without Ray installed.
    """
    if not isinstance(table, Mapping):
        msg = f"placement must be a table, got {shown(table)}"
        raise ConfigError(msg)
    engine = table.get("engine", "local")
    if engine not in ("local", "ray"):
        msg = f"placement.engine must be 'local' or 'ray', got {shown(engine)}"
        raise ConfigError(msg)
    allowed = ("engine", *_RAY_KEYS) if engine == "ray" else ("engine",)
    unknown = [key for key in table if key not in allowed]
    if unknown:
        hint = "" if engine == "ray" or unknown[0] not in _RAY_KEYS else " (a Ray setting)"
        msg = (
            f"placement.{unknown[0]} is not a setting of engine {engine!r}{hint}; "
            f"the settings are {', '.join(allowed)}"
        )
        raise ConfigError(msg)
    if engine == "local":
        return LocalPlacement()
    restart = table.get("restart")
    if restart is not None and not isinstance(restart, Mapping):
        msg = (
            f"placement.restart must be a table of {', '.join(_RESTART_KEYS)}, got {shown(restart)}"
        )
        raise ConfigError(msg)
    settings = {key: value for key, value in table.items() if key != "engine"}
    try:
        return structure(RayPlacement, settings)
    except ConfigProblemError as exc:
        raise ConfigError(exc.problem.render(("placement",))) from None


@attrs.frozen(kw_only=True)
class StageProcess:
    """Where one stage runs."""

    stage_id: str
    """The stage's id."""

    pid: int
    """Its process id (this process's, under local placement)."""

    host: str
    """The host name of its machine."""

    node_id: str | None = None
    """Its Ray node's id (None under local placement)."""


class RunningStages(Protocol):
    """What a pipeline needs of its running stages, wherever they are placed."""

    async def submit(self, request: PrefillRequest) -> None:
        """Run ``request`` through every stage; return once it is settled (``request.done``)."""

    async def stage_statistics(self) -> tuple[StageStats, ...]:
        """Each stage's statistics, in pipeline order."""

    async def clear_caches(self) -> tuple[tuple[EvictedEntry, ...], ...]:
        """Empty every stage's cache; per stage, the entries evicted."""

    async def close(self) -> None:
        """Drain and stop the stages (no request is pending any more)."""

    def processes(self) -> tuple[StageProcess, ...]:
        """Where each stage runs now, in pipeline order."""
