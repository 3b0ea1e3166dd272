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
from ._peers import TLS, Peer, RefusalLog, parse_address
from ._session import GradientStreamSession, _hand_back, _lend, _tensor_dict
from .errors import SettingError, StreamIOError

log = logging.getLogger("gradstream")

__all__ = ["Connection", "Listener", "Server", "connect", "listen", "serve"]


HANDSHAKE_TIMEOUT = 10.0
MAX_PENDING_HANDSHAKES = 64
MAX_CONNECTIONS = 256
# A listener's connections give each gradient this long once it has begun, unless the
# session or listen(deadline=) says otherwise: a server must not be held for ever.
LISTENER_DEADLINE = 300.0
AUTHKEY_MIN = 16
_UNSET: Any = object()


def _seconds(value: Any, name: str, *, none: bool) -> float | None:
    if value is None and none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number{' or None' if none else ''}, not {type(value).__name__}")
    if not (value > 0 and value != float("inf")):
        raise SettingError(name, f"{name} must be a positive number of seconds, not {value!r}")
    return float(value)


def _count(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, not {type(value).__name__}")
    if value < 1:
        raise SettingError(name, f"{name} must be at least 1, not {value}")
    return value


def _link_settings(
    session: GradientStreamSession,
    *,
    listening: bool,
    tls: TLS | None = None,
    authkey: bytes | None = None,
    protocol: str = "gradstream",
    handshake_timeout: float = HANDSHAKE_TIMEOUT,
    timeout: float | None = _UNSET,
    deadline: float | None = _UNSET,
    max_pending_handshakes: int = _UNSET,
    max_connections: int = _UNSET,
) -> tuple[dict[str, Any], tuple[int, int]]:
    """The checked settings of a connection or listener, as the engine takes them, and
    a listener's caps."""
    if protocol not in ("gradstream", "seed"):
        raise SettingError("protocol", f"protocol must be 'gradstream' or 'seed', not {protocol!r}")
    if protocol == "seed" and (tls is not None or authkey is not None):
        which = "tls" if tls is not None else "authkey"
        raise SettingError(
            which,
            f"protocol='seed' speaks the original's bare frames: it has no {which}= "
            "(use protocol='gradstream')",
        )
    if tls is not None:
        if not isinstance(tls, TLS):
            raise TypeError(f"tls must be a gradstream.TLS or None, not {type(tls).__name__}")
        if listening and (tls.cert is None or tls.key is None):
            raise SettingError("tls", "a listener's TLS needs cert= and key=")
        if not listening and tls.ca is None:
            raise SettingError("tls", "a client's TLS needs ca= (the CA that signed the server)")
    if authkey is not None:
        if not isinstance(authkey, (bytes, bytearray, memoryview)):
            raise TypeError(f"authkey must be bytes or None, not {type(authkey).__name__}")
        authkey = bytes(authkey)
        if len(authkey) < AUTHKEY_MIN:
            raise SettingError(
                "authkey", f"authkey must be at least {AUTHKEY_MIN} bytes, not {len(authkey)}"
            )
    if not listening and (max_pending_handshakes is not _UNSET or max_connections is not _UNSET):
        raise TypeError("max_pending_handshakes and max_connections are listen()'s")
    if deadline is _UNSET:
        deadline = session.deadline
        if deadline is None and listening:
            deadline = LISTENER_DEADLINE
    args = {
        "protocol": protocol,
        "tls": None if tls is None else (tls.cert, tls.key, tls.ca),
        "authkey": authkey,
        "handshake_timeout": _seconds(handshake_timeout, "handshake_timeout", none=False),
        "timeout": _seconds(session.timeout if timeout is _UNSET else timeout, "timeout", none=True),
        "deadline": _seconds(deadline, "deadline", none=True),
    }
    caps = (
        _count(MAX_PENDING_HANDSHAKES if max_pending_handshakes is _UNSET else max_pending_handshakes, "max_pending_handshakes"),
        _count(MAX_CONNECTIONS if max_connections is _UNSET else max_connections, "max_connections"),
    )
    return args, caps


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
        *,
        out: npt.NDArray[Any] | None = None,
        progress: TransferProgress | None = None,
        deadline: float | None = None,
    ) -> npt.NDArray[Any] | None:
        """Receive one gradient (into ``out`` when given: then ``out`` itself), or None
        when the peer closed the connection before another began."""
        lent = None if out is None else _lend(out)
        hub = _aio.hub()
        started = time.perf_counter()
        job = self._link.recv(hub.native, progress, None if lent is None else lent.args, deadline)
        values = await hub.track(job)
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
    ) -> dict[str, npt.NDArray[Any]] | None:
        """Receive a named set of tensors, in the sender's order; None when the peer
        closed the connection before another began."""
        hub = _aio.hub()
        started = time.perf_counter()
        got = await hub.track(self._link.recv_tensors(hub.native, progress, deadline))
        if got is None:
            return None
        tensors = _tensor_dict(got)
        size = sum(t.nbytes for t in tensors.values())
        _log_transfer("received", "tensor set", size, started, self.peer)
        return tensors

    def __aiter__(self) -> AsyncIterator[npt.NDArray[Any]]:
        return self._gradients()

    async def _gradients(self) -> AsyncIterator[npt.NDArray[Any]]:
        while (gradient := await self.recv()) is not None:
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
        self.address: tuple[str, int] = tuple(native.address)  # type: ignore[assignment]
        self._accepted: asyncio.Queue[Connection | None] = asyncio.Queue()
        self._refusals = RefusalLog(log, self.address)
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
                self._refusals.refused(tuple(address), error)
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
    session = session if session is not None else GradientStreamSession()
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
    session = session if session is not None else GradientStreamSession()
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

