"""`gradstream send` and `recv` hand back what was sent (docs/guides/cli.md): a file's
dtype (float16, float32, float64) and shape over a gradstream connection, the compact
layout, and the wire bytes beside the value bytes in the summary line; `--protocol seed`
keeps the original's flat float32. And the errors a user met trying it: a directory, a
text file, a port without its host. (.npz and .safetensors files, sent as tensor sets:
test_cli_tensor_sets.py.)"""

from __future__ import annotations

import http.server
import re
import signal
import socket
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from support.cli import (
    Child,
    assert_one_line_error,
    free_port,
    python_frames,
    run,
    start,
    start_receiver,
)


def bits(a: np.ndarray) -> np.ndarray:
    return a.view(np.dtype(f"u{a.dtype.itemsize}"))


def wire_and_values(line: str) -> tuple[int, int]:
    match = re.search(r"\(([\d,]+) bytes of values, ([\d,]+) bytes on the wire\)", line)
    assert match, line
    return int(match[1].replace(",", "")), int(match[2].replace(",", ""))


@pytest.mark.parametrize(
    "grad",
    [
        np.linspace(-1, 1, 600, dtype=np.float64).reshape(20, 30),
        (np.arange(60, dtype=np.float16) - 7).reshape(3, 4, 5),
        np.arange(100, dtype=np.float32).reshape(10, 10),
    ],
    ids=["float64", "float16", "float32"],
)
def test_send_keeps_dtype_and_shape(tmp_path: Path, spawn: list[Child], grad: np.ndarray) -> None:
    src, out = tmp_path / "g.npy", tmp_path / "out.npy"
    np.save(src, grad)
    receiver, port = start_receiver(spawn, "--out", str(out))
    sent = run("send", f"127.0.0.1:{port}", str(src))
    assert sent.returncode == 0, sent.stderr
    assert f"{grad.size:,} {grad.dtype.name} values, shape {grad.shape} (" in sent.stdout
    values, wire = wire_and_values(sent.stdout)
    # The compact layout: the values, plus each chunk's header and schema.
    assert values == grad.nbytes and values < wire < values + 2000
    status, stdout, stderr = receiver.finish()
    assert status == 0, stderr
    assert f"{grad.dtype.name} values, shape {grad.shape}" in stdout
    back = np.load(out)
    assert back.dtype == grad.dtype and back.shape == grad.shape
    assert np.array_equal(bits(back), bits(grad))


def test_protocol_seed_keeps_flat_float32(tmp_path: Path, spawn: list[Child]) -> None:
    grad = np.arange(4000, dtype=np.float32).reshape(40, 100)
    src, out = tmp_path / "g.npy", tmp_path / "out.npy"
    np.save(src, grad)
    receiver, port = start_receiver(spawn, "--out", str(out), "--protocol", "seed")
    sent = run("send", f"127.0.0.1:{port}", str(src), "--protocol", "seed")
    assert sent.returncode == 0, sent.stderr
    assert "4,000 float32 values, 1-D (flattened from shape (40, 100)) (" in sent.stdout
    values, wire = wire_and_values(sent.stdout)
    assert wire > 1.9 * values  # the seed layout: an index beside every value
    assert receiver.finish()[0] == 0
    back = np.load(out)
    assert back.shape == (4000,) and np.array_equal(back, grad.reshape(-1))


def test_an_explicit_layout_wins(tmp_path: Path, spawn: list[Child]) -> None:
    grad = np.arange(4000, dtype=np.float32)
    src, out = tmp_path / "g.npy", tmp_path / "out.npy"
    np.save(src, grad)
    receiver, port = start_receiver(spawn, "--out", str(out))
    sent = run("send", f"127.0.0.1:{port}", str(src), "--layout", "seed")
    assert sent.returncode == 0, sent.stderr
    values, wire = wire_and_values(sent.stdout)
    assert wire > 1.9 * values
    assert receiver.finish()[0] == 0
    assert np.array_equal(np.load(out), grad)


def test_send_a_directory(tmp_path: Path) -> None:
    result = run("send", f"127.0.0.1:{free_port()}", str(tmp_path))
    assert result.returncode == 1
    assert_one_line_error(result.stderr, f"cannot read {tmp_path}: it is a directory")
    assert "no such file" not in result.stderr


def test_send_a_text_file(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("a gradient, honest\n")
    result = run("send", f"127.0.0.1:{free_port()}", str(tmp_path / "notes.txt"))
    assert result.returncode == 1
    assert_one_line_error(result.stderr, "notes.txt: not a .npy file", "numpy.save")
    assert "pickle" not in result.stderr


def test_send_to_a_port_without_its_host(tmp_path: Path) -> None:
    np.save(tmp_path / "g.npy", np.ones(3, np.float32))
    result = run("send", "7000", str(tmp_path / "g.npy"))
    assert result.returncode == 2
    assert_one_line_error(result.stderr, "bad address '7000': no host", "127.0.0.1:7000")


# --------------------------------------------------------------------------- Ctrl-C


def _silent_listener() -> tuple[socket.socket, int]:
    """A TCP listener that accepts and never reads (nor answers)."""
    listener = socket.create_server(("127.0.0.1", 0))
    return listener, listener.getsockname()[1]


def test_ctrl_c_on_send_names_the_file_it_dropped(tmp_path: Path, spawn: list[Child]) -> None:
    np.save(tmp_path / "big.npy", np.ones(16 << 20, np.float32))  # 64 MiB: fills the buffers
    listener, port = _silent_listener()
    with listener:
        # --timeout bounds the exit: under load, the connection's close was once seen to
        # wait for the stopped send's job (the peer never reads) up to that bound.
        sender = start(
            spawn,
            "send",
            f"127.0.0.1:{port}",
            str(tmp_path / "big.npy"),
            "--protocol",
            "seed",
            "--timeout",
            "5",
        )
        conn, _ = listener.accept()
        with conn:
            conn.recv(65536)  # the send is under way; nothing more is read
            time.sleep(0.5)
            sender.proc.send_signal(signal.SIGINT)
            status, _, stderr = sender.finish()
    assert status == 130, stderr
    assert_one_line_error(stderr, "gradstream: interrupted while sending", "big.npy", "bytes")
    assert re.search(r"\(([\d,]+) bytes of it written\)", stderr)


def test_ctrl_c_on_send_while_connecting(tmp_path: Path, spawn: list[Child]) -> None:
    np.save(tmp_path / "g.npy", np.ones(10, np.float32))
    listener, port = _silent_listener()
    with listener:
        sender = start(
            spawn, "send", f"127.0.0.1:{port}", str(tmp_path / "g.npy"), "--timeout", "5"
        )
        conn, _ = listener.accept()
        with conn:
            time.sleep(0.5)
            sender.proc.send_signal(signal.SIGINT)
            status, _, stderr = sender.finish()
    assert status == 130, stderr
    assert_one_line_error(stderr, f"gradstream: interrupted while connecting to 127.0.0.1:{port}")


def test_ctrl_c_on_recv_names_the_transfer_it_dropped(tmp_path: Path, spawn: list[Child]) -> None:
    grad = np.ones(100_000, np.float32)
    wire = python_frames(grad, chunk_size=10_000)
    receiver, port = start_receiver(spawn, "--out", str(tmp_path / "o.npy"), "--protocol", "seed")
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(wire[: len(wire) // 2])  # half the gradient, then nothing
        time.sleep(1.0)
        receiver.proc.send_signal(signal.SIGINT)
        status, stdout, _ = receiver.finish()
    assert status == 130
    last = stdout.splitlines()[-1]
    assert last.startswith("stopped by SIGINT after 0 gradients; dropped the gradient under way ")
    assert re.search(
        r"from 127\.0\.0\.1:\d+ \([\d,]+ bytes of it received, not acknowledged\)$", last
    )


# --------------------------------------------------------------------------- not a receiver


def test_send_to_an_http_proxy_says_so_at_once(tmp_path: Path) -> None:
    np.save(tmp_path / "g.npy", np.ones(10, np.float32))
    listener, port = _silent_listener()

    def answer() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")
            time.sleep(0.5)

    with listener:
        answering = threading.Thread(target=answer, daemon=True)
        answering.start()
        start = time.monotonic()
        result = run("send", f"127.0.0.1:{port}", str(tmp_path / "g.npy"))
        answering.join()
    assert time.monotonic() - start < 5.0
    assert result.returncode == 1
    assert_one_line_error(
        result.stderr,
        f"cannot connect to 127.0.0.1:{port}",
        "an HTTP answer ('HTTP/1.1 400 Bad'...): the peer is an HTTP server or proxy, "
        "not a gradstream peer",
    )


def test_send_to_a_silent_http_server_names_what_it_may_be(tmp_path: Path) -> None:
    np.save(tmp_path / "g.npy", np.ones(10, np.float32))
    server = http.server.HTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        result = run("send", f"127.0.0.1:{server.server_address[1]}", str(tmp_path / "g.npy"))
    finally:
        server.shutdown()
        server.server_close()
    assert result.returncode == 1
    # Silent until a newline: a hello whose random bytes hold one gets an HTML error page
    # at once (http.server reads it as an HTTP/0.9 request line), else the wait runs out.
    if "an HTML page" in result.stderr:
        assert_one_line_error(result.stderr, "the peer is an HTTP server, not a gradstream peer")
    else:
        assert_one_line_error(
            result.stderr, "no gradstream hello within 10 s: not a gradstream receiver"
        )
    assert "stalled" not in result.stderr
