"""asyncio streams over real ``start_server``/``open_connection`` pairs: on the default
loop's plain TCP and Unix sockets the native session hands the socket to its socket path
(``gradstream._handover``); TLS and uvloop keep the generic path. Either way the bytes a
caller's own protocol writes around a gradient arrive intact and in order, whatever the
StreamReader had already buffered, and both paths give the same results and errors.

``handed_over`` (a counter in the module) shows which path ran; no test times anything.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("gradstream._native", reason="native extension not built")

import gradstream as gs
import gradstream.reference as ref
from gradstream import _handover, _native
from gradstream.errors import (
    FrameError,
    GradientStreamError,
    IncompleteStreamError,
    StreamTimeoutError,
)
from support.aio import run
from support.certs import Certificates
from support.streams import assert_bit_equal, gradient

CHUNK = 1000  # small chunks: many frames in little data
MODES = ["handover", "generic"]
Streams = tuple[asyncio.StreamReader, asyncio.StreamWriter]


@pytest.fixture(params=MODES)
def mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """ "handover": as shipped; "generic": the handover refused, as for a TLS stream."""
    if request.param == "generic":
        monkeypatch.setattr(_handover, "lend_reader", lambda reader: None)
        monkeypatch.setattr(_handover, "socket_to_write", lambda writer: None)
    return str(request.param)


@contextlib.asynccontextmanager
async def tcp_streams(
    family: str = "tcp", limit: int = 2**16, **ssl_args: Any
) -> AsyncIterator[tuple[Streams, Streams]]:
    """A connected ((client reader, writer), (server reader, writer)) over loopback TCP
    or a Unix socket, through start_server and open_connection; closed after."""
    accepted: asyncio.Queue[Streams] = asyncio.Queue()

    async def on_client(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await accepted.put((r, w))

    server_ssl, client_ssl = ssl_args.get("server"), ssl_args.get("client")
    if family == "tcp":
        server = await asyncio.start_server(on_client, "127.0.0.1", 0, limit=limit, ssl=server_ssl)
        port = server.sockets[0].getsockname()[1]
        client = await asyncio.open_connection("127.0.0.1", port, limit=limit, ssl=client_ssl)
    else:
        a, b = socket.socketpair()
        client = await asyncio.open_connection(sock=a, limit=limit)
        server = None
        await accepted.put(await asyncio.open_connection(sock=b, limit=limit))
    theirs = await accepted.get()
    try:
        yield client, theirs
    finally:
        for _, w in (client, theirs):
            w.close()
            with contextlib.suppress(Exception):
                await w.wait_closed()
        if server is not None:
            server.close()
            await server.wait_closed()


def counts() -> tuple[int, int]:
    return _handover.handed_over["send"], _handover.handed_over["receive"]


async def buffered_at_least(reader: asyncio.StreamReader, n: int) -> None:
    """Wait (bounded by the test's deadline) until the reader has buffered n bytes."""
    while len(reader._buffer) < n:  # type: ignore[attr-defined]
        await asyncio.sleep(0.001)


# ------------------------------------------------------------------ round trips


@pytest.mark.parametrize("family", ["tcp", "unix"])
@pytest.mark.parametrize("layout", ["seed", "compact"])
def test_a_gradient_between_the_callers_own_framing(layout: str, family: str, mode: str) -> None:
    """A length line before and a trailer after, on the same streams both ways: the
    gradient and every byte around it arrive in order; the handover ran (or not)."""
    s = gs.GradientStreamSession("t", CHUNK, layout=layout, timeout=10)
    grad = gradient(25_500, seed=1)
    before = counts()

    async def main() -> None:
        async with tcp_streams(family) as ((cr, cw), (sr, sw)):

            async def send(w: asyncio.StreamWriter, g: np.ndarray) -> None:
                w.write(b"LEN 25500\n")
                await s.stream_to(g, w)
                w.write(b"END\n")
                await w.drain()

            async def receive(r: asyncio.StreamReader, stream: Any) -> np.ndarray:
                assert await r.readline() == b"LEN 25500\n"
                got = await s.receive_from(stream)
                assert await r.readline() == b"END\n"
                return got

            _, got = await asyncio.gather(send(cw, grad), receive(sr, (sr, sw)))
            assert_bit_equal(got, grad)
            # And back, the reader alone this time.
            _, back = await asyncio.gather(send(sw, got), receive(cr, cr))
            assert_bit_equal(back, grad)
            sw.write(b"bye")
            sw.write_eof()
            assert await cr.read() == b"bye"

    run(main)
    moved = tuple(b - a for a, b in zip(before, counts(), strict=True))
    assert moved == ((2, 2) if mode == "handover" else (0, 0))


SIZES = [0, 1, CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK + 7]


def test_gradients_back_to_back_and_receive_iter(mode: str) -> None:
    """Gradients of sizes around the chunk boundary, one after another on one stream,
    received by receive_from and then by receive_iter until the peer closes."""
    s = gs.GradientStreamSession("t", CHUNK, timeout=10)
    grads = [gradient(n, seed=n) for n in SIZES]

    async def main() -> None:
        async with tcp_streams() as ((_, cw), (sr, _)):

            async def send_all() -> None:
                for g in grads + grads:
                    await s.stream_to(g, cw)
                cw.write_eof()

            sending = asyncio.create_task(send_all())
            for g in grads:
                assert_bit_equal(await s.receive_from(sr), g)
            rest = [got async for got in s.receive_iter(sr)]
            await sending
            assert len(rest) == len(grads)
            for got, g in zip(rest, grads, strict=True):
                assert_bit_equal(got, g)
            assert sr.at_eof()

    run(main)


def wire_of(s: gs.GradientStreamSession, n: int, seed: int) -> tuple[np.ndarray, bytes]:
    g = gradient(n, seed=seed)
    return g, s.encode_frames(g)


@pytest.mark.parametrize(
    "split",
    ["inside the header", "the header only", "part of a payload", "one gradient", "both"],
)
def test_the_readers_buffer_cut_anywhere(split: str, mode: str) -> None:
    """The StreamReader already holds part of the first gradient (or all of it, or it and
    the next and the trailer) when receive_from starts: every byte is read once, in
    order, and what follows the gradients is left for the caller."""
    s = gs.GradientStreamSession("t", CHUNK, timeout=10)
    g1, w1 = wire_of(s, 2 * CHUNK + 3, 1)
    g2, w2 = wire_of(s, CHUNK, 2)
    stream = b"HEAD\n" + w1 + w2 + b"TRAILER"
    cut = (
        5
        + {
            "inside the header": 7,
            "the header only": 16,
            "part of a payload": 16 + 100,
            "one gradient": len(w1),
            "both": len(w1) + len(w2) + 7,
        }[split]
    )

    async def main() -> None:
        async with tcp_streams() as ((_, cw), (sr, _)):
            cw.write(stream[:cut])
            await cw.drain()
            await buffered_at_least(sr, cut)
            assert await sr.readexactly(5) == b"HEAD\n"
            receiving = asyncio.create_task(s.receive_from(sr))
            await asyncio.sleep(0.01)
            cw.write(stream[cut:])
            await cw.drain()
            assert_bit_equal(await receiving, g1)
            assert_bit_equal(await s.receive_from(sr), g2)
            assert await sr.readexactly(7) == b"TRAILER"

    run(main)


def test_tensor_sets_with_bytes_around_them(mode: str) -> None:
    s = gs.GradientStreamSession("t", CHUNK, timeout=10)
    tensors = {"w": gradient(2500, seed=3).reshape(50, 50), "b": np.arange(7, dtype=np.float64)}

    async def main() -> None:
        async with tcp_streams() as ((_, cw), (sr, _)):
            await tensors_with_bytes_around(s, tensors, cw, sr)

    run(main)


async def tensors_with_bytes_around(
    s: gs.GradientStreamSession,
    tensors: dict[str, np.ndarray],
    writer: asyncio.StreamWriter,
    reader: asyncio.StreamReader,
) -> None:
    """A tensor set between a "<" and a ">" of the caller's: all arrive, in order."""
    writer.write(b"<")
    await s.stream_tensors(tensors, writer)
    writer.write(b">")
    await writer.drain()
    assert await reader.readexactly(1) == b"<"
    got = await s.receive_tensors(reader)
    assert await reader.readexactly(1) == b">"
    assert list(got) == list(tensors)
    for name, t in tensors.items():
        np.testing.assert_array_equal(got[name], t)
        assert got[name].dtype == t.dtype


@pytest.mark.parametrize("direction", ["native to reference", "reference to native"])
def test_the_reference_and_native_agree_over_the_same_streams(direction: str, mode: str) -> None:
    native = gs.GradientStreamSession("t", CHUNK, timeout=10)
    reference = ref.GradientStreamSession("t", CHUNK, timeout=10)
    tx, rx = (native, reference) if direction == "native to reference" else (reference, native)
    grad = gradient(3 * CHUNK + 11, seed=4)

    async def main() -> None:
        async with tcp_streams() as ((_, cw), (sr, _)):
            _, got = await asyncio.gather(tx.stream_to(grad, cw), rx.receive_from(sr))
            cw.write(b"!")
            await cw.drain()
            assert await sr.readexactly(1) == b"!"
            assert_bit_equal(got, grad)

    run(main)


# ------------------------------------------------------------------ the reader's limit


def test_a_small_limit_the_reader_paused_for(mode: str) -> None:
    """With limit=1024 the reader pauses its transport once it holds over 2 KiB: the
    receive reads on from there, and the limit still bounds the caller's readline after."""
    s = gs.GradientStreamSession("t", CHUNK, timeout=10)
    grad = gradient(4 * CHUNK, seed=5)
    long_line = b"x" * 5000 + b"\n"  # over the limit: readline refuses it

    async def main() -> None:
        async with tcp_streams(limit=1024) as ((_, cw), (sr, _)):
            cw.write(b"a\n")
            writing = asyncio.create_task(s.stream_to(grad, cw))
            assert await sr.readline() == b"a\n"
            await buffered_at_least(sr, 2049)
            got = await s.receive_from(sr)
            await writing
            assert_bit_equal(got, grad)
            cw.write(long_line)
            await cw.drain()
            with pytest.raises(ValueError, match="limit"):
                await sr.readline()

    run(main)


# ------------------------------------------------------------------ failures


async def outcome_of(receive: Awaitable[Any]) -> tuple[type, str]:
    try:
        await receive
    except GradientStreamError as exc:
        return type(exc), str(exc)
    raise AssertionError("the receive did not fail")


def close_early_cases() -> list[tuple[str, int, type]]:
    s = gs.GradientStreamSession("t", CHUNK)
    wire = s.encode_frames(gradient(2 * CHUNK, seed=6))
    first = len(wire) // 2
    return [
        ("inside the first header", 9, FrameError),
        ("inside a payload", 100, FrameError),
        ("between frames", first, IncompleteStreamError),
        ("inside a later header", first + 3, IncompleteStreamError),
    ]


@pytest.mark.parametrize(("where", "cut", "kind"), close_early_cases())
def test_a_peer_that_closes_mid_gradient(where: str, cut: int, kind: type) -> None:
    """The error the table of docs/spec/decoding-rules.md gives, word for word the same on both
    paths; the reader then sees the end of the stream."""
    s = gs.GradientStreamSession("t", CHUNK, timeout=10)
    wire = s.encode_frames(gradient(2 * CHUNK, seed=6))
    seen: dict[bool, tuple[type, str]] = {}

    async def once(handover: bool) -> None:
        async with tcp_streams() as ((_, cw), (sr, _)):
            cw.write(wire[:cut])
            cw.write_eof()
            if not handover:
                with pytest.MonkeyPatch.context() as mp:
                    mp.setattr(_handover, "lend_reader", lambda reader: None)
                    seen[handover] = await outcome_of(s.receive_from(sr))
            else:
                seen[handover] = await outcome_of(s.receive_from(sr))
            assert await sr.read() == b""

    run(lambda: once(True))
    run(lambda: once(False))
    assert seen[True] == seen[False]
    assert seen[True][0] is kind


@pytest.mark.parametrize(
    "attack",
    [
        "a header claiming more than max_payload_len",
        "a corrupted payload",
        "garbage",
    ],
)
def test_a_hostile_peer_is_refused_alike(attack: str) -> None:
    s = gs.GradientStreamSession("t", CHUNK, timeout=10, max_payload_len=1 << 16)
    wire = bytearray(s.encode_frames(gradient(CHUNK, seed=7)))
    if attack == "a header claiming more than max_payload_len":
        wire[8:12] = (1 << 30).to_bytes(4, "little")
    elif attack == "a corrupted payload":
        wire[-5] ^= 0xFF
    else:
        wire = bytearray(b"\xff" * 64)
    seen = []

    async def once(lend: Callable[[Any], Any]) -> None:
        async with tcp_streams() as ((_, cw), (sr, _)):
            cw.write(bytes(wire))
            await cw.drain()
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(_handover, "lend_reader", lend)
                seen.append(await outcome_of(s.receive_from(sr)))

    before = counts()[1]
    run(lambda: once(_handover.lend_reader))
    assert counts()[1] == before + 1
    run(lambda: once(lambda reader: None))
    assert seen[0] == seen[1]


def test_a_cancelled_receive_gives_the_stream_back_to_asyncio() -> None:
    """Cancelled mid-gradient (the connection is then out of step, as on any path): the
    transport reads again, and the reader gets the bytes that come next."""
    s = gs.GradientStreamSession("t", CHUNK, timeout=10)
    wire = s.encode_frames(gradient(2 * CHUNK, seed=8))

    async def main() -> None:
        async with tcp_streams() as ((_, cw), (sr, _)):
            cw.write(wire[:100])
            await cw.drain()
            receiving = asyncio.create_task(s.receive_from(sr))
            await asyncio.sleep(0.05)
            receiving.cancel()
            with pytest.raises(asyncio.CancelledError):
                await receiving
            assert sr._transport.is_reading()  # type: ignore[attr-defined]
            cw.write(b"after")
            cw.write_eof()
            assert (await sr.read()).endswith(b"after")

    run(main)


def test_a_reader_with_an_exception_set_raises_it() -> None:
    s = gs.GradientStreamSession("t", CHUNK, timeout=10)

    async def main() -> None:
        async with tcp_streams() as (_, (sr, _)):
            before = counts()[1]
            sr.set_exception(RuntimeError("set by the test"))
            with pytest.raises(RuntimeError, match="set by the test"):
                await s.receive_from(sr)
            assert counts()[1] == before

    run(main)


def test_bytes_queued_in_the_transport_go_first() -> None:
    """A writer with bytes still in its transport's buffer (the peer not reading): the
    send takes the generic path behind them, so they stay in order."""
    s = gs.GradientStreamSession("t", CHUNK, timeout=10)
    grad = gradient(3 * CHUNK, seed=9)
    queued = b"q" * (8 << 20)

    async def main() -> None:
        async with tcp_streams() as ((_, cw), (sr, _)):
            cw.write(queued)
            assert cw.transport.get_write_buffer_size() > 0
            before = counts()[0]
            sending = asyncio.create_task(s.stream_to(grad, cw))
            assert await sr.readexactly(len(queued)) == queued
            assert_bit_equal(await s.receive_from(sr), grad)
            await sending
            assert counts()[0] == before

    run(main)


def test_the_socket_stays_non_blocking_for_asyncio() -> None:
    s = gs.GradientStreamSession("t", CHUNK, timeout=10)

    async def main() -> None:
        async with tcp_streams() as ((_, cw), (sr, _)):
            await asyncio.gather(s.stream_to(gradient(10, seed=1), cw), s.receive_from(sr))
            for w in (cw,):
                assert w.get_extra_info("socket").gettimeout() == 0.0
            assert sr._transport.get_extra_info("socket").gettimeout() == 0.0  # type: ignore[attr-defined]

    run(main)


# ------------------------------------------------------------------ the generic path


def ssl_contexts(certs: Certificates) -> dict[str, ssl.SSLContext]:
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(certs.path("server.pem"), certs.path("server.key"))
    client = ssl.create_default_context(cafile=str(certs.ca_file))
    return {"server": server, "client": client}


def test_tls_streams_keep_the_generic_path(certs: Certificates) -> None:
    s = gs.GradientStreamSession("t", CHUNK, timeout=10)
    grad = gradient(5 * CHUNK + 1, seed=10)
    before = counts()

    async def main() -> None:
        async with tcp_streams(**ssl_contexts(certs)) as ((_, cw), (sr, sw)):
            cw.write(b"<")
            assert await sr.readexactly(1) == b"<"
            _, got = await asyncio.gather(s.stream_to(grad, cw), s.receive_from((sr, sw)))
            cw.write(b">")
            assert await sr.readexactly(1) == b">"
            assert_bit_equal(got, grad)

    run(main)
    assert counts() == before


def test_uvloop_keeps_the_generic_path() -> None:
    uvloop = pytest.importorskip("uvloop")
    s = gs.GradientStreamSession("t", CHUNK, timeout=10)
    grad = gradient(5 * CHUNK + 1, seed=11)
    before = counts()

    async def main() -> None:
        assert not isinstance(asyncio.get_running_loop(), asyncio.SelectorEventLoop)
        async with tcp_streams() as ((_, cw), (sr, _)):
            cw.write(b"<")
            assert await sr.readexactly(1) == b"<"
            _, got = await asyncio.gather(s.stream_to(grad, cw), s.receive_from(sr))
            cw.write(b">")
            assert await sr.readexactly(1) == b">"
            assert_bit_equal(got, grad)

    uvloop.run(main())
    assert counts() == before


# ------------------------------------------------------------------ both paths alike


async def received_both_ways(
    s: gs.GradientStreamSession, stream: bytes, cut: int, tail: int, **kwargs: Any
) -> list[tuple[Any, ...]]:
    """What receive_from(**kwargs) gives, then the ``tail`` bytes the reader has after it,
    on each path: the peer wrote ``stream[:cut]`` before the receive started, the rest
    after, then closed."""
    seen = []
    for lend in (_handover.lend_reader, lambda reader: None):
        async with tcp_streams() as ((_, cw), (sr, _)):
            cw.write(stream[:cut])
            await cw.drain()
            await buffered_at_least(sr, cut)
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(_handover, "lend_reader", lend)
                receiving = asyncio.ensure_future(s.receive_from(sr, **kwargs))
                await asyncio.sleep(0)
                cw.write(stream[cut:])
                cw.write_eof()
                try:
                    got = await receiving
                    result: tuple[Any, ...] = ("ok", got.dtype, got.tobytes())
                except GradientStreamError as exc:
                    result = ("error", type(exc), str(exc))
            after = await sr.readexactly(tail) if result[0] == "ok" else b""
            seen.append((*result, after))
    return seen


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    n=st.integers(0, 3 * CHUNK + 5),
    cut_at=st.floats(0, 1),
    trailer=st.binary(min_size=1, max_size=40),
    damage=st.one_of(st.none(), st.integers(0, 10**6)),
)
def test_both_paths_give_the_same_whatever_was_buffered(
    n: int, cut_at: float, trailer: bytes, damage: int | None
) -> None:
    """Differential: any gradient, any cut between what the reader buffered before the
    receive and what came after, a trailer, maybe one byte damaged (an error then, the
    same one) or the stream cut short: the same values, error and following bytes."""
    s = gs.GradientStreamSession("t", CHUNK, timeout=10)
    wire = bytearray(s.encode_frames(gradient(n, seed=n)))
    if damage is not None:
        wire[damage % len(wire)] ^= 0x5A
    stream = bytes(wire) + trailer
    cut = round(cut_at * len(stream))
    seen = run(lambda: received_both_ways(s, stream, cut, len(trailer)))
    assert seen[0] == seen[1]
    if damage is None:
        assert seen[0][0] == "ok" and seen[0][-1] == trailer


@pytest.mark.parametrize("room", [2 * CHUNK, 2 * CHUNK - 1, 2 * CHUNK + 1])
def test_into_out_and_its_size_checked_alike(room: int) -> None:
    s = gs.GradientStreamSession("t", CHUNK, timeout=10)
    grad = gradient(2 * CHUNK, seed=12)
    out = np.full(room, np.nan, np.float32)

    async def main() -> list[tuple[Any, ...]]:
        return await received_both_ways(s, s.encode_frames(grad) + b"T", 0, 1, out=out)

    seen = run(main)
    assert seen[0] == seen[1]
    if room == grad.size:
        assert seen[0] == ("ok", np.dtype(np.float32), grad.tobytes(), b"T")
    else:
        assert seen[0][0] == "error"


def test_a_stalled_peer_times_out_alike() -> None:
    """The peer sends one frame of two and stalls: StreamTimeoutError, the same words
    (chunks received, total) on both paths. Only the error is compared, never a time."""
    s = gs.GradientStreamSession("t", CHUNK, timeout=0.2)
    wire = s.encode_frames(gradient(2 * CHUNK, seed=13))
    seen = []

    async def once(lend: Callable[[Any], Any]) -> None:
        async with tcp_streams() as ((_, cw), (sr, _)):
            cw.write(wire[: len(wire) // 2 + 20])
            await cw.drain()
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(_handover, "lend_reader", lend)
                seen.append(await outcome_of(s.receive_from(sr)))

    run(lambda: once(_handover.lend_reader))
    run(lambda: once(lambda reader: None))
    assert seen[0] == seen[1]
    assert issubclass(seen[0][0], StreamTimeoutError)


def test_a_tensor_set_then_the_next_already_buffered() -> None:
    s = gs.GradientStreamSession("t", CHUNK, timeout=10)
    one = {"a": gradient(CHUNK + 1, seed=14)}
    two = {"b": np.arange(3, dtype=np.float16), "c": gradient(5, seed=15)}
    stream = s.encode_tensors(one) + s.encode_tensors(two) + b"end"
    before = counts()[1]

    async def main() -> None:
        async with tcp_streams() as ((_, cw), (sr, _)):
            cw.write(stream)
            await buffered_at_least(sr, len(stream))
            for want in (one, two):
                got = await s.receive_tensors(sr)
                assert list(got) == list(want)
                for name, t in want.items():
                    np.testing.assert_array_equal(got[name], t)
            assert await sr.readexactly(3) == b"end"
            cw.write_eof()
            assert await s.receive_tensors(sr) == {}
            assert sr.at_eof()
            # At EOF already: the generic path says so too.
            assert await s.receive_tensors(sr) == {}

    run(main)
    assert counts()[1] == before + 3


def test_both_directions_at_once_on_one_connection(mode: str) -> None:
    """Each end sends and receives at the same time: two transfers share each socket."""
    s = gs.GradientStreamSession("t", CHUNK, timeout=10)
    a, b = gradient(20 * CHUNK, seed=16), gradient(30 * CHUNK + 1, seed=17)

    async def main() -> None:
        async with tcp_streams() as ((cr, cw), (sr, sw)):
            _, got_b, _, got_a = await asyncio.gather(
                s.stream_to(a, cw), s.receive_from(cr), s.stream_to(b, sw), s.receive_from(sr)
            )
            assert_bit_equal(got_a, a)
            assert_bit_equal(got_b, b)
            cw.write(b"x")
            sw.write(b"y")
            assert (await sr.readexactly(1), await cr.readexactly(1)) == (b"x", b"y")

    run(main)


@pytest.mark.parametrize("first", ["nothing", "a handed-over transfer"])
def test_a_stream_upgraded_by_start_tls_keeps_the_generic_path(
    certs: Certificates, first: str
) -> None:
    """After StreamWriter.start_tls the reader's old transport feeds the TLS layer, not
    the reader: a handover would read ciphertext. The generic path runs, the values
    arrive; so also when a transfer before the upgrade was handed over (the stream's
    probe is kept, but its writer's transport changed and its reader's protocol too)."""
    s = gs.GradientStreamSession("t", CHUNK, timeout=10)
    grad = gradient(4 * CHUNK + 3, seed=18)
    contexts = ssl_contexts(certs)
    before = counts()

    async def main() -> None:
        async with tcp_streams() as ((cr, cw), (sr, sw)):
            if first != "nothing":
                _, got = await asyncio.gather(s.stream_to(grad, cw), s.receive_from(sr))
                assert_bit_equal(got, grad)
                assert counts() == (before[0] + 1, before[1] + 1)
            await asyncio.gather(
                cw.start_tls(contexts["client"], server_hostname="127.0.0.1"),
                sw.start_tls(contexts["server"]),
            )
            _, got = await asyncio.gather(s.stream_to(grad, cw), s.receive_from((sr, sw)))
            assert_bit_equal(got, grad)
            _, back = await asyncio.gather(s.stream_to(grad, sw), s.receive_from(cr))
            assert_bit_equal(back, grad)

    run(main)
    handed = 0 if first == "nothing" else 1
    assert counts() == (before[0] + handed, before[1] + handed)


# ------------------------------------------------------------------ the probe


class CountingReader(asyncio.StreamReader):
    """A StreamReader of the caller's own: its read() must see every byte."""

    reads = 0

    async def read(self, n: int = -1) -> bytes:
        CountingReader.reads += 1
        return await super().read(n)


class CountingWriter(asyncio.StreamWriter):
    """A StreamWriter of the caller's own: its write() must see every byte."""

    writes = 0

    def write(self, data: Any) -> None:
        CountingWriter.writes += 1
        super().write(data)


async def counting_streams(sock: socket.socket) -> Streams:
    """open_connection(sock=) with the two subclasses above."""
    loop = asyncio.get_running_loop()
    reader = CountingReader(loop=loop)
    protocol = asyncio.StreamReaderProtocol(reader, loop=loop)
    transport, _ = await loop.connect_accepted_socket(lambda: protocol, sock=sock)
    return reader, CountingWriter(transport, protocol, reader, loop)


def test_subclasses_of_the_streams_keep_the_generic_path() -> None:
    """The native side would bypass a subclass's read() and write(): both take the
    generic path, and the subclass sees the gradient's bytes."""
    s = gs.GradientStreamSession("t", CHUNK, timeout=10)
    grad = gradient(3 * CHUNK + 2, seed=20)

    async def main() -> None:
        a, b = socket.socketpair()
        ours = await counting_streams(a)
        theirs = await asyncio.open_connection(sock=b)
        before = counts()
        reads, writes = CountingReader.reads, CountingWriter.writes
        _, got = await asyncio.gather(s.stream_to(grad, ours), s.receive_from(theirs))
        assert_bit_equal(got, grad)
        _, back = await asyncio.gather(s.stream_to(grad, theirs), s.receive_from(ours))
        assert_bit_equal(back, grad)
        # theirs were handed over (a send and a receive), ours never
        assert counts() == (before[0] + 1, before[1] + 1)
        assert CountingReader.reads > reads and CountingWriter.writes > writes
        for _, w in (ours, theirs):
            w.close()

    run(main)


def test_a_reader_without_the_private_attributes_takes_the_generic_path() -> None:
    """A StreamReader whose ``_transport`` and ``_waiter`` are gone (fed from memory, as
    a caller's own stream may be): the probe finds nothing to hand over, and the generic
    path receives the gradient and what follows it."""
    s = gs.GradientStreamSession("t", CHUNK, timeout=10)
    grad = gradient(2 * CHUNK + 5, seed=21)

    async def main() -> None:
        reader = asyncio.StreamReader()
        reader.feed_data(s.encode_frames(grad) + b"tail")
        reader.feed_eof()
        del reader._transport  # type: ignore[attr-defined]
        del reader._waiter  # type: ignore[attr-defined]
        before = counts()
        assert_bit_equal(await s.receive_from(reader), grad)
        assert await reader.read() == b"tail"
        assert counts() == before

    run(main)


@pytest.mark.parametrize("attribute", ["_buffer", "_eof"])
def test_a_reader_whose_attributes_are_not_asyncios_takes_the_generic_path(
    attribute: str,
) -> None:
    """A reader on a real socket whose private attribute has another type than Python
    3.11's asyncio gives it (a future asyncio, or a caller's patch): generic path."""
    s = gs.GradientStreamSession("t", CHUNK, timeout=10)
    grad = gradient(CHUNK + 1, seed=22)

    class Buffer(bytearray):
        pass

    class Flag(int):
        pass

    async def main() -> None:
        async with tcp_streams() as ((_, cw), (sr, _)):
            if attribute == "_buffer":
                sr._buffer = Buffer()  # type: ignore[attr-defined]
            else:
                sr._eof = Flag(0)  # type: ignore[attr-defined]
            before = counts()[1]
            _, got = await asyncio.gather(s.stream_to(grad, cw), s.receive_from(sr))
            assert_bit_equal(got, grad)
            assert counts()[1] == before

    run(main)


def test_each_stream_is_probed_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The probe of a stream's loop, class, attributes and socket runs at its first
    transfer; later transfers on the stream check only its state."""
    probes: list[str] = []
    for name in ("_probe_reader", "_probe_writer"):
        probe = getattr(_handover, name)

        def counted(stream: Any, probe: Any = probe, name: str = name) -> Any:
            probes.append(name)
            return probe(stream)

        monkeypatch.setattr(_handover, name, counted)
    s = gs.GradientStreamSession("t", CHUNK, timeout=10)
    grads = [gradient(n, seed=n) for n in (1, CHUNK + 3, 5 * CHUNK)]

    async def main() -> None:
        async with tcp_streams() as ((_, cw), (sr, _)):
            before = counts()
            for g in grads:
                _, got = await asyncio.gather(s.stream_to(g, cw), s.receive_from(sr))
                assert_bit_equal(got, g)
            assert counts() == (before[0] + 3, before[1] + 3)

    run(main)
    assert sorted(probes) == ["_probe_reader", "_probe_writer"]


def test_uvloop_streams_take_the_generic_path_both_ways_with_bytes_around() -> None:
    """Under uvloop the probe refuses every stream (its transports keep their own I/O):
    gradients and tensor sets cross both ways, the caller's bytes around them intact."""
    uvloop = pytest.importorskip("uvloop")
    s = gs.GradientStreamSession("t", CHUNK, timeout=10)
    grad = gradient(2 * CHUNK + 9, seed=24)
    tensors = {"w": gradient(30, seed=25).reshape(5, 6), "b": np.arange(4, dtype=np.float64)}
    before = counts()

    async def main() -> None:
        async with tcp_streams() as ((cr, cw), (sr, sw)):
            cw.write(b"<")
            sending = asyncio.ensure_future(s.stream_to(grad, cw))
            assert await sr.readexactly(1) == b"<"
            got = await s.receive_from((sr, sw))
            await sending
            cw.write(b">")
            assert await sr.readexactly(1) == b">"
            assert_bit_equal(got, grad)
            await tensors_with_bytes_around(s, tensors, sw, cr)

    uvloop.run(main())
    assert counts() == before


@pytest.mark.parametrize("buffered", [False, True])
def test_a_small_handed_over_receive_runs_on_the_callers_thread_when_nothing_is_buffered(
    buffered: bool,
) -> None:
    """A reader holding no bytes lends its socket to the socket path's caller-thread
    receive (its transport paused, the socket peeked as any); one holding bytes goes to
    tokio, which reads them first. Both give the gradient and leave what follows."""
    s = gs.GradientStreamSession("t", CHUNK, timeout=10)
    grad = gradient(CHUNK + 7, seed=26)
    wire = s.encode_frames(grad) + b"next"

    async def main() -> None:
        async with tcp_streams() as ((_, cw), (sr, _)):
            if buffered:
                cw.write(wire[:5])
                await cw.drain()
                await buffered_at_least(sr, 5)
            before = (counts()[1], _native.fast_path_counts()[1])
            receiving = asyncio.ensure_future(s.receive_from(sr))
            await asyncio.sleep(0.01)
            cw.write(wire[5:] if buffered else wire)
            await cw.drain()
            assert_bit_equal(await receiving, grad)
            assert await sr.readexactly(4) == b"next"
            here = _native.fast_path_counts()[1] - before[1]
            assert (counts()[1] - before[0], here) == (1, 0 if buffered else 1)

    run(main)
