"""Across a long path: one gradient through the test bed's WAN relay (tests/support/wan.py,
round trip and window per flow), as float32 and on the int8 wire, beside raw TCP
through the same relay.

    python benches/wan.py [--mib N] [--rtt S] [--window BYTES]

Three processes share the machine: this one sends, one runs the relay (its own GIL: a
Python relay moving 100 MB/s needs most of a core), one receives (a raw sink, then a
gradstream listener). Each row is the time from the first byte sent to the receiver's
acknowledgement (gradstream's, or the sink's one byte after the end), and the bytes the
relay carried towards the receiver. Ratios are of rows of this run:

- int8 wire / float32, time: the issue's target <= 0.35;
- int8 wire / float32, bytes on the wire: <= 0.26;
- float32 / raw TCP, time: how much of the path gradstream gets.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import socket
import sys
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np

# The relay is the tests' (one emulator for the tests and the benchmark).
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def _relay(targets: list[tuple[str, int]], rtt: float, window: int, pipe: Connection) -> None:
    """Run a relay in front of each target; answer "bytes" with what each carried so far
    towards its target, stop at "stop"."""
    from support.wan import Relay

    relays = [Relay(t, rtt=rtt, window=window) for t in targets]
    pipe.send([r.address for r in relays])
    while (asked := pipe.recv()) != "stop":
        assert asked == "bytes"
        pipe.send([r.forwarded for r in relays])
    for r in relays:
        r.close()


def _sink(listener: socket.socket) -> None:
    """Read one connection to its end, then answer one byte."""
    conn, _ = listener.accept()
    with conn:
        while conn.recv(1 << 20):
            pass
        conn.sendall(b"k")


def _receiver(pipe: Connection, connections: int) -> None:
    """A raw sink, then a gradstream listener taking ``connections`` connections, each
    until its end."""
    import gradstream.sync as gsync

    raw = socket.create_server(("127.0.0.1", 0))
    raw.settimeout(600)
    listener = gsync.listen("127.0.0.1:0")
    pipe.send((raw.getsockname()[:2], listener.address))
    _sink(raw)
    for _ in range(connections):
        with listener.accept(timeout=600) as conn:
            for _gradient in conn:
                pass
    listener.close()


def _raw_seconds(address: tuple[str, int], nbytes: int) -> float:
    block = memoryview(bytes(4 << 20))
    with socket.create_connection(address) as s:
        start = time.perf_counter()
        left = nbytes
        while left:
            left -= s.send(block[: min(left, len(block))])
        s.shutdown(socket.SHUT_WR)
        assert s.recv(1) == b"k"
        return time.perf_counter() - start


def _gradstream_seconds(address: Any, grad: np.ndarray, **session: Any) -> float:
    import gradstream as gs
    import gradstream.sync as gsync

    with gsync.connect(address, session=gs.GradientStreamSession(**session)) as conn:
        start = time.perf_counter()
        conn.send(grad)  # returns once the receiver acknowledged the whole gradient
        return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=1024, help="float32 MiB (default 1024)")
    parser.add_argument("--rtt", type=float, default=0.040)
    parser.add_argument("--window", type=int, default=4 << 20)
    args = parser.parse_args()
    if args.mib < 1:
        parser.error(f"--mib must be >= 1, got {args.mib}")
    ctx = mp.get_context("spawn")
    rows = [("float32", {}), ("int8 wire", {"wire_dtype": "int8"})]
    to_receiver, receiver_end = ctx.Pipe()
    receiver = ctx.Process(target=_receiver, args=(receiver_end, len(rows)), daemon=True)
    receiver.start()
    # The child's end is the child's alone: held here too, a child that died would
    # leave recv() waiting for ever instead of raising EOFError.
    receiver_end.close()
    raw_at, gs_at = to_receiver.recv()
    to_relay, relay_end = ctx.Pipe()
    relay = ctx.Process(
        target=_relay,
        args=([tuple(raw_at), tuple(gs_at)], args.rtt, args.window, relay_end),
        daemon=True,
    )
    relay.start()
    relay_end.close()
    raw_relay, gs_relay = to_relay.recv()

    def carried() -> list[int]:
        to_relay.send("bytes")
        got: list[int] = to_relay.recv()
        return got

    grad = np.random.default_rng(0).standard_normal(args.mib << 18, dtype=np.float32)
    print(
        f"one gradient of {args.mib} MiB float32 through the WAN relay: rtt "
        f"{args.rtt * 1e3:.0f} ms, window {args.window / 2**20:.0f} MiB a flow "
        f"(at most {args.window / args.rtt / 1e6:.0f} MB/s), one connection"
    )
    times: dict[str, float] = {}
    wire: dict[str, int] = {}
    try:
        times["raw TCP"] = _raw_seconds(tuple(raw_relay), grad.nbytes)
        wire["raw TCP"] = carried()[0]
        for label, session in rows:
            before = carried()[1]
            times[label] = _gradstream_seconds(tuple(gs_relay), grad, **session)
            wire[label] = carried()[1] - before
    finally:
        # Both children are daemons (they die with this process on an error); the relay
        # is told to close its connections first.
        to_relay.send("stop")
        relay.join(30)
        receiver.join(30)
    print(f"{'row':<12} {'seconds':>8} {'MB/s of float32':>16} {'wire MB':>9}")
    for label, seconds in times.items():
        print(
            f"{label:<12} {seconds:>8.2f} {grad.nbytes / seconds / 1e6:>16.0f} "
            f"{wire[label] / 1e6:>9.0f}"
        )
    print(
        f"int8 wire / float32: time {times['int8 wire'] / times['float32']:.2f} (target <= "
        f"0.35), wire bytes {wire['int8 wire'] / wire['float32']:.3f} (target <= 0.26)"
    )
    print(f"float32 / raw TCP, time: {times['float32'] / times['raw TCP']:.2f}")


if __name__ == "__main__":
    main()
