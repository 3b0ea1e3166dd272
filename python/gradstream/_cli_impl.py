"""The implementation ``--impl`` chooses, through its public API only: the native package
(``gradstream``) or the reference (``gradstream.reference``), each with its
``GradientStreamSession``, ``TLS``, ``serve`` and ``connect``.

Both connections take a ``TransferProgress`` per transfer (so ``send`` shows a bar and
``recv`` counts chunks); ``Impl`` checks that from the signature (a build without it
gets none), and turns a ``LinkSettings`` into the keywords of ``serve`` / ``connect``.
Used by ``_cli_recv`` and ``_cli_send``.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Protocol, cast

import numpy.typing as npt

from . import TransferProgress
from ._cli_base import CliError
from ._cli_link import LinkSettings

__all__ = ["IMPLS", "SESSION_ID", "Connection", "Impl", "Progress", "Server", "load_impl"]

# The progress of one transfer, where the implementation's connections take one.
Progress = TransferProgress

IMPLS = ("native", "reference")
SESSION_ID = "gradstream-cli"
# What the command needs of an implementation's module.
NEEDED = ("GradientStreamSession", "TransferProgress", "TLS", "serve", "connect", "Connection")


class Connection(Protocol):
    @property
    def peer(self) -> Any: ...
    @property
    def closed(self) -> bool: ...
    def send(self, gradient: Any, **progress: Any) -> Awaitable[int]: ...
    def recv(self, **progress: Any) -> Awaitable[npt.NDArray[Any]]: ...
    async def close(self) -> None: ...


class Server(Protocol):
    @property
    def address(self) -> tuple[str, int]: ...
    async def close(self) -> None: ...


Handler = Callable[[Any], Awaitable[None]]


@dataclass(frozen=True)
class Received:
    """One gradient from a connection; ``chunks`` when the implementation counts them."""

    values: npt.NDArray[Any]
    chunks: int | None


@dataclass(frozen=True)
class Impl:
    name: str
    module: ModuleType
    # Whether Connection.send / recv take progress= (both do).
    progress_on_connections: bool

    def session(
        self,
        chunk_size: int | None = None,
        timeout: float | None = None,
        layout: str = "seed",
        compression: str | None = None,
        max_gradient_len: int | None = None,
    ) -> Any:
        args: list[Any] = [SESSION_ID]
        if chunk_size is not None:
            args.append(chunk_size)
        kwargs: dict[str, Any] = {"layout": layout}
        if compression is not None:
            kwargs["compression"] = compression
        if max_gradient_len is not None:
            kwargs["max_gradient_len"] = max_gradient_len
        if timeout is not None:
            kwargs["timeout"] = timeout
        try:
            return self.module.GradientStreamSession(*args, **kwargs)
        except (ValueError, OverflowError, TypeError) as exc:
            raise CliError(f"bad session settings: {exc}", 2) from exc

    def progress(self) -> Progress | None:
        """A fresh TransferProgress for one transfer, or None when this implementation's
        connections take none."""
        if not self.progress_on_connections:
            return None
        return cast(Progress, self.module.TransferProgress())

    def _keywords(self, link: LinkSettings) -> dict[str, Any]:
        tls = None
        if link.tls is not None:
            files = link.tls
            tls = self.module.TLS(cert=files.cert, key=files.key, ca=files.ca)
        return {"protocol": link.protocol, "tls": tls, "authkey": link.authkey}

    async def serve(
        self,
        address: tuple[str, int],
        handler: Handler,
        session: Any,
        link: LinkSettings,
        max_connections: int | None,
    ) -> Server:
        caps = {} if max_connections is None else {"max_connections": max_connections}
        server = await self.module.serve(
            address, handler, session=session, **self._keywords(link), **caps
        )
        return cast(Server, server)

    async def connect(self, address: tuple[str, int], session: Any, link: LinkSettings) -> Any:
        return await self.module.connect(address, session=session, **self._keywords(link))

    async def send(self, conn: Connection, gradient: Any, progress: Progress | None) -> int:
        """The gradient's chunk count, once sent (and, with the gradstream protocol,
        acknowledged)."""
        if progress is None:
            return await conn.send(gradient)
        return await conn.send(gradient, progress=progress)

    async def recv(self, conn: Connection, progress: Progress | None) -> Received | None:
        """The next gradient, or None when the peer closed the connection before one
        began (``recv`` then gives an empty array and the connection says it is closed;
        an empty gradient leaves it open)."""
        values = await (conn.recv() if progress is None else conn.recv(progress=progress))
        if values.size == 0 and conn.closed:
            return None
        return Received(values, None if progress is None else progress.chunks)


def load_impl(name: str) -> Impl:
    """The native (Rust) or the reference (pure Python) implementation, checked for
    connections."""
    module = importlib.import_module("gradstream" if name == "native" else "gradstream.reference")
    missing = [what for what in NEEDED if not hasattr(module, what)]
    if missing:
        other = "reference" if name == "native" else "native"
        raise CliError(
            f"the {name} implementation in this build has no connections "
            f"(missing {', '.join(missing)}); try --impl {other}"
        )
    recv_keywords = inspect.signature(module.Connection.recv).parameters
    return Impl(name, module, "progress" in recv_keywords)
