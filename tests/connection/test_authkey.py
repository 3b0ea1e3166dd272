"""authkey= (docs/guides/connections.md): a SPAKE2 exchange, then a confirmation tag each
way over both hellos. A wrong or missing key fails on both sides before any gradient
byte, a hello or key exchange message edited on the way (a man in the middle) fails the
same way, an element or tag reflected back to its sender is refused, and the listener
goes on serving the others. (What a recorded or faked connection gives an offline
guesser: test_offline_guessing.py.) Native with native and
with the test peer on either side (``pair``: listener, dialler), or the native side
against a peer by hand; a native listener logs what it refused, the test peer keeps it in
``failures``."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from types import ModuleType
from typing import Any

import numpy as np
import pytest

import gradstream as gs
import gradstream.reference as ref
from gradstream.errors import AuthenticationError, ProtocolError
from support.connections import (
    KEY,
    LOCAL,
    Proxy,
    raw_peer,
    read_to_end,
    run,
)
from support.peer import messages as p

OTHER_KEY = b"another key of 32 bytes, or so.."


def refusals(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if " refused " in r.getMessage()]


Pair = tuple[ModuleType, ModuleType]


async def refused_client(
    pair: Pair,
    listen_key: bytes | None,
    connect_key: bytes | None,
    via_proxy: Proxy | None = None,
) -> tuple[BaseException, int, list[str]]:
    """A client with ``connect_key`` at a listener with ``listen_key`` (through the
    proxy when given): the client's error, how many connections accept() gave, and what
    a test peer listening refused (its ``failures``)."""
    server, client = pair
    async with await server.listen(LOCAL, authkey=listen_key) as listener:
        accepted: list[Any] = []

        async def accepting() -> None:
            accepted.append(await listener.accept())

        task = asyncio.create_task(accepting())
        address = listener.address
        if via_proxy is not None:
            via_proxy.target = address
            address = await via_proxy.start()
        with pytest.raises((AuthenticationError, ProtocolError)) as info:
            await client.connect(address, authkey=connect_key)
        # The listener goes on: a good client is served.
        good = await client.connect(listener.address, authkey=listen_key)
        await task
        await good.close()
        await accepted[0].close()
        if via_proxy is not None:
            await via_proxy.close()
        failures = [str(f) for f in getattr(listener, "failures", [])]
        return info.value, len(accepted), failures


def listener_refusals(
    pair: Pair, caplog: pytest.LogCaptureFixture, failures: list[str]
) -> list[str]:
    """What the listener refused: a native one's log lines, a test peer's failures."""
    return refusals(caplog) if pair[0] is gs else failures


@pytest.mark.parametrize(
    ("listen_key", "connect_key", "client_says", "listener_says"),
    [
        (
            KEY,
            OTHER_KEY,
            "the peer closed the connection instead of authenticating: it refused this "
            "side's hello or authkey",
            "the peer's tag does not match",
        ),
        (
            KEY,
            None,
            "the peer requires an authkey and this side has none (give authkey=)",
            "this side requires an authkey and the peer's hello offers none",
        ),
        (
            None,
            KEY,
            "this side requires an authkey and the peer's hello offers none",
            "the peer requires an authkey and this side has none",
        ),
    ],
    ids=["wrong", "missing", "unexpected"],
)
def test_a_key_mismatch_fails_on_both_sides(
    pair: Pair,
    listen_key: bytes | None,
    connect_key: bytes | None,
    client_says: str,
    listener_says: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger="gradstream"):
        exc, accepted, failures = run(lambda: refused_client(pair, listen_key, connect_key))
    assert isinstance(exc, AuthenticationError)
    assert exc.detail == client_says
    assert str(exc).startswith("authentication with 127.0.0.1:")
    assert accepted == 1  # only the good client reached accept()
    lines = listener_refusals(pair, caplog, failures)
    assert len(lines) == 1 and listener_says in lines[0], lines


@pytest.mark.parametrize(
    ("offset", "what"),
    [
        (52, "max_gradient_len"),
        (60, "max_payload_len"),
        (30, "nonce"),
    ],
)
def test_a_man_in_the_middle_editing_a_hello_field_fails_authentication(
    pair: Pair, offset: int, what: str, caplog: pytest.LogCaptureFixture
) -> None:
    # The client's hello passes the proxy with one byte changed: both tags are over the
    # hellos each side saw, so they differ, and both sides refuse.
    proxy = Proxy(("127.0.0.1", 0), edit_at=offset, edit_xor=0x01)
    with caplog.at_level(logging.WARNING, logger="gradstream"):
        exc, accepted, failures = run(lambda: refused_client(pair, KEY, KEY, proxy))
    assert isinstance(exc, AuthenticationError), what
    # The listener refused the client's tag and closed without its own.
    assert exc.detail.startswith("the peer closed the connection instead of authenticating")
    assert accepted == 1
    lines = listener_refusals(pair, caplog, failures)
    assert len(lines) == 1 and "the peer's tag does not match" in lines[0]


def test_a_man_in_the_middle_editing_the_element_fails_authentication(
    pair: Pair, caplog: pytest.LogCaptureFixture
) -> None:
    # One bit of the client's SPAKE2 element flipped: most such edits leave no point of
    # the group (the listener refuses the message, a ProtocolError), the others a point
    # that gives the listener another key (it refuses the client's tag). Either way the
    # listener closes without its tag, and the client learns that it was refused.
    proxy = Proxy(("127.0.0.1", 0), edit_at=80 + 16 + 5, edit_xor=0x01)
    with caplog.at_level(logging.WARNING, logger="gradstream"):
        exc, accepted, failures = run(lambda: refused_client(pair, KEY, KEY, proxy))
    assert isinstance(exc, AuthenticationError) and accepted == 1
    assert exc.detail.startswith("the peer closed the connection instead of authenticating")
    lines = listener_refusals(pair, caplog, failures)
    assert len(lines) == 1
    assert (
        "a point of Ed25519's prime-order group in a key exchange message" in lines[0]
        or "the peer's tag does not match" in lines[0]
    ), lines[0]


def test_a_man_in_the_middle_editing_the_version_is_refused(
    pair: Pair, caplog: pytest.LogCaptureFixture
) -> None:
    # The version is checked before the tags: the listener refuses the hello
    # (ProtocolError, logged) and closes; the client, waiting for the listener's tag,
    # learns that it was refused.
    proxy = Proxy(("127.0.0.1", 0), edit_at=12, edit_xor=0x03)
    with caplog.at_level(logging.WARNING, logger="gradstream"):
        exc, accepted, failures = run(lambda: refused_client(pair, KEY, KEY, proxy))
    assert isinstance(exc, AuthenticationError) and accepted == 1
    assert exc.detail.startswith("the peer closed the connection instead of authenticating")
    lines = listener_refusals(pair, caplog, failures)
    assert len(lines) == 1
    assert "expected a hello of version 2, got a hello of version 1" in lines[0]


async def fake_listener(
    answer: Callable[[asyncio.StreamReader], Awaitable[bytes]], reflect_tag: bool
) -> AuthenticationError:
    """A native client with KEY at a listener without it, which sends a hello, then
    ``answer(reader)`` (having read the client's hello), then, with ``reflect_tag``, the
    client's own tag back to it; the client's error."""

    async def on_connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(p.encode_hello(p.Hello(2, 1, bytes(32), 1 << 30, 1 << 28)))
        await reader.readexactly(80)
        writer.write(await answer(reader))
        if reflect_tag:
            writer.write(await reader.readexactly(48))
        await read_to_end(reader)
        writer.close()

    server = await asyncio.start_server(on_connection, "127.0.0.1", 0)
    try:
        with pytest.raises(AuthenticationError) as info:
            await gs.connect(server.sockets[0].getsockname()[:2], authkey=KEY)
        return info.value
    finally:
        server.close()


def test_a_reflected_element_is_refused() -> None:
    # The listener sends the client's own element back as its own.
    async def reflect(reader: asyncio.StreamReader) -> bytes:
        return await reader.readexactly(48)

    detail = run(lambda: fake_listener(reflect, reflect_tag=False)).detail
    assert detail == "the peer's key exchange message is this side's own, sent back"


def test_a_reflected_tag_is_refused() -> None:
    # The listener runs SPAKE2 with a guessed key and sends the client's own tag back.
    async def guess(reader: asyncio.StreamReader) -> bytes:
        await reader.readexactly(48)  # the client's element
        return p.Exchange(OTHER_KEY, p.ROLE_SERVER).message()

    detail = run(lambda: fake_listener(guess, reflect_tag=True)).detail
    assert detail.startswith("the peer's tag does not match")


def test_a_client_guessing_a_tag_is_refused_before_any_gradient_byte_and_gets_no_tag(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # A client with a guessed key: the listener reads its tag, refuses it, and closes
    # without its own (a listener answers only a tag it verified), before any frame.
    async def main() -> bytes:
        async with await gs.listen(LOCAL, authkey=KEY) as listener:
            async with raw_peer(listener.address) as (reader, writer):
                writer.write(p.encode_hello(p.Hello(1, 1, bytes(32), 1 << 30, 1 << 28)))
                writer.write(p.Exchange(OTHER_KEY, p.ROLE_CLIENT).message())
                await reader.readexactly(80 + 48)
                writer.write(p.encode_auth(bytes(32)))
                writer.write(ref.GradientStreamSession("s").encode_frames(np.ones(3, np.float32)))
                return await read_to_end(reader)

    with caplog.at_level(logging.WARNING, logger="gradstream"):
        got = run(main)
    assert got == b""  # no tag of the listener's, then the end
    assert "the peer's tag does not match" in refusals(caplog)[0]


def test_a_client_that_sends_no_tag_gets_none() -> None:
    # A client that stops after the exchange (to learn from the listener's tag whether
    # its guess was right) waits in vain: the listener times the handshake out.
    async def main() -> bytes:
        async with await gs.listen(LOCAL, authkey=KEY, handshake_timeout=0.5) as listener:
            async with raw_peer(listener.address) as (reader, writer):
                writer.write(p.encode_hello(p.Hello(1, 1, bytes(32), 1 << 30, 1 << 28)))
                writer.write(p.Exchange(OTHER_KEY, p.ROLE_CLIENT).message())
                await reader.readexactly(80 + 48)
                return await read_to_end(reader)

    assert run(main) == b""


def test_authenticated_peers_say_so(pair: Pair) -> None:
    server_side, client_side = pair

    async def main() -> tuple[Any, Any]:
        async with await server_side.listen(LOCAL, authkey=KEY) as listener:
            client = await client_side.connect(listener.address, authkey=KEY)
            server = await listener.accept()
            peers = client.peer, server.peer
            await client.close()
            await server.close()
            return peers

    client_view, server_view = run(main)
    assert client_view.authenticated and server_view.authenticated
    assert client_view.tls_subject is None and server_view.tls_subject is None
