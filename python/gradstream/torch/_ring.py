"""How a ``"gradstream"`` group's ranks meet (``meet``): the authkey and the reduce wire
agreed through the group's store, each rank's listeners (TCP, and a Unix socket for the
ranks of its host) published there, every rank's address routed, and the ring's two
connections opened: to the next rank (sends) and from the previous one (receives). The
group (``_group``) runs the collectives on what this returns."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
from collections.abc import Awaitable
from typing import Any

from .._checks import LISTENER_MOST
from .._connection import Connection, Listener, connect, listen
from .._local_socket import SocketDirectory, host_identity
from ..errors import SettingError, StreamIOError
from . import _loop
from ._links import RING, Links
from ._options import Options, _session, options

_KEY = "gradstream/authkey"
_ADDRESS = "gradstream/address/{}"
# A rank's host identity and Unix socket ("IDENTITY unix:PATH"), or "" for none.
_LOCAL = "gradstream/local/{}"
# A rank's reduce_wire_dtype ("none" or "int8"), which every rank must share.
_REDUCE_WIRE = "gradstream/reduce_wire/{}"
log = logging.getLogger("gradstream.torch")


@dataclasses.dataclass
class Ring:
    """What a rank holds of its group once it met the others: the ring's connections,
    every channel's (``links``, whose listeners stay open for the group's life), and
    the directory of its Unix socket (None: it has none)."""

    next: Connection
    prev: Connection
    links: Links
    socket_dir: SocketDirectory | None


def meet(store: Any, rank: int, size: int, seconds: float) -> Ring:
    """Listen, publish "host:port" in the store, read the others', connect to the next
    rank and take the previous one's connection, all within ``seconds``. Nothing of a
    group that could not be made stays open or on disk."""
    settings = options()
    _agree_on_the_reduce_wire(store, rank, size, settings.reduce_wire_dtype or "none")
    key = settings.authkey
    if key is None:
        if rank == 0:
            store.set(_KEY, os.urandom(32))
        key = bytes(store.get(_KEY))
    common = {"authkey": key, "timeout": seconds, "deadline": seconds}
    # Room for a connection from every other rank per channel: the ring, the
    # collectives made of pairs and a few send/recv tags, all at once.
    # Each connection from another host takes its streams' worth of both.
    room = {
        name: min(count * settings.streams, LISTENER_MOST[name])
        for name, count in (
            ("max_connections", 256 + 4 * size),
            ("max_pending_per_source", 64 + size),
        )
    }
    listener = _loop.submit(
        listen(f"{settings.host}:0", session=_session(), tls=settings.listen_tls, **room, **common)
    ).result()
    meeting = _Meeting(store, rank, size, seconds, settings, [listener])
    try:
        return meeting.join(room, common)
    except BaseException:
        for opened in meeting.listeners:
            _loop.submit(opened.close()).result()
        if meeting.socket_dir is not None:
            meeting.socket_dir.remove()
        raise


def _agree_on_the_reduce_wire(store: Any, rank: int, size: int, mine: str) -> None:
    """Publish this rank's ``reduce_wire_dtype`` and read every rank's: ranks that
    differ would end an all-reduce with different bits, so each refuses the group
    (``SettingError``, naming the first rank that differs) before opening anything."""
    store.set(_REDUCE_WIRE.format(rank), mine)
    for k in range(size):
        theirs = bytes(store.get(_REDUCE_WIRE.format(k))).decode()
        if theirs != mine:
            raise SettingError(
                "reduce_wire_dtype",
                f"rank {k} set reduce_wire_dtype={theirs!r}, rank {rank} "
                f"{mine!r}: every rank must configure the same before "
                "init_process_group",
            )


@dataclasses.dataclass
class _Meeting:
    """A rank on its way into the ring: what it opened so far (closed by ``meet`` if
    the rest fails)."""

    store: Any
    rank: int
    size: int
    seconds: float
    settings: Options
    listeners: list[Listener]
    socket_dir: SocketDirectory | None = None

    def join(self, room: dict[str, int], common: dict[str, Any]) -> Ring:
        """The rest of ``meet``: the Unix socket for ranks of this host, the addresses
        through the store, and the ring's two connections."""
        store, settings = self.store, self.settings
        # Ranks of this host meet on a Unix socket (shared memory), without TLS: the
        # kernel is the only party between them; the authkey still admits them.
        identity = host_identity() if settings.same_host == "unix" else None
        local = ""
        if identity is not None:
            try:
                self.socket_dir = SocketDirectory("gradstream-torch-")
                self.listeners.append(
                    _loop.submit(
                        listen(self.socket_dir.address, session=_session(), **room, **common)
                    ).result()
                )
                local = f"{identity} {self.socket_dir.address}"
            except (OSError, ValueError, StreamIOError) as exc:
                log.warning("gradstream backend: rank %d has no Unix socket: %s", self.rank, exc)
                if self.socket_dir is not None:
                    self.socket_dir.remove()
                    self.socket_dir = None
        store.set(_LOCAL.format(self.rank), local)
        port = self.listeners[0].address[1]  # a (host, port): listened on settings.host
        store.set(_ADDRESS.format(self.rank), f"{settings.host}:{port}")
        addresses = [
            _route(
                bytes(store.get(_ADDRESS.format(k))).decode(),
                bytes(store.get(_LOCAL.format(k))).decode(),
                identity,
            )
            for k in range(self.size)
        ]
        n, r = self.size, self.rank
        after = addresses[(r + 1) % n]

        def dial(address: str) -> Awaitable[Connection]:
            if address.startswith("unix:"):
                return connect(address, session=_session(), **common)
            return connect(
                address,
                session=_session(),
                tls=settings.connect_tls,
                streams=settings.streams,
                **common,
            )

        async def both() -> tuple[Connection, Connection, Links]:
            # Made on the backend's loop, which its pumps run on.
            links = Links(r, n, self.listeners, addresses, dial, self.seconds)
            try:
                after_conn, before_conn = await asyncio.wait_for(
                    asyncio.gather(
                        links.outbound(((r + 1) % n, RING, 0)),
                        links.inbound(((r - 1) % n, RING, 0)),
                    ),
                    self.seconds,
                )
            except BaseException:
                await links.close()
                raise
            return after_conn, before_conn, links

        try:
            after_conn, before_conn, links = _loop.submit(both()).result()
        except (StreamIOError, TimeoutError) as exc:
            raise StreamIOError(
                f"gradstream backend: rank {r} could not join the ring (connect "
                f"to rank {(r + 1) % n} at {after}, accept rank "
                f"{(r - 1) % n}) within {self.seconds:g} s: "
                f"{exc or 'timed out'}"
            ) from exc
        return Ring(after_conn, before_conn, links, self.socket_dir)


def _route(address: str, local: str, identity: str | None) -> str:
    """Where to reach a rank: its Unix socket if it published one and shares this
    rank's host identity (kernel, namespaces and user), else its TCP ``address``."""
    their_identity, _, path = local.partition(" ")
    if identity is not None and their_identity == identity and path.startswith("unix:"):
        return path
    return address
