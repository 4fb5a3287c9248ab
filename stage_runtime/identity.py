"""Prefix identity: the BLAKE3 hash that names a cached prefix, and the keys built from it.

The hash covers everything that makes one stage's activations for a token prefix reusable: the
weights, the stage's layer range, the KV layout, the platform, the context size, the cache
namespace, the start position and the tokens themselves (spec §1.2, version V-E). Session, request
and run ids are deliberately left out, so prompts are shared across sessions.

All identities of a prompt's candidate lengths come from **one pass** over its tokens: one hasher
is fed the tokens in ascending candidate order and read out at each candidate length
(:func:`prefix_hashes`). BLAKE3's digest does not consume the hasher, so reading it at a length is
the same as hashing a ``.copy()`` of it there, without the copy.
"""

from __future__ import annotations

import functools
import platform as _platform
import struct
import sys
import sysconfig
from collections.abc import Iterable, Mapping, Sequence, Set
from typing import Any, Final

import attrs
import blake3
import numpy as np
import numpy.typing as npt

from stage_runtime._validators import check_int, check_non_negative_int, is_int
from stage_runtime.config import FlashAttention, LoadMode, StageConfig
from stage_runtime.errors import ConfigError
from stage_runtime.limits import I32_MAX as _I32_MAX
from stage_runtime.limits import I32_MIN as _I32_MIN
from stage_runtime.limits import U64_MAX as _U64_MAX

__all__ = [
    "RUNTIME_ABI_VERSION",
    "PlatformIdentity",
    "TokenArray",
    "activation_page_id",
    "as_token_array",
    "page_id",
    "prefix_hash",
    "prefix_hashes",
    "prefix_namespace_hash",
]

RUNTIME_ABI_VERSION: Final = "stage-abi-0.1/native-kv-page-v2"
"""ABI string hashed into every identity (the upstream's V-D/V-E value)."""

_HASH_PREFIX: Final = "blake3:"
_LAYOUT_CONSTANT: Final = 4  # the upstream's layer-contiguous page layout, hashed as i32
_KV_DTYPE: Final = "ggml-native-kv"
_TOKEN_DTYPE: Final = np.dtype("<i4")

TokenArray = npt.NDArray[np.int32]
"""A 1-D array of little-endian int32 token ids, as returned by :func:`as_token_array`."""

_LOAD_MODE_TAGS: Final = {
    LoadMode.LAYER_PACKAGE: "load:package-",
    LoadMode.RUNTIME_SLICE: "load:runslice",
    LoadMode.ARTIFACT_SLICE: "load:artslice",
}
# Fixed-width tags, as upstream ("offf"/"onnn" keep all three the same length).
_FLASH_TAGS: Final = {
    FlashAttention.AUTO: "fa:auto",
    FlashAttention.DISABLED: "fa:offf",
    FlashAttention.ENABLED: "fa:onnn",
}

# platform.machine() spellings mapped to the Rust target_arch names the upstream hashes.
_RUST_ARCH: Final = {
    "x86_64": "x86_64",
    "amd64": "x86_64",
    "x64": "x86_64",
    "i386": "x86",
    "i486": "x86",
    "i586": "x86",
    "i686": "x86",
    "x86": "x86",
    "aarch64": "aarch64",
    "arm64": "aarch64",
    "armv6l": "arm",
    "armv7l": "arm",
    "armv8l": "arm",
    "arm": "arm",
    "ppc64le": "powerpc64",
    "ppc64": "powerpc64",
    "ppc": "powerpc",
    "s390x": "s390x",
    "riscv64": "riscv64",
    "loongarch64": "loongarch64",
    "mips64": "mips64",
    "mips64el": "mips64",
    "mips": "mips",
    "mipsel": "mips",
    "armv5tel": "arm",
    "armv5tejl": "arm",
    "armv7": "arm",
    "aarch64_be": "aarch64",
    "i86pc": "x86_64",
    "sparc64": "sparc64",
    "wasm32": "wasm32",
}

_RUST_ARCH_32: Final = {"x86_64": "x86", "aarch64": "arm", "powerpc64": "powerpc"}
"""A 32-bit interpreter on a 64-bit kernel reports the kernel's machine; the interpreter's
target (what a Rust build for it would name) is the 32-bit architecture."""


@attrs.frozen(kw_only=True)
class PlatformIdentity:
    """The platform part of the identity: caches never alias across ABIs (spec §1.2 step 5)."""

    arch: str
    """Rust ``target_arch`` name, such as ``"x86_64"`` or ``"aarch64"``."""

    little_endian: bool
    """Byte order of the host."""

    pointer_width: int
    """Pointer width in bits (32 or 64)."""

    @classmethod
    def current(cls) -> PlatformIdentity:
        """The identity of the running interpreter's platform."""
        return _current_platform()


@functools.cache
def _current_platform() -> PlatformIdentity:
    machine = _platform.machine().lower()
    arch = _RUST_ARCH.get(machine, machine)
    pointer_width = struct.calcsize("P") * 8
    # ...unless it is a 32-bit ABI of the 64-bit architecture (x32, ILP32): same target_arch.
    multiarch = str(sysconfig.get_config_var("MULTIARCH") or "")
    if pointer_width == 32 and not multiarch.endswith(("x32", "ilp32")):
        arch = _RUST_ARCH_32.get(arch, arch)
    return PlatformIdentity(
        arch=arch, little_endian=sys.byteorder == "little", pointer_width=pointer_width
    )


# --------------------------------------------------------------------------------------------
# tokens


def _frozen(array: npt.NDArray[Any]) -> bool:
    """Whether nobody can change ``array``'s elements: it is read-only and owns its memory (a
    view could see its base changed). What the pipeline hands every stage is frozen; the cache
    keeps, hashes and puts in messages a frozen array as it is, and copies any other."""
    return not array.flags.writeable and array.base is None


def as_token_array(tokens: Sequence[int] | npt.NDArray[np.integer] | Iterable[int]) -> TokenArray:
    """Validate token ids once and return them as a 1-D little-endian int32 array.

    An int32 array that is already contiguous is returned as is (no copy); anything else is
    converted once.

    Args:
        tokens: Any sequence (or iterator) of Python ints or a 1-D integer numpy array; not a
            string, set or mapping.

    Raises:
        ConfigError: tokens are not a sequence, not 1-D, not integers, or outside the int32
            range; the message names the first offending index and value.
    """
    original: Sequence[object] | None = None
    if isinstance(tokens, np.ndarray):
        array: npt.NDArray[Any] = tokens
    else:
        if isinstance(tokens, str | bytes | bytearray | Set | Mapping) or not isinstance(
            tokens, Iterable
        ):
            msg = f"tokens must be a sequence of integers, got {type(tokens).__name__}"
            raise ConfigError(msg)
        if not isinstance(tokens, Sequence):
            tokens = list(tokens)
        if len(tokens) == 0:
            return np.zeros(0, dtype=_TOKEN_DTYPE)
        original = tokens
        try:
            array = np.asarray(tokens)
        except (ValueError, TypeError, OverflowError) as exc:
            msg = f"tokens must be a flat sequence of integers: {exc}"
            raise ConfigError(msg) from None
    if array.ndim != 1:
        msg = f"tokens must be 1-D, got shape {array.shape}"
        raise ConfigError(msg)
    if array.dtype.kind not in "iu":
        if array.size == 0:
            return np.zeros(0, dtype=_TOKEN_DTYPE)
        _raise_first_bad_token(array.tolist() if original is None else original, array.dtype)
    if original is not None and not _NOT_TOKENS.isdisjoint(map(type, original)):
        # numpy reads True and False among ints as 1 and 0; all-bool input is refused above.
        _raise_first_bad_token(original, array.dtype)
    if array.dtype == _TOKEN_DTYPE:
        return np.ascontiguousarray(array)
    if array.size and (array.dtype.itemsize > 4 or array.dtype.kind == "u"):
        out_of_range = (array < _I32_MIN) | (array > _I32_MAX)
        if out_of_range.any():
            bad = int(np.flatnonzero(out_of_range)[0])
            msg = (
                f"tokens must be in int32 range [{_I32_MIN}, {_I32_MAX}], "
                f"got {int(array[bad])} at index {bad}"
            )
            raise ConfigError(msg)
    return np.ascontiguousarray(array, dtype=_TOKEN_DTYPE)


_NOT_TOKENS: Final = frozenset({bool, np.bool_})
"""Element types numpy converts to integers that are not token ids."""


def _raise_first_bad_token(values: Sequence[object], dtype: np.dtype[Any]) -> None:
    """Raise the ConfigError naming the first token that is not an int32 integer."""
    for index, value in enumerate(values):
        if not is_int(value, numpy=True):
            msg = f"tokens must be integers, got {value!r} at index {index} (dtype {dtype})"
            raise ConfigError(msg)
        if not _I32_MIN <= int(value) <= _I32_MAX:
            msg = (
                f"tokens must be in int32 range [{_I32_MIN}, {_I32_MAX}], "
                f"got {value} at index {index}"
            )
            raise ConfigError(msg)
    # Integers in range but an object array (e.g. Python ints too mixed for numpy): convert.
    msg = f"tokens must be an integer array, got dtype {dtype}"
    raise ConfigError(msg)


# --------------------------------------------------------------------------------------------
# the byte stream (spec §1.2, V-E)


def _u32(value: int) -> bytes:
    return value.to_bytes(4, "little")


def _i32(value: int) -> bytes:
    return value.to_bytes(4, "little", signed=True)


def _u64(value: int) -> bytes:
    return value.to_bytes(8, "little")


def _tri_state(value: bool | None) -> bytes:
    return b"absent" if value is None else (b"true" if value else b"false")


def _check_token_start(token_start: int) -> int:
    return check_int("token_start", token_start, low=0, high=_U64_MAX, numpy=True)


def _check_namespace(namespace: str | None) -> None:
    if namespace is not None and not isinstance(namespace, str):
        msg = f"namespace must be a string or None, got {namespace!r}"
        raise ConfigError(msg)


@functools.lru_cache(maxsize=512)
def _namespace_prelude(
    config: StageConfig, token_start: int, namespace: str | None, platform: PlatformIdentity
) -> bytes:
    """Everything the hash covers before the tokens, as the bytes it hashes."""
    parts: list[bytes] = []
    put = parts.append
    # 1. weight identity
    put(b"kv-weight-identity-v1")
    put(config.model_id.encode())
    for tag, value in (
        (b"manifest:", config.manifest_sha256),
        (b"source:", config.source_model_sha256),
        (b"package:", config.package_ref),
    ):
        put(tag)
        put(b"<absent>" if value is None else b"=" + value.encode())
    put(_LOAD_MODE_TAGS[config.load_mode].encode())
    # 2. stage
    put(config.stage_id.encode())
    put(_u32(config.stage_index))
    put(_u32(config.layer_start))
    put(_u32(config.layer_end))
    # 3. page ABI
    put(RUNTIME_ABI_VERSION.encode())
    put(_i32(_LAYOUT_CONSTANT))
    put(_KV_DTYPE.encode())
    # 4. KV layout
    put(b"kv-layout-identity-v1")
    put(config.cache_type_k.encode())
    put(b"/")
    put(config.cache_type_v.encode())
    put(_FLASH_TAGS[config.flash_attn].encode())
    put(_i32(config.n_gpu_layers))
    device = config.selected_device
    put(b"<no-selected-device>" if device is None else device.encode())
    put(b"kv-unified:" + _tri_state(config.kv_unified))
    put(b"swa-full:" + _tri_state(config.swa_full))
    # 5. platform
    put(b"kv-platform-identity-v1")
    put(platform.arch.encode())
    put(b"endian:le" if platform.little_endian else b"endian:be")
    put(_u32(platform.pointer_width))
    # 6. context, 7. namespace, 8. start position
    put(f"ctx:{config.ctx_size}".encode())
    if namespace is not None:
        put(b"openai-cache-namespace-v1")
        put(namespace.encode())
    put(_u64(token_start))
    return b"".join(parts)


def _prelude(
    config: StageConfig,
    token_start: int,
    namespace: str | None,
    platform: PlatformIdentity | None,
) -> bytes:
    """:func:`_namespace_prelude` of checked arguments (the running platform when None)."""
    if not isinstance(config, StageConfig):
        msg = f"config must be a StageConfig, got {type(config).__name__}"
        raise ConfigError(msg)
    _check_namespace(namespace)
    start = _check_token_start(token_start)
    return _namespace_prelude(config, start, namespace, platform or _current_platform())


def prefix_namespace_hash(
    config: StageConfig,
    token_start: int,
    namespace: str | None = None,
    *,
    platform: PlatformIdentity | None = None,
) -> str:
    """Hash of everything but the tokens: the namespace a family of prefixes lives in.

    Args:
        config: The stage whose identity is hashed.
        token_start: Position of the first token.
        namespace: Cache namespace (``MessageBase.chat_template_id``), or None.
        platform: Platform identity to hash; the running platform when None.

    Returns:
        ``"blake3:"`` followed by 64 lowercase hex digits.
    """
    return (
        _HASH_PREFIX + blake3.blake3(_prelude(config, token_start, namespace, platform)).hexdigest()
    )


def prefix_hash(
    config: StageConfig,
    token_start: int,
    tokens: Sequence[int] | npt.NDArray[np.integer],
    namespace: str | None = None,
    *,
    platform: PlatformIdentity | None = None,
) -> str:
    """The identity of a token prefix on a stage (spec §1.2, V-E byte stream).

    Args:
        config: The stage whose identity is hashed.
        token_start: Position of the first token.
        tokens: The prefix's token ids (hashed as little-endian int32).
        namespace: Cache namespace (``MessageBase.chat_template_id``), or None.
        platform: Platform identity to hash; the running platform when None.

    Returns:
        ``"blake3:"`` followed by 64 lowercase hex digits.

    Raises:
        ConfigError: bad tokens, token_start or namespace.
    """
    array = as_token_array(tokens)
    prelude = _prelude(config, token_start, namespace, platform)
    return _hash_counts(prelude, array.data.cast("B"), [int(array.size)])[int(array.size)]


def prefix_hashes(
    config: StageConfig,
    token_start: int,
    tokens: Sequence[int] | npt.NDArray[np.integer],
    token_counts: Iterable[int],
    namespace: str | None = None,
    *,
    platform: PlatformIdentity | None = None,
) -> dict[int, str]:
    """The identities of several prefixes of ``tokens``, in one pass over the tokens.

    One hasher is fed the tokens in ascending order of ``token_counts`` and read out at each
    count, so the cost is one hash of ``max(token_counts)`` tokens plus one finalisation per
    count, not one pass per count. ``prefix_hashes(c, s, t, [k])[k] == prefix_hash(c, s, t[:k])``.

    Args:
        config: The stage whose identity is hashed.
        token_start: Position of the first token.
        tokens: The token ids.
        token_counts: Prefix lengths, each in ``[0, len(tokens)]``, in any order.
        namespace: Cache namespace, or None.
        platform: Platform identity to hash; the running platform when None.

    Returns:
        A mapping from each distinct count to its ``"blake3:..."`` hash.

    Raises:
        ConfigError: bad tokens, token_start, namespace, or a count out of range.
    """
    array = as_token_array(tokens)
    counts = sorted(set(token_counts))
    if counts and (counts[0] < 0 or counts[-1] > array.size):
        bad = counts[0] if counts[0] < 0 else counts[-1]
        msg = f"token_counts must be in [0, {array.size}], got {bad}"
        raise ConfigError(msg)
    prelude = _prelude(config, token_start, namespace, platform)
    return _hash_counts(prelude, array.data.cast("B"), counts)


_ALIGNED_HEAD: Final = 16 * 1024
"""Where the first call of :func:`_hash_counts` ends in the byte stream (or the first count, if
sooner): 16 BLAKE3 chunks, the most one SIMD pass hashes at once (AVX-512). BLAKE3 hashes
large inputs many chunks at a time, but only in subtrees aligned in the stream; tokens fed after
a prelude that ends inside the first chunk start misaligned, and the next few subtrees are cut
to 1, 2, 4 and 8 chunks. Hashing the prelude and the first tokens as one buffer up to the
boundary avoids that (``unaligned_over_once`` in ``benchmarks/bench_identity.py``)."""


def _hash_counts(
    prelude: bytes, data: memoryview, counts: list[int], into: dict[int, str] | None = None
) -> dict[int, str]:
    """Hash ``prelude`` then ``data`` (int32 bytes) up to each ascending count and read the
    digest out there; returns the hashes by count (added to ``into`` when given)."""
    hashes: dict[int, str] = {} if into is None else into
    if not counts:
        return hashes
    # The prelude and the tokens up to the aligned boundary (or the first count) in one buffer.
    done = min(-len(prelude) % _ALIGNED_HEAD, counts[0] * 4)
    h = blake3.blake3(prelude + data[:done])
    update, digest = h.update, h.digest  # the hot loop: one update and one digest per count
    for count in counts:
        end = count * 4
        if end > done:
            update(data[done:end])
            done = end
        hashes[count] = _HASH_PREFIX + digest().hex()
    return hashes


# --------------------------------------------------------------------------------------------
# keys (spec §1.3)


def page_id(config: StageConfig, token_start: int, token_count: int, prefix_hash: str) -> str:
    """The page id of a prefix: ``"{stage}:{start}:{count}:{layer_start}:{digest[:16]}"``.

    The ``"blake3:"`` (or legacy ``"sha256:"``) prefix is stripped before taking the first 16
    hex digits; a shorter digest is used whole.

    Raises:
        ConfigError: ``config`` is not a StageConfig, a count is not an integer >= 0, or
            ``prefix_hash`` is not a string.
    """
    if not isinstance(config, StageConfig):
        msg = f"config must be a StageConfig, got {type(config).__name__}"
        raise ConfigError(msg)
    token_start = _key_count("token_start", token_start)
    token_count = _key_count("token_count", token_count)
    if not isinstance(prefix_hash, str):
        msg = f"prefix_hash must be a string, got {prefix_hash!r}"
        raise ConfigError(msg)
    if prefix_hash.startswith(("blake3:", "sha256:")):  # both schemes are 7 characters
        digest = prefix_hash[7:23]
    else:
        digest = prefix_hash[:16]
    return f"{config.stage_id}:{token_start}:{token_count}:{config.layer_start}:{digest}"


def activation_page_id(page_id: str, width: int) -> str:
    """The activation cache key of a page at an activation width: ``"act:{page_id}:w{width}"``.

    Negative widths become ``w0``, as upstream. Different widths never alias.

    Raises:
        ConfigError: ``page_id`` is not a string or ``width`` is not an integer.
    """
    if not isinstance(page_id, str):
        msg = f"page_id must be a string, got {page_id!r}"
        raise ConfigError(msg)
    if not is_int(width, numpy=True):
        msg = f"width must be an integer, got {width!r}"
        raise ConfigError(msg)
    return f"act:{page_id}:w{max(int(width), 0)}"


def _key_count(name: str, value: object) -> int:
    if type(value) is int and value >= 0:  # the usual case, decided at once
        return value
    return check_non_negative_int(name, value, numpy=True)
