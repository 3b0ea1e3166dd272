"""The `gradstream` command, run as real processes talking TCP on 127.0.0.1: transfers,
what arrives, hostile and broken peers, --max-bytes, usage errors (the demo:
test_demo.py).

The connection side (TLS, authkey, several workers, --forever, acknowledgements, the
seed protocol) is test_cli_connections.py. Helpers: support.cli.
"""

from __future__ import annotations

import functools
import signal
import socket
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import gradstream
from gradstream._cli_recv import output_path
from gradstream.cli import CliError, format_size, output_paths, parse_address, parse_size
from support.cli import (
    TIMEOUT,
    Child,
    assert_one_line_error,
    bit_equal,
    error_lines,
    feed,
    free_port,
    gradient,
    knock,
    push,
    python_frames,
    run,
    send_over_connection,
    start_receiver,
)
from support.frames import frame

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
SEED = ("--protocol", "seed")


def checks_passed(chunks: int) -> str:
    """recv's last line, with the chunks counted."""
    return f"all {chunks} chunk CRC-32 checks passed"


def refused_then_closed(receiver: Child, port: int, wire: bytes) -> tuple[int, str, str]:
    """A peer sends `wire` (bare frames) that the receiver refuses; then a one-value
    gradient ends the run (--count 1): (status, stdout, stderr)."""
    push(port, wire)
    return feed(receiver, port, python_frames(np.ones(1, np.float32)))


# --------------------------------------------------------------------------- transfers


def test_send_recv_bit_equal(tmp_path: Path, spawn: list[Child]) -> None:
    grad = gradient(3000, shape=(3, 1000))
    src, out = tmp_path / "grad.npy", tmp_path / "out.npy"
    np.save(src, grad)
    receiver, port = start_receiver(spawn, "--out", str(out))
    sent = run("send", f"127.0.0.1:{port}", str(src), "--chunk-size", "256")
    assert sent.returncode == 0, sent.stderr
    assert "12 chunks" in sent.stdout
    # A gradstream connection keeps the shape (docs/guides/connections.md "Defaults").
    assert "3,000 float32 values, shape (3, 1000) (12,000 bytes of values, " in sent.stdout
    assert sent.stdout.rstrip().endswith(", acknowledged")
    status, stdout, stderr = receiver.finish()
    assert status == 0, stderr
    assert stderr == ""
    assert "received gradient: 3,000 float32 values, shape (3, 1000) (" in stdout
    assert " from 127.0.0.1:" in stdout
    assert checks_passed(12) in stdout
    back = np.load(out)
    assert back.shape == (3, 1000)
    assert bit_equal(back, grad)


def test_send_compact_layout_is_received_by_a_default_receiver(
    tmp_path: Path, spawn: list[Child]
) -> None:
    grad = gradient(5000, seed=3)
    src, out = tmp_path / "grad.npy", tmp_path / "out.npy"
    np.save(src, grad)
    receiver, port = start_receiver(spawn, "--out", str(out))
    sent = run(
        "send", f"127.0.0.1:{port}", str(src),
        "--chunk-size", "1000", "--layout", "compact",
    )  # fmt: skip
    assert sent.returncode == 0, sent.stderr
    status, stdout, stderr = receiver.finish()
    assert status == 0, stderr
    assert checks_passed(5) in stdout
    assert bit_equal(np.load(out), grad)


@pytest.mark.parametrize("codec", ["lz4", "zstd"])
def test_send_compressed_is_received_by_a_default_receiver(
    tmp_path: Path, spawn: list[Child], codec: str
) -> None:
    grad = gradient(5000, seed=4)
    grad[::3] = 0.0
    src, out = tmp_path / "grad.npy", tmp_path / "out.npy"
    np.save(src, grad)
    receiver, port = start_receiver(spawn, "--out", str(out))
    sent = run(
        "send", f"127.0.0.1:{port}", str(src),
        "--chunk-size", "1000", "--compression", codec,
    )  # fmt: skip
    assert sent.returncode == 0, sent.stderr
    status, stdout, stderr = receiver.finish()
    assert status == 0, stderr
    assert checks_passed(5) in stdout
    assert bit_equal(np.load(out), grad)


def test_send_on_the_int8_wire(tmp_path: Path, spawn: list[Child]) -> None:
    """--wire-dtype int8: the receiver saves what the int8 wire carries (the same values
    a local encode and decode give), in the file's dtype; with --compression it is a
    command-line mistake."""
    grad = gradient(5000, seed=5)
    src, out = tmp_path / "grad.npy", tmp_path / "out.npy"
    np.save(src, grad)
    receiver, port = start_receiver(spawn, "--out", str(out))
    sent = run(
        "send", f"127.0.0.1:{port}", str(src), "--chunk-size", "1000", "--wire-dtype", "int8",
    )  # fmt: skip
    assert sent.returncode == 0, sent.stderr
    status, stdout, stderr = receiver.finish()
    assert status == 0, stderr
    assert checks_passed(5) in stdout
    local = gradstream.GradientStreamSession("x", 1000, wire_dtype="int8").encode_frames(grad)
    want = gradstream.GradientStreamSession("x", 1000).decode_frames(local)
    got = np.load(out)
    assert got.dtype == grad.dtype and bit_equal(got, want)
    assert not bit_equal(got, grad)
    refused = run(
        "send", "127.0.0.1:9", str(src), "--wire-dtype", "int8", "--compression", "lz4",
    )  # fmt: skip
    assert refused.returncode == 2
    assert "wire_dtype='int8' does not combine with compression='lz4'" in refused.stderr


def test_send_unknown_layout_is_a_usage_error(tmp_path: Path) -> None:
    np.save(tmp_path / "g.npy", gradient(10))
    done = run("send", "127.0.0.1:9", str(tmp_path / "g.npy"), "--layout", "dense")
    assert done.returncode == 2
    assert "invalid choice" in done.stderr and len(done.stderr.strip().splitlines()) == 1


def test_count_two(tmp_path: Path, spawn: list[Child]) -> None:
    a, b = gradient(1000, seed=1), gradient(0)
    np.save(tmp_path / "a.npy", a)
    np.save(tmp_path / "b.npy", b)
    receiver, port = start_receiver(spawn, "--out", str(tmp_path / "out.npy"), "--count", "2")
    sent = run(
        "send", f"127.0.0.1:{port}", str(tmp_path / "a.npy"), str(tmp_path / "b.npy"),
        "--chunk-size", "100",
    )  # fmt: skip
    assert sent.returncode == 0, sent.stderr
    status, stdout, stderr = receiver.finish()
    assert status == 0, stderr
    assert "gradient 1/2" in stdout and "gradient 2/2" in stdout
    assert checks_passed(11) in stdout
    assert not (tmp_path / "out.npy").exists()
    assert bit_equal(np.load(tmp_path / "out-0.npy"), a)
    assert bit_equal(np.load(tmp_path / "out-1.npy"), b)


def test_count_two_but_the_only_worker_sends_one(tmp_path: Path, spawn: list[Child]) -> None:
    # Another worker may still come: the run waits, and --timeout ends the wait once no
    # connection is open. The timeout also bounds the wait for the first sender, whose
    # interpreter start (numpy, pyarrow) takes seconds on a loaded machine: 5 s, not 1.
    np.save(tmp_path / "a.npy", gradient(100))
    receiver, port = start_receiver(
        spawn, "--out", str(tmp_path / "out.npy"), "--count", "2",
        "--timeout", "5",
    )  # fmt: skip
    sent = run("send", f"127.0.0.1:{port}", str(tmp_path / "a.npy"))
    assert sent.returncode == 0, sent.stderr
    status, stdout, stderr = receiver.finish()
    assert status == 1
    assert "received gradient 1/2: 100 float32 values" in stdout
    assert_one_line_error(stderr, "no connection within 5 s (1 of 2 gradients received)")
    assert (tmp_path / "out-0.npy").exists() and not (tmp_path / "out-1.npy").exists()


@pytest.mark.parametrize("protocol", ["gradstream", "seed"])
def test_a_peer_that_closes_without_sending_is_no_failure(
    tmp_path: Path, spawn: list[Child], protocol: str
) -> None:
    out = tmp_path / "o.npy"
    receiver, port = start_receiver(spawn, "--out", str(out), "--protocol", protocol)
    knock(port)
    grad = gradient(50)
    np.save(tmp_path / "g.npy", grad)
    sent = run("send", f"127.0.0.1:{port}", str(tmp_path / "g.npy"),
               "--protocol", protocol)  # fmt: skip
    assert sent.returncode == 0, sent.stderr
    status, _, stderr = receiver.finish()
    assert status == 0, stderr
    if protocol == "seed":
        assert stderr == ""  # a bare-frames peer may leave before its first byte
    else:
        # No hello: the listener refused it (and says so: no hello, or a reset when it
        # closed before the listener's hello reached it), then served the next.
        assert_one_line_error(stderr, "gradstream: warning: listener 127.0.0.1:", " refused ")
    assert bit_equal(np.load(out), grad)


# --------------------------------------------------------------------------- hostile peers


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
def test_garbage_peer_is_logged_and_the_run_goes_on(
    tmp_path: Path, spawn: list[Child], garbage: bytes, error_class: str
) -> None:
    # Bare frames (--protocol seed) reach the frame decoder; a gradstream listener would
    # refuse them at the hello (test_cli_connections.py).
    out = tmp_path / "out.npy"
    receiver, port = start_receiver(spawn, "--out", str(out), "--timeout", "30", *SEED)
    status, _, stderr = refused_then_closed(receiver, port, garbage)
    assert status == 0, stderr
    assert_one_line_error(
        stderr, "gradstream: warning: gradient from 127.0.0.1:", f"({error_class})"
    )
    assert np.load(out).size == 1  # the good peer's, not the garbage


def test_stalled_peer_times_out(tmp_path: Path, spawn: list[Child]) -> None:
    receiver, port = start_receiver(
        spawn, "--out", str(tmp_path / "o.npy"), "--timeout", "0.5",
        *SEED,
    )  # fmt: skip
    with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT) as peer:
        peer.sendall(b"\x00\x00\x00\x00")  # a quarter of a header, then silence
        status, _, stderr = receiver.finish()
    assert status == 1
    warning, error = error_lines(stderr)
    assert warning.startswith("gradstream: warning: gradient from 127.0.0.1:")
    assert warning.endswith("(StreamTimeoutError)")
    assert error == "gradstream: error: no connection within 0.5 s"
    assert not (tmp_path / "o.npy").exists()


def test_nobody_connects_times_out(tmp_path: Path, spawn: list[Child]) -> None:
    receiver, _ = start_receiver(spawn, "--out", str(tmp_path / "o.npy"), "--timeout", "0.3")
    status, _, stderr = receiver.finish()
    assert status == 1
    assert_one_line_error(stderr, "no connection within 0.3 s")


def test_ctrl_c_exits_130_quietly(tmp_path: Path, spawn: list[Child]) -> None:
    receiver, _ = start_receiver(spawn, "--out", str(tmp_path / "o.npy"))
    time.sleep(0.2)  # into the accept loop
    receiver.proc.send_signal(signal.SIGINT)
    status, stdout, stderr = receiver.finish()
    assert status == 130
    assert stderr == ""
    assert stdout.endswith("stopped by SIGINT after 0 gradients")


# --------------------------------------------------------------------------- sender errors


def test_connection_refused(tmp_path: Path) -> None:
    np.save(tmp_path / "g.npy", gradient(10))
    result = run("send", f"127.0.0.1:{free_port()}", str(tmp_path / "g.npy"))
    assert result.returncode == 1
    assert_one_line_error(result.stderr, "cannot connect to 127.0.0.1:", ": Connection refused")


def test_missing_file(tmp_path: Path) -> None:
    result = run("send", f"127.0.0.1:{free_port()}", str(tmp_path / "nope.npy"))
    assert result.returncode == 1
    assert_one_line_error(result.stderr, "nope.npy", "no such file")


def test_not_a_npy_file(tmp_path: Path) -> None:
    (tmp_path / "text.npy").write_text("hello\n")
    result = run("send", f"127.0.0.1:{free_port()}", str(tmp_path / "text.npy"))
    assert result.returncode == 1
    # Named as what it is, not by numpy's words about pickles.
    assert_one_line_error(result.stderr, "cannot read", "not a .npy file", "numpy.save")
    assert "pickle" not in result.stderr


@pytest.mark.parametrize("dtype", ["float64", "float16", "int32"])
def test_wrong_dtype_for_the_seed_protocol(tmp_path: Path, dtype: str) -> None:
    np.save(tmp_path / "g.npy", np.arange(10).astype(dtype))
    result = run("send", f"127.0.0.1:{free_port()}", str(tmp_path / "g.npy"), "--protocol", "seed")
    assert result.returncode == 1
    assert_one_line_error(result.stderr, f"holds {dtype} values", "float32 only", "astype")


@pytest.mark.parametrize("dtype", ["int32", "complex64"])
def test_wrong_dtype(tmp_path: Path, dtype: str) -> None:
    np.save(tmp_path / "g.npy", np.arange(10).astype(dtype))
    result = run("send", f"127.0.0.1:{free_port()}", str(tmp_path / "g.npy"))
    assert result.returncode == 1
    assert_one_line_error(
        result.stderr,
        f"holds {dtype} values",
        "float16, bfloat16 (",
        "float32 or float64",
        "astype",
    )


def test_big_endian_float32_is_accepted(tmp_path: Path, spawn: list[Child]) -> None:
    grad = gradient(500)
    np.save(tmp_path / "be.npy", grad.astype(">f4"))
    receiver, port = start_receiver(spawn, "--out", str(tmp_path / "o.npy"))
    sent = run("send", f"127.0.0.1:{port}", str(tmp_path / "be.npy"))
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


@pytest.mark.parametrize("count", [[], ["--count", "3"], ["--forever"]])
def test_recv_into_missing_directory(tmp_path: Path, count: list[str]) -> None:
    result = run("recv", "0", "--out", str(tmp_path / "no" / "o.npy"),
                 *count)  # fmt: skip
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


@pytest.mark.parametrize("command", ["recv", "send"])
def test_help_names_the_connection_flags(command: str) -> None:
    help_text = " ".join(run(command, "--help").stdout.split())
    for flag in ["--protocol {gradstream,seed}", "--tls-cert FILE", "--tls-key FILE",
                 "--tls-ca FILE", "--authkey-file FILE", "-v, --verbose"]:  # fmt: skip
        assert flag in help_text, flag


@pytest.mark.parametrize("args", [["bench"], ["bench", "--quick"], ["bench", "--help"]])
def test_bench_is_not_a_subcommand(args: list[str]) -> None:
    # The benchmark lives in the repository (benches/, `make bench`), not in the package.
    result = run(*args)
    assert result.returncode == 2
    assert_one_line_error(result.stderr, "invalid choice: 'bench'")
    assert "bench" not in run("--help").stdout


# --------------------------------------------------------------------------- what arrives


def test_recv_says_the_dtype_and_shape_that_arrived(tmp_path: Path, spawn: list[Child]) -> None:
    grads = [
        gradient(24).astype(np.float64).reshape(2, 3, 4),
        gradient(5).astype(np.float16),
        np.array(1.5, np.float32),
    ]
    receiver, port = start_receiver(spawn, "--out", str(tmp_path / "o.npy"), "--count", "3")
    send_over_connection(port, grads)
    status, stdout, stderr = receiver.finish()
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
    spawn: list[Child], where: Path, wires: list[bytes], *args: str
) -> tuple[int, str, int]:
    """A seed receiver into the empty directory `where` fed each of `wires` over a
    connection of its own, the last ending the run: (status, stderr, peak RSS)."""
    where.mkdir()
    peak = where.parent / f"{where.name}.peak"
    receiver, port = start_receiver(
        spawn, "--out", str(where / "o.npy"), *SEED, *args,
        command=[*PEAK_CLI, str(peak)],
    )  # fmt: skip
    for wire in wires[:-1]:
        push(port, wire)
    status, _, stderr = feed(receiver, port, wires[-1])
    return status, stderr, int(peak.read_text()) * 1024


@needs_proc
@pytest.mark.parametrize("bomb", list(BOMBS))
def test_max_bytes_stops_a_compression_bomb(tmp_path: Path, spawn: list[Child], bomb: str) -> None:
    dtype, n, _, max_bytes = BOMBS[bomb]
    size = n * np.dtype(dtype).itemsize
    wire = bomb_wire(bomb)
    assert len(wire) * 1000 < size
    # The same receiver taking a small compressed gradient: the process's own footprint.
    small_grad = np.zeros(1000, np.float32)
    small = gradstream.GradientStreamSession("s", compression="zstd").encode_frames(small_grad)
    base_status, base_err, base = receive_measured(
        spawn, tmp_path / "base", [small], "--max-bytes", max_bytes
    )
    assert base_status == 0, base_err
    # The bomb, then the small gradient that ends the run.
    status, stderr, peak = receive_measured(
        spawn, tmp_path / "bomb", [wire, small], "--max-bytes", max_bytes
    )
    assert status == 0, stderr
    assert_one_line_error(
        stderr, "gradient from 127.0.0.1:", f"refused: it would pass --max-bytes {max_bytes} ("
    )
    assert [p.name for p in (tmp_path / "bomb").iterdir()] == ["o.npy"]
    assert bit_equal(np.load(tmp_path / "bomb" / "o.npy"), small_grad)
    grown = peak - base
    assert grown < parse_size(max_bytes) + PEAK_SLACK, (grown, base)
    assert grown < size / 2, (grown, base)


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
    tmp_path: Path, spawn: list[Child], dtype: type, n: int, fits: bool
) -> None:
    grad = gradient(n).astype(dtype)
    out = tmp_path / "o.npy"
    receiver, port = start_receiver(spawn, "--out", str(out), "--max-bytes", "64K", *SEED)
    if fits:
        status, _, stderr = feed(receiver, port, python_frames(grad, chunk_size=1000))
        assert status == 0, stderr
        back = np.load(out)
        assert back.dtype == grad.dtype and np.array_equal(back, grad, equal_nan=True)
    else:
        wire = python_frames(grad, chunk_size=1000)
        status, _, stderr = refused_then_closed(receiver, port, wire)
        assert status == 0, stderr
        assert_one_line_error(
            stderr,
            "refused: it would pass --max-bytes 64K (65,536 bytes a gradient: room for 8,192 "
            "values of up to 8 bytes): ",
            "max_gradient_len 8192",
        )
        assert np.load(out).size == 1  # the closing peer's; nothing of the refused one
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o.npy"]


def test_max_bytes_of_one_wide_value(tmp_path: Path, spawn: list[Child]) -> None:
    out = tmp_path / "o.npy"
    receiver, port = start_receiver(spawn, "--out", str(out), "--max-bytes", "8", *SEED)
    status, _, stderr = feed(receiver, port, python_frames(np.ones(1, np.float64)))
    assert status == 0, stderr
    assert np.load(out).dtype == np.float64


@pytest.mark.parametrize(
    ("args", "each"),
    [
        (["--max-bytes", "7"], ""),
        (["--max-bytes", "15", "--count", "2"], " for each of 2 gradients"),
    ],
)
def test_max_bytes_below_one_wide_value_a_gradient(
    tmp_path: Path, args: list[str], each: str
) -> None:
    # Room for less than one float64 a gradient: no gradient could be kept whole.
    result = run("recv", "0", "--out", str(tmp_path / "o.npy"), *args)
    assert result.returncode == 2
    assert_one_line_error(result.stderr, f"leaves less than 8 bytes{each}: no room for one value")


def test_max_bytes_is_shared_by_the_count(tmp_path: Path, spawn: list[Child]) -> None:
    # 8K over --count 2: 4K a gradient, room for 512 values of up to 8 bytes. The sender
    # learns it from the hello and refuses the 513-value gradient before a byte of it
    # leaves; the run goes on and takes the next one.
    a, b, c = gradient(512, seed=1), gradient(513, seed=2), gradient(512, seed=3)
    files = {}
    for name, grad in ("a", a), ("b", b), ("c", c):
        files[name] = str(tmp_path / f"{name}.npy")
        np.save(files[name], grad)
    out = tmp_path / "out"
    out.mkdir()
    receiver, port = start_receiver(
        spawn, "--out", str(out / "o.npy"), "--count", "2", "--max-bytes", "8K"
    )
    where = f"127.0.0.1:{port}"
    first = run("send", where, files["a"], files["b"], "--chunk-size", "100")
    assert first.returncode == 1
    assert f"sent {files['a']}: 512 float32 values" in first.stdout
    assert_one_line_error(
        first.stderr,
        f"sending {files['b']} (2 of 2) failed: gradient not delivered to {where}: ",
        "513 values",
        "512",
        "(DeliveryError)",
    )
    second = run("send", where, files["c"])
    assert second.returncode == 0, second.stderr
    status, _, stderr = receiver.finish()
    assert status == 0, stderr
    assert stderr == ""
    assert sorted(p.name for p in out.iterdir()) == ["o-0.npy", "o-1.npy"]
    assert bit_equal(np.load(out / "o-0.npy"), a)
    assert bit_equal(np.load(out / "o-1.npy"), c)


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
    assert "each gradient gets B/N" in help_text


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
    # --forever numbers every gradient, the first too.
    assert output_path(Path("d/g.npy"), 0, None) == Path("d/g-0.npy")
    assert output_path(Path("d/g.npy"), 41, None) == Path("d/g-41.npy")


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
