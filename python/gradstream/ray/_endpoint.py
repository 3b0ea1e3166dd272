"""A process's gradstream endpoint for the ``GRADSTREAM`` tensor transport.

The transport is one-sided (Ray asks only the receiver to act): the process that made an
object keeps its arrays here under the object's id (``offer``) and serves them to whoever
asks on its listener; a receiver asks the maker's listener for them (``fetch``) over a
connection it keeps open for the next object from the same process. Each request and
each reply is a tensor set on a gradstream connection: sealed to it, CRC-checked chunk
by chunk, acknowledged, and under TLS / authkey when the settings say so.

A maker listens twice: on TCP at its node's address, and on a Unix socket
(``"unix:PATH"``, docs/guides/same-host.md) for receivers of its own Ray node, whose
payloads then move through shared memory. Which one a receiver uses is decided from
Ray's node ids (``_rdt``), never from whether a path happens to exist: two Ray nodes
may share one filesystem.

All network work runs on this process's loop (``_loop``); ``offer``, ``withdraw`` and
``fetch`` are called from Ray's threads.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from typing import Any

import numpy as np
import numpy.typing as npt

from .. import _connection
from .._connection import Connection
from .._dtypes import DTYPES
from ..errors import (
    DeliveryError,
    FrameError,
    IncompleteStreamError,
    ObjectUnavailableError,
    ProtocolError,
    StreamIOError,
    StreamTimeoutError,
)
from . import _control, _loop
from ._same_node import LocalListener, connect_locally, reachable
from ._settings import RaySettings

log = logging.getLogger("gradstream.ray")

Address = tuple[str, int] | str
"""A maker's TCP address, or its ``"unix:PATH"`` for receivers of its node."""
Arrays = list[npt.NDArray[Any]]

_REQUEST = "a fetch request"
# Connections a maker's listener serves at once: every receiver process of the job keeps
# one to it while it fetches (and for ``timeout`` after).
_MAX_CONNECTIONS = 4096
_REPLY = "an object or a refusal"


def node_host() -> str:
    """The address Ray uses for this node (its own IP, or what ``ray start
    --node-ip-address`` / ``ray.init(_node_ip_address=)`` said)."""
    import ray

    return str(ray.util.get_node_ip_address())  # type: ignore[no-untyped-call]


class Endpoint:
    """This process's listener for the objects it made, and its connections to the other
    processes' listeners (one per address, reused, one request at a time on each)."""

    def __init__(self, settings: RaySettings) -> None:
        self.settings = settings
        self._objects: dict[str, Arrays] = {}
        self._objects_lock = threading.Lock()
        self._server: Any = None
        self._address: tuple[str, int] | None = None
        # Where receivers of this node connect ("unix:PATH"): None, none.
        self._local: LocalListener | None = None
        # What receivers are told to connect to, when it is not the listener's own
        # address (a NAT or forwarding proxy in between; the tests' tampering proxy).
        self.advertised: tuple[str, int] | None = None
        self._start_lock = threading.Lock()
        self._pool: dict[Address, Connection] = {}
        self._turns: dict[Address, asyncio.Lock] = {}
        # The fetches under way, by object (two threads may fetch the same one).
        self._fetches: dict[str, set[concurrent.futures.Future[Arrays]]] = {}
        self._fetches_lock = threading.Lock()
        # Connections this endpoint opened to others (each kept for the next fetch),
        # and how many of them were Unix-socket connections to makers of this node.
        self.connections_opened = 0
        self.unix_connections_opened = 0

    # --- the side that made the object ------------------------------------------------

    def offer(self, object_id: str, arrays: Arrays) -> tuple[tuple[str, int], str | None]:
        """Serve ``arrays`` as ``object_id`` until ``withdraw``; the TCP address to fetch
        it from, and the ``"unix:PATH"`` for receivers of this node (None: there is none,
        or receivers were told to go through ``advertised``)."""
        address = self.address()
        with self._objects_lock:
            self._objects[object_id] = arrays
        if self.advertised is not None:
            return self.advertised, None
        return address, None if self._local is None else self._local.address

    def withdraw(self, object_id: str) -> None:
        with self._objects_lock:
            self._objects.pop(object_id, None)

    def held(self) -> int:
        """How many objects this endpoint serves now."""
        with self._objects_lock:
            return len(self._objects)

    def address(self) -> tuple[str, int]:
        """The TCP listener's address, listening first if this is the first call."""
        with self._start_lock:
            if self._address is None:
                self._address = _loop.call(self._listen())
            return self._address

    async def _listen(self) -> tuple[str, int]:
        host = self.settings.host or node_host()
        # A request is an empty tensor: a peer that sends more is refused at its
        # manifest, before its tensors move. Every receiver process keeps a connection
        # while it fetches, closed here once idle for ``timeout`` (_serve).
        self._server = await _connection.serve(
            (host, 0),
            self._serve,
            max_connections=_MAX_CONNECTIONS,
            **self.settings.link_keywords(max_values=1),
        )
        address: tuple[str, int] = self._server.address
        log.info("gradstream.ray endpoint listening on %s:%d", *address)
        # Receivers of this node fetch through a Unix socket (shared memory).
        self._local = await LocalListener.start(
            "gradstream-ray-",
            self._serve,
            self.settings,
            _MAX_CONNECTIONS,
            max_values=1,
            who="receivers",
        )
        return address

    async def _serve(self, conn: Connection) -> None:
        """One receiver's connection: a request, its reply, until the receiver closes."""
        while True:
            try:
                request = await conn.recv_tensors()
            except StreamTimeoutError:
                # Idle for ``timeout``: closed, so idle peers hold no slot; the
                # receiver's next fetch opens a new connection.
                return
            if not request:
                return  # the receiver closed
            peer = conn.peer.address
            body, extra = _control.split(request, peer, _REQUEST)
            if body["kind"] != "fetch":
                raise ProtocolError(_REQUEST, f"a {body['kind']!r} message", peer)
            if extra:
                raise ProtocolError(_REQUEST, "a fetch request carrying tensors", peer)
            object_id = _control.object_id(body, peer, _REQUEST)
            with self._objects_lock:
                arrays = self._objects.get(object_id)
            if arrays is None:
                reply = _control.message(
                    "missing", id=object_id, detail="this process no longer holds it"
                )
            else:
                reply = _control.message("object", id=object_id, count=len(arrays))
                reply.update((str(i), array) for i, array in enumerate(arrays))
            await conn.send_tensors(reply)

    # --- the side that receives it ----------------------------------------------------

    def fetch(
        self,
        address: tuple[str, int],
        object_id: str,
        max_values: int | None = None,
        local: str | None = None,
    ) -> Arrays:
        """The arrays of ``object_id`` from the endpoint at ``address`` (blocking), or at
        ``local`` (its ``"unix:PATH"``: the caller established that the maker is on this
        node) when the settings allow it; a reply of more than ``max_values`` values in
        all is refused from its manifest (a ``TensorSetError``), before any of its values
        is decoded or held."""
        tcp = (str(address[0]), int(address[1]))
        peer: Address = reachable(self.settings, local) or tcp
        # Scheduled and recorded under one lock: an abort finds every fetch begun.
        with self._fetches_lock:
            future = _loop.submit(self._fetch(peer, object_id, max_values, tcp))
            self._fetches.setdefault(object_id, set()).add(future)
        try:
            return future.result()
        except concurrent.futures.CancelledError:
            raise ObjectUnavailableError(
                object_id, address, "the transfer was aborted (by Ray)"
            ) from None
        finally:
            with self._fetches_lock:
                under_way = self._fetches.get(object_id, set())
                under_way.discard(future)
                if not under_way:
                    self._fetches.pop(object_id, None)

    def abort(self, object_id: str) -> None:
        """Stop every fetch of ``object_id`` under way (their connections are closed)."""
        with self._fetches_lock:
            under_way = list(self._fetches.get(object_id, ()))
        for future in under_way:
            future.cancel()

    async def _fetch(
        self, address: Address, object_id: str, max_values: int | None, tcp: tuple[str, int]
    ) -> Arrays:
        # One request at a time per connection: fetches from one maker take turns.
        async with self._turns.setdefault(address, asyncio.Lock()):
            return await self._fetch_in_turn(address, object_id, max_values, tcp)

    async def _fetch_in_turn(
        self, address: Address, object_id: str, max_values: int | None, tcp: tuple[str, int]
    ) -> Arrays:
        for retry in (False, True):
            conn = self._pool.get(address)
            pooled = conn is not None and not conn.closed
            if conn is None or conn.closed:
                conn = await self._connect(address, object_id, tcp)
            try:
                await conn.send_tensors(_control.message("fetch", id=object_id))
                reply = await conn.recv_tensors(max_values=max_values)
            except StreamTimeoutError:
                # A stalled or trickling maker: its bound is spent, not asked again.
                await self._drop(address, conn)
                raise
            except (StreamIOError, DeliveryError, IncompleteStreamError, FrameError) as exc:
                await self._drop(address, conn)
                if isinstance(exc, FrameError) and not _ended(exc):
                    raise  # a damaged frame, not a lost connection
                # A kept connection the peer closed while idle: once more on a new one.
                # Asking again is safe: a fetch changes nothing on the peer.
                if pooled and not retry:
                    continue
                # The maker died or left mid-reply (CRC and seal errors stay as they are).
                raise ObjectUnavailableError(
                    object_id, address, f"the connection failed: {exc}"
                ) from exc
            except BaseException:
                await self._drop(address, conn)
                raise
            if not reply:
                await self._drop(address, conn)
                if pooled and not retry:
                    continue
                raise ObjectUnavailableError(
                    object_id, address, "the peer closed the connection without a reply"
                )
            try:
                return self._read_reply(reply, address, object_id)
            except BaseException:
                await self._drop(address, conn)  # a peer that broke the protocol
                raise
        raise AssertionError("unreachable: the second try returns or raises")

    async def _connect(self, address: Address, object_id: str, tcp: tuple[str, int]) -> Connection:
        """A new connection for fetches from the maker at ``address`` (kept under it);
        a maker of this node whose Unix socket cannot be reached (a process of another
        user, or in another mount namespace: refused, not there) is asked over ``tcp``
        instead. One that does not answer in ``connect_timeout`` is not asked again: it
        is stuck, and TCP would only double the wait."""
        tried = ""
        try:
            conn = None
            if isinstance(address, str):
                conn, tried = await connect_locally(address, self.settings)
                self.unix_connections_opened += conn is not None
            if conn is None:
                conn = await _connection.connect(tcp, **self.settings.link_keywords())
        except StreamIOError as exc:  # refused, reset, or no answer in connect_timeout
            # Its maker is gone (the actor died or restarted) or cannot be reached.
            why = f"cannot connect: {exc}" + (f" ({tried})" if tried else "")
            raise ObjectUnavailableError(object_id, address, why) from exc
        self._pool[address] = conn
        self.connections_opened += 1
        return conn

    async def _drop(self, address: Address, conn: Connection) -> None:
        if self._pool.get(address) is conn:
            del self._pool[address]
        await conn.close()

    def _read_reply(
        self, reply: dict[str, npt.NDArray[Any]], address: Address, object_id: str
    ) -> Arrays:
        body, arrays = _control.split(reply, address, _REPLY)
        answered = _control.object_id(body, address, _REPLY)
        if answered != object_id:
            raise ProtocolError(f"object {object_id}", f"object {answered}", address)
        if body["kind"] == "missing":
            detail = _control.field(body, "detail", str, address, _REPLY)
            raise ObjectUnavailableError(object_id, address, detail)
        if body["kind"] != "object":
            raise ProtocolError(_REPLY, f"a {body['kind']!r} message", address)
        count = _control.field(body, "count", int, address, _REPLY)
        if count != len(arrays):
            raise ProtocolError(
                f"{count} arrays, as its message says", f"{len(arrays)} arrays", address
            )
        return arrays

    async def close(self) -> None:
        """Stop listening and close every kept connection."""
        for conn in list(self._pool.values()):
            await conn.close()
        self._pool.clear()
        if self._server is not None:
            await self._server.close()
        if self._local is not None:
            await self._local.close()


def _ended(exc: FrameError) -> bool:
    """The stream ended inside a frame (the core's one text for it): the peer died or
    left mid-reply, as opposed to a frame that arrived damaged."""
    return exc.detail.startswith("truncated frame")


def check_arrays(arrays: list[Any]) -> None:
    """What the transport moves: numpy arrays of the four dtypes a gradstream tensor set
    carries (``TypeError`` naming the first other one)."""
    for index, array in enumerate(arrays):
        if not isinstance(array, np.ndarray) or array.dtype.name not in DTYPES:
            what = (
                f"an array of {array.dtype}"
                if isinstance(array, np.ndarray)
                else f"of type {type(array).__name__}"
            )
            raise TypeError(
                "the GRADSTREAM tensor transport moves numpy arrays of float32, float16, "
                f"bfloat16 or float64; value {index} of this result is {what}"
            )
