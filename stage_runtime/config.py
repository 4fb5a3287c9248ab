"""Stage and cache configuration, loaded from mappings, TOML, JSON or the environment.

Every class here is a frozen attrs class whose validators raise :class:`ConfigError` naming the
field and the bad value; derive variants with :func:`attrs.evolve`. Loading from a file adds the
file name to the message.
"""

from __future__ import annotations

import enum
import json
import os
import re
import tomllib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Final, NoReturn, TypeVar

import attrs

from stage_runtime.errors import ConfigError, shown
from stage_runtime.limits import I32_MAX as _I32_MAX
from stage_runtime.limits import I32_MIN as _I32_MIN
from stage_runtime.limits import U64_MAX as _U64_MAX

__all__ = [
    "SCHEMA_VERSION",
    "CacheIndex",
    "CacheMode",
    "CachePayload",
    "FlashAttention",
    "KvCacheConfig",
    "LoadMode",
    "MessageBase",
    "PageEviction",
    "StageConfig",
    "kill_switch_engaged",
]

SCHEMA_VERSION: Final = 1
"""Version of the stage message schema carried in :attr:`MessageBase.schema_version`."""

_U32_MAX: Final = 2**32 - 1


class CacheMode(enum.StrEnum):
    """What a stage does with its activation cache (the upstream's ``StageKvCacheMode``).

    There is no lookup-only mode, as upstream. ``AUTO`` maps to disabled.
    """

    DISABLED = "disabled"
    AUTO = "auto"
    RECORD = "record"
    LOOKUP_RECORD = "lookup-record"


class CachePayload(enum.StrEnum):
    """Which state the upstream caches (``StageKvCachePayload``); activations ignore it."""

    AUTO = "auto"
    RESIDENT_KV = "resident-kv"
    KV_RECURRENT = "kv-recurrent"
    FULL_STATE = "full-state"


class LoadMode(enum.StrEnum):
    """How the stage's weights were loaded; part of the weight identity (spec §1.2)."""

    LAYER_PACKAGE = "layer-package"
    RUNTIME_SLICE = "runtime-slice"
    ARTIFACT_SLICE = "artifact-slice"


class FlashAttention(enum.StrEnum):
    """Flash-attention setting; part of the layout identity (spec §1.2)."""

    AUTO = "auto"
    DISABLED = "disabled"
    ENABLED = "enabled"


class CacheIndex(enum.StrEnum):
    """How a stage's activation cache keys what it stores (see :mod:`stage_runtime.cache.paged`).

    ``LADDER`` is the upstream: one full copy per recorded prefix length, hits only at those
    lengths. ``PAGED`` stores pages of rows shared by every prompt with the same prefix.
    """

    LADDER = "ladder"
    PAGED = "paged"


class PageEviction(enum.StrEnum):
    """Which page the paged index evicts first (leaves only, in every policy).

    ``LRU``: the least recently used. ``REUSE``: the least valuable by reuse and recompute saved
    (GreedyDual-style). ``ADAPTIVE``: recency or frequency as the workload shows, ARC's rule
    over pages used once or more (see :mod:`stage_runtime.cache.paged.eviction`).
    """

    LRU = "lru"
    REUSE = "reuse"
    ADAPTIVE = "adaptive"


# --------------------------------------------------------------------------------------------
# validators and converters (each names its field in the message)

_E = TypeVar("_E", bound=enum.StrEnum)


def _int_in(low: int, high: int) -> Any:
    """An attrs validator: an ``int`` (not ``bool``) within ``[low, high]``."""

    def check(_instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
        if not isinstance(value, int) or isinstance(value, bool):
            msg = f"{attribute.name} must be an integer, got {shown(value)}"
            raise ConfigError(msg)
        if value < low:
            msg = f"{attribute.name} must be >= {low}, got {shown(value)}"
            raise ConfigError(msg)
        if value > high:
            msg = f"{attribute.name} must be <= {high}, got {shown(value)}"
            raise ConfigError(msg)

    return check


def _str(_instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, str):
        msg = f"{attribute.name} must be a string, got {shown(value)}"
        raise ConfigError(msg)
    check_text(attribute.name, value)


def check_text(name: str, value: str) -> None:
    """Refuse a string that is not valid Unicode text (a lone surrogate, as JSON's ``"\\udfff"``
    decodes to): it cannot be encoded as UTF-8 to be hashed into a key, or logged."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        msg = (
            f"{name} must be valid UTF-8 text, got a lone surrogate "
            f"{value[exc.start]!r} at index {exc.start}"
        )
        raise ConfigError(msg) from None


_CONTROL: Final = re.compile("[\x00-\x1f\x7f-\x9f]")
"""C0 controls, DEL and C1 controls: a terminal acts on them (``ESC [``, ``CSI``) when a log
line holding them reaches a console."""


def check_id(name: str, value: str) -> None:
    """Refuse an id a client sends (session, request, salt) that is not printable text: a lone
    surrogate (see :func:`check_text`), or a control character that the console log would
    write raw to a terminal."""
    check_text(name, value)
    control = _CONTROL.search(value)
    if control is not None:
        msg = (
            f"{name} must not hold control characters, got {control.group()!r} "
            f"at index {control.start()}"
        )
        raise ConfigError(msg)


def _nonempty_str(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    _str(instance, attribute, value)
    if not value:
        msg = f"{attribute.name} must be a non-empty string, got {shown(value)}"
        raise ConfigError(msg)


def _optional_str(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if value is not None:
        _str(instance, attribute, value)


def _optional_nonempty_str(
    instance: object, attribute: attrs.Attribute[Any], value: object
) -> None:
    if value is not None:
        _nonempty_str(instance, attribute, value)


def _optional_bool(_instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if value is not None and not isinstance(value, bool):
        msg = f"{attribute.name} must be true, false or absent, got {shown(value)}"
        raise ConfigError(msg)


def _optional_int(low: int, high: int) -> Any:
    inner = _int_in(low, high)

    def check(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
        if value is not None:
            inner(instance, attribute, value)

    return check


def _enum(kind: type[_E], name: str, value: object) -> _E:
    if isinstance(value, kind):
        return value
    if isinstance(value, str):
        try:
            return kind(_trim(value).lower().replace("_", "-"))
        except ValueError:
            pass
    choices = ", ".join(repr(str(member)) for member in kind)
    msg = f"{name} must be one of {choices}, got {shown(value)}"
    raise ConfigError(msg)


def _to_cache_mode(value: object) -> CacheMode:
    return _enum(CacheMode, "mode", value)


def _to_cache_payload(value: object) -> CachePayload:
    return _enum(CachePayload, "payload", value)


def _to_cache_index(value: object) -> CacheIndex:
    return _enum(CacheIndex, "index", value)


def _to_page_eviction(value: object) -> PageEviction:
    return _enum(PageEviction, "page_eviction", value)


def _to_load_mode(value: object) -> LoadMode:
    return _enum(LoadMode, "load_mode", value)


def _to_flash_attention(value: object) -> FlashAttention:
    return _enum(FlashAttention, "flash_attn", value)


def _to_kv_cache(value: object) -> KvCacheConfig | None:
    if value is None or isinstance(value, KvCacheConfig):
        return value
    if isinstance(value, Mapping):
        return KvCacheConfig.from_mapping(value)
    msg = f"kv_cache must be a table of cache settings or absent, got {shown(value)}"
    raise ConfigError(msg)


# --------------------------------------------------------------------------------------------
# KvCacheConfig

_ENV_MODE: Final = ("STAGE_RUNTIME_KV_CACHE", "STAGE_RUNTIME_PREFIX_CACHE")
_ENV_PREFIX: Final = "STAGE_RUNTIME_KV_CACHE_"
_DECIMAL: Final = re.compile(r"[+-]?[0-9]+")

_ENV_MODE_VALUES: Final[dict[str, CacheMode]] = {
    "": CacheMode.AUTO,
    "auto": CacheMode.AUTO,
    **dict.fromkeys(("0", "off", "false", "disabled", "disable"), CacheMode.DISABLED),
    "record": CacheMode.RECORD,
    **dict.fromkeys(
        ("1", "on", "true", "lookup-record", "lookuprecord", "exact"), CacheMode.LOOKUP_RECORD
    ),
}

_ENV_PAYLOAD_VALUES: Final[dict[str, CachePayload]] = {
    "": CachePayload.AUTO,
    "auto": CachePayload.AUTO,
    **dict.fromkeys(("resident", "resident-kv", "kv"), CachePayload.RESIDENT_KV),
    **dict.fromkeys(("kv-recurrent", "kvrecurrent"), CachePayload.KV_RECURRENT),
    **dict.fromkeys(("full", "full-state", "fullstate"), CachePayload.FULL_STATE),
}


def _env_get(environ: Mapping[str, str], name: str) -> str | None:
    """The variable's value; a ConfigError naming it when it is not a string."""
    raw = environ.get(name)
    if raw is not None and not isinstance(raw, str):
        msg = f"{name} must be a string, got {shown(raw)}"
        raise ConfigError(msg)
    return raw


_RUST_WHITESPACE: Final = (
    "\t\n\x0b\x0c\r \x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006"
    "\u2007\u2008\u2009\u200a\u2028\u2029\u202f\u205f\u3000"
)
"""Unicode ``White_Space``: what Rust's ``str::trim`` removes (Python's ``strip()`` also removes
the separators U+001C..U+001F)."""


def _trim(raw: str) -> str:
    """``raw`` trimmed as the upstream trims environment values (Rust's ``str::trim``)."""
    return raw.strip(_RUST_WHITESPACE)


def _env_mode(environ: Mapping[str, str]) -> CacheMode | None:
    """Mode from the first mode variable that is set; None if unset or unrecognised."""
    for name in _ENV_MODE:
        raw = _env_get(environ, name)
        if raw is not None:
            return _ENV_MODE_VALUES.get(_trim(raw).lower().replace("_", "-"))
    return None


@attrs.frozen(kw_only=True)
class UnrecognisedCacheMode:
    """A cache-mode variable set to a value that names no mode (the cache stays off)."""

    variable: str
    """The variable, ``STAGE_RUNTIME_KV_CACHE`` or ``STAGE_RUNTIME_PREFIX_CACHE``."""

    value: str
    """Its value, as set."""

    accepted: tuple[str, ...] = tuple(name for name in _ENV_MODE_VALUES if name)
    """The values it accepts (any case, padded, ``_`` for ``-``; empty means ``auto``)."""

    def __str__(self) -> str:
        return (
            f"{self.variable}={self.value!r} is not a cache mode, so stages without a kv_cache "
            f"table run with the cache off (accepted: {', '.join(self.accepted)})"
        )


def unrecognised_cache_mode(
    environ: Mapping[str, str] | None = None,
) -> UnrecognisedCacheMode | None:
    """The first cache-mode variable set to a value that names no mode, or None.

    Such a value disables the cache, as upstream (spec §6.1); this is for warning about it.
    """
    env = _environment(environ)
    for name in _ENV_MODE:
        raw = _env_get(env, name)
        if raw is None:
            continue
        if _trim(raw).lower().replace("_", "-") not in _ENV_MODE_VALUES:
            return UnrecognisedCacheMode(variable=name, value=raw)
        return None  # the first variable set decides, as _env_mode reads them
    return None


def _environment(environ: object) -> Mapping[str, str]:
    """``os.environ`` for None, else ``environ`` once it is known to be a mapping."""
    if environ is None:
        return os.environ
    if not isinstance(environ, Mapping):
        msg = (
            f"environ must be a mapping of variable names to strings, got {type(environ).__name__}"
        )
        raise ConfigError(msg)
    return environ


def kill_switch_engaged(environ: Mapping[str, str] | None = None) -> bool:
    """Whether either mode variable turns the cache off (spec §6.1, V-E kill switch).

    ``STAGE_RUNTIME_KV_CACHE`` or ``STAGE_RUNTIME_PREFIX_CACHE`` set to ``0``, ``off``,
    ``false``, ``disabled`` or ``disable`` disables the cache even when the stage
    configuration has a ``kv_cache`` block.
    """
    env = _environment(environ)
    for name in _ENV_MODE:
        raw = _env_get(env, name)
        normal = None if raw is None else _trim(raw).lower().replace("_", "-")
        if normal is not None and _ENV_MODE_VALUES.get(normal) is CacheMode.DISABLED:
            return True
    return False


@attrs.frozen(kw_only=True, cache_hash=True)
class KvCacheConfig:
    """Bounds and candidate policy of one stage's activation cache (upstream defaults)."""

    mode: CacheMode = attrs.field(default=CacheMode.AUTO, converter=_to_cache_mode)
    """What the stage does with the cache; ``auto`` (the default) means disabled, as upstream."""

    payload: CachePayload = attrs.field(default=CachePayload.AUTO, converter=_to_cache_payload)
    """Upstream payload kind; kept for parity, it does not change activation caching."""

    max_entries: int = attrs.field(default=64, validator=_int_in(1, _U64_MAX))
    """Entries kept before the least recently used is evicted."""

    max_bytes: int = attrs.field(default=0, validator=_int_in(0, _U64_MAX))
    """Byte bound on resident payloads; ``0`` means unbounded."""

    min_tokens: int = attrs.field(default=64, validator=_int_in(0, _U64_MAX))
    """Shortest prefix worth caching; also the lowest rung and the grid's page size."""

    shared_prefix_stride_tokens: int = attrs.field(default=128, validator=_int_in(0, _U64_MAX))
    """Spacing of the lookup grid (capped at ``min_tokens``; 0 acts as 1)."""

    shared_prefix_record_limit: int = attrs.field(default=2, validator=_int_in(0, _U64_MAX))
    """How many prefix lengths one record stores; ``0`` means every lookup candidate."""

    index: CacheIndex = attrs.field(default=CacheIndex.LADDER, converter=_to_cache_index)
    """``ladder`` (the upstream, the default) or ``paged`` (shared pages; not in the upstream)."""

    page_tokens: int | None = attrs.field(default=None, validator=_optional_int(1, _U64_MAX))
    """Tokens per page in ``paged`` mode; None means ``shared_prefix_stride_tokens``."""

    page_eviction: PageEviction = attrs.field(default=PageEviction.LRU, converter=_to_page_eviction)
    """Paged mode: ``lru`` (default), ``reuse`` (weighs reuse and recompute saved) or
    ``adaptive`` (recency or frequency, learnt from the workload)."""

    @property
    def effective_page_tokens(self) -> int:
        """``page_tokens``, or the stride (at least 1) when it is None."""
        if self.page_tokens is not None:
            return self.page_tokens
        return max(self.shared_prefix_stride_tokens, 1)

    @classmethod
    def from_mapping(
        cls, mapping: Mapping[str, Any], *, source: str | None = None
    ) -> KvCacheConfig:
        """Build from a mapping of field names to values (a TOML or JSON table).

        Raises:
            ConfigError: an unknown key or a bad value; the message names the field, the value
                and ``source`` when given.
        """
        return _build(cls, mapping, source=source, prefix="kv_cache.")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> KvCacheConfig | None:
        """Cache settings from environment variables (spec §6.1), or None when not configured.

        ``STAGE_RUNTIME_KV_CACHE`` (falling back to ``STAGE_RUNTIME_PREFIX_CACHE`` when unset, as
        upstream falls back from ``SKIPPY_KV_CACHE`` to ``SKIPPY_PREFIX_CACHE``) sets the mode:
        values are trimmed, lowercased and ``_`` becomes ``-``; ``""``/``auto`` give ``auto``,
        ``0``/``off``/``false``/``disabled``/``disable`` give ``disabled``, ``record`` gives
        ``record``, ``1``/``on``/``true``/``lookup-record``/``lookuprecord``/``exact`` give
        ``lookup-record``; an unset or unrecognised value means no configuration (None). The
        bounds come from ``STAGE_RUNTIME_KV_CACHE_MAX_ENTRIES``, ``_MAX_BYTES``, ``_MIN_TOKENS``,
        ``_SHARED_STRIDE_TOKENS``, ``_SHARED_RECORD_LIMIT``, ``_PAYLOAD``, and (paged
        index) ``_INDEX``, ``_PAGE_TOKENS`` and ``_PAGE_EVICTION`` (``lru``, ``reuse`` or
        ``adaptive``).

        Raises:
            ConfigError: a bound or payload variable is set but not valid (the upstream ignores
                such values; we refuse them, naming the variable).
        """
        env = _environment(environ)
        mode = _env_mode(env)
        if mode is None:
            return None
        values: dict[str, Any] = {"mode": mode}
        variables: dict[str, str] = {}  # field -> the variable it came from, for errors
        numbers = {
            "MAX_ENTRIES": "max_entries",
            "MAX_BYTES": "max_bytes",
            "MIN_TOKENS": "min_tokens",
            "SHARED_STRIDE_TOKENS": "shared_prefix_stride_tokens",
            "SHARED_RECORD_LIMIT": "shared_prefix_record_limit",
            "PAGE_TOKENS": "page_tokens",
        }
        for suffix, field in numbers.items():
            name = _ENV_PREFIX + suffix
            raw = _env_get(env, name)
            digits = "" if raw is None else _trim(raw)
            if not digits:
                continue
            variables[field] = name
            # ASCII decimal digits only: int() would also take "1_000" and non-ASCII digits.
            if _DECIMAL.fullmatch(digits) is None:
                msg = f"{name} must be an integer, got {shown(raw)}"
                raise ConfigError(msg)
            if len(digits) > _MAX_DIGITS:
                msg = f"{name} is out of range: an integer of {len(digits)} digits"
                raise ConfigError(msg)
            values[field] = int(digits)
        raw_payload = _env_get(env, _ENV_PREFIX + "PAYLOAD")
        if raw_payload is not None:
            payload = _ENV_PAYLOAD_VALUES.get(_trim(raw_payload).lower().replace("_", "-"))
            if payload is None:
                choices = ", ".join(repr(k) for k in _ENV_PAYLOAD_VALUES if k)
                msg = f"{_ENV_PREFIX}PAYLOAD must be one of {choices}, got {shown(raw_payload)}"
                raise ConfigError(msg)
            values["payload"] = payload
        raw_index = _env_get(env, _ENV_PREFIX + "INDEX")
        if raw_index is not None and _trim(raw_index):
            values["index"] = _trim(raw_index)
            variables["index"] = _ENV_PREFIX + "INDEX"
        raw_eviction = _env_get(env, _ENV_PREFIX + "PAGE_EVICTION")
        if raw_eviction is not None and _trim(raw_eviction):
            values["page_eviction"] = _trim(raw_eviction)
            variables["page_eviction"] = _ENV_PREFIX + "PAGE_EVICTION"
        try:
            return cls(**values)
        except ConfigError as exc:
            # Validators name the field first ("max_entries must be >= 1, got 0"): name the
            # variable the user set instead.
            text = str(exc)
            for field, name in variables.items():
                if text.startswith(f"{field} "):
                    msg = f"{name}{text[len(field) :]}"
                    break
            else:
                msg = f"environment: {text}"
            raise ConfigError(msg) from None


# --------------------------------------------------------------------------------------------
# StageConfig and MessageBase


@attrs.frozen(kw_only=True, cache_hash=True)
class StageConfig:
    """One pipeline stage: what it runs, and the fields that make up its cache identity.

    Only ``stage_id``, ``model_id``, ``layer_start`` and ``layer_end`` are required. Fields
    marked *identity* feed the prefix hash (spec §1.2); changing one changes every cache key.
    """

    stage_id: str = attrs.field(validator=_nonempty_str)
    """Name of the stage (identity)."""

    model_id: str = attrs.field(validator=_nonempty_str)
    """Model name (identity)."""

    layer_start: int = attrs.field(validator=_int_in(0, _U32_MAX))
    """First layer this stage runs (identity)."""

    layer_end: int = attrs.field(validator=_int_in(0, _U32_MAX))
    """One past the last layer this stage runs (identity); must be > ``layer_start``."""

    stage_index: int = attrs.field(default=0, validator=_int_in(0, _U32_MAX))
    """Position of the stage in the pipeline (identity)."""

    run_id: str = attrs.field(default="", validator=_str)
    """Run name; not part of the identity."""

    topology_id: str = attrs.field(default="", validator=_str)
    """Topology name; not part of the identity (V-D onward), so caches survive restarts."""

    package_ref: str | None = attrs.field(default=None, validator=_optional_str)
    """Reference of the weight package (identity)."""

    manifest_sha256: str | None = attrs.field(default=None, validator=_optional_str)
    """Digest of the package manifest (identity)."""

    source_model_sha256: str | None = attrs.field(default=None, validator=_optional_str)
    """Digest of the source model file (identity)."""

    load_mode: LoadMode = attrs.field(default=LoadMode.RUNTIME_SLICE, converter=_to_load_mode)
    """How the weights were loaded (identity)."""

    ctx_size: int = attrs.field(default=8192, validator=_int_in(1, _U32_MAX))
    """Context length (identity, as ``ctx:{ctx_size}``); also sets the record-ladder budget."""

    lane_count: int = attrs.field(default=1, validator=_int_in(1, _U32_MAX))
    """Concurrent sequences the stage serves."""

    cache_type_k: str = attrs.field(default="f16", validator=_nonempty_str)
    """KV cache element type for keys (identity)."""

    cache_type_v: str = attrs.field(default="f16", validator=_nonempty_str)
    """KV cache element type for values (identity)."""

    flash_attn: FlashAttention = attrs.field(
        default=FlashAttention.AUTO, converter=_to_flash_attention
    )
    """Flash-attention setting (identity)."""

    n_gpu_layers: int = attrs.field(default=0, validator=_int_in(_I32_MIN, _I32_MAX))
    """Layers offloaded to the GPU; negative means all (identity)."""

    selected_device: str | None = attrs.field(default=None, validator=_optional_str)
    """Backend device name such as ``"CUDA0"``, or None (identity)."""

    kv_unified: bool | None = attrs.field(default=None, validator=_optional_bool)
    """Unified KV buffer setting, or None when absent (identity)."""

    swa_full: bool | None = attrs.field(default=None, validator=_optional_bool)
    """Full sliding-window-attention cache setting, or None when absent (identity)."""

    kv_cache: KvCacheConfig | None = attrs.field(default=None, converter=_to_kv_cache)
    """Cache settings; None falls back to the environment (spec §6.1)."""

    upstream: str | None = attrs.field(default=None, validator=_optional_str)
    """Id of the previous stage, or None for the first."""

    downstream: str | None = attrs.field(default=None, validator=_optional_str)
    """Id of the next stage, or None for the last."""

    def __attrs_post_init__(self) -> None:
        if self.layer_end <= self.layer_start:  # a stage runs at least one layer
            msg = f"layer_end must be > layer_start ({self.layer_start}), got {self.layer_end}"
            raise ConfigError(msg)

    @classmethod
    def from_mapping(cls, mapping: Mapping[str, Any], *, source: str | None = None) -> StageConfig:
        """Build from a mapping (a parsed TOML or JSON document); ``kv_cache`` may be a table.

        Args:
            mapping: Field names to values. Enum fields take their string values.
            source: Where the mapping came from (a file name), added to error messages.

        Raises:
            ConfigError: a missing or unknown key, or a bad value; the message names the field,
                the value and ``source``.
        """
        return _build(cls, mapping, source=source, prefix="")

    @classmethod
    def from_toml(cls, path: str | os.PathLike[str]) -> StageConfig:
        """Load from a TOML file (top-level keys are fields; ``[kv_cache]`` is a table).

        Raises:
            ConfigError: the file cannot be read, is not UTF-8 or cannot be parsed, or holds
                a bad value; the message starts with the file name, then the line (the
                parser's for a syntax error; the field's for a bad, unknown or misplaced
                field), and names the field and value.
        """
        source = os.fspath(path)
        text = _read_text(source)
        document = _parse_toml(text, source=source)
        return _build(cls, document, source=source, prefix="", locate=_toml_locator(text))

    @classmethod
    def from_json(cls, path: str | os.PathLike[str]) -> StageConfig:
        """Load from a JSON file holding one object.

        Raises:
            ConfigError: the file cannot be read, is not UTF-8 or cannot be parsed, or holds
                a bad value; the message starts with the file name, then the line (the
                parser's for a syntax error; the field's for a bad, unknown or misplaced
                field), and names the field and value.
        """
        source = os.fspath(path)
        text = _read_text(source)
        try:
            document = json.loads(text, object_pairs_hook=_unique_keys)
        except _DuplicateKeyError as exc:
            raise _duplicate_key(text, source, exc.key) from None
        except json.JSONDecodeError as exc:
            msg = f"{source}: invalid JSON: {exc}"
            raise ConfigError(msg) from exc
        except ValueError as exc:  # an integer too long for int() (over 4,300 digits)
            raise _unreadable_number(text, source, exc) from None
        except RecursionError:
            msg = f"{source}: invalid JSON: arrays or objects nested too deeply"
            raise ConfigError(msg) from None
        if not isinstance(document, dict):
            msg = f"{source}: config must be a JSON object, got {type(document).__name__}"
            raise ConfigError(msg)
        return _build(cls, document, source=source, prefix="", locate=_json_locator(text))

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> StageConfig:
        """Load from a ``.toml`` or ``.json`` file, chosen by suffix.

        Raises:
            ConfigError: an unknown suffix, or any error of :meth:`from_toml`/:meth:`from_json`.
        """
        suffix = Path(path).suffix.lower()
        if suffix == ".toml":
            return cls.from_toml(path)
        if suffix == ".json":
            return cls.from_json(path)
        msg = f"{os.fspath(path)}: config file suffix must be .toml or .json, got {suffix!r}"
        raise ConfigError(msg)


@attrs.frozen(kw_only=True)
class MessageBase:
    """Envelope fields every stage message carries (the upstream's ``MessageBase``).

    None of these is hashed into the cache identity except ``chat_template_id``, which is the
    cache namespace (so prompts are shared across sessions by design).
    """

    schema_version: int = attrs.field(default=SCHEMA_VERSION, validator=_int_in(0, _U32_MAX))
    """Message schema version."""

    run_id: str = attrs.field(default="", validator=_str)
    """Run the message belongs to."""

    request_id: str = attrs.field(default="", validator=_str)
    """Request the message belongs to."""

    session_id: str = attrs.field(default="", validator=_str)
    """Session the request belongs to (metadata only; never hashed)."""

    stage_id: str = attrs.field(default="", validator=_str)
    """Stage the message is addressed to."""

    stage_index: int = attrs.field(default=0, validator=_int_in(0, _U32_MAX))
    """Index of that stage."""

    topology_id: str = attrs.field(default="", validator=_str)
    """Topology of the run."""

    model_id: str | None = attrs.field(default=None, validator=_optional_str)
    """Model the request targets."""

    tokenizer_id: str | None = attrs.field(default=None, validator=_optional_str)
    """Tokenizer; the identity metadata falls back to the model id when absent."""

    chat_template_id: str | None = attrs.field(default=None, validator=_optional_str)
    """Cache namespace: hashed into every prefix identity when present."""

    seq: int | None = attrs.field(default=None, validator=_optional_int(0, _U64_MAX))
    """Sequence number of the message within its request."""

    cache_salt: str | None = attrs.field(default=None, validator=_optional_nonempty_str)
    """Tenant salt mixed into every cache key: requests with different salts never share or
    probe each other's entries. None (the default) shares across sessions, as upstream. An
    empty salt is refused: it would be a tenant of its own, which an empty default almost
    never means."""


# --------------------------------------------------------------------------------------------
# building from mappings and files


_MAX_DIGITS: Final = 4300
"""Python's default limit on the digits int() converts (sys.get_int_max_str_digits)."""


def _unreadable_number(text: str, source: str, exc: ValueError) -> ConfigError:
    """The error for a number the parser could not convert, naming its line when found."""
    found = re.search(rf"[0-9][0-9_]{{{_MAX_DIGITS},}}", text)
    if found is None:
        return ConfigError(f"{source}: {exc}")
    line = text.count("\n", 0, found.start()) + 1
    digits = len(found.group().replace("_", ""))
    return ConfigError(f"{source}: line {line}: integer of {digits} digits is out of range")


class _DuplicateKeyError(Exception):
    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object, refusing a repeated key (json keeps the last one silently, where TOML
    refuses it: a repeated ``kv_cache`` would drop the first block's settings)."""
    document: dict[str, Any] = {}
    for key, value in pairs:
        if key in document:
            raise _DuplicateKeyError(key)
        document[key] = value
    return document


def _duplicate_key(text: str, source: str, key: str) -> ConfigError:
    """The error for a key a JSON object repeats, with the line of its second occurrence."""
    found = list(re.finditer(rf'"{re.escape(json.dumps(key)[1:-1])}"\s*:', text))
    where = f"line {text.count(chr(10), 0, found[1].start()) + 1}: " if len(found) > 1 else ""
    return ConfigError(f"{source}: {where}key {key!r} appears twice in one object")


def _parse_toml(text: str, *, source: str) -> dict[str, Any]:
    """Parse TOML ``text`` read from ``source``; a ConfigError names the file and the line."""
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        msg = f"{source}: invalid TOML: {exc}"
        raise ConfigError(msg) from exc
    except ValueError as exc:  # an integer too long for int() (over 4,300 digits)
        raise _unreadable_number(text, source, exc) from None
    except RecursionError:
        msg = f"{source}: invalid TOML: arrays or tables nested too deeply"
        raise ConfigError(msg) from None


def _read_text(source: str) -> str:
    """The UTF-8 text of a config file; errors name the file (and the line of a bad byte)."""
    try:
        with open(source, "rb") as handle:
            data = handle.read()
    except OSError as exc:
        msg = f"{source}: cannot read config file: {exc.strerror}"
        raise ConfigError(msg) from exc
    except ValueError as exc:  # a NUL byte in the path
        msg = f"{source!r}: cannot read config file: {exc}"
        raise ConfigError(msg) from exc
    try:
        # utf-8-sig: a byte-order mark some editors write is not part of the document.
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        msg = f"{source}: line {line}: config file must be UTF-8, got byte {data[exc.start]:#04x}"
        raise ConfigError(msg) from None


_T = TypeVar("_T")

_Locator = Callable[[str], int | None]
"""The line of a dotted field (``kv_cache.max_entries``) in a config file, if it can be found."""


def _build(
    cls: Callable[..., _T],
    mapping: Mapping[str, Any],
    *,
    source: str | None,
    prefix: str,
    locate: _Locator | None = None,
    subject: str | None = None,
) -> _T:
    """Construct ``cls`` from ``mapping``; errors name ``source``, the field's line when
    ``locate`` finds it, ``subject`` (what in the file is built), ``prefix + field`` and the
    value."""

    def fail(message: str, field: str) -> NoReturn:
        where = f"{source}: " if source else ""
        line = locate(field) if locate is not None and field else None
        if line is not None:
            where += f"line {line}: "
        if subject:
            where += f"{subject}: "
        raise ConfigError(where + message) from None

    if not isinstance(mapping, Mapping):
        name = prefix.rstrip(".")
        fail(f"{name or 'config'} must be a table, got {shown(mapping)}", name)
    fields = attrs.fields_dict(cls)  # type: ignore[arg-type]
    for key in mapping:
        if key not in fields:
            known = ", ".join(sorted(fields))
            name = key if isinstance(key, str) else repr(key)
            fail(f"unknown field {prefix}{name} (known fields: {known})", prefix + name)
    missing = [
        name
        for name, field in fields.items()
        if field.default is attrs.NOTHING and name not in mapping
    ]
    if missing:
        field = missing[0]
        for key, value in mapping.items():
            if isinstance(value, Mapping) and field in value:
                # In TOML every key after a [table] header belongs to that table.
                fail(
                    f"missing required field {prefix}{field}: it is under {prefix}{key} (in "
                    f"TOML, the keys after a table's header belong to that table: move "
                    f"{field} above the [{key}] header)",
                    f"{prefix}{key}.{field}",
                )
        fail(f"missing required field {prefix}{field}", "")
    values = dict(mapping)
    if "kv_cache" in values and isinstance(values["kv_cache"], Mapping):
        values["kv_cache"] = _build(
            KvCacheConfig,
            values["kv_cache"],
            source=source,
            prefix=prefix + "kv_cache.",
            locate=locate,
            subject=subject,
        )
    try:
        return cls(**values)
    except ConfigError as exc:
        # Value errors start with the field's name ("ctx_size must be >= 1, got 0").
        text = str(exc)
        field = next((key for key in values if text.startswith(f"{key} ")), "")
        fail(f"{prefix}{exc}", prefix + field if field else "")


_TOML_HEADER = re.compile(r"^\s*(\[\[?)\s*([^\[\]]+?)\s*\]\]?\s*(?:#.*)?$")
_TOML_KEY = re.compile(r"^\s*([A-Za-z0-9_.\-\"' ]+?)\s*=")

_KeyPath = tuple[str | int, ...]


def _toml_key(key: str) -> list[str]:
    return [part.strip().strip("\"'") for part in key.split(".")]


def _toml_key_lines(text: str) -> list[tuple[int, _KeyPath, str]]:
    """``(line number, full key path, line)`` of each ``key = value`` line and each table
    header of TOML ``text``.

    A path counts the elements of arrays of tables: the ``layer_end`` of the second
    ``[[stage]]`` is ``("stage", 1, "layer_end")``, and a ``[stage.kv_cache]`` table belongs to
    the latest ``[[stage]]``.
    """
    arrays: dict[tuple[str, ...], int] = {}
    table: _KeyPath = ()
    out: list[tuple[int, _KeyPath, str]] = []
    for number, line in enumerate(text.splitlines(), start=1):
        header = _TOML_HEADER.match(line)
        if header is not None:
            parts = _toml_key(header.group(2))
            if header.group(1) == "[[":
                arrays[tuple(parts)] = arrays.get(tuple(parts), -1) + 1
            path: list[str | int] = []
            for i, part in enumerate(parts):
                path.append(part)
                index = arrays.get(tuple(parts[: i + 1]))
                if index is not None:
                    path.append(index)
            table = tuple(path)
            out.append((number, table, line))  # the table itself (an unknown [table] is here)
            continue
        key = _TOML_KEY.match(line)
        if key is not None:
            out.append((number, table + tuple(_toml_key(key.group(1))), line))
    return out


def _toml_locator(text: str, *tables: _KeyPath) -> _Locator:
    """Find a field's line in TOML ``text``: a ``key =`` line under the field's table (or a
    dotted key), or the line of an inline table that assigns it; the field is looked for under
    each of ``tables`` in turn (default: the top level). Best effort: None when the text does
    not say it in one of these plain ways. The text is scanned only when a field is looked
    for (an error), not when the locator is made."""

    def locate(field: str) -> int | None:
        keys = _toml_key_lines(text)
        for table in tables or ((),):
            want = table + tuple(field.split("."))
            for number, path, line in keys:
                if path == want:
                    return number
                inline = re.search(rf"[{{,]\s*{re.escape(str(want[-1]))}\s*=", line)
                if path == want[: len(path)] and inline is not None:
                    return number
        return None

    return locate


def _json_locator(text: str) -> _Locator:
    """Find a field's line in JSON ``text``: its key after its parent's key. Best effort."""

    def locate(field: str) -> int | None:
        position = 0
        for part in field.split("."):
            found = re.compile(rf'"{re.escape(part)}"\s*:').search(text, position)
            if found is None:
                return None
            position = found.start()
        return text.count("\n", 0, position) + 1

    return locate
