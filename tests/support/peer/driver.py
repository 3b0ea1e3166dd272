"""The test peer over asyncio streams: ``listen``, ``connect`` and ``serve`` give
connections whose calls are the ones the connection tests make of the product's
(``send``, ``recv``, ``send_tensors``, ``recv_tensors``, ``async for``, ``close``,
``peer``, ``closed``), so a test can put this peer on either side of a connection with
the native one. Every protocol decision is the ``Machine``'s; this module only moves its
bytes, over TCP or TLS (Python's ``ssl``: TLS 1.3, ALPN ``gradstream/1``).

What the product has beyond that (progress, deadlines, caps, logs, max_values) this peer
leaves out: the tests hold the native side to those. A listener keeps the errors of the
peers it dropped in ``failures``.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
from cryptography import x509

from gradstream.errors import Address, GradientStreamError
from gradstream.reference import GradientStreamSession

from . import messages as m
from .machine import Ended, Kind, Machine

__all__ = ["Connection", "GradientStreamSession", "Listener", "PeerInfo", "connect", "listen"]

ALPN = "gradstream/1"
# Seconds a receiver that refused a transfer reads and drops what the sender still
# writes, so that its refusal is not lost to a reset.
REFUSAL_LINGER = 1.0
Protocol = Literal["gradstream", "seed"]


@dataclass(frozen=True)
class PeerInfo:
    """Who is at the other end: as ``gradstream.Peer`` says it (the subject is
    ``cryptography``'s RFC 4514 text)."""

    address: Address
    tls_subject: str | None = None
    authenticated: bool = False


def _address(address: Any) -> Address:
    if isinstance(address, str):
        host, _, port = address.rpartition(":")
        return host, int(port)
    return str(address[0]), int(address[1])


def _context(server: bool, tls: Any) -> ssl.SSLContext:
    """A context for ``tls`` (anything with ``cert``, ``key`` and ``ca`` paths, such as a
    ``gradstream.TLS``): TLS 1.3 only, ALPN ``gradstream/1``; a listener with ``ca``
    requires a client certificate."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if server else ssl.PROTOCOL_TLS_CLIENT)
    context.minimum_version = context.maximum_version = ssl.TLSVersion.TLSv1_3
    context.set_alpn_protocols([ALPN])
    if tls.cert is not None:
        context.load_cert_chain(tls.cert, tls.key)
    if tls.ca is not None:
        context.load_verify_locations(cafile=tls.ca)
        if server:
            context.verify_mode = ssl.CERT_REQUIRED
    return context


class Connection:
    """One connection after its handshake: one transfer at a time, each acknowledged
    (``protocol="gradstream"``)."""

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        machine: Machine,
        peer: PeerInfo,
    ) -> None:
        self._reader = reader
        self._writer = writer
        self._machine = machine
        self.peer = peer
        self.closed = False

    def __repr__(self) -> str:
        return f"<test peer connection with {self.peer.address}>"

    # ---- moving the machine's bytes

    async def _flush(self) -> None:
        data = self._machine.take_outgoing()
        if data:
            self._writer.write(data)
            await self._writer.drain()

    async def _read(self) -> None:
        try:
            data = await self._reader.read(1 << 16)
        except (OSError, ssl.SSLError):
            data = b""  # a reset ends the connection as a close does
        self._machine.feed(data)

    async def _until(self, step: Callable[[], Any]) -> Any:
        """``step`` again after each read, until it gives a result (or raises); what it
        queued is written each time, a refusal included."""
        while True:
            try:
                result = step()
            finally:
                with contextlib.suppress(OSError, ssl.SSLError):
                    await self._flush()
            if result is not None:
                return result
            await self._read()

    # ---- transfers

    async def send(self, gradient: Any) -> int:
        """One gradient; its chunk count once the peer acknowledged it."""
        return await self._send(lambda: self._machine.send(gradient))

    async def send_tensors(self, tensors: Any) -> int:
        """One tensor set; its frame count once the peer acknowledged it."""
        return await self._send(lambda: self._machine.send_tensors(tensors))

    async def _send(self, queue: Callable[[], int]) -> int:
        count = queue()  # DeliveryError before a byte: still in step
        self._writer.write(self._machine.take_outgoing())
        # The peer's answer is read while the frames drain: a refusal may come first.
        draining = asyncio.ensure_future(self._writer.drain())
        try:
            await self._until(self._machine.ack)
            await draining
        except BaseException:
            self._abort()
            raise
        finally:
            draining.cancel()
            await asyncio.gather(draining, return_exceptions=True)
        return count

    async def recv(self, out: np.ndarray | None = None) -> np.ndarray:
        """One gradient (into ``out`` when given); an empty one when the peer closed
        before it began (``closed`` is then True)."""
        got = await self._receive("gradient", out)
        return np.empty(0, np.float32) if got is None else got

    async def recv_tensors(self) -> dict[str, np.ndarray]:
        """One tensor set; ``{}`` when the peer closed before it began."""
        got = await self._receive("tensors", None)
        return {} if got is None else got

    async def _receive(self, kind: Kind, out: np.ndarray | None) -> Any:
        if self.closed:
            return None
        try:
            return await self._until(lambda: self._machine.receive(kind, out))
        except Ended:
            await self.close()
            return None
        except GradientStreamError:
            await self._linger()
            self._abort()
            raise

    async def _linger(self) -> None:
        """After a refusal: drop what the sender still writes until it closes."""
        with contextlib.suppress(Exception):
            async with asyncio.timeout(REFUSAL_LINGER):
                if self._writer.can_write_eof():
                    self._writer.write_eof()
                while await self._reader.read(1 << 16):
                    pass

    def __aiter__(self) -> AsyncIterator[np.ndarray]:
        return self._gradients()

    async def _gradients(self) -> AsyncIterator[np.ndarray]:
        while (got := await self._receive("gradient", None)) is not None:
            yield got

    # ---- the end

    def _abort(self) -> None:
        self.closed = True
        self._writer.transport.abort()

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._writer.close()
        with contextlib.suppress(Exception):
            async with asyncio.timeout(5):
                await self._writer.wait_closed()

    async def __aenter__(self) -> Connection:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()


def _default_session(protocol: Protocol) -> GradientStreamSession:
    if protocol == "gradstream":
        return GradientStreamSession("peer", layout="compact", keep_shape=True, keep_dtype=True)
    return GradientStreamSession("peer")


async def _established(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    role: int,
    *,
    session: GradientStreamSession | None = None,
    authkey: bytes | None = None,
    tls: Any = None,
    protocol: Protocol = "gradstream",
    nonce: bytes | None = None,
    version: int = m.VERSION,
) -> Connection:
    """A connection over streams that are up (TLS with ``tls``, anything with ``cert``,
    ``key`` and ``ca`` paths), once the handshake passed; ``nonce`` fixes this side's
    hello nonce (and SPAKE2 scalar); ``version=messages.OLD_VERSION`` plays an older
    peer."""
    name = writer.get_extra_info("peername")
    address: Address = (str(name[0]), int(name[1]))
    machine = Machine(
        role,
        # Without a session, a gradstream connection's defaults (compact, shapes and
        # dtypes kept), as the native side's; a reference session is used as it is.
        _default_session(protocol) if session is None else session,
        authkey=authkey,
        nonce=nonce,
        protocol=protocol,
        peer=address,
        version=version,
    )
    subject = None
    verified = tls is not None and (role == m.ROLE_CLIENT or tls.ca is not None)
    if tls is not None and role == m.ROLE_SERVER and tls.ca is not None:
        der = writer.get_extra_info("ssl_object").getpeercert(binary_form=True)
        subject = x509.load_der_x509_certificate(der).subject.rfc4514_string()
    conn = Connection(reader, writer, machine, PeerInfo(address, subject))
    if protocol == "gradstream":
        try:
            shaken = await conn._until(machine.handshake)
        except BaseException:
            conn._abort()
            raise
        verified = verified or shaken.authkey_proved
    conn.peer = PeerInfo(address, subject, verified)
    return conn


async def connect(address: Any, **settings: Any) -> Connection:
    """Dial a listener at ``address`` (``"host:port"`` or a pair) and shake hands;
    ``settings`` are ``_established``'s: session, authkey, tls, protocol, nonce,
    version."""
    host, port = _address(address)
    tls = settings.get("tls")
    context = None if tls is None else _context(False, tls)
    reader, writer = await asyncio.open_connection(
        host, port, ssl=context, server_hostname=host if context else None
    )
    return await _established(reader, writer, m.ROLE_CLIENT, **settings)


class Listener:
    """A listening socket whose peers come out of ``accept`` (or ``async for``) once
    their handshake passed; the errors of the others are kept in ``failures``."""

    def __init__(self, keywords: dict[str, Any]) -> None:
        self._keywords = keywords
        self._ready: asyncio.Queue[Connection | None] = asyncio.Queue()
        self._server: asyncio.Server | None = None
        # The streams of peers not accepted yet (in their handshake, or ready): closing
        # the listener closes them.
        self._unaccepted: dict[asyncio.StreamWriter, Connection | None] = {}
        self.failures: list[BaseException] = []
        self.address: Address = ("", 0)

    async def _start(self, host: str, port: int, tls: Any) -> None:
        context = None if tls is None else _context(True, tls)
        self._server = await asyncio.start_server(self._admit, host, port, ssl=context)
        self.address = _address(self._server.sockets[0].getsockname()[:2])

    async def _admit(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._server is None:  # closed while this peer came in
            writer.close()
            return
        self._unaccepted[writer] = None
        try:
            conn = await _established(reader, writer, m.ROLE_SERVER, **self._keywords)
        except Exception as exc:
            self.failures.append(exc)
            self._unaccepted.pop(writer, None)
            writer.close()
            return
        if writer not in self._unaccepted:  # the listener closed during the handshake
            await conn.close()
            return
        self._unaccepted[writer] = conn
        self._ready.put_nowait(conn)

    async def accept(self) -> Connection:
        conn = await self._ready.get()
        if conn is None:
            self._ready.put_nowait(None)
            raise ConnectionAbortedError("accept() on a closed test peer listener")
        self._unaccepted.pop(conn._writer, None)
        return conn

    def __aiter__(self) -> AsyncIterator[Connection]:
        return self._connections()

    async def _connections(self) -> AsyncIterator[Connection]:
        while True:
            try:
                yield await self.accept()
            except ConnectionAbortedError:
                return

    async def close(self) -> None:
        """Stop listening; connections not yet accepted (or still shaking hands) are
        closed."""
        if self._server is None:
            return
        server, self._server = self._server, None
        server.close()
        unaccepted, self._unaccepted = self._unaccepted, {}
        for writer, conn in unaccepted.items():
            if conn is None:
                writer.transport.abort()
            else:
                await conn.close()
        while not self._ready.empty():
            self._ready.get_nowait()
        self._ready.put_nowait(None)

    async def __aenter__(self) -> Listener:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()


async def listen(address: Any, **settings: Any) -> Listener:
    """Listen at ``address`` (port 0: any free port, see ``Listener.address``);
    ``settings`` as ``connect``'s."""
    listener = Listener(settings)
    await listener._start(*_address(address), settings.get("tls"))
    return listener


class Server:
    """``serve``'s result: each connection to ``handler`` in a task of its own, closed
    when the handler returns."""

    def __init__(self, listener: Listener, handler: Callable[[Connection], Awaitable[Any]]):
        self._listener = listener
        self._handler = handler
        self._tasks: set[asyncio.Task[None]] = set()
        self._dispatcher = asyncio.ensure_future(self._dispatch())

    @property
    def address(self) -> Address:
        return self._listener.address

    async def _dispatch(self) -> None:
        async for conn in self._listener:
            task = asyncio.ensure_future(self._serve(conn))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _serve(self, conn: Connection) -> None:
        try:
            await self._handler(conn)
        finally:
            await conn.close()

    async def close(self) -> None:
        await self._listener.close()
        for task in [self._dispatcher, *self._tasks]:
            task.cancel()
        await asyncio.gather(self._dispatcher, *self._tasks, return_exceptions=True)

    async def __aenter__(self) -> Server:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()


async def serve(
    address: Any, handler: Callable[[Connection], Awaitable[Any]], **keywords: Any
) -> Server:
    """``listen(address, **keywords)``, each connection handed to ``handler``."""
    return Server(await listen(address, **keywords), handler)
