"""An independent gradstream protocol peer for the tests (docs/spec/protocol.md): the
other side of a connection whose one side is the product, written from the
specification and sharing none of the product's connection code. The connection tests
put it against the native listener and the native dialler, plain, with an authkey and
over TLS; the hostile-peer tests speak its messages by hand; the session vectors are
recorded with it.

    messages   the protocol's messages, sans-I/O: hello, auth, ack, ids, digests
    machine    one side of a connection as a sans-I/O state machine (bytes in, bytes
               out), its frames by the pure-Python reference codec
    driver     the machine over asyncio streams, plain or TLS: ``listen``, ``connect``
               and ``serve``, with the connection calls the tests make
    sessions   whole plaintext sessions between two machines with fixed nonces: the
               vectors tests/connection/vectors/sessions.json holds

This package re-exports the driver, so ``from support import peer`` reads like the
product: ``await peer.listen(...)``, ``peer.GradientStreamSession(...)``.
"""

from .driver import (
    Connection,
    GradientStreamSession,
    Listener,
    PeerInfo,
    Server,
    connect,
    listen,
    serve,
)

__all__ = [
    "Connection",
    "GradientStreamSession",
    "Listener",
    "PeerInfo",
    "Server",
    "connect",
    "listen",
    "serve",
]
