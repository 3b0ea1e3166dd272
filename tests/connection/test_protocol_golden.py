"""The protocol's bytes, pinned to docs/spec/protocol.md and its test vectors: the hello,
the authentication message and tags, the transfer ids, the ack and its digest, and the
strict reading of each (what a peer may not send, refused from its first 16 bytes).

Each test takes a ``codec``: the messages of one implementation behind the small
interface of ``support.protocol``, the test peer's (``support.peer.messages``) and the
core's; both must give the same bytes and the same refusals. Whole sessions of these
messages, replayed against the native side, are test_protocol_sessions.py's.
"""

from __future__ import annotations

import hashlib
import itertools
import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import gradstream.reference as ref
from gradstream.errors import ProtocolError
from support.connections import tls_client_hello
from support.protocol import CODECS, Codec

CLIENT_NONCE = bytes(range(32))
SERVER_NONCE = bytes(range(32, 64))
KEY = b"correct horse battery staple"
MAX_GRADIENT_LEN = 1 << 30  # the session defaults
MAX_PAYLOAD_LEN = 1 << 28

CLIENT_HELLO = bytes.fromhex(
    "4753484c 0000000000000000 0100 5000 01 01 0000"
    + CLIENT_NONCE.hex()
    + "0000004000000000 00000010 00000000000000000000000000000000"
)
SERVER_HELLO = bytes.fromhex(
    "4753484c 0000000000000000 0100 5000 02 01 0000"
    + SERVER_NONCE.hex()
    + "0000004000000000 00000010 00000000000000000000000000000000"
)
CLIENT_AUTH = bytes.fromhex(
    "47534155 000000000000000000000000"
    "c58d31f898bb2c705e72805d419a03935dcc469545087860d5cd42ef9f90d7bb"
)
SERVER_AUTH = bytes.fromhex(
    "47534155 000000000000000000000000"
    "b2fba0c69216c74f27ee75d0b3c4bc103b48f767406d4be0ac49510b64316f5a"
)
IDS = {
    (1, 0): "fb1ea9060e8375d9842202a20885dc6b",
    (2, 0): "59f4109322c9ccbb856d64b3873a95a3",
    (1, 1): "4ed82101c06a79841f8c40f653bf93e2",
}
HEADERS = [struct.pack("<4I", 0, 2, 10, 0x11111111), struct.pack("<4I", 1, 2, 10, 0x22222222)]
ACK = bytes.fromhex(
    "4753414b 0000000000000000 00 00 0000 0000000000000000"
    "5da574165e2673baf8fb84f1debe477aec7b68a4428c3a29cf5d7a2679a1b86e"
)
REASON = "chunk 1 failed its CRC check"
REFUSAL = (
    bytes.fromhex("4753414b 0000000000000000 01 00 1c00 0000000000000000" + "00" * 32)
    + REASON.encode()
)

pytestmark = pytest.mark.parametrize("codec", CODECS, ids=[c.name for c in CODECS])


def client_hello(codec: Codec, **changes: int) -> bytes:
    fields = {"role": 1, "auth": 1, "max_gradient_len": MAX_GRADIENT_LEN}
    fields.update(changes)
    return codec.hello(
        fields["role"], fields["auth"], CLIENT_NONCE, fields["max_gradient_len"], MAX_PAYLOAD_LEN
    )


def edited(data: bytes, offset: int, value: int) -> bytes:
    return data[:offset] + bytes([value]) + data[offset + 1 :]


# --------------------------------------------------------------------------- the vectors


def test_the_hellos_are_the_vectors(codec: Codec) -> None:
    assert client_hello(codec) == CLIENT_HELLO
    assert codec.hello(2, 1, SERVER_NONCE, MAX_GRADIENT_LEN, MAX_PAYLOAD_LEN) == SERVER_HELLO
    assert len(CLIENT_HELLO) == 80
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


def test_the_auth_messages_are_the_vectors(codec: Codec) -> None:
    assert codec.auth(KEY, 1, CLIENT_HELLO, SERVER_HELLO) == CLIENT_AUTH
    assert codec.auth(KEY, 2, CLIENT_HELLO, SERVER_HELLO) == SERVER_AUTH
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


# --------------------------------------------------------------------------- what the tags bind


def test_every_hello_byte_is_under_both_tags(codec: Codec) -> None:
    # A man in the middle who edits any byte of either hello (a limit, a nonce, the
    # version) changes both tags, so the side that holds the key notices.
    tags = {codec.auth(KEY, role, CLIENT_HELLO, SERVER_HELLO) for role in (1, 2)}
    assert len(tags) == 2  # the role labels differ: a tag cannot be reflected
    for which in range(2):
        for offset in range(80):
            hellos = [CLIENT_HELLO, SERVER_HELLO]
            hellos[which] = edited(hellos[which], offset, hellos[which][offset] ^ 0x01)
            for role in (1, 2):
                assert codec.auth(KEY, role, *hellos) not in tags, (which, offset, role)


def test_another_key_gives_other_tags(codec: Codec) -> None:
    assert codec.auth(KEY + b"!", 1, CLIENT_HELLO, SERVER_HELLO) != CLIENT_AUTH


def test_ids_differ_by_direction_counter_and_nonces(codec: Codec) -> None:
    seen = {
        codec.transfer_id(c, s, d, k)
        for c, s in [(CLIENT_NONCE, SERVER_NONCE), (SERVER_NONCE, CLIENT_NONCE)]
        for d in (1, 2)
        for k in (0, 1, 2**64 - 1)
    }
    assert len(seen) == 12


# --------------------------------------------------------------------------- strict hellos


@pytest.mark.parametrize(
    ("offset", "value", "expected", "seen"),
    [
        (12, 2, "a hello of version 1", "a hello of version 2"),
        (14, 81, "a version 1 hello of 80 bytes", "a length of 81"),
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
        edited(CLIENT_HELLO, 12, 2),
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
    assert codec.describe(ACK[:16]).startswith("an ack")
    assert codec.describe(CLIENT_HELLO[:16]) == "a hello of version 1 (80 bytes)"


# --------------------------------------------------------------------------- strict auth and acks


def test_an_auth_message_with_a_nonzero_reserved_byte_is_refused(codec: Codec) -> None:
    with pytest.raises(ProtocolError, match=r"zero bytes at offsets 4\.\.15"):
        codec.read_auth(edited(CLIENT_AUTH, 9, 1))
    with pytest.raises(ProtocolError, match="expected an authentication message, got a hello"):
        codec.read_auth(CLIENT_HELLO[:48])


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
