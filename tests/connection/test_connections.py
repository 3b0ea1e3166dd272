"""Connections as a user makes them (README "Connections"), in each implementation and
across them: a native client with a reference listener and the other way round speak the
same bytes by specification.

Everything runs on 127.0.0.1 with ephemeral ports.
"""

from __future__ import annotations

import asyncio
from types import ModuleType
from typing import Any

import numpy as np
import pytest

import gradstream
import gradstream.reference
from gradstream.errors import (
    AuthenticationError,
    DeliveryError,
)

IMPLS = {"native": gradstream, "reference": gradstream.reference}
PAIRS = [(a, b) for a in IMPLS for b in IMPLS]
KEY = b"correct horse battery staple"


def impl_available(name: str) -> bool:
    return hasattr(IMPLS[name], "listen")


def pick(name: str) -> ModuleType:
    if not impl_available(name):
        pytest.skip(f"{name} has no connections yet")
    return IMPLS[name]


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 60))


def session(gs: ModuleType, **kw: Any) -> Any:
    return gs.GradientStreamSession("conn", timeout=10, **kw)


@pytest.mark.parametrize(("server", "client"), PAIRS)
def test_round_trip_both_ways_with_acks(server: str, client: str) -> None:
    gs_s, gs_c = pick(server), pick(client)
    grad = np.linspace(-1, 1, 300_001, dtype=np.float32)
    reply = np.arange(5, dtype=np.float32)

    async def main() -> None:
        listener = await gs_s.listen("127.0.0.1:0", session=session(gs_s, chunk_size=4096))
        async with listener:
            host, port = listener.address
            assert host == "127.0.0.1" and port > 0

            async def serve_one() -> tuple[Any, Any]:
                conn = await listener.accept()
                async with conn:
                    got = await conn.recv()
                    sent = await conn.send(reply)
                    end = await conn.recv()
                    return got, (sent, end, conn.peer)

            task = asyncio.create_task(serve_one())
            conn = await gs_c.connect(("127.0.0.1", port), session=session(gs_c, chunk_size=4096))
            async with conn:
                n = await conn.send(grad)
                back = await conn.recv()
            got, (sent, end, peer) = await task
        assert n == 74  # ceil(300001 / 4096)
        assert sent == 1
        assert end.size == 0  # the client closed between gradients: as receive_from
        np.testing.assert_array_equal(got, grad)
        np.testing.assert_array_equal(back, reply)
        assert peer.address[0] == "127.0.0.1"
        assert peer.tls_subject is None and peer.authenticated is False

    run(main())


@pytest.mark.parametrize(("server", "client"), PAIRS)
def test_tensor_sets_and_async_for(server: str, client: str) -> None:
    gs_s, gs_c = pick(server), pick(client)
    grads = {
        "fc.weight": np.arange(12, dtype=np.float32).reshape(3, 4),
        "fc.bias": np.arange(4, dtype=np.float64),
    }
    stream = [np.full(n, n, np.float32) for n in (1, 1000, 70_000)]

    async def main() -> tuple[Any, list[Any]]:
        listener = await gs_s.listen("127.0.0.1:0", session=session(gs_s))
        async with listener:

            async def serve_one() -> tuple[Any, list[Any]]:
                async for conn in listener:
                    async with conn:
                        tensors = await conn.recv_tensors()
                        return tensors, [g async for g in conn]
                raise AssertionError("no connection")

            task = asyncio.create_task(serve_one())
            async with await gs_c.connect(listener.address, session=session(gs_c)) as conn:
                assert await conn.send_tensors(grads) == 3
                for g in stream:
                    await conn.send(g)
            return await task

    tensors, got = run(main())
    assert list(tensors) == list(grads)
    for name, t in grads.items():
        assert tensors[name].dtype == t.dtype and tensors[name].shape == t.shape
        np.testing.assert_array_equal(tensors[name], t)
    assert len(got) == len(stream)
    for a, b in zip(got, stream, strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize(("server", "client"), PAIRS)
def test_authkey_admits_the_key_holder_and_refuses_others(server: str, client: str) -> None:
    gs_s, gs_c = pick(server), pick(client)

    async def main() -> None:
        listener = await gs_s.listen("127.0.0.1:0", session=session(gs_s), authkey=KEY)
        async with listener:
            for wrong in (b"x" * 28, None):
                with pytest.raises(AuthenticationError):
                    await gs_c.connect(listener.address, session=session(gs_c), authkey=wrong)
            accepted = asyncio.create_task(listener.accept())
            conn = await gs_c.connect(listener.address, session=session(gs_c), authkey=KEY)
            theirs = await accepted
            assert conn.peer.authenticated and theirs.peer.authenticated
            send = asyncio.create_task(conn.send(np.ones(3, np.float32)))
            np.testing.assert_array_equal(await theirs.recv(), np.ones(3, np.float32))
            assert await send == 1
            await conn.close()
            await theirs.close()

    run(main())


@pytest.mark.parametrize("name", list(IMPLS))
def test_a_refused_gradient_is_a_delivery_error_with_the_reason(name: str) -> None:
    gs = pick(name)

    async def main() -> None:
        small = session(gs, max_gradient_len=10)
        listener = await gs.listen("127.0.0.1:0", session=small)
        async with listener:
            accepted = asyncio.create_task(listener.accept())
            conn = await gs.connect(listener.address, session=session(gs))
            theirs = await accepted
            # The peer's hello said it takes at most 10 values: refused before a byte.
            with pytest.raises(DeliveryError, match="at most 10"):
                await conn.send(np.ones(11, np.float32))
            await conn.close()
            await theirs.close()

    run(main())


@pytest.mark.parametrize("name", list(IMPLS))
def test_bad_peers_are_dropped_and_the_listener_goes_on(
    name: str, caplog: pytest.LogCaptureFixture
) -> None:
    gs = pick(name)

    async def main() -> None:
        listener = await gs.listen("127.0.0.1:0", session=session(gs), handshake_timeout=0.5)
        async with listener:
            host, port = listener.address
            _reader, writer = await asyncio.open_connection(host, port)
            writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            await writer.drain()
            silent = await asyncio.open_connection(host, port)
            accepted = asyncio.create_task(listener.accept())
            conn = await gs.connect(listener.address, session=session(gs))
            theirs = await accepted
            assert theirs.peer.address[0] == host
            await conn.close()
            await theirs.close()
            writer.close()
            await asyncio.sleep(0.8)  # past the silent peer's handshake timeout
            silent[1].close()

    caplog.set_level("WARNING", logger="gradstream")
    run(main())
    text = caplog.text
    assert "HTTP request" in text
    assert "handshake_timeout (0.5 s)" in text
