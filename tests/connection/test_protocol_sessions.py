"""Whole plaintext sessions (docs/spec/protocol.md, the session vectors in
tests/connection/vectors/sessions.json) replayed against the native side, byte for byte:
the native listener against a recorded dialler (the test writes the dialler's messages,
and every byte the listener writes must be the recorded listener's: its hello and SPAKE2
element, its tag, its acks), and the native dialler against a recorded listener. The
native side's nonce is fixed for the replay by the bindings' test-only ``_test_nonce``
(see ``gradstream._connection_args``'s ``_link_settings``); its SPAKE2 scalar, every tag,
transfer id, seal and ack digest follow from it.

The vectors are what the test peer records (support.peer.sessions), and their hellos and
tags are the message vectors of test_protocol_golden.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import gradstream as gs
from gradstream import _connection_args
from gradstream.errors import SettingError
from support.connections import LOCAL, close_writer, run
from support.peer import sessions

VECTORS = sessions.load()
NAMES = list(VECTORS["sessions"])


def steps(name: str) -> list[tuple[str, str, bytes]]:
    """Session ``name``'s messages: (the side that writes it, what it is, its bytes)."""
    recorded = VECTORS["sessions"][name]["steps"]
    return [(s["from"], s["what"], bytes.fromhex(s["hex"])) for s in recorded]


def key_of(name: str) -> bytes | None:
    return bytes.fromhex(VECTORS["authkey"]) if VECTORS["sessions"][name]["authkey"] else None


@pytest.fixture
def fixed_nonce(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[bytes]]:
    """The native side's hello nonce for the connections made while the test runs: the
    last one put in the list (the keywords the engine gets, with ``_test_nonce`` added)."""
    nonce: list[bytes] = []
    real = _connection_args._link_settings

    def with_nonce(*args: Any, **keywords: Any) -> tuple[dict[str, Any], str]:
        settings, speaks = real(*args, **keywords)
        settings["_test_nonce"] = nonce[-1]
        return settings, speaks

    monkeypatch.setattr(_connection_args, "_link_settings", with_nonce)
    yield nonce


async def replay(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, name: str, native: str
) -> None:
    """Play the other side of session ``name`` on a connection to the native ``native``
    side: write that side's messages, read the native side's, which must be the recorded
    ones; then nothing more."""
    for side, what, data in steps(name):
        if side == native:
            got = await reader.readexactly(len(data))
            assert got.hex() == data.hex(), f"{name}: the {native}'s {what}"
        else:
            writer.write(data)
            await writer.drain()


def the_sent(gradient: np.ndarray, tensors: dict[str, np.ndarray]) -> None:
    """What the native receiver took is what the recorded sender sent."""
    assert gradient.dtype == np.float32
    assert gradient.tolist() == VECTORS["gradient"]["values"]
    assert list(tensors) == list(VECTORS["tensors"])
    for name, recorded in VECTORS["tensors"].items():
        assert tensors[name].dtype == np.dtype(recorded["dtype"])
        assert list(tensors[name].shape) == recorded["shape"]
        assert tensors[name].ravel().tolist() == recorded["values"]


@pytest.mark.parametrize("name", [n for n in NAMES if n.endswith("to the listener")])
def test_the_native_listener_answers_a_recorded_dialler_byte_for_byte(
    name: str, fixed_nonce: list[bytes]
) -> None:
    fixed_nonce.append(bytes.fromhex(VECTORS["server_nonce"]))

    async def main() -> tuple[np.ndarray, dict[str, np.ndarray], np.ndarray, bytes]:
        async with await gs.listen(LOCAL, authkey=key_of(name)) as listener:
            reader, writer = await asyncio.open_connection(*listener.address)
            replaying = asyncio.create_task(replay(reader, writer, name, "listener"))
            async with await listener.accept() as conn:
                gradient = await conn.recv()
                tensors = await conn.recv_tensors()
                await replaying
                writer.write_eof()  # the dialler closes: the end, between transfers
                end = await conn.recv()
                assert conn.closed
            after = await reader.read()
            await close_writer(writer)
            return gradient, tensors, end, after

    gradient, tensors, end, after = run(main)
    the_sent(gradient, tensors)
    assert end.size == 0 and after == b""  # nothing but the recorded bytes


@pytest.mark.parametrize("name", [n for n in NAMES if n.endswith("to the dialler")])
def test_the_native_dialler_answers_a_recorded_listener_byte_for_byte(
    name: str, fixed_nonce: list[bytes]
) -> None:
    fixed_nonce.append(bytes.fromhex(VECTORS["client_nonce"]))

    async def main() -> tuple[np.ndarray, dict[str, np.ndarray], bytes]:
        done: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()

        async def recorded_listener(
            reader: asyncio.StreamReader, writer: asyncio.StreamWriter
        ) -> None:
            try:
                await replay(reader, writer, name, "dialler")
                done.set_result(await reader.read())
            except BaseException as exc:
                done.set_exception(exc)
            finally:
                await close_writer(writer)

        server = await asyncio.start_server(recorded_listener, "127.0.0.1", 0)
        try:
            address = server.sockets[0].getsockname()[:2]
            async with await gs.connect(address, authkey=key_of(name)) as conn:
                gradient = await conn.recv()
                tensors = await conn.recv_tensors()
            return gradient, tensors, await done
        finally:
            server.close()

    gradient, tensors, after = run(main)
    the_sent(gradient, tensors)
    assert after == b""  # the dialler closed after its last ack


def test_the_vectors_are_what_the_test_peer_records() -> None:
    assert sessions.text(sessions.record_all()) == sessions.VECTORS.read_text()


def test_the_sessions_hellos_and_tags_are_the_message_vectors() -> None:
    from test_protocol_golden import (
        CLIENT_AUTH,
        CLIENT_HELLO,
        CLIENT_PAKE,
        SERVER_AUTH,
        SERVER_HELLO,
        SERVER_PAKE,
    )

    shaken = steps("authkey, to the listener")[:4]
    # With an authkey, each side's SPAKE2 element goes with its hello.
    assert [data for _, _, data in shaken] == [
        CLIENT_HELLO + CLIENT_PAKE,
        SERVER_HELLO + SERVER_PAKE,
        CLIENT_AUTH,
        SERVER_AUTH,
    ]
    plain = steps("plain, to the listener")[:2]
    # Without an authkey, the hellos say so (byte 17) and nothing else changes.
    assert [data[:17] + data[18:] for _, _, data in plain] == [
        h[:17] + h[18:] for h in (CLIENT_HELLO, SERVER_HELLO)
    ]
    assert [data[17] for _, _, data in plain] == [0, 0]


def test_the_nonce_hook_is_only_the_bindings_and_takes_32_bytes(
    fixed_nonce: list[bytes],
) -> None:
    async def main() -> None:
        with pytest.raises(TypeError, match="_test_nonce"):
            await gs.connect(LOCAL, _test_nonce=bytes(32))  # type: ignore[call-arg]
        fixed_nonce.append(bytes(31))
        with pytest.raises(SettingError, match="a test nonce is 32 bytes"):
            await gs.listen(LOCAL)

    run(main)
