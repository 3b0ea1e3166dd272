"""Sockets that cannot carry frames, refused alike by every entry point of both
implementations, before a byte moves.

An ``ssl.SSLSocket`` is a ``socket.socket`` whose descriptor carries TLS records: frames
written to its descriptor would go out in plaintext beneath the TLS session, and frames
read from it would be ciphertext (TLS over asyncio streams is the way). A datagram
socket has no byte stream to frame."""

from __future__ import annotations

import socket
import ssl
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import numpy as np
import pytest

from gradstream._checks import SSL_SOCKET_REFUSED
from support.aio import run

MESSAGE = SSL_SOCKET_REFUSED


@pytest.fixture
def tls_pair() -> Iterator[tuple[ssl.SSLSocket, socket.socket]]:
    a, b = socket.socketpair()
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    # No handshake: wrapping is enough to make an SSLSocket, and no certificate is needed.
    wrapped = context.wrap_socket(a, server_hostname="peer", do_handshake_on_connect=False)
    try:
        yield wrapped, b
    finally:
        wrapped.close()
        b.close()


CALLS = {
    "stream_to": lambda s, sock: s.stream_to(np.ones(8, np.float32), sock),
    "receive_from": lambda s, sock: s.receive_from(sock),
    "receive_from_out": lambda s, sock: s.receive_from(sock, out=np.zeros(8, np.float32)),
    "stream_tensors": lambda s, sock: s.stream_tensors({"w": np.ones(3, np.float32)}, sock),
    "receive_tensors": lambda s, sock: s.receive_tensors(sock),
}


@pytest.mark.parametrize("call", sorted(CALLS))
def test_every_entry_point_refuses_a_tls_socket(
    impl: ModuleType, tls_pair: tuple[ssl.SSLSocket, socket.socket], call: str
) -> None:
    tls, peer = tls_pair
    session = impl.GradientStreamSession("tls", 4)

    async def main() -> Any:
        return await CALLS[call](session, tls)

    with pytest.raises(TypeError) as caught:
        run(main)
    assert str(caught.value) == MESSAGE
    # Nothing went out beneath the TLS session.
    peer.setblocking(False)
    with pytest.raises(BlockingIOError):
        peer.recv(1)


def test_receive_iter_refuses_a_tls_socket(
    impl: ModuleType, tls_pair: tuple[ssl.SSLSocket, socket.socket]
) -> None:
    tls, _ = tls_pair
    session = impl.GradientStreamSession("tls", 4)

    async def main() -> list[Any]:
        return [g async for g in session.receive_iter(tls)]

    with pytest.raises(TypeError) as caught:
        run(main)
    assert str(caught.value) == MESSAGE


@pytest.mark.parametrize("call", sorted(CALLS))
def test_a_datagram_socket_is_refused_with_one_message(impl: ModuleType, call: str) -> None:
    session = impl.GradientStreamSession("udp", 4)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:

        async def main() -> Any:
            return await CALLS[call](session, udp)

        with pytest.raises(ValueError) as caught:
            run(main)
    assert str(caught.value) == (
        f"stream must be a connected stream socket (SOCK_STREAM), not {socket.SOCK_DGRAM!r}"
    )
