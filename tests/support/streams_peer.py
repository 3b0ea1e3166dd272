"""A client of several streams written from docs/spec/protocol.md "Several streams" and
"Resume" in Python alone (the tests' own SPAKE2 and seals, no native code): the version
3 hellos, the session secret, the grant, the join and resume proofs, the resume message.
The tests drive it where the native dialler would never go: lanes written by hand,
streams closed one by one, resumes with lies in them."""

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
    resumes: bool = False
    secret: bytes = b""
    session: bytes = b""
    joins: list[Stream] = field(default_factory=list)

    @property
    def nonces(self) -> tuple[bytes, bytes]:
        return p.nonce_of(self.client_hello), p.nonce_of(self.server_hello)


async def _shake(
    address: tuple[str, int], intent: int, count: int, session: bytes, key: bytes = KEY
) -> Stream:
    reader, writer = await asyncio.open_connection(*address)
    hello = bytearray(
        p.encode_hello(p.Hello(p.ROLE_CLIENT, p.AUTH_KEY, os.urandom(32), 1 << 30, 1 << 28))
    )
    hello[12], hello[18], hello[19] = 3, intent, count  # version 3: open, join or resume
    hello[64:80] = session
    exchange = p.Exchange(key, p.ROLE_CLIENT)
    writer.write(bytes(hello) + exchange.message())
    server_hello = await reader.readexactly(80)
    element = await reader.readexactly(48)
    key = exchange.finish(element[16:48])
    writer.write(p.encode_auth(p.confirm_tag(key, p.ROLE_CLIENT, bytes(hello), server_hello)))
    await reader.readexactly(48)  # the listener's tag
    return Stream(reader, writer, bytes(hello), server_hello, key)


async def open_streams(address: tuple[str, int], streams: int, resume: bool = False) -> Stream:
    """Open a connection of ``streams`` streams (asking to resume when ``resume``) and
    join every stream granted."""
    first = await _shake(address, 1, streams, bytes([int(resume)]) + bytes(15))
    grant = await first.reader.readexactly(32)
    assert grant[:4] == b"GSST", grant
    first.granted, first.resumes = grant[16], grant[17] == 1
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


async def resume(
    address: tuple[str, int],
    first: Stream,
    index: int,
    secret: bytes | None = None,
    key: bytes = KEY,
) -> Stream:
    """Dial stream ``index`` of ``first``'s session again (with the authkey ``key``),
    proven with ``secret`` (the session's unless given), the listener's proof checked
    (``asyncio.IncompleteReadError`` when it closes instead)."""
    secret = first.secret if secret is None else secret
    resuming = await _shake(address, 3, index, first.session, key)
    tagged = bytes([index]) + _sha(resuming.client_hello + resuming.server_hello)
    tag = hmac.new(secret, b"gradstream/3 resume client" + tagged, "sha256").digest()
    resuming.writer.write(b"GSJN" + bytes(12) + tag)
    answer = await resuming.reader.readexactly(48)
    server = hmac.new(secret, b"gradstream/3 resume server" + tagged, "sha256").digest()
    assert answer == b"GSJN" + bytes(12) + server, "the listener's proof"
    return resuming


def resume_message(received: int, digest: bytes, held: list[tuple[int, int]]) -> bytes:
    """A resume message: transfers taken, the last one's digest, the chunks held."""
    ranges = b"".join(struct.pack("<II", first, end) for first, end in held)
    head = b"GSRS" + bytes(12) + struct.pack("<Q", received) + digest
    return head + struct.pack("<I", len(held)) + bytes(4) + ranges


async def read_resume_message(
    reader: asyncio.StreamReader,
) -> tuple[int, bytes, list[tuple[int, int]]]:
    """The listener's resume message: (transfers taken, digest, held ranges)."""
    head = await reader.readexactly(64)
    assert head[:4] == b"GSRS" and head[4:16] == bytes(12) and head[60:64] == bytes(4), head
    (received,) = struct.unpack_from("<Q", head, 16)
    (count,) = struct.unpack_from("<I", head, 56)
    ranges = await reader.readexactly(8 * count)
    held = [struct.unpack_from("<II", ranges, 8 * i) for i in range(count)]
    return received, head[24:56], [(a, b) for a, b in held]


def digest_of(first: Stream, frames: list[bytes], counter: int = 0) -> bytes:
    """The ack digest of the client's transfer ``counter`` made of ``frames``."""
    transfer = p.transfer_id(*first.nonces, p.TO_SERVER, counter)
    headers = b"".join(frame[:16] for frame in sorted(frames, key=_index))
    return hashlib.sha256(b"gradstream/1 digest" + transfer + headers).digest()


def _index(frame: bytes) -> int:
    (index,) = struct.unpack_from("<I", frame, 0)
    return int(index)


def frames_of(
    gradient: np.ndarray, first: Stream, chunk_size: int = 1024, counter: int = 0
) -> list[bytes]:
    """The gradient's frames, sealed as the connection's transfer ``counter`` (the first
    by default) to the listener."""
    data = sealed_frames(gradient, *first.nonces, chunk_size=chunk_size, counter=counter)
    out, at = [], 0
    while at < len(data):
        (length,) = struct.unpack_from("<I", data, at + 8)
        out.append(data[at : at + 16 + length])
        at += 16 + length
    return out
