"""gradstream.sync (docs/guides/blocking.md): blocking connections carry gradients and
tensor sets as the asyncio ones do, with the same settings (TLS, mutual TLS, authkey,
the seal and ack of protocol="gradstream", protocol="seed"), out=, reduce_into=,
deadline=, progress= and iteration; a blocking side talks to an asyncio side; the
listener's accept(timeout=); nothing of it needs or touches an event loop."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

import gradstream as gs
import gradstream.sync as gsync
from gradstream.errors import (
    AuthenticationError,
    StreamDeadlineError,
    StreamIOError,
    StreamTimeoutError,
)
from support.certs import CLIENT_CN, Certificates
from support.connections import KEY, LOCAL

GRAD = np.arange(50_000, dtype=np.float32) * np.float32(0.5) - np.float32(3.0)
BIG = np.linspace(-1.0, 1.0, 3_000_000, dtype=np.float32)  # past every caller-thread path


class Peer:
    """A blocking listener whose first connection runs ``serve_one`` in a thread; what
    it returns (or raises) is kept for the test."""

    def __init__(self, serve_one: Callable[[gsync.Connection], Any], **listen: Any) -> None:
        self.listener = gsync.listen(LOCAL, **listen)
        self.result: Any = None
        self.error: BaseException | None = None
        self.conn: gsync.Connection | None = None

        def run() -> None:
            try:
                with self.listener.accept(timeout=20) as conn:
                    self.conn = conn
                    self.result = serve_one(conn)
            except BaseException as exc:
                self.error = exc

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def join(self) -> Any:
        self.thread.join(30)
        assert not self.thread.is_alive()
        self.listener.close()
        if self.error is not None:
            raise self.error
        return self.result


@pytest.fixture
def echo() -> Iterator[Callable[..., Peer]]:
    """A peer that sends back every gradient it receives, doubled, until the close."""
    made: list[Peer] = []

    def make(**listen: Any) -> Peer:
        def serve_one(conn: gsync.Connection) -> int:
            count = 0
            for gradient in conn:
                conn.send(gradient * 2)
                count += 1
            return count

        made.append(Peer(serve_one, **listen))
        return made[-1]

    yield make
    for peer in made:
        peer.listener.close()


@pytest.mark.parametrize("values", [GRAD, BIG], ids=["small", "large"])
def test_round_trip_and_iteration(echo: Callable[..., Peer], values: np.ndarray) -> None:
    peer = echo()
    with gsync.connect(peer.listener.address) as conn:
        for _ in range(3):
            assert conn.send(values) >= 1
            np.testing.assert_array_equal(conn.recv(), values * 2)
        assert repr(conn).endswith("idle>")
    assert conn.closed
    assert peer.join() == 3


def test_small_and_large_transfers_take_turns_on_one_connection(
    echo: Callable[..., Peer],
) -> None:
    """A small transfer runs on the caller's thread with the socket off tokio's reactor,
    a large one goes on in tokio (its send spawned, its receive past the caller's read
    budget): each hands the socket to the other on the same connection, both ends, and
    every gradient comes back whole and in order, the closes included."""
    peer = echo()
    tiny = np.arange(1_000, dtype=np.float32)
    with gsync.connect(peer.listener.address) as conn:
        for values in (tiny, BIG, tiny, tiny, BIG, GRAD, tiny):
            conn.send(values)
            np.testing.assert_array_equal(conn.recv(), values * 2)
    assert conn.closed
    assert peer.join() == 7


def test_tls_and_authkey(echo: Callable[..., Peer], certs: Certificates) -> None:
    peer = echo(tls=certs.server, authkey=KEY)
    with gsync.connect(peer.listener.address, tls=certs.client, authkey=KEY) as conn:
        assert conn.peer.authenticated
        conn.send(GRAD)
        np.testing.assert_array_equal(conn.recv(), GRAD * 2)
    peer.join()


def test_mutual_tls_names_the_client(certs: Certificates) -> None:
    def serve_one(conn: gsync.Connection) -> Any:
        got = conn.recv()
        return conn.peer.tls_subject, got

    peer = Peer(serve_one, tls=certs.mutual_server)
    with gsync.connect(peer.listener.address, tls=certs.mutual_client) as conn:
        conn.send(GRAD)
    subject, got = peer.join()
    assert CLIENT_CN in subject
    np.testing.assert_array_equal(got, GRAD)


def test_wrong_authkey_is_the_asyncio_error() -> None:
    with gsync.listen(LOCAL, authkey=KEY) as listener:
        with pytest.raises(AuthenticationError):
            gsync.connect(listener.address, authkey=b"another key, also of 32 bytes..")


def test_seed_protocol(echo: Callable[..., Peer]) -> None:
    peer = echo(protocol="seed")
    with gsync.connect(peer.listener.address, protocol="seed") as conn:
        conn.send(GRAD)
        np.testing.assert_array_equal(conn.recv(), GRAD * 2)
    peer.join()


def test_out_reduce_into_progress(echo: Callable[..., Peer]) -> None:
    peer = echo()
    with gsync.connect(peer.listener.address) as conn:
        out = np.empty_like(BIG)
        progress = gs.TransferProgress()
        conn.send(BIG, progress=progress)
        assert progress.bytes > BIG.nbytes
        assert conn.recv(out, progress=progress) is out
        np.testing.assert_array_equal(out, BIG * 2)
        total = np.ones_like(GRAD)
        conn.send(GRAD)
        assert conn.recv(reduce_into=total) is total
        np.testing.assert_array_equal(total, GRAD * 2 + 1)
    peer.join()


def test_tensor_sets() -> None:
    sent = {
        "w": np.arange(12, dtype=np.float32).reshape(3, 4),
        "b": np.linspace(0, 1, 5, dtype=np.float64),
    }

    def serve_one(conn: gsync.Connection) -> dict[str, np.ndarray]:
        got = conn.recv_tensors(max_values=100)
        conn.send_tensors(got)
        return got

    peer = Peer(serve_one)
    with gsync.connect(peer.listener.address) as conn:
        assert conn.send_tensors(sent) >= 2
        back = conn.recv_tensors()
        assert list(back) == ["w", "b"]
        for name, values in sent.items():
            np.testing.assert_array_equal(back[name], values)
            assert back[name].dtype == values.dtype and back[name].shape == values.shape
        assert conn.recv_tensors() == {}  # the peer closed
        assert conn.closed
    peer.join()


def test_deadline_and_timeout_are_the_asyncio_errors() -> None:
    done = threading.Event()

    def serve_one(conn: gsync.Connection) -> None:
        done.wait(10)  # never receives: no ack comes

    peer = Peer(serve_one)
    with gsync.connect(peer.listener.address) as conn:
        with pytest.raises(StreamDeadlineError):
            conn.send(GRAD, deadline=0.3)  # bounds the writes and the wait for the ack
        assert conn.closed  # a transfer cut short leaves the connection out of step
        with pytest.raises(StreamIOError, match="recv on a closed connection"):
            conn.recv()
    done.set()
    peer.join()
    with gsync.listen(LOCAL) as listener:
        with gsync.connect(listener.address, timeout=0.2) as conn:
            with pytest.raises(StreamTimeoutError, match=r"no progress for 0\.2 s"):
                conn.recv()  # nothing comes


def test_blocking_side_with_an_asyncio_side() -> None:
    """An asyncio listener in a loop of its own thread; the blocking dialler in this one."""
    ready: list[tuple[str, int]] = []
    got: list[np.ndarray] = []
    started = threading.Event()

    async def listen_side() -> None:
        async with await gs.listen(LOCAL) as listener:
            ready.append(listener.address)
            started.set()
            async with await listener.accept() as conn:
                got.append(await conn.recv())
                await conn.send(got[0] + 1)

    thread = threading.Thread(target=asyncio.run, args=(listen_side(),))
    thread.start()
    assert started.wait(10)
    with gsync.connect(ready[0]) as conn:
        conn.send(BIG)
        np.testing.assert_array_equal(conn.recv(), BIG + 1)
    thread.join(20)
    np.testing.assert_array_equal(got[0], BIG)


def test_from_inside_a_running_loop(echo: Callable[..., Peer]) -> None:
    """As in Jupyter: blocking calls from a coroutine, the loop's thread blocked."""
    peer = echo()

    async def notebook_cell() -> np.ndarray:
        with gsync.connect(peer.listener.address) as conn:
            conn.send(GRAD)
            return conn.recv()

    np.testing.assert_array_equal(asyncio.run(notebook_cell()), GRAD * 2)
    peer.join()


def test_accept_timeout_and_closed_listener() -> None:
    listener = gsync.listen(LOCAL)
    with pytest.raises(TimeoutError, match=r"no connection on 127\.0\.0\.1:"):
        listener.accept(timeout=0.1)
    listener.close()
    with pytest.raises(StreamIOError, match=r"accept\(\) on a closed listener"):
        listener.accept()
    assert list(listener) == []
    assert "closed" in repr(listener)
