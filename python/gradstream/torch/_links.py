"""The connections of a ``"gradstream"`` process group between any two ranks.

Each rank keeps its listener open for the group's life (it admits only peers through
its TLS and the group's authkey). A connection carries one direction of one *channel*:
(sender, receiver, kind, tag), where kind is the ring, a user's ``send``/``recv`` (with
its tag) or the collectives built on pairs (gather, scatter, all-to-all). The sender
opens it, on its first message there, and its first message names the channel
(``_hello``); the receiver's listener files it under that channel, where a ``recv``
waits for it. So one rank alone opens each connection (never two for one channel), a
pair exchanging both ways at once has a connection per direction (a connection carries
one transfer at a time), and messages of different tags never meet on one connection
(docs/guides/torch-backend.md, "Point to point").
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

import numpy as np

from .._connection import Connection, Listener
from ..errors import StreamIOError

log = logging.getLogger("gradstream.torch")

RING, P2P, COLLECTIVE = 0, 1, 2
_KINDS = {RING: "ring", P2P: "send/recv", COLLECTIVE: "collective"}
# The first value of a channel's first message: not a secret (the authkey is checked
# before it), it tells a group's connection from a stray gradient.
_HELLO = 23.0625

Key = tuple[int, int, int]
"""A channel seen from one rank: (the other rank, kind, tag)."""


def _hello(sender: int, receiver: int, kind: int, tag: int) -> np.ndarray:
    return np.array([_HELLO, sender, receiver, kind, tag], np.float64)


class Links:
    """A rank's connections to the others, by channel: its listeners' pumps (TCP, and
    a Unix socket for ranks of its host), the
    connections that arrived (``inbound``) and those this rank opened (``outbound``),
    and a lock per direction and channel (``turn``) that keeps its messages in the order
    they were called. Made, used and closed on the backend's loop."""

    def __init__(
        self,
        rank: int,
        size: int,
        listeners: list[Listener],
        addresses: list[str],
        dial: Callable[[str], Awaitable[Connection]],
        seconds: float,
    ) -> None:
        self._rank = rank
        self._size = size
        self._listeners = listeners
        self._addresses = addresses
        self._dial = dial
        self._seconds = seconds
        self._arrivals: dict[Key, asyncio.Future[Connection]] = {}
        self._out: dict[Key, Connection] = {}
        self._turns: dict[tuple[bool, Key], asyncio.Lock] = {}
        self._greeting: set[asyncio.Task[None]] = set()
        self._closed = False
        loop = asyncio.get_running_loop()
        self._pumps = [loop.create_task(self._admit(listener)) for listener in listeners]

    def turn(self, outgoing: bool, key: Key) -> asyncio.Lock:
        """The lock of one direction of a channel (FIFO: its calls in call order)."""
        lock = self._turns.get((outgoing, key))
        if lock is None:
            lock = self._turns[(outgoing, key)] = asyncio.Lock()
        return lock

    def turns(self) -> list[asyncio.Lock]:
        return list(self._turns.values())

    async def outbound(self, key: Key) -> Connection:
        """The connection this rank sends on for channel ``key``, opened (and named to
        the receiver) on first use; the caller holds the channel's turn."""
        conn = self._out.get(key)
        if conn is None:
            other, kind, tag = key
            conn = await self._dial(self._addresses[other])
            try:
                await conn.send(_hello(self._rank, other, kind, tag))
            except BaseException:
                await conn.close()
                raise
            self._out[key] = conn
        return conn

    async def inbound(self, key: Key) -> Connection:
        """The connection rank ``key[0]`` opened for channel ``key``, once it arrived."""
        arrival = self._arrival(key)
        try:
            return await asyncio.shield(arrival)
        except asyncio.CancelledError:
            if self._closed and arrival.cancelled():
                raise StreamIOError("the gradstream process group was shut down") from None
            raise

    def _arrival(self, key: Key) -> asyncio.Future[Connection]:
        arrival = self._arrivals.get(key)
        if arrival is None:
            arrival = self._arrivals[key] = asyncio.get_running_loop().create_future()
        return arrival

    async def _admit(self, listener: Listener) -> None:
        async for conn in listener:
            task = asyncio.ensure_future(self._identify(conn))
            self._greeting.add(task)
            task.add_done_callback(self._greeting.discard)

    async def _identify(self, conn: Connection) -> None:
        """Read a new connection's first message and file it under its channel; a
        connection that does not name one of this group's channels is closed."""
        filed = False
        try:
            got = await asyncio.wait_for(conn.recv(), self._seconds)
            key = self._key_of(got)
            arrival = self._arrival(key)
            if arrival.done():
                raise ValueError(f"a second connection for channel {self._name(key)}")
            arrival.set_result(conn)
            filed = True
        except Exception as exc:  # a TimeoutError among them
            log.warning(
                "gradstream backend: rank %d dropped a connection from %s: %s",
                self._rank,
                conn.peer.address,
                exc,
            )
        finally:
            if not filed:
                await conn.close()

    def _key_of(self, got: np.ndarray) -> Key:
        if got.shape != (5,) or got.dtype != np.float64 or got[0] != _HELLO:
            raise ValueError("its first message does not name a channel of the group")
        sender, receiver, kind, tag = (int(v) for v in got[1:])
        if receiver != self._rank or not 0 <= sender < self._size or kind not in _KINDS:
            raise ValueError(
                f"it names rank {sender} to rank {receiver} (kind {kind}), not a channel "
                f"to rank {self._rank} of a group of {self._size}"
            )
        return (sender, kind, tag)

    def _name(self, key: Key) -> str:
        other, kind, tag = key
        return f"{_KINDS[kind]} from rank {other} tag {tag}"

    async def close(self) -> None:
        """Stop listening and close every connection; a ``recv`` still waiting for its
        connection fails as shut down."""
        self._closed = True
        for listener in self._listeners:
            await listener.close()
        for task in [*self._pumps, *self._greeting]:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for arrival in self._arrivals.values():
            if arrival.done():
                await arrival.result().close()
            else:
                arrival.cancel()
        for conn in self._out.values():
            await conn.close()
