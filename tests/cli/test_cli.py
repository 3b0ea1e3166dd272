"""The `gradstream` command, run as real processes talking TCP on 127.0.0.1.

Every child process runs under a timeout and is killed when a test ends, pass or fail.
"""

from __future__ import annotations

import functools
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import numpy as np
import pytest

import gradstream
import gradstream.reference as ref
from gradstream.cli import CliError, format_size, output_paths, parse_address, parse_size
from support.frames import frame

CLI = [sys.executable, "-m", "gradstream"]
TIMEOUT = 60.0  # seconds any one child may run before the test fails
NATIVE_STREAMS = hasattr(gradstream.GradientStreamSession, "stream_to")
needs_native = pytest.mark.skipif(
    not NATIVE_STREAMS, reason="the native module has no stream_to in this build"
)
IMPLS = ["reference", pytest.param("native", marks=needs_native)]
LISTENING = re.compile(r"^listening on 127\.0\.0\.1:(\d+)$")
# The CLI, writing its own peak RSS (VmHWM, in KiB) at its exit to the file named first.
# Not the child's rusage: Linux counts the parent's peak, met at fork and exec, into that.
PEAK_CLI = [
    sys.executable,
    "-c",
    "import atexit, sys\n"
    "def peak():\n"
    "    with open('/proc/self/status') as f:\n"
    "        hwm = next(line for line in f if line.startswith('VmHWM:'))\n"
    "    with open(sys.argv[1], 'w') as out:\n"
    "        out.write(hwm.split()[1])\n"
    "atexit.register(peak)\n"
    "from gradstream.cli import main\n"
    "sys.exit(main(sys.argv[2:]))\n",
]
needs_proc = pytest.mark.skipif(
    not Path("/proc/self/status").exists(), reason="peak RSS is read from /proc"
)


# --------------------------------------------------------------------------- helpers


class Child:
    """A CLI process whose stdout and stderr are read in threads (reads can time out)."""

    def __init__(self, args: list[str], command: list[str] = CLI) -> None:
        self.proc = subprocess.Popen(
            [*command, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._stderr: list[str] = []
        self._first: str | None = None
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

    def first_line(self) -> str:
        try:
            line = self._lines.get(timeout=TIMEOUT)
        except queue.Empty:
            pytest.fail("no output from the child in time")
        assert line is not None, f"the child printed nothing; stderr: {self.finish()[2]!r}"
        self._first = line
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
        lines = [self._first] if self._first is not None else []
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


@pytest.fixture
def spawn() -> Iterator[list[Child]]:
    """Children started through this list are killed at the end of the test."""
    children: list[Child] = []
    yield children
    for child in children:
        child.kill()


def start(spawn: list[Child], *args: str, command: list[str] = CLI) -> Child:
    child = Child(list(args), command)
    spawn.append(child)
    return child


def start_receiver(spawn: list[Child], *args: str, command: list[str] = CLI) -> tuple[Child, int]:
    child = start(spawn, "recv", "127.0.0.1:0", *args, command=command)
    line = child.first_line()
    match = LISTENING.match(line)
    assert match, line
    return child, int(match[1])


def run(*args: str) -> subprocess.CompletedProcess[str]:
    """Run the CLI to completion (killed after TIMEOUT)."""
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=TIMEOUT)


def assert_one_line_error(stderr: str, *needles: str) -> None:
    assert "Traceback" not in stderr, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    assert lines[0].startswith("gradstream"), stderr
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
    """What a Python peer keeping dtypes and shapes sends for `grad`."""
    s = ref.GradientStreamSession("peer", chunk_size, keep_dtype=True, keep_shape=True)
    return bytes(s.encode_frames(grad))


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


# --------------------------------------------------------------------------- transfers


@pytest.mark.parametrize(
    ("send_impl", "recv_impl"),
    [
        ("reference", "reference"),
        pytest.param("native", "native", marks=needs_native),
        pytest.param("native", "reference", marks=needs_native),
        pytest.param("reference", "native", marks=needs_native),
    ],
)
def test_send_recv_bit_equal(
    tmp_path: Path, spawn: list[Child], send_impl: str, recv_impl: str
) -> None:
    grad = gradient(3000, shape=(3, 1000))
    src, out = tmp_path / "grad.npy", tmp_path / "out.npy"
    np.save(src, grad)
    receiver, port = start_receiver(spawn, "--out", str(out), "--impl", recv_impl)
    sent = run("send", f"127.0.0.1:{port}", str(src), "--impl", send_impl, "--chunk-size", "256")
    assert sent.returncode == 0, sent.stderr
    assert "12 chunks" in sent.stdout
    assert "3,000 float32 values, 1-D (flattened from shape (3, 1000)) (" in sent.stdout
    status, stdout, stderr = receiver.finish()
    assert status == 0, stderr
    assert stderr == ""
    assert "received gradient: 3,000 float32 values, 1-D (" in stdout
    assert "all 12 chunk CRC-32 checks passed" in stdout
    back = np.load(out)
    assert back.shape == (3000,)
    assert bit_equal(back, grad)


@pytest.mark.parametrize("impl", IMPLS)
def test_send_compact_layout_is_received_by_a_default_receiver(
    tmp_path: Path, spawn: list[Child], impl: str
) -> None:
    grad = gradient(5000, seed=3)
    src, out = tmp_path / "grad.npy", tmp_path / "out.npy"
    np.save(src, grad)
    receiver, port = start_receiver(spawn, "--out", str(out), "--impl", impl)
    sent = run(
        "send", f"127.0.0.1:{port}", str(src), "--impl", impl,
        "--chunk-size", "1000", "--layout", "compact",
    )  # fmt: skip
    assert sent.returncode == 0, sent.stderr
    status, stdout, stderr = receiver.finish()
    assert status == 0, stderr
    assert "all 5 chunk CRC-32 checks passed" in stdout
    assert bit_equal(np.load(out), grad)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("codec", ["lz4", "zstd"])
def test_send_compressed_is_received_by_a_default_receiver(
    tmp_path: Path, spawn: list[Child], impl: str, codec: str
) -> None:
    grad = gradient(5000, seed=4)
    grad[::3] = 0.0
    src, out = tmp_path / "grad.npy", tmp_path / "out.npy"
    np.save(src, grad)
    receiver, port = start_receiver(spawn, "--out", str(out), "--impl", impl)
    sent = run(
        "send", f"127.0.0.1:{port}", str(src), "--impl", impl,
        "--chunk-size", "1000", "--compression", codec,
    )  # fmt: skip
    assert sent.returncode == 0, sent.stderr
    status, stdout, stderr = receiver.finish()
    assert status == 0, stderr
    assert "all 5 chunk CRC-32 checks passed" in stdout
    assert bit_equal(np.load(out), grad)


def test_send_unknown_layout_is_a_usage_error(tmp_path: Path) -> None:
    np.save(tmp_path / "g.npy", gradient(10))
    done = run("send", "127.0.0.1:9", str(tmp_path / "g.npy"), "--layout", "dense")
    assert done.returncode == 2
    assert "invalid choice" in done.stderr and len(done.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("impl", IMPLS)
def test_count_two(tmp_path: Path, spawn: list[Child], impl: str) -> None:
    a, b = gradient(1000, seed=1), gradient(0)
    np.save(tmp_path / "a.npy", a)
    np.save(tmp_path / "b.npy", b)
    receiver, port = start_receiver(
        spawn, "--out", str(tmp_path / "out.npy"), "--count", "2", "--impl", impl
    )
    sent = run(
        "send", f"127.0.0.1:{port}", str(tmp_path / "a.npy"), str(tmp_path / "b.npy"),
        "--impl", impl, "--chunk-size", "100",
    )  # fmt: skip
    assert sent.returncode == 0, sent.stderr
    status, stdout, stderr = receiver.finish()
    assert status == 0, stderr
    assert "gradient 1/2" in stdout and "gradient 2/2" in stdout
    assert "all 11 chunk CRC-32 checks passed" in stdout
    assert not (tmp_path / "out.npy").exists()
    assert bit_equal(np.load(tmp_path / "out-0.npy"), a)
    assert bit_equal(np.load(tmp_path / "out-1.npy"), b)


def test_count_two_but_peer_sends_one(tmp_path: Path, spawn: list[Child]) -> None:
    np.save(tmp_path / "a.npy", gradient(100))
    receiver, port = start_receiver(
        spawn, "--out", str(tmp_path / "out.npy"), "--count", "2", "--impl", "reference"
    )
    sent = run("send", f"127.0.0.1:{port}", str(tmp_path / "a.npy"), "--impl", "reference")
    assert sent.returncode == 0, sent.stderr
    status, _, stderr = receiver.finish()
    assert status == 1
    assert_one_line_error(stderr, "closed the connection after 1 of 2")
    assert (tmp_path / "out-0.npy").exists() and not (tmp_path / "out-1.npy").exists()


def test_peer_closes_without_sending(tmp_path: Path, spawn: list[Child]) -> None:
    receiver, port = start_receiver(spawn, "--out", str(tmp_path / "o.npy"), "--impl", "reference")
    socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT).close()
    status, _, stderr = receiver.finish()
    assert status == 1
    assert_one_line_error(stderr, "closed the connection before sending a gradient")
    assert not (tmp_path / "o.npy").exists()


# --------------------------------------------------------------------------- hostile peers


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(
    ("garbage", "error_class"),
    [
        # payload_len 0xefbeadde is far above max_payload_len.
        (b"\xde\xad\xbe\xef" * 16, "FrameError"),
        (b"only ten b", "FrameError"),  # the peer closes inside the first header
        (frame(0, 1, b"not arrow at all", 0x12345678), "ChecksumMismatchError"),
        # The right CRC, so the payload is decoded: it is no Arrow IPC file.
        (frame(0, 2, b"x" * 8), "ArrowIpcError"),
    ],
)
def test_garbage_peer(
    tmp_path: Path, spawn: list[Child], impl: str, garbage: bytes, error_class: str
) -> None:
    out = tmp_path / "out.npy"
    receiver, port = start_receiver(spawn, "--out", str(out), "--impl", impl, "--timeout", "30")
    with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT) as peer:
        peer.sendall(garbage)
        peer.shutdown(socket.SHUT_WR)
        status, _, stderr = receiver.finish()
    assert status == 1
    assert_one_line_error(stderr, "transfer failed", f"({error_class})")
    assert not out.exists()


def test_stalled_peer_times_out(tmp_path: Path, spawn: list[Child]) -> None:
    receiver, port = start_receiver(
        spawn, "--out", str(tmp_path / "o.npy"), "--impl", "reference", "--timeout", "0.5"
    )
    with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT) as peer:
        peer.sendall(b"\x00\x00\x00\x00")  # a quarter of a header, then silence
        status, _, stderr = receiver.finish()
    assert status == 1
    assert_one_line_error(stderr, "transfer failed", "(StreamTimeoutError)")


def test_nobody_connects_times_out(tmp_path: Path, spawn: list[Child]) -> None:
    receiver, _ = start_receiver(
        spawn, "--out", str(tmp_path / "o.npy"), "--impl", "reference", "--timeout", "0.3"
    )
    status, _, stderr = receiver.finish()
    assert status == 1
    assert_one_line_error(stderr, "no connection within 0.3 s")


def test_ctrl_c_exits_130_quietly(tmp_path: Path, spawn: list[Child]) -> None:
    receiver, _ = start_receiver(spawn, "--out", str(tmp_path / "o.npy"), "--impl", "reference")
    time.sleep(0.2)  # into accept()
    receiver.proc.send_signal(signal.SIGINT)
    status, _, stderr = receiver.finish()
    assert status == 130
    assert stderr == ""


# --------------------------------------------------------------------------- sender errors


def test_connection_refused(tmp_path: Path) -> None:
    np.save(tmp_path / "g.npy", gradient(10))
    result = run("send", f"127.0.0.1:{free_port()}", str(tmp_path / "g.npy"), "--impl", "reference")
    assert result.returncode == 1
    assert_one_line_error(result.stderr, "cannot connect to 127.0.0.1:", "refused")


def test_missing_file(tmp_path: Path) -> None:
    result = run("send", f"127.0.0.1:{free_port()}", str(tmp_path / "nope.npy"))
    assert result.returncode == 1
    assert_one_line_error(result.stderr, "nope.npy", "no such file")


def test_not_a_npy_file(tmp_path: Path) -> None:
    (tmp_path / "text.npy").write_text("hello\n")
    result = run("send", f"127.0.0.1:{free_port()}", str(tmp_path / "text.npy"))
    assert result.returncode == 1
    assert_one_line_error(result.stderr, "cannot read", "as a .npy file")


@pytest.mark.parametrize("dtype", ["float64", "float16", "int32"])
def test_wrong_dtype(tmp_path: Path, dtype: str) -> None:
    np.save(tmp_path / "g.npy", np.arange(10).astype(dtype))
    result = run("send", f"127.0.0.1:{free_port()}", str(tmp_path / "g.npy"))
    assert result.returncode == 1
    assert_one_line_error(result.stderr, f"holds {dtype} values", "float32 only", "astype")


def test_big_endian_float32_is_accepted(tmp_path: Path, spawn: list[Child]) -> None:
    grad = gradient(500)
    np.save(tmp_path / "be.npy", grad.astype(">f4"))
    receiver, port = start_receiver(spawn, "--out", str(tmp_path / "o.npy"), "--impl", "reference")
    sent = run("send", f"127.0.0.1:{port}", str(tmp_path / "be.npy"), "--impl", "reference")
    assert sent.returncode == 0, sent.stderr
    assert receiver.finish()[0] == 0
    assert bit_equal(np.load(tmp_path / "o.npy"), grad)


@pytest.mark.parametrize(
    "address",
    ["localhost", "127.0.0.1:", "127.0.0.1:http", "127.0.0.1:70000", "127.0.0.1:0", "::1:5",
     "[::1", "[::1]5", ":5000"],
)  # fmt: skip
def test_send_bad_address(tmp_path: Path, address: str) -> None:
    np.save(tmp_path / "g.npy", gradient(10))
    result = run("send", address, str(tmp_path / "g.npy"))
    assert result.returncode == 2
    assert_one_line_error(result.stderr, "bad address", "HOST:PORT")


@pytest.mark.parametrize("address", ["abc", "127.0.0.1:99999", "127.0.0.1:-1", "host:"])
def test_recv_bad_address(tmp_path: Path, address: str) -> None:
    result = run("recv", address, "--out", str(tmp_path / "o.npy"))
    assert result.returncode == 2
    assert_one_line_error(result.stderr, "bad address", "[HOST:]PORT")


def test_recv_into_missing_directory(tmp_path: Path) -> None:
    result = run("recv", "0", "--out", str(tmp_path / "no" / "o.npy"), "--impl", "reference")
    assert result.returncode == 1
    assert_one_line_error(result.stderr, "does not exist")


@pytest.mark.parametrize(
    "args",
    [["recv"], ["send", "127.0.0.1:1"], ["recv", "0", "--out", "o.npy", "--count", "x"], []],
)
def test_usage_errors_are_one_line(args: list[str]) -> None:
    result = run(*args)
    assert result.returncode == 2
    assert_one_line_error(result.stderr, "error:")


@pytest.mark.parametrize("command", [[], ["recv"], ["send"], ["demo"]])
def test_help(command: list[str]) -> None:
    result = run(*command, "--help")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"usage: {' '.join(['gradstream', *command])}")


@pytest.mark.parametrize("args", [["bench"], ["bench", "--quick"], ["bench", "--help"]])
def test_bench_is_not_a_subcommand(args: list[str]) -> None:
    # The benchmark lives in the repository (benches/, `make bench`), not in the package.
    result = run(*args)
    assert result.returncode == 2
    assert_one_line_error(result.stderr, "invalid choice: 'bench'")
    assert "bench" not in run("--help").stdout


# --------------------------------------------------------------------------- what arrives


@pytest.mark.parametrize("impl", IMPLS)
def test_recv_says_the_dtype_and_shape_that_arrived(
    tmp_path: Path, spawn: list[Child], impl: str
) -> None:
    grads = [
        gradient(24).astype(np.float64).reshape(2, 3, 4),
        gradient(5).astype(np.float16),
        np.array(1.5, np.float32),
    ]
    receiver, port = start_receiver(
        spawn, "--out", str(tmp_path / "o.npy"), "--count", "3", "--impl", impl
    )
    status, stdout, stderr = feed(receiver, port, b"".join(python_frames(g) for g in grads))
    assert status == 0, stderr
    assert "received gradient 1/3: 24 float64 values, shape (2, 3, 4) (" in stdout
    assert "received gradient 2/3: 5 float16 values, 1-D (" in stdout
    assert "received gradient 3/3: 1 float32 value, shape () (" in stdout
    for i, grad in enumerate(grads):
        back = np.load(tmp_path / f"o-{i}.npy")
        assert back.dtype == grad.dtype and back.shape == grad.shape
        assert np.array_equal(back, grad, equal_nan=True)


# --------------------------------------------------------------------------- --max-bytes

# Compressed zeros: a few KB on the wire that decode to many MiB. (dtype, values, chunk
# size, --max-bytes.)
BOMBS = {
    # 64 MiB in one chunk, refused from its declared rows before it is decompressed.
    "one-chunk": (np.float32, 2**24, 2**24, "1M"),
    # 128 MiB of float64 in 32 chunks of 4 MiB: the values pile up to the room (32 MiB at
    # 8 bytes a value) and no further.
    "float64-chunks": (np.float64, 2**24, 2**19, "32M"),
}
# Beyond --max-bytes, what one chunk's decoding and the allocator may add to the peak.
PEAK_SLACK = 16 * 2**20


@functools.cache
def bomb_wire(name: str) -> bytes:
    dtype, n, chunk_size, _ = BOMBS[name]
    s = gradstream.GradientStreamSession(
        "bomb", chunk_size, layout="compact", compression="zstd", keep_dtype=True
    )
    return bytes(s.encode_frames(np.zeros(n, dtype)))


def receive_measured(
    spawn: list[Child], where: Path, impl: str, wire: bytes, *args: str
) -> tuple[int, str, int]:
    """A receiver into the empty directory `where` fed `wire`: (status, stderr, peak RSS)."""
    where.mkdir()
    peak = where.parent / f"{where.name}.peak"
    receiver, port = start_receiver(
        spawn, "--out", str(where / "o.npy"), "--impl", impl, *args,
        command=[*PEAK_CLI, str(peak)],
    )  # fmt: skip
    status, _, stderr = feed(receiver, port, wire)
    return status, stderr, int(peak.read_text()) * 1024


@needs_proc
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("bomb", list(BOMBS))
def test_max_bytes_stops_a_compression_bomb(
    tmp_path: Path, spawn: list[Child], impl: str, bomb: str
) -> None:
    dtype, n, _, max_bytes = BOMBS[bomb]
    size = n * np.dtype(dtype).itemsize
    wire = bomb_wire(bomb)
    assert len(wire) * 1000 < size
    # The same receiver taking a small compressed gradient: the process's own footprint.
    small = gradstream.GradientStreamSession("s", compression="zstd").encode_frames(
        np.zeros(1000, np.float32)
    )
    base_status, base_err, base = receive_measured(
        spawn, tmp_path / "base", impl, small, "--max-bytes", max_bytes
    )
    assert base_status == 0, base_err
    status, stderr, peak = receive_measured(
        spawn, tmp_path / "bomb", impl, wire, "--max-bytes", max_bytes
    )
    assert status == 1
    assert_one_line_error(stderr, f"gradient refused: it would pass --max-bytes {max_bytes} (")
    assert list((tmp_path / "bomb").iterdir()) == []
    grown = peak - base
    assert grown < parse_size(max_bytes) + PEAK_SLACK, (grown, base)
    assert grown < size / 2, (grown, base)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(
    ("dtype", "n", "fits"),
    [
        (np.float64, 8192, True),  # 64 KiB exactly
        (np.float64, 8193, False),
        # Room is counted at 8 bytes a value, so float32 gets half of it.
        (np.float32, 8192, True),
        (np.float32, 8193, False),
    ],
)
def test_max_bytes_exact_fit(
    tmp_path: Path, spawn: list[Child], impl: str, dtype: type, n: int, fits: bool
) -> None:
    grad = gradient(n).astype(dtype)
    out = tmp_path / "o.npy"
    receiver, port = start_receiver(spawn, "--out", str(out), "--impl", impl, "--max-bytes", "64K")
    status, _, stderr = feed(receiver, port, python_frames(grad, chunk_size=1000))
    if fits:
        assert status == 0, stderr
        back = np.load(out)
        assert back.dtype == grad.dtype and np.array_equal(back, grad, equal_nan=True)
    else:
        assert status == 1
        assert_one_line_error(
            stderr,
            "gradient refused: it would pass --max-bytes 64K (65,536 bytes in all, 65,536 "
            "left, room for 8,192 values of up to 8 bytes): ",
            "max_gradient_len 8192",
        )
        assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(("dtype", "fits"), [(np.float32, True), (np.float64, False)])
def test_max_bytes_below_one_wide_value(
    tmp_path: Path, spawn: list[Child], impl: str, dtype: type, fits: bool
) -> None:
    # Room for less than one float64: the session still takes one value (its least), and
    # the gradient's bytes decide before it is written.
    out = tmp_path / "o.npy"
    receiver, port = start_receiver(spawn, "--out", str(out), "--impl", impl, "--max-bytes", "4")
    status, _, stderr = feed(receiver, port, python_frames(np.ones(1, dtype)))
    if fits:
        assert status == 0, stderr
        assert np.load(out).dtype == dtype
    else:
        assert status == 1
        assert_one_line_error(
            stderr, "--max-bytes 4 (4 bytes in all, 4 left", "it arrived as 8 bytes (1 float64"
        )
        assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("impl", IMPLS)
def test_max_bytes_counts_the_whole_run(tmp_path: Path, spawn: list[Child], impl: str) -> None:
    a, b = gradient(1024, seed=1), gradient(1100, seed=2)  # 4 KiB, then 4,400 bytes
    np.save(tmp_path / "a.npy", a)
    np.save(tmp_path / "b.npy", b)
    out = tmp_path / "out"
    out.mkdir()
    receiver, port = start_receiver(
        spawn, "--out", str(out / "o.npy"), "--count", "2", "--impl", impl, "--max-bytes", "8K"
    )
    # The sender may see the receiver go away while it sends b: its status is not the point.
    run("send", f"127.0.0.1:{port}", str(tmp_path / "a.npy"), str(tmp_path / "b.npy"),
        "--impl", impl, "--chunk-size", "100")  # fmt: skip
    status, stdout, stderr = receiver.finish()
    assert status == 1
    assert "received gradient 1/2: 1,024 float32 values, 1-D" in stdout
    assert_one_line_error(
        stderr,
        "gradient 2/2 refused: it would pass --max-bytes 8K (8,192 bytes in all, 4,096 left, "
        "room for 512 values of up to 8 bytes): ",
    )
    assert sorted(p.name for p in out.iterdir()) == ["o-0.npy"]
    assert bit_equal(np.load(out / "o-0.npy"), a)


@pytest.mark.parametrize(
    "value", ["0", "0K", "-1", "-4G", "1.5G", "4 G", "4GiB", "1T", "G", "abc", "", "0x10", "١٢"]
)
def test_max_bytes_usage_errors(tmp_path: Path, value: str) -> None:
    result = run("recv", "0", "--out", str(tmp_path / "o.npy"), f"--max-bytes={value}")
    assert result.returncode == 2
    assert_one_line_error(result.stderr, "argument --max-bytes: ")
    assert list(tmp_path.iterdir()) == []


def test_max_bytes_in_help() -> None:
    help_text = " ".join(run("recv", "--help").stdout.split())
    assert "--max-bytes B" in help_text and "default 4G" in help_text
    assert "8 bytes a value" in help_text


# --------------------------------------------------------------------------- demo


@pytest.mark.parametrize("impl_only", [*IMPLS, pytest.param(None, marks=needs_native)])
def test_demo_small(impl_only: str | None) -> None:
    args = ["demo", "--elements", "100000", "--chunk-size", "4096"]
    if impl_only:
        args += ["--impl-only", impl_only]
    result = run(*args)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.rstrip().endswith("verified")
    assert ": bit-equal (" in result.stdout
    if impl_only is None:
        assert "native vs reference:" in result.stdout


# --------------------------------------------------------------------------- in-process units


def test_parse_address() -> None:
    assert parse_address("10.0.0.1:80") == ("10.0.0.1", 80)
    assert parse_address("[::1]:9000") == ("::1", 9000)
    assert parse_address("9000", default_host="127.0.0.1") == ("127.0.0.1", 9000)
    assert parse_address("0", default_host="h", allow_port_zero=True) == ("h", 0)
    with pytest.raises(CliError) as info:
        parse_address("0", default_host="h")
    assert info.value.status == 2


def test_output_paths() -> None:
    assert output_paths(Path("d/g.npy"), 1) == [Path("d/g.npy")]
    assert output_paths(Path("d/g.npy"), 3) == [Path(f"d/g-{i}.npy") for i in range(3)]
    assert output_paths(Path("g"), 2) == [Path("g-0"), Path("g-1")]


def test_parse_size() -> None:
    assert parse_size("1") == 1
    assert parse_size("4096") == 4096
    assert parse_size("64K") == parse_size("64k") == 64 * 2**10
    assert parse_size("512M") == 512 * 2**20
    assert parse_size("4G") == 4 * 2**30
    for bad in ["0", "-1", "1.5G", " 1", "1 ", "+1", "1_000", "1e6", "1KB", "K", "\uff12"]:
        with pytest.raises(ValueError):
            parse_size(bad)
    assert format_size(4 * 2**30) == "4G"
    assert format_size(1536 * 2**20) == "1536M"
    assert format_size(1000) == "1000"
    for size in [1, 1000, 2**10, 3 * 2**20 + 2**10, 2**40]:
        assert parse_size(format_size(size)) == size
