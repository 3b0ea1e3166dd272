"""The protocol's messages (docs/spec/protocol.md) of each implementation behind one
small interface, ``Codec``, so the golden tests (connection/test_protocol_golden.py) hold
both to the same bytes and the same refusals: the test peer's (``support.peer.messages``,
``PEER``) and the core's, through the extension's ``_protocol_*`` functions
(``NATIVE``)."""

from __future__ import annotations

from typing import Protocol

from gradstream import _native
from support.peer import messages as p

# (role, auth, nonce, max_gradient_len, max_payload_len)
HelloFields = tuple[int, int, bytes, int, int]
# (counter, digest, reason or None)
AckFields = tuple[int, bytes, str | None]


class Codec(Protocol):
    name: str

    def hello(
        self, role: int, auth: int, nonce: bytes, max_gradient_len: int, max_payload_len: int
    ) -> bytes: ...
    def hello_rest(self, head: bytes) -> int: ...
    def read_hello(self, data: bytes, own_role: int) -> HelloFields: ...
    def pake(self, key: bytes, role: int, seed: bytes) -> bytes: ...
    def read_pake(self, data: bytes) -> bytes: ...
    def auth(
        self,
        key: bytes,
        role: int,
        seed: bytes,
        peer_pake: bytes,
        client_hello: bytes,
        server_hello: bytes,
    ) -> bytes: ...
    def read_auth(self, data: bytes) -> bytes: ...
    def transfer_id(self, client: bytes, server: bytes, direction: int, counter: int) -> bytes: ...
    def digest(self, transfer: bytes, headers: list[bytes]) -> bytes: ...
    def digest_of_stream(self, transfer: bytes, pieces: list[bytes]) -> bytes: ...
    def ack(self, counter: int, digest: bytes, reason: str | None) -> bytes: ...
    def ack_rest(self, head: bytes) -> int: ...
    def read_ack(self, data: bytes) -> AckFields: ...
    def describe(self, head: bytes) -> str: ...


class PeerCodec:
    name = "peer"

    def hello(
        self, role: int, auth: int, nonce: bytes, max_gradient_len: int, max_payload_len: int
    ) -> bytes:
        return p.encode_hello(p.Hello(role, auth, nonce, max_gradient_len, max_payload_len))

    def hello_rest(self, head: bytes) -> int:
        return p.check_hello_head(head, None)

    def read_hello(self, data: bytes, own_role: int) -> HelloFields:
        return tuple(p.parse_hello(data, own_role, None))  # type: ignore[return-value]

    def pake(self, key: bytes, role: int, seed: bytes) -> bytes:
        return p.Exchange(key, role, seed).message()

    def read_pake(self, data: bytes) -> bytes:
        return p.parse_pake(data, None)

    def auth(
        self,
        key: bytes,
        role: int,
        seed: bytes,
        peer_pake: bytes,
        client_hello: bytes,
        server_hello: bytes,
    ) -> bytes:
        session_key = p.Exchange(key, role, seed).finish(p.parse_pake(peer_pake, None))
        return p.encode_auth(p.confirm_tag(session_key, role, client_hello, server_hello))

    def read_auth(self, data: bytes) -> bytes:
        return p.parse_auth(data, None)

    def transfer_id(self, client: bytes, server: bytes, direction: int, counter: int) -> bytes:
        return p.transfer_id(client, server, direction, counter)

    def digest(self, transfer: bytes, headers: list[bytes]) -> bytes:
        return p.ack_digest(transfer, headers)

    def digest_of_stream(self, transfer: bytes, pieces: list[bytes]) -> bytes:
        tap = p.FrameDigest(transfer)
        for piece in pieces:
            tap.feed(piece)
        return tap.digest()

    def ack(self, counter: int, digest: bytes, reason: str | None) -> bytes:
        return p.encode_ack(p.Ack(counter, digest, reason))

    def ack_rest(self, head: bytes) -> int:
        return p.check_ack_head(head, None)

    def read_ack(self, data: bytes) -> AckFields:
        return tuple(p.parse_ack(data, None))  # type: ignore[return-value]

    def describe(self, head: bytes) -> str:
        return p.describe(head)


class NativeCodec:
    name = "native"

    def hello(
        self, role: int, auth: int, nonce: bytes, max_gradient_len: int, max_payload_len: int
    ) -> bytes:
        return _native._protocol_hello(role, bool(auth), nonce, max_gradient_len, max_payload_len)

    def hello_rest(self, head: bytes) -> int:
        return _native._protocol_hello_rest(head)

    def read_hello(self, data: bytes, own_role: int) -> HelloFields:
        return _native._protocol_read_hello(data, own_role)

    def pake(self, key: bytes, role: int, seed: bytes) -> bytes:
        return _native._protocol_pake(key, role, seed)

    def read_pake(self, data: bytes) -> bytes:
        return _native._protocol_read_pake(data)

    def auth(
        self,
        key: bytes,
        role: int,
        seed: bytes,
        peer_pake: bytes,
        client_hello: bytes,
        server_hello: bytes,
    ) -> bytes:
        return _native._protocol_auth(key, role, seed, peer_pake, client_hello, server_hello)

    def read_auth(self, data: bytes) -> bytes:
        return _native._protocol_read_auth(data)

    def transfer_id(self, client: bytes, server: bytes, direction: int, counter: int) -> bytes:
        return _native._protocol_transfer_id(client, server, direction, counter)

    def digest(self, transfer: bytes, headers: list[bytes]) -> bytes:
        return _native._protocol_digest(transfer, headers)

    def digest_of_stream(self, transfer: bytes, pieces: list[bytes]) -> bytes:
        return _native._protocol_digest_of_stream(transfer, pieces)

    def ack(self, counter: int, digest: bytes, reason: str | None) -> bytes:
        return _native._protocol_ack(counter, digest, reason)

    def ack_rest(self, head: bytes) -> int:
        return _native._protocol_ack_rest(head)

    def read_ack(self, data: bytes) -> AckFields:
        return _native._protocol_read_ack(data)

    def describe(self, head: bytes) -> str:
        return _native._protocol_describe(head)


PEER = PeerCodec()
NATIVE = NativeCodec()
CODECS: list[Codec] = [PEER, NATIVE]
