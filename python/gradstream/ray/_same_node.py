"""Processes of one Ray node meet on Unix sockets (docs/guides/ray.md, "One node"): the
tensor transport's makers and the parameter server listen on one beside their TCP
listener (``LocalListener``), and a peer of the same node, by Ray's node id (never by
whether a path exists: two Ray nodes may share a filesystem), connects there
(``connect_locally``). TLS is not used on the socket, where the kernel is the only party
between the two: the job's authkey and the uid check admit a peer."""

from __future__ import annotations

import functools
import logging
import sys
from collections.abc import Awaitable, Callable
from typing import Any

import ray

from .. import _connection
from .._address import UNIX
from .._connection import Connection
from .._local_socket import SocketDirectory
from ..errors import SettingError, StreamIOError, StreamTimeoutError
from ._settings import RaySettings

log = logging.getLogger("gradstream.ray")


@functools.cache
def node_id() -> str:
    """This process's Ray node (the raylet it belongs to; it never changes)."""
    return str(ray.get_runtime_context().get_node_id())


def on_this_node(node: Any, local: Any) -> Any:
    """``local``, the Unix socket a peer said it listens on, when ``node``, the Ray node
    it said it is on, is this process's; else None."""
    return local if local is not None and node is not None and node == node_id() else None


def reachable(settings: RaySettings, local: Any) -> str | None:
    """``local`` (a peer of this node's ``"unix:PATH"``) when these settings use Unix
    sockets, else None (then TCP). Anything but a Unix address is ignored: nothing ever
    goes over TCP without the TLS the settings ask for."""
    if settings.same_node != "unix" or not isinstance(local, str) or not local.startswith(UNIX):
        return None
    return local


def _unix_keywords(settings: RaySettings, max_values: int | None = None) -> dict[str, Any]:
    return {**settings.link_keywords(max_values), "tls": None}


class LocalListener:
    """A Unix-socket server in a directory of this process's own, for peers of its node
    (``address``); ``close`` stops it and removes the directory."""

    def __init__(self, server: Any, directory: SocketDirectory) -> None:
        self._server = server
        self._directory = directory
        self.address = directory.address

    @classmethod
    async def start(
        cls,
        prefix: str,
        handler: Callable[[Connection], Awaitable[None]],
        settings: RaySettings,
        max_connections: int,
        max_values: int | None,
        who: str,
    ) -> LocalListener | None:
        """Serve ``handler`` on a new Unix socket; None (logged, naming ``who``'s peers
        that will use TCP) where the settings or the platform say no, or it cannot."""
        if settings.same_node != "unix" or sys.platform != "linux":
            return None
        try:
            directory = SocketDirectory(prefix)
        except (OSError, ValueError) as exc:
            log.warning("gradstream.ray: no Unix socket for %s of this node: %s", who, exc)
            return None
        try:
            server = await _connection.serve(
                directory.address,
                handler,
                max_connections=max_connections,
                **_unix_keywords(settings, max_values),
            )
        except (OSError, StreamIOError) as exc:
            directory.remove()
            log.warning("gradstream.ray: no Unix socket for %s of this node: %s", who, exc)
            return None
        log.info("gradstream.ray: listening on %s for %s of this node", directory.address, who)
        return cls(server, directory)

    async def close(self) -> None:
        await self._server.close()
        self._directory.remove()


async def connect_locally(address: str, settings: RaySettings) -> tuple[Connection | None, str]:
    """A connection to a peer of this node at ``address`` (``"unix:PATH"``), or None and
    why (logged) where the socket cannot be reached: a process of another user, another
    mount namespace (refused, not there); the caller then uses TCP. A peer that does not
    answer within ``connect_timeout`` raises ``StreamTimeoutError``: it is stuck, and TCP
    would only double the wait."""
    try:
        return await _connection.connect(address, **_unix_keywords(settings)), ""
    except StreamTimeoutError:
        raise
    except (StreamIOError, SettingError) as exc:
        log.warning("gradstream.ray: cannot connect to %s (%s): using TCP", address, exc)
        return None, f"its Unix socket {address}: {exc}"
