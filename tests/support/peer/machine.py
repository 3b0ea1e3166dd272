"""One side of a gradstream connection as a sans-I/O state machine (docs/spec/protocol.md):
bytes in (``feed``), bytes out (``take_outgoing``), no socket and no clock. The caller
moves the bytes; the machine says what they mean.

    m = Machine(ROLE_CLIENT, session)      # its hello is the first outgoing bytes
    m.handshake()                          # None until the peer's hello (and SPAKE2) came
    m.send(gradient); m.ack()              # a sealed transfer, then the peer's verdict
    m.receive("gradient")                  # the peer's next transfer, answered by an ack

Each step returns None while it needs more bytes (feed them, then call it again) and
raises what a gradstream peer raises: ProtocolError, AuthenticationError, DeliveryError,
or, for a transfer it refuses, the decoding error (its refusal already queued). A step
that meets the end of the connection (``feed(b"")``) where the protocol allows it (before
a transfer's first byte) raises ``Ended``.

Frames are encoded and decoded by the pure-Python reference (``gradstream.reference``'s
sealed seams), the messages by ``support.peer.messages``: nothing here comes from the
native side. ``protocol="seed"`` speaks bare frames: no hello, no seals, no acks.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable
from typing import Any, Literal, NamedTuple

import numpy as np

from gradstream.errors import (
    Address,
    AuthenticationError,
    DeliveryError,
    GradientStreamError,
    ProtocolError,
)
from gradstream.reference import HEADER_LEN, GradientStreamSession
from gradstream.reference._manifest import read_manifest
from gradstream.reference._seal import check_transfer_id
from gradstream.reference._tensors import _memory_manifest

from . import messages as m

Kind = Literal["gradient", "tensors"]


class Ended(Exception):
    """The peer closed the connection between two transfers."""


class Handshake(NamedTuple):
    """What a finished handshake gives: both nonces, the peer's hello (its limits) and
    whether the peer proved the authkey."""

    client_nonce: bytes
    server_nonce: bytes
    peer: m.Hello
    authkey_proved: bool


def reason(error: BaseException) -> str:
    """A refusal's reason: the error's message, and its notes (which tensor of a set)."""
    return "\n".join([str(error), *getattr(error, "__notes__", ())])


class Machine:
    """One side (``role``: messages.ROLE_CLIENT or ROLE_SERVER) of one connection.

    ``session`` (the reference's) encodes and decodes the frames and gives the limits this
    side's hello announces; ``nonce`` fixes the hello's nonce and with it the SPAKE2
    scalar (recorded sessions: ``messages.fixed_seed``), else both are random; ``peer`` is
    the address the errors name. ``version=messages.OLD_VERSION`` plays an older peer:
    a version 1 hello and, with an authkey, version 1's HMAC tag right after the hellos."""

    def __init__(
        self,
        role: int,
        session: GradientStreamSession,
        *,
        authkey: bytes | None = None,
        nonce: bytes | None = None,
        protocol: Literal["gradstream", "seed"] = "gradstream",
        peer: Address | None = None,
        version: int = m.VERSION,
    ) -> None:
        self.role = role
        self.version = version
        self.session = session
        self.authkey = authkey
        self.peer = peer
        self.seed = protocol == "seed"
        self._in = bytearray()
        self._ended = False
        self._out = bytearray()
        self.shaken: Handshake | None = None
        self._sent = 0  # transfers this side sent and the peer accepted
        self._received = 0  # transfers this side received and accepted
        self._awaiting: list[bytes] | None = None  # the headers of the transfer sent
        if self.seed:
            return
        auth = m.AUTH_NONE if authkey is None else m.AUTH_KEY
        own = m.Hello(
            role,
            auth,
            os.urandom(m.NONCE_LEN) if nonce is None else nonce,
            session.max_gradient_len,
            session.max_payload_len,
        )
        self._hello = m.encode_hello(own, version)
        self._peer_hello: bytes | None = None  # as it came
        self._theirs: m.Hello | None = None  # as it reads
        self._out += self._hello
        self._exchange: m.Exchange | None = None
        self._key: bytes | None = None  # the SPAKE2 session key, once the peer's element came
        if authkey is not None and version != m.OLD_VERSION:
            seed = None if nonce is None else m.fixed_seed(nonce)
            self._exchange = m.Exchange(authkey, role, seed)
            self._out += self._exchange.message()  # it needs nothing of the peer's

    # ---- bytes

    def feed(self, data: bytes) -> None:
        """Bytes from the peer; ``b""`` for the end of the connection."""
        if not data:
            self._ended = True
        self._in += data

    def take_outgoing(self) -> bytes:
        """The bytes to write to the peer, in order (each once)."""
        out = bytes(self._out)
        self._out.clear()
        return out

    def _take(self, n: int) -> bytes:
        data = bytes(self._in[:n])
        del self._in[:n]
        return data

    # ---- the handshake

    def handshake(self) -> Handshake | None:
        """Steps 2 and 3: the peer's hello, then (with an authkey) its SPAKE2 element and
        both tags; None until the bytes they need came."""
        if self.shaken is not None or self.seed:
            return self.shaken
        if self._peer_hello is None:
            if not self._hello_from_peer():
                return None
        if self._exchange is not None and self._key is None:
            if not self._arrived(m.PAKE_LEN):
                return None
            element = m.parse_pake(self._take(m.PAKE_LEN), self.peer)
            self._key = self._exchange.finish(element, self.peer)
            if self.role == m.ROLE_CLIENT:  # the client's tag first; the server answers
                self._out += m.encode_auth(self._tag(self.role))
        if self.authkey is not None:
            if not self._arrived(m.AUTH_LEN):
                return None
            tag = m.parse_auth(self._take(m.AUTH_LEN), self.peer)
            other = m.ROLE_SERVER if self.role == m.ROLE_CLIENT else m.ROLE_CLIENT
            if not m.tags_match(self._tag(other), tag):
                raise AuthenticationError(
                    "the peer's tag does not match: another authkey, or a message changed "
                    "on the way",
                    self.peer,
                )
            if self._exchange is not None and self.role == m.ROLE_SERVER:
                self._out += m.encode_auth(self._tag(self.role))  # only to a verified tag
        assert self._theirs is not None
        client, server = self._hellos()
        self.shaken = Handshake(
            m.nonce_of(client), m.nonce_of(server), self._theirs, self.authkey is not None
        )
        return self.shaken

    def _hellos(self) -> tuple[bytes, bytes]:
        assert self._peer_hello is not None
        if self.role == m.ROLE_CLIENT:
            return self._hello, self._peer_hello
        return self._peer_hello, self._hello

    def _arrived(self, n: int) -> bool:
        """Whether the next ``n`` bytes of the authentication came; AuthenticationError
        when the connection ended first (the peer refused this side: its hello, its
        element or its tag)."""
        if len(self._in) >= n:
            return True
        if self._ended:
            raise AuthenticationError(
                "the peer closed the connection instead of authenticating: it "
                "refused this side's hello or authkey",
                self.peer,
            )
        return False

    def _tag(self, role: int) -> bytes:
        assert self.authkey is not None
        if self.version == m.OLD_VERSION:
            return m.version1_tag(self.authkey, role, *self._hellos())
        assert self._key is not None
        return m.confirm_tag(self._key, role, *self._hellos())

    def _hello_from_peer(self) -> bool:
        """The peer's hello, checked from its first 16 bytes (then, as an older peer with
        an authkey, this side's version 1 tag queued). False while bytes are missing."""
        expected = "a gradstream hello"
        if len(self._in) < m.HEAD_LEN:
            if self._ended:
                raise ProtocolError(expected, m.describe(bytes(self._in)), self.peer)
            return False
        m.check_hello_head(bytes(self._in[: m.HEAD_LEN]), self.peer, self.version)
        if len(self._in) < m.HELLO_LEN:
            if self._ended:
                into = len(self._in) - m.HEAD_LEN
                seen = f"the end of the connection {into} bytes into its last 64"
                raise ProtocolError(expected, seen, self.peer)
            return False
        self._peer_hello = self._take(m.HELLO_LEN)
        hello = self._theirs = m.parse_hello(self._peer_hello, self.role, self.peer, self.version)
        if self.authkey is not None and hello.auth != m.AUTH_KEY:
            raise AuthenticationError(
                "this side requires an authkey and the peer's hello offers none", self.peer
            )
        if self.authkey is None and hello.auth == m.AUTH_KEY:
            raise AuthenticationError(
                "the peer requires an authkey and this side has none (give authkey=)", self.peer
            )
        if self.authkey is not None and self.version == m.OLD_VERSION:
            self._out += m.encode_auth(self._tag(self.role))
        return True

    # ---- transfer ids

    def _id(self, outgoing: bool) -> bytes:
        shaken = self.shaken
        assert shaken is not None, "the handshake comes first"
        to_server = (self.role == m.ROLE_CLIENT) == outgoing
        direction = m.TO_SERVER if to_server else m.TO_CLIENT
        counter = self._sent if outgoing else self._received
        return m.transfer_id(shaken.client_nonce, shaken.server_nonce, direction, counter)

    # ---- sending

    def send(self, gradient: Any) -> int:
        """Queue one gradient's frames, sealed as this side's next transfer; its chunk
        count. DeliveryError, with nothing queued, when it is over the peer's limits."""
        values = np.asarray(gradient)
        if self.seed:
            return self._queue(self.session.encode_frames(values))
        limit = self._shaken().peer.max_gradient_len
        if values.size > limit:
            raise DeliveryError(
                f"the gradient holds {values.size} values, above the peer's max_gradient_len "
                f"{limit}; nothing was sent",
                self.peer,
            )
        return self._queue(self.session._encode_frames_sealed(values, self._id(outgoing=True)))

    def send_tensors(self, tensors: Any) -> int:
        """Queue one tensor set's frames (its manifest first), sealed; its frame count."""
        if self.seed:
            return self._queue(bytes(self.session.encode_tensors(tensors)))
        return self._queue(self.session._encode_tensors_sealed(tensors, self._id(outgoing=True)))

    def _shaken(self) -> Handshake:
        assert self.shaken is not None, "the handshake comes first"
        return self.shaken

    def _queue(self, frames: bytes) -> int:
        headers = [frames[pos : pos + HEADER_LEN] for pos in _frame_starts(frames)]
        if not self.seed:
            limit = self._shaken().peer.max_payload_len
            for header in headers:
                index, _, payload_len, _ = struct.unpack("<4I", header)
                if payload_len > limit:
                    raise DeliveryError(
                        f"chunk {index}'s payload of {payload_len} bytes is above the peer's "
                        f"max_payload_len {limit}; use a smaller chunk_size",
                        self.peer,
                    )
            self._awaiting = headers
        self._out += frames
        return len(headers)

    def ack(self) -> int | None:
        """The peer's answer to the transfer sent: its counter once it accepts the frames
        sent, DeliveryError when it refuses them, acknowledges others or closes first;
        None until its bytes came (a seed connection has no answer: at once)."""
        if self.seed:
            return self._sent
        headers = self._awaiting
        assert headers is not None, "send first"
        if len(self._in) < m.HEAD_LEN:
            return self._ack_missing()
        rest = m.check_ack_head(bytes(self._in[: m.HEAD_LEN]), self.peer)
        if len(self._in) < m.HEAD_LEN + rest:
            return self._ack_missing()
        ack = m.parse_ack(self._take(m.HEAD_LEN + rest), self.peer)
        if ack.counter != self._sent:
            raise DeliveryError(
                f"the peer acknowledged transfer {ack.counter}; this was transfer {self._sent}",
                self.peer,
            )
        if ack.reason is not None:
            raise DeliveryError(f"the peer refused it: {ack.reason}", self.peer, ack.reason)
        sent = m.ack_digest(self._id(outgoing=True), headers)
        if not m.tags_match(sent, ack.digest):
            raise DeliveryError(
                f"the peer acknowledged other frames than were sent (its digest "
                f"{ack.digest.hex()[:16]}..., this side's {sent.hex()[:16]}...)",
                self.peer,
            )
        self._awaiting = None
        self._sent += 1
        return ack.counter

    def _ack_missing(self) -> None:
        if self._ended:
            raise DeliveryError(
                "the connection ended before the peer acknowledged the transfer", self.peer
            )
        return None

    # ---- receiving

    def receive(self, kind: Kind = "gradient", out: np.ndarray | None = None) -> Any:
        """The peer's next transfer, decoded (a gradient into ``out`` when given, or a
        tensor set as a dict), its ack queued; None until all its frames came. Its
        decoding error when refused (the refusal queued); ``Ended`` when the peer closed
        before its first byte."""
        end = self._transfer_end(kind)
        if end is None:
            if self._ended:
                if not self._in:
                    raise Ended
                end = len(self._in)  # cut short: the decoder says how
            else:
                return None
        data = self._take(end)
        if self.seed:
            return self._decoded(kind, data, None, out)
        transfer = self._id(outgoing=False)
        try:
            result = self._decoded(kind, data, transfer, out)
        except GradientStreamError as error:
            self._out += m.encode_ack(m.Ack(self._received, bytes(32), reason(error)))
            raise
        headers = [data[pos : pos + HEADER_LEN] for pos in _frame_starts(data)]
        self._out += m.encode_ack(m.Ack(self._received, m.ack_digest(transfer, headers), None))
        self._received += 1
        return result

    def _decoded(
        self, kind: Kind, data: bytes, transfer: bytes | None, out: np.ndarray | None
    ) -> Any:
        session = self.session
        if kind == "tensors":
            if transfer is None:
                return session.decode_tensors(data)
            return session._decode_tensors_sealed(data, transfer)
        if transfer is None:
            return session.decode_frames(data, out=out)
        return session._decode_frames_sealed(data, transfer, out=out)

    def _transfer_end(self, kind: Kind) -> int | None:
        """Where the transfer at the start of the input ends (the frames of a gradient;
        a set's manifest and then each tensor's); None while bytes are missing. A frame
        over this side's max_payload_len ends it at its header: the decoder refuses it
        from there."""
        pos = 0
        gradients = 1
        if kind == "tensors":
            manifest = self._frames_end(0, self._manifest_entries)
            if manifest is None:
                return None
            pos, gradients = manifest
        for _ in range(gradients):
            end = self._frames_end(pos, None)
            if end is None:
                return None
            pos = end[0]
        return pos

    def _frames_end(
        self, start: int, count: Callable[[bytes], int] | None
    ) -> tuple[int, int] | None:
        """The end of one gradient's frames from ``start``, and what ``count`` says of
        them (a manifest's entries)."""
        pos, frames, total = start, 0, None
        while total is None or frames < total:
            if len(self._in) < pos + HEADER_LEN:
                return None
            _, declared, payload_len, _ = struct.unpack_from("<4I", self._in, pos)
            if payload_len > self.session.max_payload_len:
                return pos + HEADER_LEN, 0
            if len(self._in) < pos + HEADER_LEN + payload_len:
                return None
            total = declared if total is None else total
            pos += HEADER_LEN + payload_len
            frames += 1
        return pos, (0 if count is None else count(bytes(self._in[start:pos])))

    def _manifest_entries(self, frames: bytes) -> int:
        """The tensors a manifest frame declares (0 when it is none: the decoder says
        why)."""
        try:
            if self.seed:
                text, _ = self.session._decode_manifest(frames)
                return 0 if text is None else len(read_manifest(text))
            # A connection's manifest is sealed to this transfer: read it as the receiver
            # will (a receiver verifies any seal it finds, docs/spec/decoding-rules.md).
            transfer = check_transfer_id(self._id(outgoing=False))
            entries, _, _ = _memory_manifest(self.session, memoryview(frames), transfer)
            return len(entries)
        except GradientStreamError:
            return 0


def _frame_starts(frames: bytes) -> list[int]:
    """Where each frame of well-formed ``frames`` begins."""
    starts, pos = [], 0
    while pos < len(frames):
        starts.append(pos)
        pos += HEADER_LEN + struct.unpack_from("<I", frames, pos + 8)[0]
    return starts
