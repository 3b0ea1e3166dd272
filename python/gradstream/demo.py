"""`make demo`: what a user compares gradstream against. The same float32 gradient (256 MiB
by default) goes from one process to another over TCP on 127.0.0.1 three ways: by
gradstream (a ``Connection`` with the default settings), by raw TCP (``sendall`` of the
array's bytes, ``recv_into`` a new array) and by pickle over a socket (``pickle.dumps``,
then ``pickle.loads`` of the bytes received). Each arrival is checked bit for bit against
the gradient sent; the times, the throughput and the ratios gradstream/raw TCP and
gradstream/pickle are printed (docs/performance.md has the method of the benchmarks).

    gradstream demo [--mib N] [--repeats R]
    python -m gradstream.demo [same options]        (the same demo)

This process makes the gradient (standard normal, fixed seed), writes it to a .npy file
in a temporary directory for the receivers to check against, and sends it; a receiver
process per way receives it. A transfer is timed on the sending side from its first byte
to the receiver's acknowledgement, which the receiver sends once it holds the whole
gradient as a numpy array (gradstream's own ack; one byte for the other two), so that
each time covers the whole way into an array on the other side (for pickle, its
``dumps`` and ``loads`` too). Connecting is not timed. Each way runs ``--repeats`` times
on one connection and its median is reported; the receiver compares what it got before it
says it is ready for the next one. Exits non-zero if any transfer or check fails.
"""

from __future__ import annotations

import argparse
import asyncio
import pickle
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import numpy as np

DEFAULT_MIB = 256
DEFAULT_REPEATS = 3
SEED = 7
# Seconds a receiver may take for any one step (starting, a transfer, a check).
STEP_TIMEOUT_S = 60.0

HELP = "the same gradient sent by gradstream, raw TCP and pickle between two processes"
DESCRIPTION = (
    "Send the same random float32 gradient (256 MiB by default) from this process to "
    "another over TCP on 127.0.0.1 three ways (gradstream's Connection with its default "
    "settings, raw TCP sendall/recv_into, pickle over a socket), check each arrival bit "
    "for bit, and print the times, GB/s and the ratios gradstream/raw TCP and "
    "gradstream/pickle. Exits non-zero if any check fails."
)

# The three ways, in the order they run: (key, name printed, how).
WAYS = (
    ("gradstream", "gradstream", "Connection, default settings"),
    ("raw", "raw TCP", "sendall / recv_into a new array"),
    ("pickle", "pickle", "pickle.dumps / socket / pickle.loads"),
)
_LENGTH = struct.Struct("<Q")  # the byte count before a raw or pickled gradient
_ACK = b"\x01"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of the demo (shared by `gradstream demo` and this module)."""
    parser.add_argument(
        "--mib",
        type=_positive_mib,
        default=DEFAULT_MIB,
        metavar="N",
        help=f"size of the gradient in MiB of float32 values (default {DEFAULT_MIB})",
    )
    parser.add_argument(
        "--repeats",
        type=_positive_int,
        default=DEFAULT_REPEATS,
        metavar="R",
        help=f"transfers of each way, the median reported (default {DEFAULT_REPEATS})",
    )


def _positive_mib(text: str) -> float:
    value = float(text)
    if not 0 < value <= 1 << 20:
        raise argparse.ArgumentTypeError(f"--mib must be > 0 and <= 1048576, not {text}")
    return value


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, not {text}")
    return value


# --------------------------------------------------------------------------- checks


def bit_equal(got: np.ndarray, want: np.ndarray) -> bool:
    """Whether two float32 arrays hold the same bits (NaN payloads and -0.0 included)."""
    if got.dtype != np.float32 or got.shape != want.shape:
        return False
    a, b = got.reshape(-1).view(np.uint32), want.reshape(-1).view(np.uint32)
    step = 1 << 24
    return all(np.array_equal(a[i : i + step], b[i : i + step]) for i in range(0, a.size, step))


def _verdict(got: Any, want: np.ndarray) -> str:
    if not isinstance(got, np.ndarray):
        return f"differs: a {type(got).__name__} arrived"
    if bit_equal(got, want):
        return "bit-equal"
    return f"differs: {got.dtype}{list(got.shape)} arrived, not float32{list(want.shape)}"


# --------------------------------------------------------------------------- the receivers


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError(f"the sender closed after {got} of {len(view)} bytes")
        got += n


def _receive_raw(conn: socket.socket) -> np.ndarray:
    header = bytearray(_LENGTH.size)
    _recv_exact(conn, memoryview(header))
    (nbytes,) = _LENGTH.unpack(header)
    values = np.empty(nbytes // 4, np.float32)
    _recv_exact(conn, values.data.cast("B"))
    conn.sendall(_ACK)
    return values


def _receive_pickle(conn: socket.socket) -> Any:
    header = bytearray(_LENGTH.size)
    _recv_exact(conn, memoryview(header))
    (nbytes,) = _LENGTH.unpack(header)
    data = bytearray(nbytes)
    _recv_exact(conn, memoryview(data))
    values = pickle.loads(data)  # the demo's own bytes, from this host
    conn.sendall(_ACK)
    return values


def _socket_receiver(way: str, want: np.ndarray, repeats: int) -> None:
    receive = _receive_raw if way == "raw" else _receive_pickle
    with socket.create_server(("127.0.0.1", 0)) as server:
        server.settimeout(STEP_TIMEOUT_S)
        print(f"listening on 127.0.0.1:{server.getsockname()[1]}", flush=True)
        conn, _ = server.accept()
        with conn:
            conn.settimeout(STEP_TIMEOUT_S)
            for _ in range(repeats):
                got = receive(conn)
                print(_verdict(got, want), flush=True)
                del got


async def _gradstream_receiver(want: np.ndarray, repeats: int) -> None:
    import gradstream

    listener = await gradstream.listen(("127.0.0.1", 0))
    try:
        print(f"listening on 127.0.0.1:{listener.address[1]}", flush=True)
        conn = await asyncio.wait_for(listener.accept(), STEP_TIMEOUT_S)
        async with conn:
            for _ in range(repeats):
                got = await asyncio.wait_for(conn.recv(), STEP_TIMEOUT_S)
                print(_verdict(got, want), flush=True)
                del got
    finally:
        await listener.close()


def _receiver_main(way: str, expected: str, repeats: int) -> int:
    """A receiver process: one connection, ``repeats`` gradients, a line about each."""
    want = np.load(expected, mmap_mode="r")
    if way == "gradstream":
        asyncio.run(_gradstream_receiver(want, repeats))
    else:
        _socket_receiver(way, want, repeats)
    return 0


# --------------------------------------------------------------------------- the senders


def _send_raw(sock: socket.socket, values: np.ndarray) -> None:
    data = values.data.cast("B")
    sock.sendall(_LENGTH.pack(len(data)))
    sock.sendall(data)
    _await_ack(sock)


def _send_pickle(sock: socket.socket, values: np.ndarray) -> None:
    data = pickle.dumps(values)
    sock.sendall(_LENGTH.pack(len(data)))
    sock.sendall(data)
    _await_ack(sock)


def _await_ack(sock: socket.socket) -> None:
    if sock.recv(1) != _ACK:
        raise ConnectionError("the receiver closed without acknowledging the gradient")


class _Receiver:
    """A receiver process and the lines it prints (read in a thread, to time out)."""

    def __init__(self, way: str, expected: Path, repeats: int) -> None:
        command = [sys.executable, "-m", "gradstream.demo", "--receiver", way, str(expected)]
        self.proc = subprocess.Popen(
            [*command, "--repeats", str(repeats)], stdout=subprocess.PIPE, text=True
        )
        self._lines: list[str | None] = []
        self._ready = threading.Condition()
        assert self.proc.stdout is not None
        threading.Thread(target=self._pump, args=(self.proc.stdout,), daemon=True).start()

    def _pump(self, stream: IO[str]) -> None:
        for line in stream:
            with self._ready:
                self._lines.append(line.rstrip("\n"))
                self._ready.notify()
        with self._ready:
            self._lines.append(None)
            self._ready.notify()

    def line(self) -> str:
        """The receiver's next line; RuntimeError when it ends or takes too long."""
        with self._ready:
            if not self._ready.wait_for(lambda: self._lines, STEP_TIMEOUT_S):
                raise RuntimeError(f"no word from the receiver in {STEP_TIMEOUT_S:g} s")
            line = self._lines.pop(0)
        if line is None:
            self.proc.wait()
            raise RuntimeError(f"the receiver ended (exit status {self.proc.returncode})")
        return line

    def port(self) -> int:
        first = self.line()
        prefix = "listening on 127.0.0.1:"
        if not first.startswith(prefix):
            raise RuntimeError(f"the receiver did not start: {first!r}")
        return int(first[len(prefix) :])

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.wait(timeout=STEP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@dataclass
class _Result:
    """One way's transfers: their times and the receiver's verdicts."""

    seconds: list[float] = field(default_factory=list)
    verdicts: list[str] = field(default_factory=list)
    failure: str | None = None

    @property
    def ok(self) -> bool:
        return self.failure is None and all(v == "bit-equal" for v in self.verdicts)

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)


def _timed(send: Callable[[], None], receiver: _Receiver, result: _Result) -> None:
    start = time.perf_counter()
    send()
    result.seconds.append(time.perf_counter() - start)
    # The receiver checks what it got, then says so: the next transfer starts after.
    result.verdicts.append(receiver.line())


def _run_way(way: str, values: np.ndarray, expected: Path, repeats: int) -> _Result:
    """One receiver process, one connection, ``repeats`` timed transfers."""
    result = _Result()
    receiver = _Receiver(way, expected, repeats)
    try:
        port = receiver.port()
        if way == "gradstream":
            asyncio.run(_send_gradstream(port, values, receiver, repeats, result))
        else:
            send = _send_raw if way == "raw" else _send_pickle
            with socket.create_connection(("127.0.0.1", port), timeout=STEP_TIMEOUT_S) as sock:
                for _ in range(repeats):
                    _timed(lambda: send(sock, values), receiver, result)
    except Exception as exc:  # any failure is reported, exit status 1
        result.failure = f"{type(exc).__name__}: {exc}"
        receiver.proc.kill()
    finally:
        receiver.stop()
    if result.failure is None and receiver.proc.returncode != 0:
        result.failure = f"the receiver exited with status {receiver.proc.returncode}"
    return result


async def _send_gradstream(
    port: int, values: np.ndarray, receiver: _Receiver, repeats: int, result: _Result
) -> None:
    import gradstream

    conn = await gradstream.connect(("127.0.0.1", port))
    async with conn:
        for _ in range(repeats):
            start = time.perf_counter()
            await conn.send(values)  # returns once the receiver acknowledged it
            result.seconds.append(time.perf_counter() - start)
            result.verdicts.append(await asyncio.to_thread(receiver.line))


# --------------------------------------------------------------------------- the demo


def _wire_note(elements: int) -> str:
    """What gradstream's frames weigh on the wire, in its default layout and the other."""
    import gradstream

    seed = gradstream.GradientStreamSession().frames_len(elements)
    compact = gradstream.GradientStreamSession(layout="compact").frames_len(elements)
    return (
        f"gradstream's frames: {seed / 2**20:,.1f} MiB on the wire in the default layout "
        f'"seed" (ipfrs-transport\'s, an index column beside the values), '
        f'{compact / 2**20:,.1f} MiB with layout="compact"'
    )


def run(mib: float = DEFAULT_MIB, repeats: int = DEFAULT_REPEATS) -> int:
    """The demo; the exit status (0 when every transfer arrived bit for bit)."""
    elements = max(1, round(mib * 2**20 / 4))
    nbytes = elements * 4
    results: dict[str, _Result] = {}
    with tempfile.TemporaryDirectory(prefix="gradstream-demo-") as tmp:
        expected = Path(tmp) / "gradient.npy"
        start = time.perf_counter()
        values = np.random.default_rng(SEED).standard_normal(elements, dtype=np.float32)
        np.save(expected, values)
        print(
            f"gradient: {elements:,} float32 values ({nbytes / 2**20:,.6g} MiB), random "
            f"normal (seed {SEED}), made in {time.perf_counter() - start:.1f} s; each way "
            f"sends it {repeats} time(s) to another process on 127.0.0.1 (median shown)",
            flush=True,
        )
        width = max(len(f"{name} ({how})") for _, name, how in WAYS)
        for way, name, how in WAYS:
            result = _run_way(way, values, expected, repeats)
            results[way] = result
            label = f"{name} ({how})".ljust(width)
            if result.ok:
                seconds = result.median
                rate = nbytes / seconds / 1e9
                print(f"{label}  {seconds:8.3f} s  {rate:6.2f} GB/s  bit-equal", flush=True)
            else:
                bad = [v for v in result.verdicts if v != "bit-equal"]
                why = result.failure or (bad[0] if bad else "no transfer")
                print(f"{label}  FAILED: {why}", flush=True)

    print(_wire_note(elements), flush=True)
    ours = results["gradstream"]
    for way, name, _ in WAYS[1:]:
        other = results[way]
        if ours.ok and other.ok:
            ratio = other.median / ours.median
            print(f"gradstream/{name}: {ratio:.2f}x the throughput", flush=True)
    verified = all(r.ok for r in results.values())
    print("verified" if verified else "VERIFICATION FAILED", flush=True)
    return 0 if verified else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m gradstream.demo",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser)
    # A receiver process of the demo's own (not for users): WAY EXPECTED.npy.
    parser.add_argument("--receiver", nargs=2, metavar=("WAY", "FILE"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    try:
        if args.receiver is not None:
            way, expected = args.receiver
            return _receiver_main(way, expected, args.repeats)
        return run(args.mib, args.repeats)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
