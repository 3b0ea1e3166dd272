"""The seal inside a connection, against a man in the middle who rewrites frames but not
their CRCs' coverage (docs/spec/protocol.md): swapped chunk indices, a transfer replayed
from another connection, a transfer repeated, a transfer reflected back to its sender.
Each is refused by the receiver with a FrameError, and the sender learns it from the
refusal (DeliveryError with the receiver's reason). The same swap on a bare
`protocol="seed"` connection goes through as a wrong gradient: the hole the seal closes.

Native with native and with the test peer on either side (``pair``), on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import struct
from collections.abc import Callable
from types import ModuleType
from typing import Any

import numpy as np

import gradstream as gs
from gradstream.errors import DeliveryError, FrameError
from support.connections import run as run_scenario

Pair = tuple[ModuleType, ModuleType]
HELLO_LEN = 80
ACK_MAGIC = b"GSAK"

Transfer = list[bytes]  # one transfer's frames, header and payload each
Tamper = Callable[[int, Transfer], Transfer]  # (index of the transfer that way, frames)


def run(coro: Any) -> Any:
    return run_scenario(lambda: coro)


async def read_unit(reader: asyncio.StreamReader) -> tuple[str, Any] | None:
    """The next ack (its bytes) or transfer (its frames) on one direction; None at the
    end."""
    try:
        head = await reader.readexactly(16)
    except asyncio.IncompleteReadError:
        return None
    if head[:4] == ACK_MAGIC:
        rest = await reader.readexactly(40)
        (reason_len,) = struct.unpack_from("<H", head, 14)
        return "ack", head + rest + await reader.readexactly(reason_len)
    frames = []
    while True:
        _, total, payload_len, _ = struct.unpack("<4I", head)
        frames.append(head + await reader.readexactly(payload_len))
        if len(frames) == total:
            return "transfer", frames
        head = await reader.readexactly(16)


class Proxy:
    """Forwards 127.0.0.1 connections to a listener; ``to_server`` / ``to_client``
    rewrite each transfer going that way; every transfer seen is recorded."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.to_server: Tamper = lambda k, frames: frames
        self.to_client: Tamper = lambda k, frames: frames
        self.seen: dict[str, list[Transfer]] = {"to_server": [], "to_client": []}

    async def start(self) -> tuple[str, int]:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        host, port = self.server.sockets[0].getsockname()[:2]
        return host, port

    async def _serve(self, c_reader: asyncio.StreamReader, c_writer: asyncio.StreamWriter) -> None:
        s_reader, s_writer = await asyncio.open_connection(*self.target)
        await asyncio.gather(
            self._pump(c_reader, s_writer, "to_server"),
            self._pump(s_reader, c_writer, "to_client"),
            return_exceptions=True,
        )

    async def _pump(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, way: str
    ) -> None:
        try:
            writer.write(await reader.readexactly(HELLO_LEN))
            count = 0
            while (unit := await read_unit(reader)) is not None:
                kind, body = unit
                if kind == "transfer":
                    self.seen[way].append(body)
                    tamper = self.to_server if way == "to_server" else self.to_client
                    body = b"".join(tamper(count, body))
                    count += 1
                writer.write(body)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


def swap_first_two_indices(frames: Transfer) -> Transfer:
    """Chunks 0 and 1 trade their chunk_index fields; every CRC stays valid."""
    a, b = bytearray(frames[0]), bytearray(frames[1])
    a[0:4], b[0:4] = b[0:4], a[0:4]
    return [bytes(b), bytes(a), *frames[2:]]


def session(side: ModuleType) -> Any:
    return side.GradientStreamSession("mitm", chunk_size=1000, timeout=10)


async def through_proxy(
    gs_s: ModuleType, gs_c: ModuleType, proxy_setup: Callable[[Proxy], None], **listen: Any
) -> tuple[Any, Any, Proxy]:
    listener = await gs_s.listen("127.0.0.1:0", session=session(gs_s), **listen)
    proxy = Proxy(listener.address)
    proxy_setup(proxy)
    address = await proxy.start()
    accepted = asyncio.create_task(listener.accept())
    conn = await gs_c.connect(address, session=session(gs_c), **listen)
    theirs = await accepted
    return (listener, proxy), conn, theirs


async def close_all(listener: Any, proxy: Proxy, conn: Any, theirs: Any) -> None:
    """Close both ends of a connection through ``proxy``, its listener and the proxy."""
    await conn.close()
    await theirs.close()
    await listener.close()
    proxy.server.close()


def assert_refused_as_another_transfer(sent: Any, received: Any) -> None:
    """The receiver refused frames sealed for another transfer, and told the sender."""
    assert isinstance(received, FrameError), received
    assert "sealed for transfer" in str(received)
    assert isinstance(sent, DeliveryError), sent


GRAD = np.arange(3000, dtype=np.float32)  # 3 chunks of 1000


def test_swapped_chunk_indices_are_refused(pair: Pair) -> None:
    gs_s, gs_c = pair

    def setup(proxy: Proxy) -> None:
        proxy.to_server = lambda k, frames: swap_first_two_indices(frames)

    async def main() -> tuple[BaseException | None, BaseException | None]:
        (listener, proxy), conn, theirs = await through_proxy(gs_s, gs_c, setup)
        results = await asyncio.gather(conn.send(GRAD), theirs.recv(), return_exceptions=True)
        await close_all(listener, proxy, conn, theirs)
        return results[0], results[1]  # type: ignore[return-value]

    sent, received = run(main())
    assert isinstance(received, FrameError), received
    assert "sealed as chunk" in str(received)
    assert isinstance(sent, DeliveryError), sent
    assert sent.reason is not None and "sealed as chunk" in sent.reason


def test_the_same_swap_on_a_seed_connection_is_a_wrong_gradient() -> None:
    async def main() -> Any:
        listener = await gs.listen("127.0.0.1:0", session=session(gs), protocol="seed")
        proxy_server = await asyncio.start_server(
            lambda r, w: splice_seed(r, w, listener.address), "127.0.0.1", 0
        )
        address = proxy_server.sockets[0].getsockname()[:2]
        accepted = asyncio.create_task(listener.accept())
        conn = await gs.connect(address, session=session(gs), protocol="seed")
        theirs = await accepted
        _, got = await asyncio.gather(conn.send(GRAD), theirs.recv())
        await conn.close()
        await theirs.close()
        await listener.close()
        proxy_server.close()
        return got

    got = run(main())
    # Accepted as "verified", yet the first two thousand values are swapped.
    assert got.shape == GRAD.shape
    np.testing.assert_array_equal(got[:1000], GRAD[1000:2000])
    np.testing.assert_array_equal(got[1000:2000], GRAD[:1000])


async def splice_seed(
    c_reader: asyncio.StreamReader, c_writer: asyncio.StreamWriter, target: tuple[str, int]
) -> None:
    _s_reader, s_writer = await asyncio.open_connection(*target)
    unit = await read_unit(c_reader)
    assert unit is not None and unit[0] == "transfer"
    s_writer.write(b"".join(swap_first_two_indices(unit[1])))
    await s_writer.drain()
    await c_reader.read()
    s_writer.close()
    c_writer.close()


def test_a_transfer_replayed_into_another_connection_is_refused(pair: Pair) -> None:
    gs_s, gs_c = pair
    recorded: list[Transfer] = []

    def record(proxy: Proxy) -> None:
        pass

    def replay(proxy: Proxy) -> None:
        proxy.to_server = lambda k, frames: recorded[0]

    async def main() -> tuple[Any, Any]:
        (listener, proxy), conn, theirs = await through_proxy(gs_s, gs_c, record)
        await asyncio.gather(conn.send(GRAD), theirs.recv())
        recorded.extend(proxy.seen["to_server"])
        await close_all(listener, proxy, conn, theirs)
        (listener, proxy), conn, theirs = await through_proxy(gs_s, gs_c, replay)
        results = await asyncio.gather(conn.send(GRAD + 1), theirs.recv(), return_exceptions=True)
        await close_all(listener, proxy, conn, theirs)
        return results[0], results[1]

    sent, received = run(main())
    assert_refused_as_another_transfer(sent, received)


def test_a_repeated_transfer_is_refused(pair: Pair) -> None:
    gs_s, gs_c = pair

    def repeat(proxy: Proxy) -> None:
        proxy.to_server = lambda k, frames: proxy.seen["to_server"][0] if k == 1 else frames

    async def main() -> tuple[Any, Any, Any]:
        (listener, proxy), conn, theirs = await through_proxy(gs_s, gs_c, repeat)
        _first, got = await asyncio.gather(conn.send(GRAD), theirs.recv())
        results = await asyncio.gather(conn.send(GRAD + 1), theirs.recv(), return_exceptions=True)
        await close_all(listener, proxy, conn, theirs)
        return got, results[0], results[1]

    got, sent, received = run(main())
    np.testing.assert_array_equal(got, GRAD)
    assert_refused_as_another_transfer(sent, received)


def test_a_transfer_reflected_to_its_sender_is_refused(pair: Pair) -> None:
    gs_s, gs_c = pair

    def reflect(proxy: Proxy) -> None:
        proxy.to_client = lambda k, frames: proxy.seen["to_server"][0]

    async def main() -> tuple[Any, Any]:
        (listener, proxy), conn, theirs = await through_proxy(gs_s, gs_c, reflect)
        await asyncio.gather(conn.send(GRAD), theirs.recv())
        # The server answers with a gradient of the same size; the client is handed
        # its own transfer instead.
        results = await asyncio.gather(theirs.send(GRAD * 2), conn.recv(), return_exceptions=True)
        await close_all(listener, proxy, conn, theirs)
        return results[0], results[1]

    sent, received = run(main())
    assert_refused_as_another_transfer(sent, received)
