"""The protocol's bytes, pinned to docs/spec/protocol.md and its test vectors
(connection/vectors/messages.json, written by support/peer/vectors.py): the hello, the
key exchange and authentication messages, the transfer ids, the ack and its digest, and
the strict reading of each (what a peer may not send, refused from its first 16 bytes).

Each test takes a ``codec``: the messages of one implementation behind the small
interface of ``support.protocol``, the test peer's (``support.peer.messages``, over
PyPI's pure-Python ``spake2``) and the core's (over RustCrypto's ``spake2``); both must
give the same bytes and the same refusals, so the two SPAKE2 implementations agree byte
for byte: the same scalar gives the same element, the same key and the same tags, and
each side of one finishes an exchange with the other. Whole sessions of these messages,
replayed against the native side, are test_protocol_sessions.py's.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import gradstream.reference as ref
from gradstream.errors import AuthenticationError, ProtocolError
from support.connections import tls_client_hello
from support.peer import messages as p
from support.peer import vectors
from support.protocol import CODECS, NATIVE, PEER, Codec

VECTORS = vectors.load()


def _hex(name: str) -> bytes:
    return bytes.fromhex(VECTORS[name])


CLIENT_NONCE = _hex("client_nonce")
SERVER_NONCE = _hex("server_nonce")
KEY = _hex("authkey")
MAX_GRADIENT_LEN = VECTORS["max_gradient_len"]
MAX_PAYLOAD_LEN = VECTORS["max_payload_len"]
CLIENT_SEED, SERVER_SEED = _hex("client_seed"), _hex("server_seed")
CLIENT_HELLO, SERVER_HELLO = _hex("client_hello"), _hex("server_hello")
CLIENT_PAKE, SERVER_PAKE = _hex("client_pake"), _hex("server_pake")
CLIENT_AUTH, SERVER_AUTH = _hex("client_auth"), _hex("server_auth")
IDS = {tuple(map(int, k.split(","))): v for k, v in VECTORS["transfer_ids"].items()}
HEADERS = [bytes.fromhex(h) for h in VECTORS["headers"]]
ACK = _hex("ack")
REASON = VECTORS["reason"]
REFUSAL = _hex("refusal")

pytestmark = pytest.mark.parametrize("codec", CODECS, ids=[c.name for c in CODECS])


def client_hello(codec: Codec, **changes: int) -> bytes:
    fields = {"role": 1, "auth": 1, "max_gradient_len": MAX_GRADIENT_LEN}
    fields.update(changes)
    return codec.hello(
        fields["role"], fields["auth"], CLIENT_NONCE, fields["max_gradient_len"], MAX_PAYLOAD_LEN
    )


def edited(data: bytes, offset: int, value: int) -> bytes:
    return data[:offset] + bytes([value]) + data[offset + 1 :]


def auth(
    codec: Codec, role: int, hellos: tuple[bytes, bytes] = (CLIENT_HELLO, SERVER_HELLO)
) -> bytes:
    """The vectors' auth message of ``role`` by ``codec``, over ``hellos``."""
    seed, peer_pake = (CLIENT_SEED, SERVER_PAKE) if role == 1 else (SERVER_SEED, CLIENT_PAKE)
    return codec.auth(KEY, role, seed, peer_pake, *hellos)


# --------------------------------------------------------------------------- the vectors


def test_the_vectors_are_what_the_script_writes(codec: Codec) -> None:
    assert vectors.text(vectors.messages()) == vectors.MESSAGES.read_text()


def test_the_hellos_are_the_vectors(codec: Codec) -> None:
    assert client_hello(codec) == CLIENT_HELLO
    assert codec.hello(2, 1, SERVER_NONCE, MAX_GRADIENT_LEN, MAX_PAYLOAD_LEN) == SERVER_HELLO
    assert len(CLIENT_HELLO) == 80
    assert struct.unpack_from("<H", CLIENT_HELLO, 12) == (2,)  # the version
    # Bytes 4-11 zero: an ipfrs-transport receiver reads total_chunks 0, payload_len 0.
    assert struct.unpack_from("<II", CLIENT_HELLO, 4) == (0, 0)


def test_the_hellos_read_back(codec: Codec) -> None:
    assert codec.read_hello(CLIENT_HELLO, 2) == (
        1,
        1,
        CLIENT_NONCE,
        MAX_GRADIENT_LEN,
        MAX_PAYLOAD_LEN,
    )
    assert codec.read_hello(SERVER_HELLO, 1) == (
        2,
        1,
        SERVER_NONCE,
        MAX_GRADIENT_LEN,
        MAX_PAYLOAD_LEN,
    )


def test_the_key_exchange_messages_are_the_vectors(codec: Codec) -> None:
    assert codec.pake(KEY, 1, CLIENT_SEED) == CLIENT_PAKE
    assert codec.pake(KEY, 2, SERVER_SEED) == SERVER_PAKE
    assert codec.read_pake(CLIENT_PAKE) == CLIENT_PAKE[16:]
    # The seeds are SHA-512 of a label and the nonce (the replays' fixed scalars).
    assert CLIENT_SEED == hashlib.sha512(b"gradstream/2 test scalar" + CLIENT_NONCE).digest()


def test_the_auth_messages_are_the_vectors(codec: Codec) -> None:
    assert auth(codec, 1) == CLIENT_AUTH
    assert auth(codec, 2) == SERVER_AUTH
    assert codec.read_auth(CLIENT_AUTH) == CLIENT_AUTH[16:]


def test_the_transfer_ids_are_the_vectors(codec: Codec) -> None:
    for (direction, counter), expected in IDS.items():
        assert codec.transfer_id(CLIENT_NONCE, SERVER_NONCE, direction, counter).hex() == expected


def test_the_acks_are_the_vectors(codec: Codec) -> None:
    tid = bytes.fromhex(IDS[(1, 0)])
    digest = codec.digest(tid, HEADERS)
    assert codec.ack(0, digest, None) == ACK
    assert codec.ack(0, digest, REASON) == REFUSAL
    assert codec.read_ack(ACK) == (0, digest, None)
    assert codec.read_ack(REFUSAL) == (0, bytes(32), REASON)


# --------------------------------------------------------------------------- SPAKE2, both ways


def test_each_implementation_finishes_an_exchange_with_the_other(codec: Codec) -> None:
    # Fresh seeds: this codec's client against the other's server, and back; both sides
    # get the same key, so each accepts the other's tag.
    other = NATIVE if codec is PEER else PEER
    for client, server in [(codec, other), (other, codec)]:
        key = os.urandom(20)
        seeds = os.urandom(64), os.urandom(64)
        pakes = client.pake(key, 1, seeds[0]), server.pake(key, 2, seeds[1])
        assert pakes[0] != CLIENT_PAKE and len(pakes[0]) == len(pakes[1]) == 48
        hellos = CLIENT_HELLO, SERVER_HELLO
        for role, side in [(1, client), (2, server)]:
            mine = side.auth(key, role, seeds[role - 1], pakes[2 - role], *hellos)
            theirs = (server if side is client else client).auth(
                key, role, seeds[role - 1], pakes[2 - role], *hellos
            )
            assert mine == theirs, role


def test_a_session_key_is_the_spake2_transcript_hash(codec: Codec) -> None:
    # K = SHA-256(SHA-256(authkey) || SHA-256(idA) || SHA-256(idB) || X || Y || Z), the
    # tags HMAC-SHA256(K, label || SHA-256(hellos)): the vectors' K gives both tags.
    key = _hex("session_key")
    for role, expected in [(1, CLIENT_AUTH), (2, SERVER_AUTH)]:
        assert p.encode_auth(p.confirm_tag(key, role, CLIENT_HELLO, SERVER_HELLO)) == expected


# --------------------------------------------------------------------------- what the tags bind


def test_every_hello_byte_is_under_both_tags(codec: Codec) -> None:
    # A man in the middle who edits any byte of either hello (a limit, a nonce, the
    # version) changes both tags, so the side that holds the key notices.
    tags = {auth(codec, role) for role in (1, 2)}
    assert len(tags) == 2  # the role labels differ: a tag cannot be reflected
    for which in range(2):
        for offset in range(0, 80, 3 if codec is NATIVE else 7):
            hellos = [CLIENT_HELLO, SERVER_HELLO]
            hellos[which] = edited(hellos[which], offset, hellos[which][offset] ^ 0x01)
            for role in (1, 2):
                assert auth(codec, role, (hellos[0], hellos[1])) not in tags, (which, offset)


def test_another_key_gives_other_tags(codec: Codec) -> None:
    assert codec.auth(KEY + b"!", 1, CLIENT_SEED, SERVER_PAKE, CLIENT_HELLO, SERVER_HELLO) != (
        CLIENT_AUTH
    )
    assert codec.pake(KEY + b"!", 1, CLIENT_SEED) != CLIENT_PAKE


def test_a_reflected_element_is_refused(codec: Codec) -> None:
    with pytest.raises(
        AuthenticationError, match="the peer's key exchange message is this side's own"
    ):
        codec.auth(KEY, 1, CLIENT_SEED, CLIENT_PAKE, CLIENT_HELLO, SERVER_HELLO)


NEUTRAL = bytes([1]) + bytes(31)  # y = 1
ORDER_TWO = bytes([0xEC]) + bytes([0xFF]) * 30 + bytes([0x7F])  # y = -1
NOT_A_POINT = bytes([2]) + bytes(31)  # y = 2: x^2 is no square
# The prime-order generator plus a point of order 8: on the curve, outside the group.
MIXED = bytes.fromhex("da99e28ba529cdde35a25fba9059e78ecaee239f99755b9b1aa4f65df00803e2")


@pytest.mark.parametrize("element", [NEUTRAL, ORDER_TWO, NOT_A_POINT, MIXED])
def test_an_element_outside_the_group_is_a_protocol_error(codec: Codec, element: bytes) -> None:
    with pytest.raises(ProtocolError) as info:
        codec.read_pake(b"GSPK" + bytes(12) + element)
    assert info.value.expected == (
        "a point of Ed25519's prime-order group in a key exchange message"
    )
    assert info.value.seen == f"bytes {element.hex()}"


# --------------------------------------------------------------------------- strict hellos


@pytest.mark.parametrize(
    ("offset", "value", "expected", "seen"),
    [
        (
            12,
            1,
            "a hello of version 2",
            "a hello of version 1 (an older gradstream: upgrade the peer)",
        ),
        (
            12,
            4,
            "a hello of version 2",
            "a hello of version 4 (a newer gradstream: upgrade this side)",
        ),
        (14, 81, "a version 2 hello of 80 bytes", "a length of 81"),
        (16, 2, "the hello of a client", "the hello of a server"),
        (17, 2, "auth 0 (none) or 1 (authkey) in the hello", "auth 2"),
        (18, 1, "zero bytes at offsets 18..19 of the hello", "0100"),
        (79, 1, "zero bytes at offsets 64..79 of the hello", "00" * 15 + "01"),
        (4, 1, "a gradstream hello", "a hello (4753484c01"),
    ],
)
def test_a_hello_out_of_spec_is_a_protocol_error(
    codec: Codec, offset: int, value: int, expected: str, seen: str
) -> None:
    with pytest.raises(ProtocolError) as info:
        codec.read_hello(edited(CLIENT_HELLO, offset, value), 2)
    assert info.value.expected == expected
    assert info.value.seen.startswith(seen), info.value.seen


def test_the_same_role_is_refused(codec: Codec) -> None:
    with pytest.raises(
        ProtocolError, match="expected the hello of a server, got the hello of a client"
    ):
        codec.read_hello(CLIENT_HELLO, 1)


def test_a_hello_is_judged_on_its_first_16_bytes(codec: Codec) -> None:
    # What the reader reads first; a bad head is refused before the other 64 are read.
    assert codec.hello_rest(CLIENT_HELLO[:16]) == 64
    for bad in (
        edited(CLIENT_HELLO, 12, 1),
        edited(CLIENT_HELLO, 14, 0xFF),
        b"GET / HTTP/1.1\r\nH",
    ):
        with pytest.raises(ProtocolError):
            codec.hello_rest(bad[:16])


# --------------------------------------------------------------------------- foreign first bytes


@pytest.mark.parametrize(
    ("first", "seen"),
    [
        (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", "an HTTP request ('GET / HTTP/1.1'...)"),
        (b"POST /x HTTP/1.1\r\n", "an HTTP request ('POST /x HTTP/1.1'...)"),
        (b"\x15\x03\x03\x00\x02\x02\x28" + bytes(9), "a TLS alert (the peer speaks TLS"),
        (bytes(range(16)), "bytes 000102030405060708090a0b0c0d0e0f"),
        (b"\x01\x02\x03", "the end of the connection after 3 bytes (010203)"),
        (b"", "the end of the connection"),
    ],
)
def test_what_a_foreign_peer_sent_is_named(codec: Codec, first: bytes, seen: str) -> None:
    assert codec.describe(first[:16]).startswith(seen), codec.describe(first[:16])


def test_a_tls_client_hello_is_named(codec: Codec) -> None:
    seen = codec.describe(tls_client_hello()[:16])
    assert seen.startswith("a TLS ClientHello (a TLS client at a plaintext listener"), seen


def test_a_bare_seed_frame_header_is_named_with_its_fields(codec: Codec) -> None:
    frames = ref.GradientStreamSession("s", 4).encode_frames(np.arange(10, dtype=np.float32))
    _, total, payload_len, checksum = struct.unpack_from("<4I", frames)
    seen = codec.describe(frames[:16])
    assert seen.startswith(
        f"a bare seed frame header (chunk 0 of 3, payload_len {payload_len}, checksum "
        f"{checksum:#010x}): an ipfrs-transport peer"
    ), seen
    assert total == 3


def test_messages_in_the_wrong_place_are_named(codec: Codec) -> None:
    assert codec.describe(CLIENT_AUTH[:16]).startswith("an authentication message")
    assert codec.describe(CLIENT_PAKE[:16]).startswith("a key exchange message (4753504b")
    assert codec.describe(ACK[:16]).startswith("an ack")
    assert codec.describe(CLIENT_HELLO[:16]) == "a hello of version 2 (80 bytes)"


# --------------------------------------------------------------------------- strict auth and acks


def test_an_auth_message_with_a_nonzero_reserved_byte_is_refused(codec: Codec) -> None:
    with pytest.raises(ProtocolError, match=r"zero bytes at offsets 4\.\.15"):
        codec.read_auth(edited(CLIENT_AUTH, 9, 1))
    with pytest.raises(ProtocolError, match="expected an authentication message, got a hello"):
        codec.read_auth(CLIENT_HELLO[:48])


def test_a_key_exchange_message_is_read_strictly(codec: Codec) -> None:
    with pytest.raises(ProtocolError, match=r"zero bytes at offsets 4\.\.15 of a key exchange"):
        codec.read_pake(edited(CLIENT_PAKE, 15, 1))
    with pytest.raises(
        ProtocolError, match="expected a key exchange message, got an authentication message"
    ):
        codec.read_pake(CLIENT_AUTH)


@pytest.mark.parametrize(
    ("offset", "value", "match"),
    [
        (12, 2, "verdict 0 .accepted. or 1 .refused. in an ack, got verdict 2"),
        (13, 1, "zero bytes at offsets 13..13 of an ack"),
        (15, 0x04, "an ack's reason of at most 1024 bytes, got 1052 bytes"),  # 0x041c
        (5, 1, "expected an ack, got an ack"),
    ],
)
def test_an_ack_head_out_of_spec_is_refused_from_16_bytes(
    codec: Codec, offset: int, value: int, match: str
) -> None:
    with pytest.raises(ProtocolError, match=match):
        codec.ack_rest(edited(REFUSAL, offset, value)[:16])


def test_an_ack_reads_at_most_its_reason(codec: Codec) -> None:
    assert codec.ack_rest(ACK[:16]) == 40
    assert codec.ack_rest(REFUSAL[:16]) == 40 + len(REASON)
    longest = codec.ack(3, bytes(32), "x" * 5000)
    assert len(longest) == 56 + 1024 and codec.ack_rest(longest[:16]) == 40 + 1024


def test_a_long_reason_is_cut_at_a_character(codec: Codec) -> None:
    data = codec.ack(0, bytes(32), "é" * 600)  # 1200 bytes of UTF-8
    assert codec.read_ack(data)[2] == "é" * 512


def test_an_accepting_ack_with_a_reason_is_refused(codec: Codec) -> None:
    with pytest.raises(ProtocolError, match="no reason in an accepting ack"):
        codec.ack_rest(edited(ACK, 14, 1)[:16])


def test_a_refusal_with_a_digest_or_bad_utf8_is_refused(codec: Codec) -> None:
    with pytest.raises(ProtocolError, match="a zero digest in a refusal"):
        codec.read_ack(edited(REFUSAL, 30, 1))
    with pytest.raises(ProtocolError, match="a UTF-8 reason in a refusal"):
        codec.read_ack(REFUSAL[:-1] + b"\xff")


def test_a_frame_header_where_an_ack_is_awaited_is_named(codec: Codec) -> None:
    with pytest.raises(ProtocolError) as info:
        codec.ack_rest(HEADERS[0])
    assert info.value.expected == "an ack"
    assert info.value.seen.startswith(
        "a frame header (chunk 0 of 2, payload_len 10, checksum 0x11111111): the peer "
        "started a transfer while this side waited for its ack"
    ), info.value.seen


# --------------------------------------------------------------------------- the digest of frames


@settings(max_examples=60, deadline=None)
@given(cuts=st.lists(st.integers(min_value=0, max_value=10_000), max_size=12))
def test_the_digest_of_frames_fed_in_any_pieces_is_the_headers_digest(
    codec: Codec, cuts: list[int]
) -> None:
    frames = ref.GradientStreamSession("s", 300, layout="compact").encode_frames(
        np.arange(1000, dtype=np.float32)
    )
    headers, pos = [], 0
    while pos < len(frames):
        headers.append(frames[pos : pos + 16])
        pos += 16 + struct.unpack_from("<I", frames, pos + 8)[0]
    tid = bytes.fromhex(IDS[(1, 0)])
    points = sorted({c % (len(frames) + 1) for c in cuts} | {0, len(frames)})
    pieces = [frames[a:b] for a, b in itertools.pairwise(points)]
    assert codec.digest_of_stream(tid, pieces) == codec.digest(tid, headers)
    expected = hashlib.sha256(b"gradstream/1 digest" + tid + b"".join(headers)).digest()
    assert codec.digest(tid, headers) == expected
