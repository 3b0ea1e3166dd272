"""A connection's transfers run their first steps on the caller's thread (issue 12, row 2;
crates/gradstream-py/src/complete.rs ``run_or_spawn``): a small send writes its frames
before any thread hop, and a receive takes what is already there, at most 256 KiB of it,
before the rest goes on in tokio. What comes out must not depend on where the bytes were
read: here gradients on both sides of the thresholds (and one far past them) go each way,
back to back (native with native and with the test peer on either side, ``pair``) and in
request/reply turns with progress counts (the native dialler, with either listener,
``acceptor``), and a native receive that waits, times out before its first byte (the
connection stays open) or is cancelled (it is closed only if bytes had moved)."""

from __future__ import annotations

import asyncio
from types import ModuleType
from typing import Any

import numpy as np
import pytest

import gradstream as gs
from gradstream.errors import StreamTimeoutError
from support.connections import LOCAL, run

Pair = tuple[ModuleType, ModuleType]
PEEK_MAX = 256 * 1024  # bytes a receive reads on the caller's thread (fastpath.rs)
SEND_MAX = 128 * 1024  # bytes of values a send writes from the caller's thread

SIZES = [0, 1, 1000, SEND_MAX // 4, SEND_MAX // 4 + 1, PEEK_MAX // 4, 1_000_000]


def grad(n: int) -> np.ndarray:
    bits = np.random.default_rng(n).integers(0, 2**32, n, dtype=np.uint32)
    return bits.view(np.float32)


def same(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a.view("u4"), b.view("u4"))


async def connected(server: ModuleType, client: ModuleType, **kwargs: Any) -> tuple[Any, Any, Any]:
    """(listener, its side of the connection, the dialler's); ``kwargs`` go to the
    dialler's connect."""
    listener = await server.listen(LOCAL)
    accepting = asyncio.ensure_future(listener.accept())
    here = await client.connect(listener.address, **kwargs)
    return listener, await accepting, here


def test_gradients_around_the_thresholds_go_each_way_in_turns(acceptor: ModuleType) -> None:
    server, client = acceptor, gs

    async def main() -> None:
        listener, there, here = await connected(server, client)
        async with listener, there, here:
            for n in SIZES:
                g = grad(n)
                progress = client.TransferProgress()
                sent, got = await asyncio.gather(here.send(g, progress=progress), there.recv())
                assert same(got, g) and sent == progress.chunks == max(1, -(-n // 65536))
                # and back, through the other side's send and this side's receive
                back, _ = await asyncio.gather(here.recv(progress=progress), there.send(got))
                assert same(back, g), n
                assert not here.closed and not there.closed

    run(main)


def test_gradients_back_to_back_each_come_out_once(pair: Pair) -> None:
    """Every send waits for its ack, so the receiver's reads of one gradient never take
    the next one's bytes; the receives here find their gradient already waiting."""
    server, client = pair

    async def main() -> None:
        listener, there, here = await connected(server, client)
        async with listener, there, here:
            grads = [grad(n) for n in SIZES]

            async def send_all() -> None:
                for g in grads:
                    await here.send(g)
                await here.close()

            sending = asyncio.ensure_future(send_all())
            got = [g async for g in there]
            await sending
            assert len(got) == len(grads)
            assert all(same(a, b) for a, b in zip(got, grads, strict=True))

    run(main)


def test_a_receive_that_times_out_before_a_byte_leaves_the_connection_open(
    acceptor: ModuleType,
) -> None:
    server, client = acceptor, gs

    async def main() -> None:
        listener, there, here = await connected(server, client, timeout=0.2)
        async with listener, there, here:
            with pytest.raises(StreamTimeoutError) as raised:
                await here.recv()
            assert (raised.value.received, raised.value.total) == (0, None)
            assert not here.closed
            g = grad(1000)
            await asyncio.gather(there.send(g), here.recv())
            cancelled = asyncio.ensure_future(here.recv())
            await asyncio.sleep(0.05)
            cancelled.cancel()
            with pytest.raises(asyncio.CancelledError):
                await cancelled
            assert not here.closed  # nothing had moved
            _, back = await asyncio.gather(there.send(g), here.recv())
            assert same(back, g)

    run(main)
