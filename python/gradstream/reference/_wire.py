"""The wire format's fixed facts, as docs/spec/wire-format.md states them: the frame
header, the payload layouts and their schemas, the schema metadata keys, and the Arrow
type and numpy storage of each value dtype.

Apart because both directions need them and neither owns them: the writer lays payloads
out with them, the reader and the receiver hold payloads to them. Nothing here runs.
"""

from __future__ import annotations

import struct
from typing import Any

import numpy as np
import pyarrow as pa

from .. import _arrow

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

# The "compact" layout: the value column alone (4 bytes a value instead of 8). The
# original's decoder only looks up `value`, so it reads these too.
COMPACT_SCHEMA = pa.schema([pa.field("value", pa.float32(), nullable=False)])
LAYOUTS = ("seed", "compact")

# The int8 wire's payload (wire_dtype="int8"), whatever the layout: a row a block, its
# int8 values and its float32 scale (docs/spec/wire-format.md, "The int8 wire").
INT8_SCHEMA = pa.schema(
    [
        pa.field("value", pa.list_(pa.field("item", pa.int8(), nullable=False)), nullable=False),
        pa.field("scale", pa.float32(), nullable=False),
    ]
)

# Schema metadata keys gradstream reads and writes, in the order it writes them:
# gradient_shape (keep_shape), gradient_dtype (_dtypes.DTYPE_KEY) and gradstream_tensors.
SHAPE_KEY = "gradient_shape"
MANIFEST_KEY = "gradstream_tensors"

# The value column's Arrow type by dtype. bfloat16 is its storage type, UInt16, with the
# field metadata of the extension type gradstream.bfloat16 (what arrow-rs writes; pyarrow
# reads it back as _arrow.BFloat16Type, registered when _arrow is imported, as the
# reader's import of it does).
_ARROW_TYPES = {
    "float16": pa.float16(),
    "bfloat16": pa.uint16(),
    "float32": pa.float32(),
    "float64": pa.float64(),
}
_BF16_FIELD_METADATA = {
    b"ARROW:extension:name": _arrow.BF16_EXTENSION.encode(),
    b"ARROW:extension:metadata": b"",
}
# The numpy dtype of a value column's values as they are moved (bfloat16 as its bits).
_STORAGE: dict[str, np.dtype] = {
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(np.uint16),
    "float32": np.dtype(np.float32),
    "float64": np.dtype(np.float64),
}


# ---------------------------------------------------------------------------- shapes
# The reference's own copy of the shape grammar's two facts (the native side's is
# gradstream-core's shape.rs): how gradient_shape is written, and the largest shape.


def shape_text(shape: Any) -> str:
    """A shape as compact JSON: ``[768,3072]``, ``[]`` for a 0-d array (the text of
    ``gradient_shape`` and of the messages about shapes)."""
    return "[" + ",".join(str(d) for d in shape) + "]"


def numpy_can_make(dims: tuple[int, ...]) -> bool:
    """Whether numpy can make an array of these dimensions in any of the four dtypes: it
    refuses when the non-zero dimensions multiply past 2**63 bytes, even for an empty
    array. docs/spec/decoding-rules.md: such a shape is refused, at most 2**60 values."""
    product = 1
    for dim in dims:
        if dim:
            product *= dim
            if product > 1 << 60:
                return False
    return True
