"""asyncio under a deadline (the one ``run`` of the tests: support/streams.py and
support/links.py set it up their way), and transfers over real connections: socketpairs
(sockets or asyncio streams) and loopback TCP."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from gradstream.errors import GradientStreamError

T = TypeVar("T")

DEADLINE = 20.0


def run(
    main: Callable[[], Awaitable[T]],
    deadline: float = DEADLINE,
    *,
    fail_on_loop_errors: bool = False,
) -> T:
    """asyncio.run(main()) under an overall deadline, so that a hang fails the test; with
    ``fail_on_loop_errors``, any error the loop only logged (a never-retrieved exception,
    a callback that raised) fails the test too."""

    async def bounded() -> T:
        if fail_on_loop_errors:
            loop = asyncio.get_running_loop()
            loop.set_exception_handler(lambda _loop, context: logged.append(context))
        async with asyncio.timeout(deadline):
            return await main()

    logged: list[dict[str, Any]] = []
    result = asyncio.run(bounded())
    assert not logged, f"the event loop logged errors: {logged}"
    return result


async def apoll(predicate: Callable[[], bool], seconds: float) -> bool:
    """Whether ``predicate`` became true within ``seconds``, asked every 20 ms while the
    running loop goes on."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if predicate():
            return True
        await asyncio.sleep(0.02)
    return bool(predicate())


async def close_all(writers: list[asyncio.StreamWriter], socks: list[socket.socket]) -> None:
    """Close the stream writers (waiting for each, whatever it raises), then the sockets."""
    for w in writers:
        w.close()
        with contextlib.suppress(Exception):
            await w.wait_closed()
    for s in socks:
        s.close()


@contextlib.asynccontextmanager
async def socketpair_ends(path: str) -> AsyncIterator[tuple[Any, Any]]:
    """The two ends of a socketpair as (what stream_to takes, what receive_from takes):
    the sockets themselves, or (path "streams") asyncio streams over them; all closed
    after."""
    a, b = socket.socketpair()
    writers: list[asyncio.StreamWriter] = []
    try:
        tx: Any = a
        rx: Any = b
        if path == "streams":
            _, wa = await asyncio.open_connection(sock=a)
            rb, wb = await asyncio.open_connection(sock=b)
            writers += [wa, wb]
            tx, rx = wa, rb
        yield tx, rx
    finally:
        await close_all(writers, [a, b])


async def transfer(
    sender: Any, receiver: Any, grad: Any, path: str, **kwargs: Any
) -> tuple[int, Any]:
    """stream_to on one end of a socketpair, receive_from(**kwargs) on the other,
    concurrently, over sockets or asyncio streams: (what stream_to returned, what
    receive_from returned)."""
    async with socketpair_ends(path) as (tx, rx):
        sent, got = await asyncio.gather(
            sender.stream_to(grad, tx), receiver.receive_from(rx, **kwargs)
        )
        return sent, got


async def receive_bytes(s: Any, data: bytes, path: str, **kwargs: Any) -> Any:
    """receive_from(**kwargs) over a socketpair whose peer wrote ``data`` (it must fit the
    socket buffer) and closed; the result or the GradientStreamError raised."""
    a, b = socket.socketpair()
    writer = None
    try:
        a.sendall(data)
        a.shutdown(socket.SHUT_WR)
        rx: Any = b
        if path == "streams":
            rx, writer = await asyncio.open_connection(sock=b)
        try:
            return await s.receive_from(rx, **kwargs)
        except GradientStreamError as exc:
            return exc
    finally:
        await close_all([writer] if writer is not None else [], [a, b])


async def read_until_eof(sock: socket.socket) -> bytes:
    loop = asyncio.get_running_loop()
    sock.setblocking(False)
    buf = bytearray()
    while data := await loop.sock_recv(sock, 1 << 20):
        buf += data
    return bytes(buf)


def tcp_socket_pair() -> tuple[socket.socket, socket.socket]:
    """A connected pair of sockets over loopback TCP: (client, server)."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        client = socket.create_connection(listener.getsockname())
        server, _ = listener.accept()
    return client, server
