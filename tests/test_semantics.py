"""Hand-picked edge cases of the README's rules, run against both implementations.

Every test takes the `impl` fixture (see conftest.py): the pure-Python reference and the
native extension must behave identically, down to exception classes, fields and messages.
"""

from __future__ import annotations

import array
import asyncio
import pickle
import socket
import zlib
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pyarrow.ipc
import pytest

from gradstream.errors import (
    ArrowIpcError,
    ChecksumMismatchError,
    FrameError,
    GradientStreamError,
    IncompleteStreamError,
    SettingError,
)
from support.frames import HEADER, frame
from support.impls import session

SEED_SCHEMA = pa.schema(
    [
        pa.field("index", pa.int32(), nullable=False),
        pa.field("value", pa.float32(), nullable=False),
    ]
)


# --------------------------------------------------------------------------- helpers


def bits(values: np.ndarray) -> np.ndarray:
    return np.asarray(values, dtype=np.float32).view(np.uint32)


def assert_same_bits(actual: np.ndarray, expected: np.ndarray) -> None:
    assert actual.dtype == np.float32
    assert actual.ndim == 1
    np.testing.assert_array_equal(bits(actual), bits(expected).reshape(-1))


def ipc_file(*batches: pa.RecordBatch, schema: pa.Schema | None = None) -> bytes:
    """An Arrow IPC *file* holding the given batches."""
    schema = schema if schema is not None else batches[0].schema
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, schema) as writer:
        for batch in batches:
            writer.write_batch(batch)
    return sink.getvalue().to_pybytes()


def ipc_stream(batch: pa.RecordBatch) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batch.schema) as writer:
        writer.write_batch(batch)
    return sink.getvalue().to_pybytes()


def value_batch(values, type_: pa.DataType | None = None, name: str = "value") -> pa.RecordBatch:
    return pa.record_batch([pa.array(values, type=type_ or pa.float32())], names=[name])


def frames_of(chunks) -> list[bytes]:
    return [frame(c.chunk_index, c.total_chunks, c.arrow_ipc_bytes, c.checksum) for c in chunks]


def make_chunk(impl, index: int, total: int, payload: bytes, checksum: int | None = None):
    crc = zlib.crc32(payload) if checksum is None else checksum
    return impl.GradientChunk("s", index, total, payload, crc)


def ramp(n: int) -> np.ndarray:
    return np.arange(n, dtype=np.float32) * np.float32(0.5) - np.float32(3.0)


def read_payload(payload: bytes) -> pa.Table:
    return pa.ipc.open_file(pa.py_buffer(payload)).read_all()


# --------------------------------------------------------------------------- session settings


def test_defaults(impl):
    s = impl.GradientStreamSession("run-7")
    assert s.session_id == "run-7"
    assert s.chunk_size == 65536
    assert s.max_payload_len == 268435456
    assert s.is_compression_enabled() is False
    d = impl.GradientStreamSession.with_defaults("run-8")
    assert (d.session_id, d.chunk_size, d.max_payload_len) == ("run-8", 65536, 268435456)


def test_chunk_size_zero_is_raised_to_one(impl):
    s = session(impl, 0)
    assert s.chunk_size == 1
    assert len(s.encode_gradient(ramp(3))) == 3


def test_negative_chunk_size_is_value_error(impl):
    with pytest.raises(ValueError):
        session(impl, -1)


@pytest.mark.parametrize("limit", [0, -1, 2**32])
def test_max_payload_len_out_of_range_is_value_error(impl, limit):
    with pytest.raises(ValueError):
        session(impl, max_payload_len=limit)


def test_max_payload_len_bounds_accepted(impl):
    assert session(impl, max_payload_len=1).max_payload_len == 1
    assert session(impl, max_payload_len=2**32 - 1).max_payload_len == 2**32 - 1


def test_with_compression_returns_new_session(impl):
    s = impl.GradientStreamSession("a", 7, max_payload_len=12345)
    on = s.with_compression(True)
    assert on is not s
    assert on.is_compression_enabled() is True
    assert s.is_compression_enabled() is False
    assert (on.session_id, on.chunk_size, on.max_payload_len) == ("a", 7, 12345)
    off = on.with_compression(False)
    assert off.is_compression_enabled() is False
    assert on.is_compression_enabled() is True


def test_compression_flag_compresses_and_round_trips(impl):
    # The original only stored the flag; here it compresses (lz4), and any decoder reads it.
    s = session(impl, 3)
    compressed = s.with_compression(True)
    assert compressed.compression == "lz4" and s.compression is None
    wire = compressed.encode_frames(ramp(7))
    assert wire != s.encode_frames(ramp(7))
    assert_same_bits(s.decode_frames(wire), ramp(7))


def test_stream_settings_defaults(impl):
    s = impl.GradientStreamSession("run-7")
    assert s.max_gradient_len == 1073741824 == 2**30
    assert s.timeout is None
    d = impl.GradientStreamSession.with_defaults("run-8")
    assert (d.max_gradient_len, d.timeout) == (2**30, None)


@pytest.mark.parametrize("limit", [0, -1, 2**64])
def test_max_gradient_len_out_of_range_is_value_error(impl, limit):
    with pytest.raises(ValueError, match="max_gradient_len"):
        session(impl, max_gradient_len=limit)


def test_max_gradient_len_bounds_accepted(impl):
    assert session(impl, max_gradient_len=1).max_gradient_len == 1
    assert session(impl, max_gradient_len=2**64 - 1).max_gradient_len == 2**64 - 1


@pytest.mark.parametrize("limit", [1.0, "5", None])
def test_max_gradient_len_must_be_an_int(impl, limit):
    with pytest.raises(TypeError):
        session(impl, max_gradient_len=limit)


@pytest.mark.parametrize("timeout", [0, 0.0, -1, -0.5, float("nan"), float("inf")])
def test_timeout_not_positive_and_finite_is_value_error(impl, timeout):
    with pytest.raises(ValueError, match="timeout"):
        session(impl, timeout=timeout)


def test_timeout_must_be_a_number(impl):
    with pytest.raises(TypeError):
        session(impl, timeout="3")


@pytest.mark.parametrize(("timeout", "stored"), [(None, None), (0.25, 0.25), (30, 30.0)])
def test_timeout_accepted(impl, timeout, stored):
    s = session(impl, timeout=timeout)
    assert s.timeout == stored
    assert s.timeout is None or type(s.timeout) is float


def test_with_compression_keeps_every_setting(impl):
    s = impl.GradientStreamSession(
        "a", 7, max_payload_len=12345, max_gradient_len=99, timeout=2.5
    ).with_compression(True)
    assert (s.session_id, s.chunk_size, s.max_payload_len) == ("a", 7, 12345)
    assert (s.max_gradient_len, s.timeout) == (99, 2.5)
    assert s.is_compression_enabled() is True
    off = s.with_compression(False)
    assert (off.max_gradient_len, off.timeout) == (99, 2.5)


@pytest.mark.parametrize(
    "name", ["session_id", "chunk_size", "max_payload_len", "max_gradient_len", "timeout"]
)
def test_session_properties_are_read_only(impl, name):
    s = session(impl)
    with pytest.raises(AttributeError):
        setattr(s, name, getattr(s, name))


# --------------------------------------------------------------------------- chunking


@pytest.mark.parametrize(
    ("length", "expected"),
    [(0, 1), (1, 1), (9, 1), (10, 1), (11, 2), (20, 2), (21, 3)],
)
def test_chunk_counts(impl, length, expected):
    chunks = session(impl, 10).encode_gradient(ramp(length))
    assert len(chunks) == expected
    assert [c.chunk_index for c in chunks] == list(range(expected))
    assert all(c.total_chunks == expected for c in chunks)
    assert all(c.session_id == "s" for c in chunks)


@pytest.mark.parametrize("length", [0, 1, 9, 10, 11, 25])
def test_chunk_k_holds_its_slice_in_seed_layout(impl, length):
    grad = ramp(length)
    for k, chunk in enumerate(session(impl, 10).encode_gradient(grad)):
        table = read_payload(chunk.arrow_ipc_bytes)
        assert table.schema.equals(SEED_SCHEMA)  # names, types, order and non-nullability
        assert table.schema.field("index").nullable is False
        assert table.schema.field("value").nullable is False
        window = grad[k * 10 : (k + 1) * 10]
        assert table.column("index").to_pylist() == list(range(len(window)))
        assert_same_bits(table.column("value").to_numpy(), window)


def test_payload_is_ipc_file_with_one_batch(impl):
    for chunk in session(impl, 10).encode_gradient(ramp(25)):
        assert chunk.arrow_ipc_bytes[:6] == b"ARROW1"
        assert chunk.arrow_ipc_bytes[-6:] == b"ARROW1"
        assert pa.ipc.open_file(pa.py_buffer(chunk.arrow_ipc_bytes)).num_record_batches == 1


def test_empty_gradient_is_one_chunk_with_one_empty_batch(impl):
    s = session(impl)
    chunks = s.encode_gradient(np.empty(0, dtype=np.float32))
    assert len(chunks) == 1
    assert (chunks[0].chunk_index, chunks[0].total_chunks) == (0, 1)
    reader = pa.ipc.open_file(pa.py_buffer(chunks[0].arrow_ipc_bytes))
    assert reader.num_record_batches == 1
    assert reader.get_batch(0).num_rows == 0
    assert reader.schema.equals(SEED_SCHEMA)
    out = s.decode_chunks(chunks)
    assert out.dtype == np.float32 and out.shape == (0,)
    out = s.decode_frames(s.encode_frames([]))
    assert out.dtype == np.float32 and out.shape == (0,)


def test_checksum_is_crc32_of_payload(impl):
    for chunk in session(impl, 3).encode_gradient(ramp(10)):
        assert chunk.checksum == zlib.crc32(chunk.arrow_ipc_bytes)
        assert chunk.verify_checksum() is True


def test_payload_property_is_buffer_over_same_bytes(impl):
    chunk = session(impl).encode_gradient(ramp(5))[0]
    assert isinstance(chunk.payload, pa.Buffer)
    assert chunk.payload.to_pybytes() == chunk.arrow_ipc_bytes
    assert isinstance(chunk.arrow_ipc_bytes, bytes)


def test_payload_over_max_payload_len_is_refused_at_encode(impl):
    grad = ramp(10)
    size = len(session(impl, 10).encode_gradient(grad)[0].arrow_ipc_bytes)
    # Exactly at the limit is fine, one byte less is not.
    assert len(session(impl, 10, max_payload_len=size).encode_gradient(grad)) == 1
    with pytest.raises(FrameError) as info:
        session(impl, 10, max_payload_len=size - 1).encode_gradient(grad)
    assert info.value.chunk_index == 0
    assert "chunk_size" in str(info.value)
    with pytest.raises(FrameError):
        session(impl, 10, max_payload_len=size - 1).encode_frames(grad)


def test_tiny_max_payload_len_refuses_even_empty_gradient(impl):
    with pytest.raises(FrameError) as info:
        session(impl, max_payload_len=16).encode_gradient([])
    assert info.value.chunk_index == 0


# --------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("chunk_size", [1, 3, 4, 100])
def test_round_trip_chunks_and_frames(impl, chunk_size):
    s = session(impl, chunk_size)
    grad = ramp(13)
    assert_same_bits(s.decode_chunks(s.encode_gradient(grad)), grad)
    assert_same_bits(s.decode_frames(s.encode_frames(grad)), grad)


def test_decoded_array_owns_writeable_memory(impl):
    s = session(impl, 3)
    grad = ramp(10)
    wire = np.frombuffer(bytearray(s.encode_frames(grad)), dtype=np.uint8)
    chunks = s.encode_gradient(grad)
    for out in (s.decode_frames(wire), s.decode_chunks(chunks)):
        assert out.flags.writeable
        assert out.flags.c_contiguous
        assert not np.shares_memory(out, wire)
        out[:] = 42.0  # must not raise nor touch the input
    assert_same_bits(s.decode_frames(wire), grad)
    assert_same_bits(s.decode_chunks(chunks), grad)


def test_decode_chunks_of_nothing_is_empty(impl):
    out = session(impl).decode_chunks([])
    assert out.dtype == np.float32 and out.shape == (0,)


def test_decode_frames_of_nothing_is_empty(impl):
    out = session(impl).decode_frames(b"")
    assert out.dtype == np.float32 and out.shape == (0,)


def test_shuffled_chunks_decode(impl):
    s = session(impl, 2)
    grad = ramp(11)
    chunks = s.encode_gradient(grad)
    order = np.random.default_rng(1).permutation(len(chunks))
    assert_same_bits(s.decode_chunks([chunks[i] for i in order]), grad)
    assert_same_bits(s.decode_chunks(reversed(chunks)), grad)
    assert_same_bits(s.decode_chunks(iter(chunks)), grad)  # any iterable, even one-shot


def test_shuffled_frames_decode(impl):
    s = session(impl, 2)
    grad = ramp(11)
    frames = frames_of(s.encode_gradient(grad))
    order = np.random.default_rng(2).permutation(len(frames))
    assert_same_bits(s.decode_frames(b"".join(frames[i] for i in order)), grad)


def test_decode_chunks_accepts_duck_typed_chunks(impl):
    s = session(impl, 3)
    grad = ramp(8)
    ducks = [
        SimpleNamespace(
            chunk_index=c.chunk_index,
            total_chunks=c.total_chunks,
            checksum=c.checksum,
            arrow_ipc_bytes=bytearray(c.arrow_ipc_bytes),
        )
        for c in s.encode_gradient(grad)
    ]
    assert_same_bits(s.decode_chunks(ducks), grad)


def test_decode_ignores_session_id(impl):
    grad = ramp(5)
    chunks = impl.GradientStreamSession("sender", 2).encode_gradient(grad)
    assert_same_bits(impl.GradientStreamSession("receiver", 99).decode_chunks(chunks), grad)


def test_other_session_settings_decode(impl):
    grad = ramp(50)
    wire = session(impl, 7).encode_frames(grad)
    assert_same_bits(session(impl, 1000).decode_frames(wire), grad)


SPECIAL_BITS = np.array(
    [
        0x7FC00001,  # quiet NaN with payload
        0xFFFFFFFF,  # negative NaN, all payload bits set
        0x7F800001,  # signalling NaN
        0x80000000,  # -0.0
        0x00000000,  # +0.0
        0x7F800000,  # +inf
        0xFF800000,  # -inf
        0x00000001,  # smallest subnormal
        0x807FFFFF,  # largest negative subnormal
        0x7F7FFFFF,  # largest finite
    ],
    dtype=np.uint32,
)


@pytest.mark.parametrize("chunk_size", [1, 3, 64])
def test_special_floats_survive_bit_for_bit(impl, chunk_size):
    grad = SPECIAL_BITS.view(np.float32)
    s = session(impl, chunk_size)
    chunks = s.encode_gradient(grad)
    np.testing.assert_array_equal(s.decode_chunks(chunks).view(np.uint32), SPECIAL_BITS)
    np.testing.assert_array_equal(
        s.decode_frames(s.encode_frames(grad)).view(np.uint32), SPECIAL_BITS
    )
    # The payload itself holds the same bits, as a foreign reader sees them.
    on_wire = np.concatenate(
        [read_payload(c.arrow_ipc_bytes).column("value").to_numpy() for c in chunks]
    )
    np.testing.assert_array_equal(on_wire.view(np.uint32), SPECIAL_BITS)


# --------------------------------------------------------------------------- gradient input


def test_2d_c_contiguous_flattens_in_c_order(impl):
    grad = ramp(12).reshape(3, 4)
    assert_same_bits(session(impl, 5).decode_frames(session(impl, 5).encode_frames(grad)), grad)


def test_fortran_order_flattens_in_c_order(impl):
    grad = np.asfortranarray(ramp(12).reshape(3, 4))
    s = session(impl, 5)
    assert_same_bits(s.decode_frames(s.encode_frames(grad)), np.ascontiguousarray(grad))


def test_strided_view_flattens_in_c_order(impl):
    base = ramp(24).reshape(4, 6)
    grad = base[::2, ::3]
    s = session(impl, 3)
    assert_same_bits(s.decode_chunks(s.encode_gradient(grad)), np.ascontiguousarray(grad))


def test_misaligned_float32_view_is_copied_not_refused(impl):
    # A float32 view at an odd byte offset is C-contiguous but cannot be read as f32 in
    # place; it must be copied once, not refused.
    raw = bytearray(1 + 4 * 10)
    raw[1:] = ramp(10).tobytes()
    grad = np.frombuffer(raw, dtype=np.float32, offset=1)
    assert not grad.flags.aligned
    s = session(impl, 4)
    assert_same_bits(s.decode_frames(s.encode_frames(grad)), ramp(10))


def test_decode_frames_reads_a_bytearray_that_changes_afterwards(impl):
    # Mutable input is copied before decoding; the result does not alias it.
    s = session(impl, 4)
    wire = bytearray(s.encode_frames(ramp(9)))
    out = s.decode_frames(wire)
    wire[:] = bytes(len(wire))
    assert_same_bits(out, ramp(9))


def test_big_endian_float32_is_swapped(impl):
    grad = ramp(9).astype(">f4")
    s = session(impl, 4)
    assert_same_bits(s.decode_frames(s.encode_frames(grad)), ramp(9))


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda v: memoryview(v), id="memoryview"),
        pytest.param(lambda v: array.array("f", v.tolist()), id="array.array"),
        pytest.param(lambda v: pa.array(v, type=pa.float32()), id="Float32Array"),
        pytest.param(lambda v: pa.chunked_array([v[:3], v[3:]], type=pa.float32()), id="Chunked"),
        pytest.param(lambda v: v.tolist(), id="list"),
        pytest.param(lambda v: tuple(v.tolist()), id="tuple"),
    ],
)
def test_accepted_inputs(impl, make):
    grad = ramp(7)
    s = session(impl, 3)
    expected = s.encode_frames(grad)
    assert s.encode_frames(make(grad)) == expected
    assert_same_bits(s.decode_chunks(s.encode_gradient(make(grad))), grad)


def test_list_of_numbers_is_converted_to_float32(impl):
    s = session(impl, 3)
    out = s.decode_frames(s.encode_frames([1, 2.5, 0.1]))
    assert_same_bits(out, np.array([1, 2.5, 0.1], dtype=np.float32))


@pytest.mark.parametrize(
    ("grad", "name"),
    [
        pytest.param(np.zeros(3, dtype=np.float64), "float64", id="float64"),
        pytest.param(np.zeros(3, dtype=np.float16), "float16", id="float16"),
        pytest.param(np.zeros(3, dtype=np.int32), "int32", id="int32"),
        pytest.param(pa.array([1.0, 2.0], type=pa.float64()), "double", id="Float64Array"),
        pytest.param(array.array("d", [1.0]), "'d'", id="array-d"),
    ],
)
def test_other_dtypes_are_type_errors_naming_the_dtype(impl, grad, name):
    s = session(impl)
    with pytest.raises(TypeError, match=name):
        s.encode_gradient(grad)
    with pytest.raises(TypeError, match=name):
        s.encode_frames(grad)


def test_raw_bytes_are_not_a_gradient(impl):
    with pytest.raises(TypeError):
        session(impl).encode_gradient(b"\x00\x00\x80\x3f")


def test_arrow_array_with_nulls_is_value_error(impl):
    with pytest.raises(ValueError, match="null"):
        session(impl).encode_gradient(pa.array([1.0, None, 3.0], type=pa.float32()))


# --------------------------------------------------------------------------- frames encoding


def test_encode_frames_is_headers_plus_payloads(impl):
    s = session(impl, 3)
    grad = ramp(10)
    chunks = s.encode_gradient(grad)
    expected = b"".join(
        HEADER.pack(c.chunk_index, c.total_chunks, len(c.arrow_ipc_bytes), c.checksum)
        + c.arrow_ipc_bytes
        for c in chunks
    )
    wire = s.encode_frames(grad)
    assert isinstance(wire, bytes)
    assert wire == expected


def test_encode_frames_as_buffer(impl):
    s = session(impl, 3)
    grad = ramp(10)
    buf = s.encode_frames(grad, as_buffer=True)
    assert isinstance(buf, pa.Buffer)
    assert buf.to_pybytes() == s.encode_frames(grad)
    assert_same_bits(s.decode_frames(buf), grad)


@pytest.mark.parametrize(
    "wrap",
    [
        pytest.param(bytes, id="bytes"),
        pytest.param(bytearray, id="bytearray"),
        pytest.param(memoryview, id="memoryview"),
        pytest.param(pa.py_buffer, id="pyarrow.Buffer"),
        pytest.param(lambda b: np.frombuffer(b, dtype=np.uint8), id="numpy-uint8"),
        pytest.param(lambda b: memoryview(b"xx" + b)[2:], id="memoryview-slice"),
    ],
)
def test_decode_frames_accepts_bytes_like(impl, wrap):
    s = session(impl, 3)
    grad = ramp(10)
    assert_same_bits(s.decode_frames(wrap(s.encode_frames(grad))), grad)


def test_decode_frames_rejects_str(impl):
    with pytest.raises(TypeError):
        session(impl).decode_frames("not bytes")


# --------------------------------------------------------------------------- checksum errors


@pytest.mark.parametrize("k", [0, 2])
def test_flipped_bit_in_chunk_k_is_checksum_mismatch(impl, k):
    s = session(impl, 3)
    chunks = s.encode_gradient(ramp(9))
    payload = bytearray(chunks[k].arrow_ipc_bytes)
    payload[len(payload) // 2] ^= 0x10
    corrupted = bytes(payload)
    expected, actual = chunks[k].checksum, zlib.crc32(corrupted)
    message = f"Checksum mismatch on chunk {k}: expected {expected:#010x}, got {actual:#010x}"

    bad = list(chunks)
    bad[k] = impl.GradientChunk("s", k, 3, corrupted, expected)
    assert bad[k].verify_checksum() is False
    with pytest.raises(ChecksumMismatchError) as info:
        s.decode_chunks(bad)
    assert (info.value.chunk_index, info.value.expected, info.value.actual) == (k, expected, actual)
    assert str(info.value) == message

    frames = frames_of(chunks)
    frames[k] = frame(k, 3, corrupted, expected)
    with pytest.raises(ChecksumMismatchError) as info:
        s.decode_frames(b"".join(frames))
    assert (info.value.chunk_index, info.value.expected, info.value.actual) == (k, expected, actual)
    assert str(info.value) == message


def test_checksum_message_pads_to_eight_hex_digits(impl):
    payload = session(impl).encode_gradient([1.0])[0].arrow_ipc_bytes
    chunk = make_chunk(impl, 0, 1, payload, checksum=0x1)
    with pytest.raises(ChecksumMismatchError, match=r"expected 0x00000001, got 0x[0-9a-f]{8}$"):
        session(impl).decode_chunks([chunk])


def test_frames_are_checked_in_arrival_order(impl):
    # Frame 1 arrives first with a bad CRC; frame 0 (bad Arrow) would only fail later.
    s = session(impl, 2)
    chunks = s.encode_gradient(ramp(4))
    wire = frame(1, 2, chunks[1].arrow_ipc_bytes, chunks[1].checksum ^ 1) + frame(0, 2, b"junk")
    with pytest.raises(ChecksumMismatchError) as info:
        s.decode_frames(wire)
    assert info.value.chunk_index == 1


def test_chunks_crc_and_decode_interleave_in_index_order(impl):
    # Chunk 0 has a valid CRC over junk, chunk 1 a bad CRC: chunk 0's Arrow error wins.
    s = session(impl, 2)
    chunks = s.encode_gradient(ramp(4))
    bad = [make_chunk(impl, 0, 2, b"junk"), make_chunk(impl, 1, 2, chunks[1].arrow_ipc_bytes, 7)]
    with pytest.raises(ArrowIpcError) as info:
        s.decode_chunks(reversed(bad))
    assert info.value.chunk_index == 0


# --------------------------------------------------------------------------- decode_chunks rules


def test_missing_chunk_is_incomplete_stream(impl):
    s = session(impl, 2)
    chunks = s.encode_gradient(ramp(10))  # 5 chunks
    with pytest.raises(IncompleteStreamError) as info:
        s.decode_chunks([chunks[0], chunks[3]])
    assert (info.value.received, info.value.total) == (2, 5)
    assert str(info.value) == "Incomplete chunk stream: received 2 of 5 chunks"


def test_duplicate_chunk_index_is_frame_error(impl):
    s = session(impl, 2)
    chunks = s.encode_gradient(ramp(6))
    with pytest.raises(FrameError) as info:
        s.decode_chunks([chunks[1], chunks[0], chunks[1]])
    assert str(info.value) == "duplicate chunk index 1"
    assert (info.value.detail, info.value.chunk_index, info.value.offset) == (
        "duplicate chunk index 1",
        1,
        None,
    )


def test_out_of_range_chunk_index_is_frame_error(impl):
    s = session(impl, 2)
    chunks = s.encode_gradient(ramp(6))  # 3 chunks
    stray = make_chunk(impl, 7, 3, chunks[0].arrow_ipc_bytes)
    with pytest.raises(FrameError) as info:
        s.decode_chunks([*chunks, stray])
    assert str(info.value) == "chunk index 7 out of range for total_chunks 3"
    assert (info.value.chunk_index, info.value.offset) == (7, None)


def test_total_chunks_zero_is_out_of_range(impl):
    payload = session(impl).encode_gradient([])[0].arrow_ipc_bytes
    with pytest.raises(FrameError) as info:
        session(impl).decode_chunks([make_chunk(impl, 0, 0, payload)])
    assert str(info.value) == "chunk index 0 out of range for total_chunks 0"
    with pytest.raises(FrameError) as info:
        session(impl).decode_frames(frame(0, 0, payload))
    assert (str(info.value), info.value.chunk_index, info.value.offset) == (
        "chunk index 0 out of range for total_chunks 0",
        0,
        0,
    )


def test_inconsistent_totals_is_frame_error(impl):
    s = session(impl, 2)
    chunks = s.encode_gradient(ramp(10))  # 5 chunks
    odd = make_chunk(impl, 3, 4, chunks[3].arrow_ipc_bytes)
    with pytest.raises(FrameError) as info:
        s.decode_chunks([chunks[4], odd, chunks[0], chunks[1], chunks[2]])
    assert str(info.value) == "chunks disagree on total_chunks: chunk 0 says 5, chunk 3 says 4"
    assert (info.value.chunk_index, info.value.offset) == (3, None)


def test_total_is_taken_from_lowest_index(impl):
    # Sorted first is chunk 1 (total 2); chunk 2 then is out of range for 2... unless it
    # first disagrees on the total, which rule 3 checks first.
    s = session(impl, 2)
    chunks = s.encode_gradient(ramp(6))  # 3 chunks
    a = make_chunk(impl, 1, 2, chunks[1].arrow_ipc_bytes)
    with pytest.raises(FrameError) as info:
        s.decode_chunks([chunks[2], a])
    assert str(info.value) == "chunks disagree on total_chunks: chunk 1 says 2, chunk 2 says 3"
    assert info.value.chunk_index == 2


def test_frame_rules_come_before_incomplete_and_checksum(impl):
    s = session(impl, 2)
    chunks = s.encode_gradient(ramp(6))  # 3 chunks
    corrupt = make_chunk(impl, 0, 3, chunks[0].arrow_ipc_bytes, checksum=0)
    # Duplicate + incomplete + bad CRC: the duplicate is reported.
    with pytest.raises(FrameError, match="duplicate chunk index 0"):
        s.decode_chunks([corrupt, corrupt])
    # Incomplete + bad CRC: incomplete is reported.
    with pytest.raises(IncompleteStreamError):
        s.decode_chunks([corrupt, chunks[1]])


def test_chunk_field_values_out_of_u32_range_in_duck_chunks(impl):
    duck = SimpleNamespace(chunk_index=-1, total_chunks=1, checksum=0, arrow_ipc_bytes=b"")
    with pytest.raises(OverflowError):
        session(impl).decode_chunks([duck])


# --------------------------------------------------------------------------- decode_frames rules


def test_truncated_payload_is_frame_error_with_offset(impl):
    s = session(impl, 3)
    frames = frames_of(s.encode_gradient(ramp(9)))
    wire = b"".join(frames)
    last_offset = len(frames[0]) + len(frames[1])
    declared = len(frames[2]) - 16
    with pytest.raises(FrameError) as info:
        s.decode_frames(wire[:-1])
    assert str(info.value) == (
        f"truncated frame: chunk 2 declares a {declared}-byte payload "
        f"but only {declared - 1} bytes follow"
    )
    assert (info.value.chunk_index, info.value.offset) == (2, last_offset)


def test_header_alone_is_truncated_frame(impl):
    with pytest.raises(FrameError) as info:
        session(impl).decode_frames(HEADER.pack(0, 1, 500, 0))
    assert (
        str(info.value)
        == "truncated frame: chunk 0 declares a 500-byte payload but only 0 bytes follow"
    )
    assert (info.value.chunk_index, info.value.offset) == (0, 0)


@pytest.mark.parametrize("n", [1, 5, 15])
def test_truncated_first_header_is_frame_error(impl, n):
    s = session(impl)
    wire = s.encode_frames(ramp(3))
    with pytest.raises(FrameError) as info:
        s.decode_frames(wire[:n])
    assert str(info.value) == f"truncated frame header: {n} of 16 bytes"
    assert (info.value.chunk_index, info.value.offset) == (None, 0)


@pytest.mark.parametrize("n", [1, 15])
def test_truncated_header_after_a_frame_is_incomplete_stream(impl, n):
    s = session(impl, 3)
    frames = frames_of(s.encode_gradient(ramp(9)))
    with pytest.raises(IncompleteStreamError) as info:
        s.decode_frames(frames[0] + frames[1][:n])
    assert (info.value.received, info.value.total) == (1, 3)
    assert str(info.value) == "Incomplete chunk stream: received 1 of 3 chunks"


def test_missing_frames_at_end_is_incomplete_stream(impl):
    s = session(impl, 3)
    frames = frames_of(s.encode_gradient(ramp(9)))
    with pytest.raises(IncompleteStreamError) as info:
        s.decode_frames(frames[2] + frames[0])
    assert (info.value.received, info.value.total) == (2, 3)


@pytest.mark.parametrize("extra", [b"\x00", b"xyz", b"\x00" * 16, b"\x00" * 40])
def test_trailing_bytes_are_frame_error(impl, extra):
    s = session(impl, 3)
    wire = s.encode_frames(ramp(9))
    with pytest.raises(FrameError) as info:
        s.decode_frames(wire + extra)
    assert str(info.value) == f"{len(extra)} bytes left over after the last chunk"
    assert info.value.offset == len(wire)


def test_second_stream_after_a_complete_one_is_left_over(impl):
    s = session(impl, 3)
    wire = s.encode_frames(ramp(2))
    with pytest.raises(FrameError) as info:
        s.decode_frames(wire + wire)
    assert str(info.value) == f"{len(wire)} bytes left over after the last chunk"
    assert info.value.offset == len(wire)


def test_hostile_payload_len_is_refused_before_reading(impl):
    with pytest.raises(FrameError) as info:
        session(impl).decode_frames(HEADER.pack(0, 1, 0xFFFFFFFF, 0))
    assert str(info.value) == (
        "chunk 0 declares a 4294967295-byte payload, above max_payload_len 268435456"
    )
    assert (info.value.chunk_index, info.value.offset) == (0, 0)


def test_hostile_payload_len_in_second_frame_reports_its_offset(impl):
    s = session(impl, 3)
    frames = frames_of(s.encode_gradient(ramp(6)))
    wire = frames[1] + HEADER.pack(0, 2, 0xFFFFFFFF, 0) + b"\x00" * 8
    with pytest.raises(FrameError) as info:
        s.decode_frames(wire)
    assert (info.value.chunk_index, info.value.offset) == (0, len(frames[1]))
    assert "4294967295-byte payload, above max_payload_len 268435456" in str(info.value)


def test_payload_len_limit_is_the_sessions(impl):
    grad = ramp(10)
    wire = session(impl, 10).encode_frames(grad)
    size = len(wire) - 16
    assert_same_bits(session(impl, 10, max_payload_len=size).decode_frames(wire), grad)
    with pytest.raises(FrameError) as info:
        session(impl, 10, max_payload_len=size - 1).decode_frames(wire)
    assert str(info.value) == (
        f"chunk 0 declares a {size}-byte payload, above max_payload_len {size - 1}"
    )


def test_payload_len_limit_comes_before_truncation(impl):
    # The payload both exceeds the limit and is truncated: rule 3 wins over rule 4.
    wire = HEADER.pack(4, 9, 1000, 0) + b"\x00" * 10
    with pytest.raises(FrameError, match="above max_payload_len 999"):
        session(impl, max_payload_len=999).decode_frames(wire)


def test_frames_disagree_on_total(impl):
    s = session(impl, 2)
    chunks = s.encode_gradient(ramp(10))  # 5 chunks
    frames = frames_of(chunks)
    odd = frame(3, 4, chunks[3].arrow_ipc_bytes)
    wire = frames[2] + frames[0] + odd
    with pytest.raises(FrameError) as info:
        s.decode_frames(wire)
    # The first *frame* (chunk 2) sets the total, not the lowest index.
    assert str(info.value) == "chunks disagree on total_chunks: chunk 2 says 5, chunk 3 says 4"
    assert (info.value.chunk_index, info.value.offset) == (3, len(frames[2]) + len(frames[0]))


def test_truncation_comes_before_total_disagreement(impl):
    s = session(impl, 2)
    frames = frames_of(s.encode_gradient(ramp(4)))
    wire = frames[0] + HEADER.pack(1, 7, 100, 0) + b"\x00" * 50
    with pytest.raises(FrameError, match=r"^truncated frame: chunk 1 declares a 100-byte"):
        s.decode_frames(wire)


def test_frame_index_out_of_range(impl):
    s = session(impl, 2)
    chunks = s.encode_gradient(ramp(4))  # 2 chunks
    frames = frames_of(chunks)
    wire = frames[0] + frame(2, 2, chunks[1].arrow_ipc_bytes)
    with pytest.raises(FrameError) as info:
        s.decode_frames(wire)
    assert str(info.value) == "chunk index 2 out of range for total_chunks 2"
    assert (info.value.chunk_index, info.value.offset) == (2, len(frames[0]))


def test_total_disagreement_comes_before_out_of_range(impl):
    s = session(impl, 2)
    chunks = s.encode_gradient(ramp(4))
    wire = frames_of(chunks)[0] + frame(9, 3, chunks[1].arrow_ipc_bytes)
    with pytest.raises(FrameError, match=r"^chunks disagree on total_chunks: chunk 0 says 2"):
        s.decode_frames(wire)


def test_duplicate_frame(impl):
    s = session(impl, 2)
    frames = frames_of(s.encode_gradient(ramp(6)))
    with pytest.raises(FrameError) as info:
        s.decode_frames(frames[1] + frames[1])
    assert str(info.value) == "duplicate chunk index 1"
    assert (info.value.chunk_index, info.value.offset) == (1, len(frames[1]))


def test_duplicate_comes_before_checksum(impl):
    s = session(impl, 2)
    chunks = s.encode_gradient(ramp(6))
    frames = frames_of(chunks)
    wire = frames[1] + frame(1, 3, chunks[1].arrow_ipc_bytes, checksum=0)
    with pytest.raises(FrameError, match=r"^duplicate chunk index 1$"):
        s.decode_frames(wire)


def test_reading_stops_after_total_frames(impl):
    # A one-chunk stream followed by garbage that is not even a full header: left over,
    # not a truncated-header error, because reading stopped after the one frame.
    s = session(impl)
    wire = s.encode_frames(ramp(3))
    with pytest.raises(FrameError) as info:
        s.decode_frames(wire + b"\xff" * 3)
    assert str(info.value) == "3 bytes left over after the last chunk"
    assert info.value.chunk_index is None


# --------------------------------------------------------------------------- max_gradient_len

HOSTILE_TOTAL = 0xFFFFFFFF


def _empty_payload(impl) -> bytes:
    return session(impl).encode_gradient(ramp(0))[0].arrow_ipc_bytes


def test_hostile_total_chunks_is_refused_at_the_first_frame(impl):
    # Thousands of tiny valid frames announcing 2^32-1 chunks: refused by the first one,
    # before the rest is looked at (without the limit this would decode them all).
    payload = _empty_payload(impl)
    wire = b"".join(frame(i, HOSTILE_TOTAL, payload) for i in range(5000))
    with pytest.raises(FrameError) as info:
        session(impl).decode_frames(wire)
    assert str(info.value) == "total_chunks 4294967295 above max_gradient_len 1073741824"
    assert info.value.detail == str(info.value)
    assert (info.value.chunk_index, info.value.offset) == (0, 0)


def test_total_chunks_limit_is_the_sessions(impl):
    grad = ramp(3)
    wire = session(impl, 1).encode_frames(grad)  # 3 chunks of one value
    assert_same_bits(session(impl, 1, max_gradient_len=3).decode_frames(wire), grad)
    with pytest.raises(FrameError) as info:
        session(impl, 1, max_gradient_len=2).decode_frames(wire)
    assert str(info.value) == "total_chunks 3 above max_gradient_len 2"
    assert (info.value.chunk_index, info.value.offset) == (0, 0)


def test_total_chunks_limit_in_a_later_frame_names_it(impl):
    # The first frame sets the total; a later one that disagrees is "disagree" (rule 5,
    # first sentence), even when its total is also above the limit.
    s = session(impl, 2)
    frames = frames_of(s.encode_gradient(ramp(4)))
    wire = frames[0] + frame(1, HOSTILE_TOTAL, _empty_payload(impl))
    with pytest.raises(FrameError) as info:
        s.decode_frames(wire)
    assert str(info.value) == (
        "chunks disagree on total_chunks: chunk 0 says 2, chunk 1 says 4294967295"
    )
    assert (info.value.chunk_index, info.value.offset) == (1, len(frames[0]))


def test_total_chunks_limit_comes_before_out_of_range_and_checksum(impl):
    payload = _empty_payload(impl)
    wire = frame(7, 5, payload, checksum=0)
    with pytest.raises(FrameError) as info:
        session(impl, max_gradient_len=4).decode_frames(wire)
    assert str(info.value) == "total_chunks 5 above max_gradient_len 4"
    assert info.value.chunk_index == 7


def test_truncation_comes_before_total_chunks_limit(impl):
    wire = HEADER.pack(0, HOSTILE_TOTAL, 100, 0) + b"\x00" * 50
    with pytest.raises(FrameError, match=r"^truncated frame: chunk 0 declares a 100-byte"):
        session(impl).decode_frames(wire)


def test_payload_len_limit_comes_before_total_chunks_limit(impl):
    wire = HEADER.pack(0, HOSTILE_TOTAL, 1000, 0)
    with pytest.raises(FrameError, match=r"above max_payload_len 999$"):
        session(impl, max_payload_len=999).decode_frames(wire)


def test_values_crossing_max_gradient_len(impl):
    s = session(impl, 4)
    frames = frames_of(s.encode_gradient(ramp(12)))  # 4 + 4 + 4 values
    with pytest.raises(FrameError) as info:
        session(impl, 4, max_gradient_len=10).decode_frames(b"".join(frames))
    assert str(info.value) == "gradient exceeds max_gradient_len 10: 12 values by chunk 2"
    assert info.value.detail == str(info.value)
    assert (info.value.chunk_index, info.value.offset) == (2, len(frames[0]) + len(frames[1]))


def test_values_are_counted_in_arrival_order(impl):
    s = session(impl, 4)
    frames = frames_of(s.encode_gradient(ramp(10)))  # 4 + 4 + 2 values
    wire = frames[2] + frames[0] + frames[1]  # 2, 6, 10 values so far
    with pytest.raises(FrameError) as info:
        session(impl, 4, max_gradient_len=9).decode_frames(wire)
    assert str(info.value) == "gradient exceeds max_gradient_len 9: 10 values by chunk 1"
    assert (info.value.chunk_index, info.value.offset) == (1, len(frames[2]) + len(frames[0]))


def test_gradient_exactly_at_max_gradient_len_is_accepted(impl):
    grad = ramp(12)
    wire = session(impl, 4).encode_frames(grad)
    assert_same_bits(session(impl, 4, max_gradient_len=12).decode_frames(wire), grad)
    assert_same_bits(session(impl, 5, max_gradient_len=12).decode_frames(wire), grad)


def test_one_frame_with_more_values_than_the_limit(impl):
    # A single chunk may hold any number of values (the receiver's chunk_size does not
    # matter): the limit counts the values decoded.
    wire = session(impl, 100).encode_frames(ramp(5))
    with pytest.raises(FrameError) as info:
        session(impl, 2, max_gradient_len=4).decode_frames(wire)
    assert str(info.value) == "gradient exceeds max_gradient_len 4: 5 values by chunk 0"
    assert (info.value.chunk_index, info.value.offset) == (0, 0)


def test_checksum_and_payload_come_before_the_values_limit(impl):
    s = session(impl, 100)
    chunk = s.encode_gradient(ramp(5))[0]
    bad_crc = frame(0, 1, chunk.arrow_ipc_bytes, checksum=chunk.checksum ^ 1)
    with pytest.raises(ChecksumMismatchError):
        session(impl, max_gradient_len=1).decode_frames(bad_crc)
    with pytest.raises(ArrowIpcError):
        session(impl, max_gradient_len=1).decode_frames(frame(0, 1, b"not arrow"))


def test_smallest_max_gradient_len_accepts_the_empty_and_one_value_gradients(impl):
    small = session(impl, max_gradient_len=1)
    empty = session(impl).encode_frames(ramp(0))
    assert len(small.decode_frames(empty)) == 0
    assert_same_bits(small.decode_frames(session(impl).encode_frames(ramp(1))), ramp(1))
    # Two one-value chunks: 2 chunks are above the limit of 1 value.
    with pytest.raises(FrameError, match=r"^total_chunks 2 above max_gradient_len 1$"):
        small.decode_frames(session(impl, 1).encode_frames(ramp(2)))
    # One two-value chunk: the values are.
    with pytest.raises(FrameError, match=r"^gradient exceeds max_gradient_len 1: 2 values"):
        small.decode_frames(session(impl).encode_frames(ramp(2)))


def test_empty_gradient_at_total_chunks_one_passes_any_limit(impl):
    # max(max_gradient_len, 1): the empty gradient is one chunk of zero values.
    wire = frame(0, 1, _empty_payload(impl))
    assert len(session(impl, max_gradient_len=1).decode_frames(wire)) == 0


# --------------------------------------------------------------------------- payload rules


GOOD_VALUES = np.array([1.0, 2.0], dtype=np.float32)


def _as_chunk_1(impl, payload: bytes):
    """A session, chunks and frames where chunk 0 of 2 is good and chunk 1 is `payload`."""
    s = session(impl, 2)
    good = s.encode_gradient(GOOD_VALUES)[0].arrow_ipc_bytes
    chunks = [make_chunk(impl, 0, 2, good), make_chunk(impl, 1, 2, payload)]
    wire = frame(0, 2, good) + frame(1, 2, payload)
    return s, chunks, wire


def _decode_payload_as_chunk_1(impl, payload: bytes) -> list[np.ndarray]:
    """Decode `payload` as chunk 1 of 2, through decode_chunks and decode_frames."""
    s, chunks, wire = _as_chunk_1(impl, payload)
    return [s.decode_chunks(chunks), s.decode_frames(wire)]


def _assert_payload_error(impl, payload: bytes, detail: str | None) -> None:
    s, chunks, wire = _as_chunk_1(impl, payload)
    for decode, arg in ((s.decode_chunks, chunks), (s.decode_frames, wire)):
        with pytest.raises(ArrowIpcError) as info:
            decode(arg)
        assert info.value.chunk_index == 1
        if detail is not None:
            assert info.value.detail == detail
            assert str(info.value) == f"Arrow IPC error on chunk 1: {detail}"


def test_payload_without_value_column(impl):
    payload = ipc_file(value_batch([1.0, 2.0], name="grad"))
    _assert_payload_error(impl, payload, "Arrow IPC block missing 'value' column")


def test_payload_value_column_float64(impl):
    """A Float64 value column decodes (to float64); after a Float32 chunk it is a
    disagreement on the value dtype, not an Arrow error."""
    payload = ipc_file(value_batch([1.0, 2.0], type_=pa.float64()))
    s = session(impl)
    alone = [
        s.decode_chunks([make_chunk(impl, 0, 1, payload)]),
        s.decode_frames(frame(0, 1, payload)),
    ]
    for got in alone:
        assert got.dtype == np.float64
        assert got.tolist() == [1.0, 2.0]
    s, chunks, wire = _as_chunk_1(impl, payload)
    for decode, arg, offset in (
        (s.decode_chunks, chunks, None),
        (s.decode_frames, wire, len(frame(0, 2, chunks[0].arrow_ipc_bytes))),
    ):
        with pytest.raises(FrameError) as info:
            decode(arg)
        assert info.value.chunk_index == 1
        assert info.value.offset == offset
        assert info.value.detail == (
            "chunks disagree on the value dtype: chunk 0 holds float32, chunk 1 holds float64"
        )


def test_payload_value_column_int32(impl):
    payload = ipc_file(value_batch([1, 2], type_=pa.int32()))
    _assert_payload_error(
        impl, payload, "'value' column is not Float16, Float32, Float64 or gradstream.bfloat16"
    )


def test_payload_value_column_with_nulls(impl):
    payload = ipc_file(value_batch([1.0, None, 3.0]))
    _assert_payload_error(impl, payload, "'value' column has 1 null value(s)")


def test_payload_second_batch_with_nulls(impl):
    schema = pa.schema([pa.field("value", pa.float32())])
    payload = ipc_file(value_batch([1.0]), value_batch([None, 2.0, None]), schema=schema)
    _assert_payload_error(impl, payload, "'value' column has 2 null value(s)")


def test_payload_missing_value_column_even_without_batches(impl):
    schema = pa.schema([pa.field("grad", pa.float32())])
    _assert_payload_error(impl, ipc_file(schema=schema), "Arrow IPC block missing 'value' column")


def test_payload_in_stream_format(impl):
    _assert_payload_error(impl, ipc_stream(value_batch([1.0, 2.0])), None)


@pytest.mark.parametrize(
    "payload",
    [
        pytest.param(b"", id="empty"),
        pytest.param(b"junk", id="junk"),
        pytest.param(b"ARROW1\x00\x00" + b"\x00" * 64 + b"ARROW1", id="magic-only"),
    ],
)
def test_payload_garbage(impl, payload):
    _assert_payload_error(impl, payload, None)


def test_payload_with_only_value_column_decodes(impl):
    payload = ipc_file(value_batch([5.0, -1.5, 0.25]))
    for out in _decode_payload_as_chunk_1(impl, payload):
        assert_same_bits(out, np.array([1.0, 2.0, 5.0, -1.5, 0.25], dtype=np.float32))


def test_payload_nullable_value_field_without_nulls_decodes(impl):
    schema = pa.schema([pa.field("value", pa.float32(), nullable=True)])
    payload = ipc_file(pa.record_batch([pa.array([7.0], pa.float32())], schema=schema))
    for out in _decode_payload_as_chunk_1(impl, payload):
        assert_same_bits(out, np.array([1.0, 2.0, 7.0], dtype=np.float32))


def test_payload_with_two_batches_concatenates(impl):
    payload = ipc_file(value_batch([3.0, 4.0]), value_batch([5.0]))
    for out in _decode_payload_as_chunk_1(impl, payload):
        assert_same_bits(out, np.array([1.0, 2.0, 3.0, 4.0, 5.0], dtype=np.float32))


def test_payload_with_no_batches_decodes_empty(impl):
    payload = ipc_file(schema=SEED_SCHEMA)
    for out in _decode_payload_as_chunk_1(impl, payload):
        assert_same_bits(out, np.array([1.0, 2.0], dtype=np.float32))


def test_payload_columns_other_than_value_are_ignored(impl):
    batch = pa.record_batch(
        [
            pa.array(["a", None], pa.string()),
            pa.array([9.0, 8.0], pa.float32()),
            pa.array([None, None], pa.int32()),
        ],
        names=["note", "value", "index"],
    )
    for out in _decode_payload_as_chunk_1(impl, ipc_file(batch)):
        assert_same_bits(out, np.array([1.0, 2.0, 9.0, 8.0], dtype=np.float32))


def test_payload_bit_flips_never_crash(impl):
    # Hostile payloads with a *valid* CRC: every outcome must be a clean value or a
    # gradstream error, never a crash or another exception type.
    s = session(impl, 8)
    base = s.encode_gradient(ramp(8))[0].arrow_ipc_bytes
    rng = np.random.default_rng(1234)
    for _ in range(300):
        payload = bytearray(base)
        for pos in rng.integers(0, len(payload), size=int(rng.integers(1, 4))):
            payload[pos] ^= 1 << int(rng.integers(0, 8))
        chunk = make_chunk(impl, 0, 1, bytes(payload))
        try:
            out = s.decode_chunks([chunk])
        except ArrowIpcError as exc:
            assert exc.chunk_index == 0
        else:
            # A flip in the value column's type can make it Float16 or Float64: still a
            # gradient (README "Dtypes"), handed back in that dtype.
            assert out.dtype in (np.float16, np.float32, np.float64) and out.ndim == 1


# --------------------------------------------------------------------------- GradientChunk


def test_chunk_constructor_round_trip(impl):
    payload = session(impl).encode_gradient([1.0, 2.0])[0].arrow_ipc_bytes
    crc = zlib.crc32(payload)
    c = impl.GradientChunk("sid", 3, 5, bytearray(payload), crc)
    assert (c.session_id, c.chunk_index, c.total_chunks, c.checksum) == ("sid", 3, 5, crc)
    assert isinstance(c.arrow_ipc_bytes, bytes)
    assert c.arrow_ipc_bytes == payload
    assert c.payload.to_pybytes() == payload
    assert c.verify_checksum() is True
    assert impl.GradientChunk("sid", 3, 5, payload, crc ^ 1).verify_checksum() is False


@pytest.mark.parametrize(
    "wrap",
    [bytes, bytearray, memoryview, pa.py_buffer, lambda b: np.frombuffer(b, dtype=np.uint8)],
)
def test_chunk_accepts_bytes_like(impl, wrap):
    c = impl.GradientChunk("s", 0, 1, wrap(b"abc"), 0)
    assert c.arrow_ipc_bytes == b"abc"
    assert type(c.arrow_ipc_bytes) is bytes


def test_chunk_equality_by_fields(impl):
    a = impl.GradientChunk("s", 1, 2, b"xy", 7)
    assert a == impl.GradientChunk("s", 1, 2, b"xy", 7)
    assert a != impl.GradientChunk("t", 1, 2, b"xy", 7)
    assert a != impl.GradientChunk("s", 0, 2, b"xy", 7)
    assert a != impl.GradientChunk("s", 1, 3, b"xy", 7)
    assert a != impl.GradientChunk("s", 1, 2, b"xz", 7)
    assert a != impl.GradientChunk("s", 1, 2, b"xy", 8)


def test_encoded_chunks_are_deterministic(impl):
    s = session(impl, 3)
    assert s.encode_gradient(ramp(7)) == s.encode_gradient(ramp(7))


@pytest.mark.parametrize("field", ["chunk_index", "total_chunks", "checksum"])
@pytest.mark.parametrize("value", [-1, 2**32])
def test_chunk_ints_out_of_u32_are_overflow_errors(impl, field, value):
    args = {"session_id": "s", "chunk_index": 0, "total_chunks": 1, "checksum": 0}
    args[field] = value
    with pytest.raises(OverflowError):
        impl.GradientChunk(
            args["session_id"], args["chunk_index"], args["total_chunks"], b"", args["checksum"]
        )


def test_chunk_ints_at_u32_max_are_accepted(impl):
    c = impl.GradientChunk("s", 2**32 - 1, 2**32 - 1, b"", 2**32 - 1)
    assert (c.chunk_index, c.total_chunks, c.checksum) == (2**32 - 1,) * 3


def test_chunk_repr_does_not_dump_payload(impl):
    c = impl.GradientChunk("sess", 4, 9, b"\xab" * 100_000, 0)
    text = repr(c)
    assert "GradientChunk" in text
    assert "sess" in text
    assert len(text) < 300


@pytest.mark.parametrize("data", [b"", b"hello", bytes(range(256)) * 10])
def test_compute_checksum_is_zlib_crc32(impl, data):
    assert impl.GradientChunk.compute_checksum(data) == zlib.crc32(data)
    assert impl.GradientChunk.compute_checksum(bytearray(data)) == zlib.crc32(data)


def test_chunk_properties_are_read_only(impl):
    c = impl.GradientChunk("s", 0, 1, b"", 0)
    for name in ("session_id", "chunk_index", "total_chunks", "checksum", "arrow_ipc_bytes"):
        with pytest.raises(AttributeError):
            setattr(c, name, getattr(c, name))


# --------------------------------------------------------------------------- errors


def test_all_errors_share_the_base_class(impl):
    for cls in (ArrowIpcError, ChecksumMismatchError, FrameError, IncompleteStreamError):
        assert issubclass(cls, GradientStreamError)
    s = session(impl)
    with pytest.raises(GradientStreamError):
        s.decode_frames(b"\x00")


# --------------------------------------------------------------------------- TransferProgress


def test_transfer_progress_starts_at_zero(impl):
    p = impl.TransferProgress()
    assert (p.bytes, p.chunks, p.total_chunks) == (0, 0, 0)
    assert all(type(v) is int for v in (p.bytes, p.chunks, p.total_chunks))


def test_transfer_progress_is_read_only(impl):
    p = impl.TransferProgress()
    for name in ("bytes", "chunks", "total_chunks"):
        with pytest.raises(AttributeError):
            setattr(p, name, 5)


def test_transfer_progress_counts_one_transfer(impl):
    s = session(impl, 1000)
    grad = ramp(4500)
    wire = s.encode_frames(grad)

    async def transfer():
        a, b = socket.socketpair()
        with a, b:
            sent_progress, got_progress = impl.TransferProgress(), impl.TransferProgress()
            sent, got = await asyncio.gather(
                s.stream_to(grad, a, progress=sent_progress),
                s.receive_from(b, progress=got_progress),
            )
        return sent, got, sent_progress, got_progress

    sent, got, sent_progress, got_progress = asyncio.run(transfer())
    assert sent == 5
    assert_same_bits(got, grad)
    for p in (sent_progress, got_progress):
        assert (p.bytes, p.chunks, p.total_chunks) == (len(wire), 5, 5)


# --------------------------------------------------------------------------- compact layout


def test_layout_defaults_to_seed_and_is_kept_by_builders(impl):
    s = impl.GradientStreamSession("run")
    assert s.layout == "seed"
    c = impl.GradientStreamSession("run", 7, layout="compact")
    assert c.layout == "compact"
    assert c.with_compression(True).layout == "compact"


@pytest.mark.parametrize("bad", ["Seed", "", "dense", None, 1])
def test_unknown_layout_is_refused(impl, bad):
    with pytest.raises((ValueError, TypeError), match=r"layout|str"):
        impl.GradientStreamSession("run", layout=bad)


def test_compact_payload_is_the_value_column_alone(impl):
    s = impl.GradientStreamSession("run", 4, layout="compact")
    for chunk in s.encode_gradient(ramp(10)):
        reader = pa.ipc.open_file(pa.py_buffer(chunk.arrow_ipc_bytes))
        assert reader.schema == pa.schema([pa.field("value", pa.float32(), nullable=False)])
        assert reader.num_record_batches == 1
        assert zlib.crc32(chunk.arrow_ipc_bytes) == chunk.checksum


def test_compact_halves_the_wire_and_round_trips(impl):
    grad = ramp(65536 * 3 + 5)
    seed = impl.GradientStreamSession("run").encode_frames(grad)
    compact = impl.GradientStreamSession("run", layout="compact").encode_frames(grad)
    assert len(compact) < 0.52 * len(seed)
    # Any session decodes either layout: decoding only looks up the value column.
    reader = impl.GradientStreamSession("other")
    assert_same_bits(reader.decode_frames(compact), grad)
    assert_same_bits(reader.decode_frames(seed), grad)


def test_compact_empty_gradient_is_one_empty_batch(impl):
    s = impl.GradientStreamSession("run", layout="compact")
    (chunk,) = s.encode_gradient(np.empty(0, np.float32))
    assert chunk.total_chunks == 1
    assert pa.ipc.open_file(pa.py_buffer(chunk.arrow_ipc_bytes)).get_batch(0).num_rows == 0
    assert s.decode_chunks([chunk]).size == 0


def test_compact_payload_limit_counts_four_bytes_a_value(impl):
    # 1000 values fit in 4 KiB + overhead compact, but never in the seed layout.
    impl.GradientStreamSession("run", 1000, max_payload_len=5000, layout="compact").encode_frames(
        ramp(3000)
    )
    with pytest.raises(FrameError):
        impl.GradientStreamSession("run", 1000, max_payload_len=5000).encode_frames(ramp(3000))


@pytest.mark.parametrize(
    ("setting", "value"),
    [
        ("layout", "dense"),
        ("compression", "gzip"),
        ("chunk_size", -1),
        ("max_payload_len", 0),
        ("max_gradient_len", 0),
        ("timeout", -1.0),
    ],
)
def test_bad_settings_are_setting_errors_naming_the_keyword(impl, setting, value):
    # Bad input: an unknown codec or layout name (or a limit out of range) is an
    # error of our classes, and also the ValueError it always was; no session is made.
    kwargs = {"chunk_size": value} if setting == "chunk_size" else {setting: value}
    chunk_size = kwargs.pop("chunk_size", 16)
    with pytest.raises(SettingError) as info:
        impl.GradientStreamSession("s", chunk_size, **kwargs)
    err = info.value
    assert isinstance(err, GradientStreamError) and isinstance(err, ValueError)
    assert err.setting == setting
    assert setting in str(err) and str(err) == err.detail
    assert pickle.loads(pickle.dumps(err)).setting == setting
