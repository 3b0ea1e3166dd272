"""Compressed payloads (issue 5, part 1): ``compression=None | True | False | "lz4" |
"zstd"``, against both implementations.

A compressed session writes the same Arrow IPC file as an uncompressed one (seed or compact
layout) but its record batch carries the IPC BodyCompression (LZ4_FRAME or ZSTD, method
BUFFER); the frame header's CRC-32 covers the compressed bytes. Every session decodes
compressed payloads from either implementation, whatever its own setting. Before anything
is decompressed, a compressed record batch is held to bounds (rows against what
max_gradient_len still allows, each buffer's declared uncompressed length against its
batch's rows, known codec and method), because an Arrow reader allocates whatever a
buffer declares.

Hostile payloads are built byte by byte, independently of the reference's own flatbuffer
walk, with the payload surgery of support/payloads.py (``the_batch``, ``with_buffer``,
``rebuild``...). Every such payload gets a correct CRC, so that it reaches the Arrow
decoders.
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import inspect
import re
import resource
import socket
import struct
import time
import warnings
import zlib
from collections import Counter
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import event, given, note, settings
from hypothesis import strategies as st

import gradstream.reference as ref
from gradstream.errors import (
    ArrowIpcError,
    ChecksumMismatchError,
    FrameError,
    GradientStreamError,
    IncompleteStreamError,
)
from support.aio import T, read_until_eof, receive_bytes, run, transfer
from support.frames import HEADER, HEADER_LEN, frame
from support.impls import CODECS, ERROR_CLASSES, FIXTURE_OK, IMPL_NAMES, LAYOUTS, PATHS, examples
from support.impls import load_impl as module
from support.memory import proc_status
from support.payloads import footer_blocks, rebuild, the_batch, value_buffer, with_buffer
from support.values import SPECIAL_BITS, special
from support.values import float32_bits as bits

CODEC_IDS = {"lz4": 0, "zstd": 1}  # CompressionType in Arrow's Message.fbs


# --------------------------------------------------------------------------- helpers


# Not support.impls.session: here the chunk size is 64 when not given.
def session(impl: ModuleType, chunk_size: int = 64, **kwargs: Any) -> Any:
    return impl.GradientStreamSession("s", chunk_size, **kwargs)


def sparse(n: int, seed: int = 0) -> np.ndarray:
    """n values, nine in ten of them zeros (+0.0), the rest raw bit patterns."""
    rng = np.random.default_rng(seed)
    words = rng.integers(0, 2**32, n, dtype=np.uint32)
    words[rng.random(n) < 0.9] = 0
    return words.view(np.float32)


def assert_bit_equal(got: Any, want: np.ndarray, what: str = "") -> None:
    assert isinstance(got, np.ndarray), what
    assert got.dtype == np.float32 and got.ndim == 1, what
    assert got.shape == (want.size,), what
    assert np.array_equal(bits(got), bits(want)), what


def split_frames(wire: bytes) -> list[tuple[int, int, int, bytes]]:
    """(chunk_index, total_chunks, checksum, payload) of each frame of a valid stream."""
    frames, pos = [], 0
    while pos < len(wire):
        index, total, length, crc = HEADER.unpack_from(wire, pos)
        payload = wire[pos + HEADER_LEN : pos + HEADER_LEN + length]
        assert len(payload) == length
        frames.append((index, total, crc, payload))
        pos += HEADER_LEN + length
    return frames


def decode_both_ways(s: Any, payload: bytes) -> list[Any]:
    """The outcomes (array or GradientStreamError) of one payload, with its correct CRC,
    as the only chunk of a gradient: [decode_chunks, decode_frames]."""
    outcomes = []
    # A chunk object of the session's own implementation.
    mod = ref if isinstance(s, ref.GradientStreamSession) else importlib.import_module("gradstream")
    crc = zlib.crc32(payload)
    for call in (
        lambda: s.decode_chunks([mod.GradientChunk("s", 0, 1, payload, crc)]),
        lambda: s.decode_frames(frame(0, 1, payload)),
    ):
        try:
            outcomes.append(call())
        except GradientStreamError as exc:
            outcomes.append(exc)
    return outcomes


def assert_arrow_error(outcome: Any, chunk_index: int, detail: str | None = None) -> None:
    assert isinstance(outcome, ArrowIpcError), f"expected ArrowIpcError, got {outcome!r}"
    assert outcome.chunk_index == chunk_index, outcome
    if detail is not None:
        assert outcome.detail == detail


@functools.lru_cache(maxsize=64)
def compressed_payload(codec: str, layout: str, n: int, kind: str = "special") -> bytes:
    """A payload of n values written by the reference (pyarrow)."""
    values = special(n) if kind == "special" else sparse(n)
    return ref.encode_payload(values, layout, codec)


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
    tail += r", keep_shape=False, keep_dtype=False, wire_dtype=None\)$"
    assert re.search(tail, repr(s)), repr(s)


def test_compression_defaults_to_none(impl: ModuleType):
    s = impl.GradientStreamSession("s")
    assert s.compression is None
    assert s.is_compression_enabled() is False
    assert impl.GradientStreamSession.with_defaults("s").compression is None
    param = inspect.signature(impl.GradientStreamSession).parameters["compression"]
    assert param.kind is inspect.Parameter.KEYWORD_ONLY
    assert param.default is None
    # Followed only by keep_shape, keep_dtype and wire_dtype (test_shape, test_dtypes).
    assert list(inspect.signature(impl.GradientStreamSession).parameters)[-4:] == [
        "compression",
        "keep_shape",
        "keep_dtype",
        "wire_dtype",
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


# --------------------------------------------------------------------------- hostile payloads


def test_rebuilt_payloads_decode_like_the_originals(impl: ModuleType):
    """The byte-level builder is faithful: rebuilding a real payload from the fields read
    out of it gives a payload both decoders read to the same values; so the hostile
    variants below fail on the field they change and on nothing else."""
    s = session(impl)
    for codec in CODECS:
        for layout in LAYOUTS:
            for n in (0, 1, 1000):
                payload = compressed_payload(codec, layout, n)
                rebuilt = rebuild(payload, the_batch(payload))
                assert the_batch(rebuilt) == the_batch(payload)
                for outcome in decode_both_ways(s, rebuilt):
                    assert_bit_equal(outcome, special(n), f"{codec} {layout} {n}")


ROWS_MESSAGE = (
    "compressed record batch declares {rows} rows, more than the {room} values "
    "max_gradient_len still allows"
)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("codec", CODECS)
def test_rows_above_max_gradient_len_are_refused(impl: ModuleType, codec: str, layout: str):
    payload = compressed_payload(codec, layout, 2000, "sparse")
    rx = session(impl, max_gradient_len=1000)
    for outcome in decode_both_ways(rx, payload):
        assert_arrow_error(outcome, 0, ROWS_MESSAGE.format(rows=2000, room=1000))
    # At the limit: accepted.
    exact = session(impl, max_gradient_len=2000)
    for outcome in decode_both_ways(exact, payload):
        assert_bit_equal(outcome, sparse(2000))


def test_room_counts_the_values_accepted_before(impl: ModuleType):
    tx = session(ref, 600, compression="lz4")
    grad = sparse(2000)
    frames = split_frames(tx.encode_frames(grad))  # 600, 600, 600, 200 values
    rx = session(impl, max_gradient_len=1000)

    def wire(order: list[int]) -> bytes:
        return b"".join(frame(frames[i][0], 4, frames[i][3]) for i in order)

    # decode_frames: the values accepted so far in arrival order.
    for order, failing, room in (
        ([0, 1, 2, 3], 1, 400),  # 600 accepted
        ([1, 0, 2, 3], 0, 400),  # chunk 1 arrived first and fits; chunk 0 does not
        ([3, 2, 1, 0], 1, 200),  # 200 + 600 accepted
    ):
        with pytest.raises(ArrowIpcError) as info:
            rx.decode_frames(wire(order))
        assert_arrow_error(info.value, failing, ROWS_MESSAGE.format(rows=600, room=room))
    # decode_chunks: the chunks before it in index order, whatever the order given.
    chunks = [impl.GradientChunk("s", i, t, p, crc) for i, t, crc, p in frames]
    for given_order in (chunks, chunks[::-1]):
        with pytest.raises(ArrowIpcError) as info:
            rx.decode_chunks(given_order)
        assert_arrow_error(info.value, 1, ROWS_MESSAGE.format(rows=600, room=400))
    # Without compression the same gradient is the FrameError of the limit (frames) and
    # unlimited (chunks): unchanged.
    plain = session(ref, 600)
    with pytest.raises(FrameError, match="gradient exceeds max_gradient_len 1000"):
        rx.decode_frames(plain.encode_frames(grad))
    assert_bit_equal(rx.decode_chunks(plain.encode_gradient(grad)), grad)


@pytest.mark.parametrize("codec", CODECS)
def test_buffer_declaring_a_terabyte_is_refused_before_any_allocation(impl: ModuleType, codec: str):
    payload = compressed_payload(codec, "compact", 1000, "sparse")
    batch = the_batch(payload)
    i = value_buffer(batch)
    data = bytearray(batch.body[batch.buffers[i][0] :][: batch.buffers[i][1]])
    data[:8] = (2**40).to_bytes(8, "little")
    hostile = rebuild(payload, with_buffer(batch, i, bytes(data)))
    s = session(impl)
    detail = "compressed IPC buffer declares 1099511627776 bytes uncompressed, more than its "
    detail += "1000-row batch can hold"

    def decode() -> list[Any]:
        return decode_both_ways(s, hostile)

    decode()  # warm up (first use of a codec or pool)
    t0 = time.monotonic()
    outcomes, growth = with_rss_growth(decode)
    assert time.monotonic() - t0 < 1.0
    assert growth < 100 * 2**20, f"RSS grew by {growth / 2**20:.0f} MiB"
    for outcome in outcomes:
        assert_arrow_error(outcome, 0, detail)


def with_rss_growth(call: Callable[[], T]) -> tuple[T, int]:
    """call()'s result and how far the peak RSS rose above the RSS before it (resetting
    the peak where the kernel allows; otherwise only a rise above the old peak shows)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # peak RSS := current RSS
        before = proc_status("VmRSS")
    except OSError:
        before = proc_status("VmHWM")
    result = call()
    return result, proc_status("VmHWM") - before


BOMB_BYTES = 256 * 2**20  # what a bomb buffer really decompresses to


@functools.lru_cache(maxsize=2)
def bomb(codec: str) -> bytes:
    """A compact payload declaring 1000 rows whose value buffer is a genuine compressed
    stream of 256 MiB of zeros (some kilobytes), with that length declared: a reader
    without the bound on the declared length allocates and fills all of it."""
    payload = compressed_payload(codec, "compact", 1000, "sparse")
    batch = the_batch(payload)
    zeros = np.zeros(BOMB_BYTES, np.uint8)  # calloc'd: reading it maps the zero page
    stream = pa.compress(zeros, codec=codec, asbytes=True)
    data = BOMB_BYTES.to_bytes(8, "little") + stream
    return rebuild(payload, with_buffer(batch, value_buffer(batch), data))


def test_bomb_is_real():
    """The control: pyarrow alone, handed the bomb, really allocates it (the buffer is
    larger than the batch needs, which Arrow readers accept)."""
    (got, growth) = with_rss_growth(
        lambda: pa.ipc.open_file(pa.py_buffer(bomb("zstd"))).get_batch(0)
    )
    assert got.num_rows == 1000
    assert growth > BOMB_BYTES // 2, f"RSS grew by {growth / 2**20:.0f} MiB only"
    del got


@pytest.mark.parametrize("codec", CODECS)
def test_bomb_is_refused_without_decompressing(impl: ModuleType, codec: str):
    payload = bomb(codec)
    s = session(impl)
    outcomes, growth = with_rss_growth(lambda: decode_both_ways(s, payload))
    assert growth < 100 * 2**20, f"RSS grew by {growth / 2**20:.0f} MiB"
    for outcome in outcomes:
        assert_arrow_error(
            outcome,
            0,
            f"compressed IPC buffer declares {BOMB_BYTES} bytes uncompressed, more than its "
            "1000-row batch can hold",
        )


@pytest.mark.parametrize("codec", CODECS)
def test_bomb_under_a_small_declared_length_is_refused(impl: ModuleType, codec: str):
    """The same 256 MiB stream declaring 8000 bytes, within the bound of 1000 rows: the
    decompressor must stop at the declared length rather than follow the stream."""
    payload = compressed_payload(codec, "compact", 1000, "sparse")
    batch = the_batch(payload)
    stream = bomb(codec)
    stream_batch = the_batch(stream)
    o, n = stream_batch.buffers[value_buffer(stream_batch)]
    data = (8000).to_bytes(8, "little") + stream_batch.body[o + 8 : o + n]
    hostile = rebuild(payload, with_buffer(batch, value_buffer(batch), data))
    s = session(impl)
    outcomes, growth = with_rss_growth(lambda: decode_both_ways(s, hostile))
    assert growth < 100 * 2**20, f"RSS grew by {growth / 2**20:.0f} MiB"
    for outcome in outcomes:
        assert_arrow_error(outcome, 0)


@functools.lru_cache(maxsize=2)
def zeros_payload(codec: str, n: int) -> bytes:
    return ref.encode_payload(np.zeros(n, np.float32), "compact", codec)


@pytest.mark.parametrize("codec", CODECS)
def test_legit_large_batch_is_refused_by_rows_before_decompressing(impl: ModuleType, codec):
    """A real 64M-value payload of zeros (kilobytes compressed) sent to a receiver that
    accepts 1000 values: refused by its rows, nothing decompressed."""
    n = BOMB_BYTES // 4
    payload = zeros_payload(codec, n)
    assert len(payload) < 2 * 2**20
    s = session(impl, max_gradient_len=1000)
    outcomes, growth = with_rss_growth(lambda: decode_both_ways(s, payload))
    assert growth < 100 * 2**20, f"RSS grew by {growth / 2**20:.0f} MiB"
    for outcome in outcomes:
        assert_arrow_error(outcome, 0, ROWS_MESSAGE.format(rows=n, room=1000))


@pytest.mark.parametrize("codec", CODECS)
def test_declared_length_bound_is_eight_bytes_a_row(impl: ModuleType, codec: str):
    """L == 8 * rows passes the bound (a buffer larger than its column needs is valid
    Arrow); 8 * rows + 1 does not."""
    payload = compressed_payload(codec, "compact", 1000, "sparse")
    batch = the_batch(payload)
    i = value_buffer(batch)
    values = np.concatenate([sparse(1000), np.ones(1000, np.float32)])
    ok = (8000).to_bytes(8, "little") + pa.compress(values, codec=codec, asbytes=True)
    s = session(impl)
    for outcome in decode_both_ways(s, rebuild(payload, with_buffer(batch, i, ok))):
        assert_bit_equal(outcome, sparse(1000))
    over = bytes(values.view(np.uint8)) + b"\0"
    too_big = (8001).to_bytes(8, "little") + pa.compress(over, codec=codec, asbytes=True)
    for outcome in decode_both_ways(s, rebuild(payload, with_buffer(batch, i, too_big))):
        assert_arrow_error(
            outcome,
            0,
            "compressed IPC buffer declares 8001 bytes uncompressed, more than its 1000-row "
            "batch can hold",
        )


@pytest.mark.parametrize("codec", ["lz4", "zstd"])
def test_declared_lengths_together_are_bounded_by_sixteen_bytes_a_row(impl: ModuleType, codec: str):
    """Each buffer within 8 bytes a row is not enough: a schema of many columns must not
    multiply what a batch can make a reader allocate. All buffers together may declare 16
    bytes a row (a seed float64 batch needs 12): here the seed layout's two data buffers at
    8 bytes a row each pass, and 8 more bytes (in the value column's validity buffer) do
    not."""
    payload = compressed_payload(codec, "seed", 1000, "sparse")
    batch = the_batch(payload)
    i = value_buffer(batch)
    j = i - 2  # the index column's data buffer (validity, data, validity, data)
    padded = np.concatenate([sparse(1000), np.zeros(1000, np.float32)])
    big = (8000).to_bytes(8, "little") + pa.compress(padded, codec=codec, asbytes=True)
    index = np.concatenate([np.arange(1000, dtype=np.int32), np.zeros(1000, np.int32)])
    big_index = (8000).to_bytes(8, "little") + pa.compress(index, codec=codec, asbytes=True)
    at_bound = with_buffer(with_buffer(batch, i, big), j, big_index)
    for outcome in decode_both_ways(session(impl), rebuild(payload, at_bound)):
        assert_bit_equal(outcome, sparse(1000))
    validity = (8).to_bytes(8, "little") + pa.compress(b"\xff" * 8, codec=codec, asbytes=True)
    hostile = with_buffer(at_bound, i - 1, validity)
    for outcome in decode_both_ways(session(impl), rebuild(payload, hostile)):
        assert_arrow_error(
            outcome,
            0,
            "compressed IPC buffers declare 16008 bytes uncompressed in all, more than their "
            "1000-row batch can hold",
        )


@pytest.mark.parametrize("declared", [-2, -(2**63)])
def test_negative_declared_length_other_than_minus_one_is_refused(impl: ModuleType, declared):
    payload = compressed_payload("zstd", "compact", 100)
    batch = the_batch(payload)
    i = value_buffer(batch)
    o, n = batch.buffers[i]
    data = declared.to_bytes(8, "little", signed=True) + batch.body[o + 8 : o + n]
    for outcome in decode_both_ways(session(impl), rebuild(payload, with_buffer(batch, i, data))):
        assert_arrow_error(
            outcome,
            0,
            f"compressed IPC buffer declares {declared} bytes uncompressed, more than its "
            "100-row batch can hold",
        )


@pytest.mark.parametrize("codec", CODECS)
def test_buffer_stored_uncompressed_is_read(impl: ModuleType, codec: str):
    """A declared length of -1: the bytes after the prefix are the buffer as it is (what
    writers do when compression does not pay)."""
    payload = compressed_payload(codec, "seed", 300)
    batch = the_batch(payload)
    raw = np.arange(300, dtype=np.int32).tobytes(), special(300).tobytes()
    batch = with_buffer(batch, 1, (-1).to_bytes(8, "little", signed=True) + raw[0])
    batch = with_buffer(batch, 3, (-1).to_bytes(8, "little", signed=True) + raw[1])
    for outcome in decode_both_ways(session(impl), rebuild(payload, batch)):
        assert_bit_equal(outcome, special(300))


@pytest.mark.parametrize("length", [1, 5, 7])
@pytest.mark.parametrize("codec", CODECS)
def test_short_buffer_without_length_prefix(impl: ModuleType, codec: str, length: int):
    payload = compressed_payload(codec, "compact", 100)
    batch = the_batch(payload)
    hostile = rebuild(payload, with_buffer(batch, value_buffer(batch), b"\x01" * length))
    for outcome in decode_both_ways(session(impl), hostile):
        assert_arrow_error(
            outcome, 0, f"compressed IPC buffer of {length} bytes has no length prefix"
        )


@pytest.mark.parametrize("codec_id", [2, 3, 127, -1, -128])
def test_unknown_codec(impl: ModuleType, codec_id: int):
    # The codec is a flatbuffer `byte` (int8): 0xFF is -1.
    payload = compressed_payload("zstd", "seed", 100)
    batch = the_batch(payload)._replace(compression=(codec_id, 0))
    for outcome in decode_both_ways(session(impl), rebuild(payload, batch)):
        assert_arrow_error(outcome, 0, f"unknown IPC compression codec {codec_id}")


@pytest.mark.parametrize("method", [1, 2, -1])
def test_unknown_method(impl: ModuleType, method: int):
    payload = compressed_payload("lz4", "seed", 100)
    batch = the_batch(payload)._replace(compression=(0, method))
    for outcome in decode_both_ways(session(impl), rebuild(payload, batch)):
        assert_arrow_error(outcome, 0, f"unknown IPC compression method {method}")


def test_check_order(impl: ModuleType):
    """Several faults in one batch: the codec, then the method (they say how to read the
    buffers at all), then the rows, then each buffer; the first fault found is named."""
    payload = compressed_payload("zstd", "compact", 2000, "sparse")
    batch = the_batch(payload)
    short = with_buffer(batch, value_buffer(batch), b"\x01" * 5)
    rx = session(impl, max_gradient_len=1000)
    cases = [
        (short._replace(compression=(5, 3)), "unknown IPC compression codec 5"),
        (short._replace(compression=(1, 3)), "unknown IPC compression method 3"),
        (short, ROWS_MESSAGE.format(rows=2000, room=1000)),
    ]
    for hostile, detail in cases:
        for outcome in decode_both_ways(rx, rebuild(payload, hostile)):
            assert_arrow_error(outcome, 0, detail)


def ipc_file(batches: list[np.ndarray], codec: str, legacy: bool = False) -> bytes:
    """A compact-layout payload of several record batches, written by pyarrow."""
    schema = ref.COMPACT_SCHEMA
    options = pa.ipc.IpcWriteOptions(compression=codec, use_legacy_format=legacy)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, schema, options=options) as writer:
        for values in batches:
            writer.write_batch(pa.record_batch([pa.array(values)], schema=schema))
    return sink.getvalue().to_pybytes()


def test_every_batch_of_a_payload_is_checked(impl: ModuleType):
    """Each batch's rows are held to the room left: the room before the chunk, less the
    rows of the compressed batches before it in the same payload (so that many batches
    cannot multiply what one payload makes a reader allocate)."""
    first, second = sparse(600), special(600)
    payload = ipc_file([first, second], "lz4")
    both = np.concatenate([first, second])
    for outcome in decode_both_ways(session(impl), payload):
        assert_bit_equal(outcome, both)
    for outcome in decode_both_ways(session(impl, max_gradient_len=1000), payload):
        assert_arrow_error(outcome, 0, ROWS_MESSAGE.format(rows=600, room=400))
    for outcome in decode_both_ways(session(impl, max_gradient_len=1200), payload):
        assert_bit_equal(outcome, both)
    for outcome in decode_both_ways(session(impl, max_gradient_len=599), payload):
        assert_arrow_error(outcome, 0, ROWS_MESSAGE.format(rows=600, room=599))
    # A hostile second batch is found too.
    bad = ipc_file([sparse(10), sparse(700)], "zstd")
    for outcome in decode_both_ways(session(impl, max_gradient_len=650), bad):
        assert_arrow_error(outcome, 0, ROWS_MESSAGE.format(rows=700, room=640))


def test_legacy_message_framing_is_checked(impl: ModuleType):
    """Messages written without the continuation marker (before Arrow 0.15) are read,
    and checked, too."""
    payload = ipc_file([sparse(1000)], "zstd", legacy=True)
    (block,) = footer_blocks(payload)
    assert payload[block.offset : block.offset + 4] != b"\xff\xff\xff\xff"
    for outcome in decode_both_ways(session(impl), payload):
        assert_bit_equal(outcome, sparse(1000))
    for outcome in decode_both_ways(session(impl, max_gradient_len=500), payload):
        assert_arrow_error(outcome, 0, ROWS_MESSAGE.format(rows=1000, room=500))


def test_codec_mislabelled_but_known_is_a_reader_error(impl: ModuleType):
    """An LZ4 body labelled ZSTD passes the checks; the decompressor then refuses it."""
    payload = compressed_payload("lz4", "compact", 100)
    batch = the_batch(payload)._replace(compression=(1, 0))
    for outcome in decode_both_ways(session(impl), rebuild(payload, batch)):
        assert_arrow_error(outcome, 0)


def test_uncompressed_receiver_limits_are_unchanged(impl: ModuleType):
    """The checks apply to compressed batches only: an uncompressed payload of 2000 values
    still meets max_gradient_len as before (FrameError after decoding, frames only)."""
    payload = ref.encode_payload(sparse(2000), "compact")
    rx = session(impl, max_gradient_len=1000)
    chunks_outcome, frames_outcome = decode_both_ways(rx, payload)
    assert_bit_equal(chunks_outcome, sparse(2000))
    assert isinstance(frames_outcome, FrameError)
    assert "gradient exceeds max_gradient_len 1000" in frames_outcome.detail


# --------------------------------------------------------------------------- differential


def native_or_skip() -> ModuleType:
    return module("native")


try:
    importlib.import_module("gradstream._native")
    NATIVE_BUILT = True
except ImportError:
    NATIVE_BUILT = False
needs_native = pytest.mark.skipif(not NATIVE_BUILT, reason="native extension not built")


def gradients() -> st.SearchStrategy[np.ndarray]:
    """Gradients of 0..3000 values: raw bit patterns, special values, or mostly zeros."""

    @st.composite
    def build(draw: st.DrawFn) -> np.ndarray:
        n = draw(st.one_of(st.sampled_from([0, 1, 63, 64, 65]), st.integers(0, 3000)))
        seed = draw(st.integers(0, 2**32 - 1))
        kind = draw(st.sampled_from(["bits", "special", "zeros", "sparse"]))
        rng = np.random.default_rng(seed)
        words = rng.integers(0, 2**32, n, dtype=np.uint32)
        if kind == "special":
            words = rng.choice(SPECIAL_BITS, n)
        elif kind == "zeros":
            words[:] = 0
        elif kind == "sparse":
            words[rng.random(n) < 0.95] = 0
        return np.ascontiguousarray(words, dtype=np.uint32).view(np.float32)

    return build()


@needs_native
@settings(max_examples=examples(60), deadline=None, suppress_health_check=FIXTURE_OK)
@given(
    grad=gradients(),
    codec=st.sampled_from(CODECS),
    layout=st.sampled_from(LAYOUTS),
    chunk_size=st.sampled_from([1, 7, 64, 1000, 4096]),
)
def test_differential_round_trip(grad: np.ndarray, codec: str, layout: str, chunk_size: int):
    native = native_or_skip()
    impls = {"native": native, "reference": ref}
    event(f"{codec} {layout}")
    for src, mod in impls.items():
        s = mod.GradientStreamSession("d", chunk_size, layout=layout, compression=codec)
        wire = s.encode_frames(grad)
        chunks = s.encode_gradient(grad)
        for c in chunks:
            assert c.checksum == zlib.crc32(c.arrow_ipc_bytes)
        for dst, other in impls.items():
            rx = other.GradientStreamSession("r", 3)
            assert_bit_equal(rx.decode_frames(wire), grad, f"{src} -> {dst} frames")
            assert_bit_equal(rx.decode_chunks(chunks), grad, f"{src} -> {dst} chunks")


# CRC-valid mutations of compressed payloads. Both implementations must give the same
# exception class and chunk_index (and, for FrameError, the same detail and offset). When
# one accepts what the other's Arrow library refuses (a flipped bit in padding or in
# metadata that one reader tolerates), the refusal must be ArrowIpcError on that chunk
# and the acceptance must hold the chunk's value count; these are counted and reported.
DISAGREEMENTS: Counter[str] = Counter()


@pytest.fixture(scope="module", autouse=True)
def _report_disagreements() -> Iterator[None]:
    yield
    if DISAGREEMENTS:
        lines = "\n".join(f"  {n:4d} x {what}" for what, n in DISAGREEMENTS.most_common())
        warnings.warn(
            "native and reference disagreed on CRC-valid mutated compressed payloads "
            f"(allowed, recorded only):\n{lines}",
            stacklevel=1,
        )


def outcome_of(call: Callable[[], Any], who: str) -> Any:
    try:
        out = call()
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # a Rust panic derives from BaseException
        if type(exc) not in ERROR_CLASSES:
            raise AssertionError(f"{who} let {type(exc).__qualname__} escape: {exc!r}") from exc
        return exc
    assert isinstance(out, np.ndarray) and out.dtype == np.float32, who
    return out


def describe(outcome: Any) -> str:
    if isinstance(outcome, np.ndarray):
        return f"array of {len(outcome)} float32"
    return f"{type(outcome).__name__}({vars(outcome)})"


INTERESTING_PREFIXES = [-1, 0, 1, 2**40, 2**63 - 1, -2]


class Mutated(NamedTuple):
    frames: list[tuple[int, int, int, bytes]]  # (chunk_index, total_chunks, crc, payload)
    k: int  # the chunk whose payload was mutated (its CRC recomputed)
    original: bytes  # that payload before the mutation
    what: str

    def __repr__(self) -> str:  # payloads are hundreds of bytes: keep reports short
        return f"Mutated({self.what!r})"


@st.composite
def mutated(draw: st.DrawFn) -> Mutated:
    """A compressed gradient's frames with one payload mutated and its CRC recomputed."""
    n = draw(st.integers(0, 300))
    chunk_size = draw(st.sampled_from([50, 128, 1000]))
    codec = draw(st.sampled_from(CODECS))
    layout = draw(st.sampled_from(LAYOUTS))
    source = draw(st.sampled_from(["native", "reference"]))
    grad = sparse(n, seed=draw(st.integers(0, 1000)))
    mod = native_or_skip() if source == "native" else ref
    s = mod.GradientStreamSession("m", chunk_size, layout=layout, compression=codec)
    frames = split_frames(s.encode_frames(grad))
    k = draw(st.integers(0, len(frames) - 1))
    index, total, _, payload = frames[k]
    data = bytearray(payload)
    kind = draw(st.sampled_from(["flip", "flip", "prefix", "field", "truncate", "append"]))
    what = f"{source} {codec} {layout}, {n} values by {chunk_size}, chunk {k}: "
    if kind == "flip":
        flips = draw(st.lists(st.integers(0, 8 * len(data) - 1), min_size=1, max_size=3))
        for bit in flips:
            data[bit // 8] ^= 1 << (bit % 8)
        what += f"flip bits {flips}"
    elif kind in ("prefix", "field"):
        batch = the_batch(payload)
        (block,) = footer_blocks(payload)
        body = block.offset + block.meta_len
        if kind == "prefix" and any(length >= 8 for _, length in batch.buffers):
            o = draw(st.sampled_from([o for o, length in batch.buffers if length >= 8]))
            rows = batch.rows
            value = draw(st.sampled_from([*INTERESTING_PREFIXES, 4 * rows, 8 * rows, 8 * rows + 1]))
            struct.pack_into("<q", data, body + o, value)
            what += f"buffer at {o} declares {value}"
        else:
            field = draw(st.sampled_from(["rows", "codec", "method", "length"]))
            value = draw(st.sampled_from([-1, 0, 1, 2, 7, 8, 2000, 2**31]))
            if field == "rows":
                batch = batch._replace(rows=value)
            elif field == "codec":
                batch = batch._replace(compression=(max(-128, min(value, 127)), 0))
            elif field == "method":
                batch = batch._replace(compression=(CODEC_IDS[codec], max(-128, min(value, 127))))
            elif batch.buffers:
                i = draw(st.integers(0, len(batch.buffers) - 1))
                buffers = list(batch.buffers)
                buffers[i] = (buffers[i][0], value)
                batch = batch._replace(buffers=buffers)
            data = bytearray(rebuild(payload, batch))
            what += f"{field} = {value}"
    elif kind == "truncate":
        cut = draw(st.integers(0, len(data) - 1))
        del data[cut:]
        what += f"truncate at {cut}"
    else:
        extra = draw(st.binary(min_size=1, max_size=16))
        data += extra
        what += f"append {extra!r}"
    frames[k] = (index, total, zlib.crc32(data), bytes(data))
    event(f"mutation: {kind}")
    return Mutated(frames, k, payload, what)


def alone(mod: ModuleType, payload: bytes) -> Any:
    """The outcome of one payload decoded as the only chunk, with no limit in the way."""
    s = mod.GradientStreamSession("a", 7)
    chunk = mod.GradientChunk("a", 0, 1, payload, zlib.crc32(payload))
    return outcome_of(lambda: s.decode_chunks([chunk]), mod.__name__)


def assert_same_error(nat: Any, refo: Any, context: str) -> None:
    assert type(nat) is type(refo), context
    if isinstance(nat, IncompleteStreamError):
        assert (nat.received, nat.total) == (refo.received, refo.total), context
        return
    assert nat.chunk_index == refo.chunk_index, context
    if isinstance(nat, FrameError):
        assert (nat.detail, nat.offset) == (refo.detail, refo.offset), context
    if isinstance(nat, ChecksumMismatchError):
        assert (nat.expected, nat.actual) == (refo.expected, refo.actual), context
    if isinstance(nat, ArrowIpcError):
        new = [e.detail.startswith(("compressed ", "unknown IPC compression")) for e in (nat, refo)]
        for who, by_new in zip(("native", "reference"), new, strict=True):
            event(f"{who} refused by {'the new checks' if by_new else 'another rule'}")
        if all(new):  # the same rules, in the same order: the same words
            assert nat.detail == refo.detail, context


@needs_native
@settings(max_examples=examples(250), deadline=None, suppress_health_check=FIXTURE_OK)
@given(case=mutated(), limit=st.sampled_from([2**30, 300, 120, 60, 1]))
def test_differential_mutated_compressed_payloads(case: Mutated, limit: int):
    """The mutated payload alone first: where the two Arrow readers legitimately differ on
    it, the refusal must be ArrowIpcError and the acceptance must hold the chunk's values
    (then the whole stream may differ too, at that chunk or at a later one: recorded, not
    failed). Otherwise the whole stream must give the same outcome from both."""
    native = native_or_skip()
    frames, k, original, what = case
    note(what)
    payload = frames[k][3]
    by_itself = {"native": alone(native, payload), "reference": alone(ref, payload)}
    verdicts = {name: isinstance(o, np.ndarray) for name, o in by_itself.items()}
    if verdicts["native"] != verdicts["reference"]:
        accepted = "native" if verdicts["native"] else "reference"
        refused = by_itself["reference" if verdicts["native"] else "native"]
        context = f"{what}: alone, only {accepted} accepts; other gave {describe(refused)}"
        assert isinstance(refused, ArrowIpcError) and refused.chunk_index == 0, context
        expected = len(ref.decode_payload(memoryview(original), 0))
        assert len(by_itself[accepted]) == expected, context
        detail = re.sub(r"\b\d+\b", "N", refused.detail)  # group by wording, not numbers
        DISAGREEMENTS[f"only {accepted} accepts; other says: {detail}"] += 1
        event(f"payload alone: only {accepted} accepts")
        return
    if verdicts["native"]:
        assert np.array_equal(bits(by_itself["native"]), bits(by_itself["reference"])), what
    else:
        assert_same_error(by_itself["native"], by_itself["reference"], f"{what} (alone)")
    sessions = {
        name: mod.GradientStreamSession("r", 7, max_gradient_len=limit)
        for name, mod in (("native", native), ("reference", ref))
    }
    wire = b"".join(frame(i, t, p, crc) for i, t, crc, p in frames)
    for method in ("decode_frames", "decode_chunks"):
        outcomes = {}
        for name, s in sessions.items():
            mod = native if name == "native" else ref
            arg: Any = wire
            if method == "decode_chunks":
                arg = [mod.GradientChunk("m", i, t, p, crc) for i, t, crc, p in frames]
            outcomes[name] = outcome_of(functools.partial(getattr(s, method), arg), name)
        nat, refo = outcomes["native"], outcomes["reference"]
        context = f"{method} after {what}: native {describe(nat)}, reference {describe(refo)}"
        event(f"{method}: native {type(nat).__name__}, reference {type(refo).__name__}")
        if isinstance(nat, np.ndarray) or isinstance(refo, np.ndarray):
            assert isinstance(nat, np.ndarray) and isinstance(refo, np.ndarray), context
            assert np.array_equal(bits(nat), bits(refo)), context
        else:
            assert_same_error(nat, refo, context)


def test_a_dictionary_batch_is_refused_before_anything_is_decompressed(impl: ModuleType):
    """A dictionary column beside `value`, its one 100 MB string of zeros compressed to a
    few KB: pyarrow would decode (and decompress) every dictionary batch before any record
    batch, past max_gradient_len's bound. No gradient payload has dictionary batches."""
    size = 100_000_000
    values = pa.array(np.arange(4, dtype=np.float32))
    tags = pa.DictionaryArray.from_arrays(
        pa.array([0, 0, 0, 0], pa.int32()), pa.array([b"\0" * size], pa.binary())
    )
    schema = pa.schema([pa.field("value", pa.float32(), nullable=False), pa.field("d", tags.type)])
    sink = pa.BufferOutputStream()
    options = pa.ipc.IpcWriteOptions(compression="zstd")
    with pa.ipc.new_file(sink, schema, options=options) as writer:
        writer.write_batch(pa.record_batch([values, tags], schema=schema))
    payload = sink.getvalue().to_pybytes()
    assert len(payload) < size // 1000
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for outcome in decode_both_ways(session(impl, max_gradient_len=16), payload):
        assert_arrow_error(
            outcome, 0, "IPC footer lists 1 dictionary batch(es); a gradient payload has none"
        )
    grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert grown_kib < 50 * 1024, f"peak RSS grew {grown_kib} KiB"
