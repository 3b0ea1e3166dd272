"""Connections over the native engine (README "Connections"): ``listen``, ``connect``,
``serve``, and the ``Connection`` and ``Listener`` they give.

The protocol (TLS, the hello, authentication, seals, acks) runs in Rust on tokio
(``gradstream._native.Link`` and ``Listener``); this module checks the arguments once,
turns each call into one job on the loop's hub, logs, and hands numpy arrays back as the
session does. ``gradstream.reference`` has its own implementation of the same API and
bytes; ``_peers`` holds what the two share (``TLS``, ``Peer``, addresses, defaults).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from types import TracebackType
from typing import Any

import numpy.typing as npt

from . import _aio
from ._native import TransferProgress
from ._peers import (
    HANDSHAKE_TIMEOUT,
    LISTENER_DEADLINE,
    MAX_CONNECTIONS,
    MAX_PENDING_HANDSHAKES,
    Peer,
    RefusalLog,
    check_authkey,
    check_count,
    check_handshake_timeout,
    check_plain_seed,
    check_protocol,
    client_tls,
    listener_tls,
    parse_address,
    peer_text,
)
from ._session import GradientStreamSession, _hand_back, _lend, _tensor_dict
from .errors import SettingError, StreamIOError

log = logging.getLogger("gradstream")

__all__ = ["Connection", "Listener", "Server", "connect", "listen", "serve"]


def _session(session: Any) -> GradientStreamSession:
    if session is None:
        return GradientStreamSession("gradstream")
    if not isinstance(session, GradientStreamSession):
        raise TypeError(
            "session must be a gradstream.GradientStreamSession or None, not "
            f"{type(session).__name__}"
        )
    return session


def _seconds(value: Any, name: str) -> float | None:
    """None, or a positive finite number of seconds (as the session checks its own)."""
    if value is None:
        return None
    if isinstance(value, (bool, str)) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be None or a number, not {type(value).__name__}")
    if not (0 < value < float("inf")):
        raise SettingError(name, f"{name} must be a positive number of seconds, got {value!r}")
    return float(value)


def _link_settings(
    session: GradientStreamSession,
    *,
    listening: bool,
    tls: Any = None,
    authkey: Any = None,
    protocol: Any = "gradstream",
    handshake_timeout: Any = HANDSHAKE_TIMEOUT,
    timeout: Any = None,
    deadline: Any = None,
    **caps: Any,
) -> tuple[dict[str, Any], tuple[int, int]]:
    """The checked keywords of ``connect`` or ``listen`` (``listening``), in the order
    and with the words of the reference (``_peers``), as the engine takes them; and a
    listener's caps. A call's timeout and deadline override the session's; a listener's
    connections give a gradient, once begun, LISTENER_DEADLINE seconds when neither
    sets a deadline."""
    kind = check_protocol(protocol)
    checked_tls = listener_tls(tls) if listening else client_tls(tls)
    key = check_authkey(authkey)
    wait = _seconds(timeout, "timeout")
    bound = _seconds(deadline, "deadline")
    check_plain_seed(kind, checked_tls, key)
    wait = session.timeout if wait is None else wait
    bound = session.deadline if bound is None else bound
    if listening and bound is None:
        bound = LISTENER_DEADLINE
    unknown = set(caps) - ({"max_pending_handshakes", "max_connections"} if listening else set())
    if unknown:
        call = "listen" if listening else "connect"
        raise TypeError(f"{call}() got an unexpected keyword argument {sorted(unknown)[0]!r}")
    args = {
        "protocol": kind,
        "tls": None if checked_tls is None else (checked_tls.cert, checked_tls.key, checked_tls.ca),
        "authkey": key,
        "handshake_timeout": check_handshake_timeout(handshake_timeout),
        "timeout": wait,
        "deadline": bound,
    }
    pending = caps.get("max_pending_handshakes", MAX_PENDING_HANDSHAKES)
    connections = caps.get("max_connections", MAX_CONNECTIONS)
    return args, (
        check_count(pending, "max_pending_handshakes"),
        check_count(connections, "max_connections"),
    )


class Connection:
    """A connection to one peer: gradients and tensor sets each way, one transfer at a
    time, each sealed to the connection and acknowledged by the receiver (with
    ``protocol="gradstream"``). Made by ``connect``, ``Listener.accept`` or ``serve``."""

    def __init__(self, link: Any, session: GradientStreamSession) -> None:
        self._link = link
        self._session = session
        address, subject, authenticated = link.peer()
        self.peer = Peer(address=tuple(address), tls_subject=subject, authenticated=authenticated)
        self._closed = False

    def __repr__(self) -> str:
        host, port = self.peer.address
        return f"<gradstream.Connection to {host}:{port}>"

    @property
    def closed(self) -> bool:
        """True once the connection is closed: by close(), by the peer, or after a
        failed transfer left it out of step."""
        return self._closed or self._link.closed()

    async def _run(self, job: int) -> Any:
        return await _aio.hub().track(job)

    async def send(
        self,
        gradient: Any,
        *,
        progress: TransferProgress | None = None,
        deadline: float | None = None,
    ) -> int:
        """Send one gradient; the number of chunks, once the peer has verified it (its
        ack). ``DeliveryError`` when it did not."""
        args = self._session._take(gradient)
        hub = _aio.hub()
        started = time.perf_counter()
        sent: int = await hub.track(self._link.send(hub.native, args, progress, deadline))
        _log_transfer("sent", "gradient", args[0].nbytes, started, self.peer)
        return sent

    async def recv(
        self,
        out: npt.NDArray[Any] | None = None,
        *,
        progress: TransferProgress | None = None,
        deadline: float | None = None,
    ) -> npt.NDArray[Any]:
        """Receive one gradient, as ``receive_from`` (into ``out`` when given: then
        ``out`` itself); what ``receive_from`` gives at the end (an empty array) when the
        peer closed the connection before another began (``closed`` is then True)."""
        got = await self._recv(out, progress, deadline, none_at_end=False)
        assert got is not None  # none_at_end=False gives the empty gradient instead
        return got

    async def _recv(
        self,
        out: npt.NDArray[Any] | None,
        progress: TransferProgress | None,
        deadline: float | None,
        *,
        none_at_end: bool,
    ) -> npt.NDArray[Any] | None:
        lent = None if out is None else _lend(out)
        hub = _aio.hub()
        started = time.perf_counter()
        args = None if lent is None else lent.args
        job = self._link.recv(hub.native, progress, args, deadline, none_at_end)
        values = await hub.track(job)
        if self._link.closed():
            self._closed = True
        if values is None:
            return None
        got = lent.array if lent is not None else _hand_back(values)
        _log_transfer("received", "gradient", got.nbytes, started, self.peer)
        return got

    async def send_tensors(
        self,
        tensors: Any,
        *,
        progress: TransferProgress | None = None,
        deadline: float | None = None,
    ) -> int:
        """Send a named set of tensors; the number of frames, once acknowledged."""
        taken = self._session._tensors(tensors, "sending")
        hub = _aio.hub()
        started = time.perf_counter()
        sent: int = await hub.track(self._link.send_tensors(hub.native, taken, progress, deadline))
        size = sum(values.nbytes for _, values, _, _ in taken)
        _log_transfer("sent", "tensor set", size, started, self.peer)
        return sent

    async def recv_tensors(
        self,
        *,
        progress: TransferProgress | None = None,
        deadline: float | None = None,
    ) -> dict[str, npt.NDArray[Any]]:
        """Receive a named set of tensors, in the sender's order; ``{}`` when the peer
        closed the connection before another began (``closed`` is then True)."""
        hub = _aio.hub()
        started = time.perf_counter()
        got = await hub.track(self._link.recv_tensors(hub.native, progress, deadline))
        if got is None:
            self._closed = True
            return {}
        tensors = _tensor_dict(got)
        size = sum(t.nbytes for t in tensors.values())
        _log_transfer("received", "tensor set", size, started, self.peer)
        return tensors

    def __aiter__(self) -> AsyncIterator[npt.NDArray[Any]]:
        return self._gradients()

    async def _gradients(self) -> AsyncIterator[npt.NDArray[Any]]:
        while (gradient := await self._recv(None, None, None, none_at_end=True)) is not None:
            yield gradient

    async def close(self) -> None:
        """Close the connection (after a running transfer, which the caller cancels
        first if it must not finish); idempotent."""
        if not self._closed:
            self._closed = True
            hub = _aio.hub()
            await hub.track(self._link.close(hub.native))

    async def __aenter__(self) -> Connection:
        return self

    async def __aexit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.close()


def _log_transfer(done: str, what: str, size: int, started: float, peer: Peer) -> None:
    if log.isEnabledFor(logging.DEBUG):
        seconds = max(time.perf_counter() - started, 1e-9)
        host, port = peer.address
        log.debug(
            "%s a %s of %d bytes with %s:%d in %.3f s (%.1f MB/s)",
            done,
            what,
            size,
            host,
            port,
            seconds,
            size / seconds / 1e6,
        )


class Listener:
    """A bound listener: peers through TLS, the hello and authentication come out of
    ``accept`` (or ``async for``); every other peer is logged and dropped."""

    def __init__(self, native: Any, session: GradientStreamSession) -> None:
        self._native = native
        self._session = session
        self.address: tuple[str, int] = native.address
        self._accepted: asyncio.Queue[Connection | None] = asyncio.Queue()
        self._refusals = RefusalLog(peer_text(self.address))
        self._pump = asyncio.get_running_loop().create_task(self._take_events())
        self._closed = False

    def __repr__(self) -> str:
        host, port = self.address
        return f"<gradstream.Listener on {host}:{port}>"

    async def _take_events(self) -> None:
        hub = _aio.hub()
        while True:
            event = await hub.track(self._native.next(hub.native))
            if event is None:
                break
            if event[0] == "connection":
                connection = Connection(event[1], self._session)
                host, port = connection.peer.address
                log.info("accepted a connection from %s:%d", host, port)
                self._accepted.put_nowait(connection)
            else:
                _, address, error = event
                self._refusals.refused(tuple(address), str(error))
        self._accepted.put_nowait(None)

    async def accept(self) -> Connection:
        """The next peer through the handshake (``StreamIOError`` once closed)."""
        if self._closed:
            raise StreamIOError("the listener is closed")
        got = await self._accepted.get()
        if got is None:
            self._accepted.put_nowait(None)  # for every other waiter
            raise StreamIOError("the listener is closed")
        return got

    def __aiter__(self) -> AsyncIterator[Connection]:
        return self._connections()

    async def _connections(self) -> AsyncIterator[Connection]:
        while True:
            try:
                yield await self.accept()
            except StreamIOError:
                if self._closed:
                    return
                raise

    async def close(self) -> None:
        """Stop accepting; connections already accepted stay open."""
        if self._closed:
            return
        self._closed = True
        self._native.close()
        self._pump.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._pump
        self._accepted.put_nowait(None)

    async def __aenter__(self) -> Listener:
        return self

    async def __aexit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.close()


async def listen(
    address: Any,
    *,
    session: GradientStreamSession | None = None,
    **settings: Any,
) -> Listener:
    """Listen on ``address`` (``"host:port"`` or ``(host, port)``; port 0 for any); the
    keywords are README "Connections"'s (tls, authkey, handshake_timeout,
    max_pending_handshakes, max_connections, timeout, deadline, protocol)."""
    session = _session(session)
    host, port = parse_address(address)
    args, caps = _link_settings(session, listening=True, **settings)
    hub = _aio.hub()
    native = await hub.track(session._engine.listen(hub.native, host, port, args, caps))
    listener = Listener(native, session)
    log.info("listening on %s:%d", *listener.address)
    return listener


async def connect(
    address: Any,
    *,
    session: GradientStreamSession | None = None,
    **settings: Any,
) -> Connection:
    """Connect to ``address`` and run the handshake; the keywords are README
    "Connections"'s (tls, authkey, handshake_timeout, timeout, deadline, protocol)."""
    session = _session(session)
    host, port = parse_address(address)
    args, _ = _link_settings(session, listening=False, **settings)
    hub = _aio.hub()
    link = await hub.track(session._engine.connect(hub.native, host, port, args))
    connection = Connection(link, session)
    log.info("connected to %s:%d", host, port)
    return connection


Handler = Callable[[Connection], Awaitable[Any]]


class Server:
    """``serve``'s result: a listener whose every connection runs ``handler`` in a task
    of its own; a handler's exception is logged and its connection closed."""

    def __init__(self, listener: Listener, handler: Handler) -> None:
        self.listener = listener
        self.address = listener.address
        self._handler = handler
        self._handlers: set[asyncio.Task[None]] = set()
        self._accepting = asyncio.get_running_loop().create_task(self._accept_all())

    async def _accept_all(self) -> None:
        async for connection in self.listener:
            task = asyncio.get_running_loop().create_task(self._handle(connection))
            self._handlers.add(task)
            task.add_done_callback(self._handlers.discard)

    async def _handle(self, connection: Connection) -> None:
        async with connection:
            try:
                await self._handler(connection)
            except Exception:
                host, port = connection.peer.address
                log.exception("the handler of the connection from %s:%d failed", host, port)

    async def serve_forever(self) -> None:
        """Wait until the server is closed."""
        await asyncio.shield(self._accepting)

    async def close(self) -> None:
        """Stop accepting and cancel the running handlers."""
        await self.listener.close()
        self._accepting.cancel()
        for task in list(self._handlers):
            task.cancel()
        await asyncio.gather(self._accepting, *self._handlers, return_exceptions=True)

    async def __aenter__(self) -> Server:
        return self

    async def __aexit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.close()


async def serve(
    address: Any,
    handler: Handler,
    *,
    session: GradientStreamSession | None = None,
    **settings: Any,
) -> Server:
    """Listen on ``address`` and run ``handler(connection)`` for every connection,
    concurrently; the keywords are ``listen``'s."""
    listener = await listen(address, session=session, **settings)
    return Server(listener, handler)
