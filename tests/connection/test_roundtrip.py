"""Connections that work (docs/guides/connections.md) over loopback, native with native
and with the test peer on either side (``pair``: listener, dialler): gradients of every
dtype and shape, tensor sets, out=, ``async for`` until the peer closes, several
gradients each way, request and reply, ``protocol="seed"``, progress; and the native
side's own: serve() with handlers at once, per-call deadlines, the rules of one transfer
at a time, the checks of its keywords, its DEBUG line per transfer."""

from __future__ import annotations

import asyncio
import errno
import logging
import re
from types import ModuleType
from typing import Any

import numpy as np
import pytest

import gradstream as gs
from gradstream.errors import SettingError, StreamDeadlineError, StreamIOError, StreamTimeoutError
from support.connections import (
    KEY,
    LOCAL,
    accept_in_background,
    hello_by_hand,
    raw_peer,
    run,
    sealed_frames,
)
from support.peer import messages as p

Pair = tuple[ModuleType, ModuleType]


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
def test_gradients_of_every_dtype_and_shape_arrive_bit_for_bit(
    pair: Pair, authkey: bytes | None
) -> None:
    server, client = pair

    def s(side: ModuleType) -> Any:
        return side.GradientStreamSession("s", 4096, keep_shape=True, keep_dtype=True)

    async def main() -> tuple[list[int], list[np.ndarray], list[np.ndarray]]:
        async with await server.listen(LOCAL, session=s(server), authkey=authkey) as listener:

            async def receive() -> tuple[list[np.ndarray], Any]:
                conn = await listener.accept()
                return [g async for g in conn], conn

            receiving = asyncio.create_task(receive())
            address = listener.address
            async with await client.connect(address, session=s(client), authkey=authkey) as conn:
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


def test_a_round_trip_both_ways_with_acks(pair: Pair) -> None:
    # (Folded in from the lead's test_connections.py.) A 74-chunk gradient one way, a
    # reply the other, and the end of the connection as receive_from's end.
    server, client = pair
    grad = np.linspace(-1, 1, 300_001, dtype=np.float32)
    reply = np.arange(5, dtype=np.float32)

    async def main() -> tuple[Any, ...]:
        s = server.GradientStreamSession("conn", 4096, timeout=10)
        async with await server.listen(LOCAL, session=s) as listener:
            host, port = listener.address
            assert host == "127.0.0.1" and port > 0

            async def serve_one() -> tuple[Any, ...]:
                async with await listener.accept() as conn:
                    got = await conn.recv()
                    sent = await conn.send(reply)
                    end = await conn.recv()
                    return got, sent, end, conn.peer, conn.closed

            task = asyncio.create_task(serve_one())
            c = client.GradientStreamSession("conn", 4096, timeout=10)
            async with await client.connect(("127.0.0.1", port), session=c) as conn:
                n = await conn.send(grad)
                back = await conn.recv()
            return n, back, *await task

    n, back, got, sent, end, peer, closed = run(main)
    assert n == 74 and sent == 1  # ceil(300001 / 4096) chunks, then one
    assert end.size == 0 and closed  # the client closed between gradients
    assert same(got, grad) and same(back, reply)
    assert peer.address[0] == "127.0.0.1"
    assert peer.tls_subject is None and peer.authenticated is False


def test_several_gradients_each_way_and_request_reply(pair: Pair) -> None:
    server_side, client = pair

    async def main() -> list[np.ndarray]:
        async def handler(conn: Any) -> None:
            async for g in conn:  # each request answered with its double
                await conn.send(g * 2)

        async with await server_side.serve(LOCAL, handler) as server:
            async with await client.connect(server.address) as conn:
                replies = []
                for k in range(5):
                    assert await conn.send(np.full(70_000, k, np.float32)) == 2
                    replies.append(await conn.recv())
                return replies

    for k, reply in enumerate(run(main)):
        assert same(reply, np.full(70_000, 2 * k, np.float32))


def test_recv_into_out_and_tensor_sets(pair: Pair) -> None:
    server, client = pair
    tensors = {
        "fc.weight": np.arange(12, dtype=np.float32).reshape(3, 4),
        "fc.bias": np.ones(3, np.float64),
        "emb": np.zeros((2, 2, 2), np.float16),
    }

    async def main() -> tuple[np.ndarray, np.ndarray, dict[str, np.ndarray], dict[str, np.ndarray]]:
        out = np.empty((50, 20), np.float32)
        async with await server.listen(LOCAL) as listener:

            async def receive() -> tuple[np.ndarray, dict[str, np.ndarray]]:
                async with await listener.accept() as conn:
                    got = await conn.recv(out=out)
                    t = await conn.recv_tensors()
                    await conn.send_tensors(t)
                    return got, t

            receiving = asyncio.create_task(receive())
            async with await client.connect(listener.address) as conn:
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

        async def handler(conn: Any) -> None:
            g = await conn.recv()
            if g[0] < 0:
                raise RuntimeError("a handler that fails")
            await both_in.wait()  # only passes if the two good handlers run at once
            await conn.send(g + 1)

        async with await gs.serve(LOCAL, handler) as server:
            bad = await gs.connect(server.address)
            await bad.send(np.full(3, -1, np.float32))
            assert len(await bad.recv()) == 0  # the handler failed: its connection closed
            conns = [await gs.connect(server.address) for _ in range(2)]
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
    assert failed[0].levelno == logging.WARNING and failed[0].exc_info is not None


def test_serve_takes_a_plain_function_and_closes_the_connection_after_it() -> None:
    async def main() -> tuple[list[str], np.ndarray]:
        seen: list[str] = []

        def handler(conn: Any) -> None:  # not a coroutine function
            seen.append(conn.peer.address[0])

        async with await gs.serve(LOCAL, handler) as server:
            async with await gs.connect(server.address) as conn:
                end = await conn.recv()  # the handler returned: its side closed
                assert conn.closed
        return seen, end

    seen, end = run(main)
    assert seen == ["127.0.0.1"] and end.size == 0


def test_seed_protocol_speaks_bare_frames(pair: Pair) -> None:
    server, client = pair
    grad = np.arange(5000, dtype=np.float32)

    async def main() -> tuple[bytes, np.ndarray]:
        s = server.GradientStreamSession("s", 1024)
        async with await server.listen(LOCAL, protocol="seed", session=s) as listener:
            # What goes on the wire is encode_frames, and nothing else.
            reader, writer = await asyncio.open_connection(*listener.address)
            conn = await listener.accept()
            assert conn.peer.authenticated is False
            assert await conn.send(grad) == 5
            await conn.close()
            wire = await reader.read()
            writer.close()
            s = client.GradientStreamSession("s", 1024)
            async with await client.connect(listener.address, protocol="seed", session=s) as c:
                other = await listener.accept()
                await c.send(grad)
                got = await other.recv()
                await other.close()
            return wire, got

    wire, got = run(main)
    assert wire == server.GradientStreamSession("s", 1024).encode_frames(grad)
    assert same(got, grad)


def test_one_transfer_at_a_time() -> None:
    async def main() -> None:
        async with await gs.listen(LOCAL) as listener:
            _, accepted = await accept_in_background(listener)
            async with await gs.connect(listener.address) as conn:
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
        async with await gs.listen(LOCAL) as listener:
            conn = await gs.connect(listener.address)
            await conn.close()
            await conn.close()  # twice is fine
            with pytest.raises(StreamIOError, match="send on a closed connection") as info:
                await conn.send(np.ones(3, np.float32))
            assert info.value.errno == errno.ENOTCONN
            with pytest.raises(StreamIOError, match="recv_tensors on a closed connection"):
                await conn.recv_tensors()
            assert [g async for g in conn] == []

    run(main)


@pytest.mark.parametrize(
    ("keywords", "error", "match"),
    [
        ({"protocol": "seed", "authkey": KEY}, SettingError, "cannot carry authkey="),
        ({"protocol": "tcp"}, SettingError, "protocol must be 'gradstream' or 'seed'"),
        ({"authkey": b"short"}, SettingError, "authkey must hold at least 16 bytes"),
        ({"timeout": 0}, SettingError, "timeout must be None or a positive number"),
        ({"deadline": "1"}, TypeError, "deadline must be None or a number, not str"),
        ({"handshake_timeout": 0}, SettingError, "handshake_timeout must be a positive"),
        ({"session": object()}, TypeError, "session must be a gradstream.GradientStreamSession"),
    ],
)
def test_bad_keywords_are_refused_before_connecting(
    keywords: dict[str, Any], error: type[Exception], match: str
) -> None:
    async def main() -> None:
        with pytest.raises(error, match=match):
            await gs.connect("127.0.0.1:9", **keywords)
        with pytest.raises(error, match=match):
            await gs.listen(LOCAL, **keywords)

    run(main)


def test_listener_keywords_are_checked() -> None:
    async def main() -> None:
        with pytest.raises(SettingError, match="max_pending_handshakes must be at least 1"):
            await gs.listen(LOCAL, max_pending_handshakes=0)
        with pytest.raises(SettingError, match="handshake_timeout must be a positive number"):
            await gs.listen(LOCAL, handshake_timeout=-1)
        with pytest.raises(TypeError, match="handler must be callable"):
            await gs.serve(LOCAL, "handler")
        with pytest.raises(TypeError, match="unexpected keyword argument 'max_connections'"):
            await gs.connect("127.0.0.1:9", max_connections=3)

    run(main)


def test_accept_on_a_closed_listener() -> None:
    async def main() -> None:
        listener = await gs.listen(LOCAL)
        waiting = asyncio.create_task(listener.accept())
        await asyncio.sleep(0)
        await listener.close()
        with pytest.raises(StreamIOError, match=r"accept\(\) on a closed listener") as info:
            await waiting
        assert info.value.errno == errno.EBADF
        with pytest.raises(StreamIOError, match=r"accept\(\) on a closed listener"):
            await listener.accept()
        assert [c async for c in listener] == []

    run(main)


def test_a_connection_to_nobody_is_a_stream_io_error() -> None:
    async def main() -> None:
        listener = await gs.listen(LOCAL)
        address = listener.address
        await listener.close()
        with pytest.raises(StreamIOError) as info:
            await gs.connect(address)
        assert isinstance(info.value, ConnectionRefusedError) or info.value.errno == 111

    run(main)


def test_connections_not_yet_accepted_are_closed_with_the_listener(pair: Pair) -> None:
    server, client = pair

    async def main() -> np.ndarray | StreamIOError:
        listener = await server.listen(LOCAL)
        conn = await client.connect(listener.address)  # through its handshake, never accepted
        await listener.close()
        async with conn:
            try:
                # The listener closed its side: the end, or a reset when it closed in
                # the middle of its own half of the handshake (the client's hello unread).
                return await conn.recv()
            except StreamIOError as exc:
                return exc
            finally:
                assert conn.closed

    got = run(main)
    assert isinstance(got, StreamIOError) or got.size == 0, got


def test_a_silent_listener_is_cut_off_by_connects_handshake_timeout() -> None:
    # A TCP server that accepts and never says a word: connect gives up after
    # handshake_timeout, however long its session's timeout is.
    async def main() -> StreamTimeoutError:
        done = asyncio.Event()

        async def mute(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await done.wait()
            writer.close()

        server = await asyncio.start_server(mute, "127.0.0.1", 0)
        try:
            with pytest.raises(StreamTimeoutError) as info:
                await gs.connect(server.sockets[0].getsockname()[:2], handshake_timeout=0.3)
            return info.value
        finally:
            done.set()
            server.close()

    exc = run(main)
    assert exc.timeout == 0.3 and not isinstance(exc, StreamDeadlineError)


def test_a_calls_deadline_overrides_the_connections() -> None:
    # A listener without a deadline of its own but 300 s; recv(deadline=0.4) cuts a slow
    # drip off, and the connection is refused and closed.
    s = gs.GradientStreamSession("s", 1024)

    async def main() -> StreamDeadlineError:
        async with await gs.listen(LOCAL, session=s) as listener:
            async with raw_peer(listener.address) as streams:
                client, server = await hello_by_hand(streams, p.ROLE_CLIENT)
                wire = sealed_frames(np.arange(20_000, dtype=np.float32), client, server)
                conn = await listener.accept()

                async def drip() -> None:
                    for start in range(0, len(wire), 512):
                        streams[1].write(wire[start : start + 512])
                        await streams[1].drain()
                        await asyncio.sleep(0.01)

                dripping = asyncio.create_task(drip())
                with pytest.raises(StreamDeadlineError) as info:
                    await conn.recv(deadline=0.4)
                assert conn.closed
                dripping.cancel()
                await asyncio.gather(dripping, return_exceptions=True)
                return info.value

    assert run(main).deadline == 0.4


def test_progress_counts_a_calls_chunks(pair: Pair) -> None:
    # The native side's counters, sending or receiving (the test peer counts none).
    server, client = pair
    sent, received = gs.TransferProgress(), gs.TransferProgress()
    sending = {"progress": sent} if client is gs else {}
    receiving = {"progress": received} if server is gs else {}

    async def main() -> None:
        async with await server.listen(LOCAL) as listener:
            accepted = asyncio.create_task(listener.accept())
            s = client.GradientStreamSession("s", 1000)
            async with await client.connect(listener.address, session=s) as conn:
                theirs = await accepted
                arrived = asyncio.create_task(theirs.recv(**receiving))
                assert await conn.send(np.ones(3500, np.float32), **sending) == 4
                assert (await arrived).size == 3500
                await theirs.close()

    run(main)
    for counted, side in ((sent, client), (received, server)):
        if side is gs:
            assert (counted.chunks, counted.total_chunks) == (4, 4)


def test_each_transfer_is_logged_at_debug_with_its_wire_bytes(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # docs/guides/limits.md: one DEBUG line per transfer; the two ends count the same
    # wire bytes for the same transfer.
    server, client = gs, gs
    grad = np.arange(10_000, dtype=np.float32)
    tensors = {"w": np.ones((3, 4), np.float64)}

    async def main() -> None:
        async with await server.listen(LOCAL) as listener:
            task = asyncio.create_task(accept_and_receive(listener))
            async with await client.connect(listener.address) as conn:
                await conn.send(grad)
                await conn.send_tensors(tensors)
            await task

    async def accept_and_receive(listener: Any) -> None:
        async with await listener.accept() as conn:
            await conn.recv()
            await conn.recv_tensors()

    caplog.set_level(logging.DEBUG, logger="gradstream")
    run(main)
    pattern = re.compile(
        r"(sent|received) a (gradient|tensor set) \((\d+) bytes on the wire\) (to|from) "
        r"127\.0\.0\.1:\d+ in [0-9.]+ s \(([0-9.]+ MB/s|at once)\)"
    )
    lines = [m.groups()[:3] for r in caplog.records if (m := pattern.fullmatch(r.getMessage()))]
    wire = {(done, what): int(n) for done, what, n in lines}
    assert len(lines) == 4 and len(wire) == 4, lines
    for what in ("gradient", "tensor set"):
        assert wire["sent", what] == wire["received", what]
    # Every value's bytes, and the frames' headers and Arrow files around them.
    assert wire["sent", "gradient"] > grad.nbytes
    assert wire["sent", "tensor set"] > tensors["w"].nbytes
