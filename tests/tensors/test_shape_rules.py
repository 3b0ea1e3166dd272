"""The receiver's rules for ``gradient_shape``, against both implementations.

Every receiver, whatever its own setting, checks that metadata chunk by chunk (after the
CRC and the payload decode, before the values are counted against max_gradient_len or
out=): well formed (rule 1a, a grammar, not JSON), and the same raw string as the first
accepted chunk's (or absent in both; rule 1b). Once the gradient is complete and otherwise
valid, the shape's product must be the value count (rule 2), and the result is reshaped to
it (with out=, out keeps its own shape).

Hostile payloads are built with pyarrow (``payload``) and carry correct CRCs, so that they
reach the shape rules.
"""

from __future__ import annotations

import zlib
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

from gradstream.errors import (
    ArrowIpcError,
    ChecksumMismatchError,
    FrameError,
    GradientSizeError,
    IncompleteStreamError,
)
from support.aio import receive_bytes, run
from support.frames import assert_error, both_ways, frame, frame_offsets
from support.impls import PATHS, session
from support.payloads import write_ipc_file
from support.shapes import assert_shaped, values_of

GRAMMAR_MESSAGE = "gradient_shape metadata is not a list of at most 32 non-negative integers: "


def payload(
    values: Any,
    shape: str | None = None,
    *,
    layout: str = "compact",
    compression: str | None = None,
    nulls: bool = False,
) -> bytes:
    """An Arrow IPC file of ``values`` written by pyarrow, with ``gradient_shape`` = shape
    in its schema metadata (none when None)."""
    vals = np.asarray(values, dtype=np.float32).reshape(-1)
    if nulls:
        column = pa.array([None] + [float(v) for v in vals[1:]], type=pa.float32())
    else:
        column = pa.array(vals, type=pa.float32())
    fields = [pa.field("value", pa.float32(), nullable=nulls)]
    columns = [column]
    if layout == "seed":
        fields.insert(0, pa.field("index", pa.int32(), nullable=False))
        columns.insert(0, pa.array(np.arange(len(vals), dtype=np.int32)))
    schema = pa.schema(fields)
    if shape is not None:
        schema = schema.with_metadata({"gradient_shape": shape})
    batch = pa.record_batch(columns, schema=schema)
    return write_ipc_file(schema, batch, compression)


# --------------------------------------------------------------------------- rule 1a: grammar

BAD_SHAPES = [
    "[1,-2]",
    "[01]",
    "[00]",
    "[1.5]",
    "[true]",
    "[null]",
    "1,2",
    "[1,2",
    "1,2]",
    "",
    "[",
    "[,]",
    "[1,]",
    "[,1]",
    "[1,,2]",
    "[+1]",
    "[1 2]",
    "[1e3]",
    "[0x10]",
    " [1]",
    "[1] ",
    "[1]\n",
    "[\t1]",
    "[\u0661]",  # ARABIC-INDIC DIGIT ONE: a digit to str.isdigit, not ASCII
    "[[1]]",
    '["1"]',
    "[10000000000000000000]",  # 20 digits
    "[1000000000000000000]",  # 19 digits: numpy sizes are below 2**63
    "[" + ",".join(["1"] * 33) + "]",  # 33 dimensions
    "[" + ",".join(["1"] * 60) + "]x",  # long: the message shows the first 100 characters
]


@pytest.mark.parametrize("bad", BAD_SHAPES)
def test_malformed_shape_is_an_arrow_error(impl, bad):
    for parts, index in [
        ([(0, 1, payload([1.0], bad))], 0),
        ([(0, 2, payload([1.0], "[2]")), (1, 2, payload([2.0], bad))], 1),
    ]:
        for got in both_ways(impl, parts):
            assert_error(got, ArrowIpcError, GRAMMAR_MESSAGE + bad[:100], index)


def test_malformed_shape_message_is_cut_at_100_characters(impl):
    bad = "[" + "1," * 80 + "]"
    got = both_ways(impl, [(0, 1, payload([1.0], bad))])
    for g in got:
        assert_error(g, ArrowIpcError, GRAMMAR_MESSAGE + bad[:100], 0)
        assert len(g.detail) == len(GRAMMAR_MESSAGE) + 100


GOOD_SHAPES = [
    ("[ 2 , 3 ]", (2, 3)),
    ("[2,3]", (2, 3)),
    ("[  2,3  ]", (2, 3)),
    ("[ 6]", (6,)),
    ("[6 ]", (6,)),
    ("[1, 6, 1]", (1, 6, 1)),
    ("[" + ",".join(["1"] * 31) + ",6]", (1,) * 31 + (6,)),  # 32 dimensions
]


@pytest.mark.parametrize(("text", "shape"), GOOD_SHAPES)
def test_well_formed_shapes_with_spaces(impl, text, shape):
    vals = values_of((6,), 11)
    parts = [(0, 2, payload(vals[:4], text)), (1, 2, payload(vals[4:], text, layout="seed"))]
    for got in both_ways(impl, parts):
        assert_shaped(got, vals.reshape(shape))


def test_empty_brackets_and_zero_dims(impl):
    # "[]" and "[ ]" are the 0-d shape (one value); "[0]" / "[3,0]" hold none.
    for text in ["[]", "[ ]", "[  ]"]:
        for got in both_ways(impl, [(0, 1, payload([4.5], text))]):
            assert_shaped(got, np.array(4.5, dtype=np.float32))
    for text, shape in [("[0]", (0,)), ("[3,0]", (3, 0)), ("[0,0,7]", (0, 0, 7))]:
        for got in both_ways(impl, [(0, 1, payload([], text))]):
            assert_shaped(got, np.zeros(shape, dtype=np.float32))


def test_eighteen_digits_are_well_formed(impl):
    text = "[100000000000000000]"
    for got in both_ways(impl, [(0, 1, payload([1.0, 2.0, 3.0], text))]):
        assert_error(
            got,
            FrameError,
            f"gradient_shape {text} holds 100000000000000000 values; the gradient has 3",
            None,
            None,
        )


def test_a_zero_sized_shape_with_huge_dimensions_still_reshapes(impl):
    # 0 values, and the largest dimension the grammar takes: numpy makes it.
    text = "[0,999999999999999999]"
    for got in both_ways(impl, [(0, 1, payload([], text))]):
        assert isinstance(got, np.ndarray), got
        assert got.shape == (0, 999999999999999999)


def test_shape_checked_after_crc_and_decode(impl):
    s = session(impl)
    bad = payload([1.0, 2.0], "[1,-2]")
    # A CRC mismatch comes first.
    wire = frame(0, 1, bad, zlib.crc32(bad) ^ 1)
    with pytest.raises(ChecksumMismatchError):
        s.decode_frames(wire)
    chunk = impl.GradientChunk("s", 0, 1, bad, zlib.crc32(bad) ^ 1)
    with pytest.raises(ChecksumMismatchError):
        s.decode_chunks([chunk])
    # A payload that fails to decode (nulls) is that ArrowIpcError, not the shape's.
    for got in both_ways(impl, [(0, 1, payload([1.0, 2.0], "[1,-2]", nulls=True))]):
        assert_error(got, ArrowIpcError, "'value' column has 1 null value(s)", 0)


# --------------------------------------------------------------------------- rule 1b: agreement


def disagree(first: int, a: str | None, index: int, b: str | None) -> str:
    return (
        f"chunks disagree on gradient_shape: chunk {first} says {a or 'none'}, "
        f"chunk {index} says {b or 'none'}"
    )


@pytest.mark.parametrize(
    ("first", "second"),
    [("[6]", None), (None, "[6]"), ("[6]", "[2,3]"), ("[6]", "[ 6]"), ("[2,3]", "[2, 3]")],
)
def test_chunks_disagreeing_on_the_shape(impl, first, second):
    p0, p1, p2 = payload([1, 2], first), payload([3, 4], first), payload([5, 6], second)
    parts = [(0, 3, p0), (1, 3, p1), (2, 3, p2)]
    chunks_got, frames_got = both_ways(impl, parts)
    msg = disagree(0, first, 2, second)
    assert_error(chunks_got, FrameError, msg, 2, None)
    assert_error(frames_got, FrameError, msg, 2, frame_offsets(parts)[2])
    # Out of order: decode_chunks compares with the lowest index; frames with the first
    # to arrive.
    shuffled = [(2, 3, p2), (0, 3, p0), (1, 3, p1)]
    chunks_got, frames_got = both_ways(impl, shuffled)
    assert_error(chunks_got, FrameError, msg, 2, None)
    assert_error(
        frames_got, FrameError, disagree(2, second, 0, first), 0, frame_offsets(shuffled)[1]
    )


@pytest.mark.parametrize("path", PATHS)
def test_disagreement_over_a_stream(impl, path):
    parts = [(1, 2, payload([3, 4], "[4]")), (0, 2, payload([1, 2], "[2,2]"))]
    wire = b"".join(frame(*p) for p in parts)
    got = run(lambda: receive_bytes(session(impl), wire, path))
    assert_error(got, FrameError, disagree(1, "[4]", 0, "[2,2]"), 0, frame_offsets(parts)[1])


def test_grammar_checked_before_agreement(impl):
    parts = [(0, 2, payload([1], "[2]")), (1, 2, payload([2], "[x]"))]
    for got in both_ways(impl, parts):
        assert_error(got, ArrowIpcError, GRAMMAR_MESSAGE + "[x]", 1)


def test_shape_errors_come_before_max_gradient_len(impl):
    # Chunk 1 both disagrees and takes the gradient past max_gradient_len 4.
    parts = [(0, 2, payload([1, 2, 3], "[6]")), (1, 2, payload([4, 5, 6], "[2,3]"))]
    s = session(impl, max_gradient_len=4)
    got = both_ways(impl, parts, max_gradient_len=4)[1]
    assert_error(got, FrameError, disagree(0, "[6]", 1, "[2,3]"), 1, frame_offsets(parts)[1])
    parts_bad = [(0, 2, payload([1, 2, 3], "[6]")), (1, 2, payload([4, 5, 6], "[-6]"))]
    got = both_ways(impl, parts_bad, max_gradient_len=4)[1]
    assert_error(got, ArrowIpcError, GRAMMAR_MESSAGE + "[-6]", 1)
    # Without the disagreement, max_gradient_len's error.
    agreeing = [(0, 2, payload([1, 2, 3], "[6]")), (1, 2, payload([4, 5, 6], "[6]"))]
    wire = b"".join(frame(*p) for p in agreeing)
    with pytest.raises(FrameError) as info:
        s.decode_frames(wire)
    assert info.value.detail == "gradient exceeds max_gradient_len 4: 6 values by chunk 1"


def test_shape_errors_come_before_out_overrun(impl):
    parts = [(0, 2, payload([1, 2, 3], "[6]")), (1, 2, payload([4, 5, 6], "[2,3]"))]
    wire = b"".join(frame(*p) for p in parts)
    out = np.zeros(4, dtype=np.float32)
    with pytest.raises(FrameError) as info:
        session(impl).decode_frames(wire, out=out)
    assert info.value.detail == disagree(0, "[6]", 1, "[2,3]")
    agreeing = [(0, 2, payload([1, 2, 3], "[6]")), (1, 2, payload([4, 5, 6], "[6]"))]
    with pytest.raises(GradientSizeError) as size_info:
        session(impl).decode_frames(b"".join(frame(*p) for p in agreeing), out=out)
    assert (size_info.value.expected, size_info.value.received) == (4, 6)
    assert size_info.value.chunk_index == 1


# --------------------------------------------------------------------------- rule 2: product


@pytest.mark.parametrize(
    ("text", "n", "product"),
    [("[5]", 6, 5), ("[2,4]", 6, 8), ("[]", 0, 1), ("[]", 2, 1), ("[0,3]", 3, 0), ("[ 7 ]", 6, 7)],
)
def test_product_must_be_the_value_count(impl, text, n, product):
    vals = values_of((n,), 12)
    parts = [(0, 2, payload(vals[:2], text)), (1, 2, payload(vals[2:], text))]
    msg = f"gradient_shape {text} holds {product} values; the gradient has {n}"
    for got in both_ways(impl, parts):
        assert_error(got, FrameError, msg, None, None)


@pytest.mark.parametrize("path", PATHS)
def test_product_mismatch_over_a_stream(impl, path):
    wire = frame(0, 1, payload([1, 2, 3], "[2,2]"))
    got = run(lambda: receive_bytes(session(impl), wire, path))
    assert_error(
        got, FrameError, "gradient_shape [2,2] holds 4 values; the gradient has 3", None, None
    )


def test_incomplete_and_left_over_come_before_the_product(impl):
    s = session(impl)
    f0 = frame(0, 2, payload([1, 2], "[9]"))
    f1 = frame(1, 2, payload([3], "[9]"))
    with pytest.raises(IncompleteStreamError) as info:
        s.decode_frames(f0)
    assert (info.value.received, info.value.total) == (1, 2)
    chunk = impl.GradientChunk(
        "s", 0, 2, payload([1, 2], "[9]"), zlib.crc32(payload([1, 2], "[9]"))
    )
    with pytest.raises(IncompleteStreamError):
        s.decode_chunks([chunk])
    with pytest.raises(FrameError) as left:
        s.decode_frames(f0 + f1 + b"xyz")
    assert left.value.detail == "3 bytes left over after the last chunk"
    with pytest.raises(FrameError) as product:
        s.decode_frames(f0 + f1)
    assert product.value.detail == "gradient_shape [9] holds 9 values; the gradient has 3"


@pytest.mark.parametrize("path", PATHS)
def test_incomplete_stream_before_the_product_over_a_stream(impl, path):
    wire = frame(1, 3, payload([1, 2], "[9]"))
    got = run(lambda: receive_bytes(session(impl), wire, path))
    assert type(got) is IncompleteStreamError and (got.received, got.total) == (1, 3)


def test_product_check_before_out_short(impl):
    s = session(impl)
    wire = frame(0, 1, payload([1, 2, 3], "[5]"))
    out = np.zeros(4, dtype=np.float32)
    with pytest.raises(FrameError) as info:
        s.decode_frames(wire, out=out)
    assert info.value.detail == "gradient_shape [5] holds 5 values; the gradient has 3"
    assert (info.value.chunk_index, info.value.offset) == (None, None)
    # With a matching shape, the short out= GradientSizeError.
    with pytest.raises(GradientSizeError) as size:
        s.decode_frames(frame(0, 1, payload([1, 2, 3], "[3]")), out=out)
    assert (size.value.expected, size.value.received, size.value.chunk_index) == (4, 3, None)
    # And out= of the right size takes a shape it does not have, if the product matches.
    out3 = np.zeros((3, 1), dtype=np.float32)
    assert s.decode_frames(frame(0, 1, payload([1, 2, 3], "[3]")), out=out3) is out3


@pytest.mark.parametrize("path", PATHS)
def test_product_check_before_out_short_over_a_stream(impl, path):
    wire = frame(0, 1, payload([1, 2, 3], "[5]"))
    out = np.zeros(4, dtype=np.float32)
    got = run(lambda: receive_bytes(session(impl), wire, path, out=out))
    assert_error(
        got, FrameError, "gradient_shape [5] holds 5 values; the gradient has 3", None, None
    )


def test_compressed_payloads_with_shapes(impl):
    vals = values_of((8,), 13)
    parts = [
        (0, 2, payload(vals[:5], "[2,4]", compression="zstd")),
        (1, 2, payload(vals[5:], "[2,4]", compression="lz4", layout="seed")),
    ]
    for got in both_ways(impl, parts):
        assert_shaped(got, vals.reshape(2, 4))
