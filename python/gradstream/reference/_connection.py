"""``Connection`` and ``connect`` for the reference (README "Connections"): the settings a
side brings to its connections (``Endpoint``), a connection made from streams that are up
(``establish``: the TLS identity, the handshake, the link of its protocol), and the
connection's own state machine, which lets one transfer run at a time and closes the
connection when a failed transfer left it out of step with the peer.

Apart from the listener, which makes its connections with ``establish`` too, and from
the transfers, which know the protocol's bytes; this module only decides who may run
what, when.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._convert import reduction
from .._io import Stalled, within
from .._peers import (
    HANDSHAKE_TIMEOUT,
    Address,
    Peer,
    Phase,
    Protocol,
    Turns,
    check_authkey,
    check_handshake_timeout,
    check_max_values,
    check_plain_seed,
    check_protocol,
    check_seconds,
    client_tls,
    connection_waits,
    describe_side,
    listener_tls,
    parse_address,
    peer_text,
)
from ..errors import StreamIOError, StreamTimeoutError
from . import _protocol as p
from ._channels import TransferProgress
from ._handshake import handshake
from ._session import GradientStreamSession, add_into
from ._streams import Streams, open_client
from ._tls import checked_peer, client_context, listener_context, tls_error
from ._transfers import AckedLink, BareLink

logger = logging.getLogger("gradstream")

# How long close() waits for the transport to finish (a TLS close_notify) before it
# drops the connection.
_CLOSE_WAIT = 5.0


# --------------------------------------------------------------------------- settings


@dataclass(frozen=True)
class Endpoint:
    """What one side brings to each of its connections: the session (with the
    connection's timeout and deadline), the protocol, the authkey, the TLS context, and
    whether it verifies client certificates (a listener with ``ca``: mutual TLS)."""

    session: GradientStreamSession
    protocol: Protocol
    authkey: bytes | None
    context: ssl.SSLContext | None
    verifies_clients: bool

    @property
    def tls(self) -> bool:
        return self.context is not None

    def describe(self) -> str:
        """For the logs: ``gradstream, TLS, authkey``."""
        return describe_side(self.protocol, self.tls, self.authkey is not None)


def _session(session: Any) -> GradientStreamSession:
    if session is None:
        return GradientStreamSession("gradstream")
    if not isinstance(session, GradientStreamSession):
        raise TypeError(
            "session must be a gradstream.reference.GradientStreamSession or None, not "
            f"{type(session).__name__}"
        )
    return session


def _with_waits(
    session: GradientStreamSession, timeout: float | None, deadline: float | None
) -> GradientStreamSession:
    """``session`` with another timeout and deadline (every other setting its own; a
    "gradstream" connection's links seal each transfer with the connection's own ids)."""
    return GradientStreamSession(
        session.session_id,
        session.chunk_size,
        max_payload_len=session.max_payload_len,
        max_gradient_len=session.max_gradient_len,
        timeout=timeout,
        deadline=deadline,
        layout=session.layout,
        compression=session.compression,
        keep_shape=session.keep_shape,
        keep_dtype=session.keep_dtype,
        wire_dtype=session.wire_dtype,
    )


def endpoint(
    *,
    session: Any,
    tls: Any,
    authkey: Any,
    timeout: Any,
    deadline: Any,
    protocol: Any,
    listener: bool,
) -> Endpoint:
    """The keywords of ``connect`` (``listener=False``) or ``listen``, checked in order;
    the waits as ``_peers.connection_waits`` gives them."""
    own = _session(session)
    kind = check_protocol(protocol)
    settings = listener_tls(tls) if listener else client_tls(tls)
    key = check_authkey(authkey)
    wait = check_seconds(timeout)
    bound = check_seconds(deadline, "deadline")
    check_plain_seed(kind, settings, key)
    wait, bound = connection_waits(own.timeout, own.deadline, wait, bound, listening=listener)
    context = None
    if settings is not None:
        context = listener_context(settings) if listener else client_context(settings)
    verifies = listener and settings is not None and settings.ca is not None
    return Endpoint(_with_waits(own, wait, bound), kind, key, context, verifies)


# --------------------------------------------------------------------------- the connection


class Connection:
    """A connection to one peer, after its handshake (README "Connections").

    ``send`` / ``send_tensors`` return once the peer acknowledged the transfer (on a
    ``"seed"`` connection: once it is written); ``recv`` / ``recv_tensors`` receive one
    and acknowledge it; ``async for g in conn`` receives gradients until the peer closes.
    One transfer at a time: a second call while one runs is a SettingError. A transfer
    that fails after its first byte closes the connection.
    """

    def __init__(
        self,
        link: BareLink,
        streams: Streams,
        peer: Peer,
        on_close: Callable[[], None] | None = None,
    ) -> None:
        self._link = link
        self._writer = streams[1]
        self._peer = peer
        self._on_close = on_close
        self._turns = Turns()

    @property
    def peer(self) -> Peer:
        return self._peer

    @property
    def closed(self) -> bool:
        return self._turns.closed

    def __repr__(self) -> str:
        return f"<Connection with {peer_text(self._peer.address)} {self._turns.phase.value}>"

    @contextlib.contextmanager
    def _turn(self, phase: Phase, call: str) -> Iterator[None]:
        with self._turns.turn(phase, call):
            try:
                yield
            except BaseException as exc:
                # Out of step, or broken (a reset; a timeout before any byte is neither).
                broken = isinstance(exc, StreamIOError) and not isinstance(exc, TimeoutError)
                if broken or not self._link.in_step:
                    self._drop(abort=True)
                raise

    async def send(
        self,
        gradient: Any,
        *,
        progress: TransferProgress | None = None,
        deadline: float | None = None,
    ) -> int:
        """Send one gradient; its chunk count, once the peer verified it (``deadline``:
        the call's, else the connection's)."""
        with self._turn(Phase.SENDING, "send"):
            return await self._link.send(gradient, progress, deadline)

    async def send_tensors(
        self,
        tensors: Any,
        *,
        progress: TransferProgress | None = None,
        deadline: float | None = None,
    ) -> int:
        """Send one tensor set; its frame count, once the peer verified it."""
        with self._turn(Phase.SENDING, "send_tensors"):
            return await self._link.send_tensors(tensors, progress, deadline)

    async def recv(
        self,
        out: np.ndarray | None = None,
        *,
        progress: TransferProgress | None = None,
        deadline: float | None = None,
        reduce_into: np.ndarray | None = None,
        op: str = "sum",
    ) -> np.ndarray:
        """Receive one gradient, as receive_from (into ``out`` when given, added into
        ``reduce_into`` when given); what receive_from gives at the end (an empty array)
        when the peer closed first."""
        acc = reduction(out, reduce_into, op)
        with self._turn(Phase.RECEIVING, "recv"):
            values, ended = await self._link.recv(out, progress, deadline)
        if ended:
            self._drop()
        return values if acc is None else add_into(acc, values)

    async def recv_tensors(
        self,
        *,
        progress: TransferProgress | None = None,
        deadline: float | None = None,
        max_values: int | None = None,
    ) -> dict[str, np.ndarray]:
        """Receive one tensor set; ``{}`` when the peer closed first; a set of more
        than ``max_values`` values in all is refused from its manifest."""
        with self._turn(Phase.RECEIVING, "recv_tensors"):
            check_seconds(deadline, "deadline")  # before max_values, as the native side
            most = check_max_values(max_values)
            tensors, ended = await self._link.recv_tensors(progress, deadline, most)
        if ended:
            self._drop()
        return tensors

    def __aiter__(self) -> Connection:
        return self

    async def __anext__(self) -> np.ndarray:
        if self._turns.closed:
            raise StopAsyncIteration
        with self._turn(Phase.RECEIVING, "async for"):
            values, ended = await self._link.recv(None)
        if ended:
            self._drop()
            raise StopAsyncIteration
        return values

    def _drop(self, abort: bool = False) -> None:
        """Close at once (the peer gone, or close()); with ``abort`` (out of step) drop
        what is still buffered for the peer instead of waiting for it to be read."""
        if not self._turns.close():
            return
        if abort:
            self._writer.transport.abort()
        else:
            self._writer.close()
        if self._on_close is not None:
            self._on_close()

    async def close(self) -> None:
        self._drop()
        try:
            await within(self._writer.wait_closed(), _CLOSE_WAIT)
        except Stalled:
            self._writer.transport.abort()
        except Exception:  # a connection that failed has nothing more to say
            pass

    async def __aenter__(self) -> Connection:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()


# --------------------------------------------------------------------------- making one


async def establish(
    streams: Streams,
    ends: Endpoint,
    role: int,
    address: Address,
    *,
    timeout: float | None,
    on_close: Callable[[], None] | None = None,
) -> Connection:
    """A connection over streams that are up (TCP, and TLS when ``ends.context``): the
    ALPN and the client's certificate checked, the handshake done. The streams are closed
    if it fails."""
    writer = streams[1]
    try:
        if ends.protocol == "seed":
            link = BareLink(streams, ends.session, address)
            return Connection(link, streams, Peer(address), on_close)
        subject = None
        if ends.context is not None:
            ssl_object = writer.get_extra_info("ssl_object")
            subject = checked_peer(ssl_object, address, ends.verifies_clients)
        shaken = await handshake(
            streams,
            tls=ends.tls,
            role=role,
            authkey=ends.authkey,
            max_gradient_len=ends.session.max_gradient_len,
            max_payload_len=ends.session.max_payload_len,
            peer=address,
            timeout=timeout,
        )
        # A client's TLS always verified the server's certificate; a listener's only
        # under mutual TLS.
        verified = ends.tls and (role == p.ROLE_CLIENT or ends.verifies_clients)
        peer = Peer(address, subject, verified or shaken.authkey_proved)
        link = AckedLink(streams, ends.session, address, shaken)
        return Connection(link, streams, peer, on_close)
    except BaseException:
        writer.close()
        raise


def _peername(streams: Streams, fallback: Address) -> Address:
    name = streams[1].get_extra_info("peername")
    return (str(name[0]), int(name[1])) if name else fallback


async def connect(
    address: Any,
    *,
    session: Any = None,
    tls: Any = None,
    authkey: Any = None,
    timeout: Any = None,
    deadline: Any = None,
    protocol: Any = "gradstream",
    handshake_timeout: Any = HANDSHAKE_TIMEOUT,
) -> Connection:
    """Connect to a listener at ``address`` and shake hands (README "Connections");
    ``handshake_timeout`` bounds the TCP connect, TLS and the hello together (each wait
    in them also by the connection's ``timeout``)."""
    host, port = parse_address(address)
    ends = endpoint(
        session=session,
        tls=tls,
        authkey=authkey,
        timeout=timeout,
        deadline=deadline,
        protocol=protocol,
        listener=False,
    )
    limit = check_handshake_timeout(handshake_timeout)
    try:
        async with asyncio.timeout(limit) as bound:
            conn = await _dial(host, port, ends)
    except TimeoutError:
        if not bound.expired():
            raise
        raise StreamTimeoutError(limit) from None
    logger.info("connected to %s (%s)", peer_text(conn.peer.address), ends.describe())
    return conn


async def _dial(host: str, port: int, ends: Endpoint) -> Connection:
    """TCP (and TLS) to ``host:port``, then the handshake, each wait under the timeout."""
    wait = ends.session.timeout
    try:
        streams = await within(open_client(host, port, ends.context, wait), wait)
    except Stalled as stalled:
        raise StreamTimeoutError(stalled.limit) from None
    except ssl.SSLError as exc:
        raise tls_error(exc, (host, port)) from None
    except OSError as exc:
        raise StreamIOError.from_os_error(exc) from exc
    peer = _peername(streams, (host, port))
    return await establish(streams, ends, p.ROLE_CLIENT, peer, timeout=wait)
