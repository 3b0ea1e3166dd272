"""The connection protocol's messages (docs/spec/protocol.md), sans-I/O: the hello, the
key exchange message, the authentication message and the ack, written and strictly read;
what a peer's first 16 bytes are when they are not a hello; the authkey's SPAKE2
exchange (PyPI's pure-Python ``spake2``: its own Ed25519 arithmetic, none of the Rust
crate's) and confirmation tags; the transfer ids; the ack digest, computed from a
transfer's frames as they pass. ``version1_tag`` is the HMAC tag of protocol version 1,
for the tests that play an older peer.

Written from the specification, not from the Rust core (crates/gradstream-core/src/
protocol/), so that the golden tests (connection/test_protocol_golden.py) hold the two to
the same bytes, and the test peer (``support.peer``) speaks the protocol independently of
the product: a reader reads exactly what these functions say (16 bytes first, the rest
only once those are checked) and hands the bytes here.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
from collections.abc import Callable
from typing import NamedTuple

from spake2 import SPAKE2_A, SPAKE2_B  # type: ignore[import-untyped]
from spake2.ed25519_basic import NotOnCurve  # type: ignore[import-untyped]
from spake2.ed25519_group import Ed25519Group  # type: ignore[import-untyped]

from gradstream.errors import Address, AuthenticationError, ProtocolError
from gradstream.reference import HEADER, HEADER_LEN

# --------------------------------------------------------------------------- constants

HELLO_MAGIC = b"GSHL"
PAKE_MAGIC = b"GSPK"
AUTH_MAGIC = b"GSAU"
ACK_MAGIC = b"GSAK"
VERSION = 2
OLD_VERSION = 1  # HMAC tags over the authkey itself: what an older peer speaks
HELLO_LEN = 80  # version 2's hello, all of it (and version 1's)
PAKE_LEN = 48
ELEMENT_LEN = 32
SEED_LEN = 64
AUTH_LEN = 48
ACK_LEN = 56  # without the reason
MAX_REASON_LEN = 1024
HEAD_LEN = 16  # every message's first bytes, checked before the rest is read
NONCE_LEN = 32
TAG_LEN = 32
ID_LEN = 16

# The most total_chunks that describe() takes for a frame header's (2**24 chunks of the
# default 65,536 values: 2**40 values).
FRAME_TOTAL_PLAUSIBLE = 1 << 24

ROLE_CLIENT = 1  # the side that connected
ROLE_SERVER = 2  # the side that accepted
AUTH_NONE = 0
AUTH_KEY = 1  # an authkey: SPAKE2, then confirmation tags
TO_SERVER = 1  # a transfer's direction: from client to server
TO_CLIENT = 2

ACCEPTED = 0
REFUSED = 1

_ROLES = {ROLE_CLIENT: "client", ROLE_SERVER: "server"}
_CLIENT_LABEL = b"gradstream/2 client"
_SERVER_LABEL = b"gradstream/2 server"
_ID_CLIENT = b"gradstream client"  # SPAKE2's identities
_ID_SERVER = b"gradstream server"
_TEST_SEED_LABEL = b"gradstream/2 test scalar"
_TRANSFER_LABEL = b"gradstream/1 transfer"
_DIGEST_LABEL = b"gradstream/1 digest"

# magic, 8 zero bytes, then per message: the hello's version and length...
_HELLO = struct.Struct("<4s8sHHBBH32sQI16s")
# ...the ack's verdict, a zero byte, reason_len, counter and digest.
_ACK = struct.Struct("<4s8sBBHQ32s")
_ZERO8 = bytes(8)

assert _HELLO.size == HELLO_LEN and _ACK.size == ACK_LEN


def role_name(role: int) -> str:
    return _ROLES.get(role, f"role {role}")


# --------------------------------------------------------------------------- foreign bytes

_HTTP_METHODS = (b"GET ", b"HEAD ", b"POST ", b"PUT ", b"DELETE ", b"OPTIONS ", b"PATCH ")
_HTTP_OTHER = (b"CONNECT ", b"TRACE ", b"PRI * HTTP/2")
_MESSAGES = {
    HELLO_MAGIC: "a hello",
    PAKE_MAGIC: "a key exchange message",
    AUTH_MAGIC: "an authentication message",
    ACK_MAGIC: "an ack",
}


def _request_line(data: bytes) -> str:
    """An HTTP request line's start, quoted: the bytes up to the first CR or LF, ``\\``
    and ``'`` escaped by a backslash, bytes outside printable ASCII as ``\\xNN``, in
    single quotes."""
    line = data.split(b"\r", 1)[0].split(b"\n", 1)[0]
    text = "".join(
        "\\" + chr(b) if b in b"\\'" else chr(b) if 0x20 <= b <= 0x7E else f"\\x{b:02x}"
        for b in line
    )
    return f"'{text}'"


def describe(head: bytes) -> str:
    """What a peer sent when its first bytes (up to 16) are not the message awaited: the
    ``seen`` of a ProtocolError."""
    head = head[:HEAD_LEN]
    n = len(head)
    if n == 0:
        return "the end of the connection"
    if n < HEAD_LEN:
        return f"the end of the connection after {n} bytes ({head.hex()})"
    if head.startswith(_HTTP_METHODS + _HTTP_OTHER):
        return f"an HTTP request ({_request_line(head)}...)"
    if head.startswith(b"HTTP/"):
        return (
            f"an HTTP answer ({_request_line(head)}...): the peer is an HTTP server or proxy, "
            "not a gradstream peer"
        )
    if head[:14].lower() == b"<!doctype html":
        return (
            "an HTML page (an HTTP/0.9 answer): the peer is an HTTP server, not a gradstream peer"
        )
    if head[0] == 0x16 and head[1] == 0x03 and head[5] == 0x01:
        return "a TLS ClientHello (a TLS client at a plaintext listener: give both sides tls=)"
    if head[0] == 0x15 and head[1] == 0x03:
        return "a TLS alert (the peer speaks TLS: give both sides tls=)"
    magic = head[:4]
    if magic in _MESSAGES:
        if magic == HELLO_MAGIC and head[4:12] == _ZERO8:
            version, length = struct.unpack_from("<HH", head, 12)
            return f"a hello of version {version} ({length} bytes)"
        return f"{_MESSAGES[magic]} ({head.hex()})"
    frame = _frame_text(head)
    if frame is not None:
        return (
            f"a bare seed frame header ({frame}): an ipfrs-transport peer, or one with "
            "protocol='seed'"
        )
    return f"bytes {head.hex()}"


def _frame_text(head: bytes) -> str | None:
    """The fields of a frame header, when 16 bytes look like one (chunk_index below a
    total_chunks of 1..2**24: more chunks than any real gradient has, and bytes of other
    kinds rarely pass), else None."""
    chunk_index, total, payload_len, checksum = HEADER.unpack(head)
    if not 1 <= total <= FRAME_TOTAL_PLAUSIBLE or chunk_index >= total:
        return None
    return f"chunk {chunk_index} of {total}, payload_len {payload_len}, checksum {checksum:#010x}"


def _foreign(expected: str, head: bytes, peer: Address | None) -> ProtocolError:
    return ProtocolError(expected, describe(head), peer)


def _check_zero(data: bytes, start: int, end: int, what: str, peer: Address | None) -> None:
    if any(data[start:end]):
        raise ProtocolError(
            f"zero bytes at offsets {start}..{end - 1} of {what}",
            f"{data[start:end].hex()}",
            peer,
        )


# --------------------------------------------------------------------------- hello


class Hello(NamedTuple):
    """One side's hello: its role, whether it holds an authkey, its nonce and the limits
    it receives under."""

    role: int
    auth: int
    nonce: bytes
    max_gradient_len: int
    max_payload_len: int


def encode_hello(hello: Hello, version: int = VERSION) -> bytes:
    """``version`` other than VERSION: an older (or newer) peer's hello, for the tests."""
    return _HELLO.pack(
        HELLO_MAGIC,
        _ZERO8,
        version,
        HELLO_LEN,
        hello.role,
        hello.auth,
        0,
        hello.nonce,
        hello.max_gradient_len,
        hello.max_payload_len,
        bytes(16),
    )


_A_HELLO = "a gradstream hello"


def check_hello_head(head: bytes, peer: Address | None, own_version: int = VERSION) -> int:
    """The first 16 bytes of the peer's hello: ProtocolError unless they are a version 2
    hello's (naming the side to upgrade); the number of bytes still to read."""
    if len(head) < HEAD_LEN or head[:4] != HELLO_MAGIC or head[4:12] != _ZERO8:
        raise _foreign(_A_HELLO, head, peer)
    version, length = struct.unpack_from("<HH", head, 12)
    if version != own_version:
        fix = (
            "an older gradstream: upgrade the peer"
            if version < own_version
            else "a newer gradstream: upgrade this side"
        )
        raise ProtocolError(
            f"a hello of version {own_version}", f"a hello of version {version} ({fix})", peer
        )
    if length != HELLO_LEN:
        raise ProtocolError(
            f"a version {own_version} hello of {HELLO_LEN} bytes", f"a length of {length}", peer
        )
    return HELLO_LEN - HEAD_LEN


def parse_hello(data: bytes, role: int, peer: Address | None, own_version: int = VERSION) -> Hello:
    """The peer's whole hello (``check_hello_head`` passed on its first 16 bytes), which
    must come from the other ``role`` than this side's."""
    check_hello_head(data[:HEAD_LEN], peer, own_version)
    if len(data) != HELLO_LEN:
        raise ProtocolError(f"a hello of {HELLO_LEN} bytes", f"{len(data)} bytes", peer)
    fields = _HELLO.unpack(data)
    peer_role, auth, nonce = fields[4], fields[5], fields[7]
    max_gradient_len, max_payload_len = fields[8], fields[9]
    expected_role = ROLE_SERVER if role == ROLE_CLIENT else ROLE_CLIENT
    if peer_role != expected_role:
        raise ProtocolError(
            f"the hello of a {role_name(expected_role)}",
            f"the hello of a {role_name(peer_role)}",
            peer,
        )
    if auth not in (AUTH_NONE, AUTH_KEY):
        raise ProtocolError("auth 0 (none) or 1 (authkey) in the hello", f"auth {auth}", peer)
    _check_zero(data, 18, 20, "the hello", peer)
    _check_zero(data, 64, 80, "the hello", peer)
    return Hello(peer_role, auth, nonce, max_gradient_len, max_payload_len)


def nonce_of(hello: bytes) -> bytes:
    """The nonce of an encoded hello."""
    return hello[20 : 20 + NONCE_LEN]


# --------------------------------------------------------------------------- authentication


def fixed_seed(nonce: bytes) -> bytes:
    """The 64 bytes a side's SPAKE2 scalar is made of when a test fixed its nonce:
    SHA-512("gradstream/2 test scalar" || nonce)."""
    return hashlib.sha512(_TEST_SEED_LABEL + nonce).digest()


class Exchange:
    """One side's SPAKE2 exchange (the client is side A): its element goes out with its
    hello; ``finish`` takes the peer's and gives the session key. ``seed`` fixes the
    scalar (64 bytes, read as a little-endian number modulo the group order, as the
    Rust crate reads its RNG's bytes); else it is fresh from os.urandom."""

    def __init__(self, authkey: bytes, role: int, seed: bytes | None = None) -> None:
        def entropy(n: int) -> bytes:
            if seed is None:
                return os.urandom(n)
            assert n == SEED_LEN == len(seed), n
            return seed[::-1]  # spake2 reads its entropy big-endian

        side = SPAKE2_A if role == ROLE_CLIENT else SPAKE2_B
        self.role = role
        self._spake = side(authkey, idA=_ID_CLIENT, idB=_ID_SERVER, entropy_f=entropy)
        self.element: bytes = self._spake.start()[1:]  # after the side byte

    def message(self) -> bytes:
        return PAKE_MAGIC + bytes(12) + self.element

    def finish(self, peer_element: bytes, peer: Address | None = None) -> bytes:
        """The session key K, from the peer's element (as ``parse_pake`` read it)."""
        if peer_element == self.element:
            raise AuthenticationError(
                "the peer's key exchange message is this side's own, sent back", peer
            )
        side = b"B" if self.role == ROLE_CLIENT else b"A"
        key: bytes = self._spake.finish(side + peer_element)
        return key


def confirm_tag(key: bytes, role: int, client_hello: bytes, server_hello: bytes) -> bytes:
    """The tag the side of ``role`` sends: HMAC-SHA256 under the session key K over its
    role's label and the hash of both hellos (as sent by the client and by the server)."""
    label = _CLIENT_LABEL if role == ROLE_CLIENT else _SERVER_LABEL
    hellos = hashlib.sha256(client_hello + server_hello).digest()
    return hmac.new(key, label + hellos, "sha256").digest()


def version1_tag(authkey: bytes, role: int, client_hello: bytes, server_hello: bytes) -> bytes:
    """Protocol version 1's tag, HMAC-SHA256 under the authkey itself over its role's
    label, both nonces and the hash of both hellos: what an older peer sends, and what
    one recorded tag let anyone test guessed keys against, offline."""
    label = b"gradstream/1 client" if role == ROLE_CLIENT else b"gradstream/1 server"
    nonces = nonce_of(client_hello) + nonce_of(server_hello)
    hellos = hashlib.sha256(client_hello + server_hello).digest()
    return hmac.new(authkey, label + nonces + hellos, "sha256").digest()


_A_PAKE = "a key exchange message"


def _check_keyed_head(head: bytes, magic: bytes, what: str, peer: Address | None) -> None:
    """A key exchange or authentication message's first 16 bytes: its magic, 12 zeros."""
    if len(head) < HEAD_LEN or head[:4] != magic:
        raise _foreign(what, head, peer)
    _check_zero(head, 4, 16, what, peer)


def check_pake_head(head: bytes, peer: Address | None) -> int:
    """The first 16 bytes of the peer's key exchange message; the bytes still to read."""
    _check_keyed_head(head, PAKE_MAGIC, _A_PAKE, peer)
    return PAKE_LEN - HEAD_LEN


def parse_pake(data: bytes, peer: Address | None) -> bytes:
    """The element of a whole key exchange message: a point of Ed25519's prime-order
    group, not the neutral element (spake2's own strict reading)."""
    check_pake_head(data[:HEAD_LEN], peer)
    element = data[HEAD_LEN:PAKE_LEN]
    try:
        Ed25519Group.bytes_to_element(element)
    except (ValueError, NotOnCurve) as exc:
        raise ProtocolError(
            "a point of Ed25519's prime-order group in a key exchange message",
            f"bytes {element.hex()}",
            peer,
        ) from exc
    return element


def encode_auth(tag: bytes) -> bytes:
    return AUTH_MAGIC + bytes(12) + tag


_AN_AUTH = "an authentication message"


def check_auth_head(head: bytes, peer: Address | None) -> int:
    """The first 16 bytes of the peer's authentication message; the bytes still to read."""
    _check_keyed_head(head, AUTH_MAGIC, _AN_AUTH, peer)
    return AUTH_LEN - HEAD_LEN


def parse_auth(data: bytes, peer: Address | None) -> bytes:
    """The tag of a whole authentication message."""
    check_auth_head(data[:HEAD_LEN], peer)
    return data[HEAD_LEN:AUTH_LEN]


def tags_match(expected: bytes, received: bytes) -> bool:
    """Constant time, so the time taken says nothing of how much of a tag was right."""
    return hmac.compare_digest(expected, received)


# --------------------------------------------------------------------------- transfers


def transfer_id(client_nonce: bytes, server_nonce: bytes, direction: int, counter: int) -> bytes:
    """The id of a direction's ``counter``-th transfer (from 0) on a connection."""
    data = _TRANSFER_LABEL + client_nonce + server_nonce + bytes([direction])
    return hashlib.sha256(data + struct.pack("<Q", counter)).digest()[:ID_LEN]


class FrameDigest:
    """The ack digest of one transfer: SHA-256 of the label, the transfer id and every
    frame's 16-byte header in the order they pass, fed with the transfer's bytes as they
    are written or read (in pieces of any size).

    ``on_header`` sees each header's four fields as soon as it is whole, before the
    piece it ends in goes on (a sender refuses there a payload over the peer's limit).
    """

    def __init__(
        self,
        transfer: bytes,
        on_header: Callable[[int, int, int, int], None] | None = None,
    ) -> None:
        self._hash = _digest_start(transfer)
        self._on_header = on_header
        self._header = bytearray()  # the header being read
        self._skip = 0  # payload bytes still to pass
        self.moved = 0  # bytes seen
        self.headers = 0  # headers seen whole
        self.first_frame = 0  # bytes of the first frame (a tensor set's manifest), once seen

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        view = memoryview(data).cast("B")
        size = len(view)
        while len(view):
            if self._skip:
                step = min(self._skip, len(view))
                self._skip -= step
                view = view[step:]
                continue
            step = min(HEADER_LEN - len(self._header), len(view))
            self._header += view[:step]
            view = view[step:]
            if len(self._header) == HEADER_LEN:
                fields = HEADER.unpack(self._header)
                if self._on_header is not None:
                    self._on_header(*fields)
                self._hash.update(self._header)
                self._header.clear()
                self._skip = fields[2]
                if not self.headers:
                    self.first_frame = HEADER_LEN + fields[2]
                self.headers += 1
        # Counted once the piece has passed: a piece refused by on_header never moved.
        self.moved += size

    def digest(self) -> bytes:
        return self._hash.digest()


def _digest_start(transfer: bytes) -> hashlib._Hash:
    return hashlib.sha256(_DIGEST_LABEL + transfer)


def ack_digest(transfer: bytes, headers: list[bytes]) -> bytes:
    """The digest over a transfer's headers given whole."""
    digest = _digest_start(transfer)
    for header in headers:
        digest.update(header)
    return digest.digest()


# --------------------------------------------------------------------------- ack


class Ack(NamedTuple):
    """A receiver's verdict on one transfer: ``reason`` is None when accepted."""

    counter: int
    digest: bytes
    reason: str | None


def _reason_bytes(reason: str) -> bytes:
    """``reason`` as UTF-8, cut (at a character) to MAX_REASON_LEN bytes."""
    data = reason.encode("utf-8")
    if len(data) <= MAX_REASON_LEN:
        return data
    return data[:MAX_REASON_LEN].decode("utf-8", "ignore").encode("utf-8")


def encode_ack(ack: Ack) -> bytes:
    if ack.reason is None:
        return _ACK.pack(ACK_MAGIC, _ZERO8, ACCEPTED, 0, 0, ack.counter, ack.digest)
    reason = _reason_bytes(ack.reason)
    head = _ACK.pack(ACK_MAGIC, _ZERO8, REFUSED, 0, len(reason), ack.counter, bytes(32))
    return head + reason


_AN_ACK = "an ack"


def check_ack_head(head: bytes, peer: Address | None) -> int:
    """The first 16 bytes of the peer's ack; the bytes still to read (the rest of the ack
    and its reason, at most MAX_REASON_LEN)."""
    if len(head) < HEAD_LEN or head[:4] != ACK_MAGIC or head[4:12] != _ZERO8:
        frame = _frame_text(head) if len(head) == HEAD_LEN else None
        if frame is None:
            raise _foreign(_AN_ACK, head, peer)
        raise ProtocolError(
            _AN_ACK,
            f"a frame header ({frame}): the peer started a transfer while this side waited "
            "for its ack; open a second connection for the other direction",
            peer,
        )
    verdict, _, reason_len = struct.unpack_from("<BBH", head, 12)
    if verdict not in (ACCEPTED, REFUSED):
        raise ProtocolError(
            "verdict 0 (accepted) or 1 (refused) in an ack", f"verdict {verdict}", peer
        )
    _check_zero(head, 13, 14, _AN_ACK, peer)
    if reason_len > MAX_REASON_LEN:
        raise ProtocolError(
            f"an ack's reason of at most {MAX_REASON_LEN} bytes", f"{reason_len} bytes", peer
        )
    if verdict == ACCEPTED and reason_len:
        raise ProtocolError("no reason in an accepting ack", f"{reason_len} bytes of reason", peer)
    return ACK_LEN - HEAD_LEN + int(reason_len)


def parse_ack(data: bytes, peer: Address | None) -> Ack:
    """A whole ack (``check_ack_head`` passed on its first 16 bytes)."""
    rest = check_ack_head(data[:HEAD_LEN], peer)
    if len(data) != HEAD_LEN + rest:
        raise ProtocolError(f"an ack of {HEAD_LEN + rest} bytes", f"{len(data)} bytes", peer)
    _, _, verdict, _, _, counter, digest = _ACK.unpack_from(data)
    if verdict == ACCEPTED:
        return Ack(counter, digest, None)
    if any(digest):
        raise ProtocolError("a zero digest in a refusal", f"digest {digest.hex()}", peer)
    try:
        reason = data[ACK_LEN:].decode("utf-8")
    except UnicodeDecodeError:
        raise ProtocolError(
            "a UTF-8 reason in a refusal", f"bytes {data[ACK_LEN:].hex()}", peer
        ) from None
    return Ack(counter, digest, reason)
