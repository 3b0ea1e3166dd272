"""deadline=: the bound on a whole transfer (issue 11, hole 2). ``timeout`` bounds each
wait, so a peer dripping one piece per timeout held a receiver for ever; the deadline
bounds the transfer from its first byte (a sender's from its start), on the session and
per call, in both implementations, over sockets and asyncio streams.

The hostile peer here is a raw socket writing a valid gradient's bytes slowly: every
piece arrives well inside the timeout, and only the deadline can stop it."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest

import gradstream.errors as errors
from support.aio import run
from support.impls import session

PATHS = ["socket", "streams"]
REFUSED = "deadline must be None or a positive number of seconds, got "
DRIP_PIECE = 512  # bytes per piece
DRIP_PAUSE = 0.01  # seconds between pieces: ~50 KB/s, far inside any timeout here


@contextlib.asynccontextmanager
async def receiving_end(path: str) -> AsyncIterator[tuple[socket.socket, Any]]:
    """(the hostile peer's raw socket, what receive_from takes on the other end)."""
    peer, mine = socket.socketpair()
    peer.setblocking(False)
    writer = None
    try:
        rx: Any = mine
        if path == "streams":
            rx, writer = await asyncio.open_connection(sock=mine)
        yield peer, rx
    finally:
        if writer is not None:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()
        peer.close()
        mine.close()


async def drip(peer: socket.socket, data: bytes, idle: float = 0.0) -> None:
    """Write ``data`` to ``peer`` a few bytes at a time (after ``idle`` seconds of
    silence), stopping quietly when the other end goes away."""
    loop = asyncio.get_running_loop()
    await asyncio.sleep(idle)
    with contextlib.suppress(OSError):
        for start in range(0, len(data), DRIP_PIECE):
            await loop.sock_sendall(peer, data[start : start + DRIP_PIECE])
            await asyncio.sleep(DRIP_PAUSE)


def wire_of(impl: Any, n: int) -> bytes:
    return bytes(session(impl, 1024).encode_frames(np.arange(n, dtype=np.float32)))


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("where", ["session", "call"])
def test_a_slow_drip_is_cut_off_at_the_deadline(impl: Any, path: str, where: str) -> None:
    wire = wire_of(impl, 20_000)  # ~80 KB: ~1.7 s at the drip's rate
    kwargs = {"deadline": 0.4} if where == "session" else {}
    s = session(impl, 1024, timeout=5.0, **kwargs)
    call = {} if where == "session" else {"deadline": 0.4}

    async def main() -> tuple[BaseException, float]:
        async with receiving_end(path) as (peer, rx):
            dripping = asyncio.create_task(drip(peer, wire))
            start = time.monotonic()
            with pytest.raises(errors.StreamDeadlineError) as info:
                await s.receive_from(rx, **call)
            took = time.monotonic() - start
            dripping.cancel()
            return info.value, took

    exc, took = run(main)
    assert 0.35 < took < 3.0, took
    assert isinstance(exc, errors.StreamTimeoutError) and isinstance(exc, TimeoutError)
    assert exc.deadline == exc.timeout == 0.4
    assert exc.total == 20 and 0 < exc.received < 20
    assert str(exc) == (
        f"the transfer took longer than its deadline of 0.4 s (after {exc.received} of 20 chunks)"
    )


@pytest.mark.parametrize("path", PATHS)
def test_the_deadline_starts_at_the_first_byte(impl: Any, path: str) -> None:
    # Idle before the gradient begins is the receiver's own time: 0.6 s of silence, then
    # a fast gradient, under a 0.4 s deadline.
    grad = np.arange(3000, dtype=np.float32)
    wire = bytes(session(impl, 1024).encode_frames(grad))
    s = session(impl, 1024, deadline=0.4)

    async def main() -> Any:
        async with receiving_end(path) as (peer, rx):
            loop = asyncio.get_running_loop()

            async def late_but_fast() -> None:
                await asyncio.sleep(0.6)
                await loop.sock_sendall(peer, wire)

            _, got = await asyncio.gather(late_but_fast(), s.receive_from(rx))
            return got

    assert np.array_equal(run(main), grad)


@pytest.mark.parametrize("path", PATHS)
def test_receive_iter_gives_each_gradient_its_own_deadline(impl: Any, path: str) -> None:
    grads = [np.full(2000, k, np.float32) for k in range(3)]
    wires = [bytes(session(impl, 1024).encode_frames(g)) for g in grads]
    s = session(impl, 1024)

    async def main() -> list[Any]:
        async with receiving_end(path) as (peer, rx):
            loop = asyncio.get_running_loop()

            async def spaced() -> None:
                for wire in wires:  # 0.3 s apart, each fast: 0.9 s in all
                    await asyncio.sleep(0.3)
                    await loop.sock_sendall(peer, wire)
                peer.shutdown(socket.SHUT_WR)

            async def collect() -> list[Any]:
                return [g async for g in s.receive_iter(rx, deadline=0.25)]

            return (await asyncio.gather(spaced(), collect()))[1]

    got = run(main)
    assert len(got) == 3 and all(np.array_equal(a, b) for a, b in zip(got, grads, strict=True))


@pytest.mark.parametrize("path", PATHS)
def test_a_sender_to_a_peer_that_never_reads_meets_its_deadline(impl: Any, path: str) -> None:
    # 64 MiB cannot fit the socket buffers: the send blocks, and the 5 s timeout would
    # be the only bound without the deadline.
    grad = np.zeros(16 << 20, np.float32)
    s = session(impl, 65536, timeout=5.0)

    async def main() -> tuple[BaseException, float]:
        a, b = socket.socketpair()
        writer = None
        try:
            tx: Any = a
            if path == "streams":
                _, writer = await asyncio.open_connection(sock=a)
                tx = writer
            start = time.monotonic()
            with pytest.raises(errors.StreamDeadlineError) as info:
                await s.stream_to(grad, tx, deadline=0.3)
            return info.value, time.monotonic() - start
        finally:
            if writer is not None:
                writer.transport.abort()
            a.close()
            b.close()

    exc, took = run(main)
    assert 0.25 < took < 3.0, took
    assert exc.deadline == 0.3 and exc.total == 256 and exc.received < 256


def test_a_set_drips_against_one_deadline(impl: Any) -> None:
    # A tensor set's deadline covers the whole set, not each tensor.
    tensors = {f"t{k}": np.full(3000, k, np.float32) for k in range(8)}
    wire = bytes(session(impl, 1024).encode_tensors(tensors))  # ~100 KB: ~2 s dripped
    s = session(impl, 1024, timeout=5.0)

    async def main() -> BaseException:
        async with receiving_end("socket") as (peer, rx):
            dripping = asyncio.create_task(drip(peer, wire))
            with pytest.raises(errors.StreamDeadlineError) as info:
                await s.receive_tensors(rx, deadline=0.5)
            dripping.cancel()
            return info.value

    exc = run(main)
    assert exc.deadline == 0.5


@pytest.mark.parametrize(
    ("value", "cls", "text"),
    [
        (-1, errors.SettingError, f"{REFUSED}-1"),
        (0.0, errors.SettingError, f"{REFUSED}0.0"),
        (float("inf"), errors.SettingError, f"{REFUSED}inf"),
        ("5", TypeError, "deadline must be None or a number, not str"),
    ],
)
def test_a_bad_deadline_is_refused_alike(impl: Any, value: Any, cls: type, text: str) -> None:
    with pytest.raises(cls) as made:
        session(impl, deadline=value)
    assert str(made.value) == text
    if cls is errors.SettingError:
        assert made.value.setting == "deadline"
    s = session(impl)

    async def main() -> BaseException:
        a, b = socket.socketpair()
        with a, b, pytest.raises(cls) as called:
            await s.receive_from(b, deadline=value)
        return called.value

    assert str(run(main)) == text


def test_the_deadline_is_a_setting_both_sides_show(impl: Any) -> None:
    s = session(impl, deadline=2.5)
    assert s.deadline == 2.5 and session(impl).deadline is None
    assert "deadline=2.5" in repr(s)
    assert s.with_compression(True).deadline == 2.5
