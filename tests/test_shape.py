"""Gradient shapes (issue 5, part 2): ``keep_shape=True``, against both implementations.

A keep_shape session writes the gradient's shape (after conversion to a numpy array, before
flattening) into every payload's Arrow schema metadata, ``gradient_shape``, as a compact
JSON array (``[768,3072]``, ``[]`` for a 0-d array). Every receiver, whatever its own
setting, checks that metadata chunk by chunk (after the CRC and the payload decode, before
the values are counted against max_gradient_len or out=): well formed (a grammar, not
JSON), and the same raw string as the first accepted chunk's (or absent in both). Once the
gradient is complete and otherwise valid, the shape's product must be the value count, and
the result is reshaped to it (with out=, out keeps its own shape).

Hostile payloads are built with pyarrow (``payload``) and carry correct CRCs, so that they
reach the shape rules.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import socket
import zlib
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, note, settings
from hypothesis import strategies as st

import gradstream.reference as ref
from gradstream.errors import (
    ArrowIpcError,
    ChecksumMismatchError,
    FrameError,
    GradientSizeError,
    IncompleteStreamError,
)
from support.aio import receive_bytes, run, transfer
from support.frames import assert_error, both_ways, frame, frame_offsets, split_frames
from support.impls import FIXTURE_OK, LAYOUTS, PAIR_IDS, PAIRS, PATHS, session
from support.impls import load_impl as module
from support.payloads import write_ipc_file
from support.values import float32_bits as bits

KEY = b"gradient_shape"

# Shapes of the round trips, with the compact JSON each must travel as.
SHAPES = [
    ((), "[]"),
    ((7,), "[7]"),
    ((3, 4), "[3,4]"),
    ((2, 3, 1, 5), "[2,3,1,5]"),
    ((0, 5), "[0,5]"),
]
SHAPE_IDS = ["0d", "1d", "2d", "4d", "empty-0x5"]

GRAMMAR_MESSAGE = "gradient_shape metadata is not a list of at most 32 non-negative integers: "


# --------------------------------------------------------------------------- helpers


def values_of(shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    """A float32 array of ``shape`` holding raw bit patterns (NaN payloads included)."""
    n = math.prod(shape)
    words = np.random.default_rng(seed).integers(0, 2**32, n, dtype=np.uint32)
    return words.view(np.float32).reshape(shape)


def assert_shaped(got: Any, want: np.ndarray) -> None:
    assert isinstance(got, np.ndarray)
    assert got.dtype == np.float32
    assert got.shape == want.shape, (got.shape, want.shape)
    assert got.flags.c_contiguous
    assert np.array_equal(bits(got), bits(want))


def split_payloads(wire: bytes) -> list[bytes]:
    return [p for _, _, p in split_frames(wire)]


def metadata_of(payload: Any) -> dict[bytes, bytes] | None:
    schema = pa.ipc.open_file(pa.py_buffer(payload)).schema
    return schema.metadata


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


# --------------------------------------------------------------------------- the setting


def test_keep_shape_setting(impl):
    s = session(impl)
    assert s.keep_shape is False
    t = session(impl, keep_shape=True)
    assert t.keep_shape is True
    rest = ", keep_dtype=False, wire_dtype=None)"
    assert repr(s).endswith(", compression=None, keep_shape=False" + rest), repr(s)
    assert repr(t).endswith(", compression=None, keep_shape=True" + rest), repr(t)
    z = session(impl, compression="zstd", keep_shape=True)
    assert repr(z).endswith(", compression='zstd', keep_shape=True" + rest), repr(z)
    # with_compression keeps it, both ways.
    assert t.with_compression(True).keep_shape is True
    assert t.with_compression(True).compression == "lz4"
    assert t.with_compression(False).keep_shape is True
    assert s.with_compression(True).keep_shape is False


def test_keep_shape_follows_compression_as_a_keyword_only_parameter(impl):
    params = list(inspect.signature(impl.GradientStreamSession).parameters.values())
    last = params[-3]  # then keep_dtype and wire_dtype (tests/test_dtypes.py)
    assert last.name == "keep_shape"
    assert params[-4].name == "compression"
    assert last.kind is inspect.Parameter.KEYWORD_ONLY
    assert last.default is False


@pytest.mark.parametrize(
    ("value", "name"), [(1, "int"), (0, "int"), (None, "NoneType"), ("yes", "str"), (1.0, "float")]
)
def test_keep_shape_must_be_a_bool(impl, value, name):
    with pytest.raises(TypeError) as info:
        session(impl, keep_shape=value)
    assert str(info.value) == f"keep_shape must be a bool, got {name}"


def test_shape_text_helper():
    assert ref._shape_text((768, 3072)) == "[768,3072]"
    assert ref._shape_text(()) == "[]"
    assert ref._shape_text((0, 5)) == "[0,5]"
    assert ref._shape_text([7]) == "[7]"


# --------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("compression", [None, "lz4"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(("shape", "text"), SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize(("enc", "dec"), PAIRS, ids=PAIR_IDS)
def test_round_trip_in_memory(enc, dec, shape, text, layout, compression):
    sender = session(module(enc), 4, layout=layout, compression=compression, keep_shape=True)
    receiver = session(module(dec), 3)  # a default receiver (keep_shape=False) reshapes
    grad = values_of(shape)
    wire = sender.encode_frames(grad)
    payloads = split_payloads(wire)
    assert len(payloads) == max(1, -(-grad.size // 4))
    for p in payloads:
        assert metadata_of(p) == {KEY: text.encode()}
    assert_shaped(receiver.decode_frames(wire), grad)
    chunks = sender.encode_gradient(grad)
    assert [bytes(c.arrow_ipc_bytes) for c in chunks] == payloads
    assert_shaped(receiver.decode_chunks(list(reversed(chunks))), grad)
    # Chunks of one implementation, decoded by the other's session.
    other = module(dec).GradientChunk
    rebuilt = [
        other("x", c.chunk_index, c.total_chunks, c.arrow_ipc_bytes, c.checksum) for c in chunks
    ]
    assert_shaped(receiver.decode_chunks(rebuilt), grad)


@pytest.mark.parametrize(("enc", "dec"), PAIRS, ids=PAIR_IDS)
def test_round_trip_of_other_inputs(enc, dec):
    sender = session(module(enc), 3, keep_shape=True)
    receiver = session(module(dec), 3)
    cases: list[tuple[Any, np.ndarray]] = [
        ([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], np.arange(1, 7, dtype=np.float32).reshape(2, 3)),
        ([[[0.5]], [[1.5]]], np.array([[[0.5]], [[1.5]]], dtype=np.float32)),
        (pa.array([1.0, 2.0, 3.0, 4.0], pa.float32()), np.arange(1, 5, dtype=np.float32)),
        (np.float32(2.5), np.array(2.5, dtype=np.float32)),
    ]
    # A non-contiguous view: its own shape travels, values in C order.
    base = values_of((4, 6), 3)
    cases.append((base[:, ::2], np.ascontiguousarray(base[:, ::2])))
    for grad, want in cases:
        wire = sender.encode_frames(grad)
        text = "[" + ",".join(str(d) for d in want.shape) + "]"
        assert all(metadata_of(p) == {KEY: text.encode()} for p in split_payloads(wire))
        assert_shaped(receiver.decode_frames(wire), want)
        assert_shaped(receiver.decode_chunks(sender.encode_gradient(grad)), want)


def test_metadata_is_the_compact_json_of_a_large_shape(impl):
    s = session(impl, 1 << 20, layout="compact", keep_shape=True)
    grad = np.zeros((768, 3072), dtype=np.float32)
    chunks = s.encode_gradient(grad)
    assert len(chunks) == 3
    for c in chunks:
        assert metadata_of(c.arrow_ipc_bytes) == {KEY: b"[768,3072]"}
    assert session(impl).decode_chunks(chunks).shape == (768, 3072)


@pytest.mark.parametrize("compression", [None, "zstd"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_without_keep_shape_the_bytes_are_unchanged(impl, layout, compression):
    grad = values_of((5, 6), 1)
    plain = session(impl, 7, layout=layout, compression=compression)
    explicit = session(impl, 7, layout=layout, compression=compression, keep_shape=False)
    wire = plain.encode_frames(grad)
    assert explicit.encode_frames(grad) == wire
    assert explicit.encode_frames(grad.reshape(-1)) == wire
    for p in split_payloads(wire):
        assert metadata_of(p) is None
    for c in explicit.encode_gradient(grad):
        assert metadata_of(c.arrow_ipc_bytes) is None
    # Without metadata the receiver returns the flat vector, as before.
    assert_shaped(plain.decode_frames(wire), grad.reshape(-1))
    # With keep_shape the frames differ (metadata) but hold the same values.
    shaped = session(impl, 7, layout=layout, compression=compression, keep_shape=True)
    shaped_wire = shaped.encode_frames(grad)
    assert shaped_wire != wire
    assert_shaped(plain.decode_frames(shaped_wire), grad)


def test_keep_shape_receiver_takes_shapeless_frames(impl):
    grad = values_of((3, 3), 2)
    wire = session(impl, 4).encode_frames(grad)
    assert_shaped(session(impl, keep_shape=True).decode_frames(wire), grad.reshape(-1))


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(("shape", "text"), SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize(("enc", "dec"), PAIRS, ids=PAIR_IDS)
def test_round_trip_streaming(enc, dec, shape, text, path):
    sender = session(module(enc), 4, layout="compact", compression="lz4", keep_shape=True)
    receiver = session(module(dec), 3)
    grad = values_of(shape, 4)
    _, got = run(lambda: transfer(sender, receiver, grad, path))
    assert_shaped(got, grad)
    # The bytes on the wire are encode_frames's.
    a, b = socket.socketpair()
    with a, b:
        run(lambda: sender.stream_to(grad, a))
        a.shutdown(socket.SHUT_WR)
        wire = b""
        while chunk := b.recv(65536):
            wire += chunk
    assert wire == sender.encode_frames(grad)
    assert all(metadata_of(p) == {KEY: text.encode()} for p in split_payloads(wire))


@pytest.mark.parametrize("path", PATHS)
def test_receive_iter_reshapes_each_gradient(impl, path):
    sender = session(impl, 4, keep_shape=True)
    grads = [values_of((2, 3), 5), values_of((), 6), values_of((5,), 7)]
    data = b"".join(sender.encode_frames(g) for g in grads) + session(impl, 4).encode_frames(
        values_of((2, 2), 8)
    )

    async def main() -> list[np.ndarray]:
        a, b = socket.socketpair()
        writer = None
        try:
            a.sendall(data)
            a.shutdown(socket.SHUT_WR)
            rx: Any = b
            if path == "streams":
                rx, writer = await asyncio.open_connection(sock=b)
            return [g async for g in session(impl).receive_iter(rx)]
        finally:
            if writer is not None:
                writer.close()
            a.close()
            b.close()

    got = run(main)
    assert len(got) == 4
    for g, want in zip(got, grads, strict=False):
        assert_shaped(g, want)
    assert_shaped(got[3], values_of((2, 2), 8).reshape(-1))


@pytest.mark.parametrize("path", PATHS)
def test_stream_ending_before_its_first_byte_is_the_empty_vector(impl, path):
    got = run(lambda: receive_bytes(session(impl, keep_shape=True), b"", path))
    assert isinstance(got, np.ndarray) and got.shape == (0,)
    assert session(impl, keep_shape=True).decode_frames(b"").shape == (0,)
    assert session(impl, keep_shape=True).decode_chunks([]).shape == (0,)


# --------------------------------------------------------------------------- out=


def test_out_keeps_its_own_shape(impl):
    sender = session(impl, 4, keep_shape=True)
    grad = values_of((3, 4), 9)
    wire = sender.encode_frames(grad)
    for out_shape in [(12,), (4, 3), (2, 2, 3)]:
        out = np.full(out_shape, -1.0, dtype=np.float32)
        got = session(impl).decode_frames(wire, out=out)
        assert got is out and out.shape == out_shape
        assert np.array_equal(bits(out), bits(grad))
    out = np.zeros((6, 2), dtype=np.float32)
    _, got = run(lambda: transfer(sender, session(impl), grad, "socket", out=out))
    assert got is out and out.shape == (6, 2)
    assert np.array_equal(bits(out), bits(grad))


def test_encode_frames_into_out_with_keep_shape(impl):
    s = session(impl, 4, keep_shape=True)
    grad = values_of((3, 5), 10)
    wire = s.encode_frames(grad)
    buf = bytearray(len(wire) + 10)
    assert s.encode_frames(grad, out=buf) == len(wire)
    assert bytes(buf[: len(wire)]) == wire
    with pytest.raises(ValueError):
        s.encode_frames(grad, out=bytearray(len(wire) - 1))


def test_frames_len_refused_in_a_keep_shape_session(impl):
    # Payload sizes depend on the shape's text, which frames_len(n_values) does not know.
    with pytest.raises(ValueError) as info:
        session(impl, keep_shape=True).frames_len(10)
    assert str(info.value) == (
        "frames_len is not known in advance when keep_shape is set: the shape metadata's "
        "size depends on the shape"
    )
    # A compressed session says so first; argument errors come before either.
    with pytest.raises(ValueError, match="compressed session"):
        session(impl, keep_shape=True, compression="lz4").frames_len(10)
    with pytest.raises(ValueError, match="n_values must be >= 0"):
        session(impl, keep_shape=True).frames_len(-1)
    assert session(impl, keep_shape=False).frames_len(10) > 0


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


# --------------------------------------------------------------------------- differential


@settings(max_examples=40, deadline=None, suppress_health_check=FIXTURE_OK)
@given(
    shape=st.lists(st.integers(0, 12), min_size=0, max_size=4).filter(
        lambda dims: math.prod(dims) <= 3000
    ),
    chunk_size=st.integers(1, 700),
    layout=st.sampled_from(LAYOUTS),
    compression=st.sampled_from([None, "lz4", "zstd"]),
    seed=st.integers(0, 2**32 - 1),
)
def test_native_and_reference_agree_on_each_others_frames(
    shape, chunk_size, layout, compression, seed
):
    native, reference = module("native"), module("reference")
    grad = values_of(tuple(shape), seed)
    note(f"shape={shape}")
    kwargs: dict[str, Any] = {"layout": layout, "compression": compression, "keep_shape": True}
    n_send = session(native, chunk_size, **kwargs)
    r_send = session(reference, chunk_size, **kwargs)
    n_wire, r_wire = n_send.encode_frames(grad), r_send.encode_frames(grad)
    text = ref._shape_text(shape).encode()
    for wire in (n_wire, r_wire):
        assert all(metadata_of(p) == {KEY: text} for p in split_payloads(wire))
        results = [session(m, 5).decode_frames(wire) for m in (native, reference)]
        for got in results:
            assert_shaped(got, grad)
        assert np.array_equal(bits(results[0]), bits(results[1]))
        assert results[0].shape == results[1].shape
    for chunks in (n_send.encode_gradient(grad), r_send.encode_gradient(grad)):
        for m in (native, reference):
            assert_shaped(session(m).decode_chunks(chunks[::-1]), grad)


def test_a_key_listed_twice_counts_once_the_first():
    """Metadata is a list of pairs on the wire: a payload may name gradient_shape twice.
    pyarrow keeps the first; the native decoder takes the first too, so both give one shape."""
    schema = pa.schema([pa.field("value", pa.float32(), nullable=False)]).with_metadata(
        {"gradient_shape": "[2,3]", "gradient_shapX": "[6]"}
    )
    batch = pa.record_batch([pa.array(np.arange(6, dtype=np.float32))], schema=schema)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, schema) as writer:
        writer.write_batch(batch)
    raw = sink.getvalue().to_pybytes()
    twice = raw.replace(b"gradient_shapX", b"gradient_shape")
    assert twice.count(b"gradient_shape") == 2 * raw.count(b"gradient_shape")
    shapes = set()
    for name in ("reference", "native"):
        for got in both_ways(module(name), [(0, 1, twice)]):
            assert isinstance(got, np.ndarray), got
            shapes.add(got.shape)
    first = pa.ipc.open_file(twice).schema.metadata[b"gradient_shape"]
    assert shapes == {tuple(int(d) for d in first.strip(b"[]").split(b","))}
