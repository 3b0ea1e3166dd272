"""What the connection tests (tests/connection/) share: a deadline for each scenario, a
listener on 127.0.0.1 with its connections collected, peers that speak the protocol by
hand (to be hostile on purpose; the messages are the test peer's, support.peer.messages)
with frames sealed as a connection seals them, and a proxy that records and edits the
bytes between two peers (a man in the middle)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import socket
import ssl
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import numpy as np

import gradstream.reference as ref
from support.aio import run as run_under_deadline
from support.peer import messages as p

DEADLINE = 30.0
run = functools.partial(run_under_deadline, deadline=DEADLINE)

KEY = b"a key both sides hold, 32 bytes."
LOCAL = "127.0.0.1:0"

Streams = tuple[asyncio.StreamReader, asyncio.StreamWriter]


async def close_writer(writer: asyncio.StreamWriter) -> None:
    writer.close()
    with contextlib.suppress(Exception):
        await writer.wait_closed()


@contextlib.asynccontextmanager
async def raw_peer(address: tuple[str, int]) -> AsyncIterator[Streams]:
    """A plain TCP connection to ``address`` that speaks whatever the test writes."""
    reader, writer = await asyncio.open_connection(*address)
    try:
        yield reader, writer
    finally:
        await close_writer(writer)


async def read_to_end(reader: asyncio.StreamReader) -> bytes:
    """Everything until the peer closes (a reset counts as the end)."""
    try:
        return await reader.read()
    except ConnectionError:
        return b""


async def accept_in_background(listener: Any) -> tuple[asyncio.Task[Any], list[Any]]:
    """A task that accepts every connection of ``listener`` into a list."""
    accepted: list[Any] = []

    async def loop() -> None:
        async for conn in listener:
            accepted.append(conn)

    return asyncio.create_task(loop()), accepted


def tls_client_hello() -> bytes:
    """The first bytes a real TLS client sends (its ClientHello record)."""
    context = ssl.create_default_context()
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = context.wrap_bio(incoming, outgoing, server_hostname="127.0.0.1")
    try:
        tls.do_handshake()
    except ssl.SSLWantReadError:
        pass
    return outgoing.read()


# --------------------------------------------------------------------------- by hand


async def hello_by_hand(
    streams: Streams,
    role: int,
    *,
    authkey: bytes | None = None,
    max_gradient_len: int = 1 << 30,
    max_payload_len: int = 1 << 28,
) -> tuple[bytes, bytes]:
    """The hello (and authkey) exchange of side ``role``, written by hand from the
    messages: (client nonce, server nonce)."""
    reader, writer = streams
    auth = p.AUTH_NONE if authkey is None else p.AUTH_KEY
    nonce = bytes([role]) * 32
    own = p.encode_hello(p.Hello(role, auth, nonce, max_gradient_len, max_payload_len))
    writer.write(own)
    theirs = await reader.readexactly(80)
    client, server = (own, theirs) if role == p.ROLE_CLIENT else (theirs, own)
    if authkey is not None:
        writer.write(p.encode_auth(p.auth_tag(authkey, role, client, server)))
        await reader.readexactly(48)
    await writer.drain()
    return p.nonce_of(client), p.nonce_of(server)


def sealed_frames(
    gradient: np.ndarray,
    client_nonce: bytes,
    server_nonce: bytes,
    *,
    direction: int = p.TO_SERVER,
    counter: int = 0,
    chunk_size: int = 1024,
) -> bytes:
    """A gradient's frames as the ``counter``-th transfer of ``direction`` on the
    connection of these nonces seals them (docs/spec/protocol.md), by the reference's
    encoder."""
    transfer = p.transfer_id(client_nonce, server_nonce, direction, counter)
    return ref.GradientStreamSession("s", chunk_size)._encode_frames_sealed(gradient, transfer)


async def frames_by_hand(reader: asyncio.StreamReader) -> list[bytes]:
    """One gradient's frames read from the wire by hand: each frame's 16-byte header (the
    payloads are read and dropped)."""
    headers: list[bytes] = []
    total = None
    while total is None or len(headers) < total:
        header = await reader.readexactly(16)
        _, total, payload_len, _ = struct.unpack("<4I", header)
        await reader.readexactly(payload_len)
        headers.append(header)
    return headers


HostileScript = Callable[[Streams, bytes, bytes], Awaitable[None]]


@contextlib.asynccontextmanager
async def hostile_listener(script: HostileScript) -> AsyncIterator[tuple[str, int]]:
    """A listener that does the server's handshake by hand, then runs ``script(streams,
    client nonce, server nonce)`` on each connection; its address."""
    done: list[asyncio.Task[None]] = []

    async def on_connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        done.append(task)
        try:
            nonces = await hello_by_hand((reader, writer), p.ROLE_SERVER)
            await script((reader, writer), *nonces)
        finally:
            await close_writer(writer)

    server = await asyncio.start_server(on_connection, "127.0.0.1", 0)
    try:
        host, port = server.sockets[0].getsockname()[:2]
        yield host, port
    finally:
        server.close()
        await asyncio.gather(*done, return_exceptions=True)
        await server.wait_closed()


# --------------------------------------------------------------------------- man in the middle


class Proxy:
    """A TCP relay in front of ``target`` that records both directions and, when told,
    XORs one byte of the client's stream at ``edit_at`` with ``edit_xor``."""

    def __init__(
        self, target: tuple[str, int], edit_at: int | None = None, edit_xor: int = 0
    ) -> None:
        self.target = target
        self.edit_at = edit_at
        self.edit_xor = edit_xor
        self.upstream = bytearray()  # client to server
        self.downstream = bytearray()
        self._server: asyncio.Server | None = None
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> tuple[str, int]:
        self._server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        host, port = self._server.sockets[0].getsockname()[:2]
        return host, port

    async def _relay(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        server_r, server_w = await asyncio.open_connection(*self.target)
        up = asyncio.create_task(self._pump(client_r, server_w, self.upstream, edit=True))
        down = asyncio.create_task(self._pump(server_r, client_w, self.downstream, edit=False))
        self._tasks += [up, down]
        await asyncio.gather(up, down, return_exceptions=True)
        await close_writer(client_w)
        await close_writer(server_w)

    async def _pump(
        self, src: asyncio.StreamReader, dst: asyncio.StreamWriter, record: bytearray, edit: bool
    ) -> None:
        try:
            while data := await src.read(65536):
                start = len(record)
                if edit and self.edit_at is not None and start <= self.edit_at < start + len(data):
                    k = self.edit_at - start
                    data = data[:k] + bytes([data[k] ^ self.edit_xor]) + data[k + 1 :]
                record += data
                dst.write(data)
                await dst.drain()
        except ConnectionError:
            pass
        finally:
            with contextlib.suppress(Exception):
                dst.write_eof()

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


def raw_listener(rcvbuf: int | None = None) -> socket.socket:
    """A plain TCP socket listening on 127.0.0.1 (a port of its own), for a hand-made
    peer; ``rcvbuf`` sets its receive buffer (so a sender's socket fills up soon)."""
    server = socket.socket()
    if rcvbuf is not None:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    return server
