"""Deadlines on connections (docs/guides/limits.md): every connection bounds each
gradient once begun (300 s unless the session, connect/listen(deadline=) say otherwise), so a
peer dripping a gradient a few bytes at a time is cut off, refused and dropped; waiting
for a gradient to begin is idle time; a sender's deadline and timeout bound its writes and
its wait for the ack. The native side against peers by hand or itself."""

from __future__ import annotations

import asyncio
import contextlib

import numpy as np
import pytest

import gradstream as gs
from gradstream import _connection_args as native_connection
from gradstream._checks import connection_waits
from gradstream.errors import StreamDeadlineError, StreamTimeoutError
from support.connections import (
    LOCAL,
    Streams,
    frames_by_hand,
    hello_by_hand,
    hostile_listener,
    raw_peer,
    read_to_end,
    run,
    sealed_frames,
)
from support.peer import messages as p

GRADIENT = np.arange(20_000, dtype=np.float32)  # ~80 KB of frames


async def drip(writer: asyncio.StreamWriter, data: bytes, piece: int = 512) -> None:
    with contextlib.suppress(ConnectionError):
        for start in range(0, len(data), piece):
            writer.write(data[start : start + piece])
            await writer.drain()
            await asyncio.sleep(0.01)  # ~50 KB/s: far inside any timeout here


def test_a_slow_drip_at_a_listener_is_cut_off_and_refused() -> None:
    s = gs.GradientStreamSession("s", 1024)

    async def main() -> tuple[StreamDeadlineError, p.Ack]:
        async with await gs.listen(LOCAL, session=s, timeout=5, deadline=0.4) as listener:
            async with raw_peer(listener.address) as streams:
                nonces = await hello_by_hand(streams, p.ROLE_CLIENT)
                conn = await listener.accept()
                dripping = asyncio.create_task(drip(streams[1], sealed_frames(GRADIENT, *nonces)))
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
    s = gs.GradientStreamSession("s", 1024)

    async def main() -> list[np.ndarray]:
        async with await gs.listen(LOCAL, session=s, deadline=0.3) as listener:

            async def receive() -> list[np.ndarray]:
                async with await listener.accept() as conn:
                    return [g async for g in conn]

            receiving = asyncio.create_task(receive())
            async with await gs.connect(listener.address, session=s) as conn:
                for g in grads:
                    await asyncio.sleep(0.5)  # longer than the deadline, between gradients
                    await conn.send(g)
            return await receiving

    got = run(main)
    assert len(got) == 2 and all(np.array_equal(a, b) for a, b in zip(got, grads, strict=True))


def test_the_connections_deadline_defaults() -> None:
    # (session timeout, session deadline, call's timeout, call's deadline): either side.
    assert connection_waits(None, None, None, None) == (None, 300.0)
    assert connection_waits(5.0, 7.0, None, None) == (5.0, 7.0)
    assert connection_waits(5.0, 7.0, 1.0, 2.0) == (1.0, 2.0)
    assert connection_waits(None, 7.0, None, None) == (None, 7.0)


@pytest.mark.parametrize("listening", [True, False])
def test_connections_wait_as_the_shared_rule_says(listening: bool) -> None:
    def native(**keywords: object) -> tuple[float | None, float | None]:
        settings: dict[str, object] = {"timeout": None, "deadline": None}
        session = keywords.pop("session", None) or gs.GradientStreamSession("s")
        settings.update(keywords)
        args, _ = native_connection._link_settings(
            session,  # type: ignore[arg-type]
            listening=listening,
            tls=None,
            authkey=None,
            protocol="gradstream",
            handshake_timeout=10,
            **settings,
        )
        return args["timeout"], args["deadline"]

    session = gs.GradientStreamSession("s", timeout=5, deadline=7)
    assert native() == connection_waits(None, None, None, None)
    assert native(session=session) == (5.0, 7.0)
    assert native(session=session, timeout=1, deadline=2) == (1.0, 2.0)


def test_a_senders_deadline_bounds_its_writes() -> None:
    # A listener that shakes hands and then reads nothing: the sender's writes stall.
    async def main() -> StreamDeadlineError:
        done = asyncio.Event()

        async def deaf(streams: Streams, client: bytes, server: bytes) -> None:
            await done.wait()

        async with hostile_listener(deaf) as address:
            async with await gs.connect(address, deadline=0.5) as conn:
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
            s = gs.GradientStreamSession("s", 1024)
            async with await gs.connect(address, session=s, timeout=0.3) as conn:
                with pytest.raises(StreamTimeoutError) as info:
                    await conn.send(np.ones(3000, np.float32))
                assert conn.closed
                return info.value

    exc = run(main)
    assert not isinstance(exc, StreamDeadlineError)
    assert str(exc) == "no progress for 0.3 s (after 3 of 3 chunks); the peer stalled"


def test_a_timeout_before_a_gradient_begins_leaves_the_connection_in_step() -> None:
    # Nothing moved: the connection is still in step, open, and the next recv works.
    async def main() -> tuple[StreamTimeoutError, np.ndarray]:
        async with await gs.listen(LOCAL) as listener:
            accepted = asyncio.create_task(listener.accept())
            async with await gs.connect(listener.address, timeout=0.2) as conn:
                theirs = await accepted
                with pytest.raises(StreamTimeoutError) as info:
                    await conn.recv()
                assert not conn.closed
                sending = asyncio.create_task(theirs.send(np.arange(10, dtype=np.float32)))
                got = await conn.recv()
                assert await sending == 1
                await theirs.close()
                return info.value, got

    exc, got = run(main)
    assert exc.timeout == 0.2 and not isinstance(exc, StreamDeadlineError)
    assert np.array_equal(got, np.arange(10, dtype=np.float32))
