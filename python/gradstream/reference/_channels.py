"""The channels: the bytes of one transfer moved over a ``socket.socket`` (the event
loop's sock_* calls and readiness callbacks) or over asyncio streams, with plain asyncio
and no threads; and ``TransferProgress``, the counters those bytes and frames are added
to as they move.

Apart because they are the only I/O of the reference: they know nothing of frames or
payloads (the session hands them whole frames to send, and fills the receiver's units with
what they read), so the wire rules can be checked without a socket and the I/O without a
gradient.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
from typing import TYPE_CHECKING, Any

from .._checks import SSL_SOCKET_REFUSED
from .._io import Clock, Stalled
from ..errors import StreamIOError

if TYPE_CHECKING:
    import numpy as np

    from ._receiver import _FrameReceiver

# --------------------------------------------------------------------------- progress


class TransferProgress:
    """Counters that transfers add to as they run, for a progress bar.

    ``bytes``: wire bytes moved; ``chunks``: frames completely sent, or received and
    accepted; ``total_chunks``: the frames announced (the plan's count when sending, the
    first frame's total_chunks when receiving; 0 until known). A transfer only ever adds
    to them, so an object passed to several transfers (or to receive_iter, which receives
    several gradients) counts all of them.
    """

    __slots__ = ("_bytes", "_chunks", "_total_chunks")

    def __init__(self) -> None:
        self._bytes = 0
        self._chunks = 0
        self._total_chunks = 0

    @property
    def bytes(self) -> int:
        return self._bytes

    @property
    def chunks(self) -> int:
        return self._chunks

    @property
    def total_chunks(self) -> int:
        return self._total_chunks

    def __repr__(self) -> str:
        return (
            f"TransferProgress(bytes={self._bytes}, chunks={self._chunks}, "
            f"total_chunks={self._total_chunks})"
        )


def _check_progress(progress: Any) -> TransferProgress | None:
    if progress is not None and not isinstance(progress, TransferProgress):
        raise TypeError(
            "progress must be a gradstream.reference.TransferProgress or None, "
            f"not {type(progress).__name__}"
        )
    return progress


def _count(
    progress: TransferProgress | None, nbytes: int = 0, chunks: int = 0, total_chunks: int = 0
) -> None:
    if progress is not None:
        progress._bytes += nbytes
        progress._chunks += chunks
        progress._total_chunks += total_chunks


# --------------------------------------------------------------------------- stream I/O
# Two channels move the bytes: one over a socket.socket (the event loop's sock_* calls and
# readiness callbacks) and one over asyncio streams. Both do partial reads and writes, so
# that the session's timeout bounds the time without a byte moving (not the time a whole
# payload takes), and the receiver can tell how many bytes of a unit arrived before the end.


# Largest piece handed to a StreamWriter before waiting for it to drain.
_WRITE_SLICE = 65_536


class _Channel:
    """Moves bytes for one transfer; every wait is bounded by its clock (the timeout, and
    what is left of the transfer's deadline)."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock

    def __enter__(self) -> None:
        pass

    def __exit__(self, *exc_info: object) -> None:
        pass

    async def recv_into(self, view: memoryview) -> int:
        """Read 1..len(view) bytes into view; 0 at the end of the stream."""
        raise NotImplementedError

    async def send(self, view: memoryview) -> int:
        """Write 1..len(view) bytes of view; how many."""
        raise NotImplementedError


# Sockets with a transfer running: [transfers, timeout to restore]. Several transfers may
# share one socket (a send and a receive at once, full duplex): the first makes the socket
# non-blocking, the last puts its mode back.
_ACTIVE_SOCKETS: dict[socket.socket, list[Any]] = {}


class _SocketChannel(_Channel):
    def __init__(self, sock: socket.socket, clock: Clock) -> None:
        super().__init__(clock)
        self.sock = sock
        self.loop = asyncio.get_running_loop()

    def __enter__(self) -> None:
        # loop.sock_* need a non-blocking socket; the caller's mode is put back at the end.
        sock = self.sock
        entry = _ACTIVE_SOCKETS.get(sock)
        if entry is not None:
            entry[0] += 1
            return
        previous = sock.gettimeout()
        try:
            sock.setblocking(False)
        except OSError as exc:  # e.g. a closed socket
            raise StreamIOError.from_os_error(exc) from exc
        _ACTIVE_SOCKETS[sock] = [1, previous]

    def __exit__(self, *exc_info: object) -> None:
        sock = self.sock
        entry = _ACTIVE_SOCKETS[sock]
        entry[0] -= 1
        if entry[0] == 0:
            del _ACTIVE_SOCKETS[sock]
            if sock.fileno() != -1:  # closed under us: nothing left to restore
                sock.settimeout(entry[1])

    async def recv_into(self, view: memoryview) -> int:
        try:
            return await self.clock.within(self.loop.sock_recv_into(self.sock, view))
        except OSError as exc:
            raise StreamIOError.from_os_error(exc) from exc

    async def send(self, view: memoryview) -> int:
        try:
            while True:
                try:
                    return self.sock.send(view)
                except (BlockingIOError, InterruptedError):
                    pass
                try:
                    await self.clock.within(self._writable())
                except NotImplementedError:
                    # A loop without readiness callbacks (Windows' proactor): sendall, so
                    # the timeout bounds the whole piece rather than each byte.
                    await self.clock.within(self.loop.sock_sendall(self.sock, view))
                    return len(view)
        except OSError as exc:
            raise StreamIOError.from_os_error(exc) from exc

    async def _writable(self) -> None:
        waiter = self.loop.create_future()
        fd = self.sock.fileno()
        self.loop.add_writer(fd, _wake, waiter)
        try:
            await waiter
        finally:
            self.loop.remove_writer(fd)


def _wake(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


class _StreamsChannel(_Channel):
    def __init__(
        self,
        reader: asyncio.StreamReader | None,
        writer: asyncio.StreamWriter | None,
        clock: Clock,
    ) -> None:
        super().__init__(clock)
        self.reader = reader
        self.writer = writer

    async def recv_into(self, view: memoryview) -> int:
        assert self.reader is not None
        try:
            # read(n) returns what is buffered, up to n, as soon as there is something:
            # never more than asked, so never past the gradient's last frame.
            data = await self.clock.within(self.reader.read(len(view)))
        except OSError as exc:
            raise StreamIOError.from_os_error(exc) from exc
        view[: len(data)] = data
        return len(data)

    async def send(self, view: memoryview) -> int:
        assert self.writer is not None
        piece = view[:_WRITE_SLICE]
        try:
            self.writer.write(piece)
            await self._drain()
        except OSError as exc:
            raise StreamIOError.from_os_error(exc) from exc
        return len(piece)

    async def _drain(self) -> None:
        # drain() waits until the transport's buffer is below its low-water mark; a
        # timeout only counts as a stall when not one byte left the buffer meanwhile.
        assert self.writer is not None
        transport = self.writer.transport
        while True:
            before = transport.get_write_buffer_size()
            try:
                await self.clock.within(self.writer.drain())
                return
            except Stalled as stalled:
                if stalled.late or transport.get_write_buffer_size() >= before:
                    raise


def _check_socket(sock: socket.socket) -> socket.socket:
    if isinstance(sock, ssl.SSLSocket):
        raise TypeError(SSL_SOCKET_REFUSED)
    if sock.type != socket.SOCK_STREAM:
        raise ValueError(
            f"stream must be a connected stream socket (SOCK_STREAM), not {sock.type!r}"
        )
    return sock


def _not_a_stream(stream: Any, method: str | None, kind: str, default: str) -> TypeError:
    """The TypeError for a ``stream`` that is no socket and no stream of ``kind``, naming
    ``method`` (the tensor-set calls) or, for the gradient calls, in their own words."""
    if method is None:
        return TypeError(f"{default}, not {type(stream).__name__}")
    return TypeError(
        f"{method} takes a connected socket.socket, an asyncio.{kind} or a (reader, "
        f"writer) pair, not {type(stream).__name__}"
    )


def _sending_channel(stream: Any, clock: Clock, method: str | None = None) -> _Channel:
    if isinstance(stream, socket.socket):
        return _SocketChannel(_check_socket(stream), clock)
    writer = stream[1] if isinstance(stream, tuple) and len(stream) == 2 else stream
    if isinstance(writer, asyncio.StreamWriter):
        return _StreamsChannel(None, writer, clock)
    raise _not_a_stream(
        stream,
        method,
        "StreamWriter",
        "stream_to expects a connected socket.socket, an asyncio.StreamWriter or a "
        "(StreamReader, StreamWriter) pair",
    )


def _receiving_channel(stream: Any, clock: Clock, method: str | None = None) -> _Channel:
    if isinstance(stream, socket.socket):
        return _SocketChannel(_check_socket(stream), clock)
    reader = stream[0] if isinstance(stream, tuple) and len(stream) == 2 else stream
    if isinstance(reader, asyncio.StreamReader):
        return _StreamsChannel(reader, None, clock)
    raise _not_a_stream(
        stream,
        method,
        "StreamReader",
        "receive_from and receive_iter expect a connected socket.socket, an "
        "asyncio.StreamReader or a (StreamReader, StreamWriter) pair",
    )


async def _send_all(channel: _Channel, data: memoryview, progress: TransferProgress | None) -> None:
    """Write all of ``data`` (one frame), counting the bytes as they leave. Stalled when
    the timeout passes without a byte moving: the caller says which frame it was."""
    sent = 0
    while sent < len(data):
        n = await channel.send(data[sent:])
        sent += n
        _count(progress, nbytes=n)


async def _recv_all(channel: _Channel, view: memoryview, progress: TransferProgress | None) -> int:
    """Fill ``view`` (one header or one payload), counting the bytes as they arrive; the
    number that arrived, short of ``len(view)`` only when the stream ended first. Stalled
    when the timeout passes without a byte moving: the caller says where it was."""
    got = 0
    while got < len(view):
        n = await channel.recv_into(view[got:])
        if n == 0:
            break
        channel.clock.start()  # a receiver's deadline runs from its first byte
        got += n
        _count(progress, nbytes=n)
    return got


async def _receive_frames(
    channel: _Channel, progress: TransferProgress | None, receiver: _FrameReceiver
) -> np.ndarray | None:
    """One gradient's frames read from ``channel`` into ``receiver`` (a session's, or a
    tensor set's whose limit is the tensor's manifest entry) until it is done; None when
    the stream ended before its first byte."""
    # The socket is non-blocking only while a gradient is being received, so between
    # two gradients of receive_iter it is in the caller's mode.
    with channel:
        while not receiver.done:
            # A header, or a payload of at most max_payload_len bytes (checked from the
            # header before this allocation); exactly what the frame needs, so nothing
            # past the gradient's last frame is ever read.
            unit = memoryview(bytearray(receiver.want))
            try:
                got = await _recv_all(channel, unit, progress)
            except Stalled as stalled:
                raise stalled.error(receiver.received, receiver.total) from None
            if got < len(unit):
                receiver.end_of_stream(got)  # raises, but before any byte
                return None
            had_total = receiver.total is not None
            received = receiver.received
            # sock_recv_into returns at once while data is buffered: give the loop a
            # turn per unit, so other tasks and cancellation are not starved.
            await asyncio.sleep(0)
            receiver.feed(unit)
            if receiver.received > received:
                _count(progress, chunks=1)
                if not had_total:
                    _count(progress, total_chunks=receiver.total or 0)
    return receiver.result()
