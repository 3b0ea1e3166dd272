"""Section 4: round trips per second of a small gradient, against a raw-socket ping-pong;
and through connections (hello, seal, ack), each against a ping-pong of its own kind
that also sends an ack of the same size after each message: a blocking
``gradstream.sync`` connection against a raw blocking one, a ``gradstream.connect``
(asyncio) connection against a pure-asyncio one (asyncio cannot reach a blocking
socket's rate, so a blocking baseline would measure asyncio, not gradstream)."""

from __future__ import annotations

import asyncio
import os
import socket
import statistics
import time
from collections.abc import Callable
from typing import Any

from .children import (
    ChildError,
    Contestant,
    free_port,
    recv_exactly,
    run_rounds,
    socket_path,
    turns,
)
from .config import F32, Config, SessionSpec, drivers_off, make_config, make_gradient, same_bits
from .results import Results, Row
from .transfers import Planned, _Link


def _window(step: Callable[[], Any], seconds: float) -> float:
    """Round trips per second over a window of about `seconds`."""
    count = 0
    start = time.perf_counter()
    while True:
        step()
        count += 1
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            return count / elapsed


async def _window_async(step: Callable[[], Any], seconds: float) -> float:
    count = 0
    start = time.perf_counter()
    while True:
        await step()
        count += 1
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            return count / elapsed


def _pp_initiator(
    out: Any,
    ctl: Any,
    sock: socket.socket,
    impl: str,
    g: F32,
    wire_len: int,
    seconds: float,
    path: str = "socket",
    off: tuple[str, ...] = (),
) -> None:
    """Side A: per turn, a window of round trips (a warm-up before the first); at the end
    it closes its side, which stops side B. ``path`` "streams": over asyncio streams on the
    socket; ``off``: native drivers turned off."""
    if impl == "raw":
        msg = (g.tobytes() * (wire_len // g.nbytes + 1))[:wire_len]
        view = memoryview(bytearray(wire_len))

        def step() -> None:
            sock.sendall(msg)
            if recv_exactly(sock, view) != wire_len:
                raise ChildError("the echo side closed the connection")

        for rep in turns(ctl):
            if rep == 0:
                _window(step, seconds / 4)
            rate = _window(step, seconds)
            out.put(("rate", rep, rate, bytes(view) == msg))
    else:
        session = SessionSpec(impl, off=off).make()
        last: list[Any] = [g]
        link = _Link(sock, path)

        async def step_async() -> None:
            await session.stream_to(g, link.stream)
            last[0] = await session.receive_from(link.stream)

        async def run() -> None:
            await link.open()
            for rep in turns(ctl):
                if rep == 0:
                    await _window_async(step_async, seconds / 4)
                rate = await _window_async(step_async, seconds)
                out.put(("rate", rep, rate, same_bits(last[0], g)))
            if link.writer is not None:
                link.writer.write_eof()
                await link.close()

        asyncio.run(run())
    if path == "socket":
        sock.shutdown(socket.SHUT_WR)


def _pp_echo(
    out: Any,
    _: Any,
    sock: socket.socket,
    impl: str,
    g: F32,
    wire_len: int,
    path: str = "socket",
    off: tuple[str, ...] = (),
) -> None:
    """Side B: sends back what arrives until side A closes."""
    if impl == "raw":
        view = memoryview(bytearray(wire_len))
        while recv_exactly(sock, view) == wire_len:
            sock.sendall(view)
        return
    # No timeout: it idles while the others take turns.
    session = SessionSpec(impl, off=off).make()
    link = _Link(sock, path)

    async def run() -> None:
        await link.open()
        while True:
            got = await session.receive_from(link.stream)
            if got.size == 0:  # the peer closed between gradients
                await link.close()
                return
            await session.stream_to(got, link.stream)

    asyncio.run(run())


# The rows whose messages are a connection's sealed frames.
SEALED_ROWS = (
    "pingpong_connection",
    "pingpong_connection_tokio",
    "pingpong_raw_ack",
    "pingpong_sync_connection",
    "pingpong_sync_connection_tokio",
    "pingpong_asyncio_ack",
    "pingpong_sync_unix",
    "pingpong_raw_unix_ack",
)
# An accepted ack's bytes on the wire (docs/spec/protocol.md: 56 bytes, no reason).
ACK_LEN = 56


def _ack_initiator(out: Any, ctl: Any, sock: socket.socket, wire_len: int, seconds: float) -> None:
    """Side A of the raw ack ping-pong: a message, the peer's ack, the echo, our ack."""
    msg = bytes(range(256)) * (wire_len // 256 + 1)
    msg = msg[:wire_len]
    view = memoryview(bytearray(wire_len))
    ack, ack_view = bytes(ACK_LEN), memoryview(bytearray(ACK_LEN))

    def step() -> None:
        sock.sendall(msg)
        recv_exactly(sock, ack_view)
        if recv_exactly(sock, view) != wire_len:
            raise ChildError("the echo side closed the connection")
        sock.sendall(ack)

    for rep in turns(ctl):
        if rep == 0:
            _window(step, seconds / 4)
        rate = _window(step, seconds)
        out.put(("rate", rep, rate, bytes(view) == msg))
    sock.shutdown(socket.SHUT_WR)


def _ack_echo(out: Any, _: Any, sock: socket.socket, wire_len: int) -> None:
    view = memoryview(bytearray(wire_len))
    ack, ack_view = bytes(ACK_LEN), memoryview(bytearray(ACK_LEN))
    while recv_exactly(sock, view) == wire_len:
        sock.sendall(ack)
        sock.sendall(view)
        recv_exactly(sock, ack_view)


def _aio_ack_initiator(
    out: Any, ctl: Any, sock: socket.socket, wire_len: int, seconds: float
) -> None:
    """Side A of the pure-asyncio ack ping-pong (asyncio streams on the socket): a
    message, the peer's ack, the echo, our ack, as ``_ack_initiator``."""
    msg = (bytes(range(256)) * (wire_len // 256 + 1))[:wire_len]
    ack = bytes(ACK_LEN)

    async def run() -> None:
        reader, writer = await asyncio.open_connection(sock=sock)
        last = [b""]

        async def step() -> None:
            writer.write(msg)
            await writer.drain()
            await reader.readexactly(ACK_LEN)
            last[0] = await reader.readexactly(wire_len)
            writer.write(ack)
            await writer.drain()

        for rep in turns(ctl):
            if rep == 0:
                await _window_async(step, seconds / 4)
            rate = await _window_async(step, seconds)
            out.put(("rate", rep, rate, last[0] == msg))
        writer.write_eof()
        writer.close()

    asyncio.run(run())


def _aio_ack_echo(out: Any, _: Any, sock: socket.socket, wire_len: int) -> None:
    async def run() -> None:
        reader, writer = await asyncio.open_connection(sock=sock)
        ack = bytes(ACK_LEN)
        while True:
            try:
                got = await reader.readexactly(wire_len)
            except asyncio.IncompleteReadError:  # side A closed
                break
            writer.write(ack)
            writer.write(got)
            await writer.drain()
            await reader.readexactly(ACK_LEN)
        writer.close()

    asyncio.run(run())


def _where(place: int | str) -> Any:
    """A port of 127.0.0.1, or a "unix:PATH" address, as connect and listen take it."""
    return place if isinstance(place, str) else ("127.0.0.1", place)


def _sync_dial(place: int | str, session: Any) -> Any:
    """A blocking connection to the echo side's listener, retried while it starts."""
    import gradstream.sync

    for _ in range(200):
        try:
            return gradstream.sync.connect(_where(place), session=session)
        except OSError:
            time.sleep(0.05)
    return gradstream.sync.connect(_where(place), session=session)


def _unix_ack_initiator(out: Any, ctl: Any, path: str, wire_len: int, seconds: float) -> None:
    """``_ack_initiator`` over a Unix-domain socket at ``path`` (the echo side listens)."""
    sock = socket.socket(socket.AF_UNIX)
    for _ in range(200):
        try:
            sock.connect(path)
            break
        except OSError:
            time.sleep(0.05)
    else:
        sock.connect(path)
    _ack_initiator(out, ctl, sock, wire_len, seconds)


def _unix_ack_echo(out: Any, ctl: Any, path: str, wire_len: int) -> None:
    with socket.socket(socket.AF_UNIX) as listening:
        listening.bind(path)
        listening.listen(1)
        sock, _ = listening.accept()
    _ack_echo(out, ctl, sock, wire_len)
    os.unlink(path)


def _sync_initiator(
    out: Any, ctl: Any, place: int | str, g: F32, seconds: float, off: tuple[str, ...] = ()
) -> None:
    """Side A through a blocking connection (over TCP to a port, or at a "unix:PATH"):
    send (returns once acknowledged), then receive the echo (acknowledging it)."""
    conn = _sync_dial(place, _conn_session(off))
    last: list[Any] = [g]

    def step() -> None:
        conn.send(g)
        last[0] = conn.recv()

    for rep in turns(ctl):
        if rep == 0:
            _window(step, seconds / 4)
        rate = _window(step, seconds)
        out.put(("rate", rep, rate, same_bits(last[0], g)))
    conn.close()


def _sync_echo(out: Any, _: Any, place: int | str, off: tuple[str, ...] = ()) -> None:
    import gradstream.sync

    with gradstream.sync.listen(_where(place), session=_conn_session(off)) as listener:
        with listener.accept() as conn:
            for got in conn:  # until side A closes
                conn.send(got)


async def _dial(port: int, session: Any) -> Any:
    """A connection to the echo side's listener, retried while it starts."""
    import gradstream

    for _ in range(200):
        try:
            return await gradstream.connect(("127.0.0.1", port), session=session)
        except OSError:
            await asyncio.sleep(0.05)
    return await gradstream.connect(("127.0.0.1", port), session=session)


def _conn_session(off: tuple[str, ...]) -> Any:
    """A connection's session: the default one, maybe without some drivers."""
    import gradstream

    return drivers_off(gradstream.GradientStreamSession("bench"), off)


def _conn_initiator(
    out: Any, ctl: Any, port: int, g: F32, seconds: float, off: tuple[str, ...] = ()
) -> None:
    """Side A through a connection: send (returns once acknowledged), then receive the
    echo (acknowledging it)."""

    async def run() -> None:
        conn = await _dial(port, _conn_session(off))
        last: list[Any] = [g]

        async def step() -> None:
            await conn.send(g)
            last[0] = await conn.recv()

        for rep in turns(ctl):
            if rep == 0:
                await _window_async(step, seconds / 4)
            rate = await _window_async(step, seconds)
            out.put(("rate", rep, rate, same_bits(last[0], g)))
        await conn.close()

    asyncio.run(run())


def _conn_echo(out: Any, _: Any, port: int, off: tuple[str, ...] = ()) -> None:
    import gradstream

    async def run() -> None:
        session = _conn_session(off)
        async with await gradstream.listen(("127.0.0.1", port), session=session) as listener:
            conn = await listener.accept()
            async for got in conn:  # until side A closes
                await conn.send(got)

    asyncio.run(run())


def bench_small(cfg: Config, res: Results, only: frozenset[str] | None = None) -> None:
    import gradstream

    g = make_gradient(cfg.pingpong_elements)
    seconds = cfg.pingpong_seconds
    wire_len = len(gradstream.GradientStreamSession("bench", 65536).encode_frames(g))
    # A connection's gradients are sealed: its frames are those of a sealing session.
    sealed_len = len(gradstream.GradientStreamSession("bench", seal=True).encode_frames(g))
    plans = [
        Planned(
            f"pingpong_{impl}",
            "small",
            name,
            Contestant(
                f"pingpong_{impl}",
                ("ping", _pp_initiator, (impl, g, wire_len, cfg.pingpong_seconds)),
                ("echo", _pp_echo, (impl, g, wire_len)),
                per_turn=1,
            ),
        )
        for impl, name in (
            ("native", f"native socket path, {g.size:,} values ({wire_len:,} wire bytes)"),
            ("reference", f"reference socket path, {g.size:,} values"),
            ("raw", f"raw socket ping-pong of {wire_len:,} bytes (sendall / recv_into)"),
        )
    ]
    # Section 7: the socket path without its caller-thread driver (tokio for every
    # transfer), and asyncio streams on the socket with and without the handover.
    for key, name, path, off in (
        (
            "pingpong_native_tokio",
            "native socket path without caller_thread",
            "socket",
            ("caller_thread",),
        ),
        ("pingpong_streams", "native asyncio streams", "streams", ()),
        (
            "pingpong_streams_generic",
            "native asyncio streams without handover",
            "streams",
            ("handover",),
        ),
    ):
        plans.append(
            Planned(
                key,
                "small",
                f"{name}, {g.size:,} values ({wire_len:,} wire bytes)",
                Contestant(
                    key,
                    ("ping", _pp_initiator, ("native", g, wire_len, seconds, path, off)),
                    ("echo", _pp_echo, ("native", g, wire_len, path, off)),
                    per_turn=1,
                ),
            )
        )
    echo_port = free_port()  # the connection's echo side listens there
    tokio_port = free_port()
    plans += [
        Planned(
            "pingpong_connection",
            "small",
            f"native connection (hello, seal, ack), {g.size:,} values ({sealed_len:,} wire bytes)",
            Contestant(
                "pingpong_connection",
                ("ping", _conn_initiator, (echo_port, g, seconds)),
                ("echo", _conn_echo, (echo_port,)),
                per_turn=1,
                connect=False,
            ),
        ),
        Planned(
            "pingpong_connection_tokio",
            "small",
            f"native connection without caller_thread, {g.size:,} values "
            f"({sealed_len:,} wire bytes)",
            Contestant(
                "pingpong_connection_tokio",
                ("ping", _conn_initiator, (tokio_port, g, seconds, ("caller_thread",))),
                ("echo", _conn_echo, (tokio_port, ("caller_thread",))),
                per_turn=1,
                connect=False,
            ),
        ),
        Planned(
            "pingpong_raw_ack",
            "small",
            f"raw ping-pong of {sealed_len:,} bytes, each answered by a {ACK_LEN}-byte ack",
            Contestant(
                "pingpong_raw_ack",
                ("ping", _ack_initiator, (sealed_len, seconds)),
                ("echo", _ack_echo, (sealed_len,)),
                per_turn=1,
            ),
        ),
    ]
    sync_port, sync_tokio_port = free_port(), free_port()
    # Issue 24: the same-host transport, against a raw Unix socket.
    unix = "unix:" + socket_path("connection")
    raw_unix = socket_path("raw")
    plans += [
        Planned(
            "pingpong_sync_connection",
            "small",
            f"blocking gradstream.sync connection (hello, seal, ack), {g.size:,} values "
            f"({sealed_len:,} wire bytes)",
            Contestant(
                "pingpong_sync_connection",
                ("ping", _sync_initiator, (sync_port, g, seconds)),
                ("echo", _sync_echo, (sync_port,)),
                per_turn=1,
                connect=False,
            ),
        ),
        Planned(
            "pingpong_sync_connection_tokio",
            "small",
            f"blocking gradstream.sync connection without caller_thread, {g.size:,} values "
            f"({sealed_len:,} wire bytes)",
            Contestant(
                "pingpong_sync_connection_tokio",
                ("ping", _sync_initiator, (sync_tokio_port, g, seconds, ("caller_thread",))),
                ("echo", _sync_echo, (sync_tokio_port, ("caller_thread",))),
                per_turn=1,
                connect=False,
            ),
        ),
        Planned(
            "pingpong_sync_unix",
            "small",
            f"blocking gradstream.sync unix: connection (shared-memory rings), {g.size:,} "
            f"values ({sealed_len:,} wire bytes)",
            Contestant(
                "pingpong_sync_unix",
                ("ping", _sync_initiator, (unix, g, seconds)),
                ("echo", _sync_echo, (unix,)),
                per_turn=1,
                connect=False,
            ),
        ),
        Planned(
            "pingpong_raw_unix_ack",
            "small",
            f"raw Unix-socket ping-pong of {sealed_len:,} bytes, each answered by a "
            f"{ACK_LEN}-byte ack",
            Contestant(
                "pingpong_raw_unix_ack",
                ("ping", _unix_ack_initiator, (raw_unix, sealed_len, seconds)),
                ("echo", _unix_ack_echo, (raw_unix, sealed_len)),
                per_turn=1,
                connect=False,
            ),
        ),
        Planned(
            "pingpong_asyncio_ack",
            "small",
            f"pure-asyncio ping-pong of {sealed_len:,} bytes, each answered by a "
            f"{ACK_LEN}-byte ack (asyncio streams)",
            Contestant(
                "pingpong_asyncio_ack",
                ("ping", _aio_ack_initiator, (sealed_len, seconds)),
                ("echo", _aio_ack_echo, (sealed_len,)),
                per_turn=1,
            ),
        ),
    ]
    if only is not None:
        plans = [p for p in plans if p.key in only]
    run_rounds([p.contestant for p in plans if p.contestant], cfg.repeats, cfg.deadline)
    for p in plans:
        c = p.contestant
        assert c is not None
        rates = [m[2] for m in c.messages if m[0] == "rate"]
        if c.error is not None or len(rates) != cfg.repeats:
            res.add(Row(p.key, "small", p.name, "failed", c.error or "missing repeats"))
            continue
        rate = statistics.median(rates)
        row = Row(p.key, "small", p.name, seconds=1 / rate, samples=[1 / r for r in rates])
        row.round_trips_per_s = rate
        row.elements = g.size
        row.wire_bytes = sealed_len if p.key in SEALED_ROWS else wire_len
        row.note = f"{1e6 / rate:,.1f} us per round trip"
        if not all(m[3] for m in c.messages):
            row.status, row.note = "failed", "the echoed gradient differs from the sent one"
        res.add(row)
    raw_unix_row = res.ok("pingpong_raw_unix_ack")
    if raw_unix_row is not None and raw_unix_row.seconds is not None:
        res.add(_unix_floor(cfg, g, raw_unix_row.seconds, sealed_len))


def _unix_floor(cfg: Config, g: F32, raw_seconds: float, sealed_len: int) -> Row:
    """What a blocking unix: round trip costs at least: the raw Unix-socket ping-pong with
    acks, plus the codec's work of one round trip (each side encodes its sealed gradient
    once and decodes the other's once), timed here in this process, in rounds, after the
    ping-pongs. Nothing else a connection does (its acks' contents, the calls from Python)
    is in it."""
    import gradstream

    session = gradstream.GradientStreamSession("bench", seal=True)

    def codec() -> None:
        session.decode_frames(session.encode_frames(g))

    codec_rates = [_window(codec, cfg.pingpong_seconds / 4) for _ in range(cfg.repeats)]
    codec_seconds = 1 / statistics.median(codec_rates)
    floor = raw_seconds + 2 * codec_seconds
    row = Row(
        "pingpong_unix_floor",
        "small",
        "the raw Unix-socket ping-pong with an ack plus a round trip's codec work "
        "(sealed encode + decode of the 1,000 values, each way; timed in-process)",
        seconds=floor,
        samples=[raw_seconds + 2 / r for r in codec_rates],
    )
    row.round_trips_per_s = 1 / floor
    row.elements = g.size
    row.wire_bytes = sealed_len
    row.note = (
        f"{1e6 * floor:,.1f} us per round trip: {1e6 * raw_seconds:,.1f} raw + 2 x "
        f"{1e6 * codec_seconds:,.1f} codec"
    )
    return row


# The connection rows of the small-transfer targets, each beside its baseline.
CONNECTION_ROWS = (
    ("pingpong_sync_connection", "pingpong_raw_ack", 0.5),
    ("pingpong_sync_unix", "pingpong_raw_unix_ack", 0.5),
    ("pingpong_connection", "pingpong_asyncio_ack", 1.0),
)


def main(argv: list[str] | None = None) -> None:
    """Only the connection rows of section 4 and their baselines, in rounds (the --quick
    window, N repeats, default 5), with the two ratios: for trying a change to the small
    path without the whole benchmark. ``cd benches && python -m suite.small [N]``."""
    import sys

    args = sys.argv[1:] if argv is None else argv
    cfg = make_config(True, False, None, int(args[0]) if args else 5)
    res = Results()
    bench_small(cfg, res, only=frozenset(key for row in CONNECTION_ROWS for key in row[:2]))
    for ours, base, target in CONNECTION_ROWS:
        a, b = res.rows[ours].seconds, res.rows[base].seconds
        if a is None or b is None:
            print(f"{ours}: failed ({res.rows[ours].note or res.rows[base].note})")
            continue
        print(
            f"{ours} / {base}: {b / a:.3f} x (target >= {target}): "
            f"{a * 1e6:.1f} vs {b * 1e6:.1f} us per round trip"
        )
    floor = res.ok("pingpong_unix_floor")
    if floor is not None:
        print(f"pingpong_unix_floor: {floor.note}")


if __name__ == "__main__":
    main()
