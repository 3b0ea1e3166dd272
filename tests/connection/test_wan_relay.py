"""The long-path relay of tests/support/wan.py, which issue 25's tests run through: bytes
pass unchanged both ways (a gradstream connection's too), no round trip is shorter than
its ``rtt``, one flow moves at most ``window`` bytes per ``rtt``, and a reset or a stall
reaches both ends. Its bounds are checked from below only: the relay may be slower than
its limits on a busy machine, never faster."""

from __future__ import annotations

import socket
import struct
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest

import gradstream.sync as gss
from gradstream.errors import DeliveryError
from support.wan import Relay

KEY = b"sixteen bytes or more"


@pytest.fixture
def echo() -> Iterator[tuple[str, int]]:
    """A raw TCP echo server (each connection in a thread): its address."""
    server = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve_one(conn: socket.socket) -> None:
        with conn:
            while True:
                try:
                    data = conn.recv(1 << 16)
                except OSError:
                    return
                if not data:
                    return
                conn.sendall(data)

    def accept() -> None:
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                return
            threading.Thread(target=serve_one, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    yield server.getsockname()[:2]
    stop.set()
    server.close()


def exchange(sock: socket.socket, data: bytes) -> bytes:
    """Send ``data`` and read as many bytes back."""
    sock.sendall(data)
    got = bytearray()
    while len(got) < len(data):
        piece = sock.recv(len(data) - len(got))
        if not piece:
            break
        got += piece
    return bytes(got)


def test_bytes_pass_unchanged_and_no_round_trip_is_shorter_than_the_rtt(
    echo: tuple[str, int],
) -> None:
    with Relay(echo, rtt=0.05, window=1 << 20) as relay:
        with socket.create_connection(relay.address) as sock:
            payload = np.random.default_rng(1).bytes(200_000)
            assert exchange(sock, payload) == payload
            for _ in range(3):
                started = time.monotonic()
                assert exchange(sock, b"x") == b"x"
                # rtt / 2 there and rtt / 2 back.
                assert time.monotonic() - started >= 0.05 * 0.95
        assert relay.connections == 1
        assert relay.forwarded >= 200_003


def test_one_flow_moves_at_most_a_window_per_rtt(echo: tuple[str, int]) -> None:
    window, rtt, size = 64 * 1024, 0.05, 1 << 20
    with Relay(echo, rtt=rtt, window=window) as relay:
        with socket.create_connection(relay.address) as sock:
            payload = np.random.default_rng(2).bytes(size)
            started = time.monotonic()
            assert exchange(sock, payload) == payload
            took = time.monotonic() - started
    # Each of the two flows (there, back) moves window bytes per rtt: the first byte
    # back arrives an rtt after the first went, the last no sooner than size / window
    # rtts after that.
    assert took >= (size / window) * rtt * 0.95, took


def first_error(sock: socket.socket) -> BaseException | None:
    """What ``sock`` meets when it writes and reads until it fails; None for a clean end
    of stream (a FIN, which is not what a reset must look like)."""
    sock.settimeout(10)
    try:
        for _ in range(1000):
            sock.sendall(b"more")
            if not sock.recv(16):
                return None
            time.sleep(0.01)
    except OSError as exc:
        return exc
    raise AssertionError("the connection never failed")


def test_a_reset_reaches_both_ends_as_a_reset() -> None:
    server = socket.create_server(("127.0.0.1", 0))
    seen: list[BaseException | None] = []

    def serve_one() -> None:
        conn, _ = server.accept()
        with conn:
            conn.settimeout(10)
            try:
                while data := conn.recv(16):
                    conn.sendall(data)
                seen.append(None)
            except OSError as exc:
                seen.append(exc)

    serving = threading.Thread(target=serve_one)
    serving.start()
    with Relay(server.getsockname()[:2], rtt=0.01, window=1 << 20) as relay:
        with socket.create_connection(relay.address) as sock:
            assert exchange(sock, b"hello") == b"hello"
            relay.reset()
            assert isinstance(first_error(sock), ConnectionResetError)
    serving.join(10)
    server.close()
    assert len(seen) == 1 and isinstance(seen[0], ConnectionResetError), seen


def test_one_end_reset_reaches_the_other_as_a_reset() -> None:
    server = socket.create_server(("127.0.0.1", 0))
    with Relay(server.getsockname()[:2], rtt=0.01, window=1 << 20) as relay:
        with socket.create_connection(relay.address) as sock:
            far, _ = server.accept()
            sock.sendall(b"hi")
            assert far.recv(2) == b"hi"
            far.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            far.close()  # an RST from the target's side
            assert isinstance(first_error(sock), ConnectionResetError)
    server.close()


def test_a_close_passes_every_byte_then_the_end_after_the_delay(
    echo: tuple[str, int],
) -> None:
    payload = np.random.default_rng(5).bytes(3_000_000)
    with Relay(echo, rtt=0.04, window=1 << 20) as relay:
        with socket.create_connection(relay.address) as sock:
            sock.sendall(payload)
            sock.shutdown(socket.SHUT_WR)
            got = bytearray()
            while piece := sock.recv(1 << 16):
                got += piece
    assert bytes(got) == payload


def test_a_reset_once_so_many_bytes_went_cuts_a_gradstream_transfer_midway() -> None:
    gradient = np.random.default_rng(3).standard_normal(2_000_000).astype(np.float32)
    with gss.listen(("127.0.0.1", 0), authkey=KEY) as listener:
        failed: list[BaseException] = []

        def receive() -> None:
            try:
                with listener.accept(timeout=20) as conn:
                    conn.recv()
            except BaseException as exc:
                failed.append(exc)

        receiver = threading.Thread(target=receive)
        receiver.start()
        with Relay(listener.address, rtt=0.01, window=1 << 20) as relay:
            relay.reset_when(gradient.nbytes // 2)
            with gss.connect(relay.address, authkey=KEY) as conn:
                with pytest.raises((OSError, DeliveryError)):
                    conn.send(gradient)
            sent_before = relay.forwarded
        receiver.join(30)
        assert not receiver.is_alive()
    assert failed, "the receiver got a gradient the relay cut in half"
    assert gradient.nbytes // 2 <= sent_before < gradient.nbytes


def test_a_gradstream_connection_round_trips_through_the_relay() -> None:
    gradient = np.random.default_rng(4).standard_normal((300, 1000)).astype(np.float32)
    with gss.listen(("127.0.0.1", 0), authkey=KEY) as listener:

        def echo_back() -> None:
            with listener.accept(timeout=20) as conn:
                for got in conn:
                    conn.send(got)

        server = threading.Thread(target=echo_back)
        server.start()
        with Relay(listener.address, rtt=0.02, window=1 << 20) as relay:
            with gss.connect(relay.address, authkey=KEY) as conn:
                conn.send(gradient)
                back = conn.recv()
        server.join(30)
        assert not server.is_alive()
    assert back.tobytes() == gradient.tobytes()


def test_a_stall_holds_every_byte_for_its_time(echo: tuple[str, int]) -> None:
    with Relay(echo, rtt=0.0, window=1 << 20) as relay:
        with socket.create_connection(relay.address) as sock:
            assert exchange(sock, b"a") == b"a"
            started = time.monotonic()
            relay.stall(0.3)
            assert exchange(sock, b"b") == b"b"
            assert time.monotonic() - started >= 0.3 * 0.95
            # A stall within a stall ends with the later one.
            started = time.monotonic()
            relay.stall(0.2)
            relay.stall(0.5)
            assert exchange(sock, b"c") == b"c"
            assert time.monotonic() - started >= 0.5 * 0.95
