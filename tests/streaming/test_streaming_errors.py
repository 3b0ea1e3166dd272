"""Streaming when the connection fails or the caller gives up: I/O errors (resets,
closed sockets) and cancellation, with nothing left behind.

Connections, paths and deadlines as in test_streaming.py (helpers: support/streams.py).
"""

from __future__ import annotations

import asyncio
import errno
import socket
import struct
import time

import pytest

pytest.importorskip("gradstream._native", reason="native extension not built")

import gradstream as gs
from gradstream.errors import GradientStreamError, StreamIOError
from support.aio import tcp_socket_pair
from support.impls import PATHS
from support.streams import (
    FAULT_GRAD,
    IMPL_NAMES,
    WIRE,
    assert_bit_equal,
    check_socket_intact,
    chunks_of,
    close_writer,
    fds_back_to,
    gradient,
    need,
    nfd,
    raw_pair,
    run,
    warm_up,
    wrap_receiver,
    wrap_sender,
)


def reset(sock: socket.socket) -> None:
    """Close with SO_LINGER 0: the peer gets a RST rather than a FIN."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


# --------------------------------------------------------------------------- I/O errors


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("sender", IMPL_NAMES)
def test_peer_reset_during_a_big_send(sender: str, path: str) -> None:
    """The peer resets (SO_LINGER 0) while a 32 MiB gradient is being sent:
    StreamIOError, an OSError with the errno, promptly; the socket stays open."""
    mod = need(sender)
    grad = gradient(8_000_000, seed=8)
    tx = mod.GradientStreamSession("tx", timeout=10)

    async def main() -> None:
        await warm_up()
        start = nfd()
        client, server = tcp_socket_pair()
        stream, writer = await wrap_sender(client, path)

        async def resetter() -> None:
            server.setblocking(False)
            await asyncio.get_running_loop().sock_recv(server, 1000)  # the send has begun
            reset(server)

        resetting = asyncio.ensure_future(resetter())
        t0 = time.monotonic()
        with pytest.raises(StreamIOError) as info:
            await tx.stream_to(grad, stream)
        assert time.monotonic() - t0 < 5
        await resetting
        exc = info.value
        assert isinstance(exc, OSError) and isinstance(exc, GradientStreamError)
        assert exc.errno in (errno.ECONNRESET, errno.EPIPE), exc
        assert exc.strerror
        if writer is None:
            check_socket_intact(client)
        else:
            await close_writer(writer)
        client.close()
        await fds_back_to(start)

    run(main)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("receiver", IMPL_NAMES)
def test_peer_reset_during_a_receive(receiver: str, path: str) -> None:
    """The peer sends part of a gradient, then resets: StreamIOError (ECONNRESET)."""
    mod = need(receiver)
    wire = gs.GradientStreamSession("tx", 1000).encode_frames(gradient(5000, seed=9))

    async def main() -> None:
        await warm_up()
        start = nfd()
        peer, ours = tcp_socket_pair()
        stream, writer = await wrap_receiver(ours, path)
        peer.sendall(wire[: len(wire) // 2])

        async def resetter() -> None:
            await asyncio.sleep(0.1)
            reset(peer)

        resetting = asyncio.ensure_future(resetter())
        with pytest.raises(StreamIOError) as info:
            await mod.GradientStreamSession("rx", 1000, timeout=10).receive_from(stream)
        await resetting
        assert isinstance(info.value, OSError)
        assert info.value.errno == errno.ECONNRESET, info.value
        if writer is None:
            check_socket_intact(ours)
        else:
            await close_writer(writer)
        ours.close()
        await fds_back_to(start)

    run(main)


@pytest.mark.parametrize("transport", ["socketpair", "tcp"])
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("sender", IMPL_NAMES)
def test_sending_to_a_closed_peer(sender: str, path: str, transport: str) -> None:
    """A peer that has closed: StreamIOError with EPIPE or ECONNRESET (over TCP the first
    small send may still be accepted by the kernel before the RST comes back)."""
    mod = need(sender)
    tx = mod.GradientStreamSession("tx", timeout=10)
    grad = gradient(1000, seed=10)

    async def main() -> None:
        peer, ours = await raw_pair(transport)
        peer.close()
        stream, writer = await wrap_sender(ours, path)
        error: StreamIOError | None = None
        for _ in range(5):
            try:
                await tx.stream_to(grad, stream)
            except StreamIOError as exc:
                error = exc
                break
            await asyncio.sleep(0.05)
        assert error is not None, "five sends to a closed peer all succeeded"
        assert isinstance(error, OSError)
        assert error.errno in (errno.EPIPE, errno.ECONNRESET), error
        if writer is None:
            check_socket_intact(ours)
        else:
            await close_writer(writer)
        ours.close()

    run(main)


# --------------------------------------------------------------------------- cancellation


@pytest.mark.parametrize("timeout", [None, 7.5])
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("receiver", IMPL_NAMES)
def test_cancel_a_waiting_receive(receiver: str, path: str, timeout: float | None) -> None:
    """wait_for(receive_from(...), 0.2) on a silent peer: TimeoutError at once; the
    transfer has really stopped (bytes sent afterwards reach Python, not a stray reader),
    the socket is open in its mode, the connection usable, nothing leaked."""
    mod = need(receiver)
    rx = mod.GradientStreamSession("rx", 4)

    async def main() -> None:
        await warm_up()
        start = nfd()
        peer, ours = socket.socketpair()
        ours.settimeout(timeout)
        stream, writer = await wrap_receiver(ours, path)
        t0 = time.monotonic()
        with pytest.raises((TimeoutError, asyncio.CancelledError)):
            await asyncio.wait_for(rx.receive_from(stream), 0.2)
        assert time.monotonic() - t0 < 1.0
        await asyncio.sleep(0.05)
        if writer is None:
            check_socket_intact(ours, timeout)
            peer.sendall(b"ping")
            ours.settimeout(2.0)
            assert ours.recv(4) == b"ping", "a cancelled transfer is still reading"
            ours.settimeout(timeout)
        # Nothing was consumed, so the connection is still in step: a gradient goes.
        peer.sendall(WIRE)
        assert_bit_equal(await rx.receive_from(stream), FAULT_GRAD)
        if writer is None:
            check_socket_intact(ours, timeout)
        peer.close()
        if writer is not None:
            await close_writer(writer)
        ours.close()
        # And a fresh pair works as ever.
        a, b = socket.socketpair()
        with a, b:
            sent, got = await asyncio.gather(
                mod.GradientStreamSession("tx", 4).stream_to(FAULT_GRAD, a), rx.receive_from(b)
            )
        assert sent == 3
        assert_bit_equal(got, FAULT_GRAD)
        await fds_back_to(start)

    run(main)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("sender", IMPL_NAMES)
def test_cancel_a_big_send_in_progress(sender: str, path: str) -> None:
    """task.cancel() on a 64 MiB stream_to blocked on a full socket: CancelledError at
    once; on the socket path no byte is written after the cancellation, the socket is
    open and blocking; nothing leaked."""
    mod = need(sender)
    grad = gradient(16 * 2**20, seed=12)
    tx = mod.GradientStreamSession("tx")

    async def main() -> None:
        await warm_up()
        start = nfd()
        peer, ours = socket.socketpair()
        stream, writer = await wrap_sender(ours, path)
        progress = mod.TransferProgress()
        task = asyncio.ensure_future(tx.stream_to(grad, stream, progress=progress))
        await asyncio.sleep(0.3)
        assert not task.done()
        t0 = time.monotonic()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert time.monotonic() - t0 < 1.0
        assert progress.total_chunks == chunks_of(len(grad))
        assert progress.chunks < progress.total_chunks
        if writer is None:
            check_socket_intact(ours)
            # Drain the peer until it has been quiet for 0.2 s: the cancelled transfer
            # must have stopped writing (it had written at most its current frame more
            # than its progress says).
            wire_len = len(tx.encode_frames(grad[:65536])) * chunks_of(len(grad))
            peer.setblocking(False)
            drained = 0
            quiet_since = time.monotonic()
            deadline = quiet_since + 5.0
            while time.monotonic() - quiet_since < 0.2:
                assert time.monotonic() < deadline, "the cancelled transfer keeps writing"
                try:
                    data = peer.recv(1 << 20)
                except BlockingIOError:
                    await asyncio.sleep(0.01)
                    continue
                drained += len(data)
                quiet_since = time.monotonic()
            assert 0 < drained <= progress.bytes + 2 * 65536 * 4
            assert drained < wire_len
        else:
            await close_writer(writer, abort=True)
        peer.close()
        ours.close()
        await fds_back_to(start)

    run(main)
