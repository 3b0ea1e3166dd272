"""Streaming over real connections: ``stream_to`` / ``receive_from`` / ``receive_iter``
between the implementations in every combination, in sequences, concurrently, and the
life cycle of what a transfer holds (faults, I/O errors, cancellation and fuzzing are in
the other test_streaming_*.py files).

Every transfer here crosses a real kernel connection (socketpair, TCP on 127.0.0.1, or a
Unix socket under tmp_path), through the socket path (Rust/tokio owns the I/O) or the
asyncio-streams path, between the native module and the reference in every combination.
Each test body runs under ``asyncio.run`` with an overall ``asyncio.timeout``, so a hang
fails the test instead of the run.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
import weakref
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("gradstream._native", reason="native extension not built")

import gradstream as gs
from gradstream.errors import IncompleteStreamError
from support.aio import read_until_eof
from support.impls import PATHS
from support.streams import (
    FAULT_GRAD,
    IMPL_NAMES,
    assert_bit_equal,
    check_socket_intact,
    chunks_of,
    close_writer,
    fds_back_to,
    frames_of,
    gradient,
    need,
    nfd,
    raw_pair,
    run,
    warm_up,
    wrap_receiver,
    wrap_sender,
)

TRANSPORTS = ["socketpair", "tcp", "unix"]


def unix_path(tmp_path: Path) -> str:
    path = str(tmp_path / "g.sock")
    if len(path) > 100:  # sun_path holds 108 bytes
        path = os.path.join(tempfile.mkdtemp(prefix="gs"), "g.sock")
    return path


@dataclass
class Conn:
    """One connection: the sender's end and the receiver's end, each a socket.socket
    (socket path) or an asyncio StreamWriter / StreamReader (streams path)."""

    send_end: Any = None
    recv_end: Any = None
    send_sock: socket.socket | None = None
    recv_sock: socket.socket | None = None
    send_writer: asyncio.StreamWriter | None = None
    recv_writer: asyncio.StreamWriter | None = None
    closers: list[Callable[[], Awaitable[None]]] = field(default_factory=list)

    async def close_sender(self) -> None:
        if self.send_writer is not None:
            await close_writer(self.send_writer)
        if self.send_sock is not None:
            self.send_sock.close()

    async def aclose(self) -> None:
        await self.close_sender()
        if self.recv_writer is not None:
            await close_writer(self.recv_writer)
        if self.recv_sock is not None:
            self.recv_sock.close()
        for closer in self.closers:
            await closer()


async def open_conn(transport: str, send_path: str, recv_path: str, tmp_path: Path) -> Conn:
    """A connected pair over the transport; the receiver is the listening side. TCP and
    Unix streams ends come from asyncio.start_server / start_unix_server and
    open_connection / open_unix_connection; socket ends are in blocking mode."""
    loop = asyncio.get_running_loop()
    conn = Conn()
    if transport == "socketpair":
        a, b = socket.socketpair()
        if send_path == "socket":
            conn.send_end = conn.send_sock = a
        else:
            _, conn.send_writer = await asyncio.open_unix_connection(sock=a)
            conn.send_end = conn.send_writer
        if recv_path == "socket":
            conn.recv_end = conn.recv_sock = b
        else:
            conn.recv_end, conn.recv_writer = await asyncio.open_unix_connection(sock=b)
        return conn

    family = socket.AF_INET if transport == "tcp" else socket.AF_UNIX
    address: Any = ("127.0.0.1", 0) if transport == "tcp" else unix_path(tmp_path)
    accepted: asyncio.Future[tuple[asyncio.StreamReader, asyncio.StreamWriter]]
    accepted = loop.create_future()
    listener: socket.socket | None = None
    if recv_path == "streams":

        def on_client(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            if not accepted.done():
                accepted.set_result((reader, writer))

        if transport == "tcp":
            server = await asyncio.start_server(on_client, *address)
        else:
            server = await asyncio.start_unix_server(on_client, address)
        address = server.sockets[0].getsockname()

        async def close_server() -> None:
            server.close()
            await server.wait_closed()

        conn.closers.append(close_server)
    else:
        listener = socket.socket(family, socket.SOCK_STREAM)
        if transport == "unix":
            with contextlib.suppress(FileNotFoundError):
                os.unlink(address)  # left by the previous connection of the test
        listener.bind(address)
        listener.listen()
        listener.setblocking(False)
        address = listener.getsockname()
    try:
        if send_path == "streams":
            if transport == "tcp":
                _, conn.send_writer = await asyncio.open_connection(*address)
            else:
                _, conn.send_writer = await asyncio.open_unix_connection(address)
            conn.send_end = conn.send_writer
        else:
            sock = socket.socket(family, socket.SOCK_STREAM)
            sock.setblocking(False)
            await loop.sock_connect(sock, address)
            sock.setblocking(True)
            conn.send_end = conn.send_sock = sock
        if listener is not None:
            sock, _ = await loop.sock_accept(listener)
            sock.setblocking(True)
            conn.recv_end = conn.recv_sock = sock
        else:
            conn.recv_end, conn.recv_writer = await accepted
    finally:
        if listener is not None:
            listener.close()
    return conn


@contextlib.asynccontextmanager
async def connection(transport: str, send_path: str, recv_path: str, tmp_path: Path) -> Any:
    conn = await open_conn(transport, send_path, recv_path, tmp_path)
    try:
        yield conn
    finally:
        await conn.aclose()


# --------------------------------------------------------------------------- interop


@pytest.mark.parametrize("recv_path", PATHS)
@pytest.mark.parametrize("send_path", PATHS)
@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("receiver", IMPL_NAMES)
@pytest.mark.parametrize("sender", IMPL_NAMES)
def test_interop_matrix(
    sender: str, receiver: str, transport: str, send_path: str, recv_path: str, tmp_path: Path
) -> None:
    """Every sender x receiver x transport x path gets the gradient back bit for bit, the
    counts right, and each socket back open in its mode."""
    tx_mod, rx_mod = need(sender), need(receiver)
    sizes = [0, 1, 65536, 65537]
    if send_path == recv_path:
        sizes.append(3_000_000)

    async def main() -> None:
        for n in sizes:
            grad = gradient(n, seed=n)
            tx = tx_mod.GradientStreamSession("tx", timeout=10)
            rx = rx_mod.GradientStreamSession("rx", timeout=10)
            sent_progress, recv_progress = tx_mod.TransferProgress(), rx_mod.TransferProgress()
            async with connection(transport, send_path, recv_path, tmp_path) as conn:
                sent, got = await asyncio.gather(
                    tx.stream_to(grad, conn.send_end, progress=sent_progress),
                    rx.receive_from(conn.recv_end, progress=recv_progress),
                )
                for sock in (conn.send_sock, conn.recv_sock):
                    if sock is not None:
                        check_socket_intact(sock)
            total = chunks_of(n)
            assert sent == total
            assert_bit_equal(got, grad)
            wire_len = len(tx.encode_frames(grad))
            assert sent_progress.bytes == recv_progress.bytes == wire_len
            assert sent_progress.chunks == sent_progress.total_chunks == total
            assert recv_progress.chunks == recv_progress.total_chunks == total

    run(main)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("sender", IMPL_NAMES)
def test_bytes_on_the_wire_are_encode_frames(
    sender: str, transport: str, path: str, tmp_path: Path
) -> None:
    """A raw socket peer reads exactly encode_frames(grad), and nothing more."""
    mod = need(sender)
    cases = [(0, 65536), (1, 65536), (65537, 65536), (3_000_000, 65536), (10_001, 1000)]

    async def main() -> None:
        for n, chunk_size in cases:
            grad = gradient(n, seed=7)
            tx = mod.GradientStreamSession("tx", chunk_size, timeout=10)
            async with connection(transport, path, "socket", tmp_path) as conn:
                assert conn.recv_sock is not None
                reading = asyncio.ensure_future(read_until_eof(conn.recv_sock))
                sent = await tx.stream_to(grad, conn.send_end)
                await conn.close_sender()
                wire = await reading
            assert sent == chunks_of(n, chunk_size)
            assert wire == tx.encode_frames(grad)
            assert len(frames_of(wire)) == sent

    run(main)


# --------------------------------------------------------------------------- sequences


@pytest.mark.parametrize(
    ("transport", "path"),
    [("socketpair", "socket"), ("tcp", "streams"), ("tcp", "socket"), ("unix", "streams")],
)
@pytest.mark.parametrize("receiver", IMPL_NAMES)
@pytest.mark.parametrize("sender", IMPL_NAMES)
def test_back_to_back_gradients_then_receive_iter_ends_on_close(
    sender: str, receiver: str, transport: str, path: str, tmp_path: Path
) -> None:
    """Several gradients follow each other on one connection: receive_from reads no byte
    past a gradient's last frame; receive_iter ends when the peer closes; after the close
    receive_from gives an empty array and receive_iter nothing."""
    tx_mod, rx_mod = need(sender), need(receiver)
    grads = [gradient(n, seed=i) for i, n in enumerate([5, 0, 70_000, 1, 65_536, 3, 131_073])]

    async def main() -> None:
        tx = tx_mod.GradientStreamSession("tx", timeout=10)
        rx = rx_mod.GradientStreamSession("rx", timeout=10)
        async with connection(transport, path, path, tmp_path) as conn:

            async def send_all() -> list[int]:
                counts = [await tx.stream_to(g, conn.send_end) for g in grads]
                await conn.close_sender()
                return counts

            sending = asyncio.ensure_future(send_all())
            first = [await rx.receive_from(conn.recv_end) for _ in range(3)]
            rest = [g async for g in rx.receive_iter(conn.recv_end)]
            counts = await sending
            assert counts == [chunks_of(len(g)) for g in grads]
            for got, want in zip(first + rest, grads, strict=True):
                assert_bit_equal(got, want)
            # The peer has closed: nothing more, however often one asks.
            assert_bit_equal(await rx.receive_from(conn.recv_end), gradient(0))
            assert [g async for g in rx.receive_iter(conn.recv_end)] == []
            if conn.recv_sock is not None:
                check_socket_intact(conn.recv_sock)

    run(main)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("receiver", IMPL_NAMES)
def test_receive_iter_raises_on_a_broken_gradient(receiver: str, path: str) -> None:
    """receive_iter yields the complete gradients, then raises what the broken one gives."""
    mod = need(receiver)
    tx = gs.GradientStreamSession("tx", 4)
    good = [gradient(9, seed=1), gradient(4, seed=2)]
    broken = tx.encode_frames(gradient(10, seed=3))
    first_frame = frames_of(broken)[0][1]
    data = b"".join(tx.encode_frames(g) for g in good) + first_frame + b"\x01\x00"

    async def main() -> None:
        peer, ours = socket.socketpair()
        with peer, ours:
            peer.sendall(data)
            peer.close()
            stream, writer = await wrap_receiver(ours, path)
            got = []
            with pytest.raises(IncompleteStreamError) as info:
                async for g in mod.GradientStreamSession("rx", 4).receive_iter(stream):
                    got.append(g)
            assert (info.value.received, info.value.total) == (1, 3)
            assert len(got) == 2
            for a, b in zip(got, good, strict=True):
                assert_bit_equal(a, b)
            if writer is not None:
                await close_writer(writer)

    run(main)


# --------------------------------------------------------------------------- concurrency


def test_many_concurrent_transfers_in_one_loop() -> None:
    """32 native sender/receiver pairs at once (socketpair and TCP, socket and streams
    paths), each with its own gradient, all bit-exact."""
    n_pairs = 32

    async def one(i: int) -> None:
        transport = "tcp" if i % 2 else "socketpair"
        path = "streams" if i % 4 >= 2 else "socket"
        grad = gradient(200_000 + i, seed=100 + i)
        tx = gs.GradientStreamSession(f"tx{i}", 4096 * (1 + i % 5), timeout=20)
        rx = gs.GradientStreamSession(f"rx{i}", timeout=20)
        a, b = await raw_pair(transport)
        send_end, send_writer = await wrap_sender(a, path)
        recv_end, recv_writer = await wrap_receiver(b, "socket" if i % 3 else path)
        try:
            sent, got = await asyncio.gather(
                tx.stream_to(grad, send_end), rx.receive_from(recv_end)
            )
            assert sent == chunks_of(len(grad), tx.chunk_size)
            assert_bit_equal(got, grad)
        finally:
            for w in (send_writer, recv_writer):
                if w is not None:
                    await close_writer(w)
            a.close()
            b.close()

    async def main() -> None:
        await warm_up()
        start = nfd()
        await asyncio.gather(*(one(i) for i in range(n_pairs)))
        await fds_back_to(start)

    run(main, deadline=40)


def test_event_loop_stays_responsive_during_a_big_native_transfer() -> None:
    """A 64M-value (256 MiB) native transfer over a socketpair leaves the event loop
    free: a 10 ms ticker is never late by more than 0.5 s and runs throughout."""
    grad = np.arange(64 * 2**20, dtype=np.float32)

    async def main() -> None:
        s = gs.GradientStreamSession("big", timeout=30)
        gaps: list[float] = []
        stop = asyncio.Event()

        async def ticker() -> None:
            last = time.monotonic()
            while not stop.is_set():
                await asyncio.sleep(0.01)
                now = time.monotonic()
                gaps.append(now - last)
                last = now

        ticking = asyncio.ensure_future(ticker())
        await asyncio.sleep(0.05)
        a, b = socket.socketpair()
        with a, b:
            t0 = time.monotonic()
            sent, got = await asyncio.gather(s.stream_to(grad, a), s.receive_from(b))
            elapsed = time.monotonic() - t0
        stop.set()
        await ticking
        assert sent == 1024
        assert np.array_equal(got, grad)
        del got
        assert max(gaps) < 0.5, f"the loop was blocked for {max(gaps):.3f} s"
        # Ticks during the transfer: about elapsed / 10 ms, allowing heavy noise.
        assert len(gaps) >= 5 + int(0.3 * elapsed / 0.011), (len(gaps), elapsed)

    run(main, deadline=60)


# --------------------------------------------------------------------------- lifecycle


def test_process_exits_cleanly_right_after_a_transfer() -> None:
    """Interpreter shutdown right after a native transfer: exit status 0 (a worker thread
    touching Python during finalization aborts the process with SIGABRT)."""
    script = textwrap.dedent(
        """
        import asyncio, socket
        import numpy as np
        import gradstream as gs

        async def main():
            s = gs.GradientStreamSession("x")
            a, b = socket.socketpair()
            sent, got = await asyncio.gather(s.stream_to(np.ones(10, np.float32), a),
                                             s.receive_from(b))
            a.close()
            assert (await s.receive_from(b)).shape == (0,)

        asyncio.run(main())
        """
    )
    runs = [
        subprocess.Popen([sys.executable, "-c", script], stderr=subprocess.PIPE) for _ in range(6)
    ]
    for proc in runs:
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, (proc.returncode, err.decode(errors="replace"))


def test_a_finished_event_loop_is_released() -> None:
    """asyncio.run(...) with a native transfer, then gc: the loop is freed, and running
    more such loops does not grow the descriptor count."""

    async def main() -> weakref.ref[asyncio.AbstractEventLoop]:
        await warm_up()
        return weakref.ref(asyncio.get_running_loop())

    asyncio.run(main())
    gc.collect()
    before = nfd()
    loops = [asyncio.run(main()) for _ in range(5)]
    gc.collect()
    assert nfd() == before, f"{nfd() - before} descriptors kept by 5 finished loops"
    assert all(r() is None for r in loops), "finished event loops are kept alive"


@pytest.mark.parametrize("impl_name", IMPL_NAMES)
def test_wrong_stream_type_is_a_type_error(impl_name: str) -> None:
    mod = need(impl_name)
    s = mod.GradientStreamSession("s")

    async def main() -> None:
        with pytest.raises(TypeError):
            await s.stream_to(FAULT_GRAD, object())
        with pytest.raises(TypeError):
            await s.receive_from("not a stream")

    run(main)
