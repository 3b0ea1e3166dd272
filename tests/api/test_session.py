"""The session, chunk and progress objects: settings and their checks, properties,
GradientChunk, the error hierarchy and TransferProgress, against both implementations.

Every test takes the `impl` fixture (see tests/conftest.py): the pure-Python reference and
the native extension must behave identically, down to exception classes, fields and
messages.
"""

from __future__ import annotations

import asyncio
import socket
import zlib

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
)
from support.cases import assert_same_bits, ramp
from support.impls import session

# --------------------------------------------------------------------------- session settings


def test_defaults(impl):
    s = impl.GradientStreamSession("run-7")
    assert s.session_id == "run-7"
    assert s.chunk_size == 65536
    assert s.max_payload_len == 268435456
    assert s.is_compression_enabled() is False
    d = impl.GradientStreamSession.with_defaults("run-8")
    assert (d.session_id, d.chunk_size, d.max_payload_len) == ("run-8", 65536, 268435456)


def test_a_session_without_an_id_gets_a_fresh_one(impl):
    # docs/reference/api.md: the id is a local label; without one, "gradstream-<16 hex>".
    a, b = impl.GradientStreamSession(), impl.GradientStreamSession(chunk_size=4)
    for s in (a, b, impl.GradientStreamSession.with_defaults()):
        prefix, _, digits = s.session_id.partition("-")
        assert (prefix, len(digits)) == ("gradstream", 16)
        int(digits, 16)
    assert a.session_id != b.session_id
    assert (a.chunk_size, b.chunk_size) == (65536, 4)
    # It works like any other session, and its chunks carry its id.
    chunks = b.encode_gradient(ramp(9))
    assert {c.session_id for c in chunks} == {b.session_id}
    assert_same_bits(a.decode_chunks(chunks), ramp(9))
    assert_same_bits(a.decode_frames(b.encode_frames(ramp(9))), ramp(9))
    # The original's positional (session_id, chunk_size) stays.
    assert impl.GradientStreamSession("run-9", 5).session_id == "run-9"
    with pytest.raises(TypeError):
        impl.GradientStreamSession(7)


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
