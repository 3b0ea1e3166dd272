"""``listen`` and ``serve`` for the reference (README "Connections"): a listening socket,
the loop that takes connections from the kernel while there is room (at most
``max_connections`` open, ``max_pending_handshakes`` of them shaking hands), each
handshake under ``handshake_timeout``, and the connections that passed queued for
``accept()``. A peer that fails TLS, the hello or authentication, or stays silent, is
logged (rate-limited) and dropped: it never reaches ``accept()``.

Apart from the connection because this is the server's bookkeeping (slots, tasks,
refusals); how a connection is made once a socket is accepted is ``establish``'s, and
``serve``'s handlers run in ``_peers.Server``, which both implementations share.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from .._peers import (
    HANDSHAKE_TIMEOUT,
    MAX_CONNECTIONS,
    MAX_PENDING_HANDSHAKES,
    Address,
    Ready,
    RefusalLog,
    Server,
    check_count,
    check_handler,
    check_handshake_timeout,
    log_accepted,
    parse_address,
    peer_text,
    silent_text,
)
from ..errors import GradientStreamError, StreamIOError
from . import _protocol as p
from ._connection import Connection, Endpoint, endpoint, establish
from ._streams import open_accepted
from ._tls import broke_off, listener_tls_error

logger = logging.getLogger("gradstream")

# Seconds before a failed accept (out of descriptors, say) is tried again.
_ACCEPT_RETRY = 0.1


@dataclass(frozen=True)
class ListenerLimits:
    """How much a listener gives to peers it does not know yet."""

    handshake_timeout: float
    max_pending_handshakes: int
    max_connections: int


async def _bound_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (resolved without blocking the loop)."""
    loop = asyncio.get_running_loop()
    try:
        infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, kind, proto, _, where = infos[0]
        sock = socket.socket(family, kind, proto)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(where)
            sock.listen(socket.SOMAXCONN)
            sock.setblocking(False)
        except BaseException:
            sock.close()
            raise
    except OSError as exc:
        raise StreamIOError.from_os_error(exc) from exc
    return sock


def _address_of(sock: socket.socket) -> Address:
    name = sock.getsockname()
    return str(name[0]), int(name[1])


class Listener:
    """Connections from peers that passed the handshake: ``await accept()``, or
    ``async for conn in listener`` (until it is closed). ``address`` is the ``(host,
    port)`` bound."""

    def __init__(self, sock: socket.socket, ends: Endpoint, limits: ListenerLimits) -> None:
        self._sock = sock
        self._ends = ends
        self._limits = limits
        self._address = _address_of(sock)
        self._refusals = RefusalLog(peer_text(self._address))
        # A connection slot is held from the kernel's accept until the connection
        # closes; a handshake slot while its handshake runs.
        self._connection_slots = asyncio.Semaphore(limits.max_connections)
        self._handshake_slots = asyncio.Semaphore(limits.max_pending_handshakes)
        self._ready: Ready[Connection] = Ready()
        self._handshakes: set[asyncio.Task[None]] = set()
        self._closed = False
        self._acceptor = asyncio.create_task(self._accept_loop())

    @property
    def address(self) -> Address:
        return self._address

    def __repr__(self) -> str:
        state = "closed" if self._closed else "listening"
        return f"<Listener {peer_text(self._address)} {self._ends.protocol} {state}>"

    # ---- taking connections from the kernel

    async def _accept_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._connection_slots.acquire()
            try:
                await self._handshake_slots.acquire()
                try:
                    sock, where = await loop.sock_accept(self._sock)
                except BaseException:
                    self._handshake_slots.release()
                    raise
            except OSError as exc:
                # Out of descriptors, say: refuse nobody in particular, and try again.
                self._connection_slots.release()
                self._refusals.refused(None, f"accept failed: {exc}")
                await asyncio.sleep(_ACCEPT_RETRY)
                continue
            except BaseException:
                self._connection_slots.release()
                raise
            task = asyncio.create_task(self._admit(sock, (str(where[0]), int(where[1]))))
            self._handshakes.add(task)
            task.add_done_callback(self._handshakes.discard)

    async def _admit(self, sock: socket.socket, address: Address) -> None:
        """One peer's handshake under the timeout: queued for accept() if it passes,
        else logged and dropped."""
        limit = self._limits.handshake_timeout
        try:
            try:
                async with asyncio.timeout(limit) as bound:
                    conn = await self._open(sock, address)
            except TimeoutError:
                if not bound.expired():
                    raise
                self._refuse(address, silent_text(limit))
                return
        except (GradientStreamError, OSError) as exc:
            self._refuse(address, str(exc) or repr(exc))
            return
        except BaseException:
            self._connection_slots.release()
            raise
        finally:
            self._handshake_slots.release()
        log_accepted(self._address, conn.peer, self._ends.protocol)
        self._ready.put(conn)

    def _refuse(self, address: Address, reason: str) -> None:
        self._connection_slots.release()
        self._refusals.refused(address, reason)

    async def _open(self, sock: socket.socket, address: Address) -> Connection:
        ends = self._ends
        try:
            streams = await open_accepted(sock, ends.context, self._limits.handshake_timeout)
        except ssl.SSLError as exc:
            raise listener_tls_error(exc, address) from None
        except OSError as exc:
            if ends.context is None:
                raise
            # A client that refuses this listener's certificate aborts its handshake.
            raise broke_off(repr(exc), address) from None
        # The whole handshake is under handshake_timeout: no wait of its own.
        return await establish(
            streams,
            ends,
            p.ROLE_SERVER,
            address,
            timeout=None,
            on_close=self._connection_slots.release,
        )

    # ---- handing them out

    async def accept(self) -> Connection:
        """The next connection that passed its handshake."""
        return await self._ready.accept()

    def __aiter__(self) -> Listener:
        return self

    async def __anext__(self) -> Connection:
        conn = await self._ready.next()
        if conn is None:
            raise StopAsyncIteration
        return conn

    async def close(self) -> None:
        """Stop listening: handshakes under way are dropped, connections not yet
        accepted are closed; connections accept() gave out stay their owners'."""
        if self._closed:
            return
        self._closed = True
        self._acceptor.cancel()
        for task in list(self._handshakes):
            task.cancel()
        await asyncio.gather(self._acceptor, *self._handshakes, return_exceptions=True)
        self._sock.close()
        await self._ready.close()
        logger.info("listener %s closed", peer_text(self._address))

    async def __aenter__(self) -> Listener:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()


async def listen(
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
) -> Listener:
    """Listen at ``address`` (port 0: any free port, see ``Listener.address``)."""
    host, port = parse_address(address)
    ends = endpoint(
        session=session,
        tls=tls,
        authkey=authkey,
        timeout=timeout,
        deadline=deadline,
        protocol=protocol,
        listener=True,
    )
    limits = ListenerLimits(
        check_handshake_timeout(handshake_timeout),
        check_count(max_pending_handshakes, "max_pending_handshakes"),
        check_count(max_connections, "max_connections"),
    )
    listener = Listener(await _bound_socket(host, port), ends, limits)
    logger.info("listening on %s (%s)", peer_text(listener.address), ends.describe())
    return listener


# --------------------------------------------------------------------------- serve

Handler = Callable[[Connection], Awaitable[Any] | Any]


async def serve(address: Any, handler: Handler, **keywords: Any) -> Server[Connection]:
    """``listen(address, **keywords)``, each connection handed to ``handler(conn)`` in a
    task of its own (``_peers.Server``); the connection is closed when the handler
    returns."""
    check_handler(handler)
    return Server(await listen(address, **keywords), handler)
