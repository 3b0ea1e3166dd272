"""`gradstream send` of a .npz archive or a .safetensors file sends its arrays as one
tensor set (names in the file's order, dtypes and shapes kept), and `recv --out FILE.npz`
or `FILE.safetensors` writes the set that came (docs/guides/cli.md "Tensor sets"). The
suffix of --out decides which kind a run takes; the other kind is refused at its first
chunk, with nothing written. The refusals of a file (a dtype that does not travel, a
pickled archive, --protocol seed, a missing package) come before anything connects.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import json
import re
import signal
import socket
import struct
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest

import gradstream as gs
from gradstream import _dtypes
from gradstream.cli import main
from support.cli import (
    Child,
    assert_one_line_error,
    free_port,
    run,
    start,
    start_receiver,
)

# The safetensors package (requirements-dev.txt; the `safetensors` extra): the cases of
# .safetensors files are skipped where it is missing, the .npz ones still run.
HAS_SAFETENSORS = importlib.util.find_spec("safetensors") is not None
needs_safetensors = pytest.mark.skipif(not HAS_SAFETENSORS, reason="safetensors not installed")

BF16 = np.dtype(ml_dtypes.bfloat16)
SUFFIXES = [".npz", pytest.param(".safetensors", marks=needs_safetensors)]


def values(n: int, dtype: np.dtype[Any], seed: int) -> np.ndarray:
    """`n` values of `dtype` with awkward bits: a NaN with a payload, -0.0, inf, and the
    smallest subnormal, then random ones."""
    g = np.random.default_rng(seed).standard_normal(n).astype(np.float32).astype(dtype)
    bits = g.view(np.dtype(f"u{dtype.itemsize}"))
    special = {
        2: [0x7E01, 0x8000, 0x7C00, 1] if dtype == np.float16 else [0x7FC1, 0x8000, 0x7F80, 1],
        4: [0x7FC01234, 0x80000000, 0x7F800000, 1],
        8: [0x7FF8000000001234, 0x8000000000000000, 0x7FF0000000000000, 1],
    }[dtype.itemsize]
    k = min(n, len(special))
    bits[:k] = np.array(special[:k], bits.dtype)
    return g


def a_set() -> dict[str, np.ndarray]:
    """The four dtypes in several shapes (a scalar and an empty one too), named in an
    order that is not sorted."""
    return {
        "fc.weight": values(12, np.dtype(np.float32), 1).reshape(3, 4),
        "embed": values(60, BF16, 2).reshape(3, 4, 5),
        "bias": values(7, np.dtype(np.float16), 3),
        "alpha": values(1, np.dtype(np.float64), 4).reshape(()),
        "empty": np.zeros((0, 3), BF16),
        "b.big": values(70_000, np.dtype(np.float64), 5).reshape(700, 100),
    }


def bits(a: np.ndarray) -> np.ndarray:
    return a.view(np.dtype(f"u{a.dtype.itemsize}"))


def save_set(path: Path, tensors: dict[str, np.ndarray]) -> None:
    if path.suffix == ".npz":
        np.savez(path, **tensors)
    else:
        importlib.import_module("safetensors.numpy").save_file(tensors, str(path))


def load_set(path: Path) -> dict[str, np.ndarray]:
    """The set in a written file, in its order, bfloat16 as bfloat16: a .npz holds it as
    numpy saves ml_dtypes' bfloat16 ('<V2'); a .safetensors file says BF16."""
    if path.suffix == ".npz":
        with np.load(path, allow_pickle=False) as z:
            got = {name: z[name] for name in z.files}
        return {k: v.view(BF16) if v.dtype.kind == "V" else v for k, v in got.items()}
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        order = [k for k in json.loads(f.read(n)) if k != "__metadata__"]
    loaded = importlib.import_module("safetensors.numpy").load_file(str(path))
    return {name: loaded[name] for name in order}


def assert_same_set(
    got: dict[str, np.ndarray], sent: dict[str, np.ndarray], *, ordered: bool = True
) -> None:
    assert list(got) == list(sent) if ordered else sorted(got) == sorted(sent)
    for name, tensor in sent.items():
        back = got[name]
        assert back.dtype == tensor.dtype, name
        assert back.shape == tensor.shape, name
        assert np.array_equal(bits(back), bits(tensor)), name


def wire_and_values(line: str) -> tuple[int, int]:
    match = re.search(r"\(([\d,]+) bytes of values, ([\d,]+) bytes on the wire\)", line)
    assert match, line
    return int(match[1].replace(",", "")), int(match[2].replace(",", ""))


def send_fails(port: int, path: Path, *needles: str) -> None:
    """`gradstream send` of `path` to the port fails: exit 1, one line with the needles."""
    done = run("send", f"127.0.0.1:{port}", str(path))
    assert done.returncode == 1
    assert_one_line_error(done.stderr, *needles)


def goes_on(receiver: Child, port: int, path: Path) -> str:
    """The receiver's run goes on after a refusal: `path` is sent and saved, and the run
    ends with it (exit 0). Its stderr."""
    assert run("send", f"127.0.0.1:{port}", str(path)).returncode == 0
    status, _, stderr = receiver.finish()
    assert status == 0, stderr
    return stderr


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("out"))


# --------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("src_suffix", SUFFIXES)
@pytest.mark.parametrize("out_suffix", SUFFIXES)
def test_a_set_round_trips_bit_equal(
    tmp_path: Path, spawn: list[Child], src_suffix: str, out_suffix: str
) -> None:
    src, out = tmp_path / f"grads{src_suffix}", tmp_path / f"out{out_suffix}"
    save_set(src, a_set())
    # The file's order: a .npz archive keeps the order given, a .safetensors writer orders
    # the tensors its own way (by dtype alignment, then name).
    sent = load_set(src)
    assert_same_set(sent, a_set(), ordered=src_suffix == ".npz")
    receiver, port = start_receiver(spawn, "--out", str(out))
    done = run("send", f"127.0.0.1:{port}", str(src), "--chunk-size", "4096")
    assert done.returncode == 0, done.stderr
    nbytes = sum(t.nbytes for t in sent.values())
    total = sum(t.size for t in sent.values())
    dtypes = ", ".join(dict.fromkeys(t.dtype.name for t in sent.values()))
    assert f"sent {src}: a tensor set of 6 tensors, {total:,} values ({dtypes}) (" in done.stdout
    value_bytes, wire = wire_and_values(done.stdout)
    chunks = re.search(r"\), ([\d,]+) chunks in ", done.stdout)
    assert chunks, done.stdout
    # One chunk a tensor, the empty one too, and 4096 values a chunk: 18 for "b.big".
    assert int(chunks[1]) == 5 + 18
    # The compact layout: the values, plus each chunk's header and schema.
    assert value_bytes == nbytes and nbytes < wire < nbytes + 2000 * int(chunks[1])
    assert done.stdout.rstrip().endswith(", acknowledged")
    status, stdout, stderr = receiver.finish()
    assert status == 0, stderr
    assert stderr == ""
    assert f"received tensor set: 6 tensors, {total:,} values " in stdout
    assert wire_and_values(stdout) == (nbytes, wire)
    assert stdout.splitlines()[-2].endswith(f"-> {out}")
    # Sent in the file's order, and written so where the format keeps it.
    assert_same_set(load_set(out), sent, ordered=out_suffix == ".npz")
    assert leftovers(tmp_path) == [out.name]


@needs_safetensors
def test_sets_and_counts_number_their_files(tmp_path: Path, spawn: list[Child]) -> None:
    first = {"w": np.arange(6, dtype=np.float32).reshape(2, 3)}
    second = {"z": np.ones(3, BF16), "a": np.full((2, 2), 0.5, np.float16)}
    save_set(tmp_path / "one.npz", first)
    save_set(tmp_path / "two.safetensors", second)
    receiver, port = start_receiver(spawn, "--out", str(tmp_path / "out.npz"), "--count", "2")
    files = [str(tmp_path / "one.npz"), str(tmp_path / "two.safetensors")]
    done = run("send", f"127.0.0.1:{port}", *files)
    assert done.returncode == 0, done.stderr
    status, stdout, stderr = receiver.finish()
    assert status == 0, stderr
    assert "received tensor set 1/2: 1 tensor, 6 values (float32) (" in stdout
    assert "received tensor set 2/2: 2 tensors, 7 values (bfloat16, float16) (" in stdout
    assert_same_set(load_set(tmp_path / "out-0.npz"), first)
    assert_same_set(load_set(tmp_path / "out-1.npz"), second, ordered=False)


@needs_safetensors
def test_a_set_from_a_python_peer(tmp_path: Path, spawn: list[Child]) -> None:
    """recv writes what a Python peer's send_tensors sent, as the CLI's send does."""
    sent = {"x": np.arange(5, dtype=np.float64), "y": np.ones((2, 1), BF16)}
    receiver, port = start_receiver(spawn, "--out", str(tmp_path / "out.safetensors"))

    async def peer() -> None:
        async with await gs.connect(("127.0.0.1", port)) as conn:
            await conn.send_tensors(sent)

    asyncio.run(peer())
    status, _, stderr = receiver.finish()
    assert status == 0, stderr
    assert_same_set(load_set(tmp_path / "out.safetensors"), sent, ordered=False)


def test_a_bfloat16_npy_file_goes_back_as_it_came(tmp_path: Path, spawn: list[Child]) -> None:
    """recv writes a lone bfloat16 gradient as numpy saves ml_dtypes' bfloat16 ('<V2'),
    and send takes such a file as bfloat16."""
    grad = values(24, BF16, 6).reshape(2, 3, 4)
    np.save(tmp_path / "g.npy", grad)
    receiver, port = start_receiver(spawn, "--out", str(tmp_path / "out.npy"))
    done = run("send", f"127.0.0.1:{port}", str(tmp_path / "g.npy"))
    assert done.returncode == 0, done.stderr
    assert "24 bfloat16 values, shape (2, 3, 4) (48 bytes of values, " in done.stdout
    status, stdout, stderr = receiver.finish()
    assert status == 0, stderr
    assert "received gradient: 24 bfloat16 values, shape (2, 3, 4) (" in stdout
    back = np.load(tmp_path / "out.npy")
    assert back.dtype == np.dtype("V2") and back.shape == grad.shape
    assert np.array_equal(back.view(np.uint16), bits(grad))


# --------------------------------------------------------------------------- the kind


def test_a_set_at_a_receiver_of_lone_gradients_is_refused_by_both(
    tmp_path: Path, spawn: list[Child]
) -> None:
    save_set(tmp_path / "g.npz", {"w": np.ones(4, np.float32)})
    np.save(tmp_path / "g.npy", np.arange(3, dtype=np.float32))
    out = tmp_path / "out.npy"
    receiver, port = start_receiver(spawn, "--out", str(out))
    send_fails(
        port,
        tmp_path / "g.npz",
        "g.npz failed: the receiver saves lone gradients",
        "have recv save to a .npz or .safetensors file",
        "(DeliveryError)",
    )
    assert leftovers(tmp_path) == []  # nothing of it written, not even a part
    stderr = goes_on(receiver, port, tmp_path / "g.npy")
    assert "tensor set from 127.0.0.1:" in stderr
    assert "refused: --out out.npy saves lone gradients; give --out FILE.npz" in stderr
    assert leftovers(tmp_path) == ["out.npy"]
    assert np.array_equal(np.load(out), np.arange(3, dtype=np.float32))


@pytest.mark.parametrize("suffix", SUFFIXES)
def test_a_lone_gradient_at_a_receiver_of_sets_is_refused_by_both(
    tmp_path: Path, spawn: list[Child], suffix: str
) -> None:
    np.save(tmp_path / "g.npy", np.ones(4, np.float32))
    receiver, port = start_receiver(spawn, "--out", str(tmp_path / f"out{suffix}"))
    send_fails(
        port,
        tmp_path / "g.npy",
        "g.npy failed: the receiver saves tensor sets",
        "send a .npz or .safetensors file, or have recv save to a .npy file",
    )
    receiver.proc.send_signal(signal.SIGINT)
    status, stdout, stderr = receiver.finish()
    assert status == 130
    assert "lone gradient from 127.0.0.1:" in stderr
    assert f"refused: --out out{suffix} saves tensor sets; give --out FILE.npy" in stderr
    assert stdout.splitlines()[-1] == "stopped by SIGINT after 0 tensor sets"
    assert leftovers(tmp_path) == []


# --------------------------------------------------------------------------- refusals


def test_max_bytes_bounds_a_set_by_its_values_in_all(tmp_path: Path, spawn: list[Child]) -> None:
    # 64 bytes: room for 8 values of up to 8 bytes. Two tensors of 5 each fit alone, not
    # together.
    save_set(tmp_path / "g.npz", {"a": np.ones(5, np.float32), "b": np.ones(5, np.float32)})
    save_set(tmp_path / "ok.npz", {"a": np.ones(4, np.float32), "b": np.ones(4, np.float16)})
    receiver, port = start_receiver(spawn, "--out", str(tmp_path / "out.npz"), "--max-bytes", "64")
    send_fails(port, tmp_path / "g.npz", "g.npz failed", "10 values", "(DeliveryError)")
    stderr = goes_on(receiver, port, tmp_path / "ok.npz")
    assert "tensor set from 127.0.0.1:" in stderr
    assert "refused: it would pass --max-bytes 64 (64 bytes a gradient: room for 8 values" in stderr
    assert leftovers(tmp_path) == ["out.npz"]
    assert load_set(tmp_path / "out.npz")["b"].dtype == np.float16


@pytest.mark.parametrize("suffix", SUFFIXES)
def test_members_whose_dtype_does_not_travel_are_named(tmp_path: Path, suffix: str) -> None:
    path = tmp_path / f"g{suffix}"
    save_set(path, {"w": np.ones(3, np.float32), "idx": np.arange(3), "mask": np.ones(2, bool)})
    # Nothing listens there: a refusal that came after connecting would say so.
    done = run("send", f"127.0.0.1:{free_port()}", str(path))
    assert done.returncode == 1
    idx, mask = ("int64", "bool") if suffix == ".npz" else ("I64", "BOOL")
    assert_one_line_error(
        done.stderr,
        f'cannot send {path}: member "idx" is {idx}; member "mask" is {mask}; ',
        "the dtypes that travel are float16, bfloat16, float32 and float64",
    )


def test_a_pickled_archive_is_refused_without_unpickling(tmp_path: Path) -> None:
    path = tmp_path / "g.npz"
    np.savez(path, w=np.ones(3, np.float32), obj=np.array([{"a": 1}, None], dtype=object))
    done = run("send", f"127.0.0.1:{free_port()}", str(path))
    assert done.returncode == 1
    assert_one_line_error(
        done.stderr, 'member "obj" holds Python objects (a pickled array), which are never loaded'
    )


@pytest.mark.parametrize(
    ("name", "content", "needle"),
    [
        ("g.npz", b"PK\x03\x04 not really a zip", "cannot read {path} as a .npz archive"),
        pytest.param(
            "g.safetensors",
            b"\x04\x00\x00\x00\x00\x00\x00\x00{}}}",
            "as a .safetensors file",
            marks=needs_safetensors,
        ),
        ("g.bin", b"hello", "not a .npy file"),
    ],
)
def test_files_that_are_not_what_they_say(
    tmp_path: Path, name: str, content: bytes, needle: str
) -> None:
    path = tmp_path / name
    path.write_bytes(content)
    done = run("send", f"127.0.0.1:{free_port()}", str(path))
    assert done.returncode == 1
    assert_one_line_error(done.stderr, needle.format(path=path))


@pytest.mark.parametrize("suffix", SUFFIXES)
def test_an_empty_set_is_refused(tmp_path: Path, suffix: str) -> None:
    path = tmp_path / f"g{suffix}"
    save_set(path, {})
    done = run("send", f"127.0.0.1:{free_port()}", str(path))
    assert done.returncode == 1
    assert_one_line_error(done.stderr, f"cannot send {path}: the ")


@pytest.mark.parametrize("suffix", SUFFIXES)
def test_protocol_seed_refuses_a_set(tmp_path: Path, suffix: str) -> None:
    path = tmp_path / f"g{suffix}"
    save_set(path, {"w": np.ones(3, np.float32)})
    done = run("send", f"127.0.0.1:{free_port()}", str(path), "--protocol", "seed")
    assert done.returncode == 1
    assert_one_line_error(
        done.stderr,
        f"cannot send {path} with --protocol seed: its arrays go as a tensor set",
        "use --protocol gradstream",
    )
    out = tmp_path / f"out{suffix}"
    done = run("recv", "0", "--out", str(out), "--protocol", "seed")
    assert done.returncode == 2
    assert_one_line_error(
        done.stderr, f"--out out{suffix} saves tensor sets, which --protocol seed does not carry"
    )


@pytest.fixture
def no_safetensors(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """safetensors as if it were not installed (in this process)."""
    for name in list(sys.modules):
        if name == "safetensors" or name.startswith("safetensors."):
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "safetensors", None)
    yield


def test_safetensors_without_the_package_names_it(
    tmp_path: Path, no_safetensors: None, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "g.safetensors"
    path.write_bytes(b"\x02\x00\x00\x00\x00\x00\x00\x00{}")
    assert main(["send", f"127.0.0.1:{free_port()}", str(path)]) == 1
    assert_one_line_error(
        capsys.readouterr().err,
        "cannot read",
        ".safetensors files need the safetensors package: pip install safetensors",
        "gradstream[safetensors]",
    )
    # recv fails before it listens.
    assert main(["recv", "0", "--out", str(tmp_path / "out.safetensors")]) == 1
    captured = capsys.readouterr()
    assert "listening" not in captured.out
    assert_one_line_error(captured.err, "cannot write", "pip install safetensors")


@pytest.mark.parametrize("suffix", SUFFIXES)
def test_bfloat16_without_ml_dtypes_names_it(
    tmp_path: Path,
    suffix: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    path = tmp_path / f"g{suffix}"
    save_set(path, {"w": np.ones(3, np.float32), "h": np.ones(2, BF16)})
    np.save(tmp_path / "h.npy", np.ones(2, BF16))
    monkeypatch.setattr(_dtypes, "ML_DTYPES", False)
    assert main(["send", f"127.0.0.1:{free_port()}", str(path)]) == 1
    assert_one_line_error(
        capsys.readouterr().err,
        f'cannot send {path}: member "h" is bfloat16',
        "pip install ml_dtypes",
    )
    assert main(["send", f"127.0.0.1:{free_port()}", str(tmp_path / "h.npy")]) == 1
    assert_one_line_error(
        capsys.readouterr().err, "h.npy: it holds bfloat16", "pip install ml_dtypes"
    )


# --------------------------------------------------------------------------- Ctrl-C


class Stall:
    """A TCP relay to the receiver that forwards the sender's first `limit` bytes and
    then holds the rest: a transfer stays half-way."""

    def __init__(self, port: int, limit: int) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.target, self.limit = port, limit
        self.forwarded = threading.Event()
        self.sockets: list[socket.socket] = [self.listener]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        client, _ = self.listener.accept()
        server = socket.create_connection(("127.0.0.1", self.target))
        self.sockets += [client, server]
        threading.Thread(target=self._pump, args=(server, client, None), daemon=True).start()
        self._pump(client, server, self.limit)

    def _pump(self, src: socket.socket, dst: socket.socket, limit: int | None) -> None:
        sent = 0
        try:
            while data := src.recv(65536):
                if limit is not None:
                    data = data[: limit - sent]
                dst.sendall(data)
                sent += len(data)
                if limit is not None and sent >= limit:
                    self.forwarded.set()
                    return
        except OSError:
            pass

    def close(self) -> None:
        for s in self.sockets:
            s.close()


def interrupt_half_way(tmp_path: Path, spawn: list[Child], side: str) -> tuple[Child, Child]:
    """A 16 MiB set sent to a receiver (--out out.npz) through a Stall that forwards its
    first MiB; once the receiver has had time to read that, SIGINT to `side` ("recv" or
    "send"). (receiver, sender)."""
    src = tmp_path / "big.npz"
    save_set(src, {"a": np.ones(2 << 20, np.float32), "b": np.ones(2 << 20, np.float32)})
    receiver, port = start_receiver(spawn, "--out", str(tmp_path / "out.npz"))
    stall = Stall(port, 1 << 20)
    try:
        sender = start(spawn, "send", f"127.0.0.1:{stall.port}", str(src), "--timeout", "30")
        assert stall.forwarded.wait(30)
        time.sleep(0.5)  # the receiver reads what was forwarded
        (receiver if side == "recv" else sender).proc.send_signal(signal.SIGINT)
        (receiver if side == "recv" else sender).proc.wait(30)
    finally:
        stall.close()
    return receiver, sender


def test_ctrl_c_on_recv_drops_the_set_under_way(tmp_path: Path, spawn: list[Child]) -> None:
    receiver, sender = interrupt_half_way(tmp_path, spawn, "recv")
    status, stdout, _ = receiver.finish()
    assert status == 130
    last = stdout.splitlines()[-1]
    assert last.startswith("stopped by SIGINT after 0 tensor sets; dropped the tensor set under ")
    assert re.search(r"\(([\d,]+) bytes of it received, not acknowledged\)$", last)
    assert leftovers(tmp_path) == []
    sent_status, _, sent_err = sender.finish()
    assert sent_status == 1
    assert "sending" in sent_err and "big.npz failed" in sent_err


def test_ctrl_c_on_send_names_the_set_it_dropped(tmp_path: Path, spawn: list[Child]) -> None:
    receiver, sender = interrupt_half_way(tmp_path, spawn, "send")
    status, stdout, stderr = sender.finish()
    assert status == 130, stderr
    assert stdout == ""
    src = tmp_path / "big.npz"
    assert_one_line_error(stderr, f"gradstream: interrupted while sending {src} (")
    assert re.search(r"\(([\d,]+) bytes of it written\): the receiver drops", stderr)
    receiver.proc.send_signal(signal.SIGINT)
    assert receiver.finish()[0] == 130
    assert leftovers(tmp_path) == []
