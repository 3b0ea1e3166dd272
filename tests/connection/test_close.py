"""Issue 22, part 2: ``close()`` closes (docs/guides/connections.md "Closing"). A
receiver that closes while a sender is in the middle of a large send releases its socket
at once, so the sender gets ``DeliveryError`` within moments instead of blocking on a
half-closed connection (before: still blocked after 20 s, the receiver's socket in
FIN-WAIT-2 with unread bytes); the same after a cancelled ``recv()``; and a
``Connection`` dropped without ``close()`` does the same when collected, with a
``ResourceWarning``."""

from __future__ import annotations

import asyncio
import gc
import time
import warnings
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import pytest

import gradstream as gs
from gradstream.errors import DeliveryError, GradientStreamError
from support.aio import run
from support.connections import LOCAL

LARGE = 1 << 24  # values (64 MiB): far more than the sockets' buffers hold
BOUND = 10.0  # seconds; the sender learns in well under one (figures: the report)


async def second_send_fails(
    after_first: Callable[[Any], Awaitable[Any]],
) -> tuple[BaseException | int, float]:
    """A handler receives one small gradient, then runs ``after_first(conn)`` while it
    still holds ``conn``; the sender's second, large send: what it gave or raised, and
    how long it took."""
    held: list[Any] = []

    async def handler(conn: Any) -> None:
        held.append(conn)
        await conn.recv()
        await after_first(conn)
        await asyncio.sleep(40)

    server = await gs.serve(LOCAL, handler)
    try:
        async with await gs.connect(server.address) as c:
            await c.send(np.ones(10, np.float32))
            start = time.monotonic()
            try:
                outcome: BaseException | int = await asyncio.wait_for(
                    c.send(np.ones(LARGE, np.float32)), 20
                )
            except (TimeoutError, GradientStreamError) as exc:
                outcome = exc
            return outcome, time.monotonic() - start
    finally:
        await server.close()


def test_close_releases_the_socket_at_once() -> None:
    async def close(conn: Any) -> None:
        await conn.close()

    outcome, seconds = run(lambda: second_send_fails(close), 60)
    assert isinstance(outcome, DeliveryError), outcome
    assert seconds < BOUND


def test_close_after_a_cancelled_recv_releases_the_socket_at_once() -> None:
    async def cancel_then_close(conn: Any) -> None:
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(conn.recv(), 0.01)  # waits for a gradient: none yet
        progress = gs.TransferProgress()
        task = asyncio.create_task(conn.recv(progress=progress))
        while progress.bytes == 0:  # cancelled as soon as the large gradient comes in
            await asyncio.sleep(0.0005)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await conn.close()

    outcome, seconds = run(lambda: second_send_fails(cancel_then_close), 60)
    assert isinstance(outcome, DeliveryError), outcome
    assert seconds < BOUND


def test_a_connection_dropped_without_close_is_closed_when_collected() -> None:
    async def main() -> tuple[BaseException | int, float, list[warnings.WarningMessage]]:
        listener = await gs.listen(LOCAL)
        async with listener:
            client = await gs.connect(listener.address)
            conn = await listener.accept()
            sending = asyncio.create_task(client.send(np.ones(LARGE, np.float32)))
            await asyncio.sleep(0.2)
            start = time.monotonic()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                del conn
                gc.collect()
            try:
                outcome: BaseException | int = await asyncio.wait_for(sending, 20)
            except (TimeoutError, GradientStreamError) as exc:
                outcome = exc
            seconds = time.monotonic() - start
            await client.close()
            return outcome, seconds, caught

    outcome, seconds, caught = run(main, 60)
    assert isinstance(outcome, DeliveryError), outcome
    assert seconds < BOUND
    assert any(
        issubclass(w.category, ResourceWarning)
        and "unclosed gradstream connection" in str(w.message)
        for w in caught
    ), [str(w.message) for w in caught]
