"""Stage and cache configuration, loaded from mappings, TOML, JSON or the environment.

Every class here is a frozen attrs class whose validators raise :class:`ConfigError` naming the
field and the bad value; derive variants with :func:`attrs.evolve`. Mappings and files are
structured with cattrs (unknown keys refused): an error names the key path of the value
(``kv_cache.max_entries``), and the file name when loading from a file.
"""

from __future__ import annotations

import enum
import json
import os
import re
import tomllib
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final, TypeVar

import attrs
import cattrs
from cattrs.errors import ForbiddenExtraKeysError

from stage_runtime._config_lines import json_line, with_line
from stage_runtime._validators import i32, optional_int_in, positive_u32, positive_u64, u32, u64
from stage_runtime.errors import ConfigError, shown
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
    (GreedyDual-style). ``ADAPTIVE``: which pages come back, learnt online per class of
    record (see :mod:`stage_runtime.cache.paged.eviction`).
    """

    LRU = "lru"
    REUSE = "reuse"
    ADAPTIVE = "adaptive"


# --------------------------------------------------------------------------------------------
# validators and converters (each names its field in the message)

_E = TypeVar("_E", bound=enum.StrEnum)


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
    if value.isascii() and value.isprintable():
        return  # (printable ASCII, the usual id: neither a surrogate nor a control character)
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


def _printable(_instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    """A string without control characters (:func:`check_id`): a name a log line shows."""
    if not isinstance(value, str):
        msg = f"{attribute.name} must be a string, got {shown(value)}"
        raise ConfigError(msg)
    check_id(attribute.name, value)


def check_name(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    """attrs validator: a non-empty string without control characters (:func:`check_id`)."""
    _printable(instance, attribute, value)
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


def _paged_only(instance: Any, attribute: Any, value: PageEviction) -> None:
    if value is not PageEviction.LRU and instance.index is not CacheIndex.PAGED:
        msg = (
            f"{attribute.name} {value.value!r} applies to index 'paged' only "
            f"(index is {instance.index.value!r})"
        )
        raise ConfigError(msg)


@attrs.frozen(kw_only=True, cache_hash=True)
class KvCacheConfig:
    """Bounds and candidate policy of one stage's activation cache (upstream defaults)."""

    mode: CacheMode = attrs.field(default=CacheMode.AUTO, converter=_to_cache_mode)
    """What the stage does with the cache; ``auto`` (the default) means disabled, as upstream."""

    payload: CachePayload = attrs.field(default=CachePayload.AUTO, converter=_to_cache_payload)
    """Upstream payload kind; kept for parity, it does not change activation caching."""

    max_entries: int = attrs.field(default=64, validator=positive_u64)
    """Entries kept before the least recently used is evicted."""

    max_bytes: int = attrs.field(default=0, validator=u64)
    """Byte bound on resident payloads; ``0`` means unbounded."""

    min_tokens: int = attrs.field(default=64, validator=u64)
    """Shortest prefix worth caching; also the lowest rung and the grid's page size."""

    shared_prefix_stride_tokens: int = attrs.field(default=128, validator=u64)
    """Spacing of the lookup grid (capped at ``min_tokens``; 0 acts as 1)."""

    shared_prefix_record_limit: int = attrs.field(default=2, validator=u64)
    """How many prefix lengths one record stores; ``0`` means every lookup candidate."""

    index: CacheIndex = attrs.field(default=CacheIndex.LADDER, converter=_to_cache_index)
    """``ladder`` (the upstream, the default) or ``paged`` (shared pages; not in the upstream)."""

    page_tokens: int | None = attrs.field(default=None, validator=optional_int_in(1, _U64_MAX))
    """Tokens per page: the ``paged`` index's page size, and with either index the unit of the
    unique-prefix accounting (``unique_prefix_bytes``); None means
    ``shared_prefix_stride_tokens``."""

    page_eviction: PageEviction = attrs.field(
        default=PageEviction.LRU, converter=_to_page_eviction, validator=_paged_only
    )
    """Paged mode: ``lru`` (default), ``reuse`` (weighs reuse and recompute saved) or
    ``adaptive`` (which pages come back, learnt from the workload). Another policy than ``lru``
    with the ladder index is refused: the ladder evicts by LRU only."""

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
        return _build(cls, mapping, source=source, root=("kv_cache",))

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

    stage_id: str = attrs.field(validator=check_name)
    """Name of the stage (identity); printable text (it names the stage in every log line)."""

    model_id: str = attrs.field(validator=check_name)
    """Model name (identity); printable text."""

    layer_start: int = attrs.field(validator=u32)
    """First layer this stage runs (identity)."""

    layer_end: int = attrs.field(validator=u32)
    """One past the last layer this stage runs (identity); must be > ``layer_start``."""

    stage_index: int = attrs.field(default=0, validator=u32)
    """Position of the stage in the pipeline (identity)."""

    run_id: str = attrs.field(default="", validator=_printable)
    """Run name; not part of the identity."""

    topology_id: str = attrs.field(default="", validator=_printable)
    """Topology name; not part of the identity (V-D onward), so caches survive restarts."""

    package_ref: str | None = attrs.field(default=None, validator=_optional_str)
    """Reference of the weight package (identity)."""

    manifest_sha256: str | None = attrs.field(default=None, validator=_optional_str)
    """Digest of the package manifest (identity)."""

    source_model_sha256: str | None = attrs.field(default=None, validator=_optional_str)
    """Digest of the source model file (identity)."""

    load_mode: LoadMode = attrs.field(default=LoadMode.RUNTIME_SLICE, converter=_to_load_mode)
    """How the weights were loaded (identity)."""

    ctx_size: int = attrs.field(default=8192, validator=positive_u32)
    """Context length (identity, as ``ctx:{ctx_size}``); also sets the record-ladder budget."""

    lane_count: int = attrs.field(default=1, validator=positive_u32)
    """Concurrent sequences the stage serves."""

    cache_type_k: str = attrs.field(default="f16", validator=_nonempty_str)
    """KV cache element type for keys (identity)."""

    cache_type_v: str = attrs.field(default="f16", validator=_nonempty_str)
    """KV cache element type for values (identity)."""

    flash_attn: FlashAttention = attrs.field(
        default=FlashAttention.AUTO, converter=_to_flash_attention
    )
    """Flash-attention setting (identity)."""

    n_gpu_layers: int = attrs.field(default=0, validator=i32)
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
        return _build(cls, mapping, source=source)

    @classmethod
    def from_toml(cls, path: str | os.PathLike[str]) -> StageConfig:
        """Load from a TOML file (top-level keys are fields; ``[kv_cache]`` is a table).

        Raises:
            ConfigError: the file cannot be read, is not UTF-8 or cannot be parsed, or holds
                a bad, unknown or misplaced key; the message starts with the file name, then
                the line (the parser's line and column for a syntax error), and names the key
                path (``kv_cache.max_entries``) and the value.
        """
        source = os.fspath(path)
        text = _read_text(source)
        document = _parse_toml(text, source=source)
        try:
            return _build(cls, document, source=source)
        except ConfigError as exc:
            raise ConfigError(with_line(str(exc), source, text)) from None

    @classmethod
    def from_json(cls, path: str | os.PathLike[str]) -> StageConfig:
        """Load from a JSON file holding one object.

        Raises:
            ConfigError: the file cannot be read, is not UTF-8 or cannot be parsed, repeats a
                key in an object, or holds a bad value; the message starts with the file name,
                then the line (the parser's line and column for a syntax error), and names the
                key path (``kv_cache.max_entries``) and the value.
        """
        source = os.fspath(path)
        text = _read_text(source)
        document = _parse_json(text, source=source)
        if not isinstance(document, dict):
            msg = f"{source}: config must be a JSON object, got {type(document).__name__}"
            raise ConfigError(msg)
        try:
            return _build(cls, document, source=source)
        except ConfigError as exc:
            raise ConfigError(with_line(str(exc), source, text, json_line)) from None

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

    schema_version: int = attrs.field(default=SCHEMA_VERSION, validator=u32)
    """Message schema version."""

    run_id: str = attrs.field(default="", validator=_str)
    """Run the message belongs to."""

    request_id: str = attrs.field(default="", validator=_str)
    """Request the message belongs to."""

    session_id: str = attrs.field(default="", validator=_str)
    """Session the request belongs to (metadata only; never hashed)."""

    stage_id: str = attrs.field(default="", validator=_str)
    """Stage the message is addressed to."""

    stage_index: int = attrs.field(default=0, validator=u32)
    """Index of that stage."""

    topology_id: str = attrs.field(default="", validator=_str)
    """Topology of the run."""

    model_id: str | None = attrs.field(default=None, validator=_optional_str)
    """Model the request targets."""

    tokenizer_id: str | None = attrs.field(default=None, validator=_optional_str)
    """Tokenizer; the identity metadata falls back to the model id when absent."""

    chat_template_id: str | None = attrs.field(default=None, validator=_optional_str)
    """Cache namespace: hashed into every prefix identity when present."""

    seq: int | None = attrs.field(default=None, validator=optional_int_in(0, _U64_MAX))
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


def _unreadable_number(source: str, exc: ValueError) -> ConfigError:
    """The error for a number the parser could not convert (it does not say where)."""
    if "integer string conversion" in str(exc):
        return ConfigError(
            f"{source}: an integer of more than {_MAX_DIGITS} digits is out of range "
            f"(no setting takes one)"
        )
    return ConfigError(f"{source}: {exc}")


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


class _Pairs(list[tuple[str, Any]]):
    """A JSON object as the parser read it, keys in order and repeats kept (see
    :func:`_unique_objects`)."""


def _unique_objects(value: Any, path: str) -> Any:
    """``value`` with every :class:`_Pairs` turned into a dict; a ConfigError names the key
    path of a key an object repeats."""
    if isinstance(value, _Pairs):
        document: dict[str, Any] = {}
        for key, item in value:
            where = f"{path}.{key}" if path else key
            if key in document:
                msg = f"key {where} appears twice in one object"
                raise ConfigError(msg)
            document[key] = _unique_objects(item, where)
        return document
    if isinstance(value, list):
        return [_unique_objects(item, f"{path}[{index}]") for index, item in enumerate(value)]
    return value


def _parse_toml(text: str, *, source: str) -> dict[str, Any]:
    """Parse TOML ``text`` read from ``source``; a ConfigError names the file (and the parser
    says the line of a syntax error)."""
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        msg = f"{source}: invalid TOML: {exc}"
        raise ConfigError(msg) from exc
    except ValueError as exc:  # an integer too long for int() (over 4,300 digits)
        raise _unreadable_number(source, exc) from None
    except RecursionError:
        msg = f"{source}: invalid TOML: arrays or tables nested too deeply"
        raise ConfigError(msg) from None


def _parse_json(text: str, *, source: str) -> Any:
    """Parse JSON ``text`` read from ``source``, refusing repeated keys."""
    try:
        return _unique_objects(json.loads(text, object_pairs_hook=_Pairs), "")
    except ConfigError as exc:
        msg = f"{source}: {exc}"
        raise ConfigError(msg) from None
    except json.JSONDecodeError as exc:
        msg = f"{source}: invalid JSON: {exc}"
        raise ConfigError(msg) from exc
    except ValueError as exc:  # an integer too long for int() (over 4,300 digits)
        raise _unreadable_number(source, exc) from None
    except RecursionError:
        msg = f"{source}: invalid JSON: arrays or objects nested too deeply"
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


# --------------------------------------------------------------------------------------------
# structuring with cattrs: the attrs classes' own converters and validators judge each value;
# cattrs walks the tables, refuses unknown and missing keys, and says where each error is.

_T = TypeVar("_T")

KeyPath = tuple[str | int, ...]
"""Where a value sits in a document: ``("stage", 2, "kv_cache", "max_entries")``."""


def key_path(path: KeyPath) -> str:
    """``("stage", 2, "kv_cache", "max_entries")`` as ``stage[2].kv_cache.max_entries``."""
    text = ""
    for part in path:
        if isinstance(part, int):
            text += f"[{part}]"
        else:
            text += f".{part}" if text else part
    return text


def _as_is(value: object, _type: object) -> object:
    """Hand a value to the attrs class unchanged: its converters and validators judge it (a
    cattrs ``str`` hook would turn 7 into ``"7"``, an ``int`` hook ``True`` into 1)."""
    return value


def _to_kv_cache_table(value: object, _type: object) -> KvCacheConfig | None:
    if value is None or isinstance(value, KvCacheConfig):
        return value
    if isinstance(value, Mapping):
        return _converter.structure(value, KvCacheConfig)
    msg = f"kv_cache must be a table of cache settings or absent, got {shown(value)}"
    raise ConfigError(msg)


_converter: Final = cattrs.Converter(forbid_extra_keys=True, detailed_validation=True)


def _holds_attrs_class(kind: object) -> bool:
    """Whether ``kind`` is an attrs class or a union with one (``RestartPolicy | None``):
    cattrs structures those from tables; everything else goes to the class as it is."""
    return attrs.has(kind) or any(attrs.has(arg) for arg in typing.get_args(kind))  # type: ignore[arg-type]


_converter.register_structure_hook_func(lambda kind: not _holds_attrs_class(kind), _as_is)
# cattrs dispatches these classes before any predicate: name them. (Its enum hook would also
# refuse "LOOKUP_RECORD", which the fields' converters accept, and not name the choices.)
_PASSED_AS_IS: Final[tuple[type, ...]] = (
    int,
    float,
    str,
    bool,
    CacheMode,
    CachePayload,
    LoadMode,
    FlashAttention,
    CacheIndex,
    PageEviction,
)
for _kind in _PASSED_AS_IS:
    _converter.register_structure_hook(_kind, _as_is)
_converter.register_structure_hook(KvCacheConfig | None, _to_kv_cache_table)


_KINDS: Final = ("misplaced", "unknown", "missing", "value")
"""Kinds of :class:`ConfigProblem`, the one reported first first: a key written under the wrong
table explains the rest (it is unknown where it is and missing where it belongs), and an
unknown key (a typo) explains a missing one."""


@attrs.frozen
class ConfigProblem:
    """One thing wrong in a configuration document, located by key path."""

    kind: str
    """One of :data:`_KINDS`."""

    path: KeyPath
    """The key at fault (for a value error, the field; for a missing key, where it belongs)."""

    message: str
    """What is wrong, with ``{path}`` where the key path goes:
    ``"{path} must be >= 1, got 0"``."""

    def render(self, root: KeyPath = ()) -> str:
        """The message with the key path under ``root`` filled in (``config`` for the document
        itself, at no key)."""
        path = root + self.path
        return self.message.format(path=key_path(path) if path else "config")


def _problems(exc: BaseException, path: KeyPath, cls: object) -> list[ConfigProblem]:
    """The problems in an error cattrs raised while structuring ``cls`` at ``path``."""
    if isinstance(exc, BaseExceptionGroup):
        inner = getattr(exc, "cl", cls)  # the class a ClassValidationError was building
        out: list[ConfigProblem] = []
        for sub in exc.exceptions:
            sub_path = path
            for note in getattr(sub, "__notes__", ()):
                name = getattr(note, "name", None)  # cattrs' AttributeValidationNote
                index = getattr(note, "index", None)  # cattrs' IterableValidationNote
                if isinstance(name, str):
                    sub_path += (name,)
                elif isinstance(index, int):
                    sub_path += (index,)
            out.extend(_problems(sub, sub_path, inner))
        return out
    if isinstance(exc, ForbiddenExtraKeysError):
        known = ", ".join(sorted(attrs.fields_dict(exc.cl)))
        return [
            ConfigProblem(
                "unknown",
                (*path, key if isinstance(key, str) else repr(key)),
                f"unknown field {{path}} (known fields: {known})",
            )
            for key in sorted(exc.extra_fields, key=str)
        ]
    if isinstance(exc, KeyError):  # cattrs' note named the missing field: the last part
        return [ConfigProblem("missing", path, "missing required field {path}")]
    text = str(exc).replace("{", "{{").replace("}", "}}")
    # Validators and converters start their message with the field's name, or an item of it
    # ("ctx_size must be >= 1, got 0", "resources['stage-0']['CPU'] must be..."); a hook's
    # error names the attribute cattrs noted.
    if path and isinstance(path[-1], str) and _names_field(text, path[-1]):
        return [ConfigProblem("value", path, "{path}" + text[len(path[-1]) :])]
    fields = attrs.fields_dict(cls) if isinstance(cls, type) and attrs.has(cls) else {}
    field = next((name for name in fields if _names_field(text, name)), None)
    if field is not None:
        return [ConfigProblem("value", (*path, field), "{path}" + text[len(field) :])]
    return [ConfigProblem("value", path, "{path}: " + text if path else text)]


def _names_field(text: str, name: str) -> bool:
    """Whether an error message starts with field ``name`` (then a space, or an item's ``[``)."""
    return text.startswith(name) and text[len(name) : len(name) + 1] in (" ", "[")


def _first(problems: list[ConfigProblem]) -> ConfigProblem:
    """The problem to report: the first of the kind that comes first in :data:`_KINDS`."""
    return min(problems, key=lambda problem: _KINDS.index(problem.kind))


def _missing_hint(problem: ConfigProblem, document: Mapping[Any, Any]) -> ConfigProblem:
    """A required key missing here but present in a sub-table: in TOML every key after a
    ``[table]`` header belongs to that table, so say so and point at it."""
    if problem.kind != "missing":
        return problem
    *parent, field = problem.path
    table: Any = document
    for part in parent:
        if isinstance(table, Mapping):
            table = table.get(part)
        elif isinstance(table, list) and isinstance(part, int):
            table = table[part]
        else:
            table = None
    if not isinstance(table, Mapping):
        return problem
    for key, value in table.items():
        if isinstance(value, Mapping) and field in value:
            under = key_path((*parent, key))
            return ConfigProblem(
                "misplaced",
                problem.path,
                f"missing required field {{path}}: it is under {under} (in TOML, the keys "
                f"after a table's header belong to that table: move {field} above the "
                f"[{key}] header)",
            )
    return problem


class ConfigProblemError(ConfigError):
    """A :class:`ConfigError` that also carries its :class:`ConfigProblem`, for callers that
    put the key path under a root of their own (as the topology loader does)."""

    def __init__(self, problem: ConfigProblem) -> None:
        super().__init__(problem.render())
        self.problem = problem

    def __reduce__(self) -> tuple[type[ConfigError], tuple[str]]:
        # Pickled (to another process) as the plain ConfigError it is to users.
        return ConfigError, (str(self),)


def structure(cls: type[_T], document: object) -> _T:
    """Build attrs class ``cls`` from a mapping (a parsed TOML or JSON table).

    Raises:
        ConfigProblemError: what is wrong and where, as a :class:`ConfigProblem`.
    """
    if not isinstance(document, Mapping):
        problem = ConfigProblem("value", (), f"{{path}} must be a table, got {shown(document)}")
        raise ConfigProblemError(problem)
    try:
        return _converter.structure(document, cls)
    except ConfigError as exc:  # not raised inside an attrs class (cattrs did not wrap it)
        raise ConfigProblemError(_problems(exc, (), cls)[0]) from None
    except cattrs.BaseValidationError as exc:
        problems = [_missing_hint(problem, document) for problem in _problems(exc, (), cls)]
        raise ConfigProblemError(_first(problems)) from None


def _build(cls: type[_T], document: object, *, source: str | None, root: KeyPath = ()) -> _T:
    """:func:`structure`, errors naming ``source`` and the key path under ``root``."""
    try:
        return structure(cls, document)
    except ConfigProblemError as exc:
        where = f"{source}: " if source else ""
        raise ConfigError(where + exc.problem.render(root)) from None
