"""Resume (docs/guides/across-the-internet.md, "Resume"; docs/spec/protocol.md,
"Resume"): a transfer cut by a reset of every stream (tests/support/wan.py's relay) goes on
once the dialler has dialled them again, from the chunks the receiver holds, bit for bit,
in either direction, on one stream or several, from asyncio and ``gradstream.sync``; the
same connection carries on. Hostile peers (support/streams_peer.py, written from the
spec): a resume proven with another secret, a resume of a transfer already taken (no
second delivery), a receiver that claims chunks it was never sent, a flood of resumes, a
dialler that never comes back."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest

import gradstream as gs
import gradstream.sync as gss
from gradstream.errors import SettingError
from support import streams_peer
from support.connections import KEY, LOCAL, run
from support.wan import Relay


def gradient(n: int, seed: int = 0) -> np.ndarray:
    """Raw float32 bit patterns (NaNs and infinities included): bits must come back."""
    words = np.random.default_rng(seed).integers(0, 2**32, n, dtype=np.uint32)
    return words.view(np.float32)


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and np.array_equal(a.view(np.uint32), b.view(np.uint32))


def session() -> gs.GradientStreamSession:
    return gs.GradientStreamSession("resume", chunk_size=10_000)


VALUES = 2_000_000  # 8 MB: 200 chunks
HALF = VALUES * 4 // 2


@pytest.mark.parametrize("streams", [1, 3])
@pytest.mark.parametrize("direction", ["to the listener", "to the dialler"])
def test_a_transfer_cut_by_a_reset_of_every_stream_resumes_bit_for_bit(
    streams: int, direction: str
) -> None:
    """Every stream reset at about half the gradient: the dialler dials them again, the
    transfer completes bit for bit, both sides count one resume, the sender sends again
    only chunks it had written that never arrived (fewer than all), and the same
    connection carries the next gradient both ways; the listener's accept sees no second
    connection."""
    grad, after = gradient(VALUES, 1), gradient(1234, 2)
    upward = direction == "to the listener"

    async def main() -> dict[str, Any]:
        async with await gs.listen(LOCAL, session=session(), authkey=KEY) as listener:
            with Relay(listener.address, rtt=0.01, window=1 << 20) as relay:

                async def serve() -> dict[str, Any]:
                    async with await listener.accept() as conn:
                        got = await conn.recv() if upward else await conn.send(grad)
                        resumed = conn.resumed
                        back = await conn.recv()
                        await conn.send(back)
                        again = asyncio.create_task(listener.accept())
                        done, _ = await asyncio.wait([again], timeout=0.3)
                        again.cancel()
                        return {"got": got, "resumed": resumed, "accepted": bool(done)}

                serving = asyncio.create_task(serve())
                async with await gs.connect(
                    relay.address, session=session(), authkey=KEY, streams=streams, resume=True
                ) as conn:
                    assert conn.resumes
                    if upward:
                        relay.reset_when(HALF)
                        await conn.send(grad)
                    else:
                        relay.reset_when(returned=HALF)
                        got = await conn.recv()
                    resumed = conn.resumed
                    await conn.send(after)
                    echoed = await conn.recv()
                served = await serving
                dialled = relay.connections
        return {
            "got": served["got"] if upward else got,
            "sender": served["resumed"] if not upward else resumed,
            "receiver": resumed if not upward else served["resumed"],
            "echoed": echoed,
            "accepted": served["accepted"],
            "dialled": dialled,
        }

    out = run(main)
    assert same_bits(out["got"], grad)
    assert same_bits(out["echoed"], after)
    assert out["sender"][0] == 1 and out["receiver"][0] == 1
    assert 0 < out["sender"][1] < VALUES // 10_000  # some in flight at the reset, not all
    assert out["receiver"][1] == 0  # the receiver sent nothing again
    assert out["dialled"] == 2 * streams  # each stream dialled once more
    assert not out["accepted"]


def test_the_blocking_face_resumes_a_transfer_into_out() -> None:
    """``gradstream.sync`` on both ends, the listener receiving into ``out=`` over two
    streams: every stream reset midway, the array filled bit for bit."""
    grad = gradient(VALUES, 3)
    out = np.empty_like(grad)
    with gss.listen(LOCAL, session=session(), authkey=KEY) as listener:
        with Relay(listener.address, rtt=0.01, window=1 << 20) as relay:
            with ThreadPoolExecutor(1) as pool:

                def serve() -> tuple[int, int]:
                    with listener.accept() as conn:
                        conn.recv(out=out)
                        return conn.resumed

                serving = pool.submit(serve)
                with gss.connect(relay.address, session=session(), authkey=KEY, streams=2) as conn:
                    relay.reset_when(HALF)
                    conn.send(grad)
                    sent = conn.resumed
                received = serving.result(timeout=60)
    assert same_bits(out, grad)
    assert sent[0] == 1 and received[0] == 1


def test_without_resume_a_reset_fails_the_transfer() -> None:
    """``resume=False`` on several streams: the reset is the transfer's failure, as
    before resumes existed (the control of the tests above)."""
    grad = gradient(VALUES, 4)

    async def main() -> BaseException | None:
        async with await gs.listen(LOCAL, session=session(), authkey=KEY) as listener:
            with Relay(listener.address, rtt=0.01, window=1 << 20) as relay:
                serving = asyncio.create_task(listener.accept())
                async with await gs.connect(
                    relay.address, session=session(), authkey=KEY, streams=2, resume=False
                ) as conn:
                    assert not conn.resumes
                    async with await serving as server:
                        receiving = asyncio.create_task(server.recv())
                        relay.reset_when(HALF)
                        try:
                            await conn.send(grad)
                        except gs.errors.GradientStreamError as exc:
                            with contextlib.suppress(gs.errors.GradientStreamError):
                                await receiving
                            return exc
        return None

    error = run(main)
    assert isinstance(error, gs.errors.GradientStreamError), error


@pytest.mark.parametrize(
    ("streams", "resume", "window", "expected"),
    [
        (1, None, 30.0, False),  # one stream speaks version 2 unless asked (older listeners)
        (2, None, 30.0, True),  # several streams resume by default
        (2, False, 30.0, False),
        (1, False, 30.0, False),
        (1, True, 30.0, True),
        (2, True, 0, False),  # a listener that grants no resumes
    ],
)
def test_who_resumes(streams: int, resume: bool | None, window: float, expected: bool) -> None:
    async def main() -> tuple[bool, bool]:
        async with await gs.listen(LOCAL, authkey=KEY, resume_window=window) as listener:
            serving = asyncio.create_task(listener.accept())
            async with await gs.connect(
                listener.address, authkey=KEY, streams=streams, resume=resume
            ) as conn:
                async with await serving as server:
                    return conn.resumes, server.resumes

    assert run(main) == (expected, expected)


@pytest.mark.parametrize("where", ["no secret", "unix", "seed", "authkey"])
def test_a_connection_of_one_stream_does_not_resume_unless_asked(where: str, tmp_path: Any) -> None:
    """No authkey or TLS, a unix: address, protocol='seed', and one stream under an
    authkey: resume=None is off, and the connection works as before (its hello is
    version 2, which a listener of gradstream 0.3.0 takes)."""

    async def main() -> tuple[bool, bool]:
        address: Any = LOCAL if where != "unix" else f"unix:{tmp_path}/s"
        keywords: dict[str, Any] = {"protocol": "seed"} if where == "seed" else {}
        if where in ("unix", "authkey"):
            keywords["authkey"] = KEY
        async with await gs.listen(address, **keywords) as listener:
            serving = asyncio.create_task(listener.accept())
            async with await gs.connect(listener.address, **keywords) as conn:
                async with await serving as server:
                    return conn.resumes, server.resumes

    assert run(main) == (False, False)


@pytest.mark.parametrize(
    ("address", "keywords", "problem"),
    [
        ("127.0.0.1:1", {}, "resume needs an authkey or TLS"),
        ("127.0.0.1:1", {"protocol": "seed"}, "protocol='seed' has no hello"),
        ("unix:/tmp/nowhere", {"authkey": KEY}, "a unix: connection has no network path"),
    ],
)
def test_what_cannot_resume_is_refused_before_dialling(
    address: str, keywords: dict[str, Any], problem: str
) -> None:
    with pytest.raises(SettingError) as raised:
        gss.connect(address, resume=True, **keywords)
    assert raised.value.setting == "resume"
    assert problem in str(raised.value)


@pytest.mark.parametrize("value", [-1, float("inf"), float("nan"), None, "5"])
def test_resume_window_is_a_positive_number_of_seconds(value: Any) -> None:
    with pytest.raises((SettingError, TypeError)):
        gss.connect("127.0.0.1:1", authkey=KEY, streams=2, resume_window=value)
    with pytest.raises((SettingError, TypeError)):
        gss.listen(LOCAL, authkey=KEY, resume_window=value)


@contextlib.asynccontextmanager
async def spec_client(
    resume_window: float = 10.0, streams: int = 1
) -> AsyncIterator[tuple[tuple[str, int], streams_peer.Stream, Any]]:
    """A listener (chunk size 1024) and support/streams_peer.py's client of ``streams``
    streams that asked to resume: the listener's address, the client's first stream,
    the connection the listener took."""
    own = gs.GradientStreamSession("s", chunk_size=1024)
    async with await gs.listen(
        LOCAL, authkey=KEY, session=own, resume_window=resume_window
    ) as listener:
        accepting = asyncio.create_task(listener.accept())
        first = await streams_peer.open_streams(listener.address, streams, resume=True)
        assert first.resumes
        async with await accepting as conn:
            yield listener.address, first, conn


def reset(writer: asyncio.StreamWriter) -> None:
    """Close with an RST (SO_LINGER 0), as a broken path would."""
    sock = writer.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


def test_a_resume_proven_with_another_secret_is_refused_and_changes_nothing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A resume tag made with a secret that is not the session's, and a resume from a
    peer of another authkey: the listener closes each without its proof (and logs why);
    the connection's stream is still its own, and the next gradient comes on it."""
    grad = gradient(5000, 5)

    async def main() -> np.ndarray:
        async with spec_client() as (address, first, conn):
            with pytest.raises(asyncio.IncompleteReadError):
                await streams_peer.resume(address, first, 0, secret=bytes(32))
            # A peer of another authkey, naming the session: refused at its handshake.
            with pytest.raises((asyncio.IncompleteReadError, ConnectionError)):
                await streams_peer.resume(address, first, 0, key=b"another authkey")
            for frame in streams_peer.frames_of(grad, first):
                first.writer.write(frame)
            got: np.ndarray = await conn.recv()
            return got

    with caplog.at_level("WARNING", logger="gradstream"):
        got = run(main)
    assert same_bits(got, grad)
    refusals = [r.getMessage() for r in caplog.records if " refused " in r.getMessage()]
    assert any("does not match its session" in line for line in refusals), refusals
    assert any("another authkey" in line for line in refusals), refusals


def test_a_resume_after_a_transfer_was_taken_delivers_it_once() -> None:
    """The client sends a gradient whole, the listener's caller takes it; the client
    then dials its stream again as if the ack had been lost: the listener's resume
    message says it took 1 transfer, with that transfer's digest (the sender's proof of
    delivery), and the same frames sent again are refused (their seal is the first
    transfer's, the listener waits for the second): delivered once."""
    grad = gradient(5000, 6)

    async def main() -> tuple[np.ndarray, tuple[int, bytes, Any], bytes, BaseException]:
        async with spec_client() as (address, first, conn):
            frames = streams_peer.frames_of(grad, first)
            for frame in frames:
                first.writer.write(frame)
            got: np.ndarray = await conn.recv()
            await first.reader.readexactly(56)  # its ack, which the client "lost"
            receiving = asyncio.create_task(conn.recv())
            await asyncio.sleep(0.1)
            again = await streams_peer.resume(address, first, 0)
            again.writer.write(streams_peer.resume_message(0, bytes(32), []))
            theirs = await streams_peer.read_resume_message(again.reader)
            for frame in frames:
                again.writer.write(frame)
            try:
                await receiving
            except gs.errors.GradientStreamError as exc:
                return got, theirs, streams_peer.digest_of(first, frames), exc
            raise AssertionError("the same transfer was delivered twice")

    got, theirs, digest, error = run(main)
    assert same_bits(got, grad)
    assert theirs == (1, digest, [])
    assert "seal" in str(error) or "transfer" in str(error), error


@pytest.mark.parametrize("streams", [1, 2])
def test_a_receiver_that_claims_chunks_it_was_never_sent_is_refused(streams: int) -> None:
    """The listener sends a gradient the client does not read (the sockets' buffers take
    a part of it); the client dials its streams again and claims to hold every chunk: the
    listener wrote only some, so its send fails with a ProtocolError, and the connection
    closes."""
    grad = gradient(4_000_000, 7)
    total = 4_000_000 // 1024 + 1

    async def main() -> BaseException | None:
        async with spec_client(streams=streams) as (address, first, conn):
            sending = asyncio.create_task(conn.send(grad))
            await asyncio.sleep(0.3)
            again = await streams_peer.resume(address, first, 0)
            lanes = [await streams_peer.resume(address, first, i) for i in range(1, streams)]
            again.writer.write(streams_peer.resume_message(0, bytes(32), [(0, total)]))
            await streams_peer.read_resume_message(again.reader)
            try:
                await sending
            except gs.errors.GradientStreamError as exc:
                assert conn.closed
                return exc
            finally:
                for lane in lanes:  # open until the end: a lane that ended is a failure
                    lane.writer.close()
            return None

    error = run(main)
    assert isinstance(error, gs.errors.ProtocolError), error
    assert "this side wrote" in str(error)


def test_a_flood_of_resumes_is_refused_past_what_its_connection_can_take(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A holder of the session's secret dials its one stream again and again while the
    listener's side is between transfers: three are proven and queued (three rounds of
    its streams), the rest are refused before their proof; each refused one is closed."""

    async def main() -> tuple[int, int]:
        async with spec_client() as (address, first, _conn):
            proven, refused, kept = 0, 0, []
            for _ in range(6):
                try:
                    kept.append(await streams_peer.resume(address, first, 0))
                    proven += 1
                except asyncio.IncompleteReadError:
                    refused += 1
            return proven, refused

    with caplog.at_level("WARNING", logger="gradstream"):
        proven, refused = run(main)
    assert (proven, refused) == (3, 3)
    refusals = [r.getMessage() for r in caplog.records if " refused " in r.getMessage()]
    assert sum("too many streams of its session" in line for line in refusals) == 3, refusals


def test_a_dialler_that_never_comes_back_fails_the_transfer_after_the_window() -> None:
    """Half a gradient, then the client's stream reset and no resume: the listener's
    receive waits its resume window (0.5 s here), then fails naming it; the connection
    closes."""
    grad = gradient(20_000, 8)

    async def main() -> tuple[BaseException | None, float, bool]:
        async with spec_client(resume_window=0.5) as (_address, first, conn):
            frames = streams_peer.frames_of(grad, first)
            receiving = asyncio.create_task(conn.recv())
            for frame in frames[: len(frames) // 2]:
                first.writer.write(frame)
            await first.writer.drain()
            await asyncio.sleep(0.1)
            began = time.monotonic()
            reset(first.writer)
            try:
                await receiving
            except gs.errors.GradientStreamError as exc:
                return exc, time.monotonic() - began, conn.closed
            return None, 0.0, conn.closed

    error, waited, closed = run(main)
    assert isinstance(error, gs.errors.StreamIOError), error
    assert "did not resume within its resume window" in str(error)
    assert 0.4 <= waited < 5.0
    assert closed


def test_a_resume_before_a_receives_first_byte_leaves_a_later_timeout_harmless() -> None:
    """The dialler's gradient is taken, then every stream is reset as its ack comes
    back: the dialler resumes, and the listener's next receive, which mends the streams
    before its first byte, learns the sender took the ack (send succeeds). When that
    receive then runs out of ``timeout`` with no byte of a transfer, the connection stays
    open, as any receive out of time before its first byte leaves it."""
    grad = gradient(200_000, 9)

    async def main() -> tuple[tuple[int, int], BaseException | None, bool, np.ndarray]:
        async with await gs.listen(LOCAL, session=session(), authkey=KEY, timeout=1.0) as listener:
            with Relay(listener.address, rtt=0.01, window=1 << 20) as relay:
                serving = asyncio.create_task(listener.accept())
                async with await gs.connect(
                    relay.address, session=session(), authkey=KEY, streams=4
                ) as conn:
                    async with await serving as server:

                        async def receive_twice() -> tuple[np.ndarray, BaseException | None]:
                            got = await server.recv()
                            try:
                                await server.recv()
                            except gs.errors.GradientStreamError as exc:
                                return got, exc
                            return got, None

                        receiving = asyncio.create_task(receive_twice())
                        await asyncio.sleep(0.2)
                        relay.reset_when(returned=relay.returned + 1)  # the ack's first byte
                        await conn.send(grad)  # mended through the next receive
                        resumed = conn.resumed
                        got, error = await receiving
                        return resumed, error, server.closed, got

    # The listener's first receive returns before the reset; its second mends the
    # streams (the sender's resume), then waits for a transfer that never comes.
    resumed, error, closed, got = run(main)
    assert same_bits(got, grad)
    assert resumed[0] == 1
    assert isinstance(error, gs.errors.StreamTimeoutError), error
    assert not closed


def test_an_ack_that_came_on_the_first_stream_is_taken_after_a_stall() -> None:
    """The path stalls past the dialler's timeout while the ack is on its way: the
    dialler, about to resume, reads the ack that did come on the first stream and
    returns; it does not wait on a listener that has moved on (and closed)."""
    grad = np.ones(100_000, np.float32)

    async def main() -> tuple[int, tuple[int, int]]:
        async with await gs.listen(LOCAL, session=session(), authkey=KEY) as listener:
            with Relay(listener.address, rtt=0.01, window=16 << 20) as relay:

                async def serve() -> None:
                    async with await listener.accept() as conn:
                        await conn.recv()
                        await asyncio.sleep(0.3)

                serving = asyncio.create_task(serve())
                async with await gs.connect(
                    relay.address, session=session(), authkey=KEY, streams=4, timeout=1.0
                ) as conn:
                    await asyncio.sleep(0.2)
                    relay.stall(1.3)
                    chunks: int = await conn.send(grad)
                    resumed = conn.resumed
                await serving
        return chunks, resumed

    chunks, resumed = run(main)
    assert chunks == 10
    assert resumed == (0, 0)


def test_a_listener_that_is_gone_fails_the_resume_at_once() -> None:
    """Every stream reset and the listener's port closed (its process went): a dial
    refused is final, so the send fails in a moment, not after the 30 s window."""
    grad = gradient(VALUES, 10)

    async def main() -> tuple[BaseException | None, float]:
        stack = contextlib.ExitStack()
        with stack:
            return await vanishing(stack)

    async def vanishing(stack: contextlib.ExitStack) -> tuple[BaseException | None, float]:
        async with await gs.listen(
            LOCAL, session=session(), authkey=KEY, resume_window=1
        ) as listener:
            relay = stack.enter_context(Relay(listener.address, rtt=0.05, window=1 << 20))
            serving = asyncio.create_task(listener.accept())
            async with await gs.connect(
                relay.address, session=session(), authkey=KEY, streams=3
            ) as conn:
                async with await serving as server:
                    receiving = asyncio.create_task(server.recv())
                    sending = asyncio.create_task(conn.send(grad))
                    await asyncio.sleep(0.05)
                    began = time.monotonic()
                    relay.vanish()  # refuses new connections, resets the open ones
                    try:
                        await sending
                        return None, 0.0
                    except gs.errors.GradientStreamError as exc:
                        with contextlib.suppress(gs.errors.GradientStreamError):
                            await receiving  # its resume window (1 s) ends it
                        return exc, time.monotonic() - began

    error, waited = run(main)
    assert isinstance(error, gs.errors.DeliveryError), error
    assert "did not resume" in str(error) and "refused" in str(error).lower(), error
    assert waited < 5.0


@pytest.mark.parametrize("streams", [1, 2])
def test_a_listener_with_every_slot_taken_still_takes_its_connections_resumes(
    streams: int,
) -> None:
    """``max_connections`` equal to the connection's streams: every slot is taken when
    the dialler dials them again, yet each resumed stream takes the slot of the one it
    replaces, and the transfer completes."""
    grad = gradient(VALUES, 11)

    async def main() -> tuple[np.ndarray, tuple[int, int]]:
        async with await gs.listen(
            LOCAL, session=session(), authkey=KEY, max_connections=streams
        ) as listener:
            with Relay(listener.address, rtt=0.01, window=1 << 20) as relay:
                serving = asyncio.create_task(listener.accept())
                async with await gs.connect(
                    relay.address, session=session(), authkey=KEY, streams=streams, resume=True
                ) as conn:
                    assert conn.streams == streams
                    async with await serving as server:
                        receiving = asyncio.create_task(server.recv())
                        relay.reset_when(HALF)
                        await conn.send(grad)
                        return await receiving, conn.resumed

    got, resumed = run(main)
    assert same_bits(got, grad)
    assert resumed[0] == 1


@pytest.mark.parametrize("direction", ["to the listener", "to the dialler"])
def test_a_second_reset_while_the_streams_come_back_is_one_more_round(direction: str) -> None:
    """Every stream reset, then reset again 60 ms later, while they are dialled again or
    their states exchanged: the resume goes round again (at most 16 times in all), and
    the gradient arrives bit for bit."""
    grad = gradient(4_000_000, 12)
    upward = direction == "to the listener"

    async def main() -> tuple[np.ndarray, tuple[int, int], tuple[int, int]]:
        async with await gs.listen(LOCAL, session=session(), authkey=KEY) as listener:
            with Relay(listener.address, rtt=0.02, window=1 << 18) as relay:
                serving = asyncio.create_task(listener.accept())
                async with await gs.connect(
                    relay.address, session=session(), authkey=KEY, streams=3
                ) as conn:
                    async with await serving as server:
                        sender, receiver = (conn, server) if upward else (server, conn)
                        receiving = asyncio.create_task(receiver.recv())
                        sending = asyncio.create_task(sender.send(grad))
                        await asyncio.sleep(0.15)
                        relay.reset()
                        await asyncio.sleep(0.06)
                        relay.reset()
                        await sending
                        return await receiving, sender.resumed, receiver.resumed

    got, sent, received = run(main)
    assert same_bits(got, grad)
    assert sent[0] >= 1 and received[0] >= 1
    assert max(sent[0], received[0]) <= 16


@pytest.mark.parametrize("streams", [1, 3])
@pytest.mark.parametrize("at", [1, HALF])
def test_a_resumed_send_counts_its_chunks_once_in_its_progress(streams: int, at: int) -> None:
    """Every stream reset once the first byte (before the receiver holds a chunk), or
    half the gradient, went: the sender's progress still says the gradient's chunk count
    once (not once a pass), and at least that many chunks went."""
    grad = gradient(VALUES, 13)
    total = VALUES // 10_000

    async def main() -> tuple[int, int, tuple[int, int]]:
        async with await gs.listen(LOCAL, session=session(), authkey=KEY) as listener:
            with Relay(listener.address, rtt=0.01, window=1 << 20) as relay:
                serving = asyncio.create_task(listener.accept())
                async with await gs.connect(
                    relay.address, session=session(), authkey=KEY, streams=streams, resume=True
                ) as conn:
                    async with await serving as server:
                        receiving = asyncio.create_task(server.recv())
                        progress = gs.TransferProgress()
                        relay.reset_when(relay.forwarded + at)
                        await conn.send(grad, progress=progress)
                        assert same_bits(await receiving, grad)
                        return progress.total_chunks, progress.chunks, conn.resumed

    total_chunks, chunks, resumed = run(main)
    assert resumed[0] >= 1
    assert total_chunks == total
    assert chunks >= total


@pytest.mark.parametrize("keywords", [{"resume": True}, {"streams": 2}])
def test_a_listener_that_speaks_version_2_only_is_named_as_a_possible_cause(
    keywords: dict[str, Any],
) -> None:
    """The tests' own protocol peer speaks version 2 alone, as a listener of gradstream
    0.3.0 does: it closes on a version 3 hello, which a client cannot tell from a refused
    authkey; the error names both, and how to reach such a listener. A client of one
    stream that does not resume still reaches it."""
    from support import peer

    async def main() -> tuple[BaseException, bool]:
        async with await peer.listen(LOCAL, authkey=KEY) as listener:
            accepting = asyncio.create_task(listener.accept())
            with pytest.raises(gs.errors.AuthenticationError) as refused:
                await gs.connect(listener.address, authkey=KEY, **keywords)
            conn = await gs.connect(listener.address, authkey=KEY)
            resumes = conn.resumes
            await conn.close()
            await (await accepting).close()
            return refused.value, resumes

    error, resumes = run(main)
    assert "its hello of version 3" in str(error), error
    assert "connect with streams=1 and resume=False" in str(error), error
    assert not resumes


@pytest.mark.parametrize(("asks", "index"), [(True, 5), (False, 0)])
def test_a_resume_past_the_grant_or_of_a_session_that_does_not_resume_is_refused(
    asks: bool, index: int, caplog: pytest.LogCaptureFixture
) -> None:
    """A resume proven with the session's secret, of a stream the session was never
    granted, or of a session whose client did not ask to resume: the listener closes
    without its proof, and logs why; the connection goes on."""
    grad = gradient(3000, 14)

    async def main() -> np.ndarray:
        own = gs.GradientStreamSession("s", chunk_size=1024)
        async with await gs.listen(LOCAL, authkey=KEY, session=own) as listener:
            accepting = asyncio.create_task(listener.accept())
            first = await streams_peer.open_streams(listener.address, 2, resume=asks)
            async with await accepting as conn:
                with pytest.raises(asyncio.IncompleteReadError):
                    await streams_peer.resume(listener.address, first, index)
                for frame in streams_peer.frames_of(grad, first):
                    first.writer.write(frame)
                got: np.ndarray = await conn.recv()
                return got

    with caplog.at_level("WARNING", logger="gradstream"):
        got = run(main)
    assert same_bits(got, grad)
    refusals = [r.getMessage() for r in caplog.records if " refused " in r.getMessage()]
    why = f"a resume of stream {index} of a session granted 2 streams"
    why += "" if asks else " and no resume"
    assert any(why in line for line in refusals), refusals
