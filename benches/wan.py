"""Across a long path: one gradient through the test bed's WAN relay (tests/support/wan.py,
round trip and window per flow), as float32 on one stream and on several, and on the
int8 wire, beside raw TCP through the same relay with one flow and with as many.

    python benches/wan.py [--mib N] [--rtt S] [--window BYTES] [--streams N]

Three processes share the machine: this one sends, one runs the relay (its own GIL: a
Python relay moving 100 MB/s needs most of a core), one receives (a raw sink, then a
gradstream listener). Each row is the time from the first byte sent to the receiver's
acknowledgement (gradstream's, or the sink's one byte after the end), and the bytes the
relay carried towards the receiver. Ratios are of rows of this run:

- int8 wire / float32, time: the issue's target <= 0.35;
- int8 wire / float32, bytes on the wire: <= 0.26;
- float32 / raw TCP, time: how much of the path gradstream gets;
- N streams / one stream, speed: the issue's target >= 5 (with 8 streams), and N streams
  / raw TCP with N flows, speed: >= 0.6. The relay is Python in one process: when it,
  not the windows, is what caps N flows, the raw row shows it, and the second ratio is
  the one that says how gradstream does.

The last row sends the gradient over N streams again, and the relay resets every one of
them once half its bytes went (docs/guides/across-the-internet.md "Resume"): the row says
whether the gradient arrived bit for bit (its SHA-256, taken by the receiver), how many
times the streams were replaced, and how many chunks were sent again (those in flight at
the reset; a chunk the receiver held sent again would fail its receive).
"""

from __future__ import annotations

import argparse
import hashlib
import multiprocessing as mp
import socket
import sys
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np

# The relay is the tests' (one emulator for the tests and the benchmark).
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def _relay(targets: list[tuple[str, int]], rtt: float, window: int, pipe: Connection) -> None:
    """Run a relay in front of each target; answer "bytes" with what each carried so far
    towards its target; at ("reset after", n), reset the last relay's connections once n
    more bytes went through it; stop at "stop"."""
    from support.wan import Relay

    relays = [Relay(t, rtt=rtt, window=window) for t in targets]
    pipe.send([r.address for r in relays])
    while (asked := pipe.recv()) != "stop":
        if asked == "bytes":
            pipe.send([r.forwarded for r in relays])
        else:
            _, more = asked
            relays[-1].reset_when(relays[-1].forwarded + more)
            pipe.send(None)
    for r in relays:
        r.close()


KEY = b"the benchmark's authkey, 32 b..."  # several streams need a secret


def _sink(listener: socket.socket, flows: int) -> None:
    """Read ``flows`` connections to their ends, then answer one byte on each."""
    conns = [listener.accept()[0] for _ in range(flows)]

    def drain(conn: socket.socket) -> None:
        while conn.recv(1 << 20):
            pass

    readers = [threading.Thread(target=drain, args=(c,)) for c in conns]
    for r in readers:
        r.start()
    for r, c in zip(readers, conns, strict=True):
        r.join()
        with c:
            c.sendall(b"k")


def _receiver(pipe: Connection, connections: int, flows: int) -> None:
    """A raw sink of one flow and one of ``flows``, then a gradstream listener taking
    ``connections`` connections, each until its end."""
    import gradstream.sync as gsync

    raw = socket.create_server(("127.0.0.1", 0), backlog=256)
    raw.settimeout(600)
    listener = gsync.listen("127.0.0.1:0", authkey=KEY)
    pipe.send((raw.getsockname()[:2], listener.address))
    _sink(raw, 1)
    _sink(raw, flows)
    for _ in range(connections):
        with listener.accept(timeout=600) as conn:
            for gradient in conn:
                last = gradient
    # The last connection's gradient (the reset row's), as it arrived.
    pipe.send(hashlib.sha256(memoryview(last)).hexdigest())
    listener.close()


def _raw_seconds(address: tuple[str, int], nbytes: int, flows: int) -> float:
    """``nbytes`` over ``flows`` connections at once (a share each), to the sink's answers."""
    block = memoryview(bytes(4 << 20))
    socks = [socket.create_connection(address) for _ in range(flows)]

    def send(s: socket.socket, left: int) -> None:
        while left:
            left -= s.send(block[: min(left, len(block))])
        s.shutdown(socket.SHUT_WR)

    shares = [nbytes // flows + (i < nbytes % flows) for i in range(flows)]
    senders = [threading.Thread(target=send, args=pair) for pair in zip(socks, shares, strict=True)]
    start = time.perf_counter()
    for t in senders:
        t.start()
    for t, s in zip(senders, socks, strict=True):
        t.join()
        with s:
            assert s.recv(1) == b"k"
    return time.perf_counter() - start


def _gradstream_seconds(
    address: Any, grad: np.ndarray, streams: int, reset: Any = None, **session: Any
) -> tuple[float, tuple[int, int]]:
    """The time of one gradient, and its connection's resumes (``reset()`` arms the
    relay's reset once connected)."""
    import gradstream as gs
    import gradstream.sync as gsync

    own = gs.GradientStreamSession(**session)
    with gsync.connect(address, session=own, authkey=KEY, streams=streams) as conn:
        assert conn.streams == streams, f"the listener granted {conn.streams} streams"
        if reset is not None:
            reset()
        start = time.perf_counter()
        conn.send(grad)  # returns once the receiver acknowledged the whole gradient
        return time.perf_counter() - start, conn.resumed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=1024, help="float32 MiB (default 1024)")
    parser.add_argument("--rtt", type=float, default=0.040)
    parser.add_argument("--window", type=int, default=4 << 20)
    parser.add_argument("--streams", type=int, default=8, help="the striped row's (default 8)")
    args = parser.parse_args()
    if args.mib < 1:
        parser.error(f"--mib must be >= 1, got {args.mib}")
    if not 2 <= args.streams <= 64:
        parser.error(f"--streams must be 2 to 64, got {args.streams}")
    n = args.streams
    ctx = mp.get_context("spawn")
    rows = [
        ("float32", 1, {}),
        ("int8 wire", 1, {"wire_dtype": "int8"}),
        (f"{n} streams", n, {}),
        ("reset at 50 %", n, {}),
    ]
    to_receiver, receiver_end = ctx.Pipe()
    receiver = ctx.Process(target=_receiver, args=(receiver_end, len(rows), n), daemon=True)
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

    def reset_at_half() -> None:
        to_relay.send(("reset after", grad.nbytes // 2))
        to_relay.recv()

    grad = np.random.default_rng(0).standard_normal(args.mib << 18, dtype=np.float32)
    print(
        f"one gradient of {args.mib} MiB float32 through the WAN relay: rtt "
        f"{args.rtt * 1e3:.0f} ms, window {args.window / 2**20:.0f} MiB a flow "
        f"(at most {args.window / args.rtt / 1e6:.0f} MB/s), one connection"
    )
    times: dict[str, float] = {}
    wire: dict[str, int] = {}
    resumed = (0, 0)
    sent_hash = hashlib.sha256(memoryview(grad)).hexdigest()
    try:
        times["raw TCP"] = _raw_seconds(tuple(raw_relay), grad.nbytes, 1)
        wire["raw TCP"] = carried()[0]
        times[f"raw, {n} flows"] = _raw_seconds(tuple(raw_relay), grad.nbytes, n)
        wire[f"raw, {n} flows"] = carried()[0] - wire["raw TCP"]
        for label, streams, session in rows:
            before = carried()[1]
            reset = reset_at_half if label == "reset at 50 %" else None
            times[label], resumed = _gradstream_seconds(
                tuple(gs_relay), grad, streams, reset, **session
            )
            wire[label] = carried()[1] - before
        got_hash = to_receiver.recv()
    finally:
        # Both children are daemons (they die with this process on an error); the relay
        # is told to close its connections first.
        to_relay.send("stop")
        relay.join(30)
        receiver.join(30)
    print(f"{'row':<13} {'seconds':>8} {'MB/s of float32':>16} {'wire MB':>9}")
    for label, seconds in times.items():
        print(
            f"{label:<13} {seconds:>8.2f} {grad.nbytes / seconds / 1e6:>16.0f} "
            f"{wire[label] / 1e6:>9.0f}"
        )
    print(
        f"int8 wire / float32: time {times['int8 wire'] / times['float32']:.2f} (target <= "
        f"0.35), wire bytes {wire['int8 wire'] / wire['float32']:.3f} (target <= 0.26)"
    )
    print(f"float32 / raw TCP, time: {times['float32'] / times['raw TCP']:.2f}")
    striped = times[f"{n} streams"]
    print(
        f"{n} streams / one stream, speed: {times['float32'] / striped:.2f} (target >= 5 "
        f"with 8); / raw TCP with {n} flows, speed: {times[f'raw, {n} flows'] / striped:.2f} "
        "(target >= 0.6)"
    )
    total = -(-grad.size // 65_536)
    print(
        f"reset at 50 % ({n} streams): bit for bit {'yes' if got_hash == sent_hash else 'NO'}, "
        f"resumes {resumed[0]}, chunks sent again {resumed[1]} of {total} (in flight at the "
        f"reset), held chunks sent again 0 (one would fail the receive), time / {n} streams "
        f"unbroken {times['reset at 50 %'] / striped:.2f}"
    )


if __name__ == "__main__":
    main()
