"""The asyncio streams of a reference connection: a ``StreamReader`` / ``StreamWriter``
pair over a new or an accepted TCP socket, through TLS when there is a context, whose
bytes pass a tap (a ``FrameDigest``) while a transfer runs.

The tap is why these are subclasses: the session's ``stream_to`` / ``receive_from`` and
tensor-set methods move a transfer's bytes through ``read`` and ``write`` of the streams
they are given, and the ack digest needs every frame header exactly as it went or came,
without a second walk of the frames and without the session knowing about acks.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
from collections.abc import Iterable, Iterator

from ._protocol import FrameDigest

# The reader's buffer limit: the transport pauses once twice this is buffered.
_LIMIT = 256 * 1024


class _Tapped:
    """The tap of a stream: set for the time of one transfer."""

    tap: FrameDigest | None = None

    @contextlib.contextmanager
    def tapping(self, tap: FrameDigest) -> Iterator[FrameDigest]:
        self.tap = tap
        try:
            yield tap
        finally:
            self.tap = None


class TappedReader(_Tapped, asyncio.StreamReader):
    """A StreamReader whose bytes, as they are read, go to the tap when one is set."""

    async def read(self, n: int = -1) -> bytes:
        data = await super().read(n)
        # read(-1) reads through read(limit): those calls fed the tap already.
        if n >= 0 and self.tap is not None:
            self.tap.feed(data)
        return data

    async def readexactly(self, n: int) -> bytes:
        data = await super().readexactly(n)
        if self.tap is not None:
            self.tap.feed(data)
        return data


class TappedWriter(_Tapped, asyncio.StreamWriter):
    """A StreamWriter whose bytes go to the tap, when one is set, before they are
    written (so the tap may refuse a frame before any of it leaves)."""

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if self.tap is not None:
            self.tap.feed(data)
        super().write(data)

    def writelines(self, data: Iterable[bytes | bytearray | memoryview]) -> None:
        for piece in data:
            self.write(piece)


Streams = tuple[TappedReader, TappedWriter]


def _parts(loop: asyncio.AbstractEventLoop) -> tuple[TappedReader, asyncio.StreamReaderProtocol]:
    reader = TappedReader(limit=_LIMIT, loop=loop)
    return reader, asyncio.StreamReaderProtocol(reader, loop=loop)


async def open_client(
    host: str, port: int, context: ssl.SSLContext | None, handshake_timeout: float | None
) -> Streams:
    """Connect to ``host:port`` (with ``context``: TLS, the server's certificate checked
    against ``host``, IP addresses included)."""
    loop = asyncio.get_running_loop()
    reader, protocol = _parts(loop)
    if context is None:
        transport, _ = await loop.create_connection(lambda: protocol, host, port)
    else:
        transport, _ = await loop.create_connection(
            lambda: protocol,
            host,
            port,
            ssl=context,
            server_hostname=host,
            ssl_handshake_timeout=handshake_timeout,
        )
    return reader, TappedWriter(transport, protocol, reader, loop)


async def open_accepted(
    sock: socket.socket, context: ssl.SSLContext | None, handshake_timeout: float
) -> Streams:
    """Streams over a socket a listener accepted (with ``context``: the server's side of
    the TLS handshake). The socket is closed if this fails."""
    loop = asyncio.get_running_loop()
    reader, protocol = _parts(loop)
    try:
        if context is None:
            transport, _ = await loop.connect_accepted_socket(lambda: protocol, sock)
        else:
            transport, _ = await loop.connect_accepted_socket(
                lambda: protocol, sock, ssl=context, ssl_handshake_timeout=handshake_timeout
            )
    except BaseException:
        sock.close()
        raise
    return reader, TappedWriter(transport, protocol, reader, loop)
