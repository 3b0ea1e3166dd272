"""The handshake of a ``"gradstream"`` connection once TCP (and TLS) is up, README
"Protocol" steps 2 and 3: both hellos sent at once and read back with their limits, then,
with an authkey, both tags. Every failure is a ProtocolError, AuthenticationError or
TlsError naming the peer; a peer's bytes are read 16 at a time first and checked before
anything more is read.

Apart from the connection because it ends where transfers begin: what it hands on is a
``Handshake``, the nonces and the peer's limits the transfers are sealed and sized by.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import ssl
from collections.abc import Awaitable, Callable, Iterator
from typing import NamedTuple, TypeVar

from .._io import Stalled, within
from ..errors import (
    Address,
    AuthenticationError,
    GradientStreamError,
    ProtocolError,
    StreamIOError,
    StreamTimeoutError,
    TlsError,
)
from . import _protocol as p
from ._streams import Streams
from ._tls import tls_error

T = TypeVar("T")


class Handshake(NamedTuple):
    """What a finished handshake gives the connection: this side's role, both nonces,
    the peer's hello (its limits) and whether the peer proved the authkey."""

    role: int
    client_nonce: bytes
    server_nonce: bytes
    peer: p.Hello
    authkey_proved: bool


@contextlib.contextmanager
def _as_ours(peer: Address | None) -> Iterator[None]:
    """ssl failures on the way (a TLS 1.3 client learns of a refused certificate only on
    its first read) as TlsError, other socket failures as StreamIOError."""
    try:
        yield
    except ssl.SSLError as exc:
        raise tls_error(exc, peer) from None
    except OSError as exc:
        if isinstance(exc, StreamIOError):
            raise
        raise StreamIOError.from_os_error(exc) from exc


class _Ended(ProtocolError):
    """The end of the connection inside a message: a ProtocolError naming the bytes that
    came (``partial`` of ``wanted``: the message's first 16 when ``head``, else the rest
    its head announced)."""

    def __init__(
        self, expected: str, partial: bytes, wanted: int, head: bool, peer: Address | None
    ) -> None:
        seen = (
            p.describe(partial)
            if head
            else f"the end of the connection {len(partial)} bytes into its last {wanted}"
        )
        super().__init__(expected, seen, peer)
        self.partial = partial
        self.head = head


class _Exchange:
    """One handshake's reads and writes over ``streams``, each wait bounded by
    ``timeout`` (a client's; a listener bounds the whole handshake instead)."""

    def __init__(self, streams: Streams, peer: Address | None, timeout: float | None) -> None:
        self.reader, self.writer = streams
        self.peer = peer
        self.timeout = timeout

    async def _wait(self, awaitable: Awaitable[T]) -> T:
        try:
            return await within(awaitable, self.timeout)
        except Stalled as stalled:
            raise StreamTimeoutError(stalled.limit) from None

    async def send(self, data: bytes) -> None:
        with _as_ours(self.peer):
            self.writer.write(data)
            await self._wait(self.writer.drain())

    async def _exactly(self, n: int, expected: str, head: bool) -> bytes:
        """``n`` bytes: a message's first 16 (``head``; cut short, they are named as
        ``describe`` names them) or the rest its head announced."""
        with _as_ours(self.peer):
            try:
                return await self._wait(self.reader.readexactly(n))
            except asyncio.IncompleteReadError as short:
                raise _Ended(expected, short.partial, n, head, self.peer) from None

    async def message(
        self, check_head: Callable[[bytes, Address | None], int], expected: str
    ) -> bytes:
        """One message: its first 16 bytes, checked, then the rest they announce."""
        head = await self._exactly(p.HEAD_LEN, expected, head=True)
        rest = check_head(head, self.peer)
        return head + await self._exactly(rest, expected, head=False)


def _own_hello(
    role: int, authkey: bytes | None, max_gradient_len: int, max_payload_len: int
) -> bytes:
    auth = p.AUTH_NONE if authkey is None else p.AUTH_KEY
    hello = p.Hello(role, auth, os.urandom(p.NONCE_LEN), max_gradient_len, max_payload_len)
    return p.encode_hello(hello)


def _check_auth_offer(authkey: bytes | None, peer: p.Hello, address: Address | None) -> None:
    if authkey is not None and peer.auth != p.AUTH_KEY:
        raise AuthenticationError(
            "this side requires an authkey and the peer's hello offers none", address
        )
    if authkey is None and peer.auth == p.AUTH_KEY:
        raise AuthenticationError(
            "the peer requires an authkey and this side has none (give authkey=)", address
        )


async def _authenticate(
    exchange: _Exchange, authkey: bytes, role: int, client_hello: bytes, server_hello: bytes
) -> None:
    """Step 3: both tags sent at once, the peer's checked in constant time."""
    other = p.ROLE_SERVER if role == p.ROLE_CLIENT else p.ROLE_CLIENT
    await exchange.send(p.encode_auth(p.auth_tag(authkey, role, client_hello, server_hello)))
    try:
        data = await exchange.message(p.check_auth_head, "an authentication message")
    except _Ended:
        raise AuthenticationError(
            "the peer closed the connection instead of authenticating: it refused this "
            "side's hello or authkey",
            exchange.peer,
        ) from None
    expected = p.auth_tag(authkey, other, client_hello, server_hello)
    if not p.tags_match(expected, p.parse_auth(data, exchange.peer)):
        raise AuthenticationError(
            "the peer's tag does not match: another authkey, or a hello changed on the way",
            exchange.peer,
        )


_A_HELLO = "a gradstream hello"


def _dropped(tls: bool, peer: Address | None) -> GradientStreamError:
    """What a client is told when the listener closes before its hello (with nothing, or
    only a TLS alert record, sent): the listener
    dropped it, and its log says why; the likely reasons, by whether this side speaks
    TLS (a TLS 1.3 client learns only now that its certificate was refused)."""
    if tls:
        return TlsError(
            "the listener closed the connection after the TLS handshake: it requires a "
            "client certificate signed by its ca (give tls=TLS(cert=, key=, ca=)), or "
            "refused this side's",
            peer,
        )
    return ProtocolError(
        _A_HELLO,
        "the end of the connection: the listener dropped this side before its hello (a "
        "TLS listener drops a plaintext client; its log says why)",
        peer,
    )


async def handshake(
    streams: Streams,
    *,
    tls: bool,
    role: int,
    authkey: bytes | None,
    max_gradient_len: int,
    max_payload_len: int,
    peer: Address | None,
    timeout: float | None,
) -> Handshake:
    """Steps 2 and 3 of README "Protocol" for the side of ``role`` (over TLS: ``tls``);
    the limits are the ones this side receives under (its session's)."""
    exchange = _Exchange(streams, peer, timeout)
    own = _own_hello(role, authkey, max_gradient_len, max_payload_len)
    await exchange.send(own)
    try:
        theirs = await exchange.message(p.check_hello_head, _A_HELLO)
    except _Ended as ended:
        # Nothing, or a TLS alert record only: the listener dropped this side.
        if role == p.ROLE_CLIENT and ended.head and ended.partial[:2] in (b"", b"\x15\x03"):
            raise _dropped(tls, peer) from None
        raise
    hello = p.parse_hello(theirs, role, peer)
    _check_auth_offer(authkey, hello, peer)
    client_hello, server_hello = (own, theirs) if role == p.ROLE_CLIENT else (theirs, own)
    if authkey is not None:
        await _authenticate(exchange, authkey, role, client_hello, server_hello)
    nonces = p.nonce_of(client_hello), p.nonce_of(server_hello)
    return Handshake(role, *nonces, hello, authkey is not None)
