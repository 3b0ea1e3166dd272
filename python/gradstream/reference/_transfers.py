"""The transfers of one connection, one at a time: a gradient or a tensor set sent or
received by the reference session over the connection's streams, and, on a
``"gradstream"`` connection, what README "Protocol" step 4 adds around it: the transfer
ids, the sender's checks against the peer's limits, the ack (its verdict, counter and
digest) and the refusal.

Two links, one per protocol: ``BareLink`` (``"seed"``: the frames alone, as
``stream_to`` / ``receive_from`` move them) and ``AckedLink`` (``"gradstream"``). Both
watch each transfer's bytes through a tap, so the connection knows whether a failed
transfer left it out of step with the peer (``in_step``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import numpy as np

from .._convert import value_buffer
from .._io import Clock, Stalled, within
from .._peers import log_transfer, peer_text
from ..errors import (
    Address,
    DeliveryError,
    GradientStreamError,
    StreamIOError,
    StreamTimeoutError,
)
from . import _protocol as p
from . import _tensors
from ._channels import _check_progress, _sending_channel
from ._handshake import Handshake
from ._receiver import _zero_values
from ._session import GradientStreamSession
from ._streams import Streams

T = TypeVar("T")

logger = logging.getLogger("gradstream")

_NO_TRANSFER = bytes(p.ID_LEN)  # what a bare link's tap is keyed by: it sends no digest

# Seconds a receiver waits, after refusing a transfer, for the sender to stop and close.
REFUSAL_LINGER = 1.0


def _counted(tap: p.FrameDigest, what: str) -> int:
    """The bytes a transfer's log line gives: what progress= counts, every frame of a
    gradient, a tensor set's frames but its manifest's."""
    return tap.moved - tap.first_frame if what == "tensor set" else tap.moved


class BareLink:
    """The transfers of a ``"seed"`` connection: the frames and nothing else, so a lost
    or refused gradient goes unnoticed (README "Connections")."""

    def __init__(self, streams: Streams, session: GradientStreamSession, peer: Address) -> None:
        self._reader, self._writer = streams
        self._session = session
        self._peer = peer
        self._tap: p.FrameDigest | None = None  # the last transfer's, until it succeeded

    @property
    def in_step(self) -> bool:
        """False once a transfer failed after its first byte moved: the peer cannot tell
        where the next one starts."""
        return self._tap is None or self._tap.moved == 0

    # ---- what the two protocols do differently

    def _outgoing_tap(self) -> p.FrameDigest:
        return p.FrameDigest(_NO_TRANSFER)

    def _incoming_tap(self) -> p.FrameDigest:
        return p.FrameDigest(_NO_TRANSFER)

    def _check_length(self, n_values: int) -> None:
        pass

    async def _deliver(
        self, run: Callable[[], Awaitable[int]], tap: p.FrameDigest, clock: Clock
    ) -> int:
        """The frames written by ``run``; on a seed connection that is all."""
        return await run()

    async def _answer(self, tap: p.FrameDigest, refusal: BaseException | None) -> None:
        pass

    # ---- the transfers

    def _outgoing_id(self) -> bytes | None:
        """The transfer id the next outgoing transfer is sealed with: none here."""
        return None

    def _incoming_id(self) -> bytes | None:
        """The transfer id the next incoming transfer must be sealed with: none here."""
        return None

    async def send(self, gradient: Any, progress: Any = None, deadline: float | None = None) -> int:
        """One gradient; its chunk count once delivered (``deadline``: the call's, else
        the connection's)."""
        session = self._session
        prepared = session._input(gradient, self._outgoing_id())
        self._check_length(len(prepared.values))
        clock = session._clock(deadline)
        checked = _check_progress(progress)
        channel = _sending_channel(self._writer, clock)
        return await self._outgoing(
            lambda: session._send(channel, prepared, checked), clock, "gradient"
        )

    async def send_tensors(
        self, tensors: Any, progress: Any = None, deadline: float | None = None
    ) -> int:
        """One tensor set; its frame count once delivered."""
        session, transfer = self._session, self._outgoing_id()
        return await self._outgoing(
            lambda: _tensors.stream_tensors(
                session, tensors, self._writer, progress, deadline, transfer
            ),
            session._clock(deadline),
            "tensor set",
        )

    async def recv(
        self, out: np.ndarray | None, progress: Any = None, deadline: float | None = None
    ) -> tuple[np.ndarray, bool]:
        """One gradient, acknowledged; and True (with receive_from's empty result) when
        the peer closed before it began."""
        session, transfer = self._session, self._incoming_id()

        async def one() -> np.ndarray:
            if transfer is None:
                return await session.receive_from(
                    self._reader, out=out, progress=progress, deadline=deadline
                )
            values = await session._receive_from_sealed(
                self._reader, transfer, out=out, progress=progress, deadline=deadline
            )
            if values is None:  # as receive_from at the end: empty, or the zeroed out=
                return _zero_values(None if out is None else value_buffer(out))
            return values

        return await self._incoming(one, "gradient")

    async def recv_tensors(
        self, progress: Any = None, deadline: float | None = None, max_values: int | None = None
    ) -> tuple[dict[str, np.ndarray], bool]:
        session, transfer, reader = self._session, self._incoming_id(), self._reader
        return await self._incoming(
            lambda: _tensors.receive_tensors(
                session, reader, progress, deadline, transfer, max_values
            ),
            "tensor set",
        )

    async def _outgoing(self, run: Callable[[], Awaitable[int]], clock: Clock, what: str) -> int:
        tap = self._tap = self._outgoing_tap()
        clock.start()
        started = time.monotonic()
        with self._writer.tapping(tap):
            chunks = await self._deliver(run, tap, clock)
        self._tap = None
        log_transfer("sent", what, _counted(tap, what), time.monotonic() - started, self._peer)
        return chunks

    async def _incoming(self, run: Callable[[], Awaitable[T]], what: str) -> tuple[T, bool]:
        tap = self._tap = self._incoming_tap()
        started = time.monotonic()
        try:
            with self._reader.tapping(tap):
                result = await run()
        except GradientStreamError as exc:
            if tap.moved:
                await self._answer(tap, exc)
            raise
        if not tap.moved:
            return result, True
        await self._answer(tap, None)
        self._tap = None
        took = time.monotonic() - started
        log_transfer("received", what, _counted(tap, what), took, self._peer)
        return result, False


def _stops(answer: asyncio.Future[p.Ack]) -> bool:
    """Whether a peer's answer that came while this side was still writing ends the
    transfer: an error or a refusal does; an ack waits for the writing to end (the peer
    may have had every byte while this side still waited for the buffer to drain), and
    is judged then."""
    return answer.exception() is not None or answer.result().reason is not None


def _reason(exc: BaseException) -> str:
    """A refusal's reason: the error's message, and its notes (which tensor of a set)."""
    return "\n".join([str(exc), *getattr(exc, "__notes__", ())])


class AckedLink(BareLink):
    """The transfers of a ``"gradstream"`` connection: each one has the id of its
    direction's counter, is refused before a byte goes when it is over the peer's limits,
    and is answered by the receiver's ack, which the sender checks."""

    def __init__(
        self,
        streams: Streams,
        session: GradientStreamSession,
        peer: Address,
        handshake: Handshake,
    ) -> None:
        super().__init__(streams, session, peer)
        self._handshake = handshake
        client = handshake.role == p.ROLE_CLIENT
        self._out_direction = p.TO_SERVER if client else p.TO_CLIENT
        self._in_direction = p.TO_CLIENT if client else p.TO_SERVER
        self._sent = 0  # transfers this side sent and the peer accepted
        self._received = 0  # transfers this side received and accepted

    def _id(self, direction: int, counter: int) -> bytes:
        h = self._handshake
        return p.transfer_id(h.client_nonce, h.server_nonce, direction, counter)

    def _outgoing_id(self) -> bytes:
        return self._id(self._out_direction, self._sent)

    def _incoming_id(self) -> bytes:
        return self._id(self._in_direction, self._received)

    def _outgoing_tap(self) -> p.FrameDigest:
        return p.FrameDigest(self._outgoing_id(), self._check_frame)

    def _incoming_tap(self) -> p.FrameDigest:
        return p.FrameDigest(self._incoming_id())

    def _check_length(self, n_values: int) -> None:
        limit = self._handshake.peer.max_gradient_len
        if n_values > limit:
            raise DeliveryError(
                f"the gradient holds {n_values} values, above the peer's max_gradient_len "
                f"{limit}; nothing was sent",
                self._peer,
            )

    def _check_frame(self, chunk_index: int, total: int, payload_len: int, checksum: int) -> None:
        limit = self._handshake.peer.max_payload_len
        if payload_len > limit:
            raise DeliveryError(
                f"chunk {chunk_index}'s payload of {payload_len} bytes is above the peer's "
                f"max_payload_len {limit}; use a smaller chunk_size",
                self._peer,
            )

    # ---- the sender's side of the ack

    async def _next_ack(self) -> p.Ack:
        """The peer's next message, which must be an ack (read as it arrives: the sender
        watches for it while it writes, and a refusal can come before the last frame)."""
        reader, peer = self._reader, self._peer
        try:
            head = await reader.readexactly(p.HEAD_LEN)
            rest = p.check_ack_head(head, peer)
            return p.parse_ack(head + await reader.readexactly(rest), peer)
        except asyncio.IncompleteReadError:
            raise DeliveryError(
                "the connection ended before the peer acknowledged the transfer", peer
            ) from None
        except OSError as exc:
            raise DeliveryError(
                f"the connection failed before the peer acknowledged the transfer: {exc}", peer
            ) from exc

    async def _deliver(
        self, run: Callable[[], Awaitable[int]], tap: p.FrameDigest, clock: Clock
    ) -> int:
        """The frames written by ``run`` while the peer's answer is awaited; the chunk
        count once the answer accepts them. An answer that comes before the last frame
        is written stops the writing (a refusal's reason is the DeliveryError's)."""
        answer = asyncio.ensure_future(self._next_ack())
        sending = asyncio.ensure_future(run())
        try:
            await asyncio.wait({answer, sending}, return_when=asyncio.FIRST_COMPLETED)
            if not sending.done() and _stops(answer):
                sending.cancel()
                self._judge(answer.result(), tap)  # raises: a refusal, or the error
            try:
                chunks = await sending
            except StreamIOError as failure:
                if not tap.moved or isinstance(failure, StreamTimeoutError):
                    raise
                # The peer went away while this side wrote: its answer, if it gave one.
                await asyncio.wait({answer}, timeout=0)
                if answer.done() and answer.exception() is None:
                    self._judge(answer.result(), tap)
                raise DeliveryError(
                    f"the connection failed before the peer acknowledged the transfer: {failure}",
                    self._peer,
                ) from failure
            try:
                ack = await clock.within(asyncio.shield(answer))
            except Stalled as stalled:
                raise stalled.error(chunks, chunks) from None
            self._judge(ack, tap)
            return chunks
        finally:
            for task in (answer, sending):
                task.cancel()
            await asyncio.gather(answer, sending, return_exceptions=True)

    def _judge(self, ack: p.Ack, tap: p.FrameDigest) -> None:
        """Accept ``ack`` as the answer to this transfer, or raise DeliveryError: another
        counter, a refusal, a digest of other frames than were sent."""
        peer = self._peer
        if ack.counter != self._sent:
            raise DeliveryError(
                f"the peer acknowledged transfer {ack.counter}; this was transfer {self._sent}",
                peer,
            )
        if ack.reason is not None:
            raise DeliveryError(f"the peer refused it: {ack.reason}", peer, ack.reason)
        sent = tap.digest()
        if not p.tags_match(sent, ack.digest):
            raise DeliveryError(
                f"the peer acknowledged other frames than were sent (its digest "
                f"{ack.digest.hex()[:16]}..., this side's {sent.hex()[:16]}...)",
                peer,
            )
        self._sent += 1

    # ---- the receiver's side

    async def _answer(self, tap: p.FrameDigest, refusal: BaseException | None) -> None:
        """The ack of the transfer just received (``refusal``: refused with its error).
        An ack that cannot be written is left to the sender to notice."""
        counter = self._received
        if refusal is None:
            ack = p.Ack(counter, tap.digest(), None)
        else:
            ack = p.Ack(counter, bytes(32), _reason(refusal))
        try:
            self._writer.write(p.encode_ack(ack))
            await within(self._writer.drain(), self._session.timeout)
        except (OSError, Stalled) as exc:
            logger.debug("the ack to %s was not written: %r", peer_text(self._peer), exc)
            return
        if refusal is None:
            self._received += 1
        else:
            await self._linger()

    async def _linger(self) -> None:
        """After a refusal: read and drop what the sender still writes until it closes
        (it stops at the refusal), for at most REFUSAL_LINGER s. Closing with its bytes
        unread would reset the connection, and a reset can destroy the refusal on its
        way."""
        writer, reader = self._writer, self._reader
        clock = Clock(None, REFUSAL_LINGER)
        clock.start()
        with contextlib.suppress(OSError, Stalled):
            if writer.can_write_eof():
                writer.write_eof()
            while await clock.within(reader.read(1 << 16)):
                pass
