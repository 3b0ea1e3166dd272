"""Issue 22, part 3: no wait without a bound by default, inside a transfer
(docs/guides/connections.md "Timeouts"). With the default session and no ``deadline=``,
a sender whose peer reads its gradient and never acknowledges it gives up after the
connections' default deadline, on either side (before: a dialler waited for ever; only a
listener's connections had a default); the default can be overridden; waiting for a
gradient to begin stays unbounded; ``gradstream send --timeout`` has the same default.

The default (300 s) is patched down to keep the tests short: the tests check that it
applies, not its value (``test_connection_parts`` checks that)."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import numpy as np
import pytest

import gradstream as gs
from gradstream import _checks
from gradstream.cli import build_parser
from gradstream.errors import StreamDeadlineError
from support.connections import (
    LOCAL,
    Streams,
    frames_by_hand,
    hello_by_hand,
    hostile_listener,
    raw_peer,
    read_to_end,
    run,
)
from support.peer import messages as p

SHORT = 0.5  # seconds: the patched default
BOUND = 10.0  # seconds the silent ack may cost a sender here, at most


@pytest.fixture
def short_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_checks, "CONNECTION_DEADLINE", SHORT)


async def never_acks(streams: Streams, client: bytes, server: bytes) -> None:
    """Read a gradient's frames, then say nothing until the sender hangs up."""
    await frames_by_hand(streams[0])
    await read_to_end(streams[0])


@asynccontextmanager
async def dialler_that_never_acks(address: tuple[str, int]) -> AsyncIterator[None]:
    async with raw_peer(address) as streams:
        await hello_by_hand(streams, p.ROLE_CLIENT)
        task = asyncio.create_task(never_acks(streams, b"", b""))
        try:
            yield
        finally:
            task.cancel()


@pytest.mark.usefixtures("short_default")
@pytest.mark.parametrize("side", ["dialler", "listener"])
def test_a_sender_gives_up_on_an_ack_that_never_comes(side: str) -> None:
    async def main() -> tuple[BaseException, float]:
        if side == "dialler":
            async with hostile_listener(never_acks) as address:
                async with await gs.connect(address) as conn:
                    return await timed_send(conn)
        async with await gs.listen(LOCAL) as listener:
            async with dialler_that_never_acks(listener.address):
                async with await listener.accept() as conn:
                    return await timed_send(conn)

    error, seconds = run(main)
    assert isinstance(error, StreamDeadlineError), error
    assert seconds < BOUND


async def timed_send(conn: gs.Connection) -> tuple[BaseException, float]:
    start = time.monotonic()
    try:
        await asyncio.wait_for(conn.send(np.ones(1000, np.float32)), 3 * BOUND)
    except (TimeoutError, gs.GradientStreamError) as exc:
        return exc, time.monotonic() - start
    raise AssertionError("the send returned without an ack")


@pytest.mark.usefixtures("short_default")
def test_the_default_is_overridden_by_a_deadline() -> None:
    async def main() -> float:
        async with hostile_listener(never_acks) as address:
            async with await gs.connect(address, deadline=2.5) as conn:
                error, seconds = await timed_send(conn)
                assert isinstance(error, StreamDeadlineError), error
                return seconds

    assert run(main) >= 2.5


@pytest.mark.usefixtures("short_default")
def test_waiting_for_a_gradient_to_begin_stays_unbounded() -> None:
    async def main() -> float:
        async with await gs.listen(LOCAL) as listener:
            async with await gs.connect(listener.address) as dialler:
                async with await listener.accept() as conn:
                    receiving = asyncio.create_task(dialler.recv())
                    await asyncio.sleep(4 * SHORT)  # idle, longer than the default
                    await conn.send(np.full(10, 2.0, np.float32))
                    got = await receiving
                    return float(got[0])

    assert run(main) == 2.0


def test_cli_send_timeout_has_the_connections_default() -> None:
    parser = build_parser()
    send = parser.parse_args(["send", "127.0.0.1:9", "g.npy"])
    assert send.timeout == _checks.CONNECTION_DEADLINE
    assert parser.parse_args(["send", "127.0.0.1:9", "g.npy", "--timeout", "3"]).timeout == 3
    assert parser.parse_args(["recv", "0", "--out", "o.npy"]).timeout is None


def test_bounds_past_a_durations_range_mean_for_ever_not_a_panic() -> None:
    """Seconds too large for a Duration (1e300: 'never') are accepted as the longest wait,
    on connections and sessions alike; before, each raised PanicException from Rust."""

    async def main() -> None:
        async def handler(conn: gs.Connection) -> None:
            await conn.send(await conn.recv())

        server = await gs.serve(LOCAL, handler, handshake_timeout=1e300, deadline=1e300)
        try:
            async with await gs.connect(
                server.address, handshake_timeout=1e300, deadline=1e300, timeout=1e300
            ) as conn:
                await conn.send(np.ones(1000, np.float32), deadline=1e300)
                got = await conn.recv(deadline=1e300)
                assert np.array_equal(got, np.ones(1000, np.float32))
        finally:
            await server.close()
        session = gs.GradientStreamSession(timeout=1e300, deadline=1e300)
        a, b = socket.socketpair()
        with a, b:
            grad = np.arange(1 << 20, dtype=np.float32)
            _, back = await asyncio.gather(session.stream_to(grad, a), session.receive_from(b))
        assert np.array_equal(back, grad)

    run(main)
