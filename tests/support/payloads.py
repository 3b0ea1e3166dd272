"""Payload surgery: read and rewrite the record batch of an Arrow IPC file payload byte by
byte, independently of the reference's own flatbuffer walk.

A small bounds-checked reader (``Flat``) finds the fields of a real payload, and a small
forward flatbuffer builder (``Builder``) writes a record batch message with any field
values, which ``rebuild`` puts back into the file with a patched footer: a well-formed file
around whatever the batch declares. Used by the compression tests (codec/) and the dtype
tests (dtypes/); the differential tests (codec/test_differential.py) use ``Flat`` alone,
the shape tests ``write_ipc_file``.

``write_ipc_file`` writes a payload with pyarrow itself, from any schema and batch.
"""

from __future__ import annotations

import struct
from typing import NamedTuple

import pyarrow as pa

# Just enough of Arrow's File.fbs / Message.fbs to read and write a record batch message.


class Flat:
    """Bounds-checked flatbuffer reading, enough to find the fields of the Arrow IPC
    footer and messages; every method returns None when the bytes do not lead there."""

    def __init__(self, buf: bytes) -> None:
        self.buf = buf

    def read(self, pos: int | None, size: int, signed: bool = False) -> int | None:
        if pos is None or not 0 <= pos <= len(self.buf) - size:
            return None
        return int.from_bytes(self.buf[pos : pos + size], "little", signed=signed)

    def root(self, pos: int | None) -> int | None:
        offset = self.read(pos, 4)
        return None if offset is None or pos is None else pos + offset

    def slot(self, table: int | None, field: int) -> int | None:
        """Position of the vtable slot of ``field`` (None if the vtable is too short)."""
        soffset = self.read(table, 4, signed=True)
        if table is None or soffset is None:
            return None
        vtable = table - soffset
        vtable_len = self.read(vtable, 2)
        slot = vtable + 4 + 2 * field
        if vtable_len is None or vtable_len < 6 + 2 * field:
            return None
        return slot if slot + 2 <= len(self.buf) else None

    def field(self, table: int | None, field: int) -> int | None:
        """Position of a present field's data; None if absent (or unreadable)."""
        voffset = self.read(self.slot(table, field), 2)
        return None if not voffset or table is None else table + voffset

    def vector(self, pos: int | None) -> tuple[int, int] | None:
        """(start of the elements, count) of the vector a field at ``pos`` points to."""
        start = self.root(pos)
        count = self.read(start, 4)
        return None if start is None or count is None else (start + 4, count)


class Block(NamedTuple):
    offset: int
    meta_len: int
    body_len: int
    at: int  # position of this Block struct in the payload


def footer_blocks(payload: bytes) -> list[Block]:
    """The record-batch blocks of a well-formed payload's footer."""
    flat = Flat(payload)
    footer_len = flat.read(len(payload) - 10, 4)
    assert footer_len is not None and payload[-6:] == b"ARROW1"
    start = len(payload) - 10 - footer_len
    blocks = flat.vector(flat.field(flat.root(start), 3))  # Footer.recordBatches
    assert blocks is not None
    first, count = blocks
    out = []
    for i in range(count):
        at = first + 24 * i  # struct Block { offset: long; metaDataLength: int; bodyLength: long }
        offset, meta_len, body_len = struct.unpack_from("<qi4xq", payload, at)
        out.append(Block(offset, meta_len, body_len, at))
    return out


class Batch(NamedTuple):
    """A record batch message's fields and its body."""

    rows: int
    nodes: list[tuple[int, int]]  # FieldNode: length, null_count
    buffers: list[tuple[int, int]]  # Buffer: offset from the body's start, length
    compression: tuple[int, int] | None  # BodyCompression: codec, method
    body: bytes


def read_batch(payload: bytes, block: Block) -> Batch:
    flat = Flat(payload)
    assert flat.read(block.offset, 4) == 0xFFFF_FFFF  # continuation marker
    message = flat.root(block.offset + 8)
    assert flat.read(flat.field(message, 1), 1) == 3  # header_type RecordBatch
    header = flat.root(flat.field(message, 2))
    rows = flat.read(flat.field(header, 0), 8, signed=True) or 0

    def structs(field: int) -> list[tuple[int, int]]:
        found = flat.vector(flat.field(header, field))
        if found is None:
            return []
        first, count = found
        return [struct.unpack_from("<qq", payload, first + 16 * i) for i in range(count)]

    compression = None
    at = flat.field(header, 3)
    if at is not None:
        table = flat.root(at)
        codec = flat.read(flat.field(table, 0), 1, signed=True) or 0
        method = flat.read(flat.field(table, 1), 1, signed=True) or 0
        compression = (codec, method)
    start = block.offset + block.meta_len
    body = payload[start : start + block.body_len]
    return Batch(rows, structs(1), structs(2), compression, body)


class Builder:
    """A forward flatbuffer builder: objects are appended and patched, so every offset
    points forward, as flatbuffer offsets must; scalars are aligned to their size."""

    def __init__(self) -> None:
        self.buf = bytearray(4)  # the root offset, set by finish()

    def _pad(self, align: int, ahead: int = 0) -> None:
        while (len(self.buf) + ahead) % align:
            self.buf.append(0)

    def table(self, fields: list[tuple[str, int] | None]) -> tuple[int, dict[int, int]]:
        """Append a table. A field is (struct format, value), ("offset", 0) for a child
        to point() at later, or None (absent). Returns (its position, {field: position of
        its offset})."""
        self._pad(2)
        vtable = len(self.buf)
        self.buf += bytes(4 + 2 * len(fields))
        self._pad(8)
        table = len(self.buf)
        self.buf += struct.pack("<i", table - vtable)
        voffsets, children = [], {}
        for i, f in enumerate(fields):
            if f is None:
                voffsets.append(0)
                continue
            fmt = "<I" if f[0] == "offset" else f[0]
            self._pad(struct.calcsize(fmt))
            pos = len(self.buf)
            self.buf += struct.pack(fmt, f[1])
            voffsets.append(pos - table)
            if f[0] == "offset":
                children[i] = pos
        n = len(fields)
        struct.pack_into(f"<HH{n}H", self.buf, vtable, 4 + 2 * n, len(self.buf) - table, *voffsets)
        return table, children

    def structs(self, items: list[tuple[int, int]]) -> int:
        """Append a vector of 16-byte structs of two longs; its position."""
        self._pad(8, ahead=4)
        pos = len(self.buf)
        self.buf += struct.pack("<I", len(items))
        for item in items:
            self.buf += struct.pack("<qq", *item)
        return pos

    def point(self, at: int, target: int) -> None:
        assert target > at
        struct.pack_into("<I", self.buf, at, target - at)

    def finish(self, root: int) -> bytes:
        self.point(0, root)
        self._pad(8)
        return bytes(self.buf)


def record_batch_message(batch: Batch, body_len: int) -> bytes:
    """A Message flatbuffer (version V5) holding ``batch``'s RecordBatch."""
    b = Builder()
    message, m = b.table([("<h", 4), ("<B", 3), ("offset", 0), ("<q", body_len)])
    compressed = batch.compression is not None
    header, h = b.table(
        [("<q", batch.rows), ("offset", 0), ("offset", 0), ("offset", 0) if compressed else None]
    )
    b.point(m[2], header)
    b.point(h[1], b.structs(batch.nodes))
    b.point(h[2], b.structs(batch.buffers))
    if batch.compression is not None:
        codec, method = batch.compression
        table, _ = b.table([("<b", codec), ("<b", method)])
        b.point(h[3], table)
    return b.finish(message)


def pad8(data: bytes) -> bytes:
    return data + bytes(-len(data) % 8)


def rebuild(template: bytes, batch: Batch) -> bytes:
    """``template`` (a one-batch payload) with its record batch message and body replaced
    by ``batch``'s, and its footer block patched to match: a well-formed file around
    whatever the batch declares."""
    (block,) = footer_blocks(template)
    body = pad8(batch.body)
    flatbuffer = record_batch_message(batch, len(body))
    metadata = struct.pack("<Ii", 0xFFFF_FFFF, len(flatbuffer)) + flatbuffer
    footer_len = int.from_bytes(template[-10:-6], "little")
    footer_start = len(template) - 10 - footer_len
    end_of_body = block.offset + block.meta_len + block.body_len
    footer = bytearray(template[footer_start:])
    struct.pack_into("<i4xq", footer, block.at + 8 - footer_start, len(metadata), len(body))
    between = template[end_of_body:footer_start]  # the end-of-stream marker
    return template[: block.offset] + metadata + body + between + bytes(footer)


def the_batch(payload: bytes) -> Batch:
    (block,) = footer_blocks(payload)
    return read_batch(payload, block)


def value_buffer(batch: Batch) -> int:
    """Index of the value column's data buffer: the last buffer in both layouts."""
    return len(batch.buffers) - 1


def with_buffer(batch: Batch, i: int, data: bytes) -> Batch:
    """``batch`` with buffer ``i``'s bytes replaced by ``data`` (the others moved after
    it as needed, each 8-byte aligned)."""
    pieces = [batch.body[o : o + n] for o, n in batch.buffers]
    pieces[i] = data
    body, buffers = b"", []
    for piece in pieces:
        buffers.append((len(body), len(piece)))
        body += pad8(piece)
    return batch._replace(body=body, buffers=buffers)


def write_ipc_file(
    schema: pa.Schema, batch: pa.RecordBatch, compression: str | None = None
) -> bytes:
    """An Arrow IPC file of ``schema`` holding ``batch``, written by pyarrow; its buffers
    compressed with ``compression`` ("lz4" or "zstd") when given."""
    sink = pa.BufferOutputStream()
    options = None if compression is None else pa.ipc.IpcWriteOptions(compression=compression)
    with pa.ipc.new_file(sink, schema, options=options) as writer:
        writer.write_batch(batch)
    data: bytes = sink.getvalue().to_pybytes()
    return data
