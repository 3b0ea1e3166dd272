"""The payload reader: open one payload (already CRC-checked) with pyarrow, after the
flatbuffer guard; check its schema, before any record batch is read, for the 'value'
column, its dtype and the gradient_dtype metadata (``_Head``); then read and validate the
value column of every record batch as numpy views over the payload bytes.

Apart because it judges one payload alone: the rules that tie the chunks of a gradient
together (total_chunks, order, the shape and dtype every chunk must agree on) are the
rules' and the receiver's, which call this. Any failure of pyarrow becomes ArrowIpcError
with pyarrow's own message.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.ipc

from .._arrow import is_bfloat16_type
from .._dtypes import DTYPE_KEY, DTYPES
from ..errors import ArrowIpcError
from . import _int8
from ._guard import _check_compressed_batches, _check_footer
from ._seal import SEAL_KEY
from ._wire import _ARROW_TYPES, _STORAGE, MANIFEST_KEY, SHAPE_KEY, USIZE_MAX

# What pyarrow raises for bytes it cannot read: its own exception classes, plain OSError
# (pyarrow.ArrowIOError is an alias of OSError, used e.g. for a corrupt footer) and
# UnicodeDecodeError for a field name that is not UTF-8 (arrow-rs's flatbuffer verifier
# refuses those too).
_ARROW_FAILURES = (pa.ArrowException, OSError, UnicodeDecodeError)

NOT_A_FLOAT = (
    "'value' column is not Float16, Float32, Float64, gradstream.bfloat16 or a list of Int8"
)
BAD_DTYPE = "gradient_dtype metadata is not float16, bfloat16, float32 or float64"
NO_SCALE = "an int8 'value' column needs a Float32 'scale' column"


def _concat(parts: Iterable[np.ndarray], dtype: np.dtype) -> np.ndarray:
    """``parts`` (1-D arrays of ``dtype``) end to end in a new array of ``dtype``."""
    # np.concatenate always allocates, so the result owns its memory and never aliases a
    # payload buffer (which may be the caller's bytes). It copies bytes, not float values.
    parts = list(parts)
    if not parts:
        return np.empty(0, dtype=dtype)
    return np.concatenate(parts)


def _storage_type(data_type: pa.DataType) -> pa.DataType:
    # arrow-rs keeps extension types as field metadata over their storage type, so to the
    # native decoder an extension column stored as Float32 *is* Float32; do the same here.
    if isinstance(data_type, pa.BaseExtensionType):
        return data_type.storage_type
    return data_type


def _field_index(names: list[str], wanted: str = "value") -> int | None:
    # The first field named ``wanted``, as arrow-rs column_by_name picks it
    # (pyarrow's get_field_index returns -1 when the name is duplicated).
    for i, name in enumerate(names):
        if name == wanted:
            return i
    return None


def _is_int8(data_type: pa.DataType) -> bool:
    """Whether a 'value' column is the int8 wire's: a list of Int8, a block a row (both
    seen through extension names, as arrow-rs sees them)."""
    data_type = _storage_type(data_type)
    return bool(pa.types.is_list(data_type) and _storage_type(data_type.value_type) == pa.int8())


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
    dtype: str  # of the value column's values (float32 for the int8 wire's, dequantized)
    result: str | None  # gradient_dtype metadata (one of DTYPES), None when absent
    shape: str | None  # gradient_shape metadata, raw (checked after the batches)
    manifest: str | None  # gradstream_tensors metadata, raw
    seal: str | None  # gradstream_seal metadata, raw (the receiver's _SealTracker reads it)
    scale: int | None = None  # of the 'scale' field, for the int8 wire's payloads alone

    @property
    def column_name(self) -> str:
        """What the value column holds, as messages name it: its dtype, or int8."""
        return self.dtype if self.scale is None else "int8"

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
    column = _field_index(names)
    if column is None:
        raise ArrowIpcError("Arrow IPC block missing 'value' column", chunk_index)
    scale = None
    if _is_int8(schema.field(column).type):
        scale = _field_index(names, "scale")
        if scale is None or _storage_type(schema.field(scale).type) != pa.float32():
            raise ArrowIpcError(NO_SCALE, chunk_index)
        dtype: str | None = "float32"
    else:
        dtype = _column_dtype(schema.field(column).type)
    if dtype is None:
        raise ArrowIpcError(NOT_A_FLOAT, chunk_index)
    result = metadata.get(DTYPE_KEY)
    if result is not None and result not in DTYPES:
        raise ArrowIpcError(BAD_DTYPE, chunk_index)
    head = _Head(
        column,
        dtype,
        result,
        metadata.get(SHAPE_KEY),
        metadata.get(MANIFEST_KEY),
        metadata.get(SEAL_KEY),
        scale,
    )
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
            batch = reader.get_batch(i)
            values = batch.column(head.column)
            # Full validation of the one column we read, before touching its buffers: a
            # hostile file must fail here, never read out of bounds later. Other columns
            # (the index) are ignored as the original ignores them, damaged or not.
            values.validate(full=True)
            scales = None if head.scale is None else batch.column(head.scale)
            if scales is not None:
                scales.validate(full=True)
        except _ARROW_FAILURES as exc:
            raise ArrowIpcError(str(exc), chunk_index) from exc
        columns.append((values, scales))
    if head.scale is not None:
        return [_int8_values(values, scales, chunk_index) for values, scales in columns]
    parts = []
    for column, _ in columns:
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


def _int8_values(values: pa.ListArray, scales: pa.Array, chunk_index: int) -> np.ndarray:
    """One batch of the int8 wire (its value list column and scale column, validated) as
    float32, block by block: nulls refused in the lists, the scales, then the lists' Int8
    values (all of them, as the native reader counts them)."""
    for what, nulls in (
        ("'value'", values.null_count),
        ("'scale'", scales.null_count),
        ("'value' column's Int8", values.values.null_count),
    ):
        if nulls:
            raise ArrowIpcError(f"{what} column has {nulls} null value(s)", chunk_index)
    # pyarrow's full validation skips the offsets of a batch of no rows, and flatten()
    # aborts the process on offsets past the child: checked here first.
    offsets = values.offsets.to_numpy(zero_copy_only=False)
    child = len(values.values)
    if len(offsets) and (offsets[0] < 0 or offsets[-1] > child or (np.diff(offsets) < 0).any()):
        raise ArrowIpcError("int8 'value' list offsets lie outside its values", chunk_index)
    q = values.flatten().to_numpy(zero_copy_only=False)
    lengths = values.value_lengths().to_numpy(zero_copy_only=False)
    return _int8.dequantize(q, scales.to_numpy(zero_copy_only=False), lengths)


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
