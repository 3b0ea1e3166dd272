"""What the reference streaming tests (streaming/test_reference_streaming*.py) share:
connections of every kind (sockets, asyncio streams and mixes) as ``Link`` objects, a
deadline for each scenario, and frames of a gradient.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import shutil
import socket
import tempfile
from collections.abc import AsyncIterator
from typing import Any

import numpy as np

import gradstream.reference as ref
from support.aio import run as run_under_deadline
from support.aio import tcp_socket_pair as tcp_pair
from support.frames import HEADER

DEADLINE = 60.0


# support.aio.run, under the reference streaming tests' own deadline.
run = functools.partial(run_under_deadline, deadline=DEADLINE)


async def send_then_close(
    s: ref.GradientStreamSession, grad: np.ndarray, sock: socket.socket, streams: bool
) -> None:
    """stream_to ``sock`` itself (then shut its sending side) or, with ``streams``, an
    asyncio stream over it (then close that stream): either way the peer sees the end."""
    if streams:
        _, w = await asyncio.open_connection(sock=sock)
        await s.stream_to(grad, w)
        w.close()
        await w.wait_closed()
    else:
        await s.stream_to(grad, sock)
        sock.shutdown(socket.SHUT_WR)


def ramp(n: int) -> np.ndarray:
    return np.arange(n, dtype=np.float32) * np.float32(0.25) - np.float32(7.0)


def assert_same_bits(actual: np.ndarray, expected: np.ndarray) -> None:
    assert actual.dtype == np.float32
    assert actual.ndim == 1
    np.testing.assert_array_equal(actual.view(np.uint32), expected.reshape(-1).view(np.uint32))


def frames_of(s: ref.GradientStreamSession, grad: np.ndarray) -> list[bytes]:
    return [
        HEADER.pack(c.chunk_index, c.total_chunks, len(c.arrow_ipc_bytes), c.checksum)
        + c.arrow_ipc_bytes
        for c in s.encode_gradient(grad)
    ]


@contextlib.contextmanager
def unix_pair() -> Any:
    directory = tempfile.mkdtemp(dir="/tmp" if os.path.isdir("/tmp") else None)
    path = os.path.join(directory, "s")
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server:
            server.bind(path)
            server.listen(1)
            a = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            a.connect(path)
            b, _ = server.accept()
        yield a, b
    finally:
        shutil.rmtree(directory, ignore_errors=True)


class Link:
    """One connection: `tx` goes to stream_to, `rx` to receive_from / receive_iter."""

    def __init__(self, tx: Any, rx: Any, tx_sock: socket.socket | None) -> None:
        self.tx = tx
        self.rx = rx
        self.tx_sock = tx_sock  # the raw socket under tx, when tx is a socket

    async def send_raw(self, data: bytes) -> None:
        """Put bytes on the wire from the tx side, outside gradstream."""
        if isinstance(self.tx, socket.socket):
            await asyncio.to_thread(self.tx.sendall, data)
        else:
            writer = self.tx[1] if isinstance(self.tx, tuple) else self.tx
            writer.write(data)
            await writer.drain()

    async def close_tx(self) -> None:
        if isinstance(self.tx, socket.socket):
            self.tx.close()
        else:
            writer = self.tx[1] if isinstance(self.tx, tuple) else self.tx
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()


SOCKET_KINDS = ["socketpair", "tcp", "unix"]


@contextlib.asynccontextmanager
async def connect(kind: str) -> AsyncIterator[Link]:
    """A fresh connection of the given kind, closed afterwards."""
    socks: list[socket.socket] = []
    writers: list[asyncio.StreamWriter] = []
    server: asyncio.Server | None = None
    with contextlib.ExitStack() as stack:
        if kind == "unix":
            a, b = stack.enter_context(unix_pair())
        elif kind in ("tcp",):
            a, b = tcp_pair()
        else:
            a, b = socket.socketpair()
        socks += [a, b]
        try:
            if kind in SOCKET_KINDS:
                link = Link(a, b, a)
            elif kind == "streams-tcp":
                a.close()
                b.close()
                accepted: asyncio.Future[tuple[Any, Any]] = (
                    asyncio.get_running_loop().create_future()
                )

                async def on_client(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
                    accepted.set_result((r, w))

                server = await asyncio.start_server(on_client, "127.0.0.1", 0)
                port = server.sockets[0].getsockname()[1]
                r1, w1 = await asyncio.open_connection("127.0.0.1", port)
                r2, w2 = await accepted
                writers += [w1, w2]
                link = Link(w1, (r2, w2), None)  # a writer; a (reader, writer) pair
            elif kind == "streams-socketpair":
                r1, w1 = await asyncio.open_connection(sock=a)
                r2, w2 = await asyncio.open_connection(sock=b)
                writers += [w1, w2]
                link = Link((r1, w1), r2, None)  # a pair; a reader
            elif kind == "socket-to-streams":
                r2, w2 = await asyncio.open_connection(sock=b)
                writers.append(w2)
                link = Link(a, r2, a)
            elif kind == "streams-to-socket":
                r1, w1 = await asyncio.open_connection(sock=a)
                writers.append(w1)
                link = Link(w1, b, None)
            else:
                raise AssertionError(kind)
            yield link
        finally:
            for w in writers:
                w.close()
            for w in writers:
                with contextlib.suppress(Exception):
                    await w.wait_closed()
            if server is not None:
                server.close()
                await server.wait_closed()
            for s in socks:
                s.close()


# A session and the three frames of a 12-value gradient, for the end-of-stream, limits and
# timeout cases.
def three_frames() -> tuple[ref.GradientStreamSession, list[bytes]]:
    s = ref.GradientStreamSession("s", 4)
    return s, frames_of(s, ramp(12))
