"""Asyncio streams on a plain socket, handed to the native socket path for one transfer.

An asyncio ``StreamReader`` moves each 256 KiB the transport reads through a Python turn
of the event loop; the native socket path reads and writes the descriptor itself in
tokio (bench section 7, "driver handover": several times the generic path's rate on a
large gradient; docs/performance.md). When a stream's transport is the default loop's
plain TCP or Unix socket transport, a transfer borrows that socket for its duration:

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
transports, a subclass of ``StreamReader`` or ``StreamWriter``, whose own methods must
see the bytes, a reader without a transport, one at EOF or with an exception set, a
transport whose protocol is not the reader's). asyncio has no public API for a reader's
buffer or transport, so this module, and no other, reads ``StreamReader._buffer``,
``_transport``, ``_eof`` and ``_waiter`` and ``StreamReaderProtocol._stream_reader``.
Whether a stream can be handed over at all is probed once per stream (its loop, its
class, those attributes and their types, its transport and socket) and kept with the
stream; each transfer then checks only the stream's state (EOF, an exception, another
reader waiting, the transport closing or its protocol replaced by ``start_tls``). A
stream the probe refuses, or whose attributes are not what Python 3.11's asyncio gives
them, takes the generic path, with the same results and errors.

The native side dups the descriptor, whose mode stays as asyncio keeps it (non-blocking); the
loop's selector does not watch the socket's reading while the receive runs. Nothing
else may read the reader or write the writer while a transfer runs (as on the generic
path). Called by ``_session`` alone.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import weakref
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple, TypeVar

from ._native import Handover

__all__ = ["handed_over", "lend_reader", "socket_to_write"]

_log = logging.getLogger("gradstream.handover")

# Transfers that took the native socket path, by direction ("receive", "send"): how a
# test tells the fast path ran.
handed_over: Counter[str] = Counter()

_FAMILIES = (socket.AF_INET, socket.AF_INET6, socket.AF_UNIX)


class _Plain(NamedTuple):
    """What a stream's probe found: the transport the native side may bypass, its socket
    and (for a reader) the protocol that feeds the reader."""

    transport: asyncio.Transport
    socket: Any  # asyncio's TransportSocket
    protocol: Any


# Each stream's probe, kept as long as the stream lives: _Plain, or None for a stream
# that always takes the generic path.
_probed: weakref.WeakKeyDictionary[Any, _Plain | None] = weakref.WeakKeyDictionary()

S = TypeVar("S")


def _plain_socket(transport: Any) -> tuple[asyncio.Transport, Any] | None:
    """``transport`` and the socket under it when native I/O may drive it: the default
    (selector) loop's transport of a plain TCP or Unix stream socket, no TLS; else None."""
    if not isinstance(asyncio.get_running_loop(), asyncio.SelectorEventLoop):
        return None  # uvloop and other loops keep their own I/O
    if not isinstance(transport, asyncio.Transport):
        return None
    if transport.get_extra_info("sslcontext") is not None:
        return None
    if transport.get_extra_info("ssl_object") is not None:
        return None
    # asyncio's TransportSocket: fileno, family and type, as the native side reads them.
    sock = transport.get_extra_info("socket")
    if sock is None:
        return None
    if sock.type != socket.SOCK_STREAM or sock.family not in _FAMILIES:
        return None
    return transport, sock


def _probe_writer(writer: asyncio.StreamWriter) -> _Plain | None:
    if type(writer) is not asyncio.StreamWriter:
        return None  # a subclass's own write() must see the bytes
    found = _plain_socket(writer.transport)
    if found is None:
        return None
    transport, sock = found
    transport.get_write_buffer_size()  # a transport of the caller's own may not have it
    return _Plain(transport, sock, None)


def _probe_reader(reader: asyncio.StreamReader) -> _Plain | None:
    if type(reader) is not asyncio.StreamReader:
        return None  # a subclass's own read() must see the bytes
    # The attributes this module reads, as Python 3.11's asyncio gives them.
    if type(getattr(reader, "_buffer", None)) is not bytearray:
        return None
    if type(getattr(reader, "_eof", None)) is not bool or not hasattr(reader, "_waiter"):
        return None
    found = _plain_socket(getattr(reader, "_transport", None))
    if found is None:
        return None
    transport, sock = found
    protocol = transport.get_protocol()
    # Its protocol must feed this reader (after start_tls the old transport feeds TLS).
    if getattr(protocol, "_stream_reader", None) is not reader:
        return None
    transport.is_reading()  # a transport of the caller's own may not have it
    return _Plain(transport, sock, protocol)


def _probe(stream: S, probe: Callable[[S], _Plain | None]) -> _Plain | None:
    """``probe(stream)``, made once per stream. A stream without a transport yet is not
    decided (asked again next time); anything a probe meets that is not as expected
    means the generic path."""
    try:
        return _probed[stream]
    except KeyError:
        pass
    except TypeError:  # not weakly referable: never handed over
        return None
    try:
        found = probe(stream)
    except (AttributeError, NotImplementedError, OSError, TypeError, ValueError):
        found = None
    if found is None and getattr(stream, "_transport", True) is None:
        return None  # a reader not yet connected: ask again once it is
    _probed[stream] = found
    return found


def socket_to_write(writer: asyncio.StreamWriter) -> Any:
    """The socket a send may write itself, or None: the generic path (no plain socket, or
    bytes still queued in the transport, which must go first)."""
    plain = _probe(writer, _probe_writer)
    if plain is None:
        return None
    transport = writer.transport
    if transport is not plain.transport or transport.is_closing():
        return None  # start_tls replaced it, or it is closing: the generic path says so
    if transport.get_write_buffer_size() != 0:
        return None
    handed_over["send"] += 1
    return plain.socket


@contextmanager
def _borrowed(reader: asyncio.StreamReader, buffer: bytearray, plain: _Plain) -> Iterator[Handover]:
    """The socket and the reader's bytes (``buffer``), lent for one receive; on the way
    out what the receive left goes back in front of the reader's buffer and reading
    resumes."""
    transport = plain.transport
    # A transport the reader paused itself (its buffer was full) stays paused: the
    # reader resumes it when it next waits for data.
    pause = transport.is_reading()
    if pause:
        transport.pause_reading()
    handover = Handover(plain.socket, bytes(buffer))
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


def lend_reader(reader: asyncio.StreamReader | None) -> Any:
    """A context manager lending the socket under ``reader`` (a ``Handover``) for one
    receive, or None: the generic path."""
    if reader is None:
        return None
    plain = _probe(reader, _probe_reader)
    if plain is None:
        return None
    if reader.exception() is not None or getattr(reader, "_eof", True) is not False:
        return None
    if getattr(reader, "_waiter", None) is not None:
        return None  # another coroutine is reading: the generic path says so
    buffer = getattr(reader, "_buffer", None)
    if type(buffer) is not bytearray:
        return None
    transport = plain.transport
    if transport.is_closing() or transport.get_protocol() is not plain.protocol:
        return None  # closing, or start_tls put TLS between the socket and the reader
    return _borrowed(reader, buffer, plain)
