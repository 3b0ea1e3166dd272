"""Peak memory of a streamed transfer: sender and receiver in separate processes.

    python benches/stream_memory.py [--gib 1.0] [--impl native|reference] [--path socket|streams]

Each side reports its peak RSS (ru_maxrss) over its baseline (RSS after imports and, for
the sender, after the gradient is in memory), so the figures are what the transfer itself
costs. The targets: a 1 GiB receive stays near one gradient (<= 1.25 GiB over baseline); a
1 GiB send adds little beyond the gradient it already holds.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import resource
import socket
import sys
import time
from typing import Any

import numpy as np


def _rss_mib() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _session(impl: str) -> Any:
    if impl == "native":
        import gradstream as gs

        return gs.GradientStreamSession("bench", timeout=60)
    import gradstream.reference as ref

    return ref.GradientStreamSession("bench", timeout=60)


async def _stream(sock: socket.socket, path: str) -> Any:
    if path == "socket":
        return sock
    reader, writer = await asyncio.open_connection(sock=sock)
    return reader, writer


def _receiver(sock: socket.socket, impl: str, path: str, out: Any) -> None:
    session = _session(impl)
    base = _rss_mib()

    async def run() -> Any:
        return await session.receive_from(await _stream(sock, path))

    start = time.perf_counter()
    grad = asyncio.run(run())
    seconds = time.perf_counter() - start
    out.put(("recv", grad.size, seconds, _peak_mib() - base, float(grad[:1000].sum())))


def _sender(sock: socket.socket, impl: str, path: str, n: int, out: Any) -> None:
    session = _session(impl)
    grad = np.random.default_rng(3).standard_normal(n, dtype=np.float32)
    base = _rss_mib()  # the gradient itself is in the baseline

    async def run() -> int:
        return int(await session.stream_to(grad, await _stream(sock, path)))

    start = time.perf_counter()
    chunks = asyncio.run(run())
    seconds = time.perf_counter() - start
    sock.close()
    out.put(("send", chunks, seconds, _peak_mib() - base, float(grad[:1000].sum())))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--impl", choices=["native", "reference"], default="native")
    parser.add_argument("--path", choices=["socket", "streams"], default="socket")
    args = parser.parse_args()
    n = int(args.gib * 2**30) // 4
    a, b = socket.socketpair()
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    procs = [
        ctx.Process(target=_receiver, args=(b, args.impl, args.path, out)),
        ctx.Process(target=_sender, args=(a, args.impl, args.path, n, out)),
    ]
    for p in procs:
        p.start()
    a.close()
    b.close()
    results = {}
    for _ in procs:
        side, count, seconds, peak, check = out.get(timeout=600)
        results[side] = (count, seconds, peak, check)
    for p in procs:
        p.join()
    gib = n * 4 / 2**30
    recv, send = results["recv"], results["send"]
    print(f"{args.impl} {args.path}: {n:,} values ({gib:.2f} GiB), {send[0]} chunks")
    print(
        f"  send: {send[1]:.2f} s, {gib / send[1]:.2f} GiB/s, peak RSS over baseline "
        f"(gradient already held) {send[2]:.0f} MiB"
    )
    print(
        f"  recv: {recv[1]:.2f} s, peak RSS over baseline {recv[2]:.0f} MiB "
        f"({recv[2] / 1024 / gib:.2f} x the gradient)"
    )
    ok = recv[0] == n and recv[3] == send[3]
    print("  received intact (size and checksum of a prefix)" if ok else "  MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
