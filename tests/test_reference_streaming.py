"""The reference's streaming API (README "Streaming"): stream_to, receive_from and
receive_iter over sockets (socketpair, TCP on 127.0.0.1, AF_UNIX) and asyncio streams.

Plain test functions running their own event loop with asyncio.run (no pytest-asyncio).
Every scenario is bounded by a global deadline so that a bug shows up as a failure, not
as a hung test run.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import shutil
import socket
import struct
import tempfile
import time
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pytest

import gradstream.reference as ref
from gradstream.errors import (
    FrameError,
    GradientStreamError,
    IncompleteStreamError,
    StreamIOError,
    StreamTimeoutError,
)
from support.aio import tcp_socket_pair as tcp_pair
from support.frames import HEADER

T = TypeVar("T")
DEADLINE = 60.0


def run(main: Callable[[], Awaitable[T]]) -> T:
    async def bounded() -> T:
        return await asyncio.wait_for(main(), DEADLINE)

    return asyncio.run(bounded())


def ramp(n: int) -> np.ndarray:
    return np.arange(n, dtype=np.float32) * np.float32(0.25) - np.float32(7.0)


def assert_same_bits(actual: np.ndarray, expected: np.ndarray) -> None:
    assert actual.dtype == np.float32
    assert actual.ndim == 1
    np.testing.assert_array_equal(actual.view(np.uint32), expected.reshape(-1).view(np.uint32))


def frames_of(s: ref.GradientStreamSession, grad: np.ndarray) -> list[bytes]:
    return [
        HEADER.pack(c.chunk_index, c.total_chunks, len(c.arrow_ipc_bytes), c.checksum)
        + c.arrow_ipc_bytes
        for c in s.encode_gradient(grad)
    ]


def recv_all(sock: socket.socket) -> bytes:
    """Everything a blocking socket receives until the peer closes (run in a thread)."""
    parts = []
    while data := sock.recv(1 << 20):
        parts.append(data)
    return b"".join(parts)


# --------------------------------------------------------------------------- connections


@contextlib.contextmanager
def unix_pair() -> Any:
    directory = tempfile.mkdtemp(dir="/tmp" if os.path.isdir("/tmp") else None)
    path = os.path.join(directory, "s")
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server:
            server.bind(path)
            server.listen(1)
            a = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            a.connect(path)
            b, _ = server.accept()
        yield a, b
    finally:
        shutil.rmtree(directory, ignore_errors=True)


class Link:
    """One connection: `tx` goes to stream_to, `rx` to receive_from / receive_iter."""

    def __init__(self, tx: Any, rx: Any, tx_sock: socket.socket | None) -> None:
        self.tx = tx
        self.rx = rx
        self.tx_sock = tx_sock  # the raw socket under tx, when tx is a socket

    async def send_raw(self, data: bytes) -> None:
        """Put bytes on the wire from the tx side, outside gradstream."""
        if isinstance(self.tx, socket.socket):
            await asyncio.to_thread(self.tx.sendall, data)
        else:
            writer = self.tx[1] if isinstance(self.tx, tuple) else self.tx
            writer.write(data)
            await writer.drain()

    async def close_tx(self) -> None:
        if isinstance(self.tx, socket.socket):
            self.tx.close()
        else:
            writer = self.tx[1] if isinstance(self.tx, tuple) else self.tx
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()


KINDS = [
    "socketpair",
    "tcp",
    "unix",
    "streams-tcp",
    "streams-socketpair",
    "socket-to-streams",
    "streams-to-socket",
]
SOCKET_KINDS = ["socketpair", "tcp", "unix"]


@contextlib.asynccontextmanager
async def connect(kind: str) -> AsyncIterator[Link]:
    """A fresh connection of the given kind, closed afterwards."""
    socks: list[socket.socket] = []
    writers: list[asyncio.StreamWriter] = []
    server: asyncio.Server | None = None
    with contextlib.ExitStack() as stack:
        if kind == "unix":
            a, b = stack.enter_context(unix_pair())
        elif kind in ("tcp",):
            a, b = tcp_pair()
        else:
            a, b = socket.socketpair()
        socks += [a, b]
        try:
            if kind in SOCKET_KINDS:
                link = Link(a, b, a)
            elif kind == "streams-tcp":
                a.close()
                b.close()
                accepted: asyncio.Future[tuple[Any, Any]] = (
                    asyncio.get_running_loop().create_future()
                )

                async def on_client(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
                    accepted.set_result((r, w))

                server = await asyncio.start_server(on_client, "127.0.0.1", 0)
                port = server.sockets[0].getsockname()[1]
                r1, w1 = await asyncio.open_connection("127.0.0.1", port)
                r2, w2 = await accepted
                writers += [w1, w2]
                link = Link(w1, (r2, w2), None)  # a writer; a (reader, writer) pair
            elif kind == "streams-socketpair":
                r1, w1 = await asyncio.open_connection(sock=a)
                r2, w2 = await asyncio.open_connection(sock=b)
                writers += [w1, w2]
                link = Link((r1, w1), r2, None)  # a pair; a reader
            elif kind == "socket-to-streams":
                r2, w2 = await asyncio.open_connection(sock=b)
                writers.append(w2)
                link = Link(a, r2, a)
            elif kind == "streams-to-socket":
                r1, w1 = await asyncio.open_connection(sock=a)
                writers.append(w1)
                link = Link(w1, b, None)
            else:
                raise AssertionError(kind)
            yield link
        finally:
            for w in writers:
                w.close()
            for w in writers:
                with contextlib.suppress(Exception):
                    await w.wait_closed()
            if server is not None:
                server.close()
                await server.wait_closed()
            for s in socks:
                s.close()


# --------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("size", [0, 1, 65536, 65537, 3_000_000])
def test_round_trip(kind: str, size: int) -> None:
    s = ref.GradientStreamSession("run-7", timeout=30)
    grad = ramp(size)

    async def main() -> tuple[int, np.ndarray]:
        async with connect(kind) as link:
            sent, got = await asyncio.gather(s.stream_to(grad, link.tx), s.receive_from(link.rx))
            return sent, got

    sent, got = run(main)
    assert sent == max(1, -(-size // 65536))
    assert_same_bits(got, grad)
    assert got.flags.owndata and got.flags.writeable


def test_readme_example() -> None:
    async def main() -> None:
        a, b = socket.socketpair()
        with a, b:
            s = ref.GradientStreamSession("run-7", timeout=30)
            grad = np.ones(10_000_000, np.float32)
            sent, got = await asyncio.gather(s.stream_to(grad, a), s.receive_from(b))
            assert sent == 153 and np.array_equal(got, grad)

    run(main)


@pytest.mark.parametrize("kind", KINDS)
def test_several_gradients_on_one_connection(kind: str) -> None:
    s = ref.GradientStreamSession("s", 1000)
    grads = [ramp(2500), ramp(0), ramp(1), ramp(3000) + 1]

    async def main() -> list[np.ndarray]:
        async with connect(kind) as link:

            async def send_all() -> None:
                for g in grads:
                    await s.stream_to(g, link.tx)

            async def receive_all() -> list[np.ndarray]:
                return [await s.receive_from(link.rx) for _ in grads]

            _, got = await asyncio.gather(send_all(), receive_all())
            return got

    for got, grad in zip(run(main), grads, strict=True):
        assert_same_bits(got, grad)


@pytest.mark.parametrize("kind", KINDS)
def test_receive_iter_ends_when_the_peer_closes(kind: str) -> None:
    s = ref.GradientStreamSession("s", 1000)
    # An empty gradient is a gradient (one empty frame), not the end.
    grads = [ramp(2500), ramp(0), ramp(7)]

    async def main() -> list[np.ndarray]:
        async with connect(kind) as link:

            async def send_all() -> None:
                for g in grads:
                    await s.stream_to(g, link.tx)
                await link.close_tx()

            async def receive_all() -> list[np.ndarray]:
                return [g async for g in s.receive_iter(link.rx)]

            _, got = await asyncio.gather(send_all(), receive_all())
            return got

    got = run(main)
    assert len(got) == len(grads)
    for g, grad in zip(got, grads, strict=True):
        assert_same_bits(g, grad)


@pytest.mark.parametrize("streams", [False, True])
@pytest.mark.parametrize("size", [0, 5, 65537, 3_000_000])
def test_bytes_on_the_wire_are_encode_frames(streams: bool, size: int) -> None:
    s = ref.GradientStreamSession("s", timeout=30)
    grad = ramp(size)

    async def main() -> bytes:
        a, b = socket.socketpair()
        with a, b:
            received = asyncio.ensure_future(asyncio.to_thread(recv_all, b))
            if streams:
                _, w = await asyncio.open_connection(sock=a)
                await s.stream_to(grad, w)
                w.close()
                await w.wait_closed()
            else:
                await s.stream_to(grad, a)
                a.shutdown(socket.SHUT_WR)
            return await received

    assert run(main) == s.encode_frames(grad)


def test_receiver_reads_no_byte_past_the_gradient() -> None:
    s = ref.GradientStreamSession("s", 3)
    wire = s.encode_frames(ramp(10))

    async def main(streams: bool) -> tuple[np.ndarray, bytes]:
        a, b = socket.socketpair()
        with a, b:
            a.sendall(wire + b"next!")
            if streams:
                r, w = await asyncio.open_connection(sock=b)
                got = await s.receive_from(r)
                rest = await r.read(100)
                w.close()
                return got, rest
            got = await s.receive_from(b)
            return got, b.recv(100)

    for streams in (False, True):
        got, rest = run(lambda streams=streams: main(streams))
        assert_same_bits(got, ramp(10))
        assert rest == b"next!"


def test_frames_in_any_order_on_a_stream() -> None:
    s = ref.GradientStreamSession("s", 4)
    frames = frames_of(s, ramp(10))

    async def main() -> np.ndarray:
        a, b = socket.socketpair()
        with a, b:
            a.sendall(frames[2] + frames[0] + frames[1])
            return await s.receive_from(b)

    assert_same_bits(run(main), ramp(10))


def test_full_duplex_on_one_socket_each_way() -> None:
    # Both ends send and receive at once on the same socket: the socket is put back in
    # blocking mode only when the last transfer on it ends.
    s = ref.GradientStreamSession("s", 10_000)
    g1, g2 = ramp(300_000), ramp(250_000) + 3

    async def main() -> tuple[np.ndarray, np.ndarray, float | None, float | None]:
        a, b = socket.socketpair()
        with a, b:
            b.settimeout(7.0)
            _, _, got_at_b, got_at_a = await asyncio.gather(
                s.stream_to(g1, a), s.stream_to(g2, b), s.receive_from(b), s.receive_from(a)
            )
            return got_at_b, got_at_a, a.gettimeout(), b.gettimeout()

    got_at_b, got_at_a, a_mode, b_mode = run(main)
    assert_same_bits(got_at_b, g1)
    assert_same_bits(got_at_a, g2)
    assert (a_mode, b_mode) == (None, 7.0)


@pytest.mark.parametrize("previous", [None, 0.0, 2.5])
def test_blocking_mode_is_restored_after_a_transfer(previous: float | None) -> None:
    s = ref.GradientStreamSession("s")

    async def main() -> tuple[float | None, float | None]:
        a, b = socket.socketpair()
        with a, b:
            a.settimeout(previous)
            b.settimeout(previous)
            await asyncio.gather(s.stream_to(ramp(100_000), a), s.receive_from(b))
            return a.gettimeout(), b.gettimeout()

    assert run(main) == (previous, previous)


def test_socket_mode_between_gradients_of_receive_iter_is_the_callers() -> None:
    s = ref.GradientStreamSession("s")

    async def main() -> list[float | None]:
        a, b = socket.socketpair()
        with a, b:
            a.sendall(s.encode_frames(ramp(3)) * 2)
            a.close()
            modes = []
            async for _ in s.receive_iter(b):
                modes.append(b.gettimeout())
            modes.append(b.gettimeout())
            return modes

    assert run(main) == [None, None, None]


def test_send_without_readiness_callbacks_falls_back_to_sendall(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A loop without add_writer (Windows' proactor): the sender falls back to sock_sendall.
    s = ref.GradientStreamSession("s")
    grad = ramp(3_000_000)

    async def main() -> bytes:
        loop = asyncio.get_running_loop()

        def no_writer(*args: object) -> None:
            raise NotImplementedError

        monkeypatch.setattr(loop, "add_writer", no_writer)
        a, b = socket.socketpair()
        with a, b:
            received = asyncio.ensure_future(asyncio.to_thread(recv_all, b))
            await s.stream_to(grad, a)
            a.shutdown(socket.SHUT_WR)
            return await received

    assert run(main) == s.encode_frames(grad)


# --------------------------------------------------------------------------- progress


def test_progress_counts_bytes_chunks_and_total() -> None:
    s = ref.GradientStreamSession("s", 1000)
    grad = ramp(4500)
    wire = s.encode_frames(grad)

    async def main() -> tuple[ref.TransferProgress, ref.TransferProgress, list[Any]]:
        a, b = socket.socketpair()
        with a, b:
            out, into = ref.TransferProgress(), ref.TransferProgress()
            seen = []

            async def watch() -> None:
                while into.chunks < 5:
                    seen.append((into.bytes, into.chunks, into.total_chunks))
                    await asyncio.sleep(0)

            await asyncio.gather(
                s.stream_to(grad, a, progress=out), s.receive_from(b, progress=into), watch()
            )
            return out, into, seen

    out, into, seen = run(main)
    for p in (out, into):
        assert (p.bytes, p.chunks, p.total_chunks) == (len(wire), 5, 5)
    assert seen == sorted(seen)  # never goes back
    assert "TransferProgress(bytes=" in repr(out)


def test_progress_adds_up_over_transfers_and_receive_iter() -> None:
    s = ref.GradientStreamSession("s", 1000)
    grads = [ramp(2500), ramp(0)]
    wire = b"".join(s.encode_frames(g) for g in grads)

    async def main() -> tuple[ref.TransferProgress, ref.TransferProgress]:
        a, b = socket.socketpair()
        with a, b:
            out, into = ref.TransferProgress(), ref.TransferProgress()

            async def send_all() -> None:
                for g in grads:
                    await s.stream_to(g, a, progress=out)
                a.shutdown(socket.SHUT_WR)

            async def receive_all() -> None:
                async for _ in s.receive_iter(b, progress=into):
                    pass

            await asyncio.gather(send_all(), receive_all())
            return out, into

    for p in run(main):
        assert (p.bytes, p.chunks, p.total_chunks) == (len(wire), 4, 4)


def test_progress_of_a_failed_receive_counts_what_arrived() -> None:
    s = ref.GradientStreamSession("s", 4)
    frames = frames_of(s, ramp(12))

    async def main() -> ref.TransferProgress:
        a, b = socket.socketpair()
        with a, b:
            a.sendall(frames[0] + frames[1][:20])
            a.close()
            p = ref.TransferProgress()
            with pytest.raises(FrameError):
                await s.receive_from(b, progress=p)
            return p

    p = run(main)
    assert (p.bytes, p.chunks, p.total_chunks) == (len(frames[0]) + 20, 1, 3)


def test_progress_must_be_a_reference_transfer_progress() -> None:
    s = ref.GradientStreamSession("s")

    async def main() -> None:
        a, b = socket.socketpair()
        with a, b:
            with pytest.raises(TypeError, match="progress"):
                await s.stream_to(ramp(3), a, progress=object())  # type: ignore[arg-type]
            with pytest.raises(TypeError, match="progress"):
                await s.receive_from(b, progress=5)  # type: ignore[arg-type]

    run(main)


# --------------------------------------------------------------------------- end of stream


def _three_frames() -> tuple[ref.GradientStreamSession, list[bytes]]:
    s = ref.GradientStreamSession("s", 4)
    return s, frames_of(s, ramp(12))


async def _receive_after(
    kind: str, data: bytes, s: ref.GradientStreamSession, *, iterate: bool = False
) -> list[np.ndarray]:
    """Send `data`, close, and receive (receive_from, or everything receive_iter gives)."""
    async with connect(kind) as link:
        await link.send_raw(data)
        await link.close_tx()
        if iterate:
            return [g async for g in s.receive_iter(link.rx)]
        return [await s.receive_from(link.rx)]


EOF_KINDS = ["socketpair", "streams-socketpair", "socket-to-streams"]


@pytest.mark.parametrize("kind", EOF_KINDS)
def test_eof_before_any_byte(kind: str) -> None:
    s, _ = _three_frames()
    (got,) = run(lambda: _receive_after(kind, b"", s))
    assert got.dtype == np.float32 and got.shape == (0,)
    assert run(lambda: _receive_after(kind, b"", s, iterate=True)) == []


@pytest.mark.parametrize("kind", EOF_KINDS)
@pytest.mark.parametrize("iterate", [False, True])
@pytest.mark.parametrize("n", [1, 15])
def test_eof_inside_the_first_header(kind: str, iterate: bool, n: int) -> None:
    s, frames = _three_frames()
    with pytest.raises(FrameError) as info:
        run(lambda: _receive_after(kind, frames[0][:n], s, iterate=iterate))
    assert str(info.value) == f"truncated frame header: {n} of 16 bytes"
    assert (info.value.chunk_index, info.value.offset) == (None, 0)


@pytest.mark.parametrize("kind", EOF_KINDS)
@pytest.mark.parametrize("iterate", [False, True])
@pytest.mark.parametrize("n", [0, 1, 15])
def test_eof_between_frames_or_inside_a_later_header(kind: str, iterate: bool, n: int) -> None:
    s, frames = _three_frames()
    with pytest.raises(IncompleteStreamError) as info:
        run(lambda: _receive_after(kind, frames[0] + frames[1][:n], s, iterate=iterate))
    assert (info.value.received, info.value.total) == (1, 3)


@pytest.mark.parametrize("kind", EOF_KINDS)
@pytest.mark.parametrize("iterate", [False, True])
@pytest.mark.parametrize("m", [0, 1, 100])
def test_eof_inside_a_payload(kind: str, iterate: bool, m: int) -> None:
    s, frames = _three_frames()
    declared = len(frames[1]) - 16
    with pytest.raises(FrameError) as info:
        run(lambda: _receive_after(kind, frames[0] + frames[1][: 16 + m], s, iterate=iterate))
    assert str(info.value) == (
        f"truncated frame: chunk 1 declares a {declared}-byte payload but only {m} bytes follow"
    )
    assert (info.value.chunk_index, info.value.offset) == (1, len(frames[0]))


@pytest.mark.parametrize("kind", EOF_KINDS)
def test_receive_iter_yields_the_complete_gradients_before_a_truncated_one(kind: str) -> None:
    s, frames = _three_frames()
    whole = b"".join(frames)
    got: list[np.ndarray] = []

    async def main() -> None:
        async with connect(kind) as link:
            await link.send_raw(whole + whole + frames[0] + frames[1][:30])
            await link.close_tx()
            async for g in s.receive_iter(link.rx):
                got.append(g)

    with pytest.raises(FrameError) as info:
        run(main)
    assert len(got) == 2
    # Offsets count from where this gradient started, not from the connection's start.
    assert (info.value.chunk_index, info.value.offset) == (1, len(frames[0]))


def test_error_offsets_count_from_where_receive_from_started() -> None:
    s, frames = _three_frames()

    async def main() -> None:
        a, b = socket.socketpair()
        with a, b:
            a.sendall(b"".join(frames) + frames[1] + frames[1])
            assert len(await s.receive_from(b)) == 12
            await s.receive_from(b)

    with pytest.raises(FrameError) as info:
        run(main)
    assert str(info.value) == "duplicate chunk index 1"
    assert (info.value.chunk_index, info.value.offset) == (1, len(frames[1]))


# --------------------------------------------------------------------------- limits on arrival


@pytest.mark.parametrize("kind", EOF_KINDS)
def test_hostile_payload_len_is_refused_from_the_header_while_the_peer_stays(kind: str) -> None:
    s = ref.GradientStreamSession("s")

    async def main() -> None:
        async with connect(kind) as link:
            await link.send_raw(HEADER.pack(0, 1, 0xFFFFFFFF, 0))
            await s.receive_from(link.rx)  # the peer never closes: must not wait

    with pytest.raises(FrameError) as info:
        run(main)
    assert "4294967295-byte payload, above max_payload_len 268435456" in str(info.value)
    assert (info.value.chunk_index, info.value.offset) == (0, 0)


@pytest.mark.parametrize("kind", EOF_KINDS)
def test_hostile_total_chunks_is_refused_at_the_first_frame_while_the_peer_stays(
    kind: str,
) -> None:
    s = ref.GradientStreamSession("s")
    empty = s.encode_gradient(ramp(0))[0].arrow_ipc_bytes
    tiny = HEADER.pack(0, 0xFFFFFFFF, len(empty), zlib.crc32(empty)) + empty

    async def main() -> None:
        async with connect(kind) as link:
            await link.send_raw(tiny)
            await s.receive_from(link.rx)

    with pytest.raises(FrameError) as info:
        run(main)
    assert str(info.value) == "total_chunks 4294967295 above max_gradient_len 1073741824"
    assert (info.value.chunk_index, info.value.offset) == (0, 0)


def test_values_over_max_gradient_len_stop_the_stream_at_that_chunk() -> None:
    sender = ref.GradientStreamSession("s", 4)
    receiver = ref.GradientStreamSession("s", 4, max_gradient_len=10)
    frames = frames_of(sender, ramp(20))

    async def main() -> None:
        a, b = socket.socketpair()
        with a, b:
            # Only the first three of five frames: the third must be refused at once.
            a.sendall(b"".join(frames[:3]))
            await receiver.receive_from(b)

    with pytest.raises(FrameError) as info:
        run(main)
    assert str(info.value) == "gradient exceeds max_gradient_len 10: 12 values by chunk 2"
    assert (info.value.chunk_index, info.value.offset) == (2, len(frames[0]) + len(frames[1]))


def test_stream_errors_match_decode_frames() -> None:
    # The same receiver class makes both: compare them on a few damaged streams.
    s, frames = _three_frames()
    bad_crc = bytearray(frames[1])
    bad_crc[-1] ^= 0xFF
    cases = [
        frames[0] + bytes(bad_crc) + frames[2],
        frames[0] + frames[0],
        frames[0] + HEADER.pack(9, 3, 0, 0),
        frames[0] + HEADER.pack(1, 4, 0, 0),
        frames[0] + frames[1] + HEADER.pack(2, 3, 2, 0) + b"xy",
    ]
    for wire in cases:
        with pytest.raises(GradientStreamError) as expected:
            s.decode_frames(wire)
        with pytest.raises(GradientStreamError) as actual:
            run(lambda wire=wire: _receive_after("socketpair", wire, s))
        assert type(actual.value) is type(expected.value)
        assert actual.value.__reduce__() == expected.value.__reduce__()


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
    s, frames = _three_frames()
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
            if streams:
                _, w = await asyncio.open_connection(sock=a)
                await s.stream_to(grad, w)
                w.close()
                await w.wait_closed()
            else:
                await s.stream_to(grad, a)
                a.shutdown(socket.SHUT_WR)
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
