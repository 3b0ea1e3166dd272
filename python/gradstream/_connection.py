"""Connections over the native engine (docs/guides/connections.md): ``listen``, ``connect``,
``serve``, and the ``Connection`` and ``Listener`` they give.

The protocol (TLS, the hello, authentication, seals, acks) runs in Rust on tokio
(``gradstream._native.Link`` and ``Listener``); this module checks the arguments once,
turns each call into one job on the loop's hub, logs, and hands numpy arrays back as the
session does. The plain-Python parts it stands on have a module each: ``_address``,
``_checks``, ``_connection_args`` (the keywords checked), ``_tls_settings``, ``_logs``,
``_turns`` and ``_server``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import warnings
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Generator, Iterator
from types import TracebackType
from typing import TYPE_CHECKING, Any, Generic, Literal, NoReturn, TypeVar

import numpy as np
import numpy.typing as npt

from . import _aio
from ._address import Address, Peer, address_of, peer_text
from ._checks import (
    AUTH_FAILURE_WINDOW,
    HANDSHAKE_TIMEOUT,
    HELLO_TIMEOUT,
    MAX_AUTH_FAILURES,
    MAX_CONNECTIONS,
    MAX_PENDING_HANDSHAKES,
    MAX_PENDING_PER_SOURCE,
    MAX_STREAMS,
    OWN_USER,
    RESUME_WINDOW,
    check_handler,
    check_max_values,
    check_seconds,
)
from ._connection_args import connect_args, listen_args
from ._logs import RefusalLog, log_accepted, log_transfer, silent_text
from ._server import Ready, Server
from ._session import GradientStreamSession, _Out, hand_back_as, lend_either, tensor_set_as
from ._torch import check_like
from ._turns import Phase, Turns

if TYPE_CHECKING:
    # The session layer alone imports the extension (tests/api/test_layers.py).
    from . import TransferProgress

log = logging.getLogger("gradstream")

T = TypeVar("T")

# Seconds a closing listener waits for the events its stopped accept loop still sends.
_LAST_EVENTS = 5.0

__all__ = ["Connection", "Listener", "Server", "connect", "listen", "serve"]


class ConnectionCore:
    """What both faces of a connection share (the asyncio ``Connection`` here, the
    blocking one in ``gradstream.sync``): the native link, the session, the peer, the
    one-transfer-at-a-time state and the close of a connection dropped unclosed. The
    faces differ only in how they wait for a transfer's job."""

    _close_advice = "await conn.close(), or async with"

    def __init__(self, link: Any, session: GradientStreamSession) -> None:
        self._link = link
        self._session = session
        address, subject, authenticated, pid, uid = link.peer()
        self.peer = Peer(
            address=address_of(address),
            tls_subject=subject,
            authenticated=authenticated,
            pid=pid,
            uid=uid,
        )
        self._turns = Turns()
        self._closing = False

    def __del__(self) -> None:
        # A connection dropped without close() closes as close() does, its socket at once
        # (docs/guides/connections.md "Closing"); a transfer it received and never handed
        # over is refused.
        if getattr(self, "_closing", True):
            return
        self._closing = True
        if self._link.close_now():
            warnings.warn(
                f"unclosed gradstream connection {self!r}: close it ({self._close_advice})",
                ResourceWarning,
                stacklevel=2,
                source=self,
            )

    def __repr__(self) -> str:
        return f"<Connection with {peer_text(self.peer.address)} {self._turns.phase.value}>"

    @property
    def streams(self) -> int:
        """How many TCP (or TLS) connections this one runs over: 1, or what the listener
        granted of ``connect(streams=)`` (docs/guides/across-the-internet.md)."""
        n: int = self._link.streams()
        return n

    @property
    def resumes(self) -> bool:
        """Whether its streams are dialled again after a failure in a transfer
        (``connect(resume=)``, granted by the listener): docs/guides/across-the-internet.md,
        "Resume"."""
        on: bool = self._link.resumes()
        return on

    @property
    def resumed(self) -> tuple[int, int]:
        """(times every stream was replaced after a failure, chunks sent again after
        them): what resumes cost this connection so far."""
        times, again = self._link.resumed()
        return times, again

    @property
    def closed(self) -> bool:
        """True once the connection is closed: by close(), by the peer, or after a
        failed transfer left it out of step."""
        self._notice_close()
        return self._turns.closed

    def _notice_close(self) -> None:
        # The link closes itself (the peer's end, a failed or abandoned transfer).
        if self._link.closed():
            self._turns.close()

    @contextlib.contextmanager
    def _turn(self, phase: Phase, call: str) -> Iterator[None]:
        self._begin(phase, call)
        try:
            yield
        finally:
            self._end(phase)

    def _begin(self, phase: Phase, call: str) -> None:
        """``_turn``'s start, without a context manager (a small transfer's round trip
        feels one): ``_end(phase)`` must follow, in a ``finally``."""
        self._notice_close()
        self._turns.begin(phase, call)

    def _end(self, phase: Phase) -> None:
        self._notice_close()
        self._turns.end(phase)

    def _abandoned(self) -> None:
        """After a transfer whose wait was cancelled or interrupted (its job stopped and
        gone): a transfer received and not taken is refused ("the receiver cancelled"),
        a connection left out of step closed."""
        if self._link.abandoned():
            self._turns.close()

    def _most(self, max_values: int | None) -> int | None:
        """``recv_tensors``'s checked ``max_values``; None when the session's limit,
        checked first, is the tighter one."""
        most = check_max_values(max_values)
        if most is not None and most >= self._session.max_gradient_len:
            return None
        return most

    def _start_close(self) -> None:
        self._closing = True
        self._turns.close()

    def _taken_set(self, got: Any, like: str, out: Any) -> Any:
        """A received set as the caller asked for it (``tensor_set_as``), then its ack:
        the set is the caller's from here, as recv's gradient. A set ``out=`` refuses
        (nothing written) is refused to the sender at once, as a transfer nobody took
        (its DeliveryError), and the connection closed."""
        try:
            tensors = tensor_set_as(got, like, out)
        except Exception:
            self._abandoned()
            raise
        self._link.settle()
        return tensors


def set_like(out: Any, like: Any) -> str:
    """``recv_tensors``'s checked ``like``, which ``out=`` excludes (both faces)."""
    kind = check_like(like)
    if out is not None and like is not None:
        raise ValueError("out= and like= exclude each other: out= is what comes back")
    return kind


class Connection(ConnectionCore):
    """A connection to one peer: gradients and tensor sets each way, one transfer at a
    time, each sealed to the connection and acknowledged by the receiver (with
    ``protocol="gradstream"``). Made by ``connect``, ``Listener.accept`` or ``serve``;
    ``gradstream.sync.Connection`` is its blocking twin."""

    async def send(
        self,
        gradient: Any,
        *,
        progress: TransferProgress | None = None,
        deadline: float | None = None,
        wire_dtype: str | None = None,
    ) -> int:
        """Send one gradient; the number of chunks, once the peer has verified it (its
        ack). ``DeliveryError`` when it did not; ``deadline`` replaces the connection's;
        ``wire_dtype`` the session's for this gradient alone."""
        self._begin(Phase.SENDING, "send")
        try:
            wire = self._session._transfer_wire(wire_dtype)
            args = self._session._take(gradient, wire)
            bound = check_seconds(deadline, "deadline")
            hub = _aio.hub()
            timed = Timed(progress)
            now, value = self._link.send(hub.native, args, timed.progress, bound, False, True)
            sent: int = value if now else await self._finished(hub, value)
        finally:
            self._end(Phase.SENDING)
        timed.log("sent", "gradient", self.peer)
        return sent

    async def recv(
        self,
        out: npt.NDArray[Any] | None = None,
        *,
        progress: TransferProgress | None = None,
        deadline: float | None = None,
        reduce_into: npt.NDArray[np.float32] | None = None,
        op: str = "sum",
        like: Literal["numpy", "torch"] | None = None,
    ) -> Any:
        """Receive one gradient, as ``receive_from`` (into ``out`` when given: then
        ``out`` itself; added into ``reduce_into`` when given: then that array); what
        ``receive_from`` gives at the end (an empty array) when the peer closed the
        connection before another began (``closed`` is then True). ``out`` and
        ``reduce_into`` may be CPU torch tensors; ``like="torch"`` hands back a torch
        tensor (docs/guides/torch.md)."""
        lent = lend_either(out, reduce_into, op)
        kind = check_like(like)
        self._begin(Phase.RECEIVING, "recv")
        try:
            got = await self._recv(lent, progress, deadline, none_at_end=False, like=kind)
        finally:
            self._end(Phase.RECEIVING)
        assert got is not None  # none_at_end=False gives the empty gradient instead
        return got

    async def _recv(
        self,
        lent: _Out | None,
        progress: TransferProgress | None,
        deadline: float | None,
        *,
        none_at_end: bool,
        like: str = "numpy",
    ) -> Any:
        bound = check_seconds(deadline, "deadline")
        hub = _aio.hub()
        timed = Timed(progress)
        args = None if lent is None else lent.args
        now, value = self._link.recv(hub.native, timed.progress, args, bound, none_at_end)
        values = value if now else await self._finished(hub, value)
        if values is None:
            return None
        got = lent.array if lent is not None else hand_back_as(values, like)
        timed.log("received", "gradient", self.peer)
        # The gradient is the caller's from here (no await before the return): only now
        # is its ack written (docs/guides/connections.md "Delivery"). The small fast path
        # wrote it already, as the native call handed the gradient over.
        if not now:
            self._link.settle()
        return got

    async def _finished(self, hub: _aio.Hub, job: Any) -> Any:
        """The result of a transfer's job (or of a ``Driven`` transfer, which this loop's
        thread drives: ``_aio.drive``). Cancelled, the transfer stops first (nothing
        writes into out= after this returns); a gradient it received and nobody took is
        refused ("the receiver cancelled"), and a connection it left out of step closed."""
        try:
            if type(job) is not int:
                return await _aio.drive(hub, job)
            return await hub.run(job)
        except asyncio.CancelledError:
            self._abandoned()
            raise

    async def send_tensors(
        self,
        tensors: Any,
        *,
        progress: TransferProgress | None = None,
        deadline: float | None = None,
    ) -> int:
        """Send a named set of tensors; the number of frames, once acknowledged."""
        with self._turn(Phase.SENDING, "send_tensors"):
            taken = self._session._tensors(tensors, "sending")
            bound = check_seconds(deadline, "deadline")
            hub = _aio.hub()
            timed = Timed(progress)
            job = self._link.send_tensors(hub.native, taken, timed.progress, bound)
            sent: int = await self._finished(hub, job)
        timed.log("sent", "tensor set", self.peer)
        return sent

    async def recv_tensors(
        self,
        *,
        progress: TransferProgress | None = None,
        deadline: float | None = None,
        max_values: int | None = None,
        out: Any = None,
        like: Literal["numpy", "torch"] | None = None,
    ) -> Any:
        """Receive a named set of tensors, in the sender's order; ``{}`` when the peer
        closed the connection before another began (``closed`` is then True). A set of
        more than ``max_values`` values in all is refused from its manifest. ``like="torch"``
        gives torch tensors; ``out=`` (a torch module or a mapping of name to tensor) is
        filled in place and returned, refused before any write when the set's names,
        shapes or dtypes differ (docs/guides/torch.md)."""
        kind = set_like(out, like)
        with self._turn(Phase.RECEIVING, "recv_tensors"):
            bound = check_seconds(deadline, "deadline")
            most = self._most(max_values)
            hub = _aio.hub()
            timed = Timed(progress)
            got = await self._finished(
                hub, self._link.recv_tensors(hub.native, timed.progress, bound, most)
            )
        if got is None:
            return {}
        tensors = self._taken_set(got, kind, out)
        timed.log("received", "tensor set", self.peer)
        return tensors

    def __aiter__(self) -> AsyncIterator[npt.NDArray[Any]]:
        return self._gradients()

    async def _gradients(self) -> AsyncIterator[npt.NDArray[Any]]:
        while not self.closed:
            self._begin(Phase.RECEIVING, "async for")
            try:
                gradient = await self._recv(None, None, None, none_at_end=True)
            finally:
                self._end(Phase.RECEIVING)
            if gradient is None:
                return
            yield gradient

    async def close(self) -> None:
        """Close the connection, its socket at once (after a running transfer, which the
        caller cancels first if it must not finish); idempotent."""
        self._start_close()
        hub = _aio.hub()
        now, job = self._link.close(hub.native)
        if not now:
            await hub.run(job)

    async def __aenter__(self) -> Connection:
        return self

    async def __aexit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.close()


class Timed:
    """One transfer's DEBUG line (``_logs.log_transfer``): its wire bytes, counted by the
    caller's progress or, when DEBUG is on and there is none, by one of its own, and its
    time from the call."""

    def __init__(self, progress: TransferProgress | None) -> None:
        self.logging = log.isEnabledFor(logging.DEBUG)
        if progress is None and self.logging:
            from . import TransferProgress as Counters  # the package holds it by now

            progress = Counters()
        self.progress = progress
        # A caller's counters add up over transfers: this one's are the difference.
        self.before = 0 if progress is None else progress.bytes
        self.started = time.perf_counter()

    def log(self, done: str, what: str, peer: Peer) -> None:
        if self.logging and self.progress is not None:
            moved = self.progress.bytes - self.before
            log_transfer(done, what, moved, time.perf_counter() - self.started, peer.address)


class Listener:
    """A bound listener: peers through TLS, the hello and authentication come out of
    ``accept`` (or ``async for``); every other peer is logged (rate-limited) and
    dropped."""

    def __init__(self, native: Any, session: GradientStreamSession, protocol: Any) -> None:
        self._native = native
        self._session = session
        self._protocol = protocol
        self.address: Address = native.address
        self._ready: Ready[Connection] = Ready()
        self._refusals = RefusalLog(peer_text(self.address))
        self._pump = asyncio.get_running_loop().create_task(self._take_events())
        self._closed = False

    def __repr__(self) -> str:
        state = "closed" if self._closed else "listening"
        return f"<Listener {peer_text(self.address)} {self._protocol} {state}>"

    async def _take_events(self) -> None:
        hub = _aio.hub()
        while True:
            event = await hub.run(self._native.next(hub.native))
            if event is None:
                break
            if event[0] == "connection":
                await self._arrived(event[1])
            elif event[0] == "silent":
                self._refusals.refused(address_of(event[1]), silent_text(event[2]))
            elif event[0] == "dropped":  # closed by the listener itself: its words
                self._refusals.refused(address_of(event[1]), event[2])
            else:
                self._refusals.refused(address_of(event[1]), str(event[2]))

    async def _arrived(self, link: Any) -> None:
        # A method of its own: the pump keeps no reference to a connection it handed
        # out, which is its owner's to close or drop (docs/guides/connections.md "Closing").
        connection = Connection(link, self._session)
        if self._closed:  # passed as the listener closed: not to be accepted
            await connection.close()
            return
        log_accepted(self.address, connection.peer, self._protocol)
        self._ready.put(connection)

    async def accept(self) -> Connection:
        """The next peer through the handshake (``StreamIOError`` once closed)."""
        return await self._ready.accept()

    def __aiter__(self) -> AsyncIterator[Connection]:
        return self._connections()

    async def _connections(self) -> AsyncIterator[Connection]:
        while (got := await self._ready.next()) is not None:
            yield got

    async def close(self) -> None:
        """Stop listening: handshakes under way are dropped, connections not yet
        accepted are closed; connections accept() gave out stay their owners'."""
        if self._closed:
            return
        self._closed = True
        await self._ready.close()
        hub = _aio.hub()
        await hub.run(self._native.close(hub.native))
        # The events still on their way (a handshake that passed as the listener closed)
        # end with the accept loop's tasks: the pump closes their connections, then ends.
        await asyncio.wait({self._pump}, timeout=_LAST_EVENTS)
        self._pump.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._pump
        log.info("listener %s closed", peer_text(self.address))

    async def __aenter__(self) -> Listener:
        return self

    async def __aexit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.close()


class Opening(Generic[T]):
    """What ``connect``, ``listen`` and ``serve`` return: awaited (``await connect(...)``)
    or entered (``async with connect(...) as conn``), the connection, listener or server.
    Anything else (``connect(...).send(g)``, a forgotten ``await``) is a TypeError that
    names the fix, not Python's words about a coroutine."""

    def __init__(self, name: str, make: Callable[[], Coroutine[Any, Any, T]]) -> None:
        self._name = name
        self._make = make
        self._got: T | None = None
        self._awaited = False

    def __await__(self) -> Generator[Any, None, T]:
        self._awaited = True
        return self._make().__await__()

    def __del__(self) -> None:
        # As Python warns of a coroutine never awaited: nothing was opened.
        if not getattr(self, "_awaited", True):
            warnings.warn(
                f"{self._name}() was never awaited, so nothing was opened: await it (or "
                f"use gradstream.sync.{self._name} for a blocking one)",
                RuntimeWarning,
                stacklevel=2,
            )

    async def __aenter__(self) -> T:
        self._got = await self
        return self._got

    async def __aexit__(self, *exc_info: object) -> None:
        got, self._got = self._got, None
        if got is not None:
            await got.close()  # type: ignore[attr-defined]

    def __repr__(self) -> str:
        return f"<gradstream {self._name}() not awaited yet>"

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        self._awaited = True  # the TypeError says it: no second word at collection
        raise TypeError(
            f"{name} on what {self._name}() returned, not yet awaited: await {self._name}() "
            f"first (or use gradstream.sync.{self._name} for a blocking one)"
        )

    def __enter__(self) -> NoReturn:
        self._awaited = True
        raise TypeError(
            f"with {self._name}(...): use async with (or gradstream.sync.{self._name} "
            "for a blocking one)"
        )

    def __exit__(self, *exc_info: object) -> None:  # pragma: no cover: __enter__ raised
        return None


def listen(
    address: Any,
    *,
    session: Any = None,
    tls: Any = None,
    authkey: Any = None,
    handshake_timeout: Any = HANDSHAKE_TIMEOUT,
    max_pending_handshakes: Any = MAX_PENDING_HANDSHAKES,
    max_connections: Any = MAX_CONNECTIONS,
    timeout: Any = None,
    deadline: Any = None,
    protocol: Any = "gradstream",
    max_pending_per_source: Any = MAX_PENDING_PER_SOURCE,
    hello_timeout: Any = HELLO_TIMEOUT,
    max_auth_failures: Any = MAX_AUTH_FAILURES,
    auth_failure_window: Any = AUTH_FAILURE_WINDOW,
    allowed_uid: Any = OWN_USER,
    max_streams: Any = MAX_STREAMS,
    resume_window: Any = RESUME_WINDOW,
) -> Opening[Listener]:
    """Listen on ``address`` (``"host:port"`` or ``(host, port)``; port 0 for any, see
    ``Listener.address``; or ``"unix:PATH"`` for processes of this host, whose user must
    be ``allowed_uid``: this process's own by default, None for any); to be awaited (or
    ``async with``). The caps, ``hello_timeout`` and the online-guessing limit:
    docs/guides/limits.md, "A listener under a flood"; ``max_streams``, the most streams
    one connection may open (each counts against ``max_connections``):
    docs/guides/across-the-internet.md, "Parallel streams"; ``resume_window``, how long
    a connection that resumes may take to dial its streams again after a failure (0: no
    resumes): "Resume" there."""
    keywords = {
        "session": session,
        "tls": tls,
        "authkey": authkey,
        "handshake_timeout": handshake_timeout,
        "max_pending_handshakes": max_pending_handshakes,
        "max_connections": max_connections,
        "timeout": timeout,
        "deadline": deadline,
        "protocol": protocol,
        "max_pending_per_source": max_pending_per_source,
        "hello_timeout": hello_timeout,
        "max_auth_failures": max_auth_failures,
        "auth_failure_window": auth_failure_window,
        "allowed_uid": allowed_uid,
        "max_streams": max_streams,
        "resume_window": resume_window,
    }
    return Opening("listen", lambda: _listen(address, keywords))


async def _listen(address: Any, keywords: dict[str, Any]) -> Listener:
    opened = listen_args(address, **keywords)
    hub = _aio.hub()
    native = await hub.run(
        opened.session._open_listener(
            hub.native, opened.host, opened.port, opened.args, opened.listener
        )
    )
    listener = Listener(native, opened.session, opened.args["protocol"])
    log.info("listening on %s (%s)", peer_text(listener.address), opened.speaks)
    return listener


def connect(
    address: Any,
    *,
    session: Any = None,
    tls: Any = None,
    authkey: Any = None,
    timeout: Any = None,
    deadline: Any = None,
    protocol: Any = "gradstream",
    handshake_timeout: Any = HANDSHAKE_TIMEOUT,
    allowed_uid: Any = OWN_USER,
    streams: Any = 1,
    resume: Any = None,
    resume_window: Any = RESUME_WINDOW,
) -> Opening[Connection]:
    """Connect to a listener at ``address`` and shake hands; to be awaited (or ``async
    with``). ``handshake_timeout`` bounds the TCP connect, TLS and the hello together. At
    a ``"unix:PATH"`` address the listener must be a process of ``allowed_uid`` (this
    process's own user by default; None: any). ``streams`` > 1 (with an authkey or TLS)
    runs the connection over that many TCP connections, a gradient's chunks spread over
    them (the listener may grant fewer): docs/guides/across-the-internet.md. ``resume``:
    after a failure of its streams in a transfer, they are dialled again (for at most
    ``resume_window`` seconds) and the transfer goes on from the chunks the receiver
    holds; None (the default) resumes a connection of several streams, not one of one
    ("Resume" in that guide)."""
    keywords = {
        "session": session,
        "tls": tls,
        "authkey": authkey,
        "timeout": timeout,
        "deadline": deadline,
        "protocol": protocol,
        "handshake_timeout": handshake_timeout,
        "allowed_uid": allowed_uid,
        "streams": streams,
        "resume": resume,
        "resume_window": resume_window,
    }
    return Opening("connect", lambda: _connect(address, keywords))


async def _connect(address: Any, keywords: dict[str, Any]) -> Connection:
    opened = connect_args(address, **keywords)
    hub = _aio.hub()
    link = await hub.run(
        opened.session._open_link(hub.native, opened.host, opened.port, opened.args)
    )
    connection = Connection(link, opened.session)
    log.info("connected to %s (%s)", peer_text(connection.peer.address), opened.speaks)
    return connection


def serve(
    address: Any,
    handler: Callable[[Connection], Awaitable[Any] | Any],
    **keywords: Any,
) -> Opening[Server[Connection]]:
    """``listen(address, **keywords)``, each connection handed to ``handler(conn)`` in a
    task of its own; the connection is closed when the handler returns. To be awaited
    (or ``async with``)."""
    check_handler(handler)

    async def started() -> Server[Connection]:
        return Server(await listen(address, **keywords), handler)

    return Opening("serve", started)
