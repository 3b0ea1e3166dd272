"""The flatbuffer guard: hand-written checks of an Arrow IPC file's footer and of its
compressed record batch messages, run on payload bytes (hostile, perhaps) after their
CRC-32 matched and before pyarrow reads anything of them.

Apart because it is the one place that parses flatbuffers by hand, with bounds-checked
reads only: it holds payloads to what arrow-rs (and the native decoder) check and pyarrow
does not (the ARROW1 magic, a record batch list, no dictionary batches, blocks that do
not overlap), and holds each compressed batch to bounds before pyarrow decompresses it,
since an Arrow reader allocates whatever uncompressed length a compressed buffer
declares. Numbers that point outside the payload give no verdict here: the Arrow reader,
whose flatbuffer verifier refuses them, judges those.
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
        _check_compressed_batch(flat, batch, offset + meta_len, room, chunk_index)
        # The compressed batches of one payload share the room.
        room -= batch.rows


def _check_compressed_batch(
    flat: _Flat, batch: _CompressedBatch, body: int, room: int, chunk_index: int
) -> None:
    """One compressed batch of ``_check_compressed_batches``, whose body starts at
    ``body``: its codec, its method, its rows against ``room``, then each buffer's
    declared uncompressed length, and all of them together, against its rows."""
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
