"""Caller-provided buffers: ``decode_frames(out=)``, ``receive_from(out=)``,
``encode_frames(out=)`` and ``frames_len``, against both implementations.

Every test but the differential one takes the ``impl`` fixture (conftest.py). A decode
into ``out`` returns ``out`` itself, bit for bit, in its own shape, or raises
``GradientSizeError`` when the gradient does not have ``out.size`` values: as soon as the
chunk that runs over is decoded (values counted in arrival order, after the
``max_gradient_len`` FrameError), or, for a gradient that comes up short, once every
other rule has passed. An encode into ``out`` writes exactly ``encode_frames()``'s bytes
at its start and nothing else; ``frames_len(n)`` is their length without any values.
"""

from __future__ import annotations

import asyncio
import contextlib
import pickle
import re
import socket
import subprocess
import sys
import textwrap
from types import ModuleType
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, note, settings
from hypothesis import strategies as st

import gradstream.reference as ref
from gradstream.errors import (
    ArrowIpcError,
    ChecksumMismatchError,
    FrameError,
    GradientSizeError,
    GradientStreamError,
    IncompleteStreamError,
)
from support.aio import run
from support.frames import frame
from support.impls import ERROR_FIELDS, FIXTURE_OK, LAYOUTS, PATHS, session
from support.values import float32_bits as bits
from support.values import special

# --------------------------------------------------------------------------- helpers


def ramp(n: int) -> np.ndarray:
    return np.arange(n, dtype=np.float32) * np.float32(0.5) - np.float32(3.0)


def frames_of(s: Any, grad: np.ndarray) -> list[bytes]:
    return [
        frame(c.chunk_index, c.total_chunks, c.arrow_ipc_bytes, c.checksum)
        for c in s.encode_gradient(grad)
    ]


def sentinel_out(shape: int | tuple[int, ...]) -> np.ndarray:
    """A float32 out= array full of a value no test gradient holds."""
    return np.full(shape, np.float32(-12345.5), dtype=np.float32)


def assert_filled(got: Any, out: np.ndarray, shape: tuple[int, ...], grad: np.ndarray) -> None:
    assert got is out
    assert out.shape == shape
    assert out.dtype == np.float32
    np.testing.assert_array_equal(bits(out), bits(grad))


def assert_size_error(
    info: pytest.ExceptionInfo[GradientSizeError],
    expected: int,
    received: int,
    chunk_index: int | None,
) -> None:
    e = info.value
    assert type(e) is GradientSizeError
    assert isinstance(e, ValueError) and isinstance(e, GradientStreamError)
    assert (e.expected, e.received, e.chunk_index) == (expected, received, chunk_index)
    assert str(e) == str(GradientSizeError(expected, received, chunk_index))


def raw_bytes(buf: Any) -> bytes:
    view = memoryview(buf)
    return view.tobytes() if view.nbytes else b""


def _send_all(sock: socket.socket, data: bytes, close: bool) -> None:
    """The raw peer (in a thread): writes data, then closes or keeps the connection open.
    A receiver that gave up closes its end, which ends a blocked sendall here."""
    with contextlib.suppress(OSError):
        sock.sendall(data)
    if close:
        sock.close()


async def receive_over(
    impl: ModuleType,
    path: str,
    data: bytes,
    *,
    close: bool = True,
    tail: int = 0,
    **kwargs: Any,
) -> tuple[Any, bytes]:
    """receive_from(**kwargs) over a socketpair whose peer writes ``data``: through the
    socket path or asyncio streams. Returns (result or raised exception, the next
    ``tail`` bytes on the connection after receive_from returned)."""
    s = kwargs.pop("s", None) or session(impl)
    a, b = socket.socketpair()
    writer: asyncio.StreamWriter | None = None
    sender = asyncio.ensure_future(asyncio.to_thread(_send_all, a, data, close))
    try:
        if path == "streams":
            reader, writer = await asyncio.open_connection(sock=b)
            stream: Any = reader
        else:
            stream = b
        try:
            result: Any = await s.receive_from(stream, **kwargs)
        except (GradientStreamError, TypeError) as exc:
            result = exc
        rest = b""
        if tail:
            if writer is not None:
                rest = await reader.readexactly(tail)
            else:
                b.setblocking(True)
                b.settimeout(5)
                while len(rest) < tail:
                    rest += b.recv(tail - len(rest))
        return result, rest
    finally:
        if writer is not None:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()
        b.close()
        await sender
        a.close()


# --------------------------------------------------------------------------- decode_frames


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("shape", [(30,), (5, 6), (2, 3, 5), (30, 1), (1, 30)])
def test_decode_frames_fills_out_and_returns_it(impl, layout, shape):
    s = session(impl, 4, layout=layout)
    grad = special(30)
    out = sentinel_out(shape)
    got = s.decode_frames(s.encode_frames(grad), out=out)
    assert_filled(got, out, shape, grad)
    # The values themselves: NaN payloads, -0.0 and subnormals intact.
    assert np.signbit(out.reshape(-1)[4]) and out.reshape(-1)[4] == 0


def test_decode_frames_out_of_order_frames_fill_out_in_index_order(impl):
    s = session(impl, 3)
    grad = special(20)  # chunks of 3,3,3,3,3,3,2 values
    frames = frames_of(s, grad)
    for seed in range(4):
        order = np.random.default_rng(seed).permutation(len(frames))
        out = sentinel_out((4, 5))
        got = s.decode_frames(b"".join(frames[i] for i in order), out=out)
        assert_filled(got, out, (4, 5), grad)
    # Reversed: every chunk but the last arrives before its turn.
    out = sentinel_out(20)
    assert_filled(s.decode_frames(b"".join(reversed(frames)), out=out), out, (20,), grad)


def test_decode_frames_out_chunks_of_a_foreign_chunk_size(impl):
    # The receiver's chunk_size plays no part: chunks of 7 values land in place.
    grad = ramp(50)
    wire = session(impl, 7).encode_frames(grad)
    out = sentinel_out((10, 5))
    assert_filled(session(impl, 1000).decode_frames(wire, out=out), out, (10, 5), grad)


def test_decode_frames_out_accepts_any_bytes_like_input(impl):
    s = session(impl, 4)
    grad = ramp(9)
    wire = s.encode_frames(grad)
    for data in (wire, bytearray(wire), memoryview(wire), np.frombuffer(wire, np.uint8)):
        out = sentinel_out(9)
        assert_filled(s.decode_frames(data, out=out), out, (9,), grad)


def test_decode_frames_out_none_is_a_new_array(impl):
    s = session(impl, 4)
    got = s.decode_frames(s.encode_frames(ramp(9)), out=None)
    assert got.shape == (9,) and got.flags.writeable and got.flags.c_contiguous
    np.testing.assert_array_equal(bits(got), bits(ramp(9)))


def test_decode_frames_out_0d_array_takes_one_value(impl):
    s = session(impl)
    out = np.zeros((), dtype=np.float32)
    got = s.decode_frames(s.encode_frames([2.5]), out=out)
    assert got is out and out.shape == () and out[()] == np.float32(2.5)


def test_decode_frames_out_in_a_slice_of_a_larger_array(impl):
    # A C-contiguous view (a row block) is fine; memory around it is not touched.
    s = session(impl, 4)
    grad = ramp(12)
    base = sentinel_out((5, 4))
    view = base[1:4]
    got = s.decode_frames(s.encode_frames(grad), out=view)
    assert got is view
    np.testing.assert_array_equal(bits(base[1:4]), bits(grad))
    np.testing.assert_array_equal(base[0], sentinel_out(4))
    np.testing.assert_array_equal(base[4], sentinel_out(4))


def _big_endian() -> np.ndarray:
    return np.zeros(3, dtype=np.dtype(np.float32).newbyteorder())


def _misaligned() -> np.ndarray:
    a = np.frombuffer(bytearray(13), dtype=np.float32, offset=1)
    assert not a.flags.aligned and a.flags.writeable and a.flags.c_contiguous
    return a


def _read_only() -> np.ndarray:
    a = np.zeros(3, dtype=np.float32)
    a.flags.writeable = False
    return a


# (factory, pattern the message must match beyond its fixed "out= must be ..." part).
DTYPE_NAME = r"(complex64|<c8|c8)"
BAD_DECODE_OUTS = {
    "list": (lambda: [0.0, 0.0, 0.0], r"\blist\b"),
    "bytearray": (lambda: bytearray(12), r"\bbytearray\b"),
    "memoryview": (lambda: memoryview(np.zeros(3, np.float32)), r"\bmemoryview\b"),
    # float16, float64 and bfloat16 are dtypes gradstream moves (tests/test_dtypes.py).
    "complex64": (lambda: np.zeros(3, np.complex64), DTYPE_NAME),
    "uint16": (lambda: np.zeros(3, np.uint16), r"(uint16|<u2|u2)"),
    "int32": (lambda: np.zeros(3, np.int32), r"(int32|<i4|i4)"),
    "uint8": (lambda: np.zeros(12, np.uint8), r"(uint8|\|u1|u1)"),
    "big-endian": (_big_endian, r"(>f4|big.endian|byte.?order|non-native)"),
    "strided": (lambda: np.zeros(6, np.float32)[::2], r"(non-contiguous|not (C-)?contiguous)"),
    "fortran": (
        lambda: np.zeros((3, 4), np.float32, order="F"),
        r"(non-contiguous|not (C-)?contiguous)",
    ),
    "read-only": (_read_only, r"(read-only|readonly|not writeable|non-writeable)"),
    "misaligned": (_misaligned, r"(misaligned|not aligned|unaligned|alignment)"),
}


@pytest.mark.parametrize("case", list(BAD_DECODE_OUTS))
def test_decode_frames_bad_out_is_type_error_naming_the_problem(impl, case):
    make, pattern = BAD_DECODE_OUTS[case]
    s = session(impl, 4)
    wire = s.encode_frames(ramp(3))
    for data in (wire, b"\x01"):  # b"\x01" would be a FrameError: out= is checked first
        with pytest.raises(TypeError) as info:
            s.decode_frames(data, out=make())
        message = str(info.value)
        assert "out=" in message
        assert re.search(pattern, message), message


def test_decode_frames_out_too_small_raises_at_the_chunk_that_runs_over(impl):
    s = session(impl, 4)
    wire = s.encode_frames(ramp(10))  # chunks of 4, 4, 2: 4, 8, 10 values so far
    for size, received, chunk in [(9, 10, 2), (8, 10, 2), (7, 8, 1), (4, 8, 1), (3, 4, 0)]:
        with pytest.raises(GradientSizeError) as info:
            s.decode_frames(wire, out=sentinel_out(size))
        assert_size_error(info, size, received, chunk)
    with pytest.raises(GradientSizeError) as info:
        s.decode_frames(wire, out=sentinel_out((0, 3)))
    assert_size_error(info, 0, 4, 0)


def test_decode_frames_out_too_small_counts_in_arrival_order(impl):
    s = session(impl, 4)
    frames = frames_of(s, ramp(10))  # 4 + 4 + 2 values
    wire = frames[2] + frames[0] + frames[1]  # 2, 6, 10 values so far
    for size, received, chunk in [(1, 2, 2), (5, 6, 0), (9, 10, 1)]:
        with pytest.raises(GradientSizeError) as info:
            s.decode_frames(wire, out=sentinel_out(size))
        assert_size_error(info, size, received, chunk)


def test_decode_frames_out_too_large_raises_once_the_stream_is_complete(impl):
    s = session(impl, 4)
    frames = frames_of(s, ramp(10))
    for wire in (b"".join(frames), frames[1] + frames[2] + frames[0]):
        for size in (11, 12, 100):
            with pytest.raises(GradientSizeError) as info:
                s.decode_frames(wire, out=sentinel_out(size))
            assert_size_error(info, size, 10, None)


def test_max_gradient_len_frame_error_wins_over_the_size_error(impl):
    s = session(impl, 4, max_gradient_len=9)
    frames = frames_of(s, ramp(10))  # 4, 8, 10 values so far
    wire = b"".join(frames)
    # Chunk 2 passes both out.size 8 and the limit 9: the limit is reported.
    with pytest.raises(FrameError) as info:
        s.decode_frames(wire, out=sentinel_out(8))
    assert str(info.value) == "gradient exceeds max_gradient_len 9: 10 values by chunk 2"
    assert (info.value.chunk_index, info.value.offset) == (2, len(frames[0]) + len(frames[1]))
    # out.size 5 is passed at chunk 1, while the limit is not yet: the size error.
    with pytest.raises(GradientSizeError) as info2:
        s.decode_frames(wire, out=sentinel_out(5))
    assert_size_error(info2, 5, 8, 1)
    # total_chunks above the limit is refused at the first frame, whatever out= is.
    with pytest.raises(FrameError, match=r"^total_chunks 3 above max_gradient_len 2$"):
        session(impl, 4, max_gradient_len=2).decode_frames(wire, out=sentinel_out(0))


def test_checksum_and_payload_errors_come_before_the_size_error(impl):
    s = session(impl, 4)
    chunks = s.encode_gradient(ramp(10))
    bad_crc = frame(0, 3, chunks[0].arrow_ipc_bytes, chunks[0].checksum ^ 1)
    with pytest.raises(ChecksumMismatchError) as info:
        s.decode_frames(bad_crc, out=sentinel_out(0))
    assert info.value.chunk_index == 0
    with pytest.raises(ArrowIpcError) as info2:
        s.decode_frames(frame(1, 3, b"not arrow"), out=sentinel_out(0))
    assert info2.value.chunk_index == 1


def test_incomplete_stream_comes_before_the_short_size_error(impl):
    s = session(impl, 4)
    frames = frames_of(s, ramp(10))  # 3 chunks
    cases = [(frames[0] + frames[1], 2), (frames[2] + frames[0], 2), (frames[0] + frames[1][:7], 1)]
    for wire, received in cases:
        for size in (10, 11, 50):
            with pytest.raises(IncompleteStreamError) as info:
                s.decode_frames(wire, out=sentinel_out(size))
            assert (info.value.received, info.value.total) == (received, 3)
    # Running over is raised at once, before the stream is found incomplete.
    with pytest.raises(GradientSizeError) as info2:
        s.decode_frames(frames[0] + frames[1], out=sentinel_out(7))
    assert_size_error(info2, 7, 8, 1)


def test_truncation_and_left_over_bytes_come_before_the_short_size_error(impl):
    s = session(impl, 4)
    wire = s.encode_frames(ramp(10))
    for size in (10, 11):
        with pytest.raises(FrameError) as info:
            s.decode_frames(wire + b"xyz", out=sentinel_out(size))
        assert str(info.value) == "3 bytes left over after the last chunk"
        assert (info.value.chunk_index, info.value.offset) == (None, len(wire))
        with pytest.raises(FrameError, match=r"^truncated frame: chunk 2 declares"):
            s.decode_frames(wire[:-1], out=sentinel_out(size))
        with pytest.raises(FrameError, match=r"^truncated frame header: 5 of 16 bytes$"):
            s.decode_frames(wire[:5], out=sentinel_out(size))


@pytest.mark.parametrize("shape", [(0,), (0, 4), (3, 0)])
def test_empty_input_fills_an_empty_out(impl, shape):
    s = session(impl)
    out = sentinel_out(shape)
    assert s.decode_frames(b"", out=out) is out
    assert out.shape == shape
    # The empty gradient (one frame of zero values) too.
    assert s.decode_frames(s.encode_frames([]), out=out) is out


@pytest.mark.parametrize("size", [1, 3])
def test_empty_input_into_a_non_empty_out_is_a_size_error(impl, size):
    s = session(impl)
    with pytest.raises(GradientSizeError) as info:
        s.decode_frames(b"", out=sentinel_out(size))
    assert_size_error(info, size, 0, None)
    with pytest.raises(GradientSizeError) as info:
        s.decode_frames(s.encode_frames([]), out=sentinel_out(size))
    assert_size_error(info, size, 0, None)


def test_errors_may_leave_part_of_the_gradient_in_out_but_never_write_past_it(impl):
    s = session(impl, 4)
    base = sentinel_out(12)
    out = base[2:9]  # 7 values: the gradient of 10 runs over at chunk 1
    with pytest.raises(GradientSizeError):
        s.decode_frames(s.encode_frames(ramp(10)), out=out)
    np.testing.assert_array_equal(bits(base[:2]), bits(sentinel_out(2)))
    np.testing.assert_array_equal(bits(base[9:]), bits(sentinel_out(3)))


def test_receive_iter_has_no_out(impl):
    a, b = socket.socketpair()
    with a, b, pytest.raises(TypeError):
        session(impl).receive_iter(b, out=sentinel_out(3))


# --------------------------------------------------------------------------- receive_from


@pytest.mark.parametrize("path", PATHS)
def test_receive_from_fills_out_and_reads_no_further(impl, path):
    s = session(impl, 1024)
    grad = special(30_000)  # 30 chunks, more than a socket buffer holds
    out = sentinel_out((100, 300))
    got, rest = run(
        lambda: receive_over(impl, path, s.encode_frames(grad) + b"next!", tail=5, s=s, out=out)
    )
    assert_filled(got, out, (100, 300), grad)
    assert rest == b"next!"


@pytest.mark.parametrize("path", PATHS)
def test_receive_from_out_of_order_frames_into_out(impl, path):
    s = session(impl, 100)
    grad = special(1050)
    frames = frames_of(s, grad)
    order = np.random.default_rng(7).permutation(len(frames))
    out = sentinel_out((3, 350))
    got, _ = run(lambda: receive_over(impl, path, b"".join(frames[i] for i in order), s=s, out=out))
    assert_filled(got, out, (3, 350), grad)


@pytest.mark.parametrize("path", PATHS)
def test_receive_from_with_stream_to_into_out(impl, path):
    # The impl's own sender on the other end, concurrently, with progress counted.
    s = session(impl, 4096)
    grad = special(50_000)
    out = sentinel_out(50_000)

    async def main() -> tuple[Any, Any]:
        a, b = socket.socketpair()
        with a, b:
            writer = None
            rx: Any = b
            if path == "streams":
                rx, writer = await asyncio.open_connection(sock=b)
            progress = impl.TransferProgress()
            _, got = await asyncio.gather(
                s.stream_to(grad, a), s.receive_from(rx, progress=progress, out=out)
            )
            if writer is not None:
                writer.close()
            return got, progress

    got, progress = run(main)
    assert_filled(got, out, (50_000,), grad)
    assert (progress.chunks, progress.total_chunks) == (13, 13)


@pytest.mark.parametrize("path", PATHS)
def test_receive_from_out_too_small_and_too_large(impl, path):
    s = session(impl, 4)
    frames = frames_of(s, ramp(10))  # 4 + 4 + 2 values
    in_order, shuffled = b"".join(frames), frames[2] + frames[0] + frames[1]
    for wire, size, expected in [
        (in_order, 7, (7, 8, 1)),
        (in_order, 9, (9, 10, 2)),
        (shuffled, 5, (5, 6, 0)),
        (in_order, 11, (11, 10, None)),
        (shuffled, 40, (40, 10, None)),
    ]:
        got, _ = run(
            lambda wire=wire, size=size: receive_over(impl, path, wire, s=s, out=sentinel_out(size))
        )
        assert type(got) is GradientSizeError, got
        assert (got.expected, got.received, got.chunk_index) == expected


@pytest.mark.parametrize("path", PATHS)
def test_receive_from_max_gradient_len_wins_over_the_size_error(impl, path):
    s = session(impl, 4, max_gradient_len=9)
    got, _ = run(
        lambda: receive_over(impl, path, s.encode_frames(ramp(10)), s=s, out=sentinel_out(8))
    )
    assert type(got) is FrameError
    assert str(got) == "gradient exceeds max_gradient_len 9: 10 values by chunk 2"


@pytest.mark.parametrize("path", PATHS)
def test_receive_from_incomplete_comes_before_the_short_size_error(impl, path):
    s = session(impl, 4)
    frames = frames_of(s, ramp(10))
    got, _ = run(lambda: receive_over(impl, path, frames[0] + frames[2], s=s, out=sentinel_out(11)))
    assert type(got) is IncompleteStreamError
    assert (got.received, got.total) == (2, 3)


@pytest.mark.parametrize("path", PATHS)
def test_receive_from_a_peer_closing_before_any_byte(impl, path):
    s = session(impl)
    out = sentinel_out((0, 2))
    got, _ = run(lambda: receive_over(impl, path, b"", s=s, out=out))
    assert got is out and out.shape == (0, 2)
    got, _ = run(lambda: receive_over(impl, path, b"", s=s, out=sentinel_out(5)))
    assert type(got) is GradientSizeError
    assert (got.expected, got.received, got.chunk_index) == (5, 0, None)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("case", ["complex64", "read-only", "strided", "list"])
def test_receive_from_bad_out_is_refused_before_reading(impl, path, case):
    make, pattern = BAD_DECODE_OUTS[case]
    s = session(impl, 4)
    grad = ramp(10)
    wire = s.encode_frames(grad)

    async def main() -> tuple[Any, Any]:
        a, b = socket.socketpair()
        with a, b:
            a.sendall(wire)
            rx: Any = b
            writer = None
            if path == "streams":
                rx, writer = await asyncio.open_connection(sock=b)
            try:
                with pytest.raises(TypeError) as info:
                    await s.receive_from(rx, out=make())
                # Nothing was read: the whole gradient is still there for the next call.
                return info.value, await s.receive_from(rx)
            finally:
                if writer is not None:
                    writer.close()

    error, got = run(main)
    assert "out=" in str(error) and re.search(pattern, str(error)), str(error)
    np.testing.assert_array_equal(bits(got), bits(grad))


# --------------------------------------------------------------------------- encode_frames


BUFFER_KINDS = {
    "bytearray": lambda n: bytearray(b"\xa5" * n),
    "memoryview": lambda n: memoryview(bytearray(b"\xa5" * n)),
    "uint8": lambda n: np.full(n, 0xA5, dtype=np.uint8),
    # Any dtype is raw bytes: float64 rows, rounded up to whole elements.
    "float64-2d": lambda n: (
        np.frombuffer(b"\xa5" * (-(-n // 16) * 16), np.float64).copy().reshape(-1, 2)
    ),
    "float32": lambda n: np.frombuffer(b"\xa5" * (-(-n // 4) * 4), np.float32).copy(),
}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kind", list(BUFFER_KINDS))
@pytest.mark.parametrize("spare", [0, 1, 1000])
def test_encode_frames_out_writes_the_frames_and_leaves_the_rest(impl, layout, kind, spare):
    s = session(impl, 5, layout=layout)
    grad = special(23)
    expected = s.encode_frames(grad)
    out = BUFFER_KINDS[kind](len(expected) + spare)
    before = raw_bytes(out)
    n = s.encode_frames(grad, out=out)
    assert type(n) is int and n == len(expected)
    after = raw_bytes(out)
    assert len(after) == len(before)
    assert after[:n] == expected
    assert after[n:] == before[n:]
    # The written frames decode to the gradient.
    np.testing.assert_array_equal(bits(s.decode_frames(after[:n])), bits(grad))


def test_encode_frames_out_of_the_empty_gradient(impl):
    s = session(impl)
    expected = s.encode_frames([])
    out = bytearray(b"\xa5" * (len(expected) + 3))
    assert s.encode_frames(np.empty(0, np.float32), out=out) == len(expected)
    assert out == expected + b"\xa5" * 3


def test_encode_frames_out_in_a_window_of_a_larger_buffer(impl):
    s = session(impl, 3)
    expected = s.encode_frames(ramp(7))
    backing = bytearray(b"\xa5" * (len(expected) + 20))
    n = s.encode_frames(ramp(7), out=memoryview(backing)[10:])
    assert bytes(backing[:10]) == b"\xa5" * 10
    assert bytes(backing[10 : 10 + n]) == expected
    assert bytes(backing[10 + n :]) == b"\xa5" * 10


def test_encode_frames_out_too_small_is_value_error_naming_both_sizes(impl):
    s = session(impl, 4)
    grad = ramp(10)
    needed = len(s.encode_frames(grad))
    for room in (needed - 1, 17, 0):
        out = bytearray(b"\xa5" * room)
        with pytest.raises(ValueError) as info:
            s.encode_frames(grad, out=out)
        message = str(info.value)
        assert re.search(rf"\b{room}\b", message) and re.search(rf"\b{needed}\b", message)
        assert out == b"\xa5" * room


# (factory, pattern for the message).
BAD_ENCODE_OUTS = {
    "bytes": (lambda: b"\xa5" * 4096, r"(read-only|readonly|not writeable|immutable)"),
    "readonly-memoryview": (
        lambda: memoryview(b"\xa5" * 4096),
        r"(read-only|readonly|not writeable|immutable)",
    ),
    "readonly-numpy": (
        lambda: np.frombuffer(b"\xa5" * 4096, np.uint8),
        r"(read-only|readonly|not writeable|immutable)",
    ),
    "strided-numpy": (
        lambda: np.full(8192, 0xA5, np.uint8)[::2],
        r"(non-contiguous|not (C-)?contiguous)",
    ),
    "strided-memoryview": (
        lambda: memoryview(bytearray(b"\xa5" * 8192))[::2],
        r"(non-contiguous|not (C-)?contiguous)",
    ),
    "fortran-numpy": (
        lambda: np.full((64, 64), 0xA5, np.uint8, order="F"),
        r"(non-contiguous|not (C-)?contiguous)",
    ),
    "list": (lambda: [0] * 4096, r"\blist\b"),
    "str": (lambda: "x" * 4096, r"\bstr\b"),
}


@pytest.mark.parametrize("case", list(BAD_ENCODE_OUTS))
def test_encode_frames_bad_out_is_type_error_and_writes_nothing(impl, case):
    make, pattern = BAD_ENCODE_OUTS[case]
    s = session(impl, 4)
    out = make()
    before = out if isinstance(out, (list, str)) else raw_bytes(out)
    with pytest.raises(TypeError) as info:
        s.encode_frames(ramp(10), out=out)
    assert re.search(pattern, str(info.value)), str(info.value)
    assert "out=" in str(info.value)
    assert (out if isinstance(out, (list, str)) else raw_bytes(out)) == before


def test_encode_frames_out_bytearray_is_not_left_locked(impl):
    # A bytearray lent as out= can be resized after the call, whether it succeeded or not.
    s = session(impl, 4)
    out = bytearray(b"\xa5" * 4096)
    s.encode_frames(ramp(10), out=out)
    out.extend(b"x")
    with pytest.raises(ValueError):
        s.encode_frames(ramp(1000), out=out)
    out.extend(b"x")
    with pytest.raises(TypeError):
        s.encode_frames(np.zeros(3, np.float64), out=out)
    out.extend(b"x")
    assert len(out) == 4099


def test_encode_frames_as_buffer_with_out_is_value_error(impl):
    s = session(impl, 4)
    out = bytearray(b"\xa5" * 4096)
    with pytest.raises(ValueError):
        s.encode_frames(ramp(10), True, out=out)
    with pytest.raises(ValueError):
        s.encode_frames(ramp(10), as_buffer=True, out=out)
    assert out == b"\xa5" * 4096
    # as_buffer=False is the default's value: fine with out.
    assert s.encode_frames(ramp(10), False, out=out) == len(s.encode_frames(ramp(10)))


def test_encode_frames_out_bad_gradient_raises_as_without_out(impl):
    s = session(impl, 4)
    out = bytearray(b"\xa5" * 4096)
    with pytest.raises(TypeError, match="float64"):
        s.encode_frames(np.zeros(3, np.float64), out=out)
    small = session(impl, 100, max_payload_len=500)
    with pytest.raises(FrameError) as without:
        small.encode_frames(ramp(250))
    with pytest.raises(FrameError) as with_out:
        small.encode_frames(ramp(250), out=out)
    assert (with_out.value.detail, with_out.value.chunk_index, with_out.value.offset) == (
        without.value.detail,
        without.value.chunk_index,
        without.value.offset,
    )


def test_encode_frames_out_refuses_an_object_array(impl):
    # Raw bytes over Python object pointers would crash the interpreter; run in a child,
    # so that a crash fails this test rather than the whole run.
    module = impl.__name__
    code = textwrap.dedent(
        f"""
        import numpy as np, {module} as impl
        out = np.empty(4096, dtype=object)
        try:
            impl.GradientStreamSession("s", 4).encode_frames([1.0, 2.0], out=out)
        except TypeError as exc:
            print("TypeError", exc)
        else:
            print("accepted")
        del out
        print("alive")
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("TypeError"), done.stdout
    assert done.stdout.rstrip().endswith("alive")


# --------------------------------------------------------------------------- frames_len


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("chunk_size", [1, 3, 7, 64])
def test_frames_len_is_the_length_of_encode_frames_at_the_edges(impl, layout, chunk_size):
    s = session(impl, chunk_size, layout=layout)
    c = chunk_size
    for n in sorted({0, 1, c - 1, c, c + 1, 2 * c - 1, 2 * c, 2 * c + 1, 5 * c + 3}):
        length = s.frames_len(n)
        assert type(length) is int
        assert length == len(s.encode_frames(ramp(n))), n


@st.composite
def lengths(draw: Any) -> tuple[int, int]:
    """(chunk_size, n): n near multiples of the chunk size, at most 64 chunks."""
    chunk_size = draw(st.one_of(st.integers(0, 16), st.integers(1, 5000)))
    c = max(chunk_size, 1)
    k = draw(st.integers(0, 63))
    n = draw(st.one_of(st.integers(max(0, k * c - 2), k * c + 2), st.integers(0, 64 * c)))
    return chunk_size, n


@settings(max_examples=80, deadline=None, suppress_health_check=FIXTURE_OK)
@given(case=lengths(), layout=st.sampled_from(LAYOUTS))
def test_frames_len_equals_len_encode_frames(impl, case, layout):
    chunk_size, n = case
    s = session(impl, chunk_size, layout=layout)
    assert s.frames_len(n) == len(s.encode_frames(special(n)))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_frames_len_of_huge_gradients_without_values(impl, layout):
    # Frames are independent: n = q*c + r takes q full frames and one of r values. Far
    # beyond what could be encoded here, so frames_len must not touch any value.
    c = 65536
    s = session(impl, c, layout=layout)
    full = s.frames_len(c)
    for q, r in [(1, 0), (1000, 17), (15_000_000, 1), (2**32 - 2, c - 1)]:
        assert s.frames_len(q * c + r) == q * full + (s.frames_len(r) if r else 0)


@pytest.mark.parametrize("bad", [-1, -(2**40)])
def test_frames_len_negative_is_value_error(impl, bad):
    with pytest.raises(ValueError):
        session(impl).frames_len(bad)


@pytest.mark.parametrize("bad", [3.0, "3", None, [3]])
def test_frames_len_non_int_is_type_error(impl, bad):
    with pytest.raises(TypeError):
        session(impl).frames_len(bad)


@pytest.mark.parametrize(
    ("chunk_size", "n", "layout"),
    [(100, 250, "seed"), (100, 100, "seed"), (1000, 300, "seed"), (1000, 140, "compact")],
)
def test_frames_len_refuses_as_encode_frames_does(impl, chunk_size, n, layout):
    s = session(impl, chunk_size, max_payload_len=500, layout=layout)
    with pytest.raises(FrameError) as encoded:
        s.encode_frames(ramp(n))
    with pytest.raises(FrameError) as sized:
        s.frames_len(n)
    fields = ("detail", "chunk_index", "offset")
    assert [getattr(sized.value, f) for f in fields] == [getattr(encoded.value, f) for f in fields]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("n", [10, 25])
def test_frames_len_at_the_exact_payload_limit(impl, layout, n):
    # The limit set at the impl's own payload length for 10 values: accepted there, and
    # refused one byte below (where only the exact length, not a lower bound, can tell).
    exact = len(session(impl, 10, layout=layout).encode_gradient(ramp(10))[0].arrow_ipc_bytes)
    at = session(impl, 10, layout=layout, max_payload_len=exact)
    assert at.frames_len(n) == len(at.encode_frames(ramp(n)))
    below = session(impl, 10, layout=layout, max_payload_len=exact - 1)
    with pytest.raises(FrameError) as encoded:
        below.encode_frames(ramp(n))
    with pytest.raises(FrameError) as sized:
        below.frames_len(n)
    assert (sized.value.detail, sized.value.chunk_index) == (
        encoded.value.detail,
        encoded.value.chunk_index,
    )
    assert sized.value.chunk_index == 0


def test_frames_len_refuses_even_the_empty_gradient_as_encode_frames_does(impl):
    s = session(impl, max_payload_len=16)
    with pytest.raises(FrameError) as encoded:
        s.encode_frames([])
    with pytest.raises(FrameError) as sized:
        s.frames_len(0)
    assert (sized.value.detail, sized.value.chunk_index) == (
        encoded.value.detail,
        encoded.value.chunk_index,
    )


def test_frames_len_refuses_more_chunks_than_a_u32(impl):
    s = session(impl, 1)
    assert s.frames_len(10) > 0
    with pytest.raises(FrameError) as info:
        s.frames_len(2**32)
    assert info.value.offset is None
    # One chunk fewer is countable (and its length is computed without any value).
    assert s.frames_len(2**32 - 1) == (2**32 - 1) * s.frames_len(1)


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize("fields", [(10, 12, 3), (10, 7, None), (0, 0, None), (5, 2**40, 0)])
def test_gradient_size_error_pickles(fields):
    e = GradientSizeError(*fields)
    back = pickle.loads(pickle.dumps(e))
    assert type(back) is GradientSizeError
    assert (back.expected, back.received, back.chunk_index) == fields
    assert str(back) == str(e) and back.args == e.args
    assert isinstance(back, ValueError) and isinstance(back, GradientStreamError)


def test_raised_gradient_size_errors_pickle(impl):
    s = session(impl, 4)
    wire = s.encode_frames(ramp(10))
    for size in (5, 11):
        with pytest.raises(GradientSizeError) as info:
            s.decode_frames(wire, out=sentinel_out(size))
        back = pickle.loads(pickle.dumps(info.value))
        assert type(back) is GradientSizeError
        fields = (back.expected, back.received, back.chunk_index)
        assert fields == (info.value.expected, info.value.received, info.value.chunk_index)
        assert str(back) == str(info.value)


# --------------------------------------------------------------------------- differential


def _outcome(session_: Any, wire: bytes, out: np.ndarray) -> tuple[Any, ...]:
    try:
        got = session_.decode_frames(wire, out=out)
    except (GradientStreamError, TypeError, ValueError) as exc:
        fields = {f: getattr(exc, f) for f in ERROR_FIELDS if hasattr(exc, f)}
        if isinstance(exc, ArrowIpcError):
            # pyarrow and arrow-rs word a broken file differently: the chunk is what counts.
            return (type(exc).__name__, exc.chunk_index)
        return (type(exc).__name__, fields, str(exc))
    assert got is out
    return ("ok", out.shape, bits(out).tobytes())


@st.composite
def out_cases(draw: Any) -> tuple[Any, ...]:
    n = draw(st.integers(0, 120))
    chunk_size = draw(st.integers(1, 16))
    layout = draw(st.sampled_from(LAYOUTS))
    sender = ref.GradientStreamSession("s", chunk_size, layout=layout)
    frames = frames_of(sender, special(n)[::-1].copy())
    order = draw(st.permutations(range(len(frames))))
    frames = [frames[i] for i in order]
    mutation = draw(st.sampled_from(["none", "none", "drop", "cut", "junk", "crc", "repeat"]))
    if mutation == "drop" and len(frames) > 1:
        del frames[draw(st.integers(0, len(frames) - 1))]
    elif mutation == "crc":
        k = draw(st.integers(0, len(frames) - 1))
        frames[k] = frames[k][:12] + b"\x00\x00\x00\x00" + frames[k][16:]
    elif mutation == "repeat":
        frames.append(frames[draw(st.integers(0, len(frames) - 1))])
    wire = b"".join(frames)
    if mutation == "cut":
        wire = wire[: draw(st.integers(0, len(wire)))]
    elif mutation == "junk":
        wire += draw(st.binary(min_size=1, max_size=20))
    size = draw(st.one_of(st.integers(max(0, n - 3), n + 3), st.integers(0, 130), st.just(n)))
    shape: tuple[int, ...] = (size,)
    if size % 2 == 0 and draw(st.booleans()):
        shape = (2, size // 2)
    limit = draw(st.one_of(st.none(), st.integers(1, 130)))
    return n, wire, shape, limit, mutation


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=out_cases())
def test_native_and_reference_agree_on_decodes_into_out(case):
    pytest.importorskip("gradstream._native", reason="native extension not built")
    import gradstream as gs

    n, wire, shape, limit, mutation = case
    note(f"n={n} shape={shape} limit={limit} mutation={mutation} wire={len(wire)} bytes")
    kwargs = {} if limit is None else {"max_gradient_len": limit}
    outcomes = [
        _outcome(mod.GradientStreamSession("r", 8, **kwargs), wire, sentinel_out(shape))
        for mod in (gs, ref)
    ]
    event(outcomes[1][0])
    assert outcomes[0] == outcomes[1]


@pytest.mark.parametrize("view", ["float32", "uint8", "memoryview"])
def test_encode_frames_refuses_an_out_that_overlaps_the_gradient(impl: Any, view: str) -> None:
    # One buffer holding both: writing the frames would overwrite values not yet read.
    s = impl.GradientStreamSession("s", 16)
    g = np.arange(100, dtype=np.float32)
    buf = np.zeros(s.frames_len(100) // 4 + 200, np.float32)
    buf[:100] = g
    out: Any = {"float32": buf, "uint8": buf.view(np.uint8), "memoryview": memoryview(buf)}[view]
    before = buf.copy()
    with pytest.raises(ValueError, match="overlaps the gradient"):
        s.encode_frames(buf[:100], out=out)
    np.testing.assert_array_equal(buf, before)
    # The same bytes in a separate buffer are fine.
    assert s.encode_frames(g, out=bytearray(s.frames_len(100))) == s.frames_len(100)
