"""The ``gradstream`` command as real processes: children whose output is read in
threads (so every read can time out), a receiver started and its port read from its
first line, runs to completion, and the checks of its one-line messages.

Every child runs under TIMEOUT and is killed when its test ends (the ``spawn`` fixture of
tests/cli/conftest.py), pass or fail.
"""

from __future__ import annotations

import asyncio
import queue
import re
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import numpy as np
import pytest

import gradstream.reference as ref
from support import peer

CLI = [sys.executable, "-m", "gradstream"]
TIMEOUT = 60.0  # seconds any one child may run before the test fails
LISTENING = re.compile(r"^listening on 127\.0\.0\.1:(\d+)$")


class Child:
    """A CLI process whose stdout and stderr are read in threads (reads can time out)."""

    def __init__(self, args: list[str], command: list[str] = CLI, cwd: Path | None = None) -> None:
        self.proc = subprocess.Popen(
            [*command, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd
        )
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._stderr: list[str] = []
        self._seen: list[str] = []
        assert self.proc.stdout is not None and self.proc.stderr is not None
        self._threads = [
            threading.Thread(target=self._pump_stdout, args=(self.proc.stdout,), daemon=True),
            threading.Thread(target=self._pump_stderr, args=(self.proc.stderr,), daemon=True),
        ]
        for t in self._threads:
            t.start()

    def _pump_stdout(self, stream: IO[str]) -> None:
        for line in stream:
            self._lines.put(line.rstrip("\n"))
        self._lines.put(None)

    def _pump_stderr(self, stream: IO[str]) -> None:
        self._stderr.append(stream.read())

    def next_line(self) -> str:
        """The next line of stdout (the test fails if none comes within TIMEOUT)."""
        try:
            line = self._lines.get(timeout=TIMEOUT)
        except queue.Empty:
            pytest.fail("no output from the child in time")
        if line is None:
            self._lines.put(None)
            pytest.fail(f"the child's output ended; stderr: {self.finish()[2]!r}")
        self._seen.append(line)
        return line

    def first_line(self) -> str:
        return self.next_line()

    def wait_for(self, wanted: Callable[[str], bool]) -> str:
        """Read stdout up to the first line that is ``wanted``."""
        while not wanted(line := self.next_line()):
            pass
        return line

    def finish(self) -> tuple[int, str, str]:
        """Wait for the exit; (status, stdout, stderr)."""
        try:
            status = self.proc.wait(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"{self.proc.args!r} did not finish within {TIMEOUT} s")
        for t in self._threads:
            t.join(TIMEOUT)
        lines = list(self._seen)
        while True:
            try:
                line = self._lines.get_nowait()
            except queue.Empty:
                break
            if line is not None:
                lines.append(line)
        return status, "\n".join(lines), "".join(self._stderr)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def start(
    spawn: list[Child], *args: str, command: list[str] = CLI, cwd: Path | None = None
) -> Child:
    child = Child(list(args), command, cwd)
    spawn.append(child)
    return child


def start_receiver(spawn: list[Child], *args: str, command: list[str] = CLI) -> tuple[Child, int]:
    child = start(spawn, "recv", "127.0.0.1:0", *args, command=command)
    line = child.first_line()
    match = LISTENING.match(line)
    assert match, line
    return child, int(match[1])


def run(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """Run the CLI to completion (killed after TIMEOUT)."""
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=TIMEOUT, cwd=cwd)


def error_lines(stderr: str) -> list[str]:
    """The lines of a child's stderr, each checked to be one of ours (no traceback)."""
    assert "Traceback" not in stderr, stderr
    lines = stderr.strip().splitlines()
    assert all(line.startswith("gradstream") for line in lines), stderr
    return lines


def assert_one_line_error(stderr: str, *needles: str) -> None:
    lines = error_lines(stderr)
    assert len(lines) == 1, stderr
    for needle in needles:
        assert needle in lines[0], stderr


def gradient(n: int, seed: int = 0, shape: tuple[int, ...] | None = None) -> np.ndarray:
    """float32 values with awkward bit patterns: NaN payloads, -0.0, inf, subnormals."""
    g = np.random.default_rng(seed).standard_normal(n, dtype=np.float32)
    bits = g.view(np.uint32)
    special = np.array([0x7FC01234, 0x80000000, 0x7F800000, 0xFF800000, 1], np.uint32)
    bits[: min(n, len(special))] = special[: min(n, len(special))]
    return g.reshape(shape) if shape else g


def bit_equal(a: np.ndarray, b: np.ndarray) -> bool:
    a, b = a.reshape(-1), b.reshape(-1)
    return a.dtype == b.dtype == np.float32 and np.array_equal(a.view(np.uint32), b.view(np.uint32))


def python_frames(grad: np.ndarray, chunk_size: int = 65536) -> bytes:
    """What a Python peer keeping dtypes and shapes sends for `grad` (bare frames)."""
    s = ref.GradientStreamSession("peer", chunk_size, keep_dtype=True, keep_shape=True)
    return bytes(s.encode_frames(grad))


def push(port: int, wire: bytes) -> None:
    """Send `wire` to 127.0.0.1:`port` as a peer, half-close, and wait until the other
    side closes (so that it has read what it wanted of it)."""
    with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT) as peer:
        try:
            peer.sendall(wire)
            peer.shutdown(socket.SHUT_WR)
            while peer.recv(65536):
                pass
        except (ConnectionResetError, BrokenPipeError):  # it closed on bytes unread: done too
            pass


def knock(port: int) -> None:
    """Connect to 127.0.0.1:`port` and close at once, without a byte."""
    socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT).close()


def feed(receiver: Child, port: int, wire: bytes) -> tuple[int, str, str]:
    """Send `wire` to the receiver as a peer, half-close, and wait for its exit."""
    with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT) as peer:
        peer.sendall(wire)
        peer.shutdown(socket.SHUT_WR)
        return receiver.finish()


def free_port() -> int:
    """A port nothing listens on (bound then closed without listening)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


def save(folder: Path, name: str, array: np.ndarray) -> str:
    """``array`` saved as ``folder/name``; its path as text, for a command line."""
    path = folder / name
    np.save(path, array)
    return str(path)


def send_over_connection(port: int, grads: list[np.ndarray], **keywords: Any) -> None:
    """The test peer (support.peer), keeping dtypes and shapes, sends `grads` over one
    gradstream connection to 127.0.0.1:`port` (each acknowledged); `keywords` go to its
    connect."""

    async def main() -> None:
        session = peer.GradientStreamSession("peer", keep_dtype=True, keep_shape=True)
        conn = await peer.connect(("127.0.0.1", port), session=session, **keywords)
        async with conn:
            for grad in grads:
                await conn.send(grad)

    asyncio.run(main())
