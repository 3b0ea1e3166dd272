"""Ctrl-C during a blocking call (docs/guides/blocking.md "Ctrl-C"): a process blocked
in ``recv`` gets SIGINT and raises KeyboardInterrupt within about a second (the wait in
Rust runs the signal handlers every 50 ms); the transfer is stopped first. Waiting for a
gradient that had not begun leaves the connection open and in step (the next ``recv``
gets the next gradient); cut mid-gradient, the connection is out of step and closed, and
its socket closed."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

import gradstream as gs
import gradstream.sync as gsync

CHILD = textwrap.dedent(
    """
    import sys, time
    import numpy as np
    import gradstream.sync as gsync

    with gsync.listen("127.0.0.1:0", protocol=sys.argv[1]) as listener:
        print(listener.address[1], flush=True)
        with listener.accept(timeout=20) as conn:
            sys.stdin.readline()  # the parent: "go"
            print("receiving", flush=True)
            started = time.monotonic()
            try:
                conn.recv()
            except KeyboardInterrupt:
                print("interrupted", round(time.monotonic() - started, 3), flush=True)
            print("closed", conn.closed, flush=True)
            if not conn.closed:
                got = conn.recv()
                print("then", got.size, float(got[0]), flush=True)
    """
)


def child(protocol: str = "gradstream") -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", CHILD, protocol],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


def line(proc: subprocess.Popen[str]) -> str:
    assert proc.stdout is not None
    return proc.stdout.readline().strip()


def interrupt(proc: subprocess.Popen[str]) -> float:
    """Let the child begin its recv, SIGINT it; seconds from the signal to its report."""
    assert proc.stdin is not None
    proc.stdin.write("go\n")
    proc.stdin.flush()
    assert line(proc) == "receiving"
    time.sleep(0.3)  # into the native wait
    sent = time.monotonic()
    proc.send_signal(signal.SIGINT)
    said = line(proc)
    took = time.monotonic() - sent
    assert said.startswith("interrupted"), said
    assert took < 1.0
    return took


def test_ctrl_c_while_waiting_keeps_the_connection() -> None:
    proc = child()
    try:
        port = int(line(proc))
        with gsync.connect(("127.0.0.1", port)) as conn:
            assert interrupt(proc) < 1.0
            assert line(proc) == "closed False"
            conn.send(np.full(10, 7, np.float32))  # the child's next recv takes it
            assert line(proc) == "then 10 7.0"
    finally:
        proc.kill()
        proc.wait()


def test_ctrl_c_mid_gradient_closes_the_connection() -> None:
    """protocol="seed" (bare frames), so that a raw socket can stop halfway through a
    gradient's frames and hold the child mid-gradient."""
    proc = child("seed")
    try:
        port = int(line(proc))
        frames = gs.GradientStreamSession("s").encode_frames(np.ones(100_000, np.float32))
        with socket.create_connection(("127.0.0.1", port)) as raw:
            raw.sendall(frames[: len(frames) // 2])
            interrupt(proc)
            assert line(proc) == "closed True"
            raw.settimeout(10)
            assert raw.recv(1) == b""  # the child closed its end
    finally:
        proc.kill()
        proc.wait()


def test_an_interrupt_before_the_wait_still_stops_the_job() -> None:
    """Ctrl-C handled just after the native call returned a job, before its wait: the
    thread's jobs are stopped and gone all the same, and the connection, whose gradient
    had not begun, stays in step."""
    from gradstream.sync._wait import stopping, waiter

    with gsync.listen("127.0.0.1:0") as listener:
        with gsync.connect(listener.address) as conn, listener.accept() as other:
            own = waiter()
            with pytest.raises(KeyboardInterrupt), stopping(own, conn._abandoned):
                now, _ = conn._link.recv(own, None, None, None, False)
                assert not now  # nothing there yet: a job on tokio
                raise KeyboardInterrupt
            assert len(own) == 0
            assert not conn.closed
            sender = threading.Thread(target=other.send, args=(np.full(3, 5, np.float32),))
            sender.start()
            np.testing.assert_array_equal(conn.recv(), np.full(3, 5, np.float32))
            sender.join(10)
