"""A client of several streams written from docs/spec/protocol.md "Several streams" in
Python alone (the tests' own SPAKE2 and seals, no native code): the version 3 hellos,
the session secret, the grant and the join proofs. The tests drive it where the native
dialler would never go: lanes written by hand, streams closed one by one."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import os
import struct
from dataclasses import dataclass, field

import numpy as np

from support.connections import KEY, sealed_frames
from support.peer import messages as p


def _sha(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


@dataclass
class Stream:
    """One connection through its handshake: its ends, its hellos and SPAKE2's key."""

    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    client_hello: bytes
    server_hello: bytes
    key: bytes
    granted: int = 0
    secret: bytes = b""
    session: bytes = b""
    joins: list[Stream] = field(default_factory=list)

    @property
    def nonces(self) -> tuple[bytes, bytes]:
        return p.nonce_of(self.client_hello), p.nonce_of(self.server_hello)


async def _shake(address: tuple[str, int], intent: int, count: int, session: bytes) -> Stream:
    reader, writer = await asyncio.open_connection(*address)
    hello = bytearray(
        p.encode_hello(p.Hello(p.ROLE_CLIENT, p.AUTH_KEY, os.urandom(32), 1 << 30, 1 << 28))
    )
    hello[12], hello[18], hello[19] = 3, intent, count  # version 3: open or join
    hello[64:80] = session
    exchange = p.Exchange(KEY, p.ROLE_CLIENT)
    writer.write(bytes(hello) + exchange.message())
    server_hello = await reader.readexactly(80)
    element = await reader.readexactly(48)
    key = exchange.finish(element[16:48])
    writer.write(p.encode_auth(p.confirm_tag(key, p.ROLE_CLIENT, bytes(hello), server_hello)))
    await reader.readexactly(48)  # the listener's tag
    return Stream(reader, writer, bytes(hello), server_hello, key)


async def open_streams(address: tuple[str, int], streams: int) -> Stream:
    """Open a connection of ``streams`` streams and join every stream granted."""
    first = await _shake(address, 1, streams, bytes(16))
    grant = await first.reader.readexactly(32)
    assert grant[:4] == b"GSST", grant
    first.granted = grant[16]
    hellos = _sha(first.client_hello + first.server_hello)
    first.secret = hmac.new(first.key, b"gradstream/3 session" + hellos, "sha256").digest()
    first.session = hmac.new(first.secret, b"gradstream/3 session id", "sha256").digest()[:16]
    for index in range(1, first.granted):
        first.joins.append(await join(address, first, index))
    return first


async def join(address: tuple[str, int], first: Stream, index: int) -> Stream:
    """Join ``first``'s session as stream ``index``, the listener's proof checked
    (``asyncio.IncompleteReadError`` when it closes instead)."""
    joining = await _shake(address, 2, index, first.session)
    tagged = bytes([index]) + _sha(joining.client_hello + joining.server_hello)
    tag = hmac.new(first.secret, b"gradstream/3 join client" + tagged, "sha256").digest()
    joining.writer.write(b"GSJN" + bytes(12) + tag)
    answer = await joining.reader.readexactly(48)
    server = hmac.new(first.secret, b"gradstream/3 join server" + tagged, "sha256").digest()
    assert answer == b"GSJN" + bytes(12) + server, "the listener's proof"
    return joining


def frames_of(gradient: np.ndarray, first: Stream, chunk_size: int = 1024) -> list[bytes]:
    """The gradient's frames, sealed as the connection's first transfer to the listener."""
    data = sealed_frames(gradient, *first.nonces, chunk_size=chunk_size)
    out, at = [], 0
    while at < len(data):
        (length,) = struct.unpack_from("<I", data, at + 8)
        out.append(data[at : at + 16 + length])
        at += 16 + length
    return out
