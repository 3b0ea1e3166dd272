"""How a small socket receive waits for its gradient (issue 12, row 2; ``_aio.Readiness``):
in an epoll set of the event loop's own, never through the loop's reader slot of the
caller's socket, re-armed once per wait and disarmed by a wait that ends without the
socket becoming readable. Nothing here times anything: the tests check what stays
registered where, and that the caller's own readers, closed and reused descriptors,
sessions taking turns, cancellations and stalls give what they gave before.
"""

from __future__ import annotations

import asyncio
import select
import socket
import struct

import pytest

pytest.importorskip("gradstream._native", reason="native extension not built")

import gradstream as gs
from gradstream import _aio
from gradstream.errors import StreamTimeoutError
from support.aio import run, tcp_socket_pair
from support.streams import assert_bit_equal, check_socket_intact, gradient

TRANSPORTS = ["tcp", "unix"]


def pair(transport: str) -> tuple[socket.socket, socket.socket]:
    """(peer, ours), blocking."""
    return tcp_socket_pair() if transport == "tcp" else socket.socketpair()


def in_loop_selector(sock: socket.socket) -> bool:
    """Whether the running loop's selector holds ``sock`` (a reader or writer on it)."""
    loop = asyncio.get_running_loop()
    return sock.fileno() in loop._selector.get_map()  # type: ignore[attr-defined]


def armed_for(sock: socket.socket) -> bool:
    """Whether the loop's watch would still report ``sock`` (call once bytes are there):
    a waiter for it, or an armed entry that reports its readability."""
    watch = _aio.hub().readiness
    if sock.fileno() in watch._waiters:
        return True
    return any(fd == sock.fileno() for fd, _ in watch._epoll.poll(0))


async def later(peer: socket.socket, data: bytes) -> None:
    """``data`` from the peer once the loop has turned a few times (the receive waits)."""
    for _ in range(3):
        await asyncio.sleep(0.01)
    peer.sendall(data)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_waiting_receive_never_takes_the_loops_reader_slot_of_the_socket(
    transport: str,
) -> None:
    """The caller's own reader on the socket stays as it was, during and after a receive
    that waited (loop.add_reader would have replaced it, remove_reader dropped it)."""
    s = gs.GradientStreamSession("s", timeout=10)
    g = gradient(300, seed=1)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        peer, ours = pair(transport)
        with peer, ours:
            ours.setblocking(False)
            calls: list[int] = []
            receiving = asyncio.ensure_future(s.receive_from(ours))
            await asyncio.sleep(0.01)
            assert not in_loop_selector(ours)
            loop.add_reader(ours.fileno(), lambda: calls.append(1))  # the caller's own
            await later(peer, s.encode_frames(g))
            assert_bit_equal(await receiving, g)
            assert in_loop_selector(ours)  # theirs, still there
            peer.sendall(b"x")
            while not calls:
                await asyncio.sleep(0.005)
            assert ours.recv(1) == b"x"
            assert loop.remove_reader(ours.fileno())
            # And their reader works after a receive that found its gradient at once.
            peer.sendall(s.encode_frames(g))
            assert_bit_equal(await s.receive_from(ours), g)
            assert not in_loop_selector(ours)
            got = asyncio.get_running_loop().create_future()
            loop.add_reader(ours.fileno(), lambda: got.done() or got.set_result(ours.recv(1)))
            peer.sendall(b"y")
            assert await got == b"y"
            loop.remove_reader(ours.fileno())
            check_socket_intact(ours, 0.0)

    run(main)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_socket_closed_between_receives_and_its_number_reused(transport: str) -> None:
    """The kernel drops a closed socket's entry; the next socket given the same
    descriptor number is watched afresh, and a wait on it still wakes."""
    s = gs.GradientStreamSession("s", timeout=10)
    g = gradient(200, seed=2)

    async def main() -> None:
        reused = 0
        for _ in range(4):
            peer, ours = pair(transport)
            with peer, ours:
                number = ours.fileno()
                for k in range(2):
                    receiving = asyncio.ensure_future(s.receive_from(ours))
                    await later(peer, s.encode_frames(g[: 100 + k]))
                    assert_bit_equal(await receiving, g[: 100 + k])
            # ours is closed now; the next pair may well take its number
            peer, ours = pair(transport)
            reused += ours.fileno() == number
            peer.close()
            ours.close()
        assert reused > 0  # the case the test is about happened

    run(main)


def test_two_sessions_take_turns_on_one_socket_both_waiting() -> None:
    first = gs.GradientStreamSession("a", timeout=10)
    second = gs.GradientStreamSession("b", 16, timeout=10, layout="compact")
    g = gradient(100, seed=3)

    async def main() -> None:
        peer, ours = pair("tcp")
        with peer, ours:
            for session in (first, second, first, second):
                receiving = asyncio.ensure_future(session.receive_from(ours))
                await later(peer, session.encode_frames(g))
                assert_bit_equal(await receiving, g)
                assert not armed_for(ours)

    run(main)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_cancelled_wait_leaves_nothing_armed_and_consumes_nothing(transport: str) -> None:
    s = gs.GradientStreamSession("s")
    g = gradient(100, seed=4)

    async def main() -> None:
        peer, ours = pair(transport)
        with peer, ours:
            waiting = asyncio.ensure_future(s.receive_from(ours))
            await asyncio.sleep(0.02)
            assert ours.fileno() in _aio.hub().readiness._waiters
            waiting.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiting
            wire = s.encode_frames(g)
            peer.sendall(wire)
            await asyncio.sleep(0.01)
            assert not armed_for(ours) and not in_loop_selector(ours)
            assert ours.recv(len(wire), socket.MSG_PEEK) == wire  # all of it still there
            assert_bit_equal(await s.receive_from(ours), g)
            check_socket_intact(ours)

    run(main)


@pytest.mark.parametrize("sent", ["nothing", "half a frame", "one of three frames"])
def test_a_stalled_peer_times_out_with_nothing_left_armed(sent: str) -> None:
    """Bytes or none, then a stall: the timeout error, and no entry left to report the
    socket when its next bytes come (those bytes are for a fresh receive)."""
    s = gs.GradientStreamSession("s", 4, timeout=0.2)
    wire = s.encode_frames(gradient(10, seed=5))
    first = 16 + struct.unpack_from("<I", wire, 8)[0]
    data = {"nothing": b"", "half a frame": wire[:20], "one of three frames": wire[:first]}[sent]

    async def main() -> None:
        peer, ours = pair("tcp")
        with peer, ours:
            peer.sendall(data)
            with pytest.raises(StreamTimeoutError):
                await s.receive_from(ours)
            peer.sendall(b"more")
            await asyncio.sleep(0.01)
            assert not armed_for(ours) and not in_loop_selector(ours)
            check_socket_intact(ours)

    run(main)


def test_many_sockets_wait_at_once_and_each_wakes_for_its_own_gradient() -> None:
    s = gs.GradientStreamSession("s", timeout=10)
    pairs = [pair("unix") for _ in range(6)]

    async def main() -> None:
        receiving = [asyncio.ensure_future(s.receive_from(ours)) for _, ours in pairs]
        await asyncio.sleep(0.01)
        sent: set[int] = set()
        for k in (3, 0, 5, 1, 4, 2):  # out of order
            pairs[k][0].sendall(s.encode_frames(gradient(50 + k, seed=k)))
            sent.add(k)
            assert_bit_equal(await receiving[k], gradient(50 + k, seed=k))
            assert all(not r.done() for j, r in enumerate(receiving) if j not in sent)
        for peer, ours in pairs:
            assert not armed_for(ours)
            peer.close()
            ours.close()

    run(main)


def test_the_watch_is_one_epoll_set_per_loop() -> None:
    async def one() -> tuple[int, int]:
        watch = _aio.hub().readiness
        assert isinstance(watch._epoll, select.epoll)
        loop = asyncio.get_running_loop()
        assert watch._epoll.fileno() in loop._selector.get_map()  # type: ignore[attr-defined]
        return id(watch), watch._epoll.fileno()

    async def both() -> None:
        assert await one() == await one()  # the same loop: the same watch

    run(both)
    run(both)
