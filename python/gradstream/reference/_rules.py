"""The decoding rules a gradient's chunks are held to together (docs/spec/decoding-rules.md),
and decode_chunks, which applies them to a set of chunks in memory.

* the texts of the errors both implementations word alike;
* the shape rules (keep_shape): the sender writes the gradient's shape into every
  payload's schema metadata (``gradient_shape``, a compact JSON array such as
  ``[768,3072]``); every receiver checks it chunk by chunk (``_check_shape_text``,
  ``_ShapeTracker``) and reshapes the result once the gradient is complete;
* the dtype rules (keep_dtype, wire_dtype): the ``value`` column is Float32, Float16,
  Float64 or UInt16 tagged ``gradstream.bfloat16``; the schema metadata
  ``gradient_dtype`` names the dtype to hand back when it is not the column's. The
  receiver checks every chunk's column dtype and gradient_dtype against the first chunk
  taken (``_DtypeTracker``), before its record batches are read, keeps the values in the
  column's dtype until the gradient is complete (or until they go into ``out=``) and then
  casts them with ``_dtypes.cast``;
* the seal (``_seal``): checked once a chunk's schema is read, before the dtype rules;
* the CRC-32 check, which comes before any parsing, and the room max_gradient_len leaves;
* decode_chunks' rules 1-5 over a list of chunks (``_decode_chunk_list``).

Apart from the payload reader, which judges one payload alone, and from the frame
receiver (``_receiver``), which applies the same trackers to frames as they arrive.
"""

from __future__ import annotations

import re
import zlib
from typing import Any, NamedTuple

import numpy as np

from .. import _dtypes
from .._convert import byte_view as _byte_view
from ..errors import (
    ArrowIpcError,
    ChecksumMismatchError,
    FrameError,
    GradientDtypeError,
    IncompleteStreamError,
)
from ._reader import _concat, _Head, _open_payload, _read_values
from ._seal import LONE, WHEN_PRESENT, Expect, _SealTracker
from ._settings import _check_u32
from ._wire import _STORAGE, numpy_can_make


def _empty_vector() -> np.ndarray:
    return np.empty(0, dtype=np.float32)


# --------------------------------------------------------------------------- error messages
# docs/spec/decoding-rules.md fixes these texts; both implementations must produce them verbatim.


def _disagree(first_index: int, first_total: int, index: int, total: int) -> str:
    return (
        f"chunks disagree on total_chunks: chunk {first_index} says {first_total}, "
        f"chunk {index} says {total}"
    )


def _duplicate(index: int) -> str:
    return f"duplicate chunk index {index}"


def _out_of_range(index: int, total: int) -> str:
    return f"chunk index {index} out of range for total_chunks {total}"


# --------------------------------------------------------------------------- shapes
# keep_shape: the sender's gradient shape travels as schema metadata of every payload.

MAX_SHAPE_DIMS = 32

# "[" then 0..32 non-negative decimal integers (ASCII digits, no sign, no leading zero but
# for 0 itself, at most 18 digits, so below 2**63 as numpy needs) separated by ",", ASCII
# spaces allowed around each element and inside the brackets, then "]". Nothing else: not
# JSON (no 1.5, true, 1e3).
_DIM = r"(?:0|[1-9][0-9]{0,17})"
_SHAPE_RE = re.compile(rf"\[ *(?:{_DIM} *(?:, *{_DIM} *){{0,{MAX_SHAPE_DIMS - 1}}})?\]")


def _check_shape_text(raw: str | None, chunk_index: int) -> tuple[int, ...] | None:
    """The dimensions of a payload's ``gradient_shape`` metadata (None when absent), or
    ArrowIpcError when it does not follow the grammar above."""
    if raw is None:
        return None
    if _SHAPE_RE.fullmatch(raw) is None:
        raise ArrowIpcError(
            "gradient_shape metadata is not a list of at most 32 non-negative integers: "
            f"{raw[:100]}",
            chunk_index,
        )
    inner = raw[1:-1].strip(" ")
    dims = tuple(int(d.strip(" ")) for d in inner.split(",")) if inner else ()
    if not numpy_can_make(dims):
        raise ArrowIpcError(
            f"gradient_shape metadata {raw[:100]} is beyond what numpy can make: its "
            "non-zero dimensions multiply past 2^60",
            chunk_index,
        )
    return dims


def _shape_name(raw: str | None) -> str:
    return "none" if raw is None else raw


class _ShapeTracker:
    """The shape rules of one gradient: every chunk's ``gradient_shape`` (raw string, or
    absent) must equal the first accepted chunk's; the complete gradient must hold as many
    values as the shape's dimensions multiply to, and is then reshaped to it."""

    __slots__ = ("_dims", "_first_index", "_raw")

    def __init__(self) -> None:
        self._first_index: int | None = None
        self._raw: str | None = None
        self._dims: tuple[int, ...] | None = None

    def check(self, raw: str | None, chunk_index: int, offset: int | None) -> None:
        """Rule 1 for one chunk whose payload has decoded; the chunk is accepted by the
        caller only if every later check passes too (``accept``)."""
        dims = _check_shape_text(raw, chunk_index)
        if self._first_index is None:
            return
        if raw != self._raw:
            raise FrameError(
                f"chunks disagree on gradient_shape: chunk {self._first_index} says "
                f"{_shape_name(self._raw)}, chunk {chunk_index} says {_shape_name(raw)}",
                chunk_index,
                offset,
            )
        assert dims == self._dims

    def accept(self, raw: str | None, chunk_index: int) -> None:
        """Record the first accepted chunk's shape (a no-op for later ones)."""
        if self._first_index is None:
            self._first_index = chunk_index
            self._raw = raw
            self._dims = _check_shape_text(raw, chunk_index)

    def finish(self, count: int) -> None:
        """Rule 2, once the gradient is otherwise complete and valid."""
        dims = self._dims
        if dims is None:
            return
        product = 1
        for d in dims:
            product *= d
        if product != count:
            raise FrameError(
                f"gradient_shape {self._raw} holds {product} values; the gradient has {count}",
                None,
                None,
            )

    def shape(self, values: np.ndarray) -> np.ndarray:
        """Rule 3: ``values`` (1-D, C order) reshaped to the shape, a view; as is without
        one."""
        if self._dims is None:
            return values
        shaped: np.ndarray = values.reshape(self._dims)
        return shaped


# --------------------------------------------------------------------------- dtypes
# keep_dtype / wire_dtype: the value column's dtype and the gradient_dtype metadata.


def _dtype_text(raw: str | None) -> str:
    return "none" if raw is None else raw


class _DtypeTracker:
    """The dtype rules of one gradient: every chunk's value column dtype and its
    ``gradient_dtype`` metadata (or its absence) must be the first accepted chunk's, and
    the dtype handed back must be that of ``out=``; checked before a chunk's record batches
    are read. Once complete, the values are cast from the column's dtype to the one handed
    back."""

    __slots__ = ("_column", "_dtype", "_first_index", "_result")

    def __init__(self) -> None:
        self._first_index: int | None = None
        self._column = "float32"  # what the first chunk's column holds: a dtype, or int8
        self._dtype = "float32"  # the empty input's
        self._result: str | None = None

    def check(
        self, head: _Head, chunk_index: int, offset: int | None, out: np.ndarray | None
    ) -> None:
        """For one chunk whose schema has been read; the chunk is accepted by the caller
        only if every later check passes too (``accept``)."""
        first = self._first_index
        if first is not None:
            if head.column_name != self._column:
                raise FrameError(
                    f"chunks disagree on the value dtype: chunk {first} holds {self._column}, "
                    f"chunk {chunk_index} holds {head.column_name}",
                    chunk_index,
                    offset,
                )
            if head.result != self._result:
                raise FrameError(
                    f"chunks disagree on gradient_dtype: chunk {first} says "
                    f"{_dtype_text(self._result)}, chunk {chunk_index} says "
                    f"{_dtype_text(head.result)}",
                    chunk_index,
                    offset,
                )
        if out is not None:
            received = _dtypes.hand_back(head.name)
            expected = _dtypes.dtype_name(out.dtype)
            assert expected is not None  # value_buffer checked it
            if expected != received:
                raise GradientDtypeError(expected, received, chunk_index)

    def accept(self, head: _Head, chunk_index: int) -> None:
        """Record the first accepted chunk's dtypes (a no-op for later ones)."""
        if self._first_index is None:
            self._first_index = chunk_index
            self._column = head.column_name
            self._dtype = head.dtype
            self._result = head.result

    @property
    def storage(self) -> np.dtype:
        """The numpy dtype the column's values are held in (bfloat16 as uint16)."""
        return _STORAGE[self._dtype]

    def hand_back(self, values: np.ndarray) -> np.ndarray:
        """Values of the column's dtype (a 1-D array of ``storage``), cast by the cast rule
        to the dtype handed back, in its numpy form (bfloat16 as ml_dtypes.bfloat16, or
        widened to float32 without ml_dtypes). A new array, or ``values`` itself when no
        cast is needed."""
        name = self._dtype if self._result is None else self._result
        return _dtypes.as_hand_back(_dtypes.cast(values, self._dtype, name), name)


def _verify_checksum(chunk_index: int, checksum: int, payload: memoryview) -> None:
    # Integrity first: a payload is never parsed before its CRC-32 matched.
    actual = zlib.crc32(payload)
    if actual != checksum:
        raise ChecksumMismatchError(chunk_index, checksum, actual)


def _room(max_gradient_len: int, accepted: int) -> int:
    """The values max_gradient_len still allows after ``accepted`` (never below 0:
    decode_chunks does not hold uncompressed chunks to the limit, so they may pass it)."""
    return max(max_gradient_len - accepted, 0)


class _ChunkFields(NamedTuple):
    """What decode_chunks needs from a chunk of any implementation."""

    chunk_index: int
    total_chunks: int
    checksum: int
    payload: memoryview


def _chunk_fields(chunk: Any) -> _ChunkFields:
    # Duck typing: native chunks, reference chunks and any look-alike object are all read
    # through these four attributes.
    try:
        index, total = chunk.chunk_index, chunk.total_chunks
        checksum, payload = chunk.checksum, chunk.arrow_ipc_bytes
    except AttributeError:
        raise TypeError(
            "decode_chunks expects chunk objects with chunk_index, total_chunks, checksum "
            f"and arrow_ipc_bytes attributes, not {type(chunk).__name__}"
        ) from None
    return _ChunkFields(
        _check_u32(index, "chunk_index"),
        _check_u32(total, "total_chunks"),
        _check_u32(checksum, "checksum"),
        _byte_view(payload),
    )


# --------------------------------------------------------------------------- decoding rules


def _check_chunk_set(chunks: list[_ChunkFields]) -> None:
    """decode_chunks rule 3 over chunks sorted by index: the first offender raises."""
    first = chunks[0]
    total = first.total_chunks
    previous: int | None = None
    for chunk in chunks:
        index = chunk.chunk_index
        if chunk.total_chunks != total:
            raise FrameError(_disagree(first.chunk_index, total, index, chunk.total_chunks), index)
        if index == previous:
            raise FrameError(_duplicate(index), index)
        if index >= total:
            raise FrameError(_out_of_range(index, total), index)
        previous = index


def _decode_chunk_list(
    chunks: list[_ChunkFields], max_gradient_len: int, seal: Expect = WHEN_PRESENT
) -> np.ndarray:
    if not chunks:  # rule 1
        return _empty_vector()
    chunks = sorted(chunks, key=lambda c: c.chunk_index)  # rule 2; sorted() is stable
    _check_chunk_set(chunks)  # rule 3
    total = chunks[0].total_chunks
    if len(chunks) != total:  # rule 4
        raise IncompleteStreamError(len(chunks), total)
    # Rule 5: CRC then decode, chunk after chunk, in index order. A compressed chunk's
    # declared rows are held to what max_gradient_len leaves after the chunks before it.
    # Before its record batches are read, the chunk's seal (whenever it has one) and
    # its value dtype and gradient_dtype: the same as the lowest index's. After them, its
    # gradient_shape: well formed, and the same as the lowest index's.
    parts: list[np.ndarray] = []
    accepted = 0
    seals = _SealTracker(seal, LONE)
    dtype = _DtypeTracker()
    shape = _ShapeTracker()
    for c in chunks:
        index = c.chunk_index
        _verify_checksum(index, c.checksum, c.payload)
        reader, head = _open_payload(c.payload, index, _room(max_gradient_len, accepted))
        transfer = seals.check(head.seal, index, c.total_chunks, None)
        dtype.check(head, index, None, None)
        chunk_parts = _read_values(reader, head, index)
        shape.check(head.shape, index, None)
        seals.accept(index, transfer)
        dtype.accept(head, index)
        shape.accept(head.shape, index)
        accepted += sum(len(part) for part in chunk_parts)
        parts.extend(chunk_parts)
    shape.finish(accepted)
    return shape.shape(dtype.hand_back(_concat(parts, dtype.storage)))
