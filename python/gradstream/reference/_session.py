"""Pure-Python reference implementation of gradstream (numpy + pyarrow + zlib + struct).

It mirrors the native module's API and follows the README's "Wire format" and "Decoding
rules" step by step, so that for any input both raise the same exception class with the
same fields. It is the executable form of the spec: keep it obvious rather than fast.

Two things hold throughout:

* values are moved as raw words (numpy views, Arrow buffers, memcpy-style
  concatenation) and never pass through another dtype unless the dtypes rules cast them
  (``_dtypes.cast``, README "The cast rule"), so NaN payloads, -0.0 and subnormals survive
  bit for bit;
* this module imports only ``.errors``, ``._convert``, ``._dtypes`` and (for tensor sets,
  when called) ``._tensors`` from the package, never the native extension, so it works (and
  can judge the extension) when the extension is absent.

The decoding rules for frames live in one place, ``_FrameReceiver``, a sans-I/O state
machine that is fed one header or one payload at a time. ``decode_frames`` drives it over
bytes in memory; ``receive_from`` / ``receive_iter`` drive it over a socket or an asyncio
stream (README "Streaming"), with plain asyncio and no threads.

Caller-provided buffers (``out=``): ``decode_frames`` and ``receive_from`` can write the
gradient into an array the caller owns, chunk by chunk as the chunks come into index order
(a chunk that arrives early is held until its turn), and refuse a gradient of another size
with ``GradientSizeError`` (of another dtype: ``GradientDtypeError``); ``encode_frames``
can write the frames into any writeable buffer, whose size ``frames_len`` tells without
encoding anything (but for a compressed, keep_shape or keep_dtype session, or a wire_dtype
other than float32, whose payload sizes depend on the values, the shape or the dtype).

Compression (``compression="lz4"`` or ``"zstd"``): the payload is the same Arrow IPC file
with the IPC BodyCompression on its record batch. Every session decodes compressed
payloads whatever its own setting, and holds each compressed batch to bounds before
pyarrow reads it (``_check_compressed_batches``): an Arrow reader allocates whatever
uncompressed length a compressed buffer declares.

Shapes (``keep_shape=True``): the sender writes the gradient's shape into every payload's
schema metadata (``gradient_shape``, a compact JSON array such as ``[768,3072]``); every
receiver checks it chunk by chunk (``_check_shape_text``, ``_ShapeTracker``) and reshapes
the result once the gradient is complete.

Dtypes (``keep_dtype=True``, ``wire_dtype=``): the ``value`` column is Float32, Float16,
Float64 or UInt16 tagged ``gradstream.bfloat16``; the schema metadata ``gradient_dtype``
names the dtype to hand back when it is not the column's. The sender casts with
``_dtypes.prepare``; the receiver checks every chunk's column dtype and gradient_dtype
against the first chunk taken (``_DtypeTracker``), before its record batches are read,
keeps the values in the column's dtype until the gradient is complete (or until they go
into ``out=``) and then casts them with ``_dtypes.cast``.
"""

from __future__ import annotations

import asyncio
import functools
import operator
import re
import socket
import ssl
import struct
import zlib
from collections.abc import AsyncIterator, Iterable, Iterator
from typing import Any, Literal, NamedTuple, overload

import numpy as np
import pyarrow as pa
import pyarrow.ipc

from .. import _dtypes
from .._convert import byte_view as _byte_view
from .._convert import check_bool as _check_bool
from .._convert import frame_buffer, value_buffer
from .._convert import shape_text as _shape_text
from .._dtypes import DTYPE_KEY, DTYPES, is_bfloat16_type, numpy_can_make
from .._io import Stalled, within
from ..errors import (
    ArrowIpcError,
    ChecksumMismatchError,
    FrameError,
    GradientDtypeError,
    GradientSizeError,
    IncompleteStreamError,
    SettingError,
    StreamIOError,
    StreamTimeoutError,
)

__all__ = ["GradientChunk", "GradientStreamSession", "TransferProgress"]

DEFAULT_CHUNK_SIZE = 65_536
DEFAULT_MAX_PAYLOAD_LEN = 268_435_456  # 256 MiB
DEFAULT_MAX_GRADIENT_LEN = 1_073_741_824  # 2**30 values, 4 GiB of float32
U32_MAX = 2**32 - 1
USIZE_MAX = 2**64 - 1  # chunk_size is a usize in the native core

# Frame header: chunk_index, total_chunks, payload_len, checksum, four little-endian u32.
HEADER = struct.Struct("<IIII")
HEADER_LEN = HEADER.size  # 16

# The "seed layout" of a payload, as ipfrs-tensorlogic writes it (float32 values).
PAYLOAD_SCHEMA = pa.schema(
    [
        pa.field("index", pa.int32(), nullable=False),
        pa.field("value", pa.float32(), nullable=False),
    ]
)

# What pyarrow raises for bytes it cannot read: its own exception classes, plain OSError
# (pyarrow.ArrowIOError is an alias of OSError, used e.g. for a corrupt footer) and
# UnicodeDecodeError for a field name that is not UTF-8 (arrow-rs's flatbuffer verifier
# refuses those too).
_ARROW_FAILURES = (pa.ArrowException, OSError, UnicodeDecodeError)

# An encoded payload holds an int32 index (seed layout) and a value per element, so a
# chunk of n values can never take fewer than (4 + width) * n bytes, or width * n in the
# compact layout; used to refuse oversized chunks early.
_INDEX_BYTES_PER_VALUE = 4


# --------------------------------------------------------------------------- argument checks


def _check_str(value: Any, name: str) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{name} must be str, not {type(value).__name__}")
    return value


def _check_u32(value: Any, name: str) -> int:
    # operator.index rejects floats and other non-integers with TypeError; the range error is
    # an OverflowError because that is what a u32 conversion raises on the native side.
    number = operator.index(value)
    if not 0 <= number <= U32_MAX:
        raise OverflowError(f"{name} must be in 0..{U32_MAX}, got {number}")
    return number


Compression = Literal["lz4", "zstd"]
COMPRESSIONS: tuple[Compression, ...] = ("lz4", "zstd")


def _check_compression_setting(value: Any) -> Compression | None:
    """The constructor's ``compression``: None/False (off), True or "lz4" (LZ4 frame), or
    "zstd". A bool is a bool: 0 and 1 (which equal False and True) are refused."""
    if value is None or value is False:
        return None
    if value is True:
        return "lz4"
    if isinstance(value, str):
        for name in COMPRESSIONS:
            if value == name:
                return name
        raise SettingError(
            "compression", f"compression must be None, True, False, 'lz4' or 'zstd', got {value!r}"
        )
    raise TypeError(
        f"compression must be None, a bool, 'lz4' or 'zstd', got {type(value).__name__}"
    )


def _check_max_gradient_len(value: Any) -> int:
    number = operator.index(value)
    # A count of values, a usize in the native core. 0 is refused (as max_payload_len 0 is):
    # a limit that lets nothing but the empty gradient through is more likely a bug.
    if not 1 <= number <= USIZE_MAX:
        raise SettingError(
            "max_gradient_len", f"max_gradient_len must be between 1 and {USIZE_MAX}, got {number}"
        )
    return number


def _check_timeout(value: Any) -> float | None:
    if value is None:
        return None
    # What float() accepts from a number (int, float, numpy scalars, Decimal...), but not
    # a str, which float() would parse.
    kind = type(value)
    if not (hasattr(kind, "__float__") or hasattr(kind, "__index__")):
        raise TypeError(f"timeout must be None or a number, not {kind.__name__}")
    seconds = float(value)
    # NaN fails the comparison; infinity is None's job ("wait for ever").
    if not 0.0 < seconds < float("inf"):
        raise SettingError(
            "timeout", f"timeout must be None or a positive number of seconds, got {value!r}"
        )
    return seconds


def _check_wire_dtype(value: Any) -> str | None:
    """The constructor's ``wire_dtype``: None, or one of the four dtype names."""
    if value is None:
        return None
    if isinstance(value, str):
        for name in DTYPES:
            if value == name:
                return name
        raise SettingError(
            "wire_dtype",
            "wire_dtype must be None, 'float16', 'bfloat16', 'float32' or 'float64', "
            f"got {value!r}",
        )
    raise TypeError(f"wire_dtype must be None or a dtype name (str), not {type(value).__name__}")


def _flat(out: np.ndarray) -> np.ndarray:
    """The 1-D view of a checked decode ``out=`` (C-contiguous, so never a copy)."""
    flat: np.ndarray = out.reshape(-1)
    return flat


def _to_bytes(data: Any) -> bytes:
    if type(data) is bytes:
        return data
    # Going through memoryview (not bytes(data)) so that an int is refused instead of being
    # taken as a length.
    return _byte_view(data).tobytes()


def _empty_vector() -> np.ndarray:
    return np.empty(0, dtype=np.float32)


def _concat(parts: Iterable[np.ndarray], dtype: np.dtype) -> np.ndarray:
    """``parts`` (1-D arrays of ``dtype``) end to end in a new array of ``dtype``."""
    # np.concatenate always allocates, so the result owns its memory and never aliases a
    # payload buffer (which may be the caller's bytes). It copies bytes, not float values.
    parts = list(parts)
    if not parts:
        return np.empty(0, dtype=dtype)
    return np.concatenate(parts)


# --------------------------------------------------------------------------- error messages
# The README fixes these texts; both implementations must produce them verbatim.


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

SHAPE_KEY = "gradient_shape"
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

    __slots__ = ("_dtype", "_first_index", "_result")

    def __init__(self) -> None:
        self._first_index: int | None = None
        self._dtype = "float32"  # the empty input's
        self._result: str | None = None

    def check(
        self, head: _Head, chunk_index: int, offset: int | None, out: np.ndarray | None
    ) -> None:
        """For one chunk whose schema has been read; the chunk is accepted by the caller
        only if every later check passes too (``accept``)."""
        first = self._first_index
        if first is not None:
            if head.dtype != self._dtype:
                raise FrameError(
                    f"chunks disagree on the value dtype: chunk {first} holds {self._dtype}, "
                    f"chunk {chunk_index} holds {head.dtype}",
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


# --------------------------------------------------------------------------- payload codec


# The "compact" layout: the value column alone (4 bytes a value instead of 8). The
# original's decoder only looks up `value`, so it reads these too.
COMPACT_SCHEMA = pa.schema([pa.field("value", pa.float32(), nullable=False)])
LAYOUTS = ("seed", "compact")

# Schema metadata keys gradstream reads and writes, in the order it writes them.
MANIFEST_KEY = "gradstream_tensors"

# The value column's Arrow type by dtype. bfloat16 is its storage type, UInt16, with the
# field metadata of the extension type gradstream.bfloat16 (what arrow-rs writes; pyarrow
# reads it back as _dtypes.BFloat16Type, registered when _dtypes is imported).
_ARROW_TYPES = {
    "float16": pa.float16(),
    "bfloat16": pa.uint16(),
    "float32": pa.float32(),
    "float64": pa.float64(),
}
_BF16_FIELD_METADATA = {
    b"ARROW:extension:name": _dtypes.BF16_EXTENSION.encode(),
    b"ARROW:extension:metadata": b"",
}
# The numpy dtype of a value column's values as they are moved (bfloat16 as its bits).
_STORAGE: dict[str, np.dtype] = {
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(np.uint16),
    "float32": np.dtype(np.float32),
    "float64": np.dtype(np.float64),
}
# Unsigned integers of each width, to move values of any dtype as raw bits.
_WORDS: dict[int, np.dtype] = {
    2: np.dtype(np.uint16),
    4: np.dtype(np.uint32),
    8: np.dtype(np.uint64),
}

NOT_A_FLOAT = "'value' column is not Float16, Float32, Float64 or gradstream.bfloat16"
BAD_DTYPE = "gradient_dtype metadata is not float16, bfloat16, float32 or float64"


@functools.cache
def _schema(layout: str, dtype: str) -> pa.Schema:
    """The schema of a payload in ``layout`` whose values are of ``dtype``."""
    if dtype == "float32":
        return COMPACT_SCHEMA if layout == "compact" else PAYLOAD_SCHEMA
    metadata = _BF16_FIELD_METADATA if dtype == "bfloat16" else None
    value = pa.field("value", _ARROW_TYPES[dtype], nullable=False, metadata=metadata)
    if layout == "compact":
        return pa.schema([value])
    return pa.schema([pa.field("index", pa.int32(), nullable=False), value])


def encode_payload(
    values: np.ndarray,
    layout: str = "seed",
    compression: str | None = None,
    shape: str | None = None,
    *,
    dtype: str = "float32",
    result: str | None = None,
    manifest: str | None = None,
) -> bytes:
    """Encode a 1-D vector of ``dtype`` values (bfloat16 as uint16 bits) as an Arrow IPC
    file in the seed or compact layout.

    With ``compression`` ("lz4" or "zstd") the record batch carries the IPC BodyCompression
    (codec LZ4_FRAME or ZSTD, method BUFFER): every buffer is stored as its uncompressed
    length (int64) followed by the compressed bytes. The schema carries, in this order and
    only those given, the custom metadata ``gradient_shape`` = ``shape`` (``_shape_text`` of
    the gradient's shape), ``gradient_dtype`` = ``result`` (the dtype the receiver hands
    back, when it is not ``dtype``) and ``gradstream_tensors`` = ``manifest``. The file is
    otherwise the same.
    """
    n = len(values)
    # from_buffers wraps the words as they are: no conversion, no NaN canonicalising.
    value_array = pa.Array.from_buffers(_ARROW_TYPES[dtype], n, [None, pa.py_buffer(values)])
    schema = _schema(layout, dtype)
    if layout == "compact":
        columns = [value_array]
    else:
        index_array = pa.array(np.arange(n, dtype=np.int32), type=pa.int32())
        columns = [index_array, value_array]
    metadata = {
        key: text
        for key, text in ((SHAPE_KEY, shape), (DTYPE_KEY, result), (MANIFEST_KEY, manifest))
        if text is not None
    }
    if metadata:
        schema = schema.with_metadata(metadata)
    batch = pa.RecordBatch.from_arrays(columns, schema=schema)
    sink = pa.BufferOutputStream()
    options = None if compression is None else pa.ipc.IpcWriteOptions(compression=compression)
    # Exactly one batch, even when it is empty: an empty gradient is one empty batch.
    with pa.ipc.new_file(sink, schema, options=options) as writer:
        writer.write_batch(batch)
    payload: bytes = sink.getvalue().to_pybytes()
    return payload


def _storage_type(data_type: pa.DataType) -> pa.DataType:
    # arrow-rs keeps extension types as field metadata over their storage type, so to the
    # native decoder an extension column stored as Float32 *is* Float32; do the same here.
    if isinstance(data_type, pa.BaseExtensionType):
        return data_type.storage_type
    return data_type


def _value_field_index(names: list[str]) -> int | None:
    # The first field named 'value', as arrow-rs column_by_name picks it
    # (pyarrow's get_field_index returns -1 when the name is duplicated).
    for i, name in enumerate(names):
        if name == "value":
            return i
    return None


_BLOCK = struct.Struct("<qi4xq")  # Block: offset, metaDataLength, padding, bodyLength


def _footer_blocks(payload: memoryview, field_index: int = 3) -> list[tuple[int, int, int]] | None:
    """The footer's record-batch blocks as (offset, metadata length, body length), or None
    when the footer has no recordBatches field (field 3 of the Footer table).

    A minimal flatbuffer walk: trailer -> footer -> root table -> vtable -> slot 3 -> vector.
    Numbers that point outside the footer give [] (no verdict), leaving it to pyarrow.
    """
    size = len(payload)
    (footer_len,) = struct.unpack_from("<i", payload, size - 10)
    start, end = size - 10 - footer_len, size - 10
    if footer_len < 4 or start < 8:
        return []
    footer = payload[start:end]

    def read(fmt: str, pos: int) -> int | None:
        if pos < 0 or pos + struct.calcsize(fmt) > len(footer):
            return None
        value: int = struct.unpack_from(fmt, footer, pos)[0]
        return value

    table = read("<I", 0)
    soffset = None if table is None else read("<i", table)
    if table is None or soffset is None:
        return []
    vtable = table - soffset
    vtable_len = read("<H", vtable)
    if vtable_len is None or read("<H", vtable + vtable_len - 2) is None:
        return []
    # After vtable_len and table_len, the field's offset: 3 is recordBatches, 2 dictionaries.
    slot = 4 + 2 * field_index
    field = read("<H", vtable + slot) if vtable_len > slot else 0
    if not field:
        return None
    vector_ref = read("<I", table + field)
    if vector_ref is None:
        return []
    vector = table + field + vector_ref
    count = read("<I", vector)
    if count is None or vector + 4 + count * _BLOCK.size > len(footer):
        return []
    return [_BLOCK.unpack_from(footer, vector + 4 + i * _BLOCK.size) for i in range(count)]


def _check_footer(payload: memoryview, chunk_index: int) -> list[tuple[int, int, int]]:
    """What pyarrow does not check and arrow-rs (or the native decoder) does; the footer's
    record-batch blocks (see _footer_blocks)."""
    # pyarrow only looks at the trailing magic.
    if len(payload) < 18 or bytes(payload[:6]) != b"ARROW1":
        raise ArrowIpcError("not an Arrow IPC file (no ARROW1 magic at the start)", chunk_index)
    blocks = _footer_blocks(payload)
    # pyarrow reads a footer without a record-batch list as a file with no batches.
    if blocks is None:
        raise ArrowIpcError("IPC footer lists no record batches", chunk_index)
    # pyarrow decodes every dictionary batch (decompressing it to whatever size it
    # declares) before any record batch; a gradient payload has none.
    dictionaries = _footer_blocks(payload, 2)
    if dictionaries:
        raise ArrowIpcError(
            f"IPC footer lists {len(dictionaries)} dictionary batch(es); a gradient payload "
            "has none",
            chunk_index,
        )
    # pyarrow would decode a block listed many times again each time: a small payload
    # could then decode to gigabytes. Writers lay blocks out in order, without overlap.
    free_from = 8
    for offset, meta_len, body_len in blocks:
        if offset < free_from:
            raise ArrowIpcError(
                f"IPC record batch block at offset {offset} overlaps the one before it",
                chunk_index,
            )
        free_from = offset + meta_len + body_len
    return blocks


# IPC encapsulated message: continuation marker, then the metadata length, then the
# Message flatbuffer (a file written before Arrow 0.15 has the length alone).
_CONTINUATION = 0xFFFF_FFFF
_MESSAGE_HEADER_RECORD_BATCH = 3  # MessageHeader union: 3 is RecordBatch
_BUFFER = struct.Struct("<qq")  # Buffer: offset (from the body's start), length
_CODECS = (0, 1)  # CompressionType: LZ4_FRAME, ZSTD
_METHODS = (0,)  # BodyCompressionMethod: BUFFER
_NO_COMPRESSION_PREFIX = -1  # a buffer's length prefix when it is stored uncompressed


# What a compressed batch may declare uncompressed, in bytes a row: each buffer alone (a
# float64 value is the widest), and all of a batch's buffers together.
_BUFFER_BYTES_PER_ROW = 8
_ALL_BUFFERS_BYTES_PER_ROW = 16


class _CompressedBatch(NamedTuple):
    """What the compression checks need from one compressed record batch message."""

    rows: int  # RecordBatch.length
    codec: int  # BodyCompression.codec (a flatbuffer byte: signed)
    method: int  # BodyCompression.method
    buffers: list[tuple[int, int]]  # Buffer structs: (offset from the body's start, length)


class _Flat:
    """Bounds-checked reads of flatbuffer tables inside one payload. Every read returns
    None when the bytes it needs are not all inside the payload."""

    __slots__ = ("data",)

    def __init__(self, data: memoryview) -> None:
        self.data = data

    def holds(self, pos: int | None, size: int) -> bool:
        return pos is not None and 0 <= pos and pos + size <= len(self.data)

    def read(self, fmt: str, pos: int | None) -> int | None:
        if pos is None or not self.holds(pos, struct.calcsize(fmt)):
            return None
        value: int = struct.unpack_from(fmt, self.data, pos)[0]
        return value

    def deref(self, pos: int | None) -> int | None:
        """The position an unsigned 32-bit flatbuffer offset stored at ``pos`` points to."""
        offset = self.read("<I", pos)
        return None if offset is None or pos is None else pos + offset

    def field(self, table: int | None, field: int) -> tuple[bool, int | None]:
        """(present, position of the field's data) of field number ``field`` of the table
        at ``table``; (True, None) when the table or its vtable cannot be read."""
        soffset = self.read("<i", table)
        if table is None or soffset is None:
            return True, None
        vtable = table - soffset
        vtable_len = self.read("<H", vtable)
        if vtable_len is None:
            return True, None
        slot = 4 + 2 * field  # after the vtable's own length and the table's length
        if vtable_len < slot + 2:
            return False, None  # a vtable too short for the field: absent (the default)
        voffset = self.read("<H", vtable + slot)
        if voffset is None:
            return True, None
        if voffset == 0:
            return False, None
        return True, table + voffset

    def scalar(self, fmt: str, table: int | None, field: int, default: int) -> int | None:
        """A scalar field, its default when absent, None when unreadable."""
        present, pos = self.field(table, field)
        return self.read(fmt, pos) if present else default


def _compressed_batch(flat: _Flat, offset: int) -> _CompressedBatch | None:
    """The compression facts of the record batch message at ``offset`` (a footer block's),
    or None when it is not a compressed record batch, or when some number needed points
    outside the payload: no verdict then, the Arrow reader judges the message (its
    flatbuffer verifier refuses anything reaching outside the metadata)."""
    # The metadata: continuation marker and length, then the Message flatbuffer.
    marker = flat.read("<I", offset)
    if marker is None:
        return None
    message = flat.deref(offset + 8 if marker == _CONTINUATION else offset + 4)
    # Message: 0 version, 1 header_type, 2 header, 3 bodyLength, 4 custom_metadata.
    header_type = flat.scalar("<B", message, 1, 0)
    if header_type != _MESSAGE_HEADER_RECORD_BATCH:
        return None  # not a record batch (or unreadable): the reader refuses it
    present, header_at = flat.field(message, 2)
    header = flat.deref(header_at) if present else None
    if header is None:
        return None
    # RecordBatch: 0 length, 1 nodes, 2 buffers, 3 compression.
    present, compression_at = flat.field(header, 3)
    if not present:
        return None  # uncompressed: nothing to check here
    compression = flat.deref(compression_at)
    rows = flat.scalar("<q", header, 0, 0)
    # BodyCompression: 0 codec (byte, default LZ4_FRAME), 1 method (byte, default BUFFER).
    codec = flat.scalar("<b", compression, 0, 0)
    method = flat.scalar("<b", compression, 1, 0)
    if compression is None or rows is None or codec is None or method is None:
        return None
    buffers: list[tuple[int, int]] = []
    present, buffers_at = flat.field(header, 2)
    if present:
        vector = flat.deref(buffers_at)
        count = flat.read("<I", vector)
        if vector is None or count is None or not flat.holds(vector + 4, count * _BUFFER.size):
            return None
        buffers = [
            _BUFFER.unpack_from(flat.data, vector + 4 + i * _BUFFER.size) for i in range(count)
        ]
    return _CompressedBatch(rows, codec, method, buffers)


def _check_compressed_batches(
    payload: memoryview, blocks: list[tuple[int, int, int]], room: int, chunk_index: int
) -> None:
    """Refuse compressed record batches whose declared sizes are out of bounds, before
    pyarrow reads them: an Arrow reader allocates whatever uncompressed length each
    compressed buffer declares, so a payload of a kilobyte could otherwise make it
    allocate terabytes. ``room``: the values max_gradient_len still allows for this chunk.
    """
    flat = _Flat(payload)
    for offset, meta_len, _body_len in blocks:
        batch = _compressed_batch(flat, offset)
        if batch is None:
            continue
        # In this order: the codec and method say how to read the buffers at all; then the
        # rows; then each buffer's declared length against them.
        if batch.codec not in _CODECS:
            raise ArrowIpcError(f"unknown IPC compression codec {batch.codec}", chunk_index)
        if batch.method not in _METHODS:
            raise ArrowIpcError(f"unknown IPC compression method {batch.method}", chunk_index)
        rows = batch.rows
        # A negative count fits no room either (the native core reads it as unsigned).
        if not 0 <= rows <= room:
            raise ArrowIpcError(
                f"compressed record batch declares {rows} rows, more than the {room} values "
                "max_gradient_len still allows",
                chunk_index,
            )
        body = offset + meta_len
        total = 0
        for buf_offset, length in batch.buffers:
            if length <= 0:
                continue
            if length < 8:
                raise ArrowIpcError(
                    f"compressed IPC buffer of {length} bytes has no length prefix", chunk_index
                )
            # A prefix outside the payload: the buffer lies outside the body, which the
            # reader refuses before decompressing anything.
            declared = flat.read("<q", body + buf_offset)
            if declared is None or declared == _NO_COMPRESSION_PREFIX:
                continue
            if not 0 <= declared <= _BUFFER_BYTES_PER_ROW * rows:
                raise ArrowIpcError(
                    f"compressed IPC buffer declares {declared} bytes uncompressed, more than "
                    f"its {rows}-row batch can hold",
                    chunk_index,
                )
            total += declared
        # All buffers together, too: a schema of many columns must not multiply the bound.
        # 16 bytes a row: a seed float64 batch needs 12 (a 4-byte index and an 8-byte value).
        if total > _ALL_BUFFERS_BYTES_PER_ROW * rows:
            raise ArrowIpcError(
                f"compressed IPC buffers declare {total} bytes uncompressed in all, more than "
                f"their {rows}-row batch can hold",
                chunk_index,
            )
        # The compressed batches of one payload share the room.
        room -= rows


def _schema_metadata(schema: pa.Schema) -> dict[str, str]:
    """The schema's custom metadata as str, the first entry of each key (as pyarrow keeps
    it; the native decoder takes the first too).

    Every key and value must be UTF-8 (arrow-rs's flatbuffer verifier refuses the schema
    otherwise): UnicodeDecodeError, which the caller turns into ArrowIpcError.
    """
    metadata = schema.metadata or {}
    return {key.decode("utf-8"): value.decode("utf-8") for key, value in metadata.items()}


def _column_dtype(data_type: pa.DataType) -> str | None:
    """The dtype of a 'value' column of this Arrow type, None when it holds none of them.

    bfloat16 is UInt16 with the extension name gradstream.bfloat16 (read by pyarrow as
    BFloat16Type); a UInt16 without it is not a dtype. A Float16/32/64 column is its dtype
    whatever extension name its field carries (arrow-rs keeps extension types as field
    metadata over their storage type).
    """
    if is_bfloat16_type(data_type):
        return "bfloat16"
    storage = _storage_type(data_type)
    for name in ("float16", "float32", "float64"):
        if storage == _ARROW_TYPES[name]:
            return name
    return None


class _Head(NamedTuple):
    """What a payload's schema says, checked before any of its record batches is read."""

    column: int  # of the 'value' field
    dtype: str  # of the value column
    result: str | None  # gradient_dtype metadata (one of DTYPES), None when absent
    shape: str | None  # gradient_shape metadata, raw (checked after the batches)
    manifest: str | None  # gradstream_tensors metadata, raw

    @property
    def name(self) -> str:
        """The dtype the gradient is handed back in (before the bfloat16 fallback)."""
        return self.result if self.result is not None else self.dtype


def _open_payload(
    payload: memoryview, chunk_index: int, room: int
) -> tuple[pa.ipc.RecordBatchFileReader, _Head]:
    """Open a payload and check its schema, before any record batch is read: the 'value'
    column and its dtype, then the gradient_dtype metadata.

    Any failure of pyarrow itself becomes ArrowIpcError with pyarrow's message. ``room``:
    the values max_gradient_len still allows for this chunk (for compressed batches).
    """
    blocks = _check_footer(payload, chunk_index)
    _check_compressed_batches(payload, blocks, room, chunk_index)
    try:
        reader = pa.ipc.open_file(pa.py_buffer(payload))
        schema = reader.schema
        names = schema.names  # decodes the names, which may fail
        metadata = _schema_metadata(schema)
    except _ARROW_FAILURES as exc:
        raise ArrowIpcError(str(exc), chunk_index) from exc

    # The schema is checked before any batch, so a file with no batch at all is still held
    # to the layout.
    column = _value_field_index(names)
    if column is None:
        raise ArrowIpcError("Arrow IPC block missing 'value' column", chunk_index)
    dtype = _column_dtype(schema.field(column).type)
    if dtype is None:
        raise ArrowIpcError(NOT_A_FLOAT, chunk_index)
    result = metadata.get(DTYPE_KEY)
    if result is not None and result not in DTYPES:
        raise ArrowIpcError(BAD_DTYPE, chunk_index)
    head = _Head(column, dtype, result, metadata.get(SHAPE_KEY), metadata.get(MANIFEST_KEY))
    return reader, head


def _read_values(
    reader: pa.ipc.RecordBatchFileReader, head: _Head, chunk_index: int
) -> list[np.ndarray]:
    """The 'value' column of every record batch, validated, as numpy views (in the column's
    dtype, bfloat16 as uint16 bits) over the payload bytes, or over the decompressed
    buffers (no copy): the caller copies them where they belong."""
    columns = []
    for i in range(reader.num_record_batches):
        try:
            values = reader.get_batch(i).column(head.column)
            # Full validation of the one column we read, before touching its buffers: a
            # hostile file must fail here, never read out of bounds later. Other columns
            # (the index) are ignored as the original ignores them, damaged or not.
            values.validate(full=True)
        except _ARROW_FAILURES as exc:
            raise ArrowIpcError(str(exc), chunk_index) from exc
        columns.append(values)
    parts = []
    for column in columns:
        if isinstance(column, pa.ExtensionArray):
            column = column.storage
        if column.null_count > 0:
            # Stricter than the original, which returns whatever bytes sit under a null.
            raise ArrowIpcError(
                f"'value' column has {column.null_count} null value(s)", chunk_index
            )
        # Without nulls a primitive array converts to numpy zero-copy, bits untouched.
        part: np.ndarray = column.to_numpy(zero_copy_only=True)
        assert part.dtype == _STORAGE[head.dtype], (part.dtype, head.dtype)
        parts.append(part)
    return parts


def decode_payload(payload: memoryview, chunk_index: int, room: int = USIZE_MAX) -> np.ndarray:
    """Decode one payload: the 'value' column of every batch, concatenated, in the column's
    dtype (bfloat16 as uint16 bits), not cast.

    ``room``: the values max_gradient_len still allows for the gradient; a compressed
    record batch declaring more rows is refused before it is decompressed. The payload's
    metadata (gradient_shape, gradient_dtype) is not looked at here, but for
    gradient_dtype's grammar.
    """
    reader, head = _open_payload(payload, chunk_index, room)
    return _concat(_read_values(reader, head, chunk_index), _STORAGE[head.dtype])


def _verify_checksum(chunk_index: int, checksum: int, payload: memoryview) -> None:
    # Integrity first: a payload is never parsed before its CRC-32 matched.
    actual = zlib.crc32(payload)
    if actual != checksum:
        raise ChecksumMismatchError(chunk_index, checksum, actual)


def _room(max_gradient_len: int, accepted: int) -> int:
    """The values max_gradient_len still allows after ``accepted`` (never below 0:
    decode_chunks does not hold uncompressed chunks to the limit, so they may pass it)."""
    return max(max_gradient_len - accepted, 0)


def _pad8(nbytes: int) -> int:
    return -(-nbytes // 8) * 8


@functools.cache
def _payload_len_constants(layout: str) -> tuple[int, int]:
    """(length of the empty payload, length of a one-value payload) in ``layout``, measured
    once from the writer itself."""
    return (
        len(encode_payload(np.empty(0, dtype=np.float32), layout)),
        len(encode_payload(np.zeros(1, dtype=np.float32), layout)),
    )


def payload_len(n_values: int, layout: str = "seed") -> int:
    """The exact length of ``encode_payload`` of ``n_values`` float32 values (no metadata,
    no compression), without encoding them.

    The IPC file's metadata (schema, record batch message, footer) has one size for every
    non-empty batch, because all its numbers are fixed-width fields; an empty batch is
    smaller, its zero lengths being flatbuffer defaults that are left out. The body holds
    one 4-byte-a-value buffer per column (index and value in the seed layout, value alone
    in the compact one), each padded to 8 bytes.
    """
    empty, one = _payload_len_constants(layout)
    if n_values == 0:
        return empty
    columns = 1 if layout == "compact" else 2
    return one + columns * (_pad8(4 * n_values) - _pad8(4))


# --------------------------------------------------------------------------- chunk


class GradientChunk:
    """One Arrow-IPC-encoded slice of a gradient with its CRC-32, as in the original."""

    __slots__ = ("_arrow_ipc_bytes", "_checksum", "_chunk_index", "_session_id", "_total_chunks")

    def __init__(
        self,
        session_id: str,
        chunk_index: int,
        total_chunks: int,
        arrow_ipc_bytes: Any,
        checksum: int,
    ) -> None:
        self._session_id = _check_str(session_id, "session_id")
        self._chunk_index = _check_u32(chunk_index, "chunk_index")
        self._total_chunks = _check_u32(total_chunks, "total_chunks")
        self._arrow_ipc_bytes = _to_bytes(arrow_ipc_bytes)
        self._checksum = _check_u32(checksum, "checksum")

    @property
    def session_id(self) -> str:
        return self._session_id

    @property
    def chunk_index(self) -> int:
        return self._chunk_index

    @property
    def total_chunks(self) -> int:
        return self._total_chunks

    @property
    def checksum(self) -> int:
        return self._checksum

    @property
    def arrow_ipc_bytes(self) -> bytes:
        return self._arrow_ipc_bytes

    @property
    def payload(self) -> pa.Buffer:
        """The payload as a pyarrow.Buffer over the same memory (no copy)."""
        return pa.py_buffer(self._arrow_ipc_bytes)

    @staticmethod
    def compute_checksum(data: Any) -> int:
        """CRC-32 (IEEE 802.3, as zlib.crc32 and crc32fast) of any bytes-like object."""
        return zlib.crc32(_byte_view(data))

    def verify_checksum(self) -> bool:
        return zlib.crc32(self._arrow_ipc_bytes) == self._checksum

    def __repr__(self) -> str:
        # The payload can be hundreds of KiB: show its length, not its bytes.
        return (
            f"GradientChunk(session_id={self._session_id!r}, chunk_index={self._chunk_index}, "
            f"total_chunks={self._total_chunks}, checksum={self._checksum:#010x}, "
            f"payload_len={len(self._arrow_ipc_bytes)})"
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, GradientChunk):
            return NotImplemented
        return (
            self._session_id == other._session_id
            and self._chunk_index == other._chunk_index
            and self._total_chunks == other._total_chunks
            and self._checksum == other._checksum
            and self._arrow_ipc_bytes == other._arrow_ipc_bytes
        )

    # Mutable-looking value objects with __eq__ are unhashable, as a PyO3 class with eq is.
    __hash__ = None  # type: ignore[assignment]


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


def _decode_chunk_list(chunks: list[_ChunkFields], max_gradient_len: int) -> np.ndarray:
    if not chunks:  # rule 1
        return _empty_vector()
    chunks = sorted(chunks, key=lambda c: c.chunk_index)  # rule 2; sorted() is stable
    _check_chunk_set(chunks)  # rule 3
    total = chunks[0].total_chunks
    if len(chunks) != total:  # rule 4
        raise IncompleteStreamError(len(chunks), total)
    # Rule 5: CRC then decode, chunk after chunk, in index order. A compressed chunk's
    # declared rows are held to what max_gradient_len leaves after the chunks before it.
    # Before its record batches are read, the chunk's value dtype and gradient_dtype: the
    # same as the lowest index's. After them, its gradient_shape: well formed, and the
    # same as the lowest index's.
    parts: list[np.ndarray] = []
    accepted = 0
    dtype = _DtypeTracker()
    shape = _ShapeTracker()
    for c in chunks:
        index = c.chunk_index
        _verify_checksum(index, c.checksum, c.payload)
        reader, head = _open_payload(c.payload, index, _room(max_gradient_len, accepted))
        dtype.check(head, index, None, None)
        chunk_parts = _read_values(reader, head, index)
        shape.check(head.shape, index, None)
        dtype.accept(head, index)
        shape.accept(head.shape, index)
        accepted += sum(len(part) for part in chunk_parts)
        parts.extend(chunk_parts)
    shape.finish(accepted)
    return shape.shape(dtype.hand_back(_concat(parts, dtype.storage)))


class _PendingFrame(NamedTuple):
    """A frame whose header has been read and whose payload is awaited."""

    chunk_index: int
    total_chunks: int
    payload_len: int
    checksum: int
    offset: int  # of the header, from the gradient's first byte


class _FrameReceiver:
    """decode_frames rules 1-9 as a sans-I/O state machine, for one gradient.

    The driver asks ``want`` for the number of bytes it needs next (a 16-byte header, then
    that header's payload), reads exactly that many and hands them to ``feed``, until
    ``done``. If the input ends first it calls ``end_of_stream`` with the number of the
    wanted bytes that did arrive. Every rule lives here, so decode_frames and the stream
    receivers raise the same errors for the same bytes. Any exception ends the gradient:
    a receiver is not fed again after one.

    The values are placed in index order as soon as they can be: chunk k goes in once
    chunks 0..k-1 have, and a chunk that arrives before its turn is held until then, in
    the value column's dtype. With ``out`` (a checked array of the caller's) they are cast
    to the dtype handed back and copied straight into it, so the receiver holds nothing but
    early chunks; the gradient must then have exactly ``out.size`` values
    (``GradientSizeError``) and come back in ``out``'s dtype (``GradientDtypeError``).
    Without ``out`` the values are kept in the column's dtype and cast once complete.
    """

    __slots__ = (
        "_copy_values",
        "_dtype",
        "_first",
        "_flat_out",
        "_held",
        "_manifest",
        "_max_gradient_len",
        "_max_payload_len",
        "_next",
        "_offset",
        "_out",
        "_pending",
        "_placed",
        "_pos",
        "_shape",
        "_values",
    )

    def __init__(
        self,
        max_payload_len: int,
        max_gradient_len: int,
        *,
        copy_values: bool,
        out: np.ndarray | None = None,
    ) -> None:
        self._max_payload_len = max_payload_len
        self._max_gradient_len = max_gradient_len
        # True when the fed payloads are transient buffers: values held for later are then
        # copied out, so that only one payload is held at a time, never all of them.
        self._copy_values = copy_values
        self._out = out
        # out= as raw words of its width: values go in as bits, never through a float.
        self._flat_out = None if out is None else _flat(out).view(_WORDS[out.dtype.itemsize])
        self._offset = 0  # of the next header, from the gradient's first byte
        self._pending: _PendingFrame | None = None
        self._first: tuple[int, int] | None = None  # (chunk_index, total_chunks)
        self._next = 0  # chunks 0.._next-1 are placed
        self._held: dict[int, list[np.ndarray]] = {}  # accepted before their turn
        self._placed: list[np.ndarray] = []  # without out: the values, in index order
        self._pos = 0  # values placed
        self._values = 0  # accepted so far, in arrival order
        self._shape = _ShapeTracker()  # gradient_shape: the first arrival's, checked
        self._dtype = _DtypeTracker()  # value dtype, gradient_dtype: likewise
        self._manifest: str | None = None  # the first arrival's gradstream_tensors

    @property
    def want(self) -> int:
        """Bytes needed next: a header, or the pending header's payload (may be 0)."""
        return HEADER_LEN if self._pending is None else self._pending.payload_len

    @property
    def done(self) -> bool:
        """As many frames as total_chunks have arrived: reading stops (rule 8)."""
        return self._first is not None and self.received == self._first[1]

    @property
    def received(self) -> int:
        return self._next + len(self._held)

    @property
    def total(self) -> int | None:
        """total_chunks, once a first frame has been accepted."""
        return None if self._first is None else self._first[1]

    @property
    def offset(self) -> int:
        """Bytes consumed: the offset of the next header."""
        return self._offset

    def feed(self, unit: memoryview) -> None:
        """Take exactly ``want`` bytes: a header or a payload."""
        assert len(unit) == self.want and not self.done
        if self._pending is None:
            self._feed_header(unit)
        else:
            self._feed_payload(self._pending, unit)

    def _feed_header(self, header: memoryview) -> None:
        index, total, payload_len, checksum = HEADER.unpack(header)
        # Rule 3 comes before any use of payload_len, so a hostile header costs nothing.
        if payload_len > self._max_payload_len:
            raise FrameError(
                f"chunk {index} declares a {payload_len}-byte payload, "
                f"above max_payload_len {self._max_payload_len}",
                index,
                self._offset,
            )
        self._pending = _PendingFrame(index, total, payload_len, checksum, self._offset)

    def _feed_payload(self, frame: _PendingFrame, payload: memoryview) -> None:
        index, total, offset = frame.chunk_index, frame.total_chunks, frame.offset
        # Rule 4 (truncation) is end_of_stream's: the whole payload is here.
        first = self._first if self._first is not None else (index, total)
        if total != first[1]:  # rule 5
            raise FrameError(_disagree(first[0], first[1], index, total), index, offset)
        # Every chunk carries at least one value, but the empty gradient's single chunk.
        limit = self._max_gradient_len
        if total > max(limit, 1):
            raise FrameError(f"total_chunks {total} above max_gradient_len {limit}", index, offset)
        if index >= total:  # rule 6
            raise FrameError(_out_of_range(index, total), index, offset)
        if index < self._next or index in self._held:  # rule 7
            raise FrameError(_duplicate(index), index, offset)
        # Rule 8: each frame is verified and decoded as it arrives.
        _verify_checksum(index, frame.checksum, payload)
        reader, head = _open_payload(payload, index, _room(limit, self._values))
        # The dtypes: after the schema, before the record batches are read.
        self._dtype.check(head, index, offset, self._out)
        parts = _read_values(reader, head, index)
        # The shape metadata: after the decode, before the values are counted.
        self._shape.check(head.shape, index, offset)
        count = self._values + sum(len(part) for part in parts)
        if count > limit:
            raise FrameError(
                f"gradient exceeds max_gradient_len {limit}: {count} values by chunk {index}",
                index,
                offset,
            )
        # out= runs over: checked on the same arrival-order count, after the limit.
        out = self._flat_out
        if out is not None and count > out.size:
            raise GradientSizeError(out.size, count, index)
        self._values = count
        if self._first is None:
            self._manifest = head.manifest
        self._first = first
        self._dtype.accept(head, index)
        self._shape.accept(head.shape, index)
        self._pending = None
        self._offset = offset + HEADER_LEN + frame.payload_len
        if index != self._next:
            # Early: held until its turn. The parts are views over the payload; a
            # transient payload is not kept, only a copy of its values (in the column's
            # dtype, as they came).
            held = [_concat(parts, self._dtype.storage)] if self._copy_values else parts
            self._held[index] = held
            return
        self._place(parts)
        while self._next in self._held:
            self._place(self._held.pop(self._next))

    def _place(self, parts: list[np.ndarray]) -> None:
        """Put chunk ``_next``'s values after those of the chunks before it."""
        out = self._flat_out
        for part in parts:
            n = len(part)
            if out is None:
                # np.concatenate copies: the result never aliases a payload buffer.
                self._placed.append(_concat([part], part.dtype))
            else:
                # Cast to the dtype handed back (out='s, checked), then copied as raw
                # words, so NaN payloads and -0.0 survive.
                values = self._dtype.hand_back(part)
                out[self._pos : self._pos + n] = values.view(out.dtype)
            self._pos += n
        self._next += 1

    @property
    def manifest(self) -> str | None:
        """The first accepted chunk's ``gradstream_tensors`` metadata (None if absent)."""
        return self._manifest

    def end_of_stream(self, got: int) -> None:
        """The input ended with ``got`` of the ``want`` bytes in. Returns only for the end
        before any byte (rule 1: an empty gradient, see ``_zero_values``); raises otherwise."""
        frame = self._pending
        if frame is not None:  # rule 4
            raise FrameError(
                f"truncated frame: chunk {frame.chunk_index} declares a "
                f"{frame.payload_len}-byte payload but only {got} bytes follow",
                frame.chunk_index,
                frame.offset,
            )
        if self._first is None:
            if got == 0:  # rule 1
                return
            # Rule 2: the original would silently return nothing here.
            raise FrameError(
                f"truncated frame header: {got} of {HEADER_LEN} bytes", None, self._offset
            )
        # Rule 9 (a header cut short after a frame counts as a missing frame).
        raise IncompleteStreamError(len(self._held) + self._next, self._first[1])

    def result(self) -> np.ndarray:
        """The gradient, once ``done`` and every other rule has passed: the values in index
        order, reshaped to the chunks' gradient_shape when they carry one (FrameError if it
        does not hold as many values), or ``out`` filled with them, in its own shape
        (GradientSizeError if it has room for more)."""
        assert self._first is not None and self.done and not self._held
        self._shape.finish(self._pos)
        if self._out is None:
            values = _concat(self._placed, self._dtype.storage)
            return self._shape.shape(self._dtype.hand_back(values))
        if self._pos != self._out.size:
            raise GradientSizeError(self._out.size, self._pos, None)
        return self._out


def _zero_values(out: np.ndarray | None) -> np.ndarray:
    """The gradient of an input that ended before its first byte (rule 1): zero values, as
    a new empty array or as ``out``, which must then have room for exactly none."""
    if out is None:
        return _empty_vector()
    if out.size != 0:
        raise GradientSizeError(out.size, 0, None)
    return out


def _decode_frame_stream(
    data: memoryview, max_payload_len: int, max_gradient_len: int, out: np.ndarray | None = None
) -> np.ndarray:
    """decode_frames: drive the receiver over bytes in memory, then rule 9's left-over, then
    the size of ``out``."""
    return _run_frames(data, max_payload_len, max_gradient_len, out)[0]


def _run_frames(
    data: memoryview, max_payload_len: int, max_gradient_len: int, out: np.ndarray | None
) -> tuple[np.ndarray, _FrameReceiver | None]:
    """_decode_frame_stream's gradient, and the receiver that read it (None for the empty
    input)."""
    receiver = _FrameReceiver(max_payload_len, max_gradient_len, copy_values=False, out=out)
    end = len(data)
    pos = 0
    while not receiver.done:
        want = receiver.want
        if end - pos < want:
            receiver.end_of_stream(end - pos)  # raises, but for the empty input
            return _zero_values(out), None
        receiver.feed(data[pos : pos + want])
        pos += want
    if pos < end:  # rule 9
        raise FrameError(f"{end - pos} bytes left over after the last chunk", None, pos)
    return receiver.result(), receiver


# --------------------------------------------------------------------------- progress


class TransferProgress:
    """Counters that transfers add to as they run, for a progress bar.

    ``bytes``: wire bytes moved; ``chunks``: frames completely sent, or received and
    accepted; ``total_chunks``: the frames announced (the plan's count when sending, the
    first frame's total_chunks when receiving; 0 until known). A transfer only ever adds
    to them, so an object passed to several transfers (or to receive_iter, which receives
    several gradients) counts all of them.
    """

    __slots__ = ("_bytes", "_chunks", "_total_chunks")

    def __init__(self) -> None:
        self._bytes = 0
        self._chunks = 0
        self._total_chunks = 0

    @property
    def bytes(self) -> int:
        return self._bytes

    @property
    def chunks(self) -> int:
        return self._chunks

    @property
    def total_chunks(self) -> int:
        return self._total_chunks

    def __repr__(self) -> str:
        return (
            f"TransferProgress(bytes={self._bytes}, chunks={self._chunks}, "
            f"total_chunks={self._total_chunks})"
        )


def _check_progress(progress: Any) -> TransferProgress | None:
    if progress is not None and not isinstance(progress, TransferProgress):
        raise TypeError(
            "progress must be a gradstream.reference.TransferProgress or None, "
            f"not {type(progress).__name__}"
        )
    return progress


def _count(
    progress: TransferProgress | None, nbytes: int = 0, chunks: int = 0, total_chunks: int = 0
) -> None:
    if progress is not None:
        progress._bytes += nbytes
        progress._chunks += chunks
        progress._total_chunks += total_chunks


# --------------------------------------------------------------------------- stream I/O
# Two channels move the bytes: one over a socket.socket (the event loop's sock_* calls and
# readiness callbacks) and one over asyncio streams. Both do partial reads and writes, so
# that the session's timeout bounds the time without a byte moving (not the time a whole
# payload takes), and the receiver can tell how many bytes of a unit arrived before the end.


# Largest piece handed to a StreamWriter before waiting for it to drain.
_WRITE_SLICE = 65_536


class _Channel:
    """Moves bytes for one transfer; every wait is bounded by the timeout."""

    def __init__(self, timeout: float | None) -> None:
        self.timeout = timeout

    def __enter__(self) -> None:
        pass

    def __exit__(self, *exc_info: object) -> None:
        pass

    async def recv_into(self, view: memoryview) -> int:
        """Read 1..len(view) bytes into view; 0 at the end of the stream."""
        raise NotImplementedError

    async def send(self, view: memoryview) -> int:
        """Write 1..len(view) bytes of view; how many."""
        raise NotImplementedError


# Sockets with a transfer running: [transfers, timeout to restore]. Several transfers may
# share one socket (a send and a receive at once, full duplex): the first makes the socket
# non-blocking, the last puts its mode back.
_ACTIVE_SOCKETS: dict[socket.socket, list[Any]] = {}


class _SocketChannel(_Channel):
    def __init__(self, sock: socket.socket, timeout: float | None) -> None:
        super().__init__(timeout)
        self.sock = sock
        self.loop = asyncio.get_running_loop()

    def __enter__(self) -> None:
        # loop.sock_* need a non-blocking socket; the caller's mode is put back at the end.
        sock = self.sock
        entry = _ACTIVE_SOCKETS.get(sock)
        if entry is not None:
            entry[0] += 1
            return
        previous = sock.gettimeout()
        try:
            sock.setblocking(False)
        except OSError as exc:  # e.g. a closed socket
            raise StreamIOError.from_os_error(exc) from exc
        _ACTIVE_SOCKETS[sock] = [1, previous]

    def __exit__(self, *exc_info: object) -> None:
        sock = self.sock
        entry = _ACTIVE_SOCKETS[sock]
        entry[0] -= 1
        if entry[0] == 0:
            del _ACTIVE_SOCKETS[sock]
            if sock.fileno() != -1:  # closed under us: nothing left to restore
                sock.settimeout(entry[1])

    async def recv_into(self, view: memoryview) -> int:
        try:
            return await within(self.loop.sock_recv_into(self.sock, view), self.timeout)
        except OSError as exc:
            raise StreamIOError.from_os_error(exc) from exc

    async def send(self, view: memoryview) -> int:
        try:
            while True:
                try:
                    return self.sock.send(view)
                except (BlockingIOError, InterruptedError):
                    pass
                try:
                    await within(self._writable(), self.timeout)
                except NotImplementedError:
                    # A loop without readiness callbacks (Windows' proactor): sendall, so
                    # the timeout bounds the whole piece rather than each byte.
                    await within(self.loop.sock_sendall(self.sock, view), self.timeout)
                    return len(view)
        except OSError as exc:
            raise StreamIOError.from_os_error(exc) from exc

    async def _writable(self) -> None:
        waiter = self.loop.create_future()
        fd = self.sock.fileno()
        self.loop.add_writer(fd, _wake, waiter)
        try:
            await waiter
        finally:
            self.loop.remove_writer(fd)


def _wake(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


class _StreamsChannel(_Channel):
    def __init__(
        self,
        reader: asyncio.StreamReader | None,
        writer: asyncio.StreamWriter | None,
        timeout: float | None,
    ) -> None:
        super().__init__(timeout)
        self.reader = reader
        self.writer = writer

    async def recv_into(self, view: memoryview) -> int:
        assert self.reader is not None
        try:
            # read(n) returns what is buffered, up to n, as soon as there is something:
            # never more than asked, so never past the gradient's last frame.
            data = await within(self.reader.read(len(view)), self.timeout)
        except OSError as exc:
            raise StreamIOError.from_os_error(exc) from exc
        view[: len(data)] = data
        return len(data)

    async def send(self, view: memoryview) -> int:
        assert self.writer is not None
        piece = view[:_WRITE_SLICE]
        try:
            self.writer.write(piece)
            await self._drain()
        except OSError as exc:
            raise StreamIOError.from_os_error(exc) from exc
        return len(piece)

    async def _drain(self) -> None:
        # drain() waits until the transport's buffer is below its low-water mark; a
        # timeout only counts as a stall when not one byte left the buffer meanwhile.
        assert self.writer is not None
        transport = self.writer.transport
        while True:
            before = transport.get_write_buffer_size()
            try:
                await within(self.writer.drain(), self.timeout)
                return
            except Stalled:
                if transport.get_write_buffer_size() >= before:
                    raise


def _check_socket(sock: socket.socket) -> socket.socket:
    if isinstance(sock, ssl.SSLSocket):
        raise TypeError("an ssl.SSLSocket cannot carry frames; use asyncio streams over TLS")
    if sock.type != socket.SOCK_STREAM:
        raise ValueError(f"stream must be a connected stream socket, not {sock.type!r}")
    return sock


def _sending_channel(stream: Any, timeout: float | None) -> _Channel:
    if isinstance(stream, socket.socket):
        return _SocketChannel(_check_socket(stream), timeout)
    writer = stream[1] if isinstance(stream, tuple) and len(stream) == 2 else stream
    if isinstance(writer, asyncio.StreamWriter):
        return _StreamsChannel(None, writer, timeout)
    raise TypeError(
        "stream_to expects a connected socket.socket, an asyncio.StreamWriter or a "
        f"(StreamReader, StreamWriter) pair, not {type(stream).__name__}"
    )


def _receiving_channel(stream: Any, timeout: float | None) -> _Channel:
    if isinstance(stream, socket.socket):
        return _SocketChannel(_check_socket(stream), timeout)
    reader = stream[0] if isinstance(stream, tuple) and len(stream) == 2 else stream
    if isinstance(reader, asyncio.StreamReader):
        return _StreamsChannel(reader, None, timeout)
    raise TypeError(
        "receive_from and receive_iter expect a connected socket.socket, an "
        "asyncio.StreamReader or a (StreamReader, StreamWriter) pair, "
        f"not {type(stream).__name__}"
    )


# --------------------------------------------------------------------------- session


class _Gradient(NamedTuple):
    """A gradient as the encoder takes it, with the schema metadata it travels with."""

    values: np.ndarray  # 1-D, C-contiguous, in the wire dtype (bfloat16 as uint16 bits)
    dtype: str  # the wire dtype: the value column's
    shape: str | None  # gradient_shape metadata (keep_shape), or None
    result: str | None  # gradient_dtype metadata (the dtype handed back), or None


class GradientStreamSession:
    """Splits gradients into Arrow IPC chunks / frames and reassembles them."""

    __slots__ = (
        "_chunk_size",
        "_compression",
        "_keep_dtype",
        "_keep_shape",
        "_layout",
        "_max_gradient_len",
        "_max_payload_len",
        "_session_id",
        "_timeout",
        "_wire_dtype",
    )

    def __init__(
        self,
        session_id: str,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        *,
        max_payload_len: int = DEFAULT_MAX_PAYLOAD_LEN,
        max_gradient_len: int = DEFAULT_MAX_GRADIENT_LEN,
        timeout: float | None = None,
        layout: str = "seed",
        compression: bool | str | None = None,
        keep_shape: bool = False,
        keep_dtype: bool = False,
        wire_dtype: str | None = None,
    ) -> None:
        self._session_id = _check_str(session_id, "session_id")
        if layout not in LAYOUTS:
            raise SettingError(
                "layout",
                "layout must be 'seed' (the original's payload) or 'compact' (values only), "
                f"got {layout!r}",
            )
        self._layout = layout
        chunk_size = operator.index(chunk_size)
        if chunk_size < 0:
            raise SettingError("chunk_size", f"chunk_size must be >= 0, got {chunk_size}")
        if chunk_size > USIZE_MAX:
            raise OverflowError(f"chunk_size must be <= {USIZE_MAX}, got {chunk_size}")
        # The original raises a chunk size of 0 to 1 rather than refusing it.
        self._chunk_size = max(chunk_size, 1)
        max_payload_len = operator.index(max_payload_len)
        if not 1 <= max_payload_len <= U32_MAX:
            # payload_len is a u32 on the wire, so no larger limit could ever be reached.
            raise SettingError(
                "max_payload_len", f"max_payload_len must be in 1..{U32_MAX}, got {max_payload_len}"
            )
        self._max_payload_len = max_payload_len
        self._max_gradient_len = _check_max_gradient_len(max_gradient_len)
        self._timeout = _check_timeout(timeout)
        self._compression = _check_compression_setting(compression)
        if not isinstance(keep_shape, bool):
            # A real bool, as the native side's: not 0/1, not numpy.bool_.
            raise TypeError(f"keep_shape must be a bool, got {type(keep_shape).__name__}")
        self._keep_shape = keep_shape
        if not isinstance(keep_dtype, bool):
            # A real bool, as keep_shape.
            raise TypeError(f"keep_dtype must be a bool, got {type(keep_dtype).__name__}")
        self._keep_dtype = keep_dtype
        self._wire_dtype = _check_wire_dtype(wire_dtype)

    @classmethod
    def with_defaults(cls, session_id: str) -> GradientStreamSession:
        return cls(session_id, DEFAULT_CHUNK_SIZE)

    def with_compression(self, enabled: bool) -> GradientStreamSession:
        """A new session with the same settings and compression "lz4" if ``enabled``, else
        none."""
        enabled = _check_bool(enabled, "enabled")
        return GradientStreamSession(
            self._session_id,
            self._chunk_size,
            max_payload_len=self._max_payload_len,
            max_gradient_len=self._max_gradient_len,
            timeout=self._timeout,
            layout=self._layout,
            compression="lz4" if enabled else None,
            keep_shape=self._keep_shape,
            keep_dtype=self._keep_dtype,
            wire_dtype=self._wire_dtype,
        )

    def is_compression_enabled(self) -> bool:
        return self._compression is not None

    @property
    def compression(self) -> Compression | None:
        """The codec of the payloads this session writes: None, "lz4" or "zstd"."""
        return self._compression

    @property
    def session_id(self) -> str:
        return self._session_id

    @property
    def chunk_size(self) -> int:
        return self._chunk_size

    @property
    def max_payload_len(self) -> int:
        return self._max_payload_len

    @property
    def max_gradient_len(self) -> int:
        return self._max_gradient_len

    @property
    def timeout(self) -> float | None:
        return self._timeout

    @property
    def layout(self) -> str:
        return self._layout

    @property
    def keep_shape(self) -> bool:
        """Whether this session writes the gradient's shape into every payload's schema
        metadata (``gradient_shape``). Receivers reshape whatever their own setting."""
        return self._keep_shape

    @property
    def keep_dtype(self) -> bool:
        """Whether this session sends float16, bfloat16 and float64 gradients in their own
        dtype (and has them handed back in it); without it (or wire_dtype) only float32 is
        taken."""
        return self._keep_dtype

    @property
    def wire_dtype(self) -> str | None:
        """The dtype every gradient is cast to for transfer, or None (its own dtype)."""
        return self._wire_dtype

    def __repr__(self) -> str:
        return (
            f"GradientStreamSession(session_id={self._session_id!r}, "
            f"chunk_size={self._chunk_size}, max_payload_len={self._max_payload_len}, "
            f"max_gradient_len={self._max_gradient_len}, timeout={self._timeout!r}, "
            f"layout={self._layout!r}, compression={self._compression!r}, "
            f"keep_shape={self._keep_shape!r}, keep_dtype={self._keep_dtype!r}, "
            f"wire_dtype={self._wire_dtype!r})"
        )

    # ---- encoding

    def _refusal(self, chunk_index: int, n_values: int) -> FrameError:
        # One message for both checks, so the text does not depend on the Arrow writer's
        # exact byte count (which differs between pyarrow and arrow-rs).
        return FrameError(
            f"chunk {chunk_index} ({n_values} values) would encode to a payload above "
            f"max_payload_len {self._max_payload_len} bytes; use a smaller chunk_size",
            chunk_index,
        )

    def _chunk_payload(self, chunk_index: int, window: np.ndarray, gradient: _Gradient) -> bytes:
        """Encode one chunk (``window``, values of ``gradient``), refusing it if its payload
        would exceed max_payload_len."""
        limit = self._max_payload_len
        # Cheap lower bound first: never build a payload we already know is too big (a
        # compressed payload has no such bound: its size depends on the values).
        floor = _STORAGE[gradient.dtype].itemsize
        if self._layout != "compact":
            floor += _INDEX_BYTES_PER_VALUE
        if self._compression is None and len(window) * floor > limit:
            raise self._refusal(chunk_index, len(window))
        payload = encode_payload(
            window,
            self._layout,
            self._compression,
            gradient.shape,
            dtype=gradient.dtype,
            result=gradient.result,
        )
        if len(payload) > limit:
            raise self._refusal(chunk_index, len(window))
        return payload

    def _frame_len(self, chunk_index: int, n_values: int) -> int:
        """Bytes of the frame of a chunk of n_values values, refused as _chunk_payload
        would refuse it."""
        length = payload_len(n_values, self._layout)
        if length > self._max_payload_len:
            raise self._refusal(chunk_index, n_values)
        return HEADER_LEN + length

    def _total_chunks(self, length: int) -> int:
        # Ceiling division; an empty gradient still makes one (empty) chunk.
        size = self._chunk_size
        total = max(1, -(-length // size))
        if total > U32_MAX:
            raise FrameError(
                f"a gradient of {length} values needs {total} chunks of {size}, more "
                f"than total_chunks can count ({U32_MAX}); use a larger chunk_size"
            )
        return total

    def _input(self, gradient: Any) -> _Gradient:
        """The gradient as the codec takes it (``_dtypes.prepare``: float32 unless
        keep_dtype or wire_dtype say otherwise), with the metadata to write: the compact
        JSON of its shape (keep_shape; after conversion to a numpy array and before
        flattening) and the dtype to hand back when it is not the wire's."""
        prepared = _dtypes.prepare(
            gradient, keep_dtype=self._keep_dtype, wire_dtype=self._wire_dtype
        )
        values = prepared.values  # C-contiguous: the flattening is a view
        shape = _shape_text(values.shape) if self._keep_shape else None
        result = None if prepared.result == prepared.wire else prepared.result
        return _Gradient(values.reshape(-1), prepared.wire, shape, result)

    def _frames(self, gradient: _Gradient) -> Iterator[tuple[int, int, bytes, int]]:
        """(chunk_index, total_chunks, payload, checksum) of each chunk, encoded one at a
        time as the caller asks for it."""
        values = gradient.values
        size = self._chunk_size
        total = self._total_chunks(len(values))
        for k in range(total):
            payload = self._chunk_payload(k, values[k * size : (k + 1) * size], gradient)
            yield k, total, payload, zlib.crc32(payload)

    def encode_gradient(self, gradient: Any) -> list[GradientChunk]:
        return [
            GradientChunk(self._session_id, k, total, payload, checksum)
            for k, total, payload, checksum in self._frames(self._input(gradient))
        ]

    def frames_len(self, n_values: int) -> int:
        """The exact number of bytes encode_frames (and stream_to) produce for a gradient
        of ``n_values`` values in this session's layout and chunk size, computed without
        any values.

        TypeError for a non-integer, ValueError for a negative count, then ValueError for
        a compressed session (its payload sizes depend on the values), a keep_shape one (the
        metadata's size depends on the shape), a keep_dtype one (on the gradient's dtype)
        and a wire_dtype other than float32; for a length that encode_frames would refuse
        (a chunk whose payload exceeds max_payload_len, more chunks than a u32 counts) the
        FrameError encode_frames would raise.
        """
        n = operator.index(n_values)
        if n < 0:
            raise ValueError(f"n_values must be >= 0, got {n}")
        if self._compression is not None:
            raise ValueError(
                "frames_len is not known in advance for a compressed session: payload sizes "
                "depend on the values"
            )
        if self._keep_shape:
            raise ValueError(
                "frames_len is not known in advance when keep_shape is set: the shape "
                "metadata's size depends on the shape"
            )
        if self._keep_dtype:
            raise ValueError(
                "frames_len is not known in advance when keep_dtype is set: payload sizes "
                "depend on the gradient's dtype"
            )
        if self._wire_dtype not in (None, "float32"):
            raise ValueError(
                f"frames_len is not known in advance when wire_dtype is {self._wire_dtype!r}: "
                "only float32 payload sizes are computed"
            )
        size = self._chunk_size
        total = self._total_chunks(n)
        last = n - (total - 1) * size  # the empty gradient's one chunk holds 0 values
        # Chunks are refused in index order, as encode_frames meets them: chunk 0 first.
        if total == 1:
            return self._frame_len(0, last)
        full = self._frame_len(0, size)
        return (total - 1) * full + self._frame_len(total - 1, last)

    @overload
    def encode_frames(
        self, gradient: Any, as_buffer: Literal[False] = False, *, out: None = None
    ) -> bytes: ...
    @overload
    def encode_frames(
        self, gradient: Any, as_buffer: Literal[True], *, out: None = None
    ) -> pa.Buffer: ...
    @overload
    def encode_frames(self, gradient: Any, as_buffer: bool = False, *, out: Any) -> int: ...
    def encode_frames(
        self, gradient: Any, as_buffer: bool = False, *, out: Any = None
    ) -> bytes | pa.Buffer | int:
        """The frames of ``gradient``: ``bytes``, or a ``pyarrow.Buffer`` (as_buffer=True).

        With ``out`` (any object exporting a writeable C-contiguous buffer: bytearray,
        memoryview, a numpy array of any dtype but object, viewed as raw bytes) the frames
        are written at its start instead and their byte count is returned; the bytes after
        them are left as they were. TypeError for a read-only or non-contiguous buffer;
        ValueError for one smaller than the frames (``frames_len`` of the gradient; a
        compressed session encodes every frame first to know their length), in which case
        nothing is written, and for as_buffer=True with out. A gradient that cannot be
        encoded raises what it raises without ``out``, before anything is written.
        """
        as_buffer = _check_bool(as_buffer, "as_buffer")
        if out is None:
            parts: list[bytes] = []
            for k, total, payload, checksum in self._frames(self._input(gradient)):
                parts.append(HEADER.pack(k, total, len(payload), checksum))
                parts.append(payload)
            frames = b"".join(parts)
            # py_buffer wraps the bytes object without copying it.
            return pa.py_buffer(frames) if as_buffer else frames
        if as_buffer:
            raise ValueError("as_buffer=True and out= exclude each other: out= is the buffer")
        with frame_buffer(out) as view:
            grad = self._input(gradient)
            values = grad.values
            if view.nbytes and np.may_share_memory(values, np.frombuffer(view, np.uint8)):
                raise ValueError(
                    "out= overlaps the gradient's memory: the frames would overwrite values "
                    "before they are read"
                )
            return self._encode_frames_into(grad, view)

    def _sizes_known(self) -> bool:
        """Whether frames_len computes the frames' length (else it raises ValueError)."""
        return (
            self._compression is None
            and not self._keep_shape
            and not self._keep_dtype
            and self._wire_dtype in (None, "float32")
        )

    def _encode_frames_into(self, gradient: _Gradient, view: memoryview) -> int:
        if not self._sizes_known():
            return self._encode_sized_frames_into(gradient, view)
        # The exact size first (raising the encoder's FrameError for a refused length), so
        # that a buffer too small is refused before a byte of it is written.
        values = gradient.values
        assert gradient.dtype == "float32" and gradient.result is None and gradient.shape is None
        needed = self.frames_len(len(values))
        if needed > len(view):
            raise ValueError(
                f"out= holds {len(view)} bytes; the frames of {len(values)} values take {needed}"
            )
        pos = 0
        for k, total, payload, checksum in self._frames(gradient):
            end = pos + HEADER_LEN + len(payload)
            if end > needed:  # frames_len and the encoder disagree: a bug, never an overrun
                raise AssertionError(f"frames_len {needed} is short of the frames' length")
            HEADER.pack_into(view, pos, k, total, len(payload), checksum)
            view[pos + HEADER_LEN : end] = payload
            pos = end
        assert pos == needed, (pos, needed)
        return pos

    def _encode_sized_frames_into(self, gradient: _Gradient, view: memoryview) -> int:
        # Payload sizes depend on the values (compression), on the shape (keep_shape) or on
        # the dtype (keep_dtype, wire_dtype): encode every frame first, so that a buffer too
        # small is refused before a byte of it is written.
        frames = [
            (HEADER.pack(k, total, len(payload), checksum), payload)
            for k, total, payload, checksum in self._frames(gradient)
        ]
        needed = sum(HEADER_LEN + len(payload) for _, payload in frames)
        if needed > len(view):
            n = len(gradient.values)
            raise ValueError(
                f"out= holds {len(view)} bytes; the frames of {n} values take {needed}"
            )
        pos = 0
        for header, payload in frames:
            view[pos : pos + HEADER_LEN] = header
            view[pos + HEADER_LEN : pos + HEADER_LEN + len(payload)] = payload
            pos += HEADER_LEN + len(payload)
        return pos

    # ---- decoding

    def decode_chunks(self, chunks: Iterable[Any]) -> np.ndarray:
        return _decode_chunk_list([_chunk_fields(c) for c in chunks], self._max_gradient_len)

    def decode_frames(self, data: Any, *, out: np.ndarray | None = None) -> np.ndarray:
        """The gradient held by the frames in ``data`` (any bytes-like object): a new 1-D
        array (float32 unless the payloads say otherwise; in the sender's shape when it
        sent one), or, with ``out``, ``out`` itself filled with the values.

        ``out`` must be a writeable, C-contiguous, aligned numpy array of float16,
        bfloat16 (ml_dtypes), float32 or float64 in native byte order, of any shape
        (TypeError otherwise, before the data is read); it is filled in C order and keeps
        its shape. The gradient must come back in ``out``'s dtype, else GradientDtypeError
        at the first chunk, before any of its values is written. It must hold exactly
        ``out.size`` values, else GradientSizeError: as soon as the chunk that runs over is
        decoded
        (values counted in arrival order; a gradient over max_gradient_len is the
        FrameError first), or, for a gradient short of it, once every other rule has
        passed (truncation, IncompleteStreamError, bytes left over). The empty input is a
        gradient of 0 values. Nothing is written past ``out``'s end, but after any error
        its contents are unspecified (part of the gradient, perhaps).
        """
        if out is not None:
            out = value_buffer(out)
        return _decode_frame_stream(
            _byte_view(data), self._max_payload_len, self._max_gradient_len, out
        )

    # ---- streaming (README "Streaming")

    async def stream_to(
        self, gradient: Any, stream: Any, *, progress: TransferProgress | None = None
    ) -> int:
        """Send one gradient over a socket or an asyncio stream; the number of chunks.

        The bytes are exactly encode_frames(gradient), encoded and written one chunk at a
        time. The gradient is read as the chunks are encoded: do not change it meanwhile.
        """
        channel = _sending_channel(stream, self._timeout)
        progress = _check_progress(progress)
        grad = self._input(gradient)
        frames = self._frames(grad)
        total = self._total_chunks(len(grad.values))  # FrameError before any byte is sent
        _count(progress, total_chunks=total)
        with channel:
            for k, _, payload, checksum in frames:
                # One buffer per frame: two writes (header, payload) would meet Nagle's
                # algorithm and delayed ACKs on TCP.
                frame = memoryview(HEADER.pack(k, total, len(payload), checksum) + payload)
                sent = 0
                while sent < len(frame):
                    try:
                        n = await channel.send(frame[sent:])
                    except Stalled:
                        raise StreamTimeoutError(self._timeout or 0.0, k, total) from None
                    sent += n
                    _count(progress, nbytes=n)
                _count(progress, chunks=1)
                await asyncio.sleep(0)  # a turn for the loop per frame, as on receipt
        return total

    async def receive_from(
        self,
        stream: Any,
        *,
        progress: TransferProgress | None = None,
        out: np.ndarray | None = None,
    ) -> np.ndarray:
        """Receive one gradient from a socket or an asyncio stream.

        The end of the stream before any byte gives an empty array (the original's "no
        network"); see the README for the other ends. ``out`` is as for decode_frames: the
        gradient is written into it as its chunks arrive, and ``out`` is returned; it is
        checked before any byte is read, and holds unspecified values after an error.
        """
        channel = _receiving_channel(stream, self._timeout)
        progress = _check_progress(progress)
        if out is not None:
            out = value_buffer(out)
        values = await self._receive(channel, progress, out)
        return _zero_values(out) if values is None else values

    async def receive_iter(
        self, stream: Any, *, progress: TransferProgress | None = None
    ) -> AsyncIterator[np.ndarray]:
        """Receive gradients until the peer closes the stream between two of them."""
        channel = _receiving_channel(stream, self._timeout)
        progress = _check_progress(progress)
        while True:
            values = await self._receive(channel, progress, None)
            if values is None:
                return
            yield values

    async def _receive(
        self, channel: _Channel, progress: TransferProgress | None, out: np.ndarray | None
    ) -> np.ndarray | None:
        """One gradient (written into ``out`` when given), or None when the stream ended
        before its first byte."""
        receiver = _FrameReceiver(
            self._max_payload_len, self._max_gradient_len, copy_values=True, out=out
        )
        # The socket is non-blocking only while a gradient is being received, so between
        # two gradients of receive_iter it is in the caller's mode.
        with channel:
            while not receiver.done:
                # A header, or a payload of at most max_payload_len bytes (checked from the
                # header before this allocation); exactly what the frame needs, so nothing
                # past the gradient's last frame is ever read.
                unit = memoryview(bytearray(receiver.want))
                got = 0
                while got < len(unit):
                    try:
                        n = await channel.recv_into(unit[got:])
                    except Stalled:
                        raise StreamTimeoutError(
                            self._timeout or 0.0, receiver.received, receiver.total
                        ) from None
                    if n == 0:
                        receiver.end_of_stream(got)  # raises, but before any byte
                        return None
                    got += n
                    _count(progress, nbytes=n)
                had_total = receiver.total is not None
                received = receiver.received
                # sock_recv_into returns at once while data is buffered: give the loop a
                # turn per unit, so other tasks and cancellation are not starved.
                await asyncio.sleep(0)
                receiver.feed(unit)
                if receiver.received > received:
                    _count(progress, chunks=1)
                    if not had_total:
                        _count(progress, total_chunks=receiver.total or 0)
        return receiver.result()

    # ---- tensor sets (README "Tensor sets"; the logic is gradstream._tensors')

    def encode_tensors(self, tensors: Any, as_buffer: bool = False) -> bytes | pa.Buffer:
        from .. import _tensors

        encoded: bytes | pa.Buffer = _tensors.encode_tensors(self, tensors, as_buffer)
        return encoded

    def decode_tensors(self, data: Any) -> dict[str, np.ndarray]:
        from .. import _tensors

        decoded: dict[str, np.ndarray] = _tensors.decode_tensors(self, data)
        return decoded

    async def stream_tensors(
        self, tensors: Any, stream: Any, *, progress: TransferProgress | None = None
    ) -> int:
        from .. import _tensors

        sent: int = await _tensors.stream_tensors(self, tensors, stream, progress=progress)
        return sent

    async def receive_tensors(
        self, stream: Any, *, progress: TransferProgress | None = None
    ) -> dict[str, np.ndarray]:
        from .. import _tensors

        received: dict[str, np.ndarray] = await _tensors.receive_tensors(
            self, stream, progress=progress
        )
        return received

    def _encode_manifest(self, text: str) -> bytes:
        """The frames of an empty gradient (one frame, chunk 0 of 1: a float32 value column
        of no rows, in this session's layout and compression) whose schema metadata holds
        ``gradstream_tensors`` = ``text`` and nothing else."""
        text = _check_str(text, "text")
        payload = encode_payload(
            np.empty(0, dtype=np.float32), self._layout, self._compression, manifest=text
        )
        if len(payload) > self._max_payload_len:
            raise self._refusal(0, 0)
        return HEADER.pack(0, 1, len(payload), zlib.crc32(payload)) + payload

    def _decode_manifest(self, data: Any) -> tuple[str | None, int]:
        """Decode ``data`` exactly as decode_frames does; the first chunk's (the first to
        arrive) ``gradstream_tensors`` metadata (None when absent, or for the empty input)
        and the gradient's number of values."""
        values, receiver = _run_frames(
            _byte_view(data), self._max_payload_len, self._max_gradient_len, None
        )
        return (None if receiver is None else receiver.manifest), values.size
