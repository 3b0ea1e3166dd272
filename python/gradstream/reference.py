"""Pure-Python reference implementation of gradstream (numpy + pyarrow + zlib + struct).

It mirrors the native module's API and follows the README's "Wire format" and "Decoding
rules" step by step, so that for any input both raise the same exception class with the
same fields. It is the executable form of the spec: keep it obvious rather than fast.

Two things hold throughout:

* float32 values are moved as raw 4-byte words (numpy float32 views, Arrow buffers,
  memcpy-style concatenation) and never pass through float64, so NaN payloads, -0.0 and
  subnormals survive bit for bit;
* this module imports only ``.errors`` and ``._convert`` from the package, never the native
  extension, so it works (and can judge the extension) when the extension is absent.
"""

from __future__ import annotations

import operator
import struct
import zlib
from collections.abc import Iterable, Iterator
from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.ipc

from ._convert import as_float32_vector
from .errors import ArrowIpcError, ChecksumMismatchError, FrameError, IncompleteStreamError

__all__ = ["GradientChunk", "GradientStreamSession"]

DEFAULT_CHUNK_SIZE = 65_536
DEFAULT_MAX_PAYLOAD_LEN = 268_435_456  # 256 MiB
U32_MAX = 2**32 - 1
USIZE_MAX = 2**64 - 1  # chunk_size is a usize in the native core

# Frame header: chunk_index, total_chunks, payload_len, checksum, four little-endian u32.
HEADER = struct.Struct("<IIII")
HEADER_LEN = HEADER.size  # 16

# The "seed layout" of a payload, as ipfrs-tensorlogic writes it.
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

# An encoded payload holds an int32 index and a float32 value per element, so a chunk of
# n values can never take fewer than 8 * n bytes; used to refuse oversized chunks early.
_MIN_PAYLOAD_BYTES_PER_VALUE = 8


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


def _check_bool(value: Any, name: str) -> bool:
    # Strict, like a native `bool` argument: 0/1 or None are more likely bugs than intent.
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be bool, not {type(value).__name__}")
    return bool(value)


def _byte_view(data: Any) -> memoryview:
    """Return a flat unsigned-byte view of any buffer-protocol object, copying only if needed.

    Accepts bytes, bytearray, memoryview, pyarrow.Buffer, numpy arrays of any dtype/shape.
    """
    view = memoryview(data)  # TypeError for str, int and other non-buffers
    if view.nbytes == 0:
        # memoryview.cast refuses shapes containing 0; an empty view is all we need.
        return memoryview(b"")
    if not view.c_contiguous:
        view = memoryview(view.tobytes())  # the one unavoidable copy
    if view.ndim != 1 or view.format != "B":
        view = view.cast("B")
    return view


def _to_bytes(data: Any) -> bytes:
    if type(data) is bytes:
        return data
    # Going through memoryview (not bytes(data)) so that an int is refused instead of being
    # taken as a length.
    return _byte_view(data).tobytes()


def _empty_vector() -> np.ndarray:
    return np.empty(0, dtype=np.float32)


def _concat(parts: Iterable[np.ndarray]) -> np.ndarray:
    # np.concatenate always allocates, so the result owns its memory and never aliases a
    # payload buffer (which may be the caller's bytes). It copies bytes, not float values.
    parts = list(parts)
    if not parts:
        return _empty_vector()
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


# --------------------------------------------------------------------------- payload codec


def encode_payload(values: np.ndarray) -> bytes:
    """Encode a 1-D float32 vector as an Arrow IPC file in the seed layout."""
    n = len(values)
    # from_buffers wraps the float32 words as they are: no conversion, no NaN canonicalising.
    value_array = pa.Array.from_buffers(pa.float32(), n, [None, pa.py_buffer(values)])
    index_array = pa.array(np.arange(n, dtype=np.int32), type=pa.int32())
    batch = pa.RecordBatch.from_arrays([index_array, value_array], schema=PAYLOAD_SCHEMA)
    sink = pa.BufferOutputStream()
    # Exactly one batch, even when it is empty: an empty gradient is one empty batch.
    with pa.ipc.new_file(sink, PAYLOAD_SCHEMA) as writer:
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


def _footer_blocks(payload: memoryview) -> list[tuple[int, int, int]] | None:
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
    slot = 4 + 2 * 3  # after vtable_len and table_len, the fourth field's offset
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


def _check_footer(payload: memoryview, chunk_index: int) -> None:
    """What pyarrow does not check and arrow-rs (or the native decoder) does."""
    # pyarrow only looks at the trailing magic.
    if len(payload) < 18 or bytes(payload[:6]) != b"ARROW1":
        raise ArrowIpcError("not an Arrow IPC file (no ARROW1 magic at the start)", chunk_index)
    blocks = _footer_blocks(payload)
    # pyarrow reads a footer without a record-batch list as a file with no batches.
    if blocks is None:
        raise ArrowIpcError("IPC footer lists no record batches", chunk_index)
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


def _value_columns(payload: memoryview, chunk_index: int) -> Iterator[pa.Array]:
    """Yield the 'value' column of each validated record batch, after checking the schema.

    Any failure of pyarrow itself becomes ArrowIpcError with pyarrow's message.
    """
    _check_footer(payload, chunk_index)
    try:
        reader = pa.ipc.open_file(pa.py_buffer(payload))
        schema = reader.schema
        names = schema.names  # decodes the names, which may fail
    except _ARROW_FAILURES as exc:
        raise ArrowIpcError(str(exc), chunk_index) from exc

    # The schema is checked before any batch, so a file with no batch at all is still held
    # to the layout.
    column = _value_field_index(names)
    if column is None:
        raise ArrowIpcError("Arrow IPC block missing 'value' column", chunk_index)
    if not pa.types.is_float32(_storage_type(schema.field(column).type)):
        raise ArrowIpcError("'value' column is not Float32", chunk_index)

    for i in range(reader.num_record_batches):
        try:
            values = reader.get_batch(i).column(column)
            # Full validation of the one column we read, before touching its buffers: a
            # hostile file must fail here, never read out of bounds later. Other columns
            # (the index) are ignored as the original ignores them, damaged or not.
            values.validate(full=True)
        except _ARROW_FAILURES as exc:
            raise ArrowIpcError(str(exc), chunk_index) from exc
        yield values


def decode_payload(payload: memoryview, chunk_index: int) -> np.ndarray:
    """Decode one payload: the Float32 'value' column of every batch, concatenated."""
    parts = []
    for column in _value_columns(payload, chunk_index):
        if isinstance(column, pa.ExtensionArray):
            column = column.storage
        if column.null_count > 0:
            # Stricter than the original, which returns whatever bytes sit under a null.
            raise ArrowIpcError(
                f"'value' column has {column.null_count} null value(s)", chunk_index
            )
        # Without nulls a Float32 array converts to numpy zero-copy, bits untouched.
        parts.append(column.to_numpy(zero_copy_only=True))
    return _concat(parts)


def _verify_and_decode(chunk_index: int, checksum: int, payload: memoryview) -> np.ndarray:
    # Integrity first: a payload is never parsed before its CRC-32 matched.
    actual = zlib.crc32(payload)
    if actual != checksum:
        raise ChecksumMismatchError(chunk_index, checksum, actual)
    return decode_payload(payload, chunk_index)


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


def _decode_chunk_list(chunks: list[_ChunkFields]) -> np.ndarray:
    if not chunks:  # rule 1
        return _empty_vector()
    chunks = sorted(chunks, key=lambda c: c.chunk_index)  # rule 2; sorted() is stable
    _check_chunk_set(chunks)  # rule 3
    total = chunks[0].total_chunks
    if len(chunks) != total:  # rule 4
        raise IncompleteStreamError(len(chunks), total)
    # Rule 5: CRC then decode, chunk after chunk, in index order.
    return _concat(_verify_and_decode(c.chunk_index, c.checksum, c.payload) for c in chunks)


def _decode_frame_stream(data: memoryview, max_payload_len: int) -> np.ndarray:
    """decode_frames rules 1-9, reading frames the way the original receiver does."""
    end = len(data)
    offset = 0
    first: tuple[int, int] | None = None  # (chunk_index, total_chunks) of the first frame
    parts: dict[int, np.ndarray] = {}

    # Reading stops once as many frames as total_chunks have arrived (rule 8).
    while first is None or len(parts) < first[1]:
        left = end - offset
        if left == 0:
            break  # rule 1 (empty result if nothing read) or rule 9
        if left < HEADER_LEN:
            if first is None:  # rule 2: the original would silently return nothing here
                raise FrameError(
                    f"truncated frame header: {left} of {HEADER_LEN} bytes", None, offset
                )
            break  # rule 9
        index, total, payload_len, checksum = HEADER.unpack_from(data, offset)
        body = offset + HEADER_LEN

        # Rule 3 comes before any use of payload_len, so a hostile header costs nothing.
        if payload_len > max_payload_len:
            raise FrameError(
                f"chunk {index} declares a {payload_len}-byte payload, "
                f"above max_payload_len {max_payload_len}",
                index,
                offset,
            )
        if end - body < payload_len:  # rule 4
            raise FrameError(
                f"truncated frame: chunk {index} declares a {payload_len}-byte payload "
                f"but only {end - body} bytes follow",
                index,
                offset,
            )
        if first is None:
            first = (index, total)
        elif total != first[1]:  # rule 5
            raise FrameError(_disagree(first[0], first[1], index, total), index, offset)
        if index >= total:  # rule 6
            raise FrameError(_out_of_range(index, total), index, offset)
        if index in parts:  # rule 7
            raise FrameError(_duplicate(index), index, offset)
        # Rule 8: each frame is verified and decoded as it arrives.
        parts[index] = _verify_and_decode(index, checksum, data[body : body + payload_len])
        offset = body + payload_len

    if first is None:  # rule 1: no bytes at all
        return _empty_vector()
    total = first[1]
    if len(parts) < total:  # rule 9
        raise IncompleteStreamError(len(parts), total)
    if offset < end:  # rule 9
        raise FrameError(f"{end - offset} bytes left over after the last chunk", None, offset)
    # Frames may arrive in any order; values are assembled in index order.
    return _concat(parts[i] for i in range(total))


# --------------------------------------------------------------------------- session


class GradientStreamSession:
    """Splits gradients into Arrow IPC chunks / frames and reassembles them."""

    __slots__ = ("_chunk_size", "_compression", "_max_payload_len", "_session_id")

    def __init__(
        self,
        session_id: str,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        *,
        max_payload_len: int = DEFAULT_MAX_PAYLOAD_LEN,
    ) -> None:
        self._session_id = _check_str(session_id, "session_id")
        chunk_size = operator.index(chunk_size)
        if chunk_size < 0:
            raise ValueError(f"chunk_size must be >= 0, got {chunk_size}")
        if chunk_size > USIZE_MAX:
            raise OverflowError(f"chunk_size must be <= {USIZE_MAX}, got {chunk_size}")
        # The original raises a chunk size of 0 to 1 rather than refusing it.
        self._chunk_size = max(chunk_size, 1)
        max_payload_len = operator.index(max_payload_len)
        if not 1 <= max_payload_len <= U32_MAX:
            # payload_len is a u32 on the wire, so no larger limit could ever be reached.
            raise ValueError(f"max_payload_len must be in 1..{U32_MAX}, got {max_payload_len}")
        self._max_payload_len = max_payload_len
        self._compression = False

    @classmethod
    def with_defaults(cls, session_id: str) -> GradientStreamSession:
        return cls(session_id, DEFAULT_CHUNK_SIZE)

    def with_compression(self, enabled: bool) -> GradientStreamSession:
        """A new session with the same settings and the flag set (stored, not applied)."""
        twin = GradientStreamSession(
            self._session_id, self._chunk_size, max_payload_len=self._max_payload_len
        )
        twin._compression = _check_bool(enabled, "enabled")
        return twin

    def is_compression_enabled(self) -> bool:
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

    def __repr__(self) -> str:
        return (
            f"GradientStreamSession(session_id={self._session_id!r}, "
            f"chunk_size={self._chunk_size}, max_payload_len={self._max_payload_len}, "
            f"compression={self._compression})"
        )

    # ---- encoding

    def _chunk_payload(self, chunk_index: int, window: np.ndarray) -> bytes:
        """Encode one chunk, refusing it if its payload would exceed max_payload_len."""
        limit = self._max_payload_len
        # One message for both checks, so the text does not depend on the Arrow writer's
        # exact byte count (which differs between pyarrow and arrow-rs).
        refusal = (
            f"chunk {chunk_index} ({len(window)} values) would encode to a payload above "
            f"max_payload_len {limit} bytes; use a smaller chunk_size"
        )
        # Cheap lower bound first: never build a payload we already know is too big.
        if len(window) * _MIN_PAYLOAD_BYTES_PER_VALUE > limit:
            raise FrameError(refusal, chunk_index)
        payload = encode_payload(window)
        if len(payload) > limit:
            raise FrameError(refusal, chunk_index)
        return payload

    def encode_gradient(self, gradient: Any) -> list[GradientChunk]:
        values = as_float32_vector(gradient)
        size = self._chunk_size
        # Ceiling division; an empty gradient still makes one (empty) chunk.
        total = max(1, -(-len(values) // size))
        if total > U32_MAX:
            raise FrameError(
                f"a gradient of {len(values)} values needs {total} chunks of {size}, more "
                f"than total_chunks can count ({U32_MAX}); use a larger chunk_size"
            )
        chunks = []
        for k in range(total):
            payload = self._chunk_payload(k, values[k * size : (k + 1) * size])
            chunks.append(GradientChunk(self._session_id, k, total, payload, zlib.crc32(payload)))
        return chunks

    def encode_frames(self, gradient: Any, as_buffer: bool = False) -> bytes | pa.Buffer:
        as_buffer = _check_bool(as_buffer, "as_buffer")
        parts: list[bytes] = []
        for chunk in self.encode_gradient(gradient):
            payload = chunk.arrow_ipc_bytes
            parts.append(
                HEADER.pack(chunk.chunk_index, chunk.total_chunks, len(payload), chunk.checksum)
            )
            parts.append(payload)
        frames = b"".join(parts)
        # py_buffer wraps the bytes object without copying it.
        return pa.py_buffer(frames) if as_buffer else frames

    # ---- decoding

    def decode_chunks(self, chunks: Iterable[Any]) -> np.ndarray:
        return _decode_chunk_list([_chunk_fields(c) for c in chunks])

    def decode_frames(self, data: Any) -> np.ndarray:
        return _decode_frame_stream(_byte_view(data), self._max_payload_len)
