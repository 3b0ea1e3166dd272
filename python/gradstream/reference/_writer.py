"""The payload writer: a 1-D vector of values as one Arrow IPC file (docs/spec/wire-format.md, "Wire
format"), in the seed or the compact layout, of any of the four dtypes, with the schema
metadata gradstream writes (gradient_shape, gradient_dtype, gradstream_tensors) and the
optional IPC BodyCompression (lz4 or zstd); and the size arithmetic of such payloads
(``payload_len``, ``_min_payload_len``), which never encodes more than two empty-ish
payloads.

Apart from the reader because nothing in it judges bytes: it only produces them, from
values the session has already checked and cast (``_dtypes.prepare``).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.ipc

from .._dtypes import DTYPE_KEY
from . import _int8
from ._seal import SEAL_KEY, Seal
from ._wire import (
    _ARROW_TYPES,
    _BF16_FIELD_METADATA,
    _STORAGE,
    COMPACT_SCHEMA,
    INT8_SCHEMA,
    MANIFEST_KEY,
    PAYLOAD_SCHEMA,
    SHAPE_KEY,
)


class _Gradient(NamedTuple):
    """A gradient as the encoder takes it, with the schema metadata it travels with."""

    values: np.ndarray  # 1-D, C-contiguous, in carrier(dtype) (bfloat16 as uint16 bits)
    dtype: str  # the wire dtype: the value column's, or int8 (values float32)
    shape: str | None  # gradient_shape metadata (keep_shape), or None
    result: str | None  # gradient_dtype metadata (the dtype handed back), or None
    seal: Seal | None = None  # each chunk's gradstream_seal is made of it, or None


# An encoded payload holds an int32 index (seed layout) and a value per element, so a
# chunk of n values can never take fewer than (4 + width) * n bytes, or width * n in the
# compact layout; used to refuse oversized chunks early.
_INDEX_BYTES_PER_VALUE = 4


@functools.cache
def _schema(layout: str, dtype: str) -> pa.Schema:
    """The schema of a payload in ``layout`` whose values are of ``dtype`` (int8: the
    int8 wire's, whatever the layout)."""
    if dtype == "int8":
        return INT8_SCHEMA
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
    seal: str | None = None,
) -> bytes:
    """Encode a 1-D vector of ``dtype`` values (bfloat16 as uint16 bits) as an Arrow IPC
    file in the seed or compact layout.

    With ``compression`` ("lz4" or "zstd") the record batch carries the IPC BodyCompression
    (codec LZ4_FRAME or ZSTD, method BUFFER): every buffer is stored as its uncompressed
    length (int64) followed by the compressed bytes. The schema carries, in this order and
    only those given, the custom metadata ``gradient_shape`` = ``shape`` (``_shape_text`` of
    the gradient's shape), ``gradient_dtype`` = ``result`` (the dtype the receiver hands
    back, when it is not ``dtype``), ``gradstream_tensors`` = ``manifest`` and
    ``gradstream_seal`` = ``seal`` (the chunk's seal, ``Seal.text``). The file is otherwise
    the same.
    """
    n = len(values)
    schema = _schema(layout, dtype)
    if dtype == "int8":
        columns = _int8_columns(values)
    elif layout == "compact":
        # from_buffers wraps the words as they are: no conversion, no NaN canonicalising.
        columns = [_value_array(values, dtype)]
    else:
        index_array = pa.array(np.arange(n, dtype=np.int32), type=pa.int32())
        columns = [index_array, _value_array(values, dtype)]
    metadata = {
        key: text
        for key, text in (
            (SHAPE_KEY, shape),
            (DTYPE_KEY, result),
            (MANIFEST_KEY, manifest),
            (SEAL_KEY, seal),
        )
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


def _value_array(values: np.ndarray, dtype: str) -> pa.Array:
    """A value column wrapping ``values``' words as they are (no NaN canonicalising)."""
    return pa.Array.from_buffers(_ARROW_TYPES[dtype], len(values), [None, pa.py_buffer(values)])


def _int8_columns(values: np.ndarray) -> list[pa.Array]:
    """The int8 wire's columns of float32 ``values``: a list of int8 a block, its scale."""
    q, scales = _int8.quantize(values)
    n = len(values)
    offsets = np.minimum(np.arange(0, len(scales) + 1, dtype=np.int64) * _int8.BLOCK, n)
    item = pa.Array.from_buffers(pa.int8(), n, [None, pa.py_buffer(q)])
    blocks = pa.ListArray.from_arrays(
        pa.array(offsets.astype(np.int32)), item, type=INT8_SCHEMA.field("value").type
    )
    scale = pa.Array.from_buffers(pa.float32(), len(scales), [None, pa.py_buffer(scales)])
    return [blocks, scale]


def _pad8(nbytes: int) -> int:
    return -(-nbytes // 8) * 8


@functools.cache
def _payload_len_constants(layout: str, sealed: bool) -> tuple[int, int]:
    """(length of the empty payload, length of a one-value payload) in ``layout``, sealed
    or not (a seal's text has one width), measured once from the writer itself."""
    seal = Seal(bytes(16), 0).text(0, 1) if sealed else None
    return (
        len(encode_payload(np.empty(0, dtype=np.float32), layout, seal=seal)),
        len(encode_payload(np.zeros(1, dtype=np.float32), layout, seal=seal)),
    )


def payload_len(n_values: int, layout: str = "seed", sealed: bool = False) -> int:
    """The exact length of ``encode_payload`` of ``n_values`` float32 values (no metadata
    but, when ``sealed``, a seal; no compression), without encoding them.

    The IPC file's metadata (schema, record batch message, footer) has one size for every
    non-empty batch, because all its numbers are fixed-width fields; an empty batch is
    smaller, its zero lengths being flatbuffer defaults that are left out. The body holds
    one 4-byte-a-value buffer per column (index and value in the seed layout, value alone
    in the compact one), each padded to 8 bytes.
    """
    empty, one = _payload_len_constants(layout, sealed)
    if n_values == 0:
        return empty
    columns = 1 if layout == "compact" else 2
    return one + columns * (_pad8(4 * n_values) - _pad8(4))


def _min_payload_len(n_values: int, layout: str, dtype: str) -> int:
    """A lower bound on the length of an uncompressed payload of ``n_values`` values of
    ``dtype`` in ``layout``, to refuse an oversized chunk before encoding it (a compressed
    payload has no such bound: its size depends on the values)."""
    if dtype == "int8":
        return n_values  # one int8 a value, no index
    floor = _STORAGE[dtype].itemsize
    if layout != "compact":
        floor += _INDEX_BYTES_PER_VALUE
    return n_values * floor
