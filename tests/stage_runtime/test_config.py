"""Stage and cache configuration: defaults, validation, files and the environment."""

from __future__ import annotations

import json
import pickle
import re
from pathlib import Path
from typing import Any

import attrs
import pytest

from stage_runtime import CacheIndex, CacheMode, ConfigError, KvCacheConfig, StageConfig
from stage_runtime.config import (
    CachePayload,
    FlashAttention,
    LoadMode,
    MessageBase,
    kill_switch_engaged,
)
from stage_runtime.integration import KvStageIntegration


def test_kv_cache_defaults_match_upstream_serde_defaults() -> None:
    """mode auto, payload auto, 64 entries, unbounded bytes, min 64, stride 128, limit 2."""
    cfg = KvCacheConfig()
    assert cfg.mode is CacheMode.AUTO
    assert cfg.payload is CachePayload.AUTO
    assert (cfg.max_entries, cfg.max_bytes, cfg.min_tokens) == (64, 0, 64)
    assert (cfg.shared_prefix_stride_tokens, cfg.shared_prefix_record_limit) == (128, 2)


def test_enum_values_are_the_upstream_kebab_case_strings() -> None:
    """Modes and payloads use the upstream's serialised names."""
    assert [str(m) for m in CacheMode] == ["disabled", "auto", "record", "lookup-record"]
    assert [str(p) for p in CachePayload] == ["auto", "resident-kv", "kv-recurrent", "full-state"]
    assert KvCacheConfig(mode="lookup_record").mode is CacheMode.LOOKUP_RECORD


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("max_entries", 0, "max_entries must be >= 1, got 0"),
        ("max_bytes", -1, "max_bytes must be >= 0, got -1"),
        ("min_tokens", "64", "min_tokens must be an integer, got '64'"),
        ("shared_prefix_record_limit", True, "shared_prefix_record_limit must be an integer"),
        ("mode", "lookup", "mode must be one of 'disabled', 'auto', 'record', 'lookup-record'"),
        ("payload", 3, "payload must be one of"),
    ],
)
def test_kv_cache_rejects_bad_values(field: str, value: object, message: str) -> None:
    """Each bad cache setting is a ConfigError naming the field and the value."""
    with pytest.raises(ConfigError, match=message):
        KvCacheConfig(**{field: value})  # type: ignore[arg-type]


def test_max_entries_is_not_clamped_to_512() -> None:
    """Unlike the upstream, a large max_entries is kept as given."""
    assert KvCacheConfig(max_entries=100_000).max_entries == 100_000


def test_stage_config_from_mapping_with_kv_cache_table() -> None:
    """A mapping with a nested kv_cache table builds frozen configs with enum fields."""
    cfg = StageConfig.from_mapping(
        {
            "stage_id": "stage-0",
            "model_id": "org/model:Q4_K_M",
            "layer_start": 0,
            "layer_end": 4,
            "load_mode": "runtime-slice",
            "flash_attn": "enabled",
            "kv_cache": {"mode": "lookup-record", "min_tokens": 256},
        }
    )
    assert cfg.load_mode is LoadMode.RUNTIME_SLICE
    assert cfg.flash_attn is FlashAttention.ENABLED
    assert cfg.kv_cache == KvCacheConfig(mode=CacheMode.LOOKUP_RECORD, min_tokens=256)
    assert attrs.evolve(cfg, stage_index=3).stage_index == 3
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        cfg.stage_id = "x"  # type: ignore[misc]


BASE = {"stage_id": "s", "model_id": "m", "layer_start": 0, "layer_end": 4}


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"bogus": 1}, "unknown field bogus"),
        ({"layer_end": -1}, "layer_end must be >= 0, got -1"),
        ({"layer_start": 5}, r"layer_end must be > layer_start \(5\), got 4"),
        ({"layer_start": 4}, r"layer_end must be > layer_start \(4\), got 4"),
        ({"stage_id": ""}, "stage_id must be a non-empty string, got ''"),
        ({"stage_id": "a\nb"}, r"stage_id must not hold control characters, got '\\n' at index 1"),
        ({"model_id": "m\x1b[2J"}, "model_id must not hold control characters"),
        ({"topology_id": "t\r"}, "topology_id must not hold control characters"),
        ({"run_id": 5}, "run_id must be a string, got 5"),
        ({"kv_unified": "yes"}, "kv_unified must be true, false or absent, got 'yes'"),
        ({"kv_cache": {"max_entries": 0}}, "kv_cache.max_entries must be >= 1, got 0"),
        ({"kv_cache": {"strde": 1}}, "unknown field kv_cache.strde"),
        ({"kv_cache": 5}, "kv_cache must be a table of cache settings or absent, got 5"),
        ({"load_mode": "mmap"}, "load_mode must be one of"),
        ({1: 2}, r"^unknown field 1 \(known fields: "),
        ({"kv_cache": {None: 1}}, r"^unknown field kv_cache.None \(known fields: "),
    ],
)
def test_stage_config_errors_name_field_and_value(changes: dict[str, object], message: str) -> None:
    """Bad keys and values are ConfigErrors naming the field (with its table) and value."""
    with pytest.raises(ConfigError, match=message):
        StageConfig.from_mapping({**BASE, **changes})


def test_stage_config_requires_identity_fields() -> None:
    """A missing required key is named."""
    with pytest.raises(ConfigError, match="missing required field model_id"):
        StageConfig.from_mapping({"stage_id": "s", "layer_start": 0, "layer_end": 1})


def test_a_json_key_given_twice_is_refused_with_its_key_path(tmp_path: Path) -> None:
    """JSON keeps the last of two equal keys silently (TOML refuses them): a second kv_cache
    object would drop the first one's mode and leave the cache off. Refused, naming the key."""
    path = tmp_path / "dup.json"
    path.write_text(
        '{"stage_id": "a", "model_id": "m", "layer_start": 0, "layer_end": 4,\n'
        '"kv_cache": {"mode": "record"},\n"kv_cache": {"max_entries": 3}}'
    )
    with pytest.raises(ConfigError, match=r"dup\.json: key kv_cache appears twice in one object"):
        StageConfig.load(path)
    nested = tmp_path / "nested.json"
    nested.write_text(
        '{"stage_id": "a", "model_id": "m", "layer_start": 0, "layer_end": 4,\n'
        '"kv_cache": {"mode": "record", "max_entries": 3, "mode": "auto"}}'
    )
    with pytest.raises(ConfigError, match=r"nested\.json: key kv_cache\.mode appears twice"):
        StageConfig.load(nested)


@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("deep.toml", 'stage_id = "a"\nmodel_id = ' + "[" * 600 + "]" * 600 + "\n"),
        ("deep.json", '{"model_id": ' + "[" * 100_000 + "]" * 100_000 + "}"),
    ],
)
def test_values_nested_too_deeply_are_config_errors(tmp_path: Path, name: str, text: str) -> None:
    """The parsers recurse per level: a deep value is a ConfigError, not a RecursionError."""
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ConfigError, match="nested too deeply"):
        StageConfig.load(path)


def test_load_toml_and_json_agree(tmp_path: Path) -> None:
    """The same stage written as TOML and JSON loads to equal configs."""
    toml = tmp_path / "stage.toml"
    toml.write_text(
        'stage_id = "stage-0"\nmodel_id = "m"\nlayer_start = 0\nlayer_end = 4\n'
        'ctx_size = 8192\n[kv_cache]\nmode = "lookup-record"\nmax_entries = 8\n'
    )
    as_json = tmp_path / "stage.json"
    as_json.write_text(
        json.dumps(
            {
                "stage_id": "stage-0",
                "model_id": "m",
                "layer_start": 0,
                "layer_end": 4,
                "ctx_size": 8192,
                "kv_cache": {"mode": "lookup-record", "max_entries": 8},
            }
        )
    )
    from_toml = StageConfig.load(toml)
    assert from_toml == StageConfig.load(as_json)
    assert from_toml.kv_cache is not None
    assert from_toml.kv_cache.max_entries == 8


def test_file_errors_name_the_file(tmp_path: Path) -> None:
    """Errors from a file start with its path and name the field and value."""
    path = tmp_path / "bad.toml"
    path.write_text('stage_id = "s"\nmodel_id = "m"\nlayer_start = 0\nlayer_end = 4\n')
    path.write_text(path.read_text() + "[kv_cache]\nmax_entries = 0\n")
    expected = f"^{re.escape(str(path))}: line 6: kv_cache.max_entries must be >= 1, got 0$"
    with pytest.raises(ConfigError, match=expected):
        StageConfig.from_toml(path)
    broken = tmp_path / "broken.json"
    broken.write_text("{")
    with pytest.raises(ConfigError, match=f"^{re.escape(str(broken))}: invalid JSON"):
        StageConfig.from_json(broken)
    with pytest.raises(ConfigError, match="cannot read config file"):
        StageConfig.from_toml(tmp_path / "missing.toml")
    with pytest.raises(ConfigError, match=re.escape("suffix must be .toml or .json, got '.yaml'")):
        StageConfig.load(tmp_path / "x.yaml")
    listed = tmp_path / "list.json"
    listed.write_text("[]")
    with pytest.raises(ConfigError, match="config must be a JSON object, got list"):
        StageConfig.from_json(listed)


TOML_BASE = 'stage_id = "s"\nmodel_id = "m"\nlayer_start = 0\nlayer_end = 4\n'


@pytest.mark.parametrize(
    ("suffix", "text", "message"),
    [
        # parse errors: the parser's line (and column) follow the file name
        (
            ".toml",
            TOML_BASE + "ctx_size = \n",
            r"invalid TOML: Invalid value \(at line 5, column 12\)",
        ),
        (
            ".toml",
            TOML_BASE + "ctx_size = 1\nctx_size = 2\n",
            r"invalid TOML: Cannot overwrite a value \(at line 6, column 13\)",
        ),
        (".json", '{\n "stage_id": "s",\n}', r"invalid JSON: .*: line 3 column 1 \(char 20\)"),
        # bad values: the key path of the field (with its table) and the value
        (".toml", TOML_BASE + "ctx_size = 0\n", "ctx_size must be >= 1, got 0$"),
        (
            ".toml",
            TOML_BASE + 'flash_attn = "fast"\n',
            "flash_attn must be one of .*got 'fast'$",
        ),
        (
            ".toml",
            TOML_BASE + "kv_cache = 5\n",
            "kv_cache must be a table of cache settings",
        ),
        (".toml", TOML_BASE + "[kv_cache]\nstride = 1\n", "unknown field kv_cache.stride "),
        (
            ".toml",  # a dotted key
            TOML_BASE + 'kv_cache.mode = "lookup-record"\nkv_cache.min_tokens = -1\n',
            "kv_cache.min_tokens must be >= 0, got -1$",
        ),
        (
            ".toml",  # an inline table
            TOML_BASE + "ctx_size = 8\nkv_cache = { mode = 'auto', max_entries = 0 }\n",
            "kv_cache.max_entries must be >= 1, got 0$",
        ),
        (
            ".toml",  # a rule between two fields: the field it names
            'stage_id = "s"\nmodel_id = "m"\nlayer_start = 4\nlayer_end = 2\n',
            r"layer_end must be > layer_start \(4\), got 2$",
        ),
        (
            ".toml",  # nothing to point at
            'stage_id = "s"\nlayer_start = 0\nlayer_end = 1\n',
            "missing required field model_id$",
        ),
        (
            ".json",
            '{"stage_id": "s", "model_id": "m", "layer_start": 0, "layer_end": 4, '
            '"kv_cache": {"mode": "lookup-record", "min_tokens": -3}}',
            "kv_cache.min_tokens must be >= 0, got -3$",
        ),
        (
            ".json",  # a key inside a table, on its own line
            '{\n "stage_id": "s",\n "model_id": "m",\n "layer_start": 0,\n "layer_end": 4,\n'
            ' "kv_cache": {\n  "mode": "lookup-record",\n  "max_entries": 0\n }\n}\n',
            "kv_cache.max_entries must be >= 1, got 0$",
        ),
        (
            ".json",
            '{"stage_id": "s", "model_id": "m", "layer_start": 0, "layer_end": true}',
            "layer_end must be an integer, got True$",
        ),
        # integers too long for int(): the parsers raise a bare ValueError, saying not where
        (".toml", TOML_BASE + "ctx_size = " + "9" * 5000 + "\n", "an integer of more than 4300 "),
        (".json", '{\n "ctx_size": ' + "9" * 4400 + "\n}", "an integer of more than 4300 digits"),
    ],
)
def test_file_errors_name_file_and_key_path(
    tmp_path: Path, suffix: str, text: str, message: str
) -> None:
    """Every error from a file starts with its path, then the parser's line for a syntax error,
    or the key path of a bad value or an unknown field (after the line the key is on: see
    test_config_lines)."""
    path = tmp_path / f"stage{suffix}"
    path.write_text(text, encoding="utf-8")
    line = r"(line \d+: )?"
    with pytest.raises(ConfigError, match=f"^{re.escape(str(path))}: {line}{message}"):
        StageConfig.load(path)


@pytest.mark.parametrize("suffix", [".toml", ".json"])
def test_non_utf8_file_is_a_config_error_naming_file_and_line(tmp_path: Path, suffix: str) -> None:
    """A byte that is not UTF-8 is a ConfigError (not a UnicodeDecodeError) with its line."""
    path = tmp_path / f"stage{suffix}"
    body = (
        b'stage_id = "s"\nmodel_id = "\xff"\n' if suffix == ".toml" else b'{\n"model_id": "\xff"}'
    )
    path.write_bytes(body)
    expected = f"^{re.escape(str(path))}: line 2: config file must be UTF-8, got byte 0xff$"
    with pytest.raises(ConfigError, match=expected):
        StageConfig.load(path)


def test_a_directory_is_a_config_error_naming_it(tmp_path: Path) -> None:
    """A path that cannot be read as a file names itself and the reason."""
    folder = tmp_path / "dir.toml"
    folder.mkdir()
    with pytest.raises(ConfigError, match=f"^{re.escape(str(folder))}: cannot read config file"):
        StageConfig.load(folder)


def test_message_base_defaults() -> None:
    """A message base needs no arguments; the namespace is chat_template_id."""
    base = MessageBase(session_id="session", chat_template_id="template", seq=1)
    assert base.schema_version == 1
    assert base.tokenizer_id is None
    with pytest.raises(ConfigError, match="seq must be >= 0, got -1"):
        MessageBase(seq=-1)


# --- environment (spec §6.1) ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "mode"),
    [
        ("", CacheMode.AUTO),
        (" Auto ", CacheMode.AUTO),
        ("0", CacheMode.DISABLED),
        ("OFF", CacheMode.DISABLED),
        ("false", CacheMode.DISABLED),
        ("disabled", CacheMode.DISABLED),
        ("disable", CacheMode.DISABLED),
        ("record", CacheMode.RECORD),
        ("1", CacheMode.LOOKUP_RECORD),
        ("on", CacheMode.LOOKUP_RECORD),
        ("true", CacheMode.LOOKUP_RECORD),
        ("lookup_record", CacheMode.LOOKUP_RECORD),
        ("lookuprecord", CacheMode.LOOKUP_RECORD),
        ("exact", CacheMode.LOOKUP_RECORD),
    ],
)
def test_env_mode_values(value: str, mode: CacheMode) -> None:
    """Mode values are trimmed, lowercased and _ becomes -, as upstream."""
    cfg = KvCacheConfig.from_env({"STAGE_RUNTIME_KV_CACHE": value})
    assert cfg is not None
    assert cfg.mode is mode


def test_env_unset_or_unknown_mode_means_no_config() -> None:
    """No mode variable, or an unrecognised value, gives no configuration."""
    assert KvCacheConfig.from_env({}) is None
    assert KvCacheConfig.from_env({"STAGE_RUNTIME_KV_CACHE": "sometimes"}) is None


def test_env_prefix_cache_variable_is_the_fallback() -> None:
    """STAGE_RUNTIME_PREFIX_CACHE is read only when STAGE_RUNTIME_KV_CACHE is unset."""
    only_fallback = KvCacheConfig.from_env({"STAGE_RUNTIME_PREFIX_CACHE": "record"})
    assert only_fallback is not None
    assert only_fallback.mode is CacheMode.RECORD
    both = KvCacheConfig.from_env(
        {"STAGE_RUNTIME_KV_CACHE": "on", "STAGE_RUNTIME_PREFIX_CACHE": "record"}
    )
    assert both is not None
    assert both.mode is CacheMode.LOOKUP_RECORD


def test_env_bounds_and_payload() -> None:
    """Bounds and payload come from their variables; defaults otherwise (effective stride 64)."""
    cfg = KvCacheConfig.from_env(
        {
            "STAGE_RUNTIME_KV_CACHE": "on",
            "STAGE_RUNTIME_KV_CACHE_MAX_ENTRIES": "8",
            "STAGE_RUNTIME_KV_CACHE_MAX_BYTES": "1024",
            "STAGE_RUNTIME_KV_CACHE_MIN_TOKENS": "256",
            "STAGE_RUNTIME_KV_CACHE_SHARED_STRIDE_TOKENS": "32",
            "STAGE_RUNTIME_KV_CACHE_SHARED_RECORD_LIMIT": "0",
            "STAGE_RUNTIME_KV_CACHE_PAYLOAD": "kvrecurrent",
        }
    )
    assert cfg == KvCacheConfig(
        mode=CacheMode.LOOKUP_RECORD,
        payload=CachePayload.KV_RECURRENT,
        max_entries=8,
        max_bytes=1024,
        min_tokens=256,
        shared_prefix_stride_tokens=32,
        shared_prefix_record_limit=0,
    )
    defaults = KvCacheConfig.from_env({"STAGE_RUNTIME_KV_CACHE": "on"})
    assert defaults == KvCacheConfig(mode=CacheMode.LOOKUP_RECORD)


@pytest.mark.parametrize(
    ("value", "payload"),
    [
        ("", CachePayload.AUTO),
        ("auto", CachePayload.AUTO),
        ("resident", CachePayload.RESIDENT_KV),
        ("Resident_KV", CachePayload.RESIDENT_KV),
        ("kv", CachePayload.RESIDENT_KV),
        ("kv-recurrent", CachePayload.KV_RECURRENT),
        ("kvrecurrent", CachePayload.KV_RECURRENT),
        ("full", CachePayload.FULL_STATE),
        (" full-state ", CachePayload.FULL_STATE),
        ("fullstate", CachePayload.FULL_STATE),
    ],
)
def test_env_payload_spellings(value: str, payload: CachePayload) -> None:
    """Spec §6.1: every payload spelling the upstream accepts (trimmed, lowercased, _ -> -)."""
    cfg = KvCacheConfig.from_env(
        {"STAGE_RUNTIME_KV_CACHE": "on", "STAGE_RUNTIME_KV_CACHE_PAYLOAD": value}
    )
    assert cfg is not None
    assert cfg.payload is payload


def test_env_numbers_accept_surrounding_space_and_a_plus_sign() -> None:
    """Values are trimmed; an explicit + is an integer as Rust's parse reads it."""
    cfg = KvCacheConfig.from_env(
        {"STAGE_RUNTIME_KV_CACHE": "on", "STAGE_RUNTIME_KV_CACHE_MIN_TOKENS": " +256 "}
    )
    assert cfg is not None
    assert cfg.min_tokens == 256


def test_env_values_are_trimmed_as_rust_trims_them() -> None:
    """Rust's trim() removes Unicode White_Space (ideographic space included) but not the
    separators U+001C..U+001F, which Python's strip() would also remove."""
    spaced = KvCacheConfig.from_env({"STAGE_RUNTIME_KV_CACHE": "\u3000on\n"})
    assert spaced is not None
    assert spaced.mode is CacheMode.LOOKUP_RECORD
    assert KvCacheConfig.from_env({"STAGE_RUNTIME_KV_CACHE": "on\x1f"}) is None
    assert not kill_switch_engaged({"STAGE_RUNTIME_PREFIX_CACHE": "\x1coff"})
    with pytest.raises(ConfigError, match="MIN_TOKENS must be an integer"):
        KvCacheConfig.from_env(
            {"STAGE_RUNTIME_KV_CACHE": "on", "STAGE_RUNTIME_KV_CACHE_MIN_TOKENS": "256\x1d"}
        )
    with pytest.raises(ConfigError, match="KV_CACHE_INDEX must be one of"):
        KvCacheConfig.from_env(
            {"STAGE_RUNTIME_KV_CACHE": "on", "STAGE_RUNTIME_KV_CACHE_INDEX": "\x1cpaged"}
        )
    paged = KvCacheConfig.from_env(
        {"STAGE_RUNTIME_KV_CACHE": "on", "STAGE_RUNTIME_KV_CACHE_INDEX": "\u3000paged\n"}
    )
    assert paged is not None
    assert paged.index is CacheIndex.PAGED


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("STAGE_RUNTIME_KV_CACHE_MAX_ENTRIES", "eight", "MAX_ENTRIES must be an integer, got 'e"),
        (
            "STAGE_RUNTIME_KV_CACHE_MAX_ENTRIES",
            "0",
            "^STAGE_RUNTIME_KV_CACHE_MAX_ENTRIES must be >= 1, got 0$",
        ),
        (
            "STAGE_RUNTIME_KV_CACHE_MAX_BYTES",
            "-1",
            "^STAGE_RUNTIME_KV_CACHE_MAX_BYTES must be >= 0, got -1$",
        ),
        (
            "STAGE_RUNTIME_KV_CACHE_PAGE_TOKENS",
            "0",
            "^STAGE_RUNTIME_KV_CACHE_PAGE_TOKENS must be >= 1, got 0$",
        ),
        ("STAGE_RUNTIME_KV_CACHE_PAYLOAD", "weights", "PAYLOAD must be one of"),
        (
            "STAGE_RUNTIME_KV_CACHE_MIN_TOKENS",
            "1_000",
            "MIN_TOKENS must be an integer, got '1_000'",
        ),
        (
            "STAGE_RUNTIME_KV_CACHE_MIN_TOKENS",
            "\u0663",
            "MIN_TOKENS must be an integer, got '\u0663'",
        ),
        ("STAGE_RUNTIME_KV_CACHE_SHARED_STRIDE_TOKENS", "1.5", "STRIDE_TOKENS must be an integer"),
        (
            "STAGE_RUNTIME_KV_CACHE_SHARED_RECORD_LIMIT",
            "-2",
            "^STAGE_RUNTIME_KV_CACHE_SHARED_RECORD_LIMIT must be >= 0, got -2$",
        ),
        (
            "STAGE_RUNTIME_KV_CACHE_MAX_BYTES",
            "9" * 5000,
            "^STAGE_RUNTIME_KV_CACHE_MAX_BYTES is out of range: an integer of 5000 digits$",
        ),
        ("STAGE_RUNTIME_KV_CACHE_MAX_BYTES", 64, "^STAGE_RUNTIME_KV_CACHE_MAX_BYTES must be a str"),
        ("STAGE_RUNTIME_KV_CACHE_PAYLOAD", b"kv", "^STAGE_RUNTIME_KV_CACHE_PAYLOAD must be a str"),
    ],
)
def test_env_bad_values_are_named(name: str, value: object, message: str) -> None:
    """A malformed bound or payload variable is a ConfigError naming it."""
    environ: dict[str, Any] = {"STAGE_RUNTIME_KV_CACHE": "on", name: value}
    with pytest.raises(ConfigError, match=message):
        KvCacheConfig.from_env(environ)


@pytest.mark.parametrize(
    ("kv", "prefix", "engaged"),
    [
        (None, None, False),
        ("on", None, False),
        ("off", None, True),
        (None, "off", True),
        ("on", "off", True),
        ("off", "on", True),
    ],
)
def test_kill_switch_vectors(kv: str | None, prefix: str | None, engaged: bool) -> None:
    """Spec §6.1: either variable parsing as disabled turns the cache off."""
    env = {}
    if kv is not None:
        env["STAGE_RUNTIME_KV_CACHE"] = kv
    if prefix is not None:
        env["STAGE_RUNTIME_PREFIX_CACHE"] = prefix
    assert kill_switch_engaged(env) is engaged


@pytest.mark.parametrize("name", ["STAGE_RUNTIME_KV_CACHE", "STAGE_RUNTIME_PREFIX_CACHE"])
def test_a_mode_variable_that_is_not_a_string_is_a_config_error(name: str) -> None:
    """A hand-built environment mapping with a non-string value is named, not an AttributeError."""
    config = StageConfig(stage_id="s", model_id="m", layer_start=0, layer_end=1)
    message = f"^{name} must be a string, got 1$"
    with pytest.raises(ConfigError, match=message):
        kill_switch_engaged({name: 1})  # type: ignore[dict-item]
    with pytest.raises(ConfigError, match=message):
        KvStageIntegration.from_config(config, environ={name: 1})  # type: ignore[dict-item]


@pytest.mark.parametrize("environ", [["STAGE_RUNTIME_KV_CACHE=1"], "STAGE_RUNTIME_KV_CACHE=1", 3])
def test_an_environment_that_is_not_a_mapping_is_a_config_error(environ: Any) -> None:
    name = type(environ).__name__
    pattern = f"environ must be a mapping of variable names to strings, got {name}"
    config = StageConfig(stage_id="s", model_id="m", layer_start=0, layer_end=1)
    with pytest.raises(ConfigError, match=pattern):
        KvCacheConfig.from_env(environ)
    with pytest.raises(ConfigError, match=pattern):
        kill_switch_engaged(environ)
    with pytest.raises(ConfigError, match=pattern):
        KvStageIntegration.from_config(config, environ=environ)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("x" * 300_000, "layer_end must be an integer, got 'xxxxx"),
        ([1] * 100_000, "layer_end must be an integer, got [1, 1,"),
        (10**5000, "layer_end must be <= 4294967295, got an integer of about 5,001 digits"),
    ],
    ids=["string", "list", "integer"],  # (pytest would print the values in test ids)
)
def test_a_huge_bad_value_is_quoted_cut_short(value: object, message: str) -> None:
    """Errors quote at most 80 characters of a bad value (a 300 KB string made a 300 KB
    one-line error), and an integer too long to print is described, not a ValueError."""
    with pytest.raises(ConfigError) as caught:
        StageConfig.from_mapping(
            {"stage_id": "a", "model_id": "m", "layer_start": 0, "layer_end": value}
        )
    assert str(caught.value).startswith(message)
    assert len(str(caught.value)) < 200


def test_a_required_field_written_under_a_table_header_is_pointed_at(tmp_path: Path) -> None:
    """A key after [kv_cache] belongs to kv_cache: the missing field is found there and the
    error says so (it said only 'missing required field layer_end')."""
    path = tmp_path / "stage.toml"
    path.write_text(
        'stage_id = "a"\nmodel_id = "m"\nlayer_start = 0\n[kv_cache]\nmode = "record"\n'
        "layer_end = 4\n"
    )
    with pytest.raises(ConfigError) as caught:
        StageConfig.load(path)
    assert str(caught.value) == (
        f"{path}: missing required field layer_end: it is under kv_cache (in TOML, "
        "the keys after a table's header belong to that table: move layer_end above the "
        "[kv_cache] header)"
    )


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[foo]\nx = 1\n", "line 5: unknown field foo "),
        (
            '[kv_cache]\nmode = "record"\n[kv_cache.extra]\nx = 1\n',
            "line 7: unknown field kv_cache.extra ",
        ),
    ],
)
def test_an_unknown_table_is_named_with_its_key_path(
    tmp_path: Path, text: str, message: str
) -> None:
    """An unknown table is named by its key path, like an unknown key."""
    path = tmp_path / "stage.toml"
    path.write_text('stage_id = "a"\nmodel_id = "m"\nlayer_start = 0\nlayer_end = 4\n' + text)
    with pytest.raises(ConfigError, match=f"^{re.escape(f'{path}: {message}')}"):
        StageConfig.load(path)


def test_a_config_error_pickles_as_a_config_error() -> None:
    """Errors cross process boundaries (Ray placement): unpickled, a loading error is the
    ConfigError users catch, with its message."""
    with pytest.raises(ConfigError) as caught:
        StageConfig.from_mapping({**BASE, "kv_cache": {"max_entries": 0}})
    again = pickle.loads(pickle.dumps(caught.value))
    assert type(again) is ConfigError
    assert str(again) == str(caught.value) == "kv_cache.max_entries must be >= 1, got 0"
