"""Gradient shapes: ``keep_shape=True``, against both implementations: the setting,
round trips, out=, and the differential test (the receiver's rules are in
test_shape_rules.py).

A keep_shape session writes the gradient's shape (after conversion to a numpy array, before
flattening) into every payload's Arrow schema metadata, ``gradient_shape``, as a compact
JSON array (``[768,3072]``, ``[]`` for a 0-d array).
"""

from __future__ import annotations

import asyncio
import inspect
import math
import socket
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, note, settings
from hypothesis import strategies as st

import gradstream.reference as ref
from support.aio import receive_bytes, run, transfer
from support.frames import both_ways, split_frames
from support.impls import FIXTURE_OK, LAYOUTS, PAIR_IDS, PAIRS, PATHS, session
from support.impls import load_impl as module
from support.shapes import assert_shaped, values_of
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


def split_payloads(wire: bytes) -> list[bytes]:
    return [p for _, _, p in split_frames(wire)]


def metadata_of(payload: Any) -> dict[bytes, bytes] | None:
    schema = pa.ipc.open_file(pa.py_buffer(payload)).schema
    return schema.metadata


# --------------------------------------------------------------------------- the setting


def test_keep_shape_setting(impl):
    s = session(impl)
    assert s.keep_shape is False
    t = session(impl, keep_shape=True)
    assert t.keep_shape is True
    rest = ", keep_dtype=False, wire_dtype=None, seal=False)"
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
    last = params[-4]  # then keep_dtype and wire_dtype (tests/dtypes/), seal (tests/seal/)
    assert last.name == "keep_shape"
    assert params[-5].name == "compression"
    assert last.kind is inspect.Parameter.KEYWORD_ONLY
    # Unset (None): the transport's default, False on bare frames (True on gradstream
    # connections: tests/api/test_connection_defaults.py).
    assert last.default is None
    assert impl.GradientStreamSession("s", keep_shape=None).keep_shape is False


@pytest.mark.parametrize(
    ("value", "name"), [(1, "int"), (0, "int"), ("yes", "str"), (1.0, "float")]
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
