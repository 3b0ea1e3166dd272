"""What the dtype tests (dtypes/) share: the four dtypes' numpy and Arrow forms, values
from bit patterns, what a receiver must hand back, and payloads written with pyarrow.
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np
import pyarrow as pa

import gradstream._convert as _convert
import gradstream._dtypes as _dtypes
from support.payloads import write_ipc_file
from support.values import SPECIAL_BITS

DTYPES = ["float16", "bfloat16", "float32", "float64"]


BF16_FIELD = {b"ARROW:extension:name": b"gradstream.bfloat16", b"ARROW:extension:metadata": b""}


# The unsigned word of each dtype's width, to compare values bit for bit.
WORD: dict[str, type] = {
    "float16": np.uint16,
    "bfloat16": np.uint16,
    "float32": np.uint32,
    "float64": np.uint64,
}


# How each dtype's values are held for _dtypes.cast (bfloat16 as its uint16 bits).
STORAGE: dict[str, type] = {
    "float16": np.float16,
    "bfloat16": np.uint16,
    "float32": np.float32,
    "float64": np.float64,
}


ARROW: dict[str, pa.DataType] = {
    "float16": pa.float16(),
    "bfloat16": pa.uint16(),
    "float32": pa.float32(),
    "float64": pa.float64(),
}


# Bit patterns of each dtype that a careless copy or cast would change (the float32 ones
# are support.values'): NaN payloads of both signs, signalling NaNs, -0.0, +-inf, the smallest
# and a negative subnormal, the largest finite value, 1.0.
SPECIALS: dict[str, list[int]] = {
    "float16": [
        0x7E01,
        0xFFFF,
        0x7C01,
        0x7DFF,
        0x8000,
        0x0000,
        0x7C00,
        0xFC00,
        0x0001,
        0x83FF,
        0x7BFF,
        0x3C00,
    ],
    "bfloat16": [
        0x7FC1,
        0xFFFF,
        0x7F81,
        0x7FBF,
        0x8000,
        0x0000,
        0x7F80,
        0xFF80,
        0x0001,
        0x807F,
        0x7F7F,
        0x3F80,
    ],
    "float32": [int(b) for b in SPECIAL_BITS],
    "float64": [
        0x7FF8_0000_0000_0001,
        0xFFFF_FFFF_FFFF_FFFF,
        0x7FF0_0000_0000_0001,
        0x7FF7_FFFF_FFFF_FFFF,
        0x8000_0000_0000_0000,
        0x0000_0000_0000_0000,
        0x7FF0_0000_0000_0000,
        0xFFF0_0000_0000_0000,
        0x0000_0000_0000_0001,
        0x800F_FFFF_FFFF_FFFF,
        0x7FEF_FFFF_FFFF_FFFF,
        0x3FF0_0000_0000_0000,
    ],
}


def numpy_dtype(name: str) -> np.dtype:
    """The numpy dtype of ``name`` as a caller holds it (bfloat16: ml_dtypes')."""
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


def from_bits(words: Any, name: str, shape: tuple[int, ...] | None = None) -> np.ndarray:
    """An array of dtype ``name`` (bfloat16: ml_dtypes) holding these bit patterns."""
    arr = np.asarray(words, dtype=WORD[name]).view(numpy_dtype(name))
    return arr.reshape(shape) if shape is not None else arr


def bits(values: Any) -> np.ndarray:
    """The raw bits of an array of one of the four dtypes, flat, C order."""
    arr = np.ascontiguousarray(values)
    name = _dtypes.dtype_name(arr.dtype)
    assert name is not None, arr.dtype
    return arr.reshape(-1).view(WORD[name])


def sample(name: str, n: int, seed: int = 0) -> np.ndarray:
    """n bit patterns of ``name``: the specials, then random words and random normal
    values (so that casts round real numbers, not only NaNs and extremes)."""
    rng = np.random.default_rng(seed)
    width = np.dtype(WORD[name]).itemsize
    words = np.frombuffer(rng.bytes(width * n), dtype=WORD[name]).copy()
    normal = rng.standard_normal(n) * np.exp2(rng.integers(-20, 20, n))
    as_name = _dtypes.cast(normal.astype(np.float64), "float64", name)
    words[1::2] = as_name.view(WORD[name])[1::2]
    special = np.array(SPECIALS[name], dtype=WORD[name])
    k = min(n, len(special))
    words[:k] = special[:k]
    return words


def expected(words: np.ndarray, source: str, wire: str, result: str) -> np.ndarray:
    """What a gradient of ``source`` bits comes back as, sent on ``wire`` and handed back
    as ``result``: two casts by the shared reference of the rule."""
    values = np.asarray(words, dtype=WORD[source]).view(STORAGE[source])
    on_wire = _dtypes.cast(values, source, wire)
    back = _dtypes.cast(on_wire, wire, result)
    return np.asarray(back).reshape(-1).view(WORD[result])


def schema_of(payload: bytes) -> pa.Schema:
    return pa.ipc.open_file(pa.py_buffer(payload)).schema


def payload(
    words: Any,
    dtype: str | None = None,
    *,
    arrow_type: pa.DataType | None = None,
    field_metadata: dict[bytes, bytes] | None = None,
    metadata: dict[str, str] | None = None,
    layout: str = "compact",
    compression: str | None = None,
    nulls: bool = False,
) -> bytes:
    """An Arrow IPC file written by pyarrow: a value column of ``arrow_type`` (by default
    ``dtype``'s, with the bfloat16 field metadata for bfloat16) holding ``words`` as raw
    bits, with the given field and schema metadata."""
    if arrow_type is None:
        assert dtype is not None
        arrow_type = ARROW[dtype]
        if dtype == "bfloat16" and field_metadata is None:
            field_metadata = BF16_FIELD
    raw = np.ascontiguousarray(words)
    n = len(raw)
    validity = None
    if nulls:
        validity = pa.py_buffer(np.packbits(np.arange(n) > 0, bitorder="little").tobytes())
    column = pa.Array.from_buffers(arrow_type, n, [validity, pa.py_buffer(raw)])
    fields = [pa.field("value", arrow_type, nullable=nulls, metadata=field_metadata)]
    columns = [column]
    if layout == "seed":
        fields.insert(0, pa.field("index", pa.int32(), nullable=False))
        columns.insert(0, pa.array(np.arange(n, dtype=np.int32)))
    schema = pa.schema(fields, metadata=metadata)
    batch = pa.RecordBatch.from_arrays(columns, schema=schema)
    return write_ipc_file(schema, batch, compression)


def assert_values(got: Any, name: str, want_bits: Any, shape: tuple[int, ...] | None = None):
    """``got`` is a numpy array handed back in ``name`` holding exactly ``want_bits``."""
    assert isinstance(got, np.ndarray), got
    assert got.dtype == numpy_dtype(name), (got.dtype, name)
    want = np.asarray(want_bits, dtype=WORD[name]).reshape(-1)
    if shape is not None:
        assert got.shape == shape, (got.shape, shape)
    else:
        assert got.ndim == 1 and got.size == want.size, got.shape
    assert np.array_equal(bits(got), want), (bits(got), want)


# What gradient input of a dtype gradstream does not take is refused with.
def rejected(name: str) -> str:
    return f"gradient has dtype {name}; {_convert._HOW}"
