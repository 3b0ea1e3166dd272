"""Hand-picked cases of encoding and decoding, against both implementations:
chunking, round trips, the gradient input accepted, encode_frames' bytes, and the compact
layout.

Every test takes the `impl` fixture (see tests/conftest.py): the pure-Python reference and
the native extension must behave identically, down to exception classes, fields and
messages.
"""

from __future__ import annotations

import array
import pickle
import zlib
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pyarrow.ipc
import pytest

from gradstream.errors import FrameError, GradientStreamError, SettingError
from support.cases import SEED_SCHEMA, assert_same_bits, frames_of, ramp
from support.frames import HEADER
from support.impls import session
from support.values import ALL_SPECIAL_BITS


def read_payload(payload: bytes) -> pa.Table:
    return pa.ipc.open_file(pa.py_buffer(payload)).read_all()


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


@pytest.mark.parametrize("chunk_size", [1, 3, 64])
def test_special_floats_survive_bit_for_bit(impl, chunk_size):
    grad = ALL_SPECIAL_BITS.view(np.float32)
    s = session(impl, chunk_size)
    chunks = s.encode_gradient(grad)
    np.testing.assert_array_equal(s.decode_chunks(chunks).view(np.uint32), ALL_SPECIAL_BITS)
    np.testing.assert_array_equal(
        s.decode_frames(s.encode_frames(grad)).view(np.uint32), ALL_SPECIAL_BITS
    )
    # The payload itself holds the same bits, as a foreign reader sees them.
    on_wire = np.concatenate(
        [read_payload(c.arrow_ipc_bytes).column("value").to_numpy() for c in chunks]
    )
    np.testing.assert_array_equal(on_wire.view(np.uint32), ALL_SPECIAL_BITS)


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


# --------------------------------------------------------------------------- compact layout


def test_layout_defaults_to_seed_and_is_kept_by_builders(impl):
    s = impl.GradientStreamSession("run")
    assert s.layout == "seed"
    assert impl.GradientStreamSession("run", layout=None).layout == "seed"  # unset: bare frames'
    c = impl.GradientStreamSession("run", 7, layout="compact")
    assert c.layout == "compact"
    assert c.with_compression(True).layout == "compact"


@pytest.mark.parametrize("bad", ["Seed", "", "dense", 1])
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
