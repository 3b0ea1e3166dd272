"""Bad peers at a listener (docs/spec/threat-model.md): an HTTP client, a TLS client at a
plaintext listener, an ipfrs-transport peer's bare frames, a peer of another version,
peers that stay silent, and more of them than the caps allow (the oldest silent one gives
way, or the newcomer is closed at once; a flood of them: test_flood.py). None reaches
``accept()``; each is logged (WARNING, with its address and why, rate-limited) and
dropped, gets a clear answer where it can read one, and the listener goes on serving good
clients. The native listener against peers by hand (their messages the test peer's); the
native dialler at a seed listener, native or the test peer's (``acceptor``)."""

from __future__ import annotations

import asyncio
import functools
import logging
import socket
from types import ModuleType
from typing import Any

import numpy as np
import pytest

import gradstream as gs
import gradstream.reference as ref
from gradstream import _connection
from gradstream._logs import RefusalLog
from gradstream.errors import ProtocolError
from support.aio import apoll
from support.connections import LOCAL, raw_peer, read_to_end, run, tls_client_hello
from support.peer import messages as p

GRAD = np.arange(5000, dtype=np.float32)


def refusals(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "gradstream" and r.levelno == logging.WARNING and " refused " in r.getMessage()
    ]


async def good_client_is_served(listener: Any) -> None:
    """A real client connects and delivers a gradient while the bad peers are (or were)
    there."""

    async def serve_one() -> np.ndarray:
        async with await listener.accept() as conn:
            return await conn.recv()

    serving = asyncio.create_task(serve_one())
    async with await gs.connect(listener.address) as conn:
        assert await conn.send(GRAD) == 1
    assert np.array_equal(await serving, GRAD)


async def hostile(listener: Any, first: bytes) -> bytes:
    """A peer that sends ``first`` and reads until the listener drops it: what it got."""
    async with raw_peer(listener.address) as (reader, writer):
        writer.write(first)
        writer.write_eof()
        return await read_to_end(reader)


SEED_FRAMES = ref.GradientStreamSession("s", 1024).encode_frames(GRAD)
CASES = {
    "http": (b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n", "hello, got an HTTP request ('GET /"),
    "tls": (None, "hello, got a TLS ClientHello (a TLS client at a plaintext listener"),
    "seed": (SEED_FRAMES, "hello, got a bare seed frame header (chunk 0 of 5, payload_len"),
    "version 4": (
        p.encode_hello(p.Hello(1, 0, bytes(32), 1, 1))[:12] + b"\x04\x00\x50\x00" + bytes(64),
        "expected a hello of version 2, got a hello of version 4 (a newer gradstream: "
        "upgrade this side)",
    ),
    "garbage": (bytes(range(100, 116)) * 2, "hello, got bytes 6465666768"),
    "short hello": (
        p.encode_hello(p.Hello(1, 0, bytes(32), 1, 1))[:30],
        "hello, got the end of the connection 14 bytes into its last 64",
    ),
    "short head": (b"GSHL", "hello, got the end of the connection after 4 bytes (4753484c)"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_foreign_peer_is_refused_logged_and_the_listener_goes_on(
    case: str, caplog: pytest.LogCaptureFixture
) -> None:
    first, seen = CASES[case]

    async def main() -> bytes:
        async with await gs.listen(LOCAL) as listener:
            got = await hostile(listener, tls_client_hello() if first is None else first)
            await good_client_is_served(listener)
            return got

    with caplog.at_level(logging.INFO, logger="gradstream"):
        got = run(main)
    # The peer read the listener's hello, and nothing more: then the end.
    assert len(got) == 80 and got.startswith(b"GSHL")
    lines = refusals(caplog)
    assert len(lines) == 1, lines
    assert "refused 127.0.0.1:" in lines[0]
    assert seen in lines[0], lines[0]
    accepted = [r.getMessage() for r in caplog.records if " accepted " in r.getMessage()]
    assert len(accepted) == 1 and accepted[0].startswith("listener 127.0.0.1:")


def test_a_gradstream_client_at_a_seed_listener_is_not_a_downgrade(acceptor: ModuleType) -> None:
    server, client = acceptor, gs

    # The other way round: a gradstream client meeting a seed peer (here: a seed
    # listener's connection that sends a gradient at once) fails with a clear error.
    async def main() -> ProtocolError:
        async with await server.listen(LOCAL, protocol="seed") as listener:

            async def push() -> None:
                async with await listener.accept() as conn:
                    await conn.send(GRAD)

            pushing = asyncio.create_task(push())
            with pytest.raises(ProtocolError) as info:
                await client.connect(listener.address)
            await pushing
            return info.value

    exc = run(main)
    assert exc.expected == "a gradstream hello"
    assert exc.seen.startswith("a bare seed frame header (chunk 0 of 1,")


def test_bare_frames_at_a_seed_listener_are_accepted() -> None:
    async def main() -> np.ndarray:
        async with await gs.listen(
            LOCAL, protocol="seed", session=gs.GradientStreamSession("s", 1024)
        ) as listener:
            async with raw_peer(listener.address) as (_, writer):
                writer.write(SEED_FRAMES)
                await writer.drain()
                conn = await listener.accept()
                got = await conn.recv()
                await conn.close()
                return got

    assert np.array_equal(run(main), GRAD)


def test_a_silent_peer_is_dropped_past_the_handshake_timeout(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def main() -> bytes:
        async with await gs.listen(LOCAL, handshake_timeout=0.3) as listener:
            async with raw_peer(listener.address) as (reader, _):
                # Served while the silent one waits...
                await good_client_is_served(listener)
                # ...which gets the listener's hello and then the end.
                return await read_to_end(reader)

    with caplog.at_level(logging.WARNING, logger="gradstream"):
        got = run(main)
    assert len(got) == 80
    lines = refusals(caplog)
    assert len(lines) == 1 and lines[0].endswith("silent past handshake_timeout (0.3 s)")


def test_a_full_listener_drops_its_oldest_silent_handshake_for_a_newcomer(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Two slots: two silent peers take them (each is sent the listener's hello, so the
    # test knows its handshake began); a third peer is not left waiting in the kernel's
    # backlog (the rule before issue 22): the oldest silent one gives way, once silent
    # for the eviction grace (0.25 s: docs/guides/limits.md).
    async def main() -> None:
        async with await gs.listen(
            LOCAL, max_pending_handshakes=2, handshake_timeout=60
        ) as listener:
            loop = asyncio.get_running_loop()
            first = [socket.create_connection(listener.address) for _ in range(2)]
            for s in first:
                s.setblocking(False)
                assert len(await loop.sock_recv(s, 80)) == 80
            third = socket.create_connection(listener.address)
            third.setblocking(False)
            assert len(await loop.sock_recv(third, 80)) == 80  # its handshake began...
            assert await loop.sock_recv(first[0], 80) == b""  # ...the oldest one's ended
            await good_client_is_served(listener)  # and a newcomer that speaks is served
            for s in [*first, third]:
                s.close()

    with caplog.at_level(logging.WARNING, logger="gradstream"):
        run(main)
    assert any(
        "silent, and the oldest silent handshake when a newer peer needed its place" in m
        for m in refusals(caplog)
    )


def test_at_most_max_connections_are_open(caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> None:
        async with await gs.listen(LOCAL, max_connections=2) as listener:
            conns = [await gs.connect(listener.address) for _ in range(2)]
            accepted = [await listener.accept() for _ in range(2)]
            # A third one is closed at once, before its hello (not left in the backlog)...
            with pytest.raises(ProtocolError, match="the listener dropped this side"):
                await gs.connect(listener.address)
            await accepted[0].close()  # ...and once a slot frees, let in
            late = await gs.connect(listener.address)
            accepted.append(await listener.accept())
            for conn in [*conns, *accepted, late]:
                await conn.close()

    with caplog.at_level(logging.WARNING, logger="gradstream"):
        run(main)
    assert any("max_connections (2) connections are open" in m for m in refusals(caplog))


def test_refusal_logs_are_rate_limited(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The listener's clock stands still for 15 refusals, then moves on a second. A peer
    # sees its connection close before the listener has logged it (the refusal reaches
    # the log through the listener's event pump), so the clock moves only once the
    # fifteenth refusal has been through the log.
    now = [0.0]
    seen: list[str] = []

    class CountedRefusalLog(RefusalLog):
        def refused(self, address: Any, reason: str) -> bool:
            seen.append(reason)
            return super().refused(address, reason)

    monkeypatch.setattr(
        _connection,
        "RefusalLog",
        functools.partial(CountedRefusalLog, clock=lambda: now[0]),
    )

    async def main() -> None:
        async with await gs.listen(LOCAL) as listener:
            for _ in range(15):
                await hostile(listener, b"GET / HTTP/1.1\r\n\r\n")
            assert await apoll(lambda: len(seen) == 15, 5)
            now[0] += 1.0
            await hostile(listener, b"PUT / HTTP/1.1\r\n\r\n")

    with caplog.at_level(logging.WARNING, logger="gradstream"):
        run(main)
    lines = refusals(caplog)
    assert len(lines) == 11
    assert all("an HTTP request ('GET / HTTP/1.1'" in line for line in lines[:10])
    assert "an HTTP request ('PUT / HTTP/1.1'" in lines[10]
    assert lines[10].endswith("(5 more refusals were not logged)")
