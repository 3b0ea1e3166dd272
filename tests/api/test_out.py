"""Caller-provided buffers on the way in: ``decode_frames(out=)`` and
``receive_from(out=)``, against both implementations (encode_frames(out=) and frames_len
are in test_out_encode.py).

Every test takes the ``impl`` fixture (tests/conftest.py). A decode into ``out`` returns
``out`` itself, bit for bit, in its own shape, or raises ``GradientSizeError`` when the
gradient does not have ``out.size`` values: as soon as the chunk that runs over is decoded
(values counted in arrival order, after the ``max_gradient_len`` FrameError), or, for a
gradient that comes up short, once every other rule has passed.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import socket
from types import ModuleType
from typing import Any

import numpy as np
import pytest

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
from support.impls import LAYOUTS, PATHS, session
from support.outputs import frames_of, ramp, sentinel_out
from support.values import float32_bits as bits
from support.values import special


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
    # float16, float64 and bfloat16 are dtypes gradstream moves (tests/dtypes/).
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
