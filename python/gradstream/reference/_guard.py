"""The flatbuffer guard: hand-written checks of an Arrow IPC file's footer and of its
compressed record batch messages, run on payload bytes (hostile, perhaps) after their
CRC-32 matched and before pyarrow reads anything of them.

Apart because it is the one place that parses flatbuffers by hand, with bounds-checked
reads only: it holds payloads to what arrow-rs (and the native decoder) check and pyarrow
does not (the ARROW1 magic, a record batch list, no dictionary batches, blocks that do
not overlap), and holds each compressed batch to bounds before pyarrow decompresses it,
since an Arrow reader allocates whatever uncompressed length a compressed buffer
declares: its rows against max_gradient_len, and each buffer against what its column of
the footer's schema can need. Numbers that point outside the payload give no verdict
here: the Arrow reader, whose flatbuffer verifier refuses them, judges those (a schema
the walk cannot read counts as one of no columns, whose buffers may declare nothing).
"""

from __future__ import annotations

import struct
from typing import NamedTuple

from ..errors import ArrowIpcError

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


# What all of a compressed batch's buffers together may declare uncompressed, in bytes a
# row (each buffer alone is bounded by its column, see _Column).
_ALL_BUFFERS_BYTES_PER_ROW = 16

# The Type union's members with a width (Schema.fbs), and FloatingPoint's precisions.
_TYPE_INT = 2
_TYPE_FLOATING_POINT = 3
_INT_WIDTHS = {8: 1, 16: 2, 32: 4, 64: 8}  # Int.bitWidth: bytes a row
_FLOAT_WIDTHS = {0: 2, 1: 4, 2: 8}  # Precision HALF, SINGLE, DOUBLE: bytes a row

UNBOUNDED_COLUMN = (
    "compressed record batch has column {position} of a type other than integer or floating point"
)
BUFFER_OUT_OF_BOUNDS = (
    "compressed IPC buffer {index} ({what}) declares {declared} bytes uncompressed; "
    "{rows} rows need at most {bound}"
)


class _Column(NamedTuple):
    """A top-level column of the footer's schema, as far as the bounds go."""

    width: int  # bytes a row of its data buffer
    nullable: bool  # whether it may carry a validity bitmap


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


def _field_column(flat: _Flat, field: int | None) -> _Column | bool:
    """The column of the Field table at ``field``; False when its buffers have no bound
    (not a flat integer or floating-point column); True when it cannot be read."""
    # Field: 1 nullable, 2 type_type, 3 type, 4 dictionary, 5 children.
    nullable = flat.scalar("<B", field, 1, 0)
    type_type = flat.scalar("<B", field, 2, 0)
    present, type_at = flat.field(field, 3)
    table = flat.deref(type_at) if present else None
    if nullable is None or type_type is None or (present and table is None):
        return True
    width = None
    if table is not None and type_type == _TYPE_INT:
        bits = flat.scalar("<i", table, 0, 0)  # Int: 0 bitWidth
        if bits is None:
            return True
        width = _INT_WIDTHS.get(bits)
    elif table is not None and type_type == _TYPE_FLOATING_POINT:
        precision = flat.scalar("<h", table, 0, 0)  # FloatingPoint: 0 precision
        if precision is None:
            return True
        width = _FLOAT_WIDTHS.get(precision)
    dictionary, _ = flat.field(field, 4)
    present, children_at = flat.field(field, 5)
    children = flat.read("<I", flat.deref(children_at)) if present else 0
    if children is None:
        return True
    if width is None or dictionary or children:
        return False
    return _Column(width, nullable != 0)


def _footer_columns(payload: memoryview) -> list[_Column] | int:
    """The columns of the footer's schema (none without a schema), or the position of the
    first whose buffers have no bound. A schema that cannot be read counts as none: pyarrow
    refuses it before reading any batch, and meanwhile no compressed buffer may declare
    anything."""
    size = len(payload)
    (footer_len,) = struct.unpack_from("<i", payload, size - 10)
    start = size - 10 - footer_len
    if footer_len < 4 or start < 8:
        return []
    flat = _Flat(payload[start : size - 10])
    # Footer: 1 schema. Schema: 1 fields.
    present, schema_at = flat.field(flat.deref(0), 1)
    present, fields_at = flat.field(flat.deref(schema_at), 1) if present else (False, None)
    vector = flat.deref(fields_at) if present else None
    count = flat.read("<I", vector)
    if vector is None or count is None or not flat.holds(vector + 4, 4 * count):
        return []
    columns = []
    for position in range(count):
        column = _field_column(flat, flat.deref(vector + 4 + 4 * position))
        if column is True:
            return []
        if column is False:
            return position
        columns.append(column)
    return columns


def _check_declared(
    columns: list[_Column], index: int, rows: int, declared: int, chunk_index: int
) -> None:
    """Buffer ``index`` of a ``rows``-row batch declares ``declared`` bytes uncompressed:
    at most its column's width times the rows for its data, the rows over 8 rounded up for
    the validity bitmap of a nullable column, nothing for that of a non-nullable one (it
    holds no null) or for a buffer past the last column. The buffers of flat columns come
    in pairs, validity bitmap then data, column by column."""
    position = index // 2
    if position >= len(columns):
        bound, what = 0, "past the last column"
    elif index % 2:
        bound, what = columns[position].width * rows, f"data of column {position}"
    elif columns[position].nullable:
        bound, what = -(-rows // 8), f"validity bitmap of column {position}"
    else:
        bound, what = 0, f"validity bitmap of non-nullable column {position}"
    if not 0 <= declared <= bound:
        detail = BUFFER_OUT_OF_BOUNDS.format(
            index=index, what=what, declared=declared, rows=rows, bound=bound
        )
        raise ArrowIpcError(detail, chunk_index)


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
    columns: list[_Column] | int | None = None  # read at the first compressed batch
    for offset, meta_len, _body_len in blocks:
        batch = _compressed_batch(flat, offset)
        if batch is None:
            continue
        if columns is None:
            columns = _footer_columns(payload)
        _check_compressed_batch(flat, batch, offset + meta_len, room, columns, chunk_index)
        # The compressed batches of one payload share the room.
        room -= batch.rows


def _check_compressed_batch(
    flat: _Flat,
    batch: _CompressedBatch,
    body: int,
    room: int,
    columns: list[_Column] | int,
    chunk_index: int,
) -> None:
    """One compressed batch of ``_check_compressed_batches``, whose body starts at
    ``body``: its codec, its method, its rows against ``room``, the schema's ``columns``
    (or the position of the first without a bound), then each buffer's declared
    uncompressed length against what its column needs, and all of them together against
    the rows."""
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
    if isinstance(columns, int):
        raise ArrowIpcError(UNBOUNDED_COLUMN.format(position=columns), chunk_index)
    total = 0
    for index, (buf_offset, length) in enumerate(batch.buffers):
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
        _check_declared(columns, index, rows, declared, chunk_index)
        total += declared
    # All buffers together, too: a schema of many columns must not multiply the bound.
    # 16 bytes a row: a seed float64 batch needs 12 (a 4-byte index and an 8-byte value).
    if total > _ALL_BUFFERS_BYTES_PER_ROW * rows:
        raise ArrowIpcError(
            f"compressed IPC buffers declare {total} bytes uncompressed in all, more than "
            f"their {rows}-row batch can hold",
            chunk_index,
        )
