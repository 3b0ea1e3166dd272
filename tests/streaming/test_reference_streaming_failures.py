"""The reference's streaming API when things go wrong: timeouts, cancellation,
connection errors and bad arguments, over sockets and asyncio streams.

Every scenario is bounded by a global deadline so that a bug shows up as a failure, not
as a hung test run.
"""

from __future__ import annotations

import asyncio
import errno
import socket
import struct
import time
from pathlib import Path

import numpy as np
import pytest

import gradstream.reference as ref
from gradstream.errors import FrameError, GradientStreamError, StreamIOError, StreamTimeoutError
from support.aio import tcp_socket_pair as tcp_pair
from support.links import assert_same_bits, connect, ramp, run, send_then_close, three_frames

# --------------------------------------------------------------------------- timeouts


@pytest.mark.parametrize("kind", ["socketpair", "tcp", "streams-socketpair"])
def test_receive_from_a_silent_peer_times_out(kind: str) -> None:
    s = ref.GradientStreamSession("s", timeout=0.3)

    async def main() -> None:
        async with connect(kind) as link:
            await s.receive_from(link.rx)

    start = time.monotonic()
    with pytest.raises(StreamTimeoutError) as info:
        run(main)
    assert 0.25 < time.monotonic() - start < 5
    e = info.value
    assert (e.timeout, e.received, e.total) == (0.3, 0, None)
    assert isinstance(e, TimeoutError) and isinstance(e, StreamIOError)
    assert isinstance(e, GradientStreamError)
    assert str(e) == "no progress for 0.3 s (after 0 chunks); the peer stalled"


@pytest.mark.parametrize("kind", ["socketpair", "streams-socketpair"])
def test_a_peer_stalling_after_a_frame_times_out_with_the_counts(kind: str) -> None:
    s, frames = three_frames()
    s = ref.GradientStreamSession("s", 4, timeout=0.3)

    async def main() -> None:
        async with connect(kind) as link:
            await link.send_raw(frames[0] + frames[1][:40])
            await s.receive_from(link.rx)

    with pytest.raises(StreamTimeoutError) as info:
        run(main)
    assert (info.value.received, info.value.total) == (1, 3)


@pytest.mark.parametrize("kind", ["socketpair", "tcp", "streams-socketpair", "streams-tcp"])
def test_stream_to_a_peer_that_does_not_read_times_out(kind: str) -> None:
    s = ref.GradientStreamSession("s", timeout=0.3)
    grad = ramp(3_000_000)  # 24 MB: more than any socket buffer

    async def main() -> tuple[ref.TransferProgress, float | None]:
        async with connect(kind) as link:
            p = ref.TransferProgress()
            with pytest.raises(StreamTimeoutError) as info:
                await s.stream_to(grad, link.tx, progress=p)
            assert info.value.total == 46
            assert info.value.received == p.chunks < 46
            mode = link.tx_sock.gettimeout() if link.tx_sock is not None else None
            return p, mode

    p, mode = run(main)
    assert 0 < p.bytes < len(s.encode_frames(grad))
    assert mode is None  # blocking again


def _slow_reader(sock: socket.socket, pause: float, out: list[bytes]) -> None:
    while data := sock.recv(256 * 1024):
        out.append(data)
        time.sleep(pause)


@pytest.mark.parametrize("streams", [False, True])
def test_a_slow_but_moving_reader_is_not_a_stall(streams: bool) -> None:
    # The whole transfer takes several timeouts, but bytes keep moving.
    s = ref.GradientStreamSession("s", timeout=0.3)
    grad = ramp(400_000)  # ~3.2 MB: about 13 reads of 256 KiB, 0.1 s apart

    async def main() -> bytes:
        a, b = socket.socketpair()
        with a, b:
            out: list[bytes] = []
            reader = asyncio.ensure_future(asyncio.to_thread(_slow_reader, b, 0.1, out))
            start = time.monotonic()
            await send_then_close(s, grad, a, streams)
            await reader
            assert time.monotonic() - start > 0.6
            return b"".join(out)

    assert run(main) == s.encode_frames(grad)


def test_a_drain_longer_than_the_timeout_is_not_a_stall_while_bytes_move() -> None:
    # Small socket buffers and a reader taking 4 KiB every 30 ms: the StreamWriter's
    # drain() waits for ~48 KiB to leave its buffer, longer than the 0.2 s timeout, but
    # bytes leave the buffer all along, so this is no stall.
    s = ref.GradientStreamSession("s", 16_384, timeout=0.2)
    grad = ramp(25_000)  # ~200 KB

    async def main() -> bytes:
        a, b = socket.socketpair()
        with a, b:
            a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
            b.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)

            def slow() -> bytes:
                parts = []
                while data := b.recv(4096):
                    parts.append(data)
                    time.sleep(0.03)
                return b"".join(parts)

            reader = asyncio.ensure_future(asyncio.to_thread(slow))
            _, w = await asyncio.open_connection(sock=a)
            await s.stream_to(grad, w)
            w.close()
            await w.wait_closed()
            return await reader

    assert run(main) == s.encode_frames(grad)


def _slow_writer(sock: socket.socket, data: bytes, piece: int, pause: float) -> None:
    for i in range(0, len(data), piece):
        sock.sendall(data[i : i + piece])
        time.sleep(pause)
    sock.shutdown(socket.SHUT_WR)


@pytest.mark.parametrize("streams", [False, True])
def test_a_slow_but_moving_writer_is_not_a_stall(streams: bool) -> None:
    s = ref.GradientStreamSession("s", timeout=0.3)
    grad = ramp(100_000)
    wire = s.encode_frames(grad)

    async def main() -> np.ndarray:
        a, b = socket.socketpair()
        with a, b:
            writer = asyncio.ensure_future(
                asyncio.to_thread(_slow_writer, a, wire, len(wire) // 8 + 1, 0.1)
            )
            if streams:
                r, w = await asyncio.open_connection(sock=b)
                got = await s.receive_from(r)
                w.close()
            else:
                got = await s.receive_from(b)
            await writer
            return got

    assert_same_bits(run(main), grad)


# --------------------------------------------------------------------------- cancellation


@pytest.mark.parametrize("previous", [None, 5.0])
def test_cancelling_a_receive_restores_the_socket(previous: float | None) -> None:
    s = ref.GradientStreamSession("s")

    async def main() -> None:
        a, b = socket.socketpair()
        with a, b:
            b.settimeout(previous)
            a.sendall(s.encode_frames(ramp(10))[:30])  # stalls inside the first payload
            task = asyncio.ensure_future(s.receive_from(b))
            await asyncio.sleep(0.1)
            assert not task.done()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert b.gettimeout() == previous
            assert b.fileno() != -1
            # Still open and usable from Python, in its own mode.
            a.sendall(b"ping")
            b.settimeout(5.0)
            assert b.recv(100)[-4:] == b"ping"

    run(main)


def test_cancelling_a_send_restores_the_socket() -> None:
    s = ref.GradientStreamSession("s")

    async def main() -> None:
        a, b = socket.socketpair()
        with a, b:
            progress = ref.TransferProgress()
            task = asyncio.ensure_future(s.stream_to(ramp(3_000_000), a, progress=progress))
            while progress.bytes == 0:
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.1)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert a.gettimeout() is None
            assert a.fileno() != -1
            assert progress.chunks < 46

    run(main)


def test_wait_for_cancels_a_receive_and_restores_the_socket() -> None:
    s = ref.GradientStreamSession("s")

    async def main() -> None:
        a, b = socket.socketpair()
        with a, b:
            # asyncio.TimeoutError: the builtin TimeoutError from 3.11, its own class in 3.10.
            with pytest.raises(asyncio.TimeoutError) as info:
                await asyncio.wait_for(s.receive_from(b), 0.2)
            # asyncio's own timeout, not the session's.
            assert not isinstance(info.value, StreamTimeoutError)
            assert b.gettimeout() is None and b.fileno() != -1

    run(main)


def test_cancelling_receive_iter_restores_the_socket() -> None:
    s = ref.GradientStreamSession("s")

    async def main() -> None:
        a, b = socket.socketpair()
        with a, b:
            a.sendall(s.encode_frames(ramp(3)))
            got = []

            async def consume() -> None:
                async for g in s.receive_iter(b):
                    got.append(g)

            task = asyncio.ensure_future(consume())
            await asyncio.sleep(0.1)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert len(got) == 1
            assert b.gettimeout() is None and b.fileno() != -1

    run(main)


# --------------------------------------------------------------------------- connection errors


def test_sending_to_a_closed_peer_is_stream_io_error() -> None:
    s = ref.GradientStreamSession("s")

    async def main() -> None:
        a, b = socket.socketpair()
        b.close()
        with a, pytest.raises(StreamIOError) as info:
            await s.stream_to(ramp(100), a)
        assert info.value.errno in (errno.EPIPE, errno.ECONNRESET)
        assert isinstance(info.value, OSError) and isinstance(info.value, GradientStreamError)
        assert isinstance(info.value.__cause__, OSError)
        assert a.gettimeout() is None

    run(main)


def test_sending_on_streams_to_a_closed_peer_is_stream_io_error() -> None:
    s = ref.GradientStreamSession("s", timeout=10)

    async def main() -> None:
        a, b = socket.socketpair()
        with a:
            _, w = await asyncio.open_connection(sock=a)
            b.close()
            with pytest.raises(StreamIOError) as info:
                await s.stream_to(ramp(3_000_000), w)
            assert info.value.errno in (errno.EPIPE, errno.ECONNRESET)
            w.close()

    run(main)


def test_a_reset_connection_is_stream_io_error() -> None:
    s = ref.GradientStreamSession("s", timeout=10)

    async def main() -> None:
        a, b = tcp_pair()
        with a, b:
            a.sendall(s.encode_frames(ramp(10))[:30])
            # SO_LINGER with a zero timeout: close() sends RST instead of FIN.
            a.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            a.close()
            with pytest.raises(StreamIOError) as info:
                await s.receive_from(b)
            assert info.value.errno == errno.ECONNRESET
            assert not isinstance(info.value, StreamTimeoutError)

    run(main)


def test_a_closed_socket_is_stream_io_error() -> None:
    s = ref.GradientStreamSession("s")

    async def main() -> None:
        a, b = socket.socketpair()
        a.close()
        b.close()
        with pytest.raises(StreamIOError) as info:
            await s.stream_to(ramp(3), a)
        assert info.value.errno == errno.EBADF
        with pytest.raises(StreamIOError):
            await s.receive_from(b)

    run(main)


# --------------------------------------------------------------------------- arguments


def test_stream_arguments_are_checked() -> None:
    s = ref.GradientStreamSession("s")

    async def main() -> None:
        with pytest.raises(TypeError, match="stream_to expects"):
            await s.stream_to(ramp(3), "not a stream")
        with pytest.raises(TypeError, match="receive_from and receive_iter expect"):
            await s.receive_from(b"bytes")
        with pytest.raises(TypeError, match="expect"):
            async for _ in s.receive_iter(42):
                pass
        a, b = socket.socketpair()
        with a, b:
            r, w = await asyncio.open_connection(sock=a)
            with pytest.raises(TypeError):
                await s.stream_to(ramp(3), r)  # a reader cannot send
            with pytest.raises(TypeError):
                await s.receive_from(w)  # nor a writer receive
            with pytest.raises(TypeError):
                await s.stream_to(ramp(3), (w, r))  # the pair is (reader, writer)
            w.close()
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
            with pytest.raises(ValueError, match="stream socket"):
                await s.receive_from(udp)
            assert udp.gettimeout() is None
        # A gradient the session refuses raises before the stream is touched.
        a, b = socket.socketpair()
        with a, b:
            with pytest.raises(TypeError, match="float64"):
                await s.stream_to(np.zeros(3), a)
            assert a.gettimeout() is None

    run(main)


def test_chunk_over_max_payload_len_is_refused_before_any_byte() -> None:
    s = ref.GradientStreamSession("s", 1000, max_payload_len=1000)

    async def main() -> None:
        a, b = socket.socketpair()
        with a, b:
            p = ref.TransferProgress()
            with pytest.raises(FrameError, match="would encode to a payload above"):
                await s.stream_to(ramp(5000), a, progress=p)
            assert p.bytes == 0
            b.setblocking(False)
            with pytest.raises(BlockingIOError):
                b.recv(1)

    run(main)


def test_a_fast_peer_does_not_starve_the_loop_or_delay_cancellation(tmp_path: Path) -> None:
    # sock_recv_into returns at once while data is buffered; without a turn for the loop
    # per frame, wait_for could not cancel receive_from until the whole gradient was in.
    # The peer is another process, so bytes keep arriving faster than the reference reads.
    import subprocess
    import sys

    session = ref.GradientStreamSession("fast")
    wire_file = tmp_path / "wire.bin"
    wire_file.write_bytes(session.encode_frames(np.ones(32 * 1024 * 1024, np.float32)))
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    pump = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import socket, sys\n"
            f"s = socket.create_connection(('127.0.0.1', {port}))\n"
            "try:\n"
            f"    s.sendall(open({str(wire_file)!r}, 'rb').read())\n"
            "except OSError:\n"
            "    pass\n",
        ]
    )
    try:
        conn, _ = listener.accept()

        async def main() -> float:
            await asyncio.sleep(0.2)  # the pump is writing at full speed by now
            start = time.perf_counter()
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(session.receive_from(conn), 0.05)
            return time.perf_counter() - start

        with conn:
            assert asyncio.run(main()) < 1.0
    finally:
        listener.close()
        pump.kill()
        pump.wait()
