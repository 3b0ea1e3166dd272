"""Deadlines on connections (README "Connections"): a listener's connections bound each
gradient once begun (300 s unless the session or listen(deadline=) says otherwise), so a
peer dripping a gradient a few bytes at a time is cut off, refused and dropped; waiting
for a gradient to begin is idle time; a sender's deadline and timeout bound its writes and
its wait for the ack."""

from __future__ import annotations

import asyncio
import contextlib

import numpy as np
import pytest

import gradstream.reference as ref
from gradstream.errors import StreamDeadlineError, StreamTimeoutError
from gradstream.reference import _connection
from gradstream.reference import _protocol as p
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

S = ref.GradientStreamSession("s", 1024)
WIRE = S.encode_frames(np.arange(20_000, dtype=np.float32))  # ~80 KB


async def drip(writer: asyncio.StreamWriter, data: bytes, piece: int = 512) -> None:
    with contextlib.suppress(ConnectionError):
        for start in range(0, len(data), piece):
            writer.write(data[start : start + piece])
            await writer.drain()
            await asyncio.sleep(0.01)  # ~50 KB/s: far inside any timeout here


def test_a_slow_drip_at_a_listener_is_cut_off_and_refused() -> None:
    async def main() -> tuple[StreamDeadlineError, p.Ack]:
        async with await ref.listen(LOCAL, session=S, timeout=5, deadline=0.4) as listener:
            async with raw_peer(listener.address) as streams:
                await hello_by_hand(streams, p.ROLE_CLIENT)
                conn = await listener.accept()
                dripping = asyncio.create_task(drip(streams[1], WIRE))
                with pytest.raises(StreamDeadlineError) as info:
                    await conn.recv()
                assert conn.closed
                dripping.cancel()
                head = await streams[0].readexactly(16)
                rest = p.check_ack_head(head, None)
                ack = p.parse_ack(head + await streams[0].readexactly(rest), None)
                return info.value, ack

    exc, ack = run(main)
    assert exc.deadline == 0.4 and exc.total == 20 and 0 < exc.received < 20
    assert ack.reason == str(exc)


def test_idle_time_before_a_gradient_is_not_counted() -> None:
    grads = [np.full(3000, k, np.float32) for k in range(2)]

    async def main() -> list[np.ndarray]:
        async with await ref.listen(LOCAL, session=S, deadline=0.3) as listener:

            async def receive() -> list[np.ndarray]:
                async with await listener.accept() as conn:
                    return [g async for g in conn]

            receiving = asyncio.create_task(receive())
            async with await ref.connect(listener.address, session=S) as conn:
                for g in grads:
                    await asyncio.sleep(0.5)  # longer than the deadline, between gradients
                    await conn.send(g)
            return await receiving

    got = run(main)
    assert len(got) == 2 and all(np.array_equal(a, b) for a, b in zip(got, grads, strict=True))


def test_the_listeners_deadline_defaults() -> None:
    def made(listener: bool, **keywords: object) -> float | None:
        settings = {
            "session": None,
            "tls": None,
            "authkey": None,
            "timeout": None,
            "deadline": None,
            "protocol": "gradstream",
        }
        settings.update(keywords)
        return _connection.endpoint(listener=listener, **settings).session.deadline

    assert made(True) == 300.0
    assert made(False) is None
    assert made(True, session=ref.GradientStreamSession("s", deadline=7)) == 7.0
    assert made(True, session=ref.GradientStreamSession("s", deadline=7), deadline=2) == 2.0
    assert made(False, session=ref.GradientStreamSession("s", deadline=7)) == 7.0


def test_a_senders_deadline_bounds_its_writes() -> None:
    # A listener that shakes hands and then reads nothing: the sender's writes stall.
    async def main() -> StreamDeadlineError:
        done = asyncio.Event()

        async def deaf(streams: Streams, client: bytes, server: bytes) -> None:
            await done.wait()

        async with hostile_listener(deaf) as address:
            async with await ref.connect(address, deadline=0.5) as conn:
                with pytest.raises(StreamDeadlineError) as info:
                    await conn.send(np.ones(1 << 24, np.float32))  # 64 MiB
                assert conn.closed
            done.set()
            return info.value

    assert run(main).deadline == 0.5


def test_a_sender_waits_for_the_ack_under_its_timeout() -> None:
    async def silent(streams: Streams, client: bytes, server: bytes) -> None:
        await frames_by_hand(streams[0])
        await read_to_end(streams[0])  # never answers

    async def main() -> StreamTimeoutError:
        async with hostile_listener(silent) as address:
            async with await ref.connect(address, session=S, timeout=0.3) as conn:
                with pytest.raises(StreamTimeoutError) as info:
                    await conn.send(np.ones(3000, np.float32))
                assert conn.closed
                return info.value

    exc = run(main)
    assert not isinstance(exc, StreamDeadlineError)
    assert str(exc) == "no progress for 0.3 s (after 3 of 3 chunks); the peer stalled"
