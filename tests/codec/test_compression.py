"""Compressed payloads: ``compression=None | True | False | "lz4" | "zstd"``, against
both implementations: round trips, the payload's bytes, streaming, and the API.

A compressed session writes the same Arrow IPC file as an uncompressed one (seed or compact
layout) but its record batch carries the IPC BodyCompression (LZ4_FRAME or ZSTD, method
BUFFER); the frame header's CRC-32 covers the compressed bytes. Every session decodes
compressed payloads from either implementation, whatever its own setting. Hostile
compressed payloads are in test_compression_hostile.py, the differential tests in
test_compression_differential.py.
"""

from __future__ import annotations

import asyncio
import inspect
import re
import socket
import zlib
from types import ModuleType
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

import gradstream.reference as ref
from gradstream.errors import ChecksumMismatchError, FrameError
from support.aio import read_until_eof, receive_bytes, run, transfer
from support.compressed import (
    CODEC_IDS,
    assert_arrow_error,
    assert_bit_equal,
    session,
    sparse,
    split_frames,
)
from support.frames import HEADER_LEN
from support.impls import CODECS, IMPL_NAMES, LAYOUTS, PATHS
from support.impls import load_impl as module
from support.payloads import the_batch
from support.values import special

# --------------------------------------------------------------------------- round trips

CHUNK = 64


LENGTHS = [0, 1, CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK + 5]


@pytest.mark.parametrize("decoder", IMPL_NAMES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("codec", CODECS)
def test_round_trip_frames_and_chunks(impl: ModuleType, decoder: str, codec: str, layout: str):
    """impl encodes, ``decoder`` decodes (a session without compression, and one with the
    other codec): the same bits, NaN payloads and -0.0 included."""
    enc = session(impl, CHUNK, layout=layout, compression=codec)
    other = "zstd" if codec == "lz4" else "lz4"
    dec_mod = module(decoder)
    receivers = [session(dec_mod, 7), session(dec_mod, 7, compression=other)]
    for n in LENGTHS:
        for grad in (special(n), sparse(n, seed=n)):
            wire = enc.encode_frames(grad)
            chunks = enc.encode_gradient(grad)
            assert len(chunks) == max(1, -(-n // CHUNK))
            for rx in receivers:
                what = f"{n} values, {rx!r}"
                assert_bit_equal(rx.decode_frames(wire), grad, what)
                assert_bit_equal(rx.decode_chunks(chunks), grad, what)
                assert_bit_equal(rx.decode_chunks(reversed(chunks)), grad, what)
                out = np.full(n, np.float32(-1.5))
                assert rx.decode_frames(wire, out=out) is out
                assert_bit_equal(out, grad, what)


@pytest.mark.parametrize("codec", CODECS)
def test_frames_are_the_chunks(impl: ModuleType, codec: str):
    s = session(impl, 100, compression=codec)
    grad = sparse(1000)
    wire = s.encode_frames(grad)
    frames = split_frames(wire)
    chunks = s.encode_gradient(grad)
    assert [(c.chunk_index, c.total_chunks, c.checksum, c.arrow_ipc_bytes) for c in chunks] == [
        (i, t, crc, p) for i, t, crc, p in frames
    ]
    assert s.encode_frames(grad, as_buffer=True).to_pybytes() == wire


# --------------------------------------------------------------------------- the payload


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("codec", CODECS)
def test_payload_carries_body_compression(impl: ModuleType, codec: str, layout: str):
    n = 1000
    grad = sparse(n)
    (chunk,) = session(impl, n, layout=layout, compression=codec).encode_gradient(grad)
    payload = chunk.arrow_ipc_bytes
    assert chunk.checksum == zlib.crc32(payload)
    assert chunk.verify_checksum()
    # The same file as without compression but for the body: pyarrow reads it.
    reader = pa.ipc.open_file(pa.py_buffer(payload))
    expected_schema = ref.COMPACT_SCHEMA if layout == "compact" else ref.PAYLOAD_SCHEMA
    assert reader.schema.equals(expected_schema)
    assert reader.num_record_batches == 1
    batch = reader.get_batch(0)
    assert batch.num_rows == n
    assert_bit_equal(batch.column("value").to_numpy(zero_copy_only=True), grad)
    if layout == "seed":
        assert batch.column("index").to_pylist() == list(range(n))
    # The record batch message declares the codec, method BUFFER, and every non-empty
    # buffer starts with its uncompressed length (or -1: stored as it is).
    message = the_batch(payload)
    assert message.rows == n
    assert message.compression == (CODEC_IDS[codec], 0)
    data = [(o, length) for o, length in message.buffers if length > 0]
    assert len(data) == (1 if layout == "compact" else 2)
    for offset, length in data:
        assert length >= 8
        declared = int.from_bytes(message.body[offset : offset + 8], "little", signed=True)
        assert declared in (4 * n, -1)


@pytest.mark.parametrize("codec", CODECS)
def test_compression_shrinks_a_zero_heavy_gradient(impl: ModuleType, codec: str):
    grad = np.zeros(65536, np.float32)
    grad[::1000] = 1.0
    sizes = {}
    for layout in LAYOUTS:
        plain = session(impl, 65536, layout=layout).encode_frames(grad)
        packed = session(impl, 65536, layout=layout, compression=codec).encode_frames(grad)
        sizes[layout] = len(packed), len(plain)
    # The value column all but vanishes. The seed layout's index column (0..n-1 as int32)
    # is half the payload and neither codec does much with it (LZ4 nothing at all).
    packed, plain = sizes["compact"]
    assert packed * 50 < plain, sizes
    packed, plain = sizes["seed"]
    assert packed < 0.65 * plain, sizes


@pytest.mark.parametrize("codec", CODECS)
def test_payload_sizes_depend_on_the_values(impl: ModuleType, codec: str):
    s = session(impl, 500, layout="compact", compression=codec)
    grad = np.concatenate([np.zeros(500, np.float32), special(500), sparse(500)])
    sizes = [len(c.arrow_ipc_bytes) for c in s.encode_gradient(grad)]
    assert len(set(sizes)) == 3, sizes


@pytest.mark.parametrize("codec", CODECS)
def test_flipped_bit_in_a_compressed_payload_is_a_checksum_mismatch(impl: ModuleType, codec):
    s = session(impl, 50, compression=codec)
    wire = bytearray(s.encode_frames(sparse(120)))
    frames = split_frames(bytes(wire))
    index, total, crc, payload = frames[1]
    at = HEADER_LEN * 2 + len(frames[0][3]) + len(payload) // 2  # mid chunk 1's payload
    wire[at] ^= 0x10
    flipped = bytearray(payload)
    flipped[len(payload) // 2] ^= 0x10
    with pytest.raises(ChecksumMismatchError) as info:
        s.decode_frames(bytes(wire))
    e = info.value
    assert (e.chunk_index, e.expected, e.actual) == (1, crc, zlib.crc32(flipped))
    chunks = s.encode_gradient(sparse(120))
    bad = impl.GradientChunk("s", index, total, bytes(flipped), crc)
    with pytest.raises(ChecksumMismatchError) as info:
        s.decode_chunks([chunks[0], bad, chunks[2]])
    assert (info.value.chunk_index, info.value.expected) == (1, crc)
    assert info.value.actual == zlib.crc32(flipped)


# --------------------------------------------------------------------------- streaming


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("receiver", IMPL_NAMES)
@pytest.mark.parametrize("codec", CODECS)
def test_stream_compressed(impl: ModuleType, receiver: str, codec: str, path: str):
    grad = np.concatenate([sparse(30_000), special(1001)])
    tx = session(impl, 4096, compression=codec)
    rx = session(module(receiver), 4096)  # its own setting does not matter

    async def main() -> None:
        sent, got = await transfer(tx, rx, grad, path)
        assert sent == -(-grad.size // 4096)
        assert_bit_equal(got, grad)
        out = np.empty((grad.size,), np.float32)
        sent, got = await transfer(tx, rx, grad, path, out=out)
        assert got is out
        assert_bit_equal(out, grad)
        # The bytes on the wire are encode_frames'.
        a, b = socket.socketpair()
        with a, b:

            async def send() -> None:
                await tx.stream_to(grad, a)
                a.shutdown(socket.SHUT_WR)

            _, wire = await asyncio.gather(send(), read_until_eof(b))
        assert wire == tx.encode_frames(grad)

    run(main)


@pytest.mark.parametrize("path", PATHS)
def test_stream_compressed_rows_above_the_room(impl: ModuleType, path: str):
    """The receiver's room is counted in arrival order, as for decode_frames."""
    tx = session(ref, 600, compression="zstd")
    rx = session(impl, 600, max_gradient_len=1000)
    wire = tx.encode_frames(sparse(2000))

    async def main() -> Any:
        return await receive_bytes(rx, wire, path)  # fits the socket buffer: some kilobytes

    assert_arrow_error(
        run(main),
        1,
        "compressed record batch declares 600 rows, more than the 400 values "
        "max_gradient_len still allows",
    )


# --------------------------------------------------------------------------- API


@pytest.mark.parametrize(
    ("value", "stored"),
    [(None, None), (False, None), (True, "lz4"), ("lz4", "lz4"), ("zstd", "zstd")],
)
def test_compression_values(impl: ModuleType, value: Any, stored: str | None):
    s = session(impl, 7, compression=value)
    assert s.compression == stored
    assert s.is_compression_enabled() is (stored is not None)
    # At the flag's old place, after the layout; the value as Python's repr shows it.
    # (How session_id and layout are quoted is not this feature's business.)
    tail = r"""layout=["']seed["'], compression=""" + re.escape(repr(stored))
    tail += r", keep_shape=False, keep_dtype=False, wire_dtype=None, seal=False\)$"
    assert re.search(tail, repr(s)), repr(s)


def test_compression_defaults_to_none(impl: ModuleType):
    s = impl.GradientStreamSession("s")
    assert s.compression is None
    assert s.is_compression_enabled() is False
    assert impl.GradientStreamSession.with_defaults("s").compression is None
    param = inspect.signature(impl.GradientStreamSession).parameters["compression"]
    assert param.kind is inspect.Parameter.KEYWORD_ONLY
    assert param.default is None
    # Followed only by keep_shape, keep_dtype, wire_dtype (test_shape, test_dtypes) and
    # seal (seal/).
    assert list(inspect.signature(impl.GradientStreamSession).parameters)[-5:] == [
        "compression",
        "keep_shape",
        "keep_dtype",
        "wire_dtype",
        "seal",
    ]


@pytest.mark.parametrize("value", ["gzip", "LZ4", "lz4_frame", "", "zstd "])
def test_unknown_compression_name_is_value_error(impl: ModuleType, value: str):
    message = f"compression must be None, True, False, 'lz4' or 'zstd', got {value!r}"
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        session(impl, compression=value)


@pytest.mark.parametrize(
    ("value", "name"),
    [(1, "int"), (0, "int"), (1.0, "float"), (b"lz4", "bytes"), (["lz4"], "list")],
)
def test_compression_of_another_type_is_type_error(impl: ModuleType, value: Any, name: str):
    message = f"compression must be None, a bool, 'lz4' or 'zstd', got {name}"
    with pytest.raises(TypeError, match=f"^{re.escape(message)}$"):
        session(impl, compression=value)


def test_compression_is_read_only(impl: ModuleType):
    s = session(impl, compression="zstd")
    with pytest.raises(AttributeError):
        s.compression = None


@pytest.mark.parametrize("start", [None, "lz4", "zstd"])
def test_with_compression(impl: ModuleType, start: str | None):
    limits = {"max_payload_len": 12345, "max_gradient_len": 99, "timeout": 2.5}
    s = impl.GradientStreamSession("a", 7, **limits, layout="compact", compression=start)
    on, off = s.with_compression(True), s.with_compression(False)
    for twin, expected in ((on, "lz4"), (off, None)):
        assert twin is not s
        assert twin.compression == expected
        assert twin.is_compression_enabled() is (expected is not None)
        assert (twin.session_id, twin.chunk_size, twin.max_payload_len) == ("a", 7, 12345)
        assert (twin.max_gradient_len, twin.timeout, twin.layout) == (99, 2.5, "compact")
    assert s.compression == start  # unchanged
    with pytest.raises(TypeError):
        s.with_compression(1)
    with pytest.raises(TypeError):
        s.with_compression("zstd")


@pytest.mark.parametrize("codec", CODECS)
def test_frames_len_of_a_compressed_session_is_value_error(impl: ModuleType, codec: str):
    s = session(impl, compression=codec)
    message = (
        "frames_len is not known in advance for a compressed session: payload sizes "
        "depend on the values"
    )
    for n in (0, 1, 1000):
        with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
            s.frames_len(n)
    # The argument checks come first.
    with pytest.raises(TypeError):
        s.frames_len("3")
    with pytest.raises(TypeError):
        s.frames_len(3.0)
    with pytest.raises(ValueError, match="n_values"):
        s.frames_len(-1)
    assert session(impl).frames_len(0) > 0  # without compression: known


@pytest.mark.parametrize("codec", CODECS)
def test_encode_frames_into_out(impl: ModuleType, codec: str):
    s = session(impl, 100, compression=codec)
    for grad in (sparse(1000), special(0), special(1)):
        wire = s.encode_frames(grad)
        for buf in (bytearray(b"\xaa" * (len(wire) + 9)), np.full(len(wire), 0xAA, np.uint8)):
            n = s.encode_frames(grad, out=buf)
            assert n == len(wire)
            assert bytes(memoryview(buf)[:n]) == wire
            assert bytes(memoryview(buf)[n:]) == b"\xaa" * (len(buf) - n)


@pytest.mark.parametrize("codec", CODECS)
def test_encode_frames_into_too_small_out(impl: ModuleType, codec: str):
    s = session(impl, 100, compression=codec)
    grad = sparse(1000)
    needed = len(s.encode_frames(grad))
    for size in (0, 1, needed - 1):
        buf = bytearray(b"\xaa" * size)
        message = f"out= holds {size} bytes; the frames of 1000 values take {needed}"
        with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
            s.encode_frames(grad, out=buf)
        assert buf == b"\xaa" * size  # nothing written


def test_compressed_chunk_over_max_payload_len_is_refused(impl: ModuleType):
    # Incompressible values: the payload is over the limit, which no floor predicts.
    grad = np.random.default_rng(1).integers(0, 2**32, 300, dtype=np.uint32).view(np.float32)
    s = session(impl, 300, layout="compact", compression="lz4", max_payload_len=1000)
    with pytest.raises(FrameError, match="max_payload_len 1000"):
        s.encode_frames(grad)
    with pytest.raises(FrameError):
        s.encode_gradient(grad)
    buf = bytearray(b"\xaa" * 10_000)
    with pytest.raises(FrameError, match="max_payload_len 1000"):
        s.encode_frames(np.concatenate([np.zeros(600, np.float32), grad]), out=buf)
    assert buf == b"\xaa" * 10_000  # chunks 0 and 1 fit, chunk 2 does not: nothing written
    # Zeros compress under the same limit, although 300 values take 1200 bytes unpacked.
    zeros = np.zeros(300, np.float32)
    assert_bit_equal(s.decode_frames(s.encode_frames(zeros)), zeros)
