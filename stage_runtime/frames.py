"""Activation frames: the rows a stage produces for a run of tokens.

A frame is a small descriptor (:class:`ActivationDesc`) plus a read-only 1-D ``uint8`` numpy
payload. Frames never copy their payload: a prefix is a view, and a *virtual* frame (used by
simulations that replay millions of tokens) is a zero-stride view of a single byte, so it has the
right size without holding any memory. Code in this module therefore only looks at ``.size``,
``.shape`` and ``.strides`` of a payload and never materialises it.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any, Final, TypeVar

import attrs
import numpy as np
import numpy.typing as npt

from stage_runtime._unchecked import unchecked_constructor
from stage_runtime._validators import check_int, int_range, is_int
from stage_runtime.errors import FrameError
from stage_runtime.limits import I32_MAX as _I32_MAX
from stage_runtime.limits import I32_MIN as _I32_MIN
from stage_runtime.limits import MAX_VIRTUAL_BYTES as _MAX_VIRTUAL_BYTES
from stage_runtime.limits import U32_MAX as _U32_MAX
from stage_runtime.limits import U64_MAX as _U64_MAX

__all__ = [
    "ActivationDType",
    "ActivationDesc",
    "ActivationFrame",
    "ActivationLayout",
]


class ActivationDType(enum.IntEnum):
    """Element type of an activation payload (the upstream's ``RuntimeActivationDType``)."""

    UNKNOWN = 0
    F32 = 1
    F16 = 2
    BF16 = 3


class ActivationLayout(enum.IntEnum):
    """How the payload bytes are arranged (the upstream's ``RuntimeActivationLayout``)."""

    OPAQUE = 0
    """No known structure: the frame can be cached at its exact length only."""

    TOKEN_MAJOR = 1
    """Row ``t`` holds token ``t``: a prefix of ``k`` tokens is the first ``k`` rows."""


# numpy element type for each dtype; bf16 has no numpy type, so it travels as raw uint16.
_NUMPY_DTYPE: Final[dict[ActivationDType, np.dtype[Any]]] = {
    ActivationDType.F32: np.dtype(np.float32),
    ActivationDType.F16: np.dtype(np.float16),
    ActivationDType.BF16: np.dtype(np.uint16),
}


def _int_in(low: int, high: int) -> Any:
    """An attrs validator: an integer (numpy's too, not ``bool``) within ``[low, high]``, else
    FrameError."""
    return int_range(low, high, numpy=True, error=FrameError)


def _to_dtype(value: object) -> ActivationDType:
    if type(value) is ActivationDType:
        return value
    return _member(ActivationDType, "dtype", value)


def _to_layout(value: object) -> ActivationLayout:
    if type(value) is ActivationLayout:
        return value
    return _member(ActivationLayout, "layout", value)


_Code = TypeVar("_Code", ActivationDType, ActivationLayout)


def _member(kind: type[_Code], name: str, value: object) -> _Code:
    """The member of ``kind`` whose code is the integer ``value`` (a member itself, or a numpy
    integer); a FrameError naming ``name`` for anything else: a bool (True == 1 == F32), or a
    float or string that merely compares equal to a code (1.0), is not a code."""
    if isinstance(value, kind):
        return value
    if is_int(value, numpy=True):
        try:
            return kind(int(value))
        except ValueError:
            pass
    msg = f"{name} must be one of {[int(member) for member in kind]}, got {value!r}"
    raise FrameError(msg)


@attrs.frozen(kw_only=True)
class ActivationDesc:
    """Descriptor of an activation frame; field widths follow the upstream's ``ActivationDesc``."""

    version: int = attrs.field(default=1, validator=_int_in(0, _U32_MAX))
    """Descriptor format version (always 1 today)."""

    dtype: ActivationDType = attrs.field(converter=_to_dtype)
    """Element type of the payload."""

    layout: ActivationLayout = attrs.field(converter=_to_layout)
    """Byte arrangement; only ``TOKEN_MAJOR`` frames can be cut into prefixes."""

    producer_stage_index: int = attrs.field(default=0, validator=_int_in(_I32_MIN, _I32_MAX))
    """Index of the stage that produced the frame."""

    layer_start: int = attrs.field(default=0, validator=_int_in(_I32_MIN, _I32_MAX))
    """First layer of the producing stage."""

    layer_end: int = attrs.field(default=0, validator=_int_in(_I32_MIN, _I32_MAX))
    """One past the last layer of the producing stage."""

    token_count: int = attrs.field(validator=_int_in(0, _U32_MAX))
    """Number of tokens the frame covers."""

    sequence_count: int = attrs.field(default=1, validator=_int_in(0, _U32_MAX))
    """Number of sequences in the frame (1 for a prefill)."""

    payload_bytes: int = attrs.field(validator=_int_in(0, _U64_MAX))
    """Length of the payload in bytes; must equal the payload's size."""

    flags: int = attrs.field(default=0, validator=_int_in(0, _U64_MAX))
    """Side-band bits; a non-zero value means the payload is not plain token rows."""


_DESC_FIELDS: Final = tuple(field.name for field in attrs.fields(ActivationDesc))


def _slot_setter(name: str) -> Callable[[ActivationDesc, Any], None]:
    """The ``__set__`` of a field's slot: what attrs' own ``__init__`` uses on a frozen class."""
    setter: Callable[[ActivationDesc, Any], None] = vars(ActivationDesc)[name].__set__
    return setter


_set_version = _slot_setter("version")
_set_dtype = _slot_setter("dtype")
_set_layout = _slot_setter("layout")
_set_producer = _slot_setter("producer_stage_index")
_set_layer_start = _slot_setter("layer_start")
_set_layer_end = _slot_setter("layer_end")
_set_token_count = _slot_setter("token_count")
_set_sequences = _slot_setter("sequence_count")
_set_payload_bytes = _slot_setter("payload_bytes")
_set_flags = _slot_setter("flags")


def _desc_with_counts(desc: ActivationDesc, token_count: int, payload_bytes: int) -> ActivationDesc:
    """``attrs.evolve(desc, token_count=..., payload_bytes=...)`` without the validators, for
    internal callers whose counts are valid by construction (every field is copied: a test
    checks this list against the class's fields)."""
    new: ActivationDesc = object.__new__(ActivationDesc)
    _set_version(new, desc.version)
    _set_dtype(new, desc.dtype)
    _set_layout(new, desc.layout)
    _set_producer(new, desc.producer_stage_index)
    _set_layer_start(new, desc.layer_start)
    _set_layer_end(new, desc.layer_end)
    _set_token_count(new, token_count)
    _set_sequences(new, desc.sequence_count)
    _set_payload_bytes(new, payload_bytes)
    _set_flags(new, desc.flags)
    return new


def _readonly_payload(value: object) -> npt.NDArray[np.uint8]:
    """Check a payload and return a read-only view of it (never a copy)."""
    if not isinstance(value, np.ndarray):
        msg = f"payload must be a numpy uint8 array, got {type(value).__name__}"
        raise FrameError(msg)
    if value.dtype != np.uint8:
        msg = f"payload dtype must be uint8, got {value.dtype}"
        raise FrameError(msg)
    if value.ndim != 1:
        msg = f"payload must be 1-D, got shape {value.shape}"
        raise FrameError(msg)
    if not value.flags.writeable:
        return value
    view = value.view()
    view.flags.writeable = False
    return view


def _is_zero_stride(payload: npt.NDArray[np.uint8]) -> bool:
    return payload.size > 0 and payload.strides[0] == 0


# One shared read-only byte per fill value backs every virtual payload: a zero-stride view of
# it costs no memory.
_FILL_BYTES: Final = [np.full(1, fill, dtype=np.uint8) for fill in range(256)]
for _byte in _FILL_BYTES:
    _byte.flags.writeable = False


_FILL_VIEWS: Final = [
    np.ndarray((_MAX_VIRTUAL_BYTES,), dtype=np.uint8, buffer=byte, strides=(0,))
    for byte in _FILL_BYTES
]
"""Per fill value, the longest virtual payload (read-only, stride 0): every other one is a slice
of it, whose ``base`` is the fill byte's array."""


def _virtual_payload(size: int, fill: int = 0) -> npt.NDArray[np.uint8]:
    # What np.broadcast_to(byte, (size,)) returns (read-only, stride 0), as a slice: a tenth of
    # what the ndarray constructor costs, and a fraction of broadcast_to's argument handling.
    if not 0 <= size <= _MAX_VIRTUAL_BYTES:  # (a slice would count from the end, or clip)
        msg = f"a payload cannot have {size} bytes"
        raise ValueError(msg)
    return _FILL_VIEWS[fill][:size]


def _broadcast_payload(rows: npt.NDArray[Any]) -> npt.NDArray[np.uint8] | None:
    """A virtual payload for rows that repeat one element whose bytes are all equal, else None.

    ``np.broadcast_to(np.float32(0), (n, width))`` then stays free instead of being copied.
    """
    if rows.size == 0 or any(stride != 0 for stride in rows.strides):
        return None
    element = np.ascontiguousarray(rows.reshape(-1)[:1]).view(np.uint8)
    if not bool(np.all(element == element[0])):
        return None
    return _virtual_payload(rows.size * rows.dtype.itemsize, int(element[0]))


def _check_desc(_instance: object, _attribute: attrs.Attribute[Any], value: Any) -> None:
    if not isinstance(value, ActivationDesc):
        msg = f"desc must be an ActivationDesc, got {type(value).__name__}"
        raise FrameError(msg)


@attrs.frozen(kw_only=True, eq=False)
class ActivationFrame:
    """An activation descriptor plus its read-only ``uint8`` payload.

    The payload may be any 1-D ``uint8`` array, including zero-stride broadcast views (see
    :meth:`virtual`); it is stored as a read-only view and never copied. Frames compare by
    identity; compare contents with :meth:`same_content`.
    """

    desc: ActivationDesc = attrs.field(validator=_check_desc)
    """What the payload holds."""

    payload: npt.NDArray[np.uint8] = attrs.field(converter=_readonly_payload, repr=False)
    """The bytes, read-only; ``payload.size == desc.payload_bytes``."""

    def __repr__(self) -> str:
        # Never print payload bytes: they can be gigabytes (and virtual).
        kind = "virtual" if self.is_virtual else "view"
        return f"ActivationFrame(desc={self.desc!r}, payload=<uint8[{self.payload.size}] {kind}>)"

    def __reduce__(self) -> tuple[Callable[..., ActivationFrame], tuple[Any, ...]]:
        # Compact pickling, for frames sent between processes (Ray placement): a virtual frame
        # is its descriptor and fill byte, not its (possibly gigabytes of) virtual size; a real
        # one is its descriptor and exactly its own bytes (a prefix view sends the prefix, not
        # the frame it views), as a numpy array that pickle protocol 5 can pass out of band.
        if self.is_virtual:
            return _unpickle_virtual, (self.desc, int(self.payload[0]))
        return _unpickle_frame, (self.desc, np.ascontiguousarray(self.payload))

    def __attrs_post_init__(self) -> None:
        if self.desc.payload_bytes != self.payload.size:
            msg = (
                f"payload_bytes must equal the payload size {self.payload.size}, "
                f"got {self.desc.payload_bytes}"
            )
            raise FrameError(msg)

    @classmethod
    def from_array(
        cls,
        rows: npt.NDArray[Any],
        *,
        dtype: ActivationDType | None = None,
        producer_stage_index: int = 0,
        layer_start: int = 0,
        layer_end: int = 0,
    ) -> ActivationFrame:
        """Wrap a 2-D ``(tokens, width)`` array as a token-major frame.

        Zero-copy when ``rows`` is C-contiguous (the frame then shares its memory, so do not
        write to ``rows`` afterwards); otherwise the rows are copied once. A zero-stride
        broadcast of one element whose bytes are all equal (such as ``0.0``) becomes a virtual
        frame instead of being materialised.

        Args:
            rows: float32 or float16 rows, or uint16 rows holding raw bf16 values.
            dtype: The activation dtype; inferred from ``rows.dtype`` when None. Required
                (``BF16``) for uint16 rows.
            producer_stage_index: Index of the producing stage.
            layer_start: First layer of the producing stage.
            layer_end: One past the last layer of the producing stage.

        Raises:
            FrameError: ``rows`` is not 2-D or its element type does not match ``dtype``.
        """
        if not isinstance(rows, np.ndarray) or rows.ndim != 2:
            shape = getattr(rows, "shape", type(rows).__name__)
            msg = f"rows must be a 2-D (tokens, width) array, got {shape}"
            raise FrameError(msg)
        if dtype is None:
            inferred: dict[np.dtype[Any], ActivationDType] = {
                np.dtype(np.float32): ActivationDType.F32,
                np.dtype(np.float16): ActivationDType.F16,
            }
            if rows.dtype not in inferred:
                msg = (
                    f"rows dtype must be float32 or float16 (or uint16 with dtype=BF16), "
                    f"got {rows.dtype}"
                )
                raise FrameError(msg)
            dtype = inferred[rows.dtype]
        dtype = _to_dtype(dtype)
        expected = _NUMPY_DTYPE.get(dtype)
        if expected is None or rows.dtype != expected:
            msg = f"rows dtype {rows.dtype} does not match activation dtype {dtype.name}"
            raise FrameError(msg)
        payload = _broadcast_payload(rows)
        if payload is None:
            payload = np.ascontiguousarray(rows).reshape(-1).view(np.uint8)
        desc = ActivationDesc(
            dtype=dtype,
            layout=ActivationLayout.TOKEN_MAJOR,
            producer_stage_index=producer_stage_index,
            layer_start=layer_start,
            layer_end=layer_end,
            token_count=rows.shape[0],
            payload_bytes=payload.size,
        )
        return cls(desc=desc, payload=payload)

    @classmethod
    def virtual(
        cls,
        *,
        token_count: int,
        bytes_per_token: int,
        dtype: ActivationDType = ActivationDType.F32,
        layout: ActivationLayout = ActivationLayout.TOKEN_MAJOR,
        producer_stage_index: int = 0,
        layer_start: int = 0,
        layer_end: int = 0,
        flags: int = 0,
        fill: int = 0,
    ) -> ActivationFrame:
        """A frame of the right size whose payload holds no memory.

        The payload is a zero-stride broadcast of one byte (``fill``), so a frame of 61 million
        tokens at 8,192 bytes each costs nothing. Simulations use it to account bytes
        faithfully without allocating them.

        The counts and ``fill`` may be ``int`` or numpy integers (stored as ``int``), as for
        :class:`ActivationDesc`; a ``bool`` or a float is not a count.

        Raises:
            FrameError: a count is not an integer >= 0, ``fill`` is not an integer byte value,
                or the payload would pass the largest size numpy can index.
        """
        token_count = check_int("token_count", token_count, low=0, numpy=True, error=FrameError)
        bytes_per_token = check_int(
            "bytes_per_token", bytes_per_token, low=0, numpy=True, error=FrameError
        )
        fill = check_int("fill", fill, low=0, high=255, numpy=True, error=FrameError)
        size = token_count * bytes_per_token
        if size > _MAX_VIRTUAL_BYTES:
            msg = (
                f"token_count x bytes_per_token must be at most {_MAX_VIRTUAL_BYTES:,} bytes, "
                f"got {token_count:,} x {bytes_per_token:,} = {size:,}"
            )
            raise FrameError(msg)
        desc = ActivationDesc(
            dtype=dtype,
            layout=layout,
            producer_stage_index=producer_stage_index,
            layer_start=layer_start,
            layer_end=layer_end,
            token_count=token_count,
            payload_bytes=size,
            flags=flags,
        )
        return cls(desc=desc, payload=_virtual_payload(size, fill))

    @property
    def token_count(self) -> int:
        """Number of tokens the frame covers."""
        return self.desc.token_count

    @property
    def payload_bytes(self) -> int:
        """Length of the payload in bytes."""
        return self.desc.payload_bytes

    @property
    def bytes_per_token(self) -> int:
        """Payload bytes per token (0 for an empty frame); exact for sliceable frames."""
        if self.desc.token_count == 0:
            return 0
        return self.desc.payload_bytes // self.desc.token_count

    @property
    def is_virtual(self) -> bool:
        """Whether the payload is a zero-stride view (no memory behind it)."""
        return _is_zero_stride(self.payload)

    def row_width(self) -> float | None:
        """Values per token row, where the frame says it: a real (not virtual) token-major
        single-sequence frame of a known dtype; None otherwise. A virtual frame's width is
        nominal (a simulation sets its bytes per token freely). Not a whole number when the
        rows are not whole elements."""
        if _is_zero_stride(self.payload):  # (virtual: first, as a simulation's frames are)
            return None
        desc = self.desc
        element = _NUMPY_DTYPE.get(desc.dtype)
        if (
            element is None
            or desc.layout != ActivationLayout.TOKEN_MAJOR
            or desc.flags
            or desc.sequence_count != 1
            or desc.token_count == 0
        ):
            return None
        return self.bytes_per_token / element.itemsize

    def check_row_width(self, width: int, *, what: str) -> None:
        """Raise :class:`FrameError` when the frame says its rows' width
        (:meth:`row_width`) and it is not ``width``: the width is part of every cache key, so
        such rows would be recorded under it and restored into prompts that expect another.

        Args:
            width: The expected values per row (an ``activation_width``).
            what: What the frame is, to begin the message (``"model output"``, ``"frame"``).
        """
        rows = self.row_width()
        if rows is not None and rows != width:
            msg = (
                f"{what} rows must be activation_width {width} {self.desc.dtype.name} values "
                f"wide, got {rows:g}"
            )
            raise FrameError(msg)

    def rows(self) -> npt.NDArray[Any]:
        """The payload as a read-only ``(tokens, width)`` array in the frame's element type.

        float32 for F32, float16 for F16, uint16 (raw bf16) for BF16. A view when the payload
        is contiguous or virtual.

        Raises:
            FrameError: the frame is not token-major, has flags, an unknown dtype, or a payload
                that is not a whole number of rows.
        """
        if self.desc.layout != ActivationLayout.TOKEN_MAJOR:
            msg = f"rows() needs a TOKEN_MAJOR frame, got layout {self.desc.layout.name}"
            raise FrameError(msg)
        if self.desc.flags != 0:
            msg = f"rows() needs a frame without side-band flags, got flags {self.desc.flags}"
            raise FrameError(msg)
        element = _NUMPY_DTYPE.get(self.desc.dtype)
        if element is None:
            msg = f"rows() needs a known dtype, got {self.desc.dtype.name}"
            raise FrameError(msg)
        tokens = self.desc.token_count
        row_bytes = self.bytes_per_token
        if (
            row_bytes * tokens != self.payload.size  # zero tokens with a payload, too
            or row_bytes % element.itemsize
        ):
            msg = (
                f"payload_bytes {self.payload.size} is not {tokens} rows of whole "
                f"{element.name} elements"
            )
            raise FrameError(msg)
        width = row_bytes // element.itemsize
        if self.is_virtual:
            # Reinterpret one element's worth of the repeated byte, then broadcast it again.
            one = np.ascontiguousarray(self.payload[: element.itemsize]).view(element)
            return np.broadcast_to(one, (tokens, width))
        data = np.ascontiguousarray(self.payload).view(element).reshape(tokens, width)
        data.flags.writeable = False
        return data

    def prefix_error(self, token_count: int) -> str | None:
        """Why :meth:`prefix` would refuse ``token_count``, or None when it would succeed."""
        if not is_int(token_count, numpy=True):
            return f"token_count must be an integer, got {token_count!r}"
        frame_tokens = self.desc.token_count
        if token_count == frame_tokens:
            return None
        if token_count <= 0 or token_count > frame_tokens:
            return f"token_count must be in [1, {frame_tokens}], got {token_count}"
        if self.desc.layout != ActivationLayout.TOKEN_MAJOR:
            return f"only TOKEN_MAJOR frames can be cut, got layout {self.desc.layout.name}"
        if self.desc.flags != 0:
            return f"frames with side-band flags cannot be cut, got flags {self.desc.flags}"
        if self.payload.size % frame_tokens:
            return (
                f"payload_bytes {self.payload.size} is not a multiple of token_count {frame_tokens}"
            )
        return None

    def prefix(self, token_count: int) -> ActivationFrame:
        """The first ``token_count`` tokens of this frame, as a zero-copy view (spec §5.3).

        ``token_count == self.token_count`` returns this frame unchanged, whatever its layout
        and flags. Any other length needs a token-major frame without flags whose payload is a
        whole number of rows, and ``0 < token_count < self.token_count``.

        Raises:
            FrameError: the frame cannot be cut at ``token_count``; the message says why.
        """
        if not is_int(token_count, numpy=True):
            msg = f"token_count must be an integer, got {token_count!r}"
            raise FrameError(msg)
        token_count = int(token_count)
        reason = self.prefix_error(token_count)
        if reason is not None:
            raise FrameError(reason)
        return self._cut(token_count)

    def _cut(self, token_count: int) -> ActivationFrame:
        """Unchecked prefix: the caller has made sure :meth:`prefix_error` returns None."""
        if token_count == self.desc.token_count:
            return self
        payload_bytes = self.payload.size // self.desc.token_count * token_count
        # Both counts shrink from valid values and the slice of a read-only payload is a
        # read-only view of the right size: build the objects without re-running validators.
        desc = _desc_with_counts(self.desc, token_count, payload_bytes)
        return _unchecked_frame(desc, self.payload[:payload_bytes])

    def _virtual_rows(self, token_count: int, fill: int = 0) -> ActivationFrame:
        """Unchecked :meth:`virtual` of ``token_count`` rows with this frame's descriptor: the
        caller has made sure this frame has whole rows of at least one token, and that
        ``token_count`` is an ``int`` that :meth:`virtual` accepts (a simulated model makes
        every frame from one checked template)."""
        desc = self.desc
        size = desc.payload_bytes // desc.token_count * token_count
        return _unchecked_frame(
            _desc_with_counts(desc, token_count, size), _virtual_payload(size, fill)
        )

    @staticmethod
    def concat(first: ActivationFrame, second: ActivationFrame) -> ActivationFrame:
        """Token-major concatenation: the rows of ``first`` followed by those of ``second``.

        Copies the payloads once, except when both are virtual with the same fill byte: the
        result is then virtual too. An empty frame contributes nothing (the other is returned).

        Raises:
            FrameError: the frames are not token-major, carry flags, are not whole rows, or
                their descriptors differ in anything but token count and payload size.
        """
        for name, frame in (("first", first), ("second", second)):
            if not isinstance(frame, ActivationFrame):
                msg = f"{name} must be an ActivationFrame, got {type(frame).__name__}"
                raise FrameError(msg)
        a, b = first.desc, second.desc
        fields = (
            "version",
            "dtype",
            "layout",
            "producer_stage_index",
            "layer_start",
            "layer_end",
            "sequence_count",
            "flags",
        )
        for name in fields:
            if getattr(a, name) != getattr(b, name):
                msg = (
                    f"cannot concat frames whose {name} differs: "
                    f"{getattr(a, name)!r} != {getattr(b, name)!r}"
                )
                raise FrameError(msg)
        if a.layout != ActivationLayout.TOKEN_MAJOR or a.flags != 0:
            msg = (
                f"concat needs TOKEN_MAJOR frames without flags, "
                f"got layout {a.layout.name} and flags {a.flags}"
            )
            raise FrameError(msg)
        if b.token_count == 0 and b.payload_bytes == 0:
            return first
        if a.token_count == 0 and a.payload_bytes == 0:
            return second
        for name, frame in (("first", first), ("second", second)):
            d = frame.desc
            if d.token_count == 0 or d.payload_bytes % d.token_count:
                msg = (
                    f"{name} frame is not whole rows: payload_bytes {d.payload_bytes}, "
                    f"token_count {d.token_count}"
                )
                raise FrameError(msg)
        if first.bytes_per_token != second.bytes_per_token:
            msg = (
                f"cannot concat frames whose bytes_per_token differs: "
                f"{first.bytes_per_token} != {second.bytes_per_token}"
            )
            raise FrameError(msg)
        token_count = a.token_count + b.token_count
        payload_bytes = a.payload_bytes + b.payload_bytes
        # First: its validators name a token count past u32 before a payload is made of it.
        desc = attrs.evolve(a, token_count=token_count, payload_bytes=payload_bytes)
        if first.is_virtual and second.is_virtual and first.payload[0] == second.payload[0]:
            if payload_bytes > _MAX_VIRTUAL_BYTES:  # as virtual() refuses it
                msg = (
                    f"concat of virtual frames must be at most {_MAX_VIRTUAL_BYTES:,} bytes, "
                    f"got {a.payload_bytes:,} + {b.payload_bytes:,} = {payload_bytes:,}"
                )
                raise FrameError(msg)
            payload = _virtual_payload(payload_bytes, int(first.payload[0]))
        else:
            payload = np.concatenate((first.payload, second.payload))
        return ActivationFrame(desc=desc, payload=payload)

    def same_content(self, other: ActivationFrame) -> bool:
        """Whether both frames have equal descriptors and equal payload bytes.

        Virtual payloads are compared by their fill byte, without materialising them.

        Raises:
            FrameError: ``other`` is not an ActivationFrame.
        """
        if not isinstance(other, ActivationFrame):
            msg = f"other must be an ActivationFrame, got {type(other).__name__}"
            raise FrameError(msg)
        if self.desc != other.desc:
            return False
        if self.payload is other.payload or self.payload.size == 0:
            return True
        if self.is_virtual and other.is_virtual:
            return bool(self.payload[0] == other.payload[0])
        if self.is_virtual or other.is_virtual:
            virtual, real = (self, other) if self.is_virtual else (other, self)
            return bool(np.all(real.payload == virtual.payload[0]))
        return bool(np.array_equal(self.payload, other.payload))


_unchecked_frame = unchecked_constructor(ActivationFrame)
"""An ActivationFrame of a descriptor and a read-only payload of its size, unchecked: for
internal callers whose frames are valid by construction (a prefix, a virtual frame's rows)."""


def _unpickle_frame(desc: ActivationDesc, payload: npt.NDArray[np.uint8]) -> ActivationFrame:
    """Rebuild a pickled real frame; its payload stays read-only (zero-copy where the
    unpickler gave a read-only buffer, as Ray's object store does)."""
    return ActivationFrame(desc=desc, payload=payload)


def _unpickle_virtual(desc: ActivationDesc, fill: int) -> ActivationFrame:
    """Rebuild a pickled virtual frame from its descriptor and fill byte."""
    return ActivationFrame(desc=desc, payload=_virtual_payload(desc.payload_bytes, fill))
