"""Asyncio streams on a plain socket, handed to the native socket path for one transfer.

An asyncio ``StreamReader`` moves each 256 KiB the transport reads through a Python turn
of the event loop; the native socket path reads and writes the descriptor itself in
tokio. When a stream's transport is the default loop's plain TCP or Unix socket
transport, a transfer borrows that socket for its duration:

- a receive pauses the transport's reading, takes the bytes the reader had already
  buffered, and hands them with the socket to the native receive (a ``Handover``), which
  reads them first; it reads no byte past the gradient's last frame, so what it leaves of
  them goes back into the reader, and the transport resumes reading: the next
  ``await reader.read()`` sees exactly the bytes after the gradient (and an end of the
  stream the native side met is fed to the reader at once, as the generic path leaves
  it);
- a send writes from the native side once the transport's write buffer is empty (when
  it is not, the bytes queued there go first: the generic path writes behind them).

Anything else takes the generic path of ``_aio`` (TLS, uvloop's or another loop's
transports, a reader without a transport, one at EOF or with an exception set, a
transport whose protocol is not the reader's). asyncio has no public API for a reader's
buffer or transport, so ``StreamReader._buffer``, ``_transport``, ``_eof`` and ``_waiter``
and ``StreamReaderProtocol._stream_reader`` are read here, each checked for the type
Python 3.11's asyncio gives it; anything unexpected means the generic path.

The native side dups the descriptor and leaves it non-blocking, as asyncio keeps it; the
loop's selector does not watch the socket's reading while the receive runs. Nothing
else may read the reader or write the writer while a transfer runs (as on the generic
path). Called by ``_session`` alone.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from ._native import Handover

__all__ = ["handed_over", "lend_reader", "socket_to_write"]

_log = logging.getLogger("gradstream.handover")

# Transfers that took the native socket path, by direction ("receive", "send"): how a
# test tells the fast path ran.
handed_over: Counter[str] = Counter()

_FAMILIES = (socket.AF_INET, socket.AF_INET6, socket.AF_UNIX)


def _plain_socket(transport: Any) -> Any:
    """The socket under ``transport`` when native I/O may drive it: the default (selector)
    loop's transport of a plain, open TCP or Unix stream socket, no TLS; else None."""
    loop = asyncio.get_running_loop()
    if not isinstance(loop, asyncio.SelectorEventLoop):
        return None  # uvloop and other loops keep their own I/O
    if not isinstance(transport, asyncio.Transport) or transport.is_closing():
        return None
    if transport.get_extra_info("sslcontext") is not None:
        return None
    if transport.get_extra_info("ssl_object") is not None:
        return None
    sock = transport.get_extra_info("socket")
    if sock is None or sock.type != socket.SOCK_STREAM or sock.family not in _FAMILIES:
        return None
    return sock


def socket_to_write(writer: asyncio.StreamWriter) -> Any:
    """The socket a send may write itself, or None: the generic path (no plain socket, or
    bytes still queued in the transport, which must go first)."""
    transport = writer.transport
    sock = _plain_socket(transport)
    try:
        if sock is None or transport.get_write_buffer_size() != 0:
            return None
    except NotImplementedError:  # a transport of the caller's own making
        return None
    handed_over["send"] += 1
    return sock


def _reading_transport(reader: asyncio.StreamReader) -> Any:
    """The transport feeding ``reader`` when its socket can be handed over, else None."""
    if reader.exception() is not None or getattr(reader, "_eof", True) is not False:
        return None
    if getattr(reader, "_waiter", None) is not None:
        return None  # another coroutine is reading: the generic path says so
    if not isinstance(getattr(reader, "_buffer", None), bytearray):
        return None
    transport = getattr(reader, "_transport", None)
    if transport is None or _plain_socket(transport) is None:
        return None
    # Its protocol must feed this reader (after start_tls the old transport feeds TLS).
    try:
        if getattr(transport.get_protocol(), "_stream_reader", None) is not reader:
            return None
        transport.is_reading()
    except NotImplementedError:  # a transport of the caller's own making
        return None
    return transport


@contextmanager
def _borrowed(reader: asyncio.StreamReader, transport: Any) -> Iterator[Handover]:
    """The socket and the reader's bytes, lent for one receive; on the way out what the
    receive left goes back in front of the reader's buffer and reading resumes."""
    buffer: bytearray = reader._buffer  # type: ignore[attr-defined]
    # A transport the reader paused itself (its buffer was full) stays paused: the
    # reader resumes it when it next waits for data.
    pause = transport.is_reading()
    if pause:
        transport.pause_reading()
    handover = Handover(transport.get_extra_info("socket"), bytes(buffer))
    _log.debug("receiving on the socket of %r, %d bytes buffered", transport, len(buffer))
    buffer.clear()
    handed_over["receive"] += 1
    try:
        yield handover
    finally:
        buffer[:0] = handover.unread()
        if handover.ended():
            # The end of the stream came to the native side: the reader says so at once
            # (the transport would tell it only on a later turn of the loop).
            reader.feed_eof()
        if pause:
            transport.resume_reading()


def lend_reader(reader: Any) -> Any:
    """A context manager lending the socket under ``reader`` (a ``Handover``) for one
    receive, or None: the generic path."""
    if not isinstance(reader, asyncio.StreamReader):
        return None
    transport = _reading_transport(reader)
    return None if transport is None else _borrowed(reader, transport)
