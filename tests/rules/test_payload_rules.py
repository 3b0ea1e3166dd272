"""The payload rules: which Arrow IPC payloads a receiver decodes and which it refuses
(no value column, another type, nulls, the stream format, garbage), against both
implementations.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.ipc
import pytest

from gradstream.errors import ArrowIpcError, FrameError
from support.cases import SEED_SCHEMA, assert_same_bits, make_chunk, ramp
from support.frames import frame
from support.impls import session


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
        impl,
        payload,
        "'value' column is not Float16, Float32, Float64, gradstream.bfloat16 or a list of Int8",
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
            # gradient (docs/guides/dtypes-and-shapes.md), handed back in that dtype.
            assert out.dtype in (np.float16, np.float32, np.float64) and out.ndim == 1
