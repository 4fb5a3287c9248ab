"""Prefix identity: the V-E byte stream, page ids, one-pass hashing and token validation."""

from __future__ import annotations

import re
import struct
import sys
from typing import Any

import attrs
import blake3
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stage_runtime import ConfigError, KvCacheConfig, StageConfig
from stage_runtime import identity as identity_module
from stage_runtime.config import FlashAttention, LoadMode
from stage_runtime.identity import (
    PlatformIdentity,
    activation_page_id,
    as_token_array,
    page_id,
    prefix_hash,
    prefix_hashes,
    prefix_namespace_hash,
)

X86 = PlatformIdentity(arch="x86_64", little_endian=True, pointer_width=64)


def config(**changes: object) -> StageConfig:
    """The seed's test_config(): stage-0, layers 0..4, ctx 8192, runtime slice, f16 caches."""
    base = StageConfig(
        run_id="run",
        topology_id="topology",
        model_id="hugging-quants/Llama-3.2-1B-Instruct-GGUF:Q4_K_M",
        stage_id="stage-0",
        stage_index=0,
        layer_start=0,
        layer_end=4,
        ctx_size=8192,
        lane_count=2,
        load_mode=LoadMode.RUNTIME_SLICE,
        kv_cache=KvCacheConfig(mode="lookup-record", payload="resident-kv", max_entries=8),
    )
    return attrs.evolve(base, **changes)  # type: ignore[arg-type]


def reference_stream(
    cfg: StageConfig,
    token_start: int,
    tokens: list[int],
    namespace: str | None,
    platform: PlatformIdentity,
) -> bytes:
    """A second, literal transcription of spec §1.2 (V-E): the exact bytes that are hashed."""

    def present(tag: str, value: str | None) -> str:
        return tag + ("<absent>" if value is None else "=" + value)

    def tri(value: bool | None) -> str:
        return "absent" if value is None else str(value).lower()

    load = {"layer-package": "load:package-", "runtime-slice": "load:runslice"}
    load["artifact-slice"] = "load:artslice"
    fa = {"auto": "fa:auto", "disabled": "fa:offf", "enabled": "fa:onnn"}
    parts = [
        b"kv-weight-identity-v1",
        cfg.model_id.encode(),
        present("manifest:", cfg.manifest_sha256).encode(),
        present("source:", cfg.source_model_sha256).encode(),
        present("package:", cfg.package_ref).encode(),
        load[cfg.load_mode.value].encode(),
        cfg.stage_id.encode(),
        struct.pack("<III", cfg.stage_index, cfg.layer_start, cfg.layer_end),
        b"stage-abi-0.1/native-kv-page-v2",
        struct.pack("<i", 4),
        b"ggml-native-kv",
        b"kv-layout-identity-v1",
        f"{cfg.cache_type_k}/{cfg.cache_type_v}".encode(),
        fa[cfg.flash_attn.value].encode(),
        struct.pack("<i", cfg.n_gpu_layers),
        (cfg.selected_device or "<no-selected-device>").encode(),
        f"kv-unified:{tri(cfg.kv_unified)}swa-full:{tri(cfg.swa_full)}".encode(),
        b"kv-platform-identity-v1",
        platform.arch.encode(),
        b"endian:le" if platform.little_endian else b"endian:be",
        struct.pack("<I", platform.pointer_width),
        f"ctx:{cfg.ctx_size}".encode(),
    ]
    if namespace is not None:
        parts += [b"openai-cache-namespace-v1", namespace.encode()]
    parts.append(struct.pack("<Q", token_start))
    parts.append(struct.pack(f"<{len(tokens)}i", *tokens))
    return b"".join(parts)


def test_prefix_hash_is_blake3_of_the_v_e_byte_stream() -> None:
    """prefix_hash equals BLAKE3 over the literal spec §1.2 stream, rendered blake3:<64 hex>."""
    cfg = config()
    tokens = list(range(300))
    stream = reference_stream(cfg, 0, tokens, "template", X86)
    expected = "blake3:" + blake3.blake3(stream).hexdigest()
    assert prefix_hash(cfg, 0, tokens, "template", platform=X86) == expected
    assert len(expected) == len("blake3:") + 64


def test_prefix_hash_stream_with_every_optional_field_set() -> None:
    """Digests, device, tri-states, flash attention and negative tokens hash as specified."""
    cfg = config(
        manifest_sha256="m" * 8,
        source_model_sha256="s" * 8,
        package_ref="pkg",
        load_mode=LoadMode.LAYER_PACKAGE,
        flash_attn=FlashAttention.DISABLED,
        n_gpu_layers=-1,
        selected_device="CUDA0",
        kv_unified=True,
        swa_full=False,
        stage_index=3,
        layer_start=12,
        layer_end=16,
    )
    tokens = [-5, 0, 2**31 - 1, -(2**31)]
    arm = PlatformIdentity(arch="aarch64", little_endian=False, pointer_width=32)
    stream = reference_stream(cfg, 7, tokens, None, arm)
    assert (
        prefix_hash(cfg, 7, tokens, platform=arm) == "blake3:" + blake3.blake3(stream).hexdigest()
    )


def test_namespace_hash_is_the_stream_without_tokens() -> None:
    """prefix_namespace_hash stops before the tokens; it equals prefix_hash of no tokens."""
    cfg = config()
    stream = reference_stream(cfg, 0, [], "template", X86)
    expected = "blake3:" + blake3.blake3(stream).hexdigest()
    assert prefix_namespace_hash(cfg, 0, "template", platform=X86) == expected
    assert prefix_hash(cfg, 0, [], "template", platform=X86) == expected


def test_current_platform_uses_rust_arch_names(monkeypatch: pytest.MonkeyPatch) -> None:
    """platform.machine() spellings map to Rust target_arch names; byte order and width come
    from the interpreter."""
    machines = [("AMD64", "x86_64"), ("arm64", "aarch64"), ("i686", "x86")]
    machines += [("armv5tel", "arm"), ("mips64el", "mips64"), ("mipsel", "mips")]
    machines += [("aarch64_be", "aarch64")]
    for machine, arch in machines:
        monkeypatch.setattr("platform.machine", lambda m=machine: m)
        identity_module._current_platform.cache_clear()
        current = PlatformIdentity.current()
        assert current.arch == arch
        assert current.pointer_width == struct.calcsize("P") * 8
    # A 32-bit interpreter on a 64-bit kernel is a 32-bit target, as a Rust build for it.
    monkeypatch.setattr("platform.machine", lambda: "x86_64")
    monkeypatch.setattr("struct.calcsize", lambda _format: 4)
    identity_module._current_platform.cache_clear()
    assert PlatformIdentity.current() == PlatformIdentity(
        arch="x86", little_endian=sys.byteorder == "little", pointer_width=32
    )
    # ...but the x32 ABI is Rust's x86_64 with 32-bit pointers.
    monkeypatch.setattr("sysconfig.get_config_var", lambda _name: "x86_64-linux-gnux32")
    identity_module._current_platform.cache_clear()
    assert PlatformIdentity.current().arch == "x86_64"
    monkeypatch.undo()
    identity_module._current_platform.cache_clear()
    assert prefix_hash(config(), 0, [1]) == prefix_hash(
        config(), 0, [1], platform=PlatformIdentity.current()
    )


# --- §9.5 identity properties -------------------------------------------------------------------

CHANGES: list[dict[str, object]] = [
    {"cache_type_k": "q8_0", "cache_type_v": "q8_0"},
    {"cache_type_k": "q8_0"},
    {"cache_type_v": "q8_0"},
    {"flash_attn": FlashAttention.ENABLED},
    {"flash_attn": FlashAttention.DISABLED},
    {"n_gpu_layers": 32},
    {"selected_device": "CUDA0"},
    {"selected_device": "Metal"},
    {"manifest_sha256": "abc"},
    {"manifest_sha256": "absent"},
    {"source_model_sha256": "abc"},
    {"source_model_sha256": "absent"},
    {"package_ref": "pkg"},
    {"package_ref": "absent"},
    {"layer_start": 1},
    {"layer_end": 5},
    {"stage_id": "stage-1"},
    {"stage_index": 1},
    {"kv_unified": False},
    {"kv_unified": True},
    {"swa_full": False},
    {"swa_full": True},
    {"ctx_size": 4096},
    {"model_id": "other/model"},
    {"load_mode": LoadMode.ARTIFACT_SLICE},
]


def test_every_identity_field_changes_the_hash() -> None:
    """Each §9.5 change (and the base config) gives a distinct hash: no two collide."""
    hashes = [prefix_hash(config(), 0, [1, 2, 3], platform=X86)]
    hashes += [prefix_hash(config(**c), 0, [1, 2, 3], platform=X86) for c in CHANGES]
    assert len(set(hashes)) == len(hashes)


def test_platform_arch_endianness_and_pointer_width_change_the_hash() -> None:
    """Caches never alias across platforms."""
    platforms = [
        X86,
        attrs.evolve(X86, arch="aarch64"),
        attrs.evolve(X86, little_endian=False),
        attrs.evolve(X86, pointer_width=32),
    ]
    assert len({prefix_hash(config(), 0, [1], platform=p) for p in platforms}) == 4


def test_start_namespace_and_tokens_change_the_hash() -> None:
    """token_start, the namespace (incl. absent vs empty) and the tokens are all hashed."""
    cfg = config()
    hashes = {
        prefix_hash(cfg, 0, [1, 2], None),
        prefix_hash(cfg, 0, [1, 2], ""),
        prefix_hash(cfg, 0, [1, 2], "template"),
        prefix_hash(cfg, 1, [1, 2], "template"),
        prefix_hash(cfg, 0, [2, 1], "template"),
    }
    assert len(hashes) == 5


def test_run_topology_and_session_do_not_change_the_hash() -> None:
    """run_id, topology_id and lane_count are not hashed; repeated calls agree."""
    cfg = config()
    h = prefix_hash(cfg, 0, [1, 2, 3], "template")
    assert (
        prefix_hash(
            config(run_id="other", topology_id="t2", lane_count=8), 0, [1, 2, 3], "template"
        )
        == h
    )
    assert prefix_hash(cfg, 0, [1, 2, 3], "template") == h


def test_tokens_hash_the_same_whatever_their_container() -> None:
    """Lists, tuples, int64/uint16/big-endian arrays all hash as little-endian int32."""
    cfg = config()
    values = [0, 1, 65535, 70000]
    h = prefix_hash(cfg, 0, values)
    assert prefix_hash(cfg, 0, tuple(values)) == h
    assert prefix_hash(cfg, 0, np.array(values, dtype=np.int64)) == h
    assert prefix_hash(cfg, 0, np.array(values, dtype=">i4")) == h
    assert prefix_hash(cfg, 0, np.array(values[:3], dtype=np.uint16)) == prefix_hash(
        cfg, 0, values[:3]
    )
    assert prefix_hash(cfg, 0, np.array(values, dtype=np.int32)[::1]) == h


# --- page ids (§1.3) ------------------------------------------------------------------------------


def test_page_id_format() -> None:
    """{stage}:{start}:{count}:{layer_start}:{first 16 hex}; the scheme prefix is stripped."""
    cfg = config(layer_start=8, layer_end=12, stage_id="stage-2")
    digest = "0123456789abcdef" + "f" * 48
    assert page_id(cfg, 5, 300, "blake3:" + digest) == "stage-2:5:300:8:0123456789abcdef"
    assert page_id(cfg, 0, 1, "sha256:" + digest) == "stage-2:0:1:8:0123456789abcdef"
    assert page_id(cfg, 0, 1, "blake3:abc") == "stage-2:0:1:8:abc"


def test_activation_page_id_includes_width_and_clamps_negative() -> None:
    """act:{page_id}:w{max(width, 0)}; widths never alias."""
    assert activation_page_id("p", 4096) == "act:p:w4096"
    assert activation_page_id("p", -3) == "act:p:w0"
    assert activation_page_id("p", 4096) != activation_page_id("p", 8192)


H = "blake3:" + "a" * 64


@pytest.mark.parametrize(
    ("builder", "args", "message"),
    [
        (page_id, ("cfg", 0, 1, H), "config must be a StageConfig, got str"),
        (page_id, (None, -1, 1, H), "token_start must be an integer >= 0, got -1"),
        (page_id, (None, 0, 1.0, H), "token_count must be an integer >= 0, got 1.0"),
        (page_id, (None, 0, True, H), "token_count must be an integer >= 0, got True"),
        (page_id, (None, 0, 1, None), "prefix_hash must be a string, got None"),
        (activation_page_id, (None, 4096), "page_id must be a string, got None"),
        (activation_page_id, ("p", True), "width must be an integer, got True"),
        (activation_page_id, ("p", "4096"), "width must be an integer, got '4096'"),
    ],
)
def test_key_builders_refuse_bad_arguments(
    builder: Any, args: tuple[Any, ...], message: str
) -> None:
    """A bad argument is a ConfigError naming it, never a silent key like ``wTrue``."""
    if builder is page_id and args[0] is None:
        args = (config(), *args[1:])
    with pytest.raises(ConfigError, match=f"^{re.escape(message)}$"):
        builder(*args)


def test_key_builders_take_numpy_integers() -> None:
    """numpy integers format as the plain numbers they hold."""
    cfg = config()
    start: Any = np.uint64(5)
    count: Any = np.int32(300)
    width: Any = np.int64(-2)
    assert page_id(cfg, start, count, H) == page_id(cfg, 5, 300, H)
    assert activation_page_id("p", width) == "act:p:w0"


# --- one pass -----------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    tokens=st.lists(st.integers(-(2**31), 2**31 - 1), max_size=300),
    data=st.data(),
)
def test_one_pass_hashes_equal_independent_hashes(tokens: list[int], data: st.DataObject) -> None:
    """prefix_hashes(..., counts)[k] == prefix_hash(tokens[:k]) for every requested k."""
    cfg = config()
    counts = data.draw(st.lists(st.integers(0, len(tokens)), max_size=12))
    got = prefix_hashes(cfg, 3, tokens, counts, "ns")
    assert set(got) == set(counts)
    for k in counts:
        assert got[k] == prefix_hash(cfg, 3, tokens[:k], "ns")


@settings(max_examples=40, deadline=None)
@given(
    size=st.integers(0, 12_000),
    namespace=st.one_of(st.none(), st.text(max_size=40), st.integers(0, 20_000).map("n".__mul__)),
    data=st.data(),
)
def test_one_pass_hashes_equal_blake3_of_the_stream_across_the_aligned_head(
    size: int, namespace: str | None, data: st.DataObject
) -> None:
    """The first BLAKE3 call takes the prelude and the tokens up to a 16 KiB boundary as one
    buffer: every hash still equals BLAKE3 of the literal stream, for counts before, at and
    after that boundary and preludes of any length (a long namespace puts it past 16 KiB)."""
    cfg = config()
    tokens = np.random.default_rng(size).integers(-(2**31), 2**31 - 1, size, dtype=np.int32)
    head = len(reference_stream(cfg, 5, [], namespace, X86))
    boundary = max(0, min(size, (-head % 16384) // 4))
    near = st.integers(max(0, boundary - 3), min(size, boundary + 3))
    counts = data.draw(st.lists(st.one_of(st.integers(0, size), near), min_size=1, max_size=6))
    got = prefix_hashes(cfg, 5, tokens, counts, namespace, platform=X86)
    for k in counts:
        stream = reference_stream(cfg, 5, tokens[:k].tolist(), namespace, X86)
        assert got[k] == "blake3:" + blake3.blake3(stream).hexdigest()


def test_one_pass_rejects_counts_out_of_range() -> None:
    """A count beyond the tokens is a ConfigError naming it."""
    with pytest.raises(ConfigError, match=r"token_counts must be in \[0, 3\], got 4"):
        prefix_hashes(config(), 0, [1, 2, 3], [2, 4])


# --- token validation -------------------------------------------------------------------------


def test_as_token_array_returns_int32_without_copying_int32_input() -> None:
    """An int32 contiguous array is returned as is."""
    tokens = np.arange(10, dtype=np.int32)
    assert as_token_array(tokens) is tokens
    assert as_token_array(range(3)).tolist() == [0, 1, 2]
    assert as_token_array([]).dtype == np.dtype("<i4")


@pytest.mark.parametrize(
    ("tokens", "message"),
    [
        (
            [1, 2**31],
            r"tokens must be in int32 range \[-2147483648, 2147483647\], got 2147483648 at index 1",
        ),
        (np.array([0, -(2**31) - 1], dtype=np.int64), "got -2147483649 at index 1"),
        (np.array([2**32], dtype=np.uint64), "got 4294967296 at index 0"),
        ([1, 2.5], "tokens must be integers, got 2.5 at index 1"),
        ([True, False], "tokens must be integers, got True at index 0"),
        ([7, True], "tokens must be integers, got True at index 1"),  # numpy would read 1
        ((7, 8, np.False_), f"tokens must be integers, got {np.False_!r} at index 2"),
        (np.zeros((2, 2), dtype=np.int32), r"tokens must be 1-D, got shape \(2, 2\)"),
        ([1, 2**70], "got 1180591620717411303424 at index 1"),
        (["a"], "tokens must be integers, got 'a' at index 0"),
        (None, "tokens must be a sequence of integers, got NoneType"),
        (7, "tokens must be a sequence of integers, got int"),
        ("123", "tokens must be a sequence of integers, got str"),
        ({3, 1, 2}, "tokens must be a sequence of integers, got set"),
        ({1: 2}, "tokens must be a sequence of integers, got dict"),
    ],
)
def test_as_token_array_rejects_bad_tokens(tokens: object, message: str) -> None:
    """Non-integers, out-of-range values and wrong shapes are ConfigErrors naming the value."""
    with pytest.raises(ConfigError, match=message):
        as_token_array(tokens)  # type: ignore[arg-type]


def test_bad_token_start_and_namespace() -> None:
    """token_start must be a u64 and the namespace a string."""
    with pytest.raises(ConfigError, match="token_start must be an integer in"):
        prefix_hash(config(), -1, [1])
    with pytest.raises(ConfigError, match="namespace must be a string or None, got 5"):
        prefix_hash(config(), 0, [1], 5)  # type: ignore[arg-type]
