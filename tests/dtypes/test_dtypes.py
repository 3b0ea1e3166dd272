"""Dtypes (docs/guides/dtypes-and-shapes.md, "The cast rule", "Decoding rules"):
``keep_dtype=True`` and
``wire_dtype=``, against both implementations: round trips, the cast rule, the input
accepted, bfloat16.

gradstream moves float16, bfloat16, float32 and float64. The ``value`` column's Arrow type
says which (bfloat16: UInt16 tagged with the extension name ``gradstream.bfloat16``); the
schema metadata ``gradient_dtype`` names the dtype to hand back when it is not the
column's. The sender casts with the shared ``gradstream._dtypes.prepare``; each receiver
casts with its own code (numpy in the reference, Rust in the native core), so the results
here are compared with ``_dtypes.cast`` *and* with bit patterns picked by hand
(``CAST_CASES``), which hold the cast rule independently of any implementation.
"""

from __future__ import annotations

import struct
from types import ModuleType
from typing import Any

import ml_dtypes
import numpy as np
import pyarrow as pa
import pytest

import gradstream
import gradstream._dtypes as _dtypes
from gradstream.errors import GradientDtypeError
from support.dtypes import (
    ARROW,
    DTYPES,
    STORAGE,
    WORD,
    assert_values,
    bits,
    expected,
    from_bits,
    numpy_dtype,
    payload,
    rejected,
    sample,
    schema_of,
)
from support.frames import both_ways, join_frames, split_frames
from support.impls import IMPL_NAMES, LAYOUTS, PAIR_IDS, PAIRS, session
from support.impls import load_impl as module


def column_bits(payload: bytes) -> np.ndarray:
    """The raw bits of a payload's value column, read by pyarrow."""
    table = pa.ipc.open_file(pa.py_buffer(payload)).read_all()
    column = table.column("value").combine_chunks()
    if isinstance(column, pa.ExtensionArray):
        column = column.storage
    values = column.to_numpy(zero_copy_only=False)
    return values.view(WORD[_dtypes.dtype_name(values.dtype) or "bfloat16"])


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
        assert field.type == (gradstream.BFloat16Type() if name == "bfloat16" else ARROW[name])
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


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: np.zeros(3, np.float16), rejected("float16")),
        (lambda: np.zeros(3, np.float64), rejected("float64")),
        (lambda: np.zeros(3, ml_dtypes.bfloat16), rejected("bfloat16")),
        (lambda: np.zeros((2, 2), ">f8"), rejected(">f8")),
        (lambda: pa.array(np.zeros(3, np.float16)), None),
        (lambda: pa.array(np.zeros(3, np.float64)), None),
        (
            lambda: pa.ExtensionArray.from_storage(
                gradstream.BFloat16Type(), pa.array(np.zeros(3, np.uint16))
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
    return pa.ExtensionArray.from_storage(gradstream.BFloat16Type(), pa.array(words, pa.uint16()))


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
    """With _dtypes.ML_DTYPES False (ml_dtypes absent), a bfloat16 gradient is handed back
    widened to float32, exactly; out= must then be float32."""
    words = sample("bfloat16", 10)
    sender = session(impl, 3, keep_dtype=True)
    wire = sender.encode_frames(from_bits(words, "bfloat16"))
    chunks = sender.encode_gradient(from_bits(words, "bfloat16"))
    cast_wire = session(impl, 3, keep_dtype=True, wire_dtype="float16").encode_frames(
        from_bits(words, "bfloat16")
    )
    monkeypatch.setattr(_dtypes, "ML_DTYPES", False)
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
