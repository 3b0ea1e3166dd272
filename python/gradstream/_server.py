"""What a listener hands out, and ``serve``'s result (docs/guides/connections.md):
``Ready``, the connections through their handshake that ``accept()`` has not given out
yet, and ``Server``, which runs a handler per connection.

Plain Python over ``_address``, ``_logs`` and ``errors``. It knows a listener and its
connections only by what it calls on them (``_Listener``, ``_Connection``), so that
``_connection`` imports it and not the other way round.
"""

from __future__ import annotations

import asyncio
import errno
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Generic, Protocol, TypeVar

from ._address import Address, Peer, peer_text
from ._logs import logger
from .errors import StreamIOError

__all__ = ["Ready", "Server"]


class _Connection(Protocol):
    @property
    def peer(self) -> Peer: ...
    async def close(self) -> None: ...


C = TypeVar("C", bound=_Connection)
C_co = TypeVar("C_co", bound=_Connection, covariant=True)


class _Listener(Protocol[C_co]):
    @property
    def address(self) -> Address: ...
    def __aiter__(self) -> AsyncIterator[C_co]: ...
    async def close(self) -> None: ...


class Ready(Generic[C]):
    """A listener's connections through their handshake that ``accept()`` has not given
    out yet (they count against max_connections, and closing the listener closes them);
    once closed, ``accept()`` is a StreamIOError (EBADF) and ``next()`` None."""

    def __init__(self) -> None:
        self._queue: asyncio.Queue[C | None] = asyncio.Queue()
        self._closed = False

    def put(self, conn: C) -> None:
        self._queue.put_nowait(conn)

    async def next(self) -> C | None:
        """The next connection; None once closed (for ``async for``)."""
        if self._closed:
            return None
        conn = await self._queue.get()
        if conn is None:
            self._queue.put_nowait(None)  # for every other waiter
        return conn

    async def accept(self) -> C:
        conn = await self.next()
        if conn is None:
            raise StreamIOError(errno.EBADF, "accept() on a closed listener")
        return conn

    async def close(self) -> None:
        """Close the connections still waiting, and wake every waiter."""
        self._closed = True
        while not self._queue.empty():
            waiting = self._queue.get_nowait()
            if waiting is not None:
                await waiting.close()
        self._queue.put_nowait(None)


class Server(Generic[C]):
    """``serve``'s result: each connection goes to ``handler`` in a task of its own,
    concurrently, and is closed when it returns; a handler's exception is logged
    (WARNING, with the traceback) and ends its connection only. ``address`` is the
    listener's."""

    def __init__(
        self, listener: _Listener[C], handler: Callable[[C], Awaitable[Any] | Any]
    ) -> None:
        self._listener = listener
        self._handler = handler
        self._handlers: set[asyncio.Task[None]] = set()
        self._dispatcher = asyncio.create_task(self._dispatch())

    @property
    def address(self) -> Address:
        return self._listener.address

    def __repr__(self) -> str:
        return f"<Server {self._listener!r}>"

    async def _dispatch(self) -> None:
        async for conn in self._listener:
            task = asyncio.create_task(self._serve(conn))
            self._handlers.add(task)
            task.add_done_callback(self._handlers.discard)

    async def _serve(self, conn: C) -> None:
        try:
            result = self._handler(conn)
            if inspect.isawaitable(result):
                await result
        except Exception as exc:
            logger.warning(
                "handler of the connection with %s failed: %r",
                peer_text(conn.peer.address),
                exc,
                exc_info=exc,
            )
        finally:
            await conn.close()

    async def serve_forever(self) -> None:
        """Wait until the server is closed."""
        await asyncio.shield(self._dispatcher)

    async def close(self) -> None:
        """Stop listening and end the running handlers (their connections closed)."""
        await self._listener.close()
        self._dispatcher.cancel()
        for task in list(self._handlers):
            task.cancel()
        await asyncio.gather(self._dispatcher, *self._handlers, return_exceptions=True)

    async def __aenter__(self) -> Server[C]:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()
