"""gradstream.sync.serve (docs/guides/blocking.md "Servers"): each connection's handler
runs in a thread of its own, concurrently, its connection closed when it returns; a
handler's exception is logged and ends its connection only; serve_forever() returns
once shutdown() is called from another thread; the context manager shuts down."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

import gradstream.sync as gsync
from support.connections import LOCAL


def doubling(conn: gsync.Connection) -> None:
    for gradient in conn:
        conn.send(gradient * 2)


def test_handlers_in_threads_concurrently() -> None:
    names: set[str] = set()

    def handler(conn: gsync.Connection) -> None:
        names.add(threading.current_thread().name)
        doubling(conn)

    with gsync.serve(LOCAL, handler) as server:
        conns = [gsync.connect(server.address) for _ in range(3)]
        # All three open at once, each served while the others wait: threads, not turns.
        for round_ in range(2):
            for index, conn in enumerate(conns):
                conn.send(np.full(1000, index + round_, np.float32))
            for index, conn in enumerate(conns):
                np.testing.assert_array_equal(conn.recv(), np.full(1000, 2 * (index + round_)))
        for conn in conns:
            conn.close()
    assert len(names) == 3 and all(name.startswith("gradstream-handler-") for name in names)


def test_handler_exception_is_logged_and_its_connection_closed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def handler(conn: gsync.Connection) -> None:
        conn.recv()
        raise ValueError("the handler's own bug")

    with gsync.serve(LOCAL, handler) as server:
        with gsync.connect(server.address) as conn:
            conn.send(np.ones(10, np.float32))
            assert conn.recv().size == 0  # the server closed it: the end
            assert conn.closed
        with gsync.connect(server.address) as conn:  # the server goes on
            conn.send(np.ones(10, np.float32))
    assert any(
        "handler of the connection with" in r.getMessage()
        and "the handler's own bug" in r.getMessage()
        for r in caplog.records
    )


def test_serve_forever_until_shutdown() -> None:
    server = gsync.serve(LOCAL, doubling)
    stopper = threading.Timer(0.3, server.shutdown)
    stopper.start()
    started = time.monotonic()
    server.serve_forever()
    assert 0.25 < time.monotonic() - started < 5
    stopper.join()
    with pytest.raises(OSError):
        gsync.connect(server.address, handshake_timeout=2)


def test_shutdown_marks_running_handlers_connections_closed() -> None:
    """A handler between transfers when the server shuts down: its next call says the
    connection closed, and shutdown waits for it."""
    inside = threading.Event()
    seen: list[BaseException] = []

    def handler(conn: gsync.Connection) -> None:
        inside.set()
        time.sleep(0.3)
        try:
            conn.recv()
        except OSError as exc:
            seen.append(exc)

    server = gsync.serve(LOCAL, handler)
    with gsync.connect(server.address) as conn:
        assert inside.wait(10)
        server.shutdown()
        assert seen and "recv on a closed connection" in str(seen[0])
        assert conn.recv().size == 0  # closed by the server


def test_handler_must_be_callable() -> None:
    with pytest.raises(TypeError, match="handler must be callable"):
        gsync.serve(LOCAL, 3)  # type: ignore[arg-type]


def test_shutdown_stops_a_handler_blocked_in_recv() -> None:
    """A handler waiting for a gradient that never comes: shutdown stops its recv at once
    (StreamIOError, "the server shut down"), as closing an asyncio server cancels its
    handlers, instead of waiting for the connection's timeout."""
    inside = threading.Event()
    seen: list[BaseException] = []

    def handler(conn: gsync.Connection) -> None:
        inside.set()
        try:
            conn.recv()
        except OSError as exc:
            seen.append(exc)

    server = gsync.serve(LOCAL, handler)
    with gsync.connect(server.address) as conn:
        assert inside.wait(10)
        time.sleep(0.2)  # into the native wait
        started = time.monotonic()
        server.shutdown()
        assert time.monotonic() - started < 2
        assert seen and "the server shut down" in str(seen[0]), seen
        assert conn.recv().size == 0  # closed by the server
