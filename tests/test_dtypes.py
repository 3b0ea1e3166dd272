"""Dtypes (README "Dtypes", "The cast rule", "Decoding rules"): ``keep_dtype=True`` and
``wire_dtype=``, against both implementations.

gradstream moves float16, bfloat16, float32 and float64. The ``value`` column's Arrow type
says which (bfloat16: UInt16 tagged with the extension name ``gradstream.bfloat16``); the
schema metadata ``gradient_dtype`` names the dtype to hand back when it is not the
column's. The sender casts with the shared ``gradstream._dtypes.prepare``; each receiver
casts with its own code (numpy in the reference, Rust in the native core), so the results
here are compared with ``_dtypes.cast`` *and* with bit patterns picked by hand
(``CAST_CASES``), which hold the cast rule independently of any implementation.

Hostile payloads are built with pyarrow (``payload``) and carry correct CRCs, so that they
reach the dtype rules.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import math
import pickle
import socket
import struct
import zlib
from types import ModuleType
from typing import Any

import ml_dtypes
import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

import gradstream._convert as _convert
import gradstream._dtypes as _dtypes
import gradstream.reference as ref
from gradstream.errors import (
    ArrowIpcError,
    FrameError,
    GradientDtypeError,
    GradientSizeError,
    GradientStreamError,
    SettingError,
)
from support import TESTS
from support.aio import run
from support.frames import HEADER, assert_error, both_ways, join_frames, split_frames
from support.frames import frame_offsets as offsets_of
from support.impls import CODECS, IMPL_NAMES, LAYOUTS, PAIR_IDS, PAIRS, examples, session
from support.impls import load_impl as module
from support.payloads import rebuild, the_batch, with_buffer, write_ipc_file
from support.values import SPECIAL_BITS

DTYPES = ["float16", "bfloat16", "float32", "float64"]
NOT_A_FLOAT = "'value' column is not Float16, Float32, Float64 or gradstream.bfloat16"
BAD_DTYPE = "gradient_dtype metadata is not float16, bfloat16, float32 or float64"
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


# --------------------------------------------------------------------------- helpers


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


def column_bits(payload: bytes) -> np.ndarray:
    """The raw bits of a payload's value column, read by pyarrow."""
    table = pa.ipc.open_file(pa.py_buffer(payload)).read_all()
    column = table.column("value").combine_chunks()
    if isinstance(column, pa.ExtensionArray):
        column = column.storage
    values = column.to_numpy(zero_copy_only=False)
    return values.view(WORD[_dtypes.dtype_name(values.dtype) or "bfloat16"])


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


# --------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", DTYPES)
@pytest.mark.parametrize(("enc", "dec"), PAIRS, ids=PAIR_IDS)
def test_keep_dtype_round_trip_is_bit_exact(enc: str, dec: str, name: str, layout: str):
    """Every dtype travels in its own column type and comes back in its own dtype, every
    bit kept (NaN payloads, signalling NaNs, -0.0, subnormals, infinities), through
    decode_frames (in order and not), decode_chunks and out=; a default receiver."""
    sender = session(module(enc), 5, layout=layout, keep_dtype=True)
    receiver = session(module(dec), 3)
    words = sample(name, 23)
    grad = from_bits(words, name)
    wire = sender.encode_frames(grad)
    parts = split_frames(wire)
    assert len(parts) == 5
    for _, _, p in parts:
        field = schema_of(p).field("value")
        assert field.type == (_dtypes.BFloat16Type() if name == "bfloat16" else ARROW[name])
        assert schema_of(p).metadata is None  # no gradient_dtype: the column says it all
    assert_values(receiver.decode_frames(wire), name, words)
    assert_values(receiver.decode_frames(join_frames(parts[::-1])), name, words)
    chunks = sender.encode_gradient(grad)
    assert [c.arrow_ipc_bytes for c in chunks] == [p for _, _, p in parts]
    assert_values(receiver.decode_chunks(chunks[::-1]), name, words)
    out = np.zeros((23, 1), dtype=numpy_dtype(name))
    assert receiver.decode_frames(join_frames(parts[2:] + parts[:2]), out=out) is out
    assert out.shape == (23, 1)
    assert np.array_equal(bits(out), words)


@pytest.mark.parametrize("keep", [False, True], ids=["float32-back", "keep-dtype"])
@pytest.mark.parametrize("wire_dtype", DTYPES)
@pytest.mark.parametrize("source", DTYPES)
def test_wire_dtype_casts_by_the_rule(impl: ModuleType, source: str, wire_dtype: str, keep):
    """Any input dtype, sent on any wire dtype, comes back as float32 (or its own dtype
    with keep_dtype) exactly as the cast rule says: cast(cast(x, source, wire), wire,
    result), bit for bit, from either receiver. The sender writes gradient_dtype only
    when the result is not the wire's dtype."""
    result = source if keep else "float32"
    sender = session(impl, 7, wire_dtype=wire_dtype, keep_dtype=keep)
    words = sample(source, 40, seed=3)
    wire = sender.encode_frames(from_bits(words, source))
    parts = split_frames(wire)
    want = expected(words, source, wire_dtype, result)
    on_wire = np.concatenate([column_bits(p) for _, _, p in parts])
    assert np.array_equal(on_wire, expected(words, source, wire_dtype, wire_dtype))
    for _, _, p in parts:
        schema = schema_of(p)
        meta = {} if result == wire_dtype else {b"gradient_dtype": result.encode()}
        assert (schema.metadata or {}) == meta
    for name in IMPL_NAMES:
        receiver = session(module(name), 3)
        assert_values(receiver.decode_frames(wire), result, want)
        assert_values(
            receiver.decode_chunks(sender.encode_gradient(from_bits(words, source))), result, want
        )
        out = np.empty(40, dtype=numpy_dtype(result))
        receiver.decode_frames(join_frames(parts[::-1]), out=out)
        assert np.array_equal(bits(out), want)


def test_wire_dtype_float32_is_a_plain_float32_stream(impl: ModuleType):
    """wire_dtype="float32" without keep_dtype sends any dtype as the original's float32
    payloads (no metadata); frames_len holds for it."""
    s = session(impl, 4, wire_dtype="float32")
    plain = session(impl, 4)
    grad64 = np.linspace(-3, 3, 10)
    wire = s.encode_frames(grad64)
    assert wire == plain.encode_frames(grad64.astype(np.float32))
    assert len(wire) == s.frames_len(10) == plain.frames_len(10)
    for _, _, p in split_frames(wire):
        assert schema_of(p).metadata is None
        assert schema_of(p).field("value").type == pa.float32()
    # keep_dtype=True adds gradient_dtype: float64 comes back float64 (cast twice).
    k = session(impl, 4, wire_dtype="float32", keep_dtype=True)
    parts = split_frames(k.encode_frames(grad64))
    assert all(schema_of(p).metadata == {b"gradient_dtype": b"float64"} for _, _, p in parts)
    back = plain.decode_frames(join_frames(parts))
    assert back.dtype == np.float64
    assert np.array_equal(back, grad64.astype(np.float32).astype(np.float64))


def test_empty_input_is_float32_and_an_empty_gradient_keeps_its_dtype(impl: ModuleType):
    s = session(impl)
    assert s.decode_frames(b"").dtype == np.float32
    assert s.decode_chunks([]).dtype == np.float32
    for name in DTYPES:
        k = session(impl, keep_dtype=True)
        grad = np.empty((0, 5), dtype=numpy_dtype(name))
        wire = k.encode_frames(grad)
        assert len(split_frames(wire)) == 1
        for got in (s.decode_frames(wire), s.decode_chunks(k.encode_gradient(grad))):
            assert got.dtype == numpy_dtype(name) and got.shape == (0,)
        w = session(impl, wire_dtype=name).encode_frames(np.empty(0, np.float32))
        got = s.decode_frames(w)
        assert got.dtype == np.float32 and got.shape == (0,)


# --------------------------------------------------------------------------- the cast rule

# (source, target, source bits, target bits), worked out by hand from the rule: to float64
# exact; otherwise rounded to float32, then to the target, to nearest, ties to even; out of
# range to infinity; NaN to the canonical quiet NaN with its sign; same dtype unchanged.
_ONE_PLUS_2M11_2M30 = 0x3FF0_0200_0040_0000  # 1 + 2^-11 + 2^-30 (float64)
_ONE_PLUS_2M8_2M30 = 0x3FF0_1000_0040_0000  # 1 + 2^-8 + 2^-30 (float64)
_JUST_BELOW_65520 = struct.unpack("<Q", struct.pack("<d", 65520.0 - 2.0**-20))[0]
_1E300 = struct.unpack("<Q", struct.pack("<d", 1e300))[0]
CAST_CASES: list[tuple[str, str, int, int]] = [
    # float32 -> bfloat16
    ("float32", "bfloat16", 0x3F80_8000, 0x3F80),  # 1 + 2^-8: a tie, to even (down)
    ("float32", "bfloat16", 0x3F80_8001, 0x3F81),  # just above the tie
    ("float32", "bfloat16", 0x3F81_8000, 0x3F82),  # a tie, to even (up)
    ("float32", "bfloat16", 0xBF81_8000, 0xBF82),  # the same, negative
    ("float32", "bfloat16", 0x7F7F_7FFF, 0x7F7F),  # below the top tie: finite
    ("float32", "bfloat16", 0x7F7F_8000, 0x7F80),  # the top tie: to even, which is inf
    ("float32", "bfloat16", 0x7F7F_FFFF, 0x7F80),  # float32 max: inf
    ("float32", "bfloat16", 0xFF7F_FFFF, 0xFF80),
    ("float32", "bfloat16", 0x7F80_0000, 0x7F80),
    ("float32", "bfloat16", 0x7FC0_0001, 0x7FC0),  # NaN payload dropped
    ("float32", "bfloat16", 0xFFFF_FFFF, 0xFFC0),  # negative NaN keeps its sign
    ("float32", "bfloat16", 0x7F80_0001, 0x7FC0),  # signalling NaN (truncation: inf)
    ("float32", "bfloat16", 0xFF80_0001, 0xFFC0),
    ("float32", "bfloat16", 0x8000_0000, 0x8000),
    ("float32", "bfloat16", 0x0000_8000, 0x0000),  # subnormal tie, to even (0)
    ("float32", "bfloat16", 0x0001_8000, 0x0002),  # subnormal tie, to even (up)
    ("float32", "bfloat16", 0x8000_0001, 0x8000),  # to signed zero
    # float32 -> float16
    ("float32", "float16", 0x477F_E000, 0x7BFF),  # 65504, the largest finite
    ("float32", "float16", 0x477F_EFFF, 0x7BFF),  # just below 65520
    ("float32", "float16", 0x477F_F000, 0x7C00),  # 65520: the tie, to even, is inf
    ("float32", "float16", 0xC77F_F000, 0xFC00),
    ("float32", "float16", 0x5015_02F9, 0x7C00),  # 1e10
    ("float32", "float16", 0x3F80_1000, 0x3C00),  # 1 + 2^-11: tie to even (down)
    ("float32", "float16", 0x3F80_3000, 0x3C02),  # 1 + 3 * 2^-11: tie to even (up)
    ("float32", "float16", 0x3F80_1001, 0x3C01),  # just above the tie
    ("float32", "float16", 0x3880_0000, 0x0400),  # 2^-14, the smallest normal
    ("float32", "float16", 0x3380_0000, 0x0001),  # 2^-24, the smallest subnormal
    ("float32", "float16", 0x3300_0000, 0x0000),  # 2^-25: tie, to even (0)
    ("float32", "float16", 0x3340_0000, 0x0001),  # 1.5 * 2^-25: up
    ("float32", "float16", 0xB300_0000, 0x8000),  # -2^-25: signed zero
    ("float32", "float16", 0x7FC0_0001, 0x7E00),
    ("float32", "float16", 0xFFC0_0000, 0xFE00),
    ("float32", "float16", 0x7F80_0001, 0x7E00),
    ("float32", "float16", 0xFF80_0001, 0xFE00),
    ("float32", "float16", 0xFF80_0000, 0xFC00),
    # float64 -> float16 and bfloat16: two roundings (a direct rounding differs)
    ("float64", "float16", _ONE_PLUS_2M11_2M30, 0x3C00),  # direct: 0x3C01
    ("float64", "float16", _JUST_BELOW_65520, 0x7C00),  # direct: 0x7BFF
    ("float64", "float16", 0x7FF0_0000_0000_0001, 0x7E00),
    ("float64", "float16", 0xFFF8_0000_0000_0000, 0xFE00),
    ("float64", "float16", 0x0000_0000_0000_0001, 0x0000),
    ("float64", "float16", 0x8000_0000_0000_0001, 0x8000),
    ("float64", "bfloat16", _ONE_PLUS_2M8_2M30, 0x3F80),  # direct: 0x3F81
    ("float64", "bfloat16", _1E300, 0x7F80),
    ("float64", "bfloat16", 0x7FF8_0000_0000_0001, 0x7FC0),
    ("float64", "bfloat16", 0xFFF0_0000_0000_0001, 0xFFC0),
    # float64 -> float32
    ("float64", "float32", 0x3FF0_0000_1000_0000, 0x3F80_0000),  # 1 + 2^-24: tie, down
    ("float64", "float32", 0x3FF0_0000_1000_0001, 0x3F80_0001),
    ("float64", "float32", 0x47EF_FFFF_F000_0000, 0x7F80_0000),  # max + half ulp: inf
    ("float64", "float32", 0x47EF_FFFF_EFFF_FFFF, 0x7F7F_FFFF),
    ("float64", "float32", 0xC7EF_FFFF_F000_0000, 0xFF80_0000),
    ("float64", "float32", 0x7FF0_0000_0000_0001, 0x7FC0_0000),
    ("float64", "float32", 0xFFF0_0000_0000_0001, 0xFFC0_0000),
    ("float64", "float32", 0x0000_0000_0000_0001, 0x0000_0000),
    ("float64", "float32", 0x36A0_0000_0000_0000, 0x0000_0001),  # 2^-149
    ("float64", "float32", 0x3690_0000_0000_0000, 0x0000_0000),  # 2^-150: tie, to 0
    # widenings: exact, NaNs canonical
    ("float16", "float64", 0x7E01, 0x7FF8_0000_0000_0000),
    ("float16", "float64", 0xFC01, 0xFFF8_0000_0000_0000),
    ("float16", "float64", 0x0001, 0x3E70_0000_0000_0000),  # 2^-24
    ("float16", "float64", 0x8000, 0x8000_0000_0000_0000),
    ("float16", "float64", 0x7BFF, 0x40EF_FC00_0000_0000),  # 65504
    ("float16", "float64", 0xFC00, 0xFFF0_0000_0000_0000),
    ("float16", "float32", 0x7C01, 0x7FC0_0000),
    ("float16", "float32", 0x0001, 0x3380_0000),
    ("float16", "float32", 0x3555, 0x3EAA_A000),
    ("bfloat16", "float32", 0x7F81, 0x7FC0_0000),
    ("bfloat16", "float32", 0x3F81, 0x3F81_0000),
    ("bfloat16", "float32", 0x8001, 0x8001_0000),
    ("bfloat16", "float64", 0x3F81, 0x3FF0_2000_0000_0000),
    ("bfloat16", "float64", 0xFFC1, 0xFFF8_0000_0000_0000),
    ("float32", "float64", 0x7FC0_0001, 0x7FF8_0000_0000_0000),
    ("float32", "float64", 0x0000_0001, 0x36A0_0000_0000_0000),
    ("float32", "float64", 0xFF80_0000, 0xFFF0_0000_0000_0000),
    # between the half-width dtypes, through float32
    ("float16", "bfloat16", 0x3C01, 0x3F80),  # 1 + 2^-10: below bfloat16's half ulp
    ("float16", "bfloat16", 0x7BFF, 0x4780),  # 65504 rounds to 65536
    ("float16", "bfloat16", 0x0001, 0x3380),
    ("float16", "bfloat16", 0x3C20, 0x3F84),  # exact
    ("float16", "bfloat16", 0xFE01, 0xFFC0),
    ("bfloat16", "float16", 0x7F7F, 0x7C00),  # bfloat16 max: inf
    ("bfloat16", "float16", 0x4780, 0x7C00),  # 65536: inf
    ("bfloat16", "float16", 0x477F, 0x7BF8),  # 65280: exact
    ("bfloat16", "float16", 0x3F81, 0x3C08),
    ("bfloat16", "float16", 0x0001, 0x0000),
    ("bfloat16", "float16", 0x8001, 0x8000),
    ("bfloat16", "float16", 0x7FC1, 0x7E00),
    ("bfloat16", "float16", 0xFF81, 0xFE00),
    # the same dtype: every bit kept, signalling NaNs included
    ("float16", "float16", 0x7C01, 0x7C01),
    ("bfloat16", "bfloat16", 0x7F81, 0x7F81),
    ("float32", "float32", 0x7F80_0001, 0x7F80_0001),
    ("float64", "float64", 0x7FF0_0000_0000_0001, 0x7FF0_0000_0000_0001),
]
CAST_PAIRS = sorted({(s, t) for s, t, _, _ in CAST_CASES})


def cases_of(source: str, target: str) -> tuple[np.ndarray, np.ndarray]:
    rows = [(a, b) for s, t, a, b in CAST_CASES if (s, t) == (source, target)]
    return (
        np.array([a for a, _ in rows], dtype=WORD[source]),
        np.array([b for _, b in rows], dtype=WORD[target]),
    )


def test_double_rounding_cases_differ_from_a_direct_rounding():
    """The float64 cases above do exercise the rule's two roundings: numpy's direct
    float64 -> float16 rounding gives other bits."""
    direct = np.array([_ONE_PLUS_2M11_2M30, _JUST_BELOW_65520], np.uint64).view(np.float64)
    assert direct.astype(np.float16).view(np.uint16).tolist() == [0x3C01, 0x7BFF]


@pytest.mark.parametrize(("source", "target"), CAST_PAIRS)
def test_cast_rule_cases_shared_cast(source: str, target: str):
    """_dtypes.cast (the senders' cast, and this file's reference) against the table."""
    src, want = cases_of(source, target)
    got = _dtypes.cast(src.view(STORAGE[source]), source, target)
    assert [hex(w) for w in np.asarray(got).view(WORD[target])] == [hex(w) for w in want]


@pytest.mark.parametrize(("source", "target"), CAST_PAIRS)
def test_cast_rule_cases_receiver(impl: ModuleType, source: str, target: str):
    """Each receiver's own cast against the table: a payload whose column is ``source``
    and whose gradient_dtype is ``target`` (written even when equal to the column's)."""
    src, want = cases_of(source, target)
    p = payload(src, source, metadata={"gradient_dtype": target})
    for got in both_ways(impl, [(0, 1, p)]):
        assert_values(got, target, want)


@pytest.mark.parametrize(("source", "target"), CAST_PAIRS)
def test_cast_rule_cases_sender(impl: ModuleType, source: str, target: str):
    """The sender's cast to wire_dtype, read from the payload's value column."""
    src, want = cases_of(source, target)
    s = session(impl, 1000, wire_dtype=target, keep_dtype=True)
    ((_, _, p),) = split_frames(s.encode_frames(from_bits(src, source)))
    assert [hex(w) for w in column_bits(p)] == [hex(w) for w in want]
    meta = None if source == target else {b"gradient_dtype": source.encode()}
    assert schema_of(p).metadata == meta


@pytest.mark.parametrize("source", ["float32", "float64"])
@pytest.mark.parametrize(("wire_dtype", "bound"), [("bfloat16", 2.0**-8), ("float16", 2.0**-11)])
def test_rounding_error_is_within_the_documented_bound(impl, source, wire_dtype, bound):
    """Normal values: relative error at most 2^-8 (bfloat16) or 2^-11 (float16); the
    result is never the worse of the two neighbours (a random check of nearest)."""
    rng = np.random.default_rng(11)
    n = 4000
    top = 15 if wire_dtype == "float16" else 100  # float16's largest finite is 65504
    magnitude = np.exp2(rng.uniform(-14, top, n))
    x = (np.where(rng.random(n) < 0.5, -1.0, 1.0) * magnitude).astype(source)
    x = x[np.abs(x.astype(np.float64)) <= (65504.0 if wire_dtype == "float16" else 3e38)]
    s = session(impl, 1 << 20, wire_dtype=wire_dtype, keep_dtype=True)
    back = session(impl).decode_frames(s.encode_frames(x))
    assert back.dtype == x.dtype
    exact = x.astype(np.float64)
    err = np.abs(back.astype(np.float64) - exact) / np.abs(exact)
    assert err.max() <= bound, err.max()
    assert err.max() > bound / 4  # the bound is not loose: values really were rounded


# --------------------------------------------------------------------------- input


def _rejected(name: str) -> str:
    return f"gradient has dtype {name}; {_convert._HOW}"


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: np.zeros(3, np.float16), _rejected("float16")),
        (lambda: np.zeros(3, np.float64), _rejected("float64")),
        (lambda: np.zeros(3, ml_dtypes.bfloat16), _rejected("bfloat16")),
        (lambda: np.zeros((2, 2), ">f8"), _rejected(">f8")),
        (lambda: pa.array(np.zeros(3, np.float16)), None),
        (lambda: pa.array(np.zeros(3, np.float64)), None),
        (
            lambda: pa.ExtensionArray.from_storage(
                _dtypes.BFloat16Type(), pa.array(np.zeros(3, np.uint16))
            ),
            None,
        ),
    ],
    ids=["float16", "float64", "bfloat16", "f8-big-endian", "arrow-f16", "arrow-f64", "arrow-bf16"],
)
def test_other_dtypes_need_keep_dtype_or_wire_dtype(impl: ModuleType, make, message):
    """Without keep_dtype and wire_dtype, only float32 is taken: the same TypeError as
    before dtypes existed, from every encoding call, the same text from both."""
    s = session(impl)
    texts = set()
    for call in (s.encode_frames, s.encode_gradient, lambda g: s.encode_frames(g, True)):
        with pytest.raises(TypeError) as info:
            call(make())
        texts.add(str(info.value))
    with pytest.raises(TypeError) as info:
        session(module("reference")).encode_frames(make())
    assert texts == {str(info.value)}
    if message is not None:
        assert texts == {message}
    else:
        assert texts.pop().startswith("gradient has Arrow type ")
    # Either setting lets it through.
    assert session(impl, keep_dtype=True).encode_frames(make())
    assert session(impl, wire_dtype="float32").encode_frames(make())


@pytest.mark.parametrize("settings_", [{"keep_dtype": True}, {"wire_dtype": "float16"}])
def test_non_float_dtypes_stay_refused(impl: ModuleType, settings_: dict[str, Any]):
    s = session(impl, **settings_)
    for bad in (np.zeros(3, np.int32), np.zeros(3, np.complex64), np.zeros(3, np.uint16)):
        with pytest.raises(TypeError) as info:
            s.encode_frames(bad)
        assert str(info.value).startswith(f"gradient has dtype {bad.dtype}"), str(info.value)


def _bf16_arrow(words: np.ndarray) -> pa.Array:
    return pa.ExtensionArray.from_storage(_dtypes.BFloat16Type(), pa.array(words, pa.uint16()))


@pytest.mark.parametrize("name", ["float16", "bfloat16", "float32", "float64"])
@pytest.mark.parametrize("container", ["array", "chunked", "sliced"])
def test_arrow_inputs_of_every_dtype(impl: ModuleType, name: str, container: str):
    words = sample(name, 30, seed=5)
    if name == "bfloat16":
        arrow = _bf16_arrow(words)
    else:
        arrow = pa.array(words.view(STORAGE[name]), type=ARROW[name])
    want = words
    if container == "chunked":
        arrow = pa.chunked_array([arrow.slice(0, 11), arrow.slice(11)])
    elif container == "sliced":
        arrow, want = arrow.slice(3, 20), words[3:23]
    s = session(impl, 8, keep_dtype=True)
    assert_values(session(impl).decode_frames(s.encode_frames(arrow)), name, want)
    f16 = session(impl, 8, wire_dtype="float16")
    assert_values(
        session(impl).decode_frames(f16.encode_frames(arrow)),
        "float32",
        expected(want, name, "float16", "float32"),
    )


def test_arrow_input_with_nulls_is_refused(impl: ModuleType):
    s = session(impl, keep_dtype=True)
    arr = pa.array(np.ones(3, np.float16), mask=np.array([False, True, False]))
    with pytest.raises(ValueError, match="null"):
        s.encode_frames(arr)


def test_buffer_protocol_inputs_of_other_widths(impl: ModuleType):
    """Buffers of format 'e' (float16) and 'd' (float64) are taken with keep_dtype."""
    s = session(impl, keep_dtype=True)
    for arr in (np.arange(5, dtype=np.float16), np.arange(5, dtype=np.float64)):
        back = session(impl).decode_frames(s.encode_frames(memoryview(arr)))
        assert back.dtype == arr.dtype and np.array_equal(back, arr)


def test_non_native_byte_order_is_swapped(impl: ModuleType):
    s = session(impl, keep_dtype=True)
    for name in ("float16", "float64"):
        words = sample(name, 12)
        grad = from_bits(words, name).astype(np.dtype(name).newbyteorder(">"))
        assert_values(session(impl).decode_frames(s.encode_frames(grad)), name, words)


def test_a_strided_input_is_copied_in_c_order(impl: ModuleType):
    s = session(impl, 4, keep_dtype=True, keep_shape=True)
    base = from_bits(sample("bfloat16", 48), "bfloat16", (6, 8))
    view = base[::2, 1::3]
    got = session(impl).decode_frames(s.encode_frames(view))
    assert got.shape == view.shape
    assert np.array_equal(bits(got), bits(view))


# --------------------------------------------------------------------------- bfloat16


def test_bfloat16_comes_back_as_ml_dtypes(impl: ModuleType):
    s = session(impl, 3, keep_dtype=True)
    words = sample("bfloat16", 10)
    back = session(impl).decode_frames(s.encode_frames(from_bits(words, "bfloat16")))
    assert back.dtype == np.dtype(ml_dtypes.bfloat16)
    assert np.array_equal(bits(back), words)
    # float32 values sent as bfloat16 and handed back as bfloat16 (gradient_dtype).
    cast = session(impl, 3, wire_dtype="float16", keep_dtype=True)
    back = session(impl).decode_frames(cast.encode_frames(from_bits(words, "bfloat16")))
    assert back.dtype == np.dtype(ml_dtypes.bfloat16)
    assert np.array_equal(bits(back), expected(words, "bfloat16", "float16", "bfloat16"))


def test_bfloat16_without_ml_dtypes_comes_back_as_float32(impl, monkeypatch):
    """With _dtypes.BFLOAT16 None (ml_dtypes absent), a bfloat16 gradient is handed back
    widened to float32, exactly; out= must then be float32."""
    words = sample("bfloat16", 10)
    sender = session(impl, 3, keep_dtype=True)
    wire = sender.encode_frames(from_bits(words, "bfloat16"))
    chunks = sender.encode_gradient(from_bits(words, "bfloat16"))
    cast_wire = session(impl, 3, keep_dtype=True, wire_dtype="float16").encode_frames(
        from_bits(words, "bfloat16")
    )
    monkeypatch.setattr(_dtypes, "BFLOAT16", None)
    rx = session(impl)
    widened = expected(words, "bfloat16", "bfloat16", "float32")
    assert_values(rx.decode_frames(wire), "float32", widened)
    assert_values(rx.decode_chunks(chunks), "float32", widened)
    # Through float16: cast to bfloat16 first (the dtype handed back), then widened.
    via = expected(
        expected(words, "bfloat16", "float16", "bfloat16"), "bfloat16", "bfloat16", "float32"
    )
    assert_values(rx.decode_frames(cast_wire), "float32", via)
    out = np.empty(10, np.float32)
    assert rx.decode_frames(wire, out=out) is out
    assert np.array_equal(bits(out), widened)
    wrong = np.full(10, 7, dtype=ml_dtypes.bfloat16)
    with pytest.raises(GradientDtypeError) as info:
        rx.decode_frames(wire, out=wrong)
    assert (info.value.expected, info.value.received, info.value.chunk_index) == (
        "bfloat16",
        "float32",
        0,
    )
    assert str(info.value) == "the gradient is float32; out= is bfloat16"


# --------------------------------------------------------------------------- out=


@pytest.mark.parametrize("name", DTYPES)
def test_out_of_each_dtype(impl: ModuleType, name: str):
    s = session(impl, 4, keep_dtype=True)
    words = sample(name, 12, seed=2)
    parts = split_frames(s.encode_frames(from_bits(words, name)))
    out = np.zeros((3, 4), dtype=numpy_dtype(name))
    got = s.decode_frames(join_frames(parts[::-1]), out=out)
    assert got is out and out.shape == (3, 4)
    assert np.array_equal(bits(out), words)


@pytest.mark.parametrize(
    ("sent", "out_dtype", "settings_"),
    [
        ("float32", "float16", {}),
        ("float16", "float32", {"keep_dtype": True}),
        ("float64", "float32", {"keep_dtype": True}),
        ("bfloat16", "float16", {"keep_dtype": True}),
        ("float32", "float64", {"wire_dtype": "float64"}),  # handed back float32
        ("float64", "float16", {"wire_dtype": "float16", "keep_dtype": True}),  # float64
    ],
)
def test_out_of_another_dtype_is_a_gradient_dtype_error(impl, sent, out_dtype, settings_):
    """At the first chunk to arrive, before any of its values is written; its fields and
    text; a TypeError too, and it pickles."""
    received = sent if settings_.get("keep_dtype") else "float32"
    s = session(impl, 4, **settings_)
    parts = split_frames(s.encode_frames(from_bits(sample(sent, 10), sent)))
    for order in ([0, 1, 2], [2, 0, 1], [1, 2, 0]):
        sentinel = np.arange(10).astype(numpy_dtype(out_dtype))
        out = sentinel.copy()
        with pytest.raises(GradientDtypeError) as info:
            session(impl).decode_frames(join_frames([parts[i] for i in order]), out=out)
        err = info.value
        assert (err.expected, err.received, err.chunk_index) == (out_dtype, received, order[0])
        assert str(err) == f"the gradient is {received}; out= is {out_dtype}"
        assert isinstance(err, TypeError) and isinstance(err, GradientStreamError)
        assert np.array_equal(bits(out), bits(sentinel))  # nothing of the chunk written
        again = pickle.loads(pickle.dumps(err))
        assert type(again) is GradientDtypeError
        assert (again.expected, again.received, again.chunk_index) == (
            out_dtype,
            received,
            order[0],
        )


def test_receive_from_out_of_another_dtype(impl: ModuleType):
    s = session(impl, 4, keep_dtype=True)
    grad = from_bits(sample("float16", 10), "float16")
    wire = s.encode_frames(grad)

    async def main() -> tuple[Any, np.ndarray]:
        a, b = socket.socketpair()
        with a, b:
            a.sendall(wire)
            out = np.zeros(10, np.float32)
            with pytest.raises(GradientDtypeError) as info:
                await s.receive_from(b, out=out)
            return info.value, out

    err, out = run(main)
    assert (err.expected, err.received, err.chunk_index) == ("float32", "float16", 0)
    assert not out.any()


def test_receive_from_out_of_the_right_dtype(impl: ModuleType):
    s = session(impl, 4, keep_dtype=True, wire_dtype="bfloat16")
    words = sample("float64", 10)
    wire = s.encode_frames(from_bits(words, "float64"))

    async def main() -> np.ndarray:
        a, b = socket.socketpair()
        with a, b:
            a.sendall(wire)
            out = np.zeros((2, 5), np.float64)
            return await s.receive_from(b, out=out)

    got = run(main)
    assert got.shape == (2, 5)
    assert np.array_equal(bits(got), expected(words, "float64", "bfloat16", "float64"))


def test_empty_input_with_out_of_any_dtype(impl: ModuleType):
    """No chunk, no dtype to check: the empty input fills an empty out= of any dtype."""
    s = session(impl)
    for name in DTYPES:
        out = np.empty((0, 3), dtype=numpy_dtype(name))
        assert s.decode_frames(b"", out=out) is out
    with pytest.raises(GradientSizeError):
        s.decode_frames(b"", out=np.empty(2, np.float16))


# --------------------------------------------------------------------------- with shapes, codecs


@pytest.mark.parametrize(("enc", "dec"), PAIRS, ids=PAIR_IDS)
def test_keep_shape_with_dtypes(enc: str, dec: str):
    """The shape and the dtype travel together; a cast keeps the shape, 0-d included."""
    rx = session(module(dec), 3)
    cases = [
        ("float16", (3, 4), None, True),
        ("bfloat16", (2, 1, 5), None, True),
        ("float64", (), "float32", True),
        ("float64", (), "float16", False),
        ("float16", (0, 5), "float64", True),
        ("float32", (4, 2), "bfloat16", False),
    ]
    for source, shape, wire_dtype, keep in cases:
        tx = session(module(enc), 4, keep_shape=True, keep_dtype=keep, wire_dtype=wire_dtype)
        words = sample(source, math.prod(shape))
        grad = from_bits(words, source, shape)
        result = source if keep else "float32"
        want = expected(words, source, wire_dtype or source, result)
        wire = tx.encode_frames(grad)
        for _, _, p in split_frames(wire):
            meta = schema_of(p).metadata or {}
            # Key order is the writer's (arrow-rs keeps schema metadata in a hash map).
            assert meta[b"gradient_shape"] == ref._shape_text(shape).encode()
        assert_values(rx.decode_frames(wire), result, want, shape)
        assert_values(rx.decode_chunks(tx.encode_gradient(grad)[::-1]), result, want, shape)


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(("enc", "dec"), PAIRS, ids=PAIR_IDS)
def test_compression_with_dtypes(enc: str, dec: str, layout: str, codec: str):
    rx = session(module(dec), 3)
    for name in DTYPES:
        words = sample(name, 300, seed=9)
        words[100:250] = 0  # something to compress
        tx = session(module(enc), 64, layout=layout, compression=codec, keep_dtype=True)
        wire = tx.encode_frames(from_bits(words, name))
        assert_values(rx.decode_frames(wire), name, words)
        assert_values(rx.decode_chunks(tx.encode_gradient(from_bits(words, name))), name, words)
        cast = session(module(enc), 64, layout=layout, compression=codec, wire_dtype="bfloat16")
        got = rx.decode_frames(cast.encode_frames(from_bits(words, name)))
        assert_values(got, "float32", expected(words, name, "bfloat16", "float32"))


def test_payloads_are_smaller_for_narrower_dtypes(impl: ModuleType):
    """chunk_size counts values; the payload holds width bytes a value (plus the index in
    the seed layout)."""
    n = 1000
    sizes = {}
    for name in DTYPES:
        s = session(impl, 400, layout="compact", keep_dtype=True)
        parts = split_frames(s.encode_frames(from_bits(sample(name, n), name)))
        assert len(parts) == 3
        sizes[name] = sum(len(p) for _, _, p in parts)
    # bfloat16's field metadata (the extension name) costs some bytes a payload.
    assert sizes["float16"] < sizes["bfloat16"] < sizes["float32"]
    assert sizes["float16"] + 1500 < sizes["float32"] < sizes["float64"] - 3500


def test_max_payload_len_refuses_by_the_wire_width(impl: ModuleType):
    """A chunk that fits as float16 is refused as float32 (the encoder's FrameError)."""
    grad = np.ones(1000, np.float32)
    f16 = session(impl, 1000, layout="compact", wire_dtype="float16", max_payload_len=3000)
    assert session(impl).decode_frames(f16.encode_frames(grad)).size == 1000
    f32 = session(impl, 1000, layout="compact", max_payload_len=3000)
    with pytest.raises(FrameError) as info:
        f32.encode_frames(grad)
    assert info.value.chunk_index == 0
    f64 = session(impl, 1000, layout="compact", wire_dtype="float64", max_payload_len=3000)
    with pytest.raises(FrameError):
        f64.encode_frames(grad)


def test_max_gradient_len_counts_values_of_any_dtype(impl: ModuleType):
    s = session(impl, 4, keep_dtype=True)
    wire = s.encode_frames(np.ones(10, np.float16))
    with pytest.raises(FrameError) as info:
        session(impl, max_gradient_len=9).decode_frames(wire)
    assert info.value.detail == "gradient exceeds max_gradient_len 9: 10 values by chunk 2"
    assert session(impl, max_gradient_len=10).decode_frames(wire).dtype == np.float16


# --------------------------------------------------------------------------- payload rules


ACCEPTED_COLUMNS = {
    # case: (arrow type, field metadata, dtype handed back)
    "float16": (pa.float16(), None, "float16"),
    "float32": (pa.float32(), None, "float32"),
    "float64": (pa.float64(), None, "float64"),
    "bfloat16": (pa.uint16(), BF16_FIELD, "bfloat16"),
    "bfloat16-no-ext-metadata": (
        pa.uint16(),
        {b"ARROW:extension:name": b"gradstream.bfloat16"},
        "bfloat16",
    ),
    "bfloat16-other-ext-metadata": (
        pa.uint16(),
        {b"ARROW:extension:name": b"gradstream.bfloat16", b"ARROW:extension:metadata": b"x"},
        "bfloat16",
    ),
    # A float column is its dtype whatever extension name its field carries.
    "float32-named-bfloat16": (pa.float32(), BF16_FIELD, "float32"),
    "float16-named-bfloat16": (pa.float16(), BF16_FIELD, "float16"),
    "float64-named-other": (pa.float64(), {b"ARROW:extension:name": b"foo.bar"}, "float64"),
    "float32-other-metadata": (pa.float32(), {b"unit": b"m/s"}, "float32"),
}
REFUSED_COLUMNS = {
    "int32": (pa.int32(), None),
    "uint16-plain": (pa.uint16(), None),
    "uint16-other-extension": (pa.uint16(), {b"ARROW:extension:name": b"foo.bfloat16"}),
    "uint16-name-as-other-key": (pa.uint16(), {b"extension:name": b"gradstream.bfloat16"}),
    "int16-named-bfloat16": (pa.int16(), BF16_FIELD),
    "uint32-named-bfloat16": (pa.uint32(), BF16_FIELD),
    "uint64": (pa.uint64(), None),
}


@pytest.mark.parametrize("case", list(ACCEPTED_COLUMNS))
def test_value_column_types_accepted(impl: ModuleType, case: str):
    arrow_type, field_metadata, name = ACCEPTED_COLUMNS[case]
    words = sample(name, 9)
    p = payload(words, arrow_type=arrow_type, field_metadata=field_metadata, layout="seed")
    for got in both_ways(impl, [(0, 1, p)]):
        assert_values(got, name, words)


@pytest.mark.parametrize("case", list(REFUSED_COLUMNS))
def test_value_column_types_refused(impl: ModuleType, case: str):
    arrow_type, field_metadata = REFUSED_COLUMNS[case]
    width = arrow_type.bit_width // 8
    words = np.arange(6, dtype=f"u{width}")
    good = payload(np.zeros(4, np.float32), "float32")
    bad = payload(words, arrow_type=arrow_type, field_metadata=field_metadata)
    for got in both_ways(impl, [(0, 2, good), (1, 2, bad)]):
        assert_error(got, ArrowIpcError, NOT_A_FLOAT, 1)
    # Before any record batch: a file with none is refused as well.
    schema = pa.schema([pa.field("value", arrow_type, metadata=field_metadata)])
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, schema):
        pass
    for got in both_ways(impl, [(0, 1, sink.getvalue().to_pybytes())]):
        assert_error(got, ArrowIpcError, NOT_A_FLOAT, 0)


@pytest.mark.parametrize(
    "text", ["float", "Float32", "float32 ", " float16", "", "int8", "bf16", "float128", "[4]"]
)
def test_gradient_dtype_grammar(impl: ModuleType, text: str):
    p = payload(np.zeros(3, np.float32), "float32", metadata={"gradient_dtype": text})
    for got in both_ways(impl, [(0, 1, p)]):
        assert_error(got, ArrowIpcError, BAD_DTYPE, 0)


@pytest.mark.parametrize("result", DTYPES)
@pytest.mark.parametrize("column", DTYPES)
def test_gradient_dtype_names_the_dtype_handed_back(impl: ModuleType, column: str, result):
    words = sample(column, 14, seed=4)
    p = payload(words, column, metadata={"gradient_dtype": result}, layout="seed")
    want = expected(words, column, column, result)
    for got in both_ways(impl, [(0, 1, p)]):
        assert_values(got, result, want)


def test_gradient_dtype_listed_twice_counts_once_the_first(impl: ModuleType):
    p = payload(
        np.zeros(3, np.float32),
        "float32",
        metadata={"gradient_dtype": "float64", "gradient_dtypX": "bfloat16"},
    )
    twice = p.replace(b"gradient_dtypX", b"gradient_dtype")
    assert twice.count(b"gradient_dtype") == 2 * p.count(b"gradient_dtype")
    first = schema_of(twice).metadata[b"gradient_dtype"].decode()
    for got in both_ways(impl, [(0, 1, twice)]):
        assert isinstance(got, np.ndarray) and got.dtype == numpy_dtype(first)


def test_checks_within_a_payload_come_in_order(impl: ModuleType):
    """Missing column, then the column's type, then gradient_dtype's grammar, all before
    the record batches (nulls) and before gradient_shape's grammar."""
    meta = {"gradient_dtype": "half", "gradient_shape": "[x]"}
    cases = [
        # a missing value column beats a bad gradient_dtype
        (
            payload(np.zeros(2, np.float32), "float32", metadata=meta).replace(b"value", b"valuX"),
            "Arrow IPC block missing 'value' column",
        ),
        # the column's type beats a bad gradient_dtype
        (payload(np.zeros(2, np.int32), arrow_type=pa.int32(), metadata=meta), NOT_A_FLOAT),
        # a bad gradient_dtype beats nulls and a bad gradient_shape
        (payload(np.zeros(3, np.float16), "float16", metadata=meta, nulls=True), BAD_DTYPE),
        # with a good gradient_dtype: the nulls, then the shape
        (
            payload(
                np.zeros(3, np.float16), "float16", nulls=True, metadata={"gradient_shape": "[x]"}
            ),
            "'value' column has 1 null value(s)",
        ),
        (
            payload(np.zeros(3, np.float16), "float16", metadata={"gradient_shape": "[x]"}),
            "gradient_shape metadata is not a list of at most 32 non-negative integers: [x]",
        ),
    ]
    for p, detail in cases:
        for got in both_ways(impl, [(0, 1, p)]):
            assert_error(got, ArrowIpcError, detail, 0)


def _dtype_parts(first: bytes, second: bytes, n: int = 2) -> list[tuple[int, int, bytes]]:
    return [(0, n, first), (1, n, second)]


DISAGREEMENTS = {
    # case: (chunk 0's payload, chunk 1's payload, what chunk 0 says, what chunk 1 says)
    "float32-float16": (
        lambda: payload(np.zeros(2, np.float32), "float32"),
        lambda: payload(np.zeros(2, np.float16), "float16"),
        "holds float32",
        "holds float16",
    ),
    "bfloat16-float16": (
        lambda: payload(np.zeros(2, np.uint16), "bfloat16"),
        lambda: payload(np.zeros(2, np.float16), "float16"),
        "holds bfloat16",
        "holds float16",
    ),
    "float64-bfloat16": (
        lambda: payload(np.zeros(2, np.float64), "float64", layout="seed"),
        lambda: payload(np.zeros(2, np.uint16), "bfloat16", compression="zstd"),
        "holds float64",
        "holds bfloat16",
    ),
    "dtype-vs-none": (
        lambda: payload(np.zeros(2, np.float32), "float32", metadata={"gradient_dtype": "float64"}),
        lambda: payload(np.zeros(2, np.float32), "float32"),
        "says float64",
        "says none",
    ),
    "none-vs-dtype": (
        lambda: payload(np.zeros(2, np.float16), "float16"),
        lambda: payload(np.zeros(2, np.float16), "float16", metadata={"gradient_dtype": "float16"}),
        "says none",
        "says float16",
    ),
    "dtype-vs-dtype": (
        lambda: payload(np.zeros(2, np.float16), "float16", metadata={"gradient_dtype": "float32"}),
        lambda: payload(np.zeros(2, np.float16), "float16", metadata={"gradient_dtype": "float64"}),
        "says float32",
        "says float64",
    ),
}


def _disagree_text(first_index: int, first: str, index: int, second: str) -> str:
    what = "the value dtype" if first.startswith("holds") else "gradient_dtype"
    return f"chunks disagree on {what}: chunk {first_index} {first}, chunk {index} {second}"


@pytest.mark.parametrize("case", list(DISAGREEMENTS))
def test_chunks_disagree_on_dtypes(impl: ModuleType, case: str):
    """decode_frames compares with the first chunk to arrive (offset: the header's),
    decode_chunks with the lowest index (offset None)."""
    make0, make1, says0, says1 = DISAGREEMENTS[case]
    p0, p1 = make0(), make1()
    parts = _dtype_parts(p0, p1)
    chunks_got, frames_got = both_ways(impl, parts)
    detail = _disagree_text(0, says0, 1, says1)
    assert_error(chunks_got, FrameError, detail, 1, None)
    assert_error(frames_got, FrameError, detail, 1, offsets_of(parts)[1])
    # Chunk 1 arrives first: decode_frames blames chunk 0; decode_chunks still chunk 1.
    backwards = parts[::-1]
    chunks_got, frames_got = both_ways(impl, backwards)
    assert_error(chunks_got, FrameError, detail, 1, None)
    assert_error(
        frames_got, FrameError, _disagree_text(1, says1, 0, says0), 0, offsets_of(backwards)[1]
    )


def test_value_dtype_is_compared_before_gradient_dtype(impl: ModuleType):
    p0 = payload(np.zeros(2, np.float32), "float32", metadata={"gradient_dtype": "float64"})
    p1 = payload(np.zeros(2, np.float16), "float16")
    for got in both_ways(impl, _dtype_parts(p0, p1)):
        assert_error(got, FrameError, _disagree_text(0, "holds float32", 1, "holds float16"), 1)


def test_dtype_checks_come_before_the_record_batches(impl: ModuleType):
    """A chunk that disagrees on a dtype is refused for that before its batches are read:
    before its nulls, its gradient_shape (grammar and agreement), max_gradient_len and
    out='s size."""
    p0 = payload(np.zeros(2, np.float32), "float32", metadata={"gradient_shape": "[4]"})
    shape_meta = {"gradient_shape": "[x]"}
    detail = _disagree_text(0, "holds float32", 1, "holds float16")
    for p1 in (
        payload(np.zeros(2, np.float16), "float16", nulls=True),
        payload(np.zeros(2, np.float16), "float16", metadata=shape_meta),
        payload(np.zeros(2, np.float16), "float16", metadata={"gradient_shape": "[5]"}),
        payload(np.zeros(50, np.float16), "float16", metadata={"gradient_shape": "[4]"}),
    ):
        parts = _dtype_parts(p0, p1)
        for got in both_ways(impl, parts, out=lambda: np.zeros(4, np.float32), max_gradient_len=10):
            assert_error(got, FrameError, detail, 1)
    # gradient_dtype likewise.
    p1 = payload(
        np.zeros(2, np.float32), "float32", metadata={"gradient_dtype": "float64", **shape_meta}
    )
    for got in both_ways(impl, _dtype_parts(p0, p1)):
        assert_error(got, FrameError, _disagree_text(0, "says none", 1, "says float64"), 1)


def test_out_dtype_is_checked_before_the_record_batches(impl: ModuleType):
    """GradientDtypeError comes before the chunk's nulls, gradient_shape, max_gradient_len
    and out= size, but after its column type and gradient_dtype grammar."""
    f16 = np.zeros(8, np.float16)
    for p in (
        payload(f16, "float16", nulls=True),
        payload(f16, "float16", metadata={"gradient_shape": "[x]"}),
        payload(np.zeros(80, np.float16), "float16"),  # over max_gradient_len and out.size
    ):
        _, got = both_ways(
            impl, [(0, 1, p)], out=lambda: np.zeros(8, np.float32), max_gradient_len=10
        )
        assert type(got) is GradientDtypeError, got
        assert (got.expected, got.received, got.chunk_index) == ("float32", "float16", 0)
    for p, detail in (
        (payload(np.zeros(8, np.int32), arrow_type=pa.int32()), NOT_A_FLOAT),
        (payload(f16, "float16", metadata={"gradient_dtype": "f16"}), BAD_DTYPE),
    ):
        _, got = both_ways(impl, [(0, 1, p)], out=lambda: np.zeros(8, np.float32))
        assert_error(got, ArrowIpcError, detail, 0)
    # The handed-back dtype is gradient_dtype's, not the column's.
    p = payload(f16, "float16", metadata={"gradient_dtype": "float32"})
    _, got = both_ways(impl, [(0, 1, p)], out=lambda: np.zeros(8, np.float16))
    assert type(got) is GradientDtypeError
    assert (got.expected, got.received) == ("float16", "float32")
    _, got = both_ways(impl, [(0, 1, p)], out=lambda: np.ones(8, np.float32))
    assert isinstance(got, np.ndarray) and not got.any()


# --------------------------------------------------------------------------- compressed bound


def _float64_seed_template(codec: str, rows: int) -> bytes:
    return payload(np.zeros(rows, np.float64), "float64", layout="seed", compression=codec)


@pytest.mark.parametrize("codec", CODECS)
def test_seed_float64_compressed_batch_is_within_the_bound(impl: ModuleType, codec: str):
    """A seed float64 batch declares 12 bytes a row (index and value): accepted, from
    either encoder; sixteen bytes a row is the most; one byte more is refused."""
    words = sample("float64", 1000)
    words[::3] = 0
    for enc in IMPL_NAMES:
        tx = session(module(enc), 1000, compression=codec, keep_dtype=True)
        assert_values(
            session(impl).decode_frames(tx.encode_frames(from_bits(words, "float64"))),
            "float64",
            words,
        )
    rows = 1000
    template = _float64_seed_template(codec, rows)
    batch = the_batch(template)
    assert len(batch.buffers) == 4  # index validity, index data, value validity, value data
    values = np.frombuffer(words.tobytes(), np.uint8)
    index = np.arange(rows, dtype=np.int32)

    def prefixed(raw: bytes) -> bytes:
        return len(raw).to_bytes(8, "little") + pa.compress(raw, codec=codec, asbytes=True)

    batch = with_buffer(batch, 1, prefixed(index.tobytes()))
    batch = with_buffer(batch, 3, prefixed(values.tobytes()))
    for extra, ok in ((4 * rows, True), (4 * rows + 1, False)):
        hostile = rebuild(template, with_buffer(batch, 2, prefixed(b"\xff" * extra)))
        for got in both_ways(impl, [(0, 1, hostile)]):
            if ok:
                assert_values(got, "float64", words)
            else:
                assert_error(
                    got,
                    ArrowIpcError,
                    f"compressed IPC buffers declare {16 * rows + 1} bytes uncompressed in all, "
                    f"more than their {rows}-row batch can hold",
                    0,
                )


# --------------------------------------------------------------------------- settings


def test_settings_defaults_and_properties(impl: ModuleType):
    s = impl.GradientStreamSession("s")
    assert s.keep_dtype is False and s.wire_dtype is None
    params = list(inspect.signature(impl.GradientStreamSession).parameters.values())
    assert [p.name for p in params[-3:]] == ["keep_shape", "keep_dtype", "wire_dtype"]
    for p in params[-2:]:
        assert p.kind is inspect.Parameter.KEYWORD_ONLY
    assert params[-2].default is False and params[-1].default is None
    for name in DTYPES:
        t = session(impl, wire_dtype=name, keep_dtype=True)
        assert t.wire_dtype == name and t.keep_dtype is True
    # A str subclass is taken as its text.
    assert session(impl, wire_dtype=type("S", (str,), {})("float16")).wire_dtype == "float16"


def test_repr_ends_with_the_dtype_settings(impl: ModuleType):
    s = session(impl)
    assert repr(s).endswith(", keep_shape=False, keep_dtype=False, wire_dtype=None)"), repr(s)
    t = session(impl, keep_shape=True, keep_dtype=True, wire_dtype="bfloat16")
    assert repr(t).endswith(", keep_shape=True, keep_dtype=True, wire_dtype='bfloat16')"), repr(t)


def test_with_compression_keeps_the_settings(impl: ModuleType):
    t = session(impl, keep_shape=True, keep_dtype=True, wire_dtype="float16")
    for enabled in (True, False):
        u = t.with_compression(enabled)
        assert (u.keep_shape, u.keep_dtype, u.wire_dtype) == (True, True, "float16")
        assert u.compression == ("lz4" if enabled else None)


@pytest.mark.parametrize(
    ("value", "name"), [(1, "int"), (0, "int"), (None, "NoneType"), ("yes", "str"), (1.0, "float")]
)
def test_keep_dtype_must_be_a_bool(impl: ModuleType, value: Any, name: str):
    with pytest.raises(TypeError) as info:
        session(impl, keep_dtype=value)
    assert str(info.value) == f"keep_dtype must be a bool, got {name}"


@pytest.mark.parametrize("value", ["int8", "Float16", "float", "", "bf16", " float32"])
def test_wire_dtype_other_names_are_a_setting_error(impl: ModuleType, value: str):
    with pytest.raises(SettingError) as info:
        session(impl, wire_dtype=value)
    assert isinstance(info.value, ValueError)
    assert info.value.setting == "wire_dtype"
    assert str(info.value) == (
        f"wire_dtype must be None, 'float16', 'bfloat16', 'float32' or 'float64', got {value!r}"
    )


@pytest.mark.parametrize(
    ("value", "name"),
    [(16, "int"), (b"float16", "bytes"), (np.dtype(np.float16), "Float16DType"), (True, "bool")],
)
def test_wire_dtype_other_types_are_a_type_error(impl: ModuleType, value: Any, name: str):
    with pytest.raises(TypeError) as info:
        session(impl, wire_dtype=value)
    assert str(info.value) == f"wire_dtype must be None or a dtype name (str), not {name}"


def test_frames_len_refusals(impl: ModuleType):
    """After the compression and keep_shape refusals: keep_dtype, then a wire_dtype other
    than float32."""
    keep = (
        "frames_len is not known in advance when keep_dtype is set: payload sizes depend on "
        "the gradient's dtype"
    )
    for kwargs, message in [
        ({"keep_dtype": True}, keep),
        ({"keep_dtype": True, "wire_dtype": "float32"}, keep),
        ({"keep_dtype": True, "wire_dtype": "float16"}, keep),
        (
            {"wire_dtype": "bfloat16"},
            "frames_len is not known in advance when wire_dtype is 'bfloat16': only float32 "
            "payload sizes are computed",
        ),
        (
            {"wire_dtype": "float64"},
            "frames_len is not known in advance when wire_dtype is 'float64': only float32 "
            "payload sizes are computed",
        ),
    ]:
        with pytest.raises(ValueError) as info:
            session(impl, **kwargs).frames_len(10)
        assert str(info.value) == message
    with pytest.raises(ValueError, match="compressed"):
        session(impl, compression="lz4", keep_dtype=True).frames_len(10)
    with pytest.raises(ValueError, match="keep_shape"):
        session(impl, keep_shape=True, wire_dtype="float16").frames_len(10)
    with pytest.raises(ValueError, match=r">= 0|negative"):
        session(impl, keep_dtype=True).frames_len(-1)
    s = session(impl, wire_dtype="float32")
    assert s.frames_len(10) == len(s.encode_frames(np.ones(10, np.float64)))


@pytest.mark.parametrize("settings_", [{"keep_dtype": True}, {"wire_dtype": "bfloat16"}])
def test_encode_frames_into_out_without_frames_len(impl: ModuleType, settings_):
    s = session(impl, 4, **settings_)
    grad = np.linspace(-1, 1, 10).astype(np.float16 if "keep_dtype" in settings_ else np.float32)
    want = s.encode_frames(grad)
    out = bytearray(b"\xa5" * (len(want) + 7))
    assert s.encode_frames(grad, out=out) == len(want)
    assert bytes(out[: len(want)]) == want and out[len(want) :] == b"\xa5" * 7
    small = bytearray(len(want) - 1)
    with pytest.raises(ValueError):
        s.encode_frames(grad, out=small)
    assert small == bytearray(len(want) - 1)


# --------------------------------------------------------------------------- manifests


@pytest.mark.parametrize("compression", [None, "zstd"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(("enc", "dec"), PAIRS, ids=PAIR_IDS)
def test_manifest_round_trip(enc: str, dec: str, layout: str, compression: str | None):
    tx = session(module(enc), layout=layout, compression=compression, keep_shape=True)
    rx = session(module(dec))
    text = '{"format":"gradstream.tensors","tensors":[{"name":"ü✓ 梯度 😀","dtype":"bfloat16"}]}'
    data = tx._encode_manifest(text)
    assert isinstance(data, bytes)
    ((index, total, p),) = split_frames(data)
    assert (index, total) == (0, 1)
    schema = schema_of(p)
    assert schema.metadata == {b"gradstream_tensors": text.encode()}
    assert schema.field("value").type == pa.float32()
    assert schema.names == (["value"] if layout == "compact" else ["index", "value"])
    assert pa.ipc.open_file(pa.py_buffer(p)).read_all().num_rows == 0
    assert rx._decode_manifest(data) == (text, 0)
    assert rx._decode_manifest(bytearray(data)) == (text, 0)
    assert rx._decode_manifest(tx._encode_manifest("")) == ("", 0)


def test_decode_manifest_of_plain_gradients(impl: ModuleType):
    s = session(impl, 4)
    assert s._decode_manifest(b"") == (None, 0)
    assert s._decode_manifest(s.encode_frames(np.ones(10, np.float32))) == (None, 10)
    k = session(impl, 4, keep_dtype=True, keep_shape=True)
    assert s._decode_manifest(k.encode_frames(np.ones((2, 3), np.float16))) == (None, 6)


def test_decode_manifest_applies_the_decoding_rules(impl: ModuleType):
    s = session(impl)
    data = s._encode_manifest("x")
    with pytest.raises(FrameError):
        s._decode_manifest(data[:-1])
    with pytest.raises(FrameError):
        s._decode_manifest(data + b"\0")
    with pytest.raises(FrameError):
        session(impl, max_payload_len=len(data) - 17)._decode_manifest(data)
    corrupt = bytearray(data)
    corrupt[-20] ^= 1
    with pytest.raises(GradientStreamError):
        s._decode_manifest(bytes(corrupt))


def test_manifest_text_must_be_a_str(impl: ModuleType):
    with pytest.raises(TypeError):
        session(impl)._encode_manifest(b"x")


# --------------------------------------------------------------------------- differential


_SHAPES = st.lists(st.integers(0, 6), min_size=0, max_size=3).map(tuple)


@st.composite
def gradients(draw: Any) -> tuple[str, np.ndarray]:
    name = draw(st.sampled_from(DTYPES))
    shape = draw(_SHAPES)
    n = math.prod(shape)
    width = 8 * np.dtype(WORD[name]).itemsize
    word = st.one_of(
        st.sampled_from(SPECIALS[name]),
        st.integers(0, 2**width - 1),
        st.floats(allow_nan=False, width=64).map(
            lambda x: int(_dtypes.cast(np.array([x]), "float64", name).view(WORD[name])[0])
        ),
    )
    words = draw(st.lists(word, min_size=n, max_size=n))
    return name, np.array(words, dtype=WORD[name]).reshape(shape)


@settings(max_examples=examples(150), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    grad=gradients(),
    layout=st.sampled_from(LAYOUTS),
    compression=st.sampled_from([None, "lz4", "zstd"]),
    keep_shape=st.booleans(),
    keep_dtype=st.booleans(),
    wire_dtype=st.sampled_from([None, *DTYPES]),
    chunk_size=st.integers(1, 40),
)
def test_differential_dtypes(
    grad, layout, compression, keep_shape, keep_dtype, wire_dtype, chunk_size
):
    """Both encoders, both decoders (four pairings, frames and chunks): the same bits, the
    dtype and shape handed back, and the cast rule's values."""
    name, words = grad
    values = from_bits(words.reshape(-1), name, words.shape)
    kwargs = dict(
        layout=layout,
        compression=compression,
        keep_shape=keep_shape,
        keep_dtype=keep_dtype,
        wire_dtype=wire_dtype,
    )
    note(f"{name} {words.shape} {kwargs} chunk_size={chunk_size}")
    senders = [session(module(m), chunk_size, **kwargs) for m in IMPL_NAMES]
    if name != "float32" and not keep_dtype and wire_dtype is None:
        messages = set()
        for s in senders:
            with pytest.raises(TypeError) as info:
                s.encode_frames(values)
            messages.add(str(info.value))
        assert messages == {_rejected(name)}
        return
    result = name if keep_dtype else "float32"
    want = expected(words.reshape(-1), name, wire_dtype or name, result)
    shape = words.shape if keep_shape else (words.size,)
    results = []
    for s in senders:
        wire = s.encode_frames(values)
        chunks = s.encode_gradient(values)
        for m in IMPL_NAMES:
            rx = session(module(m), 7)
            for got in (rx.decode_frames(wire), rx.decode_chunks(chunks[::-1])):
                assert_values(got, result, want, shape)
                results.append(bits(got))
            out = np.empty(shape, dtype=numpy_dtype(result))
            rx.decode_frames(join_frames(split_frames(wire)[::-1]), out=out)
            assert np.array_equal(bits(out), want)
    assert all(np.array_equal(results[0], r) for r in results)


# A transfer of a cast gradient over a socket, for the streaming receivers' path.
@pytest.mark.parametrize("path", ["socket", "streams"])
def test_stream_with_dtypes(impl: ModuleType, path: str):
    words = sample("float64", 50)
    tx = session(impl, 8, keep_dtype=True, wire_dtype="float16", keep_shape=True)
    rx = session(impl, 3)
    grad = from_bits(words, "float64", (5, 10))

    async def main() -> list[np.ndarray]:
        a, b = socket.socketpair()
        writers: list[asyncio.StreamWriter] = []
        try:
            txs: Any = a
            rxs: Any = b
            if path == "streams":
                _, w1 = await asyncio.open_connection(sock=a)
                r2, w2 = await asyncio.open_connection(sock=b)
                writers = [w1, w2]
                txs, rxs = w1, r2

            async def send_two() -> None:
                await tx.stream_to(grad, txs)
                await tx.stream_to(grad[:2], txs)

            async def receive_two() -> list[np.ndarray]:
                return [await rx.receive_from(rxs), await rx.receive_from(rxs)]

            _, got = await asyncio.gather(send_two(), receive_two())
            return got
        finally:
            for w in writers:
                w.close()
                with contextlib.suppress(Exception):
                    await w.wait_closed()
            a.close()
            b.close()

    first, second = run(main)
    want = expected(words, "float64", "float16", "float64")
    assert_values(first, "float64", want, (5, 10))
    assert_values(second, "float64", want[:20], (2, 10))


# --------------------------------------------------------------------------- review findings


def _one_frame(payload: bytes, index: int = 0, total: int = 1) -> bytes:
    return HEADER.pack(index, total, len(payload), zlib.crc32(payload)) + payload


@pytest.mark.parametrize("name", IMPL_NAMES)
def test_values_past_max_gradient_len_are_counted_not_held(name: str):
    """A float16 column handed back as float64 holds 4x its wire bytes: a receiver must
    refuse it at max_gradient_len without storing it first (peak RSS, in a subprocess)."""
    script = f"""
import resource, sys, numpy as np
sys.path.insert(0, {str(TESTS)!r})
from support.impls import load_impl
mod = load_impl({name!r})
n = 32 << 20
tx = mod.GradientStreamSession("x", n, keep_dtype=True, wire_dtype="float16", layout="compact")
wire = tx.encode_frames(np.ones(n, np.float64))
del tx
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
try:
    mod.GradientStreamSession("x", max_gradient_len=1).decode_frames(wire)
except Exception as e:
    print(type(e).__name__, e)
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) >> 10)
"""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True
    )
    error, growth = done.stdout.strip().splitlines()
    assert error == "FrameError gradient exceeds max_gradient_len 1: 33554432 values by chunk 0"
    # Storing would take 256 MiB (float64) or more; the wire itself is 64 MiB.
    assert int(growth) < 48, done.stdout


def test_structure_is_checked_before_the_dtypes_in_both():
    """A compressed batch over the room is an ArrowIpcError even where the dtype rules
    would also fail (out= of another dtype, chunks of another dtype)."""
    tx = session(ref, 7, keep_dtype=True, compression="lz4")
    wire = tx.encode_frames(np.arange(10, dtype=np.float16))
    for name in IMPL_NAMES:
        rx = session(module(name), 7, max_gradient_len=5)
        with pytest.raises(ArrowIpcError) as info:
            rx.decode_frames(wire, out=np.empty(10, np.float32))
        assert info.value.chunk_index == 0
        assert info.value.detail == (
            "compressed record batch declares 7 rows, more than the 5 values max_gradient_len "
            "still allows"
        )


@pytest.mark.parametrize("name", IMPL_NAMES)
def test_an_empty_gradients_shape_numpy_cannot_make_is_refused(name: str):
    """[0, 2**31, 2**30] holds no values, but numpy cannot make it (non-zero dimensions
    past 2**60 values): our ArrowIpcError, not numpy's ValueError."""
    for text, ok in (("[0,1073741824,1073741824]", True), ("[0,2147483648,1073741824]", False)):
        schema = pa.schema([pa.field("value", pa.float32(), nullable=False)])
        schema = schema.with_metadata({"gradient_shape": text})
        sink = pa.BufferOutputStream()
        with pa.ipc.new_file(sink, schema) as writer:
            writer.write_batch(pa.record_batch([pa.array([], pa.float32())], schema=schema))
        wire = _one_frame(sink.getvalue().to_pybytes())
        s = session(module(name), 7)
        if ok:
            assert s.decode_frames(wire).shape == (0, 1 << 30, 1 << 30)
            continue
        with pytest.raises(ArrowIpcError) as info:
            s.decode_frames(wire)
        assert info.value.detail == (
            f"gradient_shape metadata {text} is beyond what numpy can make: its non-zero "
            "dimensions multiply past 2^60"
        )


# --------------------------------------------------------------------------- torch tensors
# torch is not installed on the CI machines (PyPI's wheel needs the CUDA libraries), so
# these tests stand a minimal stand-in module in for it: it has the attributes and methods
# gradstream uses (dtype, device, detach, contiguous, view(torch.int16), numpy, and
# __dlpack__ for the float dtypes, as a CPU torch.Tensor has). They test gradstream's side
# of the contract, not torch's.


class _FakeTorchDtype:
    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"torch.{self.name}"


def _fake_torch() -> Any:
    import types

    torch = types.ModuleType("torch")
    torch.bfloat16 = _FakeTorchDtype("bfloat16")  # type: ignore[attr-defined]
    torch.int16 = _FakeTorchDtype("int16")  # type: ignore[attr-defined]
    torch.float16 = _FakeTorchDtype("float16")  # type: ignore[attr-defined]

    class Tensor:
        def __init__(self, values: np.ndarray, dtype: Any, device: str = "cpu") -> None:
            self._values = values
            self.dtype = dtype
            self.device = types.SimpleNamespace(type=device)
            self.shape = values.shape

        def detach(self) -> Tensor:
            return self

        def contiguous(self) -> Tensor:
            return Tensor(np.ascontiguousarray(self._values), self.dtype, self.device.type)

        def view(self, dtype: Any) -> Tensor:
            assert dtype is torch.int16  # type: ignore[attr-defined]
            return Tensor(self._values.view(np.int16), dtype, self.device.type)

        def numpy(self) -> np.ndarray:
            return self._values

        def __dlpack__(self, **kwargs: Any) -> Any:
            return self._values.__dlpack__(**kwargs)

        def __dlpack_device__(self) -> Any:
            return self._values.__dlpack_device__()

    Tensor.__module__ = "torch"
    torch.Tensor = Tensor  # type: ignore[attr-defined]
    return torch


@pytest.fixture
def torch(monkeypatch: pytest.MonkeyPatch) -> Any:
    fake = _fake_torch()
    monkeypatch.setitem(__import__("sys").modules, "torch", fake)
    return fake


@pytest.mark.parametrize(("enc", "dec"), PAIRS, ids=PAIR_IDS)
def test_torch_tensors_of_each_dtype_travel_as_they_are(torch: Any, enc: str, dec: str):
    bits16 = np.array(sample("bfloat16", 12), np.uint16).reshape(3, 4)
    half = from_bits(sample("float16", 12), "float16", (3, 4))
    cases = [
        (torch.Tensor(bits16, torch.bfloat16), "bfloat16", bits16.view(ml_dtypes.bfloat16)),
        (torch.Tensor(half, torch.float16), "float16", half),
        # Non-contiguous: the view of every other column.
        (
            torch.Tensor(bits16[:, ::2], torch.bfloat16),
            "bfloat16",
            bits16[:, ::2].view(ml_dtypes.bfloat16),
        ),
    ]
    tx = session(module(enc), 5, keep_dtype=True, keep_shape=True)
    rx = session(module(dec), 5)
    for tensor, name, want in cases:
        got = rx.decode_frames(tx.encode_frames(tensor))
        assert _dtypes.dtype_name(got.dtype) == name and got.shape == want.shape
        assert got.tobytes() == np.ascontiguousarray(want).tobytes()


def test_torch_bfloat16_on_another_device_is_refused(torch: Any):
    t = torch.Tensor(np.zeros(3, np.uint16), torch.bfloat16, device="cuda")
    for name in IMPL_NAMES:
        with pytest.raises(TypeError, match=r"gradient tensor is on .*; move it to the CPU"):
            session(module(name), keep_dtype=True).encode_frames(t)
    # Without keep_dtype or wire_dtype a torch bfloat16 tensor is the usual TypeError.
    for name in IMPL_NAMES:
        with pytest.raises(TypeError):
            session(module(name)).encode_frames(
                torch.Tensor(np.zeros(3, np.uint16), torch.bfloat16)
            )


def test_a_tensor_set_of_torch_tensors(torch: Any):
    grads = {
        "w": torch.Tensor(np.arange(6, dtype=np.uint16).reshape(2, 3) + 0x3F80, torch.bfloat16),
        "b": np.arange(3, dtype=np.float64),
    }
    for enc in IMPL_NAMES:
        for dec in IMPL_NAMES:
            got = session(module(dec)).decode_tensors(session(module(enc)).encode_tensors(grads))
            assert list(got) == ["w", "b"]
            assert got["w"].dtype == ml_dtypes.bfloat16 and got["w"].shape == (2, 3)
            assert (
                got["w"].view(np.uint16).tolist() == (np.arange(6).reshape(2, 3) + 0x3F80).tolist()
            )
            assert got["b"].tolist() == [0.0, 1.0, 2.0]
