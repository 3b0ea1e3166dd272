"""Parallel streams (docs/guides/across-the-internet.md, "Parallel streams"): one connection
over several TCP (or TLS) connections, its gradients' chunks spread over them and put
back together bit for bit, from asyncio and from ``gradstream.sync``, under an authkey
or TLS; the listener grants at most ``max_streams``; what cannot have several streams
(no secret, unix:, the seed protocol) is refused before anything is dialled. The relay
of tests/support/wan.py shows each stream is a flow of its own."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest

import gradstream as gs
import gradstream.sync as gss
from gradstream.errors import SettingError
from support import streams_peer
from support.certs import Certificates
from support.connections import KEY, LOCAL, raw_peer, read_to_end, run
from support.peer import messages as p
from support.wan import Relay


def gradient(n: int, seed: int = 0) -> np.ndarray:
    """Raw float32 bit patterns (NaNs and infinities included): bits must come back."""
    words = np.random.default_rng(seed).integers(0, 2**32, n, dtype=np.uint32)
    return words.view(np.float32)


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and np.array_equal(a.view(np.uint32), b.view(np.uint32))


def session(chunk_size: int = 1000) -> gs.GradientStreamSession:
    return gs.GradientStreamSession("streams", chunk_size=chunk_size)


async def exchange(
    listen: dict[str, Any], connect: dict[str, Any], sizes: list[int]
) -> tuple[int, int, list[np.ndarray], list[np.ndarray]]:
    """Each size's gradient from the dialler to the listener and back (the listener sends
    what it got): (streams as each side sees them, what each side received)."""
    async with await gs.listen(LOCAL, session=session(), **listen) as listener:

        async def serve() -> tuple[int, list[np.ndarray]]:
            got = []
            async with await listener.accept() as conn:
                for _ in sizes:
                    g = await conn.recv()
                    got.append(g)
                    await conn.send(g)
                return conn.streams, got

        serving = asyncio.create_task(serve())
        back = []
        async with await gs.connect(listener.address, session=session(), **connect) as conn:
            for i, n in enumerate(sizes):
                await conn.send(gradient(n, i))
                back.append(await conn.recv())
            streams = conn.streams
        listener_streams, got = await serving
    return streams, listener_streams, got, back


SIZES = [100_003, 1, 0, 4_500]  # many chunks, one (three streams idle), an empty one


def test_gradients_cross_four_streams_each_way_bit_for_bit() -> None:
    streams, theirs, got, back = run(
        lambda: exchange({"authkey": KEY}, {"authkey": KEY, "streams": 4}, SIZES)
    )
    assert (streams, theirs) == (4, 4)
    for i, n in enumerate(SIZES):
        assert same_bits(got[i], gradient(n, i)), n
        assert same_bits(back[i], gradient(n, i)), n


def test_streams_under_tls_alone(certs: Certificates) -> None:
    streams, _, got, back = run(
        lambda: exchange({"tls": certs.server}, {"tls": certs.client, "streams": 3}, SIZES[:1])
    )
    assert streams == 3
    assert same_bits(got[0], gradient(SIZES[0])) and same_bits(back[0], gradient(SIZES[0]))


@pytest.mark.parametrize(
    ("cap", "asked"),
    [
        ({"max_streams": 2}, 8),
        # Slots are held at the grant, so a join proven to its client always has one:
        # with max_connections=2, 4 streams asked are 2 granted, and they work.
        ({"max_connections": 2}, 4),
    ],
)
def test_the_listener_grants_no_more_than_max_streams_or_its_free_slots(
    cap: dict[str, int], asked: int
) -> None:
    streams, theirs, got, _ = run(
        lambda: exchange({"authkey": KEY, **cap}, {"authkey": KEY, "streams": asked}, [10_000])
    )
    assert (streams, theirs) == (2, 2)
    assert same_bits(got[0], gradient(10_000))


def test_the_blocking_face_and_out_and_tensor_sets_on_several_streams() -> None:
    grad = gradient(50_000, 7)
    tensors = {"w": gradient(3_000, 8).reshape(60, 50), "b": gradient(50, 9)}
    with gss.listen(LOCAL, authkey=KEY, session=session(700)) as listener:

        def serve() -> tuple[int, np.ndarray, dict[str, np.ndarray]]:
            with listener.accept() as server:
                out = np.empty(50_000, np.float32)
                assert server.recv(out=out) is out
                got = server.recv_tensors()
                server.send(grad)
                return server.streams, out, got

        with ThreadPoolExecutor(1) as pool:
            serving = pool.submit(serve)
            with gss.connect(listener.address, authkey=KEY, streams=5, session=session(700)) as c:
                c.send(grad)
                c.send_tensors(tensors)
                total = np.ones(50_000, np.float32)
                c.recv(reduce_into=total)
                streams = c.streams
            theirs, out, got = serving.result(timeout=60)
    assert (streams, theirs) == (5, 5)
    assert same_bits(out, grad)
    assert list(got) == ["w", "b"] and all(same_bits(got[k], tensors[k]) for k in tensors)
    with np.errstate(invalid="ignore", over="ignore"):
        assert same_bits(total, np.float32(1) + grad)


def test_each_stream_is_a_flow_of_its_own_through_the_relay() -> None:
    grad = gradient(200_000, 3)
    with gss.listen(LOCAL, authkey=KEY, session=session()) as listener:
        with Relay(listener.address, rtt=0.01, window=1 << 20) as relay:
            with ThreadPoolExecutor(1) as pool:

                def serve() -> np.ndarray:
                    with listener.accept() as server:
                        return server.recv()

                serving = pool.submit(serve)
                with gss.connect(relay.address, authkey=KEY, streams=4, session=session()) as c:
                    c.send(grad)
                assert same_bits(serving.result(timeout=60), grad)
            assert relay.connections == 4


@pytest.mark.parametrize(
    ("address", "keywords", "words"),
    [
        (LOCAL, {}, "several streams need an authkey or TLS"),
        (LOCAL, {"protocol": "seed"}, "protocol='seed' has no hello"),
        ("unix:/tmp/gradstream-none.sock", {"authkey": KEY}, "a unix: connection has one"),
    ],
)
def test_what_cannot_have_several_streams_is_refused_before_dialling(
    address: Any, keywords: dict[str, Any], words: str
) -> None:
    with pytest.raises(SettingError, match=words) as info:
        gss.connect(address, streams=2, **keywords)
    assert info.value.setting == "streams"


@pytest.mark.parametrize("value", [0, 256, -1])
def test_streams_is_a_count_from_1_to_255(value: int) -> None:
    with pytest.raises(SettingError, match="streams"):
        gss.connect(LOCAL, authkey=KEY, streams=value)
    with pytest.raises(SettingError, match="max_streams"):
        gss.listen(LOCAL, authkey=KEY, max_streams=value)


def test_a_listener_without_a_secret_refuses_an_opening_of_several_streams() -> None:
    """A client with an authkey cannot reach a keyless listener anyway; a hostile one
    that sends a version 3 opening hello without a key is refused at the listener."""

    async def main() -> bytes:
        async with await gs.listen(LOCAL) as listener:
            async with raw_peer(listener.address) as (reader, writer):
                hello = bytearray(p.encode_hello(p.Hello(1, 0, bytes(range(32)), 10, 10)))
                hello[12], hello[18], hello[19] = 3, 1, 4  # version 3: open 4 streams
                writer.write(bytes(hello))
                return await read_to_end(reader)

    answer = run(main)
    # Its hello (80 bytes), and no grant: the listener closed.
    assert len(answer) == 80 and b"GSST" not in answer


def test_a_first_receive_given_up_while_joins_arrive_loses_no_stream() -> None:
    """The listener's side waits for the joins before the first gradient; a receive
    cancelled meanwhile (here while the relay delays them) keeps what came: the next
    receive has every stream."""
    grad = gradient(100_000, 5)

    async def main() -> tuple[int, bool, np.ndarray]:
        async with await gs.listen(LOCAL, authkey=KEY) as listener:
            with Relay(listener.address, rtt=0.1, window=1 << 20) as relay:

                async def serve() -> tuple[int, bool, np.ndarray]:
                    async with await listener.accept() as conn:
                        with pytest.raises(TimeoutError):
                            await asyncio.wait_for(conn.recv(), 0.05)
                        closed = conn.closed
                        return conn.streams, closed, await conn.recv()

                serving = asyncio.create_task(serve())
                async with await gs.connect(relay.address, authkey=KEY, streams=4) as conn:
                    await conn.send(grad)
                return await serving

    streams, closed, got = run(main)
    assert (streams, closed) == (4, False)
    assert same_bits(got, grad)


def test_a_refusal_reaches_a_sender_writing_on_every_stream() -> None:
    """A receiver refusing a striped gradient (out= too small) reads and drops what comes
    on every stream, so the sender, blocked on any of them, reaches the refusal while
    the receiver still holds the connection open."""

    async def main() -> str:
        async with await gs.listen(LOCAL, authkey=KEY) as listener:
            sent = asyncio.get_running_loop().create_future()

            async def serve() -> None:
                async with await listener.accept() as conn:
                    with pytest.raises(gs.errors.GradientSizeError):
                        await conn.recv(out=np.empty(1000, np.float32))
                    await sent  # open until the sender has its answer

            serving = asyncio.create_task(serve())
            async with await gs.connect(listener.address, authkey=KEY, streams=4) as conn:
                with pytest.raises(gs.errors.DeliveryError) as info:
                    await conn.send(gradient(4_000_000))
                sent.set_result(None)
            await serving
            return str(info.value)

    assert "the peer refused it" in run(main)


def test_a_striped_send_given_up_midway_closes_the_connection() -> None:
    """Its streams were lent to tasks of their own; cancelled midway, those stop, their
    streams close, and the connection, out of step, is closed (as on one stream); the
    receiver is told its gradient was cut."""
    grad = gradient(4_000_000, 11)

    async def main() -> tuple[bool, BaseException | None]:
        async with await gs.listen(LOCAL, authkey=KEY) as listener:
            with Relay(listener.address, rtt=0.02, window=256 << 10) as relay:

                async def serve() -> BaseException | None:
                    async with await listener.accept() as conn:
                        try:
                            await conn.recv()
                        except gs.errors.GradientStreamError as exc:
                            return exc
                        return None

                serving = asyncio.create_task(serve())
                async with await gs.connect(relay.address, authkey=KEY, streams=4) as conn:
                    with pytest.raises(TimeoutError):
                        await asyncio.wait_for(conn.send(grad), 0.3)
                    closed = conn.closed
                return closed, await serving

    closed, refused = run(main)
    assert closed
    assert isinstance(refused, gs.errors.GradientStreamError), refused


def test_a_striped_receive_given_up_before_its_first_byte_leaves_the_connection_open() -> None:
    """Cancelled (or out of time) before a byte came, a receive leaves every stream the
    connection's, as on one stream: the next receive gets the next gradient."""
    first, second = gradient(50_000, 1), gradient(70_000, 2)

    async def main() -> tuple[bool, np.ndarray, np.ndarray]:
        async with await gs.listen(LOCAL, authkey=KEY) as listener:
            go_on = asyncio.Event()

            async def serve() -> tuple[bool, np.ndarray, np.ndarray]:
                async with await listener.accept() as conn:
                    a = await conn.recv()
                    with pytest.raises(TimeoutError):
                        await asyncio.wait_for(conn.recv(), 0.1)
                    closed = conn.closed
                    go_on.set()
                    return closed, a, await conn.recv()

            serving = asyncio.create_task(serve())
            async with await gs.connect(listener.address, authkey=KEY, streams=4) as conn:
                await conn.send(first)
                await go_on.wait()
                await conn.send(second)
            return await serving

    closed, a, b = run(main)
    assert not closed
    assert same_bits(a, first) and same_bits(b, second)


def test_the_timeout_bounds_each_wait_for_bytes_not_each_frame() -> None:
    """Through a narrow path a 4 MB frame takes seconds on each stream, its bytes coming
    every round trip: the receiver's timeout of 1 s is never reached while they come."""
    grad = gradient(2_000_000, 4)
    big = gs.GradientStreamSession("big", chunk_size=1_000_000)
    with gss.listen(LOCAL, authkey=KEY, timeout=1.0) as listener:
        with Relay(listener.address, rtt=0.05, window=128 << 10) as relay:
            with ThreadPoolExecutor(1) as pool:

                def serve() -> np.ndarray:
                    with listener.accept() as server:
                        return server.recv(deadline=60)

                serving = pool.submit(serve)
                with gss.connect(relay.address, authkey=KEY, streams=2, session=big) as conn:
                    conn.send(grad)
                got = serving.result(timeout=60)
    assert same_bits(got, grad)


@contextlib.asynccontextmanager
async def spec_client(streams: int) -> AsyncIterator[tuple[streams_peer.Stream, Any]]:
    """A listener (chunk size 1024) and support/streams_peer.py's client of ``streams``
    streams, joined: the client's first stream, and the connection the listener took."""
    own = gs.GradientStreamSession("s", chunk_size=1024)
    async with await gs.listen(LOCAL, authkey=KEY, session=own) as listener:
        accepting = asyncio.create_task(listener.accept())
        first = await streams_peer.open_streams(listener.address, streams)
        async with await accepting as conn:
            yield first, conn


def test_a_client_written_from_the_spec_stripes_a_gradient_the_listener_takes() -> None:
    """support/streams_peer.py (Python alone, from the spec's text): opens 3 streams,
    proves each join and checks the listener's proofs, deals its frames over the
    streams by hand; the listener gets the gradient bit for bit and acknowledges it on
    the first stream."""
    grad = gradient(5000, 13)

    async def main() -> tuple[int, np.ndarray, bytes, bytes]:
        async with spec_client(3) as (first, conn):
            frames = streams_peer.frames_of(grad, first)
            lanes = [first, *first.joins]
            for k, frame in enumerate(reversed(frames)):  # the last chunk first
                lanes[k % len(lanes)].writer.write(frame)
            got = await conn.recv()
            ack = await first.reader.readexactly(56)
            transfer = p.transfer_id(*first.nonces, p.TO_SERVER, 0)
            headers = b"".join(frame[:16] for frame in frames)  # index order
            digest = hashlib.sha256(b"gradstream/1 digest" + transfer + headers).digest()
            return conn.streams, got, ack, digest

    streams, got, ack, digest = run(main)
    assert streams == 3 and same_bits(got, grad)
    assert ack[:4] == b"GSAK" and ack[12] == 0  # accepted
    assert ack[24:56] == digest  # over the headers in index order, not as they came


def test_a_transfer_whose_first_stream_ends_midway_fails_and_is_no_clean_close() -> None:
    """Frames of a transfer on the second stream, then the first stream's end: a cut
    transfer (an error), not the peer's close between transfers (an empty gradient)."""
    grad = gradient(5000, 14)

    async def main() -> BaseException | np.ndarray:
        async with spec_client(2) as (first, conn):
            frames = streams_peer.frames_of(grad, first)
            first.joins[0].writer.write(frames[0] + frames[1] + frames[2][:30])
            await first.joins[0].writer.drain()
            await asyncio.sleep(0.2)
            first.writer.close()
            await asyncio.sleep(0.2)
            try:
                return await conn.recv()
            except gs.errors.GradientStreamError as exc:
                return exc

    got = run(main)
    assert isinstance(got, gs.errors.StreamIOError), got
    assert "stream 1 of the connection's 2 ended before the transfer's last frame" in str(got)


@pytest.mark.parametrize("index", [1, 2, 200])
def test_a_join_of_a_stream_taken_or_outside_the_grant_is_refused(
    index: int, caplog: pytest.LogCaptureFixture
) -> None:
    """Each stream joins once, and only within the grant (2 streams: index 1 is taken,
    2 and 200 are past it): the listener closes without its proof, and logs why."""

    async def main() -> None:
        async with spec_client(2) as (first, conn):
            with pytest.raises(asyncio.IncompleteReadError):
                await streams_peer.join(conn_listener_address(first), first, index)
            assert conn.streams == 2

    with caplog.at_level("WARNING", logger="gradstream"):
        run(main)
    refusals = [r.getMessage() for r in caplog.records if " refused " in r.getMessage()]
    assert any(
        f"a join as stream {index} of a session granted 2 streams" in line for line in refusals
    ), refusals


def conn_listener_address(first: streams_peer.Stream) -> tuple[str, int]:
    """Where ``first`` connected: the listener's address."""
    host, port = first.writer.get_extra_info("peername")[:2]
    return host, port
