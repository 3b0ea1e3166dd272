"""Streaming over real connections: ``stream_to`` / ``receive_from`` / ``receive_iter``.

Every transfer here crosses a real kernel connection (socketpair, TCP on 127.0.0.1, or a
Unix socket under tmp_path), through the socket path (Rust/tokio owns the I/O) or the
asyncio-streams path, between the native module and the reference in every combination.
Hostile and broken peers are plain sockets writing crafted bytes; what they provoke must
be exactly what README "Streaming", "Limits against a hostile or broken peer" and
"Decoding rules" promise, with nothing left behind (descriptors, blocking mode, stray
readers). Each test body runs under ``asyncio.run`` with an overall ``asyncio.timeout``,
so a hang fails the test instead of the run.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import gc
import os
import socket
import struct
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import weakref
import zlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

pytest.importorskip("gradstream._native", reason="native extension not built")

import gradstream as gs
import gradstream.reference as ref
from gradstream.errors import (
    ArrowIpcError,
    ChecksumMismatchError,
    FrameError,
    GradientStreamError,
    IncompleteStreamError,
    StreamIOError,
    StreamTimeoutError,
)
from support.aio import read_until_eof, tcp_socket_pair
from support.frames import HEADER, HEADER_LEN
from support.impls import ERROR_FIELDS, PATHS
from support.memory import proc_status

if sys.version_info < (3, 11):  # pragma: no cover
    pytest.skip("asyncio.timeout needs Python 3.11", allow_module_level=True)

U32_MAX = 0xFFFF_FFFF
IMPLS: dict[str, ModuleType] = {"native": gs, "reference": ref}
IMPL_NAMES = list(IMPLS)
TRANSPORTS = ["socketpair", "tcp", "unix"]
DATA_ERRORS = (ArrowIpcError, ChecksumMismatchError, FrameError, IncompleteStreamError)

# Both native paths bound the time without a byte moving, not a whole frame (the streams
# path once bounded a whole readexactly()/drain(); these tests caught it).
NATIVE_TIMEOUT_PATHS = ["socket", "streams"]


# --------------------------------------------------------------------------- helpers


def has_streaming(mod: ModuleType) -> bool:
    cls = mod.GradientStreamSession
    methods = ("stream_to", "receive_from", "receive_iter")
    return all(hasattr(cls, m) for m in methods) and hasattr(mod, "TransferProgress")


def need(name: str) -> ModuleType:
    """The implementation, or skip while the reference's async methods are not written."""
    mod = IMPLS[name]
    if not has_streaming(mod):
        pytest.skip(f"gradstream.{name} has no streaming methods yet")
    return mod


@lru_cache(maxsize=32)
def gradient(n: int, seed: int = 0) -> np.ndarray:
    """n float32 values drawn as raw bit patterns (NaN payloads, -0.0, subnormals...)."""
    bits = np.random.default_rng(seed).integers(0, 2**32, n, dtype=np.uint32)
    values = bits.view(np.float32)
    values.flags.writeable = False  # shared by the cache: nobody may change it
    return values


def assert_bit_equal(got: Any, want: np.ndarray) -> None:
    assert isinstance(got, np.ndarray)
    assert got.dtype == np.float32 and got.ndim == 1
    assert got.shape == want.shape
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


def chunks_of(n: int, chunk_size: int = 65536) -> int:
    return max(1, -(-n // chunk_size))


def nfd() -> int:
    # Event loops that are gone close their native hub's eventfd when collected: collect
    # first, so that a count is not lowered later by an earlier test's garbage.
    gc.collect()
    return len(os.listdir("/proc/self/fd"))


def start_peak_rss() -> int:
    """Reset the peak RSS (VmHWM) to the current RSS where the kernel allows it; the
    current RSS, to subtract from peak_rss() later."""
    with contextlib.suppress(OSError), open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return proc_status("VmRSS")


def peak_rss() -> int:
    return proc_status("VmHWM")


def frames_of(wire: bytes) -> list[tuple[int, bytes]]:
    """(offset, frame bytes) of each frame of a valid stream."""
    out = []
    pos = 0
    while pos < len(wire):
        length = HEADER_LEN + HEADER.unpack_from(wire, pos)[2]
        out.append((pos, wire[pos : pos + length]))
        pos += length
    return out


def outcome(call: Callable[[], Any]) -> tuple[str, Any]:
    try:
        return "ok", call()
    except GradientStreamError as exc:
        return "err", exc


async def async_outcome(awaitable: Awaitable[Any]) -> tuple[str, Any]:
    try:
        return "ok", await awaitable
    except GradientStreamError as exc:
        return "err", exc


def describe(result: tuple[str, Any]) -> tuple[Any, ...]:
    """A comparable summary: the values' bits, or the error's class, text and fields."""
    kind, value = result
    if kind == "ok":
        return ("ok", value.dtype.str, value.shape, value.view(np.uint32).tobytes())
    fields = tuple(getattr(value, name, "-") for name in ERROR_FIELDS)
    return ("err", type(value), str(value), fields)


def run(main: Callable[[], Awaitable[Any]], *, timeout: float = 20.0) -> Any:
    """asyncio.run(main()) under an overall deadline; any error the loop only logged
    (a never-retrieved exception, a callback that raised) fails the test too."""

    async def guarded() -> tuple[Any, list[dict[str, Any]]]:
        loop = asyncio.get_running_loop()
        logged: list[dict[str, Any]] = []
        loop.set_exception_handler(lambda _loop, context: logged.append(context))
        async with asyncio.timeout(timeout):
            result = await main()
        return result, logged

    result, logged = asyncio.run(guarded())
    assert not logged, f"the event loop logged errors: {logged}"
    return result


async def warm_up() -> None:
    """One native transfer on this loop, so that its one-off resources (tokio runtime,
    the loop's completion hub) exist before a test counts descriptors."""
    a, b = socket.socketpair()
    with a, b:
        a.close()
        got = await gs.GradientStreamSession("warm").receive_from(b)
    assert got.shape == (0,)


async def fds_back_to(start: int, grace: float = 1.0) -> None:
    """Assert the descriptor count returns to start (allowing a short grace period for a
    worker thread to drop its duplicate of a socket)."""
    deadline = time.monotonic() + grace
    while nfd() != start and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    assert nfd() == start, f"{nfd() - start} descriptor(s) left open"


def unix_path(tmp_path: Path) -> str:
    path = str(tmp_path / "g.sock")
    if len(path) > 100:  # sun_path holds 108 bytes
        path = os.path.join(tempfile.mkdtemp(prefix="gs"), "g.sock")
    return path


def reset(sock: socket.socket) -> None:
    """Close with SO_LINGER 0: the peer gets a RST rather than a FIN."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


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


async def close_writer(writer: asyncio.StreamWriter, *, abort: bool = False) -> None:
    """Close (abort: drop what is still buffered, for a peer that will never read it)."""
    if abort:
        writer.transport.abort()
    else:
        writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()


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


async def raw_pair(transport: str) -> tuple[socket.socket, socket.socket]:
    """(peer, ours): two blocking sockets, the peer's to be written by hand."""
    if transport == "tcp":
        return tcp_socket_pair()
    return socket.socketpair()


async def wrap_receiver(sock: socket.socket, path: str) -> tuple[Any, Any]:
    """(the stream receive_from takes, the writer to close or None)."""
    if path == "socket":
        return sock, None
    if sock.family == socket.AF_UNIX:
        reader, writer = await asyncio.open_unix_connection(sock=sock)
    else:
        reader, writer = await asyncio.open_connection(sock=sock)
    return reader, writer


async def wrap_sender(sock: socket.socket, path: str) -> tuple[Any, Any]:
    """(the stream stream_to takes, the writer to close or None)."""
    if path == "socket":
        return sock, None
    if sock.family == socket.AF_UNIX:
        _, writer = await asyncio.open_unix_connection(sock=sock)
    else:
        _, writer = await asyncio.open_connection(sock=sock)
    return writer, writer


def check_socket_intact(sock: socket.socket, timeout: float | None = None) -> None:
    """README: the Python socket is not closed; its blocking mode is put back."""
    assert sock.fileno() != -1, "the transfer closed the caller's socket"
    assert sock.gettimeout() == timeout
    assert sock.getblocking() == (timeout != 0.0)


# --------------------------------------------------------------------------- 1. interop


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


# --------------------------------------------------------------------------- 2. sequences


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


# --------------------------------------------------------------------------- 3. faults

# The stream the fault cases start from: 10 values in chunks of 4, three frames.
FAULT_SESSION = gs.GradientStreamSession("faults", 4)
FAULT_GRAD = gradient(10, seed=11)
WIRE = FAULT_SESSION.encode_frames(FAULT_GRAD)
(OFF0, FRAME0), (OFF1, FRAME1), (OFF2, FRAME2) = frames_of(WIRE)


def with_header(frame: bytes, **fields: int) -> bytes:
    values = dict(zip(("index", "total", "length", "crc"), HEADER.unpack_from(frame), strict=True))
    values.update(fields)
    return (
        HEADER.pack(values["index"], values["total"], values["length"], values["crc"])
        + frame[HEADER_LEN:]
    )


def flip_payload_bit(frame: bytes, at: int) -> bytes:
    out = bytearray(frame)
    out[HEADER_LEN + at] ^= 0x10
    return bytes(out)


def garbage_frame(index: int, total: int) -> bytes:
    payload = b"not an arrow file, but the CRC is right"
    return HEADER.pack(index, total, len(payload), zlib.crc32(payload)) + payload


@dataclass(frozen=True)
class Fault:
    """A peer that writes `data` and then closes (or, with `stall`, stays silent with the
    connection open; with `forever`, keeps writing `data` again and again)."""

    data: bytes
    check: Callable[[tuple[str, Any]], None]
    session: dict[str, Any] = field(default_factory=dict)
    stall: bool = False
    forever: bool = False
    left_over: bytes = b""
    fast: float | None = None  # seconds the receiver may take at most


def expect(
    cls: type[BaseException], *, text: str = "", **fields: Any
) -> Callable[[tuple[str, Any]], None]:
    def check(result: tuple[str, Any]) -> None:
        kind, value = result
        assert kind == "err", f"expected {cls.__name__}, got {value!r}"
        assert type(value) is cls, f"expected {cls.__name__}, got {value!r}"
        assert text in str(value)
        for name, want in fields.items():
            assert getattr(value, name) == want, (name, value)

    return check


def expect_values(want: np.ndarray) -> Callable[[tuple[str, Any]], None]:
    def check(result: tuple[str, Any]) -> None:
        kind, value = result
        assert kind == "ok", f"expected values, got {value!r}"
        assert_bit_equal(value, want)

    return check


FLIPPED = flip_payload_bit(FRAME1, 200)
TINY_FRAMES = gs.GradientStreamSession("tiny", 1).encode_frames(np.ones(1, np.float32))

FAULTS: dict[str, Fault] = {
    "closed-before-any-byte": Fault(b"", expect_values(gradient(0))),
    "complete-then-closed": Fault(WIRE, expect_values(FAULT_GRAD)),
    "bytes-after-the-last-frame-stay-unread": Fault(
        WIRE + b"next", expect_values(FAULT_GRAD), left_over=b"next"
    ),
    "closed-in-first-header": Fault(
        WIRE[:7],
        expect(
            FrameError, text="truncated frame header: 7 of 16 bytes", chunk_index=None, offset=0
        ),
    ),
    "closed-in-later-header": Fault(
        WIRE[: OFF1 + 9], expect(IncompleteStreamError, received=1, total=3)
    ),
    "closed-between-frames": Fault(WIRE[:OFF2], expect(IncompleteStreamError, received=2, total=3)),
    "closed-in-first-payload": Fault(
        WIRE[: OFF0 + HEADER_LEN + 3],
        expect(FrameError, text="truncated frame: chunk 0", chunk_index=0, offset=0),
    ),
    "closed-in-later-payload": Fault(
        WIRE[: OFF1 + HEADER_LEN + 100],
        expect(FrameError, text="truncated frame: chunk 1", chunk_index=1, offset=OFF1),
    ),
    "bit-flipped-in-payload": Fault(
        FRAME0 + FLIPPED + FRAME2,
        expect(
            ChecksumMismatchError,
            text="Checksum mismatch on chunk 1",
            chunk_index=1,
            expected=HEADER.unpack_from(FRAME1)[3],
            actual=zlib.crc32(FLIPPED[HEADER_LEN:]),
        ),
    ),
    "payload-not-arrow": Fault(
        FRAME0 + garbage_frame(1, 3) + FRAME2, expect(ArrowIpcError, chunk_index=1)
    ),
    "duplicate-frame": Fault(
        FRAME0 + FRAME0 + FRAME1 + FRAME2,
        expect(FrameError, text="duplicate chunk index 0", chunk_index=0, offset=len(FRAME0)),
    ),
    "inconsistent-total-chunks": Fault(
        FRAME0 + with_header(FRAME1, total=4) + FRAME2,
        expect(FrameError, text="chunks disagree on total_chunks"),
    ),
    "index-out-of-range": Fault(
        FRAME0 + with_header(FRAME1, index=7) + FRAME2,
        expect(FrameError, text="chunk index 7 out of range", chunk_index=7),
    ),
    "payload-len-above-max-payload-len": Fault(
        HEADER.pack(0, 1, U32_MAX, 0),
        expect(FrameError, text="above max_payload_len 268435456", chunk_index=0, offset=0),
        stall=True,  # the receiver must refuse from the header alone, not wait for 4 GiB
        fast=1.0,
    ),
    "payload-len-one-above-a-small-limit": Fault(
        HEADER.pack(0, 1, 1001, 0),
        expect(FrameError, text="1001-byte payload, above max_payload_len 1000", offset=0),
        session={"max_payload_len": 1000},
        stall=True,
        fast=1.0,
    ),
    "payload-len-at-the-limit-then-closed": Fault(
        HEADER.pack(0, 1, 1000, 0) + b"x" * 10,
        expect(FrameError, text="1000-byte payload but only 10 bytes follow", offset=0),
        session={"max_payload_len": 1000},
    ),
    "total-chunks-above-max-gradient-len": Fault(
        with_header(TINY_FRAMES, total=U32_MAX),
        expect(FrameError, text="total_chunks 4294967295 above max_gradient_len 1073741824"),
        forever=True,
        fast=1.0,
    ),
    "values-above-max-gradient-len": Fault(
        WIRE,
        expect(FrameError, text="gradient exceeds max_gradient_len 6: 8 values by chunk 1"),
        session={"max_gradient_len": 6},
    ),
    "frame-above-small-max-payload-len": Fault(
        WIRE,
        expect(FrameError, text="above max_payload_len 100", chunk_index=0, offset=0),
        session={"max_payload_len": 100},
    ),
    "stalled-in-first-header": Fault(
        WIRE[:7],
        expect(StreamTimeoutError, timeout=0.3, received=0, total=None),
        session={"timeout": 0.3},
        stall=True,
        fast=2.0,
    ),
    "stalled-after-a-frame": Fault(
        WIRE[: OFF1 + 20],
        expect(StreamTimeoutError, timeout=0.3, received=1, total=3),
        session={"timeout": 0.3},
        stall=True,
        fast=2.0,
    ),
}


async def feed(peer: socket.socket, fault: Fault) -> None:
    """Write the fault's bytes from a plain (non-blocking) socket with loop.sock_sendall."""
    loop = asyncio.get_running_loop()
    peer.setblocking(False)
    try:
        await loop.sock_sendall(peer, fault.data)
        while fault.forever:
            await loop.sock_sendall(peer, fault.data)
        if not fault.stall:
            peer.close()
            return
        await asyncio.Event().wait()  # stays silent until cancelled
    except OSError:  # forever: the receiver gave up and closed
        pass


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("receiver", IMPL_NAMES)
@pytest.mark.parametrize("name", list(FAULTS))
def test_broken_or_hostile_peer(receiver: str, path: str, name: str) -> None:
    """A raw socket peer writes crafted bytes; the receiver raises what the README says
    (the same as decode_frames for a closed peer), promptly, and leaves nothing behind:
    descriptors back to their count, the socket open in blocking mode."""
    mod = need(receiver)
    fault = FAULTS[name]
    rx = mod.GradientStreamSession("rx", 4, **fault.session)

    async def main() -> None:
        await warm_up()
        start = nfd()
        peer, ours = socket.socketpair()
        stream, writer = await wrap_receiver(ours, path)
        feeding = asyncio.ensure_future(feed(peer, fault))
        rss_before = start_peak_rss()
        t0 = time.monotonic()
        result = await async_outcome(rx.receive_from(stream))
        elapsed = time.monotonic() - t0
        rss_growth = peak_rss() - rss_before
        feeding.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await feeding
        fault.check(result)
        if isinstance(result[1], StreamTimeoutError):
            assert isinstance(result[1], TimeoutError)
            assert isinstance(result[1], OSError)
        if fault.fast is not None:
            assert elapsed < fault.fast, f"took {elapsed:.2f} s"
        assert rss_growth < 100 * 2**20, f"RSS grew by {rss_growth / 2**20:.0f} MiB"
        if not isinstance(result[1], StreamTimeoutError):
            # Exactly what decode_frames says about the bytes consumed.
            consumed = fault.data[: len(fault.data) - len(fault.left_over)]
            assert describe(result) == describe(outcome(lambda: rx.decode_frames(consumed)))
        if fault.left_over:
            if writer is None:
                ours.settimeout(2.0)
                assert ours.recv(100) == fault.left_over
                ours.settimeout(None)
            else:
                assert await stream.read() == fault.left_over
        if writer is None:
            check_socket_intact(ours)
        peer.close()
        if writer is not None:
            await close_writer(writer)
        ours.close()
        await fds_back_to(start)

    run(main)


@pytest.mark.parametrize("path", NATIVE_TIMEOUT_PATHS)
def test_timeout_counts_time_without_progress_native_receive(path: str) -> None:
    _timeout_counts_time_without_progress_receive("native", path)


@pytest.mark.parametrize("path", PATHS)
def test_timeout_counts_time_without_progress_reference_receive(path: str) -> None:
    _timeout_counts_time_without_progress_receive("reference", path)


def _timeout_counts_time_without_progress_receive(receiver: str, path: str) -> None:
    """A peer trickling a 1 MiB frame over ~1.2 s, never silent for more than ~50 ms,
    does not trip a 0.5 s timeout: it is time without a byte moving, not per frame."""
    mod = need(receiver)
    tx = gs.GradientStreamSession("tx", 1 << 18)
    grad = gradient(1 << 18, seed=5)
    wire = tx.encode_frames(grad)
    piece = len(wire) // 24 + 1

    def trickle(peer: socket.socket) -> None:
        with contextlib.suppress(OSError):
            for i in range(0, len(wire), piece):
                peer.sendall(wire[i : i + piece])
                time.sleep(0.05)
        peer.close()

    async def main() -> None:
        peer, ours = socket.socketpair()
        peer.settimeout(10)
        thread = threading.Thread(target=trickle, args=(peer,))
        thread.start()
        stream, writer = await wrap_receiver(ours, path)
        try:
            rx = mod.GradientStreamSession("rx", timeout=0.5)
            t0 = time.monotonic()
            got = await rx.receive_from(stream)
            assert time.monotonic() - t0 > 0.5  # the trickle did take longer than timeout
            assert_bit_equal(got, grad)
        finally:
            if writer is not None:
                await close_writer(writer)
            ours.close()
            await asyncio.to_thread(thread.join)

    run(main)


@pytest.mark.parametrize("path", NATIVE_TIMEOUT_PATHS)
def test_timeout_counts_time_without_progress_native_send(path: str) -> None:
    _timeout_counts_time_without_progress_send("native", path)


@pytest.mark.parametrize("path", PATHS)
def test_timeout_counts_time_without_progress_reference_send(path: str) -> None:
    _timeout_counts_time_without_progress_send("reference", path)


def _timeout_counts_time_without_progress_send(sender: str, path: str) -> None:
    """A peer reading 64 KiB every 25 ms (a 2 MiB frame takes ~0.8 s to go) does not
    trip a 0.4 s timeout on the sender."""
    mod = need(sender)
    grad = gradient(1 << 19, seed=6)
    tx = mod.GradientStreamSession("tx", 1 << 19, timeout=0.4)
    expected = tx.encode_frames(grad)

    def slow_reader(peer: socket.socket, into: bytearray) -> None:
        peer.settimeout(10)
        with contextlib.suppress(OSError):
            while data := peer.recv(65536):
                into += data
                time.sleep(0.025)

    async def main() -> None:
        peer, ours = socket.socketpair()
        got = bytearray()
        thread = threading.Thread(target=slow_reader, args=(peer, got))
        thread.start()
        stream, writer = await wrap_sender(ours, path)
        try:
            t0 = time.monotonic()
            assert await tx.stream_to(grad, stream) == 1
            assert time.monotonic() - t0 > 0.4  # the peer did take longer than timeout
        finally:
            if writer is not None:
                await close_writer(writer)
            ours.close()
            await asyncio.to_thread(thread.join)
            peer.close()
        assert bytes(got) == expected

    run(main)


@pytest.mark.parametrize("timeout", [None, 7.5, 0.0])
@pytest.mark.parametrize("receiver", IMPL_NAMES)
def test_socket_mode_is_put_back(receiver: str, timeout: float | None) -> None:
    """Blocking, with a timeout, or non-blocking: the socket's mode after a transfer
    (successful or failed) is the one it had before."""
    mod = need(receiver)
    rx = mod.GradientStreamSession("rx", 4)

    async def main() -> None:
        for data in (WIRE, WIRE[:7]):
            peer, ours = socket.socketpair()
            with peer, ours:
                ours.settimeout(timeout)
                peer.sendall(data)
                peer.close()
                await async_outcome(rx.receive_from(ours))
                check_socket_intact(ours, timeout)

    run(main)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("sender", IMPL_NAMES)
def test_a_peer_that_never_reads_times_the_sender_out(sender: str, path: str) -> None:
    """stream_to a peer that reads nothing, with timeout=0.3: StreamTimeoutError (a
    TimeoutError) with the chunk counts, within 2 s; the socket open and blocking."""
    mod = need(sender)
    grad = gradient(3_000_000, seed=13)
    tx = mod.GradientStreamSession("tx", timeout=0.3)

    async def main() -> None:
        await warm_up()
        start = nfd()
        peer, ours = socket.socketpair()
        stream, writer = await wrap_sender(ours, path)
        t0 = time.monotonic()
        with pytest.raises(StreamTimeoutError) as info:
            await tx.stream_to(grad, stream)
        assert time.monotonic() - t0 < 2.0
        exc = info.value
        assert isinstance(exc, TimeoutError) and isinstance(exc, GradientStreamError)
        assert exc.timeout == 0.3
        assert exc.total == chunks_of(len(grad))
        assert 0 <= exc.received < exc.total
        if writer is None:
            check_socket_intact(ours)
        else:
            await close_writer(writer, abort=True)
        peer.close()
        ours.close()
        await fds_back_to(start)

    run(main)


@pytest.mark.parametrize("impl_name", IMPL_NAMES)
def test_full_duplex_on_one_socket(impl_name: str) -> None:
    """A send and a receive at once on the same socket, on both ends (two peers
    exchanging gradients): both arrive; the socket stays non-blocking until the last
    transfer on it ends, then is put back to blocking."""
    mod = need(impl_name)
    s = mod.GradientStreamSession("duplex", timeout=10)
    small, big = gradient(10, seed=14), gradient(2_000_000, seed=15)

    async def main() -> None:
        a, b = socket.socketpair()
        with a, b:
            receiving = asyncio.ensure_future(s.receive_from(a))
            await asyncio.sleep(0.05)
            # The send on a ends long before the receive on a: the receive must keep a
            # non-blocking descriptor (O_NONBLOCK is shared by every duplicate of it).
            assert await s.stream_to(small, a) == 1
            assert_bit_equal(await s.receive_from(b), small)
            await asyncio.sleep(0.05)
            assert not receiving.done()
            assert _fd_nonblocking(a), "the descriptor went blocking under a running receive"
            got = await asyncio.gather(
                receiving, s.stream_to(big, b), s.receive_from(b), s.stream_to(small, a)
            )
            assert_bit_equal(got[0], big)
            assert_bit_equal(got[2], small)
            check_socket_intact(a)
            check_socket_intact(b)
            assert not _fd_nonblocking(a) and not _fd_nonblocking(b)

    run(main)


def _fd_nonblocking(sock: socket.socket) -> bool:
    return bool(fcntl.fcntl(sock.fileno(), fcntl.F_GETFL) & os.O_NONBLOCK)


# --------------------------------------------------------------------------- 4. I/O errors


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


# --------------------------------------------------------------------------- 5. cancellation


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


# --------------------------------------------------------------------------- 6. concurrency


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

    run(main, timeout=40)


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

    run(main, timeout=60)


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


# --------------------------------------------------------------------------- 7. fuzz


@st.composite
def frame_streams(draw: Any) -> bytes:
    """A valid stream of a few small chunks, then hostile edits: of whole frames (drop,
    duplicate, swap, rewrite a header word, change a payload and fix its CRC so that the
    Arrow decoder sees it), then of bytes (bit flips, cuts, inserted garbage, a tail)."""
    n = draw(st.integers(0, 40))
    chunk = draw(st.integers(1, 8))
    values = np.arange(n, dtype=np.float32) * np.float32(0.5)
    frames = frames_of_prefix(gs.GradientStreamSession("f", chunk).encode_frames(values))
    frame_edits = ["drop", "dup", "swap", "header", "payload"]
    for edit in draw(st.lists(st.sampled_from(frame_edits), max_size=3)):
        i = draw(st.integers(0, len(frames) - 1)) if frames else 0
        j = draw(st.integers(0, len(frames) - 1)) if frames else 0
        if not frames:
            break
        if edit == "drop":
            del frames[i]
        elif edit == "dup":
            frames.insert(j, frames[i])
        elif edit == "swap":
            frames[i], frames[j] = frames[j], frames[i]
        elif edit == "header":
            word = draw(st.integers(0, 3))
            value = draw(st.sampled_from([0, 1, 2, 3, 7, 1 << 20, 1 << 28, U32_MAX]))
            frame = bytearray(frames[i])
            struct.pack_into("<I", frame, 4 * word, value)
            frames[i] = bytes(frame)
        else:
            payload = bytearray(frames[i][HEADER_LEN:])
            how = draw(st.sampled_from(["flip", "cut", "replace"]))
            if how == "flip" and payload:
                for _ in range(draw(st.integers(1, 3))):
                    at = draw(st.integers(0, len(payload) - 1))
                    payload[at] ^= 1 << draw(st.integers(0, 7))
            elif how == "cut":
                payload = payload[: draw(st.integers(0, len(payload)))]
            else:
                payload = bytearray(draw(st.binary(max_size=64)))
            index, total = HEADER.unpack_from(frames[i])[:2]
            frames[i] = HEADER.pack(index, total, len(payload), zlib.crc32(payload)) + payload
    data = bytearray(b"".join(frames))
    byte_edits = ["flip", "cut", "cut-near-a-frame-end", "garbage", "tail"]
    for edit in draw(st.lists(st.sampled_from(byte_edits), max_size=2)):
        if edit == "flip" and data:
            at = draw(st.integers(0, len(data) - 1))
            data[at] ^= 1 << draw(st.integers(0, 7))
        elif edit == "cut":
            data = data[: draw(st.integers(0, len(data)))]
        elif edit == "cut-near-a-frame-end" and frames:
            end = sum(map(len, frames[: draw(st.integers(1, len(frames)))]))
            data = data[: max(0, end + draw(st.integers(-3, HEADER_LEN)))]
        elif edit == "garbage":
            at = draw(st.integers(0, len(data)))
            data[at:at] = draw(st.binary(min_size=1, max_size=40))
        elif edit == "tail":
            data += draw(st.binary(min_size=1, max_size=20))
    return bytes(data)


def frames_of_prefix(data: bytes) -> list[bytes]:
    """The whole frames at the start of data (as far as the headers make sense)."""
    out = []
    pos = 0
    while pos + HEADER_LEN <= len(data):
        end = pos + HEADER_LEN + HEADER.unpack_from(data, pos)[2]
        if end > len(data):
            break
        out.append(data[pos:end])
        pos = end
    return out


@pytest.mark.parametrize("path", PATHS)
def test_fuzz_receive_from_agrees_with_decode_frames(path: str) -> None:
    """Random and mutated frame streams, written by a peer that then closes: native
    receive_from gives only gradstream errors or values, and exactly what decode_frames
    gives for the bytes it consumed (it leaves whatever follows the last frame unread)."""
    session = gs.GradientStreamSession("fuzz", max_payload_len=1 << 16, max_gradient_len=64)

    async def receive(data: bytes) -> tuple[tuple[str, Any], bytes]:
        peer, ours = socket.socketpair()
        with peer, ours:
            peer.sendall(data)
            peer.close()
            stream, writer = await wrap_receiver(ours, path)
            async with asyncio.timeout(5):
                result = await async_outcome(session.receive_from(stream))
                if writer is None:
                    rest = await read_until_eof(ours)
                else:
                    rest = await stream.read()
                    await close_writer(writer)
        return result, rest

    with asyncio.Runner() as runner:
        start = runner.run(_count_fds_after_warm_up())

        @settings(
            max_examples=300,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        )
        @given(data=st.one_of(frame_streams(), st.binary(max_size=200)))
        def check(data: bytes) -> None:
            result, rest = runner.run(receive(data))
            note(f"result={result!r} rest={len(rest)} bytes")
            if result[0] == "err":
                assert isinstance(result[1], DATA_ERRORS), result
                assert describe(result) == describe(outcome(lambda: session.decode_frames(data)))
            else:
                assert data.endswith(rest)
                consumed = data[: len(data) - len(rest)]
                want = describe(outcome(lambda: session.decode_frames(consumed)))
                assert describe(result) == want
                if rest:
                    whole = outcome(lambda: session.decode_frames(data))
                    assert whole[0] == "err" and "left over" in str(whole[1])

        check()
        assert nfd() == start, f"{nfd() - start} descriptor(s) left open"


async def _count_fds_after_warm_up() -> int:
    await warm_up()
    return nfd()


@pytest.mark.parametrize("impl", IMPL_NAMES)
def test_socket_arguments_that_cannot_carry_a_gradient(impl: str) -> None:
    # Both implementations: a closed socket is StreamIOError(EBADF), a datagram socket a
    # ValueError, anything else a TypeError naming what is accepted.
    session = IMPLS[impl].GradientStreamSession("args")

    async def main() -> None:
        closed = socket.socket()
        closed.close()
        with pytest.raises(gs.StreamIOError) as info:
            await session.receive_from(closed)
        assert info.value.errno == errno.EBADF
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
            with pytest.raises(ValueError, match=r"(?i)stream socket|SOCK_STREAM"):
                await session.receive_from(udp)
        with pytest.raises(TypeError, match="socket"):
            await session.receive_from(object())
        with pytest.raises(TypeError, match="socket"):
            await session.stream_to(np.ones(3, np.float32), object())

    asyncio.run(main())
