"""Connections that work (README "Connections"), reference to reference over loopback:
gradients of every dtype and shape, tensor sets, out=, ``async for`` until the peer
closes, several gradients each way, request and reply, serve() with handlers at once,
``protocol="seed"``, and the rules of one transfer at a time."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import numpy as np
import pytest

import gradstream.reference as ref
from gradstream.errors import SettingError, StreamIOError
from support.connections import KEY, LOCAL, accept_in_background, run


def bits(a: np.ndarray) -> np.ndarray:
    return a.view(np.dtype(f"u{a.dtype.itemsize}"))


def same(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(bits(a), bits(b))


GRADIENTS = [
    np.arange(100_000, dtype=np.float32) * np.float32(0.5),
    (np.arange(24, dtype=np.float16) - 3).reshape(2, 3, 4),
    np.linspace(-1, 1, 3000, dtype=np.float64).reshape(30, 100),
    np.zeros(0, np.float32),
    np.array([np.nan, -0.0, np.inf, 1e-45], np.float32),
]


@pytest.mark.parametrize("authkey", [None, KEY], ids=["plain", "authkey"])
def test_gradients_of_every_dtype_and_shape_arrive_bit_for_bit(authkey: bytes | None) -> None:
    s = ref.GradientStreamSession("s", 4096, keep_shape=True, keep_dtype=True)

    async def main() -> tuple[list[int], list[np.ndarray], list[np.ndarray]]:
        async with await ref.listen(LOCAL, session=s, authkey=authkey) as listener:

            async def receive() -> tuple[list[np.ndarray], ref.Connection]:
                conn = await listener.accept()
                return [g async for g in conn], conn

            receiving = asyncio.create_task(receive())
            async with await ref.connect(listener.address, session=s, authkey=authkey) as conn:
                counts = [await conn.send(g) for g in GRADIENTS]
                assert conn.peer.authenticated is (authkey is not None)
            got, server_side = await receiving
            assert server_side.closed  # the peer closed: async for ended and closed it
            assert server_side.peer.authenticated is (authkey is not None)
            assert server_side.peer.tls_subject is None
            return counts, got, GRADIENTS

    counts, got, sent = run(main)
    assert counts == [25, 1, 1, 1, 1]
    assert len(got) == len(sent)
    for a, b in zip(got, sent, strict=True):
        assert same(a, b), (a.dtype, a.shape)


def test_several_gradients_each_way_and_request_reply() -> None:
    async def main() -> list[np.ndarray]:
        async def handler(conn: ref.Connection) -> None:
            async for g in conn:  # each request answered with its double
                await conn.send(g * 2)

        async with await ref.serve(LOCAL, handler) as server:
            async with await ref.connect(server.address) as conn:
                replies = []
                for k in range(5):
                    assert await conn.send(np.full(70_000, k, np.float32)) == 2
                    replies.append(await conn.recv())
                return replies

    for k, reply in enumerate(run(main)):
        assert same(reply, np.full(70_000, 2 * k, np.float32))


def test_recv_into_out_and_tensor_sets() -> None:
    tensors = {
        "fc.weight": np.arange(12, dtype=np.float32).reshape(3, 4),
        "fc.bias": np.ones(3, np.float64),
        "emb": np.zeros((2, 2, 2), np.float16),
    }

    async def main() -> tuple[np.ndarray, np.ndarray, dict[str, np.ndarray], dict[str, np.ndarray]]:
        out = np.empty((50, 20), np.float32)
        async with await ref.listen(LOCAL) as listener:

            async def receive() -> tuple[np.ndarray, dict[str, np.ndarray]]:
                async with await listener.accept() as conn:
                    got = await conn.recv(out=out)
                    t = await conn.recv_tensors()
                    await conn.send_tensors(t)
                    return got, t

            receiving = asyncio.create_task(receive())
            async with await ref.connect(listener.address) as conn:
                await conn.send(np.arange(1000, dtype=np.float32))
                assert await conn.send_tensors(tensors) == 4  # manifest + one frame each
                back = await conn.recv_tensors()
            got, t = await receiving
            return out, got, t, back

    out, got, t, back = run(main)
    assert got is out and same(out.reshape(-1), np.arange(1000, dtype=np.float32))
    for received in (t, back):
        assert list(received) == list(tensors)
        for name, value in tensors.items():
            assert same(received[name], value), name


def test_serve_runs_handlers_at_once_and_survives_a_failing_one(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def main() -> list[float]:
        both_in = asyncio.Barrier(3)  # two handlers and the test

        async def handler(conn: ref.Connection) -> None:
            g = await conn.recv()
            if g[0] < 0:
                raise RuntimeError("a handler that fails")
            await both_in.wait()  # only passes if the two good handlers run at once
            await conn.send(g + 1)

        async with await ref.serve(LOCAL, handler) as server:
            bad = await ref.connect(server.address)
            await bad.send(np.full(3, -1, np.float32))
            assert len(await bad.recv()) == 0  # the handler failed: its connection closed
            conns = [await ref.connect(server.address) for _ in range(2)]
            for k, conn in enumerate(conns):
                await conn.send(np.full(3, k, np.float32))
            await both_in.wait()
            replies = [float((await conn.recv())[0]) for conn in conns]
            for conn in [bad, *conns]:
                await conn.close()
            return replies

    with caplog.at_level(logging.WARNING, logger="gradstream"):
        assert run(main) == [1.0, 2.0]
    failed = [r for r in caplog.records if "handler of the connection" in r.getMessage()]
    assert len(failed) == 1 and "a handler that fails" in failed[0].getMessage()


def test_seed_protocol_speaks_bare_frames() -> None:
    grad = np.arange(5000, dtype=np.float32)

    async def main() -> tuple[bytes, np.ndarray]:
        s = ref.GradientStreamSession("s", 1024)
        async with await ref.listen(LOCAL, protocol="seed", session=s) as listener:
            # What goes on the wire is encode_frames, and nothing else.
            reader, writer = await asyncio.open_connection(*listener.address)
            conn = await listener.accept()
            assert conn.peer.authenticated is False
            assert await conn.send(grad) == 5
            await conn.close()
            wire = await reader.read()
            writer.close()
            async with await ref.connect(listener.address, protocol="seed", session=s) as c:
                other = await listener.accept()
                await c.send(grad)
                got = await other.recv()
                await other.close()
            return wire, got

    wire, got = run(main)
    assert wire == ref.GradientStreamSession("s", 1024).encode_frames(grad)
    assert same(got, grad)


def test_one_transfer_at_a_time() -> None:
    async def main() -> None:
        async with await ref.listen(LOCAL) as listener:
            _, accepted = await accept_in_background(listener)
            async with await ref.connect(listener.address) as conn:
                receiving = asyncio.create_task(conn.recv())
                await asyncio.sleep(0.05)  # let it start waiting
                with pytest.raises(SettingError, match="send while this connection is receiving"):
                    await conn.send(np.ones(3, np.float32))
                with pytest.raises(SettingError, match="one transfer at a time per connection"):
                    await conn.recv()
                receiving.cancel()
                # Cancelled before a byte moved: still in step, still usable.
                await asyncio.gather(receiving, return_exceptions=True)
                assert not conn.closed
                while not accepted:
                    await asyncio.sleep(0.01)
                server_side = accepted[0]
                sending = asyncio.create_task(conn.send(np.ones(3, np.float32)))
                assert same(await server_side.recv(), np.ones(3, np.float32))
                assert await sending == 1
                await server_side.close()

    run(main)


def test_a_closed_connection_refuses_calls() -> None:
    async def main() -> None:
        async with await ref.listen(LOCAL) as listener:
            conn = await ref.connect(listener.address)
            await conn.close()
            await conn.close()  # twice is fine
            with pytest.raises(StreamIOError, match="send on a closed connection"):
                await conn.send(np.ones(3, np.float32))
            assert [g async for g in conn] == []

    run(main)


@pytest.mark.parametrize(
    ("keywords", "error", "match"),
    [
        ({"protocol": "seed", "authkey": KEY}, SettingError, "cannot carry authkey="),
        ({"protocol": "tcp"}, SettingError, "protocol must be 'gradstream' or 'seed'"),
        ({"authkey": b"short"}, SettingError, "authkey must hold at least 16 bytes"),
        ({"timeout": 0}, SettingError, "timeout must be None or a positive number"),
        ({"session": object()}, TypeError, "session must be a gradstream.reference"),
    ],
)
def test_bad_keywords_are_refused_before_connecting(
    keywords: dict[str, Any], error: type[Exception], match: str
) -> None:
    async def main() -> None:
        with pytest.raises(error, match=match):
            await ref.connect("127.0.0.1:9", **keywords)
        with pytest.raises(error, match=match):
            await ref.listen(LOCAL, **keywords)

    run(main)


def test_listener_keywords_are_checked() -> None:
    async def main() -> None:
        with pytest.raises(SettingError, match="max_pending_handshakes must be at least 1"):
            await ref.listen(LOCAL, max_pending_handshakes=0)
        with pytest.raises(SettingError, match="handshake_timeout must be a positive number"):
            await ref.listen(LOCAL, handshake_timeout=-1)
        with pytest.raises(TypeError, match="handler must be callable"):
            await ref.serve(LOCAL, "handler")  # type: ignore[arg-type]

    run(main)


def test_accept_on_a_closed_listener() -> None:
    async def main() -> None:
        listener = await ref.listen(LOCAL)
        waiting = asyncio.create_task(listener.accept())
        await asyncio.sleep(0)
        await listener.close()
        with pytest.raises(StreamIOError, match=r"accept\(\) on a closed listener"):
            await waiting
        assert [c async for c in listener] == []

    run(main)


def test_a_connection_to_nobody_is_a_stream_io_error() -> None:
    async def main() -> None:
        listener = await ref.listen(LOCAL)
        address = listener.address
        await listener.close()
        with pytest.raises(StreamIOError) as info:
            await ref.connect(address)
        assert isinstance(info.value, ConnectionRefusedError) or info.value.errno == 111

    run(main)
