"""Blocking connections (docs/guides/blocking.md): ``connect``, ``listen`` and ``serve``
as in ``gradstream``, with the same arguments, settings, errors and guarantees, for
code without an event loop: plain scripts, threads, and Jupyter while the notebook's
loop runs. No asyncio loop is used or needed.

The shape of ``websockets.sync``: one core (``gradstream._connection``: the checks,
the native link, the one-transfer-at-a-time state), two thin faces. A call runs the
same native transfer as the asyncio face (a small one on the caller's thread, any other
on tokio) and waits for it in Rust with the GIL released, running the signal handlers
every 50 ms, so Ctrl-C raises ``KeyboardInterrupt`` promptly.
"""

from __future__ import annotations

from ._connection import Connection, connect
from ._server import Listener, Server, listen, serve

__all__ = ["Connection", "Listener", "Server", "connect", "listen", "serve"]
