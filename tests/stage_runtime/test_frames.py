"""Activation frames: construction, validation, zero-copy prefixes, virtual payloads, concat."""

from __future__ import annotations

import pickle
import re
from typing import Any

import attrs
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stage_runtime import (
    ActivationDesc,
    ActivationDType,
    ActivationFrame,
    ActivationLayout,
    FrameError,
)
from stage_runtime.frames import _DESC_FIELDS, _FILL_BYTES, _desc_with_counts, _virtual_payload


def byte_frame(token_count: int, payload_bytes: int, *, flags: int = 0) -> ActivationFrame:
    """The upstream tests' frame: F32, token-major, layers 0..4, payload of 7s."""
    desc = ActivationDesc(
        dtype=ActivationDType.F32,
        layout=ActivationLayout.TOKEN_MAJOR,
        layer_end=4,
        token_count=token_count,
        payload_bytes=payload_bytes,
        flags=flags,
    )
    return ActivationFrame(desc=desc, payload=np.full(payload_bytes, 7, dtype=np.uint8))


def test_desc_defaults_match_upstream() -> None:
    """version 1, sequence_count 1, flags 0 unless given."""
    desc = ActivationDesc(
        dtype=ActivationDType.F16, layout=ActivationLayout.OPAQUE, token_count=3, payload_bytes=6
    )
    assert (desc.version, desc.sequence_count, desc.flags) == (1, 1, 0)
    assert desc.dtype is ActivationDType.F16
    assert int(ActivationDType.BF16) == 3
    assert int(ActivationLayout.TOKEN_MAJOR) == 1


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"token_count": -1}, "token_count must be an integer in [0, 4,294,967,295], got -1"),
        (
            {"token_count": 2**32},
            "token_count must be an integer in [0, 4,294,967,295], got 4294967296",
        ),
        (
            {"payload_bytes": 1.5},
            "payload_bytes must be an integer in [0, 18,446,744,073,709,551,615], got 1.5",
        ),
        ({"flags": True}, "flags must be an integer in [0, 18,446,744,073,709,551,615], got True"),
        ({"dtype": 9}, "dtype must be one of [0, 1, 2, 3], got 9"),
        ({"layout": "rows"}, "layout must be one of [0, 1], got 'rows'"),
        ({"dtype": 1.0}, "dtype must be one of [0, 1, 2, 3], got 1.0"),
        ({"layout": 1.0}, "layout must be one of [0, 1], got 1.0"),
        ({"dtype": "1"}, "dtype must be one of [0, 1, 2, 3], got '1'"),
    ],
)
def test_desc_rejects_bad_fields(changes: dict[str, object], message: str) -> None:
    """Each descriptor field is range-checked with a FrameError naming field and value."""
    fields: dict[str, object] = {
        "dtype": 1,
        "layout": 1,
        "token_count": 1,
        "payload_bytes": 4,
    }
    fields.update(changes)
    with pytest.raises(FrameError, match=f"^{re.escape(message)}$"):
        ActivationDesc(**fields)  # type: ignore[arg-type]


def test_desc_takes_codes_as_members_ints_or_numpy_ints() -> None:
    """A code given as a member, an int or a numpy integer is the member (what a decoded
    wire frame holds); a float equal to a code (1.0) was once taken as one and is not."""
    for dtype in (ActivationDType.F16, 2, np.int64(2), np.uint8(2)):
        desc = ActivationDesc(dtype=dtype, layout=1, token_count=1, payload_bytes=2)
        assert desc.dtype is ActivationDType.F16


def test_frame_rejects_payload_size_mismatch() -> None:
    """payload_bytes must equal the payload's size."""
    desc = ActivationDesc(dtype=1, layout=1, token_count=2, payload_bytes=8)
    with pytest.raises(FrameError, match="payload_bytes must equal the payload size 7, got 8"):
        ActivationFrame(desc=desc, payload=np.zeros(7, dtype=np.uint8))


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        (b"abcd", "payload must be a numpy uint8 array, got bytes"),
        (np.zeros(4, dtype=np.int8), "payload dtype must be uint8, got int8"),
        (np.zeros((2, 2), dtype=np.uint8), r"payload must be 1-D, got shape \(2, 2\)"),
    ],
)
def test_frame_rejects_bad_payloads(payload: object, message: str) -> None:
    """Only 1-D uint8 numpy arrays are payloads."""
    desc = ActivationDesc(dtype=1, layout=1, token_count=1, payload_bytes=4)
    with pytest.raises(FrameError, match=message):
        ActivationFrame(desc=desc, payload=payload)


@pytest.mark.parametrize("desc", [None, {"token_count": 1}, "desc"])
def test_frame_rejects_a_desc_that_is_not_an_activation_desc(desc: object) -> None:
    """A descriptor of another type is a FrameError naming desc (it was attrs' TypeError)."""
    message = f"desc must be an ActivationDesc, got {type(desc).__name__}"
    with pytest.raises(FrameError, match=message):
        ActivationFrame(desc=desc, payload=np.zeros(4, dtype=np.uint8))  # type: ignore[arg-type]


def test_payload_is_read_only_view_without_copy() -> None:
    """The frame stores a read-only view of the caller's array, not a copy."""
    data = np.arange(8, dtype=np.uint8)
    frame = ActivationFrame(
        desc=ActivationDesc(dtype=1, layout=1, token_count=2, payload_bytes=8), payload=data
    )
    assert not frame.payload.flags.writeable
    assert np.shares_memory(frame.payload, data)
    with pytest.raises(ValueError, match="read-only"):
        frame.payload[0] = 1


def test_from_array_is_zero_copy_and_token_major() -> None:
    """A C-contiguous float32 array becomes a token-major F32 frame sharing its memory."""
    rows = np.arange(12, dtype=np.float32).reshape(3, 4)
    frame = ActivationFrame.from_array(rows, producer_stage_index=2, layer_start=4, layer_end=8)
    assert frame.desc.dtype is ActivationDType.F32
    assert frame.desc.layout is ActivationLayout.TOKEN_MAJOR
    assert (frame.token_count, frame.payload_bytes, frame.bytes_per_token) == (3, 48, 16)
    assert (frame.desc.producer_stage_index, frame.desc.layer_start, frame.desc.layer_end) == (
        2,
        4,
        8,
    )
    assert np.shares_memory(frame.payload, rows)
    np.testing.assert_array_equal(frame.rows(), rows)
    assert not frame.rows().flags.writeable


def test_from_array_copies_non_contiguous_rows_once() -> None:
    """A strided input is copied into a contiguous payload with the same rows."""
    base = np.arange(24, dtype=np.float16).reshape(3, 8)
    rows = base[:, ::2]
    frame = ActivationFrame.from_array(rows)
    assert frame.desc.dtype is ActivationDType.F16
    np.testing.assert_array_equal(frame.rows(), rows)


def test_from_array_bf16_needs_explicit_dtype() -> None:
    """uint16 rows are raw bf16 values only when dtype=BF16 is given."""
    rows = np.arange(6, dtype=np.uint16).reshape(2, 3)
    with pytest.raises(FrameError, match="rows dtype must be float32 or float16"):
        ActivationFrame.from_array(rows)
    frame = ActivationFrame.from_array(rows, dtype=ActivationDType.BF16)
    assert frame.desc.dtype is ActivationDType.BF16
    assert frame.rows().dtype == np.uint16
    np.testing.assert_array_equal(frame.rows(), rows)


@pytest.mark.parametrize(
    ("rows", "dtype", "message"),
    [
        (np.zeros(4, dtype=np.float32), None, r"rows must be a 2-D \(tokens, width\) array"),
        (np.zeros((2, 2), dtype=np.float32), ActivationDType.F16, "does not match"),
        (np.zeros((2, 2), dtype=np.float64), None, "got float64"),
        (
            np.zeros((2, 2), dtype=np.float32),
            True,
            r"dtype must be one of \[0, 1, 2, 3\], got True",
        ),
    ],
)
def test_from_array_rejects_bad_rows(
    rows: np.ndarray[tuple[int, ...], np.dtype[np.generic]],
    dtype: ActivationDType | None,
    message: str,
) -> None:
    """Wrong rank or element type is a FrameError."""
    with pytest.raises(FrameError, match=message):
        ActivationFrame.from_array(rows, dtype=dtype)


def test_virtual_frame_has_size_without_memory() -> None:
    """A virtual frame of 61M tokens x 8192 B is a zero-stride view of one byte."""
    frame = ActivationFrame.virtual(token_count=61_000_000, bytes_per_token=8192)
    assert frame.is_virtual
    assert frame.payload_bytes == 61_000_000 * 8192
    assert frame.payload.strides == (0,)
    assert frame.payload.base is not None
    assert frame.payload.base.nbytes <= 8
    assert frame.bytes_per_token == 8192


def test_virtual_prefix_stays_virtual() -> None:
    """Cutting a virtual frame keeps a zero-stride view of the right size."""
    frame = ActivationFrame.virtual(token_count=131_072, bytes_per_token=8192)
    prefix = frame.prefix(2048)
    assert prefix.is_virtual
    assert (prefix.token_count, prefix.payload_bytes) == (2048, 2048 * 8192)


def test_virtual_rows_are_broadcast_floats() -> None:
    """rows() of a virtual F32 frame is a broadcast (tokens, width) view of zeros."""
    frame = ActivationFrame.virtual(token_count=5, bytes_per_token=16)
    rows = frame.rows()
    assert rows.shape == (5, 4)
    assert rows.dtype == np.float32
    assert rows.strides == (0, 0)
    assert float(rows.sum()) == 0.0


def test_rows_of_zero_tokens_with_a_payload_is_a_frame_error() -> None:
    """A frame of no tokens whose payload is not empty is not whole rows: rows() says so, as
    for any other such frame (it used to raise numpy's "cannot reshape" ValueError)."""
    desc = ActivationDesc(dtype=1, layout=1, token_count=0, payload_bytes=8)
    frame = ActivationFrame(desc=desc, payload=np.zeros(8, dtype=np.uint8))
    with pytest.raises(FrameError, match="payload_bytes 8 is not 0 rows of whole float32"):
        frame.rows()
    empty = ActivationFrame(desc=attrs.evolve(desc, payload_bytes=0), payload=np.zeros(0, np.uint8))
    assert empty.rows().shape == (0, 0)


def test_virtual_rejects_negative_sizes() -> None:
    """Negative counts and non-byte fills are refused."""
    with pytest.raises(FrameError, match="token_count must be an integer >= 0, got -1"):
        ActivationFrame.virtual(token_count=-1, bytes_per_token=4)
    with pytest.raises(FrameError, match="fill must be an integer in \\[0, 255\\], got 256"):
        ActivationFrame.virtual(token_count=1, bytes_per_token=4, fill=256)
    with pytest.raises(FrameError, match=r"at most 9,223,372,036,854,775,807 bytes, got 4,294"):
        ActivationFrame.virtual(token_count=2**32 - 1, bytes_per_token=2**32)


@pytest.mark.parametrize("kind", [np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint64])
def test_virtual_accepts_numpy_integers_as_plain_ints(kind: type[np.integer[Any]]) -> None:
    """Numpy integer counts and fill are taken, as ActivationDesc and prefix() take them, and
    stored as plain ints (a numpy product could wrap: int8(100) x int8(100))."""
    counts: dict[str, Any] = {
        "token_count": kind(100),
        "bytes_per_token": kind(100),
        "fill": kind(7),
    }
    frame = ActivationFrame.virtual(**counts)
    assert type(frame.desc.token_count) is int
    assert type(frame.desc.payload_bytes) is int
    assert (frame.token_count, frame.payload_bytes) == (100, 10_000)
    assert int(frame.payload[0]) == 7


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("token_count", True, "token_count must be an integer >= 0, got True"),
        ("token_count", np.bool_(True), "token_count must be an integer >= 0, got np.True_"),
        ("token_count", 3.0, "token_count must be an integer >= 0, got 3.0"),
        ("token_count", np.float64(3), r"token_count must be an integer >= 0, got np.float64\(3"),
        ("token_count", np.int64(-1), r"token_count must be an integer >= 0, got np.int64\(-1\)"),
        ("bytes_per_token", "4", "bytes_per_token must be an integer >= 0, got '4'"),
        ("bytes_per_token", np.int32(-4), r"bytes_per_token must be .* got np.int32\(-4\)"),
        ("fill", np.uint16(256), r"fill must be an integer in \[0, 255\], got np.uint16\(256\)"),
        ("fill", False, r"fill must be an integer in \[0, 255\], got False"),
    ],
)
def test_virtual_refuses_what_is_not_a_count(field: str, value: object, message: str) -> None:
    """Bools, floats, strings and out-of-range numpy integers are FrameErrors naming the
    field and the value as given."""
    arguments: dict[str, Any] = {"token_count": 3, "bytes_per_token": 4, field: value}
    with pytest.raises(FrameError, match=message):
        ActivationFrame.virtual(**arguments)


def test_prefix_is_view_with_updated_desc() -> None:
    """A prefix is a view of the first k rows; other desc fields are unchanged."""
    frame = byte_frame(300, 1200)
    prefix = frame.prefix(256)
    assert (prefix.token_count, prefix.payload_bytes) == (256, 1024)
    assert np.shares_memory(prefix.payload, frame.payload)
    assert attrs.evolve(prefix.desc, token_count=300, payload_bytes=1200) == frame.desc


def test_prefix_of_full_length_returns_same_frame_even_if_flagged() -> None:
    """k == token_count returns the frame unchanged, with no layout or flag checks."""
    flagged = byte_frame(300, 600, flags=1)
    assert flagged.prefix(300) is flagged
    opaque = ActivationFrame(
        desc=attrs.evolve(flagged.desc, layout=ActivationLayout.OPAQUE, flags=0),
        payload=flagged.payload,
    )
    assert opaque.prefix(300) is opaque


@pytest.mark.parametrize(
    ("frame", "k", "message"),
    [
        (byte_frame(300, 1200), 0, r"token_count must be in \[1, 300\], got 0"),
        (byte_frame(300, 1200), 301, r"token_count must be in \[1, 300\], got 301"),
        (byte_frame(300, 600, flags=1), 256, "side-band flags cannot be cut, got flags 1"),
        (byte_frame(3, 10), 2, "payload_bytes 10 is not a multiple of token_count 3"),
    ],
)
def test_prefix_refuses_unsliceable_frames(frame: ActivationFrame, k: int, message: str) -> None:
    """Spec §5.3 refusals raise FrameError naming the reason."""
    with pytest.raises(FrameError, match=message):
        frame.prefix(k)
    assert frame.prefix_error(k) is not None


def test_prefix_error_names_a_length_that_is_not_an_integer() -> None:
    """prefix_error answers with a reason for any argument, never raises."""
    frame = byte_frame(300, 1200)
    assert frame.prefix_error("2") == "token_count must be an integer, got '2'"  # type: ignore[arg-type]
    assert frame.prefix_error(True) == "token_count must be an integer, got True"


def test_prefix_refuses_opaque_layout() -> None:
    """Only token-major frames can be cut below their length."""
    frame = byte_frame(4, 16)
    opaque = ActivationFrame(
        desc=attrs.evolve(frame.desc, layout=ActivationLayout.OPAQUE), payload=frame.payload
    )
    with pytest.raises(FrameError, match="only TOKEN_MAJOR frames can be cut, got layout OPAQUE"):
        opaque.prefix(2)


def test_concat_joins_rows() -> None:
    """concat puts the second frame's rows after the first's."""
    a = np.arange(8, dtype=np.float32).reshape(2, 4)
    b = np.arange(8, 20, dtype=np.float32).reshape(3, 4)
    joined = ActivationFrame.concat(ActivationFrame.from_array(a), ActivationFrame.from_array(b))
    assert joined.token_count == 5
    np.testing.assert_array_equal(joined.rows(), np.concatenate([a, b]))


def test_concat_of_virtual_frames_is_virtual() -> None:
    """Two virtual frames concatenate without allocating."""
    a = ActivationFrame.virtual(token_count=100_000, bytes_per_token=8192)
    b = ActivationFrame.virtual(token_count=31_072, bytes_per_token=8192)
    joined = ActivationFrame.concat(a, b)
    assert joined.is_virtual
    assert (joined.token_count, joined.payload_bytes) == (131_072, 131_072 * 8192)


def test_concat_of_virtual_frames_past_numpy_sizes_is_a_frame_error() -> None:
    """Two virtual frames whose joined payload numpy cannot index (each one is valid) are
    refused as virtual() refuses such a size; it used to be numpy's "Maximum allowed
    dimension exceeded" ValueError."""
    half = ActivationFrame.virtual(token_count=2**30, bytes_per_token=2**33 - 1)
    with pytest.raises(FrameError, match=r"concat of virtual frames must be at most 9,223,"):
        ActivationFrame.concat(half, half)
    many = ActivationFrame.virtual(token_count=2**31 + 5, bytes_per_token=4)
    with pytest.raises(FrameError, match="token_count must be an integer in"):
        ActivationFrame.concat(many, many)


def test_concat_with_empty_frame_returns_the_other() -> None:
    """An empty side contributes nothing."""
    a = ActivationFrame.from_array(np.ones((2, 4), dtype=np.float32))
    empty = ActivationFrame(
        desc=attrs.evolve(a.desc, token_count=0, payload_bytes=0),
        payload=np.zeros(0, dtype=np.uint8),
    )
    assert ActivationFrame.concat(a, empty) is a
    assert ActivationFrame.concat(empty, a) is a


def test_concat_rejects_mismatched_descs() -> None:
    """Descriptors must agree except for token counts; widths must match."""
    a = ActivationFrame.from_array(np.ones((2, 4), dtype=np.float32), layer_end=4)
    b = ActivationFrame.from_array(np.ones((2, 4), dtype=np.float32), layer_end=8)
    with pytest.raises(FrameError, match="layer_end differs: 4 != 8"):
        ActivationFrame.concat(a, b)
    c = ActivationFrame.from_array(np.ones((2, 2), dtype=np.float32), layer_end=4)
    with pytest.raises(FrameError, match="bytes_per_token differs: 16 != 8"):
        ActivationFrame.concat(a, c)


def test_same_content_compares_desc_and_bytes() -> None:
    """same_content is true for equal bytes and false for a different byte or desc."""
    a = byte_frame(4, 16)
    assert a.same_content(byte_frame(4, 16))
    other = np.full(16, 7, dtype=np.uint8)
    other[3] = 8
    assert not a.same_content(ActivationFrame(desc=a.desc, payload=other))
    assert not a.same_content(byte_frame(4, 16, flags=1))
    virtual = ActivationFrame.virtual(token_count=4, bytes_per_token=4, layer_end=4, fill=7)
    assert virtual.same_content(a)
    assert a.same_content(virtual)
    with pytest.raises(FrameError, match="other must be an ActivationFrame, got NoneType"):
        a.same_content(None)  # type: ignore[arg-type]


@settings(max_examples=50, deadline=None)
@given(
    tokens=st.integers(min_value=1, max_value=64),
    width=st.integers(min_value=1, max_value=16),
    data=st.data(),
)
def test_prefix_then_concat_restores_the_frame(
    tokens: int, width: int, data: st.DataObject
) -> None:
    """prefix(k) followed by the remaining rows concatenates back to the original frame."""
    rows = np.arange(tokens * width, dtype=np.float32).reshape(tokens, width)
    frame = ActivationFrame.from_array(rows)
    k = data.draw(st.integers(min_value=1, max_value=tokens))
    head = frame.prefix(k)
    tail = ActivationFrame.from_array(rows[k:])
    assert ActivationFrame.concat(head, tail).same_content(frame)


def test_from_array_keeps_broadcast_zeros_virtual() -> None:
    """Broadcast zero rows become a virtual frame; a broadcast non-uniform element is copied."""
    zeros = np.broadcast_to(np.float32(0), (1_000_000, 2048))
    frame = ActivationFrame.from_array(zeros)
    assert frame.is_virtual
    assert frame.payload_bytes == 1_000_000 * 2048 * 4
    ones = np.broadcast_to(np.float32(1), (3, 2))
    copied = ActivationFrame.from_array(ones)
    assert not copied.is_virtual
    np.testing.assert_array_equal(copied.rows(), ones)


def test_repr_never_prints_the_payload() -> None:
    """A frame's repr names size and kind, not the bytes."""
    frame = ActivationFrame.virtual(token_count=4, bytes_per_token=2)
    assert repr(frame).endswith("payload=<uint8[8] virtual>)")
    assert "payload=<uint8[16] view>" in repr(byte_frame(4, 16))


def test_virtual_frame_pickles_to_its_descriptor_and_fill() -> None:
    """A 100K-token virtual frame pickles to a few hundred bytes and comes back virtual."""
    frame = ActivationFrame.virtual(token_count=100_000, bytes_per_token=8192, fill=7)
    data = pickle.dumps(frame, protocol=5)
    assert len(data) < 1_000
    back = pickle.loads(data)
    assert back.is_virtual
    assert back.desc == frame.desc
    assert back.payload.size == frame.payload.size
    assert back.same_content(frame)


def test_prefix_view_pickles_only_its_own_bytes() -> None:
    """A prefix view of a large frame sends the prefix, read-only on arrival."""
    rows = np.arange(4096 * 64, dtype=np.float32).reshape(4096, 64)
    prefix = ActivationFrame.from_array(rows).prefix(16)
    data = pickle.dumps(prefix, protocol=5)
    assert len(data) < 16 * 64 * 4 + 1_000
    back = pickle.loads(data)
    assert not back.payload.flags.writeable
    assert back.desc == prefix.desc
    np.testing.assert_array_equal(back.rows(), rows[:16])


def test_real_frame_payload_goes_out_of_band_with_protocol_5() -> None:
    """With a buffer callback (as Ray's serializer uses), the payload is not copied into the
    pickle stream, and the rebuilt frame reads the buffer it was given."""
    rows = np.ones((256, 32), dtype=np.float32)
    frame = ActivationFrame.from_array(rows)
    buffers: list[pickle.PickleBuffer] = []
    data = pickle.dumps(frame, protocol=5, buffer_callback=buffers.append)
    assert len(data) < 1_000
    assert sum(memoryview(b).nbytes for b in buffers) == frame.payload_bytes
    back = pickle.loads(data, buffers=buffers)
    assert back.same_content(frame)
    assert not back.payload.flags.writeable


def test_prefix_descriptors_copy_every_field() -> None:
    """The unchecked prefix copies each descriptor field (a field added to ActivationDesc must
    be added to ``_desc_with_counts`` too)."""
    desc = ActivationDesc(
        version=1,
        dtype=ActivationDType.F16,
        layout=ActivationLayout.TOKEN_MAJOR,
        producer_stage_index=3,
        layer_start=4,
        layer_end=9,
        token_count=10,
        sequence_count=2,
        payload_bytes=40,
        flags=0,
    )
    assert {field.name for field in attrs.fields(ActivationDesc)} == set(_DESC_FIELDS)
    assert len(_DESC_FIELDS) == 10
    cut = _desc_with_counts(desc, 5, 20)
    assert cut == attrs.evolve(desc, token_count=5, payload_bytes=20)


@pytest.mark.parametrize(("size", "fill"), [(0, 0), (1, 255), (4096, 7), (2**40, 3)])
def test_a_virtual_payload_repeats_one_shared_byte(size: int, fill: int) -> None:
    """A virtual payload is a read-only zero-stride view of the fill byte's one shared array,
    of the size asked; a negative size is refused."""
    payload = _virtual_payload(size, fill)
    assert (payload.size, payload.dtype.name, payload.flags.writeable) == (size, "uint8", False)
    assert payload.base is _FILL_BYTES[fill]
    if size:
        assert payload.strides == (0,)
        assert int(payload[0]) == int(payload[size - 1]) == fill
    with pytest.raises(ValueError, match="cannot have -1 bytes"):
        _virtual_payload(-1, fill)
    with pytest.raises(ValueError, match=f"cannot have {2**63} bytes"):
        _virtual_payload(2**63, fill)
